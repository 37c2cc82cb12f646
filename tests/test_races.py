"""Races between this node's own concurrent operations: a change made here must never be
hidden from this node by an answer of before it. Each test forces its interleaving with
events (a remote call held until the other operation ran); no FUSE, no sleeps."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from marinfs.core import Filesystem
from marinfs.objects import ObjectInfo
from marinfs.remote import Remote
from test_core import W, cat, fs, write_file  # noqa: F401 - fs is a fixture


def run(target: Any) -> tuple[threading.Thread, list[Any]]:
    """``target`` in a thread; its result (or exception) lands in the list."""
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out.append(exc)

    t = threading.Thread(target=body)
    t.start()
    return t, out


def held(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, when: Any = lambda *args: True,
         before: bool = False) -> tuple[threading.Event, threading.Event]:
    """``owner.name`` made to stop, the first time ``when(*args)`` holds, once it has done its
    work and before it returns (``before``: before it starts): (reached, go). The test does its
    other operation meanwhile, then sets go."""
    real, reached, go = getattr(owner, name), threading.Event(), threading.Event()

    def holding(*args: Any, **kwargs: Any) -> Any:
        hold = not reached.is_set() and when(*args)
        if hold and before:
            reached.set()
            go.wait(10)
        result = real(*args, **kwargs)
        if hold and not before:
            reached.set()
            go.wait(10)
        return result

    monkeypatch.setattr(owner, name, holding)
    return reached, go


def writer_flushes_during(fs: Filesystem, fh: int, change: Any, reached: threading.Event,
                          go: threading.Event, data: bytes = b"two", offset: int = 3) -> list[Any]:
    """``change`` (a rename, a chmod) held in the remote, the file's writer writes ``data`` and
    flushes meanwhile; what the flush answered."""
    t, out = run(change)
    assert reached.wait(10)
    w, flushed = run(lambda: (fs.write(fh, data, offset), fs.flush(fh)))
    w.join(2)  # at once, unless it waits for the change to finish
    go.set()
    t.join(10)
    w.join(10)
    fs.release(fh)
    assert out == [None]
    return flushed


@pytest.mark.parametrize("moved", ["file", "directory"])
def test_a_rename_here_while_its_writer_flushes_moves_the_writes_too(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch, moved: str) -> None:
    """logrotate, or a checkpoint directory moved while a shard is open: a flush between the
    remote rename and the staged file's new key went to the old name, found it gone, and put
    its bytes in a conflict copy (close: ESTALE)."""
    src, dst, path, call = (("/a", "/b", "a", "rename") if moved == "file" else
                            ("/d", "/e", "d/log", "rename_tree"))
    if moved == "directory":
        fs.mkdir("/d")
    fh = fs.create("/" + path, os.O_CREAT | os.O_WRONLY).fh
    fs.write(fh, b"one", 0)
    fs.flush(fh)
    reached, go = held(monkeypatch, fs.remote, call)
    flushed = writer_flushes_during(fs, fh, lambda: fs.rename(src, dst), reached, go)
    assert flushed == [(3, None)], f"close() of the writer failed: {flushed!r}"
    new = dst[1:] + path[len(src) - 1:]
    assert cat(remote, new) == b"onetwo" and cat(remote, path) is None
    assert fs.writes.staged == {}  # released: nothing left in the table under either name


def test_a_chmod_in_flight_while_the_files_writer_commits_keeps_the_commit(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chmod's update answered, the writer here commits, then the chmod cached its stat of
    before the commit (old size), or locally left the writer's base stale (close: ESTALE)."""
    write_file(fs, "/a", b"old")
    fh = fs.open("/a", W).fh
    reached, go = held(monkeypatch, fs.remote, "set_attrs")
    flushed = writer_flushes_during(fs, fh, lambda: fs.set_attributes("/a", mode=0o600), reached, go,
                                    b"new content", 0)
    assert flushed == [(11, None)], f"close() of the writer failed: {flushed!r}"
    assert cat(remote, "a") == b"new content"
    assert fs.getattr("/a").size == 11  # what this node just wrote


def test_a_chmod_in_flight_when_a_writer_opens_and_commits_keeps_the_commit(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """No writer when the chmod starts: its answer, of before the commit, is not cached."""
    write_file(fs, "/a", b"old")
    reached, go = held(monkeypatch, fs.remote, "set_attrs")
    t, out = run(lambda: fs.set_attributes("/a", mode=0o600))
    assert reached.wait(10)
    fh = fs.open("/a", W | os.O_TRUNC).fh
    fs.write(fh, b"new content", 0)
    fs.flush(fh)
    go.set()
    t.join(10)
    fs.release(fh)
    assert out == [None] or isinstance(out[0], OSError)  # (its update may lose to the commit)
    assert cat(remote, "a") == b"new content"
    assert fs.getattr("/a").size == 11  # what this node just wrote, not the chmod's stat of before
    assert fs.metadata._stating == {}  # no token left behind


def test_a_chmod_while_a_commit_caches_its_stat_is_kept(fs: Filesystem, remote: Remote,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chmod between a commit's upload and its caching was overwritten in the cache by the
    commit's older stat: the mode this node had just set vanished from its view."""
    write_file(fs, "/a", b"old")
    fh = fs.open("/a", W).fh
    fs.write(fh, b"new content", 0)
    writer: list[threading.Thread] = []
    reached, go = held(monkeypatch, fs.metadata, "put_own",
                       lambda info, *rest: info.name == "a" and threading.current_thread() in writer,
                       before=True)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fs.flush(fh)))
    writer.append(t)
    t.start()
    assert reached.wait(10)
    chmod, chmodded = run(lambda: fs.set_attributes("/a", mode=0o600))
    chmod.join(1)  # done at once unless it waits for the commit to finish (then it comes after)
    go.set()
    t.join(10)
    chmod.join(10)
    assert chmodded == [None]
    fs.release(fh)
    assert out == [None]
    posix = fs.getattr("/a").posix
    assert posix is not None and posix.mode == 0o600  # this node's view has it
    # The store, once the window of a change to a file just committed here has passed (core/deferred.py).
    deadline = time.monotonic() + 5
    while fs.remote.stat("a").posix.mode != 0o600 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fs.remote.stat("a").posix.mode == 0o600
    assert 0o600 == fs.getattr("/a").posix.mode  # (still, after the update)


@pytest.mark.parametrize("remote", ["local"], indirect=True)  # directory mtimes entries move
def test_a_listing_in_flight_never_recaches_a_directory_whose_entries_changed_here(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit in d moves d's mtime on a disk; a listing of d's parent in flight landed after
    it and cached d's old mtime, so tar's or rsync's final utimens of d to that time sent
    nothing and the disk kept the wrong one."""
    fs.mkdir("/d")
    t0 = 1_000_000_000 * 10**9
    fs.set_attributes("/d", mtime_ns=t0)
    reached, go = held(monkeypatch, fs.remote, "list", lambda key, *rest: key == "")
    t, _ = run(lambda: fs.readdir("/"))
    assert reached.wait(10)
    write_file(fs, "/d/f", b"x")  # d's mtime on disk is now
    go.set()
    t.join(10)
    on_disk = os.stat(remote.full("d")).st_mtime_ns
    assert on_disk != t0
    shown = fs.getattr("/d").posix.mtime_ns
    fs.set_attributes("/d", mtime_ns=t0)  # tar/rsync: d's time back as it was
    assert shown == on_disk, f"d shows its mtime of before this node's commit in it: {shown} (disk: {on_disk})"
    assert os.stat(remote.full("d")).st_mtime_ns == t0


def test_attributes_a_listing_lacked_are_asked_again_when_this_node_made_the_file_meanwhile(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3 listing entry may come without attributes; their stat, sent before this node made
    the file and answered "missing" after it, failed a chmod or getxattr with ENOENT."""
    real, asked, go = fs.remote.stat, threading.Event(), threading.Event()

    def stale_stat(key: str, **kwargs: Any) -> Any:
        if asked.is_set():
            return real(key, **kwargs)
        asked.set()
        go.wait(10)
        raise FileNotFoundError(key)  # the answer of before the file was made here

    monkeypatch.setattr(fs.remote, "stat", stale_stat)
    listed = ObjectInfo(name="a", is_dir=False, size=0, version=None, posix=None)  # no record
    t, out = run(lambda: fs.attributes.posix_of("a", listed))
    assert asked.wait(10)
    write_file(fs, "/a", b"made here")
    fs.set_attributes("/a", mode=0o600)
    go.set()
    t.join(10)
    assert len(out) == 1 and not isinstance(out[0], BaseException), out
    assert out[0].mode == 0o600
