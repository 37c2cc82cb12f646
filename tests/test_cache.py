"""The read path through real mounts: chunk cache, readahead, kernel caching, `marinfs cache`.

In-process mounts, so the test reads the daemon's own counters: GETs are exact where
timings are noisy."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkfiles import flip_byte, records
from conftest import object_store
from mounting import MARINFS, fsspec_client, inprocess_mount, subprocess_mount
import tiers

pytestmark = pytest.mark.mount  # every test here mounts

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 1 * MiB  # small chunks keep CI sizes small while exercising many chunks


@dataclass
class Remote:
    url: str
    client: Any
    root: str
    options: dict

    def put(self, rel: str, data: bytes) -> None:
        path = f"{self.root}/{rel}"
        self.client.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # local: real parent dirs
        self.client.pipe_file(path, data)


@pytest.fixture(params=["local", "s3", "gcs"])
@tiers.needs("mount")
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Remote:
    if request.param == "local":
        (tmp_path / "remote").mkdir()
        url, options = str(tmp_path / "remote"), {}
    else:
        url, options, _ = object_store(request, request.param)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False} if options else None)
    return Remote(url, client, root, options)


@contextlib.contextmanager
def mount(remote: Remote, tmp_path: Path, name: str = "mnt", **kwargs: Any) -> Iterator[Any]:
    kwargs.setdefault("cache_size", 256 * MiB)
    kwargs.setdefault("chunk_size", CHUNK)
    with inprocess_mount(remote.url, tmp_path / name, tmp_path / "cache", storage_options=remote.options or None,
                         **kwargs) as core:
        yield core


def gets(core: Any) -> int:
    return core.remote.stats.count("get")


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_in_child(path: Path) -> bytes:
    # A child process: a page fault or read served by this very process must not hold the GIL.
    return subprocess.run(["cat", str(path)], capture_output=True, check=True, timeout=120).stdout


def test_cached_reads_are_byte_exact_and_survive_a_remount(remote: Remote, tmp_path: Path) -> None:
    data = os.urandom(5 * MiB + 333)
    remote.put("f.bin", data)
    with mount(remote, tmp_path) as core:
        assert read_in_child(tmp_path / "mnt/f.bin") == data
        assert gets(core) == 6  # one ranged GET per chunk, no byte fetched twice
        assert core.fetcher.settle()  # chunks are written to disk by their own threads
        assert core.fetcher.cache.stats.bytes_fetched == len(data)
        drop_page_cache()
        assert read_in_child(tmp_path / "mnt/f.bin") == data
        assert gets(core) == 6  # warm: from the chunk cache
    with mount(remote, tmp_path) as core:  # a new daemon over the same cache dir
        assert read_in_child(tmp_path / "mnt/f.bin") == data
        assert gets(core) == 0


def test_remote_overwrite_is_seen_after_the_ttl_never_old_chunks(remote: Remote, tmp_path: Path) -> None:
    old, new = os.urandom(3 * MiB), os.urandom(3 * MiB)
    remote.put("f", old)
    with mount(remote, tmp_path, metadata_ttl=0.3) as core:
        assert read_in_child(tmp_path / "mnt/f") == old
        remote.put("f", new)  # another node rewrites it (same size)
        if not remote.url.startswith(("s3", "gs")):
            os.utime(Path(remote.root) / "f", ns=(1, 10**18))  # a distinct local version
        import time

        time.sleep(1.6)  # our TTL (0.3 s) plus the kernel's attribute timeout (1 s)
        assert read_in_child(tmp_path / "mnt/f") == new
        assert core.fetcher.settle()  # chunks are written to disk by their own threads
        assert core.fetcher.cache.snapshot()["chunks"] == 6  # both versions, keyed apart


def test_flipped_byte_in_a_cached_chunk_is_refetched(remote: Remote, tmp_path: Path) -> None:
    data = os.urandom(2 * MiB)
    remote.put("f", data)
    with mount(remote, tmp_path):
        assert read_in_child(tmp_path / "mnt/f") == data
    flip_byte(records(tmp_path / "cache", 0)[0], 1000)
    with mount(remote, tmp_path) as core:
        drop_page_cache()
        assert read_in_child(tmp_path / "mnt/f") == data
        assert core.fetcher.cache.stats.corrupt == 1 and gets(core) == 1


def test_reading_three_times_the_cache_size_never_exceeds_it(remote: Remote, tmp_path: Path) -> None:
    data = os.urandom(12 * MiB)
    remote.put("big", data)
    with mount(remote, tmp_path, cache_size=4 * MiB) as core:
        cache = core.fetcher.cache
        done = threading.Event()
        peak = [0]

        def watch() -> None:
            while not done.is_set():
                cache.check_invariants()
                peak[0] = max(peak[0], cache.used)
                # Not a spin: that held the GIL and the cache's lock against the mount's own
                # threads (32 s instead of 3 on a busy CI machine). A chunk takes longer than this.
                done.wait(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert hashlib.sha256(read_in_child(tmp_path / "mnt/big")).digest() == hashlib.sha256(data).digest()
        finally:
            done.set()
            watcher.join()
        assert core.fetcher.settle()
        assert peak[0] <= 4 * MiB and cache.used <= 4 * MiB
        # blocks the data files take: what eviction freed (holes punched) is not counted
        on_disk = sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache/data").rglob("*") if p.is_file())
        assert on_disk <= 4 * MiB + 64 * KiB and cache.stats.evictions >= 4  # (+ the extent tree's blocks; a chunk that finds every slot
        # reserved by concurrent fetches is served without being cached: the limit wins)


def test_concurrent_readers_fetch_each_chunk_once(remote: Remote, tmp_path: Path) -> None:
    data = os.urandom(8 * MiB)
    remote.put("shared", data)
    with mount(remote, tmp_path) as core:
        procs = [subprocess.Popen(["sha256sum", str(tmp_path / "mnt/shared")], stdout=subprocess.PIPE)
                 for _ in range(8)]
        outs = [p.communicate(timeout=120)[0].split()[0].decode() for p in procs]
        assert outs == [hashlib.sha256(data).hexdigest()] * 8
        assert gets(core) == 8  # 8 chunks, each fetched once for 8 readers


MMAP_RANDOM = """
import mmap, random, sys, hashlib
random.seed(7)
with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    pages = sorted(random.sample(range(len(m) // 4096), 300))
    print(hashlib.sha256(b"".join(m[p * 4096:(p + 1) * 4096] for p in pages)).hexdigest())
"""


def test_mmap_random_pages_of_a_64_mib_file(remote: Remote, tmp_path: Path) -> None:
    if remote.url.startswith("gs"):
        pytest.skip("64 MiB objects are slow on the GCS emulator; covered on local and S3")
    import random

    data = os.urandom(64 * MiB)
    remote.put("weights.safetensors", data)
    random.seed(7)
    pages = sorted(random.sample(range(len(data) // 4096), 300))
    expect = hashlib.sha256(b"".join(data[p * 4096:(p + 1) * 4096] for p in pages)).hexdigest()
    with mount(remote, tmp_path, chunk_size=8 * MiB):
        out = subprocess.run([sys.executable, "-c", MMAP_RANDOM, str(tmp_path / "mnt/weights.safetensors")],
                             capture_output=True, text=True, check=True, timeout=120)
        assert out.stdout.strip() == expect


def test_cache_warm_then_read_costs_no_gets(remote: Remote, tmp_path: Path) -> None:
    for i in range(3):
        remote.put(f"tree/part{i}", os.urandom(3 * MiB))
    with mount(remote, tmp_path) as core:
        out = subprocess.run([*MARINFS, "cache", "warm", str(tmp_path / "mnt/tree"), "--quiet"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("warmed 3 files, 9.0 MiB")
        before = gets(core)
        assert before == 9
        drop_page_cache()
        for i in range(3):
            read_in_child(tmp_path / f"mnt/tree/part{i}")
        assert gets(core) == before


def test_full_cache_disk_degrades_to_uncached_reads(tiny_tmpfs: Path, tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    data = os.urandom(6 * MiB)
    (tmp_path / "remote/f").write_bytes(data)
    with inprocess_mount(str(tmp_path / "remote"), tmp_path / "mnt", tiny_tmpfs, cache_size=64 * MiB,
                         chunk_size=CHUNK) as core:
        assert read_in_child(tmp_path / "mnt/f") == data
        assert core.fetcher.cache.stats.write_failures >= 1
        core.fetcher.cache.check_invariants()


def test_cache_cli_stats_clear_and_bad_input(tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote/f").write_bytes(os.urandom(2 * MiB))
    cache_dir = tmp_path / "cache"
    with inprocess_mount(str(tmp_path / "remote"), tmp_path / "mnt", cache_dir, cache_size=64 * MiB,
                         chunk_size=CHUNK):
        read_in_child(tmp_path / "mnt/f")
        busy = subprocess.run([*MARINFS, "cache", "clear", "--cache-dir", str(cache_dir)],
                              capture_output=True, text=True)
        assert busy.returncode == 1 and "in use" in busy.stderr
    out = subprocess.run([*MARINFS, "cache", "stats", "--cache-dir", str(cache_dir), "--json"],
                         capture_output=True, text=True, check=True)
    assert '"chunks_on_disk": 2' in out.stdout
    out = subprocess.run([*MARINFS, "cache", "clear", "--cache-dir", str(cache_dir)],
                         capture_output=True, text=True, check=True)
    assert "removed 2 chunks" in out.stdout
    bad = subprocess.run([*MARINFS, "cache", "warm", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not under a marinfs mount" in bad.stderr
    bad = subprocess.run([*MARINFS, "cache", "stats", "--cache-dir", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_kernel_keeps_its_page_cache_while_the_version_is_unchanged(tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    data = os.urandom(4 * MiB)
    (tmp_path / "remote/f").write_bytes(data)
    with inprocess_mount(str(tmp_path / "remote"), tmp_path / "mnt", tmp_path / "cache", cache_size=64 * MiB,
                         chunk_size=CHUNK) as core:
        assert read_in_child(tmp_path / "mnt/f") == data
        hits = core.fetcher.cache.stats.hits
        assert read_in_child(tmp_path / "mnt/f") == data
        assert core.fetcher.cache.stats.hits == hits  # the second read never reached us


def test_write_then_read_back_through_the_cache(remote: Remote, tmp_path: Path) -> None:
    data = os.urandom(3 * MiB + 5)
    with mount(remote, tmp_path):
        (tmp_path / "mnt/w.bin").write_bytes(data)
        drop_page_cache()
        assert read_in_child(tmp_path / "mnt/w.bin") == data
    assert remote.client.cat_file(f"{remote.root}/w.bin") == data


def test_a_libfuse_thread_keeps_its_python_state_between_requests(tmp_path: Path) -> None:
    """Each libfuse worker thread keeps one Python thread state (fuse_ops._Fuse._wrapper):
    without it every request made and freed a fresh one, and a thread-local set in one request
    was gone by the next."""
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote/f").write_bytes(os.urandom(64 * 4096))
    local = threading.local()
    seen: list[int] = []
    with inprocess_mount(str(tmp_path / "remote"), tmp_path / "mnt", tmp_path / "cache") as core:
        real = core.read_into

        def counting(fh: int, dest: memoryview, offset: int) -> int:
            local.calls = getattr(local, "calls", 0) + 1
            seen.append(local.calls)
            return real(fh, dest, offset)

        core.read_into = counting
        fd = os.open(tmp_path / "mnt/f", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one request per pread, no readahead
            for page in range(0, 64, 2):
                assert len(os.pread(fd, 4096, page * 4096)) == 4096
        finally:
            os.close(fd)
    assert len(seen) >= 32
    assert max(seen) > 1, "every request ran in a fresh Python thread state"


HOLD_OPEN = """
import hashlib, sys
with open(sys.argv[1], "rb") as f:
    first = f.read(4096)
    print("open", flush=True)
    sys.stdin.readline()  # the test changes the object meanwhile
    print(hashlib.sha256(first + f.read()).hexdigest(), flush=True)
"""


def test_a_file_cached_whole_is_read_by_the_kernel_itself(remote: Remote, tmp_path: Path) -> None:
    """Passthrough: once the chunk cache holds a version whole, later opens of it are read (and
    mapped) by the kernel from its data file, no read reaching the daemon; a handle kept open
    reads its own version to the end while another node rewrites the object, and the new
    version is read through the daemon, then passed through in turn."""
    from marinfs.fuse.ops import LIBFUSE_PASSTHROUGH

    if not LIBFUSE_PASSTHROUGH:
        pytest.skip("libfuse < 3.17 here: no passthrough (make libfuse builds it)")
    data, new = os.urandom(3 * MiB + 333), os.urandom(2 * MiB + 5)
    remote.put("m.bin", data)
    path = tmp_path / "mnt/m.bin"
    with mount(remote, tmp_path, metadata_ttl=0.3) as core:
        assert core.backings is not None, "the kernel and libfuse agreed to no passthrough"
        assert read_in_child(path) == data
        assert core.fetcher.settle()

        def passed_through() -> bool:  # close(2) returns before the daemon sees the release
            return read_in_child(path) == data and core.kernel.passthrough_opens > 0

        eventually(passed_through)
        cache = core.fetcher.cache
        before = (cache.stats.hits, cache.stats.misses, gets(core))
        drop_page_cache()
        assert read_in_child(path) == data
        out = subprocess.run([sys.executable, "-c", MMAP_RANDOM_ANY, str(path)],
                             capture_output=True, text=True, check=True, timeout=120)
        assert out.stdout.strip() == hashlib.sha256(b"".join(data[p * 4096:(p + 1) * 4096]
                                                             for p in pages_of(len(data)))).hexdigest()
        assert (cache.stats.hits, cache.stats.misses, gets(core)) == before  # no read reached the daemon
        # O_DIRECT beside it, unaligned: read through the daemon (the backing would refuse it)
        direct = subprocess.run(["dd", f"if={path}", "iflag=direct", "bs=7777", "status=none"],
                                capture_output=True, timeout=120)
        assert direct.returncode == 0 and direct.stdout == data, direct.stderr

        holder = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, str(path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdin is not None
            assert holder.stdout.readline() == "open\n"
            assert core.fetcher.cache.pinned() == 1
            remote.put("m.bin", new)  # another node rewrites it
            if not remote.url.startswith(("s3", "gs")):
                os.utime(Path(remote.root) / "m.bin", ns=(1, 10**18))
            time.sleep(1.6)  # our TTL and the kernel's attribute timeout
            assert read_in_child(path) == new  # through the daemon, beside the passthrough handle
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == hashlib.sha256(data).hexdigest()  # its own version, whole
        finally:
            holder.kill()
            holder.wait()
        assert core.fetcher.settle()
        opens = core.kernel.passthrough_opens
        eventually(lambda: read_in_child(path) == new and core.kernel.passthrough_opens > opens)
        eventually(lambda: core.fetcher.cache.pinned() == 0)


MMAP_RANDOM_ANY = """
import mmap, random, sys, hashlib
with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    random.seed(11)
    pages = sorted(random.sample(range(len(m) // 4096), 200))
    print(hashlib.sha256(b"".join(m[p * 4096:(p + 1) * 4096] for p in pages)).hexdigest())
"""


def pages_of(size: int) -> list[int]:
    import random

    random.seed(11)
    return sorted(random.sample(range(size // 4096), 200))


def test_after_a_restart_a_file_cached_whole_is_passed_through_once_checked(remote: Remote, tmp_path: Path) -> None:
    """A restarted daemon keeps its chunk cache but has checked none of it: the first open of a
    file cached whole reads through the daemon, here one page of it, while the cache checks the
    file's checksums; later opens pass through, with no byte fetched again."""
    from marinfs.fuse.ops import LIBFUSE_PASSTHROUGH

    if not LIBFUSE_PASSTHROUGH:
        pytest.skip("libfuse < 3.17 here: no passthrough (make libfuse builds it)")
    data = os.urandom(3 * MiB + 333)
    remote.put("m.bin", data)
    path = tmp_path / "mnt/m.bin"
    with mount(remote, tmp_path) as core:
        assert read_in_child(path) == data
        assert core.fetcher.settle()
    with mount(remote, tmp_path) as core:
        page = subprocess.run(["dd", f"if={path}", "bs=4096", "skip=300", "count=1", "status=none"],
                              capture_output=True, check=True, timeout=120).stdout
        assert page == data[300 * 4096:301 * 4096] and core.kernel.passthrough_opens == 0
        eventually(lambda: read_in_child(path) == data and core.kernel.passthrough_opens > 0)
        assert gets(core) == 0


def eventually(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def _libfuse_314() -> str | None:
    from marinfs.fuse.libfuse import candidates

    return next((p for p in candidates() if p.endswith(".so.3")), None)


@pytest.mark.parametrize("how", ["libfuse 3.14", "--no-passthrough", "on"])
@tiers.needs("mount")
def test_a_daemon_passes_files_through_only_where_it_can_and_is_let(tmp_path: Path, how: str) -> None:
    """``marinfs mount`` on a libfuse without passthrough (Debian 12's 3.14), or with
    ``--no-passthrough``, reads every file through the daemon as before; where libfuse and the
    kernel have it, files the cache holds whole are passed through. ``marinfs status`` says which."""
    from marinfs.fuse.ops import LIBFUSE_PASSTHROUGH

    env, extra = {}, []
    if how == "libfuse 3.14":
        old = _libfuse_314()
        if old is None:
            pytest.skip("no libfuse3.so.3 on this machine")
        env["FUSE_LIBRARY_PATH"] = old
    elif how == "--no-passthrough":
        extra.append("--no-passthrough")
    elif not LIBFUSE_PASSTHROUGH:
        pytest.skip("libfuse < 3.17 here: no passthrough (make libfuse builds it)")
    (tmp_path / "remote").mkdir()
    data = os.urandom(2 * MiB + 7)
    (tmp_path / "remote/f").write_bytes(data)
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(tmp_path / "remote"), mnt, tmp_path / "cache", "--chunk-size", "1M", *extra, env=env):
        for _ in range(6):
            assert read_in_child(mnt / "f") == data
            time.sleep(0.2)  # (the release reaches the daemon after close returns)
        stats = tmp_path / "cache/stats.json"

        def published() -> Any:
            return json.loads(stats.read_text()).get("passthrough") if stats.exists() else None

        eventually(lambda: published() is not None and (how != "on" or published()["opens"] > 0), timeout=15)
        through = published()
        status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True, timeout=60).stdout
        if how == "on":
            assert through["on"] and through["opens"] >= 1
            assert "passthrough: on" in status
        else:
            assert through == {"on": False, "opens": 0, "files": 0}
            assert "passthrough: off" in status
