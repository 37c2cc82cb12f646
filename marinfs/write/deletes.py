"""Write-back: deletes this node shows at once and sends to the bucket in the upload queue's
order, after every upload closed before them.

Orbax's ``max_to_keep`` removes the previous step right after the next one is renamed into
place. A delete may not reach the bucket before the uploads closed before it (the old step
would be gone while the new one is not whole), so in the close-durable way an ``unlink`` waits
for the whole queue: seconds per checkpoint. Here the unlink (or rmdir) returns once its intent
is journaled; the name is gone on this node at once (``is_gone``: lookups answer ENOENT,
listings leave it out) and the queue runs the delete as a fence: after every upload before it
that is not held for a rename, and before anything queued after it starts.

A failed delete keeps its journal and its name stays gone here; it is tried again (by the
retry pass, and at the next start) only while the object is still the version that was
deleted, so a retry never removes what someone wrote since. ``_gone`` is guarded by ``_lock``,
a leaf.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from marinfs.errors import FsError
from marinfs.objects import ObjectVersion
from marinfs.remote import Remote
from marinfs.write.recovery import Recovered, recover
from marinfs.write.staging import JOURNAL_SUFFIX, write_journal
from marinfs.write.writeback import WriteBack

log = logging.getLogger(__name__)
PREFIX, SUFFIX = "delete-", ".json"


@dataclass(eq=False)
class _Delete:
    key: str
    is_dir: bool
    version: ObjectVersion | None  # what this node saw when it deleted it (None: a new file of its own)
    journal: Path
    error: str = ""  # the last failure; empty while it has not failed
    since: float = 0.0
    # The uploads closed before it that were kept after failing when its turn came (their
    # staging files): it is not sent until none of them is left (retried into the bucket, or
    # the file removed). None: its turn has not come.
    waits_for: frozenset[str] | None = None
    requeued: bool = False  # queued again by the retry pass, not run yet


class DeferredDeletes:
    """The deletes of one write-back mount not yet in the bucket."""

    def __init__(self, staging_dir: Path, remote: Remote, queue: WriteBack,
                 landed: Callable[[str, bool], None] = lambda key, is_dir: None,
                 failed_uploads: Callable[[], frozenset[str]] = frozenset) -> None:
        self.staging_dir = staging_dir
        self.remote = remote
        self.queue = queue
        # The staging files of the uploads kept after failing, now: a delete is held back while
        # one closed before it is among them (the old step stays while the new one is not whole).
        self.failed_uploads = failed_uploads
        # Called once a delete is over (before the name shows again): what was cached of the
        # name while it waited (a listing of the bucket, which still had it) goes.
        self.landed = landed
        self._lock = threading.Lock()
        self._gone: dict[str, _Delete] = {}  # GUARDED_BY(_lock)
        self._failed: dict[int, _Delete] = {}  # GUARDED_BY(_lock): deletes that failed, not over yet, by id

    def delete(self, key: str, is_dir: bool, version: ObjectVersion | None) -> None:
        """``key`` is removed here: journaled, shown gone, its delete queued behind the uploads."""
        self.staging_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Named by time: the next start applies what is left in the order it was asked for.
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{time.time_ns():020d}-", suffix=SUFFIX, dir=self.staging_dir)
        os.close(fd)
        try:
            write_journal(path, {"remote": self.remote.url, "key": key, "dir": is_dir,
                                 "version": str(version) if version is not None else None})
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
        entry = _Delete(key, is_dir, version, Path(path), since=time.time())
        with self._lock:
            self._gone[key] = entry
        self.queue.enqueue_op(key, lambda: self._run(entry))

    def _run(self, entry: _Delete) -> None:
        """The queued delete (a queue worker); a failure is kept, and raised for the log."""
        try:
            failing = self.failed_uploads()
            entry.waits_for = failing if entry.waits_for is None else entry.waits_for & failing
            if entry.waits_for:
                raise OSError(errno.EIO, f"not sent while {len(entry.waits_for)} upload(s) closed before it "
                                         "are kept after failing")
            if entry.error and entry.version is not None and not entry.is_dir:
                try:
                    if self.remote.stat(entry.key).version != entry.version:
                        log.info("not deleting %s: it changed since it was deleted here", entry.key)
                        self._done(entry)
                        return
                except FileNotFoundError:
                    self._done(entry)
                    return
            _remove(self.remote, entry.key, entry.is_dir)
        except Exception as exc:
            entry.error = str(exc) or type(exc).__name__
            with self._lock:
                self._failed[id(entry)] = entry  # (status, the retry pass, resend_failed)
            raise
        self._done(entry)

    def _done(self, entry: _Delete) -> None:
        entry.journal.unlink(missing_ok=True)
        self.landed(entry.key, entry.is_dir)
        with self._lock:
            self._failed.pop(id(entry), None)
            if self._gone.get(entry.key) is entry:
                del self._gone[entry.key]

    def is_gone(self, key: str) -> bool:
        """Removed here, its delete not yet in the bucket (it, or a directory above it)."""
        with self._lock:
            if not self._gone:
                return False
            while key:
                if key in self._gone:
                    return True
                key = key.rpartition("/")[0]
            return False

    def near(self, key: str) -> bool:
        """A delete not yet in the bucket of ``key``, above it or below it: what touches ``key``
        in the bucket right away (a copy, a marker) waits for it."""
        with self._lock:
            return any(_near(k, key) for k in self._gone)

    def failed(self) -> list[_Delete]:
        with self._lock:
            return list(self._failed.values())

    def resend_failed(self, key: str) -> None:
        """The failed deletes of ``key``, above or below it, sent again now, in the order they
        were asked for: a change of ``key`` that reaches the bucket at once (a marker, a link, a
        commit, a rename's copy) lands after them, as promised, and no later retry removes what
        it made. FsError(EIO) if one still fails: the change is not made."""
        with self._lock:
            if not self._failed:
                return
            failed = sorted((d for d in self._failed.values() if _near(d.key, key)), key=lambda d: d.journal.name)
        for entry in failed:
            try:
                self._run(entry)
            except Exception as exc:
                raise FsError(errno.EIO, f"the delete of {entry.key} asked before failed ({entry.error}); "
                              "it is kept and retried (marinfs status)") from exc

    def adopt_left(self) -> None:
        """At the start, once ``recover_in_order`` ran: the deletes an earlier daemon queued that
        it could not send (the store refused, or an upload before one failed) are this daemon's,
        as failed ones: gone here, shown by status and sync, and retried by the retry pass."""
        with self._lock:
            known = {d.journal for d in self._gone.values()} | {d.journal for d in self._failed.values()}
        for _, path, raw in _journals(self.staging_dir, self.remote):
            if path in known:
                continue
            try:
                version = ObjectVersion.parse(raw["version"]) if raw.get("version") is not None else None
            except ValueError:
                version = None
            entry = _Delete(raw["key"], bool(raw.get("dir")), version, path,
                            error="left by an earlier daemon, not sent at this start", since=time.time())
            with self._lock:
                self._gone.setdefault(entry.key, entry)
                self._failed[id(entry)] = entry

    def retry(self) -> None:
        """Queue again the deletes that failed (the retry pass), but those queued again already
        and still waiting their turn."""
        with self._lock:
            due = [d for d in self._failed.values() if not d.requeued]
            for entry in due:
                entry.requeued = True
        for entry in due:
            self.queue.enqueue_op(entry.key, lambda e=entry: self._rerun(e))

    def _rerun(self, entry: _Delete) -> None:
        with self._lock:
            entry.requeued = False
        self._run(entry)


def _near(deleted: str, key: str) -> bool:
    """``deleted`` is ``key``, above it or below it."""
    return not key or deleted == key or deleted.startswith(key + "/") or key.startswith(deleted + "/")


def _remove(remote: Remote, key: str, is_dir: bool) -> None:
    try:
        if is_dir:
            remote.remove_dir(key)
        else:
            remote.delete(key)
    except FileNotFoundError:
        pass  # (a new file never uploaded, or gone already: nothing to delete)
    except OSError as exc:
        if not (is_dir and exc.errno == errno.ENOTEMPTY):
            raise
        # Filled by someone since its rmdir here (empty then): it stays, as at the next start.
        log.info("not removing %s: something was put in it since it was removed here", key)


def recover_in_order(staging_dir: Path, remote: Remote, skip: frozenset[str], at_start: bool) -> list[Recovered]:
    """At the start: the staged files an earlier daemon left (``recover``) and the deletes it
    queued, in the order it was asked for them: before each delete, the files made before it;
    a name deleted and made again is deleted, then uploaded. One whose object changed since it
    was deleted here (someone wrote it) is left."""
    deletes = _journals(staging_dir, remote)
    if not deletes:
        return recover(staging_dir, remote, skip, at_start=at_start)
    made = _made_times(staging_dir)
    results: list[Recovered] = []
    done = set(skip)
    for when, path, entry in deletes:
        later = {data for data, t in made.items() if t > when}
        out = recover(staging_dir, remote, frozenset(done | later), at_start=at_start)
        results += out
        done |= {r.staged for r in out}
        failing = [r.key for r in results if r.committed_as is None]
        if failing:  # (the new step not whole in the bucket: the old one stays, as while it ran)
            log.warning("not deleting %s yet: %d upload(s) asked before it failed (%s); the next start tries again",
                        entry["key"], len(failing), ", ".join(failing[:3]))
            continue
        _finish(path, entry, remote)
    return results + recover(staging_dir, remote, frozenset(done), at_start=at_start)


def _journals(staging_dir: Path, remote: Remote) -> list[tuple[int, Path, dict]]:
    """The delete journals of ``remote``, oldest first, with the time each was asked for."""
    out = []
    if not staging_dir.is_dir():
        return out
    for path in sorted(staging_dir.glob(PREFIX + "*" + SUFFIX)):
        try:
            entry = json.loads(path.read_text())
            when = int(path.name[len(PREFIX):].split("-", 1)[0])
        except (OSError, ValueError):
            if path.exists() and path.stat().st_size == 0:
                path.unlink(missing_ok=True)  # made, never written
            else:
                log.error("unreadable delete journal %s; left in place", path)
            continue
        if isinstance(entry, dict) and entry.get("remote") == remote.url and isinstance(entry.get("key"), str):
            out.append((when, path, entry))
    return out


def _made_times(staging_dir: Path) -> dict[str, int]:
    """Each staged file's data path and when it was made (0: a journal from before that was kept)."""
    out = {}
    for journal in staging_dir.glob("*" + JOURNAL_SUFFIX):
        try:
            entry = json.loads(journal.read_text())
            out[str(staging_dir / entry["data"])] = int(entry.get("made_ns") or 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _finish(path: Path, entry: dict, remote: Remote) -> None:
    key, is_dir = entry["key"], bool(entry.get("dir"))
    try:
        if not is_dir and entry.get("version") is not None:
            if remote.stat(key).version != ObjectVersion.parse(entry["version"]):
                path.unlink(missing_ok=True)  # written since by someone: theirs stays
                return
        elif is_dir and remote.list(key):
            path.unlink(missing_ok=True)  # made again, or filled by someone: stays
            return
        _remove(remote, key, is_dir)
    except FileNotFoundError:
        pass
    except (OSError, FsError) as exc:
        log.error("a delete of %s an earlier daemon queued cannot be sent now (%s); the next start tries again",
                  key, exc)
        return
    path.unlink(missing_ok=True)
    log.info("deleted %s, as an earlier daemon was asked to", key)
