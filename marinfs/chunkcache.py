"""On-disk chunk store: bounded size, LRU eviction, checksums, atomic writes, survives restarts.

A chunk is ``chunk_size`` bytes of one object version, stored as one file named by a hash of
(remote URL, version) plus the chunk index and the data's checksum:
``chunks/ab/<objhash>-<index>-c<crc32c>`` (CRC-32C, hardware-accelerated: a quarter of the CPU
of zlib's CRC-32 here). Chunks written before that are named ``<objhash>-<index>-<crc32>``
(zlib CRC-32, always 8 hex digits) and are still read and verified as such: the name says
which checksum it holds, so a cache directory from an older daemon keeps working and is never misread. A new version of an object has a new hash, so it can
never be served old bytes. Files are written under a temporary name and renamed, and enter the
index only once complete, so a crash or a full disk never leaves a chunk that looks present.

Chunks are written with O_DIRECT where the filesystem allows it. Buffered writes of a cold
read's 1 GiB dirty the page cache faster than writeback drains it, and the kernel then throttles
every writer to the disk's writeback speed: measured here, 4.4 GB/s for the first ~800 MiB,
then 400 MiB/s, which capped cold reads. O_DIRECT writes ran at 1.7-2.0 GB/s sustained, and
the page cache is left to the FUSE files themselves (no second copy of every chunk in memory).
A chunk handed over in a writable page-aligned buffer (the fetcher's pooled buffers,
buffers.py) is written from that buffer and checksummed at its address; any other buffer is
copied into the writing thread's aligned buffer first. The file is the same either way.

INVARIANT: ``used <= max_bytes`` at all times (checked by :meth:`check_invariants`): space is
reserved before a chunk is written, evicting least-recently-used chunks first, and a chunk
that cannot fit is simply not cached.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import tempfile
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marinfs.checksums import crc32c_extend
from marinfs.errors import UsageError
from marinfs.objects import ObjectRef, ObjectVersion, cache_id

try:  # CRC-32C in C with the CPU's crc32 instruction (google-crc32c, which gcsfs installs)
    import google_crc32c

    _crc32c: Callable[[bytes], int] | None = google_crc32c.value if google_crc32c.implementation == "c" else None
except ImportError:  # pragma: no cover - then chunks keep zlib CRC-32 names
    _crc32c = None


# google-crc32c's C ``crc32c_extend(crc, pointer, length)`` (checksums.py): checksums any memory,
# such as the aligned buffer a chunk is written from, without a copy into a ``bytes``, and
# without the interpreter lock.
_crc32c_extend = crc32c_extend if _crc32c is not None else None

log = logging.getLogger(__name__)
Buffer = Any  # anything with the buffer protocol: bytes, obstore's Bytes


def _checksum(data: Buffer, c: bool) -> int:
    """The checksum a chunk name carries: CRC-32C (``c`` names) or zlib's CRC-32 (older names)."""
    if c:
        if _crc32c is None:
            raise LookupError("no CRC-32C here")
        return _crc32c(data if isinstance(data, bytes) else bytes(data))
    return zlib.crc32(data)


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

    def __post_init__(self) -> None:
        if not self.object_id:
            object.__setattr__(self, "object_id", cache_id(self.url, str(self.version)))

    def __hash__(self) -> int:
        return hash((self.object_id, self.index))

    @classmethod
    def of(cls, obj: ObjectRef, index: int) -> ChunkKey:
        return cls(obj.url, obj.version, index, obj.cache_id)


@dataclass
class _Entry:
    path: Path
    size: int
    crc: int
    verified: bool = False  # checksum checked since this daemon started
    c: bool = True  # the checksum is CRC-32C ("-c" names); else zlib CRC-32 (older daemons)
    fd: int = -1  # kept open while among the last chunks read (ChunkCache._open); -1: none
    users: int = 0  # reads using ``fd`` right now: it is closed only once they are done
    shut: bool = False  # ``fd`` is to be closed once ``users`` is 0 (left the index or _open)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_fetched: int = 0
    evictions: int = 0
    corrupt: int = 0
    write_failures: int = 0


class ChunkCache:
    """The chunk store of one cache directory. Thread-safe; disk I/O is done outside the lock.

    Only one daemon may use a cache directory at a time: a second one is refused (lock file),
    because two LRU indexes over one directory would evict each other's chunks blindly.

    The last chunks read keep their files open (``OPEN_FILES`` of them): a mapped file's faults
    read 4 KiB at a time, and an ``open`` and ``close`` per read cost as much as the read. A
    chunk file never changes once renamed into place, so a kept descriptor always reads the
    chunk's bytes; one is closed when its chunk leaves the index or the set, once no read is
    using it (never closed under a read: its number could be reused by another file).
    """

    OPEN_FILES = 64

    def __init__(self, cache_dir: Path, max_bytes: int, min_free_bytes: int = 0,
                 lock: bool = True) -> None:
        self.dir = chunks_dir(cache_dir)
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # LRU order, oldest first
        self._open: OrderedDict[tuple[str, int], _Entry] = OrderedDict()  # entries with a kept fd
        self.used = 0
        self._reserved = 0
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(cache_dir, 0o700)
        self.dir.mkdir(exist_ok=True, mode=0o700)
        self._direct_io = hasattr(os, "O_DIRECT")
        self._direct_read = self._direct_io
        self._advise_step = _readahead_limit(self.dir)  # what one WILLNEED reads (advise)
        self._local = threading.local()  # each writing thread's aligned O_DIRECT buffer
        self._lock_fd: int | None = None
        if lock:
            self._lock_fd = acquire_lock(cache_dir)
        self._load()

    # -- startup -------------------------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the index from disk, oldest access first; drop leftovers and excess."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                name = path.name
                if _unfinished(name):
                    path.unlink(missing_ok=True)
                    continue
                try:
                    object_id, index, crc = name.rsplit("-", 2)
                    c = len(crc) == 9 and crc[0] == "c"  # older names are 8 hex digits, never 9
                    if c and _crc32c is None:
                        raise ValueError("a CRC-32C chunk and no CRC-32C to check it: fetched again")
                    st = path.stat()
                    found.append((st.st_atime_ns, (object_id, int(index)), path, st.st_size,
                                  int(crc[1:] if c else crc, 16), c))
                except (ValueError, OSError):
                    path.unlink(missing_ok=True)
        found.sort(key=lambda item: item[0])
        for _, key, path, size, crc, c in found:
            self._index[key] = _Entry(path, size, crc, c=c)
            self.used += size
        with self._lock:
            self._evict_locked(0)
        log.info("chunk cache %s: %d chunks, %d bytes (limit %d)", self.dir, len(self._index),
                 self.used, self.max_bytes)

    # -- reads ---------------------------------------------------------------------------------
    def read(self, key: ChunkKey, offset: int, size: int) -> bytes | None:
        """Bytes ``[offset, offset+size)`` of a cached chunk, or None on a miss (see read_into)."""
        ikey = (key.object_id, key.index)
        with self._lock:
            entry = self._index.get(ikey)
        size = max(0, min(size, entry.size - offset)) if entry is not None else size
        buf = bytearray(size)
        if not self.read_into(key, memoryview(buf), offset):
            return None
        return bytes(buf)

    def read_into(self, key: ChunkKey, dest: memoryview, offset: int) -> bool:
        """Fill ``dest`` (writable bytes) with the chunk's bytes from ``offset`` on, read from
        disk straight into it; False on a miss (``dest`` may then hold anything). A chunk file
        shorter than that is corrupt: discarded, a miss.

        A chunk's checksum is verified the first time it is read after a (re)start (that read
        reads the whole chunk); a corrupt chunk is discarded (a miss), never served.
        """
        ikey = (key.object_id, key.index)
        found = self._used_entry(ikey, take_fd=True)
        if found is None:
            return False
        entry, verified, fd = found
        size = len(dest)
        if offset + size > entry.size:  # shorter than the chunk it stands for: never a short read
            if fd >= 0:
                self._done(entry, fd)
            self._discard(ikey, entry, corrupt=True)
            return False
        try:
            if not verified:
                data = entry.path.read_bytes()
                if len(data) != entry.size or _checksum(data, entry.c) != entry.crc:
                    self._discard(ikey, entry, corrupt=True)
                    return False
                entry.verified = True
                dest[:] = memoryview(data)[offset:offset + size]
                self._hit()
                return True
            if fd < 0:
                fd = self._keep_fd(ikey, entry)
            n = -1
            try:
                n = os.preadv(fd, [dest], offset)
            finally:
                self._done(entry, fd, hit=n == size)
        except FileNotFoundError:
            self._discard(ikey, entry)
            return False
        if n != size:
            # Cut short since it was verified (not by us: chunks are written whole, then
            # renamed): a miss, never a short read handed to the kernel.
            self._discard(ikey, entry, corrupt=True)
            return False
        return True

    def load_into(self, key: ChunkKey, dest: memoryview) -> int | None:
        """The whole chunk into ``dest`` (a pooled buffer: page-aligned, the chunk's size rounded
        up to 4 KiB at least) with O_DIRECT: the disk's DMA fills it, no page cache is filled
        and no copy made (a sequential reader's warm chunk is then served from memory, as a
        fetched one). Answers the chunk's size; None on a miss, or a chunk file cut short or
        failing its checksum (discarded, as ``read_into`` does). Buffered where the cache's
        filesystem has no O_DIRECT."""
        ikey = (key.object_id, key.index)
        found = self._used_entry(ikey)
        if found is None:
            return None
        entry, verified, _ = found
        size = entry.size
        aligned = -(-size // _ALIGN) * _ALIGN
        if len(dest) < aligned or _aligned_address(dest) is None:
            raise ValueError("load_into needs a page-aligned buffer of the chunk's size rounded up to 4 KiB")
        try:
            fd = self._open_direct(entry.path)
            try:
                n = os.preadv(fd, [dest[:aligned]], 0)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._discard(ikey, entry)
            return None
        if n != size or (not verified and _checksum_at(dest, size, entry.c) != entry.crc):
            self._discard(ikey, entry, corrupt=True)
            return None
        entry.verified = True
        self._hit()
        return size

    def _used_entry(self, ikey: tuple[str, int], take_fd: bool = False) -> tuple[_Entry, bool, int] | None:
        """The entry about to be read, made most recently used, whether it was verified when
        looked up, and (``take_fd``, verified) its kept descriptor, taken for one read (hand it
        back with _done; -1: none kept, _keep_fd opens one); None (a miss, counted) if the cache
        has no such chunk."""
        with self._lock:
            entry = self._index.get(ikey)
            if entry is None:
                self.stats.misses += 1
                return None
            self._index.move_to_end(ikey)
            fd = -1
            if take_fd and entry.verified and entry.fd >= 0 and not entry.shut:
                entry.users += 1
                self._open.move_to_end(ikey)
                fd = entry.fd
            return entry, entry.verified, fd

    def _keep_fd(self, ikey: tuple[str, int], entry: _Entry) -> int:
        """Open a verified entry's file for one read, kept open for later ones (OPEN_FILES of
        them, least recently read closed first); hand it back with _done."""
        fd = os.open(entry.path, os.O_RDONLY)
        with self._lock:
            if entry.fd >= 0 or self._index.get(ikey) is not entry:
                return fd  # another read kept one meanwhile, or the chunk left: this read's own
            entry.fd, entry.users, entry.shut = fd, 1, False
            self._open[ikey] = entry
            while len(self._open) > self.OPEN_FILES:
                self._shut_locked(*next(iter(self._open.items())))
        return fd

    def _done(self, entry: _Entry, fd: int, hit: bool = False) -> None:
        with self._lock:
            if hit:
                self.stats.hits += 1
            if fd != entry.fd:
                os.close(fd)
                return
            entry.users -= 1
            if entry.shut and not entry.users:
                os.close(fd)
                entry.fd = -1

    def _shut_locked(self, ikey: tuple[str, int], entry: _Entry) -> None:
        """``entry`` keeps no descriptor from now on: closed now, or by its last read's _done."""
        if self._open.get(ikey) is entry:
            del self._open[ikey]
        if entry.fd < 0:
            return
        entry.shut = True
        if not entry.users:
            os.close(entry.fd)
            entry.fd = -1

    def _open_direct(self, path: Path) -> int:
        if self._direct_read:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_read = False  # this filesystem has no O_DIRECT: buffered from now on
        return os.open(path, os.O_RDONLY)

    def advise(self, key: ChunkKey, wait: bool = False) -> None:
        """Start reading a cached chunk from disk in the background (it is about to be read);
        ``wait``: return once it has been read (a sweep lane, paced at the disk's speed: its
        reads ahead never queue in front of a reader's own by more than the lanes' chunks).

        One WILLNEED reads no more than the disk's readahead or largest request allows (4 MiB
        on this project's test machines: half a chunk), so the chunk is advised in pieces of
        that much (_readahead_limit): in smaller ones, each its own disk request, the page cache
        costs more CPU to fill (128 KiB pieces: a warm torch load's daemon +0.2 CPU-s/GiB)."""
        with self._lock:
            entry = self._index.get((key.object_id, key.index))
        if entry is None:
            return
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError:
            return
        try:
            step = self._advise_step
            for offset in range(0, entry.size, step):
                os.posix_fadvise(fd, offset, step, os.POSIX_FADV_WILLNEED)
            if wait and entry.size:
                os.pread(fd, 1, entry.size - 1)  # the last piece asked for: read when it is
        except OSError:
            pass  # advice only: a chunk evicted or damaged meanwhile is the reader's to find
        finally:
            os.close(fd)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return (key.object_id, key.index) in self._index

    def _hit(self) -> None:
        with self._lock:
            self.stats.hits += 1

    def _discard(self, ikey: tuple[str, int], entry: _Entry, corrupt: bool = False) -> None:
        with self._lock:
            if self._index.get(ikey) is entry:
                del self._index[ikey]
                self.used -= entry.size
            self._shut_locked(ikey, entry)
            self.stats.misses += 1
            if corrupt:
                self.stats.corrupt += 1
        if corrupt:
            log.warning("cached chunk %s failed its checksum; refetching", entry.path)
        entry.path.unlink(missing_ok=True)

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, data: Buffer, keep: bool = False) -> bool:
        """Store a chunk (any buffer: ``bytes``, obstore's ``Bytes``). False (and nothing stored)
        when it cannot fit or the disk says no.

        ``keep``: the chunk will likely be read again in pieces (random reads, a mapped file's
        faults), so it is written through the page cache, which then serves those reads from
        memory; otherwise it is written with O_DIRECT (a sequential reader reads it once, and
        the FUSE file's own page cache holds what it read)."""
        size = len(data)
        ikey = (key.object_id, key.index)
        with self._lock:
            self.stats.bytes_fetched += size
            if ikey in self._index:
                return True
            if size > self.max_bytes or not self._evict_locked(size):
                return False
            self._reserved += size  # counted in `used` from now on, so the limit holds
            self.used += size
        c = _crc32c is not None
        sub = self.dir / key.object_id[:2]
        path = sub / f"{key.object_id}-{key.index}"
        tmp = None
        try:
            sub.mkdir(exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix="tmp", dir=sub)  # 0600
            try:
                crc = self._write(fd, data, c, direct=self._direct_io and not keep)
            finally:
                os.close(fd)
            path = sub / f"{key.object_id}-{key.index}-{'c' if c else ''}{crc:08x}"
            os.replace(tmp, path)
        except OSError as exc:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
            with self._lock:
                self._reserved -= size
                self.used -= size
                self.stats.write_failures += 1
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cannot cache chunk %s: %s", path, exc)
            return False
        with self._lock:
            self._reserved -= size
            self._index[ikey] = _Entry(path, size, crc, verified=True, c=c)
        return True

    def _write(self, fd: int, data: Buffer, c: bool, direct: bool) -> int:
        """All of ``data`` to ``fd``: the block-aligned bulk with O_DIRECT (from an aligned
        buffer, as it requires: ``data`` itself when it is a writable page-aligned buffer, such
        as the pooled buffer a chunk was fetched into, else a copy in this thread's aligned
        buffer), the tail and any filesystem without O_DIRECT buffered. Answers the checksum of
        what was written (CRC-32C if ``c``), taken at the aligned buffer's address where it
        can be (ctypes releases the GIL): any buffer is checksummed without a copy more."""
        view = memoryview(data)
        bulk = len(view) - len(view) % _ALIGN if direct else 0
        crc = None
        if bulk:
            addr = _aligned_address(view)
            if addr is not None:  # a pooled buffer (buffers.py): written from where it is
                src = view
            else:
                buf = getattr(self._local, "buf", None)
                if buf is None or len(buf) < bulk:
                    buf = self._local.buf = mmap.mmap(-1, max(bulk, 8 << 20))  # page-aligned
                    self._local.addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
                buf[:bulk] = view[:bulk]
                src, addr = memoryview(buf), self._local.addr
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                _write_all(fd, src[:bulk])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_io = False  # this filesystem does not do O_DIRECT: buffered from now on
                log.info("chunk cache %s: no O_DIRECT (%s); buffered writes", self.dir, exc)
                os.ftruncate(fd, 0)
                bulk = 0
            finally:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            if bulk and c and _crc32c_extend is not None:
                crc = _crc32c_extend(0, addr, bulk)
                tail = view[bulk:].tobytes()
                crc = _crc32c_extend(crc, tail, len(tail)) if tail else crc
        _write_all(fd, view[bulk:], offset=bulk)
        if crc is None and c and not bulk and view.nbytes and not view.readonly and view.c_contiguous:
            crc = _checksum_at(view, view.nbytes, c)  # written buffered (a random read's): no copy either
        return crc if crc is not None else _checksum(data, c)

    def _evict_locked(self, incoming: int) -> bool:
        """Make room for ``incoming`` bytes under the size limit and the free-space floor."""
        while self.used + incoming > self.max_bytes or (incoming and self._low_on_disk(incoming)):
            if not self._index:
                return self.used + incoming <= self.max_bytes and not (incoming and self._low_on_disk(incoming))
            ikey, entry = self._index.popitem(last=False)
            self._shut_locked(ikey, entry)
            self.used -= entry.size
            self.stats.evictions += 1
            entry.path.unlink(missing_ok=True)
        return True

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
            assert len(self._open) <= self.OPEN_FILES, (len(self._open), self.OPEN_FILES)
            for ikey, entry in self._open.items():  # kept descriptors belong to indexed chunks
                assert self._index.get(ikey) is entry and entry.fd >= 0 and not entry.shut

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._shut_locked(*next(iter(self._open.items())))
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _readahead_limit(path: Path) -> int:
    """The most one POSIX_FADV_WILLNEED reads on the disk ``path`` is on: the kernel
    (force_page_cache_ra) caps it at the larger of the device's largest request
    (``max_sectors_kb``) and its ``read_ahead_kb``. 128 KiB, the default read_ahead_kb, where
    sysfs does not say (tmpfs, a filesystem on no single block device)."""
    try:
        dev = os.stat(path).st_dev
        block = Path(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
        queue = block / "queue" if (block / "queue").is_dir() else block.parent / "queue"  # a partition's disk
        kib = max(int((queue / name).read_text()) for name in ("max_sectors_kb", "read_ahead_kb"))
    except (OSError, ValueError):
        kib = 0
    return max(128, kib) << 10


_ALIGN = 4096  # O_DIRECT wants block-aligned sizes and buffers; 4 KiB suits every common disk


def _aligned_address(view: memoryview) -> int | None:
    """Where a writable, contiguous buffer starts, if that is page-aligned (what O_DIRECT
    needs: a pooled buffer from buffers.py is); None for anything else (``bytes``, obstore's
    ``Bytes``: read-only, copied into an aligned buffer first)."""
    if view.readonly or not view.c_contiguous or not view.nbytes:
        return None
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return addr if addr % mmap.PAGESIZE == 0 else None


def _checksum_at(view: memoryview, size: int, c: bool) -> int:
    """The checksum of ``view[:size]``, a writable buffer: CRC-32C taken at its address where
    the C library is there (no copy, the GIL released), else through ``_checksum``."""
    if c and _crc32c_extend is not None:
        return _crc32c_extend(0, ctypes.addressof(ctypes.c_char.from_buffer(view)), size)
    return _checksum(view[:size], c)


def _write_all(fd: int, view: memoryview, offset: int = 0) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# The cache directory's layout, in one place (the daemon, `marinfs cache` and `status` use it):
# chunks/<2 hex>/<object id>-<index>-<crc>, staging/ (staged writes and journals, never a
# cache: unsaved data), lock (the daemon's PID, flocked), stats.json (the daemon's counters).
def chunks_dir(cache_dir: Path) -> Path:
    return cache_dir / "chunks"


def staging_dir(cache_dir: Path) -> Path:
    return cache_dir / "staging"


def stats_file(cache_dir: Path) -> Path:
    return cache_dir / "stats.json"


def _unfinished(name: str) -> bool:
    return name.startswith("tmp")  # a chunk write that never finished (tempfile prefix)


def disk_usage(cache_dir: Path) -> tuple[int, int]:
    """(chunks, bytes) of the finished chunk files under ``cache_dir``, daemon or not."""
    chunks = total = 0
    root = chunks_dir(cache_dir)
    if root.is_dir():
        for sub in root.iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                if not _unfinished(path.name):
                    chunks += 1
                    total += path.stat().st_size
    return chunks, total


def wipe(cache_dir: Path) -> int:
    """Delete every chunk and the last run's counters (never the staging directory); answers
    how many chunks there were. The caller makes sure no daemon uses the directory."""
    chunks, _ = disk_usage(cache_dir)
    shutil.rmtree(chunks_dir(cache_dir), ignore_errors=True)
    stats_file(cache_dir).unlink(missing_ok=True)
    return chunks


def acquire_lock(cache_dir: Path) -> int:
    """Take the cache directory's lock, or fail with the PID that holds it."""
    path = cache_dir / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UsageError(f"cache directory {cache_dir} is in use by marinfs PID {holder}; "
                         f"give this mount its own --cache-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def lock_holder(cache_dir: Path) -> int | None:
    """The PID of the daemon using ``cache_dir``, or None when it is free."""
    path = cache_dir / "lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
