"""Page-aligned chunk buffers, reused: a fetched chunk lands once, in memory the chunk cache
writes from with O_DIRECT and readers copy from.

A fresh 8 MiB allocation per chunk costs a page fault per 4 KiB page every time (2,048 a
chunk), and a copy into an aligned buffer before each O_DIRECT write; a pool of ``mmap``
buffers, touched once and reused, costs neither.

The rule that makes reuse safe is reference counting, nothing else. :meth:`BufferPool.take`
answers a ``memoryview`` (format ``B``, ``len()`` = the bytes asked for) of a ``ctypes`` array
laid over one pooled ``mmap``; every slice or view of it, whoever took it (the fetcher's
memory, a reader copying out of it, a disk write, a GET filling part of it), keeps that array
alive. The array's finalizer gives the ``mmap`` back to the pool, so a buffer is reused only
once no reference to any view of it is left anywhere: nobody can still read it or write it.
The pool never hands out the raw ``mmap``. A view caught in a reference cycle only delays the
buffer's return (until the collector runs); meanwhile the pool allocates a fresh one.

The pool keeps at most ``keep`` idle buffers (sized by the mount's memory budget); past that, a
returned buffer is unmapped. Buffers in use are bounded by whoever holds them (the fetcher's
budget), not here: ``take`` never blocks. :meth:`BufferPool.trim` unmaps the idle ones when the
mount has gone quiet, so a daemon on every node does not keep 200 MiB after one big read.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

PAGE = mmap.PAGESIZE


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping, in huge pages where the kernel gives them (THP ``madvise``
    mode): its first touch costs a fault per 2 MiB, not per 4 KiB page (2,048 for 8 MiB)."""
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # no THP in this kernel: small pages, as before
            pass
    return mm


class BufferPool:
    """Idle page-aligned buffers of ``size`` bytes, at most ``keep`` of them."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._idle: list[tuple[mmap.mmap, float]] = []  # with when each went idle, oldest first
        # Reentrant: a buffer's finalizer may run in any thread at any allocation, even one
        # made while this thread holds the lock (the cyclic collector).
        self._lock = threading.RLock()
        self.allocated = 0  # buffers mapped since the start (a count, for tests and status)
        self.reused = 0
        pool = self

        class _Array(ctypes.c_ubyte * size):  # type: ignore[misc, valid-type]
            """One loan of a pooled buffer: its finalizer returns the buffer."""

            def __del__(self) -> None:
                try:
                    pool._give_back(self._mm)  # type: ignore[attr-defined]
                except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to give back to
                    pass

        self._array = _Array

    def take(self, length: int) -> memoryview:
        """A writable view of ``length`` (<= ``size``) bytes at a page-aligned address, its
        contents undefined. Held by nobody else until every view derived from it is gone."""
        if not 0 <= length <= self.size:
            raise ValueError(f"a buffer of {length} bytes from a pool of {self.size}-byte buffers")
        with self._lock:
            mm = self._idle.pop()[0] if self._idle else None
            if mm is not None:
                self.reused += 1
            else:
                self.allocated += 1
        if mm is None:
            mm = _anonymous(self.size)
        array = self._array.from_buffer(mm)
        array._mm = mm
        return memoryview(array).cast("B")[:length]

    def _give_back(self, mm: mmap.mmap) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append((mm, time.monotonic()))
                return
        # Unmapped once the dying array's own export of it is released (right after this).

    def trim(self, idle_for: float = 0.0) -> int:
        """Unmap the buffers idle for at least ``idle_for`` seconds; answers how many."""
        cutoff = time.monotonic() - idle_for
        with self._lock:
            old = [mm for mm, since in self._idle if since <= cutoff]
            self._idle = [(mm, since) for mm, since in self._idle if since > cutoff]
        for mm in old:
            mm.close()
        return len(old)

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

