"""The part streamer: sends a staging file in parts while it is being written.

A staged file is always complete on the local disk (that is what makes a failed commit
recoverable). On S3 and GCS its parts also leave while the writer is still writing, so ``close``
of a big sequential write only waits for the tail. The sessions that carry the parts belong to
their backends (remote/s3.py: a multipart upload, any part may be resent; remote/gcs.py: a
resumable upload, chunks in order, never resent); this module knows only the
:class:`PartSession` protocol, so the writer side (staging.py, fs.py) streams through it
without loading a backend, and a backend uploads a whole file through it (``upload_file``).

The part streamer only ever reads parts from the staging file: the file is the truth, the
stream is an optimisation that may give up at any time without losing anything.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from marinfs import interrupts
from marinfs.checksums import crc32c_extend
from marinfs.objects import ObjectVersion

log = logging.getLogger(__name__)

S3_MAX_PARTS = 10_000  # the most parts S3 takes; the streamer never asks a session for more


class PartSession(Protocol):
    """One multipart (S3) or resumable (GCS) upload of a single object."""

    part_size: int
    ordered: bool  # parts go one at a time, in order, never resent (GCS)

    def send(self, index: int, data: bytes, total: int | None = None) -> None: ...

    # Optional: ``send_range(index, fd, offset, length, total, crc32c=None)`` sends the part
    # from the file itself (up to ``length`` bytes of ``fd`` at ``offset``; ``crc32c``: its
    # CRC-32C if known, summed as it was written); without it a part is read into ``bytes``
    # for ``send``. A session with ``checksum == "crc32c"`` takes those sums.

    def complete(self, parts: int, total: int) -> ObjectVersion | None: ...

    def abort(self) -> bool | None: ...  # True: the store dropped it (or never had it)

    # Optional: ``record``, a JSON-able dict naming the upload on the store (S3: bucket, key
    # and upload id) for ``Remote.abort_upload``: journaled while the upload is open, so the
    # next daemon aborts what a killed one left (an S3 multipart upload is billed until then).


# Told when a session that has a ``record`` opens (True) and when it is over (False: completed,
# or aborted by the store's answer); the staged file journals the records in between.
SessionNote = Callable[[dict, bool], None]


Runner = Callable[[str, Callable[..., Any]], Any]  # (kind, fn) -> fn() with retries and counting
Counter = Callable[[int], None]  # bytes sent


class PartStream:
    """Sends the parts of a staging file while it is being written (see the module docstring).

    ``on_write``/``on_truncate`` are called (under the staged file's lock) after each change to
    the file; ``finish`` commits, or answers None when the stream gave up or never started and
    the caller must upload the file whole. Bounded memory: at most ``max_in_flight`` parts are
    in flight at once (a session with ``send_range`` holds none of them in memory, others read
    each into ``bytes``); a writer that outruns the network waits for a slot.
    """

    def __init__(self, fd: int, open_session: Callable[[], PartSession], part_size: int,
                 pool: cf.Executor, max_in_flight: int = 4, on_session: SessionNote | None = None) -> None:
        self.fd = fd
        self._open_session = open_session
        self.on_session = on_session  # may be set after construction (the staged file's journal)
        self.part_size = part_size
        self.pool = pool
        self.max_in_flight = max(1, max_in_flight)
        self.session: PartSession | None = None
        self.next_part = 0  # parts [0, next_part) were dispatched
        self.seq_end = 0  # bytes [0, seq_end) were written (the writer has been sequential)
        self.sequential = True
        self.broken = False  # gave up: commit uploads the whole file
        self.dirty: set[int] = set()  # dispatched parts written again since
        self.futures: dict[int, cf.Future[int]] = {}
        self.sent = 0  # bytes of the parts the store has acknowledged (for `marinfs status`)
        # CRC-32C of the parts as they are written (the bytes pass through here anyway, so the
        # part need not be read back to be summed): bytes [0, sum_at) were summed in order, the
        # current part's so far in ``_sum``; full parts not written since in ``sums``. -1: the
        # writer left the sequence (or the session takes no sums) and parts are summed as sent.
        self.sum_at = 0 if crc32c_extend is not None else -1
        self._sum = 0
        self.sums: dict[int, int] = {}

    def on_write(self, offset: int, length: int, data: Any = None) -> None:
        """``data`` (the bytes written, if the caller has them) feeds the running CRC-32C."""
        if self.broken or length <= 0:
            return
        if self.sum_at >= 0:
            if data is not None and offset == self.sum_at and len(data) == length:
                self._absorb(data)
            else:
                self._unsum(offset // self.part_size)
        end = offset + length
        first, last = offset // self.part_size, (end - 1) // self.part_size
        if first < self.next_part:
            if self.session is not None and self.session.ordered:
                self._give_up("a write went behind what was already sent")
                return
            self.dirty.update(range(first, min(last, self.next_part - 1) + 1))
        if offset <= self.seq_end:
            self.seq_end = max(self.seq_end, end)
        else:
            self.sequential = False  # a hole: stop sending ahead; commit sends the rest
        while self.sequential and (self.next_part + 1) * self.part_size <= self.seq_end:
            if self.next_part + 1 >= S3_MAX_PARTS:
                self._give_up("too many parts")
                return
            if not self._dispatch(self.next_part):
                return
            self.next_part += 1

    def _absorb(self, data: Any) -> None:
        """Extend the running CRC-32C over ``data``, written at ``sum_at``; a part it completes
        keeps its sum in ``sums``."""
        assert crc32c_extend is not None
        view = memoryview(data).cast("B")
        hold: Any = None
        keep: bytes | None = None
        try:
            if view.readonly:  # bytes: summed where they lie (a copy only of other read-only memory)
                keep = data if isinstance(data, bytes) else bytes(view)
                base = ctypes.cast(ctypes.c_char_p(keep), ctypes.c_void_p).value or 0
            else:
                hold = (ctypes.c_char * len(view)).from_buffer(view)
                base = ctypes.addressof(hold)
            done, pos, size = 0, self.sum_at, self.part_size
            while done < len(view):
                k = min(len(view) - done, (pos // size + 1) * size - pos)
                self._sum = crc32c_extend(self._sum, base + done, k)  # type: ignore[operator]
                done, pos = done + k, pos + k
                if pos % size == 0:
                    self.sums[pos // size - 1] = self._sum
                    self._sum = 0
            self.sum_at = pos
        finally:
            del hold, keep  # the caller's view must have no exports left when it is released
            view.release()

    def _unsum(self, first: int) -> None:
        """Bytes of part ``first`` (or later) were written out of order: those parts are summed
        when they are sent, and the running sum stops."""
        for i in [i for i in self.sums if i >= first]:
            del self.sums[i]
        self.sum_at = -1

    def on_truncate(self, length: int) -> None:
        if self.broken:
            return
        if self.sum_at >= 0 and length != self.sum_at:
            self._unsum(min(length, self.sum_at) // self.part_size)
        if length < self.next_part * self.part_size:
            if self.session is not None and self.session.ordered:
                self._give_up("truncated below what was already sent")
                return
            # Every sent part from the new end on holds old bytes: resend those still needed.
            self.dirty.update(range(length // self.part_size, self.next_part))
        self.seq_end = min(self.seq_end, length) if length < self.seq_end else length

    def open(self) -> PartSession:
        """Open the session; one with a ``record`` is told to ``on_session`` before any part
        leaves (a note that fails aborts it: an upload nobody could find again is not begun)."""
        session = self._open_session()
        record = getattr(session, "record", None)
        if record is not None and self.on_session is not None:
            try:
                self.on_session(record, True)
            except BaseException:
                session.abort()
                raise
        self.session = session
        return session

    def _over(self, session: PartSession) -> None:
        record = getattr(session, "record", None)
        if record is not None and self.on_session is not None:
            try:
                self.on_session(record, False)
            except Exception as exc:  # noqa: BLE001 - an upload left in the journal is aborted again: harmless
                log.debug("could not note the end of an upload: %s", exc)

    def _abort(self, session: PartSession) -> None:
        """Abort ``session`` (on a pool thread); its record goes once the store dropped it."""
        if session.abort() is True:
            self._over(session)

    def _dispatch(self, index: int) -> bool:
        try:
            if self.session is None:
                self.open()
            self._wait_for_slot()
        except Exception as exc:  # noqa: BLE001 - the commit will upload the whole file
            self._give_up(f"could not start the upload ({exc})")
            return False
        if self.sum_at >= 0 and getattr(self.session, "checksum", None) != "crc32c":
            self._unsum(0)  # this session sums its parts otherwise
        self.futures[index] = self._submit(index, None, self.sums.pop(index, None))
        return True

    def _submit(self, index: int, total: int | None, crc: int | None) -> cf.Future[int]:
        future = self.pool.submit(self._send, index, total, crc)
        future.add_done_callback(self._acknowledged)
        return future

    def _acknowledged(self, future: cf.Future[int]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.sent += future.result()  # (an int's += under the GIL: callbacks may race)

    def _wait_for_slot(self) -> None:
        pending = [f for f in self.futures.values() if not f.done()]
        limit = 1 if self.session is not None and self.session.ordered else self.max_in_flight
        while len(pending) >= limit:
            interrupts.wait(pending, first=True)  # (a writer given a signal stops streaming here)
            pending = [f for f in pending if not f.done()]

    def _send(self, index: int, total: int | None, crc: int | None = None) -> int:
        """Send part ``index``; answers its size."""
        assert self.session is not None
        start = index * self.part_size
        size = self.part_size if total is None else max(0, min(self.part_size, total - start))
        send_range = getattr(self.session, "send_range", None)
        if send_range is not None:  # from the file: no part-sized bytes in memory
            if crc is not None:
                send_range(index, self.fd, start, size, total, crc32c=crc)
            else:
                send_range(index, self.fd, start, size, total)
            return size
        data = os.pread(self.fd, size, start)
        self.session.send(index, data, total)
        return size

    def _give_up(self, why: str) -> None:
        log.debug("streaming upload stops: %s", why)
        self.broken = True
        self._drain()
        if self.session is not None:
            session, self.session = self.session, None
            self.pool.submit(self._abort, session)

    def _drain(self) -> list[BaseException]:
        errors = []
        for f in list(self.futures.values()):
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - collected for the caller
                errors.append(exc)
        return errors

    def abort(self) -> None:
        """The file will not be committed through this stream (unlinked, renamed, discarded)."""
        if not self.broken:
            self._give_up("aborted")

    def finish(self, total: int) -> tuple[bool, ObjectVersion | None]:
        """Commit ``total`` bytes: (True, the new version if known), or (False, None) when the
        stream gave up or never started and the caller must upload the file whole."""
        if self.broken or self.session is None:
            self.abort()
            return False, None
        session = self.session
        call = interrupts.current()
        if call is not None:
            call.progress(lambda: self.sent, total)
        try:
            interrupts.wait(self.futures.values())  # the parts sent while it was written
        except InterruptedError:
            self._cancel(session)
            raise
        errors = self._drain()
        if errors or total == 0:
            self.broken = True
            self.session = None
            self.pool.submit(self._abort, session)
            if errors:
                raise errors[0]
            return False, None
        parts = -(-total // self.part_size)
        try:
            if session.ordered:
                for i in range(self.next_part, parts):
                    interrupts.check()
                    self.sent += self._send(i, total if i == parts - 1 else None)
            else:
                last_full = total % self.part_size == 0
                needed = [i for i in range(parts)
                          if i >= self.next_part or i in self.dirty or (i == parts - 1 and not last_full)]
                if self.sum_at == total and not last_full and getattr(session, "checksum", None) == "crc32c":
                    self.sums[parts - 1] = self._sum  # the tail, summed as it was written
                self._send_parallel(needed, total)
            version = session.complete(parts, total)
        except InterruptedError:
            self._cancel(session)
            raise
        except BaseException:
            self.broken = True
            self.session = None
            self.pool.submit(self._abort, session)
            raise
        self.broken = True  # done: a later commit of this file starts afresh
        self.session = None
        self._over(session)
        return True, version

    def _send_parallel(self, indexes: list[int], total: int) -> None:
        futures: list[cf.Future[int]] = []
        for i in indexes:
            pending = [f for f in futures if not f.done()]
            while len(pending) >= self.max_in_flight:
                interrupts.wait(pending, first=True)
                pending = [f for f in pending if not f.done()]
            futures.append(self._submit(i, total, self.sums.pop(i, None)))
            self.futures[i] = futures[-1]  # (what an interruption waits for before the abort)
        interrupts.wait(futures)
        for f in futures:
            f.result()

    def _cancel(self, session: PartSession) -> None:
        """The caller gave up (interrupted): no part more leaves; the session is aborted once
        the parts in flight are over (a part that lands after an abort would outlive it), on a
        thread of its own, so the caller is answered now. The staging file and its journal
        stay: the commit failed like any other, and is retried."""
        self.broken = True
        self.session = None
        in_flight = [f for f in self.futures.values() if not f.cancel() and not f.done()]
        log.info("upload interrupted by its caller after %d bytes; %d parts in flight finish, then it is aborted",
                 self.sent, len(in_flight))

        def abort_after() -> None:
            cf.wait(in_flight)
            try:
                self._abort(session)
            except Exception as exc:  # noqa: BLE001 - its journal names it: the retry or the next start aborts it
                log.warning("could not abort an interrupted upload: %s", exc)

        threading.Thread(target=abort_after, name="upload-abort", daemon=True).start()


def upload_file(path: str, open_session: Callable[[], PartSession], part_size: int,
                pool: cf.Executor, max_in_flight: int, on_session: SessionNote | None = None) -> ObjectVersion | None:
    """Upload a whole local file through a part session (parts in parallel where allowed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size
        stream = PartStream(fd, open_session, part_size, pool, max_in_flight, on_session)
        stream.open()
        return stream.finish(total)[1]
    finally:
        os.close(fd)
