"""Open file descriptions: the handle table, the groups of handles that share the kernel's page
cache of a file (or a backing file, passthrough), and what an open answers the kernel."""

from __future__ import annotations

import errno
import itertools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from marinfs.errors import FsError
from marinfs.objects import ObjectInfo, ObjectVersion
from marinfs.read.reader import ObjectReader
from marinfs.write.staging import StagedFile


@dataclass
class Handle:
    """One open file description. Its fields change under the mount's table lock (``Tables``),
    except ``reader``'s first setting (also under it) and ``staged``, set once at open."""

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
    # has before this handle's first read (answered once, in the open's reply).
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


@dataclass(frozen=True)
class Opened:
    """An open's (or create's) one reply: the handle number and how the kernel is to treat
    the file (mountpoint-s3's ``Opened``): keep its page cache, read around it (direct I/O),
    read a backing file itself (passthrough, ``backing_id`` > 0), or first drop the attributes
    it holds (another version's size, which would cut this handle's reads short)."""

    fh: int
    keep_cache: bool = False
    direct_io: bool = False
    backing_id: int = 0
    drop_attrs: bool = False


class HandleTable:
    """Handle numbers to open file descriptions. ``_handles`` is guarded by ``lock`` (the
    mount's table lock, shared with the kernel view: it walks the handles of a key)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self._handles: dict[int, Handle] = {}  # GUARDED_BY(lock)
        self._next_fh = itertools.count(1)

    def add(self, handle: Handle) -> int:
        with self.lock:
            fh = next(self._next_fh)
            self._handles[fh] = handle
        return fh

    def get(self, fh: int) -> Handle:
        """The handle of ``fh``; EBADF if it is not open (one dict read: no lock needed)."""
        try:
            return self._handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    def pop_locked(self, fh: int) -> Handle | None:
        return self._handles.pop(fh, None)

    def numbers(self) -> list[int]:
        with self.lock:
            return list(self._handles)

    def all_locked(self) -> Iterator[Handle]:
        """Every open handle (under ``lock``)."""
        return iter(self._handles.values())
