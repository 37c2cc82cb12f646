"""The kernel's view of the mount: which opens may keep the kernel's page cache of a file,
which must read around it while another version's readers use it, which the kernel reads
itself from a version cached whole (FUSE passthrough), and what size and time it was told.

Every table here is guarded by the mount's table lock (``lock``, shared with the handle table
and the staged-file table, held only for dictionary work, never across remote I/O);
``released`` is a condition on it: a key's last page-cache reader let go.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from cachetools import LRUCache

from marinfs.core.defaults import Defaults
from marinfs.core.handles import Backing, Backings, Handle, HandleTable, Opened, PageUsers
from marinfs.core.paths import under
from marinfs.errors import FsError
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import ObjectInfo, ObjectVersion, cache_id
from marinfs.read.reader import ChunkFetcher
from marinfs.write.staging import StagedFile

log = logging.getLogger(__name__)

_UNSURE = (-1, -1)  # told: the kernel may hold either of two answers


def shown_time(info: ObjectInfo) -> int:
    """The time a stat shows of ``info``: one stored for it (utimens, rsync -a), else the object's."""
    posix = info.posix
    return posix.mtime_ns if posix is not None and posix.mtime_ns is not None else info.mtime_ns


def with_size_and_time(info: ObjectInfo, size: int, shown: int) -> ObjectInfo:
    """``info`` showing ``size`` and the time ``shown`` (what the kernel keeps of a file's version)."""
    posix = info.posix
    if posix is not None and posix.mtime_ns is not None:
        posix = replace(posix, mtime_ns=shown)
    return replace(info, size=size, mtime_ns=shown, posix=posix)


class KernelView:
    """What the kernel holds of each file, and how each open is to treat it."""

    def __init__(self, lock: threading.Lock, handles: HandleTable, staged: Mapping[str, StagedFile],
                 fetcher: ChunkFetcher, remote_url: str, metadata: MetadataCache, defaults: Defaults) -> None:
        self.lock = lock
        self.released = threading.Condition(lock)  # a key's last page-cache reader let go
        self.handles = handles
        self.staged = staged  # the writes room's table (read under ``lock``)
        self.fetcher = fetcher
        self.remote_url = remote_url
        self.metadata = metadata
        self.defaults = defaults
        self.release_grace = 0.1  # seconds an open of another version waits for their release
        # FUSE passthrough (set by the FUSE layer once the kernel and libfuse agreed to it): a
        # version the chunk cache holds whole is read by the kernel from its data file.
        self.backings: Backings | None = None
        self.passthrough_opens = 0
        # GUARDED_BY(lock): the version each key had when last opened: the kernel may keep its
        # page cache for a new open only if the version is unchanged (else it would serve old bytes).
        self._kernel_versions: LRUCache[str, ObjectVersion | None] = LRUCache(maxsize=65536)
        # GUARDED_BY(lock): the (size, time shown) each file's stat last told the kernel
        # (kernel_info): an open whose version has others makes the kernel ask again first.
        self._told: LRUCache[str, tuple[int, int]] = LRUCache(maxsize=65536)
        # GUARDED_BY(lock): the open read handles using the kernel's page cache of each key.
        self.page_users: dict[str, PageUsers] = {}
        # GUARDED_BY(lock): key -> writers between their check and staging (writer_opening).
        self._writers_opening: dict[str, int] = {}
        # GUARDED_BY(lock): the version we committed of a key and the writer's mtime (present).
        self._own_mtimes: LRUCache[str, tuple[ObjectVersion, int]] = LRUCache(maxsize=65536)

    # -- what a stat shows ------------------------------------------------------------------------
    def present(self, info: ObjectInfo) -> ObjectInfo:
        """``info`` as a stat shows it: the writer's time for the version it committed, and on a
        local disk the mount's modes and owner where a file has what the daemon gives its own."""
        own = self._own_mtimes.get(info.name) if not info.is_dir else None
        if own is not None and own[0] == info.version and own[1] != info.mtime_ns:
            info = replace(info, mtime_ns=own[1])
        if self.defaults.native is not None and info.posix is not None and not info.link:
            info = info.with_posix(self.defaults.as_mounted(info.posix, info.is_dir))
        return info

    def wrote(self, key: str, version: ObjectVersion, mtime_ns: int) -> None:
        """This node made ``version`` of ``key``: the kernel may still hold the writer's mtime
        for a moment, so that is the time shown for that version (tar compares stats)."""
        with self.lock:
            self._own_mtimes[key] = (version, mtime_ns)

    def rewrote(self, key: str, old: ObjectVersion | None, new: ObjectVersion) -> None:
        """A metadata-only update made ``new`` of our ``old``: it keeps the writer's time."""
        with self.lock:
            own = self._own_mtimes.get(key)
            if own is not None and own[0] == old:
                self._own_mtimes[key] = (new, own[1])

    def kernel_info(self, key: str, info: ObjectInfo) -> ObjectInfo:
        """What the kernel is told of file ``key``: ``info``, but while readers here read another
        version through the kernel's page cache (or passed through), with that version's size
        and time. The kernel keeps one size per file and stops those reads at it: another
        version's size would cut them short, or have the kernel fill them with zeros up to it
        (and a map fault past it, SIGBUS). Handles of the other version read around the page
        cache (direct I/O), to their own end."""
        if info.is_dir or info.link:
            return info
        with self.lock:
            users = self.page_users.get(key)
            if (users is not None and not users.written and users.version != info.version
                    and key not in self.staged):
                # (Only what the kernel uses of it: the rest, a chmod say, is the file's now.)
                group = self.present(users.info)
                info = with_size_and_time(info, group.size, shown_time(group))
            shown = (info.size, shown_time(info))
            told = self._told.get(key)
            # Two different answers: the kernel keeps the one whose request it sent last, which
            # need not be the one made last (answers computed across a change and written back
            # out of order; it drops the older request's): it may hold either.
            self._told[key] = shown if told is None or told == shown else _UNSURE
        return info

    def _told_other_locked(self, key: str, info: ObjectInfo) -> bool:
        """Whether the kernel may hold another size or time of ``key`` than ``info``'s: it was
        told another, or two different ones since it last dropped them."""
        shown = self.present(info)
        return self._told.get(key) != (shown.size, shown_time(shown))

    # -- opens --------------------------------------------------------------------------------------
    def admit(self, handle: Handle, info: ObjectInfo, flags: int, writable: bool) -> None:
        """Decide how the kernel treats the open ``handle`` of ``info``: its page cache kept or
        read around, a backing file (passthrough), or its attributes dropped first."""
        key = handle.key
        with self.lock:
            users = self.page_users.get(key)
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
                    self.released.wait(left)
                    users = self.page_users.get(key)
            if (tracked and not direct_open and users is None and key not in self.staged
                    and not self._bystanders_locked(key)):
                backing = self._whole_version_locked(key, info)
                if backing is not None:  # (a version cached whole: see below)
                    users = self.page_users[key] = PageUsers(key, info.version, info, backing=backing)
                    handle.stale_kernel_attrs = self._told_other_locked(key, info)
            if users is not None and users.backing is not None:  # (never a writer: writer_opening)
                self._carry_locked(handle, users, member=tracked and users.version == info.version
                                   and key not in self.staged and not direct_open)
            elif tracked and users is not None and users.version != info.version:
                # The kernel keeps one page cache per file, shared by every handle: readers of
                # another version are filling it. This one reads around it, so neither side
                # reads the other's bytes; the page cache and its pages stay theirs (kept:
                # dropping them would only make them read again). docs/semantics.md.
                handle.direct = handle.keep_kernel_cache = True
            else:
                previous = self._kernel_versions.get(key)
                handle.keep_kernel_cache = (tracked and key not in self.staged
                                            and (previous == info.version or self.metadata.is_immutable(key))
                                            and not (users is not None and users.dropping and not users.filled))
                self._kernel_versions[key] = None if writable else info.version
                if tracked:
                    if users is None:
                        users = self.page_users[key] = PageUsers(key, info.version, info,
                                                                 written=key in self.staged,
                                                                 dropping=not handle.keep_kernel_cache)
                    users.count += 1
                    handle.page_users = users
                    handle.stale_kernel_attrs = self._told_other_locked(key, info)

    def opened(self, fh: int, handle: Handle) -> Opened:
        """The open's reply. Dropping the kernel's attributes is answered once: what it is
        told next is what it holds."""
        drop = handle.stale_kernel_attrs
        if drop:
            handle.stale_kernel_attrs = False
            with self.lock:
                self._told.pop(handle.key, None)
        return Opened(fh, keep_cache=handle.keep_kernel_cache, direct_io=handle.direct,
                      backing_id=handle.backing_id, drop_attrs=drop)

    @contextlib.contextmanager
    def writer_opening(self, key: str) -> Iterator[None]:
        """Around a writer's staging, unless the kernel reads the file from a backing here
        (passthrough): every open of it would have to carry that backing, and a writer's shared
        map of it would write into the chunk cache, so it is refused (``ETXTBSY``, as for a
        program being run) once the readers had a moment to close. No backing is made for it
        while it opens, nor later while its staged file lives."""
        with self.lock:
            users = self.page_users.get(key)
            deadline = time.monotonic() + self.release_grace
            while users is not None and users.backing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FsError(errno.ETXTBSY, f"{key} is open here through passthrough; "
                                  f"close its readers before writing it")
                self.released.wait(left)
                users = self.page_users.get(key)
            self._writers_opening[key] = self._writers_opening.get(key, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                left_opening = self._writers_opening[key] - 1
                if left_opening:
                    self._writers_opening[key] = left_opening
                else:
                    del self._writers_opening[key]

    def note_writer_locked(self, key: str) -> None:
        """A writer here stages ``key``: its readers read the writes (and so does the kernel's size)."""
        users = self.page_users.get(key)
        if users is not None:
            users.written = True

    def forget_version(self, key: str) -> None:
        """A commit of ``key`` (or its failure): the next open may not keep the page cache."""
        with self.lock:
            self._kernel_versions.pop(key, None)

    def _bystanders_locked(self, key: str) -> bool:
        """Whether a handle of ``key`` is open that neither reads through a page-cache group nor
        carries a backing (a direct reader of another version, an unversioned reader), or a
        writer is opening: no backing may be made then (the kernel would refuse those handles'
        maps, or the backing's opens)."""
        if key in self._writers_opening:
            return True
        return any(h.key == key and not h.orphan and h.page_users is None and h.carries is None
                   for h in self.handles.all_locked())

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
        object_id = cache_id(f"{self.remote_url}/{key}", str(info.version))
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

    def release(self, fh: int) -> Handle | None:
        """Close handle ``fh``: the last handle of a page-cache group ends it (and unregisters
        its backing, outside the lock). Answers the handle, or None if it was not open."""
        backing = None
        with self.lock:
            handle = self.handles.pop_locked(fh)
            users = (handle.page_users or handle.carries) if handle is not None else None
            if users is not None:
                users.count -= 1
                if not users.count:
                    backing, users.backing = users.backing, None
                    if self.page_users.get(users.key) is users:
                        del self.page_users[users.key]
                        self.released.notify_all()
        if backing is not None:
            self._drop_backing(backing)
        return handle

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

    # -- a handle's version changes -------------------------------------------------------------------
    def may_repin_locked(self, handle: Handle, opened: ObjectVersion | None) -> bool:
        """Whether a handle that served nothing may move to the object's new version. Through
        the kernel's page cache only if nothing there can be the old version's: the kernel
        dropped the file's pages at this open (no keep_cache), no reader of its version served
        any since, and it is the only one (under ``lock``)."""
        if handle.orphan:
            return False  # its name was unlinked or renamed here: the name's object is another file's
        users = handle.page_users
        if users is None:
            return True
        return (not handle.keep_kernel_cache and users.count == 1 and not users.filled
                and users.version == opened and self.page_users.get(users.key) is users)

    def repin_locked(self, handle: Handle, info: ObjectInfo) -> bool:
        """``handle`` (may_repin) reads ``info``'s version from now on, the only reader of its
        page-cache group, which follows; False if it cannot (under ``lock``)."""
        assert handle.info is not None
        if handle.page_users is not None:
            if info.size > handle.info.size:
                # The kernel holds the opened version's size and would stop reads there
                # (a shorter one's first short read makes it the size).
                return False
            handle.page_users.version, handle.page_users.info = info.version, info
            self._kernel_versions[handle.page_users.key] = info.version
        return True

    def follow_locked(self, handle: Handle, key: str, version: ObjectVersion) -> None:
        """Handle ``handle`` reads ``key``'s ``version`` from now on (a rename here moved its
        bytes there): its inode's pages are the same bytes. It never moves to a later version
        of either name (orphan)."""
        assert handle.info is not None
        users = handle.page_users
        if users is not None and users.version == handle.info.version:
            users.version, users.info = version, replace(users.info, name=key, version=version)
        handle.key, handle.orphan = key, True
        handle.info = replace(handle.info, name=key, version=version)

    # -- names that change here ---------------------------------------------------------------------
    def forget_inodes(self, key: str) -> None:
        """``key`` (a file or a tree) was unlinked here, or replaced by a rename: the kernel's
        next open of each name is of another inode, with a page cache of its own."""
        with self.lock:
            self._orphan_handles_locked(key)
            for k in [k for k in self.page_users if under(k, key)]:
                del self.page_users[k]
            self._told.pop(key, None)  # (a tree's files: their next opens may ask the kernel again)

    def move_inodes(self, src: str, dst: str) -> None:
        """A rename here moved the inodes (libfuse renames the node) and their page caches:
        their readers now count under the new names. The objects there are copies, of other
        versions, and of what the source held when copied, which may not be what the readers
        read: the next open of a new name reads around the page cache until they close."""
        self.forget_inodes(dst)
        with self.lock:
            self._orphan_handles_locked(src)
            moved = [self.page_users.pop(k) for k in list(self.page_users) if under(k, src)]
            for users in moved:
                users.key = dst + users.key[len(src):]
                self.page_users[users.key] = users
            told = self._told.pop(src, None)
            if told is not None:
                self._told[dst] = told

    def _orphan_handles_locked(self, key: str) -> None:
        """Read handles of ``key`` (a file or a tree) whose name was unlinked or renamed here."""
        for handle in self.handles.all_locked():
            if handle.staged is None and under(handle.key, key):
                handle.orphan = True
