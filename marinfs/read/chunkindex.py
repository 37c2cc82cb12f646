"""Which chunks the cache holds and how they leave it: a chunk's identity (``ChunkKey``), its
entry, the index in least-recently-used order, the bytes counted against the limit, the data
files and descriptors the chunks keep, and eviction, which unlinks records, punches holes and
unlinks data files. It exists apart from ``ChunkCache`` so that the size bound and its
invariant can be read in one place, next to every table they depend on. ``ChunkIndex`` has no
lock of its own: every table of it is guarded by its ``ChunkCache``'s ``_lock``, which each
``_locked`` method expects held (``adopt`` runs before the cache is shared); an ``Entry``'s
fields are guarded by that lock too, but for ``verified``, which the read that checked the
chunk sets to True without it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from marinfs.objects import ObjectRef, ObjectVersion, cache_id

log = logging.getLogger("marinfs.read.chunkcache")  # one name for the chunk cache's lines, as before its split


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
class Entry:
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
class KeptFd:
    """A descriptor kept open for reads (ChunkIndex.fds); closed only once no read uses it."""

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


class ChunkIndex:
    """The chunks of one cache directory in least-recently-used order, what they count, and
    their removal. Every table here is GUARDED_BY(ChunkCache._lock).

    Evicting a chunk removes its record and punches a hole in its data file, once no read is
    using the chunk's bytes; the data file goes with its last chunk. A crash leaves at worst
    bytes with no record, whose blocks the next start punches out (``adopt``).

    INVARIANT: ``used <= max_bytes`` at all times (checked by ``check_invariants_locked``):
    space is reserved before a chunk is written, evicting least-recently-used chunks first, and
    a chunk that cannot fit is simply not cached. A chunk's bytes are freed (a hole punched)
    only once no read is using them, and the same chunk is not written again until then.
    """

    def __init__(self, where: Path, max_bytes: int, min_free_bytes: int, stats: CacheStats) -> None:
        # Set once, here: where, max_bytes, min_free_bytes (read without the lock).
        self.where = where  # the chunks directory: its disk's free space, and the cache's name in the log
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.stats = stats  # GUARDED_BY(ChunkCache._lock): the cache's counters (evictions counted here)
        # GUARDED_BY(ChunkCache._lock): (object id, index) -> entry, LRU order, oldest first.
        self.entries: OrderedDict[tuple[str, int], Entry] = OrderedDict()
        self.used = 0  # GUARDED_BY(ChunkCache._lock): the entries' bytes and `reserved`
        self.reserved = 0  # GUARDED_BY(ChunkCache._lock): bytes of chunks being written (reserve_locked)
        # GUARDED_BY(ChunkCache._lock): kept descriptors, least recently read first.
        self.fds: OrderedDict[Path, KeptFd] = OrderedDict()
        # GUARDED_BY(ChunkCache._lock): data file -> its chunks in the index, those that left it
        # while read, and writes into it in flight: it is unlinked only at 0, so no read or write
        # ever meets a new file of the same name.
        self.files: dict[Path, int] = {}
        # GUARDED_BY(ChunkCache._lock): chunks whose region waits for its reads to end.
        self.punching: set[tuple[str, int]] = set()
        self.writing: set[tuple[str, int]] = set()  # GUARDED_BY(ChunkCache._lock): chunks being written by put
        # GUARDED_BY(ChunkCache._lock): object id -> open pins (``pin``): its chunks are not evicted.
        self.pins: dict[str, int] = {}
        # GUARDED_BY(ChunkCache._lock): data files never punched: ones handed out by ``pin`` (a
        # process's map of the file made through passthrough outlives every handle, and reads it
        # directly: such a file leaves whole, unlinked, so the map keeps its blocks), and ones
        # holding chunks cut with two chunk sizes (a punch for one would cut into the other's
        # bytes). Both go whole.
        self.unpunched: set[Path] = set()
        # GUARDED_BY(ChunkCache._lock): the filesystem punches holes; else an eviction takes the whole file.
        self.punch = True

    def adopt(self, found: list[tuple[int, tuple[str, int], Entry]], data: Path) -> None:
        """Take the chunks the records on disk name, as (last use, key, entry), oldest first;
        unlink the data files under ``data`` that none of them is in, and free the blocks of the
        others that none of them holds. Before the cache is shared: no lock."""
        found.sort(key=lambda item: item[0])
        regions: dict[Path, list[tuple[int, int]]] = {}
        sizes: dict[Path, set[int]] = {}
        for _, key, entry in found:
            regions.setdefault(entry.path, []).append((entry.offset, entry.size))
            if key[1]:
                sizes.setdefault(entry.path, set()).add(entry.offset // key[1] if entry.offset % key[1] == 0 else -1)
            self.files[entry.path] = self.files.get(entry.path, 0) + 1
            self.entries[key] = entry
            self.used += entry.size
        self.unpunched.update(path for path, seen in sizes.items() if len(seen) > 1)
        for sub in data.iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                if path not in regions:
                    path.unlink(missing_ok=True)  # no chunk of it was recorded
                else:
                    punch_unrecorded(path, regions[path], self.where)

    def lookup_locked(self, key: ChunkKey) -> Entry | None:
        """The chunk's entry; None if there is none or it was cut with another chunk size (it
        holds other bytes of the object: dropped, its data file never punched from now on, as
        this size's chunks will overlap the other's)."""
        ikey = (key.object_id, key.index)
        entry = self.entries.get(ikey)
        if entry is not None and key.start >= 0 and entry.offset != key.start:
            self.unpunched.add(entry.path)
            self.remove_locked(ikey, entry)
            return None
        return entry

    def whole_locked(self, path: Path, object_id: str, chunks: int, size: int,
                     verified: bool = False) -> list[Entry] | None:
        """The ``chunks`` entries of a version cached whole (``size`` bytes, each chunk at its
        offset in the one data file ``path``; ``verified``: each checked since the start), in
        order; None if one is missing (or unverified)."""
        entries: list[Entry] = []
        total = 0
        for index in range(chunks):
            entry = self.entries.get((object_id, index))
            if entry is None or entry.path != path or entry.offset != total or (verified and not entry.verified):
                return None
            entries.append(entry)
            total += entry.size
        return entries if total == size else None

    def reserve_locked(self, ikey: tuple[str, int], path: Path, size: int) -> bool:
        """Room for chunk ``ikey`` of ``size`` bytes, about to be written into data file
        ``path``: counted in ``used`` from now on, so the limit holds; hand it back with
        ``written_locked``. False when it cannot fit, or the chunk is still being punched out
        or written."""
        if (ikey in self.punching or ikey in self.writing or size > self.max_bytes
                or not self.evict_locked(size)):
            return False
        self.writing.add(ikey)  # (the fetcher writes a chunk once; if not, the first one wins)
        self.reserved += size
        self.used += size
        self.files[path] = self.files.get(path, 0) + 1
        return True

    def written_locked(self, ikey: tuple[str, int], path: Path, size: int, entry: Entry | None) -> bool:
        """A reserved chunk's write is over: recorded as ``entry``, or (None) failed and its
        room given back. Answers whether it is in the index."""
        self.writing.discard(ikey)
        self.reserved -= size
        if entry is not None:
            self.entries[ikey] = entry
            return True
        self.used -= size
        self.release_file_locked(path)
        return False

    def evict_locked(self, incoming: int) -> bool:
        """Make room for ``incoming`` bytes under the size limit and the free-space floor,
        least recently used chunks first; never a chunk of a pinned version."""
        skipped = 0
        while self.used + incoming > self.max_bytes or (incoming and self.low_on_disk(incoming)):
            if len(self.entries) <= skipped:  # nothing left that may go
                return self.used + incoming <= self.max_bytes and not (incoming and self.low_on_disk(incoming))
            ikey, entry = next(iter(self.entries.items()))
            if ikey[0] in self.pins:
                self.entries.move_to_end(ikey)  # read whole by the kernel: recently used anyway
                skipped += 1
                continue
            self.remove_locked(ikey, entry)
            self.stats.evictions += 1
        return True

    def remove_locked(self, ikey: tuple[str, int], entry: Entry) -> None:
        """Take a chunk out of the index; its bytes go now, or after the reads using them."""
        del self.entries[ikey]
        self.used -= entry.size
        if entry.users:
            entry.gone = True
            entry.marker.unlink(missing_ok=True)  # unrecorded now; a crash before its bytes go: the next start frees them
            self.punching.add(ikey)
        else:
            self.erase_locked(ikey, entry)

    def erase_locked(self, ikey: tuple[str, int], entry: Entry) -> None:
        """A chunk no read uses any more, out of the index: off the disk."""
        entry.gone = False
        self.punching.discard(ikey)
        entry.marker.unlink(missing_ok=True)
        if self.files.get(entry.path, 0) > 1 and ikey[0] not in self.pins:  # (else the file goes whole)
            if self.punch and entry.path not in self.unpunched:
                try:
                    punch_region(entry.path, entry.offset, entry.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        log.warning("chunk cache: cannot free chunk %s of %s: %s", ikey[1], entry.path, exc)
                    else:
                        self.punch = False
                        log.info("chunk cache %s: no hole punching (%s); a version's chunks leave together",
                                 self.where, exc)
            if not self.punch or entry.path in self.unpunched:
                self.evict_file_locked(entry.path)
        self.release_file_locked(entry.path)

    def evict_file_locked(self, path: Path) -> None:
        """Every chunk of data file ``path`` out of the index (where holes cannot be punched,
        the space of one chunk is only freed with its whole file)."""
        for ikey, entry in [(k, e) for k, e in self.entries.items() if e.path == path]:
            if ikey[0] in self.pins:
                continue
            del self.entries[ikey]
            self.used -= entry.size
            self.stats.evictions += 1
            entry.marker.unlink(missing_ok=True)
            if entry.users:  # its share of the file is let go at its last read (_done)
                entry.gone = True
                self.punching.add(ikey)
            else:
                self.files[path] -= 1

    def release_file_locked(self, path: Path) -> None:
        left = self.files.get(path, 0) - 1
        if left > 0:
            self.files[path] = left
            return
        self.files.pop(path, None)
        self.unpunched.discard(path)  # a new file of that name is a new inode: punched as usual
        self.shut_locked(path)
        path.unlink(missing_ok=True)

    def shut_locked(self, path: Path) -> None:
        """``path`` keeps no descriptor from now on: closed now, or by its last read's _done."""
        fd = self.fds.pop(path, None)
        if fd is None:
            return
        fd.shut = True
        if not fd.users:
            os.close(fd.fd)

    def low_on_disk(self, incoming: int) -> bool:
        if not self.min_free_bytes:
            return False
        try:
            return shutil.disk_usage(self.where).free - incoming < self.min_free_bytes
        except OSError:
            return False

    def check_invariants_locked(self, open_files: int) -> None:
        assert self.used <= self.max_bytes, (self.used, self.max_bytes)
        assert self.used == sum(e.size for e in self.entries.values()) + self.reserved
        assert len(self.fds) <= open_files, (len(self.fds), open_files)
        for path, fd in self.fds.items():  # kept descriptors are of files still in use
            assert not fd.shut and path in self.files, path
        for entry in self.entries.values():
            assert not entry.gone and self.files.get(entry.path, 0) >= 1, entry.path


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_FALLOC_FL_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01  # linux/falloc.h: punching needs KEEP_SIZE


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``fd``'s blocks in ``[offset, offset+length)`` (they read as zeros), size kept."""
    if length > 0 and _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def punch_region(path: Path, offset: int, size: int) -> None:
    wfd = os.open(path, os.O_RDWR)
    try:
        punch_hole(wfd, offset, size)
    finally:
        os.close(wfd)


def punch_unrecorded(path: Path, recorded: list[tuple[int, int]], where: Path) -> None:
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
                    punch_hole(fd, at, offset - at)
                at = max(at, offset + size)
            if at < end:
                punch_hole(fd, at, end - at)
            pos = end
    except OSError as exc:
        log.info("chunk cache %s: cannot free unrecorded blocks of %s: %s", where, path, exc)
    finally:
        os.close(fd)
