"""Write benchmark: marinfs commits against direct fsspec uploads, on a local object store.

Starts SeaweedFS on 127.0.0.1 via ``tests/servers.py`` and measures, min/median/max over ``--reps``:

  a. baseline: direct fsspec ``put_file`` of a ``--size`` local file (s3fs's own multipart)
  b. ``cp`` of the same file into a fresh marinfs mount: time until ``cp`` returns (close) and
     time until the object is complete on the server (polled by a second client), both from
     the start of ``cp``; they must be equal, since close waits for the commit
  c. peak daemon RSS while ``cp`` writes a ``--rss-size`` file (0 skips)
  d. ``tar -x`` of ``--files`` small files into the mount vs direct fsspec ``pipe_file`` of each
  e. requests per case, from the daemon's ``CACHE_DIR/stats.json``

Needs root (drop_caches) and fuse3. Run from the repository root:

    make bench                                     # read and write benchmarks
    python benchmarks/write_bench.py --size 256M --rss-size 0 --reps 1
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import read_bench as rb  # noqa: E402  (servers, mounts, stats, RSS sampler)
from marinfs.config.mount import parse_size  # noqa: E402

MiB = rb.MiB


def request_counts(cache_dir: Path, after: float) -> dict[str, int]:
    path, deadline = rb.stats_file(cache_dir), time.monotonic() + 10
    while not (path.exists() and path.stat().st_mtime > after) and time.monotonic() < deadline:
        time.sleep(0.1)
    data = json.loads(path.read_text())
    return {**data["remote_requests"]["requests"], "bytes_out": data["remote_requests"]["bytes_out"]}


def diff(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


class CompletionWatcher(threading.Thread):
    """Another client polling the server until the object is there with its full size."""

    def __init__(self, fs: Any, path: str, size: int, started: float) -> None:
        super().__init__(daemon=True)
        self.fs, self.path, self.size, self.started = fs, path, size, started
        self.seconds: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.fs.info(self.path)["size"] == self.size:
                    self.seconds = time.perf_counter() - self.started
                    return
            except FileNotFoundError:
                pass
            self.stop.wait(0.01)


def bench_put(b: rb.Backend, local: Path, size: int, reps: int) -> list[float]:
    out = []
    for rep in range(reps):
        rb.drop_caches()
        out.append(rb.mbps(size, rb.timed(lambda: b.fs.put_file(str(local), f"{b.prefix}/put-{rep}.bin"))))
    return out


def bench_cp(b: rb.Backend, tmp: Path, local: Path, size: int, reps: int) -> dict[str, Any]:
    res: dict[str, Any] = {"close_mbps": [], "durable_mbps": [], "close_s": [], "durable_s": [], "stats": []}
    for rep in range(reps):
        with rb.mounted(b, tmp, f"cp{rep}") as m:
            before = request_counts(m.cache_dir, 0)
            rb.drop_caches()
            name = f"cp-{rep}.bin"
            b.fs.invalidate_cache()
            t0 = time.perf_counter()
            watcher = CompletionWatcher(b.fs, f"{b.prefix}/{name}", size, t0)
            watcher.start()
            subprocess.run(["cp", str(local), str(m.path / name)], check=True)
            close_s = time.perf_counter() - t0
            watcher.join(timeout=600)
            durable_s = watcher.seconds or float("nan")
            res["close_s"].append(close_s)
            res["durable_s"].append(durable_s)
            res["close_mbps"].append(rb.mbps(size, close_s))
            res["durable_mbps"].append(rb.mbps(size, durable_s))
            res["stats"].append(diff(request_counts(m.cache_dir, time.time()), before))
    return res


def bench_rss(b: rb.Backend, tmp: Path, size: int) -> dict[str, Any]:
    local = tmp / "rss.bin"
    rb.write_random(local, size)
    with rb.mounted(b, tmp, "wrss") as m:
        sampler = rb.RssSampler(m.pid)
        sampler.start()
        secs = rb.timed(lambda: subprocess.run(["cp", str(local), str(m.path / "rss.bin")], check=True))
        sampler.stop.set()
        sampler.join()
    local.unlink()
    b.fs.rm_file(f"{b.prefix}/rss.bin")
    return {"size": size, "peak_rss_mib": sampler.peak / MiB, "mbps": rb.mbps(size, secs)}


def small_files(n: int, size: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    files = [(f"shard-{i // 100:03d}/part-{i:05d}.json", os.urandom(size)) for i in range(n)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), files


def bench_small(b: rb.Backend, tmp: Path, n: int, size: int, reps: int) -> dict[str, Any]:
    archive, files = small_files(n, size)
    tar_path = tmp / "small.tar"
    tar_path.write_bytes(archive)
    res: dict[str, Any] = {"pipe_files_per_s": [], "tar_files_per_s": [], "stats": []}
    for rep in range(reps):
        prefix = f"{b.prefix}/pipe-{rep}"
        secs = rb.timed(lambda: [b.fs.pipe_file(f"{prefix}/{name}", data) for name, data in files])
        res["pipe_files_per_s"].append(n / secs)
        with rb.mounted(b, tmp, f"tar{rep}") as m:
            before = request_counts(m.cache_dir, 0)
            dest = m.path / f"tar-{rep}"
            dest.mkdir()
            secs = rb.timed(lambda: subprocess.run(["tar", "-xf", str(tar_path), "-C", str(dest)], check=True))
            res["tar_files_per_s"].append(n / secs)
            res["stats"].append(diff(request_counts(m.cache_dir, time.time()), before))
        got = b.fs.cat_file(f"{b.prefix}/tar-{rep}/{files[-1][0]}")
        assert got == files[-1][1], "tar -x through the mount wrote the wrong bytes"
    return res


def med(values: list[float]) -> float:
    return statistics.median(values)


def report(r: dict[str, Any]) -> str:
    s = lambda v: rb.summary(v)  # noqa: E731
    put, cp = r["put_mbps"], r["cp"]
    lines = [f"write benchmark on {r['backend']} (SeaweedFS, loopback), {r['size'] / MiB:.0f} MiB, "
             f"{r['reps']} reps; MiB/s min/median/max", "",
             "| case | min | median | max | ratio to baseline |", "|---|---|---|---|---|"]

    def row(name: str, values: list[float], base: float | None) -> None:
        st = s(values)
        ratio = f"{st['median'] / base:.2f}x" if base else "-"
        lines.append(f"| {name} | {st['min']:.0f} | {st['median']:.0f} | {st['max']:.0f} | {ratio} |")

    row("baseline: fsspec put_file", put, None)
    row("marinfs cp, until close", cp["close_mbps"], med(put))
    row("marinfs cp, until complete on server", cp["durable_mbps"], med(put))
    gap = [d - c for c, d in zip(cp["close_s"], cp["durable_s"])]
    lines.append(f"\nclose vs complete-on-server gap (s): {', '.join(f'{g:+.2f}' for g in gap)} "
                 "(negative: the object was complete before cp returned)")
    lines.append(f"requests per cp: {cp['stats'][0]}")
    sm = r["small"]
    lines += ["", f"| {r['files']} small files ({r['file_size']} B) | min | median | max | ratio |",
              "|---|---|---|---|---|"]
    st = s(sm["pipe_files_per_s"])
    lines.append(f"| baseline: fsspec pipe_file, files/s | {st['min']:.0f} | {st['median']:.0f} | {st['max']:.0f} | - |")
    st2 = s(sm["tar_files_per_s"])
    lines.append(f"| marinfs tar -x, files/s | {st2['min']:.0f} | {st2['median']:.0f} | {st2['max']:.0f} | "
                 f"{st2['median'] / st['median']:.2f}x |")
    lines.append(f"requests per tar -x: {sm['stats'][0]}")
    if "rss" in r:
        lines.append(f"\npeak daemon RSS writing {r['rss']['size'] / MiB:.0f} MiB: "
                     f"{r['rss']['peak_rss_mib']:.0f} MiB ({r['rss']['mbps']:.0f} MiB/s)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=1 << 30, help="file size (default 1G)")
    ap.add_argument("--rss-size", type=parse_size, default=4 << 30, help="RSS case file size (0: skip)")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--file-size", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=rb.ROOT / "benchmarks" / "results" / "write_bench.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("write_bench: needs root (drop_caches)")
    tmp = Path(tempfile.mkdtemp(prefix="marinfs-wbench-"))
    t0, backend = time.monotonic(), None
    try:
        backend = rb.start_backend("s3", tmp / "server")
        local = tmp / "src.bin"
        rb.write_random(local, args.size)
        r: dict[str, Any] = {"backend": "s3", "size": args.size, "reps": args.reps, "files": args.files,
                             "file_size": args.file_size}
        r["put_mbps"] = bench_put(backend, local, args.size, args.reps)
        r["cp"] = bench_cp(backend, tmp, local, args.size, args.reps)
        local.unlink()
        r["small"] = bench_small(backend, tmp, args.files, args.file_size, args.reps)
        if args.rss_size:
            r["rss"] = bench_rss(backend, tmp, args.rss_size)
        r["elapsed_s"] = round(time.monotonic() - t0, 1)
        text = report(r)
        print(text)
        r["table"] = text
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2) + "\n")
        print(f"\nresults: {args.out} ({r['elapsed_s']:.0f} s)")
    finally:
        if backend is not None:
            backend.server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
