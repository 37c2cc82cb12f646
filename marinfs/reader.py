"""Reads of object versions: chunk lookup in the cache, parallel ranged fetches, sequential
readahead that grows and resets on a seek, single-flight.

An object is read in fixed-size chunks. A chunk comes from the small in-memory LRU of recently
fetched chunks, else the on-disk :class:`ChunkCache`, else the remote; concurrent readers of
one chunk share its fetch. While a handle reads sequentially, chunks ahead of it are fetched in
parallel by a bounded pool (one ranged GET each), the window doubling up to ``max_window``
chunks; any seek resets it. A reader that waits for a chunk nobody fetched yet (the first read,
a read after a seek) gets it as ``split`` parallel sub-range GETs: one stream of a loopback
object store delivers 8 MiB in about twice the time parallel streams do.

A handle that reads at random but densely (it has touched an eighth of a file's chunks: a model
loaded through mmap, tensor by tensor, out of file order) will read most of the file: its other
chunks are fetched in the background, in file order, by lanes that each fetch the next chunk once the last
one landed (half the prefetch workers; the rest stay for other readers), until the file is done
or the handle closed; only when the disk cache can hold the whole file twice over. At worst
that fetches eight times what the reader had asked for already.

Memory stays bounded: in-flight fetches are at most ``workers`` chunks (plus one split demand
chunk per reading thread) and the memory LRU is capped in bytes; without a disk cache the
readahead window is capped to what that LRU holds, so prefetched chunks are not evicted before
they are read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cachetools import LRUCache

from marinfs.chunkcache import ChunkCache, ChunkKey
from marinfs.objects import ObjectRef

log = logging.getLogger(__name__)


Fetch = Callable[[str, int, int, Any], bytes]  # (key, start, end, version) -> bytes


class ChunkFetcher:
    """Shared by all handles of a mount: chunk sources, single-flight and the prefetch pool."""

    def __init__(self, fetch: Fetch, cache: ChunkCache | None, chunk_size: int = 8 << 20,
                 workers: int = 8, memory_bytes: int = 64 << 20, split: int = 4) -> None:
        self.fetch = fetch
        self.cache = cache
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._inflight: dict[ChunkKey, Future[bytes]] = {}
        self._memory: LRUCache[ChunkKey, bytes] = LRUCache(maxsize=max(memory_bytes, chunk_size), getsizeof=len)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch")
        self.workers = workers
        # Sub-ranges of at least 1 MiB: smaller GETs cost more in requests than they save.
        self.split = max(1, min(split, chunk_size >> 20))
        self._split_pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="demand")
        # Chunks are written to the disk cache by their own threads: an O_DIRECT write waits for
        # the disk, and a fetch worker held by it is a GET not in flight. At most this many
        # writes wait (the chunks are in the memory LRU meanwhile); past that, fetches wait.
        self._writes = threading.BoundedSemaphore(16)
        self._pending_writes = 0
        self._settled = threading.Condition()
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cache-write")
        # Readahead beyond what the memory LRU holds would evict chunks before they are read
        # when there is no disk cache to keep them.
        self.window_cap = max(1, self._memory.maxsize // chunk_size // 2) if cache is None else None

    def sweep_allowed(self, size: int) -> bool:
        """Whether the disk cache can keep a whole object of ``size`` bytes (twice over)."""
        return self.cache is not None and 2 * size <= self.cache.max_bytes

    def chunk_key(self, obj: ObjectRef, index: int) -> ChunkKey:
        return ChunkKey.of(obj, index)

    def read(self, obj: ObjectRef, index: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` within chunk ``index`` (blocking)."""
        ck = self.chunk_key(obj, index)
        with self._lock:
            data = self._memory.get(ck)
            future = self._inflight.get(ck) if data is None else None
        if data is not None:
            return data[offset:offset + size]
        if future is None and self.cache is not None:
            cached = self.cache.read(ck, offset, size)
            if cached is not None:
                return cached
        if future is None:
            future, owner = self._claim(ck)
            if owner:
                self._run(obj, index, ck, future, demand=True)  # in this thread, split
        return future.result()[offset:offset + size]

    def prefetch(self, obj: ObjectRef, index: int, advise: bool = True) -> Future[None] | None:
        """Start fetching chunk ``index`` in the background unless it is cached or under way;
        answers the background task if one was started."""
        if index * self.chunk_size >= obj.size:
            return None
        ck = self.chunk_key(obj, index)
        with self._lock:
            if ck in self._memory or ck in self._inflight:
                return None
        if self.cache is not None and self.cache.contains(ck):
            if advise:
                self.cache.advise(ck)  # a warm read: have the disk read the chunk ahead too
            return None
        future, owner = self._claim(ck)
        if owner:
            return self._pool.submit(self._run, obj, index, ck, future)
        return None

    def _claim(self, ck: ChunkKey) -> tuple[Future[bytes], bool]:
        with self._lock:
            future = self._inflight.get(ck)
            if future is not None:
                return future, False
            future = Future()
            data = self._memory.get(ck)
            if data is not None:  # fetched by another thread since our first look
                future.set_result(data)
                return future, False
            self._inflight[ck] = future
            return future, True

    def _fetch_split(self, obj: ObjectRef, start: int, end: int) -> bytes:
        """``[start, end)`` as up to ``split`` parallel GETs, the first one in this thread."""
        step = -(-(end - start) // self.split)
        if self.split == 1 or step < (1 << 20):
            return self.fetch(obj.key, start, end, obj.version)
        bounds = [(lo, min(end, lo + step)) for lo in range(start, end, step)]
        rest = [self._split_pool.submit(self.fetch, obj.key, lo, hi, obj.version) for lo, hi in bounds[1:]]
        try:
            first = self.fetch(obj.key, *bounds[0], obj.version)
            return b"".join([first, *(f.result() for f in rest)])
        finally:
            for f in rest:
                f.cancel()

    def _run(self, obj: ObjectRef, index: int, ck: ChunkKey, future: Future[bytes], demand: bool = False) -> None:
        start = index * self.chunk_size
        end = min(obj.size, start + self.chunk_size)
        try:
            data = self._fetch_split(obj, start, end) if demand else self.fetch(obj.key, start, end, obj.version)
            if len(data) != end - start:
                raise EOFError(f"short read of {obj.key}: {len(data)} of {end - start} bytes at {start}")
            with self._lock:
                self._memory[ck] = data
            future.set_result(data)  # waiting readers go on while the chunk is written to disk
            if self.cache is not None:
                self._writes.acquire()
                with self._settled:
                    self._pending_writes += 1
                try:
                    self._writer.submit(self._put, ck, data)
                except RuntimeError:  # shut down: the mount is going away
                    self._wrote()
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiter
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            with self._lock:
                self._inflight.pop(ck, None)

    def _put(self, ck: ChunkKey, data: bytes) -> None:
        try:
            assert self.cache is not None
            self.cache.put(ck, data)  # may refuse (full disk): then memory is all we have
        except Exception as exc:  # noqa: BLE001 - a chunk not cached is only a later miss
            log.warning("caching chunk %s failed: %s", ck, exc)
        finally:
            self._wrote()

    def _wrote(self) -> None:
        self._writes.release()
        with self._settled:
            self._pending_writes -= 1
            self._settled.notify_all()

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until every fetched chunk has been written to the disk cache (or refused)."""
        with self._settled:
            return self._settled.wait_for(lambda: self._pending_writes == 0, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._split_pool.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)  # every fetched chunk is on disk before we stop


class ObjectReader:
    """Serves ``read(size, offset)`` of one object version for one open handle."""

    def __init__(self, obj: ObjectRef, fetcher: ChunkFetcher, max_window: int = 32) -> None:
        self.obj = obj
        self._fetcher = fetcher
        cap = fetcher.window_cap
        self._max_window = max_window if cap is None else min(max_window, cap)
        self._lock = threading.Lock()
        self._next = 0  # where a sequential reader reads next
        self._window = 0  # chunks to keep in flight ahead of the reader
        self._ahead = -1  # the last chunk index already asked for ahead of the reader
        chunks = -(-obj.size // fetcher.chunk_size)
        # Random reads touching this many distinct chunks start the sweep (None: never).
        self._dense_at = max(4, chunks // 8) if chunks > 4 and fetcher.sweep_allowed(obj.size) else None
        self._touched: set[int] = set()
        self._sweep: int | None = None  # the next chunk the sweep asks for
        self.closed = False

    def read(self, size: int, offset: int) -> bytes:
        obj, cs = self.obj, self._fetcher.chunk_size
        if offset >= obj.size or size <= 0:
            return b""
        end = min(offset + size, obj.size)
        first, last = offset // cs, (end - 1) // cs
        with self._lock:
            # The kernel issues readahead concurrently, so "sequential" tolerates reordering
            # within a chunk of where the reader was expected.
            if abs(offset - self._next) <= cs:
                self._window = min(self._max_window, max(1, self._window * 2))
            else:
                self._window = 0
            self._next = max(self._next, end) if self._window else end
            window = self._window
            # Ask only for chunks not asked for yet: each read moves the window by a chunk at most.
            start = max(last + 1, self._ahead + 1) if window else last + 1
            self._ahead = max(self._ahead, last + window) if window else last
            start_sweep = self._dense(first, last, random=not window)
        for index in range(start, last + 1 + window):
            self._fetcher.prefetch(obj, index)
        if start_sweep:
            for _ in range(max(1, self._fetcher.workers // 2)):
                self._sweep_on()
        if first == last:
            return self._fetcher.read(obj, first, offset - first * cs, end - offset)
        parts = []
        for index in range(first, last + 1):
            lo = max(offset, index * cs) - index * cs
            hi = min(end, (index + 1) * cs) - index * cs
            parts.append(self._fetcher.read(obj, index, lo, hi - lo))
        return b"".join(parts)

    def _dense(self, first: int, last: int, random: bool) -> bool:
        """Count the chunks random reads touched; True once, when the sweep should start."""
        if self._dense_at is None or self._sweep is not None or not random:
            return False
        self._touched.update(range(first, last + 1))
        if len(self._touched) < self._dense_at:
            return False
        self._sweep, self._touched = 0, set()
        return True

    def _sweep_on(self, _done: object = None) -> None:
        """One lane of the sweep: fetch the next chunk not cached yet, then the next (half the
        prefetch workers run lanes, so other readers' readahead keeps the rest). Ends at the end
        of the file or when the handle is closed."""
        chunks = -(-self.obj.size // self._fetcher.chunk_size)
        while True:
            with self._lock:
                if self.closed or self._sweep is None or self._sweep >= chunks:
                    return
                index, self._sweep = self._sweep, self._sweep + 1
            try:
                task = self._fetcher.prefetch(self.obj, index, advise=False)
            except RuntimeError:  # the pool was shut down: the mount is going away
                return
            if task is not None:
                task.add_done_callback(self._sweep_on)
                return

    def close(self) -> None:
        """The handle is closed: no more background fetches for it."""
        with self._lock:
            self.closed = True
