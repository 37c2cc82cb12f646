"""Nothing lost, on every backend: one test per fault, each ending with the bytes on the server
(read past the mount and past the proxy) compared to the bytes written, and a bound on how long
the user waited. docs/reliability.md tables the cells.

Where each cell runs, and why not elsewhere:

- server down (at close; at close then SIGKILL; mid multipart/resumable upload; a 503 storm):
  S3 and GCS. A local remote has no server to stop.
- daemon SIGKILLed mid-upload: S3 (killed while the last part of a multipart upload is in
  flight) and GCS (while a resumable chunk is). A local commit is a copy and a rename with no
  request a test could catch in flight; test_faults.py kills a local daemon during writes.
- staging disk full: local and S3 (a 1 MiB tmpfs cache directory, so root only).
- another client overwrites between open and close: local and S3. fake-gcs-server ignores
  ``ifGenerationMatch`` (DESIGN §7); test_writepath.py checks what marinfs asks of GCS.
- write-back (``--write-back``: close returns once the bytes are staged): the store down during
  background uploads and the daemon SIGKILLed with 1,000 files pending, on S3 (the default mode
  runs those cells on S3 and GCS; here the queue, the next start, the status and ``marinfs
  sync`` are what is new, none of it backend-specific); a writer on another
  node meanwhile and a full cache disk, on local and S3, as their default-mode cells.

Servers sit behind ``faults.HttpFaultProxy``; only the daemon talks to the proxy.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tiers
from conftest import object_store
from faults import HttpFaultProxy, HttpRequest
from mounting import MARINFS, force_unmount, fsspec_client, staging_entries, subprocess_mount
from servers import start_seaweedfs
from test_faults import errno_of, journals, wait_for
from marinfs.write.staging import JOURNAL_SUFFIX

MiB = 1 << 20
CONNECT, READ, RETRIES, INTERVAL = 1.0, 3.0, 3, 2.0
MOUNT_ARGS = ["--connect-timeout", str(CONNECT), "--read-timeout", str(READ), "--retries", str(RETRIES),
              "--commit-retry-interval", str(INTERVAL), "--drain-timeout", "10"]
# How long one failing remote call may take: every attempt times out, with the backoff between
# (RemoteSettings: at most 0.25 * 2**attempt s each), plus a margin for a loaded machine.
CALL_BOUND = RETRIES * (CONNECT + READ) + sum(0.25 * 2 ** a for a in range(1, RETRIES)) + 5
# After the fault ends, the retry pass commits within one interval (the daemon looks every
# min(2 s, interval)) plus the upload itself.
COMMIT_BOUND = INTERVAL + 2 + 5


@dataclass
class Store:
    """A fresh prefix: the daemon reaches it through ``proxy`` (None for local); ``client`` goes
    straight to the server."""

    backend: str
    url: str
    env: dict[str, str]
    client: Any
    root: str
    proxy: HttpFaultProxy | None

    def cat(self, rel: str) -> bytes | None:
        try:
            return bytes(self.client.cat_file(f"{self.root}/{rel}"))
        except FileNotFoundError:
            return None

    def put(self, rel: str, data: bytes) -> None:
        if self.backend == "local":
            self.client.makedirs(f"{self.root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        self.client.pipe_file(f"{self.root}/{rel}", data)

    def incomplete_uploads(self) -> list[str]:
        """Keys of the S3 multipart uploads under our prefix that were neither completed nor
        aborted (billed on real S3 until someone aborts them). GCS's resumable sessions expire
        by themselves and cannot be listed: none."""
        if self.backend != "s3":
            return []
        bucket, _, prefix = self.root.partition("/")
        out = self.client.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
        return [u["Key"] for u in out.get("Uploads", [])]


@pytest.fixture
@tiers.needs("mount")
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    backend = request.param
    if backend == "local":
        (tmp_path / "remote").mkdir()
        url = str(tmp_path / "remote")
        client, root = fsspec_client(url)
        yield Store(backend, url, {}, client, root, None)
        return
    url, options, env = object_store(request, backend)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    client.pipe_file(f"{root}/.keep", b"")
    server = env.get("AWS_ENDPOINT_URL") or env["STORAGE_EMULATOR_HOST"]
    host, port = server.rsplit("/", 1)[1].split(":")
    with HttpFaultProxy(host, int(port), seed=17) as proxy:
        var = "AWS_ENDPOINT_URL" if backend == "s3" else "STORAGE_EMULATOR_HOST"
        store = Store(backend, url, {**env, var: proxy.endpoint}, client, root, proxy)
        yield store
    # Whatever the cell did (issue 37): no incomplete multipart upload of ours is left, billed.
    assert store.incomplete_uploads() == []


def cells(*backends: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("store", backends, indirect=True)


def failed_uploads(mnt: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """What `marinfs status --json` lists as failed commits (published every 2 s)."""
    out = subprocess.run([*MARINFS, "status", str(mnt), "--json"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=30, check=True)
    return json.loads(out.stdout)[0].get("uploads", {}).get("failed", [])


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def close_errno(fd: int) -> tuple[int, float]:
    return timed(lambda: errno_of(lambda: os.close(fd)))


def write_file(path: Path, data: bytes) -> int:
    """Open, write everything, return the descriptor (still open: its close commits)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for off in range(0, len(data), 4 * MiB):
        os.write(fd, data[off:off + 4 * MiB])
    return fd


def wait_committed(s: Store, rel: str, data: bytes, within: float) -> float:
    """Wait until the server holds exactly ``data`` at ``rel``; answers how long it took."""
    started = time.monotonic()
    wait_for(lambda: s.cat(rel) == data, within=within)
    return time.monotonic() - started


def sigkill(pid: int, mnt: Path) -> None:
    """Kill the daemon we started (by PID) and detach its dead mount."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.02)
    force_unmount(mnt)


# -- the cells ---------------------------------------------------------------------------------
@cells("s3", "gcs")
def test_server_down_at_close_is_eio_then_committed_within_one_retry_interval(store: Store, tmp_path: Path) -> None:
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    data = os.urandom(3 * MiB + 5)
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        fd = write_file(mnt / "ckpt.bin", data)
        s.proxy.stop_server()
        code, waited = close_errno(fd)
        assert code == errno.EIO and waited < CALL_BOUND, (code, waited)
        wait_for(lambda: [f["key"] for f in failed_uploads(mnt, s.env)] == ["ckpt.bin"], within=CALL_BOUND + 5)
        (failed,) = failed_uploads(mnt, s.env)
        assert failed["attempts"] >= 1 and failed["error"] and not failed["permanent"]
        assert Path(failed["staged"]).read_bytes() == data and len(journals(cache)) == 1
        assert s.cat("ckpt.bin") is None
        s.proxy.restart()
        assert wait_committed(s, "ckpt.bin", data, within=COMMIT_BOUND) < COMMIT_BOUND
        wait_for(lambda: failed_uploads(mnt, s.env) == [] and not journals(cache), within=5)
        assert (mnt / "ckpt.bin").read_bytes() == data


@cells("s3", "gcs")
def test_server_down_at_close_then_sigkill_a_new_daemon_commits_the_bytes(store: Store, tmp_path: Path) -> None:
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    data = os.urandom(2 * MiB + 3)
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env) as pid:
        fd = write_file(mnt / "ckpt.bin", data)
        s.proxy.stop_server()
        code, waited = close_errno(fd)
        assert code == errno.EIO and waited < CALL_BOUND, (code, waited)
        sigkill(pid, mnt)
    assert len(journals(cache)) == 1 and s.cat("ckpt.bin") is None
    s.proxy.restart()
    started = time.monotonic()
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):  # same cache dir
        assert wait_committed(s, "ckpt.bin", data, within=COMMIT_BOUND) < COMMIT_BOUND
        assert time.monotonic() - started < COMMIT_BOUND + 10  # the mount itself included
        assert (mnt / "ckpt.bin").read_bytes() == data
        assert failed_uploads(mnt, s.env) == []
    assert not journals(cache)


@pytest.mark.objectstore
@pytest.mark.mount
def test_the_reported_crash_a_real_seaweedfs_restart_then_a_new_daemon_commits(tmp_path: Path) -> None:
    """Issue 17 as an operator met it, with no proxy: SeaweedFS (checking signatures) is
    stopped while a file is written, close() is EIO, the daemon is SIGKILLed, the server is
    started again on its data directory, and a new daemon on the same cache commits the bytes
    within one retry interval. Our own presigned PUTs were refused with 403 here."""
    server = start_seaweedfs(tmp_path / "seaweedfs")
    try:
        url = f"s3://{server.bucket}/t-{uuid.uuid4().hex[:12]}"
        client, root = fsspec_client(url, {**server.storage_options(), "use_listings_cache": False})
        client.pipe_file(f"{root}/.keep", b"")
        mnt, cache, data = tmp_path / "mnt", tmp_path / "cache", os.urandom(MiB)
        with subprocess_mount(url, mnt, cache, *MOUNT_ARGS, env=server.env()) as pid:
            (mnt / "w").mkdir()
            fd = write_file(mnt / "w" / "keep.bin", data)
            server.stop()
            code, waited = close_errno(fd)
            assert code == errno.EIO and waited < CALL_BOUND, (code, waited)
            sigkill(pid, mnt)
        assert len(journals(cache)) == 1
        server.restart()
        with subprocess_mount(url, mnt, cache, *MOUNT_ARGS, env=server.env()):
            # The bytes may be on the server already (its answer to the first daemon's PUT was
            # lost when it stopped): the commit is done once the journal is gone too.
            wait_for(lambda: client.exists(f"{root}/w/keep.bin") and client.cat_file(f"{root}/w/keep.bin") == data
                     and not journals(cache), within=COMMIT_BOUND)
            assert (mnt / "w" / "keep.bin").read_bytes() == data
        assert not journals(cache)
    finally:
        server.stop()


@cells("s3", "gcs")
def test_server_killed_mid_multipart_upload_of_64_mib_then_back(store: Store, tmp_path: Path) -> None:
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    s.put("weights.bin", b"the old version")
    data = os.urandom(64 * MiB + 11)
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        assert (mnt / "weights.bin").read_bytes() == b"the old version"
        if s.backend == "s3":
            s.proxy.stop_when = lambda req: req.method == "PUT" and "partNumber=3" in req.target
        else:  # the third 16 MiB chunk of the resumable upload
            s.proxy.stop_when = lambda req: req.headers.get("content-range", "").startswith(f"bytes {32 * MiB}-")
        s.proxy.stop_at = "request"  # the server dies while part 3 arrives
        started = time.monotonic()
        fd = write_file(mnt / "weights.bin", data)  # parts leave while the file is written
        code, _ = close_errno(fd)
        waited = time.monotonic() - started
        assert s.proxy.counts["server stopped (request dropped)"] == 1, s.proxy.requests
        assert code == errno.EIO and waited < 2 * CALL_BOUND, (code, waited)
        assert s.cat("weights.bin") == b"the old version"  # never a torn object
        s.proxy.restart()
        assert wait_committed(s, "weights.bin", data, within=COMMIT_BOUND + 10) < COMMIT_BOUND + 10
        wait_for(lambda: not journals(cache), within=5)
        # No upload of ours is left: the one the server died in is aborted then or, if it could
        # not be, by the retry pass before it uploads again (its journal names it).
        wait_for(lambda: s.incomplete_uploads() == [], within=5)


@cells("s3", "gcs")
def test_a_503_storm_during_a_commit_loses_nothing(store: Store, tmp_path: Path) -> None:
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    storm = 8.0
    data = {f"shard-{i}": os.urandom(MiB * (i + 1) + i) for i in range(3)}
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        fds = {name: write_file(mnt / name, d) for name, d in data.items()}
        s.proxy.fail_fraction = 1.0  # every request answered 503 SlowDown
        ends = time.monotonic() + storm
        for name, fd in fds.items():
            code, waited = close_errno(fd)  # retries run out inside the storm
            assert code == errno.EIO and waited < CALL_BOUND, (name, code, waited)
        wait_for(lambda: len(failed_uploads(mnt, s.env)) == 3, within=CALL_BOUND + 5)
        assert time.monotonic() < ends, "the storm ended before every commit had failed"
        time.sleep(max(0.0, ends - time.monotonic()))
        s.proxy.fail_fraction = 0.0
        started = time.monotonic()
        for name, d in data.items():
            wait_committed(s, name, d, within=COMMIT_BOUND)
        assert time.monotonic() - started < COMMIT_BOUND
        assert s.proxy.counts["503"] >= 3 * RETRIES
        wait_for(lambda: failed_uploads(mnt, s.env) == [] and not journals(cache), within=5)


def _kill_on(pid_box: list[int], match: Callable[[HttpRequest], bool]) -> Callable[[HttpRequest], bool]:
    """A proxy trigger that SIGKILLs the daemon when the request it waits for arrives; the
    proxy then drops that request, as a connection of a dead process is dropped mid-send."""
    def trigger(req: HttpRequest) -> bool:
        if pid_box and match(req):
            os.kill(pid_box.pop(), signal.SIGKILL)
            return True
        return False

    return trigger


@cells("s3", "gcs")
def test_daemon_sigkilled_mid_upload_then_restarted_commits_everything(store: Store, tmp_path: Path) -> None:
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    data = os.urandom(32 * MiB + 7)  # two full parts leave while it is written, the tail at close
    if s.backend == "s3":
        in_flight = lambda req: req.method == "PUT" and "partNumber=3" in req.target  # noqa: E731
    else:  # a resumable chunk that ends the upload (its Content-Range names the total)
        in_flight = lambda req: f"/{len(data)}" in req.headers.get("content-range", "")  # noqa: E731
    victim: list[int] = []
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env) as pid:
        fd = write_file(mnt / "weights.bin", data)  # every byte acknowledged
        victim.append(pid)
        s.proxy.stop_when = _kill_on(victim, in_flight)
        s.proxy.stop_at, s.proxy.outage = "request", 0.0  # the server itself stays up
        code, waited = close_errno(fd)
        assert not victim, f"the daemon was not killed mid-upload: {s.proxy.requests[-5:]}"
        assert code in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO) and waited < CALL_BOUND, (code, waited)
        sigkill(pid, mnt)
    assert s.proxy.counts["server stopped (request dropped)"] == 1
    assert len(journals(cache)) == 1 and s.cat("weights.bin") is None
    if s.backend == "s3":  # the killed daemon's multipart upload, its journal names it
        assert len(s.incomplete_uploads()) == 1
        assert len(json.loads(journals(cache)[0].read_text()).get("uploads", {})) == 1
    started = time.monotonic()
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        assert wait_committed(s, "weights.bin", data, within=COMMIT_BOUND + 10) < COMMIT_BOUND + 10
        assert time.monotonic() - started < COMMIT_BOUND + 20, time.monotonic() - started
    assert not journals(cache)
    assert s.incomplete_uploads() == []  # issue 37: the new daemon aborted it (it was left, billed)


# A writer whose close() commits a sparse file (``truncate -s``: the holes are bytes to send):
# it reports close()'s errno on stdout. SIGINT has a handler, so close() itself answers.
SPARSE_WRITER = r"""
import errno, os, signal, sys
signal.signal(signal.SIGINT, lambda *_: None)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.pwrite(fd, b"head", 0)
os.ftruncate(fd, int(sys.argv[2]))
print("closing", flush=True)
try:
    os.close(fd)
    print(0, flush=True)
except OSError as exc:
    print(exc.errno, flush=True)
"""


def committing(mnt: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """What `marinfs status --json` lists as commits in progress (published every 2 s)."""
    out = subprocess.run([*MARINFS, "status", str(mnt), "--json"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=30, check=True)
    return json.loads(out.stdout)[0].get("uploads", {}).get("committing", [])


@cells("s3")
def test_a_close_uploading_for_long_is_interrupted_by_a_signal_and_keeps_the_bytes(store: Store,
                                                                                   tmp_path: Path) -> None:
    """Issue 37: close() of a sparse file sat in state D while every hole was uploaded, beyond
    `timeout` and SIGKILL of the writer. A slow store (each part waits 2 s at the proxy): while
    the parts go, `status` shows the commit with its bytes sent; SIGINT to the writer makes
    close() EINTR within seconds, no part is sent after it (those in flight finish, then the
    multipart upload is aborted); the bytes and journal stay, and a remount commits them."""
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    size = 256 * MiB  # 16 parts of 16 MiB, 4 in flight: 8 s and more at 2 s a part
    is_part = lambda req: req.method == "PUT" and "partNumber=" in req.target  # noqa: E731
    s.proxy.delay, s.proxy.delay_match = 2.0, is_part
    # No retry pass while the test watches: the next daemon commits the bytes.
    args = [a if a != str(INTERVAL) else "600" for a in MOUNT_ARGS]
    with subprocess_mount(s.url, mnt, cache, *args, env=s.env):
        writer = subprocess.Popen([sys.executable, "-c", SPARSE_WRITER, str(mnt / "sparse.bin"), str(size)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "closing"
            shown: list[dict[str, Any]] = []

            def progress_shown() -> bool:
                shown[:] = [c for c in committing(mnt, s.env) if c["key"] == "sparse.bin" and c["bytes_sent"] > 0]
                return bool(shown)

            wait_for(progress_shown, within=15)
            assert shown[0]["size"] == size and 0 < shown[0]["bytes_sent"] < size, shown
            status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True,
                                    env={**os.environ, **s.env}, timeout=30, check=True).stdout
            assert "committing sparse.bin: " in status and " of 256.0 MiB sent" in status, status
            assert writer.poll() is None, "close() returned before the upload was done"
            interrupted = time.monotonic()
            writer.send_signal(signal.SIGINT)
            out, _ = writer.communicate(timeout=30)
            waited = time.monotonic() - interrupted
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        assert out.strip() == str(errno.EINTR) and waited < 3.0, (out, waited)
        time.sleep(2.0 + 2.0 + 2.0)  # the parts in flight finish (2 s at the proxy), then the abort
        after = [(method, target) for at, method, target in s.proxy.arrivals if at > interrupted + 0.5]
        assert not [t for m, t in after if m == "PUT" and "partNumber=" in t], after
        assert [t for m, t in after if m == "DELETE" and "uploadId=" in t], after  # the abort
        sent = sum(1 for _, m, t in s.proxy.arrivals if m == "PUT" and "partNumber=" in t)
        assert sent < size // (16 * MiB), sent
        assert s.incomplete_uploads() == [] and s.cat("sparse.bin") is None
        assert len(journals(cache)) == 1 and not committing(mnt, s.env)
    print(f"interrupted close: {waited:.2f} s to EINTR, {sent} of 16 parts sent, after it: {after}")
    (journal,) = journals(cache)
    assert Path(str(journal).removesuffix(JOURNAL_SUFFIX)).stat().st_size == size
    s.proxy.delay = 0.0
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        wait_committed(s, "sparse.bin", b"head" + bytes(size - 4), within=COMMIT_BOUND + 30)
    assert not journals(cache)


@cells("s3")
@pytest.mark.parametrize("phase", ["copy", "delete"])
def test_a_directory_rename_killed_midway_is_finished_by_the_next_start(store: Store, tmp_path: Path,
                                                                        phase: str) -> None:
    """Issue 37: `mv src dst` of 350 files with the daemon SIGKILLed 0.5 s in left every file
    under src/, 43 also under dst/, with no word anywhere. Now the rename's intent is journaled
    before the first copy: killed during the copies (or during the deletes that follow), the
    next daemon on the same cache directory finishes it: one tree, the renamed one, every byte,
    no journal left."""
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    files = {f"src/{d}/f{i:03d}.txt": f"{d}-{i}-".encode() * (i % 7 + 1) for d in ("a", "b") for i in range(150)}
    for rel, data in files.items():
        s.put(rel, data)
    seen = {"n": 0}

    def nth(req: HttpRequest) -> bool:
        if phase == "copy":
            hit = req.method == "PUT" and "x-amz-copy-source" in req.headers
        else:
            hit = (req.method == "DELETE" and "/src/" in req.target) or (req.method == "POST" and "delete" in req.target)
        seen["n"] += hit
        return hit and seen["n"] == 120

    victim: list[int] = []
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env) as pid:
        assert len(os.listdir(mnt / "src" / "a")) == 150
        victim.append(pid)
        s.proxy.stop_when = _kill_on(victim, nth)
        s.proxy.stop_at, s.proxy.outage = "request", 0.0
        code = errno_of(lambda: os.rename(mnt / "src", mnt / "dst"))
        assert not victim, f"the daemon was not killed midway: {s.proxy.requests[-3:]}"
        assert code in (errno.ENOTCONN, errno.ECONNABORTED, errno.EIO), code
        sigkill(pid, mnt)
    renames = sorted((cache / "staging").glob("rename-*.json"))
    assert len(renames) == 1, renames
    under = lambda top: {p.split(f"{s.root}/", 1)[1] for p in s.client.find(f"{s.root}/{top}")}  # noqa: E731
    assert under("src") and under("dst"), "not killed midway: one tree already"
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        assert not list((cache / "staging").glob("rename-*.json"))
        assert not (mnt / "src").exists()
        assert sorted(os.listdir(mnt / "dst" / "b")) == sorted(k.rsplit("/", 1)[1] for k in files if "/b/" in k)
    assert not under("src")
    assert {k for k in under("dst") if not k.endswith("/")} == {"dst" + k[3:] for k in files}
    for rel, data in files.items():
        assert s.cat("dst" + rel[3:]) == data, rel


@cells("s3")
def test_a_commit_refused_for_good_is_kept_reported_once_never_retried_in_a_loop(store: Store,
                                                                                 tmp_path: Path) -> None:
    """Issue 37: a commit that no retry can change was retried every interval and after every
    remount, and `marinfs umount` exited 0 in silence. Access denied (every PUT of the key
    answered 403 AccessDenied): close() is EACCES; one ERROR line; no request more while
    mounted; `status` marks it final; `umount` fails with one line naming it; the next daemon
    tries it once (the credentials may have been fixed), and commits it once they are."""
    s, mnt, cache, log = store, tmp_path / "mnt", tmp_path / "cache", tmp_path / "daemon.log"
    assert s.proxy is not None
    s.proxy.fail_match = lambda req: "denied.bin" in req.target and req.method in ("PUT", "POST")
    s.proxy.fail_status, s.proxy.fail_fraction = 403, 1.0
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, "--log-file", str(log), env=s.env):
        fd = write_file(mnt / "denied.bin", b"refused bytes")
        code, waited = close_errno(fd)
        assert code == errno.EACCES and waited < CALL_BOUND, (code, waited)
        refused = s.proxy.counts["403"]
        time.sleep(3 * INTERVAL + 2.5)  # three retry passes would have run
        assert s.proxy.counts["403"] == refused, s.proxy.requests[-5:]
        (failed,) = failed_uploads(mnt, s.env)
        assert failed["key"] == "denied.bin" and failed["final"] and failed["retry"] == "at the next start"
        (mnt / "fine.txt").write_bytes(b"fine")  # the rest of the mount works
        result = subprocess.run([*MARINFS, "umount", str(mnt)], capture_output=True, text=True, timeout=120,
                                env={**os.environ, **s.env})
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert "unmounted" in lines[0] and "denied.bin (retried at the next start" in lines[0], lines[0]
        assert str(cache / "staging") in lines[0] and not os.path.ismount(mnt)
    assert s.cat("fine.txt") == b"fine" and s.cat("denied.bin") is None
    reported = [line for line in log.read_text().splitlines() if "no retry can change this" in line]
    assert len(reported) == 1 and "denied.bin" in reported[0], reported
    refused = s.proxy.counts["403"]
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):  # still refused: tried once, at start
        time.sleep(2 * INTERVAL + 2.5)
        tried = s.proxy.counts["403"] - refused
        assert 1 <= tried <= 3, s.proxy.requests[-5:]  # one commit (the direct PUT re-signed once, then s3fs's)
        assert [f["key"] for f in failed_uploads(mnt, s.env)] == ["denied.bin"]
    assert s.proxy.counts["403"] - refused == tried
    s.proxy.fail_fraction = 0.0  # the credentials fixed
    with subprocess_mount(s.url, mnt, cache, *MOUNT_ARGS, env=s.env):
        wait_committed(s, "denied.bin", b"refused bytes", within=COMMIT_BOUND)
    assert not journals(cache)


@cells("local", "s3")
def test_a_full_staging_disk_is_enospc_to_the_writer_and_commits_nothing(store: Store, tiny_tmpfs: Path,
                                                                          tmp_path: Path) -> None:
    s, mnt = store, tmp_path / "mnt"
    s.put("model.bin", b"the old version")
    with subprocess_mount(s.url, mnt, tiny_tmpfs, *MOUNT_ARGS, "--cache-size", "0", env=s.env):
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            with open(mnt / "model.bin", "wb") as f:
                for _ in range(8):
                    f.write(os.urandom(MiB))  # 8 MiB into a 1 MiB staging disk
        assert info.value.errno == errno.ENOSPC and time.monotonic() - started < CALL_BOUND
        with pytest.raises(OSError) as info:
            with open(mnt / "new.bin", "wb") as f:
                f.write(os.urandom(2 * MiB))
        assert info.value.errno == errno.ENOSPC
        time.sleep(0.5)
        assert s.cat("model.bin") == b"the old version" and s.cat("new.bin") is None  # nothing half-done
        assert not staging_entries(tiny_tmpfs / "staging")  # and no partial bytes linger
        (mnt / "small.txt").write_bytes(b"fits")  # there is room again
        assert s.cat("small.txt") == b"fits"


@cells("local", "s3")
def test_another_client_overwrites_between_open_and_close_conflict_copy_and_estale(store: Store,
                                                                                  tmp_path: Path) -> None:
    s, mnt = store, tmp_path / "mnt"
    s.put("status.json", b'{"v": 1}')
    with subprocess_mount(s.url, mnt, tmp_path / "cache", *MOUNT_ARGS, env=s.env):
        fd = os.open(mnt / "status.json", os.O_WRONLY | os.O_TRUNC)
        os.write(fd, b'{"v": "ours"}')
        time.sleep(0.01)  # a local version is mtime-based: the other write must differ in time
        s.put("status.json", b'{"v": "theirs, written meanwhile"}')
        code, waited = close_errno(fd)
        assert code == errno.ESTALE and waited < CALL_BOUND, (code, waited)
        names = os.listdir(mnt)
        assert (mnt / "status.json").read_bytes() == b'{"v": "theirs, written meanwhile"}'
    assert s.cat("status.json") == b'{"v": "theirs, written meanwhile"}'  # never overwritten
    (conflict,) = [n for n in names if n.startswith("status.json.marinfs-conflict-")]
    assert s.cat(conflict) == b'{"v": "ours"}'


@cells("s3")
def test_what_works_while_the_server_is_down(store: Store, tmp_path: Path) -> None:
    """docs/semantics.md: within the metadata TTL what is cached is served; past it, every
    lookup asks the remote and fails with EIO, cached chunks or not (their version is unknown)."""
    s, mnt = store, tmp_path / "mnt"
    assert s.proxy is not None
    cached, uncached = os.urandom(3 * MiB), os.urandom(3 * MiB)
    s.put("d/cached.bin", cached)
    s.put("d/uncached.bin", uncached)
    ttl = 4.0
    with subprocess_mount(s.url, mnt, tmp_path / "cache", *MOUNT_ARGS, "--metadata-ttl", str(ttl),
                          "--chunk-size", "1M", env=s.env):
        assert (mnt / "d/cached.bin").read_bytes() == cached
        assert sorted(os.listdir(mnt / "d")) == ["cached.bin", "uncached.bin"]
        s.proxy.stop_server()
        down = time.monotonic()
        assert (mnt / "d/cached.bin").read_bytes() == cached  # stat and chunks from the caches
        assert sorted(os.listdir(mnt / "d")) == ["cached.bin", "uncached.bin"]
        code, waited = timed(lambda: errno_of(lambda: (mnt / "d/uncached.bin").read_bytes()))
        assert code == errno.EIO and waited < CALL_BOUND
        # A new name in a directory whose listing is fresh needs no request: it is created and
        # written locally; its close fails (`cp: failed to close`) and keeps the bytes.
        fd = os.open(mnt / "d/new.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, b"written while the server was down")
        assert close_errno(fd)[0] == errno.EIO
        assert time.monotonic() - down < ttl, "too slow to check the TTL window"
        time.sleep(max(0.0, down + ttl + 1.5 - time.monotonic()))  # + the kernel's own 1 s
        for path in (mnt / "d/cached.bin", mnt / "d/other.txt"):  # `cp` to a new name: cannot stat
            code, waited = timed(lambda: errno_of(lambda: os.stat(path)))  # noqa: B023
            assert code == errno.EIO and waited < CALL_BOUND, (path, code, waited)
        assert errno_of(lambda: os.listdir(mnt / "d")) == errno.EIO
        s.proxy.restart()
        assert (mnt / "d/cached.bin").read_bytes() == cached and (mnt / "d/uncached.bin").read_bytes() == uncached
        wait_committed(s, "d/new.txt", b"written while the server was down", within=COMMIT_BOUND)


# -- write-back cells (--write-back: close returns once the bytes are staged and journaled) ---------
WB_ARGS = [*MOUNT_ARGS, "--write-back"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def bucket_sums(s: Store, rels: list[str]) -> dict[str, str | None]:
    """sha256 of each object as the server holds it (read past the mount and the proxy, all at
    once: s3fs and gcsfs fetch a list concurrently); None where there is no object."""
    paths = [f"{s.root}/{rel}" for rel in rels]
    got = s.client.cat(paths, on_error="return")
    return {rel: sha(bytes(got[p])) if isinstance(got.get(p), (bytes, bytearray)) else None
            for rel, p in zip(rels, paths)}


def staging_left(cache: Path) -> list[str]:
    return sorted(p.name for p in staging_entries(cache / "staging"))


def marinfs(*args: str, env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([*MARINFS, *args], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=timeout)
    return done, time.monotonic() - started


@cells("s3")
def test_write_back_server_down_during_background_uploads_closes_return_sync_fails_then_all_land(
        store: Store, tmp_path: Path) -> None:
    """The store goes down while background uploads are in flight (each PUT waits 1 s at the
    proxy), and stays down while more files are written: every close() returns 0 at once; the failed
    uploads are listed by `marinfs status` (and --json) with their error; `marinfs sync` of
    their directory, run at once, exits 1 in bounded time naming them (how many, the first five
    by name; none outside it); once the store
    is back the retry lands every byte (sha256 of each object, read past the mount and the proxy)."""
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    assert s.proxy is not None
    s.proxy.delay, s.proxy.delay_match = 1.0, lambda req: req.method in ("PUT", "POST")
    before = {f"ckpt/before-{i}.bin": os.urandom(1000 + 997 * i) for i in range(6)}
    before["elsewhere.bin"] = os.urandom(1234)  # outside the directory synced below
    during = {f"ckpt/during-{i}.bin": os.urandom(2000 + 991 * i) for i in range(6)}
    during["ckpt/big.bin"] = os.urandom(40 * MiB + 3)  # a multipart upload, once the store is back
    files = {**before, **during}
    timings: dict[str, float] = {}
    with subprocess_mount(s.url, mnt, cache, *WB_ARGS, "--write-back-delay", "0", "--metadata-ttl", "60",
                          env=s.env):
        (mnt / "ckpt").mkdir()  # made here: new names in it need no request
        for rel, data in before.items():
            (mnt / rel).write_bytes(data)
        # (their uploads reached the store: only theirs counted, a directory's record may come too)
        wait_for(lambda: {r for r in before if any(m == "PUT" and r in t for _, m, t in s.proxy.arrivals)}
                 == set(before), within=15)
        s.proxy.stop_server()  # every upload in flight (held at the proxy) dies with it
        down = time.monotonic()
        for rel, data in during.items():  # written while the store is down
            started = time.monotonic()
            fd = write_file(mnt / rel, data)
            code, _ = close_errno(fd)
            timings[rel] = time.monotonic() - started
            assert code == 0 and timings[rel] < 2.0, (rel, code, timings[rel])  # no request: staged
        # `marinfs sync` at once, as a job would: it waits for the uploads in flight to fail.
        synced, timings["sync"] = marinfs("sync", str(mnt / "ckpt"), env=s.env)
        assert synced.returncode == 1 and timings["sync"] < CALL_BOUND + 5, synced
        line = synced.stderr.strip().splitlines()[-1]  # (after its progress lines)
        under = sorted(rel for rel in files if rel.startswith("ckpt/"))
        assert (f"{len(under)} files failed to upload; their bytes are kept and retried: "
                f"{', '.join(under[:5])} and {len(under) - 5} more (see `marinfs status") in line, line
        wait_for(lambda: sorted(f["key"] for f in failed_uploads(mnt, s.env)) == sorted(files), within=5)
        timings["all failed and listed"] = time.monotonic() - down
        for failed in failed_uploads(mnt, s.env):
            assert failed["attempts"] >= 1 and failed["error"] and not failed["final"], failed
            assert sha(Path(failed["staged"]).read_bytes()) == sha(files[failed["key"]])
        shown, _ = marinfs("status", str(mnt), env=s.env)
        assert shown.returncode == 0 and "write-back: 0 queued or uploading" in shown.stdout, shown.stdout
        assert all(f"failed {rel} (retrying;" in shown.stdout for rel in files), shown.stdout
        assert set(bucket_sums(s, list(files)).values()) == {None}  # nothing landed while down
        s.proxy.delay = 0.0
        s.proxy.restart()
        started = time.monotonic()
        want = {rel: sha(data) for rel, data in files.items()}
        wait_for(lambda: bucket_sums(s, list(files)) == want, within=COMMIT_BOUND)
        timings["landed once back"] = time.monotonic() - started
        synced, _ = marinfs("sync", str(mnt), env=s.env)
        assert synced.returncode == 0, synced.stderr
        wait_for(lambda: failed_uploads(mnt, s.env) == [], within=5)
        assert staging_left(cache) == []
    print("store down during background uploads:", {k: round(v, 1) for k, v in timings.items()})


@cells("s3")
def test_write_back_daemon_sigkilled_with_1000_files_pending_the_next_start_uploads_all(store: Store,
                                                                                         tmp_path: Path) -> None:
    """1,000 small files closed (close returned 0: staged and journaled), none uploaded (a long
    --write-back-delay), the daemon SIGKILLed: a new daemon on the same cache directory uploads
    every one at its start, byte for byte, and leaves nothing in the staging directory. The store
    is 50 ms away then (S3's and GCS's PUT latency): one upload after the other took 1,000 round
    trips, 50 s before the mount came up, and `marinfs mount` gives up at 60 s."""
    s, mnt, cache = store, tmp_path / "mnt", tmp_path / "cache"
    files = {f"run/d{i % 10}/f{i:04d}": os.urandom(1024 + (i * 37) % 3072) for i in range(1000)}
    with subprocess_mount(s.url, mnt, cache, *WB_ARGS, "--write-back-delay", "600", env=s.env) as pid:
        for d in range(10):
            (mnt / "run" / f"d{d}").mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        for rel, data in files.items():
            (mnt / rel).write_bytes(data)  # each close returns once staged
        wrote = time.monotonic() - started
        sigkill(pid, mnt)
    assert s.proxy is not None
    sent = [t for _, m, t in s.proxy.arrivals if m == "PUT" and "/run/d" in t and not t.endswith("/")]
    assert len(journals(cache)) == 1000 and not sent  # none uploaded (the directories' markers were)
    s.proxy.delay, s.proxy.delay_match = 0.05, lambda req: req.method == "PUT"
    started = time.monotonic()
    with subprocess_mount(s.url, mnt, cache, *WB_ARGS, env=s.env):  # the next start, same cache dir
        mounted = time.monotonic() - started
        assert mounted < 20, mounted
        assert bucket_sums(s, list(files)) == {rel: sha(data) for rel, data in files.items()}
        assert (mnt / "run/d3/f0003").read_bytes() == files["run/d3/f0003"]
        assert failed_uploads(mnt, s.env) == []
    assert staging_left(cache) == []
    print(f"1,000 files: written in {wrote:.1f} s, the next start uploaded them and mounted in {mounted:.1f} s")


@cells("local", "s3")
def test_write_back_a_conflicting_writer_on_another_node_gets_their_object_and_ours_beside(
        store: Store, tmp_path: Path) -> None:
    """This node closes a rewrite of an existing object and a new file (queued, not uploaded:
    a long --write-back-delay); another node (a second mount of the prefix) writes both names
    meanwhile. The uploads meet the other writer's objects: theirs stay, ours land beside as
    conflict copies, listed by `marinfs status`; nothing is lost."""
    s, mnt, other = store, tmp_path / "mnt", tmp_path / "other"
    s.put("shared/model.txt", b"version 1")
    ours = {"shared/model.txt": os.urandom(3000), "shared/new.txt": os.urandom(2000)}
    theirs = {"shared/model.txt": os.urandom(3100), "shared/new.txt": os.urandom(2100)}
    with subprocess_mount(s.url, mnt, tmp_path / "cache", *WB_ARGS, "--write-back-delay", "600", env=s.env):
        assert (mnt / "shared/model.txt").read_bytes() == b"version 1"
        for rel, data in ours.items():
            (mnt / rel).write_bytes(data)  # close returns: queued
        assert bucket_sums(s, list(ours)) == {"shared/model.txt": sha(b"version 1"), "shared/new.txt": None}
        time.sleep(0.01)  # (a local version is mtime-based: the other write must differ in time)
        with subprocess_mount(s.url, other, tmp_path / "other-cache", *MOUNT_ARGS, env=s.env):
            for rel, data in theirs.items():
                (other / rel).write_bytes(data)  # the other node's close commits
        synced, _ = marinfs("sync", "-q", str(mnt), env=s.env)  # every byte landed, beside theirs: said once
        assert synced.returncode == 1 and len(synced.stderr.strip().splitlines()) == 1, synced.stderr
        assert "changed by someone else" in synced.stderr and all(rel in synced.stderr for rel in ours), synced.stderr
        again, _ = marinfs("sync", str(mnt), env=s.env)
        assert again.returncode == 0, again.stderr
        uploads: dict[str, Any] = {}

        def conflicts_shown() -> bool:  # (the daemon publishes its status every 2 s)
            status, _ = marinfs("status", "--json", str(mnt), env=s.env)
            uploads.update(json.loads(status.stdout)[0]["uploads"])
            return len(uploads["conflicts"]) == len(ours)

        wait_for(conflicts_shown, within=5)
        conflicts = {c["key"]: c["committed_as"] for c in uploads["conflicts"]}
        assert sorted(conflicts) == sorted(ours) and uploads["failed"] == [], uploads
        text, _ = marinfs("status", str(mnt), env=s.env)
        for rel, copy in conflicts.items():
            assert copy.startswith(f"{rel}.marinfs-conflict-"), copy
            assert f"conflict {rel}: changed by someone else; our bytes are in {copy}" in text.stdout, text.stdout
        assert bucket_sums(s, [*theirs, *conflicts.values()]) == {
            **{rel: sha(data) for rel, data in theirs.items()},
            **{copy: sha(ours[rel]) for rel, copy in conflicts.items()}}
        for rel, data in theirs.items():  # this node now shows theirs, and its copy beside
            assert (mnt / rel).read_bytes() == data
        assert sorted(os.listdir(mnt / "shared")) == sorted(Path(p).name for p in [*theirs, *conflicts.values()])
    assert staging_left(tmp_path / "cache") == []


@cells("local", "s3")
def test_write_back_a_full_cache_disk_is_enospc_at_the_write_or_a_wait_at_close_never_a_lost_file(
        store: Store, tiny_tmpfs: Path, tmp_path: Path) -> None:
    """A 1 MiB cache disk under write-back (uploads held: a long --write-back-delay). With
    --write-back-max-bytes under the disk's size, closes past it wait for uploads to make room
    and return 0; a file larger than the disk fails its write() with ENOSPC (not only its
    close), and nothing of it is uploaded: the old object stays. Every file whose close returned
    0 is in the bucket, byte for byte; nothing is left in the staging directory."""
    s, mnt = store, tmp_path / "mnt"
    s.put("model.bin", b"the old version")
    files = {f"shards/s{i:02d}": os.urandom(64 * 1024 - i) for i in range(20)}  # 1.25 MiB in all
    with subprocess_mount(s.url, mnt, tiny_tmpfs, *WB_ARGS, "--cache-size", "0", "--write-back-delay", "600",
                          "--write-back-max-bytes", "256K", env=s.env):
        (mnt / "shards").mkdir()
        closed: dict[str, float] = {}
        for rel, data in files.items():
            fd = write_file(mnt / rel, data)
            code, waited = close_errno(fd)
            assert code == 0 and waited < CALL_BOUND, (rel, code, waited)
            closed[rel] = waited
            waiting = [r for r, got in bucket_sums(s, list(closed)).items() if got is None]
            assert len(waiting) <= 4, waiting  # past 256 KiB the close waited for uploads to make room
        fd = os.open(mnt / "model.bin", os.O_WRONLY | os.O_TRUNC)
        try:
            with pytest.raises(OSError) as info:
                for _ in range(8):
                    os.write(fd, os.urandom(256 * 1024))  # 2 MiB into a 1 MiB disk
            assert info.value.errno == errno.ENOSPC
        finally:
            assert errno_of(lambda: os.close(fd)) == errno.ENOSPC  # (told again at close)
        synced, waited = marinfs("sync", str(mnt), env=s.env)
        assert synced.returncode == 0 and waited < CALL_BOUND, synced.stderr
        assert bucket_sums(s, [*files, "model.bin"]) == {**{rel: sha(data) for rel, data in files.items()},
                                                       "model.bin": sha(b"the old version")}
        assert (mnt / "model.bin").read_bytes() == b"the old version"
        assert failed_uploads(mnt, s.env) == []
    assert staging_left(tiny_tmpfs) == []
    print(f"closes past --write-back-max-bytes waited {max(closed.values()):.2f} s at most")
