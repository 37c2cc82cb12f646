"""`marinfs cache stats|clear|warm`: inspect, empty and pre-fill a chunk cache."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from marinfs.read.chunkcache import disk_usage, lock_holder, stats_file, wipe
from marinfs.errors import MarinfsError, UsageError
from marinfs.app.mounts import live_mounts
from marinfs.config.settings import human_size

WARM_READ = 8 << 20


def only_cache_under(root: Path) -> Path:
    """The one cache directory under ``root`` (each mount with default settings has its own
    there; an older marinfs used ``root`` itself), for `cache stats|clear` without --cache-dir."""
    found = [d for d in sorted(root.iterdir()) if d.is_dir() and (d / "lock").exists()] if root.is_dir() else []
    if (root / "lock").exists():
        found.insert(0, root)
    if len(found) == 1:
        return found[0]
    if not found:
        raise UsageError(f"no marinfs cache directory under {root}; give --cache-dir DIR")
    raise UsageError(f"{len(found)} cache directories under {root} (one per mount: "
                     f"{', '.join(d.name for d in found)}); give --cache-dir DIR")


def stats(cache_dir: Path) -> dict:
    """The running daemon's counters when one uses ``cache_dir``, plus what is on disk."""
    if not cache_dir.is_dir():
        raise UsageError(f"{cache_dir} is not a marinfs cache directory")
    chunks, used = disk_usage(cache_dir)
    pid = lock_holder(cache_dir)
    data: dict = {"cache_dir": str(cache_dir), "daemon_pid": pid, "chunks_on_disk": chunks,
                  "bytes_on_disk": used}
    stats_path = stats_file(cache_dir)
    if stats_path.exists():
        published = json.loads(stats_path.read_text())
        data["live" if pid else "last_run"] = published
    return data


def format_stats(data: dict) -> str:
    lines = [f"cache dir     {data['cache_dir']}",
             f"daemon        {'PID ' + str(data['daemon_pid']) if data['daemon_pid'] else 'none running'}",
             f"on disk       {data['chunks_on_disk']} chunks, {human_size(data['bytes_on_disk'])}"]
    run = data.get("live") or data.get("last_run")
    if run and run.get("cache"):
        c = run["cache"]
        lookups = c["hits"] + c["misses"]
        ratio = f"{100 * c['hits'] / lookups:.1f}%" if lookups else "n/a"
        label = "this run" if data.get("live") else "last run"
        lines += [f"mount         {run['remote']} at {run['mountpoint']} ({label})",
                  f"used / limit  {human_size(c['bytes_used'])} / {human_size(c['bytes_limit'])}",
                  f"hits          {c['hits']}  misses {c['misses']}  (hit ratio {ratio})",
                  f"fetched       {human_size(c['bytes_fetched'])}  evictions {c['evictions']}  "
                  f"corrupt {c['corrupt']}  write failures {c['write_failures']}"]
    return "\n".join(lines)


def clear(cache_dir: Path) -> int:
    """Delete every cached chunk. Staged writes are never touched: they may be unsaved data."""
    pid = lock_holder(cache_dir)
    if pid:
        raise MarinfsError(f"{cache_dir} is in use by marinfs PID {pid}; unmount it first")
    return wipe(cache_dir)


def gc_shared(shared_dir: Path, limit: int) -> dict:
    """`marinfs cache gc --shared DIR`: what a timer runs on one node. Evicts the shared tier
    down to ``limit``, removes temporary files crashes left and leases long expired."""
    from marinfs.read.sharedcache import SharedTier, check_private

    if not shared_dir.is_dir():
        raise UsageError(f"{shared_dir} is not a directory")
    check_private(shared_dir, create=False)
    tier = SharedTier(shared_dir, limit, workers=1)
    try:
        return {"shared_dir": str(shared_dir), **tier.gc()}
    finally:
        tier.close()


def format_gc(data: dict) -> str:
    return (f"{data['shared_dir']}: {human_size(data['used_bytes'])} / {human_size(data['limit_bytes'])} "
            f"after evicting {human_size(data['evicted_bytes'])}; removed {data['tmp_removed']} leftover "
            f"temporary files, {data['leases_removed']} expired leases")


def _files(paths: list[str]) -> list[Path]:
    mounts = [e.mountpoint for e in live_mounts()]
    files: list[Path] = []
    for arg in paths:
        path = Path(os.path.abspath(arg))
        if not any(str(path) == m or str(path).startswith(m.rstrip("/") + "/") for m in mounts):
            raise UsageError(f"{arg} is not under a marinfs mount")
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{arg} does not exist")
    return files


def _read_through(path: Path, progress) -> int:  # noqa: ANN001 - a tqdm bar
    """Read a file through the mount (the daemon caches every chunk); keep no page cache."""
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, WARM_READ):
            total += len(chunk)
            progress.update(len(chunk))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return total


def warm(paths: list[str], workers: int = 4, quiet: bool = False) -> str:
    from tqdm import tqdm

    files = _files(paths)
    size = sum(p.stat().st_size for p in files)
    started = time.monotonic()
    with tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc="warming",
              disable=quiet) as progress, ThreadPoolExecutor(max_workers=workers) as pool:
        done = sum(pool.map(lambda p: _read_through(p, progress), files))
    seconds = time.monotonic() - started
    rate = done / seconds / (1 << 20) if seconds > 0 else 0.0
    return f"warmed {len(files)} files, {human_size(done)} in {seconds:.1f} s ({rate:.0f} MiB/s)"


