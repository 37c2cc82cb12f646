"""Only the daemon's main thread takes its stop signals (marinfs/stopsignals.py); the end to end
case, a signal given to a Python thread of a live mount, is in test_daemon_ops.py."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from marinfs import stopsignals
from marinfs.threadnames import start_thread

pytestmark = pytest.mark.unit


def mask() -> set[int]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def mask_in(start: "callable") -> set[int]:  # type: ignore[valid-type]
    seen: list[set[int]] = []
    done = threading.Event()

    def body() -> None:
        seen.append(mask())
        done.set()

    start(body)
    assert done.wait(10)
    return seen[0]


@pytest.fixture
def hooked() -> Iterator[None]:
    stopsignals.leave_to_main_thread()
    try:
        yield
    finally:
        stopsignals.reset()


def test_our_threads_block_them_and_the_starter_keeps_its_own_mask() -> None:
    before = mask()
    assert stopsignals.STOP_SIGNALS <= mask_in(lambda f: start_thread(f, "t"))
    assert mask() == before  # the caller's mask is back as it was


def test_a_library_thread_blocks_them_once_the_daemon_says_so(hooked: None) -> None:
    assert stopsignals.STOP_SIGNALS <= mask_in(lambda f: threading.Thread(target=f).start())
    with ThreadPoolExecutor(1) as pool:
        assert stopsignals.STOP_SIGNALS <= pool.submit(mask).result()
    assert not stopsignals.STOP_SIGNALS & mask()  # the main thread still takes them (Ctrl-C at start)


def test_without_it_a_plain_thread_keeps_them() -> None:
    assert not stopsignals.STOP_SIGNALS & mask_in(lambda f: threading.Thread(target=f).start())
