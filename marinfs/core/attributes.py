"""Persisted POSIX attributes and extended attributes: chmod, chown, utimens, user.* xattrs.

A file with uncommitted bytes keeps its changes with its staged file (shown at once, sent
with the commit); a committed one gets one metadata-only update conditional on the version
seen. This room owns no table: it works through the namespace, the writes and the kernel view.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import posixpath
from collections.abc import Callable
from dataclasses import replace

from marinfs.core.defaults import Defaults
from marinfs.core.deferred import Deferred, Pending
from marinfs.core.handles import HandleTable
from marinfs.core.kernel import KernelView
from marinfs.core.namespace import Namespace
from marinfs.core.paths import key_of
from marinfs.core.writes import Writes
from marinfs.errors import FsError, PreconditionFailed
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import NO_ATTRS, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote import Remote
from marinfs.write.staging import StagedFile

log = logging.getLogger(__name__)
# Read-only attributes that tell a tool outside Python where a file lives and which version a
# read pins; the whole user.marinfs.* namespace is ours (EPERM to set). Other user.* attributes
# are stored with the file (PosixAttrs.xattrs).
XATTR_URL = "user.marinfs.url"
XATTR_VERSION = "user.marinfs.version"
XATTR_OURS = "user.marinfs."
XATTR_SYNC = "user.marinfs.sync"  # read: a barrier (``marinfs sync``; Filesystem.sync)
XATTR_CREATE, XATTR_REPLACE = 1, 2  # setxattr(2) flags (linux/xattr.h)
XATTR_SIZE_MAX = 65536  # one value, as the kernel and ext4 allow
# (All of a file's attributes together: what the store keeps, ``Remote.attrs_fit``.)


class Attributes:
    """What is stored of a file's or directory's attributes, and changes to it."""

    def __init__(self, remote: Remote, metadata: MetadataCache, handles: HandleTable, kernel: KernelView,
                 writes: Writes, namespace: Namespace, defaults: Defaults, read_only: bool,
                 deferred: Deferred) -> None:
        self.deferred = deferred
        deferred.send = self.send_deferred
        self.remote = remote
        self.metadata = metadata
        self.handles = handles
        self.kernel = kernel
        self.writes = writes
        self.namespace = namespace
        self.defaults = defaults
        self.read_only = read_only

    def lookup(self, key: str) -> ObjectInfo:
        return self.namespace.lookup(key)

    def set_attributes(self, path: str, mode: int | None = None, uid: int | None = None, gid: int | None = None,
                       mtime_ns: int | None = None, fh: int | None = None) -> None:
        """chmod, chown, utimens: the fields given replace the stored ones (None: unchanged;
        ``mode`` is taken ``& 0o7777``). See :meth:`change` for where they go."""
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
        self.change(path, fh, lambda attrs: replace(attrs, **fields))

    def _key_for(self, path: str | None, fh: int | None) -> str:
        if fh is not None:
            handle = self.handles.get(fh)
            return handle.staged.key if handle.staged is not None else handle.key
        if path is None:
            raise FsError(errno.EBADF, "neither a path nor a handle")
        return key_of(path)

    def posix_of(self, key: str, info: ObjectInfo) -> PosixAttrs:
        """All that is stored for ``info``: a listing may not have carried it (an S3 listing
        whose directory record lacks the entry), then the object's own stat tells."""
        if not key:
            return self.namespace.root_attrs
        if info.posix is not None:
            return info.posix
        if info.link:
            return NO_ATTRS
        token = self.metadata.begin_stat(key)
        try:
            fresh = self.remote.stat(key, likely_dir=info.is_dir)
        except FileNotFoundError:
            if not self.metadata.end_stat(key, token, None):
                return self.posix_of(key, self.lookup(key))  # made here meanwhile: as it is now
            self.metadata.invalidate(key)
            raise FileNotFoundError(errno.ENOENT, "no such file", key) from None
        except BaseException:
            self.metadata.end_stat(key, token, None)
            raise
        if not self.metadata.end_stat(key, token, fresh):
            # This node changed it while the remote answered: the answer may be of before (a
            # chmod merged onto it would undo the change).
            return self.posix_of(key, self.lookup(key))
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
            children = self.namespace.list_now(parent)
        found = next((c for c in children if c.name == key), None)
        return found.posix if found is not None and found.posix is not None else NO_ATTRS

    def _attrs_of(self, key: str) -> PosixAttrs:
        """The attributes shown for ``key`` now (this node's uncommitted ones first)."""
        staged = self.writes.dirty(key)
        if staged is not None:
            return staged.attrs or NO_ATTRS
        return self.posix_of(key, self.lookup(key))

    def change(self, path: str | None, fh: int | None, change: Callable[[PosixAttrs], PosixAttrs]) -> None:
        """Apply ``change`` to a file's or directory's stored attributes.

        A file with uncommitted bytes (open for writing, written): they stay with its staged
        file, are shown at once and go with its commit, no request now. A committed file: one
        metadata-only update conditional on the version seen (S3 CopyObject onto itself, GCS
        PATCH, the syscall locally); if someone changed the object since, the change is applied
        to the object as it is now (one stat, one more update), as chmod on a disk applies to
        the file as it is: only a second change in between is ESTALE. Directories: the remote's
        directory attributes. Symbolic links: nothing is stored (lchown, lutimes succeed).
        Nothing changed (chmod to the mode shown): no request.

        A file this node committed just now (rsync's temporary file, between its close and its
        rename): the change is held back a moment (core/deferred.py), shown here at once, and
        carried by the rename's copy, or else sent as one update when its window ends."""
        if self.read_only:
            raise FsError(errno.EROFS)
        key = self._key_for(path, fh)
        with self.deferred.held(key):  # (before a staged file's lock, as every holder takes them)
            handle = self.handles.get(fh) if fh is not None else None
            staged = handle.staged if handle is not None and handle.staged is not None else self.writes.staged.get(key)
            if staged is not None:
                # Held throughout: waits for a commit in flight (which may leave it clean), and no
                # commit of its writer comes between the update below and the writer's new base.
                with staged.lock:
                    if staged.unlinked or staged.dirty:
                        current = staged.attrs or NO_ATTRS
                        staged.set_attrs(self.defaults.normalized(change(current), False, current))
                    else:
                        self._change_stored(key, change, staged)
                return
            self._change_stored(key, change, None)

    def _change_stored(self, key: str, change: Callable[[PosixAttrs], PosixAttrs],
                       staged: StagedFile | None) -> None:
        info = self.lookup(key)
        if info.link:
            return
        if not key:
            self._set_root_attrs(change)
            return
        for attempt in (1, 2):
            current = self.posix_of(key, info)
            new = self.defaults.normalized(change(current), info.is_dir, current)
            if new == current:
                return
            if info.is_dir:
                self.remote.set_dir_attrs(key, new)
                self.metadata.put_own(replace(info, posix=new))
                return
            if self.remote.object_store and new.mtime_ns is None:
                # The store's metadata update gives the object a new timestamp: keep the one
                # shown, as chmod on a disk leaves the mtime alone.
                new = replace(new, mtime_ns=self.kernel.present(info).mtime_ns)
            if self.deferred.wants(key, info):
                self.deferred.defer(key, info, new)
                if staged is not None and not staged.unlinked and staged.base_version == info.version:
                    staged.rebase(info.version, attrs=new)  # (clean: a commit of its next writes carries them)
                return
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
            self.kernel.rewrote(key, info.version, version)
            self.metadata.put_own(replace(info, version=version, posix=attrs), token)
        if staged is not None and not staged.unlinked:
            with staged.lock:
                if staged.dirty or staged.base_version != info.version:
                    return  # the writer started from other bytes: its commit decides (a conflict)
                staged.rebase(version if version is not None else self._version_now(key), attrs=attrs)

    def send_deferred(self, entry: Pending) -> None:
        """The metadata-only update of attributes held back (core/deferred.py), the caller
        holding the key: conditional on the version they were set on. Another writer's object
        there meanwhile, or none, keeps what it has (the attributes belonged to bytes nobody has
        any more), as its commit would have replaced them; a file this node is writing again
        carries them with its commit. Raises what may pass (the store down): sent again later."""
        key = entry.key
        staged = self.writes.staged.get(key)
        with staged.lock if staged is not None else contextlib.nullcontext():
            if staged is not None and (staged.dirty or staged.unlinked):
                return  # its commit carries them (its attributes since they were set), or it is gone
            token = self.metadata.begin_stat(key)
            try:
                version = self.remote.set_attrs(key, entry.attrs, entry.version)
            except (PreconditionFailed, FileNotFoundError, IsADirectoryError):
                self.metadata.end_stat(key, token, None)
                self.metadata.forget(key, changed=True)  # (it showed them: the next lookup asks)
                log.info("attributes set on %s were not sent: the object changed or went since", key)
                return
            except BaseException:
                self.metadata.end_stat(key, token, None)
                raise
            if entry.info is None:  # (found in a journal at start: nothing of it is cached)
                self.metadata.end_stat(key, token, None)
                self.metadata.forget(key, changed=True)
                return
            self._attrs_set(key, entry.info, entry.attrs, version, staged, token)

    def _version_now(self, key: str) -> ObjectVersion | None:
        try:
            return self.lookup(key).version
        except FileNotFoundError:
            return None

    def _set_root_attrs(self, change: Callable[[PosixAttrs], PosixAttrs]) -> None:
        current = self.namespace.root_attrs
        new = self.defaults.normalized(change(current), True, current)
        if new == current:
            return
        if not self.remote.object_store:
            self.remote.set_dir_attrs("", new)
        self.namespace.root_attrs = new

    # -- extended attributes -------------------------------------------------------------------
    # user.* names are stored with the file (see change); the kernel's namespaces
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
            if not self.remote.attrs_fit(new):
                # As ext4 when its attribute block is full: the store keeps no more (S3: 2 KiB).
                raise FsError(errno.ENOSPC, f"{key}: the store cannot keep that many bytes of attributes")
            return new

        self.change(path, fh, change)

    def removexattr(self, path: str, name: str) -> None:
        key = key_of(path)
        self.lookup(key)
        if name.startswith(XATTR_OURS):
            raise FsError(errno.EPERM, f"{name} is read-only")

        def change(attrs: PosixAttrs) -> PosixAttrs:
            if attrs.xattr(name) is None:
                raise FsError(errno.ENODATA, name)
            return attrs.with_xattr(name, None)

        self.change(path, None, change)

    def _url_of(self, key: str) -> str:
        """Where ``key`` lives: the remote URL, then ``/key`` (checks that it exists)."""
        self.lookup(key)
        return f"{self.remote.url.rstrip('/')}/{key}" if key else self.remote.url
