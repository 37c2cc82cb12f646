"""Reads of open files: from this node's staged writes, else through an ``ObjectReader`` of
the version the handle opened, never two versions in one handle.

A handle's ``reader`` and ``served`` change under the mount's table lock (``lock``).
"""

from __future__ import annotations

import threading
import os

from marinfs.core.handles import Handle, HandleTable
from marinfs.core.kernel import KernelView
from marinfs.core.namespace import Namespace
from marinfs.core.writes import Writes
from marinfs.errors import StaleVersionError
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import ObjectInfo, ObjectRef, ObjectVersion
from marinfs.read.reader import ChunkFetcher, ObjectReader
from marinfs.write.staging import StagedFileGone


class Reads:
    """Reads by handle, and what they fetch their chunks by."""

    def __init__(self, lock: threading.Lock, handles: HandleTable, kernel: KernelView,
                 writes: Writes, fetcher: ChunkFetcher, metadata: MetadataCache,
                 namespace: Namespace, remote_url: str, max_readahead_chunks: int) -> None:
        self.lock = lock
        self.handles = handles
        self.kernel = kernel
        self.writes = writes
        self.staged = writes.staged  # the writes room's table
        self.fetcher = fetcher
        self.metadata = metadata
        self.namespace = namespace
        self.remote_url = remote_url
        self.max_readahead_chunks = max_readahead_chunks

    def read_into(self, fh: int, dest: memoryview, offset: int) -> int:
        """Fill ``dest`` (writable bytes: the FUSE reply buffer) with the file's bytes at
        ``offset``, no more than it has there; answers how many. The bytes are copied once, from
        a chunk in memory or read from a cached chunk or a staging file straight into ``dest``."""
        handle = self.handles.get(fh)
        staged = handle.staged
        if staged is None and not handle.orphan:  # (an orphan's name is another file's now)
            other = self.staged.get(handle.key)  # another handle's uncommitted writes
            staged = other if other is not None and other.dirty else None
        if staged is not None:
            try:
                return staged.read_into(dest, offset)
            except StagedFileGone:  # committed and dropped meanwhile: the object has its bytes
                if handle.staged is staged:
                    raise
        if handle.info is not None and handle.info.version is None and not handle.orphan:
            kept = self.writes.kept(handle.key)  # bytes kept after a failed commit: only here
            if kept is not None:
                fd = os.open(kept, os.O_RDONLY)
                try:
                    return os.preadv(fd, [dest], offset)
                finally:
                    os.close(fd)
        reader = self._reader(handle)
        try:
            n = reader.read_into(dest, offset)
        except StaleVersionError:
            assert handle.info is not None
            opened = handle.info.version
            with self.lock:
                if handle.served or not self.kernel.may_repin_locked(handle, opened):
                    raise  # never mix versions within one handle: ESTALE
            # Nothing served yet: the stat we opened with was stale. Open the new version.
            self.metadata.invalidate(handle.key)
            info = self.namespace.lookup(handle.key)
            with self.lock:
                if handle.served or not self.kernel.may_repin_locked(handle, opened):  # a read or a reader came meanwhile
                    raise
                if not self.kernel.repin_locked(handle, info):  # (the only reader of the page cache: it follows)
                    raise
                handle.info, handle.reader = info, None
            reader = self._reader(handle)
            n = reader.read_into(dest, offset)
        if handle.served and handle.reader is reader:
            return n  # both set under the lock; once served, the reader never changes again
        with self.lock:
            if handle.reader is not reader:
                # Another read of this handle moved it to a newer version while this one read
                # the old: fail this one rather than answer both.
                raise StaleVersionError(f"{handle.key} changed while it was read")
            handle.served = True  # only bytes actually returned pin the handle to its version
            if handle.page_users is not None:
                handle.page_users.filled = True
        return n

    def _reader(self, handle: Handle) -> ObjectReader:
        reader = handle.reader
        if reader is None:
            with self.lock:  # one reader per version of a handle, however many reads ask at once
                reader = handle.reader
                if reader is None:
                    info = handle.info
                    assert info is not None
                    reader = handle.reader = ObjectReader(self.ref(handle.key, info, id(handle)), self.fetcher,
                                                          self.max_readahead_chunks)
        return reader

    def ref(self, key: str, info: ObjectInfo, unversioned: int = 0) -> ObjectRef:
        """What reads of ``info`` fetch and key their chunks by (``unversioned``: a handle's id,
        for an object without a version: its chunks are its own)."""
        version = info.version or ObjectVersion.unversioned(unversioned)
        return ObjectRef(url=f"{self.remote_url}/{key}", key=key, version=version, size=info.size)

    def fetch_ahead(self, info: ObjectInfo) -> bool:
        """Fetch a file a walker is about to open (WalkAhead): unless this node is writing it."""
        if info.name in self.staged:
            return True
        return self.fetcher.fetch_ahead(self.ref(info.name, info))
