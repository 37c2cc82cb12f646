"""Faults. For each one: no hang beyond the configured timeouts, no torn or stale data served,
nothing acknowledged and then lost (docs/reliability.md has the table).

In-process faults go through ``faults.FaultyFS``, a fault-injecting wrapper of the fsspec
filesystem under the mount's Remote (memory:// here), so marinfs's own retry and errno code is
what is tested. Process-level faults use real servers: an HTTP proxy in front of SeaweedFS that
answers 503 or behaves like a server that stops mid-read, mid-upload or mid-listing, and
SIGKILL of the daemon while a program writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from faults import FaultPlan, FaultyFS, HttpFaultProxy
from marinfs.errors import StaleVersionError
from marinfs.write.recovery import recover
from marinfs.remote import Remote, RemoteSettings
from marinfs.write.staging import JOURNAL_SUFFIX
from chunkfiles import cut_short, records, region
from mounting import MARINFS, fsspec_client, inprocess_mount, staging_entries, subprocess_mount
import tiers

KiB, MiB = 1 << 10, 1 << 20
FAST_RETRIES = RemoteSettings(attempts=3, backoff_base=0.01, backoff_max=0.05)


def errno_of(fn: Any) -> int:
    try:
        fn()
    except OSError as exc:
        return exc.errno or 0
    return 0


def wait_for(check: Any, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def journals(cache: Path) -> list[Path]:
    return staging_entries(cache / "staging", "*" + JOURNAL_SUFFIX)


# -- in process: a memory remote behind a FaultPlan ------------------------------------------------
@dataclass
class Faulty:
    mnt: Path
    cache: Path
    core: Any  # marinfs.core.Filesystem serving the mount
    plan: FaultPlan
    client: Any  # the memory filesystem itself, fault-free: what the store really holds
    root: str

    def put(self, rel: str, data: bytes) -> None:
        self.client.pipe_file(f"{self.root}/{rel}", data)

    def cat(self, rel: str) -> bytes | None:
        try:
            return bytes(self.client.cat_file(f"{self.root}/{rel}"))
        except FileNotFoundError:
            return None

    def forget(self) -> None:
        """As if every TTL had expired: the next lookups ask the remote."""
        self.core.metadata.clear()


@pytest.fixture
@tiers.needs("mount")
def faulty(tmp_path: Path) -> Iterator[Faulty]:
    url = f"memory://faults-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url)
    client.mkdir(root)
    plan = FaultPlan(seed=7)
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with inprocess_mount(url, mnt, cache, chunk_size=64 * KiB, cache_size=64 * MiB, metadata_ttl=0.2,
                         negative_ttl=0.2) as core:
        core.remote.settings = FAST_RETRIES
        core.remote.fs = FaultyFS(core.remote.fs, plan)
        yield Faulty(mnt, cache, core, plan, client, root)
        plan.clear()


def workload(f: Faulty, n: int = 6) -> dict[str, bytes]:
    """Create, overwrite, append, rename, list and read back through the mount."""
    want: dict[str, bytes] = {}
    os.makedirs(f.mnt / "w/sub", exist_ok=True)
    for i in range(n):
        data = os.urandom(i * 50 * KiB + i)
        (f.mnt / f"w/sub/f{i}").write_bytes(data)
        want[f"w/sub/f{i}"] = data
    with open(f.mnt / "w/sub/f1", "ab") as out:
        out.write(b"appended")
    want["w/sub/f1"] += b"appended"
    os.rename(f.mnt / "w/sub/f2", f.mnt / "w/f2-renamed")
    want["w/f2-renamed"] = want.pop("w/sub/f2")
    os.unlink(f.mnt / "w/sub/f0")
    del want["w/sub/f0"]
    assert sorted(os.listdir(f.mnt / "w/sub")) == sorted(k.rsplit("/", 1)[1] for k in want if k.startswith("w/sub/"))
    f.forget()
    for rel, data in want.items():
        assert (f.mnt / rel).read_bytes() == data
    return want


def test_latency_on_every_call_changes_no_result(faulty: Faulty) -> None:
    faulty.plan.latency["*"] = 0.02
    want = workload(faulty)
    for rel, data in want.items():
        assert faulty.cat(rel) == data
    assert sum(faulty.plan.calls.values()) > 20


def test_transient_errors_and_timeouts_are_retried(faulty: Faulty) -> None:
    for kind in ("head", "list", "get", "put", "copy", "delete"):
        faulty.plan.queue(kind, ConnectionResetError(104, "injected"), TimeoutError("injected: timed out"))
    want = workload(faulty)
    for rel, data in want.items():
        assert faulty.cat(rel) == data
    assert set(faulty.plan.injected) >= {"head", "list", "get", "put", "copy", "delete"}
    assert not journals(faulty.cache)  # every commit went through


def test_thirty_percent_of_calls_failing_loses_nothing(faulty: Faulty) -> None:
    faulty.core.remote.settings = RemoteSettings(attempts=12, backoff_base=0.001, backoff_max=0.01)
    faulty.plan.fail_rate["*"] = 0.3
    want = workload(faulty, n=10)
    faulty.plan.fail_rate.clear()
    for rel, data in want.items():
        assert faulty.cat(rel) == data
    assert sum(faulty.plan.injected.values()) >= 10
    assert not journals(faulty.cache)


def test_a_store_that_stays_down_fails_calls_with_eio_in_bounded_time(faulty: Faulty) -> None:
    faulty.put("d/old", b"old bytes")
    assert (faulty.mnt / "d/old").read_bytes() == b"old bytes"
    fd = os.open(faulty.mnt / "new", os.O_WRONLY | os.O_CREAT)
    faulty.forget()
    faulty.plan.latency["*"] = 0.05
    faulty.plan.down = True
    started = time.monotonic()
    assert errno_of(lambda: os.stat(faulty.mnt / "d/other")) == errno.EIO  # not ENOENT: unknown
    assert errno_of(lambda: os.listdir(faulty.mnt / "d")) == errno.EIO
    assert errno_of(lambda: os.open(faulty.mnt / "d/x", os.O_WRONLY | os.O_CREAT)) == errno.EIO
    os.write(fd, b"written while the store is down")
    assert errno_of(lambda: os.close(fd)) == errno.EIO  # close reports the failed commit
    elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed  # 4 calls x 3 attempts x (50 ms + <= 50 ms backoff), with margin
    wait_for(lambda: faulty.core.upload_status()["failed"])  # release tried once more, and failed
    assert faulty.cat("new") is None and len(journals(faulty.cache)) == 1  # kept, not lost
    faulty.plan.down = False
    # A failed lookup was not remembered as "missing"; the listing was not cached empty.
    assert os.listdir(faulty.mnt / "d") == ["old"]
    assert (faulty.mnt / "d/old").read_bytes() == b"old bytes"
    # What the next start (or the 30 s retry) does with the kept bytes:
    (result,) = recover(faulty.cache / "staging", faulty.core.remote)
    assert result.committed_as == "new" and faulty.cat("new") == b"written while the store is down"


def test_permanent_errors_fail_at_once_with_their_errno(faulty: Faulty) -> None:
    faulty.put("f", b"data")
    assert os.stat(faulty.mnt / "f").st_size == 4
    faulty.plan.always["get"] = lambda: PermissionError(errno.EACCES, "injected: access denied")
    before = faulty.plan.calls["get"]
    assert errno_of(lambda: (faulty.mnt / "f").read_bytes()) == errno.EACCES
    # Not retried by us (an answer, not a failure): one GET per read the kernel sends (it
    # retries a failed readahead once itself).
    assert faulty.plan.calls["get"] - before <= 2
    del faulty.plan.always["get"]
    assert (faulty.mnt / "f").read_bytes() == b"data"  # and not remembered
    faulty.plan.always["put"] = lambda: PermissionError(errno.EACCES, "injected: access denied")
    fd = os.open(faulty.mnt / "g", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"gg")
    puts = faulty.plan.calls["put"]
    assert errno_of(lambda: os.close(fd)) == errno.EACCES
    wait_for(lambda: faulty.core.upload_status()["failed"])
    assert faulty.plan.calls["put"] - puts == 1  # close; release leaves the same bytes to the retry loop
    assert faulty.cat("g") is None and len(journals(faulty.cache)) == 1


def test_timeouts_fail_the_read_within_attempts_times_the_timeout(faulty: Faulty) -> None:
    faulty.put("slow", os.urandom(60 * KiB))  # one chunk: nothing to fetch ahead
    assert os.stat(faulty.mnt / "slow").st_size == 60 * KiB
    faulty.plan.latency["get"] = 0.3  # each attempt waits out a 0.3 s "read timeout", then fails
    faulty.plan.always["get"] = lambda: TimeoutError("injected: read timed out")
    started = time.monotonic()
    fd = os.open(faulty.mnt / "slow", os.O_RDONLY | os.O_DIRECT)  # one read, no kernel retry
    try:
        assert errno_of(lambda: os.pread(fd, 4096, 0)) == errno.EIO
    finally:
        os.close(fd)
    elapsed = time.monotonic() - started
    assert 0.85 < elapsed < 2.5, elapsed  # 3 attempts x 0.3 s + backoff; no hang
    assert faulty.plan.injected["get"] == 3


def test_truncated_responses_are_retried_never_served(faulty: Faulty) -> None:
    faulty.put("one-chunk", os.urandom(60 * KiB))
    faulty.plan.truncate = 1  # a response comes back short, without an error: retried
    fd = os.open(faulty.mnt / "one-chunk", os.O_RDONLY | os.O_DIRECT)  # one read, no kernel retry
    try:
        assert os.pread(fd, 4096, 0) == faulty.cat("one-chunk")[:4096]
    finally:
        os.close(fd)
    assert faulty.plan.injected["truncated"] == 1
    data = os.urandom(200 * KiB)
    faulty.put("t", data)
    faulty.plan.truncate = 2
    assert (faulty.mnt / "t").read_bytes() == data
    faulty.plan.truncate = 1000  # every read is short: fail, never serve the short bytes
    faulty.put("u", data)
    faulty.forget()
    assert errno_of(lambda: (faulty.mnt / "u").read_bytes()) == errno.EIO
    assert faulty.plan.injected["truncated"] >= 5


def test_a_lost_upload_acknowledgement_is_retried_harmlessly(faulty: Faulty) -> None:
    faulty.plan.queue("put", ConnectionResetError(104, "injected: reply lost"), after=True)
    (faulty.mnt / "acked").write_bytes(b"exactly once")
    assert faulty.plan.injected["put-after"] == 1
    assert faulty.cat("acked") == b"exactly once" and not journals(faulty.cache)


def test_an_interrupted_directory_rename_loses_no_object(faulty: Faulty) -> None:
    want = {f"src/f{i}": os.urandom(1000 + i) for i in range(6)}
    for rel, data in want.items():
        faulty.put(rel, data)
    assert len(os.listdir(faulty.mnt / "src")) == 6
    # The third copy fails for good: documented as not atomic, objects end up in both places.
    faulty.plan.queue("copy", *[PermissionError(errno.EACCES, "injected")], after=False)
    faulty.plan.fail_next["copy"] = []
    real_before = faulty.plan.before
    copies = [0]

    def third_copy_fails(kind: str) -> None:
        if kind == "copy":
            copies[0] += 1
            if copies[0] == 3:
                raise PermissionError(errno.EACCES, "injected: copy denied")
        real_before(kind)

    faulty.plan.before = third_copy_fails  # type: ignore[method-assign]
    assert errno_of(lambda: os.rename(faulty.mnt / "src", faulty.mnt / "dst")) == errno.EACCES
    faulty.plan.before = real_before  # type: ignore[method-assign]
    for rel, data in want.items():
        moved = "dst/" + rel.split("/", 1)[1]
        assert data in (faulty.cat(rel), faulty.cat(moved)), rel  # every object somewhere, intact


def test_stale_version_under_an_open_handle_is_estale_at_once(faulty: Faulty) -> None:
    faulty.put("v", b"1" * 4 * MiB)
    fd = os.open(faulty.mnt / "v", os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == b"1" * 10
        time.sleep(0.01)
        faulty.put("v", b"2" * 4 * MiB)  # another node rewrites it
        faulty.core.remote.settings = RemoteSettings(attempts=6, backoff_base=0.01, backoff_max=0.05)
        time.sleep(0.2)  # readahead of the first read is over
        gets = faulty.plan.calls["get"]
        started = time.monotonic()
        code = errno_of(lambda: os.pread(fd, 10, 3 * MiB))  # a chunk not fetched yet
        assert code == errno.ESTALE and time.monotonic() - started < 1
        assert faulty.plan.calls["get"] - gets < 6  # an answer: not retried (a chunk or 3 ahead)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_a_changed_object_is_stale_at_once_on_object_stores(request: pytest.FixtureRequest, backend: str) -> None:
    """If-Match (S3) and generation= (GCS) answer 'changed': an answer, not a failure to retry."""
    from conftest import object_store

    url, options, _ = object_store(request, backend)
    remote = Remote(url, options, RemoteSettings(attempts=4, backoff_base=0.2, backoff_max=1))
    remote.fs.pipe_file(remote.full("o"), b"one")
    first = remote.stat("o").version
    remote.fs.pipe_file(remote.full("o"), b"two")
    assert remote.stat("o").version != first
    remote.stats.reset()
    started = time.monotonic()
    with pytest.raises(StaleVersionError):
        remote.read_range("o", 0, 3, first)
    assert remote.stats.count("get") == 1 and time.monotonic() - started < 1


@pytest.mark.mount
def test_a_handle_on_s3_moves_to_a_new_version_or_is_estale_never_eio(s3_server: Any, tmp_path: Path) -> None:
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    old, new = os.urandom(4 * MiB), os.urandom(4 * MiB)
    client.pipe_file(f"{root}/f", old)
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=s3_server.storage_options(),
                         chunk_size=MiB):
        fd = os.open(tmp_path / "mnt/f", os.O_RDONLY | os.O_DIRECT)  # no kernel readahead
        try:
            client.pipe_file(f"{root}/f", new)
            assert os.pread(fd, 4096, 0) == new[:4096]  # nothing served yet: it opens the new one
            client.pipe_file(f"{root}/f", old)
            started = time.monotonic()
            assert errno_of(lambda: os.pread(fd, 4096, 3 * MiB)) == errno.ESTALE
            assert time.monotonic() - started < 1  # at once, not after every retry
        finally:
            os.close(fd)


# -- the chunk cache and the clock ------------------------------------------------------------------
def test_a_chunk_removed_or_cut_short_under_a_running_daemon_is_refetched(faulty: Faulty) -> None:
    data = os.urandom(256 * KiB)
    faulty.put("c", data)
    read = subprocess.run(["cat", str(faulty.mnt / "c")], capture_output=True, check=True).stdout
    assert read == data
    assert faulty.core.fetcher.settle()  # chunks are written to disk by their own threads
    chunks = records(faulty.cache)
    assert len(chunks) == 4
    cut_short(chunks[1], 1000)  # chunks 1 to 3 cut short in their data file
    faulty.core.fetcher.drop_memory()  # only the disk cache is left
    drop_page_cache()
    read = subprocess.run(["cat", str(faulty.mnt / "c")], capture_output=True, check=True).stdout
    assert read == data
    assert faulty.core.fetcher.settle()
    region(records(faulty.cache)[0])[0].unlink()  # the version's whole data file removed
    faulty.core.fetcher.drop_memory()
    drop_page_cache()
    read = subprocess.run(["cat", str(faulty.mnt / "c")], capture_output=True, check=True).stdout
    assert read == data


def test_wall_clock_jumps_do_not_move_ttls_or_lose_writes(faulty: Faulty, monkeypatch: pytest.MonkeyPatch) -> None:
    """TTLs run on the monotonic clock; a wall clock that jumps a day back or forward changes
    nothing a reader sees."""
    real_time, real_ns = time.time, time.time_ns
    for jump in (-86400.0, 86400.0):
        monkeypatch.setattr(time, "time", lambda j=jump: real_time() + j)
        monkeypatch.setattr(time, "time_ns", lambda j=jump: real_ns() + int(j * 1e9))
        name = f"clock{int(jump)}"
        (faulty.mnt / name).write_bytes(b"before")
        assert (faulty.mnt / name).read_bytes() == b"before"
        faulty.put(name, b"after!!")  # another node, after our TTL (0.2 s) + the kernel's
        time.sleep(0.5)
        assert (faulty.mnt / name).read_bytes() == b"after!!"
    monkeypatch.undo()


@pytest.mark.mount
def test_a_new_version_with_the_old_size_and_mtime_is_never_served_stale(tmp_path: Path) -> None:
    """A clock that jumped back, `cp -p` or `rsync -a` can give a rewritten file its old mtime;
    local versions must still differ, or cached chunks of the old bytes would be served."""
    remote = tmp_path / "remote"
    remote.mkdir()
    old, new = os.urandom(300 * KiB), os.urandom(300 * KiB)
    (remote / "f").write_bytes(old)
    first = os.stat(remote / "f")
    with inprocess_mount(str(remote), tmp_path / "mnt", tmp_path / "cache", chunk_size=64 * KiB,
                         cache_size=64 * MiB, metadata_ttl=0.2):
        assert subprocess.run(["cat", str(tmp_path / "mnt/f")], capture_output=True).stdout == old
        (tmp_path / "new").write_bytes(new)
        os.utime(tmp_path / "new", ns=(first.st_atime_ns, first.st_mtime_ns))
        os.replace(tmp_path / "new", remote / "f")  # what rsync -a does
        time.sleep(1.5)  # our TTL and the kernel's
        drop_page_cache()
        assert subprocess.run(["cat", str(tmp_path / "mnt/f")], capture_output=True).stdout == new
        with open(remote / "f", "r+b") as f:  # rewritten in place, mtime set back again
            f.write(old[:1000])
        os.utime(remote / "f", ns=(first.st_atime_ns, first.st_mtime_ns))
        time.sleep(1.5)
        drop_page_cache()
        assert subprocess.run(["cat", str(tmp_path / "mnt/f")], capture_output=True).stdout == old[:1000] + new[1000:]


@pytest.mark.core
def test_conflict_copies_never_overwrite_each_other(tmp_path: Path) -> None:
    """Two kept commits of one key that both clash are committed in the same second (a clock
    jump back makes that likelier): each must keep its own bytes."""
    from marinfs.write.staging import StagedFile

    remote = Remote(f"memory://conflicts-{uuid.uuid4().hex[:8]}")
    remote.fs.mkdir(remote.root)
    remote.fs.pipe_file(remote.full("k"), b"base")
    base = remote.stat("k").version
    for data in (b"first kept commit", b"second kept commit"):
        StagedFile(tmp_path / "staging", "k", seed=None, remote_url=remote.url, base_version=base).write(data, 0)
    time.sleep(0.01)
    remote.fs.pipe_file(remote.full("k"), b"someone else's")
    results = recover(tmp_path / "staging", remote)
    assert all(r.conflict for r in results) and len({r.committed_as for r in results}) == 2
    kept = {bytes(remote.fs.cat_file(remote.full(r.committed_as))) for r in results}
    assert kept == {b"first kept commit", b"second kept commit"}
    assert remote.fs.cat_file(remote.full("k")) == b"someone else's"


# -- process level: real servers ------------------------------------------------------------------
@dataclass
class ProxiedS3:
    proxy: HttpFaultProxy
    url: str
    client: Any  # straight to the server, past the proxy
    root: str
    env: dict[str, str]  # the daemon's environment: endpoint = the proxy

    def cat(self, rel: str) -> bytes | None:
        try:
            return bytes(self.client.cat_file(f"{self.root}/{rel}"))
        except FileNotFoundError:
            return None


@pytest.fixture
def proxied_s3(s3_server: Any) -> Iterator[ProxiedS3]:
    host, port = s3_server.endpoint.rsplit("/", 1)[1].split(":")
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    client.pipe_file(f"{root}/.keep", b"")
    with HttpFaultProxy(host, int(port), seed=30) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        yield ProxiedS3(proxy, url, client, root, env)


def mount_args(retries: int) -> list[str]:
    return ["--chunk-size", "1M", "--retries", str(retries), "--connect-timeout", "2", "--read-timeout", "5"]


@pytest.mark.mount
def test_thirty_percent_of_requests_answered_503_lose_nothing(proxied_s3: ProxiedS3, tmp_path: Path) -> None:
    p = proxied_s3
    p.proxy.fail_fraction = 0.3
    mnt = tmp_path / "mnt"
    want: dict[str, bytes] = {}
    with subprocess_mount(p.url, mnt, tmp_path / "cache", *mount_args(10), env=p.env):
        os.makedirs(mnt / "d/sub")
        for i in range(6):
            want[f"d/sub/f{i}"] = os.urandom(i * 37 * KiB + 5)
            (mnt / f"d/sub/f{i}").write_bytes(want[f"d/sub/f{i}"])
        want["d/big"] = os.urandom(2 * MiB + 1)
        (mnt / "d/big").write_bytes(want["d/big"])
        os.rename(mnt / "d/sub/f3", mnt / "d/f3")
        want["d/f3"] = want.pop("d/sub/f3")
        os.rename(mnt / "d/sub", mnt / "d/moved")
        want = {k.replace("d/sub/", "d/moved/"): v for k, v in want.items()}
        os.unlink(mnt / "d/moved/f0")
        del want["d/moved/f0"]
        assert sorted(os.listdir(mnt / "d/moved")) == sorted(k.split("/")[-1] for k in want if "moved/" in k)
        for rel, data in want.items():
            assert (mnt / rel).read_bytes() == data
    for rel, data in want.items():
        assert p.cat(rel) == data, rel
    assert p.cat("d/sub/f1") is None and p.cat("d/moved/f0") is None
    assert p.proxy.counts["503"] >= 10, p.proxy.counts


@pytest.mark.mount
def test_server_stops_mid_read_eio_in_bounded_time_then_recovers(proxied_s3: ProxiedS3, tmp_path: Path) -> None:
    p = proxied_s3
    data, other = os.urandom(4 * MiB), os.urandom(2 * MiB)
    p.client.pipe_file(f"{p.root}/shard", data)
    p.client.pipe_file(f"{p.root}/other", other)
    mnt = tmp_path / "mnt"
    with subprocess_mount(p.url, mnt, tmp_path / "cache", *mount_args(3), env=p.env):
        assert os.stat(mnt / "shard").st_size == len(data) and os.stat(mnt / "other").st_size == len(other)
        p.proxy.stop_when = lambda req: req.method == "GET" and "range" in req.headers
        p.proxy.cut_after = 300 * KiB
        started = time.monotonic()
        assert errno_of(lambda: (mnt / "shard").read_bytes()) == errno.EIO
        assert time.monotonic() - started < 10
        p.proxy.restart()
        assert (mnt / "shard").read_bytes() == data
        # A server that comes back within the retries: the read just takes longer.
        p.proxy.stop_when = lambda req: req.method == "GET" and "range" in req.headers
        p.proxy.outage = 0.05  # shorter than the backoff before a retry, almost surely
        assert (mnt / "other").read_bytes() == other  # not cached yet: it meets the stop
        assert p.proxy.counts[f"server stopped after {300 * KiB} response bytes"] == 2


@pytest.mark.mount
def test_server_stops_mid_upload_close_fails_and_the_bytes_survive(proxied_s3: ProxiedS3, tmp_path: Path) -> None:
    p = proxied_s3
    p.client.pipe_file(f"{p.root}/ckpt.bin", b"old version")
    new = os.urandom(3 * MiB)
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with subprocess_mount(p.url, mnt, cache, *mount_args(3), env=p.env):
        assert (mnt / "ckpt.bin").read_bytes() == b"old version"
        p.proxy.stop_when = lambda req: req.method == "PUT" and len(req.body) > MiB
        p.proxy.stop_at = "request"
        fd = os.open(mnt / "ckpt.bin", os.O_WRONLY | os.O_TRUNC)
        assert os.write(fd, new) == len(new)
        started = time.monotonic()
        assert errno_of(lambda: os.close(fd)) == errno.EIO
        assert time.monotonic() - started < 15
        assert p.cat("ckpt.bin") == b"old version"  # never a torn object
        assert len(journals(cache)) == 1

        def failed() -> list[str]:  # the release retries once more; counters are published every 2 s
            status = subprocess.run([*MARINFS, "status", str(mnt), "--json"], capture_output=True, text=True)
            return [f["key"] for f in json.loads(status.stdout)[0].get("uploads", {}).get("failed", [])]

        wait_for(lambda: failed() == ["ckpt.bin"], within=15)
        p.proxy.restart()
    with subprocess_mount(p.url, mnt, cache, *mount_args(3), env=p.env):  # the next start commits it
        assert p.cat("ckpt.bin") == new
        assert (mnt / "ckpt.bin").read_bytes() == new
    assert not journals(cache)


@pytest.mark.mount
def test_server_stops_mid_listing_ls_fails_whole_then_lists_everything(proxied_s3: ProxiedS3, tmp_path: Path) -> None:
    p = proxied_s3
    p.client.pipe({f"{p.root}/many/k{i:05d}": b"x" for i in range(1001)}, batch_size=64)  # two pages
    mnt = tmp_path / "mnt"
    with subprocess_mount(p.url, mnt, tmp_path / "cache", *mount_args(3), env=p.env):
        p.proxy.stop_when = lambda req: req.method == "GET" and "continuation-token" in req.target
        p.proxy.cut_after = 300  # inside the second page (one key: a short response)
        started = time.monotonic()
        assert errno_of(lambda: os.listdir(mnt / "many")) == errno.EIO  # never a partial listing
        assert time.monotonic() - started < 10
        p.proxy.restart()
        assert len(os.listdir(mnt / "many")) == 1001


WRITER = r"""
import hashlib, os, sys
mnt, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    data = hashlib.sha256(str(i).encode()).digest() * (size // 32)
    fd = os.open(f"{mnt}/f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    acked = 0
    for off in range(0, len(data), 16384):
        acked += os.write(fd, data[off:off + 16384])
        print(f"wrote f{i} {acked}", flush=True)
    os.close(fd)
    print(f"closed f{i}", flush=True)
"""


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_sigkill_of_the_daemon_during_writes_loses_no_acknowledged_byte(
        request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    from conftest import object_store

    if backend == "local":
        (tmp_path / "remote").mkdir()
        url, env = str(tmp_path / "remote"), {}
        client, root = fsspec_client(url)
    else:
        url, options, env = object_store(request, "s3")
        client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    size = 256 * KiB
    closed: list[str] = []
    acked: dict[str, int] = {}
    with subprocess_mount(url, mnt, cache, env=env) as pid:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt), "40", str(size)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert writer.stdout is not None
            for line in writer.stdout:
                word, name, *rest = line.split()
                if word == "closed":
                    closed.append(name)
                else:
                    acked[name] = int(rest[0])
                if len(closed) == 5 and acked.get("f5", 0) >= 4 * 16384:
                    os.kill(pid, signal.SIGKILL)  # mid-file: f5 is open with 4+ writes done
                    break
        finally:
            writer.kill()
            writer.wait(timeout=30)
    assert len(closed) == 5
    with subprocess_mount(url, mnt, cache, env=env):  # a new daemon over the same cache dir
        for i in range(5):
            want = hashlib.sha256(str(i).encode()).digest() * (size // 32)
            assert (mnt / f"f{i}").read_bytes() == want  # closed: committed, intact
        got = bytes(client.cat_file(f"{root}/f5"))  # open at the kill: recovered as it stood
        want = hashlib.sha256(b"5").digest() * (size // 32)
        assert len(got) >= acked["f5"] and got == want[:len(got)]
    assert not journals(cache)
