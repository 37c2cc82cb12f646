"""Long calls their caller may give up, and how far they got.

A FUSE request is interrupted when its caller gets a signal (the kernel sends FUSE_INTERRUPT;
libfuse marks the request, ``fuse_interrupted()`` answers it on the thread serving it). The
adapter says how to ask on that thread (:func:`interruptible`); code far below it that waits a
long time on the same thread (the part streamer waiting for its parts) waits in short steps
(:func:`wait`) and gives up with ``InterruptedError`` (EINTR) once the caller has. Work running
on other threads is never asked: the waiter gives up, and stops handing out more.

:func:`call` names a long call (a commit: its key) while it runs, so ``marinfs status`` can show
it and how many bytes it has sent (``Call.progress``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

POLL_SECONDS = 0.2  # how often a waiting thread asks whether its caller gave up

_local = threading.local()
_lock = threading.Lock()
_calls: dict[int, Call] = {}  # GUARDED_BY(_lock): the calls running now, by id


class Call:
    """One long call in progress: what it is, since when, and (once known) its bytes sent of
    its total."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since = time.time()
        self.total: int | None = None
        self._sent: Callable[[], int] | None = None

    def progress(self, sent: Callable[[], int], total: int) -> None:
        """From now on ``sent()`` answers the bytes sent so far, of ``total``."""
        self._sent, self.total = sent, total

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.what, "since": self.since, "size": self.total,
                "bytes_sent": self._sent() if self._sent is not None else 0}


@contextlib.contextmanager
def interruptible(asking: Callable[[], bool]) -> Iterator[None]:
    """Within: :func:`interrupted` on this thread answers ``asking()``."""
    before = getattr(_local, "asking", None)
    _local.asking = asking
    try:
        yield
    finally:
        _local.asking = before


@contextlib.contextmanager
def call(what: str) -> Iterator[Call]:
    """Within: this thread runs the long call ``what`` (listed by :func:`in_progress`)."""
    entry = Call(what)
    before = getattr(_local, "call", None)
    _local.call = entry
    with _lock:
        _calls[id(entry)] = entry
    try:
        yield entry
    finally:
        with _lock:
            del _calls[id(entry)]
        _local.call = before


def current() -> Call | None:
    return getattr(_local, "call", None)


def interrupted() -> bool:
    """Whether the caller this thread serves gave up (False where nobody can)."""
    asking = getattr(_local, "asking", None)
    return asking is not None and bool(asking())


def check() -> None:
    if interrupted():
        raise InterruptedError(errno.EINTR, "interrupted: the caller gave up (a signal)")


def wait(futures: Iterable[cf.Future[Any]], first: bool = False) -> None:
    """Wait until every one of ``futures`` is done (``first``: one of them), in steps of
    POLL_SECONDS where this thread's caller can give up; raises InterruptedError if it does."""
    pending = [f for f in futures if not f.done()]
    if getattr(_local, "asking", None) is None:
        if pending:
            cf.wait(pending, return_when=cf.FIRST_COMPLETED if first else cf.ALL_COMPLETED)
        return
    while pending:
        check()
        done, _ = cf.wait(pending, timeout=POLL_SECONDS,
                          return_when=cf.FIRST_COMPLETED if first else cf.ALL_COMPLETED)
        if first and done:
            return
        pending = [f for f in pending if not f.done()]


def in_progress() -> list[dict[str, Any]]:
    """The long calls running now, oldest first."""
    with _lock:
        calls = list(_calls.values())
    return [c.as_dict() for c in sorted(calls, key=lambda c: c.since)]
