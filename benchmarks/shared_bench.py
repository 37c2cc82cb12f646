"""The shared chunk tier's acceptance figures (issue 35): several daemons on this machine, each
with its own mount and local cache directory, sharing one directory, stand for several nodes.

Starts SeaweedFS via ``tests/servers.py``, uploads one random object (``--size``, 1 GiB) and
measures, each case with fresh mounts, empty caches and the page cache dropped:

  a. one mount alone, cold, no shared tier: its time (the reference)
  b. one mount alone, cold, with an empty shared tier
  c. N mounts (``--mounts``, 4) reading the object at the same moment, cold, sharing one
     directory: bucket bytes per mount, each mount's time, slowest / (a)
  d. the same N mounts one after another (tier emptied first): bucket bytes per mount, and
     mounts 2..N's speed against reading the shared directory's chunk files directly (``cat``,
     page cache dropped)
  e. each daemon's peak RSS (VmHWM) and CPU (utime + stime over its read), and the tier's lease
     waits, lease timeouts and skipped publishes when there were any
  f. this disk's floor for (c) and (d) without marinfs: here every cache and the shared
     directory are one disk, so a mount reading the tier also writes its own cache there
  g. the whole machine's busy core-seconds in each case (/proc/stat): N daemons, the server and
     the readers share these cores where N nodes would each have their own, so (c) can go no
     faster than its work over the cores (printed as the CPU floor)

Bucket bytes are each daemon's ``marinfs_chunk_bytes{source="bucket"}`` (its metrics), plus
``bytes_in`` of its remote (every GET). Needs root (drop_caches) and fuse3:

    python benchmarks/shared_bench.py --size 1G --mounts 4 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
# The daemons import this checkout (as bench.py's do), not whatever the venv installed.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import servers  # noqa: E402  (tests/servers.py)
from mounting import fsspec_client, subprocess_mount  # noqa: E402
from peers_bench import cpu_seconds  # noqa: E402
from marinfs.config.mount import parse_size  # noqa: E402

MiB = 1 << 20
CORES = os.cpu_count() or 1


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {f"chunk_{m.group(1)}": float(m.group(2))
           for m in re.finditer(r'^marinfs_chunk_bytes(?:_total)?\{source="(\w+)"\} (\S+)$', text, re.M)}
    m = re.search(r'^marinfs_remote_bytes(?:_total)?\{direction="in"\} (\S+)$', text, re.M)
    out["remote_in"] = float(m.group(1)) if m else 0.0
    for m in re.finditer(r'^marinfs_shared_(\w+?)(?:_total)? (\S+)$', text, re.M):
        out[f"shared_{m.group(1)}"] = float(m.group(2))
    return out


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_cpu() -> tuple[float, float]:
    """(busy, iowait) core-seconds of the whole machine so far (/proc/stat): the server, every
    daemon, the readers and the kernel's own work on their behalf, all on these cores."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / hz, iowait / hz


def read_file(path: Path) -> float:
    """Seconds to read ``path`` with 1 MiB reads."""
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, MiB):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - started


class Mounts:
    def __init__(self, server, url: str, base: Path, n: int, shared: Path | None) -> None:  # noqa: ANN001
        self.stack = ExitStack()
        self.nodes = []
        for i in range(n):
            port = free_port()
            extra = ["--metrics-port", str(port)]
            if shared is not None:
                extra += ["--shared-cache-dir", str(shared)]
            mnt, cache = base / f"mnt{i}", base / f"cache{i}"
            shutil.rmtree(cache, ignore_errors=True)
            pid = self.stack.enter_context(subprocess_mount(url, mnt, cache, *extra, env=server.env()))
            self.nodes.append({"mnt": mnt, "port": port, "pid": pid})

    def close(self) -> None:
        self.stack.close()


def case(server, url: str, base: Path, name: str, n: int, shared: Path | None, together: bool,  # noqa: ANN001
         obj: str) -> dict:
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)
        shared.mkdir(mode=0o700)
    mounts = Mounts(server, url, base / name, n, shared)
    try:
        drop_caches()
        before = [metrics(node["port"]) for node in mounts.nodes]
        cpu0 = [cpu_seconds(node["pid"]) for node in mounts.nodes]
        machine0, started = machine_cpu(), time.perf_counter()
        times: list[float] = [0.0] * n
        if together:
            barrier = threading.Barrier(n)

            def run(i: int) -> None:
                barrier.wait()
                times[i] = read_file(mounts.nodes[i]["mnt"] / obj)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i, node in enumerate(mounts.nodes):
                times[i] = read_file(node["mnt"] / obj)
                time.sleep(1.0)  # the last chunks' publishing, in the background
        wall, machine1 = time.perf_counter() - started, machine_cpu()
        after = [metrics(node["port"]) for node in mounts.nodes]
        cpu = [cpu_seconds(node["pid"]) - c for node, c in zip(mounts.nodes, cpu0)]
        per = [{k: after[i][k] - before[i].get(k, 0) for k in after[i]} for i in range(n)]
        rss = [peak_rss(node["pid"]) for node in mounts.nodes]
    finally:
        mounts.close()
    return {"case": name, "seconds": times, "moved": per, "peak_rss": rss, "cpu": cpu, "wall": wall,
            "machine_busy": machine1[0] - machine0[0], "machine_iowait": machine1[1] - machine0[1]}


def direct_read(shared: Path, drop: bool = True) -> float:
    """Seconds to read every chunk file of the shared directory (page cache dropped)."""
    if drop:
        drop_caches()
    files = sorted(p for p in (shared / "chunks").glob("*/*"))
    started = time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            while f.read(MiB):
                pass
    return time.perf_counter() - started


def _write_direct(path: Path, size: int) -> None:
    """``size`` bytes to ``path`` with O_DIRECT in 8 MiB writes: what a daemon's chunk cache does."""
    import mmap

    buf = mmap.mmap(-1, 8 * MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for off in range(0, size, 8 * MiB):
            os.pwrite(fd, buf, off)
    finally:
        os.close(fd)
        os.unlink(path)


def disk_floor(shared: Path, base: Path, size: int, n: int) -> dict[str, float]:
    """What this machine's disk allows the cases, without marinfs: every daemon's cache, the shared
    directory and this one disk are one device here, so (c) and (d) move several times the
    bytes of reading the shared directory. ``hit``: the shared directory's files read (as
    ``direct_read``) while as many bytes are written with O_DIRECT (a node's own cache keeping
    what it read from the tier): the floor of mounts 2..N in turn. ``together``: N + 1 writers of
    ``size`` (N caches, one publish) and N - 1 readers of the shared files at once."""
    def run(jobs: list[threading.Thread]) -> float:
        drop_caches()
        started = time.perf_counter()
        for t in jobs:
            t.start()
        for t in jobs:
            t.join()
        return time.perf_counter() - started

    hit = run([threading.Thread(target=direct_read, args=(shared, False)),
               threading.Thread(target=_write_direct, args=(base / "floor-w0", size))])
    together = run([threading.Thread(target=_write_direct, args=(base / f"floor-w{i}", size)) for i in range(n + 1)]
                   + [threading.Thread(target=direct_read, args=(shared, False)) for _ in range(n - 1)])
    return {"hit": hit, "together": together}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--mounts", type=int, default=4)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=1, help="run every case this many times (medians printed)")
    args = ap.parse_args()
    size = parse_size(args.size)
    n = args.mounts
    base = Path(tempfile.mkdtemp(prefix="shared-bench-"))
    server = servers.start_seaweedfs(base / "seaweedfs")
    results: dict = {"size": size, "mounts": n}
    try:
        url = f"s3://{server.bucket}/bench-{uuid.uuid4().hex[:8]}"
        client, root = fsspec_client(url, server.storage_options())
        with client.open(f"{root}/model.bin", "wb", block_size=64 * MiB) as f:
            left = size
            while left:
                block = os.urandom(min(64 * MiB, left))
                f.write(block)
                left -= len(block)
        shared = base / "shared"
        runs = []
        for _ in range(args.reps):
            runs.append([case(server, url, base, "alone", 1, None, False, "model.bin"),
                         case(server, url, base, "alone-tier", 1, shared, False, "model.bin"),
                         case(server, url, base, "together", n, shared, True, "model.bin"),
                         case(server, url, base, "in-turn", n, shared, False, "model.bin")])
            runs[-1].append(direct_read(shared))
            runs[-1].append(disk_floor(shared, base, size, n))
        results["runs"] = runs
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    gib = size / (1 << 30)
    ratios: dict[str, list[float]] = {"together / alone": [], "in turn 2..N / direct": []}
    for rep, run in enumerate(results["runs"]):
        *cases, direct, floor = run
        alone = cases[0]["seconds"][0]
        print(f"rep {rep + 1}: object {size / MiB:.0f} MiB, {n} mounts; one mount alone {alone:.2f} s "
              f"({size / MiB / alone:.0f} MiB/s)")
        for c in cases:
            bucket = [m["chunk_bucket"] / MiB for m in c["moved"]]
            remote = [m["remote_in"] / MiB for m in c["moved"]]
            print(f"{c['case']:>10}: seconds {[round(s, 2) for s in c['seconds']]}, slowest / alone "
                  f"{max(c['seconds']) / alone:.2f}; bucket MiB per mount {[round(b, 1) for b in bucket]} "
                  f"(all GETs {[round(r, 1) for r in remote]}), in all {sum(remote) / 1024:.3f} GiB "
                  f"for {gib:.3f} GiB; daemon CPU-s/GiB {[round(c_ / gib, 2) for c_ in c['cpu']]}; "
                  f"peak RSS MiB {[round(r / MiB) for r in c['peak_rss']]}")
            tier = {k[len("shared_"):]: [int(m.get(k, 0)) for m in c["moved"]] for k in
                    ("shared_lease_waits", "shared_lease_timeouts", "shared_publish_skipped", "shared_timeouts",
                     "shared_corrupt", "shared_degraded")}
            if any(any(v) for v in tier.values()):
                print(f"{'':>12}tier: {', '.join(f'{k} {v}' for k, v in tier.items() if any(v))}")
            print(f"{'':>12}machine: {c['machine_busy']:.2f} core-s busy, {c['machine_iowait']:.2f} in I/O wait, "
                  f"over {c['wall']:.2f} s ({c['machine_busy'] / c['wall']:.2f} of {CORES} cores busy)")
        turn = cases[3]["seconds"][1:]
        print(f"shared directory read directly: {direct:.2f} s ({size / MiB / direct:.0f} MiB/s); mounts 2..{n} "
              f"in turn at {[round(direct / s, 2) for s in turn]} of that speed")
        print(f"this disk's floor without marinfs: a hit (the shared files read while as much is written "
              f"with O_DIRECT) {floor['hit']:.2f} s = {direct / floor['hit']:.2f} of the direct read's speed; "
              f"{n} together ({n + 1} GiB-scale writers, {n - 1} readers at once) {floor['together']:.2f} s "
              f"= {floor['together'] / alone:.2f} x one mount alone")
        # Each node has its own cores; here N daemons, the server and the readers share CORES:
        # (c)'s work alone needs its busy core-seconds / CORES of wall time on this machine.
        cpu_floor = cases[2]["machine_busy"] / CORES
        print(f"this machine's CPU floor for {n} together: {cases[2]['machine_busy']:.2f} core-s of work "
              f"(one alone: {cases[0]['machine_busy']:.2f}) on {CORES} cores needs {cpu_floor:.2f} s "
              f"= {cpu_floor / alone:.2f} x one mount alone")
        ratios["together / alone"].append(max(cases[2]["seconds"]) / alone)
        ratios["in turn 2..N / direct"].append(min(direct / s for s in turn))
    if args.reps > 1:
        for k, v in ratios.items():
            print(f"median {k}: {statistics.median(v):.2f} (runs: {[round(x, 2) for x in v]})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
