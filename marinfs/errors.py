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


# Answers that no retry changes: the store can never hold the name (too long, not UTF-8), or it
# refuses us (access denied). A commit that meets one is final: its bytes are kept on disk,
# reported once and not retried in a loop (docs/reliability.md).
FINAL_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EILSEQ, errno.EACCES, errno.EPERM})
# Of those, what someone may cure outside marinfs (credentials, a bucket policy): a final commit
# that failed so is tried once more when the next daemon starts; a bad name never is.
# An upload its writer interrupted (EINTR: a signal during close) is kept too, not retried in a
# loop (a 1 TiB sparse file would be sent again every interval), and tried once at the next start.
CURABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EINTR})


def interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is its caller giving up: EINTR."""
    for _ in range(5):
        if exc is None:
            return False
        if isinstance(exc, InterruptedError) or (isinstance(exc, OSError) and exc.errno == errno.EINTR):
            return True
        exc = exc.__cause__
    return False


def final_errno(exc: BaseException) -> int | None:
    """The errno of ``exc`` (or of what explicitly caused it) when it is one no retry can change
    (FINAL_ERRNOS), else None. An access refusal without an errno counts as EACCES."""
    current: BaseException | None = exc
    for _ in range(5):
        if current is None:
            break
        if isinstance(current, OSError):
            code = current.errno if isinstance(current.errno, int) and current.errno > 0 else None
            if code is None and isinstance(current, PermissionError):
                code = errno.EACCES
            if code in FINAL_ERRNOS:
                return code
        current = current.__cause__
    return None


def is_final(exc: BaseException) -> bool:
    return final_errno(exc) is not None


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
