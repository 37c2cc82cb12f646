"""Races between this node's own concurrent operations: a change made here must never be
hidden from this node by an answer of before it. Each test forces its interleaving with
events (a remote call held until the other operation ran); no FUSE, no sleeps."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from marinfs.fs import Filesystem
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


def test_a_rename_here_while_its_writer_flushes_moves_the_writes_too(fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """logrotate-style: a file is renamed here while a process here keeps writing it. A flush
    that lands between the remote rename and the staged file's rekey goes to the OLD name:
    there it finds nothing (precondition) and its bytes go to a conflict copy, ESTALE."""
    fh = fs.create("/a", os.O_CREAT | os.O_WRONLY)
    fs.write(fh, b"one", 0)
    fs.flush(fh)
    real, renamed, go = fs.remote.rename, threading.Event(), threading.Event()

    def slow_rename(src: str, dst: str) -> None:
        real(src, dst)
        renamed.set()
        go.wait(10)

    monkeypatch.setattr(fs.remote, "rename", slow_rename)
    t, out = run(lambda: fs.rename("/a", "/b"))
    assert renamed.wait(10)
    w, flushed = run(lambda: (fs.write(fh, b"two", 3), fs.flush(fh)))
    w.join(2)  # at once, unless it waits for the rename to finish
    go.set()
    t.join(10)
    w.join(10)
    fs.release(fh)
    assert out == [None]
    assert flushed == [(3, None)], f"close() of the writer failed: {flushed!r}"
    assert cat(remote, "b") == b"onetwo"


def test_a_chmod_in_flight_while_the_files_writer_commits_keeps_the_commit(fs: Filesystem, remote: Remote,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A chmod's metadata update answered, then this node's writer commits, then the chmod
    caches its stat: the stat of BEFORE the commit (old size, old version)."""
    write_file(fs, "/a", b"old")
    fh = fs.open("/a", W)
    real, sent, go = fs.remote.set_attrs, threading.Event(), threading.Event()

    def slow_set_attrs(*args: Any, **kwargs: Any) -> Any:
        version = real(*args, **kwargs)
        if not sent.is_set():
            sent.set()
            go.wait(10)
        return version

    monkeypatch.setattr(fs.remote, "set_attrs", slow_set_attrs)
    t, out = run(lambda: fs.set_attributes("/a", mode=0o600))
    assert sent.wait(10)
    w, flushed = run(lambda: (fs.write(fh, b"new content", 0), fs.flush(fh)))
    w.join(2)  # at once, unless it waits for the chmod to finish
    go.set()
    t.join(10)
    w.join(10)
    fs.release(fh)
    assert out == [None]
    assert flushed == [(11, None)], f"close() of the writer failed: {flushed!r}"
    assert cat(remote, "a") == b"new content"
    assert fs.getattr("/a").size == 11  # what this node just wrote


def test_a_chmod_while_a_commit_caches_its_stat_is_kept(fs: Filesystem, remote: Remote,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit's put_own comes after the staged lock is let go: a chmod done in between is
    overwritten in the cache by the commit's older stat (the mode this node just set is lost)."""
    write_file(fs, "/a", b"old")
    fh = fs.open("/a", W)
    fs.write(fh, b"new content", 0)
    real, reached, go = fs.metadata.put_own, threading.Event(), threading.Event()
    writer: list[threading.Thread] = []

    def slow_put_own(info: ObjectInfo, *args: Any) -> None:
        if writer and threading.current_thread() is writer[0] and info.name == "a" and not reached.is_set():
            reached.set()
            go.wait(10)
        real(info, *args)

    monkeypatch.setattr(fs.metadata, "put_own", slow_put_own)
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
    assert fs.remote.stat("a").posix.mode == 0o600  # the store has it: only this node's cache lost it
    posix = fs.getattr("/a").posix
    assert posix is not None and posix.mode == 0o600  # the chmod this node just made


@pytest.mark.parametrize("remote", ["local"], indirect=True)  # directory mtimes entries move
def test_a_listing_in_flight_never_recaches_a_directory_whose_entries_changed_here(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local disks: a commit in d moves d's mtime, and _entries_changed forgets d's stat; but a
    listing of d's parent in flight (a readdir, a background listing) lands after and caches d's
    stat of before (forget() overtakes no listing)."""
    fs.mkdir("/d")
    t0 = 1_000_000_000 * 10**9
    fs.set_attributes("/d", mtime_ns=t0)
    real, listed, go = fs.remote.list, threading.Event(), threading.Event()

    def slow_list(key: str, *args: Any, **kwargs: Any) -> Any:
        children = real(key, *args, **kwargs)
        if key == "" and not listed.is_set():
            listed.set()
            go.wait(10)
        return children

    monkeypatch.setattr(fs.remote, "list", slow_list)
    t, out = run(lambda: fs.readdir("/"))
    assert listed.wait(10)
    write_file(fs, "/d/f", b"x")  # d's mtime on disk is now
    go.set()
    t.join(10)
    on_disk = os.stat(remote.full("d")).st_mtime_ns
    assert on_disk != t0
    shown = fs.getattr("/d").posix.mtime_ns  # (what a stat shows: the lstat's nanoseconds)
    # tar/rsync then set d's mtime back to t0: "nothing changed", no syscall
    fs.set_attributes("/d", mtime_ns=t0)
    after = os.stat(remote.full("d")).st_mtime_ns
    assert shown == on_disk, f"getattr shows d's mtime of before this node's commit in it: {shown} (disk: {on_disk})"
    assert after == t0


def test_a_chmod_in_flight_when_a_writer_opens_and_commits_keeps_the_commit(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    """No writer when the chmod starts: its answer, of before the commit, is not cached."""
    write_file(fs, "/a", b"old")
    real, sent, go = fs.remote.set_attrs, threading.Event(), threading.Event()

    def slow_set_attrs(*args: Any, **kwargs: Any) -> Any:
        version = real(*args, **kwargs)
        if not sent.is_set():
            sent.set()
            go.wait(10)
        return version

    monkeypatch.setattr(fs.remote, "set_attrs", slow_set_attrs)
    t, out = run(lambda: fs.set_attributes("/a", mode=0o600))
    assert sent.wait(10)
    fh = fs.open("/a", W | os.O_TRUNC)
    fs.write(fh, b"new content", 0)
    fs.flush(fh)
    go.set()
    t.join(10)
    fs.release(fh)
    assert out == [None] or isinstance(out[0], OSError)  # (its update may lose to the commit)
    assert cat(remote, "a") == b"new content"
    assert fs.getattr("/a").size == 11  # what this node just wrote, not the chmod's stat of before
    assert fs.metadata._stating == {}  # no token left behind


def test_a_directory_rename_here_while_a_writer_inside_flushes_moves_the_writes_too(
        fs: Filesystem, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    fs.mkdir("/d")
    fh = fs.create("/d/log", os.O_CREAT | os.O_WRONLY)
    fs.write(fh, b"one", 0)
    fs.flush(fh)
    real, renamed, go = fs.remote.rename_tree, threading.Event(), threading.Event()

    def slow_rename_tree(src: str, dst: str) -> None:
        real(src, dst)
        renamed.set()
        go.wait(10)

    monkeypatch.setattr(fs.remote, "rename_tree", slow_rename_tree)
    t, out = run(lambda: fs.rename("/d", "/e"))
    assert renamed.wait(10)
    w, flushed = run(lambda: (fs.write(fh, b"two", 3), fs.flush(fh)))
    w.join(2)
    go.set()
    t.join(10)
    w.join(10)
    fs.release(fh)
    assert out == [None]
    assert flushed == [(3, None)], f"close() of the writer failed: {flushed!r}"
    assert cat(remote, "e/log") == b"onetwo" and cat(remote, "d/log") is None
    assert fs._staged == {}  # released: nothing left in the table under either name
