"""Reads of one object version through ranged GETs.

The kernel sends reads of 128 KiB to 1 MiB; one GET each would pay the store's first-byte
latency every time. A handle therefore keeps the last block it fetched and, while reads stay
sequential, fetches ``block`` bytes at a time; a seek fetches only what the read touches
(at least ``min_fetch``), so random reads do not pull whole blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ObjectReader:
    """Serves ``read(size, offset)`` of an object of known ``size`` from ``fetch(start, end)``."""

    def __init__(self, size: int, fetch: Callable[[int, int], bytes], block: int = 8 << 20,
                 min_fetch: int = 1 << 20) -> None:
        self.size = size
        self._fetch = fetch
        self._block = block
        self._min_fetch = min_fetch
        self._lock = threading.Lock()
        self._buf = b""
        self._buf_start = 0
        self._next = 0  # where a sequential reader would read next

    def read(self, size: int, offset: int) -> bytes:
        if offset >= self.size or size <= 0:
            return b""
        end = min(offset + size, self.size)
        with self._lock:
            buf, start = self._buf, self._buf_start
            if not (start <= offset and end <= start + len(buf)):
                sequential = offset == self._next or offset == 0
                want = self._block if sequential else self._min_fetch
                fetch_end = min(self.size, max(end, offset + want))
                buf, start = self._fetch(offset, fetch_end), offset
                if len(buf) < end - offset:
                    raise EOFError(f"short read: wanted {end - offset} bytes at {offset}, got {len(buf)}")
                self._buf, self._buf_start = buf, start
            self._next = end
            return buf[offset - start : end - start]
