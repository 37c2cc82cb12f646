"""Directory listings fetched ahead of need, on a few background threads.

On an object store two common patterns cost one serial request per step: ``stat`` of many files
of one directory (a HEAD each) and ``find`` (a LIST per directory). So a directory whose
children keep missing the stat cache is listed once in the background (lookups go on with HEADs
meanwhile and are answered from the listing once it lands), and when a walker descends into a
subdirectory, the other subdirectories of its parent are listed ahead of it; a listing that keeps
answering a writer's lookups "missing" is listed again before it expires. Lookups never wait
for these listings; a readdir of a directory whose listing is in flight waits for it instead of
listing again (single flight).

A listing that one of our own changes in its directory overtook while it was in flight is
dropped (MetadataCache.begin_listing), so it never hides our writes.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

from cachetools import TTLCache

from marinfs.meta.metadata import MetadataCache
from marinfs.objects import ObjectInfo
from marinfs.remote import Remote
from marinfs.threadnames import name_current

log = logging.getLogger(__name__)

GRACE = 0.15  # seconds a lookup may wait for its directory's listing, from the listing's start


class ListingPrefetcher:
    """Single-flight background listings: at most one per directory, ``max_pending`` in all."""

    def __init__(self, remote: Remote, metadata: MetadataCache, workers: int = 3, misses: int = 3,
                 ahead: int = 64, max_pending: int = 256) -> None:
        self._remote, self._metadata = remote, metadata
        self.misses, self.ahead, self.max_pending = misses, ahead, max_pending
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="marinfs-list", initializer=name_current)
        self._lock = threading.RLock()  # reentrant: a done callback can run inside schedule()
        self._pending: dict[str, Future[list[ObjectInfo] | None]] = {}
        self._since: dict[str, float] = {}  # when each listing in _pending was asked for
        self._closed = False
        ttl = metadata.list_ttl or metadata.ttl or 1.0
        # Directory -> names whose lookups missed the cache there, since the first one's TTL
        # began: distinct names, so a poll of one status file never lists its directory.
        self._missed: TTLCache[str, set[str]] = TTLCache(4096, ttl)
        # Directories whose last listing was dropped as overtaken: we are writing there, and
        # listing again at once would likely be wasted too.
        self._cooldown: TTLCache[str, bool] = TTLCache(4096, ttl)
        # Parent -> (its subdirectories not listed yet, those listed ahead of the walker).
        self._walks: TTLCache[str, tuple[deque[str], set[str]]] = TTLCache(256, ttl)

    def note_miss(self, key: str) -> None:
        """A lookup of ``key`` goes to the remote: the ``misses``-th in its directory lists it."""
        parent = posixpath.dirname(key)
        with self._lock:
            names = self._missed.get(parent)
            if names is None:
                names = self._missed[parent] = set()
            names.add(key)
            if len(names) < self.misses:
                return
            del self._missed[parent]
        self.schedule(parent)

    def created(self, key: str) -> None:
        """``key`` was made here where the remote had nothing: a writer creating files in its
        directory (``tar -x``, ``cp -r``, ``git clone`` over an existing tree, where no mkdir of
        ours told us the directory was empty). The directory is listed at once, so the next
        names' lookups wait a moment for that one LIST (``in_flight``) rather than each paying
        a HEAD, a LIST and a link's HEAD: three round trips a name. A poll of a missing name
        creates nothing: it never lists."""
        self.schedule(posixpath.dirname(key))

    def in_flight(self, key: str) -> bool:
        """Wait for the listing of ``key`` in flight, if one is and began less than ``GRACE``
        ago: True if it landed (a lookup in it is then answered from the cache). A small
        directory's listing lands within it; a big one's does not, and lookups go on with their
        own requests meanwhile, never waiting more than ``GRACE`` for a listing in all."""
        with self._lock:
            future = self._pending.get(key)
            since = self._since.get(key, 0.0)
        left = since + GRACE - time.monotonic()
        if future is None or left <= 0:
            return False
        try:
            return future.result(left) is not None
        except Exception:  # noqa: BLE001 - a failed or slow listing: the lookup asks itself
            return False

    def walked_into(self, key: str) -> None:
        """A readdir of ``key``: list its parent's other subdirectories ahead of the walker, up
        to ``ahead`` at once, one more for each one it reaches (only while the parent's listing
        is fresh: a walk, not a poll of one directory)."""
        if not key:
            return
        parent = posixpath.dirname(key)
        with self._lock:
            walk = self._walks.get(parent)
            if walk is not None:
                if key in walk[1]:  # reached one we listed ahead: keep the window full
                    walk[1].discard(key)
                    self._start(walk, 1)
                return
        siblings = self._metadata.get_listing(parent)
        if siblings is None:
            return
        walk = (deque(c.name for c in siblings if c.is_dir and c.name != key), set())
        with self._lock:
            self._walks[parent] = walk
            self._start(walk, self.ahead)

    def _start(self, walk: tuple[deque[str], set[str]], n: int) -> None:
        todo, started = walk
        while todo and n > 0:
            name = todo.popleft()
            if self.schedule(name):
                started.add(name)
                n -= 1

    def keep_fresh(self, key: str) -> None:
        """A lookup was answered 'missing' from ``key``'s listing (a writer creating files there:
        ``tar -x``, ``rsync``): once the listing is past half its TTL it is listed again in the
        background, so the writer's lookups never find it expired (each would then cost a HEAD
        of the name and of its link object, and the third a LIST)."""
        age = self._metadata.listing_age(key)
        if age is not None and age >= self._metadata.list_ttl / 2:
            self.schedule(key, refresh=True)

    def schedule(self, key: str, refresh: bool = False) -> bool:
        """Start a background listing of ``key`` unless it is cached (``refresh``: even so), in
        flight or over the cap."""
        if not refresh and self._metadata.has_listing(key):
            return False
        with self._lock:
            if (self._closed or key in self._pending or key in self._cooldown
                    or len(self._pending) >= self.max_pending):
                return False
            future = self._pool.submit(self._list, key)
            self._pending[key] = future
            self._since[key] = time.monotonic()
            future.add_done_callback(partial(self._done, key))
            return True

    def _list(self, key: str) -> list[ObjectInfo] | None:
        token = self._metadata.begin_listing(key)
        try:
            children = self._remote.list(key)
        except BaseException:
            if self._metadata.end_listing(key, token, None):
                raise  # still what a readdir waiting for it would get
            return None
        if self._metadata.end_listing(key, token, children):
            # As cached: a readdir waiting for it sees our own changes made meanwhile.
            return self._metadata.get_listing(key) or children
        with self._lock:
            self._cooldown[key] = True
        return None

    def _done(self, key: str, future: Future[list[ObjectInfo] | None]) -> None:
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
                self._since.pop(key, None)
        if not future.cancelled() and future.exception() is not None:
            log.debug("background listing of %r failed: %s", key, future.exception())

    def wait(self, key: str) -> list[ObjectInfo] | None:
        """The listing of ``key`` in flight, once it lands; None if there is none (or it was
        still queued, or overtaken by our own change): then the caller lists it itself."""
        with self._lock:
            future = self._pending.get(key)
        if future is None or future.cancel():
            return None
        children = future.result()  # its error, if it failed, is what our own listing would get
        return None if children is None else list(children)

    def drain(self) -> None:
        """Wait until no listing is in flight (tests; a listing in flight starts no other)."""
        while True:
            with self._lock:
                futures = list(self._pending.values())
            if not futures:
                return
            wait(futures)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
