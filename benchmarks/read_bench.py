"""Read benchmark: marinfs against direct fsspec reads and local disks, on a local object store.

Starts SeaweedFS (or fake-gcs-server with ``--gcs``) on 127.0.0.1 via ``tests/servers.py``,
uploads one random object and measures, min/median/max over ``--reps``:

  a. baseline: direct fsspec reads (whole ``cat_file``; 8 threads of 8 MiB ranged ``cat_file``)
  b. marinfs cold ``dd`` (fresh mount, empty cache, page cache dropped)
  c. warm ``dd`` (same mount, page cache dropped: chunk-cache hits)
  d. hot ``dd`` (same mount, kernel page cache)
  e. 2,000 random 1 MiB ``pread``s on a fresh mount with an empty cache (S3 only)
  f. ``dd`` of the same bytes from ext4 (cold) and tmpfs
  g. GETs and bytes fetched per marinfs case (from the daemon's ``CACHE_DIR/stats.json``)
  h. peak daemon RSS while cold-reading a ``--rss-size`` object (S3 only; 0 skips)

The server's page cache is dropped before every baseline and cold read, so both start cold.
Needs root (drop_caches) and fuse3. Run from the repository root:

    make bench
    python benchmarks/read_bench.py --size 256M --rss-size 512M --reps 1
    python benchmarks/read_bench.py --gcs          # fake-gcs-server, 64 MiB, cases a-d (+f)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import servers  # noqa: E402  (tests/servers.py)
from marinfs.read.chunkcache import stats_file  # noqa: E402
from marinfs.config.mount import parse_size  # noqa: E402
from marinfs.app.daemon import state_file  # noqa: E402

MiB = 1 << 20
CHUNK = 8 * MiB  # marinfs --chunk-size, and the range size of the parallel baseline
RANDOM_READS = 2000
GCS_SIZE = 64 * MiB
MARINFS = [sys.executable, "-m", "marinfs"]


@dataclass
class Backend:
    """One running server, an fsspec filesystem on it and what a mount of it needs."""

    scheme: str
    server: Any  # servers.S3Server | servers.GCSServer
    fs: Any
    env: dict[str, str]

    @property
    def prefix(self) -> str:
        return f"{self.server.bucket}/bench"


def start_backend(scheme: str, workdir: Path) -> Backend:
    kw = {"use_listings_cache": False, "skip_instance_cache": True}
    if scheme == "s3":
        srv = servers.start_seaweedfs(workdir)
        import s3fs

        return Backend("s3", srv, s3fs.S3FileSystem(**srv.storage_options(), **kw), srv.env())
    srv = servers.start_fake_gcs(workdir)
    os.environ.update(srv.env())  # before gcsfs is imported (see tests/servers.py)
    import gcsfs

    return Backend("gs", srv, gcsfs.GCSFileSystem(**srv.storage_options(), **kw), srv.env())


def drop_caches() -> None:
    os.sync()  # dirty pages cannot be dropped
    Path("/proc/sys/vm/drop_caches").write_text("3")


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dd(path: Path) -> float:
    return timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True,
                                        capture_output=True))


def mbps(size: int, seconds: float) -> float:
    return size / MiB / seconds


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for off in range(0, size, 64 * MiB):
            f.write(os.urandom(min(64 * MiB, size - off)))


@dataclass
class Mount:
    path: Path
    cache_dir: Path
    pid: int


@contextmanager
def mounted(backend: Backend, tmp: Path, name: str) -> Iterator[Mount]:
    """A fresh marinfs mount of the bench prefix with its own empty cache directory."""
    mnt, cache = Path(tempfile.mkdtemp(prefix=f"mnt-{name}-", dir=tmp)), tmp / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    subprocess.run([*MARINFS, "mount", f"{backend.scheme}://{backend.prefix}", str(mnt), "--cache-dir",
                    str(cache), "--chunk-size", str(CHUNK), "--log-file", str(tmp / f"{name}.log")],
                   check=True, env={**os.environ, **backend.env}, stdout=subprocess.DEVNULL)
    try:
        yield Mount(mnt, cache, json.loads(state_file(str(mnt)).read_text())["pid"])
    finally:
        if subprocess.run([*MARINFS, "umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        shutil.rmtree(cache, ignore_errors=True)
        with suppress(OSError):  # never mask the real error
            mnt.rmdir()


def read_stats(cache_dir: Path, after: float, timeout: float = 10) -> dict[str, int]:
    """Counters from the daemon's stats.json, waiting for a copy written after ``after`` (wall time)."""
    path, deadline = stats_file(cache_dir), time.monotonic() + timeout
    while not (path.exists() and path.stat().st_mtime > after):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} not rewritten within {timeout} s")
        time.sleep(0.1)
    data = json.loads(path.read_text())
    cache = data.get("cache") or {}
    return {"gets": data["remote_requests"]["requests"].get("get", 0),
            "bytes_in": data["remote_requests"]["bytes_in"],
            "cache_hits": cache.get("hits", 0), "cache_misses": cache.get("misses", 0)}


class RssSampler(threading.Thread):
    """Peak VmRSS (bytes) of a process, sampled every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
            except OSError:
                return
            self.stop.wait(self.interval)


# -- cases ---------------------------------------------------------------------------------------
def bench_baseline(b: Backend, key: str, size: int, reps: int) -> dict[str, list[float]]:
    path = f"{b.prefix}/{key}"

    def ranged() -> None:
        with ThreadPoolExecutor(8) as pool:
            for part in pool.map(lambda s: b.fs.cat_file(path, start=s, end=min(s + CHUNK, size)),
                                 range(0, size, CHUNK)):
                assert part  # consumed and dropped: memory stays ~8 chunks

    out: dict[str, list[float]] = {"cat_file": [], "ranged_8x8MiB": []}
    for _ in range(reps):
        drop_caches()
        out["cat_file"].append(mbps(size, timed(lambda: b.fs.cat_file(path))))
        drop_caches()
        out["ranged_8x8MiB"].append(mbps(size, timed(ranged)))
    return out


def bench_sequential(b: Backend, tmp: Path, key: str, size: int, reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {c: {"mbps": [], "stats": []} for c in ("cold", "warm", "hot")}
    for rep in range(reps):
        with mounted(b, tmp, f"seq{rep}") as m:
            before = read_stats(m.cache_dir, 0)
            for case in ("cold", "warm", "hot"):
                if case != "hot":
                    drop_caches()
                res[case]["mbps"].append(mbps(size, dd(m.path / key)))
                now = read_stats(m.cache_dir, time.time())
                res[case]["stats"].append({k: now[k] - before[k] for k in now})
                before = now
    return res


def bench_random(b: Backend, tmp: Path, key: str, size: int, reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {"ops_per_s": [], "mbps": [], "stats": []}
    rng = random.Random(0)
    offsets = [rng.randrange(size // MiB) * MiB for _ in range(RANDOM_READS)]
    for rep in range(reps):
        with mounted(b, tmp, f"rand{rep}") as m:
            before = read_stats(m.cache_dir, 0)
            drop_caches()
            fd = os.open(m.path / key, os.O_RDONLY)
            try:
                secs = timed(lambda: [os.pread(fd, MiB, off) for off in offsets])
            finally:
                os.close(fd)
            res["ops_per_s"].append(RANDOM_READS / secs)
            res["mbps"].append(mbps(RANDOM_READS * MiB, secs))
            now = read_stats(m.cache_dir, time.time())
            res["stats"].append({k: now[k] - before[k] for k in now})
    return res


def bench_physical(local: Path, tmp_shm: Path, size: int, reps: int) -> dict[str, list[float]]:
    shm = tmp_shm / local.name
    shutil.copyfile(local, shm)
    out: dict[str, list[float]] = {"ext4_cold": [], "tmpfs": []}
    for _ in range(reps):
        drop_caches()
        out["ext4_cold"].append(mbps(size, dd(local)))
        out["tmpfs"].append(mbps(size, dd(shm)))
    shm.unlink()
    return out


def bench_rss(b: Backend, tmp: Path, size: int) -> dict[str, Any]:
    local = tmp / "rss.bin"
    write_random(local, size)
    b.fs.put_file(str(local), f"{b.prefix}/rss.bin")
    local.unlink()
    with mounted(b, tmp, "rss") as m:
        before = read_stats(m.cache_dir, 0)
        drop_caches()
        sampler = RssSampler(m.pid)
        sampler.start()
        secs = dd(m.path / "rss.bin")
        sampler.stop.set()
        sampler.join()
        now = read_stats(m.cache_dir, time.time())
    stats = {k: now[k] - before[k] for k in now}
    b.fs.rm_file(f"{b.prefix}/rss.bin")
    return {"size": size, "peak_rss_mib": sampler.peak / MiB, "mbps": mbps(size, secs), "stats": stats}


# -- report --------------------------------------------------------------------------------------
def report(r: dict[str, Any]) -> str:
    size, med = r["size"], lambda xs: statistics.median(xs)
    rows = [f"| {name} | {s['min']:.0f} | {s['median']:.0f} | {s['max']:.0f} | {note} |"
            for name, s, note in r["rows"]]
    lines = ["| case | MB/s min | MB/s median | MB/s max | notes |", "|---|---:|---:|---:|---|", *rows, "",
             "| ratio / check | value | target | ok |", "|---|---:|---|---|"]
    base, seq, phys = r["baseline_mbps"], r["sequential"], r["physical"]
    checks = [("cold / baseline", med(seq["cold"]["mbps"]) / base, ">= 0.9", lambda v: v >= 0.9),
              ("warm / ext4 cold dd", med(seq["warm"]["mbps"]) / med(phys["ext4_cold"]), ">= 0.6",
               lambda v: v >= 0.6),
              ("hot / tmpfs dd", med(seq["hot"]["mbps"]) / med(phys["tmpfs"]), ">= 0.8", lambda v: v >= 0.8)]
    gets_limit = math.ceil(size / CHUNK) + 2
    cold_gets = max(s["gets"] for s in seq["cold"]["stats"])
    cold_bytes = sorted({s["bytes_in"] for s in seq["cold"]["stats"]})
    warm_gets = max(s["gets"] for s in seq["warm"]["stats"])
    lines += [f"| {n} | {v:.2f} | {t} | {'yes' if ok(v) else 'NO'} |" for n, v, t, ok in checks]
    lines += [f"| cold GETs (max over reps) | {cold_gets} | <= {gets_limit} | {'yes' if cold_gets <= gets_limit else 'NO'} |",
              f"| cold bytes fetched | {', '.join(map(str, cold_bytes))} | == {size} | "
              f"{'yes' if cold_bytes == [size] else 'NO'} |",
              f"| warm GETs (max over reps) | {warm_gets} | == 0 | {'yes' if warm_gets == 0 else 'NO'} |"]
    if r.get("rss"):
        peak = r["rss"]["peak_rss_mib"]
        lines.append(f"| peak daemon RSS, cold read of {r['rss']['size'] / MiB:.0f} MiB | {peak:.0f} MiB "
                     f"| <= 300 MiB | {'yes' if peak <= 300 else 'NO'} |")
    return "\n".join(lines)


def table_rows(r: dict[str, Any]) -> list[tuple[str, dict[str, float], str]]:
    def note(stats: list[dict[str, int]]) -> str:
        return "GETs " + "/".join(str(s["gets"]) for s in stats) + ", MiB fetched " + \
            "/".join(f"{s['bytes_in'] / MiB:.0f}" for s in stats)

    rows = [(f"(a) fsspec {k}", summary(v), "direct read") for k, v in r["baseline"].items()]
    for letter, case in (("b", "cold"), ("c", "warm"), ("d", "hot")):
        rows.append((f"({letter}) marinfs {case} dd", summary(r["sequential"][case]["mbps"]),
                     note(r["sequential"][case]["stats"])))
    if r.get("random"):
        ops = summary(r["random"]["ops_per_s"])
        rows.append(("(e) marinfs 2000 random 1 MiB preads", summary(r["random"]["mbps"]),
                     f"ops/s {ops['min']:.0f}/{ops['median']:.0f}/{ops['max']:.0f}, "
                     + note(r["random"]["stats"])))
    rows += [(f"(f) dd {k}", summary(v), "local reference") for k, v in r["physical"].items()]
    if r.get("rss"):
        x = r["rss"]["mbps"]
        rows.append((f"(h) marinfs cold dd {r['rss']['size'] // MiB} MiB", summary([x]),
                     f"peak RSS {r['rss']['peak_rss_mib']:.0f} MiB, " + note([r["rss"]["stats"]])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=1 << 30, help="object size (default 1G)")
    ap.add_argument("--rss-size", type=parse_size, default=4 << 30, help="RSS case object size (0: skip)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gcs", action="store_true", help="fake-gcs-server, 64 MiB object, cases a-d (+f)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON results (default benchmarks/results/read_bench[_gcs].json)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("read_bench: needs root (drop_caches)")
    size = min(args.size, GCS_SIZE) if args.gcs else args.size
    out = args.out or ROOT / "benchmarks" / "results" / f"read_bench{'_gcs' if args.gcs else ''}.json"
    tmp, shm = Path(tempfile.mkdtemp(prefix="marinfs-bench-")), Path(tempfile.mkdtemp(dir="/dev/shm"))
    t0, backend = time.monotonic(), None
    try:
        backend = start_backend("gs" if args.gcs else "s3", tmp / "server")
        local = tmp / "obj.bin"
        write_random(local, size)
        backend.fs.put_file(str(local), f"{backend.prefix}/obj.bin")
        r: dict[str, Any] = {"backend": backend.scheme, "size": size, "chunk_size": CHUNK, "reps": args.reps}
        r["baseline"] = bench_baseline(backend, "obj.bin", size, args.reps)
        r["baseline_mbps"] = max(statistics.median(v) for v in r["baseline"].values())
        r["sequential"] = bench_sequential(backend, tmp, "obj.bin", size, args.reps)
        if not args.gcs:
            r["random"] = bench_random(backend, tmp, "obj.bin", size, args.reps)
        r["physical"] = bench_physical(local, shm, size, args.reps)
        if not args.gcs and args.rss_size:
            local.unlink()  # disk: the RSS object needs room for itself and its cached chunks
            r["rss"] = bench_rss(backend, tmp, args.rss_size)
        r["rows"] = table_rows(r)
        r["elapsed_s"] = round(time.monotonic() - t0, 1)
        text = report(r)
        print(text)
        r["table"] = text
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(r, indent=2) + "\n")
        print(f"\nresults: {out} ({r['elapsed_s']:.0f} s)")
    finally:
        if backend is not None:
            backend.server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
