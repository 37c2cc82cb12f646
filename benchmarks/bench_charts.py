"""Charts of a ``benchmarks/bench.py`` run: rates, CPU per GiB, and 0 ms against N ms latency.

    python benchmarks/bench_charts.py RUN.json [LATENCY_RUN.json] [--out DIR]
    make bench-charts      # benchmarks/results/bench.json (+ bench_lat30ms.json) -> benchmarks/results/

With one run it writes two PNGs; with two (the one with the lower ``config.latency_ms`` is the
base, usually 0 ms) a third:

- ``bench_rate.png``: every row's median rate per tool, whiskers at min and max, marinfs in
  orange, each other tool's bar labelled with marinfs ÷ tool (the table's column).
- ``bench_cpu.png``: every row's CPU per GiB moved per tool, the medians of each process
  stacked: client (the marinfs daemon, the s3fs-fuse process, the harness for the direct
  clients, the reader for local ext4), reader (the ``dd`` / loader processes of a mount, where
  the kernel's FUSE time lands), server (SeaweedFS or fake-gcs-server), proxy (with latency).
  The mmap row moves 4 KiB pages, so per GiB means nothing there: it shows CPU µs per fault.
- ``bench_latency.png``: every row both runs hold, marinfs and the best direct client (the
  direct client with the highest median at the higher latency, and the same client at the
  lower) at both latencies, each higher-latency bar labelled with its change.

One small panel per row, each with its own axis and unit, rather than one shared axis: the rows
have different units (MiB/s; faults/s for mmap) and scales (a warm read at ~700 MiB/s beside a
random read at ~100), so one axis would either mix units or flatten the small rows. Normalizing
every row to marinfs ÷ tool would share an axis, but it hides the absolute rates the ratios
come from and leaves nothing to draw for rows marinfs runs alone; so the panels keep the
rates and the bars carry the ratio as a label.

A run whose base has ``config.latency_ms`` > 0 names its files after it
(``bench_lat30ms_rate.png``), as bench.py names its JSON, so a latency run's charts do not
overwrite the 0 ms run's. The titles give latency, size, repetitions, date and marinfs version
from the JSON; when two runs' marinfs versions or sizes differ, the latency chart says so.

matplotlib (the ``bench`` extra) is imported only when a chart is drawn: importing this module
needs the standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
# bench.py's TOOLS and LABELS (not imported: bench.py imports the servers and marinfs).
TOOLS = ("marinfs", "obstore", "s3fs-py", "gcsfs", "s3fs-fuse", "rclone", "runai", "local")
LABELS = {"marinfs": "marinfs", "obstore": "obstore (direct)", "s3fs-py": "python s3fs (direct)",
          "gcsfs": "gcsfs (direct)", "s3fs-fuse": "s3fs-fuse", "rclone": "rclone mount",
          "runai": "Run:ai streamer (direct)", "local": "local ext4"}
DIRECT = ("obstore", "s3fs-py", "gcsfs")  # in the harness's own process: no reader apart from it
ROLES = ("client", "reader", "server", "proxy")
ROLE_COLORS = {"client": "tab:blue", "reader": "tab:cyan", "server": "tab:gray", "proxy": "tab:olive"}
MARINFS_COLOR, OTHER_COLOR = "tab:orange", "tab:blue"
DPI = 110

Run = dict[str, Any]


# -- the numbers (no matplotlib) -------------------------------------------------------------------
def load(path: Path) -> Run:
    return json.loads(Path(path).read_text())


def latency(run: Run) -> float:
    return float(run.get("config", {}).get("latency_ms") or 0)


def prefix(run: Run) -> str:
    """``bench`` for a 0 ms run, ``bench_lat30ms`` for 30 ms: bench.py's JSON names."""
    lat = latency(run)
    return f"bench_lat{lat:g}ms" if lat else "bench"


def tools(run: Run, row: str) -> list[str]:
    """The row's tools with samples or failures, in bench.py's order (unknown ones last)."""
    seen = list(run.get("samples", {}).get(row, {})) + list(run.get("failures", {}).get(row, {}))
    return sorted(dict.fromkeys(seen), key=lambda t: TOOLS.index(t) if t in TOOLS else len(TOOLS))


def label(tool: str) -> str:
    return LABELS.get(tool, tool)


def rate(run: Run, row: str, tool: str) -> tuple[float, float, float] | None:
    """Median, min and max of the tool's rate in the row, or None without a sample."""
    vals = [s["value"] for s in run.get("samples", {}).get(row, {}).get(tool, []) if s.get("value") is not None]
    if not vals:
        return None
    return statistics.median(vals), min(vals), max(vals)


def fails(run: Run, row: str, tool: str) -> list[str]:
    return list(run.get("failures", {}).get(row, {}).get(tool, []))


def per_unit(s: dict[str, Any], role: str, unit: str) -> float | None:
    """One sample's CPU of one process: seconds per GiB moved (bench.py's ``Sample.per_gib``),
    or for faults/s rows, µs per fault."""
    cpu = s.get("cpu", {})
    if role not in cpu:
        return None
    if unit == "faults/s":
        faults = (s.get("value") or 0) * (s.get("seconds") or 0)
        return cpu[role] / faults * 1e6 if faults else None
    return cpu[role] / (s["nbytes"] / GiB) if s.get("nbytes") else None


def cpu(run: Run, row: dict[str, Any], tool: str) -> dict[str, float]:
    """The tool's median CPU per process in the row, as the table gives it: the client, falling
    back to the reader for local ext4 (its only process); the reader only for a mount."""
    ss = run.get("samples", {}).get(row["key"], {}).get(tool, [])
    out: dict[str, float] = {}
    for role in ROLES:
        if role == "reader" and (tool in DIRECT or tool == "local"):
            continue
        src = "reader" if role == "client" and ss and all("client" not in s.get("cpu", {}) for s in ss) else role
        xs = [x for x in (per_unit(s, src, row["unit"]) for s in ss) if x is not None]
        if xs:
            out[role] = statistics.median(xs)
    return out


def best_direct(run: Run, row: str) -> str | None:
    """The direct client with the highest median rate in the row, or None."""
    cands = [(r[0], t) for t in tools(run, row) if t in DIRECT and (r := rate(run, row, t))]
    return max(cands)[1] if cands else None


def describe(run: Run) -> str:
    """Latency, size, repetitions, date (from the header) and marinfs version of a run."""
    c = run.get("config", {})
    m = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d(?: [A-Z]+)?", run.get("header", ""))
    parts = [f"latency {latency(run):g} ms", f"{c.get('size_mib', '?')} MiB", f"{c.get('reps', '?')} reps"]
    if m:
        parts.append(m.group(0))
    if run.get("versions", {}).get("marinfs"):
        parts.append(f"marinfs {run['versions']['marinfs']}")
    return ", ".join(parts)


def fmt(v: float) -> str:
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def rows_of(run: Run) -> list[dict[str, Any]]:
    return [r for r in run.get("rows", []) if tools(run, r["key"])]


# -- drawing ---------------------------------------------------------------------------------------
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels(plt: Any, heights: list[int], width: float = 14) -> tuple[Any, list[Any]]:
    """Two columns of panels, the rows in reading order, each grid row as tall as its taller
    panel's bar count; every panel gets that many bar slots, so bars are equally thick."""
    n = len(heights)
    nrows = (n + 1) // 2
    slots = [max(heights[2 * (i // 2):2 * (i // 2) + 2]) for i in range(n)]
    ratios = [slots[2 * i] + 1.6 for i in range(nrows)]
    fig = plt.figure(figsize=(width, 0.32 * sum(ratios) + 1.4))
    gs = fig.add_gridspec(nrows, 2, height_ratios=ratios)
    axes = [fig.add_subplot(gs[i // 2, i % 2]) for i in range(n)]
    for ax, k in zip(axes, slots, strict=True):
        ax.set_ylim(-0.5, k - 0.5)
        ax.marinfs_slots = k  # the y of the top bar is slots - 1
    return fig, axes


def _ys(ax: Any, n: int) -> list[int]:
    """The y of n bars from the top of the panel down."""
    return [ax.marinfs_slots - 1 - i for i in range(n)]


def _bold_marinfs(ax: Any, names: list[str]) -> None:
    for tick, name in zip(ax.get_yticklabels(), names, strict=True):
        if name.startswith("marinfs"):
            tick.set_fontweight("bold")


def _rate_axes(ax: Any, row: dict[str, Any], ys: Any, names: list[str], top: float) -> None:
    """A rate panel's tools down the side (marinfs in bold), its unit along the bottom, room on
    the right for the bars' labels, the row as its title."""
    ax.set_yticks(ys, names, fontsize=8)
    _bold_marinfs(ax, names)
    ax.set_xlim(0, top * 1.45)
    ax.set_xlabel(f"{row['unit']}, higher is better", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(row["label"], fontsize=9)


def _finish(plt: Any, fig: Any, title: str, path: Path, bottom: float = 0) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def rate_chart(run: Run, path: Path) -> Path:
    plt = _plt()
    rows = rows_of(run)
    fig, axes = _panels(plt, [len(tools(run, r["key"])) for r in rows])
    for ax, row in zip(axes, rows, strict=True):
        ts = tools(run, row["key"])
        mine = rate(run, row["key"], "marinfs")
        top = max((r[2] for t in ts if (r := rate(run, row["key"], t))), default=1.0)
        ys = _ys(ax, len(ts))
        for y, t in zip(ys, ts, strict=True):
            r = rate(run, row["key"], t)
            nf = len(fails(run, row["key"], t))
            if r is None:
                ax.text(0, y, f" FAIL: {fails(run, row['key'], t)[0][:60]}", va="center", fontsize=7, color="crimson")
                continue
            m, lo, hi = r
            ax.barh(y, m, 0.7, xerr=[[m - lo], [hi - m]], capsize=3,
                    color=MARINFS_COLOR if t == "marinfs" else OTHER_COLOR)
            text = fmt(m)
            if t != "marinfs" and mine:
                text += f"   marinfs ×{mine[0] / m:.2f}"
            if nf:
                text += f"   ({nf} FAIL)"
            ax.text(hi + top * 0.02, y, text, va="center", fontsize=7)
        _rate_axes(ax, row, ys, [label(t) for t in ts], top)
    reps = run.get("config", {}).get("reps", "?")
    return _finish(plt, fig, f"marinfs bench: rate per row, median of {reps} (whiskers: min–max)\n{describe(run)}",
                   path)


def cpu_chart(run: Run, path: Path) -> Path:
    plt = _plt()
    rows = rows_of(run)
    fig, axes = _panels(plt, [len(tools(run, r["key"])) for r in rows])
    used: set[str] = set()
    for ax, row in zip(axes, rows, strict=True):
        ts = tools(run, row["key"])
        per = {t: cpu(run, row, t) for t in ts}
        top = max((sum(c.values()) for c in per.values()), default=1.0) or 1.0
        ys = _ys(ax, len(ts))
        for y, t in zip(ys, ts, strict=True):
            c = per[t]
            if not c:
                ax.text(0, y, " FAIL" if fails(run, row["key"], t) else " —", va="center", fontsize=7,
                        color="crimson")
                continue
            left = 0.0
            for role in ROLES:
                if role in c:
                    ax.barh(y, c[role], 0.7, left=left, color=ROLE_COLORS[role],
                            edgecolor="black" if t == "marinfs" else "none", linewidth=0.8)
                    left += c[role]
                    used.add(role)
            text = f"client {fmt(c['client'])}" if "client" in c else ""
            text += f", total {fmt(left)}" if len(c) > 1 else ""
            ax.text(left + top * 0.02, y, text, va="center", fontsize=7)
        names = [label(t) for t in ts]
        ax.set_yticks(ys, names, fontsize=8)
        _bold_marinfs(ax, names)
        ax.set_xlim(0, top * 1.5)
        unit = "CPU µs per fault" if row["unit"] == "faults/s" else "CPU-s per GiB"
        ax.set_xlabel(f"{unit}, lower is better", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(row["label"], fontsize=9)
    plt_handles = [plt.Rectangle((0, 0), 1, 1, color=ROLE_COLORS[r]) for r in ROLES if r in used]
    fig.legend(plt_handles, [r for r in ROLES if r in used], loc="lower center", fontsize=8, ncol=len(plt_handles))
    reps = run.get("config", {}).get("reps", "?")
    title = (f"marinfs bench: CPU per row and process, medians of {reps} stacked (marinfs outlined)\n"
             "client: marinfs daemon / s3fs-fuse / the harness for direct clients / the reader for local ext4; "
             "reader: dd or loader of a mount\n" + describe(run))
    return _finish(plt, fig, title, path, bottom=0.03)


def latency_chart(base: Run, lat: Run, path: Path) -> Path:
    plt = _plt()
    b, n = latency(base), latency(lat)
    keys = {r["key"] for r in rows_of(lat)}
    rows = [r for r in rows_of(base) if r["key"] in keys]
    plans = []
    for row in rows:
        bars = [("marinfs", "marinfs")]
        d = best_direct(lat, row["key"]) or best_direct(base, row["key"])
        if d:
            bars.append((d, label(d)))
        plans.append(bars)
    fig, axes = _panels(plt, [2 * len(p) for p in plans])
    for ax, row, bars in zip(axes, rows, plans, strict=True):
        top = max((r[2] for run in (base, lat) for t, _ in bars if (r := rate(run, row["key"], t))), default=1.0)
        names, y = [], ax.marinfs_slots - 1
        for t, name in bars:
            r0 = rate(base, row["key"], t)
            for run, ms in ((base, b), (lat, n)):
                r = rate(run, row["key"], t)
                names.append(f"{name}, {ms:g} ms")
                color = MARINFS_COLOR if t == "marinfs" else OTHER_COLOR
                if r is None:
                    ax.text(0, y, " FAIL" if fails(run, row["key"], t) else " —", va="center", fontsize=7,
                            color="crimson")
                else:
                    m, lo, hi = r
                    ax.barh(y, m, 0.7, xerr=[[m - lo], [hi - m]], capsize=3, color=color,
                            alpha=0.45 if run is base else 1.0)
                    text = fmt(m)
                    if run is lat and r0:
                        text += f"   {(m / r0[0] - 1) * 100:+.0f}% vs {b:g} ms"
                    ax.text(hi + top * 0.02, y, text, va="center", fontsize=7)
                y -= 1
        _rate_axes(ax, row, _ys(ax, 2 * len(bars)), names, top)
    differ = [k for k, v in (("marinfs", lambda r: r.get("versions", {}).get("marinfs")),
                             ("size", lambda r: r.get("config", {}).get("size_mib"))) if v(base) != v(lat)]
    title = (f"marinfs bench: {b:g} ms (light) against {n:g} ms (dark) first-byte latency, medians "
             f"(whiskers: min–max); direct: the best direct client at {n:g} ms\n"
             f"{describe(base)}  |  {describe(lat)}")
    if differ:
        title += f"\nthe two runs differ in {' and '.join(differ)}: not one code version"
    return _finish(plt, fig, title, path)


def charts(base: Run, lat: Run | None, outdir: Path) -> list[Path]:
    """The PNGs of one run (and of its latency run), written to ``outdir``."""
    outdir = Path(outdir)
    p = prefix(base)
    made = [rate_chart(base, outdir / f"{p}_rate.png"), cpu_chart(base, outdir / f"{p}_cpu.png")]
    if lat is not None:
        made.append(latency_chart(base, lat, outdir / f"{p}_latency.png"))
    return made


def render(paths: list[Path], outdir: Path) -> list[Path]:
    """Charts from one or two bench.py JSON files: the lower latency is the base."""
    runs = sorted((load(p) for p in paths), key=latency)
    if not 1 <= len(runs) <= 2:
        raise ValueError(f"one or two runs, not {len(runs)}")
    if len(runs) == 2 and latency(runs[0]) == latency(runs[1]):
        raise ValueError(f"both runs have latency {latency(runs[0]):g} ms: nothing to compare")
    return charts(runs[0], runs[1] if len(runs) == 2 else None, outdir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="bench.py JSON: a run, and optionally a run with "
                    "another --latency-ms")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="directory for the PNGs "
                    "(benchmarks/results)")
    a = ap.parse_args(argv)
    try:
        made = render(a.runs, a.out)
    except ValueError as exc:
        sys.exit(f"bench_charts: {exc}")
    for p in made:
        print(p)


if __name__ == "__main__":
    main()
