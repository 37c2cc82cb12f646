"""Calls beyond plain bytes (issue 16): fallocate, extended attributes, mknod/mkfifo, hard
links, the kernel's permission checks, and the persisted POSIX metadata (chmod, chown,
utimens, user xattrs, create modes) kept across remounts by cp -a, tar -x and rsync -a.

Core tests call ``Filesystem`` as the adapter does; mount tests run the real tools on every
backend through the ``mounted`` fixture and check the bytes in the remote through fsspec.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import marinfs.core.writes as writes_module
from marinfs.core import Filesystem
from marinfs.core.attributes import (XATTR_CREATE, XATTR_REPLACE, XATTR_SIZE_MAX, XATTR_URL,
                                     XATTR_VERSION)
from marinfs.core.writes import FALLOC_FL_KEEP_SIZE
from marinfs.objects import NO_ATTRS, ObjectVersion, PosixAttrs
from marinfs.write.recovery import recover
from marinfs.remote import Remote
from marinfs.write.staging import JOURNAL_SUFFIX, StagedFile
import tiers
from conftest import BACKENDS, object_store
from mounting import Mounted, fsspec_client, inprocess_mount, staging_entries, subprocess_mount
from test_core import fs, put, raises_errno  # noqa: F401 - fs is a fixture

MiB = 1 << 20
CREAT = os.O_CREAT | os.O_WRONLY
FALLOC_FL_PUNCH_HOLE, FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_ZERO_RANGE = 0x02, 0x08, 0x10
KERNEL_NAMES = ("security.selinux", "security.capability", "system.posix_acl_access",
                "system.posix_acl_default", "trusted.overlay.opaque")
NOBODY = 65534


def cat(remote: Remote, key: str) -> bytes:
    return bytes(remote.fs.cat_file(remote.full(key)))


def close(fs: Filesystem, fh: int) -> None:
    fs.flush(fh)
    fs.release(fh)


def staged_fd(fs: Filesystem, fh: int) -> int:
    staged = fs.handles.get(fh).staged
    assert staged is not None
    return staged.fd


# -- fallocate (core) --------------------------------------------------------------------------
def test_fallocate_extends_a_staged_file_with_zeros_committed_at_close(fs: Filesystem, remote: Remote) -> None:
    fh = fs.create("/new.bin", CREAT).fh
    fs.write(fh, b"abc", 0)
    fs.fallocate(fh, 0, 0, MiB)
    assert fs.handle_info(fh).size == MiB and fs.getattr("/new.bin").size == MiB
    assert os.fstat(staged_fd(fs, fh)).st_blocks * 512 >= MiB  # the blocks are reserved, not a hole
    close(fs, fh)
    assert cat(remote, "new.bin") == b"abc" + bytes(MiB - 3)

    # An existing object opened without O_TRUNC: its old bytes, then zeros up to the new end.
    put(remote, "old.bin", b"0123456789")
    fh = fs.open("/old.bin", os.O_RDWR).fh
    fs.fallocate(fh, 0, 5, 20)
    assert fs.handle_info(fh).size == 25
    close(fs, fh)
    assert cat(remote, "old.bin") == b"0123456789" + bytes(15)


def test_fallocate_keep_size_and_inside_the_file_change_nothing(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f.bin", b"hello")
    before = remote.stat("f.bin").version
    fh = fs.open("/f.bin", os.O_WRONLY).fh
    fs.fallocate(fh, FALLOC_FL_KEEP_SIZE, 0, MiB)
    fs.fallocate(fh, 0, 0, 5)  # mode 0 inside the file: blocks, no new bytes
    assert fs.handle_info(fh).size == 5
    assert os.fstat(staged_fd(fs, fh)).st_blocks * 512 >= MiB
    close(fs, fh)
    assert cat(remote, "f.bin") == b"hello"
    assert remote.stat("f.bin").version == before  # nothing changed: nothing was committed


def test_fallocate_refuses_holes_ranges_and_read_only_handles(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f.bin", b"hello")
    fh = fs.open("/f.bin", os.O_RDWR).fh
    for mode in (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_ZERO_RANGE, FALLOC_FL_COLLAPSE_RANGE):
        with raises_errno(errno.EOPNOTSUPP):
            fs.fallocate(fh, mode, 0, 4096)
    with raises_errno(errno.EINVAL):
        fs.fallocate(fh, 0, 0, 0)
    close(fs, fh)
    reader = fs.open("/f.bin", os.O_RDONLY).fh
    with raises_errno(errno.EBADF):
        fs.fallocate(reader, 0, 0, 4096)
    fs.release(reader)
    assert cat(remote, "f.bin") == b"hello"


def test_fallocate_that_finds_no_space_changes_nothing(fs: Filesystem, remote: Remote,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the staging disk fails the call before the size moves, and the file still
    commits what was written: a failed reservation loses no bytes (unlike a failed write)."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    fh = fs.create("/f.bin", CREAT).fh
    fs.write(fh, b"abc", 0)
    monkeypatch.setattr(writes_module, "reserve", full)
    with raises_errno(errno.ENOSPC):
        fs.fallocate(fh, 0, 0, MiB)
    assert fs.handle_info(fh).size == 3
    close(fs, fh)
    assert cat(remote, "f.bin") == b"abc"


# -- extended attributes (core) ----------------------------------------------------------------
def test_xattrs_name_the_object_and_its_version(fs: Filesystem, remote: Remote) -> None:
    put(remote, "d/f.bin", b"data")
    url = f"{remote.url}/d/f.bin"
    assert fs.getxattr("/d/f.bin", XATTR_URL) == url.encode()
    assert fs.getxattr("/d/f.bin", XATTR_VERSION) == str(remote.stat("d/f.bin").version).encode()
    assert fs.listxattr("/d/f.bin") == []  # read by name only (see fs.listxattr)
    assert fs.getxattr("/d", XATTR_URL) == f"{remote.url}/d".encode()
    assert fs.getxattr("/", XATTR_URL) == remote.url.encode()
    assert fs.listxattr("/d") == [] and fs.listxattr("/") == []
    with raises_errno(errno.ENODATA):
        fs.getxattr("/d", XATTR_VERSION)  # directories have no version
    for name in (*KERNEL_NAMES, "user.other"):
        with raises_errno(errno.ENODATA):
            fs.getxattr("/d/f.bin", name)
    with raises_errno(errno.ENOENT):
        fs.getxattr("/missing", XATTR_URL)
    with raises_errno(errno.ENOENT):
        fs.listxattr("/missing")


def test_a_file_with_uncommitted_bytes_has_no_version_until_its_close(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f.bin", b"old")
    old = remote.stat("f.bin").version
    fh = fs.open("/f.bin", os.O_WRONLY | os.O_TRUNC).fh
    fs.write(fh, b"new bytes", 0)
    with raises_errno(errno.ENODATA):
        fs.getxattr("/f.bin", XATTR_VERSION)
    close(fs, fh)
    new = fs.getxattr("/f.bin", XATTR_VERSION).decode()
    assert new == str(remote.stat("f.bin").version) and new != str(old)


def test_kernel_namespaces_and_ours_cannot_be_set(fs: Filesystem, remote: Remote, tmp_path: Path) -> None:
    put(remote, "f.bin", b"data")
    for name in (XATTR_URL, XATTR_VERSION, "user.marinfs.other"):
        with raises_errno(errno.EPERM):
            fs.setxattr("/f.bin", name, b"s3://elsewhere")
        with raises_errno(errno.EPERM):
            fs.removexattr("/f.bin", name)
    for name in KERNEL_NAMES:
        with raises_errno(errno.ENOTSUP):
            fs.setxattr("/f.bin", name, b"v")
        with raises_errno(errno.ENODATA):
            fs.removexattr("/f.bin", name)
    with raises_errno(errno.ENODATA):
        fs.removexattr("/f.bin", "user.checksum")  # nothing stored under that name
    with raises_errno(errno.ENOENT):
        fs.setxattr("/missing", "user.checksum", b"v")
    assert fs.getxattr("/f.bin", XATTR_URL) == f"{remote.url}/f.bin".encode()
    read_only = Filesystem(remote, staging_dir=tmp_path / "ro-staging", read_only=True)
    for call in (lambda: read_only.setxattr("/f.bin", "user.checksum", b"v"),
                 lambda: read_only.removexattr("/f.bin", XATTR_URL),
                 lambda: read_only.set_attributes("/f.bin", mode=0o755)):
        with raises_errno(errno.EROFS):
            call()


# -- persisted attributes (core) ---------------------------------------------------------------
def requests(remote: Remote) -> dict[str, int]:
    return dict(remote.stats.snapshot()["requests"])


def shown(fs: Filesystem, path: str, info: Any = None) -> dict[str, Any]:
    """What a stat through the mount shows (FuseAdapter.attrs): stored values, else the mount's
    defaults and the object's time; and the user xattrs. A local file always has all of its own."""
    info = info or fs.getattr(path)
    p = info.posix or NO_ATTRS
    return {"mode": p.mode if p.mode is not None else fs.defaults.dir_mode if info.is_dir else fs.defaults.file_mode,
            "uid": fs.defaults.uid if p.uid is None else p.uid, "gid": fs.defaults.gid if p.gid is None else p.gid,
            "mtime_ns": info.mtime_ns if p.mtime_ns is None else p.mtime_ns, "xattrs": dict(p.xattrs)}


def has(fs: Filesystem, path: str, info: Any = None, **want: Any) -> None:
    got = shown(fs, path, info)
    assert {k: got[k] for k in want} == want, got


def stored(remote: Remote, key: str) -> dict[str, Any]:
    """What a new mount of ``remote`` shows for ``key``."""
    return shown(Filesystem(remote, staging_dir=Path(tempfile.mkdtemp(prefix="pt-posix-"))), "/" + key)


def reopened(fs: Filesystem, tmp_path: Path) -> Filesystem:
    """A new mount of the same remote on a fresh cache: only what the remote keeps is seen."""
    fs.close_all()
    return Filesystem(fs.remote, staging_dir=tmp_path / f"staging-{uuid.uuid4().hex[:6]}")


def test_chmod_chown_utimens_of_a_committed_file_are_one_metadata_update_each(
        fs: Filesystem, remote: Remote, tmp_path: Path) -> None:
    put(remote, "run.sh", b"#!/bin/sh\necho hi\n")
    before = fs.getattr("/run.sh")
    remote.stats.reset()
    fs.set_attributes("/run.sh", mode=stat.S_IFREG | 0o755)
    fs.set_attributes("/run.sh", uid=1234, gid=None)
    fs.set_attributes("/run.sh", mtime_ns=1_577_923_200_123_456_789)
    counts = requests(remote)
    assert counts.get("put", 0) == 0 and counts.get("get", 0) == 0, counts  # no bytes moved
    want = dict(mode=0o755, uid=1234, gid=os.getgid(), mtime_ns=1_577_923_200_123_456_789)
    has(fs, "/run.sh", **want)
    assert {k: stored(remote, "run.sh")[k] for k in want} == want  # in the remote, not only in this mount
    remote.stats.reset()
    fs.set_attributes("/run.sh", mode=0o755, uid=1234)  # what it is already: no request
    assert requests(remote) == {}
    assert fs.getattr("/run.sh").size == before.size
    other = reopened(fs, tmp_path)
    has(other, "/run.sh", **want)
    assert cat(remote, "run.sh") == b"#!/bin/sh\necho hi\n"


def test_values_the_mount_shows_anyway_are_not_stored(fs: Filesystem, remote: Remote) -> None:
    """chmod to --file-mode or chown to the mount's owner change nothing anyone sees."""
    put(remote, "f", b"x")
    fs.getattr("/f")
    remote.stats.reset()
    fs.set_attributes("/f", mode=0o644, uid=os.getuid(), gid=os.getgid())
    assert requests(remote) == {}
    has(fs, "/f", mode=0o644, uid=os.getuid(), gid=os.getgid())
    fs.set_attributes("/f", mode=0o600)
    fs.set_attributes("/f", mode=0o644)  # back to the default: stored as what it is now
    has(fs, "/f", mode=0o644)
    assert stored(remote, "f")["mode"] == 0o644


def test_attributes_set_while_writing_go_with_the_commit(fs: Filesystem, remote: Remote, tmp_path: Path) -> None:
    fh = fs.create("/new.bin", CREAT, 0o644).fh
    fs.write(fh, b"payload", 0)
    fs.set_attributes(None, mode=0o600, fh=fh)  # fchmod
    fs.set_attributes("/new.bin", uid=42, gid=43)
    fs.set_attributes("/new.bin", mtime_ns=10**18)
    fs.setxattr("/new.bin", "user.k", b"v")
    want = dict(mode=0o600, uid=42, gid=43, mtime_ns=10**18, xattrs={"user.k": b"v"})
    has(fs, "/new.bin", **want)  # shown at once
    has(fs, "/new.bin", fs.handle_info(fh), **want)
    assert fs.getxattr("/new.bin", "user.k") == b"v" and fs.listxattr("/new.bin") == ["user.k"]
    assert not remote.fs.exists(remote.full("new.bin"))  # nothing sent before the close
    remote.stats.reset()
    close(fs, fh)
    counts = requests(remote)
    assert counts.get("put") == 1 and set(counts) <= {"put", "head", "list"}, counts  # one upload carries all
    has(reopened(fs, tmp_path), "/new.bin", **want)


def test_a_write_after_utimens_sets_the_mtime_again(fs: Filesystem, remote: Remote) -> None:
    fh = fs.create("/f", CREAT).fh
    fs.write(fh, b"a", 0)
    fs.set_attributes("/f", mtime_ns=10**18, mode=0o640)
    fs.write(fh, b"b", 1)
    close(fs, fh)
    got = stored(remote, "f")
    assert got["mode"] == 0o640 and abs(got["mtime_ns"] - time.time_ns()) < 60 * 10**9, got


def test_create_and_mkdir_store_a_mode_only_when_it_is_not_the_mounts(fs: Filesystem, remote: Remote) -> None:
    for path, mode in (("/plain", 0o644), ("/private", 0o600), ("/script", 0o4755)):
        close(fs, fs.create(path, CREAT, stat.S_IFREG | mode).fh)
    if not remote.lists_posix:  # an object store: nothing stored for the plain one
        assert remote.stat("plain").posix == NO_ATTRS
    assert [stored(remote, k)["mode"] for k in ("plain", "private", "script")] == [0o644, 0o600, 0o4755]
    fs.mkdir("/d", 0o755)
    fs.mkdir("/secret", 0o700)
    has(fs, "/secret", mode=0o700)
    has(fs, "/d", mode=0o755)
    assert stored(remote, "secret")["mode"] == 0o700
    fs.mknod("/node", stat.S_IFREG | 0o640)
    assert stored(remote, "node")["mode"] == 0o640


def test_a_truncating_open_keeps_mode_owner_and_xattrs_not_the_mtime(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f", b"old")
    fs.set_attributes("/f", mode=0o600, uid=7, mtime_ns=10**18)
    fs.setxattr("/f", "user.k", b"v")
    fh = fs.open("/f", os.O_WRONLY | os.O_TRUNC).fh
    fs.write(fh, b"new", 0)
    close(fs, fh)
    got = stored(remote, "f")
    assert (got["mode"], got["uid"], got["xattrs"]) == (0o600, 7, {"user.k": b"v"}), got
    assert got["mtime_ns"] != 10**18 and cat(remote, "f") == b"new"


def test_chmod_of_an_object_changed_meanwhile_applies_to_the_new_one(fs: Filesystem, remote: Remote) -> None:
    """The stat cached here is of bytes someone replaced since: the update's precondition
    fails, and chmod applies to the object as it is now, as chmod on a disk does."""
    put(remote, "f", b"v1")
    fs.getattr("/f")  # cached: version 1
    put(remote, "f", b"v2, someone else's")
    fs.set_attributes("/f", mode=0o700)
    assert stored(remote, "f")["mode"] == 0o700
    assert cat(remote, "f") == b"v2, someone else's"
    has(fs, "/f", mode=0o700)
    assert fs.getattr("/f").size == len(b"v2, someone else's")


def test_chmod_of_a_file_open_for_writing_keeps_its_commit_ours(fs: Filesystem, remote: Remote) -> None:
    """A metadata update of the object under an open writer (nothing written yet) must not make
    the writer's commit a conflict with our own chmod."""
    put(remote, "f", b"v1")
    fh = fs.open("/f", os.O_RDWR).fh
    fs.set_attributes("/f", mode=0o600)
    fs.write(fh, b"V", 0)
    close(fs, fh)
    assert cat(remote, "f") == b"V1" and stored(remote, "f")["mode"] == 0o600
    assert fs.upload_status()["conflicts"] == []


def test_chmod_never_moves_a_writers_base_past_someone_elses_bytes(fs: Filesystem, remote: Remote) -> None:
    """A writer opened version 1; someone replaced it; our chmod applies to their object. The
    writer's commit must still find that it started from other bytes: a conflict, not a blind
    overwrite of theirs."""
    put(remote, "f", b"v1")
    fh = fs.open("/f", os.O_RDWR).fh
    put(remote, "f", b"v2, theirs")
    fs.set_attributes("/f", mode=0o600)
    fs.write(fh, b"ours", 0)
    with raises_errno(errno.ESTALE):
        fs.flush(fh)
    fs.release(fh)
    assert cat(remote, "f") == b"v2, theirs" and stored(remote, "f")["mode"] == 0o600


def test_a_recovered_commit_carries_its_attributes(fs: Filesystem, remote: Remote, tmp_path: Path) -> None:
    fh = fs.create("/crashed", CREAT, 0o600).fh
    fs.write(fh, b"staged", 0)
    fs.setxattr("/crashed", "user.k", b"\x00\xff")
    fs.set_attributes("/crashed", mtime_ns=10**18)
    # The daemon dies here: the staged file and its journal stay.
    results = recover(fs.staging_dir, remote, frozenset())
    assert [r.committed_as for r in results] == ["crashed"]
    got = stored(remote, "crashed")
    assert (got["mode"], got["mtime_ns"], got["xattrs"]) == (0o600, 10**18, {"user.k": b"\x00\xff"}), got
    assert cat(remote, "crashed") == b"staged"


def test_a_journal_written_before_attributes_is_still_replayed(tmp_path: Path, remote: Remote) -> None:
    staging = tmp_path / "old-staging"
    staging.mkdir()
    (staging / "staged-x").write_bytes(b"old daemon's bytes")
    (staging / ("staged-x" + JOURNAL_SUFFIX)).write_text(json.dumps(
        {"remote": remote.url, "key": "old", "base_version": None, "data": "staged-x"}))
    assert [r.committed_as for r in recover(staging, remote)] == ["old"]
    assert cat(remote, "old") == b"old daemon's bytes"
    assert (stored(remote, "old")["mode"], stored(remote, "old")["xattrs"]) == (0o644, {})


def test_a_streamed_commit_is_followed_by_one_metadata_update(tmp_path: Path) -> None:
    """A part upload begun before chmod cannot carry it: set_attrs of the version it made."""
    class Streamed:
        def on_write(self, offset: int, n: int, data: Any = None) -> None: ...
        def on_truncate(self, n: int) -> None: ...
        def abort(self) -> None: ...
        def finish(self, total: int) -> tuple[bool, ObjectVersion]:
            return True, ObjectVersion("etag", "v1")

    calls: list[Any] = []
    staged = StagedFile(tmp_path, "big", seed=None, dirty=True, stream=lambda fd, key, expect: Streamed())
    staged.write(b"x" * 10, 0)
    staged.set_attrs(PosixAttrs(mode=0o600))

    def upload(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("streamed: not uploaded again")

    def set_attrs(key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion:
        calls.append((key, attrs, expect))
        return ObjectVersion("etag", "v2")

    assert staged.commit(upload, set_attrs=set_attrs) == ObjectVersion("etag", "v2")
    assert calls == [("big", PosixAttrs(mode=0o600), ObjectVersion("etag", "v1"))]
    staged.discard()


def test_a_chmod_of_a_directory_on_a_new_mount_keeps_what_was_stored(fs: Filesystem, remote: Remote,
                                                                     tmp_path: Path) -> None:
    """A directory's stat may not carry its attributes (object stores keep them in the parent's
    record): a change merges into what the parent's listing tells, never into nothing."""
    fs.mkdir("/d")
    fs.set_attributes("/d", mtime_ns=10**18)
    fs.setxattr("/d", "user.k", b"v")
    fs.close_all()
    remote.close()  # the daemon ends: its records are written

    def new_mount() -> Filesystem:
        return Filesystem(Remote(remote.url), staging_dir=tmp_path / f"staging-{uuid.uuid4().hex[:6]}")

    other = new_mount()
    other.set_attributes("/d", mode=0o700)
    assert other.getxattr("/d", "user.k") == b"v"
    other.close_all()
    other.remote.close()
    third = new_mount()
    third.readdir("/")
    has(third, "/d", mode=0o700, mtime_ns=10**18, xattrs={"user.k": b"v"})


def test_user_xattrs_are_stored_with_create_and_replace_flags(fs: Filesystem, remote: Remote, tmp_path: Path) -> None:
    put(remote, "d/f", b"data")
    fs.setxattr("/d/f", "user.b", b"2")
    fs.setxattr("/d/f", "user.a", b"1", XATTR_CREATE)
    with raises_errno(errno.EEXIST):
        fs.setxattr("/d/f", "user.a", b"again", XATTR_CREATE)
    with raises_errno(errno.ENODATA):
        fs.setxattr("/d/f", "user.missing", b"x", XATTR_REPLACE)
    fs.setxattr("/d/f", "user.a", b"one", XATTR_REPLACE)
    assert fs.listxattr("/d/f") == ["user.a", "user.b"]  # never user.marinfs.*
    assert fs.getxattr("/d/f", "user.a") == b"one"
    fs.removexattr("/d/f", "user.b")
    with raises_errno(errno.ENODATA):
        fs.getxattr("/d/f", "user.b")
    with raises_errno(errno.E2BIG):
        fs.setxattr("/d/f", "user.huge", bytes(XATTR_SIZE_MAX + 1))
    with raises_errno(errno.ENOSPC):
        fs.setxattr("/d/f", "user.big", bytes(fs.remote.attrs_limit))
    fs.setxattr("/d", "user.dir", b"on a directory")
    other = reopened(fs, tmp_path)
    assert other.listxattr("/d/f") == ["user.a"] and other.getxattr("/d/f", "user.a") == b"one"
    assert other.getxattr("/d", "user.dir") == b"on a directory"
    assert cat(remote, "d/f") == b"data"


def test_directories_keep_their_attributes_and_links_store_none(fs: Filesystem, remote: Remote,
                                                                  tmp_path: Path) -> None:
    fs.mkdir("/d")
    fs.set_attributes("/d", mode=0o700, mtime_ns=10**18)
    has(fs, "/d", mode=0o700, mtime_ns=10**18)
    fs.symlink("d", "/link")
    fs.set_attributes("/link", uid=5, mtime_ns=10**18)  # lchown, lutimes (cp -a, tar -x): accepted
    has(reopened(fs, tmp_path), "/d", mode=0o700, mtime_ns=10**18)


# -- mknod (core) ------------------------------------------------------------------------------
def test_mknod_makes_regular_files_and_refuses_fifos_devices_sockets(fs: Filesystem, remote: Remote) -> None:
    fs.mknod("/plain", stat.S_IFREG | 0o644)
    fs.mknod("/typeless", 0o644)  # mknod(2) with no type is a regular file
    assert cat(remote, "plain") == b"" and cat(remote, "typeless") == b""
    for kind in (stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK):
        with raises_errno(errno.EPERM):
            fs.mknod("/special", kind | 0o644)
    assert not remote.fs.exists(remote.full("special"))
    assert sorted(i.name for i in fs.readdir("/")) == ["plain", "typeless"]
    with raises_errno(errno.EEXIST):
        fs.mknod("/plain", stat.S_IFIFO | 0o644)
    assert not any(p.name.endswith(".journal.json") for p in staging_entries(fs.staging_dir))


# -- through the mount, on every backend -------------------------------------------------------
def sh(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 0, f"{args} failed: {result.stderr}"
    return result


def test_fallocate_through_the_mount(mounted: Mounted) -> None:
    m = mounted.mnt
    sh("fallocate", "-l", "1M", str(m / "f"))
    assert sh("stat", "-c", "%s", str(m / "f")).stdout.strip() == str(MiB)
    assert mounted.remote_bytes("f") == bytes(MiB)

    (m / "g").write_bytes(b"abc")
    sh("fallocate", "-n", "-l", "1M", str(m / "g"))  # KEEP_SIZE: reserved, not longer
    assert sh("stat", "-c", "%s", str(m / "g")).stdout.strip() == "3"
    assert mounted.remote_bytes("g") == b"abc"
    sh("fallocate", "-o", "2", "-l", "10", str(m / "g"))  # past the end: zeros, like ext4
    assert (m / "g").read_bytes() == b"abc" + bytes(9)
    assert mounted.remote_bytes("g") == b"abc" + bytes(9)

    for flag in ("-p", "-z", "-c"):  # punch hole, zero range, collapse range
        result = subprocess.run(["fallocate", flag, "-o", "0", "-l", "4096", str(m / "f")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0, flag
    fd = os.open(m / "g", os.O_RDONLY)
    try:
        with raises_errno(errno.EBADF):
            os.posix_fallocate(fd, 0, MiB)
    finally:
        os.close(fd)
    assert mounted.remote_bytes("f") == bytes(MiB) and mounted.remote_bytes("g") == b"abc" + bytes(9)

    # Preallocate, then fill (downloaders do): the size is known before the bytes, and parts
    # the streamer sent while they were still zeros are sent again (S3) or the file whole (GCS).
    data = os.urandom(20 * MiB + 5)
    fd = os.open(m / "pre", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.posix_fallocate(fd, 0, len(data))
        assert os.fstat(fd).st_size == len(data)
        for offset in range(0, len(data), MiB):
            os.pwrite(fd, data[offset:offset + MiB], offset)
    finally:
        os.close(fd)
    assert mounted.remote_bytes("pre") == data


def expected_version(mounted: Mounted, rel: str) -> str:
    """The version marinfs pins, from the store's own metadata: GCS generation, S3 ETag, else
    mtime and size."""
    info = mounted.fs.info(mounted.remote_path(rel))
    if info.get("generation"):
        return f"g{info['generation']}"
    if info.get("ETag") or info.get("etag"):
        return "e" + str(info.get("ETag") or info.get("etag")).strip('"')
    return ""


def test_xattrs_through_the_mount(mounted: Mounted) -> None:
    m = mounted.mnt
    (m / "d").mkdir()
    (m / "d/f").write_bytes(b"one")
    for name in KERNEL_NAMES:
        with raises_errno(errno.ENODATA):
            os.getxattr(m / "d/f", name)
    assert os.getxattr(m / "d/f", XATTR_URL).decode() == f"{mounted.url}/d/f"
    assert os.getxattr(m / "d", XATTR_URL).decode() == f"{mounted.url}/d"
    assert os.listxattr(m / "d/f") == [] and os.listxattr(m / "d") == []

    first = os.getxattr(m / "d/f", XATTR_VERSION).decode()
    (m / "d/f").write_bytes(b"two, longer")
    second = os.getxattr(m / "d/f", XATTR_VERSION).decode()
    assert second != first
    want = expected_version(mounted, "d/f")
    if want:  # S3, GCS: the store's own version
        assert second == want
    elif mounted.url.startswith("/"):  # local: mtime and size (and inode, ctime)
        assert second.startswith("m") and ":11" in second
    assert mounted.remote_bytes("d/f") == b"two, longer"

    with raises_errno(errno.EPERM):
        os.setxattr(m / "d/f", XATTR_URL, b"gs://elsewhere/x")
    with raises_errno(errno.EPERM):
        os.removexattr(m / "d/f", XATTR_VERSION)
    for name in ("security.selinux", "trusted.x"):
        with raises_errno(errno.ENOTSUP):
            os.setxattr(m / "d/f", name, b"v")
    # A well-formed ACL (version 2; user::rw- group::r-- other::r--) gets past the kernel's parser.
    acl = (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + (0xFFFFFFFF).to_bytes(4, "little")
        for tag, perm in ((0x01, 6), (0x04, 4), (0x20, 4)))
    with raises_errno(errno.ENOTSUP):
        os.setxattr(m / "d/f", "system.posix_acl_access", acl)
    with raises_errno(errno.ENODATA):
        os.removexattr(m / "d/f", "user.checksum")
    os.setxattr(m / "d/f", "user.checksum", b"sha256:0")  # stored with the file (see below)
    assert os.listxattr(m / "d/f") == ["user.checksum"]
    assert os.getxattr(m / "d/f", XATTR_URL).decode() == f"{mounted.url}/d/f"
    assert mounted.remote_bytes("d/f") == b"two, longer"


def test_cp_a_rsync_x_and_tar_xattrs_copy_no_attributes(mounted: Mounted, tmp_path: Path) -> None:
    """The read-only attributes are not listed: copies out of the mount do not carry a URL
    that is false for them, and copies between mounts do not fail to set one."""
    m = mounted.mnt
    (m / "f").write_bytes(b"x")
    sh("cp", "-a", str(m / "f"), str(tmp_path / "copy"))
    assert os.listxattr(tmp_path / "copy") == []
    sh("cp", "-a", str(m / "f"), str(m / "cp-a"))
    assert sh("rsync", "-aX", str(m / "f"), str(m / "rsync-ax")).stderr == ""
    out = sh("tar", "--xattrs", "-cf", str(tmp_path / "x.tar"), "-C", str(m), "f")
    assert out.stderr == ""  # no "Cannot flistxattr: Operation not supported"
    (m / "untar").mkdir()
    assert sh("tar", "--xattrs", "-xf", str(tmp_path / "x.tar"), "-C", str(m / "untar")).stderr == ""
    for rel in ("cp-a", "rsync-ax", "untar/f"):
        assert mounted.remote_bytes(rel) == b"x", rel
    if shutil.which("getfattr"):  # package attr
        assert sh("getfattr", "-d", "-m", "-", str(m / "f")).stdout == ""
        value = sh("getfattr", "--only-values", "-n", XATTR_URL, str(m / "f")).stdout
        assert value == f"{mounted.url}/f"


def test_mkfifo_mknod_and_ln_fail_cleanly_through_the_mount(mounted: Mounted) -> None:
    m = mounted.mnt
    (m / "t").write_text("t")
    for args in (["mkfifo", str(m / "fifo")], ["ln", str(m / "t"), str(m / "hard")]):
        result = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and "Operation not permitted" in result.stderr, (args, result.stderr)
    for kind in (stat.S_IFIFO, stat.S_IFCHR):
        with raises_errno(errno.EPERM):
            os.mknod(m / "node", kind | 0o644, os.makedev(1, 3))
    with socket.socket(socket.AF_UNIX) as sock:
        with raises_errno(errno.EPERM):
            sock.bind(str(m / "sock"))
    os.mknod(m / "plain", stat.S_IFREG | 0o644)
    assert mounted.remote_bytes("plain") == b""
    assert sorted(os.listdir(m)) == ["plain", "t"]
    for name in ("fifo", "hard", "node", "sock"):
        assert not mounted.remote_exists(name)


# -- permissions: allow_other + default_permissions ------------------------------------------
def as_nobody(*args: str) -> subprocess.CompletedProcess:
    """Run ``args`` as uid/gid 65534 with no supplementary groups."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
@tiers.needs("mount")
def shared_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A root mount with --allow-other at a mountpoint other users can reach (pytest's own
    tmp directories are 0700)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "f.txt").write_bytes(b"root's\n")
    top = Path(tempfile.mkdtemp(prefix="marinfs-perm-", dir="/tmp"))
    try:
        top.chmod(0o755)
        with subprocess_mount(str(remote), top / "mnt", tmp_path / "cache", "--allow-other"):
            yield top / "mnt", remote
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_allow_other_lets_other_users_read_but_not_write_0644_files(shared_mount: tuple[Path, Path]) -> None:
    mnt, remote = shared_mount
    st = os.stat(mnt / "f.txt")
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o644)
    read = as_nobody("cat", str(mnt / "f.txt"))
    assert read.returncode == 0 and read.stdout == "root's\n", read.stderr
    for script in (f"echo x >> {mnt}/f.txt", f"echo x > {mnt}/new.txt", f"mkdir {mnt}/d", f"rm {mnt}/f.txt",
                   f"mv {mnt}/f.txt {mnt}/g.txt"):
        result = as_nobody("sh", "-c", script)
        assert result.returncode != 0 and "Permission denied" in result.stderr, (script, result.stderr)
    for script in (f"chmod 666 {mnt}/f.txt", f"chown {NOBODY} {mnt}/f.txt"):  # not the owner
        result = as_nobody("sh", "-c", script)
        assert result.returncode != 0 and "Operation not permitted" in result.stderr, (script, result.stderr)
    assert (remote / "f.txt").read_bytes() == b"root's\n"
    assert sorted(os.listdir(remote)) == ["f.txt"]
    (mnt / "f.txt").write_bytes(b"root writes\n")  # the owner may
    assert (remote / "f.txt").read_bytes() == b"root writes\n"


def test_allow_other_enforces_persisted_modes(shared_mount: tuple[Path, Path]) -> None:
    """default_permissions checks the mode marinfs shows: a 0600 file root wrote is not for
    others until a chmod (persisted, so every node enforces the same)."""
    mnt, remote = shared_mount
    fd = os.open(mnt / "private.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"root only\n")
    os.close(fd)
    assert stat.S_IMODE(os.stat(mnt / "private.txt").st_mode) == 0o600
    read = as_nobody("cat", str(mnt / "private.txt"))
    assert read.returncode != 0 and "Permission denied" in read.stderr, read
    os.chmod(mnt / "private.txt", 0o644)
    read = as_nobody("cat", str(mnt / "private.txt"))
    assert read.returncode == 0 and read.stdout == "root only\n", read.stderr
    os.chown(mnt / "private.txt", NOBODY, NOBODY)  # now it is theirs: they may write it
    write = as_nobody("sh", "-c", f"echo theirs > {mnt}/private.txt")
    assert write.returncode == 0, write.stderr
    assert (remote / "private.txt").read_bytes() == b"theirs\n"


# -- persisted attributes through mounts, on every backend, across remounts --------------------
@dataclass
class Store:
    """A fresh prefix on one backend, mounted (in this process, so its request counts can be
    read) as many times as a test wants, each on a fresh cache directory: what another node,
    or this one after a remount, sees is only what the remote keeps."""

    url: str
    options: dict[str, Any]
    tmp: Path
    mounts: int = 0

    @contextlib.contextmanager
    def mount(self) -> Iterator[tuple[Path, Filesystem]]:
        self.mounts += 1
        mnt, cache = self.tmp / f"mnt{self.mounts}", self.tmp / f"cache{self.mounts}"
        with inprocess_mount(self.url, mnt, cache, storage_options=self.options or None) as core:
            yield mnt, core


@pytest.fixture(params=BACKENDS)
@tiers.needs("mount")
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        (tmp_path / "remote").mkdir()
        return Store(str(tmp_path / "remote"), {}, tmp_path)
    if request.param == "memory":
        url = f"memory://posix-{uuid.uuid4().hex[:12]}"
        client, root = fsspec_client(url)
        client.mkdir(root)
        return Store(url, {}, tmp_path)
    url, options, _ = object_store(request, request.param)
    fsspec_client(url, options)[0].pipe_file(f"{fsspec_client(url, options)[1]}/.keep", b"")
    return Store(url, options, tmp_path)


def counts(core: Filesystem) -> dict[str, int]:
    return dict(core.remote.stats.snapshot()["requests"])


def stats_below(tree: Path) -> list[str]:
    """``stat -c '%n %a %u %g %Y'`` of everything below ``tree`` but links (whose own mode,
    owner and times nothing stores; their targets are compared by diff)."""
    out = sh("sh", "-c", f"cd '{tree}' && find . -not -type l -exec stat -c '%n %a %u %g %Y' {{}} +").stdout
    return sorted(out.splitlines())


def same_tree(src: Path, dst: Path) -> None:
    os.listdir(dst.parent)  # (object stores: a directory's attributes show once its parent is listed)
    result = subprocess.run(["diff", "-r", "--no-dereference", str(src), str(dst)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert stats_below(dst) == stats_below(src)


def make_tree(top: Path) -> Path:
    """A tree as a user has one: a script, a 0600 file, another owner's file, a 0700
    directory, a symbolic link, old mtimes (files and directories)."""
    src = top / "src"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o750)
    (src / "secret").write_bytes(b"0600")
    (src / "secret").chmod(0o600)
    (src / "sub" / "data.bin").write_bytes(os.urandom(3000))
    (src / "sub" / "deeper" / "theirs.txt").write_text("someone else's\n")
    os.chown(src / "sub" / "deeper" / "theirs.txt", 1234, 2345)
    (src / "link").symlink_to("sub/data.bin")
    (src / "sub" / "deeper").chmod(0o700)
    for i, path in enumerate(sorted(src.rglob("*"), reverse=True) + [src]):  # children first
        if not path.is_symlink():
            os.utime(path, ns=(1_500_000_000_000_000_000 + i, 1_500_000_000_123_456_789 + i * 10**9))
    return src


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the source tree needs root")
def test_cp_a_keeps_modes_owners_times_and_links_across_a_remount(store: Store, tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    with store.mount() as (mnt, core):
        core.remote.stats.reset()
        sh("cp", "-a", str(src), str(mnt / "dst"))
        print("cp -a:", counts(core))
        same_tree(src, mnt / "dst")
    with store.mount() as (mnt, core):
        same_tree(src, mnt / "dst")
        assert (mnt / "dst/run.sh").read_text() == "#!/bin/sh\necho ran\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the source tree needs root")
def test_tar_x_keeps_modes_owners_times_and_links_across_a_remount(store: Store, tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    sh("tar", "-cf", str(tmp_path / "tree.tar"), "-C", str(tmp_path), "src")
    with store.mount() as (mnt, core):
        (mnt / "x").mkdir()
        sh("tar", "-xpf", str(tmp_path / "tree.tar"), "-C", str(mnt / "x"))
        same_tree(src, mnt / "x/src")
    with store.mount() as (mnt, core):
        same_tree(src, mnt / "x/src")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of the source tree needs root")
def test_rsync_a_twice_with_a_remount_between_sends_nothing_the_second_time(store: Store, tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    with store.mount() as (mnt, core):
        sh("rsync", "-a", f"{src}/", f"{mnt}/dst/")
        same_tree(src, mnt / "dst")
    with store.mount() as (mnt, core):
        core.remote.stats.reset()
        out = sh("rsync", "-a", "--itemize-changes", f"{src}/", f"{mnt}/dst/").stdout
        time.sleep(0.5)  # a directory record's write would follow within its 0.2 s window
        second = counts(core)
        print("rsync -a, second run:", second, out)
        assert second.get("put", 0) == 0 and second.get("copy", 0) == 0, (second, out)
        same_tree(src, mnt / "dst")


def test_o_rdonly_o_trunc_empties_the_file_as_on_a_local_disk(store: Store, tmp_path: Path) -> None:
    disk = tmp_path / "disk-file"
    disk.write_bytes(b"hello")
    os.close(os.open(disk, os.O_RDONLY | os.O_TRUNC))
    assert disk.read_bytes() == b""  # what the kernel's own filesystems do
    with store.mount() as (mnt, core):
        (mnt / "f").write_bytes(b"hello")
        fd = os.open(mnt / "f", os.O_RDONLY | os.O_TRUNC)
        try:
            assert os.fstat(fd).st_size == 0 and os.read(fd, 10) == b""
        finally:
            os.close(fd)
        assert (mnt / "f").read_bytes() == b""
    with store.mount() as (mnt, core):
        assert (mnt / "f").read_bytes() == b""


def test_chmod_x_then_the_script_runs_here_and_after_a_remount(store: Store) -> None:
    with store.mount() as (mnt, core):
        (mnt / "run.sh").write_text("#!/bin/sh\necho ran \"$1\"\n")
        with pytest.raises(PermissionError):  # 0644: not executable
            subprocess.run(["./run.sh"], cwd=mnt, capture_output=True)
        core.remote.stats.reset()
        sh("chmod", "+x", str(mnt / "run.sh"))
        print("chmod +x:", counts(core))
        assert sh("./run.sh", "here", cwd=mnt).stdout == "ran here\n"
    with store.mount() as (mnt, core):
        assert stat.S_IMODE(os.stat(mnt / "run.sh").st_mode) == 0o755
        assert sh("./run.sh", "again", cwd=mnt).stdout == "ran again\n"


def test_touch_d_sets_mtimes_that_a_remount_still_shows(store: Store, tmp_path: Path) -> None:
    sh("touch", "-d", "2020-01-02", str(tmp_path / "ref"))
    want = os.stat(tmp_path / "ref").st_mtime_ns
    with store.mount() as (mnt, core):
        (mnt / "old").write_bytes(b"existing")
        (mnt / "d").mkdir()
        for name in ("old", "new", "d"):
            sh("touch", "-d", "2020-01-02", str(mnt / name))  # new: created, then utimensat
        sh("touch", "-m", "-d", "2021-03-04 05:06:07.123456789", str(mnt / "old"))
        later = os.stat(mnt / "old").st_mtime_ns
        sh("touch", "-a", str(mnt / "old"))  # the mtime omitted (UTIME_OMIT): unchanged
        assert os.stat(mnt / "old").st_mtime_ns == later
    with store.mount() as (mnt, core):
        assert os.stat(mnt / "new").st_mtime_ns == want
        os.listdir(mnt)  # object stores: a directory's attributes show once its parent is listed
        assert os.stat(mnt / "d").st_mtime_ns == want
        assert os.stat(mnt / "old").st_mtime_ns == later
        assert (mnt / "old").read_bytes() == b"existing"
        sh("touch", str(mnt / "old"))  # now (UTIME_NOW)
        assert abs(os.stat(mnt / "old").st_mtime_ns - time.time_ns()) < 30 * 10**9


def test_user_xattrs_set_by_tools_are_there_after_a_remount(store: Store) -> None:
    with store.mount() as (mnt, core):
        (mnt / "f").write_bytes(b"x")
        (mnt / "d").mkdir()
        subprocess.run([sys.executable, "-c", "import os, sys; os.setxattr(sys.argv[1], 'user.k', b'v\\x00w');"
                        "os.setxattr(sys.argv[2], 'user.dir', b'1')", str(mnt / "f"), str(mnt / "d")], check=True)
        sh("setfattr", "-n", "user.tool", "-v", "setfattr", str(mnt / "f"))
        with raises_errno(errno.EEXIST):
            os.setxattr(mnt / "f", "user.k", b"again", os.XATTR_CREATE)
        if store.url.startswith("s3://"):  # 2 KiB of user metadata in all: ENOSPC, nothing sent
            with raises_errno(errno.ENOSPC):
                os.setxattr(mnt / "f", "user.big", b"x" * 1600)
        else:
            os.setxattr(mnt / "f", "user.big", b"x" * 1600)
            os.removexattr(mnt / "f", "user.big")
    with store.mount() as (mnt, core):
        got = subprocess.run([sys.executable, "-c", "import os, sys; print(sorted(os.listxattr(sys.argv[1])),"
                              "os.getxattr(sys.argv[1], 'user.k'), os.getxattr(sys.argv[2], 'user.dir'))",
                              str(mnt / "f"), str(mnt / "d")], capture_output=True, text=True, check=True).stdout
        assert got == "['user.k', 'user.tool'] b'v\\x00w' b'1'\n"
        assert sh("getfattr", "--only-values", "-n", "user.tool", str(mnt / "f")).stdout == "setfattr"
        os.removexattr(mnt / "f", "user.tool")
        assert os.listxattr(mnt / "f") == ["user.k"]


def test_cp_a_of_many_files_carries_their_attributes_in_their_uploads(store: Store, tmp_path: Path) -> None:
    """Attributes set on a file being written go with its upload: no metadata update per file;
    on S3 the directory's record is written a few times (coalesced), not once a file."""
    src = tmp_path / "many"
    src.mkdir()
    for i in range(100):
        (src / f"f{i:03}").write_bytes(b"x" * i)
        (src / f"f{i:03}").chmod(0o600)
        os.utime(src / f"f{i:03}", ns=(10**18, 10**18 + i))
    with store.mount() as (mnt, core):
        core.remote.stats.reset()
        started = time.monotonic()
        sh("cp", "-a", str(src), str(mnt / "many"))
        elapsed = time.monotonic() - started
        got = counts(core)
        print("cp -a of 100 files:", got, f"in {elapsed:.1f} s")
        assert got.get("copy", 0) == 0 and got.get("patch", 0) == 0, got
        if store.url.startswith(("s3://", "gs://", "memory://")):
            # One PUT a file, the marker, and the directory's record once per 0.2 s window the
            # copy lasted (a loaded box copies slower: more windows), never once a file.
            records = min(99, int(elapsed / 0.2) + 2)
            assert 100 <= got.get("put", 0) <= 101 + records, (got, elapsed)
    with store.mount() as (mnt, core):
        same_tree(src, mnt / "many")


def test_streamed_uploads_carry_a_create_mode_and_are_followed_by_later_changes(store: Store) -> None:
    """A big file is uploaded while written (S3 multipart, GCS resumable): a mode given at
    create goes with that upload; a utimens before close, made after it began, costs one
    metadata update after it."""
    data = os.urandom(40 * MiB)
    with store.mount() as (mnt, core):
        core.remote.stats.reset()
        fd = os.open(mnt / "private.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        for offset in range(0, len(data), MiB):
            os.write(fd, data[offset:offset + MiB])
        os.close(fd)
        created = counts(core)
        fd = os.open(mnt / "dated.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        for offset in range(0, len(data), MiB):
            os.write(fd, data[offset:offset + MiB])
        os.utime(fd, ns=(10**18, 10**18))
        os.close(fd)
        dated = {k: v - created.get(k, 0) for k, v in counts(core).items()}
        print("streamed with a create mode:", created, "then with a utimens:", dated)
        if core.remote.streams:
            assert not {"copy", "patch"} & set(created), created
            assert dated.get("copy", 0) + dated.get("patch", 0) == 1, dated
    with store.mount() as (mnt, core):
        assert stat.S_IMODE(os.stat(mnt / "private.bin").st_mode) == 0o600
        assert os.stat(mnt / "dated.bin").st_mtime_ns == 10**18
        assert (mnt / "dated.bin").read_bytes() == data


@pytest.mark.core
@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_local_disk_shows_the_mounts_modes_and_owner_for_what_the_daemon_gave_its_files(
        tmp_path: Path) -> None:
    """A local file always has a mode and an owner: those every file the daemon writes gets
    (its uid and gid, its umask's mode) show as --uid/--gid/--file-mode, anything else as set."""
    root = tmp_path / "remote"
    (root / "d").mkdir(parents=True)
    (root / "plain").write_bytes(b"x")
    (root / "chmodded").write_bytes(b"x")
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(root / "plain", 0o666 & ~umask)
    os.chmod(root / "d", 0o777 & ~umask)
    os.chmod(root / "chmodded", 0o750)
    fs = Filesystem(Remote(str(root)), staging_dir=tmp_path / "staging", file_mode=0o600, dir_mode=0o700,
                    uid=1234, gid=4321)
    has(fs, "/plain", mode=0o600, uid=1234, gid=4321)
    has(fs, "/d", mode=0o700, uid=1234)
    has(fs, "/chmodded", mode=0o750, uid=1234)
    fs.set_attributes("/plain", mode=0o755, uid=42)
    has(fs, "/plain", mode=0o755, uid=42)
    assert stat.S_IMODE(os.stat(root / "plain").st_mode) == 0o755 and os.stat(root / "plain").st_uid == 42
