"""A directory on a local disk: real directories, atomic commits and renames.

A commit is written under a hidden ``.marinfs-tmp-*`` name and renamed into place, so readers
never see half a file. Symbolic links are real ones, reported as links (lstat, readlink): the
kernel resolves them, never marinfs. A link's target is only text here; every read, write,
listing or removal of data goes through ``full()``, whose path, links resolved, must stay under
the prefix, so a mount never becomes a way out of the tree it was given.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import uuid
from typing import Any

from marinfs.errors import UsageError
from marinfs.objects import ObjectInfo, ObjectVersion
from marinfs.remote.base import TMP_PREFIX, Remote


class LocalRemote(Remote):
    protocols = ("file", "local")
    _root_default = "/"
    link_objects = False  # real symbolic links

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

    def entry(self, key: str) -> str:
        """The path of ``key`` itself, its last component not followed: for operations on a
        name (lstat, readlink, symlink, unlink, rename), which never touch what a link leads
        to. Its directory, links resolved, must be under the prefix."""
        path = super().full(key)
        if key and not self._inside(posixpath.dirname(path)):
            raise PermissionError(errno.EACCES, "a symbolic link leads outside the mounted prefix", path)
        return path

    def _lstat_link(self, key: str, path: str) -> ObjectInfo | None:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            return None
        target = os.readlink(path)
        return ObjectInfo(name=key, is_dir=False, size=st.st_size, mtime_ns=st.st_mtime_ns, link=True,
                          target=target, version=ObjectVersion.local(st.st_mtime_ns, st.st_size, st.st_ino,
                                                                      st.st_ctime_ns))

    def stat(self, key: str, likely_dir: bool = False, likely_link: bool = False) -> ObjectInfo:
        if key:
            try:
                link = self._lstat_link(key, self.entry(key))
            except FileNotFoundError:
                self.stats.add("head")  # one lstat: what super().stat counts for a name
                raise
            if link is not None:
                self.stats.add("head")
                return link
        return super().stat(key, likely_dir)

    def _link_info(self, raw: dict[str, Any], key: str) -> ObjectInfo:
        try:
            link = self._lstat_link(key, raw["name"])
        except FileNotFoundError:
            link = None
        return link if link is not None else self._info_of(raw, key)

    def symlink(self, key: str, target: str) -> ObjectVersion | None:
        self.stats.add("put")
        os.symlink(target, self.entry(key))  # FileExistsError if anything has the name
        return None

    def readlink(self, key: str, info: ObjectInfo) -> str:
        self.stats.add("get")
        return os.readlink(self.entry(key))  # the link now, not the stat's text

    def delete_link(self, key: str) -> None:
        self.stats.add("delete")
        path = self.entry(key)
        if not os.path.islink(path):
            raise FileNotFoundError(errno.ENOENT, "not a symbolic link any more", path)
        os.unlink(path)

    def rename_link(self, src: str, dst: str) -> None:
        self.rename(src, dst)

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
        # rename(2) moves names, never what a link leads to: neither last component is followed.
        os.replace(self.entry(src), self.entry(dst))

    def rename_tree(self, src: str, dst: str) -> None:
        """One rename(2) moves the whole tree, atomically."""
        self.rename(src, dst)

    def remove_dir(self, key: str) -> None:
        self.stats.add("rmdir")
        os.rmdir(self.full(key))
