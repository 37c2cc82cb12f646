"""Request counters: what a remote asked of its store, by kind, and the bytes it moved (the
numbers `marinfs status`, the metrics and the benchmarks' request counts come from)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class RequestStats:
    """Counts remote requests by kind (list, head, get, put, part, copy, delete; patch: a GCS
    metadata PATCH; setattr: local metadata syscalls), failures and bytes moved; thread-safe,
    resettable by tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

        self.errors: Counter[str] = Counter()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def add_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def add_bytes(self, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def count(self, kind: str) -> int:
        with self._lock:
            return self.counts[kind]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.counts), "errors": dict(self.errors),
                    "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.errors.clear()
            self.bytes_in = self.bytes_out = 0
