"""Paths and keys, and what every room of the core shares about them.

Paths are the FUSE adapter's absolute paths (``/a/b``); keys are the remote's relative ones
(``a/b``).
"""

from __future__ import annotations

import errno
import posixpath

from marinfs.errors import FsError
from marinfs.meta.metadata import MetadataCache
from marinfs.objects import ObjectInfo
from marinfs.remote import Remote

NAME_MAX = 255
PATH_MAX = 4096  # the longest symbolic link target the kernel passes (with its NUL)
ROOT = ObjectInfo(name="", is_dir=True)


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


def under(key: str, tree: str) -> bool:
    """``key`` is ``tree`` or inside it."""
    return key == tree or key.startswith(tree + "/")


def entries_changed(remote: Remote, metadata: MetadataCache, *keys: str) -> None:
    """The directories of ``keys`` gained, lost or replaced an entry. A local disk's
    directories have real times that this moves (a commit renames into place): their
    cached stats go, so ``rsync -a`` and ``tar`` setting a directory's mtime after its
    files compare with the time it has now. Object stores keep a directory's time as set."""
    if remote.object_store or not remote.lists_posix:
        return
    for key in keys:
        parent = posixpath.dirname(key)
        if parent:
            metadata.forget(parent, changed=True)
