"""A directory on a local disk: real directories, atomic commits and renames.

A commit is written under a hidden ``.marinfs-tmp-*`` name and renamed into place, so readers
never see half a file. Symbolic links are followed only while they stay under the prefix: a
mount must not become a way out of the tree it was given.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import uuid
from typing import Any

from marinfs.errors import UsageError
from marinfs.objects import ObjectVersion
from marinfs.remote.base import TMP_PREFIX, Remote


class LocalRemote(Remote):
    protocols = ("file", "local")
    _root_default = "/"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(url, storage_options, settings)
        # Where the prefix really is: symbolic links must not lead out of it.
        self._real_root = os.path.realpath(self.root)

    def full(self, key: str) -> str:
        path = super().full(key)
        if key and not self._inside(path):
            raise PermissionError(errno.EACCES, "a symbolic link leads outside the mounted prefix", path)
        return path

    def _inside(self, path: str) -> bool:
        """Whether a local path, symbolic links resolved, stays under the prefix."""
        real, root = os.path.realpath(path), self._real_root
        return real == root or real.startswith(root.rstrip("/") + "/")

    def _followed(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """A symbolic link as what it leads to, or None when that is outside the prefix or
        nothing: links are followed only within the mounted tree."""
        path = raw["name"]
        try:
            if not self._inside(path):
                return None
            st = os.stat(path)
        except OSError:
            return None
        return {**raw, "type": "directory" if stat.S_ISDIR(st.st_mode) else "file", "size": st.st_size,
                "mtime": st.st_mtime, "created": st.st_ctime, "ino": st.st_ino}

    def _check(self) -> None:
        info = self.fs.info(self.root)
        if info.get("type") != "directory":
            raise UsageError(f"{self.url} is not a directory")

    def _confirm_dir(self, key: str) -> None:
        """A local listing of a missing or non-directory path fails by itself."""

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None) -> ObjectVersion | None:
        """Copy to a hidden temporary name, check ``expect``, rename into place (atomic)."""
        size = os.path.getsize(local_path)
        target = self.full(key)
        tmp = posixpath.join(posixpath.dirname(target), f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            self._call("put", self.fs.put_file, local_path, tmp)
            self._check_expected(key, expect)
            self.fs.mv(tmp, target)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except OSError:
                pass
            raise
        self.stats.add_bytes(bytes_out=size)
        return None

    def rename(self, src: str, dst: str) -> None:
        """rename(2): atomic, and it replaces an existing target."""
        self.stats.add("rename")
        os.replace(self.full(src), self.full(dst))

    def rename_tree(self, src: str, dst: str) -> None:
        """One rename(2) moves the whole tree, atomically."""
        self.rename(src, dst)

    def remove_dir(self, key: str) -> None:
        self.stats.add("rmdir")
        os.rmdir(self.full(key))
