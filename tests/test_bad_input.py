"""Bad input: odd flags and values, odd names, keys that are not POSIX names, huge directories,
empty and huge files. Never a crash, never a hang: an errno or a documented presentation
(docs/reliability.md has the table)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from marinfs import cli
from mounting import MARINFS, Mounted, fsspec_client, force_unmount, inprocess_mount

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- flags and values ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [
    ["--chunk-size", "1K"], ["--chunk-size", "2G"], ["--chunk-size", "lots"], ["--cache-size", "-5"],
    ["--cache-min-free", "1Q"], ["--retries", "0"], ["--retries", "many"], ["--metrics-port", "70000"],
    ["--metrics-port", "-1"], ["--uid", "-1"], ["--gid", "x"], ["--file-mode", "10000"],
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


# -- names ---------------------------------------------------------------------------------------


def test_a_name_that_is_not_utf8(mounted: Mounted) -> None:
    """Local and memory remotes take any bytes as a name, as a local disk does; object store keys
    are UTF-8, so there such a name is EILSEQ (not EIO with a traceback), and nothing is sent."""
    bad = os.fsencode(str(mounted.mnt)) + b"/latin1-caf\xe9"
    if mounted.url.startswith(("s3://", "gs://")):
        for op in (os.stat, lambda p: os.open(p, os.O_WRONLY | os.O_CREAT, 0o644), os.mkdir):
            fd = None
            try:
                with pytest.raises(OSError) as info:
                    fd = op(bad)
            finally:
                if isinstance(fd, int):
                    os.close(fd)  # (never leave a descriptor open on a mount)
            assert info.value.errno == errno.EILSEQ
        assert os.listdir(mounted.mnt) == []
    else:
        with open(bad, "wb") as f:
            f.write(b"bytes")
        assert os.listdir(os.fsencode(str(mounted.mnt))) == [b"latin1-caf\xe9"]
        with open(bad, "rb") as f:
            assert f.read() == b"bytes"
        os.unlink(bad)
    (mounted.mnt / "fine").write_text("ok")
    assert os.listdir(mounted.mnt) == ["fine"]


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
