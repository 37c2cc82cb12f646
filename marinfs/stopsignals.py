"""The daemon's stop signals (SIGTERM, SIGINT, SIGHUP) are taken by its main thread alone.

libfuse ends its loop on them with a handler that sets a flag and counts on interrupting the
main thread's wait. The kernel queues a signal sent to a process for all of its threads, and
any thread not blocking it that returns to user space first takes it: a Python thread that did
(the stats loop, fsspec's event loop, an upload worker) set the flag and woke nobody, and the
daemon served on after SIGTERM or Ctrl-C (1 stop in 10 on a busy machine). libfuse blocks them
in its own threads; these helpers do so in ours. The main thread keeps them, so a Ctrl-C while
the daemon starts (a slow endpoint, recovery) still ends it at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


@contextmanager
def blocked() -> Iterator[None]:
    """The calling thread blocks them meanwhile: a thread started inside inherits that."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def leave_to_main_thread() -> None:
    """Every Python thread started from now on (libraries' too: fsspec's event loop, executors'
    workers) blocks them before its first line runs; the calling (main) thread takes them, even
    if whatever started the daemon had them blocked (a mask is inherited across fork and exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def first_line(frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)  # (once: this thread runs unprofiled from here on)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    threading.setprofile(first_line)


def reset() -> None:
    """Undo ``leave_to_main_thread`` (tests)."""
    threading.setprofile(None)  # type: ignore[arg-type]
