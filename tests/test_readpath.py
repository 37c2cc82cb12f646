"""The read path without FUSE: chunk cache (limits, LRU, checksums, restarts, lock) and the
reader (chunk fetches, readahead, single-flight, versions)."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from marinfs.chunkcache import ChunkCache, ChunkKey, lock_holder
from marinfs.errors import UsageError, errno_for
from marinfs.reader import ChunkFetcher, ObjectReader, ObjectRef

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


def ref(size: int = len(DATA), version: str = "v1") -> ObjectRef:
    return ObjectRef(url="mem://b/obj", key="obj", version=version, size=size)


def test_sequential_reads_fetch_each_chunk_once(tmp_path: Path) -> None:
    fetch = RecordingFetch(DATA)
    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 64 * MiB), chunk_size=8 * MiB)
    reader = ObjectReader(ref(), fetcher)
    out = b"".join(reader.read(128 * KiB, off) for off in range(0, len(DATA), 128 * KiB))
    assert out == DATA
    assert sorted(fetch.calls) == [(0, 8 * MiB), (8 * MiB, 16 * MiB), (16 * MiB, 20 * MiB)]
    fetcher.close()


def test_random_read_fetches_only_the_chunk_it_touches() -> None:
    fetch = RecordingFetch(DATA)
    reader = ObjectReader(ref(), ChunkFetcher(fetch, None, chunk_size=1 * MiB))
    assert reader.read(4096, 10 * MiB + 5) == DATA[10 * MiB + 5:10 * MiB + 4101]
    time.sleep(0.05)
    assert fetch.calls == [(10 * MiB, 11 * MiB)]  # no readahead after a seek


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
    assert fetch.calls.count((0, 8 * MiB)) == 1


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
    assert (0, 8 * MiB) in third.calls  # a new version is never served old chunks


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
    (path,) = [p for p in (tmp_path / "chunks").rglob("*-1-*")]
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = ChunkCache(tmp_path, MiB)
    assert restarted.read(key(1), 0, 11) is None
    assert restarted.stats.corrupt == 1 and not path.exists()
    restarted.check_invariants()


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

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("marinfs.chunkcache.tempfile.mkstemp", no_space)
    fetch = RecordingFetch(DATA)
    fetcher = ChunkFetcher(fetch, cache, chunk_size=8 * MiB)
    reader = ObjectReader(ref(), fetcher)
    assert reader.read(MiB, 3 * MiB) == DATA[3 * MiB:4 * MiB]
    fetcher.close()  # let the readahead it started finish (and fail to cache) too
    assert cache.used == 0 and cache.stats.write_failures >= 1
    cache.check_invariants()
