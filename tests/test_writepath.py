"""The write path: parts sent while a file is written, conditional commits (no blind
overwrite), the order of commits seen from another client, and a remote that goes away
during an upload."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import random
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from conftest import object_store
from faults import TcpProxy
from marinfs.errors import FsError
from marinfs.core import Filesystem
from marinfs.objects import ABSENT, PosixAttrs
from marinfs.remote import Remote, RemoteSettings
from marinfs.remote.parts import PartStream
from mounting import MARINFS, daemon_pid, fsspec_client, staging_entries, subprocess_mount

MiB = 1 << 20


# -- the part streamer, against a fake session ---------------------------------------------------
class FakeSession:
    """Records what a multipart (ordered=False) or resumable (ordered=True) upload received."""

    def __init__(self, part_size: int, ordered: bool = False, delay: float = 0.0,
                 fail_part: int | None = None) -> None:
        self.part_size, self.ordered, self.delay, self.fail_part = part_size, ordered, delay, fail_part
        self.parts: dict[int, bytes] = {}
        self.sends: list[int] = []
        self.completed: bytes | None = None
        self.aborted = False
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def send(self, index: int, data: bytes, total: int | None = None) -> None:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.delay)
            if index == self.fail_part:
                raise ConnectionError("injected part failure")
            if self.ordered:
                assert index == len(self.parts) and index not in self.parts, "resumable chunks go in order"
            with self._lock:
                self.parts[index] = data
                self.sends.append(index)
        finally:
            with self._lock:
                self.active -= 1

    def complete(self, parts: int, total: int) -> str:
        self.completed = b"".join(self.parts[i] for i in range(parts))
        assert len(self.completed) == total
        return "e-fake"

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def pool() -> Any:
    with cf.ThreadPoolExecutor(8) as executor:
        yield executor


def eventually(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(check())


def staging_fd(tmp_path: Path) -> int:
    return os.open(tmp_path / "staged", os.O_RDWR | os.O_CREAT, 0o600)


def write(fd: int, stream: PartStream, data: bytes, offset: int) -> None:
    os.pwrite(fd, data, offset)
    stream.on_write(offset, len(data))


def test_parts_leave_while_the_file_is_written(tmp_path: Path, pool: Any) -> None:
    fd, session = staging_fd(tmp_path), FakeSession(4)
    stream = PartStream(fd, lambda: session, 4, pool, max_in_flight=2)
    data = bytes(range(23))
    for off in range(0, 23, 3):
        write(fd, stream, data[off:off + 3], off)
    stream._drain()
    assert sorted(session.sends) == [0, 1, 2, 3, 4]  # every full part before close
    assert stream.finish(23) == (True, "e-fake")
    assert session.completed == data and sorted(session.sends) == [0, 1, 2, 3, 4, 5]


def test_a_patch_behind_resends_only_that_part(tmp_path: Path, pool: Any) -> None:
    fd, session = staging_fd(tmp_path), FakeSession(4)
    stream = PartStream(fd, lambda: session, 4, pool)
    write(fd, stream, b"a" * 16, 0)
    write(fd, stream, b"HEAD", 4)  # a zip writer fixing a header it wrote earlier
    assert stream.finish(16)[0]
    assert session.completed == b"a" * 4 + b"HEAD" + b"a" * 8
    assert session.sends.count(1) == 2 and session.sends.count(0) == 1 and session.sends.count(2) == 1


def test_an_ordered_upload_gives_up_on_a_patch_behind(tmp_path: Path, pool: Any) -> None:
    fd, session = staging_fd(tmp_path), FakeSession(4, ordered=True)
    stream = PartStream(fd, lambda: session, 4, pool)
    write(fd, stream, b"a" * 12, 0)
    write(fd, stream, b"X", 0)
    assert stream.finish(12) == (False, None)  # the caller uploads the file whole
    assert eventually(lambda: session.aborted)  # aborted in the background


def test_truncate_and_holes(tmp_path: Path, pool: Any) -> None:
    fd, session = staging_fd(tmp_path), FakeSession(4)
    stream = PartStream(fd, lambda: session, 4, pool)
    write(fd, stream, b"b" * 12, 0)
    os.ftruncate(fd, 6)
    stream.on_truncate(6)
    write(fd, stream, b"c", 9)  # a hole: nothing more is sent ahead
    stream._drain()
    assert max(session.sends) <= 2
    assert stream.finish(10)[0]
    assert session.completed == b"b" * 6 + b"\0" * 3 + b"c"


def test_memory_is_bounded_by_parts_in_flight(tmp_path: Path, pool: Any) -> None:
    fd, session = staging_fd(tmp_path), FakeSession(4, delay=0.02)
    stream = PartStream(fd, lambda: session, 4, pool, max_in_flight=2)
    for i in range(20):
        write(fd, stream, bytes([i]) * 4, 4 * i)
    assert stream.finish(80)[0]
    assert session.max_active <= 2 and len(session.completed or b"") == 80


def test_a_failed_part_fails_the_commit(tmp_path: Path, pool: Any) -> None:
    fd, session = staging_fd(tmp_path), FakeSession(4, fail_part=1)
    stream = PartStream(fd, lambda: session, 4, pool)
    write(fd, stream, b"d" * 10, 0)
    with pytest.raises(ConnectionError):
        stream.finish(10)
    assert eventually(lambda: session.aborted)


@pytest.mark.parametrize("ordered", [False, True])
def test_random_writes_always_commit_the_file_content(tmp_path: Path, pool: Any, ordered: bool) -> None:
    """Differential: whatever the mix of writes and truncates, what the stream commits is the
    staging file's content, or it hands the commit back to a whole-file upload."""
    rng = random.Random(1234 + ordered)
    for case in range(400):
        path = tmp_path / f"s{case}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        session = FakeSession(8, ordered=ordered)
        stream = PartStream(fd, lambda s=session: s, 8, pool, max_in_flight=3)
        size = 0
        for _ in range(rng.randint(1, 25)):
            roll = rng.random()
            if roll < 0.65:  # mostly appends, like real writers
                off, n = size, rng.randint(1, 20)
            elif roll < 0.85:
                off, n = rng.randint(0, size + 12), rng.randint(1, 10)  # patches and holes
            else:
                length = rng.randint(0, size + 4)
                os.ftruncate(fd, length)
                stream.on_truncate(length)
                size = length
                continue
            write(fd, stream, rng.randbytes(n), off)
            size = max(size, off + n)
        assert os.fstat(fd).st_size == size
        done, _ = stream.finish(size)
        expected = path.read_bytes()
        if done:
            assert session.completed == expected, case
        os.close(fd)


@pytest.mark.core
def test_a_remotes_part_stream_sends_as_its_settings_say(tmp_path: Path) -> None:
    """Remote.part_stream: the part size and parts in flight of its settings, its own sending
    threads, and a session opened for the key with the version expected (and a create's mode,
    only when there is one)."""
    remote = Remote(f"memory://w-{uuid.uuid4().hex[:10]}", None,
                    RemoteSettings(upload_part_size=4, upload_concurrency=3))
    opened: list[tuple[Any, ...]] = []
    sessions: list[FakeSession] = []

    def part_session(key: str, expect: Any, *args: Any, **kwargs: Any) -> FakeSession:
        opened.append((key, expect, args, kwargs))
        sessions.append(FakeSession(4))
        return sessions[-1]

    remote.part_session = part_session  # type: ignore[method-assign]
    try:
        fd = staging_fd(tmp_path)
        stream = remote.part_stream(fd, "d/new", ABSENT)
        assert (stream.part_size, stream.max_in_flight, stream.pool) == (4, 3, remote.part_pool)
        data = bytes(range(10))
        write(fd, stream, data, 0)
        assert stream.finish(10) == (True, "e-fake") and sessions[0].completed == data
        mode = PosixAttrs(mode=0o600)
        remote.part_stream(fd, "d/other", None, mode).open()
        assert opened == [("d/new", ABSENT, (), {}), ("d/other", None, (), {"attrs": mode})]
        os.close(fd)
    finally:
        remote.close()


# -- real object stores, through the filesystem core --------------------------------------------
def _core(request: pytest.FixtureRequest, backend: str, tmp_path: Path,
          part_size: int = 5 * MiB) -> tuple[Filesystem, Any, str]:
    if backend == "memory":
        url = f"memory://w-{uuid.uuid4().hex[:10]}"
        client, root = fsspec_client(url)
        client.mkdir(root)
        options: dict = {}
    else:
        url, options, _ = object_store(request, backend)
        client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    settings = RemoteSettings(attempts=2, backoff_base=0.05, upload_part_size=part_size)
    remote = Remote(url, options, settings)
    return Filesystem(remote, staging_dir=tmp_path / "staging"), client, root


@pytest.mark.parametrize("backend", ["s3", "gcs"])
@pytest.mark.core
def test_sequential_write_is_uploaded_before_close(request: pytest.FixtureRequest, tmp_path: Path,
                                                   backend: str) -> None:
    core, client, root = _core(request, backend, tmp_path)
    data = os.urandom(17 * MiB + 5)
    fh = core.create("/big.bin", os.O_WRONLY | os.O_CREAT).fh
    for off in range(0, len(data), MiB):
        core.write(fh, data[off:off + MiB], off)
    staged = core.handles.get(fh).staged
    assert staged is not None and staged.stream is not None
    staged.stream._drain()
    sent = core.remote.stats.count("part")
    assert sent >= 3  # session start + the first parts, while the writer was still writing
    core.flush(fh)
    core.release(fh)
    assert client.cat_file(f"{root}/big.bin") == data
    assert core.remote.stats.snapshot()["bytes_out"] == len(data)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
@pytest.mark.core
def test_seek_back_patch_of_a_streamed_file(request: pytest.FixtureRequest, tmp_path: Path,
                                            backend: str) -> None:
    core, client, root = _core(request, backend, tmp_path)
    data = bytearray(os.urandom(12 * MiB))
    fh = core.create("/ckpt.zip", os.O_WRONLY | os.O_CREAT).fh
    for off in range(0, len(data), MiB):
        core.write(fh, bytes(data[off:off + MiB]), off)
    core.write(fh, b"PATCHED-HEADER", 30)
    data[30:44] = b"PATCHED-HEADER"
    core.flush(fh)
    core.release(fh)
    assert client.cat_file(f"{root}/ckpt.zip") == bytes(data)


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.parametrize("size", [100, 11 * MiB])
@pytest.mark.core
def test_no_blind_overwrite_of_a_changed_object(request: pytest.FixtureRequest, tmp_path: Path,
                                                backend: str, size: int) -> None:
    """Someone else replaced the object while we had it open: close fails with ESTALE, their
    object stays, and our bytes are committed beside it as NAME.marinfs-conflict-<time>."""
    core, client, root = _core(request, backend, tmp_path)
    client.pipe_file(f"{root}/status", b"RUNNING")
    ours = os.urandom(size)
    fh = core.open("/status", os.O_WRONLY | os.O_TRUNC).fh
    core.write(fh, ours, 0)
    client.pipe_file(f"{root}/status", b"SUCCESS from another node")
    with pytest.raises(FsError) as info:
        core.flush(fh)
    assert info.value.errno == errno.ESTALE
    core.release(fh)
    assert client.cat_file(f"{root}/status") == b"SUCCESS from another node"
    (conflict,) = [p for p in client.ls(root, detail=False) if ".marinfs-conflict-" in p]
    assert client.cat_file(conflict) == ours
    assert core.upload_status()["conflicts"][0]["key"] == "status"
    assert core.upload_status()["failed"] == []  # nothing is left to retry: the bytes are safe
    with pytest.raises(FsError, check=lambda e: e.errno == errno.EEXIST):
        core.sync("/")  # `marinfs sync` says so too (a writer may not look at close), once
    assert core.sync("/") == b"0"


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.core
def test_a_new_file_never_replaces_one_created_meanwhile(request: pytest.FixtureRequest, tmp_path: Path,
                                                         backend: str) -> None:
    core, client, root = _core(request, backend, tmp_path)
    fh = core.create("/out.json", os.O_WRONLY | os.O_CREAT).fh
    core.write(fh, b"{}", 0)
    client.pipe_file(f"{root}/out.json", b"theirs")
    with pytest.raises(FsError) as info:
        core.flush(fh)
    assert info.value.errno == errno.ESTALE
    core.release(fh)
    assert client.cat_file(f"{root}/out.json") == b"theirs"


@pytest.mark.parametrize("backend", ["memory", "s3", "gcs"])
@pytest.mark.core
def test_our_own_rewrites_are_not_conflicts(request: pytest.FixtureRequest, tmp_path: Path,
                                            backend: str) -> None:
    """RUNNING -> SUCCESS rewrites by the same node, fsync then more writes, and a rename of an
    open file all commit normally."""
    core, client, root = _core(request, backend, tmp_path)
    for text in (b"RUNNING", b"SUCCESS", b"SUCCESS!"):
        fh = core.open("/.executor_status", os.O_WRONLY | os.O_TRUNC).fh if text != b"RUNNING" else \
            core.create("/.executor_status", os.O_WRONLY | os.O_CREAT).fh
        core.write(fh, text, 0)
        core.fsync(fh)
        core.write(fh, b"\n", len(text))
        core.flush(fh)
        core.release(fh)
        assert client.cat_file(f"{root}/.executor_status") == text + b"\n"
    fh = core.create("/x.tmp", os.O_WRONLY | os.O_CREAT).fh
    core.write(fh, b"one", 0)
    core.rename("/x.tmp", "/x")
    core.write(fh, b"two", 3)
    core.flush(fh)
    core.release(fh)
    assert client.cat_file(f"{root}/x") == b"onetwo"
    assert not [p for p in client.ls(root, detail=False) if "conflict" in p]


@pytest.mark.objectstore
def test_gcs_commits_carry_the_generation_precondition(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """fake-gcs-server ignores ifGenerationMatch (DESIGN §7), so check what we ask of GCS: every
    upload names the generation it replaces, or 0 for a new object."""
    core, client, root = _core(request, "gcs", tmp_path)
    seen: list[tuple[str, Any]] = []
    call = core.remote.fs._call

    async def recording(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if "/upload/" in str(path) and "uploadType" in kwargs:
            seen.append((kwargs["uploadType"], kwargs.get("ifGenerationMatch")))
        return await call(method, path, *args, **kwargs)

    core.remote.fs._call = recording
    client.pipe_file(f"{root}/old", b"v1")
    generation = str(client.info(f"{root}/old")["generation"])
    for path, flags, size in (("/new", os.O_CREAT | os.O_WRONLY, 10), ("/old", os.O_WRONLY | os.O_TRUNC, 10),
                              ("/big", os.O_CREAT | os.O_WRONLY, 6 * MiB)):
        fh = core.create(path, flags).fh if flags & os.O_CREAT else core.open(path, flags).fh
        core.write(fh, b"z" * size, 0)
        core.flush(fh)
        core.release(fh)
    assert seen == [("media", "0"), ("media", generation), ("resumable", "0")]


# -- through a mount --------------------------------------------------------------------------
def _store(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> tuple[str, dict[str, str], Any, str]:
    """A fresh prefix to mount: (URL, the daemon's environment, a direct client, its root)."""
    if backend == "local":
        url = str(tmp_path / "remote")
        os.mkdir(url)
        options: dict = {}
        env: dict[str, str] = {}
    else:
        url, options, env = object_store(request, backend)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False} if options else None)
    return url, env, client, root


def _writer_order_script(mnt: Path, n: int) -> str:
    return (f"import os\nfor i in range({n}):\n"
            f"    with open('{mnt}/data-%d.bin' % i, 'wb') as f: f.write(os.urandom({3 * MiB}))\n"
            f"with open('{mnt}/_SUCCESS', 'w') as f: f.write('done')\n")


@pytest.mark.parametrize("backend", ["local", "s3", "gcs"])
@pytest.mark.mount
def test_a_marker_written_last_is_never_seen_before_its_data(request: pytest.FixtureRequest,
                                                             tmp_path: Path, backend: str) -> None:
    url, env, client, root = _store(request, backend, tmp_path)
    n, violations, checks = 4, [], []
    stop = threading.Event()

    def watch() -> None:  # another node: whenever the marker exists, all data must be complete
        while not stop.is_set():
            if client.exists(f"{root}/_SUCCESS"):
                sizes = [client.info(f"{root}/data-{i}.bin")["size"] if client.exists(f"{root}/data-{i}.bin")
                         else None for i in range(n)]
                checks.append(sizes)
                if sizes != [3 * MiB] * n:
                    violations.append(sizes)
                return
            time.sleep(0.005)

    with subprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", env=env):
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            subprocess.run(["python3", "-c", _writer_order_script(tmp_path / "mnt", n)], check=True, timeout=120)
            watcher.join(timeout=30)
        finally:
            stop.set()
            watcher.join()
    assert checks and not violations


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_estale_through_the_mount(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> None:
    url, env, client, root = _store(request, backend, tmp_path)
    client.pipe_file(f"{root}/metadata.json", b'{"v": 1}')
    mnt = tmp_path / "mnt"
    with subprocess_mount(url, mnt, tmp_path / "cache", env=env):
        fd = os.open(mnt / "metadata.json", os.O_WRONLY | os.O_TRUNC)
        os.write(fd, b'{"v": "ours"}')
        time.sleep(0.01)  # a local mtime-based version needs the other write to differ in time
        client.pipe_file(f"{root}/metadata.json", b'{"v": "theirs!"}')
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.ESTALE
        names = os.listdir(mnt)
    assert client.cat_file(f"{root}/metadata.json") == b'{"v": "theirs!"}'
    (conflict,) = [n for n in names if n.startswith("metadata.json.marinfs-conflict-")]
    assert client.cat_file(f"{root}/{conflict}") == b'{"v": "ours"}'


@pytest.mark.mount
def test_remote_down_during_upload_keeps_the_bytes_then_commits_them(s3_server: Any, tmp_path: Path) -> None:
    """The server goes away while a file is being written: close fails with EIO within the
    timeouts and the bytes stay staged (status lists them); once it is back, the retry loop
    commits them, and nothing is left in the staging directory."""
    host, port = s3_server.endpoint.rsplit("/", 1)[1].split(":")
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    data = os.urandom(20 * MiB + 7)
    with TcpProxy(host, int(port)) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        with subprocess_mount(url, mnt, cache, "--connect-timeout", "1", "--read-timeout", "1",
                              "--retries", "2", "--commit-retry-interval", "1", env=env) as pid:
            fd = os.open(mnt / "weights.bin", os.O_WRONLY | os.O_CREAT)
            os.write(fd, data[:10 * MiB])
            proxy.wedged.set()  # mid-upload: parts may be in flight
            os.write(fd, data[10 * MiB:])
            started = time.monotonic()
            with pytest.raises(OSError) as info:
                os.close(fd)
            assert info.value.errno == errno.EIO
            assert time.monotonic() - started < 60
            staged = [p for p in staging_entries(cache / "staging") if not p.name.endswith(".json")]
            assert len(staged) == 1 and staged[0].read_bytes() == data
            status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True,
                                    env={**os.environ, **env}, timeout=60)
            deadline = time.monotonic() + 10
            while "1 failed" not in status.stdout and time.monotonic() < deadline:
                time.sleep(0.5)
                status = subprocess.run([*MARINFS, "status", str(mnt)], capture_output=True, text=True,
                                        env={**os.environ, **env}, timeout=60)
            assert "1 failed" in status.stdout and "weights.bin" in status.stdout, status.stdout
            assert daemon_pid(mnt) == pid
            proxy.wedged.clear()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not client.exists(f"{root}/weights.bin"):
                time.sleep(0.5)
            assert client.cat_file(f"{root}/weights.bin") == data
            deadline = time.monotonic() + 10
            while staging_entries(cache / "staging") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert staging_entries(cache / "staging") == []


@pytest.mark.mount
def test_tar_into_a_new_directory_costs_one_put_per_file(s3_server: Any, tmp_path: Path) -> None:
    """A directory we just made is known empty, and our own commits keep its listing current,
    so extracting into it asks the remote nothing but the uploads themselves."""
    from mounting import inprocess_mount

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    src = tmp_path / "src"
    for i in range(30):
        (src / f"shard-{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"shard-{i % 3}" / f"part-{i}.json").write_bytes(os.urandom(100 + i))
    subprocess.run(["tar", "-cf", str(tmp_path / "a.tar"), "-C", str(src), "."], check=True)
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=s3_server.storage_options()) as core:
        os.mkdir(tmp_path / "mnt/out")
        core.remote.stats.reset()
        subprocess.run(["tar", "-xf", str(tmp_path / "a.tar"), "-C", str(tmp_path / "mnt/out")], check=True,
                       timeout=120)
        counts = core.remote.stats.snapshot()["requests"]
    # Every file (the mtime tar restores goes with its PUT), a marker per directory, and the
    # directory records of out/ and the 3 shards, each once per 0.2 s window: no COPY per file.
    assert 30 + 3 <= counts.get("put", 0) <= 30 + 3 + 12, counts  # (records may land after)
    assert "copy" not in counts, counts
    assert counts.get("head", 0) + counts.get("list", 0) <= 2, counts
    for i in (0, 29):
        assert client.cat_file(f"{root}/out/shard-{i % 3}/part-{i}.json") == \
            (src / f"shard-{i % 3}" / f"part-{i}.json").read_bytes()


def _hold_open_writer(path: Path, data_len: int) -> subprocess.Popen:
    """A process that writes a file and keeps it open (as a job does when the node stops)."""
    code = (f"import os, sys, time\nf = open({str(path)!r}, 'wb')\n"
            f"f.write(bytes(range(256)) * ({data_len} // 256))\nf.flush()\n"
            "print('written', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(["python3", "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    return proc


def _wait_gone(pid: int, timeout: float) -> float:
    started = time.monotonic()
    while os.path.exists(f"/proc/{pid}") and time.monotonic() - started < timeout:
        try:
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_sigterm_commits_files_still_open(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> None:
    """systemd stops the daemon while a job still has a file open: the stop drains, so the
    bytes written so far are committed before the daemon exits."""
    url, env, client, root = _store(request, backend, tmp_path)
    mnt = tmp_path / "mnt"
    with subprocess_mount(url, mnt, tmp_path / "cache", env=env) as pid:
        writer = _hold_open_writer(mnt / "log.txt", 3 * MiB)
        try:
            os.kill(pid, 15)
            assert _wait_gone(pid, 60) < 60
        finally:
            writer.kill()
            writer.wait()
    assert client.cat_file(f"{root}/log.txt") == bytes(range(256)) * (3 * MiB // 256)
    assert not staging_entries(tmp_path / "cache/staging")


@pytest.mark.mount
def test_drain_timeout_bounds_the_stop_and_the_journal_keeps_the_bytes(s3_server: Any, tmp_path: Path) -> None:
    host, port = s3_server.endpoint.rsplit("/", 1)[1].split(":")
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with TcpProxy(host, int(port)) as proxy:
        env = {**s3_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
        with subprocess_mount(url, mnt, cache, "--connect-timeout", "2", "--read-timeout", "60",
                              "--retries", "1", "--drain-timeout", "3", env=env) as pid:
            writer = _hold_open_writer(mnt / "state.bin", MiB)
            try:
                proxy.wedged.set()  # the remote stops answering: the commit at stop hangs
                os.kill(pid, 15)
                assert _wait_gone(pid, 40) < 20  # the drain timeout, not the 60 s read timeout
            finally:
                writer.kill()
                writer.wait()
        journals = staging_entries(cache / "staging", "*.journal.json")
        assert len(journals) == 1 and not client.exists(f"{root}/state.bin")
        proxy.wedged.clear()
        with subprocess_mount(url, mnt, cache, env=env):
            pass  # the next start commits what the last one could not
    assert client.cat_file(f"{root}/state.bin") == bytes(range(256)) * (MiB // 256)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
@pytest.mark.mount
def test_a_large_zip_written_through_the_mount(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> None:
    """torch.save's pattern at checkpoint scale: a zip writer streams big members, then seeks
    back to patch each local header; the streamed upload must end up byte-exact."""
    import io
    import zipfile

    url, options, env = object_store(request, backend)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    mnt = tmp_path / "mnt"
    code = ("import os, random, zipfile\nrng = random.Random(7)\n"
            f"with zipfile.ZipFile({str(mnt / 'ckpt.pt')!r}, 'w', zipfile.ZIP_STORED) as z:\n"
            "    for i in range(3):\n"
            "        with z.open(f'archive/data/{i}', 'w', force_zip64=True) as f:\n"
            "            for _ in range(9):\n"
            "                f.write(rng.randbytes(1 << 20))\n")
    with subprocess_mount(url, mnt, tmp_path / "cache", env=env):
        subprocess.run(["python3", "-c", code], check=True, timeout=300)
        local = (mnt / "ckpt.pt").read_bytes()
    remote = client.cat_file(f"{root}/ckpt.pt")
    assert remote == local and len(remote) > 27 * MiB
    with zipfile.ZipFile(io.BytesIO(remote)) as z:
        assert z.testzip() is None and len(z.namelist()) == 3


@pytest.mark.parametrize("backend", ["s3", "gcs"])
@pytest.mark.core
def test_commits_of_odd_names(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> None:
    """Our own upload requests (not fsspec's) must encode names like fsspec does."""
    core, client, root = _core(request, backend, tmp_path)
    names = ["a b.txt", "ünïcødé.json", "x:y=z&w", "100%", "q?#.bin", "plus+sign"]
    for name in names:
        for size in (10, 6 * MiB):  # one request, and a multipart/resumable session
            fh = core.create(f"/{name}", os.O_WRONLY | os.O_CREAT).fh if size == 10 else \
                core.open(f"/{name}", os.O_WRONLY | os.O_TRUNC).fh
            data = name.encode() * (size // len(name.encode()) + 1)
            core.write(fh, data[:size], 0)
            core.flush(fh)
            core.release(fh)
            assert client.cat_file(f"{root}/{name}") == data[:size], name
    assert sorted(os.path.basename(p) for p in client.ls(root, detail=False)) == sorted(names)


# -- writes handed down as views of libfuse's buffer ---------------------------------------------
@pytest.mark.mount  # imports the binding, which loads libfuse
def test_a_fuse_write_reaches_the_staging_file_as_a_view_of_libfuses_buffer(tmp_path: Path) -> None:
    """_Fuse.write gives the filesystem a memoryview of the request buffer (no bytes copy),
    which os.pwrite takes as it is, and releases it on return: a view kept past the call
    would read memory libfuse reuses."""
    import ctypes

    from marinfs.fuse.ops import _Fuse

    fd = os.open(tmp_path / "staged", os.O_RDWR | os.O_CREAT, 0o600)
    got: list[Any] = []

    class Ops:
        def write(self, path: str | None, data: Any, offset: int, fi: Any) -> int:
            got.append((path, data, fi))
            return os.pwrite(fd, data, offset)

    class Fi:
        fh = 7

    class FiPointer:
        contents = Fi()

    binding = _Fuse.__new__(_Fuse)  # no mount: only the callback under test
    binding.operations, binding.encoding, binding.errors = Ops(), "utf-8", "surrogateescape"
    payload = os.urandom(MiB + 3)
    raw = (ctypes.c_byte * len(payload)).from_buffer_copy(payload)
    try:
        assert binding.write(b"/f", ctypes.cast(raw, ctypes.POINTER(ctypes.c_byte)), len(payload), 5, FiPointer()) \
            == len(payload)
        assert binding.write(None, ctypes.cast(raw, ctypes.POINTER(ctypes.c_byte)), 0, 0, FiPointer()) == 0
        assert os.pread(fd, len(payload), 5) == payload
        path, view, fi = got[0]
        assert path == "/f" and isinstance(view, memoryview) and fi.fh == 7
        with pytest.raises(ValueError):  # released: nobody reads the buffer after the call
            bytes(view)
    finally:
        os.close(fd)


@pytest.mark.mount
def test_a_big_write_through_the_mount_is_byte_exact(s3_server: Any, tmp_path: Path) -> None:
    """Odd-sized writes through FUSE (views of libfuse's buffer into the staging file), parts
    sent from the staging file while it is written, one part patched after it was sent: the
    object's sha256 is the writer's, and the parts went with their CRC-32C."""
    import hashlib

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, {**s3_server.storage_options(), "use_listings_cache": False})
    mnt = tmp_path / "mnt"
    code = ("import hashlib, os, random, sys\nrng = random.Random(3)\nh = hashlib.sha256()\n"
            f"fd = os.open({str(mnt / 'big.bin')!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
            "data = bytearray()\n"
            "while len(data) < 40 << 20:\n"
            "    block = rng.randbytes(rng.choice((1 << 20, (1 << 20) + 13, 4093, 300000)))\n"
            "    os.write(fd, block)\n"
            "    data += block\n"
            "patch = rng.randbytes(100)\n"
            "os.pwrite(fd, patch, 1000)\n"  # into part 0, long since sent
            "data[1000:1100] = patch\n"
            "os.close(fd)\n"
            "print(hashlib.sha256(data).hexdigest())\n")
    with subprocess_mount(url, mnt, tmp_path / "cache", env=s3_server.env()):
        out = subprocess.run(["python3", "-c", code], check=True, timeout=300, capture_output=True, text=True)
        assert hashlib.sha256((mnt / "big.bin").read_bytes()).hexdigest() == out.stdout.strip()
    assert hashlib.sha256(client.cat_file(f"{root}/big.bin")).hexdigest() == out.stdout.strip()
    head = client.call_s3("head_object", Bucket=s3_server.bucket, Key=f"{root.split('/', 1)[1]}/big.bin",
                          ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C")  # a composite of the parts' CRC-32C: they were sent and checked


class SummingSession(FakeSession):
    """A session that sends from the file and takes the CRC-32C the stream summed (S3's)."""

    checksum = "crc32c"

    def __init__(self, part_size: int) -> None:
        super().__init__(part_size)
        self.given: dict[int, list[int | None]] = {}

    def send_range(self, index: int, fd: int, offset: int, length: int, total: int | None = None,
                   crc32c: int | None = None) -> None:
        data = os.pread(fd, length, offset)
        with self._lock:
            self.given.setdefault(index, []).append(crc32c)
        self.send(index, data, total)


def test_parts_are_summed_as_they_are_written_and_never_with_stale_sums(tmp_path: Path, pool: Any) -> None:
    """Sequential writes feed each part's CRC-32C (so the part is not read back to be summed);
    a part written again, out of order or truncated is sent without one (summed from the file),
    and every sum given is the CRC-32C of the bytes the part holds when it is sent."""
    import google_crc32c

    fd, session = staging_fd(tmp_path), SummingSession(8)
    stream = PartStream(fd, lambda: session, 8, pool, max_in_flight=2)
    data = bytearray(os.urandom(45))
    for off in range(0, 40, 5):  # parts 0-4 dispatched as they fill, with their sums
        os.pwrite(fd, data[off:off + 5], off)
        stream.on_write(off, 5, memoryview(data)[off:off + 5])
    os.pwrite(fd, b"!", 3)  # a patch of part 0, already sent: resent at commit, summed then
    stream.on_write(3, 1, b"!")
    data[3:4] = b"!"
    os.pwrite(fd, data[40:45], 40)  # after the patch: the running sum has stopped
    stream.on_write(40, 5, bytes(data[40:45]))
    assert stream.finish(45)[0]
    assert session.completed == bytes(data)
    assert len(session.given[0]) == 2 and session.given[0][1] is None  # sent as written, then again
    for i in range(1, 5):
        assert session.given[i] == [google_crc32c.value(bytes(data[8 * i:8 * i + 8]))]
    assert session.given[5] == [None]  # the tail came after the out-of-order write
    first = session.given[0][0]
    assert first is not None and first != google_crc32c.value(bytes(data[:8]))  # summed before the patch...
    assert session.parts[0] == bytes(data[:8])  # ...so part 0 went again, summed from the file

    fd2, session2 = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT, 0o600), SummingSession(8)
    stream2 = PartStream(fd2, lambda: session2, 8, pool)
    payload = os.urandom(21)
    os.pwrite(fd2, payload, 0)
    stream2.on_write(0, 21, payload)
    assert stream2.finish(21)[0] and session2.completed == payload
    assert session2.given == {0: [google_crc32c.value(payload[:8])], 1: [google_crc32c.value(payload[8:16])],
                              2: [google_crc32c.value(payload[16:])]}  # the tail summed as written too

    fd3, session3 = os.open(tmp_path / "c", os.O_RDWR | os.O_CREAT, 0o600), SummingSession(8)
    stream3 = PartStream(fd3, lambda: session3, 8, pool)
    os.pwrite(fd3, payload[:12], 0)
    stream3.on_write(0, 12, payload[:12])
    os.ftruncate(fd3, 4)  # below what was summed: no sums from there on
    stream3.on_truncate(4)
    os.pwrite(fd3, payload[4:21], 4)
    stream3.on_write(4, 17, payload[4:21])
    assert stream3.finish(21)[0] and session3.completed == payload
    assert session3.given[1] == [None] and session3.given[2] == [None]


@pytest.mark.objectstore
def test_a_sequential_write_to_s3_is_summed_as_written_and_seaweedfs_agrees(request: pytest.FixtureRequest,
                                                                           tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Through the Filesystem core on SeaweedFS (which checks every part's CRC-32C): a file
    written in order is never read back to be summed, and every sum is right the first time:
    exactly create, 3 parts, complete, and no part refused."""
    core, client, root = _core(request, "s3", tmp_path)
    remote = core.remote
    digests: list[int] = []
    real = remote._direct._digest
    remote._direct._digest = lambda *a: digests.append(1) or real(*a)
    data = os.urandom((12 << 20) + 5)
    remote.stats.reset()
    fh = core.create("/seq.bin", os.O_WRONLY | os.O_CREAT).fh
    for off in range(0, len(data), (1 << 20) + 7):  # FUSE-sized writes, not aligned to parts
        core.write(fh, memoryview(data)[off:off + (1 << 20) + 7], off)
    core.flush(fh)
    core.release(fh)
    assert client.cat_file(f"{root}/seq.bin") == data
    assert remote.stats.count("part") == 5 and not digests
    assert not [r for r in caplog.records if "BadDigest" in r.getMessage()]


def test_a_file_never_grows_past_the_largest_file_size(remote: Remote, tmp_path: Path) -> None:
    """`truncate -s 1T` by mistake is EFBIG at once, not 1 TiB of zeros uploaded at close (issue
    37: its close sat in state D for 10 minutes sending holes); so are a write, an append and a
    fallocate that would cross --max-file-size. Nothing is sent; the file stays as it was."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", max_file_size=1 << 20)
    fh = fs.create("/f", os.O_WRONLY | os.O_CREAT).fh
    fs.write(fh, b"x" * 1000, 0)
    for attempt in (lambda: fs.truncate("/f", (1 << 20) + 1, fh=fh),
                    lambda: fs.write(fh, b"y", 1 << 20),
                    lambda: fs.fallocate(fh, 0, 0, (1 << 20) + 1)):
        with pytest.raises(FsError) as err:
            attempt()
        assert err.value.errno == errno.EFBIG
    fs.truncate("/f", 1 << 20, fh=fh)  # up to the limit is fine
    fs.flush(fh)
    fs.release(fh)
    assert remote.stat("f").size == 1 << 20
    with pytest.raises(FsError) as err:
        fs.truncate("/f", 1 << 40)  # by path
    assert err.value.errno == errno.EFBIG
    fh = fs.open("/f", os.O_WRONLY | os.O_APPEND).fh
    with pytest.raises(FsError) as err:
        fs.write(fh, b"z", 0)  # an append past the limit
    assert err.value.errno == errno.EFBIG
    fs.release(fh)
    assert remote.stat("f").size == 1 << 20
    fs.close()


@pytest.mark.parametrize("backend", ["s3"])
def test_truncate_past_the_largest_file_size_is_efbig_through_the_mount(
        request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> None:
    """The shell's view of it: `truncate -s 1T` fails at once with 'File too large' and the
    bucket gets the empty file truncate created (as on a disk), not a byte more."""
    url, options, env = object_store(request, backend)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    with subprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", "--max-file-size", "1G", env=env):
        started = time.monotonic()
        out = subprocess.run(["truncate", "-s", "1T", str(tmp_path / "mnt" / "sparse")], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode != 0 and "File too large" in out.stderr
        assert time.monotonic() - started < 10
        (tmp_path / "mnt" / "ok").write_bytes(b"fine")
    assert client.cat_file(f"{root}/sparse") == b"" and client.cat_file(f"{root}/ok") == b"fine"
