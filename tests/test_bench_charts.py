"""benchmarks/bench_charts.py on a tiny synthetic bench.py result: the numbers it draws, and the
PNGs (when matplotlib, the ``bench`` extra, is installed; CI's ``test`` extra lacks it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_charts as bc  # noqa: E402

pytestmark = pytest.mark.unit
GiB = 1 << 30


def sample(value: float, cpu: dict[str, float], nbytes: int = GiB, seconds: float = 1.0) -> dict[str, Any]:
    return {"value": value, "seconds": seconds, "nbytes": nbytes, "cpu": cpu, "extra": {}}


def run(latency_ms: float, scale: float = 1.0) -> dict[str, Any]:
    proxy = {"proxy": 0.5} if latency_ms else {}
    return {
        "config": {"size_mib": 1024, "reps": 2, "latency_ms": latency_ms},
        "versions": {"marinfs": "abc1234"},
        "header": f"marinfs bench, latency {latency_ms:g} ms, 1024 MiB, 2 reps, 2026-12-01 19:30 UTC; load",
        "rows": [{"key": "seq_cold", "group": "seq", "label": "cold sequential read 1 GiB", "unit": "MiB/s"},
                 {"key": "mmap", "group": "mmap", "label": "2,000 mmap faults", "unit": "faults/s"},
                 {"key": "write", "group": "write", "label": "write 512 MiB", "unit": "MiB/s"}],
        "samples": {
            "seq_cold": {
                "marinfs": [sample(200 * scale, {"client": 2.0, "server": 3.0, "reader": 0.5, **proxy}),
                            sample(220 * scale, {"client": 4.0, "server": 3.0, "reader": 0.5, **proxy})],
                "obstore": [sample(350 * scale, {"client": 1.0, "server": 3.0, "reader": 0.0, **proxy})],
                "s3fs-py": [sample(300 * scale, {"client": 2.0, "server": 3.0, "reader": 0.0, **proxy})],
            },
            "mmap": {
                "marinfs": [sample(2000 * scale, {"client": 0.4, "server": 0.2, "reader": 0.1}, 0, 1.0)],
                "local": [sample(10000, {"reader": 0.1}, 0, 0.2)],
            },
            "write": {"marinfs": [sample(100 * scale, {"client": 1.0, "server": 6.0, "reader": 0.3})]},
        },
        "failures": {"write": {"s3fs-fuse": ["timed out"]}},
    }


def test_the_numbers_are_the_tables() -> None:
    r = run(0)
    rows = {row["key"]: row for row in r["rows"]}
    assert bc.tools(r, "write") == ["marinfs", "s3fs-fuse"]  # a tool that only failed is still shown
    assert bc.rate(r, "seq_cold", "marinfs") == (210, 200, 220)
    assert bc.rate(r, "write", "s3fs-fuse") is None and bc.fails(r, "write", "s3fs-fuse") == ["timed out"]
    assert bc.cpu(r, rows["seq_cold"], "marinfs") == {"client": 3.0, "reader": 0.5, "server": 3.0}
    assert bc.cpu(r, rows["seq_cold"], "obstore") == {"client": 1.0, "server": 3.0}  # no reader of its own
    assert bc.cpu(r, rows["mmap"], "marinfs") == pytest.approx({"client": 200, "reader": 50, "server": 100})
    assert bc.cpu(r, rows["mmap"], "local") == pytest.approx({"client": 50})  # µs per fault, the reader's
    assert bc.best_direct(r, "seq_cold") == "obstore" and bc.best_direct(r, "mmap") is None
    assert bc.prefix(r) == "bench" and bc.prefix(run(30)) == "bench_lat30ms"
    assert bc.describe(r) == "latency 0 ms, 1024 MiB, 2 reps, 2026-12-01 19:30 UTC, marinfs abc1234"


def test_importing_it_does_not_import_matplotlib() -> None:
    code = "import sys, bench_charts; sys.exit('matplotlib' in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", check=True, timeout=60)


def test_it_draws_the_three_charts(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401 - in the test extra: `make test` installs it, so this never skips
    base, lat = tmp_path / "bench.json", tmp_path / "bench_lat30ms.json"
    base.write_text(json.dumps(run(0)))
    lat.write_text(json.dumps(run(30, scale=0.6)))
    made = bc.render([lat, base], tmp_path / "out")  # the lower latency is the base, whatever the order
    assert [p.name for p in made] == ["bench_rate.png", "bench_cpu.png", "bench_latency.png"]
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in bc.render([lat], tmp_path / "one")] == ["bench_lat30ms_rate.png", "bench_lat30ms_cpu.png"]
    with pytest.raises(ValueError, match="nothing to compare"):
        bc.render([base, base], tmp_path / "same")
