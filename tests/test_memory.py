"""The daemon's memory stays bounded for trees of many small files (docs/caching.md, Memory).

Each small file's only chunk used to take a whole pooled 8 MiB buffer, advised into huge pages,
while the fetcher's budget counted the few KiB asked for: a cold walk over 2,000 small files took
the daemon to 4 GiB of RSS. Measured here as the daemon's peak RSS (VmHWM), on a real mount of
each backend whose daemon is a process of its own.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import Mounted, mount_backend
import tiers

KiB, MiB = 1 << 10, 1 << 20
WALKERS = 8
FILES_EACH = 200
BIG = 128 * MiB
PEAK_RSS = 300 * MiB  # issue 32's bound for any mix of walkers and big readers


@pytest.fixture(params=["local", "s3", "gcs"])
@tiers.needs("mount")
def daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mounted]:
    """A fresh mount whose daemon is a process of its own (its RSS is its own)."""
    with mount_backend(request, request.param, tmp_path) as m:
        assert m.pid is not None
        yield m


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KiB
    raise AssertionError(f"no VmHWM for PID {pid}")


def small_tree(seed: int) -> dict[str, bytes]:
    """``WALKERS`` directories of ``FILES_EACH`` files of 1-64 KiB."""
    rng = random.Random(seed)
    return {f"tree/d{d}/f{i:04d}": rng.randbytes(rng.randint(KiB, 64 * KiB))
            for d in range(WALKERS) for i in range(FILES_EACH)}


def put_all(m: Mounted, files: dict[str, bytes]) -> None:
    """Written behind the mount's back, straight to the remote: the walk is cold."""
    if m.url.startswith(("s3://", "gs://")):
        m.fs.pipe({m.remote_path(rel): data for rel, data in files.items()})
        return
    for rel, data in files.items():
        path = Path(m.remote_path(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def walk(top: Path) -> str:
    """What `find | sort | xargs cat` reads of ``top``, one file at a time in name order."""
    out = subprocess.run(f"find {top} -type f | sort | xargs cat | sha256sum", shell=True, check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return out.split()[0]


def test_small_file_walkers_beside_a_big_reader_stay_within_the_memory_bound(daemon: Mounted) -> None:
    """Eight cold walkers over 1,600 small files in parallel, beside a cold sequential read of a
    128 MiB file: every byte right, and the daemon's peak RSS under 300 MiB (4 GiB before)."""
    files = small_tree(32)
    big = os.urandom(BIG)
    put_all(daemon, {**files, "big.bin": big})
    expected = {d: hashlib.sha256(b"".join(files[k] for k in sorted(files) if k.startswith(f"tree/d{d}/"))).hexdigest()
                for d in range(WALKERS)}
    with ThreadPoolExecutor(WALKERS + 1) as pool:
        reader = pool.submit(lambda: hashlib.sha256((daemon.mnt / "big.bin").read_bytes()).hexdigest())
        walkers = {d: pool.submit(walk, daemon.mnt / "tree" / f"d{d}") for d in range(WALKERS)}
        assert {d: w.result() for d, w in walkers.items()} == expected
        assert reader.result() == hashlib.sha256(big).hexdigest()
    assert daemon.pid is not None
    peak = peak_rss(daemon.pid)
    assert peak <= PEAK_RSS, f"daemon peak RSS {peak / MiB:.0f} MiB"
