"""Stat and listing cache with TTLs and a negative cache.

A listing fills the stat cache, so ``ls -l`` of N objects costs one LIST and no HEADs. Our own
writes invalidate what they change, so the writing node reads its writes at once; other nodes
see them when their TTL expires.
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections.abc import Callable, Iterable

from cachetools import TTLCache

from marinfs.remote import ObjectInfo


class MetadataCache:
    """Thread-safe TTL caches of stats, listings and known-missing keys.

    ``timer`` is injectable so TTL tests need no sleeps. A TTL of 0 disables that cache.
    """

    def __init__(self, ttl: float = 5.0, negative_ttl: float = 1.0, maxsize: int = 200_000,
                 timer: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self._stats: TTLCache[str, ObjectInfo] = TTLCache(maxsize, ttl or 1e-9, timer=timer)
        self._listings: TTLCache[str, tuple[str, ...]] = TTLCache(max(1, maxsize // 10), ttl or 1e-9, timer=timer)
        self._missing: TTLCache[str, bool] = TTLCache(maxsize, negative_ttl or 1e-9, timer=timer)

    def get_stat(self, key: str) -> ObjectInfo | None:
        with self._lock:
            return self._stats.get(key)

    def is_missing(self, key: str) -> bool:
        with self._lock:
            return self._missing.get(key, False)

    def put_stat(self, info: ObjectInfo) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            self._stats[info.name] = info
            self._missing.pop(info.name, None)

    def put_missing(self, key: str) -> None:
        if self.negative_ttl <= 0:
            return
        with self._lock:
            self._missing[key] = True
            self._stats.pop(key, None)

    def get_listing(self, key: str) -> list[ObjectInfo] | None:
        """The cached children of ``key``, only if every child's stat is still cached too."""
        with self._lock:
            names = self._listings.get(key)
            if names is None:
                return None
            children = []
            for name in names:
                info = self._stats.get(posixpath.join(key, name) if key else name)
                if info is None:
                    return None
                children.append(info)
            return children

    def put_listing(self, key: str, children: Iterable[ObjectInfo]) -> None:
        if self.ttl <= 0:
            return
        children = list(children)
        with self._lock:
            for info in children:
                self._stats[info.name] = info
                self._missing.pop(info.name, None)
            self._listings[key] = tuple(posixpath.basename(info.name) for info in children)

    def invalidate(self, key: str) -> None:
        """Forget ``key`` and its parent's listing (its entry may have appeared or gone)."""
        with self._lock:
            self._stats.pop(key, None)
            self._missing.pop(key, None)
            self._listings.pop(key, None)
            self._listings.pop(posixpath.dirname(key), None)

    def invalidate_tree(self, key: str) -> None:
        """Forget ``key`` and everything below it (directory renames and removals)."""
        prefix = key + "/" if key else ""
        with self._lock:
            for cache in (self._stats, self._missing, self._listings):
                for name in [n for n in list(cache.keys()) if n == key or n.startswith(prefix)]:
                    cache.pop(name, None)
            self._listings.pop(posixpath.dirname(key), None)

    def clear(self) -> None:
        with self._lock:
            self._stats.clear()
            self._listings.clear()
            self._missing.clear()
