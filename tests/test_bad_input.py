"""Bad input: odd flags and values, odd names, keys that are not POSIX names, huge directories,
empty and huge files. Never a crash, never a hang: an errno or a documented presentation
(docs/reliability.md has the table)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
import unicodedata
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from marinfs.app import cli
from mounting import MARINFS, Mounted, force_unmount, fsspec_client, inprocess_mount, staging_entries, subprocess_mount
import tiers

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def refused(op: Callable[[Any], Any], path: Any) -> int:
    """The errno ``op(path)`` fails with (a descriptor it opened anyway is closed: never leave one
    open on a mount)."""
    fd = None
    try:
        with pytest.raises(OSError) as info:
            fd = op(path)
    finally:
        if isinstance(fd, int):
            os.close(fd)
    return info.value.errno


# -- flags and values ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [
    ["--chunk-size", "1K"], ["--chunk-size", "2G"], ["--chunk-size", "lots"], ["--cache-size", "-5"],
    ["--cache-min-free", "1Q"], ["--retries", "0"], ["--retries", "many"], ["--metrics-port", "70000"],
    ["--metrics-port", "-1"], ["--uid", "-1"], ["--gid", "x"], ["--file-mode", "10000"],
    ["--uid", "99999999999"], ["--gid", "4294967295"], ["--file-mode", "07777"], ["--file-mode", "04755"],
    ["--metrics-addr", "999.1.1.1"], ["--metrics-addr", "not an address"],
    ["--dir-mode", "rwx"], ["--log-level", "loud"], ["--prefetch-workers", "0"], ["--read-ahead-kb", "-1"],
    ["--metadata-ttl", "nan"], ["--negative-ttl", "-0.1"], ["--list-ttl", "nan"],
    ["--connect-timeout", "nan"], ["--read-timeout", "-1"], ["--mount-timeout", "nan"],
    ["-o", "=value"], ["-o", "novalue"], ["--unknown-flag"], ["extra", "positional"],
])
def test_bad_mount_flags_are_one_line_and_exit_2(flags: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "remote").mkdir()
    (tmp_path / "mnt").mkdir()
    try:
        code = cli.main(["mount", str(tmp_path / "remote"), str(tmp_path / "mnt"), "--cache-dir",
                         str(tmp_path / "cache"), *flags])
    finally:
        if os.path.ismount(tmp_path / "mnt"):  # accepted after all: never leave it mounted
            subprocess.run([*MARINFS, "umount", str(tmp_path / "mnt")], capture_output=True, timeout=60)
            force_unmount(tmp_path / "mnt")
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("marinfs: error: ") and "Traceback" not in err
    assert not os.path.ismount(tmp_path / "mnt")


@pytest.mark.parametrize("flags, named", [
    (["--metrics-addr", "999.1.1.1"], "--metrics-addr"), (["--uid", "99999999999"], "--uid"),
    (["--file-mode", "07777"], "--file-mode"),
])
def test_a_flag_out_of_range_is_named_in_its_one_line(flags: list[str], named: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37: these were accepted (an owner no uid_t holds, setuid on every file), or the
    address failed later without naming the flag."""
    (tmp_path / "remote").mkdir()
    (tmp_path / "mnt").mkdir()
    code = cli.main(["mount", str(tmp_path / "remote"), str(tmp_path / "mnt"), "--cache-dir",
                     str(tmp_path / "cache"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"marinfs: error: {named}: ") and flags[1] in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.mount
def test_metrics_that_cannot_be_served_fail_the_mount_naming_the_flag(tmp_path: Path) -> None:
    """An address this machine does not have (TEST-NET-1): one line naming the flags, exit 2,
    nothing mounted and no daemon state left behind."""
    (tmp_path / "remote").mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = subprocess.run([*MARINFS, "mount", str(tmp_path / "remote"), str(mnt), "--cache-dir",
                                 str(tmp_path / "cache"), "--metrics-addr", "192.0.2.1", "--metrics-port", "9"],
                                capture_output=True, text=True, timeout=120)
    finally:
        force_unmount(mnt)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("marinfs: error: --metrics-addr 192.0.2.1 --metrics-port 9: "), lines[0]
    from marinfs.app.daemon import state_file
    assert not state_file(str(mnt)).exists()
    assert not os.path.ismount(mnt)


@pytest.mark.parametrize("args", [
    ["umount"], ["cache"], ["cache", "warm"], ["cache", "warm", "/", "--workers", "0"], ["status", "a", "b"],
    ["config", "check"], ["path"], ["mount"], ["mount", "--config", "/nonexistent/marinfs.toml", "/mnt"],
])
def test_bad_subcommand_arguments_are_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code in (1, 2) and len(err.strip().splitlines()) == 1 and err.startswith("marinfs: error: "), err


def test_unusable_cache_dir_and_log_file_fail_the_mount_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    (tmp_path / "mnt").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    for extra in (["--cache-dir", str(tmp_path / "a-file")], ["--cache-dir", str(tmp_path / "a-file/sub")],
                  ["--log-file", str(tmp_path / "no/such/dir/log")]):
        args = [*MARINFS, "mount", str(tmp_path / "remote"), str(tmp_path / "mnt"), *extra]
        if "--cache-dir" not in extra:
            args += ["--cache-dir", str(tmp_path / "cache")]
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
        try:
            assert result.returncode != 0, extra
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("marinfs: error: "), result.stderr
            assert "Traceback" not in result.stderr
            assert not os.path.ismount(tmp_path / "mnt")
        finally:
            force_unmount(tmp_path / "mnt")


@pytest.mark.mount
def test_a_mountpoint_with_spaces_newlines_and_unicode(tmp_path: Path) -> None:
    """/proc/mounts escapes them; umount, status and path must find the mount all the same."""
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote/f").write_text("f")
    mnt = tmp_path / "mount point\twith\nodd ünicode"
    with subprocess_mount(str(tmp_path / "remote"), mnt, tmp_path / "cache"):
        assert (mnt / "f").read_text() == "f"
        status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        path = subprocess.run([*MARINFS, "path", str(mnt / "f")], capture_output=True, text=True, timeout=60)
        assert path.returncode == 0 and path.stdout.strip() == str(tmp_path / "remote/f")
    assert not os.path.ismount(mnt)


# -- names ---------------------------------------------------------------------------------------
ODD_NAMES = [
    "with space", " leading space", "trailing space ", "new\nline", "tab\there", "colon:name",
    "ünïcödé", "日本語のファイル", "emoji-🙂", "percent%20encoded", "question?", "hash#frag",
    "plus+sign", "star*", "back\\slash", "quote'\"", "-dash", "...", "..a", "a..", "semi;colon",
    "brackets[]{}()", "amp&", "dollar$HOME", "~tilde", "eq=sign", "comma,", "at@", "pipe|",
    "lt<gt>", "x" * 255, "é" * 127 + "x",  # 255 bytes of UTF-8
    unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café"),  # two names
]


def test_odd_names_round_trip_through_the_mount_and_the_remote(mounted: Mounted) -> None:
    """Each name: create, list, read, rename, unlink, and the remote key is the name itself."""
    d = mounted.mnt / "odd"
    os.mkdir(d)
    names = ODD_NAMES
    if mounted.url.startswith("s3://"):  # SeaweedFS stores "\\" as "/" (AWS S3 keeps it)
        names = [n for n in names if "\\" not in n]
    for i, name in enumerate(names):
        (d / name).write_bytes(f"{i}".encode())
    assert sorted(os.listdir(d)) == sorted(names)
    for i, name in enumerate(names):
        assert (d / name).read_bytes() == f"{i}".encode(), name
        assert mounted.remote_bytes(f"odd/{name}") == f"{i}".encode(), name
    for name in names:
        renamed = name[:-1] + "2" if len(name.encode()) >= 255 else name + ".2"
        os.rename(d / name, d / renamed)
        assert (d / renamed).exists() and not (d / name).exists()
        os.unlink(d / renamed)
    assert os.listdir(d) == []


def test_names_over_255_bytes_are_enametoolong(mounted: Mounted) -> None:
    (mounted.mnt / "src").write_bytes(b"s")
    for name in ("x" * 256, "é" * 128, "日" * 85 + "x"):  # 256 bytes each
        assert len(name.encode()) == 256
        for op in (lambda p: p.write_bytes(b"x"), os.mkdir, os.stat, lambda p: os.rename(mounted.mnt / "src", p)):
            with pytest.raises(OSError) as info:
                op(mounted.mnt / name)
            assert info.value.errno == errno.ENAMETOOLONG
    assert os.listdir(mounted.mnt) == ["src"]


def test_a_name_that_is_not_utf8(mounted: Mounted) -> None:
    """Local and memory remotes take any bytes as a name, as a local disk does; object store keys
    are UTF-8, so there such a name is EILSEQ (not EIO with a traceback), and nothing is sent."""
    bad = os.fsencode(str(mounted.mnt)) + b"/latin1-caf\xe9"
    if mounted.url.startswith(("s3://", "gs://")):
        os.mkdir(mounted.mnt / "new")  # made here: its (empty) listing is known, nothing asks the store
        (mounted.mnt / "src").write_bytes(b"s")
        in_new = os.fsencode(str(mounted.mnt)) + b"/new/latin1-caf\xe9"
        for path in (bad, in_new):  # refused at create in both (issue 37: accepted in "new", then
            for op in (os.stat, lambda p: os.open(p, os.O_WRONLY | os.O_CREAT, 0o644), os.mkdir,  # retried forever)
                       lambda p: os.rename(mounted.mnt / "src", p)):
                assert refused(op, path) in ((errno.EILSEQ, errno.ENOENT) if op is os.stat else (errno.EILSEQ,)), op
        assert sorted(os.listdir(mounted.mnt)) == ["new", "src"] and os.listdir(mounted.mnt / "new") == []
        assert not staging_entries(mounted.cache_dir / "staging", "*.journal.json")  # nothing staged to fail later
        os.rmdir(mounted.mnt / "new")
        os.unlink(mounted.mnt / "src")
    else:
        with open(bad, "wb") as f:
            f.write(b"bytes")
        assert os.listdir(os.fsencode(str(mounted.mnt))) == [b"latin1-caf\xe9"]
        with open(bad, "rb") as f:
            assert f.read() == b"bytes"
        os.unlink(bad)
    (mounted.mnt / "fine").write_text("ok")
    assert os.listdir(mounted.mnt) == ["fine"]


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_an_object_key_over_the_stores_limit_is_enametoolong_at_once(backend: str, request: pytest.FixtureRequest,
                                                                      tmp_path: Path) -> None:
    """S3 and GCS keep keys of at most 1024 bytes (the prefix included), however short each name.
    A longer one is ENAMETOOLONG at create, mkdir, rename and stat, with no request: SeaweedFS's
    "Your key is too long" was retried as transient, then EIO (and a file's bytes were
    accepted, then failed at every commit)."""
    from conftest import mount_backend

    with mount_backend(request, backend, tmp_path) as m:
        room = 1024 - len(m.root.partition("/")[2].encode()) - 1  # bytes left for the key under the prefix
        deep = m.mnt
        while room > 200:  # directories of up to 250 bytes, until 100 to 200 bytes are left
            step = min(250, room - 100)
            deep /= "d" * step
            room -= step + 1
            os.mkdir(deep)
        fits, over = deep / ("f" * room), deep / ("f" * (room + 1))  # exactly 1024 bytes of key, and 1025
        fits.write_bytes(b"fits")
        assert m.remote_bytes(str(fits.relative_to(m.mnt))) == b"fits"
        (m.mnt / "short").write_bytes(b"s")
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            os.stat(over)
        assert info.value.errno in (errno.ENOENT, errno.ENAMETOOLONG)  # (known absent from a listing: ENOENT)
        for op in (lambda p: os.open(p, os.O_WRONLY | os.O_CREAT, 0o644), os.mkdir,
                   lambda p: os.rename(m.mnt / "short", p), lambda p: os.symlink("short", p)):
            assert refused(op, over) == errno.ENAMETOOLONG, op
        assert time.monotonic() - started < 2  # no retries
        assert sorted(os.listdir(deep)) == [fits.name] and (m.mnt / "short").read_bytes() == b"s"
        assert not staging_entries(m.cache_dir / "staging", "*.journal.json")  # nothing staged to fail later


def test_a_key_the_store_calls_too_long_is_final_never_retried() -> None:
    """s3fs turns S3's KeyTooLongError (HTTP 400) into ENAMETOOLONG with botocore's ClientError
    as its cause, whose class name is also aiohttp's transient one: it was retried, then EIO."""
    import botocore.exceptions

    from marinfs.remote import RemoteSettings
    from marinfs.remote import Remote
    from marinfs.remote.base import is_final, is_transient

    def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
        return botocore.exceptions.ClientError({"Error": {"Code": code, "Message": code},
                                                "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    too_long = OSError(errno.ENAMETOOLONG, "Your key is too long.")
    too_long.__cause__ = client_error("KeyTooLongError", 400)
    assert is_final(too_long) and not is_transient(too_long)
    assert is_final(client_error("AccessDenied", 403)) and not is_transient(client_error("AccessDenied", 403))
    assert is_transient(client_error("SlowDown", 503)) and not is_final(client_error("SlowDown", 503))
    calls = []

    def put() -> None:
        calls.append(1)
        raise too_long

    remote = Remote(f"memory://final-{uuid.uuid4().hex[:8]}", settings=RemoteSettings(attempts=4, backoff_base=0))
    with pytest.raises(OSError) as info:
        remote._call("put", put)
    assert info.value.errno == errno.ENAMETOOLONG and len(calls) == 1


@pytest.mark.mount
def test_a_local_name_that_is_not_utf8_does_not_break_its_directory(tmp_path: Path) -> None:
    """A local remote may hold names that are not UTF-8: the rest of the directory lists."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "good").write_text("g")
    with open(os.fsencode(str(remote)) + b"/latin1-\xe9", "wb") as f:
        f.write(b"l")
    with subprocess_mount(str(remote), tmp_path / "mnt", tmp_path / "cache"):
        names = os.listdir(os.fsencode(str(tmp_path / "mnt")))
        assert b"good" in names
        assert (tmp_path / "mnt/good").read_text() == "g"


# -- remote keys that are not POSIX names -----------------------------------------------------------
# Written behind marinfs's back by other clients. GCS (and AWS S3) keep any key verbatim;
# SeaweedFS, our S3 server, refuses "." and ".." components and components over 255 bytes and
# folds "//" and "\\" into "/", so on S3 only the keys it keeps are tried.
ODD_KEYS = {
    "a//b": b"double slash",
    "c/./d": b"dot component",
    "e/../f": b"dotdot component",
    "g/": b"a key ending in / with content",
    "h": b"object h",
    "h/inside": b"object under prefix h/",
    "long/" + "n" * 300: b"a component over 255 bytes",
    "nl/new\nline": b"newline",
    "ok/plain": b"plain",
}
SEAWEEDFS_KEEPS = ("g/", "h", "h/inside", "nl/new\nline", "ok/plain")


@pytest.fixture(params=["s3", "gcs"])
@tiers.needs("mount")
def odd_keys(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    from conftest import object_store

    url, options, env = object_store(request, request.param)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    bucket, _, prefix = root.partition("/")
    for key, data in ODD_KEYS.items():
        if request.param == "s3":
            if key in SEAWEEDFS_KEEPS:  # s3fs would normalize the key: the raw client does not
                client.call_s3("put_object", Bucket=bucket, Key=f"{prefix}/{key}", Body=data)
        else:
            client.pipe_file(f"{root}/{key}", data)
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=options):
        yield tmp_path / "mnt", request.param


def walk(root: Path) -> dict[str, bytes | None]:
    """Every name reachable by listing, with its bytes (None for directories): raises on errors."""
    out: dict[str, bytes | None] = {}
    todo = [""]
    while todo:
        rel = todo.pop()
        for name in os.listdir(root / rel):
            assert name and name not in (".", "..") and "/" not in name, repr(name)
            path = f"{rel}/{name}" if rel else name
            if os.path.isdir(root / path):
                out[path] = None
                todo.append(path)
            else:
                out[path] = (root / path).read_bytes()
    return out


def test_keys_that_are_not_posix_names_are_hidden_or_shown_never_a_crash(odd_keys: Any) -> None:
    mnt, backend = odd_keys
    tree = walk(mnt)
    # The documented presentation (docs/reliability.md): components that are empty, "." or ".."
    # or over 255 bytes cannot be reached by a path, so those objects are not listed (their
    # directories are); an object with the name of a prefix is shadowed by the directory; a
    # `g/` object with bytes is the directory g and its bytes are not shown.
    want: dict[str, bytes | None] = {"g": None, "h": None, "h/inside": b"object under prefix h/", "nl": None,
                                     "nl/new\nline": b"newline", "ok": None, "ok/plain": b"plain"}
    if backend == "gcs":
        want.update({"a": None, "c": None, "e": None, "long": None})
    assert tree == want
    for tool in (["ls", "-laR", str(mnt)], ["find", str(mnt)], ["du", "-s", str(mnt)]):
        out = subprocess.run(tool, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (tool, out.stderr)


# -- big directories, empty and huge files --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["local", "memory"])
@pytest.mark.mount
def test_a_directory_of_10000_entries(backend: str, tmp_path: Path) -> None:
    names = [f"entry-{i:05d}" for i in range(10_000)]
    if backend == "local":
        (tmp_path / "remote/big").mkdir(parents=True)
        for name in names:
            (tmp_path / "remote/big" / name).touch()
        url = str(tmp_path / "remote")
    else:
        url = f"memory://big-{uuid.uuid4().hex[:8]}"
        client, root = fsspec_client(url)
        client.pipe({f"{root}/big/{name}": b"" for name in names})
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache"):
        assert sorted(os.listdir(tmp_path / "mnt/big")) == names
        out = subprocess.run(["ls", "-l", str(tmp_path / "mnt/big")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and len(out.stdout.splitlines()) == 10_001
        assert os.stat(tmp_path / "mnt/big/entry-09999").st_size == 0


def test_zero_byte_files(mounted: Mounted) -> None:
    m = mounted.mnt
    (m / "empty").write_bytes(b"")
    assert mounted.remote_bytes("empty") == b"" and os.stat(m / "empty").st_size == 0
    assert (m / "empty").read_bytes() == b""
    with open(m / "empty", "rb") as f:
        f.seek(100)
        assert f.read(10) == b""
    os.truncate(m / "empty", 0)
    os.rename(m / "empty", m / "still-empty")
    assert mounted.remote_bytes("still-empty") == b""
    with open(m / "still-empty", "ab") as f:
        f.write(b"now not")
    assert mounted.remote_bytes("still-empty") == b"now not"
    os.truncate(m / "still-empty", 0)
    assert mounted.remote_bytes("still-empty") == b"" and os.stat(m / "still-empty").st_size == 0
    mounted.put_remote("remote-empty", b"")
    assert (m / "remote-empty").read_bytes() == b""


@pytest.mark.mount
def test_a_sparse_file_over_5_gib_reads_at_every_offset(tmp_path: Path) -> None:
    """Sizes and offsets past 4 GiB (32-bit overflow) through FUSE, the reader and the cache."""
    remote = tmp_path / "remote"
    remote.mkdir()
    size = 5 * GiB + 7
    marks = {0: b"start", 4 * GiB - 3: b"across-4GiB", 5 * GiB - 100: b"near-end", size - 3: b"end"}
    with open(remote / "huge.bin", "wb") as f:
        f.truncate(size)
        for offset, data in marks.items():
            f.seek(offset)
            f.write(data)
    assert os.stat(remote / "huge.bin").st_size == size
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote), mnt, tmp_path / "cache", "--chunk-size", "1M"):
        assert os.stat(mnt / "huge.bin").st_size == size
        with open(mnt / "huge.bin", "rb") as f:
            for offset, data in marks.items():
                f.seek(offset - 2 if offset else 0)
                want = (b"\0\0" if offset else b"") + data
                assert f.read(len(want)) == want, offset
            f.seek(size + 10)
            assert f.read(10) == b""
        tail = subprocess.run(["tail", "-c", "5", str(mnt / "huge.bin")], capture_output=True, timeout=60)
        assert tail.stdout == b"\0\0end"


@pytest.mark.mount
def test_a_staged_file_grown_past_5_gib_then_cut_back_commits_only_what_is_left(tmp_path: Path) -> None:
    """ftruncate to 5 GiB + 1 and a write near its end stay local and sparse; only the final
    size is uploaded."""
    remote = tmp_path / "remote"
    remote.mkdir()
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with subprocess_mount(str(remote), mnt, cache):
        fd = os.open(mnt / "grow", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 5 * GiB + 1)
            assert os.fstat(fd).st_size == 5 * GiB + 1
            assert os.pwrite(fd, b"far out", 5 * GiB - 6) == 7
            assert os.pread(fd, 9, 5 * GiB - 8) == b"\0\0far out"
            staged = [p for p in staging_entries(cache / "staging") if not p.name.endswith(".json")]
            assert len(staged) == 1 and staged[0].stat().st_blocks * 512 < 64 * MiB  # sparse
            os.ftruncate(fd, 100)
            os.pwrite(fd, b"kept", 0)
        finally:
            os.close(fd)
        assert (remote / "grow").read_bytes() == b"kept" + b"\0" * 96
