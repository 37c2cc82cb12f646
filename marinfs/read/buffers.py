"""Page-aligned chunk buffers, reused: a fetched chunk lands once, in memory the chunk cache
writes from with O_DIRECT and readers copy from.

A fresh 8 MiB allocation per chunk costs a page fault per 4 KiB page every time (2,048 a
chunk), and a copy into an aligned buffer before each O_DIRECT write; a pool of ``mmap``
buffers, touched once and reused, costs neither.

Buffers come in size classes, powers of two from 16 KiB up to the chunk size: a small file's
only chunk takes a buffer its own size, not a chunk-sized one. :meth:`BufferPool.capacity` is
what a buffer of a given length really occupies: the fetcher's memory budget counts that, not
the bytes asked for (counting 4 KiB for each small file's 8 MiB buffer took a walk over 4,000
small files to 7.8 GiB of RSS).

No class is advised into huge pages (``MADV_HUGEPAGE``) any more. A huge page saves a reused
buffer nothing measurable (re-touching 8 MiB: 0.45 against 0.51 ms) and a fresh one 2,044
faults, but it has to come from a free 2 MiB block, and on a VM that reports free memory to
its host (virtio free page reporting, as on the test machines) those blocks are exactly the
ones handed back: the first touch of a fresh 8 MiB huge-page buffer cost 60-130 ms there
against 3-4 ms in small pages, and a cold 1 GiB read through the fetcher (12 fresh buffers,
in-process) 0.97 s and 1.44 CPU-s against 0.20 s and 0.26.

The rule that makes reuse safe is reference counting, nothing else. :meth:`BufferPool.take`
answers a ``memoryview`` (format ``B``, ``len()`` = the bytes asked for) of a ``ctypes`` array
laid over one pooled ``mmap``; every slice or view of it, whoever took it (the fetcher's
memory, a reader copying out of it, a disk write, a GET filling part of it), keeps that array
alive. The array's finalizer gives the ``mmap`` back to the pool, so a buffer is reused only
once no reference to any view of it is left anywhere: nobody can still read it or write it.
The pool never hands out the raw ``mmap``. A view caught in a reference cycle only delays the
buffer's return (until the collector runs); meanwhile the pool allocates a fresh one.

The pool keeps idle buffers only while everything it has mapped, in use and idle, fits in
``keep_bytes`` (sized by the mount's memory budget), and idle small ones in an eighth of that;
past that, the buffers idle longest are unmapped. Buffers in use are bounded by whoever holds
them (the fetcher's budget), not here: ``take`` never blocks. :meth:`BufferPool.trim` unmaps the
idle ones when the mount has gone quiet, so a daemon on every node does not keep 200 MiB after
one big read.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

PAGE = mmap.PAGESIZE
SMALLEST = 16 << 10  # the smallest class: four pages
SMALL_BELOW = 2 << 20  # classes below this are small files' (kept idle in an eighth of the pool)


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping in small pages (see the module on huge pages)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _close(mm: mmap.mmap) -> None:
    """Unmap an idle buffer. One given back this very moment may still be exported by its dying
    array (its finalizer gives it back before the array is freed): it is unmapped once it is."""
    try:
        mm.close()
    except BufferError:
        pass


class BufferPool:
    """Page-aligned buffers of up to ``size`` bytes in size classes; idle ones kept while all
    mapped fit in ``keep_bytes``."""

    def __init__(self, size: int, keep_bytes: int) -> None:
        self.size = size
        self.keep_bytes = keep_bytes
        classes, c = [], SMALLEST
        while c < size:
            classes.append(c)
            c *= 2
        self.classes = [*classes, size]
        self._small = [c for c in classes if c < SMALL_BELOW]  # small files' classes (not the chunk's)
        # Idle buffers of each class, with when each went idle, oldest first (taken from the end).
        self._idle: dict[int, list[tuple[mmap.mmap, float]]] = {c: [] for c in self.classes}
        self._idle_bytes = 0
        # Reentrant: a buffer's finalizer may run in any thread at any allocation, even one
        # made while this thread holds the lock (the cyclic collector).
        self._lock = threading.RLock()
        self.allocated = 0  # buffers mapped since the start (a count, for tests and status)
        self.reused = 0
        self.mapped = 0  # bytes mapped now, in use or idle: the pool's real footprint
        self.peak = 0  # the most ``mapped`` has been
        self._arrays = {c: self._array_type(c) for c in self.classes}

    def _array_type(self, capacity: int) -> type:
        pool = self

        class _Array(ctypes.c_ubyte * capacity):  # type: ignore[misc, valid-type]
            """One loan of a pooled buffer: its finalizer returns the buffer."""

            def __del__(self) -> None:
                try:
                    pool._give_back(self._mm)  # type: ignore[attr-defined]
                except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to give back to
                    pass

        return _Array

    def capacity(self, length: int) -> int:
        """The bytes a buffer of ``length`` bytes occupies (its class)."""
        for c in self.classes:
            if length <= c:
                return c
        raise ValueError(f"a buffer of {length} bytes from a pool of {self.size}-byte buffers")

    def take(self, length: int) -> memoryview:
        """A writable view of ``length`` (<= ``size``) bytes at a page-aligned address, its
        contents undefined. Held by nobody else until every view derived from it is gone."""
        if length < 0:
            raise ValueError(f"a buffer of {length} bytes")
        cap = self.capacity(length)
        with self._lock:
            idle = self._idle[cap]
            mm = idle.pop()[0] if idle else None
            if mm is not None:
                self._idle_bytes -= cap
                self.reused += 1
            else:
                self.allocated += 1
                self.mapped += cap
                self.peak = max(self.peak, self.mapped)
        if mm is None:
            mm = _anonymous(cap)
        array = self._arrays[cap].from_buffer(mm)
        array._mm = mm
        return memoryview(array).cast("B")[:length]

    def _give_back(self, mm: mmap.mmap) -> None:
        cap = len(mm)
        with self._lock:
            self._idle[cap].append((mm, time.monotonic()))
            self._idle_bytes += cap
            gone = self._shrink_locked()
        for old in gone:  # (mm itself is unmapped once the dying array's export of it is released)
            if old is not mm:
                _close(old)

    def _shrink_locked(self) -> list[mmap.mmap]:
        """Let go of the buffers idle longest until everything mapped (in use and idle) fits in
        ``keep_bytes``, and idle buffers of the small classes in an eighth of it: a walk over
        small files leaves thousands of them idle when a big read needs big ones."""
        gone = []
        small = self._small
        while self._idle_bytes and (self.mapped > self.keep_bytes
                                    or sum(c * len(self._idle[c]) for c in small) > self.keep_bytes // 8):
            over = self.mapped > self.keep_bytes
            cap = min((c for c in (self.classes if over else small) if self._idle[c]),
                      key=lambda c: self._idle[c][0][1])
            gone.append(self._idle[cap].pop(0)[0])
            self._idle_bytes -= cap
            self.mapped -= cap
        return gone

    def trim(self, idle_for: float = 0.0) -> int:
        """Unmap the buffers idle for at least ``idle_for`` seconds; answers how many."""
        cutoff = time.monotonic() - idle_for
        old = []
        with self._lock:
            for cap, idle in self._idle.items():
                keep = [(mm, since) for mm, since in idle if since > cutoff]
                gone = [mm for mm, since in idle if since <= cutoff]
                self._idle[cap] = keep
                self._idle_bytes -= cap * len(gone)
                self.mapped -= cap * len(gone)
                old += gone
        for mm in old:
            _close(mm)
        return len(old)

    def idle(self) -> int:
        with self._lock:
            return sum(len(idle) for idle in self._idle.values())
