"""OS-level thread names, so ``top -H``, ``ps -L``, ``perf`` and ``/proc/PID/task/*/comm`` tell
marinfs's threads apart (fetch workers, cache writes, libfuse's request threads) instead of
showing "python" for all of them. Python 3.11 keeps ``threading`` names to itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any

from marinfs import stopsignals

_PR_SET_NAME = 15
_COMM_MAX = 15  # the kernel keeps 15 bytes of a thread's name (TASK_COMM_LEN - 1)

try:
    _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: names stay Python's own
    _prctl = None


def set_os_name(name: str) -> bool:
    """Name the calling thread for the OS (cut to 15 bytes); False where that cannot be done."""
    if _prctl is None:
        return False
    return _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode(errors="replace")[:_COMM_MAX]), 0, 0, 0) == 0


def name_current() -> None:
    """Give the calling thread its ``threading`` name at the OS level (an executor's
    ``initializer``: its workers are named ``PREFIX_N``)."""
    set_os_name(threading.current_thread().name)


def start_thread(target: Callable[..., object], name: str, *args: object) -> threading.Thread:
    """A daemon thread named ``name`` for Python and for the OS alike, started."""
    def run() -> None:
        set_os_name(name)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with stopsignals.blocked():  # (inherited: the daemon's stop signals are its main thread's)
        thread.start()
    return thread


AT_ONCE = 16  # calls at once: the requests of one step of a tree rename


def each_at_once(fn: Callable[[Any], Any], keys: list[Any]) -> list[Any]:
    """``fn`` of every key on threads of their own, up to AT_ONCE at once (remote requests: a
    round trip for them all, not one each); every call ends before this returns, and the first
    failure is then raised."""
    if len(keys) <= 1:
        return [fn(k) for k in keys]
    with cf.ThreadPoolExecutor(max_workers=min(AT_ONCE, len(keys)),
                               thread_name_prefix="tree", initializer=name_current) as pool:
        futures = [pool.submit(fn, k) for k in keys]
        cf.wait(futures)
    return [f.result() for f in futures]
