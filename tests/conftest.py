"""Fixtures: one behaviour suite, many backends. Each mount is torn down even on failure."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mounting import Mounted, fsspec_client, inprocess_mount, subprocess_mount

BACKENDS = ["local", "memory"]


@pytest.fixture(params=BACKENDS)
def mounted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mounted]:
    """A live mount of a fresh, empty prefix on each backend."""
    backend = request.param
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    if backend == "local":
        root = tmp_path / "remote"
        root.mkdir()
        url = str(root)
        fs, base = fsspec_client(url)
        with subprocess_mount(url, mnt, cache) as pid:
            yield Mounted(mnt=mnt, url=url, fs=fs, root=base, cache_dir=cache, pid=pid)
    elif backend == "memory":
        url = f"memory://marinfs-test-{uuid.uuid4().hex[:12]}"
        fs, base = fsspec_client(url)
        fs.mkdir(base)
        with inprocess_mount(url, mnt, cache):
            yield Mounted(mnt=mnt, url=url, fs=fs, root=base, cache_dir=cache)
    else:  # pragma: no cover
        raise ValueError(backend)
