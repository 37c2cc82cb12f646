"""Write-back (--write-back): close returns once the bytes are staged, uploads run in the
background in closing order, and barriers (unlink, rmdir, rename, a commit marker's close,
``marinfs sync``, unmount) wait for what was closed before them. Core tier: no FUSE."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tiers
from marinfs.core import Filesystem
from marinfs.remote import Remote
from marinfs.write.writeback import WriteBack
from mounting import daemon_ended, staging_entries

CREAT = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
MARKERS = ("**/.executor_status", "**/_SUCCESS")


class Gate:
    """Holds the remote's uploads (those whose key ``holds`` answers True) until opened, and
    records the order of uploads and deletes."""

    def __init__(self, remote: Remote, holds: Any = lambda key: True) -> None:
        self.open = threading.Event()
        self.events: list[tuple[str, str]] = []
        self.fail: set[str] = set()
        self._lock = threading.Lock()
        upload, delete = remote.upload, remote.delete

        def gated_upload(local: str, key: str, *args: Any, **kwargs: Any) -> Any:
            if holds(key):
                self.open.wait(30)
            if key in self.fail:
                raise OSError(errno.EIO, "injected", key)
            out = upload(local, key, *args, **kwargs)
            with self._lock:
                self.events.append(("put", key))
            return out

        def recorded_delete(key: str) -> None:
            delete(key)
            with self._lock:
                self.events.append(("delete", key))

        remote.upload = gated_upload  # type: ignore[method-assign]
        remote.delete = recorded_delete  # type: ignore[method-assign]


@contextlib.contextmanager
def gated(remote: Remote, tmp_path: Path, holds: Any = None, **settings: Any) -> Iterator[tuple[Filesystem, Gate]]:
    """A write-back filesystem (4 uploads, 5 s delay) whose uploads wait for the gate; opened
    and closed however the test ends."""
    gate = Gate(remote) if holds is None else Gate(remote, holds=holds)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back_uploads=4, write_back_delay=5.0,
                    commit_markers=MARKERS, drain_timeout=30, **settings)
    try:
        yield fs, gate
    finally:
        gate.open.set()
        fs.close_all()


@pytest.fixture
@tiers.needs("core")
def wb(remote: Remote, tmp_path: Path) -> Iterator[tuple[Filesystem, Gate]]:
    with gated(remote, tmp_path, write_back=True) as made:
        yield made


def write(fs: Filesystem, path: str, data: bytes) -> None:
    fh = fs.create(path, CREAT).fh
    fs.write(fh, data, 0)
    fs.flush(fh)
    fs.release(fh)


def stored(remote: Remote, key: str) -> bytes | None:
    try:
        return bytes(remote.fs.cat_file(remote.full(key)))
    except FileNotFoundError:
        return None


def test_close_returns_before_the_upload_and_sync_returns_once_all_are_in_the_bucket(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = wb
    for i in range(20):
        write(fs, f"/f{i}", b"x" * i)  # (the uploads are held: each close returned regardless)
    assert stored(remote, "f3") is None
    assert fs.getattr("/f3").size == 3 and fs.read(fs.open("/f3", os.O_RDONLY).fh, 10, 0) == b"xxx"  # this node sees its writes
    assert fs.upload_status()["write_back"]["queued"] == 20
    done = threading.Event()
    threading.Thread(target=lambda: (fs.sync("/"), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # the barrier waits for the held uploads
    gate.open.set()
    assert done.wait(10)
    assert [stored(remote, f"f{i}") for i in range(20)] == [b"x" * i for i in range(20)]
    assert fs.upload_status()["pending"] == []


def test_uploads_run_in_closing_order_and_a_marker_lands_after_everything_before_it(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = wb
    fs.mkdir("/step")
    for i in range(30):
        write(fs, f"/step/shard{i:02d}", os.urandom(100))
    closed = threading.Event()
    threading.Thread(target=lambda: (write(fs, "/step/.executor_status", b"SUCCESS"), closed.set()),
                     daemon=True).start()
    assert not closed.wait(0.3)  # a marker's close is a barrier: the shards are held
    gate.open.set()
    assert closed.wait(10)
    puts = [k for kind, k in gate.events if kind == "put"]
    assert puts[-1] == "step/.executor_status" and len(puts) == 31  # last, after all 30
    assert stored(remote, "step/.executor_status") == b"SUCCESS"


def test_a_delete_never_overtakes_an_upload_closed_before_it(wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    """Orbax's max_to_keep: the old step goes right after the new one is saved; it must not be
    gone from the bucket while the new one is incomplete there. The unlink and rmdir return at
    once and the names are gone here at once; the bucket loses them after the new step is whole."""
    fs, gate = wb
    gate.open.set()
    fs.mkdir("/step1")
    write(fs, "/step1/a", b"old")
    fs.sync("/")
    gate.open.clear()
    fs.mkdir("/step2")
    for i in range(5):
        write(fs, f"/step2/p{i}", b"new")
    started = time.monotonic()
    fs.unlink("/step1/a")
    fs.rmdir("/step1")
    assert time.monotonic() - started < 1.0  # (not waiting for the uploads before them)
    with pytest.raises(FileNotFoundError):
        fs.getattr("/step1")
    assert "step1" not in [posixpath.basename(c.name) for c in fs.readdir("/")]
    time.sleep(0.3)
    assert stored(remote, "step1/a") == b"old"  # the bucket keeps it while step2 is not there
    gate.open.set()
    fs.sync("/")
    assert stored(remote, "step1/a") is None and not remote.fs.exists(remote.full("step1"))
    order = [e for e in gate.events if e[0] == "delete" or e[1].startswith("step2/")]
    assert order.index(("delete", "step1/a")) > max(order.index(("put", f"step2/p{i}")) for i in range(5))


def test_an_unlink_of_a_file_whose_upload_is_under_way_returns_at_once(wb: tuple[Filesystem, Gate],
                                                                      remote: Remote) -> None:
    """Orbax deletes the previous step while its big file may still be uploading: the unlink
    does not wait for that upload (it held the file's lock for all of it); the delete lands after it."""
    fs, gate = wb
    write(fs, "/old", b"x" * 100_000)
    hurry = threading.Thread(target=fs.sync, args=("/",), daemon=True)
    hurry.start()  # (its upload starts now, and waits at the gate holding the file)
    deadline = time.monotonic() + 10
    while not any(t.name.startswith("marinfs-wb") and t.is_alive() for t in threading.enumerate()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    started = time.monotonic()
    fs.unlink("/old")
    assert time.monotonic() - started < 1.0
    with pytest.raises(FileNotFoundError):
        fs.getattr("/old")
    gate.open.set()
    hurry.join(10)
    fs.sync("/")
    assert stored(remote, "old") is None
    assert ("put", "old") in gate.events and gate.events.index(("delete", "old")) > gate.events.index(("put", "old"))


def test_deletes_of_other_names_run_together_and_their_directory_after_them(wb: tuple[Filesystem, Gate],
                                                                             remote: Remote) -> None:
    """rm -r in write-back: the files' deletes go at once (up to --write-back-uploads), not one
    round trip after the other; the directory's after all of them."""
    fs, gate = wb
    gate.open.set()
    fs.mkdir("/d")
    for i in range(8):
        write(fs, f"/d/f{i}", b"x")
    fs.sync("/")
    delete, remove_dir = remote.delete, remote.remove_dir
    order: list[str] = []
    lock = threading.Lock()

    def slow_delete(key: str) -> None:
        time.sleep(0.3)
        delete(key)
        with lock:
            order.append(key)

    def recorded_remove_dir(key: str) -> None:
        remove_dir(key)
        with lock:
            order.append(key + "/")

    remote.delete = slow_delete  # type: ignore[method-assign]
    remote.remove_dir = recorded_remove_dir  # type: ignore[method-assign]
    started = time.monotonic()
    for i in range(8):
        fs.unlink(f"/d/f{i}")
    fs.rmdir("/d")
    fs.sync("/")
    assert time.monotonic() - started < 1.5  # 8 x 0.3 s one after the other would be 2.4 s
    assert order[-1] == "d/" and sorted(order[:-1]) == sorted(f"d/f{i}" for i in range(8))
    assert not remote.fs.exists(remote.full("d/f0"))


def test_a_name_deleted_here_and_made_again_lands_after_its_delete(wb: tuple[Filesystem, Gate],
                                                                  remote: Remote) -> None:
    """rm then a new file of the same name (or rm -r then mkdir): the delete queued first lands
    first, the new file or directory stays."""
    fs, gate = wb
    gate.open.set()
    fs.mkdir("/d")
    write(fs, "/d/f", b"one")
    fs.sync("/")
    gate.open.clear()
    write(fs, "/d/g", b"pending")  # an upload the delete must wait for
    fs.unlink("/d/f")
    write(fs, "/d/f", b"two")
    fh = fs.open("/d/f", os.O_RDONLY).fh
    assert fs.read(fh, 10, 0) == b"two"
    fs.release(fh)
    gate.open.set()
    fs.sync("/")
    assert stored(remote, "d/f") == b"two"  # deleted ("one"), then uploaded: not the other way round
    gate.open.clear()
    write(fs, "/d/h", b"pending")
    for name in ("f", "g", "h"):
        fs.unlink(f"/d/{name}")
    fs.rmdir("/d")
    gate.open.set()
    fs.mkdir("/d")  # (its marker waits for the rmdir queued before it)
    fs.sync("/")
    assert fs.getattr("/d").is_dir and fs.readdir("/d") == []
    assert remote.fs.exists(remote.full("d")) and not any(stored(remote, f"d/{n}") for n in "fgh")


def test_attributes_set_after_close_travel_with_the_upload(wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = wb
    write(fs, "/f", b"data")
    fs.set_attributes("/f", mtime_ns=1_600_000_000_000_000_000)  # rsync -a, tar: after the close
    puts_before = remote.stats.count("put") if hasattr(remote.stats, "count") else None
    gate.open.set()
    fs.sync("/")
    fs.metadata.forget("f")
    assert fs.getattr("/f").posix.mtime_ns == 1_600_000_000_000_000_000 and stored(remote, "f") == b"data"
    if puts_before is not None:
        assert remote.stats.count("setattr") == 0  # no metadata update after the upload: it carried them


def test_a_failed_background_upload_is_kept_and_the_next_sync_says_so(wb: tuple[Filesystem, Gate],
                                                                       remote: Remote) -> None:
    fs, gate = wb
    gate.fail.add("bad")
    write(fs, "/bad", b"kept")
    write(fs, "/good", b"ok")
    gate.open.set()
    with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
        fs.sync("/")
    assert fs.sync("/good") == b"0"  # a path the failure is not under
    status = fs.upload_status()
    assert [f["key"] for f in status["failed"]] == ["bad"] and stored(remote, "bad") is None
    gate.fail.clear()
    fs.retry_failed_commits()  # the daemon's retry loop
    assert stored(remote, "bad") == b"kept" and fs.sync("/") == b"0"


def test_a_writer_on_another_node_meanwhile_gets_a_conflict_copy_not_an_overwrite(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = wb
    gate.open.set()
    write(fs, "/f", b"v1")
    fs.sync("/")
    fh = fs.open("/f", os.O_WRONLY).fh  # starts from v1
    fs.write(fh, b"ours", 0)
    remote.fs.pipe_file(remote.full("f"), b"theirs")  # another node's commit meanwhile
    fs.flush(fh)
    fs.release(fh)
    # The bytes landed, beside the object: the next sync of a tree holding f says so, once.
    fs.mkdir("/elsewhere", 0o755)
    assert fs.sync("/elsewhere") == b"0"  # a tree it is not in
    with pytest.raises(OSError, check=lambda e: e.errno == errno.EEXIST):
        fs.sync("/")
    assert fs.sync("/") == b"0"  # reported: not every sync after it
    conflicts = fs.upload_status()["conflicts"]
    assert [c["key"] for c in conflicts] == ["f"] and stored(remote, "f") == b"theirs"
    assert stored(remote, conflicts[0]["committed_as"]) == b"ours"


def test_fsync_keeps_the_bytes_on_the_local_disk_without_waiting_for_the_bucket(
        wb: tuple[Filesystem, Gate], remote: Remote, tmp_path: Path) -> None:
    fs, gate = wb
    fh = fs.create("/f", CREAT).fh
    fs.write(fh, b"durable", 0)
    fs.fsync(fh)  # returns with the uploads held
    assert stored(remote, "f") is None
    assert any(p.name.endswith(".journal.json") for p in staging_entries(tmp_path / "staging"))
    fs.flush(fh)
    fs.release(fh)


def test_a_daemon_killed_with_uploads_pending_uploads_them_at_its_next_start(remote: Remote, tmp_path: Path) -> None:
    killed = Remote(remote.url)  # the first daemon's own client: its uploads never get through
    gate = Gate(killed)
    first = Filesystem(killed, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=2)
    for i in range(10):
        write(first, f"/f{i}", f"bytes {i}".encode())
    try:
        daemon_ended(first)
        second = Filesystem(remote, staging_dir=tmp_path / "staging")  # the next start, same cache directory
        results = second.recover_staged(at_start=True)
        assert sorted(r.key for r in results if r.committed_as) == sorted(f"f{i}" for i in range(10))
        assert [stored(remote, f"f{i}") for i in range(10)] == [f"bytes {i}".encode() for i in range(10)]
    finally:
        gate.fail.update(f"f{i}" for i in range(10))  # the killed daemon's held uploads end, failing
        gate.open.set()


def test_deletes_a_killed_daemon_queued_are_sent_at_its_next_start_after_the_uploads(
        remote: Remote, tmp_path: Path) -> None:
    """unlink returned (journaled), the daemon died before the uploads ahead of it ran: the
    next start uploads, then deletes; a name made again after its delete keeps its new bytes."""
    remote.fs.makedirs(remote.full("old"), exist_ok=True)
    for key in ("old/a", "keep"):
        remote.fs.pipe_file(remote.full(key), b"before")
    killed = Remote(remote.url)
    gate = Gate(killed)
    first = Filesystem(killed, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=2)
    write(first, "/x", b"new")  # pending: the deletes wait for it
    first.unlink("/old/a")
    first.unlink("/keep")
    write(first, "/keep", b"again")
    assert len(list((tmp_path / "staging").glob("delete-*.json"))) == 2
    try:
        daemon_ended(first)
        second = Filesystem(remote, staging_dir=tmp_path / "staging")
        second.recover_staged(at_start=True)
        assert stored(remote, "x") == b"new" and stored(remote, "keep") == b"again"
        assert stored(remote, "old/a") is None
        assert not list((tmp_path / "staging").glob("delete-*.json"))
    finally:
        gate.fail.update({"x", "keep"})
        gate.open.set()


def test_unmount_waits_for_the_queue(remote: Remote, tmp_path: Path) -> None:
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, drain_timeout=30)
    for i in range(10):
        write(fs, f"/f{i}", b"z")
    fs.close_all()
    assert fs.drained and [stored(remote, f"f{i}") for i in range(10)] == [b"z"] * 10
    assert not staging_entries(tmp_path / "staging")


class Fake:
    """What the queue needs of a staged file."""

    def __init__(self, key: str) -> None:
        self.key = key

    def known_size(self) -> int:
        return 1


@tiers.needs("unit")
def test_the_queue_uploads_in_order_and_a_barrier_covers_only_what_came_before() -> None:
    started: list[str] = []
    release = threading.Event()

    def upload(staged: Any) -> None:
        started.append(staged.key)
        if staged.key == "slow":
            release.wait(10)

    queue = WriteBack(upload, lambda staged: None, workers=1)
    try:
        for key in ("a", "slow", "b"):
            assert queue.enqueue(Fake(key))  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            queue.barrier(timeout=0.2)
        assert time.monotonic() - t0 < 2 and started == ["a", "slow"]
        queue.barrier(under="a", timeout=2)  # done already: returns at once
        release.set()
        queue.barrier(timeout=5)
        assert started == ["a", "slow", "b"] and queue.pending() == 0
    finally:
        release.set()
        assert queue.close(5)


@tiers.needs("unit")
def test_the_queue_picks_its_next_task_without_scanning_every_held_or_waiting_one() -> None:
    """A tar -x closes thousands of files within the delay: each close woke all 16 workers
    to scan every task and glob every held key (most of the daemon's CPU during the tar). Now
    a held key is asked once (and again after a rename), a close wakes one worker."""
    asked: list[str] = []
    sent: list[str] = []

    def hold(key: str) -> bool:
        asked.append(key)
        return key.startswith("tmp/")

    queue = WriteBack(lambda staged: sent.append(staged.key), lambda staged: None, workers=16,
                      delay=0.5, hold=hold)

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(sent) < count and time.monotonic() < deadline:
            time.sleep(0.02)

    try:
        held = [Fake(f"tmp/{i}") for i in range(1000)]
        for staged in [*held, *(Fake(f"later/{i}") for i in range(1000))]:
            assert queue.enqueue(staged)  # type: ignore[arg-type]
        wait_for(1000)  # the others pass the held ones once their delay is over
        time.sleep(0.2)
        assert sorted(sent) == sorted(f"later/{i}" for i in range(1000))
        assert len(asked) <= 2000  # each key asked once (it was ~16 x 1,000 x 1,000 globs)
        for staged in held[:10]:  # renamed out of the held directory: they go, the others wait
            staged.key = staged.key.replace("tmp/", "final/")
        queue.changed()
        wait_for(1010)
        time.sleep(0.2)
        assert sorted(sent[1000:]) == sorted(f"final/{i}" for i in range(10)) and len(asked) <= 2010
        queue.barrier(timeout=10)  # a barrier frees the held ones, in closing order
        assert sorted(sent[1010:]) == sorted(f"tmp/{i}" for i in range(10, 1000)) and len(asked) <= 2010
    finally:
        assert queue.close(5)


# -- through a mount ---------------------------------------------------------------------------
@pytest.fixture(params=["local", "s3"])
@tiers.needs("mount")
def wb_mount(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A live --write-back mount of a fresh prefix (a daemon of the test's own)."""
    from conftest import object_store
    from mounting import Mounted, fsspec_client, subprocess_mount

    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    if request.param == "local":
        (tmp_path / "remote").mkdir()
        url, env, options = str(tmp_path / "remote"), None, {}
    else:
        url, options, env = object_store(request, request.param)
    fs, root = fsspec_client(url, {**options, "use_listings_cache": False} if options else None)
    with subprocess_mount(url, mnt, cache, "--write-back", env=env) as pid:
        yield Mounted(mnt=mnt, url=url, fs=fs, root=root, cache_dir=cache, pid=pid, env=env)


def test_tar_through_a_write_back_mount_then_marinfs_sync_has_every_file_in_the_bucket(
        wb_mount: Any, tmp_path: Path) -> None:
    import subprocess
    import sys
    import tarfile

    src = tmp_path / "src"
    files = {f"d{i % 5}/f{i:03d}": os.urandom(1 + (i * 97) % 5000) for i in range(150)}
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(src, arcname="tree")
    subprocess.run(["tar", "-xf", str(archive), "-C", str(wb_mount.mnt)], check=True, timeout=300)
    done = subprocess.run([sys.executable, "-m", "marinfs", "sync", "-q", str(wb_mount.mnt / "tree")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(wb_mount.env or {})})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("synced ")
    for name, data in files.items():
        assert wb_mount.remote_bytes(f"tree/{name}") == data


def test_a_marker_is_never_in_the_bucket_before_the_files_closed_before_it(wb_mount: Any) -> None:
    """Another node polling the bucket for the marker finds every data file once it sees it."""
    d = wb_mount.mnt / "step-1"
    d.mkdir()
    names = [f"shard{i:03d}" for i in range(100)]
    seen: list[bool] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            if wb_mount.remote_exists("step-1/.executor_status"):
                seen.append(all(wb_mount.remote_exists(f"step-1/{n}") for n in names))
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    for n in names:
        (d / n).write_bytes(os.urandom(2000))
    (d / ".executor_status").write_text("SUCCESS")  # its close returns once it is in the bucket
    poller.join(30)
    stop.set()
    assert seen == [True]


def test_marinfs_sync_outside_a_mount_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    for args in ([str(tmp_path)], [str(tmp_path / "missing")]):
        done = subprocess.run([sys.executable, "-m", "marinfs", "sync", *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "marinfs: error:" in done.stderr, done.stderr


def test_a_rename_of_files_not_uploaded_yet_sends_their_uploads_to_the_new_names(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    """Orbax saves into a temporary directory and renames it; rsync writes a temporary file and
    renames it: the bytes go once, to the final names, and nothing is copied in the bucket."""
    fs, gate = wb
    if remote.renames_in_place:
        pytest.skip("a local disk renames what it holds in one rename(2): nothing to re-target")
    fs.mkdir("/ckpt.tmp-123")
    for i in range(5):
        write(fs, f"/ckpt.tmp-123/array{i}", f"array {i}".encode())
    write(fs, "/.f.XyZ12", b"rsync's")
    fs.set_attributes("/.f.XyZ12", mtime_ns=1_500_000_000_000_000_000)
    fs.rename("/ckpt.tmp-123", "/ckpt")  # returns with the uploads still held
    fs.rename("/.f.XyZ12", "/f")
    assert sorted(c.name for c in fs.readdir("/ckpt")) == [f"ckpt/array{i}" for i in range(5)]
    assert fs.read(fs.open("/f", os.O_RDONLY).fh, 100, 0) == b"rsync's"
    gate.open.set()
    fs.sync("/")
    assert [stored(remote, f"ckpt/array{i}") for i in range(5)] == [f"array {i}".encode() for i in range(5)]
    assert stored(remote, "f") == b"rsync's" and stored(remote, ".f.XyZ12") is None
    assert not remote.fs.exists(remote.full("ckpt.tmp-123"))
    assert remote.stats.count("copy") == 0  # no byte copied in the bucket
    puts = [k for kind, k in gate.events if kind == "put"]
    assert sorted(puts) == sorted([f"ckpt/array{i}" for i in range(5)] + ["f"])
    fs.metadata.forget("f")
    assert fs.getattr("/f").posix.mtime_ns == 1_500_000_000_000_000_000


def test_a_manifest_written_beside_and_renamed_over_the_last_one_is_uploaded_once_at_the_end(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    """TensorStore's OCDBT writes manifest.ocdbt.__lock and renames it over manifest.ocdbt,
    many times a save: each rename re-targets, replacing the previous pending upload."""
    fs, gate = wb
    if remote.renames_in_place:
        pytest.skip("a local disk renames what it holds in one rename(2): nothing to re-target")
    for i in range(6):
        write(fs, "/manifest.ocdbt.__lock", f"manifest {i}".encode())
        fs.rename("/manifest.ocdbt.__lock", "/manifest.ocdbt")  # returns at once: the uploads are held
    assert fs.read(fs.open("/manifest.ocdbt", os.O_RDONLY).fh, 100, 0) == b"manifest 5"
    gate.open.set()
    fs.sync("/")
    assert stored(remote, "manifest.ocdbt") == b"manifest 5" and stored(remote, "manifest.ocdbt.__lock") is None
    assert remote.stats.count("copy") == 0 and fs.upload_status()["conflicts"] == []
    assert [k for kind, k in gate.events if kind == "put"] == ["manifest.ocdbt"]


def test_a_directory_partly_uploaded_moves_what_is_in_the_bucket_and_re_targets_the_rest(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = wb
    if remote.renames_in_place:
        pytest.skip("a local disk renames what it holds in one rename(2): nothing to re-target")
    gate.open.set()
    fs.mkdir("/tmp-step")
    write(fs, "/tmp-step/early", b"early")
    fs.sync("/")  # in the bucket
    gate.open.clear()
    write(fs, "/tmp-step/late", b"late")  # held
    fs.rename("/tmp-step", "/step")
    gate.open.set()
    fs.sync("/")
    assert stored(remote, "step/early") == b"early" and stored(remote, "step/late") == b"late"
    assert remote.stats.count("copy") == 1  # only the one in the bucket
    assert not remote.fs.exists(remote.full("tmp-step/early"))


def test_files_under_a_temporary_checkpoint_directory_wait_for_its_rename(remote: Remote, tmp_path: Path) -> None:
    """--write-back-hold (Orbax's temporary directories by default): past the delay their uploads
    still wait, while later files go; the rename sends them to their final names."""
    if remote.renames_in_place:
        pytest.skip("a local disk renames what it holds in one rename(2): nothing to re-target")
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=0.0,
                    write_back_hold=("**/*.orbax-checkpoint-tmp*/**",))
    try:
        fs.mkdir("/1.orbax-checkpoint-tmp")
        write(fs, "/1.orbax-checkpoint-tmp/array", b"weights")
        write(fs, "/other", b"goes")
        deadline = time.monotonic() + 10
        while stored(remote, "other") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored(remote, "other") == b"goes"  # behind the held one, not stuck behind it
        time.sleep(0.3)
        assert fs.upload_status()["write_back"]["queued"] == 1  # still held
        fs.rename("/1.orbax-checkpoint-tmp", "/1")
        fs.sync("/")
        assert stored(remote, "1/array") == b"weights" and remote.stats.count("copy") == 0
    finally:
        fs.close_all()


def test_directories_made_in_a_temporary_checkpoint_directory_reach_the_bucket_with_its_rename(
        remote: Remote, tmp_path: Path) -> None:
    """Orbax's shape: step.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt/d, renamed to
    .../default, then the step renamed into place. Directories made inside the temporary one are
    this node's until the rename takes them out: no marker made, none renamed, none deleted."""
    if remote.renames_in_place:
        pytest.skip("a local disk renames what it holds in one rename(2): nothing to re-target")
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=60.0,
                    write_back_hold=("**/*.orbax-checkpoint-tmp*/**",))
    try:
        fs.mkdir("/s.orbax-checkpoint-tmp")
        fs.mkdir("/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp")
        fs.mkdir("/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt", 0o750)
        fs.mkdir("/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt/d")
        fs.mkdir("/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/empty")
        write(fs, "/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/ocdbt/d/chunk", b"weights")
        fs.rmdir("/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/empty")
        inner = "/s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp"
        assert [posixpath.basename(c.name) for c in fs.readdir(inner)] == ["ocdbt"]
        assert fs.getattr(inner + "/ocdbt/d").is_dir
        with pytest.raises(OSError) as err:
            fs.rmdir(inner + "/ocdbt")
        assert err.value.errno == errno.ENOTEMPTY
        assert not remote.fs.exists(remote.full("s.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp"))
        before = remote.stats.snapshot()["requests"]
        fs.rename(inner, "/s.orbax-checkpoint-tmp/default")  # still inside the temporary one
        spent = {k: v - before.get(k, 0) for k, v in remote.stats.snapshot()["requests"].items()}
        assert sum(spent.values()) <= 1, spent  # (one listing: is anything of it in the bucket)
        assert not remote.fs.exists(remote.full("s.orbax-checkpoint-tmp/default"))
        fs.rename("/s.orbax-checkpoint-tmp", "/s")
        assert remote.fs.isdir(remote.full("s/default/ocdbt/d"))  # made by the rename out
        fs.sync("/")
        assert stored(remote, "s/default/ocdbt/d/chunk") == b"weights"
        assert fs.getattr("/s/default/ocdbt").posix.mode == 0o750
        assert not remote.fs.exists(remote.full("s.orbax-checkpoint-tmp"))
        assert remote.stats.count("copy") == 0
    finally:
        fs.close_all()


def test_a_barrier_before_the_rename_makes_the_directories_of_what_it_sends(remote: Remote, tmp_path: Path) -> None:
    """`marinfs sync` while a temporary checkpoint directory is being written: its files go up
    under their temporary names with their directories, and the rename then moves them."""
    if remote.renames_in_place:
        pytest.skip("a local disk renames what it holds in one rename(2): nothing to re-target")
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=60.0,
                    write_back_hold=("**/*.orbax-checkpoint-tmp*/**",))
    try:
        fs.mkdir("/t.orbax-checkpoint-tmp")
        fs.mkdir("/t.orbax-checkpoint-tmp/a")
        fs.mkdir("/t.orbax-checkpoint-tmp/a/b")
        write(fs, "/t.orbax-checkpoint-tmp/a/b/f", b"early")
        fs.sync("/")
        assert stored(remote, "t.orbax-checkpoint-tmp/a/b/f") == b"early"
        assert [posixpath.basename(c.name) for c in fs.readdir("/t.orbax-checkpoint-tmp/a/b")] == ["f"]
        write(fs, "/t.orbax-checkpoint-tmp/a/g", b"late")
        fs.rename("/t.orbax-checkpoint-tmp", "/t")
        fs.sync("/")
        assert stored(remote, "t/a/b/f") == b"early" and stored(remote, "t/a/g") == b"late"
        assert not remote.fs.exists(remote.full("t.orbax-checkpoint-tmp/a/b/f"))
        assert sorted(posixpath.basename(c.name) for c in fs.readdir("/t/a")) == ["b", "g"]
    finally:
        fs.close_all()


def test_a_full_staging_area_makes_a_close_wait_for_room_not_fail(remote: Remote, tmp_path: Path) -> None:
    gate = Gate(remote)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=5.0,
                    write_back_max_bytes=2500)
    try:
        write(fs, "/a", b"x" * 1000)
        write(fs, "/b", b"x" * 1000)  # 2,000 bytes wait: room left
        closed = threading.Event()
        threading.Thread(target=lambda: (write(fs, "/c", b"x" * 1000), closed.set()), daemon=True).start()
        assert not closed.wait(0.5)  # 3,000 > 2,500: the close waits (the uploads are held)
        gate.open.set()
        assert closed.wait(10)  # room made: it returns
        fs.sync("/")
        assert [stored(remote, k) for k in "abc"] == [b"x" * 1000] * 3
    finally:
        gate.open.set()
        fs.close_all()


def test_a_rename_of_a_file_already_uploaded_copies_it_after_the_uploads_before_it(
        wb: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = wb
    gate.open.set()
    write(fs, "/a", b"first")
    fs.sync("/")
    fs.rename("/a", "/b")
    assert stored(remote, "b") == b"first" and stored(remote, "a") is None


def test_a_checkpoint_saved_to_a_temporary_directory_then_renamed_is_uploaded_once(wb_mount: Any) -> None:
    """Orbax on a POSIX path: save into a temporary directory, rename it into place. With
    write-back the rename sends the uploads to the final names: no byte is copied in the bucket."""
    import json
    import subprocess
    import sys

    tmp = wb_mount.mnt / "step_100.orbax-checkpoint-tmp-1"
    tmp.mkdir()
    arrays = {f"array{i}": os.urandom(50_000 + i) for i in range(20)}
    arrays["big"] = os.urandom(24 << 20)  # parts: none may go to the temporary name while written
    env = {**os.environ, **(wb_mount.env or {})}

    def counters() -> dict[str, Any]:
        time.sleep(2.5)  # the daemon publishes its counters every 2 s
        return json.loads(subprocess.run([sys.executable, "-m", "marinfs", "status", "--json", str(wb_mount.mnt)],
                                         capture_output=True, text=True, check=True, env=env).stdout)[0]

    before = counters() if not wb_mount.url.startswith("/") else None
    for name, data in arrays.items():
        with open(tmp / name, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())  # TensorStore fsyncs every file: the local disk, not the bucket
    os.rename(tmp, wb_mount.mnt / "step_100")
    subprocess.run([sys.executable, "-m", "marinfs", "sync", "-q", str(wb_mount.mnt)], check=True, env=env,
                   timeout=120)
    for name, data in arrays.items():
        assert wb_mount.remote_bytes(f"step_100/{name}") == data
    assert not wb_mount.remote_exists("step_100.orbax-checkpoint-tmp-1/array0")
    if before is not None:  # (a local disk renames in place)
        after = counters()["remote_requests"]
        assert after["requests"].get("copy", 0) == 0
        sent = after["bytes_out"] - before["remote_requests"]["bytes_out"]
        assert sent < 1.05 * sum(map(len, arrays.values())), sent  # each byte sent once


def test_rsync_through_a_write_back_mount_costs_one_request_a_file(wb_mount: Any, tmp_path: Path) -> None:
    """rsync -a: a temporary name, close, utimens, chmod, rename. With write-back the
    attributes travel with the upload and the rename re-targets it: one PUT a file, no copy."""
    import json
    import subprocess
    import sys

    if wb_mount.url.startswith("/"):
        pytest.skip("requests are counted on object stores")
    src = tmp_path / "src"
    for i in range(120):
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i:03d}").write_bytes(os.urandom(100 + i))
        os.chmod(src / f"d{i % 4}" / f"f{i:03d}", 0o600)
    env = {**os.environ, **(wb_mount.env or {})}

    def requests() -> dict[str, int]:
        time.sleep(2.5)  # the daemon publishes its counters every 2 s
        out = subprocess.run([sys.executable, "-m", "marinfs", "status", "--json", str(wb_mount.mnt)],
                             capture_output=True, text=True, check=True, env=env).stdout
        return json.loads(out)[0]["remote_requests"]["requests"]

    before = requests()
    subprocess.run(["rsync", "-a", f"{src}/", str(wb_mount.mnt / "dst")], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "marinfs", "sync", "-q", str(wb_mount.mnt)], check=True, env=env,
                   timeout=300)
    after = requests()
    spent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert spent.get("copy", 0) == 0 and spent.get("delete", 0) == 0, spent
    assert sum(spent.values()) <= 1.2 * 120, spent  # one PUT a file (and a few for the directories)
    for i in (0, 57, 119):
        name = f"dst/d{i % 4}/f{i:03d}"
        assert wb_mount.remote_bytes(name) == (src / f"d{i % 4}" / f"f{i:03d}").read_bytes()
    assert os.stat(wb_mount.mnt / "dst" / "d1" / "f001").st_mode & 0o777 == 0o600


@tiers.needs("unit")
def test_status_shows_the_write_back_queue() -> None:
    from marinfs.app.status import format_status

    item = {"mountpoint": "/m", "remote": "s3://b/p",
            "uploads": {"pending": ["a", "b"], "failed": [], "conflicts": [], "write_back": {"queued": 2, "uploaded": 7}}}
    assert "  write-back: 2 queued or uploading, 7 ended" in format_status([item]).splitlines()
    item["uploads"]["write_back"]["paths"] = ["ckpt/**", "*.bin"]  # --write-back-path
    assert "  write-back (paths ckpt/**, *.bin only): 2 queued or uploading, 7 ended" in format_status([item]).splitlines()



# -- write-back for some paths (--write-back-path) -----------------------------------------------
SCOPE = ("ckpt/**",)


def in_scope(key: str) -> bool:
    return key.startswith("ckpt/")


@pytest.fixture
@tiers.needs("core")
def scoped(remote: Remote, tmp_path: Path) -> Iterator[tuple[Filesystem, Gate]]:
    """Write-back for ckpt/** only: the uploads of files there are held until the gate opens;
    every other file is committed at its close, as in the default mode."""
    with gated(remote, tmp_path, holds=in_scope, write_back_paths=SCOPE) as made:
        yield made


@pytest.mark.core
def test_the_write_back_paths_decide_per_file_and_write_back_alone_means_every_file(
        remote: Remote, tmp_path: Path) -> None:
    def writes_back(**kwargs: Any) -> list[bool] | None:
        fs = Filesystem(remote, staging_dir=tmp_path / "staging", **kwargs)
        try:
            if fs.writes.write_back is None:
                return None  # no queue at all: the default mode everywhere
            return [fs.writes.writes_back(k) for k in ("ckpt/a", "ckpt/d/b", "logs/c", "ckpt")]
        finally:
            fs.close_all()

    assert writes_back() is None
    assert writes_back(write_back=True) == [True, True, True, True]
    assert writes_back(write_back_paths=SCOPE) == [True, True, False, False]
    assert writes_back(write_back=True, write_back_paths=SCOPE) == [True, True, False, False]  # still narrowed


def test_only_files_under_the_write_back_paths_return_from_close_before_the_bucket_has_them(
        scoped: tuple[Filesystem, Gate], remote: Remote, tmp_path: Path) -> None:
    fs, gate = scoped
    fs.mkdir("/ckpt")
    fs.mkdir("/logs")
    write(fs, "/ckpt/a", b"weights")  # returns with its upload held
    write(fs, "/logs/b", b"line")  # returns once it is in the bucket
    assert stored(remote, "ckpt/a") is None and stored(remote, "logs/b") == b"line"
    fh = fs.create("/logs/c", CREAT).fh
    fs.write(fh, b"synced", 0)
    fs.fsync(fh)  # the default mode's fsync: the bucket
    assert stored(remote, "logs/c") == b"synced"
    fs.release(fh)
    fh = fs.create("/ckpt/d", CREAT).fh
    fs.write(fh, b"local", 0)
    fs.fsync(fh)  # write-back's fsync: the local disk
    assert stored(remote, "ckpt/d") is None
    fs.flush(fh)
    fs.release(fh)
    status = fs.upload_status()["write_back"]
    assert status["queued"] == 2 and status["paths"] == ["ckpt/**"]
    gate.open.set()
    assert fs.sync("/ckpt") == b"0"
    assert stored(remote, "ckpt/a") == b"weights" and stored(remote, "ckpt/d") == b"local"
    assert fs.upload_status()["write_back"]["queued"] == 0


def test_a_file_renamed_out_of_the_write_back_paths_is_in_the_bucket_when_the_rename_returns(
        scoped: tuple[Filesystem, Gate], remote: Remote) -> None:
    """Its new name promises what a close there promises: the rename uploads it (after every
    upload closed before it), while a rename inside the paths returns at once, re-targeted."""
    fs, gate = scoped
    fs.mkdir("/ckpt")
    fs.mkdir("/ckpt/tmp-dir")
    fs.mkdir("/out")
    write(fs, "/ckpt/earlier", b"closed before")
    write(fs, "/ckpt/x.tmp", b"leaves")
    write(fs, "/ckpt/tmp-dir/p", b"tree leaves")
    write(fs, "/ckpt/y.tmp", b"stays")
    if not remote.renames_in_place:  # (a local disk renames what it holds: committed, then rename(2))
        fs.rename("/ckpt/y.tmp", "/ckpt/y")  # inside: re-targeted at once, nothing in the bucket yet
        assert stored(remote, "ckpt/y") is None
    renamed = threading.Event()

    def rename_out() -> None:
        fs.rename("/ckpt/x.tmp", "/out/x")
        fs.rename("/ckpt/tmp-dir", "/out/dir")
        renamed.set()

    threading.Thread(target=rename_out, daemon=True).start()
    assert not renamed.wait(0.5)  # waits for its upload, held by the gate
    gate.open.set()
    assert renamed.wait(20)
    assert stored(remote, "out/x") == b"leaves" and stored(remote, "out/dir/p") == b"tree leaves"
    assert stored(remote, "ckpt/x.tmp") is None and stored(remote, "ckpt/tmp-dir/p") is None
    assert stored(remote, "ckpt/earlier") == b"closed before"  # what was closed before it landed first
    assert fs.read(fs.open("/out/x", os.O_RDONLY).fh, 100, 0) == b"leaves"
    fs.sync("/")
    assert stored(remote, "ckpt/y" if not remote.renames_in_place else "ckpt/y.tmp") == b"stays"


def test_a_rename_out_of_the_write_back_paths_whose_upload_fails_is_eio_and_moves_nothing(
        scoped: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = scoped
    gate.open.set()
    gate.fail.add("ckpt/x.tmp")
    fs.mkdir("/ckpt")
    write(fs, "/ckpt/x.tmp", b"kept")
    with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
        fs.rename("/ckpt/x.tmp", "/x")
    assert stored(remote, "x") is None and [f["key"] for f in fs.upload_status()["failed"]] == ["ckpt/x.tmp"]
    assert fs.read(fs.open("/ckpt/x.tmp", os.O_RDONLY).fh, 100, 0) == b"kept"  # still this node's, at its name
    gate.fail.clear()
    fs.retry_failed_commits()
    assert stored(remote, "ckpt/x.tmp") == b"kept"


def test_a_delete_outside_the_write_back_paths_never_overtakes_an_upload_closed_before_it(
        scoped: tuple[Filesystem, Gate], remote: Remote) -> None:
    """The barrier rule is mount-wide: an old file outside the paths is not deleted from the
    bucket while a new checkpoint closed before the delete is incomplete there."""
    fs, gate = scoped
    fs.mkdir("/old")
    write(fs, "/old/a", b"old")  # the default mode: in the bucket at its close
    assert stored(remote, "old/a") == b"old"
    fs.mkdir("/ckpt")
    for i in range(3):
        write(fs, f"/ckpt/p{i}", b"new")
    removed = threading.Event()
    threading.Thread(target=lambda: (fs.unlink("/old/a"), removed.set()), daemon=True).start()
    assert not removed.wait(0.3) and stored(remote, "old/a") == b"old"
    gate.open.set()
    assert removed.wait(10)
    order = [e for e in gate.events if e == ("delete", "old/a") or e[1].startswith("ckpt/")]
    assert order.index(("delete", "old/a")) > max(order.index(("put", f"ckpt/p{i}")) for i in range(3))


def test_a_commit_marker_outside_the_write_back_paths_lands_after_the_files_closed_before_it(
        scoped: tuple[Filesystem, Gate], remote: Remote) -> None:
    fs, gate = scoped
    fs.mkdir("/ckpt")
    for i in range(3):
        write(fs, f"/ckpt/p{i}", b"shard")
    closed = threading.Event()
    threading.Thread(target=lambda: (write(fs, "/_SUCCESS", b"ok"), closed.set()), daemon=True).start()
    assert not closed.wait(0.3) and stored(remote, "_SUCCESS") is None
    gate.open.set()
    assert closed.wait(10) and stored(remote, "_SUCCESS") == b"ok"  # its close: the bucket, last
    puts = [k for kind, k in gate.events if kind == "put"]
    assert puts[-1] == "_SUCCESS" and sorted(puts[:-1]) == [f"ckpt/p{i}" for i in range(3)]


@pytest.mark.mount
def test_through_a_mount_only_a_close_under_a_write_back_path_returns_before_the_bucket_has_it(
        request: pytest.FixtureRequest, s3_server: Any, tmp_path: Path) -> None:
    """--write-back-path alone, on S3, with uploads delayed 10 minutes: a file under the path is
    still not in the bucket after its close returned, a file elsewhere is in the bucket once its
    close returns; `marinfs sync` then uploads the first at once."""
    import subprocess
    import sys

    from conftest import object_store
    from mounting import Mounted, fsspec_client, subprocess_mount

    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    url, options, env = object_store(request, "s3")
    fs, root = fsspec_client(url, {**options, "use_listings_cache": False})
    with subprocess_mount(url, mnt, cache, "--write-back-path", "ckpt/**", "--write-back-delay", "600",
                          env=env) as pid:
        m = Mounted(mnt=mnt, url=url, fs=fs, root=root, cache_dir=cache, pid=pid, env=env)
        (mnt / "ckpt").mkdir()
        (mnt / "logs").mkdir()
        weights, line = os.urandom(100_000), b"step 1 done\n"
        (mnt / "ckpt" / "weights").write_bytes(weights)  # close returned; the upload waits 600 s
        (mnt / "logs" / "train.log").write_bytes(line)  # close returned once it was in the bucket
        assert m.remote_bytes("logs/train.log") == line
        assert not m.remote_exists("ckpt/weights")
        assert (mnt / "ckpt" / "weights").read_bytes() == weights  # this node reads its own writes
        subprocess.run([sys.executable, "-m", "marinfs", "sync", "-q", str(mnt / "ckpt")], check=True,
                       env={**os.environ, **env}, timeout=120)
        assert m.remote_bytes("ckpt/weights") == weights


@pytest.mark.unit
def test_marinfs_sync_names_the_conflicts_it_was_told_of_not_older_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon answers a sync EEXIST for conflicts no sync reported yet and marks them
    ``synced``; its status lists every conflict it had, so the CLI names those marked since it
    asked, under its path."""
    from marinfs.app import synccli

    published = [{"published": 100.0, "uploads": {"conflicts": [
        {"key": "a/old", "committed_as": "a/old.marinfs-conflict-1", "synced": 40.0},
        {"key": "a/new", "committed_as": "a/new.marinfs-conflict-2", "synced": 60.0},
        {"key": "b/new", "committed_as": "b/new.marinfs-conflict-3", "synced": 60.0}]}}]
    monkeypatch.setattr(synccli, "_status", lambda mountpoint: published)
    assert synccli._conflicts_under("/mnt/a", "/mnt", since=90.0, reported_after=50.0) == [
        ("a/new", "a/new.marinfs-conflict-2")]
    assert len(synccli._conflicts_under("/mnt", "/mnt", since=90.0, reported_after=50.0)) == 2
