"""OS thread names: marinfs's threads are told apart by ``top -H``, ``ps -L`` and perf."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from marinfs.read.reader import ChunkFetcher
from marinfs.threadnames import set_os_name, start_thread


def _comm(tid: int | None = None) -> str:
    tid = threading.get_native_id() if tid is None else tid
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def _names() -> set[str]:
    names = set()
    for t in os.listdir("/proc/self/task"):
        try:
            names.add(_comm(int(t)))
        except OSError:  # that thread ended meanwhile
            pass
    return names


@pytest.mark.unit
def test_a_thread_is_named_for_the_os_cut_to_what_the_kernel_keeps() -> None:
    got: list[str] = []

    def run() -> None:
        set_os_name("a-long-thread-name-of-marinfs")
        got.append(_comm())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == ["a-long-thread-n"]  # 15 bytes: TASK_COMM_LEN - 1


@pytest.mark.unit
def test_a_started_thread_has_its_name_for_python_and_the_os() -> None:
    got: list[tuple[str, str, int]] = []
    t = start_thread(lambda n: got.append((threading.current_thread().name, _comm(), n)), "marinfs-drain", 7)
    t.join()
    assert t.daemon and got == [("marinfs-drain", "marinfs-drain", 7)]


@pytest.mark.unit
def test_the_fetchers_threads_carry_their_names_at_the_os_level() -> None:
    fetcher = ChunkFetcher(lambda key, start, end, version: b"", None)
    try:
        seen = {pool: pool.submit(_comm).result()
                for pool in (fetcher._pool, fetcher._split_pool, fetcher._writer)}
    finally:
        fetcher.close()
    assert [n.rsplit("_", 1)[0] for n in seen.values()] == ["prefetch", "demand", "cache-write"]


@pytest.mark.mount
def test_libfuse_request_threads_are_named_fuse(tmp_path: Path) -> None:
    from mounting import inprocess_mount

    (tmp_path / "remote").mkdir()
    (tmp_path / "remote/f").write_bytes(b"x" * 4096)
    with inprocess_mount(str(tmp_path / "remote"), tmp_path / "mnt", tmp_path / "cache", cache_size=64 << 20):
        assert (tmp_path / "mnt/f").read_bytes() == b"x" * 4096  # served by a libfuse thread of this process
        assert "fuse" in _names()
