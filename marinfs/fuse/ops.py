"""The FUSE adapter: the only importer of the binding (mfusepy, fusepy's API, on libfuse3).

Each operation unpacks its arguments, calls :class:`marinfs.core.Filesystem`, and packs the
result. One decorator maps every exception to an errno through the table in errors.py; the
binding would otherwise answer EINVAL for anything that is not an OSError. Reads are the one
op that does not return its result: the filesystem writes it into libfuse's reply buffer
(``_Fuse.read``), so no ``bytes`` is made and copied again per read. Writes likewise hand the
filesystem a view of libfuse's request buffer (``_Fuse.write``), not a copy.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import itertools
import logging
import math
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

# mfusepy picks libfuse2 when libfuse.so.2 exists; we need libfuse3 (1 MiB requests), the newest
# one installed (3.17 and later can pass files through to the kernel).
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
from marinfs.fuse.libfuse import pick_libfuse  # noqa: E402

pick_libfuse()
import mfusepy as fuse  # noqa: E402

from marinfs import interrupts  # noqa: E402
from marinfs.errors import FsError, RemoteError, errno_for  # noqa: E402
from marinfs.core import Filesystem, Opened  # noqa: E402
from marinfs.objects import ObjectInfo  # noqa: E402
from marinfs.threadnames import set_os_name  # noqa: E402

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
LIBFUSE_MAJOR = fuse.fuse_version_major
FUSE_READDIR_PLUS = 1  # libfuse3 enum fuse_readdir_flags: the kernel asks for attributes too
FUSE_FILL_DIR_PLUS = 2  # libfuse3 enum fuse_fill_dir_flags: this entry's struct stat is complete
KERNEL_XATTR_PREFIXES = (b"security.", b"system.", b"trusted.")  # see _Fuse.getxattr
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2  # a timespec's tv_nsec in utimensat(2)
# FUSE passthrough (libfuse >= 3.17, Linux >= 6.9): a file opened with a backing id is read (and
# mapped) by the kernel from the local file registered under that id, without the daemon.
LIBFUSE_PASSTHROUGH = (fuse.fuse_version_major, fuse.fuse_version_minor) >= (3, 17)
# Interrupts (flush and fsync of a long commit, _interrupted): libfuse 3.14 marks every request
# the kernel interrupts; 3.17 does so only with the ``intr`` config set (set in init: a 3.14
# that reads it at fuse_new would signal threads with SIGUSR1 and no handler).
LIBFUSE_INTERRUPT_OPT_IN = (fuse.fuse_version_major, fuse.fuse_version_minor) >= (3, 17)
FUSE_CAP_PASSTHROUGH = 1 << 29  # fuse_common.h
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map {int32 fd; uint32 flags; uint64 padding})
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)
# struct fuse_file_info (3.17): flags, the bit fields, two paddings, fh, lock_owner, poll_events
# (uint32), then int32 backing_id. mfusepy declares poll_events as 64 bits, so no field of its
# struct names it: it is written at its offset.
FI_BACKING_ID_OFFSET = 36


class KernelBackings:
    """core.handles.Backings through /dev/fuse: the session's descriptor and its backing ioctls."""

    def __init__(self, session_fd: int) -> None:
        self.session_fd = session_fd
        self.closed = False  # the session is ending: its descriptor may be closed, its number reused

    def register(self, fd: int) -> int:
        if self.closed:
            raise OSError(errno.ENOTCONN, "the FUSE session is ending")
        return fcntl.ioctl(self.session_fd, FUSE_DEV_IOC_BACKING_OPEN, bytearray(struct.pack("=iIQ", fd, 0, 0)))

    def unregister(self, backing_id: int) -> None:
        if not self.closed:  # (else the kernel drops every id with the connection)
            fcntl.ioctl(self.session_fd, FUSE_DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("=I", backing_id)))


def _session_fd() -> int:
    """The /dev/fuse descriptor of the session serving this callback."""
    lib = fuse._libfuse
    lib.fuse_get_session.restype = ctypes.c_void_p
    lib.fuse_get_session.argtypes = [ctypes.c_void_p]
    lib.fuse_session_fd.restype = ctypes.c_int
    lib.fuse_session_fd.argtypes = [ctypes.c_void_p]
    return lib.fuse_session_fd(lib.fuse_get_session(lib.fuse_get_context().contents.fuse))


def _invalidate_path(path: str) -> None:
    """Have the kernel drop the attributes and pages it holds of ``path``'s inode, so it asks
    again (fuse_invalidate_path: FUSE_NOTIFY_INVAL_INODE). Only from an operation the kernel does
    not wait on with the inode's locks held (not getattr, read, write, setattr, lookup)."""
    lib = fuse._libfuse
    if lib.fuse_invalidate_path.argtypes is None:
        lib.fuse_invalidate_path.restype = ctypes.c_int
        lib.fuse_invalidate_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    code = lib.fuse_invalidate_path(lib.fuse_get_context().contents.fuse, os.fsencode(path))
    if code:
        log.debug("invalidating %s in the kernel: %s", path, os.strerror(-code))


def _interrupted() -> bool:
    """Whether the kernel interrupted the request this thread serves (its caller got a signal):
    libfuse marks the request when FUSE_INTERRUPT for it arrives, before or while it runs."""
    return bool(_fuse_interrupted())


_fuse_interrupted = fuse._libfuse.fuse_interrupted
_fuse_interrupted.restype, _fuse_interrupted.argtypes = ctypes.c_int, []


def _errors(method: F, op: str | None = None) -> F:
    """Turn any exception into FuseOSError(errno); unknown ones are EIO and logged in full.
    ``op``: the operation's name in logs and metrics, if not the method's."""

    name = op or method.__name__

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        metrics = args[0].metrics
        started = time.perf_counter() if metrics is not None else 0.0
        code = 0
        try:
            return method(*args, **kwargs)
        except fuse.FuseOSError as exc:
            code = exc.errno
            raise
        except Exception as exc:  # noqa: BLE001 - this is the one place errors become errno
            code = errno_for(exc)
            if isinstance(exc, RemoteError):  # already classified and retried: one line
                log.error("%s%s failed: %s", name, args[1:2], exc)
            elif code == errno.EIO:  # unexpected: keep the traceback for the bug report
                log.error("%s%s failed: %s", name, args[1:2], exc, exc_info=True)
            elif code not in (errno.ENOENT, errno.ENODATA):  # ENODATA: every write asks for xattrs
                log.debug("%s%s -> %s", name, args[1:2], errno.errorcode.get(code, code))
            raise fuse.FuseOSError(code) from None
        finally:
            if metrics is not None:
                metrics.observe(name, time.perf_counter() - started, code)

    return wrapper  # type: ignore[return-value]


class FuseAdapter(fuse.Operations):
    """mfusepy operations over a Filesystem. With ``raw_fi`` the file info struct is passed in."""

    use_ns = True
    metrics: Any = None  # a marinfs.app.metrics.Metrics when --metrics-port is set
    on_destroy: Any = None  # called when the session ends, before open files are committed
    on_init: Any = None  # called once the kernel's INIT is answered: the mount is live

    def __init__(self, fs: Filesystem, uid: int, gid: int, file_mode: int, dir_mode: int,
                 passthrough: bool = True) -> None:
        self.fs = fs
        self.passthrough = passthrough
        self._backings: KernelBackings | None = None
        self.uid, self.gid = uid, gid
        self.file_mode, self.dir_mode = file_mode, dir_mode
        # Object stores have no directory times; one stable time for every directory keeps
        # tools that compare stats (tar, rsync) from seeing changes that did not happen.
        self.dir_mtime_ns = time.time_ns()
        self._dir_handles = itertools.count(1)

    def attrs(self, info: ObjectInfo) -> dict[str, int]:
        """The stat of ``info``: what is stored for it (chmod, chown, utimens), else the mount's
        modes and owner, the object's time (directories: the mount's start)."""
        if info.is_dir:
            kind, perm, nlink, size = stat.S_IFDIR, self.dir_mode, 2, 0
        elif info.link:  # a link's size is its target's length, as lstat(2) tells on a disk
            kind, perm, nlink, size = stat.S_IFLNK, 0o777, 1, info.size
        else:
            kind, perm, nlink, size = stat.S_IFREG, self.file_mode, 1, info.size
        t = self.dir_mtime_ns if info.is_dir else info.mtime_ns
        uid, gid, posix = self.uid, self.gid, info.posix
        if posix is not None and not info.link:
            perm = perm if posix.mode is None else posix.mode
            uid = uid if posix.uid is None else posix.uid
            gid = gid if posix.gid is None else posix.gid
            t = t if posix.mtime_ns is None else posix.mtime_ns
        return {"st_mode": kind | perm, "st_nlink": nlink, "st_size": size, "st_uid": uid,
                "st_gid": gid, "st_mtime": t, "st_ctime": t, "st_atime": t,
                "st_blocks": (size + 511) // 512, "st_blksize": 1 << 20}

    # -- metadata ------------------------------------------------------------------------------
    @_errors
    def getattr(self, path: str | None, fh: Any = None) -> dict[str, int]:
        # With a handle (fstat, or the kernel refreshing a file it reads; only a file's): what
        # that handle reads. Without a path: an unlinked file still open (hard_remove).
        if fh is not None:
            try:
                return self.attrs(self.fs.fgetattr(fh.fh))
            except FsError as exc:
                if exc.errno != errno.EBADF or path is None:
                    raise
        return self.attrs(self.fs.getattr(path))

    def opendir(self, path: str) -> int:
        """A distinct handle per open directory: _Fuse keeps its readdirplus listing under it."""
        return next(self._dir_handles)

    def releasedir(self, path: str | None, fh: int) -> int:
        return 0  # defined so the binding registers releasedir; _Fuse drops the listing

    @_errors
    def readdir(self, path: str, fh: Any, plus: bool = False) -> list[Any]:
        """The entries with their type. With ``plus`` (readdirplus, see _Fuse), each also with
        the attributes getattr would answer without a request, which the kernel then caches,
        saving a LOOKUP per entry; an entry with none cached keeps only its type, and the
        kernel looks it up as before. Plain listings skip that work (about 3 µs an entry)."""
        entries: list[Any] = [".", ".."]
        for info in self.fs.readdir(path):
            name = info.name.rsplit("/", 1)[-1]
            known = self.fs.getattr_cached(info.name) if plus else None
            if known is not None:
                entries.append((name, self.attrs(known), 0))
            else:
                kind = stat.S_IFDIR if info.is_dir else stat.S_IFLNK if info.link else stat.S_IFREG
                entries.append((name, {"st_mode": kind}, 0))
        return entries

    @_errors
    def statfs(self, path: str) -> dict[str, int]:
        return self.fs.statfs()

    @_errors
    def access(self, path: str, amode: int) -> int:
        self.fs.access(path, amode)
        return 0

    # By path; by the file info only when there is no path (an unlinked file still open: its
    # staged file keeps them), as a directory's handle is no file handle. With neither there is
    # nothing left to keep them for.
    @staticmethod
    def _fh(path: str | None, fi: Any) -> int | None:
        return fi.fh if path is None and fi is not None else None

    @_errors
    def chmod(self, path: str | None, mode: int, fi: Any = None) -> int:
        if path is not None or fi is not None:
            self.fs.set_attributes(path, mode=mode, fh=self._fh(path, fi))
        return 0

    @_errors
    def chown(self, path: str | None, uid: int, gid: int, fi: Any = None) -> int:
        if path is not None or fi is not None:  # -1: unchanged
            self.fs.set_attributes(path, uid=None if uid == -1 else uid, gid=None if gid == -1 else gid,
                                   fh=self._fh(path, fi))
        return 0

    @_errors
    def utimens(self, path: str | None, times: tuple[int | None, int | None] | None = None, fi: Any = None) -> int:
        """``times``: (atime, mtime) in ns, None for UTIME_OMIT (see _Fuse.utimens_fuse_3); only
        the mtime is kept (noatime)."""
        mtime = time.time_ns() if times is None else times[1]
        if path is not None or fi is not None:
            self.fs.set_attributes(path, mtime_ns=mtime, fh=self._fh(path, fi))
        return 0

    def init_with_config(self, conn: Any, config: Any) -> None:
        """Take FUSE_INTERRUPT; ask for passthrough where libfuse and the kernel have it (conn:
        fuse_conn_info)."""
        try:
            self._init(conn, config)
        finally:
            if self.on_init is not None:
                self.on_init()

    def _init(self, conn: Any, config: Any) -> None:
        if config is not None and LIBFUSE_INTERRUPT_OPT_IN:
            # 3.17 tells the kernel to send no FUSE_INTERRUPT unless ``intr`` is set (no longer
            # a mount option: the config of init, read after it). It also has libfuse signal the
            # serving thread (SIGUSR1, a handler that does nothing) until the request ends:
            # Python resumes the calls that signal cuts short (PEP 475).
            config.intr = 1
        if not (self.passthrough and LIBFUSE_PASSTHROUGH and conn is not None):
            log.info("passthrough: %s", "off" if not self.passthrough else
                     f"libfuse {fuse.fuse_version_major}.{fuse.fuse_version_minor} has none (3.17 has)")
            return
        if not conn.capable & FUSE_CAP_PASSTHROUGH:
            log.info("passthrough: the kernel offers none (Linux 6.9 has it)")
            return
        conn.want |= FUSE_CAP_PASSTHROUGH
        # The cache's filesystem may itself be stacked once (overlayfs: a container's disk).
        conn.max_backing_stack_depth = 1
        self._backings = self.fs.backings = KernelBackings(_session_fd())
        log.info("passthrough: on; files the chunk cache holds whole are read by the kernel")

    # -- files ---------------------------------------------------------------------------------
    @_errors
    def open(self, path: str, fi: Any) -> int:
        self._reply(path, fi, self.fs.open(path, fi.flags))
        return 0

    @_errors
    def create(self, path: str, mode: int, fi: Any) -> int:
        self._reply(path, fi, self.fs.create(path, fi.flags, mode))
        return 0

    @staticmethod
    def _reply(path: str, fi: Any, opened: Opened) -> None:
        """How the kernel is to read the file just opened: its page cache kept, read around it,
        or a backing file read by the kernel itself (passthrough)."""
        fi.fh = opened.fh
        fi.keep_cache = opened.keep_cache
        fi.direct_io = opened.direct_io
        if opened.backing_id:
            ctypes.c_int32.from_address(ctypes.addressof(fi) + FI_BACKING_ID_OFFSET).value = opened.backing_id
        if opened.drop_attrs:
            # Before the reply, so before its first read: the kernel holds another version's size
            # and would stop this one's reads there, or fill them with zeros up to it.
            _invalidate_path(path)

    @_errors
    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        return self.fs.read(fi.fh, size, offset)

    def read_into(self, path: str | None, dest: memoryview, offset: int, fi: Any) -> int:
        """What _Fuse.read calls: the reply written straight into libfuse's buffer ``dest``."""
        return self.fs.read_into(fi.fh, dest, offset)

    read_into = _errors(read_into, op="read")  # the read it serves, in logs and metrics

    @_errors
    def write(self, path: str | None, data: bytes | memoryview, offset: int, fi: Any) -> int:
        """``data``: from _Fuse.write, a view of libfuse's buffer, valid only during the call.
        A write that waits for the parts streaming ahead of it stops waiting when interrupted."""
        with interrupts.interruptible(_interrupted):
            return self.fs.write(fi.fh, data, offset)

    @_errors
    def truncate(self, path: str, length: int, fi: Any = None) -> int:
        self.fs.truncate(path, length, fi.fh if fi is not None else None)
        return 0

    @_errors
    def fallocate(self, path: str | None, mode: int, offset: int, size: int, fi: Any) -> int:
        self.fs.fallocate(fi.fh, mode, offset, size)
        return 0

    @_errors
    def flush(self, path: str, fi: Any) -> int:
        """The commit at close: a signal to the caller interrupts it (EINTR), bytes kept."""
        with interrupts.interruptible(_interrupted):
            self.fs.flush(fi.fh)
        return 0

    @_errors
    def fsync(self, path: str, datasync: int, fi: Any) -> int:
        with interrupts.interruptible(_interrupted):
            self.fs.fsync(fi.fh)
        return 0

    @_errors
    def release(self, path: str, fi: Any) -> int:
        self.fs.release(fi.fh)
        return 0

    # -- namespace -----------------------------------------------------------------------------
    @_errors
    def unlink(self, path: str) -> int:
        self.fs.unlink(path)
        return 0

    @_errors
    def mkdir(self, path: str, mode: int) -> int:
        self.fs.mkdir(path, mode)
        return 0

    @_errors
    def rmdir(self, path: str) -> int:
        self.fs.rmdir(path)
        return 0

    @_errors
    def rename(self, old: str, new: str) -> int:
        self.fs.rename(old, new)
        return 0

    @_errors
    def mknod(self, path: str, mode: int, dev: int) -> int:
        self.fs.mknod(path, mode)
        return 0

    @_errors
    def link(self, target: str, source: str) -> int:
        raise fuse.FuseOSError(errno.EPERM)  # objects have no hard links (the kernel's answer without them)

    @_errors
    def symlink(self, target: str, source: str) -> int:
        """``ln -s source target``: the binding's names (``target`` is the new link's path)."""
        self.fs.symlink(source, target)
        return 0

    @_errors
    def readlink(self, path: str) -> str:
        return self.fs.readlink(path)

    # -- extended attributes (fs.py says what each answers) ------------------------------------
    @_errors
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        return self.fs.getxattr(path, name)

    @_errors
    def listxattr(self, path: str) -> list[str]:
        return self.fs.listxattr(path)

    @_errors
    def setxattr(self, path: str, name: str, value: bytes, options: int, position: int = 0) -> int:
        self.fs.setxattr(path, name, value, options)
        return 0

    @_errors
    def removexattr(self, path: str, name: str) -> int:
        self.fs.removexattr(path, name)
        return 0

    def destroy(self, path: str) -> None:
        if self._backings is not None:
            self._backings.closed = True
        if self.on_destroy is not None:
            self.on_destroy()
        self.fs.close_all()


class _Fuse(fuse.FUSE):
    """The binding drops the file handle of ftruncate on libfuse3; pass it on so an open
    writer's truncate stays staged until its close instead of being committed at once.

    It also ignores FUSE_READDIR_PLUS, so after a listing the kernel sends a LOOKUP per entry
    for attributes the listing already had; readdir_fuse_3 below answers readdirplus.
    """

    def __init__(self, operations: FuseAdapter, mountpoint: str, **kwargs: Any) -> None:
        # Open directory handle -> its entries, for readdirplus requests after the first.
        self._listings: dict[int, list[Any]] = {}
        # Directory -> until when the kernel surely still holds the attributes we last sent
        # with its entries (half its attr_timeout): meanwhile another readdirplus is answered
        # plainly, as converting every stat again would cost more than it saves.
        self._plus_fresh_until: dict[bytes, float] = {}
        self._plus_quiet = float(kwargs.get("attr_timeout", 1.0)) / 2
        self._pinned = threading.local()  # set in a libfuse thread once its Python state is kept
        super().__init__(operations, mountpoint, **kwargs)  # runs the FUSE loop

    def _wrapper(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Every callback from a libfuse thread: keep that thread's Python thread state alive.

        A ctypes callback from a thread Python did not start makes a fresh thread state and
        frees it on return (PyGILState_Ensure/Release): an mmap, a munmap and the state's set-up
        per request, a third of a small read's cost. One extra Ensure, never released, keeps
        it; libfuse's threads are bounded and never exit (max_idle_threads = max_threads)."""
        if not getattr(self._pinned, "kept", False):
            ctypes.pythonapi.PyGILState_Ensure()
            self._pinned.kept = True
            set_os_name("fuse")  # libfuse's request threads, apart from marinfs's own in top -H
        return super()._wrapper(func, *args, **kwargs)

    def readdir_fuse_3(self, path: bytes, buf: Any, filler: Any, offset: int, fip: Any, flags: int) -> int:
        """Plain readdir from the start: as the binding does (the whole listing at once with
        offset 0; libfuse pages it out). readdirplus: entries with non-zero offsets, one kernel
        buffer per call, complete stats flagged FUSE_FILL_DIR_PLUS. libfuse 3.14 drops the
        attributes of plus entries filled with offset 0 (fixed upstream in 3.17, PR #896), so
        offsets are what make the kernel keep them. The listing is taken at offset 0 and kept
        for the handle, so each later buffer is a slice, not a new listing."""
        fh = fip.contents.fh
        plus = bool(flags & FUSE_READDIR_PLUS)
        if offset == 0:
            self._listings.pop(fh, None)
            if plus and time.monotonic() < self._plus_fresh_until.get(path, 0.0):
                plus = False
            if not plus:
                return super().readdir_fuse_3(path, buf, filler, offset, fip, flags)
        entries = self._listings.get(fh)
        if offset == 0 or entries is None:
            entries = self.operations.readdir(path.decode(self.encoding, self.errors), fh, plus=plus)
            self._listings[fh] = entries
            if plus:
                if len(self._plus_fresh_until) > 65536:  # a bound, not an LRU: forgetting is safe
                    self._plus_fresh_until.clear()
                self._plus_fresh_until[path] = time.monotonic() + self._plus_quiet
        st = fuse.c_stat()
        for index in range(offset, len(entries)):
            item = entries[index]
            name, attrs = (item, None) if isinstance(item, str) else (item[0], item[1])
            ctypes.memset(ctypes.byref(st), 0, ctypes.sizeof(st))
            fill = 0
            if attrs is None:  # "." and "..": libfuse makes no entry for them; type only
                st.st_mode = stat.S_IFDIR
            elif plus and "st_nlink" in attrs:  # a complete stat (see FuseAdapter.readdir)
                fuse.set_st_attrs(st, attrs, use_ns=self.use_ns)
                fill = FUSE_FILL_DIR_PLUS
            else:
                st.st_mode = attrs["st_mode"]
            if filler(buf, name.encode(self.encoding, self.errors), st, index + 1, fill) != 0:
                break  # the kernel's buffer is full; it asks again from this entry's offset
        return 0

    def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
        """The binding's read takes ``bytes`` from the adapter and copies them into libfuse's
        buffer; here the filesystem fills that buffer itself (``buf``: a ``c_byte`` pointer to
        ``size`` writable bytes, valid until this returns), so a reply costs one copy and no
        allocation."""
        if size <= 0:
            return 0
        dest = memoryview((ctypes.c_ubyte * size).from_address(ctypes.addressof(buf.contents))).cast("B")
        return self.operations.read_into(self._decoded(path), dest, offset, fip.contents)

    def write(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
        """The binding's write copies libfuse's request buffer into a ``bytes`` first; here the
        filesystem gets a memoryview of that buffer (``buf``: a ``c_byte`` pointer to ``size``
        bytes, valid until this returns), which os.pwrite takes as it is. Released on return:
        a view kept past it would read freed memory, so keeping one is an error (BufferError)."""
        if size <= 0:
            return self.operations.write(self._decoded(path), b"", offset, fip.contents)
        data = memoryview((ctypes.c_ubyte * size).from_address(ctypes.addressof(buf.contents))).cast("B")
        try:
            return self.operations.write(self._decoded(path), data, offset, fip.contents)
        finally:
            data.release()

    def getxattr(self, path: bytes, name: bytes, value: Any, size: int, *args: Any) -> int:
        """The kernel's own namespaces hold nothing here: ENODATA at once, without the adapter,
        as the kernel asks for ``security.capability`` before every write(2) to a file (libfuse
        3.14 cannot negotiate FUSE_HANDLE_KILLPRIV_V2, which would spare that round trip)."""
        if name.startswith(KERNEL_XATTR_PREFIXES):
            return -errno.ENODATA
        return super().getxattr(path, name, value, size, *args)

    def releasedir(self, path: bytes | None, fip: Any) -> int:
        self._listings.pop(fip.contents.fh, None)
        return super().releasedir(path, fip)

    def _decoded(self, path: bytes | None) -> str | None:
        return None if path is None else path.decode(self.encoding, self.errors)

    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        return self.operations.truncate(self._decoded(path), length, fip.contents if fip else None)

    # The binding drops the file info of chmod, chown and utimens too; libfuse passes it when
    # the kernel sent the handle, so an open writer's attributes stay with its staged file.
    def chmod_fuse_3(self, path: bytes | None, mode: int, fip: Any) -> int:
        return self.operations.chmod(self._decoded(path), mode, fip.contents if fip else None)

    def chown_fuse_3(self, path: bytes | None, uid: int, gid: int, fip: Any) -> int:
        # -1 ("unchanged") arrives as the unsigned maximum
        uid = -1 if fuse.c_uid_t(uid + 1).value == 0 else uid
        gid = -1 if fuse.c_gid_t(gid + 1).value == 0 else gid
        return self.operations.chown(self._decoded(path), uid, gid, fip.contents if fip else None)

    def utimens_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
        """libfuse3 always passes both timespecs, UTIME_NOW and UTIME_OMIT in tv_nsec as the
        kernel sent them (``touch`` is NOW; ``touch -m``, ``utimensat`` with OMIT); the
        binding would pass them on as times 1.07 s after the epoch."""
        def ns(ts: Any) -> int | None:
            if ts.tv_nsec == UTIME_OMIT:
                return None
            if ts.tv_nsec == UTIME_NOW:
                return time.time_ns()
            return ts.tv_sec * 1_000_000_000 + ts.tv_nsec

        times = (ns(buf.contents.actime), ns(buf.contents.modtime)) if buf else None
        return self.operations.utimens(self._decoded(path), times, fip.contents if fip else None)


def serve(adapter: FuseAdapter, mountpoint: str, *, fsname: str, read_only: bool,
          allow_other: bool, attr_timeout: float, negative_timeout: float, inode_ttl: float,
          foreground: bool = True) -> None:
    """Run the FUSE loop until unmounted. Blocks; raises RuntimeError if the mount fails."""
    options: dict[str, Any] = {
        # libfuse splits -o options on ',': escape commas (and backslashes) in the remote URL.
        "fsname": fsname.replace("\\", "\\\\").replace(",", "\\,"),
        "subtype": "marinfs",
        "attr_timeout": attr_timeout,
        "entry_timeout": attr_timeout,
        "negative_timeout": negative_timeout,
        # With atime == mtime, relatime makes every read bump the cached times and tar reports
        # "file changed as we read it". Objects have no atime to keep anyway.
        "noatime": True,
        # Unlink means unlink: without it libfuse renames a file that is still open to a
        # .fuse_hidden* name, which every node would see (and object stores would store).
        # fs.unlink keeps an open file's staged bytes usable through its descriptors.
        "hard_remove": True,
        # st_ino is libfuse's node id, which it drops once the kernel forgets the inode (when
        # memory runs short, or by drop_caches) and renumbers at the next
        # lookup: tar -x then fails ("Directory renamed before its status could be extracted")
        # and find sees a directory change under it. Keeping forgotten nodes (an entry of
        # ~250 bytes each) for inode_ttl keeps every number that is in use stable, and
        # readdir_ino gives a plain readdir's entries those numbers (not "unknown", 2**32-1).
        "remember": math.ceil(inode_ttl),
        "readdir_ino": True,
        # libfuse 3.14 passes its "unlimited" default of max_idle_threads (UINT_MAX) through its
        # own range check and warns "Ignoring invalid max threads value 4294967295" at every
        # mount. Its thread limit is 10 (max_threads), so keeping 10 idle is the same thing.
        "max_threads": 10,
        "max_idle_threads": 10,
    }
    if read_only:
        options["ro"] = True
    if allow_other:
        options["allow_other"] = True
        options["default_permissions"] = True
    _Fuse(adapter, mountpoint, raw_fi=True, foreground=foreground, nothreads=False, **options)
