"""On-disk chunk store: bounded size, LRU eviction, checksums, atomic writes, survives restarts.

The chunks of one object version live in one sparse file, the version's data file
(``data/ab/<objhash>``, the hash of (remote URL, version)), each at its offset in the object, so
a version cached whole is an ordinary file holding the object (what FUSE passthrough needs:
fs.py). Each chunk is recorded by an empty file named for it and the data's checksum,
``chunks/ab/<objhash>-<index>-c<crc32c>+<offset>+<size>`` (CRC-32C, hardware-accelerated: a
quarter of the CPU of zlib's CRC-32 here), made only once its bytes are written, so a crash or a
full disk never leaves a chunk that looks present. A record's name says which checksum it holds
(zlib CRC-32 where google-crc32c is missing: 8 hex digits, no "c"). Chunks of older daemons, a
file each (``<objhash>-<index>-<crc>``, no ``+``), do not say the chunk size they were cut with,
so after a ``--chunk-size`` change they would stand for other bytes: they are dropped at start
and fetched again, never misread. A new version of an object has a new hash, so it can never be
served old bytes.

This module is the cache's front door, ``ChunkCache`` (what reader.py, fs.py and the daemon
call): lookups, reads, writes, whole versions and the start's scan, tied together under one
lock, ``ChunkCache._lock``, which guards every table of its ``ChunkIndex`` (the entries, the
bytes they count, data files, kept descriptors, pins), its counters, and its own
``_verifying``, ``_verifier`` and ``_closed``. The rooms behind it: cachedir.py (the directory's
layout, record names, its lock, `marinfs cache`'s usage and wipe), chunkio.py (checksums,
``O_DIRECT`` writes, whole reads), chunkindex.py (the LRU index, its bound and eviction). What
other modules import from them is imported here too, so ``from marinfs.read.chunkcache import ...``
works as before the split.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from marinfs.read.cachedir import (acquire_lock, chunk_size_of, chunks_dir, data_dir, data_file, disk_usage, lock_holder,
                              parse_record, record_name, staging_dir, stats_file, unfinished, wipe)
from marinfs.read.chunkindex import CacheStats, ChunkIndex, ChunkKey, Entry, KeptFd, punch_region
from marinfs.read.chunkio import (ALIGN, HAS_CRC32C, Buffer, DirectIO, aligned_address, checksum_at, read_whole,
                             readahead_limit)
from marinfs.threadnames import name_current

__all__ = ["Buffer", "CacheStats", "ChunkCache", "ChunkKey", "acquire_lock", "chunk_size_of", "chunks_dir",
           "data_dir", "disk_usage", "lock_holder", "staging_dir", "stats_file", "wipe"]

log = logging.getLogger(__name__)


class ChunkCache:
    """The chunk store of one cache directory. Thread-safe: one lock, ``_lock``, guards every
    table, its index's included; disk I/O is done outside it, but for eviction's unlinks and
    hole punches (chunkindex.py).

    Only one daemon may use a cache directory at a time: a second one is refused (lock file),
    because two LRU indexes over one directory would evict each other's chunks blindly.

    A version whose every chunk is cached is an ordinary file holding the whole object, which
    the kernel can read by itself (FUSE passthrough: fs.py, ``pin``).

    The last data files read keep a descriptor open (``OPEN_FILES`` of them): a mapped file's
    faults read 4 KiB at a time, and an ``open`` and ``close`` per read cost as much as the
    read. One is closed when its file leaves the set, once no read is using it (never closed
    under a read: its number could be reused by another file).
    """

    OPEN_FILES = 64

    def __init__(self, cache_dir: Path, max_bytes: int, min_free_bytes: int = 0,
                 lock: bool = True, chunk_size: int = 8 << 20) -> None:
        self.dir = chunks_dir(cache_dir)
        self.data = data_dir(cache_dir)
        self.chunk_size = chunk_size  # where chunk N starts, for keys that do not say (ChunkKey.start)
        self.stats = CacheStats()  # GUARDED_BY(_lock)
        self._lock = threading.Lock()
        # Every table of the index (entries, bytes, data files, kept descriptors, pins, ...) is
        # GUARDED_BY(_lock): chunkindex.py.
        self._index = ChunkIndex(self.dir, max_bytes, min_free_bytes, self.stats)
        # GUARDED_BY(_lock): whole versions whose checksums a thread of its own is checking (verify_later).
        self._verifying: set[str] = set()
        self._verifier: ThreadPoolExecutor | None = None  # GUARDED_BY(_lock)
        self._closed = False  # GUARDED_BY(_lock)
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(cache_dir, 0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        self.data.mkdir(exist_ok=True, mode=0o700)
        self._io = DirectIO(self.dir)  # no lock: its flags only fall to False, its buffers are per thread
        self._advise_step = readahead_limit(self.dir)  # what one WILLNEED reads (advise)
        self._lock_fd: int | None = None
        if lock:
            self._lock_fd = acquire_lock(cache_dir)
        self._load()

    @property
    def max_bytes(self) -> int:
        return self._index.max_bytes

    @property
    def min_free_bytes(self) -> int:
        return self._index.min_free_bytes

    @property
    def used(self) -> int:
        """Bytes of the cached chunks and of those being written (read without the lock: a
        moment's value)."""
        return self._index.used

    # -- startup -------------------------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the index from disk, oldest first; drop leftovers, bytes no marker records,
        and excess."""
        found: list[tuple[int, tuple[str, int], Entry]] = []  # (last use, key, entry)
        have: dict[Path, bool] = {}  # data file -> it exists
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                name = path.name
                if unfinished(name):
                    path.unlink(missing_ok=True)
                    continue
                try:
                    object_id, index, crc, c, offset, size = parse_record(name)
                    if c and not HAS_CRC32C:
                        raise ValueError("a CRC-32C chunk and no CRC-32C to check it: fetched again")
                    where = data_file(self.data, object_id)
                    if where not in have:
                        have[where] = where.exists()
                    if not have[where]:
                        raise ValueError("its data file is gone")
                    found.append((path.stat().st_atime_ns, (object_id, index),
                                  Entry(where, offset, size, crc, path, c=c)))
                except (ValueError, OSError):
                    path.unlink(missing_ok=True)
        self._index.adopt(found, self.data)
        with self._lock:
            self._index.evict_locked(0)
        log.info("chunk cache %s: %d chunks, %d bytes (limit %d)", self.dir, len(self._index.entries),
                 self.used, self.max_bytes)

    # -- reads ---------------------------------------------------------------------------------
    def read(self, key: ChunkKey, offset: int, size: int) -> bytes | None:
        """Bytes ``[offset, offset+size)`` of a cached chunk, or None on a miss (see read_into)."""
        with self._lock:
            entry = self._index.lookup_locked(key)
        size = max(0, min(size, entry.size - offset)) if entry is not None else size
        buf = bytearray(size)
        if not self.read_into(key, memoryview(buf), offset):
            return None
        return bytes(buf)

    def read_into(self, key: ChunkKey, dest: memoryview, offset: int) -> bool:
        """Fill ``dest`` (writable bytes) with the chunk's bytes from ``offset`` on, read from
        disk straight into it; False on a miss (``dest`` may then hold anything). A chunk whose
        file holds less than that is corrupt: discarded, a miss.

        A chunk's checksum is verified the first time it is read after a (re)start (that read
        reads the whole chunk); a corrupt chunk is discarded (a miss), never served.
        """
        ikey = (key.object_id, key.index)
        found = self._used_entry(key, take_fd=True)
        if found is None:
            return False
        entry, verified, fd = found
        size = len(dest)
        drop: str | None = "corrupt"  # unless the read below succeeds
        try:
            if offset + size > entry.size:  # shorter than the chunk it stands for: never a short read
                return False
            if not verified:
                data = read_whole(entry.path, entry.offset, entry.size, entry.crc, entry.c)
                if data is None:
                    return False
                entry.verified = True
                _touch(entry.marker)  # its place in the LRU order across restarts
                dest[:] = memoryview(data)[offset:offset + size]
                drop = None
                return True
            if fd is None:
                fd = self._keep_fd(entry.path)
            if os.preadv(fd.fd, [dest], entry.offset + offset) != size:
                # Cut short since it was verified (not by us: chunks are written whole): a
                # miss, never a short read handed to the kernel.
                return False
            drop = None
            return True
        except FileNotFoundError:
            drop = "missing"
            return False
        finally:
            self._done(ikey, entry, fd, hit=drop is None, drop=drop)

    def load_into(self, key: ChunkKey, dest: memoryview) -> int | None:
        """The whole chunk into ``dest`` (a pooled buffer: page-aligned, the chunk's size rounded
        up to 4 KiB at least) with O_DIRECT: the disk's DMA fills it, no page cache is filled
        and no copy made (a sequential reader's warm chunk is then served from memory, as a
        fetched one). Answers the chunk's size; None on a miss, or a chunk cut short or
        failing its checksum (discarded, as ``read_into`` does). Buffered where the cache's
        filesystem has no O_DIRECT."""
        ikey = (key.object_id, key.index)
        with self._lock:
            entry = self._index.lookup_locked(key)
        if entry is not None and (len(dest) < -(-entry.size // ALIGN) * ALIGN or aligned_address(dest) is None):
            raise ValueError("load_into needs a page-aligned buffer of the chunk's size rounded up to 4 KiB")
        found = self._used_entry(key)
        if found is None:
            return None
        entry, verified, _ = found
        size = entry.size
        aligned = -(-size // ALIGN) * ALIGN
        drop: str | None = "corrupt"
        try:
            fd = self._io.open_for_read(entry.path) if entry.offset % ALIGN == 0 else os.open(entry.path, os.O_RDONLY)
            try:
                n = os.preadv(fd, [dest[:aligned]], entry.offset)
            finally:
                os.close(fd)
            # A data file's next chunk may follow the chunk: only its own bytes count.
            if min(n, size) != size or not (verified or checksum_at(dest, size, entry.c) == entry.crc):
                return None
            entry.verified = True
            drop = None
            return size
        except FileNotFoundError:
            drop = "missing"
            return None
        finally:
            self._done(ikey, entry, None, hit=drop is None, drop=drop)

    def _used_entry(self, key: ChunkKey, take_fd: bool = False,
                    read: bool = True) -> tuple[Entry, bool, KeptFd | None] | None:
        """The entry about to be read, made most recently used and counted as read (hand it
        back with _done), whether it was verified when looked up, and (``take_fd``, verified)
        its file's kept descriptor, taken for one read (None: none kept, _keep_fd opens one);
        None (a miss, counted if ``read``) if the cache has no such chunk."""
        with self._lock:
            entry = self._index.lookup_locked(key)
            if entry is None:
                self.stats.misses += read
                return None
            self._index.entries.move_to_end((key.object_id, key.index))
            entry.users += 1
            kept = None
            if take_fd and entry.verified:
                kept = self._index.fds.get(entry.path)
                if kept is not None and not kept.shut:
                    kept.users += 1
                    self._index.fds.move_to_end(entry.path)
                else:
                    kept = None
            return entry, entry.verified, kept

    def _keep_fd(self, path: Path) -> KeptFd:
        """Open ``path`` for one read, kept open for later ones (OPEN_FILES of them, least
        recently read closed first); hand it back with _done."""
        fd = KeptFd(os.open(path, os.O_RDONLY), users=1)
        with self._lock:
            kept = self._index.fds
            if path in kept:
                return fd  # another read kept one meanwhile: this read's own (closed by _done)
            kept[path] = fd
            while len(kept) > self.OPEN_FILES:
                self._index.shut_locked(next(iter(kept)))
        return fd

    def _done(self, ikey: tuple[str, int], entry: Entry, fd: KeptFd | None, hit: bool = False,
              drop: str | None = None) -> None:
        """A read of ``entry`` is over: hand back its descriptor, count it, and discard the
        chunk if the read found it damaged (``drop`` "corrupt") or its file gone ("missing"),
        or remove it from disk if it left the index meanwhile and this was its last read."""
        with self._lock:
            if hit:
                self.stats.hits += 1
            if fd is not None:
                fd.users -= 1
                if self._index.fds.get(entry.path) is not fd:
                    fd.shut = True
                if fd.shut and not fd.users:
                    os.close(fd.fd)
            entry.users -= 1
            if drop and self._index.entries.get(ikey) is entry:
                self._index.remove_locked(ikey, entry)
                self.stats.misses += 1
                self.stats.corrupt += drop == "corrupt"
            elif entry.gone and not entry.users:
                self._index.erase_locked(ikey, entry)
        if drop == "corrupt":
            log.warning("cached chunk %s of %s failed its checksum or is cut short; refetching",
                        ikey[1], entry.path)

    def advise(self, key: ChunkKey, wait: bool = False) -> None:
        """Start reading a cached chunk from disk in the background (it is about to be read);
        ``wait``: return once it has been read (a sweep lane, paced at the disk's speed: its
        reads ahead never queue in front of a reader's own by more than the lanes' chunks).

        One WILLNEED reads no more than the disk's readahead or largest request allows (4 MiB
        on this project's test machines: half a chunk), so the chunk is advised in pieces of
        that much (chunkio.readahead_limit): in smaller ones, each its own disk request, the page cache
        costs more CPU to fill (128 KiB pieces: a warm torch load's daemon +0.2 CPU-s/GiB)."""
        ikey = (key.object_id, key.index)
        found = self._used_entry(key, read=False)
        if found is None:
            return
        entry = found[0]
        try:
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                step = self._advise_step
                for offset in range(0, entry.size, step):
                    os.posix_fadvise(fd, entry.offset + offset, min(step, entry.size - offset), os.POSIX_FADV_WILLNEED)
                if wait and entry.size:
                    os.pread(fd, 1, entry.offset + entry.size - 1)  # the last piece asked for: read when it is
            finally:
                os.close(fd)
        except OSError:
            pass  # advice only: a chunk damaged meanwhile is the reader's to find
        finally:
            self._done(ikey, entry, None)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._index.lookup_locked(key) is not None

    # -- whole versions ------------------------------------------------------------------------
    def pin(self, object_id: str, chunks: int, size: int) -> int | None:
        """A read-only descriptor of the data file of a version whose every chunk (``chunks``
        of them, ``size`` bytes in all) is cached and verified since this daemon started: the
        whole object, as a file. Its chunks are then not evicted until ``unpin``, and the file
        is never punched (a map of it, made through passthrough, reads it after every handle
        closed): it leaves the cache whole. None when a chunk is missing or unverified."""
        if chunks <= 0:
            return None
        with self._lock:
            entries = self._index.whole_locked(data_file(self.data, object_id), object_id, chunks, size,
                                               verified=True)
            if entries is None:
                return None
            path = entries[0].path
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None
            if os.fstat(fd).st_size != size:
                os.close(fd)
                return None
            self._index.pins[object_id] = self._index.pins.get(object_id, 0) + 1
            self._index.unpunched.add(path)  # maps of it may outlive the pin
            return fd

    def verify_later(self, object_id: str, chunks: int, size: int) -> bool:
        """Check, on a thread of its own, the checksums of a version cached whole that were not
        all read since this daemon started, so that a later ``pin`` of it succeeds: a restart
        keeps the cache, and the kernel is handed only verified files. True if a check was
        queued (not for a version not whole, already verified, or queued before)."""
        with self._lock:
            if object_id in self._verifying or self._closed or chunks <= 0:
                return False
            entries = self._index.whole_locked(data_file(self.data, object_id), object_id, chunks, size)
            if entries is None or all(entry.verified for entry in entries):
                return False
            if self._verifier is None:
                self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-verify",
                                                    initializer=name_current)
            self._verifier.submit(self._verify, object_id, chunks)
            self._verifying.add(object_id)
        return True

    def _verify(self, object_id: str, chunks: int) -> None:
        """verify_later's check, one chunk at a time as a read would (its blocks are not
        punched meanwhile); a chunk that fails is discarded, and the check ends."""
        try:
            for index in range(chunks):
                ikey = (object_id, index)
                with self._lock:
                    entry = self._index.entries.get(ikey)
                    if entry is None or self._closed:
                        return  # evicted meanwhile: not whole any more
                    if entry.verified:
                        continue
                    entry.users += 1
                drop: str | None = "corrupt"
                try:
                    if read_whole(entry.path, entry.offset, entry.size, entry.crc, entry.c) is not None:
                        entry.verified = True
                        drop = None
                except FileNotFoundError:
                    drop = "missing"
                except OSError as exc:  # (the disk, not the chunk: it stays, for a read to check)
                    log.warning("cannot check cached chunk %s of %s: %s", index, entry.path, exc)
                    drop = None
                    return
                finally:
                    self._done(ikey, entry, None, drop=drop)
                if drop:
                    return
                with self._lock:
                    if self._index.entries.get(ikey) is not entry:
                        return  # evicted or put again meanwhile: not that whole version any more
        except Exception:  # noqa: BLE001 - a check that failed leaves the version to the daemon's reads
            log.exception("checking the cached chunks of %s failed", object_id)
        finally:
            with self._lock:
                self._verifying.discard(object_id)

    def verifying(self) -> int:
        """Versions queued or being checked by verify_later (for tests and status)."""
        with self._lock:
            return len(self._verifying)

    def unpin(self, object_id: str) -> None:
        with self._lock:
            pins = self._index.pins
            left = pins.get(object_id, 0) - 1
            if left > 0:
                pins[object_id] = left
            else:
                pins.pop(object_id, None)

    def pinned(self) -> int:
        with self._lock:
            return sum(self._index.pins.values())

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, data: Buffer, keep: bool = False, crc32c: int | None = None) -> bool:
        """Store a chunk (any buffer: ``bytes``, obstore's ``Bytes``), at ``key.start`` in its
        version's data file (where it starts in the object). False (and nothing stored) when it
        cannot fit or the disk says no.

        ``keep``: the chunk will likely be read again in pieces (random reads, a mapped file's
        faults), so it is written through the page cache, which then serves those reads from
        memory; otherwise it is written with O_DIRECT (a sequential reader reads it once, and
        the FUSE file's own page cache holds what it read).

        ``crc32c``: the chunk's CRC-32C when the caller knows it already (the shared tier checked
        it as it read the chunk, or took it to publish it): the record carries it, not taken
        again."""
        size = len(data)
        ikey = (key.object_id, key.index)
        offset = key.index * self.chunk_size if key.start < 0 else key.start
        path = data_file(self.data, key.object_id)
        with self._lock:
            self.stats.bytes_fetched += size
            if self._index.lookup_locked(key) is not None:
                return True
            if not self._index.reserve_locked(ikey, path, size):
                return False
        c = HAS_CRC32C
        stored = False
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                crc = self._io.write(fd, data, c, direct=self._io.write_direct and not keep, offset=offset,
                                     crc=crc32c if c else None)
            finally:
                os.close(fd)
            sub = self.dir / key.object_id[:2]
            sub.mkdir(exist_ok=True, mode=0o700)
            marker = sub / record_name(key.object_id, key.index, crc, c, offset, size)
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))
            stored = True
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cannot cache chunk %s of %s: %s", key.index, path, exc)
            with self._lock:  # (a file a map may read, or of two chunk sizes: its bytes stay)
                punch = path not in self._index.unpunched
            if punch:  # it may hold part of the chunk, which nothing records
                with contextlib.suppress(OSError):  # (else the next start frees it)
                    punch_region(path, offset, size)
        with self._lock:
            entry = Entry(path, offset, size, crc, marker, verified=True, c=c) if stored else None
            if self._index.written_locked(ikey, path, size, entry):
                return True
            self.stats.write_failures += 1
        return False

    # -- maintenance ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, int]:
        with self._lock:
            s = self.stats
            return {"bytes_used": self.used, "bytes_limit": self.max_bytes, "chunks": len(self._index.entries),
                    "hits": s.hits, "misses": s.misses, "bytes_fetched": s.bytes_fetched,
                    "evictions": s.evictions, "corrupt": s.corrupt, "write_failures": s.write_failures}

    def check_invariants(self) -> None:
        with self._lock:
            self._index.check_invariants_locked(self.OPEN_FILES)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            verifier, self._verifier = self._verifier, None
        if verifier is not None:
            verifier.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._verifying.clear()  # (checks cancelled before they began)
            while self._index.fds:
                self._index.shut_locked(next(iter(self._index.fds)))
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
