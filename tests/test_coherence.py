"""Many nodes, one tree: two daemons (separate cache dirs) on one bucket prefix, plus a plain
fsspec client standing for other Marin code. Node A is a `marinfs mount` subprocess; node B
runs in this process so the test can read its request counters."""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import SHARED, check_shared_tier, object_store
from mounting import fsspec_client, inprocess_mount, subprocess_mount
import tiers

MiB = 1 << 20
TTL = 1.0  # metadata TTL of both nodes; the kernel caches attributes min(TTL, 1 s) on top
NEG_TTL = 0.5
VISIBLE_WITHIN = 2 * TTL + 1.5  # our TTL + the kernel's + margin


@dataclass
class Nodes:
    a: Path  # mount of node A (subprocess daemon)
    b: Path  # mount of node B (in-process)
    b_core: Any  # node B's Filesystem
    client: Any  # node C: a plain fsspec client
    root: str

    def c_put(self, rel: str, data: bytes) -> None:
        self.client.pipe_file(f"{self.root}/{rel}", data)

    def b_requests(self) -> dict[str, int]:
        return dict(self.b_core.remote.stats.snapshot()["requests"])


# The tests that read files' bytes also run with both nodes on one shared chunk tier (the
# fixture's SHARED variant; conftest.SHARED_TIER_FILES says why only where bytes are read).
READS = pytest.mark.parametrize("nodes", ["s3", "gcs", SHARED], indirect=True)


@pytest.fixture(params=["s3", "gcs"])
@tiers.needs("mount")
def nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Nodes]:
    """Nodes A and B; in the shared variant both on one shared chunk tier (--shared-cache-dir)
    and one chunk size (A's, the default: B's 1 MiB elsewhere), so each reads what the other
    fetched: a version another node or client wrote since must never be served from it."""
    url, options, env = object_store(request, request.param)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    client.pipe_file(f"{root}/.keep", b"")  # the prefix exists before either node mounts
    immutable = getattr(request, "param_immutable", ())
    shared = tmp_path / "shared" if request.param == SHARED else None
    tier = ["--shared-cache-dir", str(shared)] if shared else []
    with subprocess_mount(url, tmp_path / "a", tmp_path / "cache-a", "--metadata-ttl", str(TTL),
                          "--negative-ttl", str(NEG_TTL), *tier, env=env), \
            inprocess_mount(url, tmp_path / "b", tmp_path / "cache-b", storage_options=options,
                            cache_size=256 * MiB, chunk_size=8 * MiB if shared else 1 * MiB, metadata_ttl=TTL,
                            negative_ttl=NEG_TTL, immutable=("ckpt/*/step-*/**",) + tuple(immutable),
                            shared_dir=shared) as core:
        yield Nodes(tmp_path / "a", tmp_path / "b", core, client, root)
    if shared:  # both unmounted: their tier never failed them
        check_shared_tier(json.loads((tmp_path / "cache-a" / "stats.json").read_text()))
        check_shared_tier({"shared": core.fetcher.shared.snapshot()})


def eventually(check: Callable[[], bool], within: float = VISIBLE_WITHIN) -> float:
    """Seconds until ``check()`` held; fails after ``within``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            pytest.fail(f"not visible within {within} s")
        time.sleep(0.05)
    return time.monotonic() - started


def exists(path: Path) -> bool:
    return os.path.exists(path)


def test_create_on_a_is_visible_on_b_only_after_close(nodes: Nodes) -> None:
    with open(nodes.a / "new.bin", "wb") as f:
        f.write(b"part one;")
        f.flush()
        deadline = time.monotonic() + VISIBLE_WITHIN
        while time.monotonic() < deadline:  # not committed: B must not see it
            assert not exists(nodes.b / "new.bin")
            time.sleep(0.1)
        f.write(b"part two")
    eventually(lambda: exists(nodes.b / "new.bin"))
    assert (nodes.b / "new.bin").read_bytes() == b"part one;part two"


@READS
def test_overwrite_on_a_is_read_by_b_after_the_ttl(nodes: Nodes) -> None:
    nodes.c_put("f", b"old" * 1000)
    eventually(lambda: exists(nodes.b / "f"))
    assert (nodes.b / "f").read_bytes() == b"old" * 1000
    (nodes.a / "f").write_bytes(b"new" * 1000)
    eventually(lambda: (nodes.b / "f").read_bytes() == b"new" * 1000)


@READS
def test_an_open_handle_never_mixes_versions(nodes: Nodes) -> None:
    old, new = os.urandom(24 * MiB), os.urandom(24 * MiB)
    nodes.c_put("shard", old)
    eventually(lambda: exists(nodes.b / "shard"))
    served = bytearray()
    stale = False
    with open(nodes.b / "shard", "rb", buffering=0) as f:
        served += f.read(MiB)
        (nodes.a / "shard").write_bytes(new)  # node A rewrites it while B reads on
        time.sleep(0.2)
        while True:
            try:
                piece = f.read(MiB)
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
                stale = True
                break
            if not piece:
                break
            served += piece
    assert bytes(served) == old[:len(served)]  # a consistent prefix of the old version, never a mix
    assert stale or len(served) == len(old)
    assert (nodes.b / "shard").read_bytes() == new or not stale  # a new open sees the new version
    eventually(lambda: (nodes.b / "shard").read_bytes() == new)


def test_delete_on_a_is_enoent_on_b(nodes: Nodes) -> None:
    nodes.c_put("doomed", b"x")
    eventually(lambda: exists(nodes.b / "doomed"))
    os.unlink(nodes.a / "doomed")
    eventually(lambda: not exists(nodes.b / "doomed"))
    with pytest.raises(FileNotFoundError):
        open(nodes.b / "doomed")


@READS
def test_b_never_sees_the_marker_before_the_data(nodes: Nodes) -> None:
    shards = {f"out/shard-{i}.bin": os.urandom(2 * MiB) for i in range(3)}
    (nodes.a / "out").mkdir()

    def write_on_a() -> None:
        for rel, data in shards.items():
            (nodes.a / rel).write_bytes(data)
        (nodes.a / "out/.executor_status").write_text("SUCCESS")

    writer = threading.Thread(target=write_on_a)
    writer.start()
    try:
        eventually(lambda: exists(nodes.b / "out/.executor_status"), within=60)
        for rel, data in shards.items():  # the marker is visible: every data file must be whole
            assert (nodes.b / rel).read_bytes() == data
    finally:
        writer.join()


def test_listing_on_b_picks_up_new_entries(nodes: Nodes) -> None:
    (nodes.a / "ckpts").mkdir()
    (nodes.a / "ckpts/step-1").write_text("1")
    eventually(lambda: os.listdir(nodes.b / "ckpts") == ["step-1"])
    nodes.c_put("ckpts/step-2", b"2")  # a third client writes directly to the bucket
    eventually(lambda: sorted(os.listdir(nodes.b / "ckpts")) == ["step-1", "step-2"])


@READS
def test_an_immutable_path_is_served_from_cache_with_no_requests(nodes: Nodes) -> None:
    data = os.urandom(3 * MiB)
    nodes.c_put("ckpt/run/step-100/model.bin", data)
    assert (nodes.b / "ckpt/run/step-100/model.bin").read_bytes() == data
    time.sleep(2 * TTL + 0.2)  # every TTL, ours and the kernel's, has expired
    nodes.b_core.remote.stats.reset()
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    assert (nodes.b / "ckpt/run/step-100/model.bin").read_bytes() == data
    assert nodes.b_requests() == {}


def test_polling_a_status_file_costs_one_request_per_ttl(nodes: Nodes) -> None:
    nodes.c_put("status/.executor_status", b"RUNNING")
    eventually(lambda: exists(nodes.b / "status/.executor_status"))
    nodes.b_core.remote.stats.reset()
    seconds, polls = 5.0, 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        os.stat(nodes.b / "status/.executor_status")
        polls += 1
        time.sleep(0.1)
    counts = nodes.b_requests()
    assert polls >= 40
    # Per TTL: one HEAD for the file, one LIST to revalidate its directory; not one per poll.
    assert counts.get("head", 0) <= seconds / TTL + 2, counts
    assert sum(counts.values()) <= 2 * (seconds / TTL + 2), counts


@READS
def test_handles_of_two_versions_never_read_each_others_pages(nodes: Nodes) -> None:
    """The kernel keeps one page cache per file, not per handle: an old version's handle must
    not fill it with bytes that a handle of the new version then reads, nor the other way.
    On node A (a daemon of its own): this process maps the file, and its faults must not wait
    for node B's libfuse threads, which need this process's interpreter lock."""
    old, new = os.urandom(8 * MiB), os.urandom(8 * MiB)
    path = nodes.a / "twice"
    nodes.c_put("twice", old)
    eventually(lambda: exists(path))
    h1 = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(h1, 8 * MiB, 0) == old  # the old version, whole, in A's chunk cache
        m1 = mmap.mmap(h1, 8 * MiB, prot=mmap.PROT_READ)
        nodes.c_put("twice", new)

        def new_open() -> bool:
            with open(path, "rb", buffering=0) as f:
                return f.read(4096) == new[:4096]

        eventually(new_open)
        h2 = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(h1, MiB, 4 * MiB) == old[4 * MiB:5 * MiB]  # still the version it opened
            assert os.pread(h2, MiB, 4 * MiB) == new[4 * MiB:5 * MiB]
            assert os.pread(h2, MiB, 6 * MiB) == new[6 * MiB:7 * MiB]
            assert os.pread(h1, MiB, 6 * MiB) == old[6 * MiB:7 * MiB]
            assert m1[2 * MiB:3 * MiB] == old[2 * MiB:3 * MiB]
            with pytest.raises(OSError, check=lambda e: e.errno == errno.ENODEV):
                mmap.mmap(h2, 8 * MiB, prot=mmap.PROT_READ)  # shared: it reads around the page cache
        finally:
            os.close(h2)
        m1.close()
    finally:
        os.close(h1)

    def mapped_shared() -> bool:
        """The old handles are gone: a new open takes the page cache (once the daemon has their
        release, which close(2) does not wait for)."""
        with open(path, "rb") as f:
            try:
                m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except OSError as exc:
                assert exc.errno == errno.ENODEV, exc
                return False
            try:
                assert m[:] == new
            finally:
                m.close()
            return True

    eventually(mapped_shared)


@READS
def test_a_file_made_again_under_an_open_name_is_mapped_as_usual(nodes: Nodes) -> None:
    """Unlinked and written again on this node, a name is a new inode: its readers share
    nothing with the old file's open handle, and map it shared as any file."""
    path = nodes.a / "again"
    path.write_bytes(b"old" * 4096)
    with open(path, "rb", buffering=0) as old:
        assert old.read(3) == b"old"
        os.unlink(path)
        path.write_bytes(b"new" * 4096)
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            assert m[:] == b"new" * 4096
            m.close()
        assert os.pread(old.fileno(), 3, 9000) == b"old"  # the unlinked file, still open


@READS
def test_a_reader_of_the_version_open_here_reads_it_to_its_end_whatever_stat_saw(nodes: Nodes) -> None:
    """The kernel keeps one size per file and stops page-cache reads at it: a stat of a shorter
    new version must not cut the readers of the longer one still open here (a model server
    reading its old checkpoint while another node writes the next)."""
    old, new = os.urandom(3 * MiB), os.urandom(1 * MiB + 123)
    path = nodes.a / "shrinks"
    nodes.c_put("shrinks", old)
    eventually(lambda: exists(path))
    h = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(h, 64 * 1024, 0) == old[:64 * 1024]
        nodes.c_put("shrinks", new)

        def new_open() -> bool:
            with open(path, "rb") as f:  # reads around the page cache, to the new version's end
                return f.read() == new

        eventually(new_open)
        os.stat(path)  # the kernel asks for the name's stat now (it used to take the new, shorter size)
        rest = b"".join(os.pread(h, MiB, offset) for offset in range(64 * 1024, len(old), MiB))
        assert rest == old[64 * 1024:]
        assert os.stat(path).st_size == os.fstat(h).st_size == len(old)  # the version open here, while it is
    finally:
        os.close(h)
    eventually(lambda: os.stat(path).st_size == len(new))  # theirs gone, the name's own


def _version_bytes(n: int) -> bytes:
    """Version ``n`` of a churned file: its number in every 8 bytes, one of 21 sizes."""
    size = (1 + n % 3) * MiB + (n % 7) * 1000
    return (n.to_bytes(8, "little") * (size // 8 + 1))[:size]


@pytest.mark.mount
@pytest.mark.parametrize("passthrough", ["--passthrough", "--no-passthrough"])
def test_readers_of_a_file_replaced_twice_a_second_each_read_one_whole_version(tmp_path: Path, passthrough: str) -> None:
    """Churn faster than the TTLs: another tool replaces a file every 0.5 s while four readers
    open, fstat, read to the end and close it in a loop. Each read is one whole version, its
    own size (or ESTALE: the local disk keeps no old version). The kernel keeps one size per
    file, which such reads used to be cut at, or filled with zeros up to."""
    remote = tmp_path / "remote"
    remote.mkdir()
    target = remote / "f.bin"
    target.write_bytes(_version_bytes(0))
    stop = threading.Event()
    bad: list[str] = []
    counts = {"ok": 0, "estale": 0}
    sizes = {len(_version_bytes(n)) for n in range(21)}

    def writer() -> None:
        n = 1
        while not stop.wait(0.5):
            (remote / ".next").write_bytes(_version_bytes(n))
            os.rename(remote / ".next", target)
            n += 1

    def reader(path: Path) -> None:
        while not stop.is_set():
            try:
                with open(path, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    data = b"".join(iter(lambda: f.read(256 * 1024), b""))
            except OSError as exc:  # (any other failure fails the test too)
                if exc.errno == errno.ESTALE:
                    counts["estale"] += 1
                else:
                    bad.append(repr(exc))
                continue
            except BaseException as exc:  # noqa: BLE001 - a thread's error would otherwise vanish
                bad.append(repr(exc))
                return
            n = int.from_bytes(data[:8], "little")
            # (fstat may show the size of another version open here: the kernel keeps one)
            if data != _version_bytes(n) or size not in sizes:
                bad.append(f"{len(data)} bytes starting as version {n} (its size {len(_version_bytes(n))}), fstat {size}")
            else:
                counts["ok"] += 1

    with subprocess_mount(str(remote), tmp_path / "mnt", tmp_path / "cache", "--metadata-ttl", "1", passthrough):
        threads = [threading.Thread(target=writer)] + [
            threading.Thread(target=reader, args=(tmp_path / "mnt" / "f.bin",)) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(30)
    print(counts, len(bad))
    assert not bad, bad[:5]
    assert counts["ok"] > 20
