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
    later = Filesystem(remote, staging_dir=tmp_path / "staging")  # the next start tries it once
    later.recover_staged(at_start=True)
    assert bytes(remote.fs.cat_file(remote.full("sparse"))) == b"bytes"


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
