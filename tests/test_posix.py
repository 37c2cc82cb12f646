"""Calls beyond plain bytes (issue 16, the part that needs no object metadata): fallocate,
extended attributes, mknod/mkfifo, hard links, and the kernel's permission checks.

Core tests call ``Filesystem`` as the adapter does; mount tests run the real tools on every
backend through the ``mounted`` fixture and check the bytes in the remote through fsspec.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import marinfs.fs as fs_module
from marinfs.fs import FALLOC_FL_KEEP_SIZE, XATTR_URL, XATTR_VERSION, Filesystem
from marinfs.remote import Remote
import tiers
from mounting import Mounted, subprocess_mount
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
    staged = fs._handle(fh).staged
    assert staged is not None
    return staged.fd


# -- fallocate (core) --------------------------------------------------------------------------
def test_fallocate_extends_a_staged_file_with_zeros_committed_at_close(fs: Filesystem, remote: Remote) -> None:
    fh = fs.create("/new.bin", CREAT)
    fs.write(fh, b"abc", 0)
    fs.fallocate(fh, 0, 0, MiB)
    assert fs.handle_info(fh).size == MiB and fs.getattr("/new.bin").size == MiB
    assert os.fstat(staged_fd(fs, fh)).st_blocks * 512 >= MiB  # the blocks are reserved, not a hole
    close(fs, fh)
    assert cat(remote, "new.bin") == b"abc" + bytes(MiB - 3)

    # An existing object opened without O_TRUNC: its old bytes, then zeros up to the new end.
    put(remote, "old.bin", b"0123456789")
    fh = fs.open("/old.bin", os.O_RDWR)
    fs.fallocate(fh, 0, 5, 20)
    assert fs.handle_info(fh).size == 25
    close(fs, fh)
    assert cat(remote, "old.bin") == b"0123456789" + bytes(15)


def test_fallocate_keep_size_and_inside_the_file_change_nothing(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f.bin", b"hello")
    before = remote.stat("f.bin").version
    fh = fs.open("/f.bin", os.O_WRONLY)
    fs.fallocate(fh, FALLOC_FL_KEEP_SIZE, 0, MiB)
    fs.fallocate(fh, 0, 0, 5)  # mode 0 inside the file: blocks, no new bytes
    assert fs.handle_info(fh).size == 5
    assert os.fstat(staged_fd(fs, fh)).st_blocks * 512 >= MiB
    close(fs, fh)
    assert cat(remote, "f.bin") == b"hello"
    assert remote.stat("f.bin").version == before  # nothing changed: nothing was committed


def test_fallocate_refuses_holes_ranges_and_read_only_handles(fs: Filesystem, remote: Remote) -> None:
    put(remote, "f.bin", b"hello")
    fh = fs.open("/f.bin", os.O_RDWR)
    for mode in (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_ZERO_RANGE, FALLOC_FL_COLLAPSE_RANGE):
        with raises_errno(errno.EOPNOTSUPP):
            fs.fallocate(fh, mode, 0, 4096)
    with raises_errno(errno.EINVAL):
        fs.fallocate(fh, 0, 0, 0)
    close(fs, fh)
    reader = fs.open("/f.bin", os.O_RDONLY)
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

    fh = fs.create("/f.bin", CREAT)
    fs.write(fh, b"abc", 0)
    monkeypatch.setattr(fs_module, "reserve", full)
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
    fh = fs.open("/f.bin", os.O_WRONLY | os.O_TRUNC)
    fs.write(fh, b"new bytes", 0)
    with raises_errno(errno.ENODATA):
        fs.getxattr("/f.bin", XATTR_VERSION)
    close(fs, fh)
    new = fs.getxattr("/f.bin", XATTR_VERSION).decode()
    assert new == str(remote.stat("f.bin").version) and new != str(old)


def test_xattrs_cannot_be_set_or_removed(fs: Filesystem, remote: Remote, tmp_path: Path) -> None:
    put(remote, "f.bin", b"data")
    for name in (XATTR_URL, XATTR_VERSION):
        with raises_errno(errno.EPERM):
            fs.setxattr("/f.bin", name, b"s3://elsewhere")
        with raises_errno(errno.EPERM):
            fs.removexattr("/f.bin", name)
    for name in (*KERNEL_NAMES, "user.checksum"):
        with raises_errno(errno.ENOTSUP):
            fs.setxattr("/f.bin", name, b"v")
        with raises_errno(errno.ENODATA):
            fs.removexattr("/f.bin", name)
    with raises_errno(errno.ENOENT):
        fs.setxattr("/missing", "user.checksum", b"v")
    assert fs.getxattr("/f.bin", XATTR_URL) == f"{remote.url}/f.bin".encode()
    read_only = Filesystem(remote, staging_dir=tmp_path / "ro-staging", read_only=True)
    with raises_errno(errno.EROFS):
        read_only.setxattr("/f.bin", "user.checksum", b"v")
    with raises_errno(errno.EROFS):
        read_only.removexattr("/f.bin", XATTR_URL)


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
    assert not any(p.name.endswith(".journal.json") for p in fs.staging_dir.iterdir())


# -- through the mount, on every backend -------------------------------------------------------
def sh(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
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
    for name in ("user.checksum", "security.selinux", "trusted.x"):
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
    assert os.getxattr(m / "d/f", XATTR_URL).decode() == f"{mounted.url}/d/f"


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
