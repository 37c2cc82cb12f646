"""The directory record (marinfs/dirmeta.py): its format, what listings cost, coalesced and
conditional writes, two nodes writing one directory. Against an in-memory store fake that
checks preconditions like S3 (unit tier), and against marinfs's remotes (core: memory://,
objectstore: SeaweedFS)."""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import object_store
from marinfs.remote.dirmeta import RECORD_NAME, DirRecords, decode, encode, record_key
from marinfs.errors import FsError, PreconditionFailed, RemoteError
from marinfs.objects import ABSENT, NO_ATTRS, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote import GCSRemote, MemoryRemote, Remote, S3Remote
from marinfs.remote.recorded import hooks_missing
from mounting import fsspec_client
import tiers


class FakeStore:
    """read_small/put_small with honest conditional semantics: each write gets a new version;
    a put whose ``expect`` is not the current version (ABSENT: any object) fails."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, ObjectVersion]] = {}
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._n = 0
        self.fail_puts = 0  # the next N puts fail as a network error would
        self.unversioned = False  # puts answer None (a store that does not say)

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        with self.lock:
            self.counts["get"] += 1
            if key not in self.objects:
                raise FileNotFoundError(key)
            return self.objects[key]

    def put_small(self, key: str, data: bytes, expect: ObjectVersion) -> ObjectVersion | None:
        with self.lock:
            self.counts["put"] += 1
            if self.fail_puts:
                self.fail_puts -= 1
                raise RemoteError("put failed after its retries")
            current = self.objects.get(key)
            if (current is None) != expect.absent or (current is not None and current[1] != expect):
                self.counts["412"] += 1
                raise PreconditionFailed(key)
            return self._store(key, data, None if self.unversioned else ...)

    def _store(self, key: str, data: bytes, answer: object = ...) -> ObjectVersion | None:
        self._n += 1
        version = ObjectVersion("generation", str(self._n))
        self.objects[key] = (data, version)
        return version if answer is ... else None

    def raw_put(self, key: str, data: bytes) -> ObjectVersion:
        """Another tool's unconditional write."""
        with self.lock:
            version = self._store(key, data)
            assert version is not None
            return version

    def version(self, key: str) -> ObjectVersion | None:
        with self.lock:
            return self.objects[key][1] if key in self.objects else None


def v(n: int) -> ObjectVersion:
    return ObjectVersion("generation", str(n))


def files(dir_key: str, store: FakeStore, **versions: int) -> list[ObjectInfo]:
    """A listing of ``dir_key``: the named files at those versions, plus the record if any."""
    prefix = dir_key + "/" if dir_key else ""
    out = [ObjectInfo(name=prefix + n, is_dir=False, size=1, version=v(g)) for n, g in versions.items()]
    rv = store.version(record_key(dir_key))
    if rv is not None:
        out.append(ObjectInfo(name=record_key(dir_key), is_dir=False, size=10, version=rv))
    return out


def by_name(listing: list[ObjectInfo]) -> dict[str, PosixAttrs | None]:
    return {i.name.rsplit("/", 1)[-1]: i.posix for i in listing}


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


@pytest.fixture
def records(store: FakeStore):
    r = DirRecords(store, flush_delay=3600)  # written only by flush(): deterministic
    yield r
    r.close(timeout=5)


MODE = PosixAttrs(mode=0o600)
FULL = PosixAttrs(mode=0o4755, uid=1000, gid=0, mtime_ns=1_700_000_000_123_456_789,
                  xattrs=(("user.bin", b"\x00\xff\n"), ("user.empty", b""), ("user.text", "é".encode())))


# -- the format ----------------------------------------------------------------------------------
def test_encode_decode_round_trip() -> None:
    entries = {"a": ("g1", FULL), "b": ("eabc", MODE), "sub/": (None, PosixAttrs(uid=7)), "ü ñ": ("g2", MODE)}
    data = encode(entries)
    assert decode(data) == entries
    assert encode(decode(data)) == data  # canonical: equal records are equal bytes
    doc = json.loads(data)
    assert doc["v"] == 1 and doc["entries"]["b"] == {"version": "eabc", "mode": 0o600}  # only what is set
    assert doc["entries"]["sub/"] == {"uid": 7}  # a directory has no version
    assert doc["entries"]["a"]["xattrs"] == {"user.bin": "AP8K", "user.empty": "", "user.text": "w6k="}
    assert decode(encode({})) == {}


@pytest.mark.parametrize("data", [b"", b"not json", b"\xff\xfe", b"[1, 2]", b'{"v": 2, "entries": {}}',
                                  b'{"entries": {"a": {"version": "g1", "mode": 1}}}', b'{"v": 1, "entries": []}'])
def test_a_corrupt_record_decodes_empty_with_one_warning(data: bytes, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="marinfs.remote.dirmeta"):
        assert decode(data, "d/" + RECORD_NAME) == {}
    assert len(caplog.records) == 1


def test_bad_entries_are_left_out_and_the_rest_kept(caplog: pytest.LogCaptureFixture) -> None:
    data = (b'{"v": 1, "entries": {"ok": {"version": "g1", "mode": 420},'
            b' "noversion": {"mode": 420}, "mode": {"version": "g1", "mode": 99999},'
            b' "neg": {"version": "g1", "uid": -1}, "bool": {"version": "g1", "gid": true},'
            b' "b64": {"version": "g1", "xattrs": {"user.x": "***"}}, "a/b": {"version": "g1"},'
            b' "..": {"version": "g1"}, "": {"version": "g1"}, "list": [1], "d/": {"version": "x", "mode": 448}}}')
    with caplog.at_level(logging.WARNING, logger="marinfs.remote.dirmeta"):
        assert decode(data) == {"ok": ("g1", PosixAttrs(mode=0o644)), "d/": (None, PosixAttrs(mode=0o700))}
    assert len(caplog.records) == 1


# -- listings ------------------------------------------------------------------------------------
def test_a_listing_without_record_costs_nothing_and_shows_defaults(store: FakeStore, records: DirRecords) -> None:
    listing = records.apply("d", files("d", store, a=1, b=2) + [ObjectInfo(name="d/sub", is_dir=True)])
    assert by_name(listing) == {"a": NO_ATTRS, "b": NO_ATTRS, "sub": NO_ATTRS}
    assert store.counts == {}


def test_apply_reads_the_record_once_per_version(store: FakeStore, records: DirRecords) -> None:
    store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", MODE), "sub/": (None, FULL)}))
    listing = files("d", store, a=1, b=2) + [ObjectInfo(name="d/sub", is_dir=True)]
    shown = records.apply("d", listing)
    assert by_name(shown) == {"a": MODE, "b": NO_ATTRS, "sub": FULL}  # the record itself is hidden
    assert store.counts["get"] == 1
    for _ in range(3):  # the listed version is the cached one: no request
        assert by_name(records.apply("d", listing)) == by_name(shown)
    assert store.counts["get"] == 1
    store.raw_put("d/" + RECORD_NAME, encode({"b": ("g2", MODE)}))  # another node changed it
    assert by_name(records.apply("d", files("d", store, a=1, b=2))) == {"a": NO_ATTRS, "b": MODE}
    assert store.counts["get"] == 2


class SlowStore(FakeStore):
    """Its GETs wait until released, and say when they began."""

    def __init__(self) -> None:
        super().__init__()
        self.began, self.go = threading.Event(), threading.Event()

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        self.began.set()
        assert self.go.wait(10)
        return super().read_small(key)


def test_prefetch_sends_the_one_get_before_apply_needs_it() -> None:
    store = SlowStore()
    records = DirRecords(store, flush_delay=3600)
    try:
        store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", MODE)}))
        listing = files("d", store, a=1, b=2)
        records.prefetch("d", store.version("d/" + RECORD_NAME))  # the page with the record landed
        records.prefetch("d", store.version("d/" + RECORD_NAME))  # a second page: still one GET
        assert store.began.wait(5)  # under way while the later pages would still be coming
        store.go.set()
        assert by_name(records.apply("d", listing)) == {"a": MODE, "b": NO_ATTRS}
        assert store.counts["get"] == 1
        records.prefetch("d", store.version("d/" + RECORD_NAME))  # the cached version: nothing
        assert by_name(records.apply("d", listing)) == {"a": MODE, "b": NO_ATTRS}
        assert store.counts["get"] == 1
    finally:
        store.go.set()
        records.close(timeout=5)


def test_a_prefetch_that_failed_leaves_the_listing_working(store: FakeStore, records: DirRecords,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", MODE)}))
    broken = RemoteError("get failed after its retries")

    def fail(key: str) -> tuple[bytes, ObjectVersion]:
        raise broken

    store.read_small = fail  # type: ignore[method-assign]
    records.prefetch("d", store.version("d/" + RECORD_NAME))
    with caplog.at_level(logging.WARNING, logger="marinfs.remote.dirmeta"):
        shown = by_name(records.apply("d", files("d", store, a=1)))
    assert shown == {"a": None}  # not known, as an unreadable record always shows
    assert "cannot read directory record" in caplog.text


def test_an_entry_of_other_bytes_is_not_applied(store: FakeStore, records: DirRecords) -> None:
    store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", MODE), "b": ("g2", MODE)}))
    shown = by_name(records.apply("d", files("d", store, a=1, b=9)))  # b rewritten by another tool
    assert shown == {"a": MODE, "b": NO_ATTRS}
    assert records.cached("d", "b", v(9)) is None and records.cached("d", "a", v(1)) == MODE
    assert records.cached("d", "a", None) is None  # a file of unknown version matches nothing


def test_a_corrupt_record_shows_defaults(store: FakeStore, records: DirRecords) -> None:
    store.raw_put("d/" + RECORD_NAME, b'{"v": 1, "entries": {"a": ')
    assert by_name(records.apply("d", files("d", store, a=1))) == {"a": NO_ATTRS}
    records.set("d", "a", v(1), MODE)  # the next change replaces it
    assert records.flush(5)
    assert decode(store.objects["d/" + RECORD_NAME][0]) == {"a": ("g1", MODE)}


def test_an_unreadable_record_leaves_posix_unknown(store: FakeStore, records: DirRecords,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", MODE)}))
    listing = files("d", store, a=1)

    def broken(key: str) -> tuple[bytes, ObjectVersion]:
        raise RemoteError("get failed after its retries")

    store.read_small = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="marinfs.remote.dirmeta"):
        assert by_name(records.apply("d", listing)) == {"a": None}
    assert caplog.records


def test_the_root_directory_has_a_record_too(store: FakeStore, records: DirRecords) -> None:
    records.set("", "top", v(3), MODE)
    assert records.flush(5)
    assert RECORD_NAME in store.objects
    fresh = DirRecords(store)
    assert by_name(fresh.apply("", files("", store, top=3))) == {"top": MODE}


# -- writes --------------------------------------------------------------------------------------
def test_own_changes_show_before_they_are_written(store: FakeStore, records: DirRecords) -> None:
    records.set("d", "a", v(1), MODE)
    records.set("d", "sub/", None, FULL)
    assert records.cached("d", "a", v(1)) == MODE and records.cached("d", "a", v(2)) is None
    assert records.cached("d", "sub/", None) == FULL
    listing = files("d", store, a=1) + [ObjectInfo(name="d/sub", is_dir=True)]
    assert by_name(records.apply("d", listing)) == {"a": MODE, "sub": FULL}
    assert store.counts["put"] == 0
    assert records.flush(5)
    assert store.counts["put"] == 1 and records.cached("d", "a", v(1)) == MODE
    assert by_name(records.apply("d", files("d", store, a=1) + [ObjectInfo(name="d/sub", is_dir=True)])) == \
        {"a": MODE, "sub": FULL}
    assert store.counts["get"] == 0  # the record we wrote is the one listed


class FlushBetween(DirRecords):
    """Its flusher's PUT lands right after a listing found its record: the moment the flusher
    thread hits now and then when ``ls`` and a flush overlap (a CI flake of ``rsync -a``)."""

    def _current(self, dir_key: str, listed: ObjectVersion | None):  # type: ignore[no-untyped-def]
        record = super()._current(dir_key, listed)
        assert self.flush(5)
        return record


def test_a_put_landing_while_a_listing_is_applied_loses_nothing(store: FakeStore) -> None:
    records = FlushBetween(store, flush_delay=3600)
    try:
        store.raw_put("d/" + RECORD_NAME, encode({"b": ("g2", MODE)}))
        assert by_name(records.apply("d", files("d", store, a=1, b=2))) == {"a": NO_ATTRS, "b": MODE}
        records.set("d", "a", v(1), FULL)
        listing = files("d", store, a=1, b=2)  # listed before the PUT: the old record's version
        assert by_name(records.apply("d", listing)) == {"a": FULL, "b": MODE}
        assert store.counts["put"] == 1 and records.cached("d", "a", v(1)) == FULL
    finally:
        records.close(timeout=5)


class HeldGet(FakeStore):
    """Its first GET reads the record at once and answers when released: a PUT may land
    between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.began, self.go, self.held = threading.Event(), threading.Event(), False

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        answer = super().read_small(key)
        if not self.held:
            self.held = True
            self.began.set()
            assert self.go.wait(10)
        return answer


def test_a_get_sent_before_our_put_does_not_bring_the_older_record_back() -> None:
    store = HeldGet()
    records = DirRecords(store, flush_delay=3600)
    try:
        store.raw_put("d/" + RECORD_NAME, encode({"b": ("g2", MODE)}))  # another node's record
        records.prefetch("d", store.version("d/" + RECORD_NAME))  # our listing saw it: one GET
        assert store.began.wait(5)
        records.set("d", "a", v(1), FULL)
        assert records.flush(5)  # expected ABSENT (never read): 412, a GET, the merged PUT
        store.go.set()
        deadline = time.monotonic() + 5
        while records._reading and time.monotonic() < deadline:
            time.sleep(0.01)
        assert records.cached("d", "a", v(1)) == FULL and records.cached("d", "b", v(2)) == MODE
        listing = files("d", store, a=1, b=2)
        gets = store.counts["get"]
        assert by_name(records.apply("d", listing)) == {"a": FULL, "b": MODE}
        assert store.counts["get"] == gets  # the record we wrote is the one listed
    finally:
        store.go.set()
        records.close(timeout=5)


def test_lists_sent_before_our_put_made_the_record_keep_it(store: FakeStore, records: DirRecords) -> None:
    sent = records.tick()
    first, second = files("d", store, a=1), files("d", store, a=1)  # no record yet
    records.set("d", "a", v(1), FULL)
    assert records.flush(5)
    assert by_name(records.apply("d", first, sent=sent)) == {"a": FULL}
    assert by_name(records.apply("d", second, sent=sent)) == {"a": FULL}
    assert records.cached("d", "a", v(1)) == FULL
    records.set("d", "a", v(1), MODE)
    assert records.flush(5)
    assert store.counts["put"] == 2 and store.counts["412"] == 0  # it still knew its version
    del store.objects["d/" + RECORD_NAME]  # another node removed it: a listing sent since says so
    assert by_name(records.apply("d", files("d", store, a=1), sent=records.tick())) == {"a": NO_ATTRS}


def test_a_listing_sent_before_a_newer_one_never_undoes_what_that_one_read(store: FakeStore,
                                                                            records: DirRecords) -> None:
    older_sent = records.tick()
    older = files("d", store, a=1)  # no record yet
    store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", FULL)}))  # another node makes it
    newer_sent = records.tick()
    assert by_name(records.apply("d", files("d", store, a=1), sent=newer_sent)) == {"a": FULL}
    assert by_name(records.apply("d", older, sent=older_sent)) == {"a": FULL}  # it landed late
    assert records.cached("d", "a", v(1)) == FULL and store.counts["get"] == 1


class ChmodBetween(DirRecords):
    """A newer change of a name is queued and written while a listing reads the record."""

    def _current(self, dir_key: str, listed: ObjectVersion | None):  # type: ignore[no-untyped-def]
        self.set("d", "a", v(1), MODE)
        assert self.flush(5)
        return super()._current(dir_key, listed)


def test_a_change_written_while_a_listing_is_applied_wins_over_the_one_before(store: FakeStore) -> None:
    records = ChmodBetween(store, flush_delay=3600)
    try:
        store.raw_put("d/" + RECORD_NAME, encode({"b": ("g2", MODE)}))
        records.set("d", "a", v(1), FULL)  # queued; the chmod to MODE comes while the listing is applied
        assert by_name(records.apply("d", files("d", store, a=1, b=2))) == {"a": MODE, "b": MODE}
        assert records.cached("d", "a", v(1)) == MODE
    finally:
        records.close(timeout=5)


def test_many_changes_in_one_window_are_one_put(store: FakeStore) -> None:
    records = DirRecords(store, flush_delay=0.1)
    try:
        for i in range(500):
            records.set("d", f"f{i}", v(i + 1), PosixAttrs(mode=0o600 + i % 8))
        records.set("d", "f0", v(1), FULL)  # the last change of a name wins
        records.forget("d", "f1")
        records.set("e", "x", v(7), MODE)  # another directory: its own PUT
        deadline = time.monotonic() + 10
        while records.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert store.counts["put"] == 2 and store.counts["get"] == 0  # new records: PUT if absent
        entries = decode(store.objects["d/" + RECORD_NAME][0])
        assert len(entries) == 499 and entries["f0"] == ("g1", FULL) and "f1" not in entries
    finally:
        records.close(5)


def test_the_window_is_timed_by_the_injected_clock(store: FakeStore) -> None:
    now = [0.0]
    records = DirRecords(store, flush_delay=5.0, clock=lambda: now[0])
    try:
        records.set("d", "a", v(1), MODE)
        time.sleep(0.2)
        assert store.counts["put"] == 0  # 0.2 s of real time, none of the clock's
        now[0] = 10.0
        records.set("e", "b", v(2), MODE)  # wakes the flusher, which finds d due
        deadline = time.monotonic() + 5
        while "d/" + RECORD_NAME not in store.objects and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "d/" + RECORD_NAME in store.objects and "e/" + RECORD_NAME not in store.objects
    finally:
        records.close(5)
    assert "e/" + RECORD_NAME in store.objects  # close flushes


def test_empty_attrs_and_forget_remove_the_entry(store: FakeStore, records: DirRecords) -> None:
    records.set("d", "a", v(1), MODE)
    records.set("d", "b", v(2), MODE)
    assert records.flush(5)
    records.set("d", "a", v(1), NO_ATTRS)
    records.forget("d", "b")
    assert records.cached("d", "b", v(2)) is None
    assert records.flush(5)
    assert decode(store.objects["d/" + RECORD_NAME][0]) == {}  # written empty
    with pytest.raises(ValueError):
        records.set("d", "c", None, MODE)  # a file's entry must name its version


def test_removals_never_create_a_record(store: FakeStore, records: DirRecords) -> None:
    records.forget("d", "gone")
    assert records.flush(5)
    assert store.counts == {"get": 1}  # read once: there is none, nothing to write
    records.forget("d", "gone2")
    assert records.flush(5)
    assert store.counts == {"get": 1} and not store.objects


def test_an_unchanged_record_is_not_written_again(store: FakeStore, records: DirRecords) -> None:
    records.set("d", "a", v(1), MODE)
    assert records.flush(5)
    records.set("d", "a", v(1), MODE)
    assert records.flush(5)
    assert store.counts["put"] == 1


def test_two_nodes_changing_one_directory_both_survive(store: FakeStore) -> None:
    one, two = DirRecords(store, flush_delay=3600), DirRecords(store, flush_delay=3600)
    try:
        one.set("d", "shared", v(5), MODE)
        assert one.flush(5)
        for node in (one, two):  # both know the record at its current version
            node.apply("d", files("d", store, a=1, b=2, shared=5))
        one.set("d", "a", v(1), MODE)
        two.set("d", "b", v(2), FULL)
        two.set("d", "shared", v(5), NO_ATTRS)
        assert one.flush(5) and two.flush(5)  # two's If-Match fails: it re-reads and merges
        assert store.counts["412"] == 1
        assert decode(store.objects["d/" + RECORD_NAME][0]) == {"a": ("g1", MODE), "b": ("g2", FULL)}
        assert by_name(one.apply("d", files("d", store, a=1, b=2, shared=5))) == \
            {"a": MODE, "b": FULL, "shared": NO_ATTRS}
    finally:
        one.close(5)
        two.close(5)


def test_many_nodes_racing_for_a_new_record_lose_nothing(store: FakeStore) -> None:
    nodes = [DirRecords(store, flush_delay=0.01) for _ in range(4)]
    start = threading.Barrier(len(nodes))

    def work(i: int, node: DirRecords) -> None:
        start.wait()
        for j in range(20):
            node.set("d", f"n{i}-{j}", v(100 * i + j + 1), MODE)
            time.sleep(0.002)

    threads = [threading.Thread(target=work, args=(i, n)) for i, n in enumerate(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for node in nodes:
        for _ in range(10):  # bounded attempts per flush: a loser tries again at the next
            if node.flush(10):
                break
        node.close(5)
    entries = decode(store.objects["d/" + RECORD_NAME][0])
    assert set(entries) == {f"n{i}-{j}" for i in range(4) for j in range(20)}


def test_a_failed_write_is_kept_and_retried(store: FakeStore, records: DirRecords,
                                            caplog: pytest.LogCaptureFixture) -> None:
    store.fail_puts = 1
    records.set("d", "a", v(1), MODE)
    with caplog.at_level(logging.WARNING, logger="marinfs.remote.dirmeta"):
        assert not records.flush(5)
    assert caplog.records and records.pending() == 1
    assert records.cached("d", "a", v(1)) == MODE  # still this node's
    records.set("d", "b", v(2), MODE)
    assert records.flush(5)
    assert decode(store.objects["d/" + RECORD_NAME][0]) == {"a": ("g1", MODE), "b": ("g2", MODE)}
    assert records.pending() == 0


def test_a_store_that_does_not_say_the_version(store: FakeStore, records: DirRecords) -> None:
    store.unversioned = True
    records.set("d", "a", v(1), MODE)
    assert records.flush(5)
    records.set("d", "b", v(2), MODE)
    assert records.flush(5)  # reads the record first for a version to expect
    assert store.counts["412"] == 0 and store.counts["get"] == 1
    assert set(decode(store.objects["d/" + RECORD_NAME][0])) == {"a", "b"}


def test_move_takes_the_attributes_along(store: FakeStore, records: DirRecords) -> None:
    store.raw_put("src/" + RECORD_NAME, encode({"f": ("g1", FULL), "keep": ("g2", MODE), "sub/": (None, MODE)}))
    records.move("src", "f", "dst", "g", v(30))  # the source record never read here: read at flush
    records.move("src", "sub/", "src", "sub2/", None)
    records.move("src", "plain", "dst", "plain", v(31))  # nothing set on it: nothing to take
    assert records.flush(5)
    # One GET (the source record, for all three moves), one PUT per directory (dst: a new record).
    assert store.counts == {"get": 1, "put": 2}
    assert decode(store.objects["src/" + RECORD_NAME][0]) == {"keep": ("g2", MODE), "sub2/": (None, MODE)}
    assert decode(store.objects["dst/" + RECORD_NAME][0]) == {"g": ("g30", FULL)}
    assert records.cached("dst", "g", v(30)) == FULL and records.cached("src", "f", v(1)) is None
    records.move("dst", "g", "src", "f", v(40))  # known now: moves at once, no request
    assert records.cached("src", "f", v(40)) == FULL
    assert records.flush(5) and store.counts == {"get": 1, "put": 4}


def test_move_of_a_change_not_yet_written(store: FakeStore, records: DirRecords) -> None:
    records.set("d", "a", v(1), MODE)
    records.move("d", "a", "d", "b", v(2))
    assert records.cached("d", "b", v(2)) == MODE and records.cached("d", "a", v(1)) is None  # at once
    assert records.flush(5)
    assert decode(store.objects["d/" + RECORD_NAME][0]) == {"b": ("g2", MODE)}
    assert store.counts["put"] == 1


def test_close_flushes_and_stops_the_thread(store: FakeStore) -> None:
    records = DirRecords(store, flush_delay=3600)
    records.set("d", "a", v(1), MODE)
    thread = records._thread
    assert thread is not None and thread.is_alive()
    assert records.close(5)
    assert not thread.is_alive()
    assert decode(store.objects["d/" + RECORD_NAME][0]) == {"a": ("g1", MODE)}
    records.set("d", "b", v(2), MODE)  # a change after close starts it again
    assert records.close(5)
    assert set(decode(store.objects["d/" + RECORD_NAME][0])) == {"a", "b"}


def test_nothing_to_do_starts_no_thread(store: FakeStore) -> None:
    records = DirRecords(store)
    records.apply("d", files("d", store, a=1))
    assert records._thread is None and records.flush(1) and records.close(1)


def test_listings_that_carry_file_metadata_get_only_directory_entries(store: FakeStore, records: DirRecords) -> None:
    store.raw_put("d/" + RECORD_NAME, encode({"a": ("g1", MODE), "sub/": (None, FULL)}))
    own = PosixAttrs(uid=5)
    listing = [ObjectInfo(name="d/a", is_dir=False, version=v(1), posix=own), ObjectInfo(name="d/sub", is_dir=True)]
    listing += files("d", store)
    assert by_name(records.apply("d", listing, files=False)) == {"a": own, "sub": FULL}  # as GCS lists them


def test_by_key(store: FakeStore, records: DirRecords) -> None:
    records.set_key("d/a", v(1), MODE)
    records.set_key("d/sub", None, FULL, is_dir=True)
    records.set_key("", None, MODE, is_dir=True)  # the prefix itself has no parent: ignored by fill
    stat = ObjectInfo(name="d/a", is_dir=False, version=v(1), posix=NO_ATTRS)  # a HEAD without metadata
    assert records.fill(stat).posix == MODE
    assert records.fill(ObjectInfo(name="d/sub", is_dir=True)).posix == FULL
    assert records.fill(ObjectInfo(name="d/other", is_dir=True)).posix is None  # not known: no request
    assert records.fill(ObjectInfo(name="", is_dir=True)).posix is None
    records.move_key("d/a", "e/b", v(2))
    records.move_key("d/sub", "e/sub2", None, is_dir=True)
    assert records.cached("e", "b", v(2)) == MODE and records.cached("e", "sub2/", None) == FULL
    records.set_key("e/b", v(3), None)  # a plain commit over it: its entry goes
    assert records.cached("e", "b", v(2)) is None
    records.forget_key("e/sub2", is_dir=True)
    assert records.flush(5)
    assert not store.objects  # every change undone before its flush: no record written, none there
    before = dict(store.counts)
    records.set_key("f/new", v(9), None)  # nothing known of it: no change queued, no request
    assert records.flush(5) and store.counts == before and records._thread is not None


def test_a_stat_that_carries_attributes_repairs_an_existing_record(store: FakeStore, records: DirRecords) -> None:
    store.raw_put("d/" + RECORD_NAME, encode({"other": ("g5", MODE)}))
    records.apply("d", files("d", store, a=1, other=5))
    head = ObjectInfo(name="d/a", is_dir=False, version=v(1), posix=FULL)  # updated; the record not (a crash)
    assert records.fill(head, repair=True) == head
    assert records.flush(5)
    assert decode(store.objects["d/" + RECORD_NAME][0]) == {"a": ("g1", FULL), "other": ("g5", MODE)}
    puts = store.counts["put"]
    records.fill(head, repair=True)  # now in step: nothing to write
    records.fill(ObjectInfo(name="e/x", is_dir=False, version=v(2), posix=FULL), repair=True)  # no record there
    assert records.flush(5) and store.counts["put"] == puts


# -- wired into the remotes (core: memory://; objectstore: SeaweedFS) -----------------------------
class Peer:
    """Another client of the same prefix (raw fsspec: no marinfs), and a way to make a second
    marinfs node of it."""

    def __init__(self, url: str, options: dict) -> None:
        self.url, self.options = url, options
        self.fs, self.root = fsspec_client(url, {**options, "use_listings_cache": False})

    def put(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.root}/{rel}", data)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(f"{self.root}/{rel}"))

    def node(self) -> Remote:
        return Remote(self.url, self.options)


@pytest.fixture(params=["memory", "s3"])
@tiers.needs("core")
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[Remote, Peer]]:
    """A fresh prefix on memory:// or SeaweedFS, as a marinfs Remote and as another client."""
    if request.param == "memory":
        url, options = f"memory://dirmeta-{uuid.uuid4().hex[:12]}", {}
    else:
        url, options, _ = object_store(request, "s3")
    remote = Remote(url, options)
    if request.param == "memory":
        remote.fs.mkdir(remote.root)
    try:
        yield remote, Peer(url, options)
    finally:
        remote.close()


def _file(tmp_path: Path, data: bytes = b"x") -> str:
    path = tmp_path / f"src-{uuid.uuid4().hex[:8]}"
    path.write_bytes(data)
    return str(path)


def _counts(remote: Remote) -> dict[str, int]:
    return dict(remote.stats.snapshot()["requests"])


def test_every_backend_with_records_calls_their_hooks() -> None:
    for cls in (S3Remote, GCSRemote, MemoryRemote):
        assert hooks_missing(cls) == [], "call self._recorded_*() (or super()) in these: remote/recorded.py"


def test_a_listing_costs_its_lists_and_one_get(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    n = 120 if remote.protocol == "memory" else 40
    src = _file(tmp_path)
    for i in range(n):
        remote.upload(src, f"d/f{i:03}", ABSENT, attrs=PosixAttrs(mode=0o600 + i % 64, uid=i))
    remote.make_dir("d/sub")
    remote.set_dir_attrs("d/sub", PosixAttrs(mode=0o711))
    assert remote.records.flush(10)
    writer = _counts(remote)
    assert writer.get("put", 0) <= n + 2 + 3  # the objects, the marker, the record once (or a few windows)

    node = peer.node()  # another mount: nothing cached
    try:
        prefetched = []
        prefetch = node.records.prefetch
        node.records.prefetch = lambda d, ver: (prefetched.append((d, ver)), prefetch(d, ver))  # type: ignore[method-assign]
        listing = node.list("d")
        # The page that held the record started its GET (before the later pages came).
        assert [d for d, _ in prefetched] == ["d"], prefetched
        counts = _counts(node)
        assert counts.get("head", 0) == 0 and counts.get("get") == 1, counts
        assert counts.get("list", 0) >= 1 and set(counts) <= {"list", "get"}, counts
        shown = {i.name: i.posix for i in listing}
        assert RECORD_NAME not in {i.name.rsplit("/", 1)[-1] for i in listing}
        assert len(shown) == n + 1
        assert all(shown[f"d/f{i:03}"] == PosixAttrs(mode=0o600 + i % 64, uid=i) for i in range(n))
        assert shown["d/sub"] == PosixAttrs(mode=0o711)
        node.stats.reset()
        node.list("d")  # the record did not change: the LIST alone
        assert set(_counts(node)) == {"list"}
    finally:
        node.close()
    remote.stats.reset()
    remote.list("d")  # the writer knows the version it wrote: no GET either
    assert set(_counts(remote)) == {"list"}


def test_an_object_another_client_rewrote_shows_defaults(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    src = _file(tmp_path)
    for name in ("a", "b"):
        remote.upload(src, f"d/{name}", ABSENT, attrs=MODE)
    assert remote.records.flush(10)
    peer.put("d/b", b"other bytes")  # another tool: no metadata, a new version
    node = peer.node()
    try:
        shown = {i.name: i.posix for i in node.list("d")}
        assert shown == {"d/a": MODE, "d/b": NO_ATTRS}
        assert node.stat("d/b").posix == NO_ATTRS  # not the record's: other bytes
        assert node.stat("d/a").posix == MODE
    finally:
        node.close()


def test_two_nodes_set_attrs_in_one_directory(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    other = peer.node()
    try:
        src = _file(tmp_path)
        va = remote.upload(src, "d/a", ABSENT)
        vb = other.upload(src, "d/b", ABSENT)
        remote.list("d")
        other.list("d")  # both know the directory has no record yet
        remote.set_attrs("d/a", MODE, va)
        other.set_attrs("d/b", FULL, vb)
        assert remote.records.flush(10) and other.records.flush(10)  # the second: a 412, merged
        node = peer.node()
        try:
            assert {i.name: i.posix for i in node.list("d")} == {"d/a": MODE, "d/b": FULL}
        finally:
            node.close()
    finally:
        other.close()


def test_the_record_name_is_reserved(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    src = _file(tmp_path)
    remote.upload(src, "d/a", ABSENT, attrs=MODE)
    assert remote.records.flush(10)
    assert peer.exists("d/" + RECORD_NAME)
    for attempt in (lambda: remote.upload(src, "d/" + RECORD_NAME, None),
                    lambda: remote.upload(src, RECORD_NAME, ABSENT),
                    lambda: remote.rename("d/a", "d/" + RECORD_NAME),
                    lambda: remote.make_dir("d/" + RECORD_NAME),
                    lambda: remote.symlink("d/" + RECORD_NAME, "a")):
        with pytest.raises(FsError) as err:
            attempt()
        assert err.value.errno == errno.EPERM
    with pytest.raises(FileNotFoundError):
        remote.stat("d/" + RECORD_NAME)
    assert [i.name for i in remote.list("d")] == ["d/a"]
    assert remote.stat("d/a").posix == MODE


def test_delete_rename_and_directories(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    src = _file(tmp_path)
    remote.upload(src, "d/a", ABSENT, attrs=MODE)
    remote.upload(src, "d/b", ABSENT, attrs=FULL)
    remote.upload(src, "d/gone", ABSENT, attrs=MODE)
    remote.make_dir("d/sub")
    remote.set_dir_attrs("d/sub", PosixAttrs(mode=0o700))
    remote.upload(src, "d/sub/x", ABSENT, attrs=PosixAttrs(uid=3))
    assert remote.records.flush(10)
    remote.upload(src, "d/plain", ABSENT)
    remote.delete("d/gone")
    remote.rename("d/plain", "d/b2")  # over nothing: no entry to move
    remote.rename("d/a", "d/a2")
    remote.rename("d/b", "e/b")
    remote.rename_tree("d/sub", "e/sub2")
    assert remote.records.flush(10)

    node = peer.node()
    try:
        assert {i.name: i.posix for i in node.list("d")} == {"d/a2": MODE, "d/b2": NO_ATTRS}
        assert {i.name: i.posix for i in node.list("e")} == {"e/b": FULL, "e/sub2": PosixAttrs(mode=0o700)}
        assert {i.name: i.posix for i in node.list("e/sub2")} == {"e/sub2/x": PosixAttrs(uid=3)}
        assert node.stat("e/sub2").posix == PosixAttrs(mode=0o700)  # e's record is cached by its listing
        assert decode(node.read_small("d/" + RECORD_NAME)[0]).keys() == {"a2"}  # the rest removed
    finally:
        node.close()
    assert not peer.exists("d/sub/" + RECORD_NAME)

    # A directory emptied and removed takes its record along (else its prefix would stay).
    remote.delete("e/sub2/x")
    remote.remove_dir("e/sub2")
    assert remote.records.flush(10)
    assert not peer.exists("e/sub2/" + RECORD_NAME) and not peer.exists("e/sub2")
    assert {i.name for i in remote.list("e")} == {"e/b"}

    # A file renamed over one with attributes takes their place with its own (none here).
    remote.upload(src, "e/plain", ABSENT)
    remote.rename("e/plain", "e/b")
    assert remote.records.flush(10)
    node = peer.node()
    try:
        assert {i.name: i.posix for i in node.list("e")} == {"e/b": NO_ATTRS}
    finally:
        node.close()


def test_close_writes_what_is_queued(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    version = remote.upload(_file(tmp_path), "f", ABSENT)
    remote.records.flush_delay = 3600  # only close() would write it
    remote.set_attrs("f", FULL, version)
    assert not peer.exists(RECORD_NAME)
    remote.close()
    assert peer.exists(RECORD_NAME)
    node = peer.node()
    try:
        assert {i.name: i.posix for i in node.list("")} == {"f": FULL}
    finally:
        node.close()


def test_a_stat_repairs_the_record_a_crash_left_behind(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    src = _file(tmp_path)
    remote.upload(src, "d/a", ABSENT, attrs=MODE)
    version = remote.upload(src, "d/b", ABSENT, attrs=MODE)
    assert remote.records.flush(10)
    crashed = peer.node()
    try:
        crashed.records.flush_delay = 3600
        version = crashed.set_attrs("d/b", FULL, version)  # the object updated...
        assert crashed.records.drop("d")  # ...and the node gone before its record's flush
    finally:
        crashed.close()
    node = peer.node()
    try:
        listed = {i.name: i.posix for i in node.list("d")}
        # The record still has its entry for b; where the update kept the version (memory, as
        # GCS) it applies, else b shows the defaults: never FULL before a stat has seen it.
        assert listed["d/a"] == MODE and listed["d/b"] in (MODE, NO_ATTRS)
        assert node.stat("d/b").posix == FULL  # the HEAD: the object's own
        assert node.records.flush(10)  # the entry queued by that stat
    finally:
        node.close()
    fresh = peer.node()
    try:
        assert {i.name: i.posix for i in fresh.list("d")} == {"d/a": MODE, "d/b": FULL}
    finally:
        fresh.close()


def test_the_record_cache_is_bounded_by_entries(store: FakeStore) -> None:
    records = DirRecords(store, max_entries=10)
    for d in ("a", "b"):
        store.raw_put(f"{d}/{RECORD_NAME}", encode({f"f{i}": (f"g{i}", MODE) for i in range(6)}))
    big = f"c/{RECORD_NAME}"
    store.raw_put(big, encode({f"f{i}": (f"g{i}", MODE) for i in range(20)}))  # more than the cache
    for d in ("a", "b", "c", "a"):
        assert by_name(records.apply(d, files(d, store, f1=1)))["f1"] == MODE
    assert store.counts["get"] == 4  # a evicted by b (7 + 7 > 10), c never kept, a read again
    assert records.apply("c", files("c", store, f1=1)) and store.counts["get"] == 5


def test_a_directory_renamed_before_its_first_flush(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    remote.records.flush_delay = 3600
    remote.upload(_file(tmp_path), "d/sub/x", ABSENT, attrs=MODE)  # queued, not written
    remote.set_dir_attrs("d/sub", FULL)
    remote.rename_tree("d/sub", "d/moved")
    assert remote.records.flush(10)
    assert not peer.exists("d/sub")  # nothing written under the old name
    node = peer.node()
    try:
        assert {i.name: i.posix for i in node.list("d")} == {"d/moved": FULL}
        assert {i.name: i.posix for i in node.list("d/moved")} == {"d/moved/x": MODE}
    finally:
        node.close()


def test_where_nothing_was_set_the_records_cost_nothing(backend: tuple[Remote, Peer], tmp_path: Path) -> None:
    remote, peer = backend
    src = _file(tmp_path)
    for i in range(5):
        remote.upload(src, f"d/f{i}", ABSENT)
    remote.make_dir("d/sub")
    remote.list("d")
    remote.list("d/sub")  # (as rmdir does, to see it is empty)
    remote.stats.reset()
    remote.list("d")
    remote.stat("d/f0")
    remote.rename("d/f0", "d/g0")
    remote.delete("d/f1")
    remote.remove_dir("d/sub")
    assert remote.records.flush(10)
    # What these cost without records: no GET, no record written, no HEAD for the rename.
    if remote.protocol == "s3":  # (its copy is pinned to the stat's ETag, no HEAD; the marker is a DELETE)
        assert _counts(remote) == {"list": 1, "head": 1, "copy": 1, "delete": 3}
    else:
        assert _counts(remote) == {"list": 1, "head": 1, "copy": 1, "delete": 2, "rmdir": 1}
    assert not peer.exists("d/" + RECORD_NAME)


@pytest.mark.parametrize("store_name", ["gcs"])
def test_on_gcs_the_record_keeps_directories_only(request: pytest.FixtureRequest, store_name: str,
                                                  tmp_path: Path) -> None:
    """GCS listings carry each object's metadata: files need no entry, directories (prefixes,
    with no metadata of their own) still do."""
    url, options, _ = object_store(request, store_name)
    remote, peer = Remote(url, options), Peer(url, options)
    try:
        assert remote.lists_posix
        src = _file(tmp_path)
        for i in range(3):
            remote.upload(src, f"d/f{i}", ABSENT, attrs=PosixAttrs(mode=0o600 + i))
        remote.make_dir("d/sub")
        remote.set_dir_attrs("d/sub", PosixAttrs(mode=0o711))
        assert remote.records.flush(10)
        assert decode(peer.fs.cat_file(f"{peer.root}/d/{RECORD_NAME}")) == {"sub/": (None, PosixAttrs(mode=0o711))}
        node = peer.node()
        try:
            shown = {i.name: i.posix for i in node.list("d")}
            assert shown == {"d/f0": PosixAttrs(mode=0o600), "d/f1": PosixAttrs(mode=0o601),
                             "d/f2": PosixAttrs(mode=0o602), "d/sub": PosixAttrs(mode=0o711)}
            assert _counts(node).get("get") == 1 and "head" not in _counts(node)
        finally:
            node.close()
        with pytest.raises(FsError):
            remote.symlink("d/" + RECORD_NAME, "x")
        remote.rename_tree("d/sub", "d/sub2")
        remote.list("d/sub2")
        remote.remove_dir("d/sub2")
        assert remote.records.flush(10)
        assert not peer.exists("d/sub2") and not peer.exists("d/sub")
        assert decode(peer.fs.cat_file(f"{peer.root}/d/{RECORD_NAME}")) == {}
    finally:
        remote.close()
