"""Nothing staged is lost: journals, replay after a crash, conflicts, and SIGKILL of a live daemon."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from marinfs.core import Filesystem
from marinfs.write.recovery import recover
from marinfs.remote import Remote
from marinfs.app.status import format_failed
from marinfs.write.staging import JOURNAL_SUFFIX, StagedFile
from mounting import daemon_ended, staging_entries, subprocess_mount
from test_cli import assert_one_line_error, marinfs
import tiers


@pytest.fixture
@tiers.needs("core")
def remote() -> Remote:
    url = f"memory://recovery-{uuid.uuid4().hex[:10]}"
    r = Remote(url)
    r.fs.mkdir(r.root)
    return r


def stage(tmp_path: Path, remote: Remote, key: str, data: bytes, base: str | None) -> StagedFile:
    """What a daemon that dies before commit leaves behind."""
    staged = StagedFile(tmp_path / "staging", key, seed=None, dirty=base is None,
                        remote_url=remote.url, base_version=base)
    staged.write(data, 0)
    return staged


def close_failing(fs: Filesystem, path: str, data: bytes, error: type[OSError] = OSError) -> None:
    """Write ``data`` to a new file whose commit fails (``error`` from the flush), then close it:
    the bytes stay staged and the failure goes on the retry list."""
    fh = fs.create(path, os.O_WRONLY | os.O_CREAT).fh
    fs.write(fh, data, 0)
    with pytest.raises(error):
        fs.flush(fh)
    fs.release(fh)


def test_journal_exists_exactly_while_bytes_are_uncommitted(tmp_path: Path, remote: Remote) -> None:
    staged = StagedFile(tmp_path / "staging", "k", seed=None, remote_url=remote.url)
    assert not Path(staged.journal_path).exists()  # nothing to commit yet
    staged.write(b"abc", 0)
    entry = json.loads(Path(staged.journal_path).read_text())
    assert entry == {"remote": remote.url, "key": "k", "base_version": None,
                     "data": os.path.basename(staged.path), "made_ns": staged.made_ns}
    staged.rekey("renamed")
    assert json.loads(Path(staged.journal_path).read_text())["key"] == "renamed"
    staged.commit(remote.upload)
    assert not Path(staged.journal_path).exists() and remote.fs.cat_file(remote.full("renamed")) == b"abc"
    staged.discard()
    assert staging_entries(tmp_path / "staging") == []


def test_replay_commits_new_files_and_unchanged_bases(tmp_path: Path, remote: Remote) -> None:
    stage(tmp_path, remote, "new.txt", b"never committed", base=None)
    remote.fs.pipe_file(remote.full("old.txt"), b"v1")
    base = remote.stat("old.txt").version
    stage(tmp_path, remote, "old.txt", b"v2 staged", base=base)
    results = recover(tmp_path / "staging", remote)
    assert {(r.key, r.committed_as, r.conflict) for r in results} == {
        ("new.txt", "new.txt", False), ("old.txt", "old.txt", False)}
    assert remote.fs.cat_file(remote.full("new.txt")) == b"never committed"
    assert remote.fs.cat_file(remote.full("old.txt")) == b"v2 staged"
    assert staging_entries(tmp_path / "staging") == []  # nothing left once committed


def test_replay_never_overwrites_a_changed_object(tmp_path: Path, remote: Remote) -> None:
    remote.fs.pipe_file(remote.full("shared.json"), b"base")
    base = remote.stat("shared.json").version
    stage(tmp_path, remote, "shared.json", b"ours", base=base)
    time.sleep(0.01)
    remote.fs.pipe_file(remote.full("shared.json"), b"theirs, written later")  # another node
    (result,) = recover(tmp_path / "staging", remote)
    assert result.conflict and result.committed_as.startswith("shared.json.marinfs-conflict-")
    assert remote.fs.cat_file(remote.full("shared.json")) == b"theirs, written later"
    assert remote.fs.cat_file(remote.full(result.committed_as)) == b"ours"


def test_replay_leaves_other_remotes_and_failed_uploads(tmp_path: Path, remote: Remote,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    other = Remote(f"memory://other-{uuid.uuid4().hex[:8]}")
    stage(tmp_path, other, "x", b"not ours", base=None)
    stage(tmp_path, remote, "y", b"ours", base=None)

    def broken(local: str, key: str, expect: str | None = None) -> None:
        raise OSError(5, "injected")

    monkeypatch.setattr(remote, "upload", broken)
    (result,) = recover(tmp_path / "staging", remote)
    assert result.key == "y" and result.committed_as is None and "injected" in (result.error or "")
    assert len(staging_entries(tmp_path / "staging", "*" + JOURNAL_SUFFIX)) == 2  # both kept


@pytest.mark.mount
def test_sigkill_with_a_staged_file_then_a_new_mount_commits_it(tmp_path: Path) -> None:
    remote_dir, mnt, cache = tmp_path / "remote", tmp_path / "mnt", tmp_path / "cache"
    remote_dir.mkdir()
    with subprocess_mount(str(remote_dir), mnt, cache) as pid:
        fd = os.open(mnt / "checkpoint.bin", os.O_WRONLY | os.O_CREAT)
        os.write(fd, b"written before the crash")
        os.kill(pid, signal.SIGKILL)  # the daemon dies with the file open and uncommitted
        time.sleep(0.5)
        try:
            os.close(fd)
        except OSError:
            pass  # the dead mount answers ENOTCONN
        status = marinfs("status", str(mnt))
        assert status.returncode == 0 and f"its daemon is gone (PID {pid} ended)" in status.stdout
        again = marinfs("mount", str(remote_dir), str(mnt), "--cache-dir", str(cache))
        assert_one_line_error(again, "is a mount whose daemon is gone", "marinfs umount --lazy")
        assert marinfs("umount", "--lazy", str(mnt)).returncode == 0 and not os.path.ismount(mnt)
        assert not (remote_dir / "checkpoint.bin").exists()
    with subprocess_mount(str(remote_dir), mnt, cache):  # a new daemon over the same cache dir
        assert (remote_dir / "checkpoint.bin").read_bytes() == b"written before the crash"
        assert (mnt / "checkpoint.bin").read_bytes() == b"written before the crash"
    assert not staging_entries(cache / "staging", "*" + JOURNAL_SUFFIX)


def test_a_full_staging_disk_fails_the_write_and_commits_nothing(tiny_tmpfs: Path, tmp_path: Path) -> None:
    """ENOSPC while staging: the writer gets the error and no half-written file appears."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote_dir), mnt, tiny_tmpfs, "--cache-size", "0"):
        with pytest.raises(OSError) as info:
            with open(mnt / "big.bin", "wb") as f:
                for _ in range(8):
                    f.write(os.urandom(1 << 20))  # 8 MiB into a 1 MiB staging disk
        assert info.value.errno == errno.ENOSPC
        time.sleep(0.3)
        assert not (remote_dir / "big.bin").exists()  # nothing half-committed is visible
        assert not staging_entries(tiny_tmpfs / "staging")  # and no partial bytes linger
        (mnt / "small.txt").write_text("fits")  # the mount still works once there is room
        assert (remote_dir / "small.txt").read_text() == "fits"


def test_a_journal_that_meets_a_full_staging_disk_leaves_no_file(tiny_tmpfs: Path, tmp_path: Path) -> None:
    """Issue 37: a new file's journal written on a full disk left a 0-byte
    ``staged-*.journal.json.tmp`` (and its empty staging file) behind for good."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote_dir), mnt, tiny_tmpfs, "--cache-size", "0"):
        fd = os.open(mnt / "fills.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as info:
                for _ in range(64):
                    os.write(fd, b"x" * (64 << 10))  # until the 1 MiB staging disk is full
            assert info.value.errno == errno.ENOSPC
            with pytest.raises(OSError) as info:
                os.close(os.open(mnt / "second.txt", os.O_WRONLY | os.O_CREAT, 0o644))  # its journal finds no room
            assert info.value.errno == errno.ENOSPC
        finally:
            try:
                os.close(fd)
            except OSError:
                pass  # (the failed write's error again)
        time.sleep(0.3)
        assert not staging_entries(tiny_tmpfs / "staging")  # no journal, no temporary, no empty staging file
        assert sorted(os.listdir(mnt)) == [] and sorted(os.listdir(remote_dir)) == []
        (mnt / "small.txt").write_text("fits")  # there is room again
        assert (remote_dir / "small.txt").read_text() == "fits"


def test_a_journal_write_that_fails_removes_its_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import marinfs.write.staging as staging

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(staging.os, "write", full)
    with pytest.raises(OSError):
        staging.write_journal(str(tmp_path / "staged-x.journal.json"), {"key": "k"})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):  # a new file whose journal cannot be written: nothing of it stays
        monkeypatch.setattr(staging.os, "write", full)
        StagedFile(tmp_path / "staging", "k", seed=None, dirty=True, remote_url="memory://x")
    monkeypatch.undo()
    assert staging_entries(tmp_path / "staging") == []


class RecordedSession:
    """A part session the store keeps apart (an S3 multipart upload, as far as journals see)."""

    part_size, ordered = 4, False
    record = {"store": "fake", "bucket": "b", "key": "k", "id": "u-1"}

    def send(self, index: int, data: bytes, total: int | None = None) -> None:
        pass

    def complete(self, parts: int, total: int) -> None:
        return None

    def abort(self) -> bool:
        return True


def test_the_journal_names_an_open_multipart_upload_and_recovery_aborts_it(
        tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: a killed daemon's incomplete multipart upload stayed in the bucket (billed on
    S3). Its id is journaled before the first part leaves; the next daemon aborts it, then
    replays; an abort that cannot be sent yet (the store down) keeps both for the next pass."""
    import concurrent.futures as cf

    from marinfs.remote.parts import PartStream

    pool = cf.ThreadPoolExecutor(2)
    staged = StagedFile(tmp_path / "staging", "k", seed=None, dirty=True, remote_url=remote.url,
                        stream=lambda fd, key, expect: PartStream(fd, RecordedSession, 4, pool))
    staged.write(b"0123456789", 0)  # two parts leave: the upload is open
    assert json.loads(Path(staged.journal_path).read_text())["uploads"] == {"u-1": RecordedSession.record}
    # The daemon is killed here. The next one:
    down, aborted = [ConnectionResetError(errno.ECONNRESET, "injected: down")], []

    def abort_upload(record: dict) -> None:
        if down:
            raise down[0]
        aborted.append(record["id"])

    monkeypatch.setattr(remote, "abort_upload", abort_upload)
    (result,) = recover(tmp_path / "staging", remote)
    assert result.committed_as is None and "down" in (result.error or "") and not remote.fs.exists(remote.full("k"))
    assert json.loads(Path(staged.journal_path).read_text())["uploads"] == {"u-1": RecordedSession.record}
    down.clear()
    (result,) = recover(tmp_path / "staging", remote)
    assert aborted == ["u-1"] and result.committed_as == "k"
    assert remote.fs.cat_file(remote.full("k")) == b"0123456789" and not Path(staged.journal_path).exists()
    pool.shutdown()


def test_a_completed_upload_leaves_the_journal_and_a_commit_aborts_what_is_left(tmp_path: Path) -> None:
    """A session completed goes from the journal; one still open when a commit succeeds (its
    own abort failed) is handed to the caller to abort."""
    import concurrent.futures as cf

    from marinfs.remote.parts import PartStream

    pool = cf.ThreadPoolExecutor(2)
    staged = StagedFile(tmp_path / "staging", "k", seed=None, dirty=True, remote_url="memory://x",
                        stream=lambda fd, key, expect: PartStream(fd, RecordedSession, 4, pool))
    staged.write(b"0123456789", 0)
    staged.commit(lambda *a, **k: None)  # the stream completes the upload
    assert not Path(staged.journal_path).exists() and staged.take_leftover_uploads() == []
    staged.write(b"more", 10)
    staged.note_upload({"store": "fake", "key": "k", "id": "u-2"}, True)  # an upload whose abort failed
    assert "u-2" in json.loads(Path(staged.journal_path).read_text())["uploads"]
    staged.commit(lambda *a, **k: None)
    assert [r["id"] for r in staged.take_leftover_uploads()] == ["u-2"]
    pool.shutdown()


def test_a_commit_failing_during_a_retry_pass_stays_on_the_retry_list(tmp_path: Path, remote: Remote,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry pass uploads without the filesystem lock, so a close may fail meanwhile and
    append its own failure: the pass must merge its results, not overwrite the list with them."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    real_upload = remote.upload
    down = {"first", "second"}
    in_retry, go_on = threading.Event(), threading.Event()

    def upload(local_path: str, key: str, expect: str | None = None) -> str | None:
        if key in down:
            raise ConnectionResetError(errno.ECONNRESET, "injected: the store is down")
        if key == "first":  # the retry pass: hold it inside its upload
            in_retry.set()
            assert go_on.wait(10)
        return real_upload(local_path, key, expect)

    monkeypatch.setattr(remote, "upload", upload)
    close_failing(fs, "/first", b"first bytes")
    assert [f["key"] for f in fs.upload_status()["failed"]] == ["first"]
    second = fs.create("/second", os.O_WRONLY | os.O_CREAT).fh  # open while the pass starts
    fs.write(second, b"second bytes", 0)

    down.discard("first")  # the store is back for the pass, not yet for the next close
    retry = threading.Thread(target=fs.retry_failed_commits)
    retry.start()
    try:
        assert in_retry.wait(10)
        with pytest.raises(OSError):
            fs.flush(second)
        closer = threading.Thread(target=fs.release, args=(second,))  # appends under the lock
        closer.start()
        closer.join(5)
        assert not closer.is_alive(), "the retry pass held the filesystem lock across its upload"
    finally:
        go_on.set()
        retry.join(10)
    assert not retry.is_alive()
    assert remote.fs.cat_file(remote.full("first")) == b"first bytes"
    assert [f["key"] for f in fs.upload_status()["failed"]] == ["second"]  # not lost from the list
    down.clear()
    fs.retry_failed_commits()
    assert remote.fs.cat_file(remote.full("second")) == b"second bytes"
    assert fs.upload_status()["failed"] == [] and not staging_entries(tmp_path / "staging")


@pytest.mark.parametrize("error", [FileNotFoundError(errno.ENOENT, "NoSuchBucket")])
def test_a_permanent_commit_failure_is_logged_once_shown_and_retried(
        tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: OSError) -> None:
    """The bucket gone: retrying will not cure it, so it is one ERROR line, not one per retry;
    the bytes stay and are still retried (the bucket may be made again). Access denied is
    final instead (test_a_final_commit_failure_is_kept_reported_once_and_never_retried_in_a_loop)."""
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    real_upload = remote.upload
    broken = [error]

    def upload(local_path: str, key: str, expect: str | None = None) -> str | None:
        if broken:
            raise broken[0]
        return real_upload(local_path, key, expect)

    monkeypatch.setattr(remote, "upload", upload)
    close_failing(fs, "/ckpt", b"kept bytes", type(error))
    for _ in range(3):
        fs.retry_failed_commits()
    (failed,) = fs.upload_status()["failed"]
    assert failed["key"] == "ckpt" and failed["permanent"] and failed["attempts"] == 4
    assert str(error.strerror) in failed["error"] and Path(failed["staged"]).read_bytes() == b"kept bytes"
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "will not pass by retrying" in loud[0] and "\n" not in loud[0], loud
    assert "permanent" in format_failed(failed) and failed["staged"] in format_failed(failed)
    broken.clear()  # fixed: the next pass commits
    fs.retry_failed_commits()
    assert remote.fs.cat_file(remote.full("ckpt")) == b"kept bytes" and fs.upload_status()["failed"] == []


@pytest.mark.parametrize("error", [OSError(errno.EILSEQ, "object store keys are UTF-8; this name is not"),
                                   OSError(errno.ENAMETOOLONG, "Your key is too long."),
                                   PermissionError(errno.EACCES, "Access Denied")])
def test_a_final_commit_failure_is_kept_reported_once_and_never_retried_in_a_loop(
        tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: OSError) -> None:
    """Issue 37: a name the store can never hold was retried every interval and after every
    remount. Final now: one ERROR line, the bytes kept, no retry by this daemon, its journal
    marked so; the next daemon leaves it alone, but tries an access refusal once (the
    credentials may have been fixed meanwhile)."""
    real_upload = remote.upload
    broken, calls = [error], []

    def upload(local_path: str, key: str, expect: str | None = None) -> str | None:
        calls.append(key)
        if broken:
            raise broken[0]
        return real_upload(local_path, key, expect)

    monkeypatch.setattr(remote, "upload", upload)
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    close_failing(fs, "/ckpt", b"kept bytes", type(error))
    for _ in range(3):
        assert fs.retry_failed_commits() == []
    assert calls == ["ckpt"]  # the close's, no more
    (failed,) = fs.upload_status()["failed"]
    curable = error.errno == errno.EACCES
    assert failed["final"] and failed["retry"] == ("at the next start" if curable else "never")
    assert failed["attempts"] == 1 and Path(failed["staged"]).read_bytes() == b"kept bytes"
    (journal,) = staging_entries(tmp_path / "staging", "*" + JOURNAL_SUFFIX)
    assert json.loads(journal.read_text())["final"]["errno"] == error.errno
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "no retry can change this" in loud[0] and failed["staged"] in loud[0], loud
    assert "final" in format_failed(failed) and failed["staged"] in format_failed(failed)

    calls.clear()
    daemon_ended(fs)
    again = Filesystem(remote, staging_dir=tmp_path / "staging")  # a new daemon on the same cache
    again.recover_staged(at_start=True)
    assert calls == (["ckpt"] if curable else [])  # a bad name is never sent again
    (failed,) = again.upload_status()["failed"]
    assert failed["final"] and Path(failed["staged"]).read_bytes() == b"kept bytes"
    again.retry_failed_commits()
    assert calls == (["ckpt"] if curable else [])
    broken.clear()  # the credentials fixed (a name stays what it is)
    calls.clear()
    daemon_ended(again)
    Filesystem(remote, staging_dir=tmp_path / "staging").recover_staged(at_start=True)
    if curable:
        assert remote.fs.cat_file(remote.full("ckpt")) == b"kept bytes"
        assert not staging_entries(tmp_path / "staging")
    else:
        assert calls == [] and len(staging_entries(tmp_path / "staging")) == 2  # the bytes and their journal


def test_a_transient_commit_failure_is_retried_and_reported_each_time(
        tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")

    def upload(local_path: str, key: str, expect: str | None = None) -> str | None:
        raise ConnectionResetError(errno.ECONNRESET, "injected: reset")

    monkeypatch.setattr(remote, "upload", upload)
    close_failing(fs, "/f", b"x")
    fs.retry_failed_commits()
    fs.retry_failed_commits()
    (failed,) = fs.upload_status()["failed"]
    assert not failed["permanent"] and failed["attempts"] == 3 and "reset" in failed["error"]
    assert [r.levelname for r in caplog.records if r.levelno >= logging.WARNING] == ["ERROR", "WARNING", "WARNING"]
    assert "retrying" in format_failed(failed)


@tiers.needs("unit")
def test_a_journal_is_rewritten_in_place_and_reads_back_whole_longer_or_shorter(tmp_path: Path) -> None:
    """A rewrite that fits a page is one pwrite over the old journal (same inode, no rename),
    padded to the old length; a shorter entry still reads back exactly; one past a page is
    written anew (temp + rename)."""
    from marinfs.write.staging import IN_PLACE, write_journal

    path = str(tmp_path / "x.journal.json")
    write_journal(path, {"key": "k", "attrs": {"mode": 0o644, "mtime": "1" * 100}})
    inode = os.stat(path).st_ino
    write_journal(path, {"key": "k"})  # shorter: padded with blanks
    assert os.stat(path).st_ino == inode and json.loads(Path(path).read_text()) == {"key": "k"}
    write_journal(path, {"key": "k", "attrs": {"mode": 0o600, "mtime": "2" * 300}})  # longer, same page
    assert os.stat(path).st_ino == inode and json.loads(Path(path).read_text())["attrs"]["mode"] == 0o600
    big = {"key": "k", "uploads": {"u": "x" * IN_PLACE}}
    write_journal(path, big)
    assert os.stat(path).st_ino != inode and json.loads(Path(path).read_text()) == big
    assert not list(tmp_path.glob("*.tmp"))


def test_the_status_is_published_while_a_retry_pass_waits_on_a_store_that_is_down(
        tmp_path: Path, remote: Remote) -> None:
    """A retry pass over kept commits waits out the store's timeouts (minutes with the default
    --connect-timeout and --retries when it is down). It ran on the thread that publishes what
    `marinfs status` and `marinfs sync` read, which then stood still for the whole pass."""
    from types import SimpleNamespace

    from marinfs.app.daemon import _watch_mount
    from marinfs.read.chunkcache import stats_file

    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    passing = threading.Event()
    fs.writes.failing = lambda: True  # type: ignore[method-assign]
    fs.retry_failed_commits = lambda: passing.wait(30)  # type: ignore[method-assign]  # the store hangs
    cfg = SimpleNamespace(mountpoint="/", mount_timeout=5, read_ahead_kb=0, commit_retry_interval=0.1,
                          cache_dir=tmp_path, remote=remote.url)
    stop, live = threading.Event(), threading.Event()
    watcher = threading.Thread(target=_watch_mount, args=(fs, cfg, stop, live), daemon=True)
    watcher.start()
    seen: set[float] = set()
    try:
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline:
            try:
                seen.add(json.loads(stats_file(tmp_path).read_text())["published"])
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
    finally:
        stop.set()
        passing.set()
        watcher.join(10)
        fs.close()
    assert len(seen) >= 3, sorted(seen)  # at once, then every 2 s, the pass waiting all along
