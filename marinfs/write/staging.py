"""Staged writes: a local file that holds an object's new content until it is committed.

Object stores cannot write part of an object, so every write lands in a staging file in the
cache directory and the whole file is uploaded on flush/fsync. Random writes, appends,
truncation and ``O_RDWR`` therefore work as on a local disk; only the commit is remote.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from marinfs.objects import ABSENT, NO_ATTRS, ObjectVersion, PosixAttrs
from marinfs.remote.parts import PartStream

log = logging.getLogger(__name__)
JOURNAL_SUFFIX = ".journal.json"
STAGED_PREFIX = "staged-"


IN_PLACE = 4096  # a journal that fits one page is rewritten by one pwrite(2)


def write_journal(path: str, entry: dict) -> None:
    """Atomically: a torn journal would be worse than none. A new one by temp + rename; one
    that exists and fits a page is rewritten in place by one ``pwrite`` of at least its old
    length (JSON allows the trailing blanks), which a killed daemon cannot leave half done
    (one page, one syscall). ``tar -x`` rewrites every file's journal twice (its chmod, its
    utimens): a rename over the old one cost ~1.4 ms each on a busy ext4, the pwrite ~4 µs.

    Not fsync'd, like the staged bytes it describes: journals guard against a daemon that
    crashes or is killed (the page cache survives that), not against the machine losing power,
    and an fsync per new file would halve the speed of ``tar -x``.
    """
    data = json.dumps(entry).encode()
    if len(data) <= IN_PLACE and _rewrite_in_place(path, data):
        return
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            if os.write(fd, data) != len(data):  # a full disk may take part of it
                raise OSError(errno.ENOSPC, "the journal was written short", tmp)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # never a torn or empty journal left for good
        raise


def _rewrite_in_place(path: str, data: bytes) -> bool:
    """``data`` over the journal at ``path`` in one pwrite, padded to its old length; False if
    there is none yet or it is longer than a page (the caller writes a new one)."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size > IN_PLACE:
            return False
        padded = data + b" " * (size - len(data))  # (no padding when it grew)
        if os.pwrite(fd, padded, 0) != len(padded):  # (growing, as a spare's empty one: a full disk)
            raise OSError(errno.ENOSPC if len(padded) > size else errno.EIO, "the journal was written short", path)
        return True
    finally:
        os.close(fd)


def note_upload_in_journal(journal_path: str, record: dict, opened: bool) -> None:
    """Add (``opened``) or remove an upload session's record in a journal no StagedFile holds
    (a replay of a kept commit): while it is there, the next daemon aborts it before anything."""
    entry = json.loads(Path(journal_path).read_text())
    uploads = dict(entry.get("uploads") or {})
    if opened:
        uploads[record["id"]] = record
    elif uploads.pop(record["id"], None) is None:
        return
    entry["uploads"] = uploads
    write_journal(journal_path, entry)


def mark_final(journal_path: str, error: str, code: int) -> None:
    """Note in a kept commit's journal that its failure is final (errors.FINAL_ERRNOS): the next
    daemon then leaves it alone (or, access denied, tries it once), not retrying it at every
    start. Best effort: a journal that cannot be rewritten stays as it was (and is retried)."""
    try:
        entry = json.loads(Path(journal_path).read_text())
        entry["final"] = {"error": error, "errno": code, "since": time.time()}
        write_journal(journal_path, entry)
    except (OSError, ValueError) as exc:
        log.warning("cannot mark %s as final (%s); it will be tried again at the next start", journal_path, exc)


def attrs_to_json(attrs: PosixAttrs) -> dict:
    """The journal's form of ``attrs``: only the fields set, xattr values in base64."""
    out: dict = {k: getattr(attrs, k) for k in ("mode", "uid", "gid", "mtime_ns") if getattr(attrs, k) is not None}
    if attrs.xattrs:
        out["xattrs"] = {name: base64.b64encode(value).decode() for name, value in attrs.xattrs}
    return out


def attrs_from_json(entry: dict | None) -> PosixAttrs | None:
    """The inverse of :func:`attrs_to_json`; None for a journal that has none (older ones)."""
    if not entry:
        return None
    xattrs = tuple(sorted((n, base64.b64decode(v)) for n, v in (entry.get("xattrs") or {}).items()))
    return PosixAttrs(mode=entry.get("mode"), uid=entry.get("uid"), gid=entry.get("gid"),
                      mtime_ns=entry.get("mtime_ns"), xattrs=xattrs)


class StagedFileGone(Exception):
    """The staged file was dropped (committed and released) while a reader waited for it."""


class StagedFile:
    """The new content of one remote key, shared by every handle open on it.

    ``seed`` copies the current remote content into the staging file; it runs lazily, the first
    time old bytes are needed, and never for a new or truncated file. ``dirty`` means the staging
    file holds bytes the remote does not have yet. ``base_version`` is the version the writer
    started from (None: the key did not exist); a commit only replaces that version.

    A new or truncated file may also be streamed: ``stream`` (a function of the staging file's
    descriptor) makes a :class:`PartStream` that sends parts while the file is written, so the
    commit at close only sends the tail. The staging file stays complete either way.

    ``attrs`` are the POSIX attributes (chmod, chown, utimens, user xattrs) the file will carry:
    set while it holds uncommitted bytes, they are shown at once and go with the commit (and
    are journaled, so a recovered commit carries them too). None: nothing set.
    """

    def __init__(self, staging_dir: Path, key: str, seed: Callable[[str, str], None] | None,
                 base_size: int = 0, dirty: bool = False, remote_url: str | None = None,
                 base_version: ObjectVersion | None = None,
                 stream: Callable[..., PartStream] | None = None,
                 attrs: PosixAttrs | None = None, spare: tuple[int, str] | None = None) -> None:
        if spare is not None:  # made ahead (write/spares.py), with an empty journal beside it
            fd, self.path = spare
        else:
            try:  # (the directory is there but for the first file: no mkdir per file of a tar -x)
                fd, self.path = tempfile.mkstemp(prefix=STAGED_PREFIX, dir=staging_dir)  # mode 0600
            except FileNotFoundError:
                staging_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd, self.path = tempfile.mkstemp(prefix=STAGED_PREFIX, dir=staging_dir)
        self.fd = fd
        self.key = key
        # The journal says what these bytes are, so a daemon that died before committing them
        # can commit them on its next start (marinfs.write.recovery). It exists exactly while the
        # staged file holds bytes the remote lacks.
        self.journal_path = self.path + JOURNAL_SUFFIX
        self.remote_url = remote_url
        self.base_version = base_version
        self.attrs = attrs
        self._journaled = False
        self.made_ns = time.time_ns()  # (a recovery interleaves uploads and deletes by it: write/deletes.py)
        # Upload sessions the store keeps apart (S3 multipart uploads) opened for these bytes
        # and not known to be over, by id: journaled, so a daemon killed meanwhile leaves the
        # next one what to abort. ``leftover_uploads``: those still open when the journal went.
        self.uploads: dict[str, dict] = {}
        self.leftover_uploads: list[dict] = []
        self.lock = threading.RLock()
        # Reads take only this (held for one preadv), so they never wait for an upload holding
        # ``lock``; discard closes the descriptor under both.
        self._fd_lock = threading.Lock()
        self._closed = False
        self._seed = seed
        self.seeded = seed is None
        # The staging file's size once seeded: set under ``lock``, read without it, so a stat
        # never waits for an upload that holds the lock (write-back's background uploads).
        self._size = 0
        self.base_size = base_size  # the remote size, valid until seeded
        self.dirty = False
        self.unlinked = False
        self.changes = 0  # writes, truncates and renames so far
        self.failed_changes = -1  # ``changes`` when a commit last failed
        if dirty:  # a new or truncated file: it is committed even if nothing is written
            try:
                self._mark_dirty()
            except BaseException:  # its journal found no room: nothing of this file stays
                os.close(fd)
                Path(self.journal_path).unlink(missing_ok=True)
                Path(self.path).unlink(missing_ok=True)
                raise
        self.mtime_ns = time.time_ns()
        self.refs = 0
        self.failed_write = 0  # errno of a write that did not reach the staging file
        self.kept = False
        self.failures = 0  # commits of these bytes that failed, and the last one's error
        self.last_error: BaseException | None = None
        self.stream: PartStream | None = None
        # The attributes the stream's upload was begun with (a create mode): a commit with the
        # same needs no metadata update after it.
        self.streamed_attrs: PosixAttrs | None = None
        if stream is not None and seed is None:
            if attrs is not None and not attrs.empty:
                self.stream = stream(self.fd, key, self.expected, attrs)
                self.streamed_attrs = attrs
            else:
                self.stream = stream(self.fd, key, self.expected)
            if isinstance(self.stream, PartStream):
                self.stream.on_session = self.note_upload

    @property
    def failed_unchanged(self) -> bool:
        """A commit of exactly these bytes failed already (close said so): committing again at
        release would only hold the writer's release for another round of timeouts."""
        return self.failures > 0 and self.failed_changes == self.changes

    @property
    def expected(self) -> ObjectVersion:
        """What a commit requires the remote to hold: the base version, or no object at all."""
        return self.base_version if self.base_version is not None else ABSENT

    def _ensure_seeded(self) -> None:
        if self.seeded:
            return
        assert self._seed is not None
        self._seed(self.key, self.path)  # the current key: the file may have been renamed
        self._size = os.fstat(self.fd).st_size
        self.seeded = True

    def known_size(self) -> int:
        """The current size without fetching anything (stat must not download the object), nor
        waiting for the lock (a commit holds it while it uploads)."""
        return self._size if self.seeded else self.base_size

    def read(self, size: int, offset: int) -> bytes:
        view = memoryview(bytearray(size))
        return view[:self.read_into(view, offset)].tobytes()

    def read_into(self, dest: memoryview, offset: int) -> int:
        """Fill ``dest`` from the staging file at ``offset`` (read straight into it); answers how
        many bytes it holds there (fewer at its end). Raises StagedFileGone if it was dropped
        meanwhile (its bytes are the committed object's now)."""
        if not self.seeded:
            with self.lock:
                self._ensure_seeded()
        with self._fd_lock:
            if self._closed:
                raise StagedFileGone(self.key)
            return os.preadv(self.fd, [dest], offset)

    def write(self, data: bytes | memoryview, offset: int | None) -> int:
        """Write at ``offset``; ``None`` appends at the current end (O_APPEND). ``data`` is not
        kept (it may be a view of the FUSE request buffer)."""
        with self.lock:
            self._ensure_seeded()
            if offset is None:
                offset = os.fstat(self.fd).st_size
            try:
                written = os.pwrite(self.fd, data, offset)
                self._size = max(self._size, offset + written)
                self._mark_dirty()  # the journal too needs the disk
            except OSError as exc:
                self._poison(exc)
                raise
            self._touched()
            if self.stream is not None:  # the bytes too: the stream sums parts as they are written
                self.stream.on_write(offset, written, data if written == len(data) else None)
            return written

    def truncate(self, length: int) -> None:
        with self.lock:
            if length == 0:
                self.seeded = True  # old bytes are not needed
            else:
                self._ensure_seeded()
            os.ftruncate(self.fd, length)
            self._size = length
            self._mark_dirty()
            self._touched()
            if self.stream is not None:
                self.stream.on_truncate(length)

    def _touched(self) -> None:
        """New bytes: the mtime is now, as on a disk, also after a utimens set another."""
        self.mtime_ns = time.time_ns()
        if self.attrs is not None and self.attrs.mtime_ns is not None:
            self.set_attrs(replace(self.attrs, mtime_ns=None))

    def sync_local(self) -> None:
        """The bytes and their journal on the local disk (fsync), so the next start commits them
        even after the machine went down (write-back's fsync)."""
        with self.lock:
            os.fsync(self.fd)
            if self._journaled:
                fd = os.open(self.journal_path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def retain(self) -> None:
        """One more handle shares these bytes (under the mount's table lock, as ``let_go``)."""
        self.refs += 1

    def let_go(self) -> int:
        """A handle closed: answers how many still share these bytes."""
        self.refs -= 1
        return self.refs

    def commit_failed(self, exc: BaseException) -> None:
        """A commit of the bytes as they are now failed with ``exc``."""
        self.failures += 1
        self.failed_changes = self.changes
        self.last_error = exc

    def rebase(self, version: ObjectVersion | None, attrs: PosixAttrs | None = None) -> None:
        """The remote object is now ``version`` (our commit, a metadata update of ours, a rename
        here), with ``attrs`` if given: the next commit replaces exactly that one."""
        with self.lock:
            changed = version != self.base_version
            if attrs is not None:
                self.attrs = attrs
            self.base_version = version
            if changed and self._journaled:  # a replay after a crash must expect it too
                self._write_journal()

    def set_attrs(self, attrs: PosixAttrs | None) -> None:
        """Attributes for the commit to carry; the journal says so too (a crash keeps them)."""
        with self.lock:
            if attrs == self.attrs:
                return  # (tar's fchown and fchmod to what is already there: no journal rewrite)
            self.attrs = attrs
            if self._journaled:
                self._write_journal()

    def _mark_dirty(self) -> None:
        self.dirty = True
        self.changes += 1
        if self._journaled or self.remote_url is None or self.unlinked:
            return
        self._write_journal()
        self._journaled = True

    def _write_journal(self) -> None:
        entry = {"remote": self.remote_url, "key": self.key,
                 "base_version": None if self.base_version is None else str(self.base_version),
                 "data": os.path.basename(self.path), "made_ns": self.made_ns}
        if self.attrs is not None and not self.attrs.empty:
            entry["attrs"] = attrs_to_json(self.attrs)
        if self.uploads:
            entry["uploads"] = dict(self.uploads)
        write_journal(self.journal_path, entry)

    def note_upload(self, record: dict, opened: bool) -> None:
        """An upload session of these bytes opened (journaled before its first part leaves)
        or is over (completed, or aborted)."""
        with self.lock:
            if opened:
                self.uploads[record["id"]] = record
            elif self.uploads.pop(record["id"], None) is None:
                return
            if self._journaled:
                self._write_journal()

    def take_leftover_uploads(self) -> list[dict]:
        """Sessions still open when the journal went (their abort failed, or runs): the
        caller aborts them, since no journal names them any more."""
        with self.lock:
            out, self.leftover_uploads = self.leftover_uploads, []
            return out

    def rekey(self, key: str) -> None:
        """The file was renamed: later commits (and a recovery) go to the new name."""
        with self.lock:
            self.key = key
            self._end_stream()  # its upload was addressed to the old name
            if self._journaled:
                self._journaled = False
                self._mark_dirty()

    def keep_old_bytes(self) -> None:
        """The object is about to go (unlinked, or replaced by a rename): fetch the bytes not
        fetched yet, so open descriptors keep them, as on a local disk."""
        with self.lock:
            self._ensure_seeded()

    def mark_unlinked(self) -> None:
        """Its name is gone (unlinked, or replaced by a rename): the bytes stay usable through
        open descriptors but are never committed, so no journal may commit them after a crash."""
        with self.lock:
            self.unlinked = True
            self._end_stream()  # its upload would recreate the name
            self._drop_journal()

    def _drop_journal(self) -> None:
        if self._journaled:
            Path(self.journal_path).unlink(missing_ok=True)
            self._journaled = False
        if self.uploads:
            self.leftover_uploads += self.uploads.values()
            self.uploads = {}

    def _poison(self, exc: OSError) -> None:
        """A write was lost (staging disk full...): the file must never be committed half-done."""
        self.failed_write = exc.errno or 5
        log.error("staging %s failed (%s); it will not be committed", self.key, exc.strerror)

    def _end_stream(self) -> None:
        if self.stream is not None:
            self.stream.abort()
            self.stream = None

    def commit(self, upload: Callable[..., ObjectVersion | None],
               key: str | None = None, expect: ObjectVersion | None = None,
               set_attrs: Callable[[str, PosixAttrs, ObjectVersion | None], ObjectVersion | None] | None = None,
               ) -> ObjectVersion | None:
        """Upload the staged bytes if the remote lacks them; raises the upload's error, and
        PreconditionFailed when the remote object is not ``expect`` (default: the version the
        writer started from). ``key`` commits elsewhere (a conflict copy; marinfs.write.commit decides
        where and what it expects). Answers the new version if known.

        ``attrs`` go with the upload (``upload(..., attrs=)``, only when set, so a plain file's
        upload is what it always was). A streamed upload began before they were known: it is
        followed by ``set_attrs`` (a metadata-only update of the version it made)."""
        with self.lock:
            if not self.dirty or self.unlinked:
                return None
            if self.failed_write:
                raise OSError(self.failed_write, f"a write to {self.key} failed; not committed")
            self._ensure_seeded()
            elsewhere = key is not None and key != self.key
            if expect is None:
                expect = ABSENT if elsewhere else self.expected
            stream, self.stream = self.stream, None  # one stream per staged file: later commits upload whole
            done, version = False, None
            if stream is not None:
                if not elsewhere:
                    done, version = stream.finish(os.fstat(self.fd).st_size)
                else:
                    stream.abort()
            attrs = self.attrs if self.attrs is not None and not self.attrs.empty else None
            if not done:
                if attrs is None:
                    version = upload(self.path, key or self.key, expect)
                else:
                    version = upload(self.path, key or self.key, expect, attrs=attrs)
            elif (attrs or NO_ATTRS) != (self.streamed_attrs or NO_ATTRS) and set_attrs is not None:
                version = set_attrs(self.key, attrs or NO_ATTRS, version) or version
            self.dirty = False
            self._drop_journal()
            return version

    def discard(self) -> None:
        """Drop the staging file, unless it holds uncommitted bytes: those are kept on disk."""
        with self.lock:
            self._end_stream()
            with self._fd_lock:
                os.close(self.fd)
                self._closed = True
            if self.dirty and not self.unlinked and not self.failed_write:
                self.kept = True  # the journal stays: the next start (or a retry) commits it
                log.debug("%s: uncommitted bytes kept in %s", self.key, self.path)  # the caller reports it
                return
            try:  # (the bytes first, then what describes them: never a staging file without a journal)
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._drop_journal()
            Path(self.journal_path).unlink(missing_ok=True)
