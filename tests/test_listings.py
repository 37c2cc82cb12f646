"""Background listings (marinfs/meta/listings.py) on the core Filesystem: request counts on the memory
and local backends, single flight, and that a listing overtaken by our own change is dropped."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from marinfs.errors import RemoteError
from marinfs.core import Filesystem
import marinfs.meta.listings as listings_module
from marinfs.meta.metadata import MetadataCache
from marinfs.remote import ObjectInfo, Remote


def core(remote: Remote, tmp_path: Path, prefetch: bool = True) -> Filesystem:
    return Filesystem(remote, staging_dir=tmp_path / "staging", list_prefetch=prefetch)


def put(remote: Remote, key: str, data: bytes = b"x") -> None:
    remote.fs.makedirs(remote.full(os.path.dirname(key)), exist_ok=True)
    remote.fs.pipe_file(remote.full(key), data)


def write(fs: Filesystem, path: str, data: bytes) -> None:
    fh = fs.create(path, os.O_WRONLY | os.O_CREAT).fh
    fs.write(fh, data, 0)
    fs.flush(fh)
    fs.release(fh)


def listed_keys(remote: Remote) -> Counter[str]:
    """Count Remote.list calls by directory (the fixture's remote is the test's own)."""
    calls: Counter[str] = Counter()
    original = remote.list

    def counting(key: str) -> list[ObjectInfo]:
        calls[key] += 1
        return original(key)

    remote.list = counting  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("prefetch", [True, False])
def test_stats_of_many_children_are_answered_from_one_background_listing(
        remote: Remote, tmp_path: Path, prefetch: bool) -> None:
    for i in range(200):
        put(remote, f"d/f{i:03d}", b"x" * (i % 5))
    fs = core(remote, tmp_path, prefetch)
    fs.getattr("/d")
    remote.stats.reset()
    for i in range(200):
        assert fs.getattr(f"/d/f{i:03d}").size == i % 5
        if i == 2 and fs.listings is not None:
            fs.listings.drain()  # the third miss started the listing: let it land
    with pytest.raises(FileNotFoundError):
        fs.getattr("/d/nope")  # the listing says it does not exist: no request
    heads, lists = remote.stats.count("head"), remote.stats.count("list")
    if prefetch:
        assert (heads, lists) == (3, 1)
    else:
        # The miss also asks for a link of that name (d/nope.rclonelink) where links are objects.
        assert (heads, lists) == (202 if remote.link_objects else 201, 0)


def test_a_poll_of_one_file_never_lists_its_directory(remote: Remote, tmp_path: Path) -> None:
    for i in range(50):
        put(remote, f"d/f{i:02d}")
    now = [1000.0]
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", list_prefetch=True,
                    metadata=MetadataCache(ttl=5.0, timer=lambda: now[0]))
    fs.getattr("/d")
    remote.stats.reset()
    for _ in range(10):
        now[0] += 6  # the stat expired: each poll is a miss, always of the same name
        fs.getattr("/d/f07")
    assert fs.listings is not None
    fs.listings.drain()
    assert (remote.stats.count("head"), remote.stats.count("list")) == (10, 0)


def test_a_walk_lists_every_directory_once_and_ahead_of_the_walker(remote: Remote, tmp_path: Path) -> None:
    for i in range(100):
        put(remote, f"t/arrays/a{i:03d}/c.0")
        put(remote, f"t/arrays/a{i:03d}/c.1")
    fs = core(remote, tmp_path)
    calls = listed_keys(remote)
    assert fs.listings is not None
    fs.listings.ahead = 10

    def walk(path: str) -> int:
        files = 0
        for child in fs.readdir(path):
            if child.is_dir:
                files += walk("/" + child.name)
            else:
                files += 1
        return files

    # A readdir alone is not a walk: a poll of one directory lists nothing ahead.
    order = [c.name for c in fs.readdir("/t/arrays")]  # a walker's order (local: unsorted)
    fs.listings.drain()
    assert sum(calls.values()) == 1
    # The walker reaches the first: the next `ahead` of its siblings are listed in the background.
    fs.readdir("/" + order[0])
    fs.listings.drain()
    assert [fs.metadata.has_listing(k) for k in order[1:11]] == [True] * 10
    assert not fs.metadata.has_listing(order[11])
    # Reading a directory again is no walk: nothing more is listed ahead.
    fs.readdir("/" + order[0])
    fs.listings.drain()
    assert not fs.metadata.has_listing(order[11])
    # Each directory it reaches lists one more; nothing is listed twice.
    assert walk("/t") == 200
    fs.listings.drain()
    assert set(calls) == {"t", "t/arrays"} | {f"t/arrays/a{i:03d}" for i in range(100)}
    assert set(calls.values()) == {1}, {k: n for k, n in calls.items() if n > 1}


class BlockedListing:
    """Makes the background listing of ``key`` take its snapshot, then wait for release()."""

    def __init__(self, remote: Remote, key: str, fail: bool = False) -> None:
        self.started, self.released = threading.Event(), threading.Event()
        original = remote.list

        def blocked(k: str) -> list[ObjectInfo]:
            if k != key or not threading.current_thread().name.startswith("marinfs-list"):
                return original(k)
            children = original(k)
            self.started.set()
            assert self.released.wait(10)
            if fail:
                raise RemoteError("the listing failed")
            return children

        remote.list = blocked  # type: ignore[method-assign]

    def release(self) -> None:
        self.released.set()


def listing_held(fs: Filesystem, remote: Remote, d: str) -> BlockedListing:
    """A background listing of ``d`` in flight, held until release()."""
    blocked = BlockedListing(remote, d)
    start_background_listing(fs, d)
    assert blocked.started.wait(10)
    return blocked


def start_background_listing(fs: Filesystem, d: str) -> None:
    """Three lookups that miss the cache in ``d`` (names that do not exist: no stat is cached)."""
    for name in ("m0", "m1", "m2"):
        with pytest.raises(FileNotFoundError):
            fs.getattr(f"/{d}/{name}")


def _commit(fs: Filesystem) -> None:
    write(fs, "/d/new", b"mine")


def _unlink(fs: Filesystem) -> None:
    fs.unlink("/d/f1")


def _mkdir(fs: Filesystem) -> None:
    fs.mkdir("/d/sub")


def _rename(fs: Filesystem) -> None:
    fs.rename("/d/f1", "/d/new")


def change_during_a_listing(remote: Remote, tmp_path: Path, change: Callable[[Filesystem], None],
                            meanwhile: Callable[[Filesystem], None] | None = None) -> Filesystem:
    """A background listing of d/ (holding f0, f1) sent before ``change`` and answered after it
    (and after ``meanwhile``, which runs once the change is made)."""
    put(remote, "d/f0")
    put(remote, "d/f1")
    fs = core(remote, tmp_path)
    fs.getattr("/d")
    blocked = BlockedListing(remote, "d")
    start_background_listing(fs, "d")
    assert blocked.started.wait(10)  # listed before the change, answered after it
    change(fs)
    if meanwhile is not None:
        meanwhile(fs)
    blocked.release()
    assert fs.listings is not None
    fs.listings.drain()
    return fs


@pytest.mark.parametrize("change", [_commit, _unlink, _mkdir, _rename])
def test_a_listing_overtaken_by_our_own_change_never_hides_it(
        remote: Remote, tmp_path: Path, change: Callable[[Filesystem], None]) -> None:
    """Dropped, or kept with the change laid over it: either way this node sees its change."""
    fs = change_during_a_listing(remote, tmp_path, change)
    expected = {os.path.basename(k) for k in remote.fs.ls(remote.full("d"), detail=False)}
    assert {os.path.basename(c.name) for c in fs.readdir("/d")} == expected
    for name in ("f0", "f1", "new", "sub"):
        present = name in expected
        try:
            fs.getattr(f"/d/{name}")
            assert present, name
        except FileNotFoundError:
            assert not present, name


def _rename_with_mtime(fs: Filesystem) -> None:
    fs.set_attributes("/d/f1", mtime_ns=1_700_000_000 * 10**9)
    fs.rename("/d/f1", "/d/new")


@pytest.mark.parametrize("change", [_commit, _unlink, _rename_with_mtime])
def test_a_listing_overtaken_by_our_own_known_change_is_kept_with_the_change_laid_over(
        remote: Remote, tmp_path: Path, change: Callable[[Filesystem], None]) -> None:
    """A commit, an unlink or a file rename here, whose outcome this node knows, does not cost
    the listing in flight (tar -x and rsync change a directory every few milliseconds: its
    listing would never land again): it is cached with the change laid over its answer."""
    fs = change_during_a_listing(remote, tmp_path, change)
    kept = not (change is _rename_with_mtime and remote.renames_in_place)  # (local: a stat is a syscall)
    assert fs.metadata.has_listing("d") == kept
    expected = {os.path.basename(k) for k in remote.fs.ls(remote.full("d"), detail=False)}
    remote.stats.reset()
    assert {os.path.basename(c.name) for c in fs.readdir("/d")} == expected
    for name in ("f0", "f1", "new", "nope"):
        try:
            fs.getattr(f"/d/{name}")
            assert name in expected, name
        except FileNotFoundError:
            assert name not in expected, name
    assert remote.stats.count("list") == 0 or not kept  # all from the listing


def test_an_rsync_of_files_keeps_the_directory_listed(remote: Remote, tmp_path: Path) -> None:
    """rsync's pattern per file (look the name up, write a temporary name, set its mtime and
    mode, rename it onto the name) costs no lookup request once the directory is listed: a
    rename here whose outcome this node knows keeps both listings valid."""
    put(remote, "d/seed")
    fs = core(remote, tmp_path)
    fs.readdir("/d")
    remote.stats.reset()
    for i in range(20):
        with pytest.raises(FileNotFoundError):
            fs.getattr(f"/d/f{i}")
        with pytest.raises(FileNotFoundError):
            fs.getattr(f"/d/.f{i}.tmp")
        write(fs, f"/d/.f{i}.tmp", b"x" * i)
        fs.set_attributes(f"/d/.f{i}.tmp", mtime_ns=(1_700_000_000 + i) * 10**9)
        fs.set_attributes(f"/d/.f{i}.tmp", mode=0o600)
        fs.rename(f"/d/.f{i}.tmp", f"/d/f{i}")
        assert fs.getattr(f"/d/f{i}").size == i
    if not remote.renames_in_place:  # (a local rename is a syscall: its stat costs as much)
        assert remote.stats.count("list") == 0
    assert sorted(c.name for c in fs.readdir("/d")) == sorted(["d/seed", *(f"d/f{i}" for i in range(20))])
    posix = fs.getattr("/d/f7").posix
    assert posix is not None and posix.mtime_ns == (1_700_000_000 + 7) * 10**9 and posix.mode == 0o600


def test_a_listing_that_answers_a_writers_lookups_is_listed_again_before_it_expires(
        remote: Remote, tmp_path: Path) -> None:
    """tar -x looks up each name it is about to create: past half its TTL, the listing that
    answers "missing" is listed again in the background, so no create finds it expired (each
    would cost two HEADs, and the third a LIST)."""
    put(remote, "d/seed")
    now = [1000.0]
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", list_prefetch=True,
                    metadata=MetadataCache(ttl=5.0, timer=lambda: now[0]))
    fs.readdir("/d")
    remote.stats.reset()
    misses: list[str] = []
    ask = fs.namespace.ask_stat

    def counting(key: str) -> tuple[ObjectInfo | None, bool]:
        misses.append(key)  # a lookup the caches did not answer
        return ask(key)

    fs.namespace.ask_stat = counting  # type: ignore[method-assign]
    for step in range(12):  # 12 s of creates, 0.5 s apart: the listing would expire twice
        now[0] += 0.5
        with pytest.raises(FileNotFoundError):
            fs.getattr(f"/d/f{step}")
        write(fs, f"/d/f{step}", b"x")
        assert fs.listings is not None
        fs.listings.drain()
    assert misses == []  # every lookup answered by a listing
    assert 2 <= remote.stats.count("list") <= 6  # listed again about every half TTL
    assert sorted(c.name for c in fs.readdir("/d")) == sorted(["d/seed", *(f"d/f{i}" for i in range(12))])
    fs.close()


@pytest.mark.parametrize("change", [_commit, _unlink])
def test_a_readdir_that_joins_a_listing_overtaken_by_our_change_sees_the_change(
        remote: Remote, tmp_path: Path, change: Callable[[Filesystem], None]) -> None:
    """A readdir that waits for a background listing sent before this node's own change gets
    the listing with the change laid over it, not the answer as the remote gave it (found by a
    review: `rm d/f1; ls d` showed f1)."""
    result: list[list[str]] = []
    readers: list[threading.Thread] = []

    def readdir_waiting(fs: Filesystem) -> None:
        reader = threading.Thread(target=lambda: result.append(sorted(c.name for c in fs.readdir("/d"))))
        reader.start()
        reader.join(0.2)  # it waits for the listing in flight
        readers.append(reader)

    change_during_a_listing(remote, tmp_path, change, readdir_waiting)
    readers[0].join(10)
    expected = sorted(f"d/{os.path.basename(k)}" for k in remote.fs.ls(remote.full("d"), detail=False))
    assert result == [expected]


def test_a_rename_of_a_file_changed_behind_this_node_shows_the_copy_as_it_is(
        remote: Remote, tmp_path: Path) -> None:
    """This node's stat of the source is older than the object the rename copies (another node
    rewrote it): the target is not given the old stat's size under the copy's version (found
    by a review: reads of the target came back cut to the old size)."""
    if remote.renames_in_place:
        pytest.skip("a local rename keeps no stat of its own")
    fs = Filesystem(remote, staging_dir=tmp_path / "staging", list_prefetch=True,
                    metadata=MetadataCache(ttl=60.0))
    write(fs, "/f", b"a" * 100)
    fs.set_attributes("/f", mtime_ns=1_700_000_000 * 10**9)
    assert fs.getattr("/f").size == 100
    remote.fs.pipe_file(remote.full("f"), b"b" * 200)  # another node, within our stat's TTL
    fs.rename("/f", "/g")
    assert fs.getattr("/g").size == 200
    fh = fs.open("/g", os.O_RDONLY).fh
    try:
        assert fs.read(fh, 1000, 0) == b"b" * 200
    finally:
        fs.release(fh)


def test_a_readdir_waits_for_the_listing_in_flight_instead_of_listing_again(
        remote: Remote, tmp_path: Path) -> None:
    put(remote, "d/f0")
    fs = core(remote, tmp_path)
    fs.getattr("/d")
    blocked = listing_held(fs, remote, "d")
    remote.stats.reset()
    result: list[list[ObjectInfo]] = []
    reader = threading.Thread(target=lambda: result.append(fs.readdir("/d")))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # waiting for the listing in flight
    blocked.release()
    reader.join(10)
    assert [c.name for c in result[0]] == ["d/f0"]
    assert remote.stats.count("list") == 0


def test_a_failed_background_listing_is_ignored(remote: Remote, tmp_path: Path) -> None:
    put(remote, "d/f0")
    fs = core(remote, tmp_path)
    fs.getattr("/d")
    blocked = BlockedListing(remote, "d", fail=True)
    start_background_listing(fs, "d")
    assert blocked.started.wait(10)
    blocked.release()
    assert fs.listings is not None
    fs.listings.drain()
    assert not fs.metadata.has_listing("d")
    assert fs.getattr("/d/f0").size == 1  # lookups go on with HEADs
    with pytest.raises(OSError, check=lambda e: e.errno == errno.ENOENT):
        fs.getattr("/d/m3")
    assert [c.name for c in fs.readdir("/d")] == ["d/f0"]


def test_creates_in_a_directory_not_listed_list_it_once_and_the_next_lookups_use_that_listing(
        remote: Remote, tmp_path: Path) -> None:
    """tar -x over an existing tree: no mkdir of ours says the directory is empty, so each new
    name's lookup was a HEAD, a LIST and a link's HEAD, until the third listed the directory.
    Now the first create lists it; the next names wait a moment for that listing."""
    for i in range(20):
        put(remote, f"d/old{i:02d}")
    fs = core(remote, tmp_path)
    fs.getattr("/d")
    stats: list[str] = []
    original = remote.stat
    remote.stat = lambda key, **kw: stats.append(key) or original(key, **kw)  # type: ignore[method-assign]
    listed = listed_keys(remote)
    looked_up = []
    for i in range(10):
        before = len(stats)
        fh = fs.create(f"/d/new{i}", os.O_WRONLY | os.O_CREAT).fh  # (its lookup first)
        looked_up += stats[before:]
        fs.write(fh, b"x", 0)
        fs.release(fh)
        if i == 0 and fs.listings is not None:
            fs.listings.drain()
    if fs.listings is None:  # (a local disk keeps no listings: a stat is a syscall)
        assert len(looked_up) >= 10
        return
    assert looked_up == ["d/new0"] and listed["d"] == 1  # the other nine: from the one listing
    assert {os.path.basename(c.name) for c in fs.readdir("/d")} == (
        {f"old{i:02d}" for i in range(20)} | {f"new{i}" for i in range(10)})


def test_a_lookup_waits_briefly_for_its_directorys_listing_in_flight(
        remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listings_module, "GRACE", 5.0)  # (a loaded machine: the wait is what is tested)
    put(remote, "d/a")
    fs = core(remote, tmp_path)
    fs.getattr("/d")
    blocked = listing_held(fs, remote, "d")
    threading.Timer(0.05, blocked.release).start()
    remote.stats.reset()
    with pytest.raises(FileNotFoundError):
        fs.getattr("/d/nope")  # answered by the listing once it lands: no request of its own
    assert remote.stats.count("head") == 0
    monkeypatch.setattr(listings_module, "GRACE", 0.2)
    put(remote, "e/a")
    fs.getattr("/e")
    blocked = listing_held(fs, remote, "e")  # a listing that does not land within the grace
    try:
        t0 = time.monotonic()
        assert fs.getattr("/e/a").size == 1  # asked itself after at most the grace
        assert time.monotonic() - t0 < 2.0 and not blocked.released.is_set()
    finally:
        blocked.release()


@pytest.mark.unit
def test_a_failed_listing_is_not_the_answer_once_we_changed_the_directory_since() -> None:
    """A CI run's `ls` of a GCS mount's root showed nothing after a file was written there: a
    background listing sent while the prefix had no object failed "not found" (gcsfs), the
    file's commit landed meanwhile, and the readdir waiting for that listing got its error
    (ENOENT, which readdir(3) takes as the end). A failure is the answer only while nothing of
    ours changed there since it was sent; else the caller lists again."""
    metadata = MetadataCache(ttl=5.0)
    token = metadata.begin_listing("")
    assert metadata.end_listing("", token, None)  # nothing changed: its error stands
    token = metadata.begin_listing("")
    metadata.put_own(ObjectInfo(name="fine", is_dir=False, size=2))
    assert not metadata.end_listing("", token, None)
    assert metadata.get_listing("") is None


@pytest.mark.unit
def test_the_mount_root_with_no_object_under_its_prefix_lists_empty(tmp_path: Path) -> None:
    """gcsfs answers a listing of a prefix with no object "not found"; the mount's root is there
    all the same (a directory under it with nothing left is not)."""
    remote = Remote(f"memory://root-{os.getpid()}-{time.monotonic_ns()}")

    def not_found(full: str, on_page: object = None) -> list:
        raise FileNotFoundError(errno.ENOENT, "not found", full)

    remote._list_entries = not_found  # type: ignore[method-assign]
    assert remote.list("") == []
    with pytest.raises(FileNotFoundError):
        remote.list("gone")
