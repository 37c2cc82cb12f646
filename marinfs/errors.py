"""The exception hierarchy and the one table that maps exceptions to errno values.

Every layer raises Python exceptions; only the FUSE adapter turns them into errno values, and it
does so through :func:`errno_for` alone, so one table decides what a user sees.
"""

from __future__ import annotations

import errno
import logging

log = logging.getLogger(__name__)


class MarinfsError(Exception):
    """Base class: an error whose message is fit to show a user on one line."""


class UsageError(MarinfsError):
    """Bad input from the user (flags, paths, URLs, config). CLI exit code 2."""


class MountError(MarinfsError):
    """The mount could not be made or removed. CLI exit code 1."""


class RemoteError(MarinfsError):
    """A remote call failed after its retries; surfaces as EIO unless a subclass says otherwise."""


class StaleVersionError(OSError):
    """The object changed under an open handle; the read fails rather than mix versions."""

    def __init__(self, detail: str) -> None:
        super().__init__(errno.ESTALE, detail)


class PreconditionFailed(MarinfsError):
    """A conditional commit found the object changed since the writer opened it (HTTP 412)."""


class FsError(OSError):
    """An error that already knows its errno (raised by the filesystem core)."""

    def __init__(self, code: int, detail: str = "") -> None:
        super().__init__(code, detail or errno.errorcode.get(code, str(code)))


# Exception class -> errno. Order matters: the first matching class wins, so subclasses come first.
ERRNO_TABLE: tuple[tuple[type[BaseException], int], ...] = (
    (FileNotFoundError, errno.ENOENT),
    (FileExistsError, errno.EEXIST),
    (IsADirectoryError, errno.EISDIR),
    (NotADirectoryError, errno.ENOTDIR),
    (PermissionError, errno.EACCES),
    (InterruptedError, errno.EINTR),
    (TimeoutError, errno.ETIMEDOUT),
    (ConnectionError, errno.EIO),
    (NotImplementedError, errno.ENOSYS),
    (PreconditionFailed, errno.ESTALE),
    (RemoteError, errno.EIO),
)


def errno_for(exc: BaseException) -> int:
    """The errno a syscall should fail with for ``exc``; unknown errors are EIO, never EINVAL.

    An OSError that carries a positive errno keeps it (the local backend raises real ones), so
    ENOSPC or ENAMETOOLONG from the staging disk reach the user unchanged.
    """
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and exc.errno > 0:
        return exc.errno
    for cls, code in ERRNO_TABLE:
        if isinstance(exc, cls):
            return code
    return errno.EIO
