"""rename(2): the remote rename of a file, link or tree, the staged files that follow it, and
the read handles that follow their bytes to the new name.

The read handles a rename moves are found under the mount's table lock (``lock``) and told
outside it; the staged files under the source are held (their own locks, in key order)
across the commit, the remote rename and the rekey.
"""

from __future__ import annotations

import contextlib
import errno
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from marinfs.core.deferred import Deferred
from marinfs.core.handles import Handle, HandleTable
from marinfs.core.kernel import KernelView
from marinfs.core.namespace import Namespace
from marinfs.core.paths import entries_changed, key_of, under
from marinfs.core.writes import Writes, staged_info
from marinfs.errors import FsError, PreconditionFailed
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import Copied, ObjectInfo, ObjectRef, ObjectVersion
from marinfs.read.reader import ObjectReader
from marinfs.remote import Remote
from marinfs.write import renames
from marinfs.write.commit import describe
from marinfs.write.staging import StagedFile

# A read handle to move: (handle, its key and version then, new key, new version).
Move = tuple[Handle, str, ObjectVersion, str, ObjectVersion]


class Renamer:
    """File, link and directory renames made here."""

    def __init__(self, lock: threading.Lock, remote: Remote, metadata: MetadataCache, handles: HandleTable,
                 kernel: KernelView, writes: Writes, namespace: Namespace,
                 ref: Callable[[str, ObjectInfo], ObjectRef], deferred: Deferred) -> None:
        self.lock = lock
        self.deferred = deferred  # attributes held back: a file's rename carries them
        self.remote = remote
        self.metadata = metadata
        self.handles = handles
        self.kernel = kernel
        self.writes = writes
        self.namespace = namespace
        self.ref = ref
        # GUARDED_BY(lock): directory renames left midway (their journals stay), for `status`.
        self.unfinished: list[renames.UnfinishedRename] = []

    def finish_unfinished(self) -> None:
        """Finish the directory renames an earlier daemon (or this one) left midway."""
        left = renames.finish_renames(self.writes.staging_dir, self.remote)
        with self.lock:
            self.unfinished[:] = left

    def unfinished_status(self) -> list[dict[str, object]]:
        with self.lock:
            return [u.as_dict() for u in self.unfinished]

    def _journaled(self, src: str, dst: str) -> list[Copied]:
        copies = renames.journaled_rename_tree(self.writes.staging_dir, self.remote, src, dst)
        with self.lock:  # (the same rename again finished one left midway)
            self.unfinished[:] = [u for u in self.unfinished if (u.src, u.dst) != (src, dst)]
        return copies

    def rename(self, old: str, new: str) -> None:
        src, dst = key_of(old), key_of(new)
        if src == dst:
            return
        self.remote.check_key(dst)
        if not src or dst.startswith(src + "/"):
            raise FsError(errno.EINVAL, f"cannot move {src!r} into itself")
        # Attributes held back inside a directory are sent before it moves (its copies keep
        # what the objects have); a file's own are carried by its copy (_rename_file_held).
        self.deferred.send_under(src)
        with self.deferred.held(src, dst):
            self._rename(src, dst, new)

    def _rename(self, src: str, dst: str, new: str) -> None:
        info = self.namespace.lookup(src)
        if self.writes.kept(src) is not None:
            raise FsError(errno.EIO, f"{src}: its commit failed; its bytes are kept and retried (marinfs status)")
        target = self.namespace.lookup_or_none(dst)
        self.namespace.require_dir(posixpath.dirname(dst))
        in_place = self._in_place_readers(src) if self.remote.renames_in_place else []
        staged = src in self.writes.staged  # (before the rename moves it to dst)
        retargeted = self._retarget(src, dst, info, target)
        if retargeted is not None:
            copies = retargeted
        else:
            # A rename's deletes never overtake an upload closed before it (write-back, mount-wide).
            # A file not uploaded yet whose new name is not written back is uploaded by it too:
            # the new name promises what a close there promises (then copied, as in the default mode).
            self.writes.barrier()
            self.writes.settle(src)  # (deletes in either tree that failed: sent first, else EIO)
            self.writes.settle(dst)
            if info.is_dir:  # (directories made in a temporary one: the bucket's rename moves them)
                self.writes.materialize_tree(src)
            if not info.is_dir and self.writes.kept(src) is not None:  # (its upload failed meanwhile)
                raise FsError(errno.EIO, f"{src}: its upload failed; its bytes are kept and retried (marinfs status)")
            copies = self._rename_remote(src, dst, info, target, new)  # (a failed rename moves no reader)
        self.deferred.discard(dst)  # (a file replaced: what was held back for it went with it)
        self._follow(self._moves(copies))
        if in_place:
            self._follow_in_place(src, dst, in_place)
        if retargeted is not None and not info.is_dir:  # what this node shows until its upload lands: its staged bytes
            moved = self.writes.staged.get(dst)
            renamed = staged_info(moved) if moved is not None else None
        else:
            renamed = self._renamed_info(dst, info, target, next((c for c in copies if c.src == src), None), staged)
        if renamed is not None:  # both parents' listings stay valid: rsync renames every file
            self.metadata.removed_own(src)
            self.metadata.put_own(renamed)
        else:
            self.metadata.invalidate_tree(src)
            self.metadata.invalidate_tree(dst)
        entries_changed(self.remote, self.metadata, src, dst)
        self.kernel.move_inodes(src, dst)

    def _renamed_info(self, dst: str, info: ObjectInfo, target: ObjectInfo | None,
                      copied: Copied | None, staged: bool) -> ObjectInfo | None:
        """What a stat of ``dst`` answers after a file rename here, where this node knows it
        all: the remote copied exactly the version ``info`` describes (``copied``: pinned to
        that version), and the time shown is one the copy kept (a stored mtime: the copy's
        own is new); else None (ask the remote). Not for a file with writes staged here (its
        size may have grown since ``info``)."""
        if (info.is_dir or info.link or (target is not None and target.link) or staged
                or self.remote.renames_in_place):  # (a local rename is a syscall: its stat costs as much)
            return None
        if copied is None or copied.new is None or info.version is None or copied.old != info.version:
            return None  # (the object changed since our stat: its size and attributes may have too)
        if info.posix is None or info.posix.mtime_ns is None:
            return None
        return replace(info, name=dst, version=copied.new)

    def _rename_remote(self, src: str, dst: str, info: ObjectInfo, target: ObjectInfo | None,
                       new: str) -> list[Copied]:
        """The remote rename; answers the copies the store made of what it moved."""
        if info.is_dir:
            if target is not None and not target.is_dir:
                raise FsError(errno.ENOTDIR, dst)
            unfinished = (not self.remote.renames_in_place
                          and renames.journal_of(self.writes.staging_dir, self.remote, src, dst) is not None)
            if target is not None and not unfinished:  # (the same rename again finishes one left midway)
                self.namespace.check_empty(dst)
                self.remote.remove_dir(dst)
            return self._rename_dir(src, dst)
        if target is not None and target.is_dir:
            raise FsError(errno.EISDIR, dst)
        if not info.link:
            self.namespace.file_name_allowed(dst)
        if target is not None and target.link != info.link and self.remote.link_objects:
            # A link and a file of one name are different objects (x.rclonelink, x): the
            # one replaced goes first. Not atomic, like every rename on an object store.
            if target.link:
                self.remote.delete_link(dst)
            else:
                self.namespace.unlink(new, now=True)
        if info.link:
            self.remote.rename_link(src, dst)
            return []
        return self._rename_file(src, dst)

    def _retarget(self, src: str, dst: str, info: ObjectInfo, target: ObjectInfo | None) -> list[Copied] | None:
        """Write-back where a rename copies (object stores): the new files under ``src`` whose
        uploads have not run (rsync's temporary file, Orbax's temporary checkpoint directory,
        TensorStore's manifest written beside and renamed over the last one) send their uploads
        to the new names, in their place in the queue, instead of being uploaded then copied in
        the bucket; what of the tree is in the bucket already is moved as before. Answers the
        copies made, or None where this does not apply (the caller renames as in the default
        mode). The staged files are held meanwhile (in key order; an upload under way ends
        first), a replaced target's too: the new bytes then replace what it left in the bucket.
        Only files whose new name is written back (``--write-back-path``) are re-targeted: one
        that leaves write-back is uploaded before the rename returns, as the caller's default
        rename does (its barrier, then the commit and the copy)."""
        if self.writes.write_back is None or self.remote.renames_in_place or info.link:
            return None  # (a local disk renames what it holds in one rename(2))
        if self.writes.deletes is not None and (self.writes.deletes.near(src) or self.writes.deletes.near(dst)):
            return None  # (a delete queued in either tree: renamed after it, as in the default mode)
        if info.is_dir:
            if target is not None and not target.is_dir:
                return None
            pending = self.writes.staged_under(src)
            has_local = self.writes.has_local_dirs(src)
        else:
            one = self.writes.staged.get(src)
            if one is None or (target is not None and (target.is_dir or target.link)):
                return None
            pending = [(src, one)]
        if not pending and not (info.is_dir and has_local):
            return None
        replaced = None if info.is_dir else self.writes.staged.get(dst)
        held_files = sorted(pending + ([(dst, replaced)] if replaced is not None else []), key=lambda p: p[0])
        with contextlib.ExitStack() as held:
            for _, staged in held_files:
                held.enter_context(staged.lock)
            if any(staged.key != key for key, staged in held_files):
                return None  # (moved meanwhile)
            new = {key for key, staged in pending
                   if self.writes.not_uploaded(staged) and self.writes.writes_back(dst + key[len(src):])}
            if info.is_dir:
                if any(staged.dirty and key not in new for key, staged in pending):
                    return None  # (new bytes of a file in the bucket: committed, then copied, as before)
                if target is not None:
                    self.namespace.check_empty(dst)
                    self.remote.remove_dir(dst)
                if self.writes.local_dir(src) is not None and self._nothing_in_bucket(src):
                    copies = []  # (a directory made in a temporary one: nothing of it in the bucket)
                else:
                    copies = self._journaled(src, dst)  # what is in the bucket, and the directories
                self.writes.move(src, dst, keys={key for key, _ in pending} - new)
                self.writes.move(src, dst, retarget=True, keys=new)
                # Directories made in a temporary directory: the rename out of it makes them.
                self.writes.make_local_dirs(self.writes.move_local_dirs(src, dst))
                self._markers_last([staged for key, staged in pending if key in new])
                return copies
            if not new:
                return None
            self.namespace.file_name_allowed(dst)
            base = target.version if target is not None else None
            if replaced is not None:
                replaced.keep_old_bytes()  # still open: its descriptors keep the bytes
                base = replaced.base_version  # what it left in the bucket (it rebased past its upload)
            self.writes.move(src, dst, retarget=True, keys=new)
            pending[0][1].rebase(base)  # its upload replaces exactly that
            self._markers_last([pending[0][1]])
        return []

    def _nothing_in_bucket(self, tree: str) -> bool:
        files, _, explicit = self.remote.walk(tree)
        return not files and not explicit

    def _markers_last(self, moved: list[StagedFile]) -> None:
        """A commit marker renamed into place (``_SUCCESS.tmp`` to ``_SUCCESS``, Orbax's
        temporary directory with its commit_success.txt): its upload waits for every upload
        queued before it, as its close would have."""
        assert self.writes.write_back is not None
        for staged in moved:
            if self.writes.is_marker(staged.key) and not self.writes.is_held(staged.key):
                self.writes.write_back.mark_last(staged)

    def _rename_file(self, src: str, dst: str) -> list[Copied]:
        staged = self.writes.staged.get(src)
        if staged is None:
            return self._rename_file_held(src, dst, None)
        with staged.lock:  # no flush of its writer between the remote rename and the rekey
            return self._rename_file_held(src, dst, staged)

    def _rename_file_held(self, src: str, dst: str, staged: StagedFile | None) -> list[Copied]:
        """The file rename, with ``staged`` (the source's staged file) held by the caller."""
        if staged is not None:
            self.writes.commit(staged)  # the remote must hold the bytes we are about to move
        replaced = self.writes.staged.get(dst)
        if replaced is not None:
            replaced.keep_old_bytes()  # still open: its descriptors keep the bytes
        pending = self.deferred.get(src)
        if pending is None:
            copies = self.remote.rename(src, dst)
        else:
            # Attributes held back since its commit (rsync's times and mode of its temporary
            # file): the copy carries them, one request for all. A source that is no longer the
            # version they were set on is renamed as it is, and they go with those bytes.
            try:
                copies = self.remote.rename(src, dst, attrs=pending.attrs, expect=pending.version)
            except PreconditionFailed:
                copies = self.remote.rename(src, dst)
            self.deferred.discard(src)
        self.writes.move(src, dst)
        return copies

    def _rename_dir(self, src: str, dst: str) -> list[Copied]:
        pending = self.writes.staged_under(src)
        with contextlib.ExitStack() as held:
            # Their writers' flushes wait until they are moved: one between the copy and the
            # move would commit to the old name, gone by then (in key order: no deadlock
            # with another rename of the tree).
            for _, staged in pending:
                held.enter_context(staged.lock)
            for _, staged in pending:
                self.writes.commit(staged)
            # One rename(2) on a local disk; on object stores every object is copied, then the
            # originals are deleted: not atomic (documented), so journaled: a daemon killed midway
            # (or a failure) leaves the next start the rest to do.
            if self.remote.renames_in_place:
                copies = self.remote.rename_tree(src, dst)
            else:
                try:
                    copies = self._journaled(src, dst)
                except Exception as exc:
                    journal = renames.journal_of(self.writes.staging_dir, self.remote, src, dst)
                    if journal is not None:
                        with self.lock:
                            self.unfinished[:] = [u for u in self.unfinished if (u.src, u.dst) != (src, dst)]
                            self.unfinished.append(renames.UnfinishedRename(src, dst, str(journal), describe(exc),
                                                                            time.time()))
                    raise
            self.writes.move(src, dst)
        return copies

    # -- the read handles that follow ------------------------------------------------------------
    def _in_place_readers(self, src: str) -> list[tuple[Handle, str, ObjectVersion]]:
        """Before a rename(2) of ``src``: the read handles under it whose file is still the very
        version they read (its ctime too: an in-place rewrite keeping size and mtime is not)."""
        with self.lock:
            found = [(handle, handle.key, handle.info.version) for handle in self.handles.all_locked()
                     if handle.staged is None and handle.info is not None
                     and handle.info.version is not None and under(handle.key, src)]
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

    def _moves(self, copies: list[Copied]) -> list[Move]:
        """The remote made each ``dst`` a copy of exactly version ``old`` of ``src``, as its
        version ``new``: read handles of that version follow it, as an open file on a disk
        keeps reading after a ``mv``. Handles of another version (the source changed since
        they opened) stay, and find it gone (ESTALE)."""
        pinned = {c.src: c for c in copies if c.old is not None and c.new is not None}
        if not pinned:
            return []
        with self.lock:
            return [(handle, c.src, c.old, c.dst, c.new) for handle in self.handles.all_locked()
                    if handle.staged is None and (c := pinned.get(handle.key)) is not None
                    and handle.info is not None and handle.info.version == c.old]

    def _follow(self, moves: list[Move]) -> None:
        """Apply moves whose handle is still there as it was; their readers are told outside
        our lock (the reader's own lock, then the fetcher's, a leaf)."""
        readers: list[tuple[ObjectReader | None, ObjectRef]] = []
        with self.lock:
            for handle, was, version, key, now in moves:
                if handle.key == was and handle.info is not None and handle.info.version == version:
                    self.kernel.follow_locked(handle, key, now)
                    readers.append((handle.reader, self.ref(key, handle.info)))
        for reader, ref in readers:
            if reader is not None:
                reader.moved(ref)
