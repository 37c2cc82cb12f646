"""Long calls their caller gives up (marinfs/interrupts.py): the part streamer stops sending and
aborts its session once the parts in flight are over; a call's progress is listed meanwhile."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from pathlib import Path

import pytest

from marinfs import interrupts
from marinfs.remote.parts import PartStream

PART = 1 << 16


class SlowSession:
    """A multipart session whose parts wait for ``release``; records what it was asked."""

    part_size = PART
    ordered = False

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.started: list[int] = []
        self.aborted_after: list[int] | None = None
        self.completed = False
        self.release = threading.Event()
        self.lock = threading.Lock()

    def send(self, index: int, data: bytes, total: int | None = None) -> None:
        with self.lock:
            self.started.append(index)
        self.release.wait(10)
        with self.lock:
            self.sent.append(index)

    def complete(self, parts: int, total: int) -> None:
        self.completed = True

    def abort(self) -> bool:
        with self.lock:
            self.aborted_after = list(self.sent)
        return True


def _stream(tmp_path: Path, size: int) -> tuple[PartStream, SlowSession, int, cf.ThreadPoolExecutor]:
    path = tmp_path / "staged"
    path.write_bytes(b"")
    os.truncate(path, size)
    fd = os.open(path, os.O_RDONLY)
    session = SlowSession()
    pool = cf.ThreadPoolExecutor(8)
    stream = PartStream(fd, lambda: session, PART, pool, max_in_flight=2)
    stream.open()
    return stream, session, fd, pool


def test_an_interrupted_finish_sends_no_part_more_and_aborts_after_those_in_flight(tmp_path: Path) -> None:
    stream, session, fd, pool = _stream(tmp_path, 20 * PART)
    given_up = threading.Event()
    seen: list[dict] = []

    def finish() -> BaseException | None:
        with interrupts.interruptible(given_up.is_set), interrupts.call("big.bin"):
            try:
                stream.finish(20 * PART)
            except InterruptedError as exc:
                return exc
        return None

    try:
        with cf.ThreadPoolExecutor(1) as runner:
            result = runner.submit(finish)
            deadline = time.monotonic() + 5
            while len(session.started) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            seen = interrupts.in_progress()
            started = time.monotonic()
            given_up.set()
            exc = result.result(timeout=5)
            waited = time.monotonic() - started
        assert isinstance(exc, InterruptedError) and waited < 1.0, (exc, waited)
        assert [c["key"] for c in seen] == ["big.bin"] and seen[0]["size"] == 20 * PART
        assert interrupts.in_progress() == []
        assert session.aborted_after is None  # not while its 2 parts are in flight
        session.release.set()
        deadline = time.monotonic() + 5
        while session.aborted_after is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(session.started) == [0, 1] and sorted(session.aborted_after or []) == [0, 1]
        assert not session.completed and stream.sent == 2 * PART
    finally:
        session.release.set()
        pool.shutdown(wait=True)
        os.close(fd)


def test_a_finish_nobody_can_interrupt_waits_as_before(tmp_path: Path) -> None:
    stream, session, fd, pool = _stream(tmp_path, 3 * PART)
    session.release.set()
    try:
        assert not interrupts.interrupted()
        stream.finish(3 * PART)
        assert session.completed and sorted(session.sent) == [0, 1, 2] and stream.sent == 3 * PART
    finally:
        pool.shutdown(wait=True)
        os.close(fd)


def test_check_raises_eintr_only_where_the_caller_gave_up() -> None:
    interrupts.check()
    with interrupts.interruptible(lambda: False):
        interrupts.check()
    with interrupts.interruptible(lambda: True), pytest.raises(InterruptedError):
        interrupts.check()
    interrupts.check()
