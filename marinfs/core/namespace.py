"""Names: lookups (this node's staged writes, then the metadata cache, then the remote),
listings, links, and the namespace operations that make or remove a name.

``_link_targets`` is guarded by the mount's table lock (``lock``); the metadata cache and the
background listings lock themselves.
"""

from __future__ import annotations

import errno
import os
import posixpath
import threading
import time
from dataclasses import replace

from cachetools import LRUCache

from marinfs.core.defaults import Defaults
from marinfs.core.deferred import Deferred
from marinfs.core.handles import HandleTable
from marinfs.core.kernel import KernelView, shown_time, with_size_and_time
from marinfs.core.paths import NAME_MAX, PATH_MAX, ROOT, entries_changed, key_of
from marinfs.core.writes import Writes, staged_info
from marinfs.errors import FsError, RemoteError, StaleVersionError
from marinfs.meta.listings import ListingPrefetcher
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import NO_ATTRS, ObjectInfo, PosixAttrs
from marinfs.remote import LINK_SUFFIX, Remote


FOLLOW_SECONDS = 1.0  # a lookup waits this long at most for the same key's stat under way


class _Flight:
    """One remote stat that other lookups of the same key wait for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: tuple[ObjectInfo | None, bool] = (None, False)
        self.error: BaseException | None = None

    def answer(self, timeout: float) -> tuple[ObjectInfo | None, bool] | None:
        """The shared answer, or None if it did not come within ``timeout`` seconds."""
        if not self.done.wait(timeout):
            return None
        if self.error is not None:
            raise self.error
        return self.result


class Namespace:
    """Lookups and the names of the tree."""

    def __init__(self, lock: threading.Lock, remote: Remote, metadata: MetadataCache,
                 listings: ListingPrefetcher | None, handles: HandleTable, kernel: KernelView, writes: Writes,
                 defaults: Defaults, deferred: Deferred) -> None:
        self.lock = lock
        self.deferred = deferred  # attributes held back: shown by every lookup and listing
        self.remote = remote
        self.metadata = metadata
        self.listings = listings
        self.handles = handles
        self.kernel = kernel
        self.writes = writes
        self.defaults = defaults
        # The mount root has no parent to keep its attributes on an object store: this mount's
        # chmod/utimens of it are shown (rsync -a sets them), and stored only on local disks.
        self.root_attrs = NO_ATTRS
        # GUARDED_BY(lock): link targets read from the remote (an S3 link's body), by key and the
        # link's version: a link object that changed has a new version, so an old target is never answered.
        self._link_targets: LRUCache[tuple[str, str], str] = LRUCache(maxsize=65536)
        self._stating: dict[str, _Flight] = {}  # GUARDED_BY(lock): remote stats under way, by key

    # -- lookups -------------------------------------------------------------------------------
    def lookup(self, key: str) -> ObjectInfo:
        """The metadata of ``key``: our own staged writes first, then the cache, then the remote."""
        if not key:
            return ROOT if self.root_attrs.empty else replace(ROOT, posix=self.root_attrs)
        info = self.known(key)
        if info is not None:
            return info
        if self.metadata.is_missing(key) or self.writes.is_gone(key):
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        if self.metadata.listed_missing(key):
            if self.listings is not None:
                self.listings.keep_fresh(posixpath.dirname(key))
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        if self.listings is not None:
            # Its directory being listed (a writer's earlier miss there): that one LIST answers.
            if self.listings.in_flight(posixpath.dirname(key)):
                info = self.known(key)
                if info is not None:
                    return info
                if self.metadata.listed_missing(key):
                    raise FileNotFoundError(errno.ENOENT, "no such file", key)
            self.listings.note_miss(key)
        info, cached = self.ask_stat(key)
        if not cached:
            # This node changed the key while the remote answered (a commit, say): the answer
            # may be of before. What this node knows now, else the remote once more.
            info = self.known(key) or self.ask_stat(key)[0]
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", key)
        return self.deferred.shown(info)

    def ask_stat(self, key: str) -> tuple[ObjectInfo | None, bool]:
        """The remote's stat of ``key`` (None: there is no such key) and whether it was cached:
        not if this node changed the key while the remote answered. Stats of one key at once
        share one answer: ten threads opening files in a directory whose stat expired (a
        restore) ask the remote once, not ten times."""
        with self.lock:
            flight = self._stating.get(key)
            if flight is None:
                flight = self._stating[key] = _Flight()
                leader = True
            else:
                leader = False
        if not leader:
            answered = flight.answer(FOLLOW_SECONDS)
            if answered is not None:
                return answered
            return self._ask_stat(key)  # (a slow one: not worth waiting for, ask again)
        try:
            flight.result = self._ask_stat(key)
            return flight.result
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self.lock:
                del self._stating[key]
            flight.done.set()

    def _ask_stat(self, key: str) -> tuple[ObjectInfo | None, bool]:
        token = self.metadata.begin_stat(key)
        try:
            info = self.remote.stat(key, likely_dir=self.metadata.was_dir(key), likely_link=self.metadata.was_link(key))
        except FileNotFoundError:
            return None, self.metadata.end_stat(key, token, None, missing=True)
        except BaseException:
            self.metadata.end_stat(key, token, None)
            raise
        return info, self.metadata.end_stat(key, token, info)

    def known(self, key: str) -> ObjectInfo | None:
        """What lookup() answers for ``key`` without asking the remote, or None."""
        staged = self.writes.dirty(key)
        if staged is not None:
            # Bytes the remote lacks yet: our writes are what this node shows. A clean staged
            # file (committed, or open but unwritten) matches the remote, whose stat has a version.
            return staged_info(staged)
        if self.writes.is_gone(key):  # (deleted here; the bucket has it until its delete's turn)
            return None
        local = self.writes.local_dir(key)
        if local is not None:
            return local
        info = self.writes.kept_info(key) or self.metadata.get_stat(key)
        return self.deferred.shown(info) if info is not None else None

    def lookup_or_none(self, key: str) -> ObjectInfo | None:
        try:
            return self.lookup(key)
        except FileNotFoundError:
            return None

    def require_dir(self, key: str) -> None:
        if self.metadata.has_listing(key):
            return  # listed fresh: a directory (tar -x creates in one past its stat's TTL)
        if not self.lookup(key).is_dir:
            raise FsError(errno.ENOTDIR, key)

    def getattr(self, path: str) -> ObjectInfo:
        key = key_of(path)
        return self.kernel.kernel_info(key, self.kernel.present(self.lookup(key)))

    def getattr_cached(self, key: str) -> ObjectInfo | None:
        """What getattr() would answer for ``key`` right now without a request, or None.
        readdirplus hands the kernel only these: a listing older than the stat TTL
        (``--list-ttl`` above ``--metadata-ttl``) or a file this node is writing must not
        give the kernel attributes that getattr would not."""
        info = self.known(key)
        return None if info is None else self.kernel.kernel_info(key, self.kernel.present(info))

    def fgetattr(self, fh: int) -> ObjectInfo:
        """fstat(2) of an open file: the file's stat, with the size and time of the version this
        handle reads (as on a local disk), unless another version is read through the page
        cache here (kernel_info). A reader's beside a writer here, or after one, is the file's
        as written (it reads the writes, as on a local disk); one whose name was unlinked or
        renamed here keeps what it opened."""
        handle = self.handles.get(fh)
        if handle.staged is not None or handle.orphan or handle.info is None:
            return self.handle_info(fh)
        present = self.kernel.present
        try:
            info = present(self.lookup(handle.key))
        except (FileNotFoundError, RemoteError):  # (gone, or the store not answering: what it opened)
            return self.handle_info(fh)
        if info.is_dir or info.link:
            return self.handle_info(fh)
        users = handle.page_users
        if handle.key not in self.writes.staged and not (users is not None and users.written):
            own = present(handle.info)
            info = with_size_and_time(info, own.size, shown_time(own))
        return self.kernel.kernel_info(handle.key, info)

    def handle_info(self, fh: int) -> ObjectInfo:
        """An open file's attributes by its handle: it may have no name any more (unlinked)."""
        handle = self.handles.get(fh)
        staged = handle.staged
        if staged is not None:
            return staged_info(staged)
        if handle.info is None:
            raise FsError(errno.EBADF)
        return handle.info

    def readdir(self, path: str) -> list[ObjectInfo]:
        key = key_of(path)
        if not self.lookup(key).is_dir:
            raise FsError(errno.ENOTDIR, key)
        if self.writes.local_dir(key) is not None:  # (nothing of it in the bucket to list)
            children = self.writes.local_dirs_in(key) + [staged_info(s) for s in self.writes.in_dir(key)]
            return [self.kernel.present(c) for c in children]
        children = self.metadata.get_listing(key)
        if children is None and self.listings is not None:
            # A background listing that landed between the lookup above and wait() is gone
            # from the pending set by now, but cached: look again before listing it twice.
            children = self.listings.wait(key) or self.metadata.get_listing(key)
        if children is None:
            children = self.list_now(key)
        if self.listings is not None:
            self.listings.walked_into(key)
        if self.writes.deletes is not None:
            children = [c for c in children if not self.writes.is_gone(c.name)]
        names = {posixpath.basename(c.name) for c in children}
        for staged in self.writes.in_dir(key):  # new files not committed yet are ours to show
            name = posixpath.basename(staged.key)
            if name not in names:
                children.append(staged_info(staged))
                names.add(name)
        for kept in self.writes.kept_in(key):  # and those whose commit failed (kept, retried)
            if posixpath.basename(kept.name) not in names:
                children.append(kept)
        for local in self.writes.local_dirs_in(key):  # and directories with no marker yet
            if posixpath.basename(local.name) not in names:
                children.append(local)
        shown = self.deferred.shown
        return [self.kernel.present(shown(c)) for c in children]

    def list_now(self, key: str) -> list[ObjectInfo]:
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

    @staticmethod
    def statfs() -> dict[str, int]:
        # Object stores have no capacity; report a large, stable figure so df and cp proceed.
        blocks = 1 << 32
        return {"f_bsize": 1 << 20, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": blocks,
                "f_bavail": blocks, "f_files": 1 << 32, "f_ffree": 1 << 32, "f_namemax": NAME_MAX}

    # -- links ---------------------------------------------------------------------------------
    def symlink(self, target: str, path: str) -> None:
        """symlink(2): ``path`` becomes a link whose content is ``target``, text that marinfs
        stores in the backend's convention and never follows (the kernel resolves links)."""
        key = key_of(path)
        data = target.encode("utf-8", "surrogateescape")
        if not data:
            raise FsError(errno.ENOENT, "an empty link target")
        if len(data) >= PATH_MAX:
            raise FsError(errno.ENAMETOOLONG, "link target")
        self.remote.check_key(key)
        if not key or self.lookup_or_none(key) is not None:
            raise FsError(errno.EEXIST, key)
        self.require_dir(posixpath.dirname(key))
        self.writes.settle(key)
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
            # is shown as ours for that version, as for a committed file (see Writes.commit).
            info = ObjectInfo(name=key, is_dir=False, size=len(data), mtime_ns=time.time_ns(), version=version,
                              link=True, target=target)
            self.kernel.wrote(key, version, info.mtime_ns)
        self.metadata.put_own(info)
        entries_changed(self.remote, self.metadata, key)

    def readlink(self, path: str) -> str:
        """The target text of link ``path``: from its stat where the store keeps it there (local
        disks, GCS), else one small GET (an S3 link's body), cached with the link's version."""
        key = key_of(path)
        info = self.lookup(key)
        if not info.link:
            raise FsError(errno.EINVAL, f"{key} is not a symbolic link")
        cache_key = (key, str(info.version)) if info.version is not None else None
        if info.target is None and cache_key is not None:
            with self.lock:
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
            with self.lock:
                self._link_targets[cache_key] = target
        return target

    def file_name_allowed(self, key: str) -> None:
        """Where links are ``NAME.rclonelink`` objects, a file of such a name would read back as
        a link: EPERM, as for any other kind of file the store cannot hold."""
        if self.remote.link_objects and key.endswith(LINK_SUFFIX):
            raise FsError(errno.EPERM, f"{key}: names ending in {LINK_SUFFIX} are links on this store")

    # -- names made and removed ----------------------------------------------------------------
    def unlink(self, path: str, now: bool = False) -> None:
        """unlink(2); in write-back the delete is queued (write/deletes.py) unless ``now`` (a
        rename replacing the file, after its barrier: the name is taken again at once). A delete
        never overtakes an upload closed before it: queued behind them, or sent after them."""
        key = key_of(path)
        info = self.lookup(key)
        if info.is_dir:
            raise FsError(errno.EISDIR, key)
        deferred = self.writes.deletes is not None and not now and not info.link and self.writes.writes_back(key)
        if not deferred:
            self.writes.barrier()
        if info.link:
            try:
                self.remote.delete_link(key)
            finally:
                self.metadata.invalidate(key)
                entries_changed(self.remote, self.metadata, key)
            return
        staged = self.writes.unlinked(key, wait=not deferred)  # (queued: not behind its upload under way)
        kept = self.writes.drop_kept(key)
        if deferred:  # write-back: sent behind the uploads closed before it
            # The version deleted (a retry sends it only while the object is still that one):
            # an open writer's is the one it started from; none for a file never uploaded.
            version = None if kept else info.version if staged is None else staged.base_version
            self.writes.deletes.delete(key, False, version)
            self.metadata.removed_own(key)
            entries_changed(self.remote, self.metadata, key)
            self.kernel.forget_inodes(key)
            return
        gone = False
        try:
            self.remote.delete(key)
            gone = True
        except FileNotFoundError:
            if staged is None and not kept:
                raise
            gone = True  # never committed: nothing to delete
        finally:
            if gone:  # its parent's listing stays valid without it
                self.metadata.removed_own(key)
            else:
                self.metadata.invalidate(key)
            entries_changed(self.remote, self.metadata, key)
        self.kernel.forget_inodes(key)

    def mkdir(self, path: str, mode: int | None = None) -> None:
        """A directory; its mode is stored only if it is not the mount's ``--dir-mode``."""
        key = key_of(path)
        self.remote.check_key(key)
        if not key or self.lookup_or_none(key) is not None:
            raise FsError(errno.EEXIST, key)
        self.require_dir(posixpath.dirname(key))
        keep = mode is not None and self.remote.stores_posix
        attrs = self.defaults.normalized(PosixAttrs(mode=mode & 0o7777), True) if keep else NO_ATTRS
        info = ObjectInfo(name=key, is_dir=True, mtime_ns=time.time_ns(), posix=attrs)
        if self.writes.keeps_local(key):  # (in a temporary directory: made in the bucket by its rename)
            self.writes.add_local_dir(info)
        else:
            self.writes.settle(key)  # (an rmdir of it queued: its marker would go after this one)
            self.writes.make_dir(info)
        self.metadata.put_own(info)
        self.metadata.put_listing(key, [])  # we just made it: nothing is in it yet
        entries_changed(self.remote, self.metadata, key)

    def rmdir(self, path: str) -> None:
        key = key_of(path)
        if not key:
            raise FsError(errno.EBUSY, "cannot remove the mount root")
        info = self.lookup_or_none(key)
        if info is None:
            raise FsError(errno.ENOENT, key)
        if not info.is_dir:
            raise FsError(errno.ENOTDIR, key)
        self.check_empty(key)
        if self.writes.drop_local_dir(key):
            pass  # (never in the bucket)
        elif self.writes.deletes is not None and self.writes.writes_back(key):  # queued, after what was in it
            self.writes.deletes.delete(key, True, None)
        else:
            self.writes.barrier()  # (write-back elsewhere: after the uploads closed before it)
            self.remote.remove_dir(key)
        self.metadata.invalidate_tree(key)
        entries_changed(self.remote, self.metadata, key)

    def check_empty(self, key: str) -> None:
        if self.writes.local_dir(key) is not None:
            if self.writes.any_under(key):
                raise FsError(errno.ENOTEMPTY, key)
            return
        try:
            children = self.remote.list(key)
        except FileNotFoundError:
            # An implicit directory vanishes with its last object: removing it is a success.
            children = []
        children = [c for c in children if not self.writes.is_gone(c.name)]
        if children or self.writes.any_under(key):
            raise FsError(errno.ENOTEMPTY, key)

    def access(self, path: str, mode: int, read_only: bool) -> None:
        self.lookup(key_of(path))
        if mode & os.W_OK and read_only:
            raise FsError(errno.EROFS)
