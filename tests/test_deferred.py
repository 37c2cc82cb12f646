"""Attributes set by path on a file this node has just committed are held back a moment
(core/deferred.py): rsync's times and mode of its temporary file ride on the rename's copy, so
``rsync -a`` costs PUT + COPY + DELETE a file in the default (close-durable) mode. Held back,
they are shown here at once, journaled (a daemon killed meanwhile leaves them to the next start),
and sent when their window ends or before the file's next change here."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tiers
from mounting import daemon_ended
from marinfs.core import Filesystem
from marinfs.core.deferred import DEFER_SECONDS
from marinfs.remote import Remote
from marinfs.write import attrjournal

W, CREAT_EXCL = os.O_WRONLY, os.O_CREAT | os.O_WRONLY | os.O_EXCL
T0 = 1_600_000_000 * 10**9  # an old mtime, as rsync restores it


def write(fs: Filesystem, path: str, data: bytes, mode: int | None = None) -> None:
    fh = fs.create(path, CREAT_EXCL, mode).fh
    fs.write(fh, data, 0)
    fs.flush(fh)
    fs.release(fh)


def rsync_one(fs: Filesystem, directory: str, name: str, data: bytes, mtime_ns: int, mode: int) -> None:
    """What rsync -a does for one file: a temporary name (created 0600), written and closed,
    its times then its mode set by path, renamed onto the name."""
    tmp = f"{directory}/.{name}.Xy12Ab"
    write(fs, tmp, data, 0o600)
    fs.set_attributes(tmp, mtime_ns=mtime_ns)
    fs.set_attributes(tmp, mode=mode)
    fs.rename(tmp, f"{directory}/{name}")


def journals(staging: Path) -> list[Path]:
    return sorted(staging.glob(attrjournal.PREFIX + "*" + attrjournal.SUFFIX))


def requests(remote: Remote) -> dict[str, int]:
    return dict(remote.stats.snapshot()["requests"])


def count_record_puts(remote: Remote) -> list[int]:
    """Count the directory records' PUTs and GETs (remote/dirmeta.py: the only small PUTs and
    whole GETs), which go in the background: a PUT per directory per 0.2 s window where listings
    carry no metadata (S3, memory), a GET of a directory's record before its first change."""
    counter = [0, 0]
    put_small, read_small = remote.put_small, remote.read_small

    def put(*args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return put_small(*args, **kwargs)

    def get(*args: Any, **kwargs: Any) -> Any:
        counter[1] += 1
        return read_small(*args, **kwargs)

    remote.put_small = put  # type: ignore[method-assign]
    remote.read_small = get  # type: ignore[method-assign]
    return counter


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def stored(remote: Remote, key: str) -> Any:
    """What another node finds: the object's own attributes (a stat, no cache of ours)."""
    return remote.stat(key).posix


@pytest.fixture
@tiers.needs("core")
def memory(tmp_path: Path) -> Iterator[Remote]:
    r = Remote(f"memory://deferred-{uuid.uuid4().hex}")
    r.fs.mkdir(r.root)
    yield r
    r.close()


@pytest.fixture
def fs(memory: Remote, tmp_path: Path) -> Iterator[Filesystem]:
    fs = Filesystem(memory, staging_dir=tmp_path / "staging")
    try:
        yield fs
    finally:
        fs.close_all()
        fs.deferred.stop()


# -- the fold, in the core -------------------------------------------------------------------------
def test_rsyncs_times_and_mode_ride_on_the_renames_copy(fs: Filesystem, memory: Remote, tmp_path: Path) -> None:
    """The core of the acceptance item, counted: per file one upload, one copy, one delete; no
    metadata update of its own, now or once the window has passed; the new names carry the
    mode and the time another node sees."""
    fs.mkdir("/d")
    records = count_record_puts(memory)
    memory.stats.reset()
    for i in range(20):
        rsync_one(fs, "/d", f"f{i:02d}", b"x" * i, T0 + i * 10**9, 0o640 if i % 2 else 0o755)
    assert journals(tmp_path / "staging") == []  # nothing left held back: each rename carried them
    time.sleep(DEFER_SECONDS + 0.2)
    spent = requests(memory)
    assert spent.get("put", 0) - records[0] == 20 and spent.get("copy") == 20 and spent.get("delete") == 20, spent
    assert "patch" not in spent and "setattr" not in spent, spent  # (memory's metadata update)
    other = Filesystem(memory, staging_dir=tmp_path / "other")  # another node: nothing cached
    for i in range(20):
        posix = other.getattr(f"/d/f{i:02d}").posix
        assert posix is not None and posix.mode == (0o640 if i % 2 else 0o755) and posix.mtime_ns == T0 + i * 10**9
        assert posix == stored(memory, f"d/f{i:02d}")
    assert sorted(c.name for c in other.readdir("/d")) == [f"d/f{i:02d}" for i in range(20)]


def test_attributes_no_rename_carries_are_shown_here_and_sent_when_the_window_ends(
        fs: Filesystem, memory: Remote, tmp_path: Path) -> None:
    """touch -d, then chmod, of a file just written: one update once the window ends, both
    changes in it; this node shows them from the first call on, in stats and listings."""
    write(fs, "/f", b"data")
    memory.stats.reset()
    fs.set_attributes("/f", mtime_ns=T0)
    fs.set_attributes("/f", mode=0o600)
    fs.setxattr("/f", "user.origin", b"rsync")
    assert requests(memory) == {}  # held back: nothing sent yet
    assert stored(memory, "f").mode is None
    assert len(journals(tmp_path / "staging")) == 1
    shown = fs.getattr("/f").posix
    assert shown is not None and shown.mode == 0o600 and shown.mtime_ns == T0
    listed = next(c for c in fs.readdir("/") if c.name == "f").posix
    assert listed == shown and fs.getxattr("/f", "user.origin") == b"rsync"
    assert eventually(lambda: stored(memory, "f").mode == 0o600, timeout=DEFER_SECONDS + 3)
    assert stored(memory, "f") == shown
    assert requests(memory).get("patch") == 1  # the three changes in one update
    assert eventually(lambda: journals(tmp_path / "staging") == [])
    assert fs.getattr("/f").posix == shown


def test_a_writers_open_sends_what_is_held_back_first_and_commits_without_a_conflict(
        fs: Filesystem, memory: Remote) -> None:
    write(fs, "/f", b"one")
    fs.set_attributes("/f", mode=0o600)
    fh = fs.open("/f", W).fh  # the next change of the file: the update goes first
    assert stored(memory, "f").mode == 0o600
    fs.write(fh, b"two", 0)
    fs.flush(fh)
    fs.release(fh)
    assert bytes(memory.fs.cat_file(memory.full("f"))) == b"two"  # committed in place, not beside
    assert stored(memory, "f").mode == 0o600  # and the new bytes keep the mode, as on a disk
    assert [c.name for c in fs.readdir("/")] == ["f"]


def test_a_writer_still_open_when_they_were_set_commits_them_with_its_next_bytes(
        fs: Filesystem, memory: Remote) -> None:
    """rsync's close returns before the kernel's release reaches the daemon: the chmod may find
    the writer's clean staged file still there. Its next bytes carry the mode; nothing is sent
    twice and nothing is a conflict."""
    fh = fs.create("/f", CREAT_EXCL | os.O_RDWR, None).fh
    fs.write(fh, b"one", 0)
    fs.flush(fh)
    fs.set_attributes("/f", mode=0o700)
    fs.write(fh, b"three", 0)
    fs.flush(fh)
    fs.release(fh)
    time.sleep(DEFER_SECONDS + 0.2)
    assert bytes(memory.fs.cat_file(memory.full("f"))) == b"three"
    assert stored(memory, "f").mode == 0o700
    assert list(fs.writes.conflicts) == []


def test_an_unlink_or_a_rename_onto_the_file_drops_what_is_held_back(
        fs: Filesystem, memory: Remote, tmp_path: Path) -> None:
    """Never an update after the object is gone (S3's copy onto itself would bring it back)."""
    write(fs, "/gone", b"a")
    write(fs, "/replaced", b"b")
    write(fs, "/new", b"c")
    fs.set_attributes("/gone", mode=0o600)
    fs.set_attributes("/replaced", mode=0o600)
    memory.stats.reset()
    fs.unlink("/gone")
    fs.rename("/new", "/replaced")
    time.sleep(DEFER_SECONDS + 0.2)
    assert "patch" not in requests(memory)
    assert not memory.fs.exists(memory.full("gone"))
    assert stored(memory, "replaced").mode is None  # the bytes of "new", with what "new" had
    assert journals(tmp_path / "staging") == []


def test_attributes_of_a_file_another_node_replaced_meanwhile_are_not_sent(
        fs: Filesystem, memory: Remote, tmp_path: Path) -> None:
    """The update is conditional on the version they were set on: another writer's object
    keeps what it has (as if our chmod had come first and its upload after: it replaced them)."""
    write(fs, "/f", b"ours")
    fs.set_attributes("/f", mode=0o600)
    memory.fs.pipe_file(memory.full("f"), b"theirs")
    assert eventually(lambda: journals(tmp_path / "staging") == [], timeout=DEFER_SECONDS + 3)
    assert bytes(memory.fs.cat_file(memory.full("f"))) == b"theirs"
    assert stored(memory, "f").mode is None
    fs.metadata.clear()
    assert fs.getattr("/f").posix.mode is None  # (nor does this node show ours over theirs)


def test_a_directory_rename_sends_what_is_held_back_inside_first(fs: Filesystem, memory: Remote) -> None:
    fs.mkdir("/a")
    write(fs, "/a/f", b"x")
    fs.set_attributes("/a/f", mode=0o600)
    fs.rename("/a", "/b")
    assert stored(memory, "b/f").mode == 0o600


def test_unmount_sends_what_is_held_back(memory: Remote, tmp_path: Path) -> None:
    fs = Filesystem(memory, staging_dir=tmp_path / "staging")
    write(fs, "/f", b"x")
    fs.set_attributes("/f", mode=0o600)
    fs.close_all()
    assert stored(memory, "f").mode == 0o600
    assert journals(tmp_path / "staging") == []
    fs.close()


def test_a_crash_within_the_window_leaves_them_to_the_next_start(memory: Remote, tmp_path: Path) -> None:
    """The core's crash: the daemon's threads die with it, its journal stays."""
    fs = Filesystem(memory, staging_dir=tmp_path / "staging")
    write(fs, "/f", b"x")
    fs.set_attributes("/f", mtime_ns=T0)
    fs.set_attributes("/f", mode=0o600)
    fs.deferred.stop()  # (SIGKILL: nothing more is sent)
    assert stored(memory, "f").mode is None and len(journals(tmp_path / "staging")) == 1
    daemon_ended(fs)
    again = Filesystem(memory, staging_dir=tmp_path / "staging")
    again.recover_staged(at_start=True)
    again.send_kept_attributes()
    assert stored(memory, "f").mode == 0o600 and stored(memory, "f").mtime_ns == T0
    assert journals(tmp_path / "staging") == []
    again.close_all()
    again.close()


def test_a_kept_journal_whose_object_changed_since_is_dropped_not_applied(memory: Remote, tmp_path: Path) -> None:
    fs = Filesystem(memory, staging_dir=tmp_path / "staging")
    write(fs, "/f", b"x")
    fs.set_attributes("/f", mode=0o600)
    fs.deferred.stop()
    memory.fs.pipe_file(memory.full("f"), b"rewritten by another node")
    again = Filesystem(memory, staging_dir=tmp_path / "staging")
    again.send_kept_attributes()
    assert stored(memory, "f").mode is None and journals(tmp_path / "staging") == []
    again.close()


@pytest.mark.parametrize("remote", ["local"], indirect=True)
def test_a_local_disk_holds_nothing_back(remote: Remote, tmp_path: Path) -> None:
    """No request to save there, and a rename(2) keeps the file's attributes: set at once."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    write(fs, "/.f.tmp", b"x", 0o600)
    fs.set_attributes("/.f.tmp", mtime_ns=T0)
    fs.set_attributes("/.f.tmp", mode=0o640)
    assert fs.deferred.pending() == 0
    assert os.stat(remote.full(".f.tmp")).st_mode & 0o777 == 0o640
    fs.rename("/.f.tmp", "/f")
    st = os.stat(remote.full("f"))
    assert st.st_mode & 0o777 == 0o640 and st.st_mtime_ns == T0
    fs.close_all()
    fs.close()


# -- the stores' own copies --------------------------------------------------------------------------
@pytest.fixture(params=["s3", "gcs"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[Remote, str, dict[str, Any]]]:
    from conftest import object_store

    url, options, _ = object_store(request, request.param)
    remote = Remote(url, options)
    try:
        yield remote, url, options
    finally:
        remote.close()


@pytest.fixture(params=["memory", "s3", "gcs"])
def folding(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    from conftest import object_store

    if request.param == "memory":
        url, options = f"memory://fold-{uuid.uuid4().hex}", {}
    else:
        url, options, _ = object_store(request, request.param)
    remote = Remote(url, options)
    try:
        yield remote
    finally:
        remote.close()


def test_a_rename_whose_copy_carries_attributes_keeps_the_rest_and_is_pinned(folding: Remote,
                                                                             tmp_path: Path) -> None:
    """Remote.rename(..., attrs=, expect=): one copy gives the new name the attributes, the
    object's other metadata as it was (a tool's own key, S3's and GCS's content type); a source
    that is not ``expect`` is PreconditionFailed with both names as they were."""
    from marinfs.errors import PreconditionFailed
    from marinfs.objects import PosixAttrs

    remote = folding
    assert remote.folds_attrs
    local = tmp_path / "bytes"
    local.write_bytes(b"payload")
    version = remote.upload(str(local), "src", attrs=PosixAttrs(mode=0o600))
    assert version is not None
    if remote.protocol in ("s3", "s3a"):  # another tool's metadata and headers, kept by the copy
        bucket, key, _ = remote.fs.split_path(remote.full("tagged"))
        remote.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"tagged", ContentType="text/x-mine",
                          Metadata={"origin": "other-tool", "mode": "33152"})
        tagged = remote.stat("tagged").version
    elif remote.protocol in ("gs", "gcs"):
        remote.fs.pipe_file(remote.full("tagged"), b"tagged", content_type="text/x-mine",
                            metadata={"origin": "other-tool", "goog-reserved-posix-mode": "600"})
        tagged = remote.stat("tagged").version
    else:
        tagged = None
    new = PosixAttrs(mode=0o640, mtime_ns=T0, xattrs=(("user.k", b"v"),))
    remote.stats.reset()
    copies = remote.rename("src", "dst", attrs=new, expect=version)
    assert remote.stats.snapshot()["requests"].get("copy") == 1
    assert [c.old for c in copies] == [version] and copies[0].new is not None
    assert remote.stat("dst").posix == new and remote.read_range("dst", 0, 7) == b"payload"
    assert not remote.fs.exists(remote.full("src"))
    local.write_bytes(b"other bytes")
    remote.upload(str(local), "changed")
    with pytest.raises(PreconditionFailed):  # "changed" is not the version the attributes were set on
        remote.rename("changed", "elsewhere", attrs=PosixAttrs(mode=0o700), expect=version)
    assert remote.stat("changed").posix.mode is None and not remote.fs.exists(remote.full("elsewhere"))
    if tagged is not None:
        remote.rename("tagged", "tagged2", attrs=PosixAttrs(mode=0o644), expect=tagged)
        info = remote.fs.info(remote.full("tagged2"))
        meta = {k.lower(): v for k, v in (info.get("Metadata") or info.get("metadata") or {}).items()}
        if not meta and remote.protocol in ("s3", "s3a"):
            bucket, key, _ = remote.fs.split_path(remote.full("tagged2"))
            head = remote.fs.call_s3("head_object", Bucket=bucket, Key=key)
            meta, ctype = {k.lower(): v for k, v in head["Metadata"].items()}, head.get("ContentType")
        else:
            ctype = info.get("ContentType") or info.get("contentType")
        assert meta.get("origin") == "other-tool" and ctype == "text/x-mine", info
        assert remote.stat("tagged2").posix.mode == 0o644


@pytest.mark.parametrize("remote", ["local"], indirect=True)
def test_a_local_rename_carries_no_attributes(remote: Remote) -> None:
    from marinfs.objects import PosixAttrs

    assert not remote.folds_attrs
    remote.fs.pipe_file(remote.full("a"), b"x")
    with pytest.raises(OSError):
        remote.rename("a", "b", attrs=PosixAttrs(mode=0o600), expect=remote.stat("a").version)
    assert remote.fs.exists(remote.full("a"))


def test_a_stores_copy_carries_the_attributes_in_the_one_request(store: tuple[Remote, str, dict[str, Any]],
                                                                 tmp_path: Path) -> None:
    """S3: CopyObject with MetadataDirective=REPLACE; GCS: a rewrite whose body gives the copy's
    metadata. rsync's pattern through the core: an upload, a copy and a delete per file (GCS: no
    GET, our upload's answer gives the source's metadata), and the copy keeps the object's
    other metadata."""
    remote, url, options = store
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    try:
        fs.mkdir("/d")
        fs.readdir("/d")
        records = count_record_puts(remote)
        remote.stats.reset()
        for i in range(5):
            rsync_one(fs, "/d", f"f{i}", b"y" * (i + 1), T0 + i * 10**9, 0o640)
        time.sleep(DEFER_SECONDS + 0.2)
        spent = requests(remote)
        assert spent.get("copy") == 5 and spent.get("delete") == 5, spent
        assert spent.get("put", 0) - records[0] == 5, spent  # the files (and the directory's record)
        assert spent.get("get", 0) - records[1] == 0, (spent, records)
        assert "patch" not in spent and "head" not in spent, spent
        for i in range(5):
            posix = stored(remote, f"d/f{i}")
            assert posix.mode == 0o640 and posix.mtime_ns == T0 + i * 10**9
            assert remote.read_range(f"d/f{i}", 0, i + 1) == b"y" * (i + 1)
        assert journals(tmp_path / "staging") == []
    finally:
        fs.close_all()
        fs.close()
    other = Filesystem(Remote(url, options), staging_dir=tmp_path / "other")  # a fresh node's listing
    try:
        listed = {c.name: c.posix for c in other.readdir("/d")}
        assert len(listed) == 5 and all(p is not None and p.mode == 0o640 for p in listed.values()), listed
    finally:
        other.close()


# -- through a mount: real rsync, a real crash ------------------------------------------------------
def _tree(top: Path, n: int) -> Path:
    src = top / "src"
    for i in range(n):
        d = src / f"d{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        f = d / f"f{i:03d}.bin"
        f.write_bytes(os.urandom(200 + 37 * i))
        os.chmod(f, 0o600 if i % 3 == 0 else 0o644 if i % 3 == 1 else 0o755)
        os.utime(f, ns=(T0 + i * 10**9, T0 + i * 10**9))
    return src


def _stats(tree: Path) -> list[str]:
    out = subprocess.run(["sh", "-c", f"cd '{tree}' && find . -type f -exec stat -c '%n %a %Y %s' {{}} +"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(out.splitlines())


@pytest.mark.mount
def test_rsync_a_of_100_files_into_s3_costs_3_requests_a_file(s3_server: Any, tmp_path: Path) -> None:
    """The acceptance item, counted through a mount: ``rsync -a`` of 100 small files into S3
    (SeaweedFS) in the default mode. Per file an upload, a copy that carries its times and
    mode, a delete, and no lookup; what else the mount sends is per directory (its marker, its
    lookup) or in the background (its record, once per 0.2 s window). Then a fresh mount (a
    new cache: another node) shows every mode and mtime."""
    from mounting import inprocess_mount

    n = 100
    src = _tree(tmp_path, n)
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    options = s3_server.storage_options()
    # Listings kept a minute: on a loaded machine rsync may reach a directory after the default
    # TTL, and that directory's first lookups would go to the store (measured in bench.py).
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=options,
                         metadata_ttl=60.0, list_prefetch=True) as core:
        record_puts = count_record_puts(core.remote)
        core.remote.stats.reset()
        subprocess.run(["rsync", "-a", f"{src}/", str(tmp_path / "mnt" / "dst")], check=True, timeout=300,
                       capture_output=True)
        spent = requests(core.remote)
        records = record_puts[0]
        time.sleep(DEFER_SECONDS + 0.2)
        later = requests(core.remote)
        assert {k: v for k, v in later.items() if k != "put"} == {k: v for k, v in spent.items() if k != "put"}, \
            (spent, later)  # nothing sent late but the directory records'
        assert later.get("put", 0) - spent.get("put", 0) == record_puts[0] - records
        print("rsync -a of", n, "files:", spent, "of which directory records:", records)
        dirs = 3  # dst, dst/d0, dst/d1: a marker each
        assert spent.get("copy") == n and spent.get("delete") == n, spent  # one copy a file: it carried them
        assert spent.get("put", 0) - records - dirs == n, (spent, records)  # one upload a file
        lookups = spent.get("head", 0) + spent.get("list", 0) + spent.get("get", 0)
        assert lookups <= 2 * dirs, spent  # none a file: the listings made here answer rsync's lookups
        critical = sum(spent.values()) - records
        assert critical <= 3 * n + 3 * dirs, spent
        assert journals(tmp_path / "cache" / "staging") == []  # nothing left for later
    with inprocess_mount(url, tmp_path / "mnt2", tmp_path / "cache2", storage_options=options) as fresh:
        assert _stats(tmp_path / "mnt2" / "dst") == _stats(src)
        assert fresh.remote.stats.snapshot()["requests"].get("copy", 0) == 0


@pytest.mark.mount
def test_a_daemon_killed_within_the_window_leaves_the_attributes_to_its_next_start(
        s3_server: Any, tmp_path: Path) -> None:
    """SIGKILL right after a chmod and touch of a file just written (no rename to carry them):
    the bucket has the bytes, not yet the attributes; the journal is on the cache disk. The next
    daemon on that cache directory sends them before it serves, and a fresh mount shows them."""
    from mounting import force_unmount, inprocess_mount, subprocess_mount

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    options, env = s3_server.storage_options(), s3_server.env()
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    client = Remote(url, options)
    try:
        with subprocess_mount(url, mnt, cache, env=env) as pid:
            (mnt / "f").write_bytes(b"payload")
            os.utime(mnt / "f", ns=(T0, T0))
            os.chmod(mnt / "f", 0o600)
            os.kill(pid, signal.SIGKILL)  # within the window: nothing sent yet
            assert len(journals(cache / "staging")) == 1
            force_unmount(mnt)
        assert client.read_range("f", 0, 7) == b"payload"
        assert client.stat("f").posix.mode is None  # the kill came first
        with subprocess_mount(url, mnt, cache, env=env):
            assert journals(cache / "staging") == []  # sent at start
            posix = client.stat("f").posix
            assert posix.mode == 0o600 and posix.mtime_ns == T0
        with inprocess_mount(url, tmp_path / "mnt2", tmp_path / "cache2", storage_options=options):
            st = os.stat(tmp_path / "mnt2" / "f")
            assert st.st_mode & 0o777 == 0o600 and st.st_mtime_ns == T0
    finally:
        client.close()
