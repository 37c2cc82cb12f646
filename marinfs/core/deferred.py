"""Attributes held back a moment: set by path on a file this node has just committed, they wait
for the file's rename, whose copy carries them, or else at most ``DEFER_SECONDS``.

rsync writes each file under a temporary name, closes it (the commit: one PUT), sets its times
and mode by path, then renames it. On an object store each of those attribute changes is a
metadata update (S3: a CopyObject onto itself), and the rename a copy and a delete: five
requests a file. Held back here, the two changes merge, and the rename's copy carries them
(``Remote.rename(..., attrs=)``: S3 ``MetadataDirective=REPLACE``, a GCS rewrite given the
destination's metadata): PUT + COPY + DELETE.

What is held back, and until when:

- only attribute changes of a file this node committed under ``RECENT_COMMIT_SECONDS`` ago, of
  that very version, on a store whose copies can carry them (``folds_attrs``: not local disks,
  where nothing costs a request and a rename(2) keeps them);
- they are shown here at once (``shown``: stats and listings, as the object will have them) and
  journaled in the staging directory (``write/attrjournal.py``): a daemon killed meanwhile
  leaves the next start to send them;
- they are sent as one metadata-only update (conditional on the version they were set on) once
  ``DEFER_SECONDS`` have passed since the first of them, or before the next other change of the
  file here: a writer's open, a truncate. A rename of the file carries them in its copy (or, the
  source no longer that version, drops them: they were set on bytes nobody has any more); an
  unlink, or a rename onto it, drops them with the object; a commit of new bytes here carries
  them (a file open for writing has them as its staged attributes); a directory rename sends
  those under it first; the unmount sends what is left.

Each key's changes are serialized by ``held``: the attribute changes, renames, unlinks and the
sends of one key never overlap (a send racing an unlink could bring the object back: a copy onto
itself of an object deleted meanwhile). Lock order: a key's ``held``, then a staged file's lock,
then the table lock; a commit (which holds its staged file's lock) only drops an entry here,
never waits for a key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from marinfs.objects import ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote import Remote
from marinfs.threadnames import start_thread
from marinfs.write import attrjournal
from marinfs.write.commit import describe

log = logging.getLogger(__name__)

# rsync's utimens, chmod and rename of a file follow its close within a millisecond or two
# (nothing stands between them once the attributes cost no request); 0.3 s covers them on a
# loaded machine with room to spare, and bounds how late another node sees attributes that no
# rename carried (as the directory record's 0.2 s flush window bounds a listing's).
DEFER_SECONDS = 0.3
# A file counts as "just committed here" this long after its commit: what follows a close
# (rsync, ``touch`` after writing) comes at once; an S3 copy within it needs no HEAD (our PUT's
# answer is remembered as long).
RECENT_COMMIT_SECONDS = 5.0
MAX_PENDING = 1024  # more held back at once: the next change is sent at once, as without the window
SENDERS = 8  # updates sent at once when their window ends (each its own request)
RECENT_KEPT = 4096  # commits remembered (key -> version), oldest forgotten first
RETRY_MAX_SECONDS = 60.0  # a send that failed is tried again after 1, 2, 4... s, at most this


@dataclass(eq=False)
class Pending:
    """Attributes for ``key``, set here on its ``version`` and not sent yet."""

    key: str
    version: ObjectVersion
    attrs: PosixAttrs
    info: ObjectInfo | None  # the object as it was then (None: found in a journal at start)
    due: float  # monotonic: sent from then on
    journal: str
    failures: int = 0
    sending: bool = False


class Deferred:
    """The attributes held back on this mount, and the thread that sends them when due."""

    def __init__(self, remote: Remote, staging_dir: Path, window: float = DEFER_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remote = remote
        self.staging_dir = staging_dir
        self.window = window
        self.clock = clock
        self.enabled = remote.folds_attrs and remote.stores_posix
        # Sends one entry's update (Attributes.send_deferred), the caller holding its key;
        # raises to be tried again later.
        self.send: Callable[[Pending], None] | None = None
        self._cond = threading.Condition()
        self._entries: dict[str, Pending] = {}  # GUARDED_BY(_cond)
        self._holders: dict[str, tuple[int, int]] = {}  # GUARDED_BY(_cond): key -> (thread, depth)
        self._recent: OrderedDict[str, tuple[ObjectVersion, float]] = OrderedDict()  # GUARDED_BY(_cond)
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # -- what this node shows --------------------------------------------------------------------
    def shown(self, info: ObjectInfo) -> ObjectInfo:
        """``info`` with the attributes held back for it, while it is the version they were set on."""
        if not self._entries or info.is_dir:
            return info
        entry = self._entries.get(info.name)
        if entry is None or entry.version != info.version:
            return info
        return info.with_posix(entry.attrs)

    def pending(self) -> int:
        return len(self._entries)

    # -- this node's commits -----------------------------------------------------------------------
    def committed(self, key: str, version: ObjectVersion | None) -> None:
        """A commit here replaced ``key`` (None: its bytes went to a conflict name): what was held
        back for the old version went with it (a file open for writing has them as its staged
        attributes) or is moot. Never waits for the key: the committer holds a staged file's lock."""
        if not self.enabled:
            return
        with self._cond:
            entry = self._entries.pop(key, None)
            if version is not None:
                self._recent[key] = (version, self.clock())
                self._recent.move_to_end(key)
                while len(self._recent) > RECENT_KEPT:
                    self._recent.popitem(last=False)
            else:
                self._recent.pop(key, None)
        if entry is not None:
            attrjournal.drop(entry.journal)

    # -- one key at a time -------------------------------------------------------------------------
    @contextmanager
    def held(self, *keys: str) -> Iterator[None]:
        """Hold ``keys`` (in key order, so two holders never wait for each other): no other
        change of theirs here and no send of their held-back attributes meanwhile. Reentrant
        for the holding thread."""
        if not self.enabled:
            yield
            return
        me = threading.get_ident()
        wanted = sorted(set(keys))
        with self._cond:
            while any(k in self._holders and self._holders[k][0] != me for k in wanted):
                self._cond.wait()
            for k in wanted:
                _, depth = self._holders.get(k, (me, 0))
                self._holders[k] = (me, depth + 1)
        try:
            yield
        finally:
            with self._cond:
                for k in wanted:
                    _, depth = self._holders[k]
                    if depth > 1:
                        self._holders[k] = (me, depth - 1)
                    else:
                        del self._holders[k]
                self._cond.notify_all()

    # -- held back, merged, taken (the caller holds the key) ------------------------------------------
    def get(self, key: str) -> Pending | None:
        return self._entries.get(key)

    def wants(self, key: str, info: ObjectInfo) -> bool:
        """Whether a change of ``key``, as ``info`` shows it, is held back: it has changes held
        back already (of that version), or this node committed that version just now."""
        if not self.enabled or info.is_dir or info.link or info.version is None:
            return False
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                return entry.version == info.version
            if len(self._entries) >= MAX_PENDING or self._closed:
                return False
            recent = self._recent.get(key)
        return (recent is not None and recent[0] == info.version
                and self.clock() - recent[1] <= RECENT_COMMIT_SECONDS)

    def defer(self, key: str, info: ObjectInfo, attrs: PosixAttrs) -> None:
        """Hold back ``attrs`` (the complete new value) for ``key`` at ``info.version``: journaled
        first (a disk error fails the change, nothing held), shown from now on, due a window
        after the first change held back."""
        assert info.version is not None
        entry = self._entries.get(key)
        if entry is not None:
            attrjournal.write(self.staging_dir, self.remote.url, key, entry.version, attrs, path=entry.journal)
            with self._cond:
                entry.attrs = attrs
            return
        journal = attrjournal.write(self.staging_dir, self.remote.url, key, info.version, attrs)
        with self._cond:
            self._entries[key] = Pending(key, info.version, attrs, info, self.clock() + self.window, journal)
            self._start_locked()
            self._cond.notify_all()

    def take(self, key: str) -> Pending | None:
        """The entry of ``key``, no longer held back: the caller carries it (a rename's copy) or
        drops it; its journal goes."""
        with self._cond:
            entry = self._entries.pop(key, None)
        if entry is not None:
            attrjournal.drop(entry.journal)
        return entry

    def discard(self, key: str) -> None:
        """``key``'s object is gone or replaced here (unlink, rename onto it): nothing to send."""
        if self.enabled and key in self._entries:
            self.take(key)

    def adopt(self, kept: attrjournal.Kept) -> None:
        """A journal an earlier daemon left that could not be sent at start: sent from here."""
        with self._cond:
            self._entries[kept.key] = Pending(kept.key, kept.version, kept.attrs, None,
                                              self.clock() + 1.0, kept.path, failures=1)
            self._start_locked()
            self._cond.notify_all()

    # -- sending ----------------------------------------------------------------------------------------
    def send_now(self, key: str) -> None:
        """Send what is held back for ``key`` before its next change here (a writer's open)."""
        if not self.enabled or key not in self._entries:
            return
        with self.held(key):
            entry = self._entries.get(key)
            if entry is not None:
                self._send(entry, raise_errors=True)

    def send_under(self, tree: str) -> None:
        """Send what is held back inside directory ``tree`` (before the directory is renamed:
        its copies keep what the objects have)."""
        if not self.enabled or not self._entries:
            return
        prefix = tree + "/" if tree else ""
        for key in [k for k in list(self._entries) if k.startswith(prefix)]:
            self.send_now(key)

    def _send(self, entry: Pending, raise_errors: bool = False) -> bool:
        """One entry's update, its key held; the entry and its journal go once it is sent (or
        found moot). A failure keeps it, tried again later."""
        assert self.send is not None
        try:
            self.send(entry)
        except Exception as exc:
            with self._cond:
                entry.failures += 1
                entry.due = self.clock() + min(RETRY_MAX_SECONDS, 2.0 ** (entry.failures - 1))
                self._cond.notify_all()
            log.warning("attributes of %s not sent (%s); tried again in %.0f s", entry.key, describe(exc),
                        entry.due - self.clock())
            if raise_errors:
                raise
            return False
        with self._cond:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
        attrjournal.drop(entry.journal)
        return True

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._pool = ThreadPoolExecutor(SENDERS, thread_name_prefix="marinfs-attrs")
            self._thread = start_thread(self._run, "marinfs-attrs")

    def _run(self) -> None:
        """Send entries as they fall due, several at once; an entry whose key is held waits for
        it (the holder may carry or drop it)."""
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = self.clock()
                    waiting = [e for e in self._entries.values() if not e.sending and e.key not in self._holders]
                    due = [e for e in waiting if e.due <= now]
                    if due:
                        break
                    next_due = min((e.due for e in waiting), default=None)
                    self._cond.wait(None if next_due is None else max(0.001, next_due - now))
                for entry in due:
                    entry.sending = True
            assert self._pool is not None
            for entry in due:
                self._pool.submit(self._send_due, entry)

    def _send_due(self, entry: Pending) -> None:
        try:
            with self.held(entry.key):
                if self._entries.get(entry.key) is entry and entry.due <= self.clock():
                    self._send(entry)
        except Exception:  # noqa: BLE001 - a sender thread must not die; _send logged it
            log.exception("sending the attributes of %s", entry.key)
        finally:
            with self._cond:
                entry.sending = False
                self._cond.notify_all()

    # -- the end ----------------------------------------------------------------------------------------
    def close(self, timeout: float) -> bool:
        """Unmount: send what is held back (within ``timeout``), then stop. Answers whether
        nothing is left (what is left keeps its journal: the next start sends it)."""
        if not self.enabled:
            return True
        self.stop()
        deadline = time.monotonic() + timeout
        for key in list(self._entries):
            if time.monotonic() >= deadline:
                break
            try:
                self.send_now(key)
            except Exception:  # noqa: BLE001 - logged by _send; the journal stays
                pass
        left = len(self._entries)
        if left:
            log.warning("%d file(s)' attributes not sent at unmount; their journals in %s are sent by the next "
                        "start", left, self.staging_dir)
        return left == 0

    def stop(self) -> None:
        """Stop the sending threads (what is held back stays journaled)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
