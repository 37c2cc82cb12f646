"""Edges of write-back and journaled renames a review found (each failed before its fix): a
marker renamed into place, a rename over a file still uploading, a crash after a re-targeted
rename, fsync after a lost write, a stale rename journal, a file whose upload failed.
Core tier: memory://, no FUSE."""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import tiers
from mounting import daemon_ended
from test_writeback import stored, write

from marinfs.core import Filesystem
from marinfs.remote import Remote

CREAT = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
MARKERS = ("**/.executor_status", "**/_SUCCESS")


@pytest.fixture
@tiers.needs("core")
def remote() -> Any:
    r = Remote(f"memory://review-{uuid.uuid4().hex}")
    r.fs.mkdir(r.root)
    yield r
    r.close()
    try:
        r.fs.rm(r.root, recursive=True)
    except Exception:
        pass


def names(remote: Remote) -> list[str]:
    return sorted(p[len(remote.root) + 1:] for p in remote.fs.find(remote.root))


# 1 -------------------------------------------------------------------------------------------
def test_a_marker_renamed_into_place_never_lands_before_the_files_closed_before_it(
        remote: Remote, tmp_path: Path) -> None:
    """`echo ok > _SUCCESS.tmp && mv _SUCCESS.tmp _SUCCESS`: a marker is committed after every
    file closed before it (semantics.md). _retarget sends the marker's upload into the queue
    beside the earlier ones instead."""
    held = threading.Event()
    upload = remote.upload

    def slow_a(local: str, key: str, *args: Any, **kwargs: Any) -> Any:
        if key == "a":
            held.wait(20)
        return upload(local, key, *args, **kwargs)

    remote.upload = slow_a  # type: ignore[method-assign]
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=4,
                    write_back_delay=0.5, commit_markers=MARKERS, drain_timeout=30)
    try:
        write(fs, "/a", b"data closed before the marker")
        write(fs, "/_SUCCESS.tmp", b"ok")
        fs.rename("/_SUCCESS.tmp", "/_SUCCESS")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and stored(remote, "_SUCCESS") is None:
            time.sleep(0.05)
        marker, data = stored(remote, "_SUCCESS"), stored(remote, "a")
        assert not (marker is not None and data is None), "the marker is in the bucket before a"
    finally:
        held.set()
        fs.close_all()


# 2 -------------------------------------------------------------------------------------------
def test_a_new_file_renamed_over_a_rewritten_file_pending_upload_replaces_it(remote: Remote, tmp_path: Path) -> None:
    """f exists in the bucket; this node rewrites it (queued, base = its version), then renames a
    new file over it (rsync, an editor's save). _retarget rebases the new file on the *staged*
    target's version, None: its upload expects no object, meets f, and goes to a conflict name."""
    remote.fs.pipe(remote.full("f"), b"old")
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=2,
                    write_back_delay=60, drain_timeout=30)
    try:
        fh = fs.open("/f", os.O_WRONLY | os.O_TRUNC).fh
        fs.write(fh, b"rewritten", 0)
        fs.flush(fh)
        fs.release(fh)
        write(fs, "/.f.tmp", b"final")
        fs.rename("/.f.tmp", "/f")
        fs.sync("/")
    finally:
        fs.close_all()
    assert stored(remote, "f") == b"final", names(remote)
    assert names(remote) == ["f"], names(remote)


# 3 -------------------------------------------------------------------------------------------
def test_a_retargeted_rename_over_an_existing_object_survives_a_crash(remote: Remote, tmp_path: Path) -> None:
    """_retarget's rebase(target.version) is in memory only: the journal (rewritten by rekey
    before it) still says base_version None, so the next start's replay expects no object at f,
    meets the old one, and commits the bytes to a conflict name."""
    remote.fs.pipe(remote.full("f"), b"old")
    first = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=1,
                       write_back_delay=600, drain_timeout=1)
    write(first, "/.f.tmp", b"final")
    first.lookup("f")
    first.rename("/.f.tmp", "/f")
    # killed: never closed (its workers wait 600 s); the next start on the same cache directory
    daemon_ended(first)
    second = Filesystem(remote, staging_dir=tmp_path / "staging")
    results = second.recover_staged(at_start=True)
    assert [(r.key, r.committed_as, r.conflict) for r in results] == [("f", "f", False)], results
    assert stored(remote, "f") == b"final", names(remote)


# 4 -------------------------------------------------------------------------------------------
def test_fsync_in_write_back_reports_a_write_that_never_reached_the_staging_file(
        remote: Remote, tmp_path: Path) -> None:
    """A write lost to a full staging disk poisons the file (failed_write). The default mode's
    fsync raises it; flush does in write-back too; write-back's fsync answers success."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=60)
    try:
        fh = fs.create("/f", CREAT).fh
        fs.write(fh, b"x", 0)
        staged = fs.handles.get(fh).staged
        staged._poison(OSError(errno.ENOSPC, "No space left on device"))  # as write() does on ENOSPC
        with pytest.raises(OSError) as err:
            fs.fsync(fh)
        assert err.value.errno == errno.ENOSPC
    finally:
        fs.release(fh)
        fs.close_all()


# 5 -------------------------------------------------------------------------------------------
def test_a_stale_rename_journal_does_not_move_a_tree_made_later(remote: Remote, tmp_path: Path) -> None:
    """`mv out out.old` fails midway (journal kept); the user cleans up (`rm -rf out`) and the
    next job writes a new `out`. The next start replays the old journal: the new `out` is moved
    into `out.old`, silently, over what is there."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    for name in ("a", "b"):
        remote.fs.pipe(remote.full(f"out/{name}"), name.encode())
    copy = remote.copy
    calls = {"n": 0}

    def failing_copy(src: str, dst: str, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EIO, "injected: the store went away")
        return copy(src, dst, *args, **kwargs)

    remote.copy = failing_copy  # type: ignore[method-assign]
    with pytest.raises(OSError):
        fs.rename("/out", "/out.old")
    remote.copy = copy  # type: ignore[method-assign]
    for name in ("a", "b"):  # rm -rf out
        fs.unlink(f"/out/{name}")
    try:
        fs.rmdir("/out")
    except OSError:
        pass
    if fs.namespace.lookup_or_none("out") is None:
        fs.mkdir("/out")
    write(fs, "/out/new", b"the next job's output")
    fs.close_all()
    second = Filesystem(remote, staging_dir=tmp_path / "staging")
    second.finish_renames()  # the next start
    assert stored(remote, "out/new") == b"the next job's output", names(remote)


# 6 -------------------------------------------------------------------------------------------
def test_a_file_whose_background_upload_failed_can_be_removed_and_stays_removed(
        remote: Remote, tmp_path: Path) -> None:
    """semantics.md: in write-back this node's stat shows its own writes, uploaded or not, and a
    failed upload's bytes are kept and retried. Once the queue released the file, the name is
    gone here (ENOENT), so `rm` cannot remove it, and the retry then puts it in the bucket."""
    upload = remote.upload
    failing = {"on": True}

    def flaky(local: str, key: str, *args: Any, **kwargs: Any) -> Any:
        if failing["on"]:
            raise OSError(errno.EIO, "injected", key)
        return upload(local, key, *args, **kwargs)

    remote.upload = flaky  # type: ignore[method-assign]
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=0)
    try:
        write(fs, "/f", b"bytes")
        with pytest.raises(OSError):
            fs.sync("/")
        removed = True
        try:
            fs.getattr("/f")  # still this node's file
            fs.unlink("/f")
        except FileNotFoundError:
            removed = False
        failing["on"] = False
        fs.retry_failed_commits()
        assert removed and stored(remote, "f") is None, (removed, names(remote))
    finally:
        fs.close_all()


def test_a_commit_its_writer_interrupted_is_kept_not_retried_in_a_loop(remote: Remote, tmp_path: Path) -> None:
    """Issue 37, item 1: once the writer gave up (EINTR), the daemon stops sending, also at the
    next retry interval; the bytes are kept and tried once more at the next start."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    sent: list[str] = []
    upload = remote.upload

    def interrupted_upload(local: str, key: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(key)
        raise InterruptedError(errno.EINTR, "the caller gave up")

    remote.upload = interrupted_upload  # type: ignore[method-assign]
    fh = fs.create("/sparse", CREAT).fh
    fs.write(fh, b"bytes", 0)
    with pytest.raises(OSError, check=lambda e: e.errno == errno.EINTR):
        fs.flush(fh)
    fs.release(fh)
    assert sent == ["sparse"] and [f["retry"] for f in fs.upload_status()["failed"]] == ["at the next start"]
    assert fs.retry_failed_commits() == [] and sent == ["sparse"]  # the retry loop sends nothing
    remote.upload = upload  # type: ignore[method-assign]
    daemon_ended(fs)
    later = Filesystem(remote, staging_dir=tmp_path / "staging")  # the next start tries it once
    later.recover_staged(at_start=True)
    assert bytes(remote.fs.cat_file(remote.full("sparse"))) == b"bytes"


# Deferred deletes (unlink and rmdir queued as fences of the upload queue) -----------------------
def _deferring(remote: Remote, tmp_path: Path, holds: Any = lambda key: key == "pending", **kwargs: Any) -> Any:
    """A write-back mount whose uploads of ``holds``'s keys wait for the gate: a delete queued
    behind one of them waits too."""
    from test_writeback import Gate

    gate = Gate(remote, holds)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=4,
                    write_back_delay=5.0, drain_timeout=30, **kwargs)
    return fs, gate


def _open_soon(gate: Any, after: float = 0.3) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after), gate.open.set()), daemon=True)
    thread.start()
    return thread


def test_a_truncate_by_path_of_a_name_made_again_is_not_undone_by_its_queued_delete(
        remote: Remote, tmp_path: Path) -> None:
    """rm f; a new f; truncate(2) of it by path: that truncate commits at once, so it must come
    after the delete queued before it (which would otherwise remove the new bytes)."""
    remote.fs.pipe_file(remote.full("f"), b"old bytes")
    fs, gate = _deferring(remote, tmp_path)
    try:
        write(fs, "/pending", b"p")  # held: the delete of f waits for it
        fs.unlink("/f")
        write(fs, "/f", b"new bytes")
        _open_soon(gate)
        fs.truncate("/f", 3)
        fs.sync("/")
        assert stored(remote, "f") == b"new", names(remote)
    finally:
        gate.open.set()
        fs.close_all()


def test_a_file_open_at_unmount_over_a_name_deleted_before_it_keeps_its_bytes(
        remote: Remote, tmp_path: Path) -> None:
    """A log rotated by rm and a new open, the daemon stopped while the new one is open: the
    unmount commits it, after the delete queued before it."""
    remote.fs.pipe_file(remote.full("log"), b"old log")
    fs, gate = _deferring(remote, tmp_path)
    try:
        write(fs, "/pending", b"p")
        fs.unlink("/log")
        fh = fs.create("/log", CREAT).fh
        fs.write(fh, b"new log", 0)
        _open_soon(gate)
        fs.close_all()  # (the unmount: the file still open)
        assert fs.drained and stored(remote, "log") == b"new log", names(remote)
    finally:
        gate.open.set()


def test_a_listing_taken_while_a_delete_waits_does_not_bring_the_name_back_once_it_lands(
        remote: Remote, tmp_path: Path) -> None:
    """An `ls` past the listing TTL while the delete waits in the queue lists the bucket, which
    still has the name (hidden here meanwhile); once the delete lands that listing must not show
    it again, nor its stat answer for it."""
    from marinfs.meta.metadata import MetadataCache

    now = [1000.0]
    metadata = MetadataCache(ttl=60, list_ttl=60, timer=lambda: now[0])
    for key in ("d/a", "d/b"):
        remote.fs.pipe_file(remote.full(key), b"x")
    fs, gate = _deferring(remote, tmp_path, metadata=metadata)
    try:
        assert sorted(c.name for c in fs.readdir("/d")) == ["d/a", "d/b"]
        write(fs, "/pending", b"p")
        fs.unlink("/d/a")
        now[0] += 61  # the listing expired: the next ls lists the bucket, the delete still queued
        assert [c.name for c in fs.readdir("/d")] == ["d/b"]
        gate.open.set()
        fs.sync("/")
        assert stored(remote, "d/a") is None
        assert [c.name for c in fs.readdir("/d")] == ["d/b"]
        with pytest.raises(FileNotFoundError):
            fs.getattr("/d/a")
    finally:
        gate.open.set()
        fs.close_all()


def test_a_directory_someone_filled_while_its_rmdir_waited_stays_and_is_shown(
        remote: Remote, tmp_path: Path) -> None:
    """rmdir returned (empty here); before its turn another node put a file in the directory:
    the store refuses the removal (not empty), as the next start's replay of it leaves such a
    directory. It is no failure kept and retried for ever, and the directory shows again."""
    fs, gate = _deferring(remote, tmp_path)
    try:
        fs.mkdir("/d")
        write(fs, "/pending", b"p")
        fs.rmdir("/d")
        remote.fs.pipe_file(remote.full("d/theirs"), b"another node's")
        gate.open.set()
        assert fs.sync("/") == b"0"
        assert fs.upload_status()["failed_deletes"] == []
        assert [c.name for c in fs.readdir("/d")] == ["d/theirs"]
    finally:
        gate.open.set()
        fs.close_all()


def _failing(remote: Remote, method: str) -> dict[str, bool]:
    """``remote.<method>`` fails (EIO) while the switch is on."""
    real = getattr(remote, method)
    switch = {"on": True}

    def call(*args: Any, **kwargs: Any) -> Any:
        if switch["on"]:
            raise OSError(errno.EIO, "injected", args[0])
        return real(*args, **kwargs)

    setattr(remote, method, call)
    return switch


def test_a_directory_made_again_after_its_rmdir_failed_is_made_and_stays(remote: Remote, tmp_path: Path) -> None:
    """semantics.md: a name deleted and made again is deleted in the bucket first, then made.
    Its delete failed (kept, retried): mkdir sends it first, and the retry pass leaves the new one."""
    fs, gate = _deferring(remote, tmp_path)
    gate.open.set()
    try:
        fs.mkdir("/d")
        down = _failing(remote, "remove_dir")
        fs.rmdir("/d")
        with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
            fs.sync("/")  # (names the failed delete)
        down["on"] = False  # the store answers again
        fs.mkdir("/d")
        assert fs.getattr("/d").is_dir
        fs.retry_failed_commits()  # the daemon's retry pass
        fs.sync("/")
        assert fs.getattr("/d").is_dir and remote.fs.isdir(remote.full("d")), names(remote)
    finally:
        fs.close_all()


def test_a_file_renamed_over_a_name_whose_delete_failed_is_not_removed_by_its_retry(
        remote: Remote, tmp_path: Path) -> None:
    """f open for writing here when unlinked (so its delete has no version to check), the
    delete failed; `mv x f` then must not leave f to that delete's retry (x is gone by then)."""
    fs, gate = _deferring(remote, tmp_path)
    gate.open.set()
    try:
        write(fs, "/f", b"old")
        write(fs, "/x", b"precious")
        fs.sync("/")
        fh = fs.open("/f", os.O_WRONLY).fh
        down = _failing(remote, "delete")
        fs.unlink("/f")
        fs.release(fh)
        with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
            fs.sync("/")
        down["on"] = False
        fs.rename("/x", "/f")
        assert fs.read(fs.open("/f", os.O_RDONLY).fh, 20, 0) == b"precious"  # (not hidden as gone)
        fs.retry_failed_commits()
        fs.sync("/")
        assert stored(remote, "f") == b"precious", names(remote)
        assert fs.read(fs.open("/f", os.O_RDONLY).fh, 20, 0) == b"precious"
    finally:
        fs.close_all()


def test_a_file_made_again_after_its_delete_failed_lands_under_its_name(remote: Remote, tmp_path: Path) -> None:
    """rm f (its delete fails), then a new f: the new file's upload must not find the old object
    in its way (a conflict copy, then the retried delete removing the name)."""
    fs, gate = _deferring(remote, tmp_path)
    gate.open.set()
    try:
        write(fs, "/f", b"old")
        fs.sync("/")
        down = _failing(remote, "delete")
        fs.unlink("/f")
        with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
            fs.sync("/")
        down["on"] = False
        write(fs, "/f", b"new")
        fs.sync("/")
        fs.retry_failed_commits()
        fs.sync("/")
        assert stored(remote, "f") == b"new" and fs.upload_status()["conflicts"] == [], names(remote)
        assert fs.read(fs.open("/f", os.O_RDONLY).fh, 20, 0) == b"new"
    finally:
        fs.close_all()


def test_a_delete_queued_after_an_upload_that_failed_waits_for_its_retry(remote: Remote, tmp_path: Path) -> None:
    """semantics.md: a step deleted after the next step's save is never gone from the bucket
    while the next step is incomplete there. The next step's upload failed (kept, retried): the
    old step stays until that retry has put it in the bucket."""
    remote.fs.pipe_file(remote.full("step1/a"), b"old step")
    fs, gate = _deferring(remote, tmp_path)
    try:
        gate.fail.add("step2/a")
        fs.mkdir("/step2")
        write(fs, "/step2/a", b"new step")
        fs.unlink("/step1/a")
        gate.open.set()
        with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
            fs.sync("/")
        assert stored(remote, "step2/a") is None
        assert stored(remote, "step1/a") == b"old step"  # the only whole step in the bucket
        gate.fail.clear()
        for _ in range(2):
            fs.retry_failed_commits()  # the daemon's retry pass, each interval
            fs.sync("/step2")
        fs.writes.barrier()
        assert stored(remote, "step2/a") == b"new step" and stored(remote, "step1/a") is None, names(remote)
        assert fs.sync("/") == b"0"
    finally:
        gate.open.set()
        fs.close_all()


def test_a_killed_daemons_delete_waits_at_the_next_start_for_an_upload_before_it_that_fails(
        remote: Remote, tmp_path: Path) -> None:
    """The same at the next start: the step saved before the delete cannot be uploaded (the
    store refuses it for now): the old step stays, its delete kept for later."""
    from test_writeback import Gate

    remote.fs.pipe_file(remote.full("step1/a"), b"old step")
    killed = Remote(remote.url)
    gate = Gate(killed)
    first = Filesystem(killed, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=2)
    try:
        first.mkdir("/step2")
        write(first, "/step2/a", b"new step")  # pending when the daemon dies
        first.unlink("/step1/a")
        down = _failing(remote, "upload")
        daemon_ended(first)
        second = Filesystem(remote, staging_dir=tmp_path / "staging")
        second.recover_staged(at_start=True)
        assert stored(remote, "step1/a") == b"old step", names(remote)
        down["on"] = False
        daemon_ended(second)
        third = Filesystem(remote, staging_dir=tmp_path / "staging")  # the start after: both go
        third.recover_staged(at_start=True)
        assert stored(remote, "step2/a") == b"new step" and stored(remote, "step1/a") is None, names(remote)
    finally:
        gate.fail.add("step2/a")
        gate.open.set()


def test_a_delete_left_by_a_killed_daemon_and_not_sent_at_start_is_shown_kept_and_retried(
        remote: Remote, tmp_path: Path) -> None:
    """One the next start could not send: the name stays gone there, `marinfs status` and
    `marinfs sync` say so, and the retry pass sends it (not only the start after)."""
    from test_writeback import Gate

    remote.fs.pipe_file(remote.full("step1/a"), b"old step")
    killed = Remote(remote.url)
    gate = Gate(killed)
    first = Filesystem(killed, staging_dir=tmp_path / "staging", write_back=True, write_back_uploads=2)
    second = None
    try:
        first.mkdir("/step2")
        write(first, "/step2/a", b"new step")
        first.unlink("/step1/a")
        down = _failing(remote, "upload")
        daemon_ended(first)
        second = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=0)
        second.recover_staged(at_start=True)
        assert [d["key"] for d in second.upload_status()["failed_deletes"]] == ["step1/a"]
        with pytest.raises(FileNotFoundError):
            second.getattr("/step1/a")  # removed, as asked
        with pytest.raises(OSError, check=lambda e: e.errno == errno.EIO):
            second.sync("/")
        down["on"] = False
        for _ in range(2):
            second.retry_failed_commits()
            second.writes.barrier()
        assert stored(remote, "step2/a") == b"new step" and stored(remote, "step1/a") is None, names(remote)
        assert second.sync("/") == b"0" and not list((tmp_path / "staging").glob("delete-*.json"))
    finally:
        gate.fail.add("step2/a")
        gate.open.set()
        if second is not None:
            second.close_all()


def test_a_failed_delete_waiting_for_its_retry_in_the_queue_is_not_queued_again_each_pass(
        remote: Remote, tmp_path: Path) -> None:
    """The retry pass runs each interval; a delete it queued again that still waits its turn
    (uploads ahead of it) is not queued once more each time (each copy a request and a fence)."""
    remote.fs.pipe_file(remote.full("f"), b"old")
    fs, gate = _deferring(remote, tmp_path)
    sent: list[str] = []
    delete = remote.delete

    def counted(key: str) -> None:
        sent.append(key)
        delete(key)

    try:
        down = _failing(remote, "delete")
        fs.unlink("/f")
        fs.writes.barrier()
        assert [d["key"] for d in fs.upload_status()["failed_deletes"]] == ["f"]
        down["on"] = False
        remote.delete = counted  # type: ignore[method-assign]
        write(fs, "/pending", b"p")  # held: the retried delete waits behind it
        for _ in range(5):
            fs.retry_failed_commits()
        assert fs.writes.write_back.pending() == 2  # the upload and one delete
        gate.open.set()
        fs.sync("/")
        assert sent == ["f"] and stored(remote, "f") is None
    finally:
        gate.open.set()
        fs.close_all()


def test_a_retried_delete_of_a_file_open_for_writing_when_removed_spares_another_nodes_write(
        remote: Remote, tmp_path: Path) -> None:
    """semantics.md: a retried delete is sent only while the object is still the version deleted
    here. A file open for writing here when unlinked has that version too (the one its writer
    started from): another node's object written meanwhile stays."""
    fs, gate = _deferring(remote, tmp_path)
    gate.open.set()
    try:
        write(fs, "/f", b"ours")
        fs.sync("/")
        fh = fs.open("/f", os.O_WRONLY).fh
        down = _failing(remote, "delete")
        fs.unlink("/f")
        fs.release(fh)
        fs.writes.barrier()
        remote.fs.pipe_file(remote.full("f"), b"another node's")
        down["on"] = False
        fs.retry_failed_commits()
        fs.writes.barrier()
        assert stored(remote, "f") == b"another node's"
    finally:
        fs.close_all()


def test_a_background_upload_that_fails_is_tried_once_not_again_by_the_release_behind_it(
        remote: Remote, tmp_path: Path) -> None:
    """close(2) is a FUSE flush, then a release. With --write-back-delay 0 the upload the flush
    queued may begin before the release comes; the release queued it a second time, so an upload
    that failed (the store down) was sent again at once, every attempt doubled before its bytes
    were kept and reported (found by test_fault_matrix's store-down cell)."""
    upload = remote.upload
    began, fail = threading.Event(), threading.Event()
    calls: list[str] = []

    def down(local: str, key: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(key)
        began.set()
        fail.wait(10)
        raise OSError(errno.EIO, "injected: the store is down", key)

    remote.upload = down  # type: ignore[method-assign]
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", write_back=True, write_back_delay=0)
    try:
        fh = fs.create("/f", CREAT).fh
        fs.write(fh, b"bytes", 0)
        fs.flush(fh)
        assert began.wait(10)  # the upload began before the release
        fs.release(fh)
        fail.set()
        deadline = time.monotonic() + 10
        while not fs.upload_status()["failed"] or fs.upload_status()["write_back"]["queued"]:
            assert time.monotonic() < deadline, fs.upload_status()
            time.sleep(0.01)
        assert calls == ["f"] and [f["key"] for f in fs.upload_status()["failed"]] == ["f"]
        remote.upload = upload  # type: ignore[method-assign]
        fs.retry_failed_commits()
        assert stored(remote, "f") == b"bytes"
    finally:
        fail.set()
        remote.upload = upload  # type: ignore[method-assign]
        fs.close_all()
