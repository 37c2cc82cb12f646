"""The filesystem in plain Python types, usable and tested without FUSE: a facade over rooms
that each own their tables.

Paths are the FUSE adapter's absolute paths (``/a/b``); keys are the remote's relative ones
(``a/b``). A failure is an OSError (FsError, or the backend's FileNotFoundError,
PermissionError...) or a MarinfsError (RemoteError after the retries, PreconditionFailed);
``errors.errno_for`` turns either into an errno, EIO for anything else.

The rooms (docs/architecture.md has the lock order): ``handles`` (open file descriptions),
``kernel`` (what the kernel holds: page-cache groups, passthrough, sizes and times told),
``writes`` (staged files, commits, kept commits), ``namespace`` (lookups, listings, links,
names made and removed), ``attributes`` (chmod, chown, utimens, xattrs), ``renamer``
(rename and the readers that follow it) and ``reads``. One table lock, ``_lock``, guards the
tables of the handles, the kernel view and the writes (held only for dictionary work, never
across remote I/O); a staged file's lock is taken before it, never after.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from marinfs.write.commit import FailedCommit
from marinfs.core.attributes import XATTR_SYNC, Attributes
from marinfs.core.defaults import Defaults
from marinfs.core.deferred import Deferred

from marinfs.core.handles import Backings, Handle, HandleTable, Opened
from marinfs.core.kernel import KernelView
from marinfs.core.namespace import Namespace
from marinfs.core.paths import key_of
from marinfs.core.reads import Reads
from marinfs.core.rename import Renamer
from marinfs.core.writes import Writes
from marinfs import interrupts
from marinfs.errors import FsError
from marinfs.meta.listings import ListingPrefetcher
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import ObjectInfo, PosixAttrs
from marinfs.read.reader import ChunkFetcher
from marinfs.write import attrjournal
from marinfs.write.recovery import Recovered
from marinfs.remote import Remote
from marinfs.threadnames import start_thread
from marinfs.read.walkahead import WalkAhead

log = logging.getLogger(__name__)


class Filesystem:
    """POSIX operations over a :class:`Remote`, with a metadata cache and staged writes."""

    def __init__(self, remote: Remote, staging_dir: Path, metadata: MetadataCache | None = None,
                 read_only: bool = False, fetcher: ChunkFetcher | None = None,
                 max_readahead_chunks: int = 32, drain_timeout: float = 300.0,
                 list_prefetch: bool = False, file_mode: int = 0o644, dir_mode: int = 0o755,
                 uid: int | None = None, gid: int | None = None, max_file_size: int = 5 << 40,
                 write_back: bool = False, write_back_uploads: int = 16, write_back_delay: float = 0.0,
                 commit_markers: tuple[str, ...] = (), write_back_hold: tuple[str, ...] = (),
                 write_back_max_bytes: int = 0, write_back_paths: tuple[str, ...] = ()) -> None:
        self.remote = remote
        self.read_only = read_only
        self.staging_dir = staging_dir
        self.drain_timeout = drain_timeout
        self.drained = True  # False once an unmount gave up waiting for pending commits
        self.defaults = Defaults.of(remote, file_mode, dir_mode, uid, gid)
        self.metadata = metadata or MetadataCache()
        # Background listings (see listings.py): they pay off where a request costs milliseconds,
        # and only if the cache may keep what they fetch.
        keeps = self.metadata.ttl > 0 or self.metadata.list_ttl > 0
        self.listings = ListingPrefetcher(remote, self.metadata) if list_prefetch and keeps else None
        self.fetcher = fetcher or ChunkFetcher(remote.read_range, cache=None)
        self._lock = threading.Lock()
        self.handles = HandleTable(self._lock)
        staged: dict = {}
        self.kernel = KernelView(self._lock, self.handles, staged, self.fetcher, remote.url, self.metadata,
                                 self.defaults)
        self.writes = Writes(self._lock, remote, self.metadata, self.kernel, staging_dir, max_file_size,
                             write_back=write_back, write_back_uploads=write_back_uploads,
                             write_back_delay=write_back_delay, write_back_hold=write_back_hold,
                             write_back_max_bytes=write_back_max_bytes, write_back_paths=write_back_paths,
                             commit_markers=commit_markers)
        self.kernel.staged = self.writes.staged
        # Attributes set on a file just committed here wait a moment for its rename (core/deferred.py).
        self.deferred = Deferred(remote, staging_dir)
        self.writes.on_commit = self.deferred.committed
        self.namespace = Namespace(self._lock, remote, self.metadata, self.listings, self.handles, self.kernel,
                                   self.writes, self.defaults, self.deferred)
        self.attributes = Attributes(remote, self.metadata, self.handles, self.kernel, self.writes, self.namespace,
                                     self.defaults, read_only, self.deferred)
        self.reads = Reads(self._lock, self.handles, self.kernel, self.writes, self.fetcher, self.metadata,
                           self.namespace, remote.url, max_readahead_chunks)
        self.renamer = Renamer(self._lock, remote, self.metadata, self.handles, self.kernel, self.writes,
                               self.namespace, self.reads.ref, self.deferred)
        # A walker's next small files fetched ahead of it (walkahead.py): on object stores, as
        # the listings ahead, and only where listings are kept (it walks by them).
        # Files of 1 MiB at most: a tool that opens each file of a directory to read its header
        # costs at most a window of those.
        self.walkahead = (WalkAhead(self.metadata.get_listing, self.reads.fetch_ahead, ttl=self.metadata.list_ttl,
                                    small=min(1 << 20, self.fetcher.chunk_size))
                          if list_prefetch and self.metadata.list_ttl > 0 else None)
        # What the daemon reads of the rooms.
        self.failed_commits: list[FailedCommit] = self.writes.failed_commits
        self.conflicts = self.writes.conflicts

    @property
    def backings(self) -> Backings | None:
        """FUSE passthrough, set by the FUSE layer once the kernel and libfuse agreed to it."""
        return self.kernel.backings

    @backings.setter
    def backings(self, backings: Backings | None) -> None:
        self.kernel.backings = backings

    # -- the daemon's view ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the daemon publishes (status file, metrics): chunk cache counters, remote
        requests, pending and failed uploads, the chunk memory, passthrough opens and the
        versions open so now."""
        cache = self.fetcher.cache
        return {"cache": cache.snapshot() if cache else None, "remote_requests": self.remote.stats.snapshot(),
                "uploads": self.upload_status(), "memory": self.fetcher.memory(),
                "passthrough": {"on": self.kernel.backings is not None, "opens": self.kernel.passthrough_opens,
                                "files": cache.pinned() if cache else 0}}

    def upload_status(self) -> dict[str, Any]:
        return {**self.writes.upload_status(), "committing": interrupts.in_progress(),
                "renames": self.renamer.unfinished_status()}

    def finish_renames(self) -> None:
        """Finish the directory renames an earlier daemon left midway (at start, before the
        staged files are recovered: theirs were committed before the rename began)."""
        self.renamer.finish_unfinished()

    def retry_failed_commits(self) -> list[Recovered]:
        return self.writes.retry_failed_commits()

    def recover_staged(self, at_start: bool = False) -> list[Recovered]:
        return self.writes.recover_staged(at_start=at_start)

    def send_kept_attributes(self) -> None:
        """Attributes an earlier daemon held back and never sent (write/attrjournal.py): sent now,
        after the staged commits were replayed (a commit of new bytes replaced the version they
        were set on: they are then dropped, as that commit carried the file's attributes). What
        the store does not take now is sent by this daemon later."""
        for kept in attrjournal.replay(self.staging_dir, self.remote):
            self.deferred.adopt(kept)

    def close(self) -> None:
        """Once unmounted: stop the fetch workers (every fetched chunk reaches the disk first),
        release the chunk cache's lock, so the next daemon on this cache may take it, and the
        remote's threads and connections."""
        self.deferred.stop()  # (what is held back still: journaled, sent by the next start)
        self.writes.spares.close()
        self.fetcher.close()
        if self.fetcher.cache is not None:
            self.fetcher.cache.close()
        self.remote.close()

    def _writable(self) -> None:
        if self.read_only:
            raise FsError(errno.EROFS)

    # -- lookups and listings -------------------------------------------------------------------
    def lookup(self, key: str) -> ObjectInfo:
        return self.namespace.lookup(key)

    def getattr(self, path: str) -> ObjectInfo:
        return self.namespace.getattr(path)

    def getattr_cached(self, key: str) -> ObjectInfo | None:
        return self.namespace.getattr_cached(key)

    def fgetattr(self, fh: int) -> ObjectInfo:
        return self.namespace.fgetattr(fh)

    def handle_info(self, fh: int) -> ObjectInfo:
        return self.namespace.handle_info(fh)

    def readdir(self, path: str) -> list[ObjectInfo]:
        return self.namespace.readdir(path)

    def statfs(self) -> dict[str, int]:
        return self.namespace.statfs()

    def access(self, path: str, mode: int) -> None:
        self.namespace.access(path, mode, self.read_only)

    def readlink(self, path: str) -> str:
        return self.namespace.readlink(path)

    # -- attributes -----------------------------------------------------------------------------
    def set_attributes(self, path: str, mode: int | None = None, uid: int | None = None, gid: int | None = None,
                       mtime_ns: int | None = None, fh: int | None = None) -> None:
        self.attributes.set_attributes(path, mode=mode, uid=uid, gid=gid, mtime_ns=mtime_ns, fh=fh)

    def getxattr(self, path: str, name: str) -> bytes:
        if name == XATTR_SYNC:
            return self.sync(path)
        return self.attributes.getxattr(path, name)

    def sync(self, path: str) -> bytes:
        """``marinfs sync PATH`` (getxattr of ``user.marinfs.sync``): returns once every file
        closed under PATH before it is in the bucket; EIO if one's bytes are kept after a failed
        commit; EEXIST if one's went to a conflict name (someone else had written the name:
        theirs stayed), once for each such file (not ESTALE: the kernel asks a path's getxattr
        again after it, and the second answer would be 0)."""
        key = key_of(path)
        self.lookup(key)
        self.writes.barrier(key or None)
        failed = self.writes.failed_under(key)
        if failed:
            raise FsError(errno.EIO, f"{len(failed)} file(s) under /{key} failed to upload and are kept: "
                          + ", ".join(failed[:5]))
        conflicts = self.writes.sync_conflicts(key)
        if conflicts:
            raise FsError(errno.EEXIST, f"{len(conflicts)} file(s) under /{key} were changed by someone else "
                          "before their upload; ours are beside: "
                          + ", ".join(c["committed_as"] for c in conflicts[:5]))
        return b"0"

    def listxattr(self, path: str) -> list[str]:
        return self.attributes.listxattr(path)

    def setxattr(self, path: str, name: str, value: bytes, flags: int = 0, fh: int | None = None) -> None:
        self._writable()
        self.attributes.setxattr(path, name, value, flags, fh=fh)

    def removexattr(self, path: str, name: str) -> None:
        self._writable()
        self.attributes.removexattr(path, name)

    # -- open files -----------------------------------------------------------------------------
    def open(self, path: str, flags: int) -> Opened:
        """Open an existing file: the handle and how the kernel is to treat it (one reply)."""
        key = key_of(path)
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        if writable or flags & os.O_TRUNC:
            self._writable()
        if writable or flags & os.O_TRUNC:
            # A writer is the next change: attributes held back for the file go first (else
            # their update would give the object a version the writer did not start from).
            self.deferred.send_now(key)
        if writable and key not in self.writes.staged:
            # The version a writer starts from decides whether its commit may replace the
            # object: take it from the remote, not from a cache that may be seconds old.
            self.metadata.forget(key)
        info = self.lookup(key)
        if info.is_dir:
            raise FsError(errno.EISDIR, key)
        if info.link:  # the kernel resolves links before an open: only O_NOFOLLOW's answer here
            raise FsError(errno.ELOOP, key)
        if flags & os.O_TRUNC and not writable and info.size > 0:
            # O_RDONLY|O_TRUNC empties the file, as on a local disk (POSIX leaves it open; the
            # kernel has checked the caller may write it): then it is read as such.
            self.truncate(path, 0)
            info = self.lookup(key)
        staged = self.writes.writer(key, info, bool(flags & os.O_TRUNC)) if writable else None
        handle = Handle(key=key, flags=flags, info=info, staged=staged)
        self.kernel.admit(handle, info, flags, writable)
        if self.walkahead is not None and not writable and info.version is not None:
            self.walkahead.opened(info)
        return self.kernel.opened(self.handles.add(handle), handle)

    def create(self, path: str, flags: int, mode: int | None = None) -> Opened:
        """A new file (an existing one is opened: ``mode`` applies only to new files). Its mode
        is stored only if it is not the mount's ``--file-mode``, so plain writes carry nothing."""
        self._writable()
        key = key_of(path)
        self.remote.check_key(key)  # a name the store cannot hold fails here, not at every commit
        existing = self.namespace.lookup_or_none(key)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST, key)
            return self.open(path, flags)
        self.namespace.require_dir(posixpath.dirname(key))
        self.namespace.file_name_allowed(key)
        self.writes.settle(key, wait=False)  # (a delete of the name that failed: its upload would clash)
        self.metadata.forget(key)  # the listing stays: the staged file shows until committed
        keep = mode is not None and self.remote.stores_posix
        attrs = self.defaults.normalized(PosixAttrs(mode=mode & 0o7777), False) if keep else None
        staged = self.writes.writer(key, None, truncate=False, attrs=None if attrs is None or attrs.empty else attrs)
        handle = Handle(key=key, flags=flags, info=None, staged=staged)
        if self.listings is not None:
            self.listings.created(key)  # (unless listed: its next names are looked up in that listing)
        return self.kernel.opened(self.handles.add(handle), handle)

    def mknod(self, path: str, mode: int) -> None:
        """mknod(2): a regular file is an empty object, made as create + close make it. Fifos,
        sockets and devices cannot be objects: EPERM, what the kernel answers for a
        filesystem without them (vfat), so mkfifo and bind() fail cleanly and leave nothing."""
        self._writable()
        key = key_of(path)
        if self.namespace.lookup_or_none(key) is not None:
            raise FsError(errno.EEXIST, key)
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            raise FsError(errno.EPERM, f"{key}: only regular files and directories can be objects")
        fh = self.create(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, stat.S_IMODE(mode) or None).fh
        try:
            self.flush(fh)
        finally:
            self.release(fh)

    def read(self, fh: int, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` as ``bytes`` (see read_into)."""
        view = memoryview(bytearray(max(0, size)))
        return view[:self.read_into(fh, view, offset)].tobytes()

    def read_into(self, fh: int, dest: memoryview, offset: int) -> int:
        return self.reads.read_into(fh, dest, offset)

    def write(self, fh: int, data: bytes | memoryview, offset: int) -> int:
        return self.writes.write(self.handles.get(fh), data, offset)

    def flush(self, fh: int) -> None:
        """Commit on close: returns only once the remote has the bytes, or raises its error
        (write-back: once they are staged, the upload queued; see Writes.flush)."""
        handle = self.handles.get(fh)
        if handle.staged is not None:
            with interrupts.call(handle.staged.key):  # (`marinfs status`: its bytes sent so far)
                self.writes.flush(handle.staged)

    def fsync(self, fh: int) -> None:
        handle = self.handles.get(fh)
        if handle.staged is not None:
            with interrupts.call(handle.staged.key):
                self.writes.fsync(handle.staged)

    def release(self, fh: int) -> None:
        handle = self.kernel.release(fh)
        if handle is not None and handle.reader is not None:
            handle.reader.close()
        if handle is not None and handle.staged is not None:
            self.writes.release(handle.staged)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        self._writable()
        if length < 0:
            raise FsError(errno.EINVAL)
        self.writes.check_size(length)
        if fh is not None:
            self.writes.truncate_open(self.handles.get(fh), length)
            return
        key = key_of(path)
        self.writes.settle(key)  # (committed at once: after a delete of it queued before)
        self.deferred.send_now(key)  # (the next change of the file: see open)
        info = self.lookup(key)
        if info.is_dir:
            raise FsError(errno.EISDIR, key)
        if key not in self.writes.staged and info.posix is None:  # (a listing's): the commit keeps them
            info = replace(info, posix=self.attributes.posix_of(key, info))
        staged = self.writes.acquire(key, info, truncate=False)
        try:
            staged.truncate(length)
            self.writes.commit(staged)
        finally:
            self.writes.release(staged)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        self.writes.fallocate(self.handles.get(fh), mode, offset, length)

    # -- namespace ------------------------------------------------------------------------------
    def symlink(self, target: str, path: str) -> None:
        self._writable()
        self.namespace.symlink(target, path)

    # A delete or rename never overtakes an upload (write-back): a delete is queued behind what was
    # closed before it (write/deletes.py), a rename waits for it (unless it re-targets uploads).
    def unlink(self, path: str) -> None:
        self._writable()
        key = key_of(path)
        with self.deferred.held(key):  # (no update of attributes held back races the delete)
            try:
                self.namespace.unlink(path)
            except FileNotFoundError:
                self.deferred.discard(key)
                raise
            self.deferred.discard(key)  # they went with the object

    def mkdir(self, path: str, mode: int | None = None) -> None:
        self._writable()
        self.namespace.mkdir(path, mode)

    def rmdir(self, path: str) -> None:
        self._writable()
        self.namespace.rmdir(path)

    def rename(self, old: str, new: str) -> None:
        self._writable()
        self.renamer.rename(old, new)  # (a barrier first, unless it re-targets uploads: Renamer)

    # -- lifecycle -----------------------------------------------------------------------------
    def close_all(self) -> None:
        """Release every handle (unmount): commits what can be committed within the drain
        timeout, and in write-back waits for the uploads queued; what is left stays staged with
        its journal for the next start to commit."""
        if self.listings is not None:
            self.listings.close()  # nothing will read ahead any more
        started = time.monotonic()
        worker = start_thread(self._close_all, "marinfs-drain")
        worker.join(self.drain_timeout)
        self.drained = not worker.is_alive()
        if self.writes.write_back is not None:
            left = max(0.0, self.drain_timeout - (time.monotonic() - started))
            self.drained = self.writes.write_back.close(left) and self.drained
        # Attributes held back: sent now (what the store does not take stays journaled).
        self.deferred.close(max(0.0, self.drain_timeout - (time.monotonic() - started)))
        if not self.drained:
            left_keys = self.writes.pending()
            log.error("unmount: pending commits did not finish within %.0f s; %d file(s) stay staged "
                      "in %s with journals and are committed on the next start: %s",
                      self.drain_timeout, len(left_keys), self.staging_dir, ", ".join(left_keys[:20]))

    def _close_all(self) -> None:
        for fh in self.handles.numbers():
            try:
                handle = self.handles.get(fh)
            except FsError:
                continue
            if handle.staged is not None:
                try:
                    self.writes.settle(handle.staged.key)  # (a delete of it queued before: first)
                    self.writes.commit(handle.staged)
                except Exception:  # noqa: BLE001 - the bytes stay staged; discard() says where
                    log.exception("commit of %s failed at unmount", handle.key)
            self.release(fh)
