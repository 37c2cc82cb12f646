"""The FUSE adapter: the only importer of the binding (mfusepy, fusepy's API, on libfuse3).

Each operation unpacks its arguments, calls :class:`marinfs.fs.Filesystem`, and packs the
result. One decorator maps every exception to an errno through the table in errors.py; the
binding would otherwise answer EINVAL for anything that is not an OSError.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Any, TypeVar

# mfusepy picks libfuse2 when libfuse.so.2 exists; we need libfuse3 (1 MiB requests).
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
import mfusepy as fuse  # noqa: E402

from marinfs.errors import RemoteError, errno_for  # noqa: E402
from marinfs.fs import Filesystem  # noqa: E402
from marinfs.remote import ObjectInfo  # noqa: E402

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
LIBFUSE_MAJOR = fuse.fuse_version_major


def _errors(method: F) -> F:
    """Turn any exception into FuseOSError(errno); unknown ones are EIO and logged in full."""

    name = method.__name__

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
                log.error("%s%s failed: %s", method.__name__, args[1:2], exc)
            elif code == errno.EIO:  # unexpected: keep the traceback for the bug report
                log.error("%s%s failed: %s", method.__name__, args[1:2], exc, exc_info=True)
            elif code != errno.ENOENT:
                log.debug("%s%s -> %s", method.__name__, args[1:2], errno.errorcode.get(code, code))
            raise fuse.FuseOSError(code) from None
        finally:
            if metrics is not None:
                metrics.observe(name, time.perf_counter() - started, code)

    return wrapper  # type: ignore[return-value]


class FuseAdapter(fuse.Operations):
    """mfusepy operations over a Filesystem. With ``raw_fi`` the file info struct is passed in."""

    use_ns = True
    metrics: Any = None  # a marinfs.metrics.Metrics when --metrics-port is set
    on_destroy: Any = None  # called when the session ends, before open files are committed

    def __init__(self, fs: Filesystem, uid: int, gid: int, file_mode: int, dir_mode: int) -> None:
        self.fs = fs
        self.uid, self.gid = uid, gid
        self.file_mode, self.dir_mode = file_mode, dir_mode
        # Object stores have no directory times; one stable time for every directory keeps
        # tools that compare stats (tar, rsync) from seeing changes that did not happen.
        self.dir_mtime_ns = time.time_ns()

    def attrs(self, info: ObjectInfo) -> dict[str, int]:
        if info.is_dir:
            mode, nlink, size = stat.S_IFDIR | self.dir_mode, 2, 0
        else:
            mode, nlink, size = stat.S_IFREG | self.file_mode, 1, info.size
        t = self.dir_mtime_ns if info.is_dir else info.mtime_ns
        return {"st_mode": mode, "st_nlink": nlink, "st_size": size, "st_uid": self.uid,
                "st_gid": self.gid, "st_mtime": t, "st_ctime": t, "st_atime": t,
                "st_blocks": (size + 511) // 512, "st_blksize": 1 << 20}

    # -- metadata ------------------------------------------------------------------------------
    @_errors
    def getattr(self, path: str | None, fh: Any = None) -> dict[str, int]:
        if path is None:  # an unlinked file that is still open (hard_remove): only its handle
            return self.attrs(self.fs.handle_info(fh.fh))
        return self.attrs(self.fs.getattr(path))

    @_errors
    def readdir(self, path: str, fh: Any) -> list[Any]:
        entries: list[Any] = [".", ".."]
        for info in self.fs.readdir(path):
            name = info.name.rsplit("/", 1)[-1]
            entries.append((name, {"st_mode": stat.S_IFDIR if info.is_dir else stat.S_IFREG}, 0))
        return entries

    @_errors
    def statfs(self, path: str) -> dict[str, int]:
        return self.fs.statfs()

    @_errors
    def access(self, path: str, amode: int) -> int:
        self.fs.access(path, amode)
        return 0

    @_errors
    def chmod(self, path: str | None, mode: int) -> int:
        if path is not None:  # None: an unlinked open file, nothing to check
            self.fs.set_attributes(path)
        return 0

    @_errors
    def chown(self, path: str | None, uid: int, gid: int) -> int:
        if path is not None:  # None: an unlinked open file, nothing to check
            self.fs.set_attributes(path)
        return 0

    @_errors
    def utimens(self, path: str | None, times: Any = None) -> int:
        if path is not None:  # None: an unlinked open file, nothing to check
            self.fs.set_attributes(path)
        return 0

    # -- files ---------------------------------------------------------------------------------
    @_errors
    def open(self, path: str, fi: Any) -> int:
        fi.fh = self.fs.open(path, fi.flags)
        fi.keep_cache = self.fs.keeps_kernel_cache(fi.fh)
        return 0

    @_errors
    def create(self, path: str, mode: int, fi: Any) -> int:
        fi.fh = self.fs.create(path, fi.flags)
        return 0

    @_errors
    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        return self.fs.read(fi.fh, size, offset)

    @_errors
    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        return self.fs.write(fi.fh, data, offset)

    @_errors
    def truncate(self, path: str, length: int, fi: Any = None) -> int:
        self.fs.truncate(path, length, fi.fh if fi is not None else None)
        return 0

    @_errors
    def flush(self, path: str, fi: Any) -> int:
        self.fs.flush(fi.fh)
        return 0

    @_errors
    def fsync(self, path: str, datasync: int, fi: Any) -> int:
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
        self.fs.mkdir(path)
        return 0

    @_errors
    def rmdir(self, path: str) -> int:
        self.fs.rmdir(path)
        return 0

    @_errors
    def rename(self, old: str, new: str) -> int:
        self.fs.rename(old, new)
        return 0

    def link(self, target: str, source: str) -> int:
        raise fuse.FuseOSError(errno.EPERM)  # objects have no hard links

    def symlink(self, target: str, source: str) -> int:
        raise fuse.FuseOSError(errno.EPERM)  # objects have no symbolic links

    def destroy(self, path: str) -> None:
        if self.on_destroy is not None:
            self.on_destroy()
        self.fs.close_all()


class _Fuse(fuse.FUSE):
    """The binding drops the file handle of ftruncate on libfuse3; pass it on so an open
    writer's truncate stays staged until its close instead of being committed at once."""

    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        fi = fip.contents if fip else None
        decoded = None if path is None else path.decode(self.encoding, self.errors)
        return self.operations.truncate(decoded, length, fi)


def serve(adapter: FuseAdapter, mountpoint: str, *, fsname: str, read_only: bool,
          allow_other: bool, attr_timeout: float, negative_timeout: float,
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
    }
    if read_only:
        options["ro"] = True
    if allow_other:
        options["allow_other"] = True
        options["default_permissions"] = True
    _Fuse(adapter, mountpoint, raw_fi=True, foreground=foreground, nothreads=False, **options)
