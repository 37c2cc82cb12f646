"""The read path without FUSE: chunk cache (limits, LRU, checksums, restarts, lock) and the
reader (chunk fetches, readahead, single-flight, versions)."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from chunkfiles import cut_short, flip_byte, records, region
from marinfs.read.chunkcache import ChunkCache, ChunkKey, lock_holder
from marinfs.errors import UsageError, errno_for
from marinfs.read.reader import ChunkFetcher, ObjectReader, ObjectRef

KiB, MiB = 1 << 10, 1 << 20
DATA = os.urandom(20 * MiB)


class RecordingFetch:
    """A remote stand-in that records every ranged GET (and can be slow or short)."""

    def __init__(self, data: bytes, delay: float = 0.0, short: bool = False) -> None:
        self.data, self.delay, self.short = data, delay, short
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, key: str, start: int, end: int, version: str) -> bytes:
        with self.lock:
            self.calls.append((start, end))
        time.sleep(self.delay)
        return self.data[start:end][: 3 if self.short else None]


def fetched(calls: list[tuple[int, int]], start: int = 0, end: int = 1 << 62) -> int:
    """Bytes fetched within [start, end), counting overlaps twice."""
    return sum(max(0, min(e, end) - max(s, start)) for s, e in calls)


def covers(calls: list[tuple[int, int]], size: int) -> bool:
    """Whether the calls fetched [0, size) exactly once."""
    pos = 0
    for s, e in sorted(calls):
        if s != pos:
            return False
        pos = e
    return pos == size


def ref(size: int = len(DATA), version: str = "v1") -> ObjectRef:
    return ObjectRef(url="mem://b/obj", key="obj", version=version, size=size)


def test_sequential_reads_fetch_each_chunk_once(tmp_path: Path) -> None:
    fetch = RecordingFetch(DATA)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 64 * MiB), chunk_size=8 * MiB)
    reader = ObjectReader(ref(), fetcher)
    out = b"".join(reader.read(128 * KiB, off) for off in range(0, len(DATA), 128 * KiB))
    assert out == DATA
    assert covers(fetch.calls, len(DATA))
    assert sorted(fetch.calls)[-2:] == [(8 * MiB, 16 * MiB), (16 * MiB, 20 * MiB)]  # readahead: whole chunks
    fetcher.close()


def test_random_read_fetches_only_the_chunk_it_touches() -> None:
    fetch = RecordingFetch(DATA)
    reader = ObjectReader(ref(), ChunkFetcher(fetch, None, chunk_size=1 * MiB))
    assert reader.read(4096, 10 * MiB + 5) == DATA[10 * MiB + 5:10 * MiB + 4101]
    time.sleep(0.05)
    assert fetch.calls == [(10 * MiB, 11 * MiB)]  # no readahead after a seek


def test_a_demand_miss_is_fetched_as_parallel_sub_ranges() -> None:
    """A reader waiting on a chunk gets it as 4 concurrent GETs of 2 MiB (one stream delivers
    8 MiB in about twice the time), each byte once; small chunks are not split below 1 MiB."""
    fetch = RecordingFetch(DATA, delay=0.2)
    fetcher = ChunkFetcher(fetch, None, chunk_size=8 * MiB)
    started = time.monotonic()
    assert ObjectReader(ref(), fetcher).read(MiB, 9 * MiB) == DATA[9 * MiB:10 * MiB]
    assert time.monotonic() - started < 0.6  # concurrent, not 4 x 0.2 s
    assert sorted(fetch.calls) == [(lo, lo + 2 * MiB) for lo in range(8 * MiB, 16 * MiB, 2 * MiB)]
    small = RecordingFetch(DATA)
    ObjectReader(ref(), ChunkFetcher(small, None, chunk_size=1 * MiB)).read(10, 5 * MiB)
    assert small.calls == [(5 * MiB, 6 * MiB)]
    fetcher.close()


def test_dense_random_reads_fetch_the_rest_of_the_file(tmp_path: Path) -> None:
    """A handle whose random reads touched an eighth of the chunks gets the rest fetched in
    the background, each chunk once; not when the disk cache could not hold the file twice."""
    data = os.urandom(64 * MiB)
    fetch = RecordingFetch(data)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path / "big", 256 * MiB), chunk_size=1 * MiB)
    reader = ObjectReader(ref(len(data)), fetcher)
    order = [37, 3, 55, 12, 60, 21, 44, 8]  # 8 of 64 chunks, out of order
    for i in order:
        assert reader.read(4096, i * MiB + 100) == data[i * MiB + 100:i * MiB + 4196]
    deadline = time.monotonic() + 10
    while fetched(fetch.calls) < len(data) and time.monotonic() < deadline:
        time.sleep(0.01)  # the sweep goes on by itself
    fetcher.close()
    assert covers(fetch.calls, len(data))
    for i in range(64):
        assert reader.read(10, i * MiB) == data[i * MiB:i * MiB + 10]

    slow = RecordingFetch(data, delay=0.05)
    stopped = ChunkFetcher(slow, ChunkCache(tmp_path / "closed", 256 * MiB), chunk_size=1 * MiB)
    reader = ObjectReader(ref(len(data)), stopped)
    for i in order:
        reader.read(10, i * MiB)
    reader.close()  # the handle is released: its sweep stops
    time.sleep(0.5)
    stopped.close()
    assert fetched(slow.calls) < len(data) // 2

    sparse = RecordingFetch(data)
    small_cache = ChunkFetcher(sparse, ChunkCache(tmp_path / "small", 100 * MiB), chunk_size=1 * MiB)
    reader = ObjectReader(ref(len(data)), small_cache)
    for i in order * 3:
        reader.read(4096, i * MiB)
    small_cache.close()
    assert fetched(sparse.calls) == len(order) * MiB  # only what was read


def test_without_a_disk_cache_readahead_fits_the_memory_it_has() -> None:
    """With --cache-size 0 the readahead window is capped to what the memory LRU holds:
    a sequential read fetches each byte once (it used to fetch a 1 GiB file twice)."""
    data = os.urandom(48 * MiB)
    fetch = RecordingFetch(data, delay=0.002)
    fetcher = ChunkFetcher(fetch, None, chunk_size=1 * MiB, memory_bytes=8 * MiB)
    reader = ObjectReader(ref(len(data)), fetcher, max_window=32)
    out = b"".join(reader.read(128 * KiB, off) for off in range(0, len(data), 128 * KiB))
    fetcher.close()
    assert out == data and covers(fetch.calls, len(data))


def test_reads_across_chunks_eof_and_short_fetch() -> None:
    fetch = RecordingFetch(DATA)
    reader = ObjectReader(ref(), ChunkFetcher(fetch, None, chunk_size=1 * MiB))
    assert reader.read(3 * MiB, MiB - 10) == DATA[MiB - 10:4 * MiB - 10]
    assert reader.read(10, len(DATA)) == b"" and reader.read(0, 5) == b""
    assert reader.read(100, len(DATA) - 7) == DATA[-7:]
    short = ObjectReader(ref(), ChunkFetcher(RecordingFetch(DATA, short=True), None, chunk_size=1 * MiB))
    with pytest.raises(EOFError) as caught:
        short.read(10, 0)
    assert errno_for(caught.value) == errno.EIO


def test_concurrent_readers_of_one_chunk_share_one_get() -> None:
    fetch = RecordingFetch(DATA, delay=0.2)
    fetcher = ChunkFetcher(fetch, None, chunk_size=8 * MiB)
    results: list[bytes] = []
    readers = [ObjectReader(ref(), fetcher) for _ in range(8)]
    threads = [threading.Thread(target=lambda r=r: results.append(r.read(MiB, 2 * MiB))) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [DATA[2 * MiB:3 * MiB]] * 8
    assert fetched(fetch.calls, 0, 8 * MiB) == 8 * MiB  # each byte of chunk 0 once


def test_disk_cache_serves_a_new_fetcher_and_keys_by_version(tmp_path: Path) -> None:
    first = RecordingFetch(DATA)
    fetcher = ChunkFetcher(first, ChunkCache(tmp_path, 64 * MiB, lock=False), chunk_size=8 * MiB)
    assert ObjectReader(ref(), fetcher).read(MiB, 0) == DATA[:MiB]
    fetcher.close()  # waits for the readahead of chunk 1
    second = RecordingFetch(DATA)
    fetcher = ChunkFetcher(second, ChunkCache(tmp_path, 64 * MiB, lock=False), chunk_size=8 * MiB)
    assert ObjectReader(ref(), fetcher).read(MiB, 0) == DATA[:MiB]
    fetcher.close()
    assert second.calls == []  # a restart keeps the cache
    new_data = bytes(reversed(DATA))
    third = RecordingFetch(new_data)
    fetcher = ChunkFetcher(third, ChunkCache(tmp_path, 64 * MiB, lock=False), chunk_size=8 * MiB)
    assert ObjectReader(ref(version="v2"), fetcher).read(MiB, 0) == new_data[:MiB]
    fetcher.close()
    assert fetched(third.calls, 0, 8 * MiB) == 8 * MiB  # a new version is never served old chunks


# -- the chunk cache -----------------------------------------------------------------------------


def key(i: int, version: str = "v") -> ChunkKey:
    return ChunkKey("s3://b/x", version, i)


def test_limit_holds_and_eviction_is_lru(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 10 * KiB)
    for i in range(30):
        assert cache.put(key(i), bytes([i]) * 3000)
        cache.check_invariants()
        assert cache.used <= 10 * KiB
        if i >= 1:
            assert cache.read(key(i - 1), 0, 1) == bytes([i - 1])  # recently used stays
    assert cache.snapshot()["chunks"] == 3 and cache.stats.evictions == 27
    assert cache.read(key(0), 0, 10) is None
    assert not cache.put(key(99), b"x" * (11 * KiB))  # larger than the whole cache: not cached
    cache.check_invariants()


def _open_chunk_files(cache_dir: Path) -> list[str]:
    """The files of ``cache_dir`` this process has open (deleted ones end in " (deleted)")."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith((str(cache_dir / "chunks"), str(cache_dir / "data"))):
            found.append(target)
    return found


def test_reads_of_a_chunk_share_one_kept_descriptor_closed_when_it_goes(tmp_path: Path) -> None:
    """A mapped file's faults read a chunk 4 KiB at a time: its file stays open between reads
    (an open and a close per read cost as much as the read), for the last OPEN_FILES files
    read; evicted, discarded or the cache closed, nothing stays open."""
    cache = ChunkCache(tmp_path, 3 * KiB)
    cache.OPEN_FILES = 2
    for i in range(3):  # three versions: three data files
        assert cache.put(key(0, f"v{i}"), bytes([i]) * KiB)
    for _ in range(3):
        for i in range(3):
            assert cache.read(key(0, f"v{i}"), 7, 2) == bytes([i]) * 2  # the first read verifies the chunk
    assert len(_open_chunk_files(tmp_path)) == 2  # v1 and v2: v0 was read least recently
    assert cache.put(key(0, "v3"), b"3" * KiB) and cache.put(key(0, "v4"), b"4" * KiB)  # evicts v0, then v1
    assert cache.stats.evictions == 2
    assert all("deleted" not in f for f in _open_chunk_files(tmp_path))  # v1's file closed with it
    assert len(_open_chunk_files(tmp_path)) == 1 and cache.read(key(0, "v1"), 0, 1) is None
    cache.close()
    assert _open_chunk_files(tmp_path) == []
    cache.check_invariants()


def test_a_chunk_evicted_while_read_keeps_its_bytes_until_the_read_ends(tmp_path: Path) -> None:
    """A chunk that leaves the index while a read uses it: the read still reads its bytes (its
    region is punched out, and its descriptor closed, only after that read), the same chunk is
    not written again into the region meanwhile, and the version's other chunks stay whole."""
    cache = ChunkCache(tmp_path, MiB, chunk_size=64 * KiB)
    first, second = os.urandom(64 * KiB), os.urandom(64 * KiB)
    assert cache.put(key(0), first) and cache.put(key(1), second) and cache.read(key(1), 0, 1) == second[:1]
    (rec0,), (rec1,) = records(tmp_path, 0), records(tmp_path, 1)
    path, offset, size = region(rec1)
    assert region(rec0)[0] == path and (offset, size) == (64 * KiB, 64 * KiB)  # one data file
    ikey = (key(1).object_id, 1)
    entry, verified, fd = cache._used_entry(key(1), take_fd=True)  # a read in flight holds it
    assert verified and fd is not None
    with cache._lock:
        cache._index.remove_locked(ikey, entry)  # evicted
    assert not rec1.exists() and cache.read(key(1), 0, 1) is None  # gone from the index at once
    assert not cache.put(key(1), second)  # not into a region a read still uses
    assert os.pread(fd.fd, 3, offset + 2) == second[2:5]  # the reader finishes
    cache.check_invariants()
    cache._done(ikey, entry, fd)
    with open(path, "rb") as f:
        assert os.lseek(f.fileno(), offset, os.SEEK_HOLE) == offset  # its blocks are freed now
    assert cache.read(key(0), 0, 64 * KiB) == first
    assert cache.put(key(1), second) and cache.read(key(1), 0, 64 * KiB) == second
    cache.close()
    assert _open_chunk_files(tmp_path) == []
    cache.check_invariants()


def test_files_are_private_and_a_second_daemon_is_refused(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", MiB)
    cache.put(key(1), b"abc")
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
    files = [p for p in (tmp_path / "c/chunks").rglob("*") if p.is_file()]
    assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    assert lock_holder(tmp_path / "c") == os.getpid()
    with pytest.raises(UsageError, match="in use"):
        ChunkCache(tmp_path / "c", MiB)
    cache.close()
    assert lock_holder(tmp_path / "c") is None
    ChunkCache(tmp_path / "c", MiB).close()


def test_corrupt_chunk_is_detected_and_never_served(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, MiB)
    cache.put(key(1), b"hello world")
    cache.close()
    (path,) = records(tmp_path, 1)
    flip_byte(path, 3)
    restarted = ChunkCache(tmp_path, MiB)
    assert restarted.read(key(1), 0, 11) is None
    assert restarted.stats.corrupt == 1 and not path.exists()
    restarted.check_invariants()


def _data_blocks(path: Path) -> list[tuple[int, int]]:
    """The (start, end) ranges of ``path`` that hold blocks (SEEK_DATA / SEEK_HOLE)."""
    ranges, pos = [], 0
    with open(path, "rb") as f:
        while True:
            try:
                start = os.lseek(f.fileno(), pos, os.SEEK_DATA)
            except OSError:
                return ranges
            pos = os.lseek(f.fileno(), start, os.SEEK_HOLE)
            ranges.append((start, pos))


def test_a_version_is_one_sparse_file_of_its_chunks_at_their_offsets(tmp_path: Path) -> None:
    """Chunks of one version land in one data file at their offsets in the object, each
    recorded by its own empty file; with all of them cached the data file is the object."""
    chunk = 64 * KiB
    data = os.urandom(3 * chunk + 100)
    cache = ChunkCache(tmp_path, MiB, chunk_size=chunk)
    for i in (2, 0, 3):
        assert cache.put(key(i), data[i * chunk:(i + 1) * chunk])
    (path, offset, size), = {region(r) for r in records(tmp_path, 3)}
    assert (offset, size) == (3 * chunk, 100) and path.stat().st_size == len(data)
    assert all(r.stat().st_size == 0 for r in records(tmp_path))
    assert _data_blocks(path) == [(0, chunk), (2 * chunk, len(data))]  # chunk 1: a hole
    assert cache.pin(key(0).object_id, 4, len(data)) is None  # chunk 1 missing: not the object
    assert cache.put(key(1), data[chunk:2 * chunk])
    assert path.read_bytes() == data
    cache.check_invariants()


def test_a_pinned_version_is_the_object_and_is_not_evicted(tmp_path: Path) -> None:
    """``pin`` hands out the data file of a version cached whole and verified (what the kernel
    reads by itself, FUSE passthrough); its chunks are not evicted while pinned, and a chunk
    that cannot fit beside them is not cached. Unverified chunks (after a restart) or a wrong
    size or count: no pin."""
    chunk = 64 * KiB
    data = os.urandom(2 * chunk)
    cache = ChunkCache(tmp_path, 3 * chunk, chunk_size=chunk)
    oid = key(0).object_id
    for i in range(2):
        assert cache.put(key(i), data[i * chunk:(i + 1) * chunk])
    assert cache.pin(oid, 2, len(data) + 1) is None and cache.pin(oid, 3, 3 * chunk) is None
    fd = cache.pin(oid, 2, len(data))
    assert fd is not None
    try:
        assert os.pread(fd, len(data) + 1, 0) == data
        for i in range(3):  # other versions come and go; the pinned one stays
            assert cache.put(key(0, f"other{i}"), b"x" * chunk)
            cache.check_invariants()
        assert not cache.put(key(1, "other9"), b"y" * (2 * chunk))  # no room beside the pin
        assert cache.contains(key(0)) and cache.contains(key(1))
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
        cache.unpin(oid)
    assert cache.pinned() == 0
    assert cache.put(key(0, "new"), b"z" * (2 * chunk)) and not cache.contains(key(0))  # evictable again
    cache.close()
    again = ChunkCache(tmp_path, 8 * chunk, chunk_size=chunk)
    assert again.put(key(0, "w"), data[:chunk]) and again.put(key(1, "w"), data[chunk:])
    again.close()
    restarted = ChunkCache(tmp_path, 8 * chunk, chunk_size=chunk)
    woid = key(0, "w").object_id
    assert restarted.pin(woid, 2, len(data)) is None  # not verified since this start
    assert restarted.read(key(0, "w"), 0, chunk) == data[:chunk]
    assert restarted.read(key(1, "w"), 0, chunk) == data[chunk:]
    fd = restarted.pin(woid, 2, len(data))
    assert fd is not None
    os.close(fd)
    restarted.unpin(woid)


def _settled(cache: ChunkCache) -> None:
    deadline = time.monotonic() + 10
    while cache.verifying() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not cache.verifying()


def test_a_version_cached_whole_before_a_restart_is_checked_in_the_background(tmp_path: Path) -> None:
    """After a restart nothing is verified yet; ``verify_later`` checks a whole version's chunks
    on a thread of its own (once), after which it pins; a damaged chunk is discarded instead."""
    chunk = 64 * KiB
    data, other = os.urandom(3 * chunk + 5), os.urandom(2 * chunk)
    cache = ChunkCache(tmp_path, 16 * chunk, chunk_size=chunk)
    for i in range(4):
        assert cache.put(key(i), data[i * chunk:(i + 1) * chunk])
    for i in range(2):
        assert cache.put(key(i, "b"), other[i * chunk:(i + 1) * chunk])
    assert cache.put(key(0, "part"), data[:chunk])  # a version not whole
    cache.close()
    flip_byte(next(r for r in records(tmp_path, 1) if r.name.startswith(key(1, "b").object_id)))
    restarted = ChunkCache(tmp_path, 16 * chunk, chunk_size=chunk)
    oid, boid = key(0).object_id, key(0, "b").object_id
    assert restarted.pin(oid, 4, len(data)) is None  # not verified since this start
    assert restarted.read(key(0), 0, chunk) == data[:chunk]  # one read through: still not all
    assert restarted.pin(oid, 4, len(data)) is None
    assert restarted.verify_later(oid, 4, len(data))
    assert restarted.verify_later(boid, 2, len(other))
    assert not restarted.verify_later(key(0, "part").object_id, 2, 2 * chunk)  # not whole: nothing to do
    _settled(restarted)
    fd = restarted.pin(oid, 4, len(data))
    assert fd is not None and os.pread(fd, len(data) + 1, 0) == data
    os.close(fd)
    restarted.unpin(oid)
    assert not restarted.verify_later(oid, 4, len(data))  # verified: nothing to do
    assert restarted.pin(boid, 2, len(other)) is None and not restarted.contains(key(1, "b"))
    assert restarted.stats.corrupt == 1
    restarted.check_invariants()
    restarted.close()


def test_chunks_cut_with_two_chunk_sizes_never_punch_each_other(tmp_path: Path) -> None:
    """A restart with another chunk size: chunk N stands for other bytes, and the new chunks
    overlap the old ones in the version's data file, so dropping or evicting an old one must
    not punch the new one's bytes out (they were read back as zeros, unchecked). Found in review."""
    data = os.urandom(256 * KiB)
    small, big = 64 * KiB, 128 * KiB

    def at(i: int, size: int) -> ChunkKey:
        return ChunkKey("s3://b/x", "v", i, start=i * size)

    cache = ChunkCache(tmp_path, 4 * MiB, chunk_size=small)
    for i in range(4):
        assert cache.put(at(i, small), data[i * small:(i + 1) * small])
    cache.close()
    cache = ChunkCache(tmp_path, 4 * MiB, chunk_size=big)
    assert cache.read(at(1, big), 0, big) is None  # the 64 KiB chunk 1 is other bytes: dropped
    assert cache.put(at(1, big), data[big:])  # over the old chunks 2 and 3
    assert cache.read(at(2, big), 0, 1) is None  # drops the old chunk 2, under the new chunk 1
    assert cache.read(at(1, big), 0, big) == data[big:]
    for i in range(8):  # the rest of the old ones evicted
        assert cache.put(ChunkKey("s3://b/y", "v", i, start=i * big), b"y" * big)
    assert cache.read(at(1, big), 0, big) in (data[big:], None)  # evicted whole, or whole
    cache.check_invariants()
    cache.close()
    restarted = ChunkCache(tmp_path, 4 * MiB, chunk_size=big)  # a data file of both sizes: never punched
    assert restarted.read(at(1, big), 0, big) in (data[big:], None)


def _mapped_then_closed(tmp_path: Path, chunk: int) -> tuple[ChunkCache, bytes, Any]:
    """A cache of room for 3 chunks holding a 2-chunk version whole, pinned, mapped as
    passthrough would map it, then its file closed and unpinned: the map is all that is left
    (torch.load(mmap=True) does this)."""
    import mmap

    data = os.urandom(2 * chunk)
    cache = ChunkCache(tmp_path, 3 * chunk, chunk_size=chunk)
    for i in range(2):
        assert cache.put(key(i), data[i * chunk:(i + 1) * chunk])
    oid = key(0).object_id
    fd = cache.pin(oid, 2, len(data))
    assert fd is not None
    m = mmap.mmap(fd, len(data), prot=mmap.PROT_READ)
    os.close(fd)
    cache.unpin(oid)
    return cache, data, m


def test_a_data_file_handed_to_the_kernel_is_never_punched(tmp_path: Path) -> None:
    """A map made through passthrough reads the data file itself after every handle closed
    (the kernel's map holds the backing file, not the FUSE file): once unpinned, its chunks
    leave the cache together and the file is unlinked, never punched under the map; the next
    write of that version is a new file. Found in review."""
    chunk = 64 * KiB
    cache, data, m = _mapped_then_closed(tmp_path, chunk)
    oid = key(0).object_id
    try:
        for i in range(2):  # other reads evict the version
            assert cache.put(key(i, "other"), b"y" * chunk)
            cache.check_invariants()
        assert m[:] == data
        assert not cache.contains(key(0)) and not cache.contains(key(1))
        assert not (tmp_path / "data" / oid[:2] / oid).exists()  # unlinked; the map keeps its blocks
        assert cache.put(key(1), data[chunk:]) and cache.read(key(1), 0, chunk) == data[chunk:]
        assert m[:] == data
    finally:
        m.close()
    cache.check_invariants()


def test_a_failed_write_into_a_handed_out_file_punches_nothing(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file once handed to the kernel may be mapped: a chunk written into it again that
    fails midway leaves the bytes where they are (a punch would zero them under the map)."""
    chunk = 64 * KiB
    cache, data, m = _mapped_then_closed(tmp_path, chunk)
    oid = key(0).object_id
    try:
        entry, _, _ = cache._used_entry(key(1))  # a read in flight keeps the file linked
        for i in range(2):
            assert cache.put(key(i, "other"), b"y" * chunk)  # the version leaves, whole
        assert not cache.contains(key(0))

        def no_space(fd: int, data: object, offset: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr("marinfs.read.chunkcache.os.pwrite", no_space)
        cache.put(key(0, "other"), b"z")  # (evicts the other version's chunk 0 to make room)
        assert not cache.put(key(0), data[:chunk])  # into the same, still linked file: fails
        monkeypatch.undo()
        assert m[:] == data
        cache._done((oid, 1), entry, None)
    finally:
        m.close()
    cache.check_invariants()


def test_a_restart_frees_bytes_no_record_stands_for(tmp_path: Path) -> None:
    """A crash between a chunk's bytes and its record leaves blocks the index does not count:
    the next start punches them out; a data file no record names goes, and a record whose
    data file is gone is dropped."""
    chunk = 64 * KiB
    cache = ChunkCache(tmp_path, MiB, chunk_size=chunk)
    kept = os.urandom(chunk)
    assert cache.put(key(0), kept) and cache.put(key(1), os.urandom(chunk)) and cache.put(key(0, "lone"), b"l" * 10)
    cache.close()
    path = tmp_path / "data" / key(0).object_id[:2] / key(0).object_id
    for r in records(tmp_path, 1):
        r.unlink()  # chunk 1's bytes are there, its record is not
    (lone,) = [r for r in records(tmp_path, 0) if key(0, "lone").object_id in r.name]
    lone_data = region(lone)[0]
    lone.unlink()  # a data file with no record at all
    orphan = tmp_path / "chunks" / "ff" / f"{'f' * 32}-0-c00000000+0+5"
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"")  # a record whose data file is gone
    assert _data_blocks(path) == [(0, 2 * chunk)]
    again = ChunkCache(tmp_path, MiB, chunk_size=chunk)
    assert _data_blocks(path) == [(0, chunk)] and not lone_data.exists() and not orphan.exists()
    assert again.read(key(0), 0, chunk) == kept and again.read(key(1), 0, 1) is None
    assert again.snapshot()["chunks"] == 1 and again.used == chunk
    again.check_invariants()


def test_without_hole_punching_a_version_leaves_the_cache_whole(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On a filesystem that cannot punch holes, evicting one chunk of a data file would free
    nothing: its version's other chunks go with it, so the limit holds on disk too."""
    def no_punch(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr("marinfs.read.chunkindex.punch_hole", no_punch)
    chunk = 64 * KiB
    cache = ChunkCache(tmp_path, 3 * chunk, chunk_size=chunk)
    for i in range(3):
        assert cache.put(key(i), bytes([i]) * chunk)
    assert cache.put(key(0, "next"), b"n" * chunk)  # evicts chunk 0 of v, and so all of v
    assert not any(cache.contains(key(i)) for i in range(3)) and cache.contains(key(0, "next"))
    assert records(tmp_path) == [r for r in records(tmp_path) if key(0, "next").object_id in r.name]
    assert not (tmp_path / "data" / key(0).object_id[:2] / key(0).object_id).exists()
    cache.check_invariants()


def test_a_chunk_write_that_fails_midway_leaves_no_bytes_behind(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = 64 * KiB
    cache = ChunkCache(tmp_path, MiB, chunk_size=chunk)
    assert cache.put(key(0), b"a" * chunk)
    real = os.pwrite
    calls = []

    def full_after_one(fd: int, data: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, memoryview(data)[:4096], offset)  # type: ignore[arg-type]

    monkeypatch.setattr("marinfs.read.chunkcache.os.pwrite", full_after_one)
    assert not cache.put(key(1), b"b" * chunk)
    path = region(records(tmp_path, 0)[0])[0]
    assert _data_blocks(path) == [(0, chunk)] and records(tmp_path, 1) == []
    assert cache.used == chunk and cache.stats.write_failures == 1
    cache.check_invariants()


def test_restart_keeps_chunks_and_drops_unfinished_writes(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, MiB)
    cache.put(key(1), b"one")
    cache.put(key(2), b"two")
    cache.close()
    (tmp_path / "chunks/ab").mkdir(exist_ok=True)
    (tmp_path / "chunks/ab/tmp123").write_bytes(b"partial")
    again = ChunkCache(tmp_path, MiB)
    assert again.read(key(2), 0, 3) == b"two" and again.read(key(1), 1, 2) == b"ne"
    assert not (tmp_path / "chunks/ab/tmp123").exists()
    again.close()
    smaller = ChunkCache(tmp_path, 4)  # a smaller limit after a restart is enforced at once
    assert smaller.used <= 4
    smaller.check_invariants()


def test_a_full_disk_degrades_to_uncached_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ChunkCache(tmp_path, 64 * MiB)

    real_open = os.open

    def no_space(path: object, flags: int, *args: object) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("marinfs.read.chunkcache.os.open", no_space)
    fetch = RecordingFetch(DATA)
    fetcher = ChunkFetcher(fetch, cache, chunk_size=8 * MiB)
    reader = ObjectReader(ref(), fetcher)
    assert reader.read(MiB, 3 * MiB) == DATA[3 * MiB:4 * MiB]
    fetcher.close()  # let the readahead it started finish (and fail to cache) too
    assert cache.used == 0 and cache.stats.write_failures >= 1
    cache.check_invariants()


@pytest.mark.parametrize("size", [0, 100, 4096, 8 * MiB, 8 * MiB + 123, 3 * 4096 + 1])
def test_chunks_of_any_size_survive_direct_io(tmp_path: Path, size: int) -> None:
    """Chunks are written with O_DIRECT (aligned bulk) plus a buffered tail; every size reads
    back whole, also after a restart (which verifies the checksum)."""
    data = os.urandom(size)
    cache = ChunkCache(tmp_path, 64 * MiB)
    assert cache.put(key(1), data)
    assert cache.read(key(1), 0, size + 10) == data
    assert cache._io.write_direct  # this machine's disk takes O_DIRECT: the path above was the direct one
    cache.close()
    again = ChunkCache(tmp_path, 64 * MiB)
    assert again.read(key(1), 0, size + 10) == data and again.stats.corrupt == 0


@pytest.mark.parametrize("size", [100, 4096, 8 * MiB + 123])
def test_chunks_from_any_buffer_are_named_and_verified_like_bytes(tmp_path: Path, size: int) -> None:
    """A chunk fetched as obstore's ``Bytes`` (or any buffer) is written without a copy into a
    ``bytes``, its CRC-32C taken from the aligned copy: the same file name as from ``bytes``,
    verified again after a restart; and reads through the fetcher answer ``bytes`` (FUSE's)."""
    obstore = pytest.importorskip("obstore")
    data = os.urandom(size)
    plain = ChunkCache(tmp_path / "plain", 64 * MiB)
    assert plain.put(key(1), data)
    for kind, buf in (("Bytes", obstore.Bytes(data)), ("memoryview", memoryview(data))):
        cache = ChunkCache(tmp_path / kind, 64 * MiB)
        assert cache.put(key(1), buf) and cache._io.write_direct
        assert [p.name for p in (tmp_path / kind).rglob("*-1-*")] == [p.name for p in (tmp_path / "plain").rglob("*-1-*")]
        cache.close()
        again = ChunkCache(tmp_path / kind, 64 * MiB)
        assert again.read(key(1), 0, size) == data and again.stats.corrupt == 0
    fetcher = ChunkFetcher(lambda k, lo, hi, v: obstore.Bytes(data[lo:hi]), ChunkCache(tmp_path / "f", 64 * MiB),
                           chunk_size=8 * MiB)
    reader = ObjectReader(ObjectRef(url="mem://x", key="x", version="v1", size=size), fetcher)
    got = reader.read(size, 0)
    assert type(got) is bytes and got == data
    fetcher.close()


def test_a_filesystem_without_direct_io_gets_buffered_writes(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite

    def no_direct(fd: int, data: object, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr("marinfs.read.chunkcache.os.pwrite", no_direct)
    cache = ChunkCache(tmp_path, 64 * MiB)
    data = os.urandom(MiB + 5)
    assert cache.put(key(1), data) and cache.put(key(2), data[:4096])
    assert cache.read(key(1), 0, MiB + 5) == data and cache.read(key(2), 0, MiB) == data[:4096]
    assert not cache._io.write_direct
    assert cache.put(key(3), memoryview(data)) and cache.read(key(3), 0, MiB + 5) == data  # any buffer


def test_chunks_of_an_older_daemon_are_dropped_and_other_chunk_sizes_never_served(tmp_path: Path) -> None:
    """An older daemon kept a file per chunk, named for its index alone: with another
    ``--chunk-size`` since, chunk N stands for other bytes of the object, so such files are
    dropped at start (fetched again), never served. A record names where its chunk starts: a
    chunk cut with another chunk size is a miss, dropped, never another chunk's bytes."""
    import zlib

    cache = ChunkCache(tmp_path, MiB)
    cache.put(key(1), b"new chunk")
    cache.close()
    (new,) = records(tmp_path, 1)
    crc = new.name.rsplit("-", 1)[1].split("+")[0]
    assert len(crc) == 9 and crc[0] == "c"
    sub, object_id = new.parent, new.name.split("-")[0]
    old = sub / f"{object_id}-2-{zlib.crc32(b'old chunk'):08x}"
    old.write_bytes(b"old chunk")
    again = ChunkCache(tmp_path, MiB)
    assert not old.exists() and again.read(key(2), 0, 9) is None
    assert again.read(key(1), 0, 9) == b"new chunk"  # (key(1) says nothing of where: the cache's size)
    at = ChunkKey("s3://b/x", "v", 1, start=MiB)  # chunk 1 of a 1 MiB chunk size: other bytes
    assert not again.contains(at) and again.read(at, 0, 9) is None and not new.exists()
    assert again.put(at, b"other size") and again.read(at, 0, 10) == b"other size"
    again.check_invariants()


def test_readahead_of_many_readers_shares_one_memory_budget() -> None:
    """8 readers at once, without a disk cache to fall back on: memory (chunks held plus
    chunks asked for ahead) stays within the mount's budget but for what each reader needs to
    go on (the chunk it reads and the next, read on demand when readahead had no room), every
    byte is fetched once (a chunk fetched ahead is never dropped before it is read), and a
    lone reader still gets a window ahead of it."""
    data = os.urandom(16 * MiB)
    fetch = RecordingFetch(data, delay=0.005)
    fetcher = ChunkFetcher(fetch, None, chunk_size=1 * MiB, memory_bytes=6 * MiB)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            m = fetcher.memory()
            peak[0] = max(peak[0], m["used"] + m["reserved"])
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    refs = [ObjectRef(url=f"mem://b/o{i}", key="obj", version="v1", size=len(data)) for i in range(8)]
    outs: dict[int, bytes] = {}

    def run(i: int) -> None:
        reader = ObjectReader(refs[i], fetcher)
        outs[i] = b"".join(reader.read(256 * KiB, off) for off in range(0, len(data), 256 * KiB))
        reader.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert all(outs[i] == data for i in range(8))
    assert fetched(fetch.calls) == 8 * len(data)  # each object's bytes once
    assert peak[0] <= 6 * MiB + 2 * 8 * MiB  # old design: 8 windows of up to 32 chunks each
    assert fetcher.memory()["held"] == 0  # closed readers hold nothing
    fetcher.close()

    lone = RecordingFetch(data, delay=0.05)
    solo = ChunkFetcher(lone, None, chunk_size=1 * MiB, memory_bytes=6 * MiB)
    reader = ObjectReader(ref(len(data)), solo)
    for off in range(0, 640 * KiB, 128 * KiB):  # the window doubles: 1, 2, 4, 8, 16 chunks
        reader.read(128 * KiB, off)
    time.sleep(0.03)
    assert len(lone.calls) == 6  # the chunk read and 5 ahead: as many as the budget holds
    solo.close()


# -- reads into the caller's buffer (what FUSE replies are made of) ------------------------------


def guarded(size: int, pad: int = 64) -> tuple[bytearray, memoryview]:
    """A buffer of ``size`` bytes between two guard bands, as a writable view of it."""
    buf = bytearray(b"\xaa" * (size + 2 * pad))
    return buf, memoryview(buf)[pad:pad + size]


def untouched_guards(buf: bytearray, size: int, pad: int = 64) -> bool:
    return buf[:pad] == b"\xaa" * pad and buf[pad + size:] == b"\xaa" * pad


def test_read_into_fills_a_view_across_chunks_from_memory_then_from_disk(tmp_path: Path) -> None:
    fetch = RecordingFetch(DATA)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 64 * MiB, lock=False), chunk_size=MiB)
    size, offset = 3 * MiB + 20, MiB - 10  # spans chunks 0 to 4
    buf, view = guarded(size)
    assert ObjectReader(ref(), fetcher).read_into(view, offset) == size
    assert view == DATA[offset:offset + size] and untouched_guards(buf, size)
    assert fetcher.settle()
    fetcher.drop_memory()  # only the disk cache is left
    before = len(fetch.calls)
    buf, view = guarded(size)
    assert ObjectReader(ref(), fetcher).read_into(view, offset) == size
    assert view == DATA[offset:offset + size] and untouched_guards(buf, size)
    assert fetch.calls[before:] == [] or all(s >= 5 * MiB for s, _ in fetch.calls[before:])  # readahead only
    fetcher.close()


def test_read_into_stops_at_the_end_of_the_object_and_leaves_the_rest() -> None:
    fetcher = ChunkFetcher(RecordingFetch(DATA), None, chunk_size=MiB)
    reader = ObjectReader(ref(), fetcher)
    buf, view = guarded(100)
    assert reader.read_into(view, len(DATA) - 7) == 7
    assert view[:7] == DATA[-7:] and view[7:] == b"\xaa" * 93 and untouched_guards(buf, 100)
    assert reader.read_into(view, len(DATA)) == 0 and reader.read_into(view[:0], 0) == 0
    fetcher.close()


def test_read_into_a_ctypes_buffer_like_libfuses() -> None:
    """FUSE hands a C buffer; the view of it (see _Fuse.read) must take memoryview slices."""
    import ctypes

    size = 2 * MiB
    raw = (ctypes.c_byte * size)()
    pointer = ctypes.cast(raw, ctypes.POINTER(ctypes.c_byte))
    view = memoryview((ctypes.c_ubyte * size).from_address(ctypes.addressof(pointer.contents))).cast("B")
    fetcher = ChunkFetcher(RecordingFetch(DATA), None, chunk_size=MiB)
    assert ObjectReader(ref(), fetcher).read_into(view, 5) == size
    assert bytes(raw) == DATA[5:5 + size]
    fetcher.close()


def test_corrupt_or_cut_chunks_are_never_served_into_a_view(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, MiB)
    cache.put(key(1), b"hello world")
    cache.put(key(2), b"second chunk")
    cache.close()
    (path,) = records(tmp_path, 1)
    flip_byte(path, 4)  # found by the first read's checksum
    restarted = ChunkCache(tmp_path, MiB)
    buf, view = guarded(5)
    assert not restarted.read_into(key(1), view, 6)
    assert restarted.stats.corrupt == 1 and not path.exists()
    view[:] = b"zzzzz"
    assert restarted.read_into(key(2), view, 0) and view == b"secon"  # verified, then read
    (cut,) = records(tmp_path, 2)
    cut_short(cut, 3)  # cut short after it was verified: a miss, never a short read
    assert not restarted.read_into(key(2), view, 0)
    assert restarted.stats.corrupt == 2 and not cut.exists() and untouched_guards(buf, 5)
    restarted.check_invariants()


def test_a_corrupt_cached_chunk_is_fetched_again_by_read_into(tmp_path: Path) -> None:
    fetcher = ChunkFetcher(RecordingFetch(DATA), ChunkCache(tmp_path, 64 * MiB, lock=False), chunk_size=MiB)
    ObjectReader(ref(), fetcher).read(MiB, 0)
    fetcher.close()
    for path in records(tmp_path, 0):
        flip_byte(path, 100)
    fetch = RecordingFetch(DATA)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 64 * MiB, lock=False), chunk_size=MiB)
    view = memoryview(bytearray(MiB))
    assert ObjectReader(ref(), fetcher).read_into(view, 0) == MiB and view == DATA[:MiB]
    assert (0, MiB) in fetch.calls and fetcher.cache.stats.corrupt == 1
    fetcher.close()


class IntoFetch(RecordingFetch):
    """A remote that reads into the buffer it is given (``fetch_into``), as S3 over urllib3 does."""

    def into(self, key: str, start: int, end: int, version: str, buf: memoryview) -> None:
        data = self(key, start, end, version)
        if len(data) != len(buf):
            raise EOFError(f"short read: {len(data)} of {len(buf)}")
        buf[:] = data


def test_a_pooled_buffer_is_never_reused_while_anyone_still_holds_it() -> None:
    """Buffers return to the pool only when no view of them is left: a chunk's data held past
    its eviction keeps its bytes while new chunks are fetched into recycled buffers."""
    fetch = IntoFetch(DATA)
    fetcher = ChunkFetcher(fetch, None, chunk_size=1 * MiB, memory_bytes=2 * MiB, fetch_into=fetch.into)
    obj = ref()
    fetcher.read(obj, 0, 0, MiB, split=False)  # read through: evictable
    with fetcher._lock:
        held = fetcher._chunks[fetcher.chunk_key(obj, 0)].data  # what a reader copies out of, outside the lock
    part = held[100:200]  # a slice a copy is made from holds the buffer too
    del held
    for index in range(1, 20):  # chunk 0 evicted, buffers recycled many times over
        assert fetcher.read(obj, index, 0, MiB, split=False) == DATA[index * MiB:(index + 1) * MiB]
    assert fetcher.chunk_key(obj, 0) not in fetcher._chunks
    with fetcher._lock:  # and no two chunks in memory share a buffer
        assert all(bytes(e.data) == DATA[ck.index * MiB:(ck.index + 1) * MiB] for ck, e in fetcher._chunks.items())
    assert fetcher.buffers.reused > 0  # buffers did come back and were reused...
    assert part.tobytes() == DATA[100:200]  # ...never the one still referenced
    before = fetcher.buffers.idle()
    del part
    assert fetcher.buffers.idle() == min(fetcher.buffers.keep_bytes // MiB, before + 1)  # its last view gone: back
    fetcher.close()


def test_the_pool_keeps_at_most_its_bound_of_idle_buffers() -> None:
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(64 * KiB, keep_bytes=128 * KiB)
    views = [pool.take(64 * KiB) for _ in range(5)]
    assert pool.allocated == 5 and pool.idle() == 0
    import ctypes
    assert all(ctypes.addressof(ctypes.c_char.from_buffer(v)) % 4096 == 0 for v in views)  # page-aligned
    del views
    assert pool.idle() == 2
    short = pool.take(40 * KiB)
    assert len(short) == 40 * KiB and pool.reused == 1  # the 64 KiB class
    assert pool.mapped == 2 * 64 * KiB  # the three let go beyond the bound are unmapped
    with pytest.raises(ValueError):
        pool.take(64 * KiB + 1)


def test_unmapping_a_buffer_still_exported_by_its_dying_array_is_no_error() -> None:
    """A buffer is given back by its array's finalizer, before the array is freed: a trim or a
    shrink in another thread at that moment may pick it, and must not fail (the watcher thread
    that trims a quiet mount died of the BufferError; found by a review)."""
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(MiB, keep_bytes=4 * MiB)
    view = pool.take(MiB)
    mm = view.obj._mm  # type: ignore[union-attr]
    with pool._lock:  # as if given back already, its array still alive
        pool._idle[MiB].append((mm, 0.0))
        pool._idle_bytes += MiB
    assert pool.trim() == 1  # no BufferError
    view[:3] = b"abc"
    assert bytes(view[:3]) == b"abc"  # still usable through the live view
    del view


def test_a_small_buffer_takes_its_size_class_and_the_budget_counts_the_class() -> None:
    """A few KiB take a 16 KiB buffer, not a chunk-sized one; what the pool has mapped is
    the sum of the classes, and the idle ones beyond the bound go oldest first, any class."""
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(8 * MiB, keep_bytes=8 * MiB + 64 * KiB)
    assert pool.classes[0] == 16 * KiB and pool.classes[-1] == 8 * MiB
    assert [pool.capacity(n) for n in (1, 16 * KiB, 16 * KiB + 1, 3 * MiB, 8 * MiB)] == \
        [16 * KiB, 16 * KiB, 32 * KiB, 4 * MiB, 8 * MiB]
    small = [pool.take(3000) for _ in range(100)]
    assert pool.mapped == 100 * 16 * KiB and pool.allocated == 100
    del small[:40]  # idle small buffers: an eighth of the bound at most (~1 MiB, 64 of them)
    assert pool.idle() == 40 and pool.mapped == 100 * 16 * KiB
    del small[:30]
    assert pool.idle() == 64 and pool.mapped == (100 - 6) * 16 * KiB
    big = pool.take(8 * MiB)
    del small  # with the big one in use, all that is mapped fits in the bound: four small stay
    assert pool.idle() == 4 and pool.mapped == 8 * MiB + 64 * KiB
    del big
    assert pool.idle() == 5
    assert len(pool.take(5 * MiB)) == 5 * MiB and pool.reused == 1
    assert pool.peak == 100 * 16 * KiB + 8 * MiB - 6 * 16 * KiB
    odd = BufferPool(3 * MiB, keep_bytes=0)  # a chunk size that is no power of two is the top class
    assert odd.capacity(3 * MiB) == 3 * MiB and odd.capacity(2 * MiB + 1) == 3 * MiB


def test_small_chunks_are_budgeted_by_their_buffer_not_their_bytes(tmp_path: Path) -> None:
    """Thousands of small objects read once each through a fetcher with a disk cache: what
    memory keeps of them stays within the budget counted in real buffer bytes (and nothing once
    each was read through and is on disk), and the pool's mapped bytes stay within the budget
    plus its idle bound (each small chunk held a whole
    8 MiB buffer and was counted at its few KiB: 4 GiB of RSS for 2,000 small files)."""
    data = os.urandom(64 * KiB)

    class Small(IntoFetch):
        def __call__(self, key: str, start: int, end: int, version: str) -> bytes:
            self.calls.append((start, end))
            return data[start:end]

    fetch = Small(data)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 1 << 30), chunk_size=8 * MiB, memory_bytes=32 * MiB,
                           fetch_into=fetch.into)
    for i in range(2000):
        size = 1 + (i * 7919) % (64 * KiB)
        obj = ObjectRef(url=f"mem://b/f{i}", key=f"f{i}", version=f"v{i}", size=size)
        reader = ObjectReader(obj, fetcher)
        assert reader.read(size, 0) == data[:size]
        reader.close()
        memory = fetcher.memory()
        assert memory["used"] + memory["reserved"] <= memory["limit"]
        with fetcher._lock:  # (one snapshot: the cache writers change it meanwhile)
            assert fetcher._used == sum(e.cost for e in fetcher._chunks.values())
    assert fetcher.settle()
    # Read through and on disk, a small file's only chunk has left memory: nothing to keep.
    assert fetcher.memory()["used"] == 0 and fetcher.memory()["chunks"] == 0
    bound = fetcher.memory_bytes + fetcher.buffers.keep_bytes + 16 * 64 * KiB  # (writes queued)
    assert fetcher.buffers.peak <= bound, fetcher.buffers.peak
    assert fetcher.buffers.reused > 1000  # small buffers come back and are used again
    fetcher.close()


def test_a_split_fetch_fills_each_slice_of_one_buffer(tmp_path: Path) -> None:
    """A first read's sub-range GETs each read into their own slice of the chunk's buffer."""
    fetch = IntoFetch(DATA, delay=0.01)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 64 * MiB), chunk_size=8 * MiB, fetch_into=fetch.into)
    obj = ref(size=12 * MiB + 5)
    assert fetcher.read(obj, 0, 0, 8 * MiB) == DATA[:8 * MiB]
    assert sorted(fetch.calls) == [(0, 2 * MiB), (2 * MiB, 4 * MiB), (4 * MiB, 6 * MiB), (6 * MiB, 8 * MiB)]
    assert fetcher.read(obj, 1, 0, 4 * MiB + 5) == DATA[8 * MiB:12 * MiB + 5]  # a short last chunk
    with fetcher._lock:
        assert all(isinstance(e.data, memoryview) and len(e.data) == fetcher._size(obj, ck.index)
                   for ck, e in fetcher._chunks.items())
    assert fetcher.settle()
    fetcher.drop_memory()
    assert fetcher.read(obj, 0, 3, 5 * MiB) == DATA[3:5 * MiB + 3]  # from the disk cache, as written
    assert fetched(fetch.calls) == 12 * MiB + 5
    fetcher.cache.check_invariants()
    fetcher.close()


def test_a_failed_sub_range_fails_the_read_and_a_short_one_is_eoferror() -> None:
    class Failing(IntoFetch):
        def into(self, key: str, start: int, end: int, version: str, buf: memoryview) -> None:
            if start == 4 * MiB:
                raise ConnectionError("reset")
            super().into(key, start, end, version, buf)

    fetch = Failing(DATA)
    fetcher = ChunkFetcher(fetch, None, chunk_size=8 * MiB, fetch_into=fetch.into)
    with pytest.raises(ConnectionError):
        fetcher.read(ref(), 0, 0, 10)
    short = IntoFetch(DATA, short=True)
    fetcher = ChunkFetcher(short, None, chunk_size=1 * MiB, fetch_into=short.into)
    with pytest.raises(EOFError):
        ObjectReader(ref(), fetcher).read(10, 5 * MiB)
    assert fetcher.memory()["used"] == 0 and fetcher.memory()["reserved"] == 0


@pytest.mark.parametrize("size", [8 * MiB, 3 * MiB + 123])
def test_a_pooled_buffer_is_written_in_place_with_the_same_name_and_crc(tmp_path: Path, size: int) -> None:
    """A chunk in a pooled (page-aligned, writable) buffer goes to disk with O_DIRECT from that
    very buffer, no copy into the thread's aligned buffer; its file name and CRC-32C are the
    ones ``bytes`` get, and it verifies after a restart."""
    from marinfs.read.buffers import BufferPool

    data = os.urandom(size)
    plain = ChunkCache(tmp_path / "plain", 64 * MiB)
    assert plain.put(key(1), data)
    buf = BufferPool(8 * MiB, 8 * MiB).take(size)
    buf[:] = data
    cache = ChunkCache(tmp_path / "pooled", 64 * MiB)
    assert cache.put(key(1), buf) and cache._io.write_direct
    assert getattr(cache._io.aligned, "buf", None) is None  # written from where it was
    names = [p.name for p in (tmp_path / "pooled").rglob("*-1-*")]
    assert names == [p.name for p in (tmp_path / "plain").rglob("*-1-*")] and "-c" in names[0]
    assert bytes(buf) == data  # untouched
    cache.check_invariants()
    cache.close()
    again = ChunkCache(tmp_path / "pooled", 64 * MiB)
    assert again.read(key(1), 0, size) == data and again.stats.corrupt == 0


def test_a_quiet_fetcher_gives_its_memory_and_idle_buffers_back(tmp_path: Path) -> None:
    """After a big read, memory holds chunks up to the budget and the pool its idle buffers;
    once no read has come for a while both are given back, and reads go on as before."""
    fetch = IntoFetch(DATA)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 64 * MiB), chunk_size=1 * MiB, memory_bytes=8 * MiB,
                           fetch_into=fetch.into)
    reader = ObjectReader(ref(), fetcher)
    assert reader.read(len(DATA), 0) == DATA
    assert fetcher.settle()
    reader.close()
    assert fetcher.memory()["used"] > 0
    assert not fetcher.trim_idle(60.0)  # read just now: kept
    assert fetcher.memory()["used"] > 0
    time.sleep(0.05)
    assert fetcher.trim_idle(0.01)
    assert fetcher.memory()["used"] == 0 and fetcher.buffers.idle() == 0
    assert ObjectReader(ref(), fetcher).read(10, 3 * MiB) == DATA[3 * MiB:3 * MiB + 10]  # from the disk cache
    assert fetched(fetch.calls) == len(DATA)
    fetcher.close()


def test_the_pool_unmaps_only_buffers_idle_long_enough() -> None:
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(MiB, keep_bytes=4 * MiB)
    views = [pool.take(MiB) for _ in range(3)]
    del views
    assert pool.idle() == 3
    assert pool.trim(60.0) == 0 and pool.idle() == 3
    assert pool.trim() == 3 and pool.idle() == 0
    view = pool.take(10)
    view[:] = b"x" * 10
    assert bytes(view) == b"x" * 10 and pool.allocated == 4


class KeepRecordingCache(ChunkCache):
    """A chunk cache that records, per chunk index, whether it was asked to keep the chunk in
    the page cache (``put(keep=True)``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.kept: dict[int, bool] = {}

    def put(self, key: ChunkKey, data: object, keep: bool = False, **kw: object) -> bool:  # type: ignore[override]
        self.kept[key.index] = keep
        return super().put(key, data, keep=keep, **kw)  # type: ignore[arg-type]


def test_chunks_read_at_random_are_cached_through_the_page_cache(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk fetched for a random read (a demand miss, the sweep) is written buffered, so the
    page cache serves the random reads that follow (a mapped file's faults); chunks fetched
    ahead of a sequential reader keep O_DIRECT (read once; the FUSE file's page cache has them)."""
    real, direct = os.pwrite, []

    def recording(fd: int, data: object, offset: int) -> int:
        direct.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr("marinfs.read.chunkcache.os.pwrite", recording)
    cache = ChunkCache(tmp_path / "c", 64 * MiB)
    assert cache.put(key(1), DATA[:MiB], keep=True) and direct and not any(direct)
    direct.clear()
    assert cache.put(key(2), DATA[:MiB]) and direct and all(direct)
    assert cache.read(key(1), 0, MiB) == DATA[:MiB] == cache.read(key(2), 0, MiB)
    monkeypatch.setattr("marinfs.read.chunkcache.os.pwrite", real)

    seq_cache = KeepRecordingCache(tmp_path / "seq", 256 * MiB)
    fetcher = ChunkFetcher(RecordingFetch(DATA), seq_cache, chunk_size=1 * MiB)
    reader = ObjectReader(ref(), fetcher)
    for off in range(0, len(DATA), 128 * KiB):
        assert reader.read(128 * KiB, off) == DATA[off:off + 128 * KiB]
    fetcher.close()
    assert len(seq_cache.kept) == 20 and not seq_cache.kept[19]  # readahead chunks: O_DIRECT
    assert sum(seq_cache.kept.values()) == 1  # the first read (a demand miss) alone: kept

    data = os.urandom(64 * MiB)
    rnd_cache = KeepRecordingCache(tmp_path / "rnd", 256 * MiB)
    fetcher = ChunkFetcher(RecordingFetch(data), rnd_cache, chunk_size=1 * MiB)
    reader = ObjectReader(ref(len(data)), fetcher)
    for i in [37, 3, 55, 12, 60, 21, 44, 8]:  # an eighth of the chunks: the sweep fetches the rest
        assert reader.read(4096, i * MiB + 100) == data[i * MiB + 100:i * MiB + 4196]
    deadline = time.monotonic() + 10
    while len(rnd_cache.kept) < 64 and time.monotonic() < deadline:
        time.sleep(0.01)
    fetcher.close()
    assert len(rnd_cache.kept) == 64 and all(rnd_cache.kept.values())


def _read_once_cold(tmp_path: Path, size: int, chunk_size: int = MiB,
                    **fetcher_args: int) -> tuple[bytes, RecordingFetch, ChunkCache]:
    """An object of ``size`` random bytes read once through a fetcher, so the disk cache has
    all of it: its bytes, the fetch (which counted the GETs) and the cache."""
    data = os.urandom(size)
    fetch = RecordingFetch(data)
    cache = ChunkCache(tmp_path, 256 * MiB)
    fetcher = ChunkFetcher(fetch, cache, chunk_size=chunk_size, **fetcher_args)
    reader = ObjectReader(ref(len(data)), fetcher)
    for off in range(0, len(data), MiB):
        reader.read(MiB, off)
    reader.close()
    fetcher.settle()
    fetcher.close()
    return data, fetch, cache


def test_a_warm_dense_random_reader_has_the_disk_read_the_rest_ahead(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense random reads of a file the disk cache has whole (a model loaded through mmap
    again, page cache dropped): the sweep asks the kernel to read every other chunk file into
    the page cache (WILLNEED), in file order, so the faults that follow are not each a small
    disk read; no GET, and the bytes are exact."""
    data, fetch, cache = _read_once_cold(tmp_path, 64 * MiB)

    real, advised = os.posix_fadvise, []

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append(offset // MiB)  # the chunk it is in
        real(fd, offset, length, advice)

    monkeypatch.setattr("marinfs.read.chunkcache.os.posix_fadvise", recording)
    fetch.calls.clear()
    fetcher = ChunkFetcher(fetch, cache, chunk_size=1 * MiB)
    reader = ObjectReader(ref(len(data)), fetcher)
    order = [37, 3, 55, 12, 60, 21, 44, 8]  # an eighth of the chunks: the sweep starts
    for i in order:
        assert reader.read(4096, i * MiB + 100) == data[i * MiB + 100:i * MiB + 4196]
    rest = set(range(64)) - set(order)
    deadline = time.monotonic() + 10
    while not set(advised) >= rest and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(advised) >= rest

    # A stretch of sequential reads of the swept handle is served from the page cache the sweep
    # filled: no chunk is loaded again from the disk with O_DIRECT.
    real_open, direct = os.open, []

    def opening(path: object, flags: int, *args: object) -> int:
        direct.append(bool(flags & os.O_DIRECT))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("marinfs.read.chunkcache.os.open", opening)
    for off in range(20 * MiB, 40 * MiB, 256 * KiB):
        assert reader.read(256 * KiB, off) == data[off:off + 256 * KiB]
    fetcher.settle()
    assert direct and not any(direct)
    assert fetch.calls == []
    for i in range(64):
        assert reader.read(10, i * MiB) == data[i * MiB:i * MiB + 10]
    fetcher.close()


def _resident(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages it has): mincore(2) of a copy-on-write
    mapping, never written, so each page reported is the file's own."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            assert libc.mincore(ctypes.addressof(anchor), size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            del anchor
        return sum(b & 1 for b in vec), pages
    finally:
        m.close()


def test_advising_a_cached_chunk_reads_all_of_it_into_the_page_cache(tmp_path: Path) -> None:
    """One POSIX_FADV_WILLNEED reads no more than the disk's readahead or largest request
    allows (4 MiB on this machine's disk, half a chunk): the warm sweep then left half of every
    chunk to its faults, each a small read of the disk. Advised in pieces, all of it is read."""
    cache = ChunkCache(tmp_path / "c", 256 * MiB)
    data = os.urandom(8 * MiB)
    assert cache.put(key(0), data)  # written with O_DIRECT: nothing of it in the page cache
    path, _, _ = region(records(tmp_path / "c", 0)[0])
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    before, pages = _resident(path)
    if before == pages:
        pytest.skip("the filesystem under tmp_path keeps every page resident (tmpfs): nothing to read ahead")
    assert before < pages // 2
    cache.advise(key(0))
    deadline = time.monotonic() + 10
    while _resident(path)[0] < pages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _resident(path) == (pages, pages)
    assert cache.read(key(0), 0, len(data)) == data


def test_the_warm_sweep_reads_ahead_only_what_memory_can_keep(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm sweep's read-ahead (WILLNEED) asks the page cache to keep the whole file: with
    less memory available than twice the file (its chunk files' pages and the mapped file's),
    pages read ahead would be evicted before their faults come, so nothing is advised and the
    faults read the disk themselves; with enough, every other chunk is. The bytes are exact."""
    data, fetch, cache = _read_once_cold(tmp_path, 32 * MiB)
    fetch.calls.clear()

    advised: list[int] = []
    real = os.posix_fadvise

    def recording(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append(fd)
        real(fd, offset, length, advice)

    monkeypatch.setattr("marinfs.read.chunkcache.os.posix_fadvise", recording)
    order = [17, 3, 25, 9]  # an eighth of the chunks: the sweep starts
    for available, expect in ((2 * len(data) - 1, 0), (2 * len(data), 32 - len(order))):
        advised.clear()
        fetcher = ChunkFetcher(fetch, cache, chunk_size=1 * MiB)
        fetcher.mem_available = lambda available=available: available  # type: ignore[misc]
        reader = ObjectReader(ref(len(data)), fetcher)
        for i in order:
            assert reader.read(4096, i * MiB + 100) == data[i * MiB + 100:i * MiB + 4196]
        deadline = time.monotonic() + 10
        while len(advised) < expect and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # what else the sweep would have asked for by now
        swept = len(advised)
        assert swept >= expect and (expect or not swept), (available, swept)
        for i in range(31, -1, -3):  # backwards: no sequential readahead of its own
            assert reader.read(10, i * MiB) == data[i * MiB:i * MiB + 10]
        fetcher.close()
    assert fetch.calls == []


def test_warm_readahead_loads_cached_chunks_with_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ahead of a sequential reader, chunks already in the disk cache are loaded into memory
    with O_DIRECT (no page cache filled and read back) and served from there, no GET; one
    whose file was damaged while the daemon was down fails its checksum there and is fetched
    again, never served."""
    data, fetch, cache = _read_once_cold(tmp_path, 24 * MiB + 5, chunk_size=4 * MiB, memory_bytes=32 * MiB)
    cache.close()
    flip_byte(records(tmp_path, 3)[0], 100)

    real_preadv, opened = os.preadv, []

    def recording(fd: int, buffers: list, offset: int) -> int:  # (chunk read, with O_DIRECT)
        opened.append((str(offset // (4 * MiB)), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr("marinfs.read.chunkcache.os.preadv", recording)
    fetch.calls.clear()
    cache = ChunkCache(tmp_path, 256 * MiB)  # restarted: chunks unverified
    fetcher = ChunkFetcher(fetch, cache, chunk_size=4 * MiB, memory_bytes=32 * MiB)
    reader = ObjectReader(ref(len(data)), fetcher)
    got = b"".join(reader.read(MiB, off) for off in range(0, len(data), MiB))
    assert got == data
    assert fetch.calls == [(12 * MiB, 16 * MiB)]  # the damaged chunk alone, fetched again
    assert cache.stats.corrupt == 1
    direct = {chunk for chunk, d in opened if d}
    assert {"2", "4", "5", "6"} <= direct  # chunks ahead of the reader: loaded with O_DIRECT
    assert "1" not in direct  # asked for after one read only: read ahead by the disk instead
    reader.close()
    fetcher.close()

    # A random reader whose next read lands near its last is not loading a file: the chunk
    # after is not loaded whole (the disk is asked to read it ahead, nothing more).
    opened.clear()
    fetcher = ChunkFetcher(fetch, cache, chunk_size=4 * MiB, memory_bytes=32 * MiB)
    reader = ObjectReader(ref(len(data)), fetcher)
    for off in (20 * MiB + 5, 8 * MiB + 100, 8 * MiB + 200 * KiB):
        assert reader.read(4096, off) == data[off:off + 4096]
    fetcher.settle()
    assert not any(d for _, d in opened)
    reader.close()
    fetcher.close()


def test_a_reader_moved_to_another_name_lets_go_of_what_was_held_and_reads_there() -> None:
    """ObjectReader.moved (a rename made here): chunks held for it under the old name are let
    go (the budget does not leak), and its reads fetch the new name's version from then on."""
    fetch = IntoFetch(DATA)
    fetcher = ChunkFetcher(fetch, None, chunk_size=MiB, memory_bytes=8 * MiB, fetch_into=fetch.into)
    reader = ObjectReader(ref(), fetcher)
    for off in range(0, 3 * MiB, 256 * KiB):  # sequential: chunks ahead are held for it
        reader.read(256 * KiB, off)
    deadline = time.monotonic() + 5
    while fetcher._inflight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fetcher.memory()["held"] > 0
    moved = ObjectRef(url="mem://b/other", key="other", version="v2", size=len(DATA))
    reader.moved(moved)
    assert fetcher.memory()["held"] == 0
    before = len(fetch.calls)
    assert reader.read(100, 5 * MiB) == DATA[5 * MiB:5 * MiB + 100]
    assert len(fetch.calls) > before and reader.obj is moved
    fetcher.close()
