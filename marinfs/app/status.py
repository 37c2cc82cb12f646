"""`marinfs status`: what each running mount is doing, from the counters its daemon publishes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from marinfs.read.chunkcache import stats_file
from marinfs.app.daemon import alive, state_file
from marinfs.errors import UsageError
from marinfs.app.mounts import live_mounts
from marinfs.config.settings import human_size


def collect(mountpoint: str | None = None) -> list[dict[str, Any]]:
    mounts = live_mounts()
    if mountpoint is not None:
        wanted = os.path.abspath(mountpoint)
        mounts = [m for m in mounts if m.mountpoint == wanted]
        if not mounts:
            raise UsageError(f"{mountpoint} is not a marinfs mount")
    out = []
    for entry in mounts:
        item: dict[str, Any] = {"mountpoint": entry.mountpoint, "remote": entry.remote}
        state = state_file(entry.mountpoint)
        if state.exists():
            info = json.loads(state.read_text())
            item["pid"] = info.get("pid")
            if not isinstance(item["pid"], int) or not alive(item["pid"]):
                item["problem"] = (f"its daemon is gone (PID {item['pid']} ended): the mount answers nothing; "
                                   f"`marinfs umount --lazy {entry.mountpoint}` frees it, and the next mount on its "
                                   "cache directory commits what was staged")
            if "settings" in info:  # what the daemon runs with, after file < env < flags
                item["settings"] = info["settings"]
            stats = stats_file(Path(info.get("cache_dir", "")))
            if info.get("cache_dir") and stats.exists():
                published = json.loads(stats.read_text())
                if published.get("pid") == info.get("pid"):
                    item.update({k: published[k] for k in ("published", "uptime_s", "cache", "remote_requests", "uploads", "memory", "passthrough",
                                                              "sources", "shared")
                                 if k in published})
            if "uptime_s" not in item and isinstance(info.get("started"), (int, float)):
                # Nothing published yet (the daemon publishes every 2 s): the state file's start.
                item["uptime_s"] = round(max(0.0, time.time() - info["started"]), 1)
        else:
            item["problem"] = "no daemon state (started by another user, or the daemon died)"
        out.append(item)
    return out


def format_status(items: list[dict[str, Any]]) -> str:
    if not items:
        return "no marinfs mounts"
    blocks = []
    for it in items:
        lines = [f"{it['mountpoint']}  <-  {it['remote']}"]
        if "problem" in it:
            lines.append(f"  {it['problem']}")
        if "pid" in it:
            lines.append(f"  daemon PID {it['pid']}, up {it.get('uptime_s', '?')} s")
        cache = it.get("cache")
        if cache:
            lookups = cache["hits"] + cache["misses"]
            ratio = f"{100 * cache['hits'] / lookups:.1f}%" if lookups else "n/a"
            lines.append(f"  cache {human_size(cache['bytes_used'])} / {human_size(cache['bytes_limit'])}, "
                         f"hit ratio {ratio}, {cache['evictions']} evictions")
        memory = it.get("memory")
        if memory:
            lines.append(f"  chunk memory {human_size(memory['used'] + memory['reserved'])} / "
                         f"{human_size(memory['limit'])}, buffers mapped {human_size(memory['buffers_mapped'])} "
                         f"(peak {human_size(memory['buffers_peak'])})")
        sources = it.get("sources")
        if sources:
            lines.append(f"  chunks from: local disk {human_size(sources['local'])}, shared tier "
                         f"{human_size(sources['shared'])}, bucket {human_size(sources['bucket'])}")
        shared = it.get("shared")
        if shared:
            lines.append(format_shared(shared))
        through = it.get("passthrough")
        if through:
            lines.append(f"  passthrough: {'on' if through['on'] else 'off'}, {through['opens']} opens, "
                         f"{through['files']} versions open")
        req = it.get("remote_requests")
        if req:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(req["requests"].items())) or "none"
            lines.append(f"  requests: {kinds}; in {human_size(req['bytes_in'])}, out {human_size(req['bytes_out'])}")
            if req["errors"]:
                lines.append("  errors: " + ", ".join(f"{k} {v}" for k, v in sorted(req["errors"].items())))
        up = it.get("uploads")
        if up:
            conflicts = up.get("conflicts", [])
            lines.append(f"  uploads: {len(up['pending'])} pending, {len(up['failed'])} failed, "
                         f"{len(conflicts)} conflicts")
            wb = up.get("write_back")
            if wb is not None:  # --write-back: closed files not yet in the bucket (`marinfs sync` waits for them)
                only = f" (paths {', '.join(wb['paths'])} only)" if wb.get("paths") else ""
                lines.append(f"  write-back{only}: {wb['queued']} queued or uploading, {wb['uploaded']} ended")
            lines += [format_committing(c, time.time()) for c in up.get("committing", [])]
            lines += [format_failed(f) for f in up["failed"]]
            lines += [f"    delete of {d['key']} failed ({d['error']}); tried again, and at the next start"
                      for d in up.get("failed_deletes", [])]
            lines += [f"    unfinished directory rename {r['src']} -> {r['dst']} ({r['error']}): {r['todo']}"
                      for r in up.get("renames", [])]
            lines += [f"    conflict {c['key']}: changed by someone else; our bytes are in {c['committed_as']}"
                      for c in conflicts[-10:]]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def format_shared(shared: dict[str, Any]) -> str:
    """The shared tier's line: where, its state (degraded: why), what it served and published."""
    state = shared["state"] if shared["state"] == "ok" else f"{shared['state'].upper()}: {shared.get('reason', '')}"
    return (f"  shared tier {shared['dir']}: {state}; {shared['hits']} hits, {shared['misses']} misses, "
            f"{shared['published']} published, {shared['lease_waits']} lease waits, "
            f"{shared['corrupt']} damaged, ~{human_size(shared['used_estimate'])} / {human_size(shared['limit'])}")


def format_committing(c: dict[str, Any], now: float | None) -> str:
    """A commit uploading now: its bytes acknowledged by the store so far (published every
    2 s), of its size."""
    size = c.get("size")
    of = f" of {human_size(size)}" if isinstance(size, int) else ""
    took = f", for {max(0.0, now - c['since']):.0f} s" if isinstance(now, (int, float)) and c.get("since") else ""
    return f"    committing {c['key']}: {human_size(c.get('bytes_sent') or 0)}{of} sent{took}"


def format_failed(f: dict[str, Any]) -> str:
    """One staged file that could not be committed: key, where its bytes are, how often it
    failed and why; a failure that retrying will not cure is marked so (retried quietly), a
    final one says when it is tried again (at the next start, or never)."""
    attempts = f.get("attempts", 1)
    if f.get("final"):
        retry = f.get("retry", "never")
        kind = "final: no retry can change it; " + ("never tried again" if retry == "never" else f"tried again {retry}")
    elif f.get("permanent"):
        kind = "permanent: will not pass by retrying, fix it and it is committed"
    else:
        kind = "retrying"
    error = f"; last error: {f['error']}" if f.get("error") else ""
    return (f"    failed {f['key']} ({kind}; {attempts} attempt{'s' * (attempts != 1)}{error}); "
            f"bytes kept in {f['staged']}")
