"""A walker's next small files fetched ahead of it (marinfs/read/walkahead.py): the window rules as
units, then on the core Filesystem over memory and local remotes, counted in GETs."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Mounted, mount_backend
from mounting import MARINFS
import tiers

from marinfs.core import Filesystem
from marinfs.objects import ObjectInfo, ObjectVersion
from marinfs.read.reader import ChunkFetcher
from marinfs.remote import Remote
from marinfs.read.walkahead import WalkAhead

KiB, MiB = 1 << 10, 1 << 20


def info(name: str, size: int = 100, is_dir: bool = False, version: str | None = "v") -> ObjectInfo:
    return ObjectInfo(name=name, is_dir=is_dir, size=size,
                      version=None if version is None else ObjectVersion("etag", version))


class Walk:
    """A WalkAhead over one fake listing, recording what it asked to fetch."""

    def __init__(self, children: list[ObjectInfo] | None, room: int = 1000) -> None:
        self.children, self.room = children, room
        self.fetched: list[str] = []
        self.ahead = WalkAhead(self.listing, self.fetch, small=MiB, ttl=60.0)

    def listing(self, key: str) -> list[ObjectInfo] | None:
        return self.children if key == "d" else None

    def fetch(self, i: ObjectInfo) -> bool:
        if self.room <= 0:
            return False
        self.room -= 1
        self.fetched.append(i.name)
        return True

    def open(self, *names: str) -> list[str]:
        before = len(self.fetched)
        for name in names:
            self.ahead.opened(info(f"d/{name}"))
        return self.fetched[before:]


FILES = [info(f"d/f{i:02d}") for i in range(40)]


@pytest.mark.unit
def test_the_window_starts_at_the_second_file_in_order_and_doubles() -> None:
    w = Walk(list(reversed(FILES)))  # (a listing in any order: walked by name)
    assert w.open("f00") == []  # one open is not a walk
    assert w.open("f01") == ["d/f02", "d/f03", "d/f04", "d/f05"]
    assert w.open("f02") == [f"d/f{i:02d}" for i in range(6, 11)]  # window 8, from where it left off
    assert w.open("f03") == [f"d/f{i:02d}" for i in range(11, 20)]  # 16
    assert w.open("f04", "f05") == [f"d/f{i:02d}" for i in range(20, 38)]  # 32 at most
    assert len(set(w.fetched)) == len(w.fetched)  # each file asked for once


@pytest.mark.unit
def test_a_poll_random_opens_and_a_jump_back_start_nothing() -> None:
    w = Walk(FILES)
    assert w.open("f05", "f05", "f05", "f05") == []  # a status file polled
    assert w.open("f30", "f10", "f20", "f03") == []  # at random
    assert w.open("f04") != []  # the next one: a walk
    assert w.open("f01") == []  # back: ends it


@pytest.mark.unit
def test_a_walker_may_skip_files_fetched_ahead() -> None:
    w = Walk(FILES)
    w.open("f00", "f01")
    assert w.open("f04") == [f"d/f{i:02d}" for i in range(6, 13)]  # within the window: still a walk


@pytest.mark.unit
def test_only_small_versioned_files_are_fetched_and_directories_are_not_walked() -> None:
    children = [info("d/a"), info("d/b"), info("d/c", size=2 * MiB), info("d/d", is_dir=True), info("d/e", version=None),
                info("d/f")]
    w = Walk(children)
    assert w.open("a", "b") == ["d/f"]  # c too big, d a directory (not a place), e without a version


@pytest.mark.unit
def test_without_a_cached_listing_nothing_is_fetched() -> None:
    w = Walk(None)
    assert w.open("f00", "f01", "f02") == []


@pytest.mark.unit
def test_a_window_without_room_is_asked_for_again_at_the_next_open() -> None:
    w = Walk(FILES, room=2)
    assert w.open("f00", "f01") == ["d/f02", "d/f03"]
    w.room = 100
    assert w.open("f02") == [f"d/f{i:02d}" for i in range(4, 11)]


@pytest.mark.unit
def test_a_chunk_fetched_ahead_leaves_memory_once_on_disk(tmp_path: Path) -> None:
    """A walker's open of a file cached whole may be served by the disk or the kernel itself
    (passthrough), never from memory: the fetched-ahead chunk is let go once it is on disk
    (on S3 a walk over 20,000 files kept the budget full of them)."""
    from marinfs.read.chunkcache import ChunkCache
    from marinfs.read.reader import ObjectRef

    data = os.urandom(40 * KiB)
    calls = []

    def fetch(key: str, start: int, end: int, version: object) -> bytes:
        calls.append(key)
        return data[start:end]

    fetcher = ChunkFetcher(fetch, ChunkCache(tmp_path, 1 << 30), chunk_size=MiB, memory_bytes=8 * MiB)
    try:
        deadline = time.monotonic() + 10
        for i in range(50):  # (8 at once: the rest wait for room, as a walker's later opens ask again)
            while not fetcher.fetch_ahead(ObjectRef(url=f"mem://b/f{i}", key=f"f{i}", version="v", size=len(data))):
                assert time.monotonic() < deadline
                time.sleep(0.005)
        while fetcher._walking and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fetcher.settle()
        assert len(calls) == 50 and fetcher.memory()["chunks"] == 0 and fetcher.memory()["used"] == 0
        view = memoryview(bytearray(len(data)))
        fetcher.read_into(ObjectRef(url="mem://b/f7", key="f7", version="v", size=len(data)), 0, 0, view)
        assert view == data and len(calls) == 50  # from the disk cache
    finally:
        fetcher.close()


def put(remote: Remote, key: str, data: bytes) -> None:
    remote.fs.makedirs(remote.full(os.path.dirname(key)), exist_ok=True)
    remote.fs.pipe_file(remote.full(key), data)


def cat(fs: Filesystem, path: str) -> bytes:
    fh = fs.open(path, os.O_RDONLY).fh
    try:
        return fs.read(fh, 1 << 20, 0)
    finally:
        fs.release(fh)


def test_a_walk_reads_each_small_file_with_one_get_fetched_before_its_open(remote: Remote, tmp_path: Path) -> None:
    """Every file is fetched once, most of them before the walker opened them, and the bytes
    the walker reads are each file's own; a second walk fetches nothing."""
    files = {f"d/f{i:03d}": os.urandom(1 + i * 97) for i in range(60)}
    for key, data in files.items():
        put(remote, key, data)
    fetcher = ChunkFetcher(remote.read_range, None, chunk_size=MiB, memory_bytes=64 * MiB)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", list_prefetch=True, fetcher=fetcher)
    try:
        assert fs.walkahead is not None
        assert len(fs.readdir("/d")) == 60
        gets_before_open = []
        remote.stats.reset()
        for key, data in files.items():
            fs.fetcher.settle(1)  # (no disk cache: nothing to settle, only a short wait is needed)
            deadline = time.monotonic() + 2
            while fs.fetcher._walking and time.monotonic() < deadline:
                time.sleep(0.001)  # let the fetches ahead land: then reads make no GET
            gets_before_open.append(remote.stats.count("get"))
            assert cat(fs, f"/{key}") == data
        assert remote.stats.count("get") == 60  # (generic remotes check the version with a stat)
        assert gets_before_open[10] > 10  # files fetched ahead of the walker's opens
    finally:
        fs.close()


def test_a_file_rewritten_after_its_fetch_ahead_is_read_as_its_new_version(remote: Remote, tmp_path: Path) -> None:
    """A fetch ahead is keyed by the listed version: a file changed behind the mount since is
    read as what the walker's open finds, never the bytes fetched ahead."""
    for i in range(10):
        put(remote, f"d/f{i}", b"old %d" % i)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", list_prefetch=True)
    try:
        fs.readdir("/d")
        assert cat(fs, "/d/f0") == b"old 0" and cat(fs, "/d/f1") == b"old 1"  # f2.. fetched ahead
        time.sleep(0.05)
        put(remote, "d/f3", b"brand new")
        fs.metadata.invalidate("d/f3")
        fs.metadata.invalidate("d")
        assert cat(fs, "/d/f2") == b"old 2" and cat(fs, "/d/f3") == b"brand new"
    finally:
        fs.close()


@pytest.fixture(params=["s3", "gcs"])
@tiers.needs("mount")
def store_mount(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mounted]:
    with mount_backend(request, request.param, tmp_path) as m:
        yield m


def daemon_requests(m: Mounted) -> dict[str, int]:
    time.sleep(2.5)  # the daemon publishes its counters every 2 s
    out = subprocess.run([*MARINFS, "status", str(m.mnt), "--json"], capture_output=True, text=True, check=True,
                         env={**os.environ, **m.env})
    (item,) = json.loads(out.stdout)
    return item["remote_requests"]["requests"]


def test_a_cold_walk_costs_one_get_and_no_head_per_file(store_mount: Mounted) -> None:
    """`find | sort | xargs cat` over 300 small files written behind the mount's back: every
    file's bytes right, one GET per file, no HEAD per file (the listings gave every stat), a
    LIST per directory; and the walk reads them again from the cache without a request."""
    rng = random.Random(7)
    files = {f"w/d{i // 100}/f{i:03d}": rng.randbytes(rng.randint(1, 64 * KiB)) for i in range(300)}
    store_mount.fs.pipe({store_mount.remote_path(k): v for k, v in files.items()})
    walk = f"cd {store_mount.mnt} && find w -type f | sort | xargs cat | sha256sum"
    expected = hashlib.sha256(b"".join(files[k] for k in sorted(files))).hexdigest()
    assert subprocess.run(walk, shell=True, check=True, capture_output=True, text=True).stdout.split()[0] == expected
    counts = daemon_requests(store_mount)
    # The walk's top is looked up by name (a HEAD, a LIST): then no file costs a HEAD.
    assert counts.get("get") == 300 and counts.get("head", 0) <= 1, counts
    assert counts.get("list", 0) <= 6, counts
    subprocess.run("echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    assert subprocess.run(walk, shell=True, check=True, capture_output=True, text=True).stdout.split()[0] == expected
    assert daemon_requests(store_mount).get("get") == 300
