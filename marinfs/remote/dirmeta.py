"""The directory record: one object per directory that maps child names to the POSIX attributes
set on them, for stores whose listings carry no user metadata (S3, memory://).

Why: an S3 LIST has no ``x-amz-meta-*``, and a HEAD per entry would make ``ls -l`` of 2,000
files 2,000 requests. The record ``.marinfs-attrs.json`` lives in the directory's own prefix,
so the LIST that lists the directory also gives the record's version: a cached record still
current costs nothing, a changed one one GET (docs/architecture.md, "Directory record").

An entry applies to a listed child only while its ``version`` equals the child's listed version
(``str(ObjectVersion)``): attributes never move to bytes another tool wrote. Subdirectories are
``name/`` entries without a version.

Writes are queued and coalesced: after ``flush_delay`` one background thread sends one
conditional PUT per dirty directory (``If-Match`` on the record's known version, ABSENT for a
new one); a failed precondition re-reads the record, lays our pending changes on top per name
and tries again. Until written, this node's own changes show in :meth:`DirRecords.apply` and
:meth:`DirRecords.cached` (it reads its own writes).

This module imports no backend: the store is anything with ``read_small``/``put_small``.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

from cachetools import LRUCache

from marinfs.errors import PreconditionFailed
from marinfs.objects import ABSENT, NO_ATTRS, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.threadnames import start_thread

log = logging.getLogger(__name__)

RECORD_NAME = ".marinfs-attrs.json"
FORMAT = 1  # the record's "v"; one of another format reads as empty (and the next change replaces it)

Entry = tuple[str | None, PosixAttrs]  # (the child's version it belongs to; None for "name/"), attrs
Op = Entry | None  # a queued change of one name: the new entry, or None (remove it)

PUT_ATTEMPTS = 5  # conditional PUTs per directory and flush before the changes wait for the next one
MAX_BACKOFF = 60.0  # seconds between attempts at a record that keeps failing


class RecordStore(Protocol):
    """What the record needs from a store (``Remote.read_small``/``put_small``)."""

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        """The whole object and its version; FileNotFoundError if there is none."""

    def put_small(self, key: str, data: bytes, expect: ObjectVersion) -> ObjectVersion | None:
        """Write ``key`` only if it is ``expect`` (ABSENT: must not exist), else raise
        PreconditionFailed; answers the new version if the store says."""


def record_key(dir_key: str) -> str:
    """The key of the record of directory ``dir_key`` ("" is the prefix itself)."""
    return f"{dir_key}/{RECORD_NAME}" if dir_key else RECORD_NAME


def split_key(key: str) -> tuple[str, str]:
    """(parent directory key, name) of ``key``."""
    parent, _, name = key.rpartition("/")
    return parent, name


def is_record(key: str) -> bool:
    """Whether ``key`` names a directory record (a reserved name)."""
    return split_key(key)[1] == RECORD_NAME


# -- the format ----------------------------------------------------------------------------------
def encode(entries: Mapping[str, Entry]) -> bytes:
    """The record's bytes: only fields that are set, keys sorted, so equal records are equal
    bytes (and an unchanged record need not be written)."""
    out: dict[str, dict[str, object]] = {}
    for name, (version, attrs) in entries.items():
        item: dict[str, object] = {}
        if version is not None and not name.endswith("/"):
            item["version"] = version
        for field in ("mode", "uid", "gid", "mtime_ns"):
            value = getattr(attrs, field)
            if value is not None:
                item[field] = value
        if attrs.xattrs:
            item["xattrs"] = {k: base64.b64encode(v).decode("ascii") for k, v in attrs.xattrs}
        out[name] = item
    return json.dumps({"v": FORMAT, "entries": out}, sort_keys=True, separators=(",", ":")).encode("ascii")


def _int(value: object, low: int | None = None, high: int | None = None) -> int | None:
    """``value`` as a set field (None: absent); ValueError if it is not an int within bounds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"not an integer: {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"out of range: {value}")
    return value


def _valid_name(name: object) -> bool:
    if not isinstance(name, str):
        return False
    bare = name[:-1] if name.endswith("/") else name
    return bool(bare) and "/" not in bare and bare not in (".", "..")


def _entry(name: str, item: object) -> Entry:
    if not isinstance(item, dict):
        raise ValueError("not an object")
    version = item.get("version")
    if name.endswith("/"):
        version = None  # a directory has no version of its own to match
    elif not isinstance(version, str) or not version:
        raise ValueError("a file entry without a version can never apply")
    xattrs = item.get("xattrs") or {}
    if not isinstance(xattrs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in xattrs.items()):
        raise ValueError("xattrs must map names to base64 text")
    decoded = tuple(sorted((k, base64.b64decode(v, validate=True)) for k, v in xattrs.items()))
    attrs = PosixAttrs(mode=_int(item.get("mode"), 0, 0o7777), uid=_int(item.get("uid"), 0),
                       gid=_int(item.get("gid"), 0), mtime_ns=_int(item.get("mtime_ns")), xattrs=decoded)
    return version, attrs


def decode(data: bytes, where: str = "") -> dict[str, Entry]:
    """The entries of a record. Never raises: a record that is not JSON or of an unknown format
    reads as empty, a bad entry is left out, with one warning per record (another tool or a
    newer marinfs wrote it; the listing still works, with defaults)."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        log.warning("directory record %s is not JSON (%s); its attributes are ignored", where or "?", exc)
        return {}
    if not isinstance(doc, dict) or doc.get("v") != FORMAT or not isinstance(doc.get("entries"), dict):
        version = doc.get("v") if isinstance(doc, dict) else None
        log.warning("directory record %s has unknown format %r; its attributes are ignored", where or "?", version)
        return {}
    entries: dict[str, Entry] = {}
    bad: list[str] = []
    for name, item in doc["entries"].items():
        if not _valid_name(name):
            bad.append(repr(name))
            continue
        try:
            entries[name] = _entry(name, item)
        except (ValueError, TypeError, binascii.Error):
            bad.append(repr(name))
    if bad:
        log.warning("directory record %s: %d bad entries ignored (%s)", where or "?", len(bad), ", ".join(bad[:5]))
    return entries


# -- the cache and the flusher -------------------------------------------------------------------
@dataclass
class _Record:
    """A record as last read or written. ``version`` None: not known (the store did not say)."""

    version: ObjectVersion | None
    entries: dict[str, Entry]
    # When it was seen (a tick): a GET or LIST when sent, our own PUT when done. An answer sent
    # before another one was seen may be older: it never replaces it in the cache.
    seen: int = 0


def _valid(entry: Entry | None, version: ObjectVersion | str | None, is_dir: bool) -> PosixAttrs | None:
    """The entry's attributes if it belongs to this child (a file: this very version)."""
    if entry is None:
        return None
    if is_dir:
        return entry[1]
    return entry[1] if version is not None and entry[0] == str(version) else None


class DirRecords:
    """The directory records of one mount: applied to listings, queued and flushed on changes.

    Thread-safe; no global state. ``clock`` and ``flush_delay`` are injectable so tests need no
    sleeps (:meth:`flush` writes at once). The flusher thread starts with the first change and
    stops at :meth:`close` (a later change starts it again).
    """

    def __init__(self, store: RecordStore, flush_delay: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = 200_000) -> None:
        self.store = store
        self.flush_delay = flush_delay
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Records as last read or written, bounded by their entries (a few hundred bytes each):
        # an evicted one costs its next listing a GET, nothing else.
        self._records: LRUCache[str, _Record] = LRUCache(max_entries, getsizeof=lambda r: len(r.entries) + 1)
        self._pending: dict[str, dict[str, Op]] = {}  # dir -> name -> change, not yet sent
        self._since: dict[str, float] = {}  # dir -> when its oldest pending change was queued
        self._inflight: dict[str, dict[str, Op]] = {}  # dir -> the changes a PUT is sending now
        self._failures: dict[str, int] = {}  # dir -> rounds in a row its record was not written
        self._moves: list[tuple[str, str, str, str, str | None]] = []  # (src dir, name, dst dir, name, version)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._force = 0  # flush() requests made
        self._forced = 0  # flush() requests a round has answered
        self._forced_ok = True  # whether that round wrote everything
        self._reading: dict[str, Future[_Record]] = {}  # dir -> the record GET prefetch() started
        self._ticks = itertools.count(1)  # orders GETs sent and PUTs done (taken under the lock)

    # -- reads ---------------------------------------------------------------------------------
    def tick(self) -> int:
        """A mark to take before sending a LIST, for :meth:`apply` (``sent``): whether our own
        PUT of the record came after it."""
        with self._lock:
            return next(self._ticks)

    def apply(self, dir_key: str, children: list[ObjectInfo], files: bool = True,
              sent: int | None = None) -> list[ObjectInfo]:
        """The listing of ``dir_key`` without its record, each child with ``posix`` set
        (``files`` False: directories only, where listings carry the files' own, as on GCS).

        Costs no request when the listing has no record or its listed version is the cached
        one, else one GET. A child without a valid entry gets ``PosixAttrs()`` (nothing set:
        the mount's defaults), the same with or without a record, so a listing always answers
        ``posix``; None only when the record exists but could not be read (the cause logged):
        a stat may still find the attributes. ``sent``: :meth:`tick` taken before the LIST (a
        listing without the record then does not undo our PUT that made it after)."""
        rkey = record_key(dir_key)
        listed = next((c for c in children if c.name == rkey and not c.is_dir), None)
        rest = [c for c in children if c is not listed]
        record: _Record | None
        if listed is None:
            with self._lock:  # (a LIST sent before a record was seen, ours say, leaves it)
                record = self._remember_locked(dir_key, _Record(ABSENT, {}, next(self._ticks) if sent is None else sent))
        else:
            record = self._current(dir_key, listed.version)
        with self._lock:
            # The record as cached now and our changes not in it, at one moment: a PUT landing
            # meanwhile moves its changes from the one to the other. (The record found above
            # may be older than the cache by then, and an overlay taken before it newer.)
            if record is not None:
                record = self._records.get(dir_key) or record
            overlay = self._overlay_locked(dir_key)
        out = []
        for child in rest:
            if not files and not child.is_dir:
                out.append(child)
                continue
            name = split_key(child.name)[1] + ("/" if child.is_dir else "")
            if name in overlay:
                attrs = _valid(overlay[name], child.version, child.is_dir) or NO_ATTRS
            elif record is None:
                attrs = None  # the record could not be read: not known
            else:
                attrs = _valid(record.entries.get(name), child.version, child.is_dir) or NO_ATTRS
            out.append(child if attrs is None else child.with_posix(attrs))
        return out

    def prefetch(self, dir_key: str, listed: ObjectVersion | None) -> None:
        """A listing page showed the record at ``listed``: if that is not the cached one, start
        its GET now, on a thread of its own, so it travels (and is decoded) while the later
        pages of the listing come; :meth:`apply` then takes its result. The same one GET as
        without, only sooner."""
        with self._lock:
            cached = self._records.get(dir_key)
            if (cached is not None and listed is not None and cached.version == listed) or dir_key in self._reading:
                return
            future: Future[_Record] = Future()
            self._reading[dir_key] = future
        start_thread(self._read_into, "record-get", dir_key, future)

    def _read_into(self, dir_key: str, future: Future[_Record]) -> None:
        try:
            future.set_result(self._read(dir_key))
        except BaseException as exc:  # noqa: BLE001 - handed to apply(), which logs it
            future.set_exception(exc)
        finally:
            with self._lock:
                if self._reading.get(dir_key) is future:
                    del self._reading[dir_key]

    def _current(self, dir_key: str, listed: ObjectVersion | None) -> _Record | None:
        """The record at the listed version: the cached one if it is that, else one GET (the
        one :meth:`prefetch` started, if it did)."""
        with self._lock:
            cached = self._records.get(dir_key)
            future = self._reading.get(dir_key)
        if cached is not None and listed is not None and cached.version == listed:
            return cached
        try:
            return future.result() if future is not None else self._read(dir_key)
        except Exception as exc:  # noqa: BLE001 - the listing must not fail because of its record
            log.warning("cannot read directory record of %r: %s", dir_key, exc)
            return None

    def _read(self, dir_key: str) -> _Record:
        """One GET of the record (absent: an empty record at ABSENT), cached."""
        rkey = record_key(dir_key)
        with self._lock:
            sent = next(self._ticks)
        try:
            data, version = self.store.read_small(rkey)
            record = _Record(version, decode(data, rkey), sent)
        except FileNotFoundError:
            record = _Record(ABSENT, {}, sent)
        with self._lock:  # (one seen since it was sent, our PUT say, stands: it may be newer)
            return self._remember_locked(dir_key, record)

    def _remember_locked(self, dir_key: str, record: _Record) -> _Record:
        """Cache ``record`` unless the cached one was seen after it; answers the one kept."""
        cached = self._records.get(dir_key)
        if cached is not None and cached.seen > record.seen:
            return cached
        if len(record.entries) < self._records.maxsize:
            self._records[dir_key] = record
        else:  # bigger than the whole cache: read each time
            self._records.pop(dir_key, None)
        return record

    def cached(self, dir_key: str, name: str, version: ObjectVersion | str | None) -> PosixAttrs | None:
        """The attributes of child ``name`` (``name/`` for a directory) at ``version`` if this
        node knows them without a request (its own queued changes, a cached record), else None:
        for stats whose answer carries no metadata."""
        is_dir = name.endswith("/")
        with self._lock:
            overlay = self._overlay_locked(dir_key)
            if name in overlay:
                return _valid(overlay[name], version, is_dir)
            record = self._records.get(dir_key)
            return None if record is None else _valid(record.entries.get(name), version, is_dir)

    def _overlay_locked(self, dir_key: str) -> dict[str, Op]:
        """This node's changes not yet in the cached record: being sent, then queued."""
        return {**self._inflight.get(dir_key, {}), **self._pending.get(dir_key, {})}

    # -- changes -------------------------------------------------------------------------------
    def set(self, dir_key: str, name: str, version: ObjectVersion | str | None, attrs: PosixAttrs) -> None:
        """Queue child ``name`` (``name/``: a directory) at ``version`` having ``attrs``;
        empty attrs remove its entry."""
        entry: Op
        if attrs.empty:
            entry = None
        elif name.endswith("/"):
            entry = (None, attrs)
        elif version is None:
            raise ValueError(f"a file's entry needs its version: {dir_key!r} {name!r}")
        else:
            entry = (str(version), attrs)
        self._queue(dir_key, {name: entry})

    def forget(self, dir_key: str, name: str) -> None:
        """Queue the removal of child ``name``'s entry (it was deleted)."""
        self._queue(dir_key, {name: None})

    def move(self, src_dir: str, src_name: str, dst_dir: str, dst_name: str,
             version: ObjectVersion | str | None) -> None:
        """Queue a rename: the source's attributes go to ``dst_name`` at ``version`` (the
        copy's), the source's entry goes. A source entry this node knows moves at once (so
        ``mv a b; ls -l b`` shows them); one it never read is read at the next flush (one GET
        of the source record at most)."""
        move = (src_dir, src_name, dst_dir, dst_name, None if version is None else str(version))
        with self._wake:
            known = self._known_locked(src_dir, src_name)
            if known is not None:
                self._move_locked(move, known[0])
            else:
                self._moves.append(move)
                self._pending.setdefault(src_dir, {})
                self._pending.setdefault(dst_dir, {})
            self._mark_locked(src_dir)
            self._mark_locked(dst_dir)
            self._start_locked()

    def _known_locked(self, dir_key: str, name: str) -> tuple[Entry | None] | None:
        """(the entry of ``name`` as this node knows it, None if it has none), or None if this
        node does not know (no change of it queued, the record never read)."""
        overlay = self._overlay_locked(dir_key)
        if name in overlay:
            return (overlay[name],)
        record = self._records.get(dir_key)
        return None if record is None else (record.entries.get(name),)

    def _move_locked(self, move: tuple[str, str, str, str, str | None], entry: Entry | None) -> None:
        src_dir, src_name, dst_dir, dst_name, version = move
        attrs = NO_ATTRS if entry is None else entry[1]
        dst: Op = None
        if not attrs.empty and (dst_name.endswith("/") or version is not None):
            dst = (None if dst_name.endswith("/") else version, attrs)
        self._pending.setdefault(src_dir, {})[src_name] = None
        self._pending.setdefault(dst_dir, {})[dst_name] = dst

    def _queue(self, dir_key: str, ops: Mapping[str, Op]) -> None:
        with self._wake:
            self._pending.setdefault(dir_key, {}).update(ops)
            self._mark_locked(dir_key)
            self._start_locked()

    def _mark_locked(self, dir_key: str) -> None:
        self._since.setdefault(dir_key, self.clock())
        self._wake.notify_all()

    def _start_locked(self) -> None:
        self._stop = False  # a change after close() (or during it) is written too
        if self._thread is None or not self._thread.is_alive():
            self._thread = start_thread(self._run, "marinfs-dirmeta")

    # -- by key (what a Remote calls) ----------------------------------------------------------
    def fill(self, info: ObjectInfo, repair: bool = False) -> ObjectInfo:
        """A stat's answer with the record's attributes where the object carried none (a
        directory always; a file whose HEAD had no metadata), from what this node knows: no
        request. ``repair``: a file whose HEAD carried attributes that its directory's existing
        record lacks (a crash between the object's update and the record's flush) gets its
        entry queued again."""
        if not info.name:
            return info
        dir_key, name = split_key(info.name)
        if info.is_dir:
            attrs = self.cached(dir_key, name + "/", None)
            return info if attrs is None else replace(info, posix=attrs)
        if info.posix is None or info.posix.empty:
            attrs = self.cached(dir_key, name, info.version)
            return info if attrs is None else replace(info, posix=attrs)
        if repair and info.version is not None and not info.link:
            with self._lock:
                record = self._records.get(dir_key)
                known = self._known_locked(dir_key, name)
            stale = known is not None and known[0] != (str(info.version), info.posix)
            if stale and record is not None and record.version != ABSENT:
                self.set(dir_key, name, info.version, info.posix)
        return info

    def set_key(self, key: str, version: ObjectVersion | str | None, attrs: PosixAttrs | None,
                is_dir: bool = False) -> None:
        """:meth:`set` by key. ``attrs`` None or empty on a file removes an entry this node
        knows of (a plain commit: a request only where there is one to remove). The prefix
        itself ("") has no parent to keep its entry: nothing is kept."""
        if not key:
            return
        dir_key, name = split_key(key)
        if is_dir:
            self.set(dir_key, name + "/", None, attrs or NO_ATTRS)
        elif attrs is not None and not attrs.empty:
            self.set(dir_key, name, version, attrs)
        else:
            with self._lock:
                known = self._known_locked(dir_key, name)
            if known is not None and known[0] is not None:
                self.forget(dir_key, name)

    def forget_key(self, key: str, is_dir: bool = False) -> None:
        """:meth:`forget` by key (a file deleted, a directory removed)."""
        if not key:
            return
        dir_key, name = split_key(key)
        self.forget(dir_key, name + "/" if is_dir else name)
        if is_dir:
            with self._lock:
                self._records.pop(key, None)

    def move_key(self, src: str, dst: str, version: ObjectVersion | str | None, is_dir: bool = False) -> None:
        """:meth:`move` by key (a directory's own entry when ``is_dir``)."""
        (src_dir, src_name), (dst_dir, dst_name) = split_key(src), split_key(dst)
        slash = "/" if is_dir else ""
        self.move(src_dir, src_name + slash, dst_dir, dst_name + slash, version)

    def may_have(self, key: str) -> bool:
        """Whether file ``key`` may have an entry: this node knows one, or does not know its
        directory's record (never read, or evicted)."""
        dir_key, name = split_key(key)
        with self._lock:
            known = self._known_locked(dir_key, name)
        return known is None or known[0] is not None

    def drop(self, dir_key: str, timeout: float = 10.0) -> bool:
        """Directory ``dir_key`` is gone: its queued changes are dropped (a flush would make its
        record, and so its prefix, again) once a write in flight is done. Whether a record
        may be left to delete (False only when this node knows there is none)."""
        with self._wake:
            self._pending.pop(dir_key, None)
            self._since.pop(dir_key, None)
            self._wake.wait_for(lambda: dir_key not in self._inflight, timeout)
            self._pending.pop(dir_key, None)  # a failed write puts its changes back
            self._since.pop(dir_key, None)
            record = self._records.pop(dir_key, None)
        return record is None or record.version != ABSENT

    # -- flushing ------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Write every change queued so far now; True if all of them were written."""
        with self._wake:
            if not self._pending and not self._inflight and not self._moves:
                return True
            self._start_locked()
            self._force += 1
            ticket = self._force
            self._wake.notify_all()
            if not self._wake.wait_for(lambda: self._forced >= ticket, timeout):
                return False
            return self._forced_ok

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush, then stop the flusher thread; True if everything was written."""
        ok = self.flush(timeout)
        with self._wake:
            self._stop = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return ok

    def pending(self) -> int:
        """Directories with changes not yet written (for status and tests)."""
        with self._lock:
            return len(set(self._pending) | set(self._inflight))

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    if self._force > self._forced:
                        forced, due = self._force, list(self._pending)
                        break
                    if self._stop:
                        return
                    now = self.clock()
                    due = [d for d, t in self._since.items() if t + self.flush_delay <= now]
                    if due:
                        forced = 0
                        break
                    waits = [t + self.flush_delay - now for t in self._since.values()]
                    self._wake.wait(min(waits) if waits else None)
            try:
                ok = self._round(due)
            except Exception:  # noqa: BLE001 - a flusher that died would leave flush() waiting
                log.exception("directory records: flush round failed")
                ok = False
            if forced:
                with self._wake:
                    self._forced, self._forced_ok = forced, ok
                    self._wake.notify_all()

    def _round(self, dirs: Iterable[str]) -> bool:
        """Write the records of ``dirs``; True if every one was written."""
        dirs = list(dirs)
        with self._lock:
            moves, self._moves = self._moves, []
        self._resolve(moves)
        ok = True
        for dir_key in dirs:
            with self._lock:
                ops = self._pending.pop(dir_key, None)
                self._since.pop(dir_key, None)
                if ops is None:
                    continue
                self._inflight[dir_key] = ops
            try:
                written = self._write(dir_key, ops)
            except Exception as exc:  # noqa: BLE001 - kept and retried; the objects hold their metadata
                log.warning("directory record of %r not written (%s); kept for a later flush", dir_key, exc)
                written = False
            with self._lock:
                del self._inflight[dir_key]
                self._wake.notify_all()  # drop() may wait for it
                if written:
                    self._failures.pop(dir_key, None)
                else:  # changes queued since then are newer: they win
                    self._pending[dir_key] = {**ops, **self._pending.get(dir_key, {})}
                    failures = self._failures[dir_key] = self._failures.get(dir_key, 0) + 1
                    # Backing off (up to a minute) so that a store that refuses is not hammered.
                    backoff = min(MAX_BACKOFF, self.flush_delay * 2 ** failures) - self.flush_delay
                    self._since[dir_key] = self.clock() + max(0.0, backoff)
                    ok = False
        return ok

    def _resolve(self, moves: list[tuple[str, str, str, str, str | None]]) -> None:
        """Turn the moves whose source entry was not known into a set at the destination and a
        removal at the source, reading the source record now."""
        for move in moves:
            src_dir, src_name = move[0], move[1]
            with self._lock:
                known = self._known_locked(src_dir, src_name)
            if known is None:
                try:
                    known = (self._read(src_dir).entries.get(src_name),)
                except Exception as exc:  # noqa: BLE001 - the object keeps its own metadata
                    log.warning("cannot read directory record of %r for a rename: %s", src_dir, exc)
                    known = (None,)
            with self._lock:
                self._move_locked(move, known[0])

    def _write(self, dir_key: str, ops: Mapping[str, Op]) -> bool:
        """One conditional PUT of the record with ``ops`` on top; on a failed precondition,
        re-read, merge per name and try again (PUT_ATTEMPTS in all). An unknown record is
        expected ABSENT (a new one costs one PUT), except for removals alone, which read it
        first so that a directory without a record never gets an empty one."""
        rkey = record_key(dir_key)
        with self._lock:
            record = self._records.get(dir_key)
        if (record is None and all(op is None for op in ops.values())) or (record and record.version is None):
            record = self._read(dir_key)
        for _ in range(PUT_ATTEMPTS):
            base = {} if record is None else record.entries
            merged = dict(base)
            for name, op in ops.items():
                if op is None:
                    merged.pop(name, None)
                else:
                    merged[name] = op
            if record is not None and merged == base:
                return True  # nothing changes: no PUT
            try:
                version = self.store.put_small(rkey, encode(merged), ABSENT if record is None else record.version)
            except PreconditionFailed:
                record = self._read(dir_key)  # another node wrote it: their entries, ours on top
                continue
            with self._lock:
                self._remember_locked(dir_key, _Record(version, merged, next(self._ticks)))
            return True
        log.warning("directory record of %r changed under %d attempts to write it", dir_key, PUT_ATTEMPTS)
        return False
