"""Reference-model tests: hypothesis drives random sequences of POSIX calls at a marinfs mount and,
call for call, at a plain local directory (the model). After every step the two must agree on
contents, sizes, listings, errno values and the attributes marinfs persists (mode, owner,
user.* xattrs, and the mtime a utimens set). Where docs/semantics.md documents a difference from
a local disk, the test asserts that difference instead of skipping the case.

Open file descriptors are part of the state (open, write, read, truncate, fsync and close happen
in separate steps), so close-to-commit and several handles on one file are exercised; so are
unmount + remount over the same cache directory and, on daemons in their own process, SIGKILL
with files open followed by a new daemon (recovery).

The rules call a driver, so the same machine also runs on ``marinfs.core.Filesystem`` without
FUSE (``FsDriver``: the calls FuseAdapter makes, plus what the kernel answers before a call
reaches FUSE), on memory and local, in the core tier: many more steps in the same time, with a
crash as an abandoned Filesystem whose journals the next one replays.

Budget: ``MARINFS_MODEL_EXAMPLES`` sequences of up to ``MARINFS_MODEL_STEPS`` steps per backend
in ``MARINFS_MODEL_BACKENDS`` (CI: local and s3, a bounded budget, derandomized so a run is
reproducible); ``make soak`` sets them high, on every backend, with random seeds. Each run prints
how many examples and steps it ran. The core machine: ``MARINFS_MODEL_CORE_EXAMPLES`` ×
``MARINFS_MODEL_CORE_STEPS``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import random
import signal
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from conftest import object_store
from mounting import force_unmount, fsspec_client, inprocess_mount, remote_find, staging_entries, subprocess_mount
import tiers

KiB = 1 << 10
CHUNK = 64 * KiB  # the smallest chunk size: files of a few hundred KiB span several chunks
EXAMPLES = int(os.environ.get("MARINFS_MODEL_EXAMPLES", "8"))
STEPS = int(os.environ.get("MARINFS_MODEL_STEPS", "40"))
BACKENDS = os.environ.get("MARINFS_MODEL_BACKENDS", "local,s3").split(",")
# The same machine on the Filesystem core (memory and local, no FUSE): a bigger budget, fast tier.
CORE_EXAMPLES = int(os.environ.get("MARINFS_MODEL_CORE_EXAMPLES", "30"))
CORE_STEPS = int(os.environ.get("MARINFS_MODEL_CORE_STEPS", "50"))
RANDOM = os.environ.get("MARINFS_MODEL_RANDOM", "") not in ("", "0")  # soak: fresh seeds each run
REMOUNT_EVERY = 8  # at most one remount or crash per this many steps: each costs a daemon start

NAMES = ("a", "b", "c")  # few names: collisions make the interesting errnos
FLAGS = {
    "r": os.O_RDONLY,
    "w+trunc": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "rw+creat": os.O_RDWR | os.O_CREAT,
    "rw": os.O_RDWR,
    "append": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "excl": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "rw+trunc": os.O_RDWR | os.O_TRUNC,
}

names = st.sampled_from(NAMES)
# Mostly shallow paths; rules also draw existing ones (MountVersusModel.where).
paths = st.one_of(names, names, st.lists(names, min_size=2, max_size=2).map("/".join),
                  st.lists(names, min_size=3, max_size=3).map("/".join))
offsets = st.one_of(st.integers(0, 16), st.sampled_from([CHUNK - 1, CHUNK, 2 * CHUNK + 5]),
                    st.integers(0, 3 * CHUNK))
lengths = st.one_of(st.integers(0, 16), st.sampled_from([4096, CHUNK, CHUNK + 1]), st.integers(0, 3 * CHUNK))
blobs = st.builds(lambda seed, n: random.Random(seed).randbytes(n), st.integers(0, 1 << 30),
                  st.one_of(st.integers(0, 64), st.sampled_from([4096, CHUNK + 3]), st.integers(0, 2 * CHUNK)))
fd_slots = st.integers(0, 7)
modes = st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o4755, 0o1777, 0o640])
owners = st.sampled_from([-1, 0, 1000, 65534])
mtimes = st.one_of(st.integers(0, 2**33 * 10**9), st.sampled_from([1_577_923_200_000_000_000, 1_500_000_000_123_456_789]))
xattr_names = st.sampled_from(["user.a", "user.b"])
xattr_values = st.sampled_from([b"", b"1", b"\x00\xff", b"v" * 300])
xattr_flags = st.sampled_from([0, os.XATTR_CREATE, os.XATTR_REPLACE])
# Links have names of their own, which ``paths`` and ``where`` never produce: no rule but the link
# rules meets a link, so no path goes through one (the kernel would resolve it on the mount; the
# core, like marinfs, never follows links). Their targets are compared as text, never traversed.
LINK_NAMES = ("l", "m")
link_names = st.sampled_from(LINK_NAMES)
link_targets = st.sampled_from(["a", "b", "a/b", "../c", "../a/b", "nowhere", "../../x/y", ".", "l", "c/"])
FALLOC_FL_KEEP_SIZE = 0x01  # linux/falloc.h
fallocate_modes = st.sampled_from([0, FALLOC_FL_KEEP_SIZE])
falloc_lengths = st.one_of(st.integers(1, 16), st.sampled_from([4096, CHUNK + 1]))
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
UMASK = os.umask(0o022)
os.umask(UMASK)
AS_ROOT = os.geteuid() == 0  # chown needs it on the model


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """('ok', value) or ('err', errno name): what a syscall did, comparable across filesystems."""
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno or 0, str(exc.errno)))


def describe(tree: dict[str, Any]) -> dict[str, Any]:
    """A readable form of a snapshot for assertion messages (sizes and a digest, not bytes)."""
    import hashlib

    return {k: v if v[0] in ("dir", "link") else (v[0], hashlib.sha1(v[1]).hexdigest()[:8], v[2]) for k, v in tree.items()}


# -- drivers: the POSIX calls the rules make, on a directory or on the Filesystem core -----------
class Driver:
    """The calls the state machine makes, by path relative to the driver's root or by handle.
    Each raises OSError with the errno a process would see."""

    def open(self, path: str, flags: int) -> Any: raise NotImplementedError
    def close(self, h: Any) -> None: raise NotImplementedError
    def pread(self, h: Any, size: int, offset: int) -> bytes: raise NotImplementedError
    def pwrite(self, h: Any, data: bytes, offset: int) -> int: raise NotImplementedError
    def append(self, h: Any, data: bytes) -> int: raise NotImplementedError
    def ftruncate(self, h: Any, length: int) -> None: raise NotImplementedError
    def fsync(self, h: Any) -> None: raise NotImplementedError
    def truncate(self, path: str, length: int) -> None: raise NotImplementedError
    def mkdir(self, path: str) -> None: raise NotImplementedError
    def rmdir(self, path: str) -> None: raise NotImplementedError
    def unlink(self, path: str) -> None: raise NotImplementedError
    def rename(self, src: str, dst: str) -> None: raise NotImplementedError
    def stat(self, path: str) -> tuple[str, int]: raise NotImplementedError  # ("dir", 0) or ("file", size)
    def is_link(self, path: str) -> bool: raise NotImplementedError  # lstat(2)'s type, no link followed
    def symlink(self, target: str, path: str) -> None: raise NotImplementedError
    def readlink(self, path: str) -> str: raise NotImplementedError
    def fallocate(self, h: Any, mode: int, offset: int, length: int) -> None: raise NotImplementedError
    def listdir(self, path: str) -> list[str]: raise NotImplementedError
    # What marinfs persists: (mode & 0o7777, uid, gid, {user.* name: value}), and the mtime.
    def meta(self, path: str) -> tuple[int, int, int, dict[str, bytes]]: raise NotImplementedError
    def mtime_ns(self, path: str) -> int: raise NotImplementedError
    def chmod(self, path: str, mode: int) -> None: raise NotImplementedError
    def chown(self, path: str, uid: int, gid: int) -> None: raise NotImplementedError
    def utime(self, path: str, mtime_ns: int) -> None: raise NotImplementedError
    def setxattr(self, path: str, name: str, value: bytes, flags: int) -> None: raise NotImplementedError
    def getxattr(self, path: str, name: str) -> bytes: raise NotImplementedError
    def listxattr(self, path: str) -> list[str]: raise NotImplementedError
    def removexattr(self, path: str, name: str) -> None: raise NotImplementedError

    def read_file(self, path: str) -> bytes:
        h = self.open(path, os.O_RDONLY)
        try:
            out = bytearray()
            while chunk := self.pread(h, 1 << 20, len(out)):
                out += chunk
            return bytes(out)
        finally:
            self.close(h)

    def write_file(self, path: str, data: bytes) -> None:
        h = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self.pwrite(h, data, 0)
        finally:
            self.close(h)

    def snapshot(self, root: str) -> dict[str, Any]:
        """Every entry below ``root``: directories as 'dir', files as (size, bytes), links as
        ('link', target). Raises on any error, unlike os.walk, which would hide one."""
        out: dict[str, Any] = {}

        def walk(rel: str) -> None:
            for entry in sorted(self.listdir(f"{root}/{rel}" if rel else root)):
                name = f"{rel}/{entry}" if rel else entry
                if self.is_link(f"{root}/{name}"):
                    out[name] = ("link", self.readlink(f"{root}/{name}"))
                    continue
                kind, size = self.stat(f"{root}/{name}")
                meta = self.meta(f"{root}/{name}")
                if kind == "dir":
                    out[name] = ("dir", meta)
                    walk(name)
                else:
                    out[name] = (size, self.read_file(f"{root}/{name}"), meta)

        walk("")
        return out


class OsDriver(Driver):
    """os.* below a directory: the model (a local disk), or a mount of marinfs."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def open(self, path: str, flags: int) -> int:
        return os.open(self.base / path, flags, 0o644)

    def close(self, h: int) -> None:
        os.close(h)

    def pread(self, h: int, size: int, offset: int) -> bytes:
        return os.pread(h, size, offset)

    def pwrite(self, h: int, data: bytes, offset: int) -> int:
        return os.pwrite(h, data, offset)

    def append(self, h: int, data: bytes) -> int:
        return os.write(h, data)

    def ftruncate(self, h: int, length: int) -> None:
        os.ftruncate(h, length)

    def fsync(self, h: int) -> None:
        os.fsync(h)

    def truncate(self, path: str, length: int) -> None:
        os.truncate(self.base / path, length)

    def mkdir(self, path: str) -> None:
        os.mkdir(self.base / path)

    def rmdir(self, path: str) -> None:
        os.rmdir(self.base / path)

    def unlink(self, path: str) -> None:
        os.unlink(self.base / path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.base / src, self.base / dst)

    def stat(self, path: str) -> tuple[str, int]:
        s = os.stat(self.base / path)
        return ("dir", 0) if stat.S_ISDIR(s.st_mode) else ("file", s.st_size)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(self.base / path)

    def is_link(self, path: str) -> bool:
        return stat.S_ISLNK(os.lstat(self.base / path).st_mode)

    def symlink(self, target: str, path: str) -> None:
        os.symlink(target, self.base / path)

    def readlink(self, path: str) -> str:
        return os.readlink(self.base / path)

    def fallocate(self, h: int, mode: int, offset: int, length: int) -> None:
        if mode == 0:
            os.posix_fallocate(h, offset, length)
        elif _libc.fallocate(h, mode, offset, length) != 0:  # KEEP_SIZE: not in the os module
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    def meta(self, path: str) -> tuple[int, int, int, dict[str, bytes]]:
        s = os.stat(self.base / path)
        return (stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid,
                {n: os.getxattr(self.base / path, n) for n in sorted(os.listxattr(self.base / path))})

    def mtime_ns(self, path: str) -> int:
        return os.stat(self.base / path).st_mtime_ns

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self.base / path, mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self.base / path, uid, gid)

    def utime(self, path: str, mtime_ns: int) -> None:
        os.utime(self.base / path, ns=(mtime_ns, mtime_ns))

    def setxattr(self, path: str, name: str, value: bytes, flags: int) -> None:
        os.setxattr(self.base / path, name, value, flags)

    def getxattr(self, path: str, name: str) -> bytes:
        return os.getxattr(self.base / path, name)

    def listxattr(self, path: str) -> list[str]:
        return sorted(os.listxattr(self.base / path))

    def removexattr(self, path: str, name: str) -> None:
        os.removexattr(self.base / path, name)


@dataclass
class CoreHandle:
    """A descriptor of FsDriver: the Filesystem handle plus what the kernel's VFS keeps."""

    fh: int | None  # None for a directory opened read-only (the kernel's opendir)
    flags: int
    path: str
    generation: int  # the Filesystem it belongs to; one that crashed answers ENOTCONN


class FsDriver(Driver):
    """marinfs.core.Filesystem called as fuse_ops.FuseAdapter calls it, plus what the kernel does
    before a call reaches FUSE: the lookup of every path component (ENOENT, ENOTDIR), the
    access mode of a descriptor (EBADF, EINVAL), O_EXCL and directories at open, flush then
    release at close, and zero-length reads and writes answered without a request."""

    def __init__(self, target: CoreTarget) -> None:
        self.target = target

    @property
    def fs(self) -> Any:
        return self.target.fs

    def _walk(self, path: str) -> None:
        """Look up every parent, as the kernel does before any call on ``path``."""
        parts = path.split("/")
        for i in range(1, len(parts)):
            if self.fs.getattr("/" + "/".join(parts[:i])).is_dir is False:
                raise OSError(errno.ENOTDIR, "not a directory", path)

    def _lookup(self, path: str) -> Any:
        self._walk(path)
        return self.fs.getattr("/" + path)

    def _live(self, h: CoreHandle) -> CoreHandle:
        if h.generation != self.target.generation:
            raise OSError(errno.ENOTCONN, "the filesystem that opened it is gone")
        return h

    def open(self, path: str, flags: int) -> CoreHandle:
        self._walk(path)
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        try:
            info = self.fs.getattr("/" + path)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            return CoreHandle(self.fs.create("/" + path, flags, 0o644 & ~UMASK).fh, flags, path, self.target.generation)
        if flags & os.O_CREAT and flags & os.O_EXCL:
            raise OSError(errno.EEXIST, "exists", path)
        if info.is_dir:
            if writable or flags & os.O_CREAT:
                raise OSError(errno.EISDIR, "is a directory", path)
            return CoreHandle(None, flags, path, self.target.generation)
        fh = self.fs.open("/" + path, flags & ~(os.O_CREAT | os.O_EXCL)).fh
        return CoreHandle(fh, flags, path, self.target.generation)

    def close(self, h: CoreHandle) -> None:
        self._live(h)
        if h.fh is None:
            return
        try:
            self.fs.flush(h.fh)  # close(2) returns flush's error; release cannot report one
        finally:
            self.fs.release(h.fh)

    def pread(self, h: CoreHandle, size: int, offset: int) -> bytes:
        self._live(h)
        if h.fh is None:
            raise OSError(errno.EISDIR, "is a directory")
        if h.flags & os.O_ACCMODE == os.O_WRONLY:
            raise OSError(errno.EBADF, "not open for reading")
        return self.fs.read(h.fh, size, offset) if size else b""

    def _writable(self, h: CoreHandle) -> int:
        self._live(h)
        if h.fh is None or h.flags & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "not open for writing")
        return h.fh

    def pwrite(self, h: CoreHandle, data: bytes, offset: int) -> int:
        fh = self._writable(h)
        return self.fs.write(fh, data, offset) if data else 0

    def append(self, h: CoreHandle, data: bytes) -> int:
        fh = self._writable(h)
        return self.fs.write(fh, data, 0) if data else 0  # O_APPEND: the handle writes at its end

    def ftruncate(self, h: CoreHandle, length: int) -> None:
        self._live(h)
        if h.fh is None or h.flags & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EINVAL, "not open for writing")
        self.fs.truncate("/" + h.path, length, h.fh)

    def fsync(self, h: CoreHandle) -> None:
        self._live(h)
        if h.fh is not None:
            self.fs.fsync(h.fh)

    def fallocate(self, h: CoreHandle, mode: int, offset: int, length: int) -> None:
        fh = self._writable(h)  # the VFS answers EBADF for a descriptor not open for writing
        self.fs.fallocate(fh, mode, offset, length)

    def truncate(self, path: str, length: int) -> None:
        if self._lookup(path).is_dir:
            raise OSError(errno.EISDIR, "is a directory", path)
        self.fs.truncate("/" + path, length)

    def mkdir(self, path: str) -> None:
        self._walk(path)
        self.fs.mkdir("/" + path, 0o777 & ~UMASK)

    def rmdir(self, path: str) -> None:
        self._walk(path)
        self.fs.rmdir("/" + path)

    def unlink(self, path: str) -> None:
        self._walk(path)
        self.fs.unlink("/" + path)

    def rename(self, src: str, dst: str) -> None:
        self._walk(src)  # both parents first, then the source itself, as the VFS does
        self._walk(dst)
        self.fs.getattr("/" + src)
        # The VFS checks these (lock_rename's trap) before the rename reaches FUSE.
        if dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, "into itself", dst)
        if src.startswith(dst + "/"):
            raise OSError(errno.ENOTEMPTY, "onto an ancestor", dst)
        self.fs.rename("/" + src, "/" + dst)

    def stat(self, path: str) -> tuple[str, int]:
        info = self._lookup(path)
        return ("dir", 0) if info.is_dir else ("file", info.size)

    def listdir(self, path: str) -> list[str]:
        self._walk(path)
        return [posixpath.basename(info.name) for info in self.fs.readdir("/" + path)]

    def is_link(self, path: str) -> bool:
        return bool(self._lookup(path).link)

    def symlink(self, target: str, path: str) -> None:
        self._walk(path)
        self.fs.symlink(target, "/" + path)

    def readlink(self, path: str) -> str:
        self._walk(path)  # the VFS answers EINVAL for a non-link itself; the core does the same
        return self.fs.readlink("/" + path)

    def meta(self, path: str) -> tuple[int, int, int, dict[str, bytes]]:
        """What FuseAdapter.attrs shows: stored values, else the mount's defaults."""
        info = self._lookup(path)
        posix = info.posix
        mode = self.fs.defaults.dir_mode if info.is_dir else self.fs.defaults.file_mode
        uid, gid = self.fs.defaults.uid, self.fs.defaults.gid
        if posix is not None:
            mode = mode if posix.mode is None else posix.mode
            uid = uid if posix.uid is None else posix.uid
            gid = gid if posix.gid is None else posix.gid
        return mode, uid, gid, {n: self.fs.getxattr("/" + path, n) for n in self.fs.listxattr("/" + path)}

    def mtime_ns(self, path: str) -> int:
        info = self._lookup(path)
        return info.posix.mtime_ns if info.posix is not None and info.posix.mtime_ns is not None else info.mtime_ns

    def chmod(self, path: str, mode: int) -> None:
        self._lookup(path)
        self.fs.set_attributes("/" + path, mode=mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        self._lookup(path)
        self.fs.set_attributes("/" + path, uid=None if uid == -1 else uid, gid=None if gid == -1 else gid)

    def utime(self, path: str, mtime_ns: int) -> None:
        self._lookup(path)
        self.fs.set_attributes("/" + path, mtime_ns=mtime_ns)

    def setxattr(self, path: str, name: str, value: bytes, flags: int) -> None:
        self._lookup(path)
        self.fs.setxattr("/" + path, name, value, flags)

    def getxattr(self, path: str, name: str) -> bytes:
        self._lookup(path)
        return self.fs.getxattr("/" + path, name)

    def listxattr(self, path: str) -> list[str]:
        self._lookup(path)
        return sorted(self.fs.listxattr("/" + path))

    def removexattr(self, path: str, name: str) -> None:
        self._lookup(path)
        self.fs.removexattr("/" + path, name)


# -- what is under test: a mount, or the Filesystem core ----------------------------------------
@dataclass
class Target:
    """One mount that the state machine may unmount, remount or kill; always torn down."""

    backend: str
    url: str
    mnt: Path
    cache: Path
    env: dict[str, str]
    _stack: contextlib.ExitStack | None = None
    pid: int | None = None
    mounts: int = 0
    crashes: int = 0

    @property
    def killable(self) -> bool:
        return self.backend != "memory"  # memory:// lives in this process: no daemon to kill

    def driver(self) -> Driver:
        return OsDriver(self.mnt)

    def mount(self) -> None:
        assert self._stack is None
        stack = contextlib.ExitStack()
        try:
            if self.backend == "memory":
                stack.enter_context(inprocess_mount(self.url, self.mnt, self.cache, chunk_size=CHUNK,
                                                    cache_size=64 << 20))
                self.pid = None
            else:
                self.pid = stack.enter_context(subprocess_mount(
                    self.url, self.mnt, self.cache, "--chunk-size", str(CHUNK), "--cache-size", "64M",
                    "--cache-min-free", "0", env=self.env))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self.mounts += 1

    def unmount(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def kill(self) -> None:
        """SIGKILL the daemon: no flush, no drain, no unmount."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{self.pid}").exists():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        self.crashes += 1


@dataclass
class CoreTarget:
    """A Filesystem over a Remote, started as the daemon starts one (journals replayed first);
    "unmount" is close_all, "kill" abandons it with its files open and staged."""

    backend: str
    remote: Any
    cache_dir: Path
    fs: Any = None
    cache: Any = None
    generation: int = 0
    mounts: int = 0
    crashes: int = 0
    killable: bool = True
    dead: list[Any] = field(default_factory=list)  # crashed ones, kept until the test ends

    def driver(self) -> Driver:
        return FsDriver(self)

    def mount(self) -> None:
        """As the daemon starts: the chunk cache of the same directory, journals replayed."""
        from marinfs.read.chunkcache import ChunkCache
        from marinfs.core import Filesystem
        from marinfs.read.reader import ChunkFetcher
        from marinfs.write.recovery import recover

        assert self.fs is None
        self.cache = ChunkCache(self.cache_dir, 64 << 20)
        recover(self.cache_dir / "staging", self.remote)
        self.fs = Filesystem(self.remote, staging_dir=self.cache_dir / "staging",
                             fetcher=ChunkFetcher(self.remote.read_range, self.cache, chunk_size=CHUNK))
        self.fs.send_kept_attributes()  # (after the commits, as the daemon does)
        self.generation += 1
        self.mounts += 1

    def _stop(self) -> None:
        self.fs.fetcher.close()
        self.cache.close()
        self.fs = self.cache = None
        self.generation += 1

    def unmount(self) -> None:
        if self.fs is not None:
            self.fs.close_all()
            self._stop()

    def kill(self) -> None:
        """What dies with the process: threads and the cache lock. The staged files, their
        journals and the chunks on disk stay; the dead Filesystem is never called again."""
        self.fs.deferred.stop()  # (its thread sending attributes held back dies too)
        self.dead.append(self.fs)
        self._stop()
        self.crashes += 1

    def close(self) -> None:
        self.unmount()


@pytest.fixture(params=BACKENDS)
@tiers.needs("mount")
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    backend = request.param
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    env: dict[str, str] = {}
    if backend == "local":
        (tmp_path / "remote").mkdir()
        url = str(tmp_path / "remote")
    elif backend == "memory":
        url = f"memory://model-{uuid.uuid4().hex[:12]}"
        fs, root = fsspec_client(url)
        fs.mkdir(root)
    else:
        url, _, env = object_store(request, backend)
    t = Target(backend, url, mnt, cache, env)
    t.mount()
    try:
        yield t
    finally:
        try:
            t.unmount()
        finally:  # even when a timeout interrupted the unmount itself
            force_unmount(mnt)
            if t.pid is not None and daemon_of(t.pid, mnt):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(t.pid, signal.SIGKILL)


@pytest.fixture
@tiers.needs("core")
def core_target(remote: Any, tmp_path: Path) -> Iterator[CoreTarget]:
    """The Filesystem core over conftest's memory and local remotes."""
    t = CoreTarget("memory" if remote.url.startswith("memory://") else "local", remote, tmp_path / "cache")
    t.mount()
    try:
        yield t
    finally:
        t.close()


def daemon_of(pid: int, mnt: Path) -> bool:
    """Whether ``pid`` still is the marinfs daemon we started for ``mnt`` (not a reused PID)."""
    try:
        return str(mnt).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# -- the state machine -------------------------------------------------------------------------
@dataclass
class OpenFile:
    path: str  # where it was opened (files may be renamed or unlinked while open)
    flags: int
    model: int  # the descriptor on the model
    mount: Any  # the descriptor (or core handle) on the filesystem under test
    # Bytes the file had at open: a read-only handle may keep serving the version it opened
    # (docs/semantics.md: "no mixed versions") once the file changed under it.
    opened: bytes | None = None
    history: list[bytes] = field(default_factory=list)

    @property
    def writable(self) -> bool:
        return self.flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


class Counters:
    examples = 0
    steps = 0
    remounts = 0
    crashes = 0
    errnos: dict[str, int] = {}


def make_machine(target: Target | CoreTarget, model_base: Path, counters: Counters) -> type[RuleBasedStateMachine]:
    """The rules, for either target: the model is always os.* on a local directory; the
    other side is ``target.driver()`` (os.* on the mount, or the Filesystem core's calls)."""
    model_driver = OsDriver(model_base)
    target_driver = target.driver()

    class MountVersusModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.files: list[OpenFile] = []
            self.since_remount = 0
            self.root = ""

        # -- helpers -------------------------------------------------------------------------
        @property
        def m(self) -> Path:
            return model_base / self.root

        def at(self, path: str) -> str:
            return f"{self.root}/{path}" if path else self.root

        def both(self, op: Callable[[Driver, str], Any], path: str) -> tuple[tuple[str, Any], tuple[str, Any]]:
            return (outcome(lambda: op(model_driver, self.at(path))),
                    outcome(lambda: op(target_driver, self.at(path))))

        def agree(self, what: str, model: tuple[str, Any], mount: tuple[str, Any]) -> None:
            outcome_name = model[1] if model[0] == "err" else "ok"
            counters.errnos[outcome_name] = counters.errnos.get(outcome_name, 0) + 1
            if os.environ.get("MARINFS_MODEL_TRACE"):
                print(what.split("(")[0].split(" ")[0], outcome_name)
            assert mount == model, f"{what}: model {model}, mount {mount}"

        def where(self, data: st.DataObject) -> str:
            """A path: often one that exists, or a name inside an existing directory, so that calls
            meet files and directories rather than ENOENT."""
            existing = sorted(str(p.relative_to(self.m)) for p in self.m.rglob("*") if not p.is_symlink())
            choices = [paths]
            if existing:
                there = st.sampled_from(existing)
                choices += [there, there, st.tuples(there, names).map("/".join)]
            return data.draw(st.one_of(*choices), label="path")

        def where_link(self, data: st.DataObject) -> str:
            """A path for the link rules: an existing link, a link name in an existing directory
            (or in a path that is not one), or any path ``where`` draws (files, directories)."""
            links = sorted(str(p.relative_to(self.m)) for p in self.m.rglob("*") if p.is_symlink())
            dirs = [""] + sorted(str(p.relative_to(self.m)) for p in self.m.rglob("*")
                                 if p.is_dir() and not p.is_symlink())
            how = data.draw(st.sampled_from(["in a directory"] * 3 + ["anywhere", "below a path"]
                                            + ["a link"] * bool(links)), label="link path")
            if how == "anywhere":
                return self.where(data)
            if how == "a link":
                return data.draw(st.sampled_from(links), label="link")
            parent = data.draw(st.sampled_from(dirs) if how == "in a directory" else paths, label="in")
            return posixpath.join(parent, data.draw(link_names, label="name"))

        def pick(self, slot: int) -> OpenFile | None:
            return self.files[slot % len(self.files)] if self.files else None

        def note_change(self) -> None:
            """Record what each read-only descriptor's file holds now: the versions it may serve."""
            for f in self.files:
                if not f.writable and f.opened is not None:
                    now = self.read_model_inode(f)
                    if now is not None and (not f.history or f.history[-1] != now):
                        f.history.append(now)

        def read_model_inode(self, f: OpenFile) -> bytes | None:
            try:
                fd = os.open(f"/proc/self/fd/{f.model}", os.O_RDONLY)
            except OSError:
                return None
            try:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    return None
                size = os.fstat(fd).st_size
                return os.pread(fd, size, 0) if size else b""
            finally:
                os.close(fd)

        # -- setup ---------------------------------------------------------------------------
        @initialize()
        def fresh_root(self) -> None:
            counters.examples += 1
            self.root = f"ex-{uuid.uuid4().hex[:8]}"
            seed = random.Random(counters.examples).randbytes(CHUNK + 100)
            for d in (model_driver, target_driver):  # something to meet: a directory, a file in it, a file
                d.mkdir(self.root)
                d.mkdir(self.at("a"))
                d.write_file(self.at("a/b"), seed)
                d.write_file(self.at("c"), seed[:10])

        def teardown(self) -> None:
            for f in self.files:
                with contextlib.suppress(OSError):
                    model_driver.close(f.model)
                with contextlib.suppress(OSError):
                    target_driver.close(f.mount)
            self.files.clear()

        # -- descriptors ---------------------------------------------------------------------
        @rule(data=st.data(), how=st.sampled_from(sorted(FLAGS)))
        def open(self, data: st.DataObject, how: str) -> None:
            self.open_path(self.where(data), how)

        def open_path(self, path: str, how: str) -> None:
            flags = FLAGS[how]
            model, mount = self.both(lambda d, p: d.open(p, flags), path)
            if model[0] == "ok" and mount[0] == "ok":
                f = OpenFile(path, flags, model[1], mount[1])
                if not f.writable:
                    f.opened = self.read_model_inode(f)
                    f.history = [f.opened] if f.opened is not None else []
                self.files.append(f)
                self.note_change()
                self.agree(f"open({path!r}, {how})", ("ok", None), ("ok", None))  # (counted)
                return
            for side, d in ((model, model_driver), (mount, target_driver)):  # one side opened: close it
                if side[0] == "ok":
                    d.close(side[1])
            self.agree(f"open({path!r}, {how})", model, mount)

        def handle(self, slot: int, data: st.DataObject) -> OpenFile | None:
            """An open file for a descriptor call; when none is open, open one first (so that
            descriptor calls stay frequent whatever rules hypothesis picks)."""
            if not self.files:
                how = data.draw(st.sampled_from(["rw+creat", "rw", "append", "w+trunc", "r"]), label="open")
                self.open_path(self.where(data), how)
            return self.pick(slot)

        def on_fd(self, f: OpenFile, op: Callable[[Driver, Any], Any]) -> tuple[tuple[str, Any], tuple[str, Any]]:
            return outcome(lambda: op(model_driver, f.model)), outcome(lambda: op(target_driver, f.mount))

        @rule(slot=fd_slots, blob=blobs, offset=offsets, data=st.data())
        def write(self, slot: int, blob: bytes, offset: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            if f.flags & os.O_APPEND:
                model, mount = self.on_fd(f, lambda d, h: d.append(h, blob))
            else:
                model, mount = self.on_fd(f, lambda d, h: d.pwrite(h, blob, offset))
            self.agree(f"write {len(blob)} bytes at {offset} to {f.path!r}", model, mount)
            self.note_change()

        @rule(slot=fd_slots, offset=offsets, size=lengths, data=st.data())
        def read(self, slot: int, offset: int, size: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            model, mount = self.on_fd(f, lambda d, h: d.pread(h, size, offset))
            if mount != model and not f.writable and model[0] == "ok":
                # Documented: once its file changed, a read-only handle fails with ESTALE or
                # keeps serving one version it saw, never a mix (docs/semantics.md, Reading).
                if mount == ("err", "ESTALE") and len(f.history) > 1:
                    return
                if mount[0] == "ok" and any(mount[1] == v[offset:offset + size] for v in f.history):
                    return
            self.agree(f"pread({size}, {offset}) of {f.path!r} ({'rw' if f.writable else 'ro'})", model, mount)

        @rule(slot=fd_slots, length=lengths, data=st.data())
        def ftruncate(self, slot: int, length: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            model, mount = self.on_fd(f, lambda d, h: d.ftruncate(h, length))
            self.agree(f"ftruncate({f.path!r}, {length})", model, mount)
            self.note_change()

        @rule(slot=fd_slots, data=st.data())
        def fsync(self, slot: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            model, mount = self.on_fd(f, lambda d, h: d.fsync(h))
            self.agree(f"fsync({f.path!r})", model, mount)

        @rule(slot=fd_slots, mode=fallocate_modes, offset=st.integers(0, 32), length=falloc_lengths,
              data=st.data())
        def fallocate(self, slot: int, mode: int, offset: int, length: int, data: st.DataObject) -> None:
            """Mode 0 (posix_fallocate: zeros past the end) and KEEP_SIZE (reserves only)."""
            f = self.handle(slot, data)
            if f is None:
                return
            model, mount = self.on_fd(f, lambda d, h: d.fallocate(h, mode, offset, length))
            self.agree(f"fallocate({f.path!r}, {mode}, {offset}, {length})", model, mount)
            self.note_change()

        @precondition(lambda self: self.files)
        @rule(slot=fd_slots)
        def close(self, slot: int) -> None:
            f = self.pick(slot)
            assert f is not None
            self.files.remove(f)
            model, mount = self.on_fd(f, lambda d, h: d.close(h))  # close commits: it must report success
            self.agree(f"close({f.path!r})", model, mount)

        # -- paths ---------------------------------------------------------------------------
        @rule(data=st.data(), length=lengths)
        def truncate(self, data: st.DataObject, length: int) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.truncate(p, length), path)
            self.agree(f"truncate({path!r}, {length})", model, mount)
            self.note_change()

        @rule(data=st.data())
        def mkdir(self, data: st.DataObject) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.mkdir(p), path)
            self.agree(f"mkdir({path!r})", model, mount)

        @rule(data=st.data())
        def rmdir(self, data: st.DataObject) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.rmdir(p), path)
            self.agree(f"rmdir({path!r})", model, mount)

        @rule(data=st.data())
        def unlink(self, data: st.DataObject) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.unlink(p), path)
            self.agree(f"unlink({path!r})", model, mount)
            self.note_change()

        @rule(data=st.data())
        def rename(self, data: st.DataObject) -> None:
            src, dst = self.where(data), self.where(data)
            model, mount = self.both(lambda d, p: d.rename(p, self.at(dst)), src)
            self.agree(f"rename({src!r}, {dst!r})", model, mount)
            self.note_change()

        @rule(data=st.data())
        def look(self, data: st.DataObject) -> None:
            """stat and listdir (the tree itself is compared after every step anyway)."""
            path = "" if data.draw(st.booleans(), label="the root") else self.where(data)
            model, mount = self.both(lambda d, p: d.stat(p), path)
            self.agree(f"stat({path!r})", model, mount)
            model, mount = self.both(lambda d, p: sorted(d.listdir(p)), path)
            self.agree(f"listdir({path!r})", model, mount)

        # -- links: created, read and listed, never traversed (see LINK_NAMES) ----------------
        @rule(data=st.data(), to=link_targets)  # (``target`` is hypothesis's: a rule's bundle)
        def symlink(self, data: st.DataObject, to: str) -> None:
            path = self.where_link(data)
            model, mount = self.both(lambda d, p: d.symlink(to, p), path)
            self.agree(f"symlink({to!r}, {path!r})", model, mount)

        @rule(data=st.data())
        def readlink(self, data: st.DataObject) -> None:
            path = self.where_link(data)
            model, mount = self.both(lambda d, p: d.readlink(p), path)
            self.agree(f"readlink({path!r})", model, mount)

        # -- persisted attributes (the tree's comparison includes mode, owner and xattrs) ------
        @rule(data=st.data(), mode=modes)
        def chmod(self, data: st.DataObject, mode: int) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.chmod(p, mode), path)
            self.agree(f"chmod({path!r}, {mode:o})", model, mount)

        @precondition(lambda self: AS_ROOT)
        @rule(data=st.data(), uid=owners, gid=owners)
        def chown(self, data: st.DataObject, uid: int, gid: int) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.chown(p, uid, gid), path)
            self.agree(f"chown({path!r}, {uid}, {gid})", model, mount)

        @rule(data=st.data(), mtime=mtimes)
        def utime(self, data: st.DataObject, mtime: int) -> None:
            """The mtime is compared right after: a local disk moves it on every write (and a
            directory's on every entry), marinfs on writes only."""
            path = self.where(data)
            model, mount = self.both(lambda d, p: (d.utime(p, mtime), d.mtime_ns(p))[1], path)
            self.agree(f"utime({path!r}, {mtime})", model, mount)

        @rule(data=st.data(), name=xattr_names, value=xattr_values, flags=xattr_flags)
        def setxattr(self, data: st.DataObject, name: str, value: bytes, flags: int) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.setxattr(p, name, value, flags), path)
            self.agree(f"setxattr({path!r}, {name}, {len(value)} bytes, {flags})", model, mount)

        @rule(data=st.data(), name=xattr_names)
        def xattrs(self, data: st.DataObject, name: str) -> None:
            path = self.where(data)
            for what, op in (("getxattr", lambda d, p: d.getxattr(p, name)), ("listxattr", lambda d, p: d.listxattr(p))):
                model, mount = self.both(op, path)
                self.agree(f"{what}({path!r}, {name})", model, mount)

        @rule(data=st.data(), name=xattr_names)
        def removexattr(self, data: st.DataObject, name: str) -> None:
            path = self.where(data)
            model, mount = self.both(lambda d, p: d.removexattr(p, name), path)
            self.agree(f"removexattr({path!r}, {name})", model, mount)

        # -- the daemon ----------------------------------------------------------------------
        @precondition(lambda self: self.since_remount >= REMOUNT_EVERY)
        @rule()
        def remount(self) -> None:
            """Close everything, unmount, mount again over the same cache directory."""
            for f in list(self.files):
                self.close(self.files.index(f))
            target.unmount()
            target.mount()
            self.since_remount = 0
            counters.remounts += 1

        @precondition(lambda self: target.killable and self.since_remount >= REMOUNT_EVERY)
        @rule()
        def crash(self) -> None:
            """SIGKILL the daemon with files open; a new daemon commits what they held
            (docs/semantics.md, Durability: "as they stood").

            Not compared: attributes set less than the directory record's 0.2 s window before
            the kill (documented: the object has them, listings show the defaults until a stat
            of the file repairs the record), so object stores get that window first."""
            if target.backend in ("s3", "gcs"):
                time.sleep(0.5)
            target.kill()
            for f in self.files:
                model_driver.close(f.model)
                with contextlib.suppress(OSError):
                    target_driver.close(f.mount)  # the dead mount answers ENOTCONN
            self.files.clear()
            target.unmount()
            target.mount()
            self.since_remount = 0
            counters.crashes += 1

        # -- after every step ----------------------------------------------------------------
        @invariant()
        def same_tree(self) -> None:
            if not self.root:
                return
            counters.steps += 1
            self.since_remount += 1
            model = model_driver.snapshot(self.root)
            mount = target_driver.snapshot(self.root)
            if mount != model:
                assert describe(mount) == describe(model), "tree differs"
                assert mount == model, "tree differs"

    return MountVersusModel


def run_model(target: Target | CoreTarget, tmp_path: Path, capsys: pytest.CaptureFixture[str],
              examples: int, steps: int, what: str) -> Counters:
    model_base = tmp_path / "model"
    model_base.mkdir()
    counters = Counters()
    counters.errnos = {}
    machine = make_machine(target, model_base, counters)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if RANDOM else [])
    started = time.monotonic()
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
            derandomize=not RANDOM, phases=phases, suppress_health_check=list(HealthCheck),
            print_blob=True))
    finally:
        took = time.monotonic() - started
        with capsys.disabled():
            print(f"\n{what}[{target.backend}]: {counters.examples} examples, {counters.steps} steps "
                  f"({counters.steps / max(took, 1e-9):.0f}/s), {target.mounts - 1} remounts "
                  f"({target.crashes} after a crash), outcomes compared "
                  f"{dict(sorted(counters.errnos.items()))}, {took:.1f} s")
    return counters


def test_mount_agrees_with_a_local_directory(target: Target, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run_model(target, tmp_path, capsys, EXAMPLES, STEPS, "model")


def test_filesystem_agrees_with_a_local_directory(core_target: CoreTarget, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The same rules on the Filesystem core, no FUSE: many more steps in the same time."""
    counters = run_model(core_target, tmp_path, capsys, CORE_EXAMPLES, CORE_STEPS, "model-core")
    assert counters.steps >= CORE_EXAMPLES  # it ran (a broken setup would run nothing)


# -- sequences the state machine found, replayed as plain tests on every backend ------------------
def remote_names(mounted: Any) -> list[str]:
    """Every object below the prefix, as another client sees them."""
    try:
        found = remote_find(mounted.fs, mounted.root, withdirs=True)
    except FileNotFoundError:
        return []
    return sorted(p[len(mounted.root) + 1:] for p in found if p.rstrip("/") != mounted.root)


def test_unlinking_an_open_file_leaves_no_hidden_file(mounted: Any) -> None:
    """open(O_APPEND|O_CREAT); unlink; -> the mount listed (and uploaded) a .fuse_hidden* file:
    libfuse renames an open file on unlink unless told hard_remove."""
    fd = os.open(mounted.mnt / "a", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"before")
        os.unlink(mounted.mnt / "a")
        assert os.listdir(mounted.mnt) == []
        os.write(fd, b" after")  # an unlinked file stays usable through its descriptor
        assert os.pread(fd, 100, 0) == b"before after"
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.listdir(mounted.mnt) == []
    assert remote_names(mounted) == []


def store(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> tuple[str, dict[str, str], Any, str]:
    """(URL of a fresh prefix, the daemon's environment, a direct client, its root path)."""
    if backend == "local":
        (tmp_path / "remote").mkdir()
        url, env = str(tmp_path / "remote"), {}
        client, root = fsspec_client(url)
    else:
        url, options, env = object_store(request, backend)
        client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    return url, env, client, root


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_a_file_unlinked_or_replaced_while_open_stays_gone_after_a_crash(
        request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    """open; write; unlink; SIGKILL -> the next daemon committed the unlinked file again: its
    journal outlived the name."""
    url, env, client, root = store(request, backend, tmp_path)
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with subprocess_mount(url, mnt, cache, env=env) as pid:
        gone = os.open(mnt / "gone", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(gone, b"unlinked while open")
        os.unlink(mnt / "gone")
        replaced = os.open(mnt / "replaced", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(replaced, b"replaced while open")
        (mnt / "new").write_bytes(b"the new file")
        os.rename(mnt / "new", mnt / "replaced")
        os.kill(pid, signal.SIGKILL)
        for fd in (gone, replaced):
            with contextlib.suppress(OSError):
                os.close(fd)
    with subprocess_mount(url, mnt, cache, env=env):
        assert sorted(os.listdir(mnt)) == ["replaced"]
        assert (mnt / "replaced").read_bytes() == b"the new file"
    assert not staging_entries(cache / "staging", "*.journal.json")


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_bytes_written_after_an_fsync_are_recovered_in_place_after_a_crash(
        request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    """write; fsync; write; SIGKILL -> the next daemon saw the object at the version the fsync
    made, not the one the writer opened, called it a conflict and set the bytes aside."""
    url, env, client, root = store(request, backend, tmp_path)
    client.pipe_file(f"{root}/log", b"v1")
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with subprocess_mount(url, mnt, cache, env=env) as pid:
        fd = os.open(mnt / "log", os.O_WRONLY | os.O_APPEND)
        os.write(fd, b" fsynced")
        os.fsync(fd)
        assert bytes(client.cat_file(f"{root}/log")) == b"v1 fsynced"
        os.write(fd, b" then written")
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(fd)
    with subprocess_mount(url, mnt, cache, env=env):
        assert os.listdir(mnt) == ["log"]
        assert (mnt / "log").read_bytes() == b"v1 fsynced then written"


def test_an_open_file_keeps_its_bytes_after_unlink_or_replace(mounted: Any) -> None:
    """open(O_RDWR) (nothing read or written yet); unlink; ftruncate -> ENOENT: the staged file
    fetched the old bytes only when first needed, and by then the object was gone."""
    m = mounted.mnt
    for how in ("unlink", "replace"):
        (m / "f").write_bytes(b"old bytes")
        fd = os.open(m / "f", os.O_RDWR)
        try:
            if how == "unlink":
                os.unlink(m / "f")
            else:
                (m / "new").write_bytes(b"the new file")
                os.rename(m / "new", m / "f")
            os.ftruncate(fd, 6207)
            assert os.pread(fd, 9, 0) == b"old bytes"
            os.pwrite(fd, b"O", 0)
            assert os.pread(fd, 9, 0) == b"Old bytes" and len(os.pread(fd, 10_000, 0)) == 6207
            if how == "unlink":  # documented: libfuse has no name left to stat it by
                with pytest.raises(OSError) as info:
                    os.fstat(fd)
                assert info.value.errno == errno.ESTALE
        finally:
            os.close(fd)
        if how == "unlink":
            assert os.listdir(m) == [] and remote_names(mounted) == []
        else:
            assert os.listdir(m) == ["f"] and (m / "f").read_bytes() == b"the new file"
            assert mounted.remote_bytes("f") == b"the new file"
            os.unlink(m / "f")
