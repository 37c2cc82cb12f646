"""Reads of object versions: chunk lookup in the cache, parallel ranged fetches, sequential
readahead that grows and resets on a seek, single-flight.

An object is read in fixed-size chunks. A chunk comes from memory (chunks fetched ahead, or
read lately, within the mount's budget below), else the on-disk :class:`ChunkCache`, else the remote; concurrent readers of
one chunk share its fetch. While a handle reads sequentially, chunks ahead of it are fetched in
parallel by a bounded pool (one ranged GET each), the window doubling up to ``max_window``
chunks; any seek resets it. A reader that waits for a chunk nobody fetched yet (the first read,
a read after a seek) gets it as ``split`` parallel sub-range GETs: one stream of a loopback
object store delivers 8 MiB in about twice the time parallel streams do.

A handle that reads at random but densely (it has touched an eighth of a file's chunks: a model
loaded through mmap, tensor by tensor, out of file order) will read most of the file: its other
chunks are fetched in the background, in file order, by lanes that each fetch the next chunk once the last
one landed (half the prefetch workers; the rest stay for other readers), until the file is done
or the handle closed; only when the disk cache can hold the whole file twice over. Chunks the
disk cache has already are read into the page cache by the kernel instead (the warm load), only
while the memory the kernel could give (``MemAvailable``) holds the file twice over (the chunk
files' pages and the mapped file's): pages read ahead into a page cache too small for them are
evicted before they are read. At worst that fetches eight times what the reader had asked for already.

Memory is one byte budget for the whole mount (``memory_bytes``), not a window per handle:
every chunk a reader asked for ahead counts against it from the moment it is asked for until
the reader has read it, and a chunk fetched ahead is never dropped before it is read (it is
*held* for its reader). A reader whose next chunk does not fit asks for it on a later read: its
window shrinks while other readers hold the budget. Chunks already read are kept only while the
budget has room (least recently used go first), and chunks still queued for the disk cache stay
readable from memory until they are on disk. Beyond the budget: the chunks being fetched on
demand (one per reading thread) and the background sweep's fetches (half the workers).

Reads fill the caller's buffer (``read_into``: for FUSE, libfuse's reply buffer): one copy from
a chunk in memory, or one ``preadv`` of a cached chunk's file straight into it; ``read`` is
``read_into`` a new buffer, for callers that want ``bytes``.

Where the remote can read into a buffer it is given (``fetch_into``: S3 and GCS read the body
from the socket), a chunk is fetched into a page-aligned buffer from the fetcher's pool (buffers.py; a
split fetch's GETs each into their slice of it): the disk cache writes it with O_DIRECT from
there, readers copy out of it, and it goes back to the pool when the last reference to it is
gone (the chunk left memory, its disk write finished, no reader copying from it). The pool
keeps as many idle buffers as the budget, the demand fetches (one per worker) and the sweep
take; ``_Held.data`` is then a ``memoryview`` of the buffer, ``len()`` the chunk's size.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from marinfs.read.buffers import BufferPool
from marinfs.read.chunkcache import ChunkCache, ChunkKey
from marinfs.objects import ObjectRef
from marinfs.read.sharedcache import SharedTier
from marinfs.threadnames import name_current

log = logging.getLogger(__name__)


def mem_available() -> int | None:
    """The memory the kernel could give without swapping (free plus reclaimable page cache), in
    bytes; None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


Fetch = Callable[[str, int, int, Any], Any]  # (key, start, end, version) -> bytes or any buffer
FetchInto = Callable[[str, int, int, Any, memoryview], None]  # the same bytes, into the buffer given


@dataclass(eq=False)
class _Held:
    """A chunk in memory."""

    data: Any  # bytes, the buffer the remote answered (obstore's Bytes), or a pooled buffer's view
    held: bool  # fetched for a reader that has not read all of it yet: never evicted
    writing: bool  # queued for the disk cache: its memory is taken anyway, and not on disk yet
    served: int = 0  # bytes read from it; a reader that read them all releases it
    keep: bool = False  # fetched for random reads: cached through the page cache (ChunkCache.put)
    cost: int = 0  # what it occupies in the budget: its buffer's capacity, not only its bytes
    whole: bool = False  # its object's only chunk (a small file): see _done_with_locked
    stored: bool = False  # the disk cache has it
    crc32c: int | None = None  # its CRC-32C where the shared tier took it: the disk cache keeps it as is


class ChunkFetcher:
    """Shared by all handles of a mount: chunk sources, single-flight, the prefetch pool and
    the mount's memory budget."""

    def __init__(self, fetch: Fetch, cache: ChunkCache | None, chunk_size: int = 8 << 20,
                 workers: int = 8, memory_bytes: int = 64 << 20, split: int = 4,
                 fetch_into: FetchInto | None = None, shared: SharedTier | None = None) -> None:
        self.fetch = fetch
        # The second tier (sharedcache.py): a chunk not on this node's disk is looked for there
        # before the bucket, and one fetched from the bucket is published there.
        self.shared = shared
        self._sources = {"local": 0, "shared": 0, "bucket": 0}  # chunk bytes by where they came from
        self._sources_lock = threading.Lock()
        # With ``fetch_into``, a chunk is fetched into a pooled page-aligned buffer (buffers.py)
        # that the disk cache writes from and readers copy from: no allocation, no copy more.
        self.fetch_into = fetch_into
        self.cache = cache
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._inflight: dict[ChunkKey, Future[bytes]] = {}
        # The budget: chunks in memory (_used) plus chunks asked for ahead and not landed yet
        # (_reserved) stay within it; only chunks not held and not waiting for the disk are evicted.
        self.memory_bytes = max(memory_bytes, chunk_size)
        self._chunks: OrderedDict[ChunkKey, _Held] = OrderedDict()  # least recently used first
        self._used = 0
        self._reserved = 0
        self._hold: set[ChunkKey] = set()  # chunks a reader asked for and has not read through
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch",
                                        initializer=name_current)
        self.workers = workers
        # Sub-ranges of at least 1 MiB: smaller GETs cost more in requests than they save.
        self.split = max(1, min(split, chunk_size >> 20))
        self._split_pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="demand",
                                              initializer=name_current)
        # Chunks are written to the disk cache by their own threads: an O_DIRECT write waits for
        # the disk, and a fetch worker held by it is a GET not in flight. At most this many
        # writes wait (the chunks stay readable in memory meanwhile); past that, fetches wait.
        # A walker's next small files (fetch_ahead): their own threads, so that a walk never
        # takes the workers big files' readahead needs; this many GETs at once for every walker.
        self.walk_ahead = max(1, workers)
        self._walking = 0
        self._walk_pool = ThreadPoolExecutor(max_workers=self.walk_ahead, thread_name_prefix="walk-ahead",
                                             initializer=name_current)
        self._writes = threading.BoundedSemaphore(16)
        self._pending_writes = 0
        self._settled = threading.Condition()
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cache-write",
                                          initializer=name_current)
        # Idle buffers kept: as many bytes as the budget, the demand fetches (one per worker,
        # as many reading threads as that at most in practice) and the sweep's (half the
        # workers) take. A chunk waiting for the disk past the budget, or a reader's copy
        # in progress, takes a fresh buffer instead: bounded by those, never kept past that.
        self.buffers = BufferPool(chunk_size, self.memory_bytes + (workers + workers // 2) * chunk_size)
        self._last_read = time.monotonic()
        self.mem_available: Callable[[], int | None] = mem_available  # tests replace it

    def sweep_allowed(self, size: int) -> bool:
        """Whether the disk cache can keep a whole object of ``size`` bytes (twice over)."""
        return self.cache is not None and 2 * size <= self.cache.max_bytes

    def chunk_key(self, obj: ObjectRef, index: int) -> ChunkKey:
        return ChunkKey.of(obj, index, index * self.chunk_size)

    def _size(self, obj: ObjectRef, index: int) -> int:
        start = index * self.chunk_size
        return max(0, min(obj.size, start + self.chunk_size) - start)

    def _cost(self, size: int) -> int:
        """What a chunk of ``size`` bytes occupies in memory: the pooled buffer it lands in (its
        size class, buffers.py) when the remote fetches into one, else its bytes."""
        return self.buffers.capacity(size) if self.fetch_into is not None and size else size

    def _cost_of(self, data: Any) -> int:
        """What ``data`` (a landed chunk) occupies in memory: a pooled buffer's whole capacity."""
        if isinstance(data, memoryview) and isinstance(data.obj, ctypes.Array):
            return ctypes.sizeof(data.obj)
        return len(data)

    def read(self, obj: ObjectRef, index: int, offset: int, size: int, split: bool = True) -> bytes:
        """``size`` bytes at ``offset`` within chunk ``index`` as ``bytes`` (see read_into)."""
        buf = bytearray(size)
        self.read_into(obj, index, offset, memoryview(buf), split)
        return bytes(buf)

    def read_into(self, obj: ObjectRef, index: int, offset: int, dest: memoryview, split: bool = True) -> None:
        """Fill ``dest`` (writable bytes, within the chunk) with chunk ``index``'s bytes from
        ``offset`` on (blocking): one copy from the chunk in memory, or one read from its disk
        file, into ``dest``. The chunk is held in memory for the reader until all of it was read
        (or the reader releases it). A chunk nobody fetched yet is fetched in this thread, as
        ``split`` sub-ranges if asked (a first read or a seek: one GET per chunk otherwise, as
        readahead would have fetched it)."""
        size = len(dest)
        ck = self.chunk_key(obj, index)
        self._last_read = time.monotonic()  # a float stored: no lock needed (trim_idle reads it)
        with self._lock:
            entry = self._chunks.get(ck)
            if entry is not None:
                self._served_locked(ck, entry, size)
                data = entry.data
            else:
                data = None
                future = self._inflight.get(ck)
        if data is not None:
            dest[:] = memoryview(data)[offset:offset + size]
            return
        if future is None and self.cache is not None and self.cache.read_into(ck, dest, offset):
            self._count_source("local", size)
            return
        if future is None:
            future, owner = self._claim(ck, hold=True)  # a demand fetch is held for its reader too
            if owner:
                # Counted in the budget too (never refused: the reader waits for it), so that
                # readahead makes room for it instead of adding to it.
                size_ = self._cost(self._size(obj, index))
                with self._lock:
                    self._reserved += size_
                # A first read or a seek (split) is random access until shown otherwise.
                self._run(obj, index, ck, future, demand=split, reserved=size_, keep=split)  # in this thread
        data = future.result()
        with self._lock:
            entry = self._chunks.get(ck)
            if entry is not None and entry.data is data:
                self._served_locked(ck, entry, size)
        dest[:] = memoryview(data)[offset:offset + size]

    def _served_locked(self, ck: ChunkKey, entry: _Held, size: int) -> None:
        self._chunks.move_to_end(ck)
        entry.served += size
        if entry.held and entry.served >= len(entry.data):
            entry.held = False  # read through: in the page cache now, and on disk soon
            self._hold.discard(ck)
        self._done_with_locked(ck, entry)

    def _done_with_locked(self, ck: ChunkKey, entry: _Held) -> None:
        """A small file's only chunk leaves memory once it is on disk and no reader holds it (it
        was read through, or fetched ahead of a walker: then the disk serves its open, or the
        kernel itself through passthrough): a walk over thousands of small files would otherwise
        fill the budget with chunks never read from here again."""
        if (entry.whole and entry.stored and not entry.held and not entry.writing
                and self._chunks.get(ck) is entry):
            del self._chunks[ck]
            self._used -= entry.cost

    def ahead(self, obj: ObjectRef, index: int, load: bool = True) -> bool:
        """Fetch chunk ``index`` ahead of a sequential reader, held for it, if the mount's
        budget has room for it. False when it has not (nothing started): ask again later.
        ``load``: a chunk the disk cache has is loaded into memory (below); else the disk is
        only asked to read it ahead, for a reader that may not be sequential after all."""
        if index * self.chunk_size >= obj.size:
            return True
        ck = self.chunk_key(obj, index)
        with self._lock:
            entry = self._chunks.get(ck)
            if entry is not None or ck in self._inflight:
                if entry is not None and entry.served < len(entry.data):
                    entry.held = True
                self._hold.add(ck)
                return True
        # A chunk in the disk cache is loaded into memory ahead of the reader like a fetched one,
        # with O_DIRECT (ChunkCache.load_into): the disk fills the buffer, no page cache is filled
        # and read back, and the reader's reads are served from memory.
        cached = self.cache is not None and self.cache.contains(ck)
        if cached and not load:
            self.cache.advise(ck)  # type: ignore[union-attr]
            return True
        size = self._cost(self._size(obj, index))
        with self._lock:
            if not self._room_locked(size):
                return False
            self._reserved += size
            self._hold.add(ck)
        future, owner = self._claim(ck)
        if not owner:
            with self._lock:
                self._reserved -= size
            return True
        try:
            self._pool.submit(self._run, obj, index, ck, future, reserved=size, cached=cached)
        except BaseException:
            with self._lock:
                self._reserved -= size
                self._inflight.pop(ck, None)
            future.set_exception(RuntimeError("the mount is closing"))
            raise
        return True

    def prefetch(self, obj: ObjectRef, index: int) -> Future[None] | None:
        """For the sweep (a dense random reader): start getting chunk ``index`` in the
        background unless it is in memory or under way (not held, outside the budget); answers
        the task if one was started. A chunk not cached is fetched and cached through the page
        cache (random reads follow); a cached one is read into the page cache by the kernel, in
        file order and in large reads (ChunkCache.advise: a warm model load through mmap
        otherwise reads each chunk file from the disk in the small pieces its faults ask for),
        unless the memory available could not keep the object twice over."""
        if index * self.chunk_size >= obj.size:
            return None
        ck = self.chunk_key(obj, index)
        with self._lock:
            if ck in self._chunks or ck in self._inflight:
                return None
        if self.cache is not None and self.cache.contains(ck):
            available = self.mem_available()
            if available is not None and 2 * obj.size > available:
                return None  # the page cache cannot keep it: the faults read the disk themselves
            # In a worker, which waits until the chunk has been read: the lanes go at the disk's
            # pace (all of a file's reads submitted at once queue in front of the reader's own
            # faults) and a FUSE thread never waits for them.
            return self._pool.submit(self.cache.advise, ck, True)
        future, owner = self._claim(ck)
        if owner:
            return self._pool.submit(self._run, obj, index, ck, future, keep=True)
        return None

    def fetch_ahead(self, obj: ObjectRef) -> bool:
        """For a walker's next files (walkahead.py): fetch ``obj``'s first chunk ahead of any
        open of it, not held (memory may let it go once it is on disk), in the budget, at most
        ``walk_ahead`` at once. True if it is started, in memory, under way or on disk; False if
        there is no room now."""
        ck = self.chunk_key(obj, 0)
        with self._lock:
            if ck in self._chunks or ck in self._inflight:
                return True
        if self.cache is not None and self.cache.contains(ck):
            return True
        cost = self._cost(self._size(obj, 0))
        with self._lock:
            if self._walking >= self.walk_ahead or not self._room_locked(cost):
                return False
            self._walking += 1
            self._reserved += cost
        future, owner = self._claim(ck)
        if not owner:
            with self._lock:
                self._walking -= 1
                self._reserved -= cost
            return True

        def run() -> None:
            try:
                self._run(obj, 0, ck, future, reserved=cost)
            finally:
                with self._lock:
                    self._walking -= 1

        try:
            self._walk_pool.submit(run)
        except BaseException:
            with self._lock:
                self._walking -= 1
                self._reserved -= cost
                self._inflight.pop(ck, None)
            future.set_exception(RuntimeError("the mount is closing"))
            raise
        return True

    def release(self, obj: ObjectRef, indices: set[int] | range) -> None:
        """A reader no longer needs these chunks held for it (it moved elsewhere or closed)."""
        with self._lock:
            for index in indices:
                ck = self.chunk_key(obj, index)
                self._hold.discard(ck)
                entry = self._chunks.get(ck)
                if entry is not None:
                    entry.held = False
            self._trim_locked()

    def _room_locked(self, size: int) -> bool:
        """Evict chunks nobody holds until ``size`` more bytes fit in the budget."""
        while self._used + self._reserved + size > self.memory_bytes:
            if not self._evict_one_locked():
                return False
        return True

    def _trim_locked(self) -> None:
        while self._used + self._reserved > self.memory_bytes and self._evict_one_locked():
            pass

    def _evict_one_locked(self) -> bool:
        for ck, entry in self._chunks.items():
            if not entry.held and not entry.writing:
                del self._chunks[ck]
                self._used -= entry.cost
                return True
        return False

    def _claim(self, ck: ChunkKey, hold: bool = False) -> tuple[Future[bytes], bool]:
        with self._lock:
            if hold:
                self._hold.add(ck)
            future = self._inflight.get(ck)
            if future is not None:
                return future, False
            future = Future()
            entry = self._chunks.get(ck)
            if entry is not None:  # fetched by another thread since our first look
                future.set_result(entry.data)
                return future, False
            self._inflight[ck] = future
            return future, True

    def _fetch(self, obj: ObjectRef, start: int, end: int, split: bool) -> Any:
        """``[start, end)`` of ``obj``: as one GET, or as up to ``split`` parallel GETs (the
        first one in this thread), into one pooled buffer when the remote can fill one."""
        step = -(-(end - start) // self.split)
        if not split or self.split == 1 or step < (1 << 20):
            if self.fetch_into is None:
                return self.fetch(obj.key, start, end, obj.version)
            buf = self.buffers.take(end - start)
            self.fetch_into(obj.key, start, end, obj.version, buf)
            return buf
        return self._fetch_split(obj, start, end, step)

    def _fetch_tiered(self, obj: ObjectRef, start: int, end: int, split: bool) -> tuple[Any, int | None]:
        """``[start, end)`` of ``obj`` from the shared tier, else the bucket (see _fetch), and its
        CRC-32C where the tier took it (checked as it read it, or to publish it)."""
        crc = None
        if self.shared is None:
            data, source = self._fetch(obj, start, end, split), "bucket"
        else:
            take = self.buffers.take if self.fetch_into is not None else (lambda n: memoryview(bytearray(n)))
            data, source, crc = self.shared.get_checked(obj, start, end, lambda: self._fetch(obj, start, end, split),
                                                        take)
        self._count_source(source, len(data))
        return data, crc

    def _count_source(self, source: str, n: int) -> None:
        with self._sources_lock:
            self._sources[source] += n

    def sources(self) -> dict[str, int]:
        """Chunk bytes this mount got, by source: its disk cache (``local``: read by readers or
        loaded into memory), the shared tier, the bucket. The kernel's page cache and passthrough
        reads never reach the daemon: not counted."""
        with self._sources_lock:
            return dict(self._sources)

    def _fetch_split(self, obj: ObjectRef, start: int, end: int, step: int) -> Any:
        bounds = [(lo, min(end, lo + step)) for lo in range(start, end, step)]
        if self.fetch_into is None:
            rest = [self._split_pool.submit(self.fetch, obj.key, lo, hi, obj.version) for lo, hi in bounds[1:]]
            try:
                first = self.fetch(obj.key, *bounds[0], obj.version)
                return b"".join([first, *(f.result() for f in rest)])
            finally:
                for f in rest:
                    f.cancel()
        # Each GET fills its own slice of the chunk's buffer. A GET still running after
        # another failed holds its slice, so the buffer is not reused under it (buffers.py).
        buf = self.buffers.take(end - start)
        into = self.fetch_into
        rest = [self._split_pool.submit(into, obj.key, lo, hi, obj.version, buf[lo - start:hi - start])
                for lo, hi in bounds[1:]]
        try:
            lo, hi = bounds[0]
            into(obj.key, lo, hi, obj.version, buf[lo - start:hi - start])
            for f in rest:
                f.result()
            return buf
        finally:
            for f in rest:
                f.cancel()

    def _run(self, obj: ObjectRef, index: int, ck: ChunkKey, future: Future[bytes], demand: bool = False,
             reserved: int = 0, keep: bool = False, cached: bool = False) -> None:
        """Fetch chunk ``index`` (``cached``: load it from the disk cache, fetched only if it is not
        there after all) into memory, answer ``future`` with it, and queue it for the disk cache."""
        start = index * self.chunk_size
        end = min(obj.size, start + self.chunk_size)
        try:
            data = self._load(ck, end - start) if cached else None
            loaded = data is not None
            crc = None
            if data is None:
                data, crc = self._fetch_tiered(obj, start, end, split=demand)
            else:
                self._count_source("local", len(data))
            if len(data) != end - start:
                raise EOFError(f"short read of {obj.key}: {len(data)} of {end - start} bytes at {start}")
            with self._lock:
                entry = _Held(data, held=ck in self._hold, writing=self.cache is not None and not loaded, keep=keep,
                              cost=self._cost_of(data), whole=index == 0 and obj.size <= self.chunk_size,
                              stored=loaded, crc32c=crc)
                self._reserved -= reserved
                reserved = 0
                old = self._chunks.pop(ck, None)
                if old is not None:
                    self._used -= old.cost
                self._chunks[ck] = entry
                self._used += entry.cost
                self._trim_locked()
            future.set_result(data)  # waiting readers go on while the chunk is written to disk
            if self.cache is not None and not loaded:
                self._writes.acquire()
                with self._settled:
                    self._pending_writes += 1
                try:
                    self._writer.submit(self._put, ck, entry)
                except RuntimeError:  # shut down: the mount is going away
                    self._written(ck, entry)
                    self._wrote()
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiter
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            with self._lock:
                self._reserved -= reserved
                self._inflight.pop(ck, None)
                if future.exception() is not None:
                    self._hold.discard(ck)

    def _load(self, ck: ChunkKey, size: int) -> Any:
        """Chunk ``ck`` (``size`` bytes) from the disk cache into a pooled buffer; None if the
        cache no longer has it whole and sound."""
        assert self.cache is not None
        # O_DIRECT reads whole blocks: room for the tail's.
        buf = self.buffers.take(min(self.chunk_size, -(-size // 4096) * 4096))
        try:
            if self.cache.load_into(ck, buf) != size:
                return None
        except OSError as exc:  # the disk failed us: the remote still has it
            log.warning("loading cached chunk %s failed: %s", ck, exc)
            return None
        return buf[:size]

    def _put(self, ck: ChunkKey, entry: _Held) -> None:
        stored = False
        try:
            assert self.cache is not None
            stored = self.cache.put(ck, entry.data, keep=entry.keep, crc32c=entry.crc32c)  # may refuse (full disk): then memory is all we have
        except Exception as exc:  # noqa: BLE001 - a chunk not cached is only a later miss
            log.warning("caching chunk %s failed: %s", ck, exc)
        finally:
            self._written(ck, entry, stored)
            self._wrote()

    def _written(self, ck: ChunkKey, entry: _Held, stored: bool = False) -> None:
        with self._lock:
            entry.writing = False  # on disk (or refused): memory may let it go
            entry.stored = stored
            self._done_with_locked(ck, entry)
            self._trim_locked()

    def _wrote(self) -> None:
        self._writes.release()
        with self._settled:
            self._pending_writes -= 1
            self._settled.notify_all()

    def trim_idle(self, idle_for: float) -> bool:
        """Once no read has come for ``idle_for`` seconds, give the memory back: chunks nobody
        holds leave memory (they are on disk, or fetched again if asked for) and idle pooled
        buffers are unmapped. True if it trimmed (the mount was quiet)."""
        if time.monotonic() - self._last_read < idle_for:
            return False
        with self._lock:
            while self._evict_one_locked():
                pass
        self.buffers.trim()
        return True

    def memory(self) -> dict[str, int]:
        """What the budget holds (bytes in memory, asked for ahead, the limit) and what the buffer
        pool has mapped (now, at most since the start, idle now)."""
        with self._lock:
            out = {"used": self._used, "reserved": self._reserved, "limit": self.memory_bytes,
                   "chunks": len(self._chunks), "held": sum(e.held for e in self._chunks.values())}
        pool = self.buffers
        return {**out, "buffers_mapped": pool.mapped, "buffers_peak": pool.peak, "buffers_idle": pool.idle()}

    def drop_memory(self) -> None:
        """Forget every chunk in memory (tests: only the disk cache is left)."""
        with self._lock:
            self._chunks.clear()
            self._used = 0

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until every fetched chunk has been written to the disk cache (or refused)."""
        with self._settled:
            return self._settled.wait_for(lambda: self._pending_writes == 0, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._split_pool.shutdown(wait=True, cancel_futures=True)
        self._walk_pool.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)  # every fetched chunk is on disk before we stop
        if self.shared is not None:
            self.shared.close()  # what was fetched is published (for a bounded time)


class ObjectReader:
    """Serves ``read(size, offset)`` of one object version for one open handle."""

    def __init__(self, obj: ObjectRef, fetcher: ChunkFetcher, max_window: int = 32) -> None:
        self.obj = obj
        self._fetcher = fetcher
        self._max_window = max_window
        self._lock = threading.Lock()
        self._next = 0  # where a sequential reader reads next
        self._window = 0  # chunks to keep in flight ahead of the reader
        self._ahead = -1  # the last chunk index already asked for ahead of the reader
        self._asked: set[int] = set()  # chunks held for this reader (see ChunkFetcher.release)
        chunks = -(-obj.size // fetcher.chunk_size)
        # Random reads touching this many distinct chunks start the sweep (None: never).
        self._dense_at = max(4, chunks // 8) if chunks > 4 and fetcher.sweep_allowed(obj.size) else None
        self._touched: set[int] = set()
        self._sweep: int | None = None  # the next chunk the sweep asks for
        self.closed = False

    def read(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` as ``bytes`` (see read_into)."""
        if offset >= self.obj.size or size <= 0:
            return b""
        buf = bytearray(min(size, self.obj.size - offset))
        self.read_into(memoryview(buf), offset)
        return bytes(buf)

    def read_into(self, dest: memoryview, offset: int) -> int:
        """Fill ``dest`` (writable bytes) from ``offset`` on, up to the end of the object, each
        chunk it spans in turn; answers how many bytes were filled."""
        obj, cs = self.obj, self._fetcher.chunk_size
        size = len(dest)
        if offset >= obj.size or size <= 0:
            return 0
        end = min(offset + size, obj.size)
        first, last = offset // cs, (end - 1) // cs
        released: set[int] = set()
        with self._lock:
            obj = self.obj  # (moved() may change it: what this read asks for is of this one)
            fresh = not self._window  # a first read, or the first after a seek
            # The kernel issues readahead concurrently, so "sequential" tolerates reordering
            # within a chunk of where the reader was expected.
            if abs(offset - self._next) <= cs:
                self._window = min(self._max_window, max(1, self._window * 2))
            else:
                self._window = 0
                # A seek: what was held for this reader ahead of its old position is not needed.
                released, self._asked = self._asked, set()
            self._next = max(self._next, end) if self._window else end
            window = self._window
            # Ask only for chunks not asked for yet: each read moves the window by a chunk at most.
            start = max(last + 1, self._ahead + 1) if window else last + 1
            self._ahead = max(self._ahead, last + window) if window else last
            self._asked.update(range(first, last + 1 + window))
            start_sweep = self._dense(first, last, random=not window)
        released.difference_update(range(first, last + 1))
        if released:
            self._fetcher.release(obj, released)
        # A window of one chunk (the first read of a file, or one read near the last after a
        # seek: random reads land near each other now and then) is not yet a sequential reader:
        # its cached chunk is read ahead by the disk, not loaded whole; once the window has grown
        # past one chunk, it is. Not for a handle being swept: the sweep has the page cache
        # read the chunks already (an O_DIRECT load would read them from the disk a second time).
        load = window > 1 and self._sweep is None
        for index in range(start, last + 1 + window):
            if not self._fetcher.ahead(obj, index, load=load):
                # The mount's budget is taken: this reader's window ends here for now.
                with self._lock:
                    self._ahead = min(self._ahead, index - 1)
                    self._asked.difference_update(range(index, last + 1 + window))
                break
        if self.obj is not obj:  # moved meanwhile: what was held for the old name is let go
            self._fetcher.release(obj, range(first, last + 1 + window))
        if start_sweep:
            for _ in range(max(1, self._fetcher.workers // 2)):
                self._sweep_on()
        split = fresh  # mid-stream, a chunk the budget did not let us fetch ahead: one GET
        n = end - offset
        if first == last:
            self._fetcher.read_into(obj, first, offset - first * cs, dest[:n] if n < size else dest, split)
            return n
        pos = 0
        for index in range(first, last + 1):
            lo = max(offset, index * cs) - index * cs
            hi = min(end, (index + 1) * cs) - index * cs
            self._fetcher.read_into(obj, index, lo, dest[pos:pos + hi - lo], split)
            pos += hi - lo
        return n

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
        """One lane of the sweep: get the next chunk (fetched, or read ahead from the disk cache),
        then the next (half the prefetch workers run lanes, so other readers' readahead keeps the
        rest). Ends at the end of the file or when the handle is closed."""
        chunks = -(-self.obj.size // self._fetcher.chunk_size)
        while True:
            with self._lock:
                if self.closed or self._sweep is None or self._sweep >= chunks:
                    return
                index, self._sweep = self._sweep, self._sweep + 1
            try:
                task = self._fetcher.prefetch(self.obj, index)
            except RuntimeError:  # the pool was shut down: the mount is going away
                return
            if task is not None:
                task.add_done_callback(self._sweep_on)
                return

    def moved(self, obj: ObjectRef) -> None:
        """Read ``obj`` from now on: the same bytes under another name and version (a rename
        made on this node). What was held for this reader under the old name is let go; its
        readahead starts again (chunks are cached by name and version: fetched anew)."""
        with self._lock:
            old, asked = self.obj, self._asked
            self.obj, self._asked = obj, set()
            self._window, self._ahead = 0, -1
            self._sweep, self._touched = None, set()  # dense reads start it again, over the new name
        self._fetcher.release(old, asked)

    def close(self) -> None:
        """The handle is closed: no more background fetches for it."""
        with self._lock:
            self.closed = True
            asked, self._asked = self._asked, set()
        self._fetcher.release(self.obj, asked)
