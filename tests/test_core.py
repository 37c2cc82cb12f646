"""Fast unit tests of the layers below the FUSE adapter: no mounts, no servers, no sleeps."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from marinfs.config.mount import MountConfig, normalize_remote, parse_mode, parse_storage_option
from marinfs.errors import FsError, RemoteError, UsageError, errno_for
from marinfs.core import Filesystem
from marinfs.meta.metadata import MetadataCache
from marinfs.read.reader import ChunkFetcher
from marinfs.remote import TMP_PREFIX, ObjectInfo, Remote
from marinfs.write.staging import StagedFile
import tiers
from mounting import staging_entries

KiB, MiB = 1 << 10, 1 << 20
W, RW, CREAT = os.O_WRONLY, os.O_RDWR, os.O_CREAT | os.O_WRONLY


class FakeClock:
    """An injectable timer: time only moves when a test advances ``now``."""

    now = 1000.0

    def __call__(self) -> float:
        return self.now


def raises_errno(code: int) -> AbstractContextManager[Any]:
    """pytest.raises(OSError) that also requires ``errno == code`` (FsError is an OSError)."""
    return pytest.raises(OSError, check=lambda e: e.errno == code)


# -- fixtures and helpers ----------------------------------------------------------------------
@pytest.fixture
@tiers.needs("core")
def fs(remote: Remote, tmp_path: Path) -> Filesystem:
    return Filesystem(remote, staging_dir=tmp_path / "staging")


def put(remote: Remote, key: str, data: bytes) -> None:
    """Write an object straight through fsspec, behind marinfs' back."""
    parent = os.path.dirname(key)
    if parent:
        remote.fs.makedirs(remote.full(parent), exist_ok=True)
    remote.fs.pipe_file(remote.full(key), data)


def cat(remote: Remote, key: str) -> bytes | None:
    """The object's bytes as fsspec sees them, None if there is no such object."""
    try:
        return bytes(remote.fs.cat_file(remote.full(key)))
    except (FileNotFoundError, IsADirectoryError):
        return None


def close(fs: Filesystem, fh: int) -> None:
    """What close(2) does: flush (commit), then release."""
    fs.flush(fh)
    fs.release(fh)


def write_file(fs: Filesystem, path: str, data: bytes) -> None:
    fh = fs.create(path, CREAT | os.O_TRUNC).fh
    fs.write(fh, data, 0)
    close(fs, fh)


def staging_files(fs: Filesystem) -> list[Path]:
    return staging_entries(fs.staging_dir)


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("exc", "code"), [
    (FileNotFoundError(), errno.ENOENT), (FileExistsError(), errno.EEXIST),
    (IsADirectoryError(), errno.EISDIR), (NotADirectoryError(), errno.ENOTDIR),
    (PermissionError(), errno.EACCES), (TimeoutError(), errno.ETIMEDOUT),
    (RemoteError("x"), errno.EIO),
    (OSError(errno.ENOSPC, "full"), errno.ENOSPC), (FsError(errno.ENAMETOOLONG), errno.ENAMETOOLONG),
    (PermissionError(errno.EPERM, "x"), errno.EPERM),
    (ValueError("x"), errno.EIO), (KeyError("x"), errno.EIO), (EOFError(), errno.EIO),
])
def test_errno_for(exc: BaseException, code: int) -> None:
    assert errno_for(exc) == code


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "want"), [
    ("s3://b//p/", "s3://b/p"), ("gs://bucket/", "gs://bucket"), ("S3://B/x", "s3://B/x"),
    ("memory://core//x//", "memory://core/x"), ("file:///x/y/", "/x/y"), ("data/x/", "/home/u/data/x"),
    ("./a/../b", "/home/u/b"), ("//a//b/", "/a/b"), ("/abs/", "/abs"),
])
def test_normalize_remote(raw: str, want: str) -> None:
    assert normalize_remote(raw, cwd="/home/u") == want


@pytest.mark.parametrize("raw", ["", "   ", "s3://", "s3:///", "gs:////", "1x://b", "s 3://b", "://b"])
def test_normalize_remote_rejects(raw: str) -> None:
    with pytest.raises(UsageError):
        normalize_remote(raw, cwd="/home/u")


def test_mount_config_validate_accepts_defaults() -> None:
    config = MountConfig(remote="s3://b", mountpoint="/mnt", metadata_ttl=0, chunk_size=64 * KiB)
    assert config.validate() is config


@pytest.mark.parametrize("override", [
    {"log_level": "loud"}, {"file_mode": 0o10000}, {"dir_mode": -1}, {"uid": -1}, {"gid": -2},
    {"metadata_ttl": -1}, {"negative_ttl": -0.5}, {"read_timeout": -1}, {"mount_timeout": -1},
    {"retries": 0}, {"chunk_size": 1024},
])
def test_mount_config_validate_rejects(override: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        MountConfig(remote="s3://b", mountpoint="/mnt", **override).validate()  # type: ignore[arg-type]


def test_parse_mode_and_storage_option() -> None:
    assert parse_mode("0644") == 0o644 and parse_mode("755") == 0o755
    assert parse_storage_option("k=v") == ("k", "v") and parse_storage_option("a=b=c") == ("a", "b=c")
    assert parse_storage_option(" k =v") == ("k", "v") and parse_storage_option("k=") == ("k", "")
    for parse, bad in ((parse_mode, "rwx"), (parse_mode, ""), (parse_mode, "8"), (parse_mode, "0x1ff"),
                       (parse_storage_option, "novalue"), (parse_storage_option, "=v")):
        with pytest.raises(UsageError):
            parse(bad)  # type: ignore[operator]


def test_parse_storage_option_rejects_blank_key() -> None:
    with pytest.raises(UsageError):
        parse_storage_option("  =v")


# -- metadata ----------------------------------------------------------------------------------
def info(name: str, is_dir: bool = False, size: int = 1) -> ObjectInfo:
    return ObjectInfo(name=name, is_dir=is_dir, size=0 if is_dir else size, version=None if is_dir else "v1")


def test_metadata_stat_and_negative_ttl() -> None:
    clock = FakeClock()
    cache = MetadataCache(ttl=5.0, negative_ttl=1.0, timer=clock)
    cache.put_stat(info("a"))
    cache.put_missing("m")
    clock.now += 0.9
    assert cache.get_stat("a") == info("a") and cache.is_missing("m")
    clock.now += 0.2
    assert not cache.is_missing("m")
    clock.now += 4.0
    assert cache.get_stat("a") is None
    cache.put_stat(info("b"))
    cache.put_missing("b")  # "missing" replaces a stat, and a stat replaces "missing"
    assert cache.get_stat("b") is None and cache.is_missing("b")
    cache.put_stat(info("b"))
    assert not cache.is_missing("b")
    off = MetadataCache(ttl=0, negative_ttl=0, timer=clock)  # a TTL of 0 disables the cache
    off.put_stat(info("a"))
    off.put_listing("d", [info("d/a")])
    off.put_missing("m")
    assert off.get_stat("a") is None and off.get_listing("d") is None and not off.is_missing("m")


def test_metadata_listing_ttl_and_a_vanished_child() -> None:
    clock = FakeClock()
    cache = MetadataCache(ttl=5.0, list_ttl=2.0, maxsize=20, timer=clock)
    children = [info("d/a"), info("d/sub", is_dir=True)]
    cache.put_listing("d", children)
    assert cache.get_listing("d") == children
    assert cache.get_stat("d/sub") == children[1]  # a listing fills the stat cache
    cache.put_missing("d/a")  # a child is known gone: the listing is no longer trusted
    assert cache.get_listing("d") is None
    cache.put_listing("f", [info("f/a")])
    clock.now += 2.1
    assert cache.get_listing("f") is None and cache.get_stat("f/a") is not None  # list TTL < stat TTL
    clock.now += 3.0
    assert cache.get_stat("f/a") is None


def test_metadata_immutable_paths_never_expire() -> None:
    clock = FakeClock()
    cache = MetadataCache(ttl=1.0, immutable=["checkpoints/*/step-*/**"], timer=clock)
    cache.put_stat(info("checkpoints/run1/step-100/shard-0.bin"))
    cache.put_stat(info("checkpoints/run1/latest.json"))
    clock.now += 3600
    assert cache.get_stat("checkpoints/run1/step-100/shard-0.bin") is not None
    assert cache.get_stat("checkpoints/run1/latest.json") is None
    assert cache.is_immutable("checkpoints/r/step-1/a/b/c") and not cache.is_immutable("checkpoints/r/step-1")
    cache.invalidate("checkpoints/run1/step-100/shard-0.bin")  # our own write still invalidates
    assert cache.get_stat("checkpoints/run1/step-100/shard-0.bin") is None


def test_metadata_invalidate() -> None:
    cache = MetadataCache(timer=FakeClock())
    cache.put_listing("", [info("d", is_dir=True), info("dd")])
    cache.put_listing("d", [info("d/a"), info("d/b")])
    cache.invalidate("d/a")
    assert cache.get_stat("d/a") is None and cache.get_listing("d") is None
    assert cache.get_stat("d/b") is not None and cache.get_listing("") is not None
    cache.put_missing("x")
    cache.invalidate("x")
    assert not cache.is_missing("x") and cache.get_listing("") is None

    cache.put_listing("", [info("d", is_dir=True), info("dd")])
    cache.put_listing("d", [info("d/a"), info("d/x", is_dir=True)])
    cache.put_listing("d/x", [info("d/x/y")])
    cache.put_missing("d/gone")
    cache.invalidate_tree("d")
    assert all(cache.get_stat(k) is None for k in ("d", "d/a", "d/x", "d/x/y"))
    assert cache.get_listing("d") is None and cache.get_listing("d/x") is None
    assert not cache.is_missing("d/gone")
    assert cache.get_listing("") is None  # the parent's listing changed too
    assert cache.get_stat("dd") is not None  # a sibling sharing the prefix "d" is kept


def test_metadata_a_stat_overtaken_by_our_own_change_is_not_cached() -> None:
    cache = MetadataCache(timer=FakeClock())
    token = cache.begin_stat("a")
    assert cache.end_stat("a", token, info("a")) and cache.get_stat("a") == info("a")
    token = cache.begin_stat("a")
    cache.put_own(info("a", size=9))  # committed here while the remote answered the stat
    assert not cache.end_stat("a", token, info("a")) and cache.get_stat("a").size == 9
    token = cache.begin_stat("new")
    cache.put_own(info("new"))
    assert not cache.end_stat("new", token, None, missing=True)
    assert not cache.is_missing("new") and cache.get_stat("new") == info("new")
    for change in (cache.forget, cache.invalidate, lambda k: cache.invalidate_tree("d"), lambda k: cache.clear()):
        token = cache.begin_stat("d/f")
        change("d/f")
        assert not cache.end_stat("d/f", token, None, missing=True) and not cache.is_missing("d/f")
    first, second = cache.begin_stat("m"), cache.begin_stat("m")  # two in flight, no change
    assert cache.end_stat("m", first, None) and cache.end_stat("m", second, None, missing=True)
    assert cache.is_missing("m")
    token = cache.begin_stat("dd")
    cache.invalidate_tree("d")  # not below d
    assert cache.end_stat("dd", token, info("dd"))
    assert cache._stating == {}  # nothing left behind once the stats ended


# -- writer ------------------------------------------------------------------------------------
class Seeder:
    def __init__(self, content: bytes) -> None:
        self.content, self.calls = content, 0

    def __call__(self, key: str, local: str) -> None:
        self.calls += 1
        Path(local).write_bytes(self.content)


def test_staged_new_file(tmp_path: Path) -> None:
    staged = StagedFile(tmp_path / "st", "k", seed=None, dirty=True)
    assert staged.write(b"hello", 0) == 5 and staged.write(b"!", None) == 1
    assert staged.read(100, 0) == b"hello!" and staged.known_size() == 6
    assert stat.S_IMODE(os.stat(staged.path).st_mode) == 0o600


def test_staged_lazy_seed(tmp_path: Path) -> None:
    seed = Seeder(b"old content")
    staged = StagedFile(tmp_path / "st", "k", seed=seed, base_size=11)
    assert staged.known_size() == 11 and seed.calls == 0  # stat does not download
    assert staged.read(3, 0) == b"old" and seed.calls == 1
    staged.write(b"++", None)  # append after the old bytes
    staged.write(b"N", 0)
    staged.truncate(12)
    assert staged.read(100, 0) == b"Nld content+" and seed.calls == 1
    other_seed = Seeder(b"old content")
    other = StagedFile(tmp_path / "st", "k2", seed=other_seed, base_size=11)
    other.truncate(5)  # keeps old bytes: must seed
    assert other_seed.calls == 1 and other.read(100, 0) == b"old c" and other.dirty
    never = Seeder(b"old content")
    emptied = StagedFile(tmp_path / "st", "k3", seed=never, base_size=11)
    emptied.truncate(0)  # old bytes are not needed: never seeds
    emptied.write(b"new", None)
    assert emptied.read(100, 0) == b"new" and never.calls == 0


def test_staged_commit_once_and_discard(tmp_path: Path) -> None:
    uploads: list[tuple[str, str, bytes]] = []

    def upload(local: str, key: str, expect: str | None = None) -> None:
        uploads.append((local, key, Path(local).read_bytes()))

    staged = StagedFile(tmp_path / "st", "dir/k", seed=Seeder(b"old"), base_size=3)
    staged.commit(upload)
    assert uploads == []  # clean: nothing to upload
    staged.write(b"X", 0)
    staged.commit(upload)
    staged.commit(upload)
    assert uploads == [(staged.path, "dir/k", b"Xld")]
    staged.discard()
    assert not os.path.exists(staged.path) and not staged.kept


def test_staged_discard_keeps_only_dirty_bytes(tmp_path: Path) -> None:
    kept = StagedFile(tmp_path / "st", "k", seed=None, dirty=True)
    kept.write(b"precious", 0)
    kept.discard()
    assert kept.kept and Path(kept.path).read_bytes() == b"precious"
    gone = StagedFile(tmp_path / "st", "k2", seed=None, dirty=True)
    gone.unlinked = True  # an unlinked file is never uploaded and leaves nothing behind
    gone.commit(lambda local, key, expect=None: pytest.fail("uploaded an unlinked file"))
    gone.discard()
    assert not os.path.exists(gone.path)


# -- remote ------------------------------------------------------------------------------------
def test_remote_stat_and_list(remote: Remote) -> None:
    for key, data in (("a", b"1"), ("d/b", b"22"), ("d/sub/c", b"333"), (f"d/{TMP_PREFIX}1", b"t")):
        put(remote, key, data)
    b, d = remote.stat("d/b"), remote.stat("d")
    assert (b.name, b.is_dir, b.size) == ("d/b", False, 2) and b.version and b.mtime_ns > 0
    assert d.is_dir and d.version is None and remote.stat("").is_dir
    with pytest.raises(FileNotFoundError):
        remote.stat("nope")
    assert {(i.name, i.is_dir) for i in remote.list("")} == {("a", False), ("d", True)}
    children = {i.name: i for i in remote.list("d")}  # direct children only, no temporary names
    assert set(children) == {"d/b", "d/sub"} and children["d/b"].size == 2 and children["d/sub"].is_dir


def test_remote_data_operations(remote: Remote, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"0123456789")
    remote.upload(str(src), "f")
    assert cat(remote, "f") == b"0123456789" and remote.read_range("f", 2, 5) == b"234"
    assert [i.name for i in remote.list("")] == ["f"]  # no temporary upload names left
    remote.copy("f", "g")
    remote.rename("g", "h")
    assert cat(remote, "h") == b"0123456789" and cat(remote, "g") is None
    remote.delete("h")
    assert cat(remote, "h") is None
    with pytest.raises(FileNotFoundError):
        remote.delete("h")


def test_remote_dirs_and_walk(remote: Remote) -> None:
    remote.make_dir("d")
    assert remote.stat("d").is_dir and remote.list("d") == []
    remote.make_dir("d/e")
    put(remote, "d/e/f", b"x")
    put(remote, "d/g", b"y")
    files, dirs, explicit = remote.walk("d")
    assert sorted(files) == ["d/e/f", "d/g"] and dirs == ["d/e"]
    assert "d/e" in explicit and "d/e/f" not in explicit
    remote.make_dir("empty")
    remote.remove_dir("empty")
    with pytest.raises(FileNotFoundError):
        remote.stat("empty")


def test_remote_counts_requests_and_versions(remote: Remote, tmp_path: Path) -> None:
    src = tmp_path / "src"
    versions = []
    for content in (b"abcd", b"second", b"3"):
        src.write_bytes(content)
        remote.stats.reset()
        remote.upload(str(src), "f")
        versions.append(remote.stat("f").version)
        assert {i.name: i.version for i in remote.list("")}["f"] == versions[-1]
        assert remote.read_range("f", 0, 3) == content[:3]
        snap = remote.stats.snapshot()
        assert snap["requests"] == {"put": 1, "head": 1, "list": 1, "get": 1}
        assert snap["bytes_out"] == len(content) and snap["bytes_in"] == min(3, len(content))
    assert len(set(versions)) == 3  # the version changes whenever the content does


# -- filesystem --------------------------------------------------------------------------------
def test_fs_create_write_flush_commits(fs: Filesystem, remote: Remote) -> None:
    fh = fs.create("/new.txt", CREAT).fh
    fs.write(fh, b"hello ", 0)
    fs.write(fh, b"world", 6)
    assert cat(remote, "new.txt") is None  # nothing reaches the remote before flush
    fs.flush(fh)
    assert cat(remote, "new.txt") == b"hello world"
    fs.release(fh)
    assert fs.getattr("/new.txt").size == 11 and staging_files(fs) == []


def test_fs_open_errors(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f", b"x")
    with pytest.raises(FileNotFoundError):
        fs.open("/missing", os.O_RDONLY).fh
    for path, flags, code in (("/f", CREAT | os.O_EXCL, errno.EEXIST), ("/nodir/f", CREAT, errno.ENOENT),
                              ("/" + "n" * 256, CREAT, errno.ENAMETOOLONG),
                              ("/" + "é" * 128, CREAT, errno.ENAMETOOLONG)):  # 256 bytes in UTF-8
        with raises_errno(code):
            fs.create(path, flags).fh
    with raises_errno(errno.ENAMETOOLONG):
        fs.getattr("/" + "n" * 256)
    assert staging_files(fs) == []


def test_fs_append_and_rdwr_read_after_write(fs: Filesystem, remote: Remote) -> None:
    put(remote, "log", b"line1\n")
    fh = fs.open("/log", W | os.O_APPEND).fh
    fs.write(fh, b"line2\n", 0)  # O_APPEND ignores the offset
    close(fs, fh)
    assert cat(remote, "log") == b"line1\nline2\n"
    put(remote, "f", b"abcdef")
    fh = fs.open("/f", RW).fh
    fs.write(fh, b"XY", 2)
    assert fs.read(fh, 100, 0) == b"abXYef" and cat(remote, "f") == b"abcdef"
    close(fs, fh)
    assert cat(remote, "f") == b"abXYef"


def test_fs_read_into_fills_a_view_from_the_object_or_the_staged_file(fs: Filesystem, remote: Remote) -> None:
    """read_into (what FUSE replies are made of) fills the caller's buffer and no more: from the
    object, from this handle's staged file, from another handle's staged bytes; short at EOF."""
    put(remote, "f", b"abcdef")
    reader = fs.open("/f", os.O_RDONLY).fh
    buf = bytearray(b"." * 8)
    assert fs.read_into(reader, memoryview(buf)[1:5], 1) == 4 and buf == b".bcde..."
    writer = fs.open("/f", RW).fh
    fs.write(writer, b"XY", 4)
    assert fs.read_into(writer, memoryview(buf)[2:6], 3) == 3 and buf == b".bdXY..."  # its own staged file
    assert fs.read_into(reader, memoryview(buf), 0) == 6 and buf == b"abcdXY.."  # another's staged bytes
    assert fs.read_into(reader, memoryview(buf), 6) == 0 and buf == b"abcdXY.."
    close(fs, writer)
    close(fs, reader)


def test_fs_truncate_by_path_and_handle(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f", b"abcdef")
    fs.truncate("/f", 2)
    assert cat(remote, "f") == b"ab" and fs.getattr("/f").size == 2
    fh = fs.open("/f", W).fh
    fs.truncate("/f", 0, fh=fh)
    fs.write(fh, b"Z", 3)
    close(fs, fh)
    assert cat(remote, "f") == b"\0\0\0Z"
    with raises_errno(errno.EINVAL):
        fs.truncate("/f", -1)


def test_fs_reader_sees_writers_staged_bytes(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f", b"old")
    reader = fs.open("/f", os.O_RDONLY).fh
    writer = fs.open("/f", W | os.O_TRUNC).fh
    fs.write(writer, b"new bytes", 0)
    assert fs.read(reader, 100, 0) == b"new bytes" and fs.getattr("/f").size == 9
    with raises_errno(errno.EBADF):
        fs.write(reader, b"x", 0)
    close(fs, writer)
    close(fs, reader)
    assert cat(remote, "f") == b"new bytes"


def test_fs_unlink_mkdir_rmdir(fs: Filesystem, remote: Remote) -> None:
    fs.mkdir("/d")
    assert fs.getattr("/d").is_dir and remote.stat("d").is_dir
    write_file(fs, "/d/f", b"x")
    for op, code in ((lambda: fs.mkdir("/d"), errno.EEXIST), (lambda: fs.rmdir("/d"), errno.ENOTEMPTY),
                     (lambda: fs.rmdir("/d/f"), errno.ENOTDIR), (lambda: fs.mkdir("/d/f/s"), errno.ENOTDIR),
                     (lambda: fs.readdir("/d/f"), errno.ENOTDIR), (lambda: fs.unlink("/d"), errno.EISDIR)):
        with raises_errno(code):
            op()
    fs.unlink("/d/f")
    assert cat(remote, "d/f") is None
    with pytest.raises(FileNotFoundError):
        fs.getattr("/d/f")
    fh = fs.create("/d/pending", CREAT).fh  # an uncommitted file also makes the directory non-empty
    with raises_errno(errno.ENOTEMPTY):
        fs.rmdir("/d")
    fs.unlink("/d/pending")
    fs.release(fh)
    fs.rmdir("/d")
    with pytest.raises(FileNotFoundError):
        remote.stat("d")
    with pytest.raises(FileNotFoundError):
        fs.getattr("/d")


def test_fs_rename_file(fs: Filesystem, remote: Remote) -> None:
    put(remote, "a", b"from a")
    put(remote, "b", b"old b")
    assert fs.getattr("/b").size == 5  # cached before the rename
    fs.rename("/a", "/b")
    assert cat(remote, "b") == b"from a" and cat(remote, "a") is None and fs.getattr("/b").size == 6
    with pytest.raises(FileNotFoundError):
        fs.getattr("/a")
    fh = fs.create("/draft", CREAT).fh  # a new file renamed while its writer is open
    fs.write(fh, b"part1 ", 0)
    fs.rename("/draft", "/final")
    fs.write(fh, b"part2", 6)
    close(fs, fh)
    assert cat(remote, "final") == b"part1 part2" and cat(remote, "draft") is None


def test_fs_rename_directory_moves_every_object(fs: Filesystem, remote: Remote) -> None:
    for d in ("/src", "/src/sub", "/src/empty"):
        fs.mkdir(d)
    for path in ("/src/a", "/src/sub/b", "/src/sub/c"):
        write_file(fs, path, path.encode())
    fs.rename("/src", "/dst")
    files, dirs, _ = remote.walk("dst")
    assert sorted(files) == ["dst/a", "dst/sub/b", "dst/sub/c"] and sorted(dirs) == ["dst/empty", "dst/sub"]
    assert cat(remote, "dst/sub/c") == b"/src/sub/c"
    assert [i.name for i in remote.list("")] == ["dst"]  # nothing left under src
    assert {i.name for i in fs.readdir("/")} == {"dst"}
    with raises_errno(errno.EINVAL):
        fs.rename("/dst", "/dst/sub/inside")


def test_fs_rename_existing_file_while_writer_open(fs: Filesystem, remote: Remote) -> None:
    put(remote, "a", b"hello")
    fh = fs.open("/a", W).fh  # staged lazily: nothing downloaded yet
    fs.rename("/a", "/b")
    fs.write(fh, b"J", 0)  # needs the old bytes: they are downloaded from the new name
    close(fs, fh)
    assert cat(remote, "b") == b"Jello"


def test_fs_rename_onto_file_open_for_writing(fs: Filesystem, remote: Remote) -> None:
    put(remote, "src", b"renamed content")
    fh = fs.create("/dst", CREAT).fh
    fs.write(fh, b"old", 0)
    fs.flush(fh)
    fs.rename("/src", "/dst")
    assert fs.getattr("/dst").size == len(b"renamed content")
    fs.write(fh, b"X", 0)  # POSIX: this lands in the replaced, now nameless file
    close(fs, fh)
    assert cat(remote, "dst") == b"renamed content"


def test_fs_readdir_includes_uncommitted_file(fs: Filesystem, remote: Remote) -> None:
    put(remote, "old", b"1")
    assert {i.name for i in fs.readdir("/")} == {"old"}  # also caches the listing
    fh = fs.create("/new", CREAT).fh
    fs.write(fh, b"abc", 0)
    listing = {i.name: i for i in fs.readdir("/")}
    assert set(listing) == {"old", "new"} and listing["new"].size == 3 and cat(remote, "new") is None
    fs.release(fh)


def test_fs_read_only(remote: Remote, tmp_path: Path) -> None:
    put(remote, "f", b"data")
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", read_only=True)
    fh = fs.open("/f", os.O_RDONLY).fh
    assert fs.read(fh, 100, 0) == b"data"
    fs.release(fh)
    for op in (lambda: fs.open("/f", W).fh, lambda: fs.open("/f", os.O_RDONLY | os.O_TRUNC).fh,
               lambda: fs.create("/g", CREAT).fh, lambda: fs.mkdir("/d"), lambda: fs.unlink("/f"),
               lambda: fs.rename("/f", "/g"), lambda: fs.truncate("/f", 0), lambda: fs.access("/f", os.W_OK)):
        with raises_errno(errno.EROFS):
            op()
    assert cat(remote, "f") == b"data" and staging_files(fs) == []


def test_fs_failed_upload_keeps_staged_bytes(fs: Filesystem, remote: Remote,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing_upload(local_path: str, key: str, expect: str | None = None) -> None:
        calls.append(key)
        raise OSError(errno.EIO, "injected upload failure")

    monkeypatch.setattr(remote, "upload", failing_upload)
    fh = fs.create("/f", CREAT).fh
    fs.write(fh, b"unsaved", 0)
    with raises_errno(errno.EIO):
        fs.flush(fh)
    fs.release(fh)  # cannot report; must keep the bytes, and not try the same bytes again
    assert calls == ["f"]  # the retry loop tries next, not the release (it would hold it for the timeouts)
    kept = staging_files(fs)
    data = [p for p in kept if not p.name.endswith(".journal.json")]
    assert len(data) == 1 and data[0].read_bytes() == b"unsaved" and cat(remote, "f") is None
    (journal,) = [p for p in kept if p.name.endswith(".journal.json")]  # says what to commit, where
    assert json.loads(journal.read_text())["key"] == "f"
    (failed,) = fs.upload_status()["failed"]
    assert failed["key"] == "f" and failed["staged"] == str(data[0]) and failed["attempts"] == 1
    assert "injected upload failure" in failed["error"] and not failed["permanent"]


def test_fs_bytes_written_after_a_failed_flush_are_committed_at_release(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    real_upload, broken = remote.upload, [True]

    def upload(local_path: str, key: str, expect: Any = None) -> Any:
        if broken:
            raise OSError(errno.EIO, "injected upload failure")
        return real_upload(local_path, key, expect)

    monkeypatch.setattr(remote, "upload", upload)
    fh = fs.create("/f", CREAT).fh
    fs.write(fh, b"first", 0)
    with raises_errno(errno.EIO):
        fs.flush(fh)
    broken.clear()
    fs.write(fh, b"+more", 5)  # changed since the failure: release commits it
    fs.release(fh)
    assert cat(remote, "f") == b"first+more" and fs.upload_status()["failed"] == [] and staging_files(fs) == []


def test_fs_metadata_cache_saves_requests(fs: Filesystem, remote: Remote) -> None:
    for name in ("a", "b"):
        put(remote, name, b"xy")
    assert fs.getattr("/a").size == 2
    with pytest.raises(FileNotFoundError):
        fs.getattr("/missing")
    remote.stats.reset()
    assert fs.getattr("/a").size == 2  # a cached stat
    with pytest.raises(FileNotFoundError):
        fs.getattr("/missing")  # a cached "does not exist"
    assert remote.stats.snapshot()["requests"] == {}
    assert len(fs.readdir("/")) == 2
    assert fs.getattr("/b").size == 2 and len(fs.readdir("/")) == 2  # the listing filled b's stat
    assert remote.stats.snapshot()["requests"] == {"list": 1}


@pytest.mark.parametrize("before", [b"v1", None])
def test_fs_a_stat_in_flight_while_this_node_commits_does_not_hide_the_commit(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch, before: bytes | None) -> None:
    """A stat sent before this node's commit and answered after it describes the object of
    before (or none): cached, this node would show its own new file as the old one, or as
    missing, for the TTL."""
    if before is not None:
        put(remote, "state.json", before)
    real_stat, asked, answer = fs.remote.stat, threading.Event(), threading.Event()

    def slow_stat(key: str, **kwargs: Any) -> ObjectInfo:
        try:
            found: ObjectInfo | FileNotFoundError = real_stat(key, **kwargs)  # the answer as of now
        except FileNotFoundError as exc:
            found = exc
        if key == "state.json" and not asked.is_set():
            asked.set()
            answer.wait(10)
        if isinstance(found, FileNotFoundError):
            raise found
        return found

    monkeypatch.setattr(fs.remote, "stat", slow_stat)
    seen: list[Any] = []

    def stat_it() -> None:
        try:
            seen.append(fs.getattr("/state.json"))
        except FileNotFoundError as exc:
            seen.append(exc)

    stat = threading.Thread(target=stat_it)
    stat.start()
    assert asked.wait(10)
    write_file(fs, "/state.json", b"version two")
    answer.set()
    stat.join(10)
    assert len(seen) == 1 and isinstance(seen[0], ObjectInfo) and seen[0].size == 11  # what is known now
    assert fs.getattr("/state.json").size == 11
    fh = fs.open("/state.json", os.O_RDONLY).fh
    assert fs.read(fh, 100, 0) == b"version two"
    fs.release(fh)


def test_fs_a_failed_read_does_not_pin_the_handle_to_a_version(fs: Filesystem, remote: Remote) -> None:
    put(remote, "a", b"old")
    fh = fs.open("/a", os.O_RDONLY).fh
    real_fetch = fs.fetcher.fetch

    def failing(*args: object) -> bytes:
        raise RemoteError("injected")

    fs.fetcher.fetch = failing
    with pytest.raises(RemoteError):
        fs.read(fh, 10, 0)  # nothing was served...
    fs.fetcher.fetch = real_fetch
    put(remote, "a", b"new")  # ...so a change now is picked up, not answered with ESTALE
    assert fs.read(fh, 10, 0) == b"new"
    fs.release(fh)


def test_fs_two_versions_open_at_once_never_share_the_kernel_page_cache(fs: Filesystem, remote: Remote) -> None:
    """The kernel has one page cache per file: while readers of one version use it, a reader of
    another version reads around it (direct I/O), and the cache is theirs until the last closes."""
    put(remote, "a", b"old")
    h1_opened = fs.open("/a", os.O_RDONLY)
    h1 = h1_opened.fh
    assert fs.read(h1, 10, 0) == b"old"  # pinned (and in the fetcher's memory)
    h1b_opened = fs.open("/a", os.O_RDONLY)
    h1b = h1b_opened.fh
    assert not h1_opened.direct_io and h1b_opened.keep_cache  # one version: shared
    put(remote, "a", b"newer!")
    fs.metadata.forget("a")  # as after the TTL
    h2_opened = fs.open("/a", os.O_RDONLY)
    h2 = h2_opened.fh
    # Around the page cache, and leaving the old readers' pages where they are.
    assert h2_opened.direct_io and h2_opened.keep_cache
    assert fs.read(h2, 10, 0) == b"newer!" and fs.read(h1, 10, 0) == b"old"
    fs.release(h1)
    h3_opened = fs.open("/a", os.O_RDONLY)
    h3 = h3_opened.fh
    assert h3_opened.direct_io  # h1b still reads the old version through it
    fs.release(h1b)
    fs.release(h3)
    put(remote, "a", b"third")
    fs.metadata.forget("a")
    h4_opened = fs.open("/a", os.O_RDONLY)
    h4 = h4_opened.fh
    # The old readers are gone: the new version takes the page cache, dropping the old pages.
    assert not h4_opened.direct_io and not h4_opened.keep_cache
    h5_opened = fs.open("/a", os.O_RDONLY)
    h5 = h5_opened.fh
    # Before either read: h4's open may not have dropped the old pages yet, so h5's does too.
    assert not h5_opened.direct_io and not h5_opened.keep_cache
    put(remote, "a", b"4th")  # before either read: "third" is gone
    fs.metadata.forget("a")
    # Neither served anything, but moving on to "4th" could mix versions in the page cache:
    # h4 shares it with h5.
    with raises_errno(errno.ESTALE):
        fs.read(h5, 10, 0)
    with raises_errno(errno.ESTALE):
        fs.read(h4, 10, 0)
    fs.release(h5)
    assert fs.read(h4, 10, 0) == b"4th"  # its open dropped the pages, and it reads alone
    h6_opened = fs.open("/a", os.O_RDONLY)
    h6 = h6_opened.fh
    assert h6_opened.keep_cache and not h6_opened.direct_io  # h4 moved the cache on
    w_opened = fs.open("/a", os.O_WRONLY)
    w = w_opened.fh  # a writer on this node: as before, it is not counted
    assert not w_opened.direct_io
    for fh in (h2, h4, h6, w):
        fs.release(fh)
    assert fs.kernel.page_users == {}


def test_fs_a_handle_moves_to_a_new_version_only_if_no_old_page_can_be_cached(fs: Filesystem, remote: Remote) -> None:
    put(remote, "a", b"one")
    h1 = fs.open("/a", os.O_RDONLY).fh  # no pages kept at this open
    h2 = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h2, 10, 0) == b"one"  # h2 fills the page cache with "one"...
    fs.release(h2)  # ...and leaves
    put(remote, "a", b"two!")  # (another size: a local version's mtime may not have moved)
    assert fs.fetcher.trim_idle(0.0)  # "one" leaves memory (and there is no disk cache): h1 must fetch
    with raises_errno(errno.ESTALE):
        fs.read(h1, 10, 0)  # moving on could mix "two" with h2's pages
    fs.release(h1)

    put(remote, "b", b"one")
    h3 = fs.open("/b", os.O_RDONLY).fh
    put(remote, "b", b"two!")
    real_lookup = fs.namespace.lookup
    joined: list[int] = []

    def lookup(key: str) -> ObjectInfo:  # another reader opens while h3 looks the new version up
        info = real_lookup(key)
        if not joined:
            joined.append(0)
            # with a stat as stale as h3's was: it joins h3's readers of "one"
            fs.metadata.put_stat(replace(info, version=fs.handles.get(h3).info.version))
            joined[0] = fs.open("/b", os.O_RDONLY).fh
        return info

    fs.namespace.lookup = lookup  # type: ignore[method-assign]
    with raises_errno(errno.ESTALE):
        fs.read(h3, 10, 0)
    fs.namespace.lookup = real_lookup  # type: ignore[method-assign]
    fs.release(h3)
    fs.release(joined[0])
    assert fs.kernel.page_users == {}


def test_fs_the_kernel_is_told_the_size_of_the_version_its_page_cache_serves(fs: Filesystem, remote: Remote) -> None:
    """One size per file in the kernel, which stops page-cache reads there: while a version is
    read through it here, every stat answers that version; a handle of another one reads
    around the page cache, to its own end."""
    put(remote, "a", b"0123456789")
    h1 = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h1, 4, 0) == b"0123"
    put(remote, "a", b"short")
    fs.metadata.forget("a")  # as after the TTL
    assert fs.getattr("/a").size == 10 and fs.getattr_cached("a").size == 10  # (stat, readdirplus)
    h2_opened = fs.open("/a", os.O_RDONLY)
    h2 = h2_opened.fh
    assert h2_opened.direct_io and fs.read(h2, 10, 0) == b"short"
    assert fs.fgetattr(h1).size == 10 and fs.fgetattr(h2).size == 10
    assert fs.read(h1, 10, 4) == b"456789"
    fs.release(h1)
    assert fs.getattr("/a").size == 5 and fs.fgetattr(h2).size == 5  # theirs once they are gone
    fs.release(h2)

    h3 = fs.open("/a", os.O_RDONLY).fh
    put(remote, "a", b"a new and longer one")
    fs.metadata.forget("a")
    w = fs.open("/a", os.O_WRONLY | os.O_APPEND).fh  # a writer here: its readers read what it writes
    assert fs.getattr("/a").size == len(b"a new and longer one")
    fs.release(w)
    fs.release(h3)


def test_fs_what_the_kernel_is_told_follows_this_nodes_own_changes(fs: Filesystem, remote: Remote) -> None:
    """Only the size and time come from the version open here: a writer's bytes, a chmod, a
    truncate made here show at once, to stat and fstat alike; a file this node wrote is not
    taken for another version at each open (the time it shows is the writer's)."""
    put(remote, "a", b"0123456789")
    r = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(r, 4, 0) == b"0123"
    w = fs.open("/a", os.O_WRONLY | os.O_APPEND).fh
    fs.write(w, b"more bytes", 10)
    assert fs.fgetattr(r).size == fs.getattr("/a").size == 20
    close(fs, w)
    assert fs.fgetattr(r).size == fs.getattr("/a").size == 20
    fs.set_attributes("/a", mode=0o600)
    assert fs.getattr("/a").posix.mode == fs.fgetattr(r).posix.mode == 0o600
    fs.truncate("/a", 3)
    assert fs.getattr("/a").size == fs.fgetattr(r).size == 3
    fs.release(r)
    write_file(fs, "/b", b"x" * 100)
    assert fs.getattr("/b").size == 100
    for _ in range(3):
        h_opened = fs.open("/b", os.O_RDONLY)
        h = h_opened.fh
        assert not h_opened.drop_attrs
        assert _shown(fs.fgetattr(h)) == _shown(fs.getattr("/b"))
        fs.release(h)


def _shown(info: ObjectInfo) -> tuple[int, int]:
    """(size, time) as a stat shows them (FuseAdapter.attrs: a stored mtime, else the object's)."""
    posix = info.posix
    return info.size, posix.mtime_ns if posix is not None and posix.mtime_ns is not None else info.mtime_ns


def test_fs_the_time_told_is_the_open_versions_even_where_times_are_stored(fs: Filesystem, remote: Remote) -> None:
    """rsync -a and touch store a file's time: what the kernel is told while a version is open
    here is that version's time as shown, never the new one's beside the old one's size."""
    if not remote.stores_posix:
        pytest.skip("this store keeps no times")
    put(remote, "a", b"0123456789")
    fs.set_attributes("/a", mtime_ns=1_000_000_000_000_000_000)
    fs.metadata.forget("a")
    before = _shown(fs.getattr("/a"))
    h = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h, 4, 0) == b"0123"
    put(remote, "a", b"short")
    fs.metadata.forget("a")
    fs.set_attributes("/a", mtime_ns=2_000_000_000_000_000_000)
    fs.metadata.forget("a")
    assert _shown(fs.getattr("/a")) == _shown(fs.fgetattr(h)) == before == (10, 1_000_000_000_000_000_000)
    fs.release(h)
    assert _shown(fs.getattr("/a")) == (5, 2_000_000_000_000_000_000)


def test_fs_an_open_makes_the_kernel_drop_another_versions_size_before_it_reads(fs: Filesystem, remote: Remote) -> None:
    put(remote, "a", b"0123456789")
    assert fs.getattr("/a").size == 10  # what the kernel now holds
    h1_opened = fs.open("/a", os.O_RDONLY)
    h1 = h1_opened.fh
    assert not h1_opened.drop_attrs
    fs.release(h1)
    put(remote, "a", b"a longer version")
    fs.metadata.forget("a")  # the daemon's stat renewed before the kernel's (their timeouts run apart)
    h2_opened = fs.open("/a", os.O_RDONLY)
    h2 = h2_opened.fh
    assert h2_opened.drop_attrs  # it would stop this handle's reads at 10 bytes
    assert fs.fgetattr(h2).size == 16  # what it then asks for
    h3_opened = fs.open("/a", os.O_RDONLY)
    h3 = h3_opened.fh
    assert not h3_opened.drop_attrs
    for fh in (h2, h3):
        fs.release(fh)


def test_fs_after_two_different_answers_an_open_makes_the_kernel_ask_again(fs: Filesystem, remote: Remote) -> None:
    """The kernel keeps the attributes of the getattr it sent last, not of the one answered
    last: two answers computed across a change and written back out of order leave it the
    older one (the churn test's failure: a reader of the new version cut at the old size). So
    once it was told two different sizes, the next open has it drop what it holds, whichever."""
    put(remote, "a", b"0123456789")
    assert fs.getattr("/a").size == 10
    put(remote, "a", b"a longer version")
    fs.metadata.forget("a")
    assert fs.getattr("/a").size == 16  # (the kernel may have taken the 10 sent after this)
    h_opened = fs.open("/a", os.O_RDONLY)
    h = h_opened.fh
    assert h_opened.drop_attrs
    assert fs.fgetattr(h).size == 16  # asked again: one answer since, that one held
    h2_opened = fs.open("/a", os.O_RDONLY)
    h2 = h2_opened.fh
    assert not h2_opened.drop_attrs
    for fh in (h, h2):
        fs.release(fh)


def test_fs_a_handle_moves_on_only_to_a_version_no_longer_than_the_one_it_opened(fs: Filesystem,
                                                                                  remote: Remote) -> None:
    put(remote, "a", b"one")
    h1 = fs.open("/a", os.O_RDONLY).fh
    put(remote, "a", b"three")  # longer: the kernel holds 3 bytes as its size and stops reads there
    with raises_errno(errno.ESTALE):
        fs.read(h1, 10, 0)
    fs.release(h1)
    put(remote, "b", b"one")
    h2 = fs.open("/b", os.O_RDONLY).fh
    put(remote, "b", b"2")  # shorter: the kernel takes the end of its first read as the size
    assert fs.read(h2, 10, 0) == b"2"
    fs.release(h2)


def test_fs_readers_opened_beside_a_writer_are_counted(fs: Filesystem, remote: Remote) -> None:
    put(remote, "a", b"one")
    w = fs.open("/a", os.O_RDWR).fh
    r = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(r, 10, 0) == b"one"
    fs.release(w)  # nothing written: nothing committed
    put(remote, "a", b"two!")
    fs.metadata.forget("a")
    r2_opened = fs.open("/a", os.O_RDONLY)
    r2 = r2_opened.fh
    assert r2_opened.direct_io  # r still reads "one" through the page cache
    fs.release(r)
    fs.release(r2)


def test_fs_a_name_unlinked_or_renamed_here_is_a_new_inode_for_its_next_readers(fs: Filesystem, remote: Remote) -> None:
    """libfuse gives the next file of an unlinked name another inode, and moves a renamed
    file's inode (its page cache) to the new name."""
    put(remote, "d/a", b"old")
    h1 = fs.open("/d/a", os.O_RDONLY).fh
    fs.unlink("/d/a")
    write_file(fs, "/d/a", b"newer!")
    h2_opened = fs.open("/d/a", os.O_RDONLY)
    h2 = h2_opened.fh
    assert not h2_opened.direct_io  # another inode than h1's
    assert fs.read(h2, 10, 0) == b"newer!"
    fs.rename("/d", "/e")
    fs.mkdir("/d")
    write_file(fs, "/d/a", b"third")
    h3_opened = fs.open("/d/a", os.O_RDONLY)
    h3 = h3_opened.fh
    assert not h3_opened.direct_io  # d/a is a new inode again
    # h2's inode (its page cache) is e/a's now; e/a is a copy of whatever d/a held when it was
    # copied, which may not be what h2 read: a new open reads around it while h2 is open...
    fs.kernel.release_grace = 0.0
    e1_opened = fs.open("/e/a", os.O_RDONLY)
    e1 = e1_opened.fh
    same = fs.handles.get(e1).info.version == fs.handles.get(h2).info.version  # a local rename keeps it
    assert e1_opened.direct_io != same
    fs.release(h2)
    e2_opened = fs.open("/e/a", os.O_RDONLY)
    e2 = e2_opened.fh  # ...and takes the page cache once h2 is gone
    assert not e2_opened.direct_io
    for fh in (h1, h3, e1, e2):
        fs.release(fh)
    h4_opened = fs.open("/d/a", os.O_RDONLY)
    h4 = h4_opened.fh  # the released old handles did not count against h4's
    h5_opened = fs.open("/d/a", os.O_RDONLY)
    h5 = h5_opened.fh
    assert not h4_opened.direct_io and not h5_opened.direct_io
    for fh in (h4, h5):
        fs.release(fh)
    assert fs.kernel.page_users == {}


def test_fs_one_handle_never_answers_two_versions_even_from_concurrent_reads(remote: Remote, tmp_path: Path) -> None:
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", max_readahead_chunks=0,  # chunk 1: never fetched
                    fetcher=ChunkFetcher(remote.read_range, None, chunk_size=64 * KiB))
    fs.kernel.release_grace = 0.0
    put(remote, "a", b"0" * (128 * KiB))
    h0 = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h0, 1, 0) == b"0"  # readers of "0"s hold the page cache
    put(remote, "a", b"1" * (128 * KiB + 1))
    fs.metadata.forget("a")
    h_opened = fs.open("/a", os.O_RDONLY)
    h = h_opened.fh
    other = fs.open("/a", os.O_RDONLY).fh
    assert h_opened.direct_io and fs.read(other, 1, 0) == b"1"  # chunk 0 of "1"s in memory
    put(remote, "a", b"2" * (128 * KiB + 2))
    fs.metadata.forget("a")
    real_lookup, inner = fs.namespace.lookup, []

    def lookup(key: str) -> ObjectInfo:  # h's first read looks up the new version: another read of h meanwhile
        if not inner:
            inner.append(fs.read(h, 4, 0))
        return real_lookup(key)

    fs.namespace.lookup = lookup  # type: ignore[method-assign]
    with raises_errno(errno.ESTALE):
        fs.read(h, 4, 100 * KiB)  # chunk 1 of "1"s is gone: it may not move on, as h served "1"s
    fs.namespace.lookup = real_lookup  # type: ignore[method-assign]
    assert inner == [b"1111"]
    for fh in (h0, h, other):
        fs.release(fh)


def test_fs_a_handle_whose_name_was_unlinked_here_never_reads_the_names_next_file(fs: Filesystem, remote: Remote) -> None:
    fs.kernel.release_grace = 0.0
    put(remote, "a", b"first file")
    h0 = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h0, 1, 0) == b"f"
    put(remote, "a", b"old file")
    fs.metadata.forget("a")
    direct_opened = fs.open("/a", os.O_RDONLY)
    direct = direct_opened.fh  # reads around h0's page cache; served nothing yet
    assert direct_opened.direct_io
    fs.unlink("/a")
    write_file(fs, "/a", b"another file")
    assert fs.read(h0, 20, 2) == b"rst file"  # pinned: its version, from memory
    with raises_errno(errno.ESTALE):
        fs.read(direct, 20, 2)  # "old file" is gone; the name's file now is another one
    fs.release(h0)
    fs.release(direct)


def test_fs_an_open_of_a_new_version_waits_a_moment_for_a_closing_old_reader(fs: Filesystem, remote: Remote) -> None:
    """close(2) returns before the daemon has the release: a reload that closes the old file and
    opens the new one at once still gets the page cache (a shared map)."""
    put(remote, "a", b"old")
    h1 = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h1, 3, 0) == b"old"
    put(remote, "a", b"newer")
    fs.metadata.forget("a")
    fs.kernel.release_grace = 5.0
    late = threading.Timer(0.05, fs.release, (h1,))
    late.start()
    h2_opened = fs.open("/a", os.O_RDONLY)
    h2 = h2_opened.fh
    late.join()
    assert not h2_opened.direct_io and fs.read(h2, 5, 0) == b"newer"
    fs.release(h2)


def test_stats_and_close_are_the_filesystems_own(remote: Remote, tmp_path: Path) -> None:
    """The daemon and the metrics read one snapshot from the filesystem, and close() releases
    the chunk cache: the next daemon on the same cache directory may take it."""
    from marinfs.read.chunkcache import ChunkCache
    from marinfs.read.reader import ChunkFetcher

    cache = ChunkCache(tmp_path / "cache", 64 << 20)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging",
                    fetcher=ChunkFetcher(remote.read_range, cache, chunk_size=1 << 20))
    put(remote, "f", b"x" * 3000)
    fh = fs.open("/f", os.O_RDONLY).fh
    assert fs.read(fh, 4096, 0) == b"x" * 3000
    fs.release(fh)
    assert fs.fetcher.settle()  # the chunk is counted as it is written to disk, by its own thread
    stats = fs.stats()
    assert stats["cache"]["misses"] == 1 and stats["cache"]["bytes_fetched"] == 3000
    assert stats["remote_requests"]["bytes_in"] == 3000
    assert stats["uploads"] == fs.upload_status()
    with pytest.raises(UsageError):
        ChunkCache(tmp_path / "cache", 64 << 20)  # this one still holds it
    fs.close()
    ChunkCache(tmp_path / "cache", 64 << 20).close()


def test_an_unreachable_gcs_fails_within_our_retries_not_gcsfs_s() -> None:
    """gcsfs retries each request 6 times with 31 s of sleeps between; ours is the one bounded
    loop, so an unreachable GCS is EIO after our attempts, each request counted."""
    from marinfs.remote import RemoteSettings
    from servers import free_port

    remote = Remote("gs://marin/p", {"endpoint_url": f"http://127.0.0.1:{free_port()}", "token": "anon",
                                     "project": "test"},
                    RemoteSettings(attempts=3, connect_timeout=1, read_timeout=2))
    started = time.monotonic()
    with pytest.raises(RemoteError):
        remote.stat("x")
    assert time.monotonic() - started < 5
    assert remote.stats.count("head") == 3


# -- passthrough: the kernel reads versions the chunk cache holds whole -----------------------
class FakeBackings:
    """fs.Backings as the kernel's ioctls would be, recording what each backing id reads."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.next_id = 0
        self.live: dict[int, bytes] = {}

    def register(self, fd: int) -> int:
        if self.refuse:
            raise OSError(errno.EPERM, "Operation not permitted")
        self.next_id += 1
        self.live[self.next_id] = os.pread(fd, 1 << 24, 0)
        return self.next_id

    def unregister(self, backing_id: int) -> None:
        del self.live[backing_id]


def passthrough_fs(remote: Remote, tmp_path: Path, backings: FakeBackings) -> Filesystem:
    from marinfs.read.chunkcache import ChunkCache

    chunk = 64 << 10
    cache = ChunkCache(tmp_path / "cache", 64 << 20, chunk_size=chunk)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging",
                    fetcher=ChunkFetcher(remote.read_range, cache, chunk_size=chunk))
    fs.backings = backings
    return fs


def whole_in_cache(remote: Remote, tmp_path: Path, data: bytes,
                   backings: FakeBackings | None = None) -> Filesystem:
    """A passthrough filesystem whose chunk cache holds object "m" (``data``) whole: read
    once through it, its chunks on disk."""
    put(remote, "m", data)
    fs = passthrough_fs(remote, tmp_path, backings or FakeBackings())
    fh = fs.open("/m", os.O_RDONLY).fh
    assert fs.read(fh, len(data), 0) == data
    fs.release(fh)
    assert fs.fetcher.settle()
    return fs


def test_fs_a_version_cached_whole_is_passed_through_to_the_kernel(remote: Remote, tmp_path: Path) -> None:
    """Once the chunk cache holds every chunk of a version, an open of it is answered with a
    backing id: the kernel reads the version's data file (the whole object) by itself. The
    handles of that version opened meanwhile share it; a reader of a newer version carries it
    too (the kernel takes one backing per inode, and every open must carry it) but reads
    through the daemon (direct I/O), and keeps it until it closes; the last release drops the
    backing and unpins the version."""
    data = os.urandom(200 << 10)  # 4 chunks, the last one short
    put(remote, "m", data)
    backings = FakeBackings()
    fs = passthrough_fs(remote, tmp_path, backings)
    cold_opened = fs.open("/m", os.O_RDONLY)
    cold = cold_opened.fh
    assert not cold_opened.backing_id  # nothing cached yet: read through the daemon
    assert fs.read(cold, len(data) + 1, 0) == data
    assert fs.fetcher.settle()
    a_opened = fs.open("/m", os.O_RDONLY)
    a = a_opened.fh  # cold is still open, with the page cache: so does a
    assert not a_opened.backing_id
    fs.release(cold)
    fs.release(a)
    a_opened, b_opened = fs.open("/m", os.O_RDONLY), fs.open("/m", os.O_RDONLY)
    a, b = a_opened.fh, b_opened.fh
    backing_id = a_opened.backing_id
    assert backing_id > 0 and b_opened.backing_id == backing_id
    assert backings.live == {backing_id: data}  # the file registered is the object
    assert not a_opened.direct_io and fs.fetcher.cache.pinned() == 1
    put(remote, "m", data + b"more")  # another node's new version
    fs.metadata.forget("m")
    n_opened = fs.open("/m", os.O_RDONLY)
    n = n_opened.fh  # (after the grace for a's and b's release)
    assert n_opened.direct_io and n_opened.backing_id == backing_id
    assert fs.read(n, len(data) + 10, 0) == data + b"more"  # through the daemon: the new version
    fs.release(a)
    fs.release(b)
    assert backing_id in backings.live  # n still carries it: the kernel keeps it for the inode
    c_opened = fs.open("/m", os.O_RDONLY)
    c = c_opened.fh  # so a new open carries it too, and reads the new version
    assert c_opened.direct_io and c_opened.backing_id == backing_id
    fs.release(c)
    fs.release(n)
    assert backings.live == {} and fs.fetcher.cache.pinned() == 0
    assert fs.fetcher.settle()
    d_opened = fs.open("/m", os.O_RDONLY)
    d = d_opened.fh  # nothing carries the old one: the new version, cached whole by now
    assert d_opened.backing_id not in (0, backing_id) and not d_opened.direct_io
    assert backings.live == {d_opened.backing_id: data + b"more"}
    fs.release(d)
    assert fs.stats()["passthrough"] == {"on": True, "opens": 3, "files": 0}
    assert fs.kernel.page_users == {}
    fs.close()


def test_fs_after_a_restart_a_version_cached_whole_passes_through_once_checked(remote: Remote,
                                                                              tmp_path: Path) -> None:
    """A restart keeps the chunk cache but has verified none of it: the first open of a version
    cached whole reads through the daemon and has its checksums checked meanwhile, on a thread
    of the cache's; the next open passes through, with no byte read from the remote again."""
    data = os.urandom(200 << 10)
    whole_in_cache(remote, tmp_path, data).close()
    backings = FakeBackings()
    fs = passthrough_fs(remote, tmp_path, backings)
    fh_opened = fs.open("/m", os.O_RDONLY)
    fh = fh_opened.fh
    assert not fh_opened.backing_id
    assert fs.read(fh, 100, 0) == data[:100]  # a partial read: it alone would never qualify
    fs.release(fh)
    deadline = time.monotonic() + 10
    while fs.fetcher.cache.verifying() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fs.fetcher.cache.verifying(), "the cache's check did not end within 10 s"
    remote.stats.reset()
    fh_opened = fs.open("/m", os.O_RDONLY)
    fh = fh_opened.fh
    assert fh_opened.backing_id and backings.live == {fh_opened.backing_id: data}
    fs.release(fh)
    assert remote.stats.snapshot()["requests"].get("get", 0) == 0
    fs.close()


def test_fs_a_kernel_that_refuses_backing_files_leaves_reads_to_the_daemon(remote: Remote, tmp_path: Path) -> None:
    data = os.urandom(100 << 10)
    fs = whole_in_cache(remote, tmp_path, data, FakeBackings(refuse=True))
    fh_opened = fs.open("/m", os.O_RDONLY)
    fh = fh_opened.fh
    assert not fh_opened.backing_id and not fh_opened.direct_io
    assert fs.read(fh, len(data), 0) == data
    fs.release(fh)
    assert fs.backings is None and fs.fetcher.cache.pinned() == 0  # asked once, never again
    fs.close()


def test_fs_no_writer_opens_beside_passthrough_readers(remote: Remote, tmp_path: Path) -> None:
    """Every open of a file the kernel reads from a backing must carry it, and a writer's
    shared map would then write into the chunk cache: a writer (or a create of the name) waits
    a moment for the readers to close, then fails with ETXTBSY; once they closed it writes, and
    no backing is made while it is open. Found in review."""
    data = os.urandom(100 << 10)
    fs = whole_in_cache(remote, tmp_path, data)
    r_opened = fs.open("/m", os.O_RDONLY)
    r = r_opened.fh
    assert r_opened.backing_id
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
        with raises_errno(errno.ETXTBSY):
            fs.open("/m", flags).fh
    with raises_errno(errno.ETXTBSY):
        fs.create("/m", os.O_WRONLY | os.O_CREAT).fh
    assert cat(remote, "m") == data and fs.writes.staged == {}  # the refused O_TRUNC truncated nothing
    fs.release(r)
    w = fs.open("/m", os.O_WRONLY | os.O_TRUNC).fh
    r2_opened = fs.open("/m", os.O_RDONLY)
    r2 = r2_opened.fh  # beside a writer: through the daemon, no backing
    assert not r2_opened.backing_id
    fs.write(w, b"new", 0)
    close(fs, w)
    fs.release(r2)
    assert cat(remote, "m") == b"new" and fs.fetcher.cache.pinned() == 0
    fs.close()


def test_fs_no_backing_while_a_reader_of_another_version_is_open(remote: Remote, tmp_path: Path) -> None:
    """A reader of a newer version opened beside page-cache readers of the old one reads around
    the page cache and belongs to no group: while it is open, no backing is made for the file
    (it was opened without one: the kernel would refuse its maps, or the backing's opens).
    Found in review."""
    v1, v2 = os.urandom(200 << 10), os.urandom(150 << 10)
    put(remote, "m", v1)
    fs = passthrough_fs(remote, tmp_path, FakeBackings())
    a = fs.open("/m", os.O_RDONLY).fh  # v1, not cached: the page cache
    put(remote, "m", v2)
    fs.metadata.forget("m")
    b_opened = fs.open("/m", os.O_RDONLY)
    b = b_opened.fh  # v2 beside it: direct, in no group
    assert b_opened.direct_io and not b_opened.backing_id
    assert fs.read(b, len(v2), 0) == v2 and fs.fetcher.settle()  # v2 is cached whole now
    fs.release(a)
    c_opened = fs.open("/m", os.O_RDONLY)
    c = c_opened.fh
    assert not c_opened.backing_id and fs.read(c, len(v2), 0) == v2
    fs.release(b)
    fs.release(c)
    d_opened = fs.open("/m", os.O_RDONLY)
    d = d_opened.fh  # nothing else open: passed through
    assert d_opened.backing_id
    fs.release(d)
    assert fs.fetcher.cache.pinned() == 0
    fs.close()


def test_fs_o_direct_opens_read_through_the_daemon_beside_passthrough(remote: Remote, tmp_path: Path) -> None:
    """The kernel opens the backing file with the FUSE file's flags: with O_DIRECT, the cache's
    disk then refuses the unaligned reads FUSE serves (EINVAL; found testing a real mount). An
    O_DIRECT open makes no backing, and beside one carries it around it, through the daemon."""
    data = os.urandom(100 << 10)
    fs = whole_in_cache(remote, tmp_path, data)
    d_opened = fs.open("/m", os.O_RDONLY | os.O_DIRECT)
    d = d_opened.fh
    assert not d_opened.backing_id and fs.fetcher.cache.pinned() == 0
    fs.release(d)
    r_opened = fs.open("/m", os.O_RDONLY)
    r = r_opened.fh
    d_opened = fs.open("/m", os.O_RDONLY | os.O_DIRECT)
    d = d_opened.fh
    assert r_opened.backing_id and d_opened.backing_id == r_opened.backing_id
    assert d_opened.direct_io and not r_opened.direct_io
    assert fs.read(d, 7777, 3) == data[3:7780]
    assert fs.stats()["passthrough"]["opens"] == 1  # d only carries it
    fs.release(d)
    fs.release(r)
    assert fs.fetcher.cache.pinned() == 0
    fs.close()


def test_fs_a_reader_whose_name_went_never_reads_the_next_files_pending_writes(fs: Filesystem, remote: Remote) -> None:
    """A reader of a name unlinked (or renamed away) here reads its own version; another file
    written under that name since, not committed yet, is not its file (it read those writes)."""
    put(remote, "a", b"old bytes")
    h = fs.open("/a", os.O_RDONLY).fh
    assert fs.read(h, 20, 0) == b"old bytes"
    fs.unlink("/a")
    w = fs.create("/a", CREAT | os.O_TRUNC).fh
    fs.write(w, b"NEW", 0)
    assert fs.read(h, 20, 0) == b"old bytes"
    close(fs, w)
    fs.release(h)


def test_fs_a_rename_that_fails_midway_moves_no_reader(fs: Filesystem, remote: Remote,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is made, the source's delete fails: the rename fails, and its readers stay on
    the source's name (still there), not on a copy the failed rename may leave or take away."""
    if remote.renames_in_place:
        pytest.skip("rename(2) does not fail halfway")
    put(remote, "a", b"bytes")
    h = fs.open("/a", os.O_RDONLY).fh

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, "refused")

    monkeypatch.setattr(remote.fs, "rm_file", refused)
    with pytest.raises(OSError):
        fs.rename("/a", "/b")
    assert fs.handles.get(h).key == "a" and not fs.handles.get(h).orphan
    monkeypatch.undo()
    fs.rename("/a", "/b")
    assert fs.handles.get(h).key == "b" and fs.read(h, 10, 0) == b"bytes"
    fs.release(h)


def test_fs_a_directory_rename_that_fails_midway_is_reported_and_finished_by_the_same_rename(
        fs: Filesystem, remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a directory rename on a store that copies is journaled; one that fails midway
    (every copy made, the deletes refused) keeps its journal, is listed by the status with what
    to do, and the same rename again (its target no longer empty) finishes it, as does a new
    Filesystem's start (finish_renames)."""
    if remote.renames_in_place:
        pytest.skip("rename(2) does not fail halfway")
    for i in range(5):
        put(remote, f"src/f{i}", b"bytes %d" % i)

    def refused(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, "refused")

    monkeypatch.setattr(remote.fs, "rm_file", refused)
    with pytest.raises(OSError):
        fs.rename("/src", "/dst")
    monkeypatch.undo()
    (journal,) = sorted((tmp_path / "staging").glob("rename-*.json"))
    (left,) = fs.upload_status()["renames"]
    assert (left["src"], left["dst"], left["journal"]) == ("src", "dst", str(journal))
    assert "next start" in left["todo"] and str(journal) in left["todo"]
    assert cat(remote, "src/f0") == b"bytes 0" and cat(remote, "dst/f0") == b"bytes 0"  # both trees
    fs.rename("/src", "/dst")  # the same rename again: not ENOTEMPTY, it finishes
    assert not journal.exists() and fs.upload_status()["renames"] == []
    assert [cat(remote, f"src/f{i}") for i in range(5)] == [None] * 5
    assert [cat(remote, f"dst/f{i}") for i in range(5)] == [b"bytes %d" % i for i in range(5)]
    # Left midway again, then a new Filesystem on the same staging directory finishes it.
    monkeypatch.setattr(remote.fs, "rm_file", refused)
    with pytest.raises(OSError):
        fs.rename("/dst", "/moved")
    monkeypatch.undo()
    again = Filesystem(remote, staging_dir=tmp_path / "staging")
    again.finish_renames()
    assert not list((tmp_path / "staging").glob("rename-*.json")) and again.upload_status()["renames"] == []
    assert [cat(remote, f"moved/f{i}") for i in range(5)] == [b"bytes %d" % i for i in range(5)]
    assert cat(remote, "dst/f0") is None


def test_fs_lookups_of_one_key_at_once_share_one_remote_stat(fs: Filesystem, remote: Remote,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten threads opening files of a directory whose stat expired (a restore) ask once."""
    put(remote, "d/f", b"x")
    real_stat, calls = fs.remote.stat, []

    def slow_stat(key: str, **kwargs: Any) -> ObjectInfo:
        calls.append(key)
        time.sleep(0.2)
        return real_stat(key, **kwargs)

    monkeypatch.setattr(fs.remote, "stat", slow_stat)
    barrier = threading.Barrier(10)
    seen: list[bool] = []

    def look() -> None:
        barrier.wait()
        seen.append(fs.getattr("/d").is_dir)

    threads = [threading.Thread(target=look) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [True] * 10 and calls.count("d") == 1
