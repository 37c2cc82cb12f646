"""Writes: the staged files of this mount, their commits, and the commits that failed.

Default mode: a close (flush) commits, and returns the upload's error. Write-back
(``--write-back``, or only for the files matching ``--write-back-path``: ``writes_back`` decides
per key): a close queues the file for a background upload (write/writeback.py) and returns; a
file matching a ``--commit-marker`` glob is committed at its close after everything closed
before it; ``barrier`` waits for what was closed before it (unlink, rmdir, rename, ``marinfs
sync``, unmount), mount-wide whatever the mode of the path it is taken for.

``staged`` (key -> the file's staged bytes, shared by its writers) and ``failed_commits`` and
``conflicts`` are guarded by the mount's table lock (``lock``); a staged file has its own lock,
taken before the table lock, never after. A commit holds its staged file's lock from the upload
until its stat is cached.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import posixpath
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from marinfs.write.commit import RETRY_NEXT_START, FailedCommit, commit_or_conflict, describe, is_permanent, retry_of
from marinfs.core.handles import Handle
from marinfs.core.kernel import KernelView
from marinfs.core.paths import entries_changed, under
from marinfs.errors import FsError, final_errno, interrupted
from marinfs.meta.metadata import MetadataCache, compile_glob
from marinfs.threadnames import each_at_once, start_thread
from marinfs.objects import NO_ATTRS, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.write.deletes import DeferredDeletes, recover_in_order
from marinfs.write.recovery import Recovered, recover
from marinfs.remote import Remote
from marinfs.write.spares import Spares, sweep
from marinfs.write.staging import JOURNAL_SUFFIX, StagedFile, mark_final, note_upload_in_journal
from marinfs.write.writeback import WriteBack

log = logging.getLogger(__name__)

# fallocate(2) modes (linux/falloc.h): only plain allocation and KEEP_SIZE have a meaning for
# a file that is uploaded whole; holes and ranges would need the object's layout.
FALLOC_FL_KEEP_SIZE = 0x01
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def reserve(fd: int, offset: int, length: int) -> None:
    """Reserve disk blocks for ``fd``'s range without changing its size, so a full staging
    disk fails the fallocate (ENOSPC) rather than a later write. A staging disk that cannot
    reserve (EOPNOTSUPP) is no error: the commit uploads the same bytes either way."""
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        if code != errno.EOPNOTSUPP:
            raise OSError(code, os.strerror(code))


def staged_info(staged: StagedFile) -> ObjectInfo:
    """What this node shows for a file with uncommitted bytes: its size, mtime and attributes."""
    return ObjectInfo(name=staged.key, is_dir=False, size=staged.known_size(), mtime_ns=staged.mtime_ns,
                      posix=staged.attrs or NO_ATTRS)


class Writes:
    """Staged files: made by writers, committed at flush, kept and retried when that fails."""

    def __init__(self, lock: threading.Lock, remote: Remote, metadata: MetadataCache, kernel: KernelView,
                 staging_dir: Path, max_file_size: int, write_back: bool = False, write_back_uploads: int = 16,
                 write_back_delay: float = 0.0, commit_markers: Sequence[str] = (),
                 write_back_hold: Sequence[str] = (), write_back_max_bytes: int = 0,
                 write_back_paths: Sequence[str] = ()) -> None:
        self.lock = lock
        self.remote = remote
        self.metadata = metadata
        self.kernel = kernel
        self.staging_dir = staging_dir
        self.max_file_size = max_file_size  # EFBIG past it (check_size)
        self.staged: dict[str, StagedFile] = {}  # GUARDED_BY(lock)
        self.failed_commits: list[FailedCommit] = []  # GUARDED_BY(lock): bytes kept on disk, retried
        # GUARDED_BY(lock): commits that found the object changed by someone else: key -> where the bytes went.
        self.conflicts: deque[dict[str, Any]] = deque(maxlen=1000)
        # GUARDED_BY(lock): those of them no `marinfs sync` has reported yet (sync_conflicts).
        self._unsynced: deque[dict[str, Any]] = deque(maxlen=1000)
        # GUARDED_BY(lock): directories made under a temporary directory that is renamed into place
        # (--write-back-hold, write-back): no marker in the bucket until the rename takes them out
        # of it, so Orbax's mkdirs and the rename of its inner temporary directory send nothing.
        self.local_dirs: dict[str, ObjectInfo] = {}
        remote.on_upload_session = self._upload_session  # multipart uploads go in the journals
        self._markers = [compile_glob(g) for g in commit_markers]
        self._holds = [compile_glob(g) for g in write_back_hold]
        self.write_back_max_bytes = write_back_max_bytes  # closed, not uploaded; 0: no bound
        # Told of every commit here (core/deferred.py: attributes of the version it replaced
        # are moot; changes of the new one may be held back): key, its new version (None: the
        # bytes went to a conflict name). Called with the staged file's lock held: never waits.
        self.on_commit: Callable[[str, ObjectVersion | None], None] = lambda key, version: None
        # --write-back-path: only the files matching are written back (given alone, it turns
        # write-back on for them; with --write-back too, it still narrows it); none: every file.
        self.write_back_paths = tuple(write_back_paths)
        self._scope = [compile_glob(g) for g in write_back_paths]
        # The queue exists wherever some file may be written back: its barriers are mount-wide.
        self.write_back = (WriteBack(self._upload_queued, self.release, workers=write_back_uploads,
                                     delay=write_back_delay, hold=self.is_held)
                           if write_back or self._scope else None)
        # Write-back: unlinks and rmdirs shown here at once, sent behind the uploads before them.
        self.spares = Spares(staging_dir)  # (a create takes its staging file from these)
        self.deletes = (DeferredDeletes(staging_dir, remote, self.write_back, landed=self._delete_landed,
                                        failed_uploads=self._failed_uploads)
                        if self.write_back is not None else None)

    # -- staged files ------------------------------------------------------------------------------
    def writer(self, key: str, info: ObjectInfo | None, truncate: bool, attrs: PosixAttrs | None = None) -> StagedFile:
        """The staged file a writer opens (``KernelView.writer_opening``: not while the kernel
        reads the file from a backing here)."""
        with self.kernel.writer_opening(key):
            return self.acquire(key, info, truncate, attrs=attrs)

    def acquire(self, key: str, info: ObjectInfo | None, truncate: bool,
                attrs: PosixAttrs | None = None) -> StagedFile:
        """The staged file of ``key``, shared by its writers. An existing file's new content
        keeps its mode, owner and xattrs (as on ext4), not its stored mtime: the next write sets it."""
        if info is not None and info.posix is not None and not info.posix.empty:
            attrs = replace(info.posix, mtime_ns=None)
        with self.lock:
            self.kernel.note_writer_locked(key)
            staged = self.staged.get(key)
            if staged is None:
                base = dict(remote_url=self.remote.url, base_version=info.version if info else None,
                            attrs=attrs)
                if info is None or truncate or info.size == 0:
                    staged = StagedFile(self.staging_dir, key, seed=None, base_size=0,
                                        dirty=info is None or (truncate and info.size > 0),
                                        stream=self._stream_for(key), spare=self.spares.take(), **base)
                else:
                    staged = StagedFile(self.staging_dir, key, base_size=info.size,
                                        seed=self.remote.download, spare=self.spares.take(), **base)
                self.staged[key] = staged
                truncate = False
            staged.retain()
        if truncate:
            staged.truncate(0)
        return staged

    def _stream_for(self, key: str) -> Callable[..., Any] | None:
        """A new file's parts go up while it is written in the default mode (its close waits
        for the bucket); in write-back they wait for the close and its delay: a file renamed
        meanwhile (Orbax's temporary directory) would have sent its parts to the old name."""
        return self.remote.part_stream if self.remote.streams and not self.writes_back(key) else None

    def release(self, staged: StagedFile) -> None:
        """A writer closed: the last one commits what raced its close and drops the staged
        file, or keeps its bytes (with their journal) in ``failed_commits``. In write-back the
        upload queue holds its own reference, and releases it once it uploaded the file."""
        if self.writes_back(staged.key) and self._uploadable(staged):
            self._schedule(staged)
        with self.lock:
            if staged.let_go() > 0:
                return
        try:
            # Normally flush committed already; this catches writes that raced the last close.
            # Bytes whose commit just failed go straight to the retry list (the retry loop).
            if not staged.failed_unchanged:
                self.commit(staged)
        except Exception:  # noqa: BLE001 - release cannot report; discard() keeps the bytes
            pass  # logged below, once, if the bytes stay uncommitted
        with self.lock:
            if staged.refs > 0:
                return  # reopened meanwhile
            # By identity: a directory rename may have moved it in the table but not yet
            # given it its new key (see move).
            for key in [k for k, s in self.staged.items() if s is staged]:
                del self.staged[key]
        staged.discard()
        self._abort_leftovers(staged)
        if staged.kept:
            error = staged.last_error
            code = final_errno(error) if error is not None else None
            if code is None and interrupted(error):  # its writer gave up: not retried in a loop
                code = errno.EINTR
            entry = FailedCommit(staged.key, staged.path, describe(error) if error else "",
                                 error is not None and is_permanent(error), attempts=max(1, staged.failures),
                                 since=time.time(), retry=retry_of(code))
            if code is not None:  # the next daemon leaves it alone too (or, denied, tries it once)
                mark_final(staged.journal_path, entry.error, code)
            with self.lock:
                self.failed_commits.append(entry)
            _report_failed(entry, None)

    def dirty(self, key: str) -> StagedFile | None:
        """``key``'s staged file if it holds bytes the remote lacks (what this node shows)."""
        staged = self.staged.get(key)
        return staged if staged is not None and staged.dirty else None

    def in_dir(self, key: str) -> list[StagedFile]:
        """Staged files directly in directory ``key`` (new ones are shown before their commit)."""
        with self.lock:
            return [s for k, s in self.staged.items() if posixpath.dirname(k) == key]

    def any_under(self, key: str) -> bool:
        with self.lock:
            return any(k.startswith(key + "/") for k in itertools.chain(self.staged, self.local_dirs))

    # -- directories of a temporary directory --------------------------------------------------------
    def keeps_local(self, key: str) -> bool:
        """A directory made at ``key`` stays on this node until renamed out of a held path."""
        return self.writes_back(key) and self.is_held(key)

    def add_local_dir(self, info: ObjectInfo) -> None:
        with self.lock:
            self.local_dirs[info.name] = info

    # Every lookup and listing asks these: none made (all but a write-back mount saving a
    # checkpoint), no wait for the mount's table lock.
    def local_dir(self, key: str) -> ObjectInfo | None:
        if not self.local_dirs:
            return None
        with self.lock:
            return self.local_dirs.get(key)

    def local_dirs_in(self, key: str) -> list[ObjectInfo]:
        """Local directories directly in directory ``key``."""
        if not self.local_dirs:
            return []
        with self.lock:
            return [d for k, d in self.local_dirs.items() if posixpath.dirname(k) == key]

    def drop_local_dir(self, key: str) -> bool:
        with self.lock:
            return self.local_dirs.pop(key, None) is not None

    def materialize(self, key: str) -> None:
        """Directory ``key`` and those above it that are local get their markers (and
        attributes) in the bucket, and leave the table: something in them is about to be."""
        with self.lock:
            made = [self.local_dirs[k] for k in _ancestry(key) if k in self.local_dirs]
        self.make_local_dirs(made)

    def materialize_tree(self, tree: str) -> None:
        """The local directories in ``tree`` (itself included) get their markers: the tree is
        renamed in the bucket, which moves what is there."""
        with self.lock:
            made = [d for k, d in self.local_dirs.items() if under(k, tree)]
        self.make_local_dirs(made)

    def make_dir(self, info: ObjectInfo) -> None:
        """Directory ``info``'s marker (and its attributes) in the bucket."""
        self.remote.make_dir(info.name)
        if info.posix is not None and not info.posix.empty:
            self.remote.set_dir_attrs(info.name, info.posix)

    def make_local_dirs(self, made: list[ObjectInfo]) -> None:
        """Their markers in the bucket (all at once), then off the table."""
        each_at_once(self.make_dir, sorted(made, key=lambda i: i.name))
        with self.lock:
            for info in made:
                self.local_dirs.pop(info.name, None)

    def has_local_dirs(self, tree: str) -> bool:
        """A local directory in ``tree`` (itself included)."""
        with self.lock:
            return any(under(k, tree) for k in self.local_dirs)

    def move_local_dirs(self, src: str, dst: str) -> list[ObjectInfo]:
        """A tree rename: the local directories in it (``src`` itself too) follow; answers those
        whose new name is held no more (``make_local_dirs`` makes them)."""
        out = []
        with self.lock:
            for k in [k for k in self.local_dirs if under(k, src)]:
                info = replace(self.local_dirs.pop(k), name=dst + k[len(src):])
                self.local_dirs[info.name] = info
                if not self.keeps_local(info.name):
                    out.append(info)
        return out

    def pending(self) -> list[str]:
        """Keys with uncommitted bytes."""
        with self.lock:
            return sorted(k for k, st in self.staged.items() if st.dirty and not st.unlinked)

    # -- writes by handle ------------------------------------------------------------------------
    def check_size(self, size: int) -> None:
        """A file may grow to ``size`` bytes: else EFBIG, as a disk answers past its largest file."""
        if size > self.max_file_size:
            raise FsError(errno.EFBIG, f"{size} bytes is more than --max-file-size ({self.max_file_size})")

    def write(self, handle: Handle, data: bytes | memoryview, offset: int) -> int:
        """``data`` may be a view of the FUSE request buffer: used during the call, never kept."""
        if handle.staged is None:
            raise FsError(errno.EBADF, "file not open for writing")
        self.check_size((handle.staged.known_size() if handle.append else offset) + len(data))
        return handle.staged.write(data, None if handle.append else offset)

    def truncate_open(self, handle: Handle, length: int) -> None:
        if handle.staged is None:
            raise FsError(errno.EBADF, "file not open for writing")
        handle.staged.truncate(length)

    def fallocate(self, handle: Handle, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on a file open for writing, applied to its staged file: mode 0 reserves
        and extends the size like ext4 (zeros, committed at close); KEEP_SIZE only reserves.
        Punching holes, zeroing or collapsing ranges: EOPNOTSUPP (the object is uploaded whole;
        a hole is just zeros to write). Read-only handle: EBADF, as ext4 (the kernel checks that
        itself before it reaches us)."""
        if mode & ~FALLOC_FL_KEEP_SIZE:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x}")
        if offset < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        staged = handle.staged
        if staged is None:
            raise FsError(errno.EBADF, "file not open for writing")
        if not mode & FALLOC_FL_KEEP_SIZE:
            self.check_size(offset + length)
        with staged.lock:
            reserve(staged.fd, offset, length)  # ENOSPC here changes nothing
            if not mode & FALLOC_FL_KEEP_SIZE and offset + length > staged.known_size():
                staged.truncate(offset + length)  # the new bytes are zeros, as on ext4

    # -- commits ----------------------------------------------------------------------------------
    def flush(self, staged: StagedFile) -> None:
        """close(2): commit (a path in the default mode; a commit marker, after everything
        closed before it wherever write-back is on, its own path in it or not), or queue the
        upload (a path in write-back) once the bytes are staged."""
        key = staged.key
        if self.write_back is not None and self.is_marker(key) and not self.is_held(key):
            self.write_back.barrier()
            self.commit(staged)
        elif not self.writes_back(key):
            self.settle(key)  # (a delete of it queued: not after this commit)
            self.commit(staged)
        elif self._uploadable(staged):
            self._schedule(staged)
            if self.write_back_max_bytes:  # the staging area is bounded: a writer waits for room
                self.write_back.room(self.write_back_max_bytes)
        elif staged.failed_write:
            raise OSError(staged.failed_write, f"a write to {staged.key} failed; not committed")

    def fsync(self, staged: StagedFile) -> None:
        """fsync(2): the bucket in the default mode; in write-back the bytes and their journal
        on the local disk (what TensorStore's fsync of every file it writes then costs), so a
        crash of the daemon or the machine loses nothing the next start cannot upload."""
        if not self.writes_back(staged.key) or self.is_marker(staged.key):
            self.flush(staged)
        elif staged.failed_write:  # a write that never reached the staging file: not durable
            raise OSError(staged.failed_write, f"a write to {staged.key} failed; not committed")
        else:
            staged.sync_local()

    def writes_back(self, key: str) -> bool:
        """A close of ``key`` queues its upload (write-back) rather than committing it: every key
        with ``--write-back`` alone, only those matching ``--write-back-path`` where it is given,
        none without either."""
        if self.write_back is None:
            return False
        return not self._scope or any(glob.match(key) for glob in self._scope)

    def is_marker(self, key: str) -> bool:
        """A file others take as a commit point (``--commit-marker``)."""
        return any(glob.match(key) for glob in self._markers)

    def is_held(self, key: str) -> bool:
        """Under a temporary directory whose uploads wait for its rename (``--write-back-hold``):
        a marker there is no commit point yet (Orbax's commit_success.txt), the rename is."""
        return any(glob.match(key) for glob in self._holds)

    def is_gone(self, key: str) -> bool:
        """Deleted here (write-back), the delete not yet in the bucket: not shown."""
        return self.deletes is not None and self.deletes.is_gone(key)

    def _failed_uploads(self) -> frozenset[str]:
        """The staging files of the commits kept after failing (a queued delete waits for them)."""
        with self.lock:
            kept = {f.staged for f in self.failed_commits}
            kept |= {s.path for s in self.staged.values() if s.failed_unchanged and s.dirty}
        return frozenset(kept)

    def _delete_landed(self, key: str, is_dir: bool) -> None:
        """A queued delete is over: a listing or stat cached while it waited (the bucket still
        had the name, hidden here) would show the name again once it is no longer gone."""
        if is_dir:
            self.metadata.invalidate_tree(key)
        else:
            self.metadata.invalidate(key)

    def settle(self, key: str, wait: bool = True) -> None:
        """Before a change that reaches the bucket at once (a directory marker, a link, a
        close-durable commit, a rename) of ``key``: the deletes queued of it, above or below it,
        land first; those that failed are sent again, EIO if one still fails. ``wait=False``:
        only those that failed (a new file, whose upload is queued behind the others)."""
        if self.deletes is None:
            return
        if wait and self.deletes.near(key):
            self.barrier()
        self.deletes.resend_failed(key)

    def barrier(self, tree: str | None = None) -> None:
        """Write-back: wait until every file closed so far (in ``tree``, or all) is uploaded
        or kept after failing; nothing in the default mode (a close committed)."""
        if self.write_back is not None:
            self.write_back.barrier(tree)

    def failed_under(self, tree: str) -> list[str]:
        """Keys in ``tree`` (all: "") whose bytes are kept after a failed commit."""
        def covered(key: str) -> bool:
            return not tree or under(key, tree)

        with self.lock:
            kept = [f.key for f in self.failed_commits if covered(f.key)]
            kept += [k for k, s in self.staged.items() if covered(k) and s.failed_unchanged and s.dirty]
        kept += [d.key for d in (self.deletes.failed() if self.deletes is not None else []) if covered(d.key)]
        return sorted(set(kept))

    def _conflict_locked(self, key: str, committed_as: str) -> None:
        entry: dict[str, Any] = {"key": key, "committed_as": committed_as}
        self.conflicts.append(entry)
        self._unsynced.append(entry)

    def sync_conflicts(self, tree: str) -> list[dict[str, Any]]:
        """Conflicts in ``tree`` (all: "") no `marinfs sync` has reported yet, now reported: a
        sync fails once for each, not every sync after it. Each is marked with the time
        (``synced``, in `marinfs status --json` too), so the sync names these, not older ones."""
        def covered(key: str) -> bool:
            return not tree or under(key, tree)

        with self.lock:
            taken = [c for c in self._unsynced if covered(c["key"])]
            if taken:
                self._unsynced = deque((c for c in self._unsynced if not covered(c["key"])), maxlen=1000)
                now = time.time()
                for c in taken:
                    c["synced"] = now
        return taken

    def failing(self) -> bool:
        """Something kept after a failure that the retry pass tries again."""
        return bool(self.failed_commits) or (self.deletes is not None and bool(self.deletes.failed()))

    def not_uploaded(self, staged: StagedFile) -> bool:
        """A new file whose bytes are only here, waiting for their upload (write-back): a
        rename may send them to the new name instead of copying them in the bucket."""
        return (self.write_back is not None and staged.dirty and not staged.unlinked and staged.base_version is None
                and not staged.failed_write)

    def _uploadable(self, staged: StagedFile) -> bool:
        return staged.dirty and not staged.unlinked and not staged.failed_unchanged and not staged.failed_write

    def _schedule(self, staged: StagedFile) -> None:
        """Queue ``staged`` for upload, with a reference of the queue's own."""
        assert self.write_back is not None
        with self.lock:
            staged.retain()
        if not self.write_back.enqueue(staged):  # queued already: that task uploads it
            with self.lock:
                staged.let_go()

    def _upload_queued(self, staged: StagedFile) -> None:
        """A background upload (write-back). A second task of bytes whose upload just failed
        sends nothing: a release queues the file again when the upload the flush queued has
        already begun, and that failure keeps the bytes for the retry loop (they were sent
        twice, every attempt and timeout doubled, before being kept and reported)."""
        with staged.lock:
            if not staged.failed_unchanged:
                self.commit_locked(staged)

    def commit(self, staged: StagedFile) -> None:
        """Commit on close: returns only once the remote has the bytes, or raises its error."""
        with staged.lock:  # (a rename's rekey, a chmod: not between the upload and the cache)
            self.commit_locked(staged)

    def commit_locked(self, staged: StagedFile) -> None:
        """``commit`` with ``staged.lock`` held."""
        if not staged.dirty or staged.unlinked:
            return
        key = staged.key
        if self.local_dirs:  # (a barrier sends a file of a temporary directory before its rename)
            self.materialize(posixpath.dirname(key))
        token = self.metadata.begin_stat(key)
        try:
            done = commit_or_conflict(lambda k, expect: staged.commit(self.remote.upload, key=k, expect=expect,
                                                                      set_attrs=self.remote.set_attrs),
                                      key, staged.base_version, Path(staged.path))
        except BaseException as exc:
            self.metadata.invalidate(key)
            staged.commit_failed(exc)
            raise
        finally:
            self.kernel.forget_version(key)
        if done.conflict:
            # Someone else replaced (or removed) the object under our writer: it was not
            # overwritten, our bytes are beside it, and close() says so (docs/semantics.md).
            self.metadata.invalidate(key)
            self.metadata.invalidate(done.committed_as)
            with self.lock:
                self._conflict_locked(key, done.committed_as)
            self.on_commit(key, None)
            raise FsError(errno.ESTALE, f"{key} was changed by someone else since it was opened")
        version = done.version
        if version is not None:
            # The upload answered the new version (S3 ETag, GCS generation): that and the size
            # we wrote are the object's metadata; its timestamp is shown as the writer's below.
            info = ObjectInfo(name=key, is_dir=False, size=staged.known_size(), mtime_ns=staged.mtime_ns,
                              version=version, posix=staged.attrs or NO_ATTRS)
        else:
            # Learn the committed object's own metadata (version, timestamp) now: a listing will
            # report the same, so tools that compare stats (tar) never see a change that was not.
            self.metadata.forget(key)
            token = self.metadata.begin_stat(key)
            try:
                info = self.remote.stat(key)
            except FileNotFoundError:
                self.metadata.invalidate(key)
                return  # unlinked or renamed meanwhile by someone else
            except BaseException:
                self.metadata.end_stat(key, token, None)
                raise
        # The next commit of this file replaces exactly what we wrote: the version the upload
        # answered (a stat could already show a later writer's object), else the stat's.
        staged.rebase(version or info.version)
        self._abort_leftovers(staged)
        # The kernel may still hold the writer's mtime for a moment: keep showing it for the
        # version we wrote, so tools that compare stats (tar) do not see a change that was not.
        if info.version:
            self.kernel.wrote(key, info.version, staged.mtime_ns)
        self.metadata.put_own(info, token)
        entries_changed(self.remote, self.metadata, key)
        self.on_commit(key, version or info.version)

    def _upload_session(self, local_path: str, record: dict[str, Any], opened: bool) -> None:
        """An upload of staging file ``local_path`` opened (or ended) a session the store keeps
        apart: its staged file journals it, or, for a replay of a kept commit, its journal."""
        with self.lock:
            staged = next((st for st in self.staged.values() if st.path == local_path), None)
        if staged is not None:
            staged.note_upload(record, opened)
        else:
            try:
                note_upload_in_journal(local_path + JOURNAL_SUFFIX, record, opened)
            except (OSError, ValueError) as exc:
                if opened:
                    raise  # not begun: nobody could find it again
                log.debug("could not note the end of an upload in %s: %s", local_path, exc)

    def _abort_leftovers(self, staged: StagedFile) -> None:
        """Abort upload sessions of ``staged`` that no journal names any more (their own abort
        failed, or is still on its way: a second one is harmless). Rare, so here and now: a
        background abort could be cancelled by the unmount that follows."""
        for record in staged.take_leftover_uploads():
            try:
                self.remote.abort_upload(record)
            except Exception as exc:  # noqa: BLE001 - a bucket lifecycle rule is the last resort
                log.warning("could not abort the upload %s of %s: %s", record.get("id"), record.get("key"), exc)

    # -- bytes kept after a failed commit ------------------------------------------------------------
    def kept(self, key: str) -> str | None:
        """The staging file holding ``key``'s bytes kept after a failed commit (retried), or None:
        this node still shows them (stat, listings, reads), as its own writes."""
        if not self.failed_commits:
            return None
        with self.lock:
            found = next((f for f in reversed(self.failed_commits) if f.key == key), None)
        return found.staged if found is not None else None

    def kept_info(self, key: str) -> ObjectInfo | None:
        path = self.kept(key)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return ObjectInfo(name=key, is_dir=False, size=st.st_size, mtime_ns=st.st_mtime_ns, posix=NO_ATTRS)

    def kept_in(self, directory: str) -> list[ObjectInfo]:
        with self.lock:
            keys = {f.key for f in self.failed_commits if posixpath.dirname(f.key) == directory}
        return [info for key in sorted(keys) if (info := self.kept_info(key)) is not None]

    def drop_kept(self, key: str) -> bool:
        """``key`` is unlinked here: its kept bytes and journal go, never to be retried (the
        retry would bring back a file the user removed)."""
        with self.lock:
            gone = [f for f in self.failed_commits if f.key == key]
            self.failed_commits[:] = [f for f in self.failed_commits if f.key != key]
        for entry in gone:
            for path in (entry.staged + JOURNAL_SUFFIX, entry.staged):
                Path(path).unlink(missing_ok=True)
        return bool(gone)

    # -- names that change here ---------------------------------------------------------------------
    def unlinked(self, key: str, wait: bool = True) -> StagedFile | None:
        """``key`` is being unlinked: its open staged file keeps its bytes for its descriptors
        and is never committed. Answers it (None: none open). Not ``wait`` (a delete queued
        behind the uploads): a file whose upload is under way leaves the table now and is
        marked once that upload ends (it was whole to be sent; the queued delete comes after)."""
        open_staged = self.staged.get(key)
        if open_staged is not None and not wait and not open_staged.lock.acquire(blocking=False):
            with self.lock:
                if self.staged.get(key) is open_staged:
                    del self.staged[key]
            start_thread(open_staged.mark_unlinked, "marinfs-unlinked")
            return open_staged
        try:
            if open_staged is not None:
                open_staged.keep_old_bytes()  # still open: its descriptors keep the bytes
            with self.lock:
                staged = self.staged.pop(key, None)
            if staged is not None:  # (its lock waits for a commit in flight: never under ours)
                staged.mark_unlinked()  # open handles keep working; nothing is committed
            return staged
        finally:
            if open_staged is not None and not wait:
                open_staged.lock.release()

    def staged_under(self, tree: str) -> list[tuple[str, StagedFile]]:
        """The staged files inside directory ``tree``, in key order."""
        with self.lock:
            return sorted((k, s) for k, s in self.staged.items() if k.startswith(tree + "/"))

    def move(self, src: str, dst: str, retarget: bool = False, keys: set[str] | None = None) -> None:
        """Open staged files follow their rename, so later writes commit under the new name.
        A replaced target that is still open becomes nameless, as on a local disk.
        ``retarget``: files whose upload has not happened (write-back) go to the new name as
        new files (nothing of theirs is in the bucket, nor at the new name: no stat), only
        ``keys`` (those checked: a file made under ``src`` meanwhile stays)."""
        with self.lock:
            replaced = self.staged.pop(dst, None)
            moving = [k for k in self.staged if under(k, src) and (keys is None or k in keys)]
            moves = []
            for k in moving:
                staged = self.staged.pop(k)
                self.staged[dst + k[len(src):]] = staged
                moves.append((staged, dst + k[len(src):]))
        for staged, new_key in moves:
            staged.rekey(new_key)  # (its lock outside ours: a rename holds it while it takes ours)
            if retarget:
                staged.rebase(None)
                continue
            # The rename made a new object: the writer's next commit replaces that one.
            try:
                staged.rebase(self.remote.stat(staged.key).version)
            except FileNotFoundError:
                staged.rebase(None)
        if replaced is not None:
            replaced.mark_unlinked()
        if retarget and self.write_back is not None:
            self.write_back.changed()  # (held uploads may go now)

    # -- kept commits ---------------------------------------------------------------------------------
    def retry_failed_commits(self) -> list[Recovered]:
        """Commit again what failed before (the daemon calls this every commit retry interval).
        Nothing to retry (none failed, or only finally): nothing is asked of the remote."""
        if self.deletes is not None:
            self.deletes.retry()
        with self.lock:
            if not any(not f.final for f in self.failed_commits):
                return []
        return self.recover_staged()

    def recover_staged(self, at_start: bool = False) -> list[Recovered]:
        """Replay every journal in the staging directory whose file is not open here (a crashed
        run's, or a failed commit's), and merge what still fails into ``failed_commits``.
        Journals of final failures are left alone (``at_start``: access refusals are tried once
        more), and listed.

        The remote is called without ``lock``: a close failing meanwhile appends its own entry,
        and the merge keeps it unless this pass committed its bytes."""
        with self.lock:
            before = {f.staged: f for f in self.failed_commits}
        skip = self.open_staging_files()
        if at_start:
            sweep(self.staging_dir)  # (spares and files never written an earlier run left)
        results = (recover_in_order(self.staging_dir, self.remote, skip, at_start) if at_start
                   else recover(self.staging_dir, self.remote, skip, at_start=at_start))
        if at_start and self.deletes is not None:
            self.deletes.adopt_left()  # (those not sent: kept and retried, as this daemon's own)
        now = time.time()
        reports: list[tuple[FailedCommit, FailedCommit | None]] = []
        with self.lock:
            seen = {r.staged for r in results}
            current = {f.staged: f for f in self.failed_commits}
            # Entries this pass did not look at (appended while it ran) stay as they are.
            merged = {k: f for k, f in current.items() if k not in before and k not in seen}
            for r in results:
                if r.committed_as is not None:
                    if r.conflict:
                        self._conflict_locked(r.key, r.committed_as)
                    continue
                prev = current.get(r.staged) or before.get(r.staged)
                if not r.tried and prev is not None:
                    merged[r.staged] = prev  # a final failure this daemon knows: nothing new
                    continue
                entry = FailedCommit(r.key, r.staged, r.error or "", r.permanent,
                                     attempts=(prev.attempts if prev else 0) + (1 if r.tried else 0) or 1,
                                     since=prev.since if prev else now, retry=retry_of(r.final))
                merged[r.staged] = entry
                reports.append((entry, None if not r.tried else prev))
            self.failed_commits[:] = merged.values()
        for entry, prev in reports:
            _report_failed(entry, prev)
        return results

    def upload_status(self) -> dict[str, Any]:
        """Open files with uncommitted bytes, and commits that failed (their bytes kept on disk)."""
        with self.lock:
            pending = sorted(k for k, st in self.staged.items() if st.dirty and not st.unlinked)
            failed = [f.as_dict() for f in self.failed_commits]
            conflicts = list(self.conflicts)
        out = {"pending": pending, "failed": failed, "conflicts": conflicts}
        if self.write_back is not None:  # files closed and not uploaded yet, and uploads ended
            out["write_back"] = {"queued": self.write_back.pending(), "uploaded": self.write_back.uploaded,
                                 "paths": list(self.write_back_paths)}  # (none: every path)
        if self.deletes is not None:  # deletes that failed: kept, tried again
            out["failed_deletes"] = [{"key": d.key, "error": d.error, "since": d.since} for d in self.deletes.failed()]
        return out

    def open_staging_files(self) -> frozenset[str]:
        """Staging files of files open right now (recovery must leave them to their writers)."""
        with self.lock:
            return frozenset(st.path for st in self.staged.values())


def _ancestry(key: str) -> list[str]:
    """``key`` and the directories above it (not the root)."""
    out = []
    while key:
        out.append(key)
        key = posixpath.dirname(key)
    return out


def _report_failed(entry: FailedCommit, prev: FailedCommit | None) -> None:
    """One ERROR line when the bytes are first kept, or when a failure turns out to be one
    that retrying will not cure; later attempts: WARNING if it may pass, else quietly. A
    final failure is reported once by the daemon that met it (and once more by a daemon
    that finds it kept, at its start) and never again: it is not retried in a loop."""
    if entry.final and not (prev is not None and prev.final) and entry.error.startswith("Interrupted"):
        log.warning("the commit of %s was interrupted by its writer; its bytes are kept in %s and tried once "
                    "more at the next start (delete that file and its journal to drop them)", entry.key, entry.staged)
    elif entry.final and not (prev is not None and prev.final):
        when = ("it is tried once more at the next start (fix the credentials or the bucket's policy, "
                "then remount)" if entry.retry == RETRY_NEXT_START else "it is never tried again")
        log.error("cannot commit %s: %s; no retry can change this, so %s; its bytes are kept in %s",
                  entry.key, entry.error, when, entry.staged)
    elif entry.final:
        log.debug("commit of %s still fails finally: %s", entry.key, entry.error)
    elif entry.permanent and not (prev is not None and prev.permanent):
        log.error("cannot commit %s: %s; this will not pass by retrying (check the credentials and the "
                  "bucket); its bytes are kept in %s and retried", entry.key, entry.error, entry.staged)
    elif prev is None:
        log.error("commit of %s failed: %s; its bytes are kept in %s and retried",
                  entry.key, entry.error, entry.staged)
    elif entry.permanent:
        log.debug("commit of %s still fails (attempt %d): %s", entry.key, entry.attempts, entry.error)
    else:
        log.warning("commit of %s failed again (attempt %d): %s; its bytes stay in %s",
                    entry.key, entry.attempts, entry.error, entry.staged)
