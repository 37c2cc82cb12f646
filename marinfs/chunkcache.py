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

Chunks are written with O_DIRECT where the filesystem allows it (why, and how: chunkio.py,
with the checksums and the whole reads that check them).

INVARIANT: ``used <= max_bytes`` at all times (checked by :meth:`check_invariants`): space is
reserved before a chunk is written, evicting least-recently-used chunks first, and a chunk
that cannot fit is simply not cached. A chunk's bytes are freed (a hole punched) only once no
read is using them, and the same chunk is not written again until then.

The directory's layout, the records' names and its lock are cachedir.py's (the daemon, `marinfs
cache` and `status` read them without a ``ChunkCache``); the names other modules import from
there are imported here too, so ``from marinfs.chunkcache import stats_file`` works as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from marinfs.cachedir import (acquire_lock, chunk_size_of, chunks_dir, data_dir, data_file, disk_usage, lock_holder,
                              parse_record, record_name, staging_dir, stats_file, unfinished, wipe)
from marinfs.chunkio import (ALIGN, HAS_CRC32C, Buffer, DirectIO, aligned_address, checksum_at, read_whole,
                             readahead_limit)
from marinfs.objects import ObjectRef, ObjectVersion, cache_id
from marinfs.threadnames import name_current

__all__ = ["Buffer", "CacheStats", "ChunkCache", "ChunkKey", "acquire_lock", "chunk_size_of", "chunks_dir",
           "data_dir", "disk_usage", "lock_holder", "staging_dir", "stats_file", "wipe"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkKey:
    """Identity of one chunk: which object version, which chunk of it. Its file name is the
    version's ``cache_id`` (objects.py) and the chunk's index. Hashed by those two (equal keys
    have equal ids): a key is looked up several times a read, and hashing the version's
    fields each time cost more than the rest of the lookup."""

    url: str
    version: ObjectVersion | str
    index: int
    object_id: str = field(default="", compare=False, repr=False)  # cache_id(url, str(version))
    # Where the chunk starts in its object (index x the mount's chunk size); -1: index x the
    # cache's. A record made with another chunk size stands for other bytes: never served.
    start: int = field(default=-1, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.object_id:
            object.__setattr__(self, "object_id", cache_id(self.url, str(self.version)))

    def __hash__(self) -> int:
        return hash((self.object_id, self.index))

    @classmethod
    def of(cls, obj: ObjectRef, index: int, start: int = -1) -> ChunkKey:
        return cls(obj.url, obj.version, index, obj.cache_id, start)


@dataclass
class _Entry:
    path: Path  # its version's data file
    offset: int  # where the chunk starts in it (and in the object)
    size: int
    crc: int
    marker: Path  # the file recording it
    verified: bool = False  # checksum checked since this daemon started
    c: bool = True  # the checksum is CRC-32C ("-c" names); else zlib CRC-32 (older daemons)
    users: int = 0  # reads of its bytes in flight: its region is punched only once they are done
    gone: bool = False  # left the index while read: removed from disk by the last read's _done


@dataclass
class _Fd:
    """A descriptor kept open for reads (ChunkCache._fds); closed only once no read uses it."""

    fd: int
    users: int = 0
    shut: bool = False


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    evictions: int = 0
    corrupt: int = 0
    write_failures: int = 0


class ChunkCache:
    """The chunk store of one cache directory. Thread-safe; disk I/O is done outside the lock,
    but for eviction's unlinks and hole punches.

    Only one daemon may use a cache directory at a time: a second one is refused (lock file),
    because two LRU indexes over one directory would evict each other's chunks blindly.

    The chunks of one version live in one sparse file, its data file, each at its own offset in
    the object (``data/ab/<objhash>``), and each is recorded by an empty marker file named for
    it (``chunks/ab/<objhash>-<index>-c<crc>+<offset>+<size>``), made once its bytes are
    written: a crash leaves at worst bytes with no marker, whose blocks the next start punches
    out. A version whose every chunk is cached is then an ordinary file holding the whole
    object, which the kernel can read by itself (FUSE passthrough: fs.py, ``pin``). Evicting a
    chunk removes its marker and punches a hole in the data file, once no read is using the
    chunk's bytes; the data file goes with its last chunk. Chunks of older daemons (a file per
    chunk, ``<objhash>-<index>-<crc>``, which says nothing of the chunk size it was cut with)
    are dropped at start: fetched again, never misread.

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
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.chunk_size = chunk_size  # where chunk N starts, for keys that do not say (ChunkKey.start)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # LRU order, oldest first
        self._fds: OrderedDict[Path, _Fd] = OrderedDict()  # kept descriptors, least recently read first
        # Data file -> its chunks in the index, those that left it while read, and writes into
        # it in flight: it is unlinked only at 0, so no read or write ever meets a new file of
        # the same name.
        self._files: dict[Path, int] = {}
        self._punching: set[tuple[str, int]] = set()  # chunks whose region waits for its reads to end
        self._writing: set[tuple[str, int]] = set()  # chunks being written by put
        self._pins: dict[str, int] = {}  # object id -> open pins (``pin``): its chunks are not evicted
        # Data files never punched: ones handed out by ``pin`` (a process's map of the file made
        # through passthrough outlives every handle, and reads it directly: such a file leaves
        # whole, unlinked, so the map keeps its blocks), and ones holding chunks cut with two
        # chunk sizes (a punch for one would cut into the other's bytes). Both go whole.
        self._unpunched: set[Path] = set()
        # Whole versions whose checksums a thread of its own is checking (verify_later).
        self._verifying: set[str] = set()
        self._verifier: ThreadPoolExecutor | None = None
        self._closed = False
        self.used = 0
        self._reserved = 0
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(cache_dir, 0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        self.data.mkdir(exist_ok=True, mode=0o700)
        self._io = DirectIO(self.dir)  # no lock: its flags only fall to False, its buffers are per thread
        self._punch = True  # the cache's filesystem punches holes; else an eviction takes the whole file
        self._advise_step = readahead_limit(self.dir)  # what one WILLNEED reads (advise)
        self._lock_fd: int | None = None
        if lock:
            self._lock_fd = acquire_lock(cache_dir)
        self._load()

    # -- startup -------------------------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the index from disk, oldest first; drop leftovers, bytes no marker records,
        and excess."""
        found: list[tuple[int, tuple[str, int], _Entry]] = []  # (last use, key, entry)
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
                                  _Entry(where, offset, size, crc, path, c=c)))
                except (ValueError, OSError):
                    path.unlink(missing_ok=True)
        found.sort(key=lambda item: item[0])
        regions: dict[Path, list[tuple[int, int]]] = {}
        sizes: dict[Path, set[int]] = {}
        for _, key, entry in found:
            regions.setdefault(entry.path, []).append((entry.offset, entry.size))
            if key[1]:
                sizes.setdefault(entry.path, set()).add(entry.offset // key[1] if entry.offset % key[1] == 0 else -1)
            self._files[entry.path] = self._files.get(entry.path, 0) + 1
            self._index[key] = entry
            self.used += entry.size
        self._unpunched.update(path for path, seen in sizes.items() if len(seen) > 1)
        for sub in self.data.iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                if path not in regions:
                    path.unlink(missing_ok=True)  # no chunk of it was recorded
                else:
                    self._punch_unrecorded(path, regions[path])
        with self._lock:
            self._evict_locked(0)
        log.info("chunk cache %s: %d chunks, %d bytes (limit %d)", self.dir, len(self._index),
                 self.used, self.max_bytes)

    def _punch_unrecorded(self, path: Path, recorded: list[tuple[int, int]]) -> None:
        """Free the blocks of ``path`` that hold no recorded chunk (a write a crash cut off
        before its marker): they would take disk space the index does not count."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            recorded.sort()
            pos = 0
            while True:
                try:
                    start = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError:  # ENXIO: no data past pos
                    break
                end = os.lseek(fd, start, os.SEEK_HOLE)
                at = start
                for offset, size in recorded:
                    if offset + size <= at or offset >= end:
                        continue
                    if offset > at:
                        _punch_hole(fd, at, offset - at)
                    at = max(at, offset + size)
                if at < end:
                    _punch_hole(fd, at, end - at)
                pos = end
        except OSError as exc:
            log.info("chunk cache %s: cannot free unrecorded blocks of %s: %s", self.dir, path, exc)
        finally:
            os.close(fd)

    # -- reads ---------------------------------------------------------------------------------
    def _lookup_locked(self, key: ChunkKey) -> _Entry | None:
        """The chunk's entry; None if there is none or it was cut with another chunk size (it
        holds other bytes of the object: dropped, its data file never punched from now on, as
        this size's chunks will overlap the other's)."""
        ikey = (key.object_id, key.index)
        entry = self._index.get(ikey)
        if entry is not None and key.start >= 0 and entry.offset != key.start:
            self._unpunched.add(entry.path)
            self._remove_locked(ikey, entry)
            return None
        return entry

    def read(self, key: ChunkKey, offset: int, size: int) -> bytes | None:
        """Bytes ``[offset, offset+size)`` of a cached chunk, or None on a miss (see read_into)."""
        with self._lock:
            entry = self._lookup_locked(key)
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
            entry = self._lookup_locked(key)
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
                    read: bool = True) -> tuple[_Entry, bool, _Fd | None] | None:
        """The entry about to be read, made most recently used and counted as read (hand it
        back with _done), whether it was verified when looked up, and (``take_fd``, verified)
        its file's kept descriptor, taken for one read (None: none kept, _keep_fd opens one);
        None (a miss, counted if ``read``) if the cache has no such chunk."""
        with self._lock:
            entry = self._lookup_locked(key)
            if entry is None:
                self.stats.misses += read
                return None
            self._index.move_to_end((key.object_id, key.index))
            entry.users += 1
            kept = None
            if take_fd and entry.verified:
                kept = self._fds.get(entry.path)
                if kept is not None and not kept.shut:
                    kept.users += 1
                    self._fds.move_to_end(entry.path)
                else:
                    kept = None
            return entry, entry.verified, kept

    def _keep_fd(self, path: Path) -> _Fd:
        """Open ``path`` for one read, kept open for later ones (OPEN_FILES of them, least
        recently read closed first); hand it back with _done."""
        fd = _Fd(os.open(path, os.O_RDONLY), users=1)
        with self._lock:
            if path in self._fds:
                return fd  # another read kept one meanwhile: this read's own (closed by _done)
            self._fds[path] = fd
            while len(self._fds) > self.OPEN_FILES:
                self._shut_locked(next(iter(self._fds)))
        return fd

    def _done(self, ikey: tuple[str, int], entry: _Entry, fd: _Fd | None, hit: bool = False,
              drop: str | None = None) -> None:
        """A read of ``entry`` is over: hand back its descriptor, count it, and discard the
        chunk if the read found it damaged (``drop`` "corrupt") or its file gone ("missing"),
        or remove it from disk if it left the index meanwhile and this was its last read."""
        with self._lock:
            if hit:
                self.stats.hits += 1
            if fd is not None:
                fd.users -= 1
                if self._fds.get(entry.path) is not fd:
                    fd.shut = True
                if fd.shut and not fd.users:
                    os.close(fd.fd)
            entry.users -= 1
            if drop and self._index.get(ikey) is entry:
                self._remove_locked(ikey, entry)
                self.stats.misses += 1
                self.stats.corrupt += drop == "corrupt"
            elif entry.gone and not entry.users:
                self._erase_locked(ikey, entry)
        if drop == "corrupt":
            log.warning("cached chunk %s of %s failed its checksum or is cut short; refetching",
                        ikey[1], entry.path)

    def _shut_locked(self, path: Path) -> None:
        """``path`` keeps no descriptor from now on: closed now, or by its last read's _done."""
        fd = self._fds.pop(path, None)
        if fd is None:
            return
        fd.shut = True
        if not fd.users:
            os.close(fd.fd)

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
            return self._lookup_locked(key) is not None

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
            entries = self._whole_locked(object_id, chunks, size, verified=True)
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
            self._pins[object_id] = self._pins.get(object_id, 0) + 1
            self._unpunched.add(path)  # maps of it may outlive the pin
            return fd

    def _whole_locked(self, object_id: str, chunks: int, size: int,
                      verified: bool = False) -> list[_Entry] | None:
        """The ``chunks`` entries of a version cached whole (``size`` bytes, each chunk at its
        offset in the one data file; ``verified``: each checked since the start), in order;
        None if one is missing (or unverified)."""
        path = data_file(self.data, object_id)
        entries: list[_Entry] = []
        total = 0
        for index in range(chunks):
            entry = self._index.get((object_id, index))
            if entry is None or entry.path != path or entry.offset != total or (verified and not entry.verified):
                return None
            entries.append(entry)
            total += entry.size
        return entries if total == size else None

    def verify_later(self, object_id: str, chunks: int, size: int) -> bool:
        """Check, on a thread of its own, the checksums of a version cached whole that were not
        all read since this daemon started, so that a later ``pin`` of it succeeds: a restart
        keeps the cache, and the kernel is handed only verified files. True if a check was
        queued (not for a version not whole, already verified, or queued before)."""
        with self._lock:
            if object_id in self._verifying or self._closed or chunks <= 0:
                return False
            entries = self._whole_locked(object_id, chunks, size)
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
                    entry = self._index.get(ikey)
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
                    if self._index.get(ikey) is not entry:
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
            left = self._pins.get(object_id, 0) - 1
            if left > 0:
                self._pins[object_id] = left
            else:
                self._pins.pop(object_id, None)

    def pinned(self) -> int:
        with self._lock:
            return sum(self._pins.values())

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, data: Buffer, keep: bool = False) -> bool:
        """Store a chunk (any buffer: ``bytes``, obstore's ``Bytes``), at ``key.start`` in its
        version's data file (where it starts in the object). False (and nothing stored) when it
        cannot fit or the disk says no.

        ``keep``: the chunk will likely be read again in pieces (random reads, a mapped file's
        faults), so it is written through the page cache, which then serves those reads from
        memory; otherwise it is written with O_DIRECT (a sequential reader reads it once, and
        the FUSE file's own page cache holds what it read)."""
        size = len(data)
        ikey = (key.object_id, key.index)
        offset = key.index * self.chunk_size if key.start < 0 else key.start
        path = data_file(self.data, key.object_id)
        with self._lock:
            self.stats.bytes_fetched += size
            if self._lookup_locked(key) is not None:
                return True
            if (ikey in self._punching or ikey in self._writing or size > self.max_bytes
                    or not self._evict_locked(size)):
                return False
            self._writing.add(ikey)  # (the fetcher writes a chunk once; if not, the first one wins)
            self._reserved += size  # counted in `used` from now on, so the limit holds
            self.used += size
            self._files[path] = self._files.get(path, 0) + 1
        c = HAS_CRC32C
        stored = False
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                crc = self._io.write(fd, data, c, direct=self._io.write_direct and not keep, offset=offset)
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
                punch = path not in self._unpunched
            if punch:  # it may hold part of the chunk, which nothing records
                with contextlib.suppress(OSError):  # (else the next start frees it)
                    self._punch_region(path, offset, size)
        with self._lock:
            self._writing.discard(ikey)
            self._reserved -= size
            if stored:
                self._index[ikey] = _Entry(path, offset, size, crc, marker, verified=True, c=c)
                return True
            self.stats.write_failures += 1
            self.used -= size
            self._release_file_locked(path)
        return False

    # -- removal -------------------------------------------------------------------------------
    def _evict_locked(self, incoming: int) -> bool:
        """Make room for ``incoming`` bytes under the size limit and the free-space floor,
        least recently used chunks first; never a chunk of a pinned version."""
        skipped = 0
        while self.used + incoming > self.max_bytes or (incoming and self._low_on_disk(incoming)):
            if len(self._index) <= skipped:  # nothing left that may go
                return self.used + incoming <= self.max_bytes and not (incoming and self._low_on_disk(incoming))
            ikey, entry = next(iter(self._index.items()))
            if ikey[0] in self._pins:
                self._index.move_to_end(ikey)  # read whole by the kernel: recently used anyway
                skipped += 1
                continue
            self._remove_locked(ikey, entry)
            self.stats.evictions += 1
        return True

    def _remove_locked(self, ikey: tuple[str, int], entry: _Entry) -> None:
        """Take a chunk out of the index; its bytes go now, or after the reads using them."""
        del self._index[ikey]
        self.used -= entry.size
        if entry.users:
            entry.gone = True
            entry.marker.unlink(missing_ok=True)  # unrecorded now; a crash before its bytes go: the next start frees them
            self._punching.add(ikey)
        else:
            self._erase_locked(ikey, entry)

    def _erase_locked(self, ikey: tuple[str, int], entry: _Entry) -> None:
        """A chunk no read uses any more, out of the index: off the disk."""
        entry.gone = False
        self._punching.discard(ikey)
        entry.marker.unlink(missing_ok=True)
        if self._files.get(entry.path, 0) > 1 and ikey[0] not in self._pins:  # (else the file goes whole)
            if self._punch and entry.path not in self._unpunched:
                try:
                    self._punch_region(entry.path, entry.offset, entry.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        log.warning("chunk cache: cannot free chunk %s of %s: %s", ikey[1], entry.path, exc)
                    else:
                        self._punch = False
                        log.info("chunk cache %s: no hole punching (%s); a version's chunks leave together",
                                 self.dir, exc)
            if not self._punch or entry.path in self._unpunched:
                self._evict_file_locked(entry.path)
        self._release_file_locked(entry.path)

    @staticmethod
    def _punch_region(path: Path, offset: int, size: int) -> None:
        wfd = os.open(path, os.O_RDWR)
        try:
            _punch_hole(wfd, offset, size)
        finally:
            os.close(wfd)

    def _evict_file_locked(self, path: Path) -> None:
        """Every chunk of data file ``path`` out of the index (where holes cannot be punched,
        the space of one chunk is only freed with its whole file)."""
        for ikey, entry in [(k, e) for k, e in self._index.items() if e.path == path]:
            if ikey[0] in self._pins:
                continue
            del self._index[ikey]
            self.used -= entry.size
            self.stats.evictions += 1
            entry.marker.unlink(missing_ok=True)
            if entry.users:  # its share of the file is let go at its last read (_done)
                entry.gone = True
                self._punching.add(ikey)
            else:
                self._files[path] -= 1

    def _release_file_locked(self, path: Path) -> None:
        left = self._files.get(path, 0) - 1
        if left > 0:
            self._files[path] = left
            return
        self._files.pop(path, None)
        self._unpunched.discard(path)  # a new file of that name is a new inode: punched as usual
        self._shut_locked(path)
        path.unlink(missing_ok=True)

    def _low_on_disk(self, incoming: int) -> bool:
        if not self.min_free_bytes:
            return False
        try:
            return shutil.disk_usage(self.dir).free - incoming < self.min_free_bytes
        except OSError:
            return False

    # -- maintenance ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, int]:
        with self._lock:
            s = self.stats
            return {"bytes_used": self.used, "bytes_limit": self.max_bytes, "chunks": len(self._index),
                    "hits": s.hits, "misses": s.misses, "bytes_fetched": s.bytes_fetched,
                    "evictions": s.evictions, "corrupt": s.corrupt, "write_failures": s.write_failures}

    def check_invariants(self) -> None:
        with self._lock:
            assert self.used <= self.max_bytes, (self.used, self.max_bytes)
            assert self.used == sum(e.size for e in self._index.values()) + self._reserved
            assert len(self._fds) <= self.OPEN_FILES, (len(self._fds), self.OPEN_FILES)
            for path, fd in self._fds.items():  # kept descriptors are of files still in use
                assert not fd.shut and path in self._files, path
            for entry in self._index.values():
                assert not entry.gone and self._files.get(entry.path, 0) >= 1, entry.path

    def close(self) -> None:
        with self._lock:
            self._closed = True
            verifier, self._verifier = self._verifier, None
        if verifier is not None:
            verifier.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._verifying.clear()  # (checks cancelled before they began)
            while self._fds:
                self._shut_locked(next(iter(self._fds)))
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_FALLOC_FL_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # linux/falloc.h: punching needs KEEP_SIZE


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``fd``'s blocks in ``[offset, offset+length)`` (they read as zeros), size kept."""
    if length > 0 and _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
