"""The shared chunk tier (marinfs/read/sharedcache.py) without FUSE: several SharedTier objects over
one directory stand for several nodes. Fetches are counted: one GET for all nodes is a count."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from marinfs.read import sharedcache
from marinfs.objects import ObjectRef, ObjectVersion
from marinfs.read.sharedcache import TRAILER, SharedDirError, SharedTier, check_private, chunk_name

pytestmark = pytest.mark.unit

CHUNK = 64 << 10


class Bucket:
    """The remote, counted: each fetch of a chunk is a GET."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.gets = 0
        self.lock = threading.Lock()

    def fetcher(self, obj: ObjectRef, start: int, end: int):
        def fetch() -> bytes:
            with self.lock:
                self.gets += 1
            if self.delay:
                time.sleep(self.delay)
            return content(obj, start, end)
        return fetch


def content(obj: ObjectRef, start: int, end: int) -> bytes:
    seed = f"{obj.url}{obj.version}".encode()
    return bytes((b + i) % 251 for i, b in zip(range(start, end), seed * ((end - start) // len(seed) + 1)))


def take(n: int) -> memoryview:
    return memoryview(bytearray(n))


def obj_of(name: str = "a/model.safetensors", version: str = "e:abc", size: int = 8 * CHUNK) -> ObjectRef:
    return ObjectRef(url=f"s3://bucket/p/{name}", key=name, version=ObjectVersion.parse(version), size=size)


def node(root: Path, **kw) -> SharedTier:
    kw.setdefault("limit", 1 << 30)
    kw.setdefault("io_timeout", 2.0)
    return SharedTier(root, **kw)


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    check_private(root)
    return root


def get(tier: SharedTier, bucket: Bucket, obj: ObjectRef, index: int = 0) -> tuple[bytes, str]:
    start, end = index * CHUNK, min(obj.size, (index + 1) * CHUNK)
    data, source = tier.get(obj, start, end, bucket.fetcher(obj, start, end), take)
    assert bytes(data) == content(obj, start, end)
    return bytes(data), source


def test_a_chunk_one_node_fetched_is_read_by_another_without_a_get(shared: Path) -> None:
    bucket = Bucket()
    a, b = node(shared), node(shared)
    obj = obj_of()
    assert get(a, bucket, obj)[1] == "bucket"
    a.settle()
    assert get(b, bucket, obj)[1] == "shared"
    assert bucket.gets == 1
    assert b.snapshot()["hits"] == 1 and a.snapshot()["published"] == 1
    # Published private to the daemons' user.
    (path,) = (shared / "chunks").glob("*/*")
    assert path.stat().st_mode & 0o777 == 0o600


def test_another_version_or_range_is_another_chunk(shared: Path) -> None:
    bucket = Bucket()
    a, b = node(shared), node(shared)
    get(a, bucket, obj_of(version="e:one"))
    a.settle()
    get(b, bucket, obj_of(version="e:two"))
    assert bucket.gets == 2
    obj = obj_of()
    assert chunk_name(obj, 0, CHUNK) != chunk_name(obj, 0, CHUNK // 2) != chunk_name(obj, CHUNK, CHUNK)


def test_unversioned_objects_are_never_shared(shared: Path) -> None:
    bucket = Bucket()
    a, b = node(shared), node(shared)
    obj = ObjectRef(url="memory://x/f", key="f", version=ObjectVersion.unversioned(7), size=CHUNK)
    get(a, bucket, obj)
    a.settle()
    assert get(b, bucket, obj)[1] == "bucket"
    assert bucket.gets == 2 and not list((shared / "chunks").glob("*/*"))


def test_nodes_missing_one_chunk_together_send_one_get(shared: Path) -> None:
    bucket = Bucket(delay=0.3)
    nodes = [node(shared) for _ in range(4)]
    obj = obj_of()
    start = threading.Barrier(len(nodes))
    sources: list[str] = []

    def read(tier: SharedTier) -> None:
        start.wait()
        sources.append(get(tier, bucket, obj)[1])

    threads = [threading.Thread(target=read, args=(t,)) for t in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert bucket.gets == 1
    assert sorted(sources) == ["bucket", "shared", "shared", "shared"]
    assert sum(t.snapshot()["lease_waits"] for t in nodes) == 3
    assert not list((shared / "leases").iterdir())  # the holder let go once published


def test_a_dead_holders_lease_is_broken_after_its_expiry(shared: Path) -> None:
    bucket = Bucket()
    obj = obj_of()
    dead = node(shared, lease_ttl=0.5)
    assert dead._take_lease(chunk_name(obj, 0, CHUNK))  # then the holder dies: never fetched, never let go
    taken = time.monotonic()  # (the lease expires 0.5 s after this, however long the next node takes to start)
    alive = node(shared, lease_ttl=0.5)
    assert get(alive, bucket, obj)[1] == "bucket"
    waited = time.monotonic() - taken
    assert 0.4 <= waited < 2.0, waited  # waited for the expiry, and not much longer
    assert bucket.gets == 1
    snap = alive.snapshot()
    assert snap["lease_waits"] == 1 and snap["leases_broken"] + snap["lease_timeouts"] == 1


def test_an_expired_lease_is_broken_at_once_with_an_injected_clock(shared: Path) -> None:
    now = [1000.0]
    obj = obj_of()
    name = chunk_name(obj, 0, CHUNK)
    holder = node(shared, lease_ttl=10.0, clock=lambda: now[0])
    assert holder._take_lease(name)
    other = node(shared, lease_ttl=10.0, clock=lambda: now[0])
    assert not other._take_lease(name)  # live
    now[0] += 11
    assert other._take_lease(name)  # expired: broken and taken
    assert json.loads((shared / "leases" / name).read_bytes())["holder"] == other.holder
    assert other.snapshot()["leases_broken"] == 1
    holder._release(name)  # no longer its lease: left alone
    assert (shared / "leases" / name).exists()
    other._release(name)
    assert not (shared / "leases" / name).exists()


def test_a_lease_never_written_expires_by_its_mtime(shared: Path) -> None:
    obj = obj_of()
    name = chunk_name(obj, 0, CHUNK)
    tier = node(shared, lease_ttl=5.0)
    (shared / "leases" / name).touch()  # created, then its holder died before writing it
    assert not tier._take_lease(name)
    os.utime(shared / "leases" / name, (time.time() - 6, time.time() - 6))
    assert tier._take_lease(name)


def test_breaking_a_lease_never_removes_a_fresh_one(shared: Path) -> None:
    now = [1000.0]
    tier = node(shared, lease_ttl=10.0, clock=lambda: now[0])
    path = shared / "leases" / "x"
    assert tier.root == shared
    path.write_bytes(b'{"holder": "fresh", "expires": 2000}')
    assert not tier._break(path, b'{"holder": "old", "expires": 1}')  # what it saw was replaced meanwhile
    assert path.read_bytes() == b'{"holder": "fresh", "expires": 2000}'


def publish_then_damage(shared: Path, holder, bucket: Bucket, obj: ObjectRef, damage: str) -> None:  # noqa: ANN001
    """``holder`` reads ``obj`` (its one chunk goes to the tier), then that chunk file is damaged:
    a bit flipped (at byte 100, or in the last byte of the data: ``flip-tail``), cut to half a
    chunk, or its trailer's checksum flipped."""
    get(holder, bucket, obj)
    holder.settle()
    (path,) = (shared / "chunks").glob("*/*")
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[100] ^= 0x40
    elif damage == "flip-tail":
        raw[obj.size - 1] ^= 0x40  # in the last partial block, read through the scratch
    elif damage == "truncate":
        raw = raw[:CHUNK // 2]
    else:
        raw[-TRAILER.size] ^= 1
    path.write_bytes(raw)


@pytest.mark.parametrize("damage", ["flip", "truncate", "trailer"])
def test_a_damaged_chunk_is_detected_removed_and_fetched_again(shared: Path, damage: str) -> None:
    bucket = Bucket()
    a, b = node(shared), node(shared)
    obj = obj_of()
    publish_then_damage(shared, a, bucket, obj, damage)
    assert get(b, bucket, obj)[1] == "bucket"  # never the damaged bytes
    assert b.snapshot()["corrupt"] == 1 and bucket.gets == 2
    b.settle()
    assert get(a, bucket, obj)[1] == "shared"  # replaced with a sound copy
    assert bucket.gets == 2


def test_a_full_tier_evicts_the_least_recently_used_within_its_limit(shared: Path) -> None:
    bucket = Bucket()
    limit = 5 * (CHUNK + TRAILER.size)
    # Each node sees the others' chunks at its next scan: rescan=0 scans before every publish.
    a, b = node(shared, limit=limit, rescan=0), node(shared, limit=limit, rescan=0)
    objs = [obj_of(f"f{i}", size=CHUNK) for i in range(20)]
    for i, obj in enumerate(objs):
        tier = (a, b)[i % 2]
        get(tier, bucket, obj)
        tier.settle()
        a.check_invariants()
    assert a.snapshot()["evicted"] + b.snapshot()["evicted"] >= 15
    assert get(a, bucket, objs[-1])[1] == "shared"  # the newest stay
    assert get(a, bucket, objs[0])[1] == "bucket"  # the oldest went
    a.settle()
    a.check_invariants()


def test_one_node_keeps_the_limit_between_scans(shared: Path) -> None:
    bucket = Bucket()
    limit = 5 * (CHUNK + TRAILER.size)
    a = node(shared, limit=limit)  # the default rescan: its own publishes are counted in between
    for i in range(12):
        get(a, bucket, obj_of(f"f{i}", size=CHUNK))
        a.settle()
        a.check_invariants()


def test_a_chunk_larger_than_the_limit_is_not_published(shared: Path) -> None:
    bucket = Bucket()
    a = node(shared, limit=CHUNK)
    get(a, bucket, obj_of())
    a.settle()
    assert not list((shared / "chunks").glob("*/*"))


def test_a_read_only_tier_serves_what_it_holds_and_sends_misses_to_the_bucket(
        shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = Bucket()
    writer = node(shared)
    held, missing = obj_of("held"), obj_of("missing")
    get(writer, bucket, held)
    writer.settle()
    real_open = os.open

    def read_only(path, flags, *args):  # noqa: ANN001 - os.open's signature
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(sharedcache.os, "open", read_only)
    tier = node(shared)
    assert get(tier, bucket, held)[1] == "shared"
    assert get(tier, bucket, missing)[1] == "bucket"
    assert tier.snapshot()["state"] == "read-only"
    assert get(tier, bucket, missing, 1)[1] == "bucket"
    assert get(tier, bucket, held)[1] == "shared"  # still read from
    assert bucket.gets == 3


def test_a_directory_gone_sends_reads_to_the_bucket(shared: Path) -> None:
    bucket = Bucket()
    tier = node(shared)
    shutil.rmtree(shared)
    assert get(tier, bucket, obj_of())[1] == "bucket"
    snap = tier.snapshot()
    assert snap["state"] == "degraded" and "gone" in snap["reason"]
    assert get(tier, bucket, obj_of(), 1)[1] == "bucket"
    assert bucket.gets == 2


def test_a_slow_directory_costs_one_bounded_wait_then_is_skipped(shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = Bucket()
    release = threading.Event()
    tier = node(shared, io_timeout=0.2, retry_after=60)

    def hung(name, buf):  # noqa: ANN001 - a read of a dead NFS server
        release.wait(10)
        return False

    monkeypatch.setattr(tier, "_read_chunk", hung)
    try:
        started = time.monotonic()
        assert get(tier, bucket, obj_of())[1] == "bucket"
        assert time.monotonic() - started < 1.0
        assert tier.snapshot()["state"] == "degraded"
        started = time.monotonic()
        for i in range(1, 8):
            assert get(tier, bucket, obj_of(), i)[1] == "bucket"
        # Skipped: no more waits (each of the 7 waiting its 0.2 s would be 1.4 s; a loaded
        # 2-core box took over 0.2 s for the 7 without any wait).
        assert time.monotonic() - started < 0.7
    finally:
        release.set()


def test_the_tier_comes_back_after_retry_after(shared: Path) -> None:
    now = [0.0]
    bucket = Bucket()
    tier = node(shared, retry_after=30, monotonic=lambda: now[0])
    tier._degrade(tier._down, "test")
    assert not tier.usable()
    now[0] = 31
    assert tier.usable() and tier.snapshot()["state"] == "ok"
    get(tier, bucket, obj_of())
    tier.settle()
    assert list((shared / "chunks").glob("*/*"))


def test_fetch_errors_come_out_and_let_the_lease_go(shared: Path) -> None:
    tier = node(shared)
    obj = obj_of()

    def fail() -> bytes:
        raise TimeoutError("the bucket is down")

    with pytest.raises(TimeoutError):
        tier.get(obj, 0, CHUNK, fail, take)
    assert not list((shared / "leases").iterdir())


def test_check_private(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "shared"
    check_private(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    with pytest.raises(SharedDirError, match="writable by group or others"):
        check_private(open_dir)
    os.chmod(open_dir, 0o775)
    with pytest.raises(SharedDirError, match="writable by group or others"):
        check_private(open_dir)
    os.chmod(open_dir, 0o755)
    check_private(open_dir)
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(SharedDirError, match="not a directory"):
        check_private(not_dir)
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 12345, 12345)
        with pytest.raises(SharedDirError, match="owned by uid 12345"):
            check_private(other)


def test_nodes_starting_together_on_a_new_directory_both_take_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node's daemon starting at once (a DaemonSet rolled out) on a shared directory not
    made yet: one makes it between another's look and its own mkdir. That one must take the
    directory the other made, not fail to mount on "File exists"."""
    fresh = tmp_path / "shared"
    looked = Path.exists

    def another_node_makes_it_after_this_look(path: Path) -> bool:
        seen = looked(path)
        if path == fresh and not seen:
            fresh.mkdir(mode=0o700)
        return seen

    monkeypatch.setattr(Path, "exists", another_node_makes_it_after_this_look)
    check_private(fresh)
    assert fresh.is_dir()


def test_gc_removes_crash_leftovers_and_evicts_to_the_limit(shared: Path) -> None:
    bucket = Bucket()
    tier = node(shared)
    for i in range(4):
        get(tier, bucket, obj_of(f"f{i}", size=CHUNK))
    tier.settle()
    old = time.time() - 3600
    left = shared / "tmp" / "x.crashed"
    left.write_bytes(b"half")
    os.utime(left, (old, old))
    recent = shared / "tmp" / "y.writing"
    recent.write_bytes(b"now")
    (shared / "leases" / "stale").write_text(json.dumps({"holder": "h", "expires": old}))
    (shared / "leases" / "live").write_text(json.dumps({"holder": "h", "expires": time.time() + 60}))
    small = node(shared, limit=2 * (CHUNK + TRAILER.size))
    out = small.gc()
    assert out["tmp_removed"] == 1 and out["leases_removed"] == 1
    assert not left.exists() and recent.exists() and (shared / "leases" / "live").exists()
    assert out["used_bytes"] <= small.limit and out["evicted_bytes"] > 0
    small.check_invariants()


def test_pooled_buffers_are_checksummed_in_place(shared: Path) -> None:
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(CHUNK, 4 * CHUNK)
    obj = obj_of()
    a, b = node(shared), node(shared)

    def fetch() -> memoryview:
        buf = pool.take(CHUNK)
        buf[:] = content(obj, 0, CHUNK)
        return buf

    data, source = a.get(obj, 0, CHUNK, fetch, pool.take)
    a.settle()
    data, source = b.get(obj, 0, CHUNK, fetch, pool.take)
    assert source == "shared" and bytes(data) == content(obj, 0, CHUNK)


@pytest.mark.parametrize("size", [CHUNK, CHUNK - 1000, 100, 4096 - 24, 4096 - 23])
@pytest.mark.parametrize("writer_direct,reader_direct", [(True, True), (True, False), (False, True)])
def test_pooled_chunks_go_with_o_direct_and_read_the_same_either_way(
        shared: Path, size: int, writer_direct: bool, reader_direct: bool) -> None:
    """A chunk fetched into a pooled (page-aligned) buffer is written with O_DIRECT and read
    back with O_DIRECT into one: its last partial block and trailer through the thread's
    aligned scratch. The file is the same as a buffered one: a node whose filesystem refused
    O_DIRECT (here: told so) reads and writes the same chunks."""
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(CHUNK, 4 * CHUNK)
    obj = obj_of(size=size)
    a, b = node(shared), node(shared)
    a._direct.write_direct = writer_direct
    b._direct.read_direct = reader_direct
    writes = []
    real = a._direct.write
    a._direct.write = lambda fd, data, c, direct, **kw: writes.append(direct) or real(fd, data, c, direct, **kw)

    def fetch() -> memoryview:
        buf = pool.take(size)
        buf[:] = content(obj, 0, size)
        return buf

    a.get(obj, 0, size, fetch, pool.take)
    a.settle()
    assert writes == [writer_direct]
    (path,) = (shared / "chunks").glob("*/*")
    assert path.stat().st_size == size + TRAILER.size
    data, source = b.get(obj, 0, size, fetch, pool.take)
    assert source == "shared" and bytes(data) == content(obj, 0, size)
    assert b._direct.read_direct == reader_direct  # (this disk took O_DIRECT: no fallback met)
    data, source = b.get(obj, 0, size, fetch, take)  # an unaligned buffer: read through the page cache
    assert source == "shared" and bytes(data) == content(obj, 0, size)


@pytest.mark.parametrize("damage", ["flip", "flip-tail", "truncate", "trailer"])
def test_a_damaged_chunk_read_with_o_direct_is_detected(shared: Path, damage: str) -> None:
    from marinfs.read.buffers import BufferPool

    pool = BufferPool(CHUNK, 4 * CHUNK)
    bucket = Bucket()
    size = CHUNK - 1000
    a, b = node(shared), node(shared)
    obj = obj_of(size=size)
    publish_then_damage(shared, a, bucket, obj, damage)
    data, source = b.get(obj, 0, size, bucket.fetcher(obj, 0, size), pool.take)
    assert source == "bucket" and bytes(data) == content(obj, 0, size)
    assert b.snapshot()["corrupt"] == 1 and bucket.gets == 2


# -- wired into the read path (reader.ChunkFetcher), each "node" with its own disk cache ---------

class CountingRemote:
    """A remote of one object: fetches counted in bytes, read into the fetcher's buffer."""

    def __init__(self, obj: ObjectRef, delay: float = 0.0) -> None:
        self.obj = obj
        self.data = content(obj, 0, obj.size)
        self.delay = delay
        self.bytes = 0
        self.lock = threading.Lock()

    def fetch(self, key: str, start: int, end: int, version) -> bytes:  # noqa: ANN001
        with self.lock:
            self.bytes += end - start
        if self.delay:
            time.sleep(self.delay)
        return self.data[start:end]

    def fetch_into(self, key: str, start: int, end: int, version, buf: memoryview) -> None:  # noqa: ANN001
        buf[:] = self.fetch(key, start, end, version)


def fetcher_node(tmp: Path, shared: Path, remote: CountingRemote, name: str):
    from marinfs.read.chunkcache import ChunkCache
    from marinfs.read.reader import ChunkFetcher

    cache = ChunkCache(tmp / name, 1 << 30, 0, chunk_size=CHUNK)
    return ChunkFetcher(remote.fetch, cache, chunk_size=CHUNK, workers=4, memory_bytes=8 * CHUNK,
                        fetch_into=remote.fetch_into, shared=node(shared))


def read_all(fetcher, obj: ObjectRef) -> bytes:
    from marinfs.read.reader import ObjectReader

    reader = ObjectReader(obj, fetcher)
    out = bytearray()
    while len(out) < obj.size:
        out += reader.read(256 << 10, len(out))
    reader.close()
    return bytes(out)


def test_fetchers_sharing_a_tier_fetch_an_object_from_the_bucket_once(tmp_path: Path, shared: Path) -> None:
    obj = obj_of(size=16 * CHUNK + 123)
    remote = CountingRemote(obj)
    first = fetcher_node(tmp_path, shared, remote, "n1")
    try:
        assert read_all(first, obj) == remote.data
        first.settle()
        first.shared.settle()
        assert remote.bytes == obj.size
        assert first.sources() == {"local": 0, "shared": 0, "bucket": obj.size}
    finally:
        first.close()
    second = fetcher_node(tmp_path, shared, remote, "n2")
    try:
        assert read_all(second, obj) == remote.data
        assert remote.bytes == obj.size  # nothing more from the bucket
        assert second.sources()["shared"] == obj.size and second.sources()["bucket"] == 0
        second.settle()
        second.drop_memory()
        assert read_all(second, obj) == remote.data  # now from its own disk: the first tier
        assert second.sources()["local"] == obj.size and second.sources()["shared"] == obj.size
    finally:
        second.close()


def test_a_chunk_is_checksummed_once_on_its_way_to_the_tier_and_the_disk_cache(
        tmp_path: Path, shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC-32C the tier checked (a hit) or took to publish (a fetch) is the one the node's
    own disk cache records: one pass over the bytes, not one per copy; and it is the right one
    (each cached chunk's record verifies against its bytes)."""
    from marinfs.read import chunkio
    from marinfs.read.chunkio import read_whole

    if not chunkio.HAS_CRC32C or sharedcache.crc32c_extend is None:
        pytest.skip("no google-crc32c C library: each writer takes zlib's CRC-32")
    summed = [0]

    def counting(real):  # noqa: ANN001, ANN202
        def extend(crc, addr, n):  # noqa: ANN001, ANN202
            summed[0] += n
            return real(crc, addr, n)
        return extend

    monkeypatch.setattr(sharedcache, "crc32c_extend", counting(sharedcache.crc32c_extend))
    monkeypatch.setattr(chunkio, "_crc32c_extend", counting(chunkio._crc32c_extend))
    obj = obj_of(size=16 * CHUNK + 123)
    remote = CountingRemote(obj)
    for name, source in (("n1", "bucket"), ("n2", "shared")):
        summed[0] = 0
        fetcher = fetcher_node(tmp_path, shared, remote, name)
        try:
            assert read_all(fetcher, obj) == remote.data
            fetcher.settle()
            fetcher.shared.settle()
            assert fetcher.sources()[source] == obj.size
            assert summed[0] == obj.size, f"{name}: {summed[0]} bytes checksummed for {obj.size}"
            entries = list(fetcher.cache._index.entries.values())
            assert len(entries) == 17
            for e in entries:
                assert read_whole(e.path, e.offset, e.size, e.crc, e.c) is not None
        finally:
            fetcher.close()
    assert remote.bytes == obj.size


def test_fetchers_reading_together_fetch_about_one_copy(tmp_path: Path, shared: Path) -> None:
    obj = obj_of(size=24 * CHUNK)
    remote = CountingRemote(obj, delay=0.02)
    nodes = [fetcher_node(tmp_path, shared, remote, f"n{i}") for i in range(4)]
    start = threading.Barrier(len(nodes))
    results: list[bytes] = []

    def run(f) -> None:  # noqa: ANN001
        start.wait()
        results.append(read_all(f, obj))

    try:
        threads = [threading.Thread(target=run, args=(f,)) for f in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [remote.data] * 4
        assert remote.bytes <= 1.1 * obj.size, remote.bytes / obj.size
        assert sum(f.sources()["bucket"] for f in nodes) == remote.bytes
    finally:
        for f in nodes:
            f.close()


def test_cache_gc_shared_from_the_command_line(shared: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from marinfs.app import cli

    bucket = Bucket()
    tier = node(shared)
    for i in range(3):
        get(tier, bucket, obj_of(f"f{i}", size=CHUNK))
    tier.settle()
    assert cli.main(["cache", "gc", "--shared", str(shared), "--limit", str(CHUNK + TRAILER.size), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["used_bytes"] <= CHUNK + TRAILER.size and out["evicted_bytes"] >= 2 * CHUNK
    assert len(list((shared / "chunks").glob("*/*"))) <= 1
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    assert cli.main(["cache", "gc", "--shared", str(open_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "writable by group or others" in err


def test_status_says_where_chunks_came_from_and_a_degraded_tier(shared: Path) -> None:
    from marinfs.app.status import format_status

    tier = node(shared)
    tier._degrade(tier._down, "slow: read chunk took over 3 s")
    item = {"mountpoint": "/mnt", "remote": "s3://b", "sources": {"local": 1 << 20, "shared": 2 << 30, "bucket": 0},
            "shared": tier.snapshot()}
    text = format_status([item])
    assert "chunks from: local disk 1.0 MiB, shared tier 2.0 GiB, bucket 0 B" in text
    assert "DEGRADED: slow: read chunk took over 3 s" in text


def test_a_fetch_waits_for_a_publishing_slot_instead_of_skipping(shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node fetching faster than the directory takes its chunks waits (briefly): each chunk it
    fetched is published, so no other node goes to the bucket for it."""
    bucket = Bucket()
    tier = node(shared)
    tier.max_publishing = 1
    real = tier._write_chunk

    def slow(name, data, *crc):  # noqa: ANN001
        time.sleep(0.05)
        return real(name, data, *crc)

    monkeypatch.setattr(tier, "_write_chunk", slow)
    for i in range(6):
        get(tier, bucket, obj_of(), i)
    tier.settle()
    assert tier.snapshot()["published"] == 6 and tier.snapshot()["publish_skipped"] == 0


def test_a_chunk_published_between_a_miss_and_the_lease_is_not_fetched_again(
        shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = Bucket()
    a, b = node(shared), node(shared)
    obj = obj_of()
    real = b._read_chunk
    looks = []

    def late(name, buf):  # noqa: ANN001 - b looks just before a publishes and lets its lease go
        looks.append(name)
        if len(looks) == 1:
            get(a, bucket, obj)
            a.settle()
            return False
        return real(name, buf)

    monkeypatch.setattr(b, "_read_chunk", late)
    assert get(b, bucket, obj)[1] == "shared"
    assert bucket.gets == 1
