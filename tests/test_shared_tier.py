"""The shared chunk tier through real mounts (issue 35): several daemons on one machine, each
with its own mount and local cache directory, share one directory and stand for several nodes,
against SeaweedFS. Bucket bytes are counted exactly, by each daemon's metrics
(``marinfs_chunk_bytes{source=...}``), not timed."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mounting import MARINFS, fsspec_client, subprocess_mount, tmpfs, weed_mount
from servers import S3Server

pytestmark = [pytest.mark.mount, pytest.mark.objectstore]

MiB = 1 << 20
SIZE = 64 * MiB  # the 1 GiB acceptance figure is benchmarks/shared_bench.py's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chunk_bytes(port: int) -> dict[str, float]:
    """The daemon's chunk bytes by source, from its metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^marinfs_chunk_bytes(?:_total)?\{source="(\w+)"\} (\S+)$', text, re.M)}


@dataclass
class Node:
    mnt: Path
    cache: Path
    port: int
    pid: int

    def counts(self) -> dict[str, float]:
        return chunk_bytes(self.port)


@dataclass
class Cluster:
    url: str
    client: object
    root: str
    shared: Path
    nodes: list[Node]

    def put(self, size: int = SIZE) -> tuple[str, str]:
        name = f"obj-{uuid.uuid4().hex[:8]}.bin"
        data = os.urandom(size)
        self.client.pipe_file(f"{self.root}/{name}", data)  # type: ignore[attr-defined]
        return name, hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def cluster(server: S3Server, base: Path, n: int, *extra: str) -> Iterator[Cluster]:
    url = f"s3://{server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**server.storage_options(), "use_listings_cache": False})
    client.pipe_file(f"{root}/.keep", b"")
    shared = base / "shared"
    shared.mkdir(mode=0o700)
    nodes: list[Node] = []
    with contextlib.ExitStack() as stack:
        for i in range(n):
            mnt, cache, port = base / f"mnt{i}", base / f"cache{i}", free_port()
            pid = stack.enter_context(subprocess_mount(
                url, mnt, cache, "--shared-cache-dir", str(shared), "--metrics-port", str(port), *extra,
                env=server.env()))
            nodes.append(Node(mnt, cache, port, pid))
        yield Cluster(url, client, root, shared, nodes)


def read_hash(path: Path) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        while block := os.read(fd, MiB):
            digest.update(block)
    finally:
        os.close(fd)
    return digest.hexdigest()


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


@pytest.fixture(scope="module")
def four(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(s3_server, tmp_path_factory.mktemp("shared4"), 4) as c:
        yield c


def test_four_mounts_reading_one_object_cold_at_once_fetch_about_one_copy(four: Cluster) -> None:
    name, want = four.put()
    before = [n.counts() for n in four.nodes]
    start = threading.Barrier(len(four.nodes))
    got: dict[int, str] = {}

    def read(i: int) -> None:
        start.wait()
        got[i] = read_hash(four.nodes[i].mnt / name)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(four.nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == {i: want for i in range(len(four.nodes))}
    moved = [delta(b, n.counts()) for b, n in zip(before, four.nodes)]
    bucket = sum(m["bucket"] for m in moved)
    assert bucket <= 1.1 * SIZE, f"{bucket / SIZE:.2f} copies from the bucket: {moved}"
    assert sum(m["shared"] for m in moved) >= 2.9 * SIZE


def test_mounts_one_after_another_fetch_nothing_from_the_bucket(four: Cluster) -> None:
    name, want = four.put()
    first = four.nodes[0]
    before = first.counts()
    assert read_hash(first.mnt / name) == want
    assert delta(before, first.counts())["bucket"] == SIZE
    time.sleep(0.5)  # publishing is in the background: let the last chunks land
    for node in four.nodes[1:]:
        before = node.counts()
        assert read_hash(node.mnt / name) == want
        moved = delta(before, node.counts())
        assert moved["bucket"] == 0 and moved["shared"] == SIZE, moved


def shared_counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^marinfs_shared_{name}(?:_total)? (\S+)$", text, re.M)
    assert m, f"no marinfs_shared_{name}"
    return float(m.group(1))


def test_a_lease_holder_killed_mid_fetch_holds_nobody_up_past_its_expiry(
        s3_server: S3Server, tmp_path: Path) -> None:
    lease = 2.0
    with cluster(s3_server, tmp_path, 2, "--shared-cache-lease", str(lease), "--prefetch-workers", "2") as c:
        name, want = c.put()
        holder, other = c.nodes
        reader = subprocess.Popen(["dd", f"if={holder.mnt / name}", "of=/dev/null", "bs=1M"],
                                  stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not any((c.shared / "leases").iterdir()):  # the holder is fetching
                assert time.monotonic() < deadline, "no lease taken"
                time.sleep(0.002)
            os.kill(holder.pid, signal.SIGKILL)
        finally:
            reader.wait(60)  # its read fails (the daemon is gone): ENOTCONN
        # Leases of chunks the holder never published: the other node must wait out their expiry.
        orphans = [p.name for p in (c.shared / "leases").iterdir() if not any((c.shared / "chunks").glob(f"*/{p.name}"))]
        assert orphans, "the holder was killed after it published: nothing to test"
        started = time.monotonic()
        assert read_hash(other.mnt / name) == want
        took = time.monotonic() - started
        assert took < lease + 15, took  # the expiry, plus a cold read of 64 MiB: bounded
        assert shared_counter(other.port, "leases_broken") + shared_counter(other.port, "lease_timeouts") >= 1
        assert not any((c.shared / "leases" / o).exists() for o in orphans)  # broken, not left behind
        assert other.counts()["bucket"] <= SIZE


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A shared directory on a tmpfs of its own, which the test unmounts or makes read-only."""
    with tmpfs(tmp_path / "sharedfs", "512m") as path:
        yield path


@pytest.mark.parametrize("fault", ["read-only", "unmounted"])
def test_a_shared_directory_made_read_only_or_unmounted_during_reads_fails_no_read(
        s3_server: S3Server, tmp_path: Path, tmpfs_dir: Path, fault: str) -> None:
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    warm, cold = os.urandom(SIZE), os.urandom(SIZE)
    client.pipe_file(f"{root}/warm.bin", warm)
    client.pipe_file(f"{root}/cold.bin", cold)
    port = free_port()
    with subprocess_mount(url, tmp_path / "a", tmp_path / "ca", "--shared-cache-dir", str(tmpfs_dir),
                          "--metrics-port", str(port), env=s3_server.env()):
        assert read_hash(tmp_path / "a" / "warm.bin") == hashlib.sha256(warm).hexdigest()
    port = free_port()
    mnt = tmp_path / "b"
    with subprocess_mount(url, mnt, tmp_path / "cb", "--shared-cache-dir", str(tmpfs_dir),
                          "--metrics-port", str(port), "--prefetch-workers", "2", env=s3_server.env()):
        fd = os.open(mnt / "cold.bin", os.O_RDONLY)
        try:
            digest = hashlib.sha256(os.read(fd, 8 * MiB))  # reading has begun with the tier working
            if fault == "read-only":
                # A read-only view stacked on the path (a remount of the tmpfs itself is refused
                # while the daemon writes a chunk there): new opens meet EROFS.
                subprocess.run(["mount", "--bind", str(tmpfs_dir), str(tmpfs_dir)], check=True, capture_output=True)
                # (EBUSY while the daemon has a chunk open for writing through the new view: again)
                for attempt in range(50):
                    done = subprocess.run(["mount", "-o", "remount,bind,ro", str(tmpfs_dir)], capture_output=True)
                    if done.returncode == 0:
                        break
                    time.sleep(0.1)
                else:
                    raise AssertionError(f"cannot make {tmpfs_dir} read-only: {done.stderr!r}")
            else:
                subprocess.run(["umount", "-l", str(tmpfs_dir)], check=True, capture_output=True)
            while block := os.read(fd, MiB):
                digest.update(block)
        finally:
            os.close(fd)
        assert digest.hexdigest() == hashlib.sha256(cold).hexdigest()
        assert read_hash(mnt / "warm.bin") == hashlib.sha256(warm).hexdigest()
        counts = chunk_bytes(port)
        if fault == "read-only":
            assert counts["shared"] == SIZE  # what the tier held is still read from it
        status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        deadline = time.monotonic() + 10  # published every 2 s
        while "READ-ONLY" not in status.stdout and "DEGRADED" not in status.stdout:
            assert time.monotonic() < deadline, status.stdout
            time.sleep(0.5)
            status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True, timeout=60)
        assert "chunks from:" in status.stdout


def test_a_shared_directory_others_can_write_is_refused(s3_server: S3Server, tmp_path: Path) -> None:
    shared = tmp_path / "open"
    shared.mkdir()
    os.chmod(shared, 0o777)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = subprocess.run([*MARINFS, "mount", f"s3://{s3_server.bucket}/x", str(mnt), "--shared-cache-dir",
                             str(shared)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **s3_server.env()})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "writable by group or others" in result.stderr
    assert not os.path.ismount(mnt)


# -- the tier on a filesystem two nodes mount: two `weed mount` views of one filer directory ------
CHUNK = 8 * MiB  # the daemon's default chunk size


def settled(view: Path, files: int, timeout: float = 30) -> list[Path]:
    """The tier's chunk files as ``view`` shows them, once it shows ``files`` of them and no
    lease or temporary file (every publish landed and let its lease go)."""
    deadline = time.monotonic() + timeout
    while True:
        chunks = sorted((view / "chunks").glob("*/*"))
        if len(chunks) == files and not any((view / "leases").iterdir()) and not any((view / "tmp").iterdir()):
            return chunks
        assert time.monotonic() < deadline, f"{view}: {len(chunks)} chunk files, not {files}"
        time.sleep(0.02)


@pytest.fixture
def weed_views(s3_server: S3Server, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """One directory of SeaweedFS's filer through two `weed mount`s, as NFS on two nodes: the
    tier's directory made through one and seen through the other."""
    path = f"/tier-{uuid.uuid4().hex[:12]}"
    with weed_mount(s3_server.filer(), path, tmp_path / "view-a", tmp_path / "weed-a") as a, \
            weed_mount(s3_server.filer(), path, tmp_path / "view-b", tmp_path / "weed-b") as b:
        (a / "tier").mkdir(mode=0o700)
        deadline = time.monotonic() + 10
        while not (b / "tier").is_dir():
            assert time.monotonic() < deadline, "the directory made through one view never showed in the other"
            time.sleep(0.02)
        yield a / "tier", b / "tier"


def test_two_nodes_share_chunks_through_two_weed_mount_views_of_one_directory(
        s3_server: S3Server, tmp_path: Path, weed_views: tuple[Path, Path]) -> None:
    """A file read by node A is read by node B with no byte from the bucket, each node's tier
    being its own view of the directory; a chunk damaged through A's view is seen damaged
    through B's, rejected by its checksum, fetched again and published sound."""
    view_a, view_b = weed_views
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    shared = os.urandom(3 * CHUNK)
    damaged = os.urandom(3 * CHUNK)
    client.pipe_file(f"{root}/shared.bin", shared)
    client.pipe_file(f"{root}/damaged.bin", damaged)
    port_a, port_b = free_port(), free_port()
    with subprocess_mount(url, tmp_path / "a", tmp_path / "ca", "--shared-cache-dir", str(view_a),
                          "--metrics-port", str(port_a), env=s3_server.env()), \
            subprocess_mount(url, tmp_path / "b", tmp_path / "cb", "--shared-cache-dir", str(view_b),
                             "--metrics-port", str(port_b), env=s3_server.env()):
        assert read_hash(tmp_path / "a" / "shared.bin") == hashlib.sha256(shared).hexdigest()
        assert chunk_bytes(port_a)["bucket"] == len(shared)
        settled(view_b, 3)  # A's publishes, as B's view shows them
        assert read_hash(tmp_path / "b" / "shared.bin") == hashlib.sha256(shared).hexdigest()
        assert chunk_bytes(port_b) == {"bucket": 0, "local": 0, "shared": len(shared)}

        before = set(settled(view_a, 3))
        assert read_hash(tmp_path / "a" / "damaged.bin") == hashlib.sha256(damaged).hexdigest()
        new = sorted(set(settled(view_a, 6)) - before)
        assert len(new) == 3
        victim = new[1]
        sound = victim.read_bytes()
        fd = os.open(victim, os.O_WRONLY)  # one byte flipped in place, through A's view
        try:
            os.pwrite(fd, bytes([sound[12345] ^ 0xFF]), 12345)
        finally:
            os.close(fd)
        seen_by_b = view_b / victim.relative_to(view_a)
        deadline = time.monotonic() + 10
        while seen_by_b.read_bytes() == sound:  # B's view catches up
            assert time.monotonic() < deadline, "the damage never showed through B's view"
            time.sleep(0.05)
        before_b = chunk_bytes(port_b)
        assert read_hash(tmp_path / "b" / "damaged.bin") == hashlib.sha256(damaged).hexdigest()
        moved = delta(before_b, chunk_bytes(port_b))
        assert moved == {"bucket": CHUNK, "local": 0, "shared": 2 * CHUNK}, moved
        assert shared_counter(port_b, "corrupt") == 1
        settled(view_a, 6)
        assert victim.read_bytes() == sound  # fetched again by B and published whole, as A's view shows
