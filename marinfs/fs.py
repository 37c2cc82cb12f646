"""The filesystem in plain Python types, usable and tested without FUSE.

Paths are the FUSE adapter's absolute paths (``/a/b``); keys are the remote's relative ones
(``a/b``). A failure is an OSError (FsError, or the backend's FileNotFoundError,
PermissionError...) or a MarinfsError (RemoteError after the retries, PreconditionFailed);
``errors.errno_for`` turns either into an errno, EIO for anything else.
Locking: ``_lock`` guards the tables of this mount's own state (open handles, staged files,
failed commits, conflicts, the versions and mtimes we wrote) and is never held across remote
I/O; a staged file has its own lock, and the caches below lock themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import posixpath
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from cachetools import LRUCache

from marinfs.commit import RETRY_NEXT_START, FailedCommit, commit_or_conflict, describe, is_permanent, retry_of
from marinfs.errors import FsError, PreconditionFailed, RemoteError, StaleVersionError, final_errno
from marinfs.listings import ListingPrefetcher
from marinfs.metadata import MetadataCache
from marinfs.reader import ChunkFetcher, ObjectReader, ObjectRef
from marinfs.objects import NO_ATTRS, ObjectInfo, ObjectVersion, PosixAttrs, cache_id
from marinfs.posixmeta import to_gcs, to_s3
from marinfs.recovery import Recovered, recover
from marinfs.remote import LINK_SUFFIX, Remote
from marinfs.remote.parts import PartStream
from marinfs.staging import JOURNAL_SUFFIX, StagedFile, mark_final, note_upload_in_journal
from marinfs.threadnames import start_thread
from marinfs.walkahead import WalkAhead

log = logging.getLogger(__name__)

NAME_MAX = 255
PATH_MAX = 4096  # the longest symbolic link target the kernel passes (with its NUL)
ROOT = ObjectInfo(name="", is_dir=True)

# fallocate(2) modes (linux/falloc.h): only plain allocation and KEEP_SIZE have a meaning for
# a file that is uploaded whole; holes and ranges would need the object's layout.
FALLOC_FL_KEEP_SIZE = 0x01
# Read-only attributes that tell a tool outside Python where a file lives and which version a
# read pins; the whole user.marinfs.* namespace is ours (EPERM to set). Other user.* attributes
# are stored with the file (PosixAttrs.xattrs).
XATTR_URL = "user.marinfs.url"
XATTR_VERSION = "user.marinfs.version"
XATTR_OURS = "user.marinfs."
XATTR_CREATE, XATTR_REPLACE = 1, 2  # setxattr(2) flags (linux/xattr.h)
XATTR_SIZE_MAX = 65536  # one value, as the kernel and ext4 allow
# All of a file's user.* names and values together, where the store does not say less (a
# ``max_xattr_bytes`` of its own); on S3 and GCS what counts is the object metadata they are
# encoded into (posixmeta.py): S3 keeps 2 KiB of user metadata in all, GCS 8 KiB.
XATTR_TOTAL_MAX = 65536
METADATA_MAX = {"s3": 2048, "s3a": 2048, "gs": 8192, "gcs": 8192}
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


@dataclass
class Handle:
    """One open file description."""

    key: str
    flags: int
    info: ObjectInfo | None  # what the remote had at open time (None for a new file)
    staged: StagedFile | None = None  # set for handles that may write
    reader: ObjectReader | None = None
    keep_kernel_cache: bool = False
    # Read through the kernel's page cache of the file (one of these PageUsers), or around it
    # (FOPEN_DIRECT_IO) while handles of another version are open there.
    page_users: PageUsers | None = None
    direct: bool = False
    # > 0: the backing file the kernel has for this inode (passthrough). A member of page_users
    # reads it; a handle that only carries it (another version, a writer) reads through the daemon.
    backing_id: int = 0
    carries: PageUsers | None = None
    orphan: bool = False  # its name was unlinked or renamed here: it never moves to the name's new object
    served: bool = False  # bytes of info's version were returned: it may not change any more
    # The kernel may hold another version's size for the file: it is to drop the attributes it
    # has before this handle's first read (the FUSE layer asks it at open).
    stale_kernel_attrs: bool = False

    @property
    def append(self) -> bool:
        return bool(self.flags & os.O_APPEND)


@dataclass(eq=False)
class PageUsers:
    """The open read handles of one file that read through the kernel's page cache of its
    inode: all of one version. The inode follows a rename here to its new name; a name
    unlinked here gets a new inode (libfuse forgets the old node), counted anew."""

    key: str
    version: ObjectVersion
    info: ObjectInfo  # that version's stat: what the kernel is told of the file while they read
    count: int = 0
    filled: bool = False  # one of them served bytes: the page cache may hold this version's
    # Made by an open that has the kernel drop the file's pages (another version's may be there):
    # the kernel does so once that open's reply reaches it, which may come after another open of
    # them and its reads. Until one of them served bytes, every open of them drops the pages.
    dropping: bool = False
    written: bool = False  # a writer here opened the file meanwhile: its pages are the writes'
    # The version's data file in the chunk cache, registered with the kernel: every handle of
    # these reads it by itself (FUSE passthrough), none through the daemon or the page cache.
    backing: Backing | None = None


@dataclass(eq=False)
class Backing:
    """A version cached whole, registered with the kernel for passthrough (``Backings``)."""

    id: int
    fd: int
    object_id: str
    via: Backings  # what registered it, and unregisters it (even once the mount stopped asking)


class Backings(Protocol):
    """What the FUSE layer gives for passthrough: registers a local file with the kernel, so
    the reads and maps of a file opened with its id go to that file without the daemon."""

    def register(self, fd: int) -> int:
        """The backing id of ``fd`` (> 0); raises OSError if the kernel refuses."""

    def unregister(self, backing_id: int) -> None:
        """Drop an id (files opened with it keep their own reference)."""


def _shown_time(info: ObjectInfo) -> int:
    """The time a stat shows of ``info``: one stored for it (utimens, rsync -a), else the object's."""
    posix = info.posix
    return posix.mtime_ns if posix is not None and posix.mtime_ns is not None else info.mtime_ns


_UNSURE = (-1, -1)  # _told: the kernel may hold either of two answers


def _with_size_and_time(info: ObjectInfo, size: int, shown: int) -> ObjectInfo:
    """``info`` showing ``size`` and the time ``shown`` (what the kernel keeps of a file's version)."""
    posix = info.posix
    if posix is not None and posix.mtime_ns is not None:
        posix = replace(posix, mtime_ns=shown)
    return replace(info, size=size, mtime_ns=shown, posix=posix)


def _under(key: str, tree: str) -> bool:
    """``key`` is ``tree`` or inside it."""
    return key == tree or key.startswith(tree + "/")


def key_of(path: str) -> str:
    """``/a/b`` -> ``a/b``; rejects names longer than NAME_MAX bytes, like a local disk."""
    key = path.strip("/")
    if key:
        for part in key.split("/"):
            if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG, part[:40] + "...")
            if part in (".", ".."):
                raise FsError(errno.EINVAL, f"bad path component {part!r}")
    return key


class Filesystem:
    """POSIX operations over a :class:`Remote`, with a metadata cache and staged writes."""

    def __init__(self, remote: Remote, staging_dir: Path, metadata: MetadataCache | None = None,
                 read_only: bool = False, fetcher: ChunkFetcher | None = None,
                 max_readahead_chunks: int = 32, drain_timeout: float = 300.0,
                 list_prefetch: bool = False, file_mode: int = 0o644, dir_mode: int = 0o755,
                 uid: int | None = None, gid: int | None = None, max_file_size: int = 5 << 40) -> None:
        self.remote = remote
        self.max_file_size = max_file_size  # EFBIG past it (_check_size)
        remote.on_moved = self._moved  # a rename's pinned copy: its readers here follow it
        remote.on_upload_session = self._upload_session  # multipart uploads go in the journals
        self._renaming = threading.local()  # .moves: what this thread's rename's copies told
        # What every file shows when nothing is stored for it: a chmod, chown or create mode
        # equal to these is not stored (it changes nothing anyone sees).
        self.file_mode, self.dir_mode = file_mode & 0o7777, dir_mode & 0o7777
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        # The mount root has no parent to keep its attributes on an object store: this mount's
        # chmod/utimens of it are shown (rsync -a sets them), and stored only on local disks.
        self._root_attrs = NO_ATTRS
        # A local disk's files always have a mode and owner (see _as_mounted): what the daemon
        # gives its own files, (euid, egid, file mode, dir mode) after its umask.
        self._native: tuple[int, int, int, int] | None = None
        if not remote.object_store and remote.lists_posix:
            umask = os.umask(0o022)
            os.umask(umask)
            self._native = (os.geteuid(), os.getegid(), 0o666 & ~umask, 0o777 & ~umask)
        self.metadata = metadata or MetadataCache()
        # Background listings (see listings.py): they pay off where a request costs milliseconds,
        # and only if the cache may keep what they fetch.
        keeps = self.metadata.ttl > 0 or self.metadata.list_ttl > 0
        self.listings = ListingPrefetcher(remote, self.metadata) if list_prefetch and keeps else None
        self.staging_dir = staging_dir
        self.read_only = read_only
        self.fetcher = fetcher or ChunkFetcher(remote.read_range, cache=None)
        # A walker's next small files fetched ahead of it (walkahead.py): on object stores, as
        # the listings ahead, and only where listings are kept (it walks by them).
        # Files of 1 MiB at most: a tool that opens each file of a directory to read its header
        # costs at most a window of those.
        self.walkahead = (WalkAhead(self.metadata.get_listing, self._fetch_ahead, ttl=self.metadata.list_ttl,
                                    small=min(1 << 20, self.fetcher.chunk_size))
                          if list_prefetch and self.metadata.list_ttl > 0 else None)
        self.max_readahead_chunks = max_readahead_chunks
        # FUSE passthrough (set by the FUSE layer once the kernel and libfuse agreed to it): a
        # version the chunk cache holds whole is read by the kernel from its data file.
        self.backings: Backings | None = None
        self.passthrough_opens = 0
        self.drain_timeout = drain_timeout
        self.drained = True  # False once an unmount gave up waiting for pending commits
        # The version each key had when last opened: the kernel may keep its page cache for a
        # new open only if the version is unchanged (else it would serve the old bytes).
        self._kernel_versions: LRUCache[str, ObjectVersion | None] = LRUCache(maxsize=65536)
        # The (size, time shown) each file's stat last told the kernel (kernel_info): an open whose
        # version has others makes the kernel ask again before it reads (Handle.stale_kernel_attrs).
        self._told: LRUCache[str, tuple[int, int]] = LRUCache(maxsize=65536)
        # The open read handles using the kernel's page cache of each key (one version each).
        self._page_users: dict[str, PageUsers] = {}
        self._writers_opening: dict[str, int] = {}  # key -> writers between their check and staging (_writer_staged)
        self.release_grace = 0.1  # seconds an open of another version waits for their release
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # a key's last page-cache reader let go
        self._handles: dict[int, Handle] = {}
        self._staged: dict[str, StagedFile] = {}
        self._own_mtimes: LRUCache[str, tuple[ObjectVersion, int]] = LRUCache(maxsize=65536)
        # Link targets read from the remote (an S3 link's body), by key and the link's version:
        # a link object that changed has a new version, so an old target is never answered.
        self._link_targets: LRUCache[tuple[str, str], str] = LRUCache(maxsize=65536)
        self.failed_commits: list[FailedCommit] = []  # staged bytes kept on disk, retried
        # Commits that found the object changed by someone else: key -> where the bytes went.
        self.conflicts: deque[dict[str, str]] = deque(maxlen=1000)
        self._next_fh = itertools.count(1)

    # -- the daemon's view ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the daemon publishes (status file, metrics): chunk cache counters, remote
        requests, pending and failed uploads, the chunk memory, passthrough opens and the
        versions open so now."""
        cache = self.fetcher.cache
        return {"cache": cache.snapshot() if cache else None, "remote_requests": self.remote.stats.snapshot(),
                "uploads": self.upload_status(), "memory": self.fetcher.memory(),
                "passthrough": {"on": self.backings is not None, "opens": self.passthrough_opens,
                                "files": cache.pinned() if cache else 0}}

    def close(self) -> None:
        """Once unmounted: stop the fetch workers (every fetched chunk reaches the disk first),
        release the chunk cache's lock, so the next daemon on this cache may take it, and the
        remote's threads and connections."""
        self.fetcher.close()
        if self.fetcher.cache is not None:
            self.fetcher.cache.close()
        self.remote.close()

    # -- lookups -------------------------------------------------------------------------------
    def lookup(self, key: str) -> ObjectInfo:
        """The metadata of ``key``: our own staged writes first, then the cache, then the remote."""
        if not key:
            return ROOT if self._root_attrs.empty else replace(ROOT, posix=self._root_attrs)
        info = self._known(key)
        if info is not None:
            return info
        if self.metadata.is_missing(key):
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        if self.metadata.listed_missing(key):
            if self.listings is not None:
                self.listings.keep_fresh(posixpath.dirname(key))
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        if self.listings is not None:
            self.listings.note_miss(key)
        info, cached = self._ask_stat(key)
        if not cached:
            # This node changed the key while the remote answered (a commit, say): the answer
            # may be of before. What this node knows now, else the remote once more.
            info = self._known(key) or self._ask_stat(key)[0]
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        return info

    def _ask_stat(self, key: str) -> tuple[ObjectInfo | None, bool]:
        """The remote's stat of ``key`` (None: there is no such key) and whether it was cached:
        not if this node changed the key while the remote answered."""
        token = self.metadata.begin_stat(key)
        try:
            info = self.remote.stat(key, likely_dir=self.metadata.was_dir(key), likely_link=self.metadata.was_link(key))
        except FileNotFoundError:
            return None, self.metadata.end_stat(key, token, None, missing=True)
        except BaseException:
            self.metadata.end_stat(key, token, None)
            raise
        return info, self.metadata.end_stat(key, token, info)

    def _known(self, key: str) -> ObjectInfo | None:
        """What lookup() answers for ``key`` without asking the remote, or None."""
        staged = self._staged.get(key)
        if staged is not None and staged.dirty:
            # Bytes the remote lacks yet: our writes are what this node shows. A clean staged
            # file (committed, or open but unwritten) matches the remote, whose stat has a version.
            return self._staged_info(staged)
        return self.metadata.get_stat(key)

    @staticmethod
    def _staged_info(staged: StagedFile) -> ObjectInfo:
        """What this node shows for a file with uncommitted bytes: its size, mtime and attributes."""
        return ObjectInfo(name=staged.key, is_dir=False, size=staged.known_size(), mtime_ns=staged.mtime_ns,
                          posix=staged.attrs or NO_ATTRS)

    def _lookup_or_none(self, key: str) -> ObjectInfo | None:
        try:
            return self.lookup(key)
        except FileNotFoundError:
            return None

    def _require_dir(self, key: str) -> None:
        if self.metadata.has_listing(key):
            return  # listed fresh: a directory (tar -x creates in one past its stat's TTL)
        if not self.lookup(key).is_dir:
            raise FsError(errno.ENOTDIR, key)

    def _writable(self) -> None:
        if self.read_only:
            raise FsError(errno.EROFS)

    def getattr(self, path: str) -> ObjectInfo:
        key = key_of(path)
        return self.kernel_info(key, self._present(self.lookup(key)))

    def getattr_cached(self, key: str) -> ObjectInfo | None:
        """What getattr() would answer for ``key`` right now without a request, or None.
        readdirplus hands the kernel only these: a listing older than the stat TTL
        (``--list-ttl`` above ``--metadata-ttl``) or a file this node is writing must not
        give the kernel attributes that getattr would not."""
        info = self._known(key)
        return None if info is None else self.kernel_info(key, self._present(info))

    def fgetattr(self, fh: int) -> ObjectInfo:
        """fstat(2) of an open file: the file's stat, with the size and time of the version this
        handle reads (as on a local disk), unless another version is read through the page
        cache here (kernel_info). A reader's beside a writer here, or after one, is the file's
        as written (it reads the writes, as on a local disk); one whose name was unlinked or
        renamed here keeps what it opened."""
        handle = self._handle(fh)
        if handle.staged is not None or handle.orphan or handle.info is None:
            return self.handle_info(fh)
        try:
            info = self._present(self.lookup(handle.key))
        except (FileNotFoundError, RemoteError):  # (gone, or the store not answering: what it opened)
            return self.handle_info(fh)
        if info.is_dir or info.link:
            return self.handle_info(fh)
        users = handle.page_users
        if handle.key not in self._staged and not (users is not None and users.written):
            own = self._present(handle.info)
            info = _with_size_and_time(info, own.size, _shown_time(own))
        return self.kernel_info(handle.key, info)

    def kernel_info(self, key: str, info: ObjectInfo) -> ObjectInfo:
        """What the kernel is told of file ``key``: ``info``, but while readers here read another
        version through the kernel's page cache (or passed through), with that version's size
        and time. The kernel keeps one size per file and stops those reads at it: another
        version's size would cut them short, or have the kernel fill them with zeros up to it
        (and a map fault past it, SIGBUS). Handles of the other version read around the page
        cache (direct I/O), to their own end."""
        if info.is_dir or info.link:
            return info
        with self._lock:
            users = self._page_users.get(key)
            if (users is not None and not users.written and users.version != info.version
                    and key not in self._staged):
                # (Only what the kernel uses of it: the rest, a chmod say, is the file's now.)
                group = self._present(users.info)
                info = _with_size_and_time(info, group.size, _shown_time(group))
            shown = (info.size, _shown_time(info))
            told = self._told.get(key)
            # Two different answers: the kernel keeps the one whose request it sent last, which
            # need not be the one made last (answers computed across a change and written back
            # out of order; it drops the older request's): it may hold either.
            self._told[key] = shown if told is None or told == shown else _UNSURE
        return info

    def _told_other_locked(self, key: str, info: ObjectInfo) -> bool:
        """Whether the kernel may hold another size or time of ``key`` than ``info``'s: it was
        told another, or two different ones since it last dropped them."""
        shown = self._present(info)
        return self._told.get(key) != (shown.size, _shown_time(shown))

    def kernel_attrs_stale(self, fh: int) -> bool:
        """Whether the kernel is to drop the attributes it holds for this file before it reads
        it through this handle (it holds another version's size: it would stop this one's reads
        there, or fill them with zeros up to it). Answered once per handle."""
        handle = self._handle(fh)
        stale, handle.stale_kernel_attrs = handle.stale_kernel_attrs, False
        if stale:
            with self._lock:
                self._told.pop(handle.key, None)  # the kernel drops them now: what it is told next
        return stale

    def readdir(self, path: str) -> list[ObjectInfo]:
        key = key_of(path)
        if not self.lookup(key).is_dir:
            raise FsError(errno.ENOTDIR, key)
        children = self.metadata.get_listing(key)
        if children is None and self.listings is not None:
            # A background listing that landed between the lookup above and wait() is gone
            # from the pending set by now, but cached: look again before listing it twice.
            children = self.listings.wait(key) or self.metadata.get_listing(key)
        if children is None:
            children = self._list_now(key)
        if self.listings is not None:
            self.listings.walked_into(key)
        names = {posixpath.basename(c.name) for c in children}
        with self._lock:
            pending = [s for k, s in self._staged.items() if posixpath.dirname(k) == key]
        for staged in pending:  # new files not committed yet are ours to show
            name = posixpath.basename(staged.key)
            if name not in names:
                children.append(self._staged_info(staged))
        return [self._present(c) for c in children]

    def _list_now(self, key: str) -> list[ObjectInfo]:
        """One listing of ``key`` from the remote, cached under a listing token (a change made
        meanwhile keeps the stale answer out of the cache)."""
        token = self.metadata.begin_listing(key)
        children = None
        try:
            children = self.remote.list(key)
        finally:
            cached = self.metadata.end_listing(key, token, children)
        # As cached: with our own changes made meanwhile laid over the answer.
        return (self.metadata.get_listing(key) if cached else None) or children

    def statfs(self) -> dict[str, int]:
        # Object stores have no capacity; report a large, stable figure so df and cp proceed.
        blocks = 1 << 32
        return {"f_bsize": 1 << 20, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": blocks,
                "f_bavail": blocks, "f_files": 1 << 32, "f_ffree": 1 << 32, "f_namemax": NAME_MAX}

    def access(self, path: str, mode: int) -> None:
        self.lookup(key_of(path))
        if mode & os.W_OK and self.read_only:
            raise FsError(errno.EROFS)

    # -- persisted POSIX attributes ------------------------------------------------------------
    def set_attributes(self, path: str, mode: int | None = None, uid: int | None = None, gid: int | None = None,
                       mtime_ns: int | None = None, fh: int | None = None) -> None:
        """chmod, chown, utimens: the fields given replace the stored ones (None: unchanged;
        ``mode`` is taken ``& 0o7777``). See :meth:`_change_attrs` for where they go."""
        fields: dict[str, int] = {}
        for name, value in (("mode", None if mode is None else mode & 0o7777), ("uid", uid), ("gid", gid),
                            ("mtime_ns", mtime_ns)):
            if value is not None:
                fields[name] = value
        if not fields or not self.remote.stores_posix:
            # chown(-1, -1), utimens omitting both times; or a plain fsspec store, which keeps
            # nothing: accepted so cp -p and rsync -a work, as before attributes were stored.
            self.lookup(self._key_for(path, fh))
            return
        self._change_attrs(path, fh, lambda attrs: replace(attrs, **fields))

    def _key_for(self, path: str | None, fh: int | None) -> str:
        if fh is not None:
            handle = self._handle(fh)
            return handle.staged.key if handle.staged is not None else handle.key
        if path is None:
            raise FsError(errno.EBADF, "neither a path nor a handle")
        return key_of(path)

    def _normalized(self, attrs: PosixAttrs, is_dir: bool, current: PosixAttrs = NO_ATTRS) -> PosixAttrs:
        """What is shown anyway is not stored: a mode, uid or gid that nothing stored yet
        (``current``'s is None) set to the mount's default, so ``cp -a`` of 0644 files owned by
        the mounting user stores only their mtimes. A stored value is replaced, never dropped
        (a local file always has its own)."""
        changes: dict[str, None] = {}
        defaults = (("mode", self.dir_mode if is_dir else self.file_mode), ("uid", self.uid), ("gid", self.gid))
        for name, default in defaults:
            if getattr(attrs, name) == default and getattr(current, name) is None:
                changes[name] = None
        return replace(attrs, **changes) if changes else attrs

    def _set_streamed_attrs(self, key: str, attrs: PosixAttrs, version: ObjectVersion | None) -> ObjectVersion | None:
        """After a streamed upload (begun before the attributes were known): one metadata update."""
        return self.remote.set_attrs(key, attrs, version)

    def _posix_of(self, key: str, info: ObjectInfo) -> PosixAttrs:
        """All that is stored for ``info``: a listing may not have carried it (an S3 listing
        whose directory record lacks the entry), then the object's own stat tells."""
        if not key:
            return self._root_attrs
        if info.posix is not None:
            return info.posix
        if info.link:
            return NO_ATTRS
        token = self.metadata.begin_stat(key)
        try:
            fresh = self.remote.stat(key, likely_dir=info.is_dir)
        except FileNotFoundError:
            if not self.metadata.end_stat(key, token, None):
                return self._posix_of(key, self.lookup(key))  # made here meanwhile: as it is now
            self.metadata.invalidate(key)
            raise FileNotFoundError(errno.ENOENT, "no such file", key) from None
        except BaseException:
            self.metadata.end_stat(key, token, None)
            raise
        if not self.metadata.end_stat(key, token, fresh):
            # This node changed it while the remote answered: the answer may be of before (a
            # chmod merged onto it would undo the change).
            return self._posix_of(key, self.lookup(key))
        if fresh.posix is None and fresh.is_dir:
            return self._listed_posix(key)
        return fresh.posix if fresh.posix is not None else NO_ATTRS

    def _listed_posix(self, key: str) -> PosixAttrs:
        """A directory's attributes as its parent's listing tells them: object stores keep them
        in the parent's directory record, which a stat does not read. Only where they must be
        exact (a chmod merges into them, getxattr reads them): one LIST of the parent, cached."""
        parent = posixpath.dirname(key)
        children = self.metadata.get_listing(parent)
        if children is None:
            children = self._list_now(parent)
        found = next((c for c in children if c.name == key), None)
        return found.posix if found is not None and found.posix is not None else NO_ATTRS

    def _attrs_of(self, key: str) -> PosixAttrs:
        """The attributes shown for ``key`` now (this node's uncommitted ones first)."""
        staged = self._staged.get(key)
        if staged is not None and staged.dirty:
            return staged.attrs or NO_ATTRS
        return self._posix_of(key, self.lookup(key))

    def _change_attrs(self, path: str | None, fh: int | None, change: Callable[[PosixAttrs], PosixAttrs]) -> None:
        """Apply ``change`` to a file's or directory's stored attributes.

        A file with uncommitted bytes (open for writing, written): they stay with its staged
        file, are shown at once and go with its commit, no request now. A committed file: one
        metadata-only update conditional on the version seen (S3 CopyObject onto itself, GCS
        PATCH, the syscall locally); if someone changed the object since, the change is applied
        to the object as it is now (one stat, one more update), as chmod on a disk applies to
        the file as it is: only a second change in between is ESTALE. Directories: the remote's
        directory attributes. Symbolic links: nothing is stored (lchown, lutimes succeed).
        Nothing changed (chmod to the mode shown): no request."""
        self._writable()
        key = self._key_for(path, fh)
        handle = self._handle(fh) if fh is not None else None
        staged = handle.staged if handle is not None and handle.staged is not None else self._staged.get(key)
        if staged is not None:
            # Held throughout: waits for a commit in flight (which may leave it clean), and no
            # commit of its writer comes between the update below and the writer's new base.
            with staged.lock:
                if staged.unlinked or staged.dirty:
                    current = staged.attrs or NO_ATTRS
                    staged.set_attrs(self._normalized(change(current), False, current))
                else:
                    self._change_stored_attrs(key, change, staged)
            return
        self._change_stored_attrs(key, change, None)

    def _change_stored_attrs(self, key: str, change: Callable[[PosixAttrs], PosixAttrs],
                             staged: StagedFile | None) -> None:
        info = self.lookup(key)
        if info.link:
            return
        if not key:
            self._set_root_attrs(change)
            return
        for attempt in (1, 2):
            current = self._posix_of(key, info)
            new = self._normalized(change(current), info.is_dir, current)
            if new == current:
                return
            if info.is_dir:
                self.remote.set_dir_attrs(key, new)
                self.metadata.put_own(replace(info, posix=new))
                return
            if self.remote.object_store and new.mtime_ns is None:
                # The store's metadata update gives the object a new timestamp: keep the one
                # shown, as chmod on a disk leaves the mtime alone.
                new = replace(new, mtime_ns=self._present(info).mtime_ns)
            # Taken before the update is sent: an own change of the key meanwhile (a commit
            # of a writer that opened since) makes this update's answer too old to cache.
            token = self.metadata.begin_stat(key)
            try:
                version = self.remote.set_attrs(key, new, info.version)
            except PreconditionFailed:
                if attempt == 2:
                    raise  # changed twice meanwhile: ESTALE
                self.metadata.forget(key)  # someone changed it since our stat: apply to theirs
                info = self.lookup(key)
                if info.is_dir or info.link:
                    raise FsError(errno.ESTALE, f"{key} was replaced meanwhile") from None
                continue
            except FileNotFoundError:
                self.metadata.invalidate(key)
                raise
            except BaseException:
                self.metadata.end_stat(key, token, None)  # (forget and invalidate drop it too)
                raise
            self._attrs_set(key, info, new, version, staged, token)
            return

    def _attrs_set(self, key: str, info: ObjectInfo, attrs: PosixAttrs, version: ObjectVersion | None,
                   staged: StagedFile | None, token: int | None = None) -> None:
        """After a metadata-only update: cache what the store answered (no stat after it), and
        keep an open writer's base on the new version, so its commit is not a conflict with our
        own chmod."""
        if version is None:
            self.metadata.forget(key, changed=True)  # the store did not say: the next lookup asks
        else:
            with self._lock:
                own = self._own_mtimes.get(key)
                if own is not None and own[0] == info.version:
                    self._own_mtimes[key] = (version, own[1])
            self.metadata.put_own(replace(info, version=version, posix=attrs), token)
        if staged is not None and not staged.unlinked:
            with staged.lock:
                if staged.dirty or staged.base_version != info.version:
                    return  # the writer started from other bytes: its commit decides (a conflict)
                staged.attrs = attrs
                staged.base_version = version if version is not None else self._version_now(key)

    def _version_now(self, key: str) -> ObjectVersion | None:
        try:
            return self.lookup(key).version
        except FileNotFoundError:
            return None

    def _set_root_attrs(self, change: Callable[[PosixAttrs], PosixAttrs]) -> None:
        new = self._normalized(change(self._root_attrs), True, self._root_attrs)
        if new == self._root_attrs:
            return
        if not self.remote.object_store:
            self.remote.set_dir_attrs("", new)
        self._root_attrs = new

    # -- extended attributes -------------------------------------------------------------------
    # user.* names are stored with the file (see _change_attrs); the kernel's namespaces
    # (security.*, system.*, trusted.*) hold nothing (ENODATA) and take nothing (ENOTSUP), never
    # EIO. getxattr of a name that is not ours sends no request: the kernel asks for
    # security.capability before every write(2).
    def getxattr(self, path: str, name: str) -> bytes:
        if name == XATTR_URL:
            return self._url_of(key_of(path)).encode()
        if name == XATTR_VERSION:
            info = self.lookup(key_of(path))
            if not info.is_dir and info.version is not None:
                return str(info.version).encode()  # its token: g…, e…, m… (also an ObjectVersion's)
        elif name.startswith("user.") and not name.startswith(XATTR_OURS):
            value = self._attrs_of(key_of(path)).xattr(name)
            if value is not None:
                return value
        raise FsError(errno.ENODATA, name)

    def listxattr(self, path: str) -> list[str]:
        """The stored user.* names. Ours (user.marinfs.*) are read by name only, as CephFS's
        virtual ``ceph.*`` attributes are: listed, ``cp -a``, ``rsync -X`` and ``tar --xattrs``
        would copy them out of the mount onto files they are false for, and into a mount where
        setting them fails (``rsync -aX`` between two mounts would exit 23)."""
        return [name for name, _ in self._attrs_of(key_of(path)).xattrs]

    def setxattr(self, path: str, name: str, value: bytes, flags: int = 0, fh: int | None = None) -> None:
        self._writable()
        key = key_of(path)
        self.lookup(key)
        if name.startswith(XATTR_OURS):
            raise FsError(errno.EPERM, f"{name} is read-only")
        if not name.startswith("user.") or not self.remote.stores_posix:
            raise FsError(errno.ENOTSUP, f"{name}: only user.* attributes are stored, where the store keeps them")
        if len(value) > XATTR_SIZE_MAX:
            raise FsError(errno.E2BIG, f"{name}: {len(value)} bytes")
        def change(attrs: PosixAttrs) -> PosixAttrs:
            exists = attrs.xattr(name) is not None
            if flags & XATTR_CREATE and exists:
                raise FsError(errno.EEXIST, name)
            if flags & XATTR_REPLACE and not exists:
                raise FsError(errno.ENODATA, name)
            new = attrs.with_xattr(name, bytes(value))
            if not self._fits(new):
                # As ext4 when its attribute block is full: the store keeps no more (S3: 2 KiB).
                raise FsError(errno.ENOSPC, f"{key}: the store cannot keep that many bytes of attributes")
            return new

        self._change_attrs(path, fh, change)

    def _fits(self, attrs: PosixAttrs) -> bool:
        """Whether the store can keep ``attrs``: checked before anything is sent, so a value
        too big fails its setxattr with ENOSPC, not a later close with EIO."""
        limit = getattr(self.remote, "max_xattr_bytes", None)
        if limit is None and self.remote.protocol in METADATA_MAX:
            encoded = to_s3(attrs) if self.remote.protocol.startswith("s3") else to_gcs(attrs)
            size = sum(len(k.encode()) + len(v.encode()) for k, v in encoded.items())
            return size <= METADATA_MAX[self.remote.protocol]
        return sum(len(n.encode()) + len(v) for n, v in attrs.xattrs) <= (limit or XATTR_TOTAL_MAX)

    def removexattr(self, path: str, name: str) -> None:
        self._writable()
        key = key_of(path)
        self.lookup(key)
        if name.startswith(XATTR_OURS):
            raise FsError(errno.EPERM, f"{name} is read-only")

        def change(attrs: PosixAttrs) -> PosixAttrs:
            if attrs.xattr(name) is None:
                raise FsError(errno.ENODATA, name)
            return attrs.with_xattr(name, None)

        self._change_attrs(path, None, change)

    def _url_of(self, key: str) -> str:
        """Where ``key`` lives: the remote URL, then ``/key`` (checks that it exists)."""
        self.lookup(key)
        return f"{self.remote.url.rstrip('/')}/{key}" if key else self.remote.url

    # -- open files ----------------------------------------------------------------------------
    def _acquire_staged(self, key: str, info: ObjectInfo | None, truncate: bool,
                        attrs: PosixAttrs | None = None) -> StagedFile:
        """The staged file of ``key``, shared by its writers. An existing file's new content
        keeps its mode, owner and xattrs (as on ext4), not its stored mtime: the next write sets it."""
        if info is not None and info.posix is not None and not info.posix.empty:
            attrs = replace(info.posix, mtime_ns=None)
        with self._lock:
            users = self._page_users.get(key)
            if users is not None:
                users.written = True  # its readers read the writes (and so does the kernel's size)
            staged = self._staged.get(key)
            if staged is None:
                base = dict(remote_url=self.remote.url, base_version=info.version if info else None,
                            attrs=attrs)
                if info is None or truncate or info.size == 0:
                    staged = StagedFile(self.staging_dir, key, seed=None, base_size=0,
                                        dirty=info is None or (truncate and info.size > 0),
                                        stream=self._stream if self.remote.streams else None, **base)
                else:
                    staged = StagedFile(self.staging_dir, key, base_size=info.size,
                                        seed=self.remote.download, **base)
                self._staged[key] = staged
                truncate = False
            staged.refs += 1
        if truncate:
            staged.truncate(0)
        return staged

    def _stream(self, fd: int, key: str, expect: ObjectVersion | None, attrs: PosixAttrs | None = None) -> PartStream:
        """A part upload of a new or truncated file; ``attrs`` (a create mode) go with it."""
        settings = self.remote.settings

        def session() -> Any:
            if attrs is None:
                return self.remote.part_session(key, expect)
            return self.remote.part_session(key, expect, attrs=attrs)

        return PartStream(fd, session, settings.upload_part_size, self.remote.part_pool, settings.upload_concurrency)

    def _release_staged(self, staged: StagedFile) -> None:
        with self._lock:
            staged.refs -= 1
            if staged.refs > 0:
                return
        try:
            # Normally flush committed already; this catches writes that raced the last close.
            # Bytes whose commit just failed go straight to the retry list (the retry loop).
            if not staged.failed_unchanged:
                self._commit(staged)
        except Exception:  # noqa: BLE001 - release cannot report; discard() keeps the bytes
            pass  # logged below, once, if the bytes stay uncommitted
        with self._lock:
            if staged.refs > 0:
                return  # reopened meanwhile
            # By identity: a directory rename may have moved it in the table but not yet
            # given it its new key (see _move_staged).
            for key in [k for k, s in self._staged.items() if s is staged]:
                del self._staged[key]
        staged.discard()
        self._abort_leftovers(staged)
        if staged.kept:
            error = staged.last_error
            code = final_errno(error) if error is not None else None
            entry = FailedCommit(staged.key, staged.path, describe(error) if error else "",
                                 error is not None and is_permanent(error), attempts=max(1, staged.failures),
                                 since=time.time(), retry=retry_of(code))
            if code is not None:  # the next daemon leaves it alone too (or, denied, tries it once)
                mark_final(staged.journal_path, entry.error, code)
            with self._lock:
                self.failed_commits.append(entry)
            self._report_failed(entry, None)

    def retry_failed_commits(self) -> list[Recovered]:
        """Commit again what failed before (the daemon calls this every commit retry interval).
        Nothing to retry (none failed, or only finally): nothing is asked of the remote."""
        with self._lock:
            if not any(not f.final for f in self.failed_commits):
                return []
        return self.recover_staged()

    def recover_staged(self, at_start: bool = False) -> list[Recovered]:
        """Replay every journal in the staging directory whose file is not open here (a crashed
        run's, or a failed commit's), and merge what still fails into ``failed_commits``.
        Journals of final failures are left alone (``at_start``: access refusals are tried once
        more), and listed.

        The remote is called without ``_lock``: a close failing meanwhile appends its own entry,
        and the merge keeps it unless this pass committed its bytes."""
        with self._lock:
            before = {f.staged: f for f in self.failed_commits}
        results = recover(self.staging_dir, self.remote, self.open_staging_files(), at_start=at_start)
        now = time.time()
        reports: list[tuple[FailedCommit, FailedCommit | None]] = []
        with self._lock:
            seen = {r.staged for r in results}
            current = {f.staged: f for f in self.failed_commits}
            # Entries this pass did not look at (appended while it ran) stay as they are.
            merged = {k: f for k, f in current.items() if k not in before and k not in seen}
            for r in results:
                if r.committed_as is not None:
                    if r.conflict:
                        self.conflicts.append({"key": r.key, "committed_as": r.committed_as})
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
            self._report_failed(entry, prev)
        return results

    @staticmethod
    def _report_failed(entry: FailedCommit, prev: FailedCommit | None) -> None:
        """One ERROR line when the bytes are first kept, or when a failure turns out to be one
        that retrying will not cure; later attempts: WARNING if it may pass, else quietly. A
        final failure is reported once by the daemon that met it (and once more by a daemon
        that finds it kept, at its start) and never again: it is not retried in a loop."""
        if entry.final and not (prev is not None and prev.final):
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

    def upload_status(self) -> dict[str, Any]:
        """Open files with uncommitted bytes, and commits that failed (their bytes kept on disk)."""
        with self._lock:
            pending = sorted(k for k, st in self._staged.items() if st.dirty and not st.unlinked)
            failed = [f.as_dict() for f in self.failed_commits]
            conflicts = list(self.conflicts)
        return {"pending": pending, "failed": failed, "conflicts": conflicts}

    def open_staging_files(self) -> frozenset[str]:
        """Staging files of files open right now (recovery must leave them to their writers)."""
        with self._lock:
            return frozenset(st.path for st in self._staged.values())

    def _new_handle(self, handle: Handle) -> int:
        with self._lock:
            fh = next(self._next_fh)
            self._handles[fh] = handle
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    def open(self, path: str, flags: int) -> int:
        key = key_of(path)
        writable = (flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
        if writable or flags & os.O_TRUNC:
            self._writable()
        if writable and key not in self._staged:
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
        staged = self._writer_staged(key, info, bool(flags & os.O_TRUNC)) if writable else None
        handle = Handle(key=key, flags=flags, info=info, staged=staged)
        with self._lock:
            users = self._page_users.get(key)
            tracked = not writable and info.version is not None
            # O_DIRECT: the kernel would open the backing file with it, and the cache's disk
            # then refuses unaligned reads (EINVAL) that FUSE serves: such opens read through
            # the daemon, and never make a backing.
            direct_open = bool(flags & getattr(os, "O_DIRECT", 0))
            if tracked and users is not None and users.version != info.version:
                # close(2) does not wait for the daemon's release: a reader of the old version
                # that has just closed (a server reloading its model) is let go first.
                deadline = time.monotonic() + self.release_grace
                while users is not None and users.version != info.version:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._released.wait(left)
                    users = self._page_users.get(key)
            if (tracked and not direct_open and users is None and key not in self._staged
                    and not self._bystanders_locked(key)):
                backing = self._whole_version_locked(key, info)
                if backing is not None:  # (a version cached whole: see below)
                    users = self._page_users[key] = PageUsers(key, info.version, info, backing=backing)
                    handle.stale_kernel_attrs = self._told_other_locked(key, info)
            if users is not None and users.backing is not None:  # (never a writer: _writer_staged)
                self._carry_locked(handle, users, member=tracked and users.version == info.version
                                   and key not in self._staged and not direct_open)
            elif tracked and users is not None and users.version != info.version:
                # The kernel keeps one page cache per file, shared by every handle: readers of
                # another version are filling it. This one reads around it, so neither side
                # reads the other's bytes; the page cache and its pages stay theirs (kept:
                # dropping them would only make them read again). docs/semantics.md.
                handle.direct = handle.keep_kernel_cache = True
            else:
                previous = self._kernel_versions.get(key)
                handle.keep_kernel_cache = (tracked and key not in self._staged
                                            and (previous == info.version or self.metadata.is_immutable(key))
                                            and not (users is not None and users.dropping and not users.filled))
                self._kernel_versions[key] = None if writable else info.version
                if tracked:
                    if users is None:
                        users = self._page_users[key] = PageUsers(key, info.version, info,
                                                                  written=key in self._staged,
                                                                  dropping=not handle.keep_kernel_cache)
                    users.count += 1
                    handle.page_users = users
                    handle.stale_kernel_attrs = self._told_other_locked(key, info)
        if self.walkahead is not None and not writable and info.version is not None:
            self.walkahead.opened(info)
        return self._new_handle(handle)

    def _fetch_ahead(self, info: ObjectInfo) -> bool:
        """Fetch a file a walker is about to open (WalkAhead): unless this node is writing it."""
        if info.name in self._staged:
            return True
        return self.fetcher.fetch_ahead(self._ref(info.name, info))

    def _ref(self, key: str, info: ObjectInfo, unversioned: int = 0) -> ObjectRef:
        """What reads of ``info`` fetch and key their chunks by (``unversioned``: a handle's id,
        for an object without a version: its chunks are its own)."""
        version = info.version or ObjectVersion.unversioned(unversioned)
        return ObjectRef(url=f"{self.remote.url}/{key}", key=key, version=version, size=info.size)

    def _writer_staged(self, key: str, info: ObjectInfo | None, truncate: bool,
                       attrs: PosixAttrs | None = None) -> StagedFile:
        """The staged file a writer opens, unless the kernel reads the file from a backing here
        (passthrough): every open of it would have to carry that backing, and a writer's shared
        map of it would write into the chunk cache, so it is refused (``ETXTBSY``, as for a
        program being run) once the readers had a moment to close. No backing is made for it
        while it opens (``_writers_opening``), nor later while its staged file lives."""
        with self._lock:
            users = self._page_users.get(key)
            deadline = time.monotonic() + self.release_grace
            while users is not None and users.backing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FsError(errno.ETXTBSY, f"{key} is open here through passthrough; "
                                  f"close its readers before writing it")
                self._released.wait(left)
                users = self._page_users.get(key)
            self._writers_opening[key] = self._writers_opening.get(key, 0) + 1
        try:
            return self._acquire_staged(key, info, truncate, attrs=attrs)
        finally:
            with self._lock:
                left_opening = self._writers_opening[key] - 1
                if left_opening:
                    self._writers_opening[key] = left_opening
                else:
                    del self._writers_opening[key]

    def _bystanders_locked(self, key: str) -> bool:
        """Whether a handle of ``key`` is open that neither reads through a page-cache group nor
        carries a backing (a direct reader of another version, an unversioned reader), or a
        writer is opening: no backing may be made then (the kernel would refuse those handles'
        maps, or the backing's opens)."""
        if key in self._writers_opening:
            return True
        return any(h.key == key and not h.orphan and h.page_users is None and h.carries is None
                   for h in self._handles.values())

    def _carry_locked(self, handle: Handle, users: PageUsers, member: bool) -> None:
        """``handle``, a reader, opens an inode the kernel reads from a backing file
        (passthrough): while any handle carrying it is open, every open of that inode must carry
        it too (the kernel refuses any other, EIO). A member (``users``' version) is read by the
        kernel from it; a reader of another version (or an O_DIRECT one) reads through the
        daemon (direct I/O: the kernel then sends its reads here), but a map of it shows the
        backing file's pages."""
        assert users.backing is not None
        users.count += 1
        handle.backing_id = users.backing.id
        if member:
            handle.page_users = users
            self.passthrough_opens += 1
            return
        handle.carries, handle.direct = users, True
        if handle.info is not None and handle.info.version != users.version:
            log.info("%s: another version is open here through passthrough; this open reads the new "
                     "version, but a map of it shows the older one until those handles close", users.key)

    def _whole_version_locked(self, key: str, info: ObjectInfo) -> Backing | None:
        """``info``'s version, registered with the kernel for passthrough, if the chunk cache
        holds all of it (pinned there until the backing is dropped); else None."""
        cache = self.fetcher.cache
        if self.backings is None or cache is None or info.version is None or info.size <= 0:
            return None
        chunk = self.fetcher.chunk_size
        object_id = cache_id(f"{self.remote.url}/{key}", str(info.version))
        chunks = -(-info.size // chunk)
        fd = cache.pin(object_id, chunks, info.size)
        if fd is None:
            # Whole but not read since this daemon started (a restart keeps the cache): its
            # checksums are checked meanwhile, so that a later open passes through.
            cache.verify_later(object_id, chunks, info.size)
            return None
        try:
            backing_id = self.backings.register(fd)
        except OSError as exc:
            os.close(fd)
            cache.unpin(object_id)
            log.warning("passthrough refused for %s (%s): files are read through the daemon from now on", key, exc)
            self.backings = None  # the kernel refuses this mount's backing files: stop asking
            return None
        return Backing(backing_id, fd, object_id, self.backings)

    def _drop_backing(self, backing: Backing) -> None:
        """The last handle of a passthrough version is gone: unregister and unpin it."""
        try:
            backing.via.unregister(backing.id)
        except OSError as exc:
            log.warning("passthrough: cannot drop backing %d: %s", backing.id, exc)
        finally:
            os.close(backing.fd)
            if self.fetcher.cache is not None:
                self.fetcher.cache.unpin(backing.object_id)

    def passes_through(self, fh: int) -> int:
        """The backing id this handle is opened with (passthrough), or 0: the kernel reads its
        bytes from that file, unless it bypasses the kernel's caches (then through the daemon)."""
        return self._handle(fh).backing_id

    def handle_info(self, fh: int) -> ObjectInfo:
        """An open file's attributes by its handle: it may have no name any more (unlinked)."""
        handle = self._handle(fh)
        staged = handle.staged
        if staged is not None:
            return self._staged_info(staged)
        if handle.info is None:
            raise FsError(errno.EBADF)
        return handle.info

    def keeps_kernel_cache(self, fh: int) -> bool:
        """Whether the kernel may keep the pages it cached for this file (version unchanged)."""
        return self._handle(fh).keep_kernel_cache

    def bypasses_kernel_cache(self, fh: int) -> bool:
        """Whether this handle's reads must go around the kernel's page cache (direct I/O):
        handles of another version of the file are open and reading through it."""
        return self._handle(fh).direct

    def create(self, path: str, flags: int, mode: int | None = None) -> int:
        """A new file (an existing one is opened: ``mode`` applies only to new files). Its mode
        is stored only if it is not the mount's ``--file-mode``, so plain writes carry nothing."""
        self._writable()
        key = key_of(path)
        self.remote.check_key(key)  # a name the store cannot hold fails here, not at every commit
        existing = self._lookup_or_none(key)
        if existing is not None:
            if flags & os.O_EXCL:
                raise FsError(errno.EEXIST, key)
            return self.open(path, flags)
        self._require_dir(posixpath.dirname(key))
        self._file_name_allowed(key)
        self.metadata.forget(key)  # the listing stays: the staged file shows until committed
        keep = mode is not None and self.remote.stores_posix
        attrs = self._normalized(PosixAttrs(mode=mode & 0o7777), False) if keep else None
        staged = self._writer_staged(key, None, truncate=False, attrs=None if attrs is None or attrs.empty else attrs)
        return self._new_handle(Handle(key=key, flags=flags, info=None, staged=staged))

    def _file_name_allowed(self, key: str) -> None:
        """Where links are ``NAME.rclonelink`` objects, a file of such a name would read back as
        a link: EPERM, as for any other kind of file the store cannot hold."""
        if self.remote.link_objects and key.endswith(LINK_SUFFIX):
            raise FsError(errno.EPERM, f"{key}: names ending in {LINK_SUFFIX} are links on this store")

    def mknod(self, path: str, mode: int) -> None:
        """mknod(2): a regular file is an empty object, made as create + close make it. Fifos,
        sockets and devices cannot be objects: EPERM, what the kernel answers for a
        filesystem without them (vfat), so mkfifo and bind() fail cleanly and leave nothing."""
        self._writable()
        key = key_of(path)
        if self._lookup_or_none(key) is not None:
            raise FsError(errno.EEXIST, key)
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            raise FsError(errno.EPERM, f"{key}: only regular files and directories can be objects")
        fh = self.create(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, stat.S_IMODE(mode) or None)
        try:
            self.flush(fh)
        finally:
            self.release(fh)

    def read(self, fh: int, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` as ``bytes`` (see read_into)."""
        view = memoryview(bytearray(max(0, size)))
        return view[:self.read_into(fh, view, offset)].tobytes()

    def read_into(self, fh: int, dest: memoryview, offset: int) -> int:
        """Fill ``dest`` (writable bytes: the FUSE reply buffer) with the file's bytes at
        ``offset``, no more than it has there; answers how many. The bytes are copied once, from
        a chunk in memory or read from a cached chunk or a staging file straight into ``dest``."""
        handle = self._handle(fh)
        staged = handle.staged
        if staged is None and not handle.orphan:  # (an orphan's name is another file's now)
            other = self._staged.get(handle.key)  # another handle's uncommitted writes
            staged = other if other is not None and other.dirty else None
        if staged is not None:
            return staged.read_into(dest, offset)
        reader = self._reader(handle)
        try:
            n = reader.read_into(dest, offset)
        except StaleVersionError:
            assert handle.info is not None
            opened = handle.info.version
            with self._lock:
                if handle.served or not self._may_repin_locked(handle, opened):
                    raise  # never mix versions within one handle: ESTALE
            # Nothing served yet: the stat we opened with was stale. Open the new version.
            self.metadata.invalidate(handle.key)
            info = self.lookup(handle.key)
            with self._lock:
                if handle.served or not self._may_repin_locked(handle, opened):  # a read or a reader came meanwhile
                    raise
                if handle.page_users is not None:  # the only reader of the page cache: it follows
                    if info.size > handle.info.size:
                        # The kernel holds the opened version's size and would stop reads there
                        # (a shorter one's first short read makes it the size).
                        raise
                    handle.page_users.version, handle.page_users.info = info.version, info
                    self._kernel_versions[handle.page_users.key] = info.version
                handle.info, handle.reader = info, None
            reader = self._reader(handle)
            n = reader.read_into(dest, offset)
        if handle.served and handle.reader is reader:
            return n  # both set under the lock; once served, the reader never changes again
        with self._lock:
            if handle.reader is not reader:
                # Another read of this handle moved it to a newer version while this one read
                # the old: fail this one rather than answer both.
                raise StaleVersionError(f"{handle.key} changed while it was read")
            handle.served = True  # only bytes actually returned pin the handle to its version
            if handle.page_users is not None:
                handle.page_users.filled = True
        return n

    def _may_repin_locked(self, handle: Handle, opened: ObjectVersion | None) -> bool:
        """Whether a handle that served nothing may move to the object's new version. Through
        the kernel's page cache only if nothing there can be the old version's: the kernel
        dropped the file's pages at this open (no keep_cache), no reader of its version served
        any since, and it is the only one (under ``self._lock``)."""
        if handle.orphan:
            return False  # its name was unlinked or renamed here: the name's object is another file's
        users = handle.page_users
        if users is None:
            return True
        return (not handle.keep_kernel_cache and users.count == 1 and not users.filled
                and users.version == opened and self._page_users.get(users.key) is users)

    def _reader(self, handle: Handle) -> ObjectReader:
        reader = handle.reader
        if reader is None:
            with self._lock:  # one reader per version of a handle, however many reads ask at once
                reader = handle.reader
                if reader is None:
                    info = handle.info
                    assert info is not None
                    reader = handle.reader = ObjectReader(self._ref(handle.key, info, id(handle)), self.fetcher,
                                                          self.max_readahead_chunks)
        return reader

    def write(self, fh: int, data: bytes | memoryview, offset: int) -> int:
        """``data`` may be a view of the FUSE request buffer: used during the call, never kept."""
        handle = self._handle(fh)
        if handle.staged is None:
            raise FsError(errno.EBADF, "file not open for writing")
        self._check_size((handle.staged.known_size() if handle.append else offset) + len(data))
        return handle.staged.write(data, None if handle.append else offset)

    def _check_size(self, size: int) -> None:
        """A file may grow to ``size`` bytes: else EFBIG, as a disk answers past its largest file."""
        if size > self.max_file_size:
            raise FsError(errno.EFBIG, f"{size} bytes is more than --max-file-size ({self.max_file_size})")

    def flush(self, fh: int) -> None:
        """Commit on close: returns only once the remote has the bytes, or raises its error."""
        handle = self._handle(fh)
        if handle.staged is not None:
            self._commit(handle.staged)

    fsync = flush

    def _commit(self, staged: StagedFile) -> None:
        with staged.lock:  # (a rename's rekey, a chmod: not between the upload and the cache)
            self._commit_locked(staged)

    def _commit_locked(self, staged: StagedFile) -> None:
        if not staged.dirty or staged.unlinked:
            return
        key = staged.key
        token = self.metadata.begin_stat(key)
        try:
            done = commit_or_conflict(lambda k, expect: staged.commit(self.remote.upload, key=k, expect=expect,
                                                                      set_attrs=self._set_streamed_attrs),
                                      key, staged.base_version, Path(staged.path))
        except BaseException as exc:
            self.metadata.invalidate(key)
            staged.failures += 1
            staged.failed_changes = staged.changes
            staged.last_error = exc
            raise
        finally:
            with self._lock:
                self._kernel_versions.pop(key, None)
        if done.conflict:
            # Someone else replaced (or removed) the object under our writer: it was not
            # overwritten, our bytes are beside it, and close() says so (docs/semantics.md).
            self.metadata.invalidate(key)
            self.metadata.invalidate(done.committed_as)
            with self._lock:
                self.conflicts.append({"key": key, "committed_as": done.committed_as})
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
        staged.base_version = version or info.version
        self._abort_leftovers(staged)
        # The kernel may still hold the writer's mtime for a moment: keep showing it for the
        # version we wrote, so tools that compare stats (tar) do not see a change that was not.
        if info.version:
            with self._lock:
                self._own_mtimes[key] = (info.version, staged.mtime_ns)
        self.metadata.put_own(info, token)
        self._entries_changed(key)

    def _entries_changed(self, *keys: str) -> None:
        """The directories of ``keys`` gained, lost or replaced an entry. A local disk's
        directories have real times that this moves (a commit renames into place): their
        cached stats go, so ``rsync -a`` and ``tar`` setting a directory's mtime after its
        files compare with the time it has now. Object stores keep a directory's time as set."""
        if self.remote.object_store or not self.remote.lists_posix:
            return
        for key in keys:
            parent = posixpath.dirname(key)
            if parent:
                self.metadata.forget(parent, changed=True)

    def _present(self, info: ObjectInfo) -> ObjectInfo:
        """``info`` as a stat shows it: the writer's time for the version it committed, and on a
        local disk the mount's modes and owner where a file has what the daemon gives its own."""
        own = self._own_mtimes.get(info.name) if not info.is_dir else None
        if own is not None and own[0] == info.version and own[1] != info.mtime_ns:
            info = replace(info, mtime_ns=own[1])
        if self._native is not None and info.posix is not None and not info.link:
            info = info.with_posix(self._as_mounted(info.posix, info.is_dir))
        return info

    def _as_mounted(self, posix: PosixAttrs, is_dir: bool) -> PosixAttrs:
        """A local file always has a mode and an owner; those it got from the daemon itself
        (its own uid and gid, its umask's mode, as every file it wrote) show as the mount's
        ``--uid``/``--gid`` and ``--file-mode``/``--dir-mode``, so these settings mean on a local
        disk what they mean on object stores; a chmod or chown to anything else shows as set."""
        uid, gid, file_mode, dir_mode = self._native  # type: ignore[misc]
        changes: dict[str, None] = {}
        if posix.uid == uid:
            changes["uid"] = None
        if posix.gid == gid:
            changes["gid"] = None
        if posix.mode == (dir_mode if is_dir else file_mode):
            changes["mode"] = None
        return replace(posix, **changes) if changes else posix

    def release(self, fh: int) -> None:
        backing = None
        with self._lock:
            handle = self._handles.pop(fh, None)
            users = (handle.page_users or handle.carries) if handle is not None else None
            if users is not None:
                users.count -= 1
                if not users.count:
                    backing, users.backing = users.backing, None
                    if self._page_users.get(users.key) is users:
                        del self._page_users[users.key]
                        self._released.notify_all()
        if backing is not None:
            self._drop_backing(backing)
        if handle is not None and handle.reader is not None:
            handle.reader.close()
        if handle is not None and handle.staged is not None:
            self._release_staged(handle.staged)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        self._writable()
        if length < 0:
            raise FsError(errno.EINVAL)
        self._check_size(length)
        if fh is not None:
            handle = self._handle(fh)
            if handle.staged is None:
                raise FsError(errno.EBADF, "file not open for writing")
            handle.staged.truncate(length)
            return
        key = key_of(path)
        info = self.lookup(key)
        if info.is_dir:
            raise FsError(errno.EISDIR, key)
        if key not in self._staged and info.posix is None:  # (a listing's): the commit keeps them
            info = replace(info, posix=self._posix_of(key, info))
        staged = self._acquire_staged(key, info, truncate=False)
        try:
            staged.truncate(length)
            self._commit(staged)
        finally:
            self._release_staged(staged)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on a file open for writing, applied to its staged file: mode 0 reserves
        and extends the size like ext4 (zeros, committed at close); KEEP_SIZE only reserves.
        Punching holes, zeroing or collapsing ranges: EOPNOTSUPP (the object is uploaded whole;
        a hole is just zeros to write). Read-only handle: EBADF, as ext4 (the kernel checks that
        itself before it reaches us)."""
        if mode & ~FALLOC_FL_KEEP_SIZE:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x}")
        if offset < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        staged = self._handle(fh).staged
        if staged is None:
            raise FsError(errno.EBADF, "file not open for writing")
        if not mode & FALLOC_FL_KEEP_SIZE:
            self._check_size(offset + length)
        with staged.lock:
            reserve(staged.fd, offset, length)  # ENOSPC here changes nothing
            if not mode & FALLOC_FL_KEEP_SIZE and offset + length > staged.known_size():
                staged.truncate(offset + length)  # the new bytes are zeros, as on ext4

    # -- namespace -----------------------------------------------------------------------------
    def symlink(self, target: str, path: str) -> None:
        """symlink(2): ``path`` becomes a link whose content is ``target``, text that marinfs
        stores in the backend's convention and never follows (the kernel resolves links)."""
        self._writable()
        key = key_of(path)
        data = target.encode("utf-8", "surrogateescape")
        if not data:
            raise FsError(errno.ENOENT, "an empty link target")
        if len(data) >= PATH_MAX:
            raise FsError(errno.ENAMETOOLONG, "link target")
        self.remote.check_key(key)
        if not key or self._lookup_or_none(key) is not None:
            raise FsError(errno.EEXIST, key)
        self._require_dir(posixpath.dirname(key))
        try:
            version = self.remote.symlink(key, target)
        finally:
            self.metadata.forget(key)
        if version is None:  # the store did not say: its stat, as a listing will show it
            try:
                info = self.remote.stat(key)
            except FileNotFoundError:
                self.metadata.invalidate(key)
                return  # removed meanwhile by someone else
        else:
            # The PUT answered the version (S3 ETag, GCS generation): no stat needed. Its time
            # is shown as ours for that version, as for a committed file (see _commit).
            info = ObjectInfo(name=key, is_dir=False, size=len(data), mtime_ns=time.time_ns(), version=version,
                              link=True, target=target)
            with self._lock:
                self._own_mtimes[key] = (version, info.mtime_ns)
        self.metadata.put_own(info)
        self._entries_changed(key)

    def readlink(self, path: str) -> str:
        """The target text of link ``path``: from its stat where the store keeps it there (local
        disks, GCS), else one small GET (an S3 link's body), cached with the link's version."""
        key = key_of(path)
        info = self.lookup(key)
        if not info.link:
            raise FsError(errno.EINVAL, f"{key} is not a symbolic link")
        cache_key = (key, str(info.version)) if info.version is not None else None
        if info.target is None and cache_key is not None:
            with self._lock:
                cached = self._link_targets.get(cache_key)
            if cached is not None:
                return cached
        try:
            target = self.remote.readlink(key, info)
        except (FileNotFoundError, StaleVersionError):
            self.metadata.invalidate(key)  # gone or changed since its stat: look again
            info = self.lookup(key)
            if not info.link:
                raise FsError(errno.EINVAL, f"{key} is not a symbolic link") from None
            target = self.remote.readlink(key, info)
            cache_key = (key, str(info.version)) if info.version is not None else None
        if info.target is None and cache_key is not None:
            with self._lock:
                self._link_targets[cache_key] = target
        return target

    def unlink(self, path: str) -> None:
        self._writable()
        key = key_of(path)
        info = self.lookup(key)
        if info.is_dir:
            raise FsError(errno.EISDIR, key)
        if info.link:
            try:
                self.remote.delete_link(key)
            finally:
                self.metadata.invalidate(key)
                self._entries_changed(key)
            return
        open_staged = self._staged.get(key)
        if open_staged is not None:
            open_staged.keep_old_bytes()  # still open: its descriptors keep the bytes
        with self._lock:
            staged = self._staged.pop(key, None)
        if staged is not None:  # (its lock waits for a commit in flight: never under ours)
            staged.mark_unlinked()  # open handles keep working; nothing is committed
        gone = False
        try:
            self.remote.delete(key)
            gone = True
        except FileNotFoundError:
            if staged is None:
                raise
            gone = True  # never committed: nothing to delete
        finally:
            if gone:  # its parent's listing stays valid without it
                self.metadata.removed_own(key)
            else:
                self.metadata.invalidate(key)
            self._entries_changed(key)
        self._forget_inodes(key)

    def mkdir(self, path: str, mode: int | None = None) -> None:
        """A directory; its mode is stored only if it is not the mount's ``--dir-mode``."""
        self._writable()
        key = key_of(path)
        self.remote.check_key(key)
        if not key or self._lookup_or_none(key) is not None:
            raise FsError(errno.EEXIST, key)
        self._require_dir(posixpath.dirname(key))
        self.remote.make_dir(key)
        keep = mode is not None and self.remote.stores_posix
        attrs = self._normalized(PosixAttrs(mode=mode & 0o7777), True) if keep else NO_ATTRS
        if not attrs.empty:
            self.remote.set_dir_attrs(key, attrs)
        self.metadata.put_own(ObjectInfo(name=key, is_dir=True, mtime_ns=time.time_ns(), posix=attrs))
        self.metadata.put_listing(key, [])  # we just made it: nothing is in it yet
        self._entries_changed(key)

    def rmdir(self, path: str) -> None:
        self._writable()
        key = key_of(path)
        if not key:
            raise FsError(errno.EBUSY, "cannot remove the mount root")
        info = self._lookup_or_none(key)
        if info is None:
            raise FsError(errno.ENOENT, key)
        if not info.is_dir:
            raise FsError(errno.ENOTDIR, key)
        self._check_empty(key)
        self.remote.remove_dir(key)
        self.metadata.invalidate_tree(key)
        self._entries_changed(key)

    def _check_empty(self, key: str) -> None:
        try:
            children = self.remote.list(key)
        except FileNotFoundError:
            # An implicit directory vanishes with its last object: removing it is a success.
            children = []
        prefix = key + "/"
        with self._lock:
            pending = any(k.startswith(prefix) for k in self._staged)
        if children or pending:
            raise FsError(errno.ENOTEMPTY, key)

    def rename(self, old: str, new: str) -> None:
        self._writable()
        src, dst = key_of(old), key_of(new)
        if src == dst:
            return
        self.remote.check_key(dst)
        if not src or dst.startswith(src + "/"):
            raise FsError(errno.EINVAL, f"cannot move {src!r} into itself")
        info = self.lookup(src)
        target = self._lookup_or_none(dst)
        self._require_dir(posixpath.dirname(dst))
        in_place = self._in_place_readers(src) if self.remote.renames_in_place else []
        staged = src in self._staged  # (before the rename moves it to dst)
        self._renaming.moves, self._renaming.copied = [], {}
        try:
            self._rename_remote(src, dst, info, target, new)
            moves, copied = self._renaming.moves, self._renaming.copied
        finally:
            self._renaming.moves = self._renaming.copied = None  # a failed rename moves no reader
        self._follow(moves)
        if in_place:
            self._follow_in_place(src, dst, in_place)
        renamed = self._renamed_info(dst, info, target, copied.get(src), staged)
        if renamed is not None:  # both parents' listings stay valid: rsync renames every file
            self.metadata.removed_own(src)
            self.metadata.put_own(renamed)
        else:
            self.metadata.invalidate_tree(src)
            self.metadata.invalidate_tree(dst)
        self._entries_changed(src, dst)
        self._move_inodes(src, dst)

    def _renamed_info(self, dst: str, info: ObjectInfo, target: ObjectInfo | None,
                      copied: tuple[ObjectVersion, ObjectVersion] | None, staged: bool) -> ObjectInfo | None:
        """What a stat of ``dst`` answers after a file rename here, where this node knows it
        all: the remote copied exactly the version ``info`` describes (``copied``: that version
        and the copy's), and the time shown is one the copy kept (a stored mtime: the copy's
        own is new); else None (ask the remote). Not for a file with writes staged here (its
        size may have grown since ``info``)."""
        if (info.is_dir or info.link or (target is not None and target.link) or staged
                or self.remote.renames_in_place):  # (a local rename is a syscall: its stat costs as much)
            return None
        if copied is None or info.version is None or copied[0] != info.version:
            return None  # (the object changed since our stat: its size and attributes may have too)
        if info.posix is None or info.posix.mtime_ns is None:
            return None
        return replace(info, name=dst, version=copied[1])

    def _rename_remote(self, src: str, dst: str, info: ObjectInfo, target: ObjectInfo | None, new: str) -> None:
        if info.is_dir:
            if target is not None and not target.is_dir:
                raise FsError(errno.ENOTDIR, dst)
            if target is not None:
                self._check_empty(dst)
                self.remote.remove_dir(dst)
            self._rename_dir(src, dst)
        else:
            if target is not None and target.is_dir:
                raise FsError(errno.EISDIR, dst)
            if not info.link:
                self._file_name_allowed(dst)
            if target is not None and target.link != info.link and self.remote.link_objects:
                # A link and a file of one name are different objects (x.rclonelink, x): the
                # one replaced goes first. Not atomic, like every rename on an object store.
                if target.link:
                    self.remote.delete_link(dst)
                else:
                    self.unlink(new)
            if info.link:
                self.remote.rename_link(src, dst)
            else:
                self._rename_file(src, dst)

    def _in_place_readers(self, src: str) -> list[tuple[Handle, str, ObjectVersion]]:
        """Before a rename(2) of ``src``: the read handles under it whose file is still the very
        version they read (its ctime too: an in-place rewrite keeping size and mtime is not)."""
        with self._lock:
            found = [(handle, handle.key, handle.info.version) for handle in self._handles.values()
                     if handle.staged is None and handle.info is not None
                     and handle.info.version is not None and _under(handle.key, src)]
        keep = []
        for handle, key, version in found:
            try:
                if self.remote.stat(key).version == version:
                    keep.append((handle, key, version))
            except OSError:
                pass
        return keep

    def _follow_in_place(self, src: str, dst: str, readers: list[tuple[Handle, str, ObjectVersion]]) -> None:
        """A rename(2) here moved the files themselves: the read handles found before it follow
        to the new names, with the version each file has now (its ctime moved on; its inode,
        size and mtime did not, or it is not the same file, and the handle stays)."""
        moves = []
        for handle, was, version in readers:
            key = dst + was[len(src):]
            try:
                now = self.remote.stat(key).version
            except OSError:
                continue
            if now is not None and now.same_file(version):
                moves.append((handle, was, version, key, now))
        self._follow(moves)

    def _upload_session(self, local_path: str, record: dict[str, Any], opened: bool) -> None:
        """An upload of staging file ``local_path`` opened (or ended) a session the store keeps
        apart: its staged file journals it, or, for a replay of a kept commit, its journal."""
        with self._lock:
            staged = next((st for st in self._staged.values() if st.path == local_path), None)
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

    def _moved(self, src: str, dst: str, old: ObjectVersion, new: ObjectVersion) -> None:
        """The remote made ``dst`` a copy of exactly version ``old`` of ``src``, as its version
        ``new`` (during a rename here, before the source goes): once the rename is done, read
        handles of that version follow it, as an open file on a disk keeps reading after a
        ``mv``. Handles of another version (the source changed since they opened) stay, and
        find it gone (ESTALE). Outside a rename of this thread's, nothing moves."""
        moves = getattr(self._renaming, "moves", None)
        if moves is None:
            return
        self._renaming.copied[src] = (old, new)
        with self._lock:
            moves.extend((handle, src, old, dst, new) for handle in self._handles.values()
                         if handle.staged is None and handle.key == src
                         and handle.info is not None and handle.info.version == old)

    def _follow(self, moves: list[tuple[Handle, str, ObjectVersion, str, ObjectVersion]]) -> None:
        """Apply moves (handle, its key and version then, new key, new version) whose handle
        is still there as it was; their readers are told outside our lock."""
        readers = []
        with self._lock:
            for handle, was, version, key, now in moves:
                if handle.key == was and handle.info is not None and handle.info.version == version:
                    readers.append(self._follow_locked(handle, key, now))
        self._move_readers(readers)

    def _follow_locked(self, handle: Handle, key: str,
                       version: ObjectVersion) -> tuple[ObjectReader | None, ObjectRef]:
        """Handle ``handle`` reads ``key``'s ``version`` from now on: the bytes it was reading,
        under their new name. It never moves to a later version of either name (orphan).
        Answers its reader and what it is to read, for _move_readers (outside our lock)."""
        assert handle.info is not None
        users = handle.page_users
        if users is not None and users.version == handle.info.version:  # its inode's pages: the same bytes
            users.version, users.info = version, replace(users.info, name=key, version=version)
        handle.key, handle.orphan = key, True
        handle.info = replace(handle.info, name=key, version=version)
        return handle.reader, self._ref(key, handle.info)

    @staticmethod
    def _move_readers(moves: list[tuple[ObjectReader | None, ObjectRef]]) -> None:
        for reader, ref in moves:
            if reader is not None:
                reader.moved(ref)

    def _forget_inodes(self, key: str) -> None:
        """``key`` (a file or a tree) was unlinked here, or replaced by a rename: the kernel's
        next open of each name is of another inode, with a page cache of its own."""
        with self._lock:
            self._orphan_handles_locked(key)
            for k in [k for k in self._page_users if _under(k, key)]:
                del self._page_users[k]
            self._told.pop(key, None)  # (a tree's files: their next opens may ask the kernel again)

    def _move_inodes(self, src: str, dst: str) -> None:
        """A rename here moved the inodes (libfuse renames the node) and their page caches:
        their readers now count under the new names. The objects there are copies, of other
        versions, and of what the source held when copied, which may not be what the readers
        read: the next open of a new name reads around the page cache until they close."""
        self._forget_inodes(dst)
        with self._lock:
            self._orphan_handles_locked(src)
            moved = [self._page_users.pop(k) for k in list(self._page_users) if _under(k, src)]
            for users in moved:
                users.key = dst + users.key[len(src):]
                self._page_users[users.key] = users
            told = self._told.pop(src, None)
            if told is not None:
                self._told[dst] = told

    def _orphan_handles_locked(self, key: str) -> None:
        """Read handles of ``key`` (a file or a tree) whose name was unlinked or renamed here."""
        for handle in self._handles.values():
            if handle.staged is None and _under(handle.key, key):
                handle.orphan = True

    def _move_staged(self, src: str, dst: str) -> None:
        """Open staged files follow their rename, so later writes commit under the new name.
        A replaced target that is still open becomes nameless, as on a local disk."""
        with self._lock:
            replaced = self._staged.pop(dst, None)
            moving = [k for k in self._staged if k == src or k.startswith(src + "/")]
            moves = []
            for k in moving:
                staged = self._staged.pop(k)
                self._staged[dst + k[len(src):]] = staged
                moves.append((staged, dst + k[len(src):]))
        for staged, new_key in moves:
            staged.rekey(new_key)  # (its lock outside ours: a rename holds it while it takes ours)
            # The rename made a new object: the writer's next commit replaces that one.
            try:
                staged.base_version = self.remote.stat(staged.key).version
            except FileNotFoundError:
                staged.base_version = None
        if replaced is not None:
            replaced.mark_unlinked()

    def _rename_file(self, src: str, dst: str) -> None:
        staged = self._staged.get(src)
        if staged is None:
            self._rename_file_locked(src, dst, None)
            return
        with staged.lock:  # no flush of its writer between the remote rename and the rekey
            self._rename_file_locked(src, dst, staged)

    def _rename_file_locked(self, src: str, dst: str, staged: StagedFile | None) -> None:
        if staged is not None:
            self._commit(staged)  # the remote must hold the bytes we are about to move
        replaced = self._staged.get(dst)
        if replaced is not None:
            replaced.keep_old_bytes()  # still open: its descriptors keep the bytes
        self.remote.rename(src, dst)
        self._move_staged(src, dst)

    def _rename_dir(self, src: str, dst: str) -> None:
        with self._lock:
            pending = sorted((k, s) for k, s in self._staged.items() if k.startswith(src + "/"))
        with contextlib.ExitStack() as held:
            # Their writers' flushes wait until they are moved: one between the copy and the
            # move would commit to the old name, gone by then (in key order: no deadlock
            # with another rename of the tree).
            for _, staged in pending:
                held.enter_context(staged.lock)
            for _, staged in pending:
                self._commit(staged)
            # One rename(2) on a local disk; on object stores every object is copied, then the
            # originals are deleted: not atomic (documented).
            self.remote.rename_tree(src, dst)
            self._move_staged(src, dst)

    # -- lifecycle -----------------------------------------------------------------------------
    def close_all(self) -> None:
        """Release every handle (unmount): commits what can be committed within the drain
        timeout; what is left stays staged with its journal for the next start to commit."""
        if self.listings is not None:
            self.listings.close()  # nothing will read ahead any more
        worker = start_thread(self._close_all, "marinfs-drain")
        worker.join(self.drain_timeout)
        self.drained = not worker.is_alive()
        if not self.drained:
            with self._lock:
                left = sorted(k for k, st in self._staged.items() if st.dirty and not st.unlinked)
            log.error("unmount: pending commits did not finish within %.0f s; %d file(s) stay staged "
                      "in %s with journals and are committed on the next start: %s",
                      self.drain_timeout, len(left), self.staging_dir, ", ".join(left[:20]))

    def _close_all(self) -> None:
        with self._lock:
            fhs = list(self._handles)
        for fh in fhs:
            handle = self._handles.get(fh)
            if handle is not None and handle.staged is not None:
                try:
                    self._commit(handle.staged)
                except Exception:  # noqa: BLE001 - the bytes stay staged; discard() says where
                    log.exception("commit of %s failed at unmount", handle.key)
            self.release(fh)
