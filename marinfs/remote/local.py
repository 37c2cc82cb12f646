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
from marinfs.objects import Copied, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote.base import TMP_PREFIX, Remote

XATTR_PREFIX = "user."


def posix_of(path: str, st: os.stat_result | None = None) -> PosixAttrs:
    """What the file at ``path`` (never followed) holds: every field, since a local file always
    has a mode, owner and mtime; and its ``user.*`` xattrs (none where the filesystem keeps none)."""
    st = st or os.lstat(path)
    xattrs: tuple[tuple[str, bytes], ...] = ()
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        names = []  # ENOTSUP and friends: no xattrs here
    if names:  # (most files have none: a listing pays one listxattr per entry, no more)
        items = []
        for name in names:
            if name.startswith(XATTR_PREFIX):
                try:
                    items.append((name, os.getxattr(path, name, follow_symlinks=False)))
                except OSError:
                    pass  # removed meanwhile, or not readable
        xattrs = tuple(sorted(items))
    return PosixAttrs(st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime_ns, xattrs)


def apply_posix(path: str, attrs: PosixAttrs, replace_xattrs: bool = True) -> None:
    """Make the file or directory at ``path`` hold ``attrs`` with the syscalls; a field left
    None stays as it is (a local file always has one). Owner before mode (chown clears setuid),
    mtime last. ``replace_xattrs``: ``user.*`` names not in ``attrs`` are removed."""
    st = os.stat(path)
    wanted = dict(attrs.xattrs)
    if replace_xattrs:
        try:
            present = [n for n in os.listxattr(path) if n.startswith(XATTR_PREFIX)]
        except OSError:
            present = []
        for name in present:
            if name not in wanted:
                os.removexattr(path, name)
    for name, value in attrs.xattrs:
        os.setxattr(path, name, value)
    uid = -1 if attrs.uid is None or attrs.uid == st.st_uid else attrs.uid
    gid = -1 if attrs.gid is None or attrs.gid == st.st_gid else attrs.gid
    if uid != -1 or gid != -1:
        os.chown(path, uid, gid)
    if attrs.mode is not None:
        os.chmod(path, attrs.mode)
    if attrs.mtime_ns is not None:
        os.utime(path, ns=(st.st_atime_ns, attrs.mtime_ns))


class LocalRemote(Remote):
    renames_in_place = True  # rename(2): the same file under the new name (only its ctime moves on)
    protocols = ("file", "local")
    _root_default = "/"
    link_objects = False  # real symbolic links
    lists_posix = True  # each entry's lstat (taken for its size anyway) and xattrs

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
                                                                      st.st_ctime_ns),
                          posix=posix_of(path, st))

    def _posix_of(self, raw: dict[str, Any], is_dir: bool) -> PosixAttrs | None:
        """From the file itself (directories too): an lstat for the nanoseconds fsspec's float
        mtime lost, and its xattrs. None if it is gone meanwhile."""
        try:
            return posix_of(raw["name"])
        except OSError:
            return None

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

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None,
               attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        """Copy to a hidden temporary name, check ``expect``, rename into place (atomic).
        ``attrs`` are set on the temporary file before the rename, so the file appears with
        them, and a failure (EPERM for a chown by a user) commits nothing."""
        size = os.path.getsize(local_path)
        target = self.full(key)
        tmp = posixpath.join(posixpath.dirname(target), f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            self._call("put", self.fs.put_file, local_path, tmp)
            if attrs is not None and not attrs.empty:
                apply_posix(tmp, attrs, replace_xattrs=False)
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

    def set_attrs(self, key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion | None:
        """The syscalls, after a stat that must show ``expect`` (as close as a local disk
        allows). The version after differs: chmod and chown change ctime, utimens mtime."""
        self._current_file(key, expect)
        self.stats.add("setattr")
        apply_posix(self.full(key), attrs)
        return self.stat(key).version

    def set_dir_attrs(self, key: str, attrs: PosixAttrs) -> None:
        self.stats.add("setattr")
        path = self.full(key)
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        apply_posix(path, attrs)

    def rename(self, src: str, dst: str, attrs: PosixAttrs | None = None,
               expect: ObjectVersion | None = None) -> list[Copied]:
        """rename(2): atomic, and it replaces an existing target. No copy: the files themselves
        move (the filesystem's readers follow them by inode, ``renames_in_place``), with their
        attributes: none are folded into it (``folds_attrs`` is False)."""
        self._no_fold(attrs)
        self.stats.add("rename")
        # rename(2) moves names, never what a link leads to: neither last component is followed.
        os.replace(self.entry(src), self.entry(dst))
        return []

    def rename_tree(self, src: str, dst: str) -> list[Copied]:
        """One rename(2) moves the whole tree, atomically."""
        return self.rename(src, dst)

    def remove_dir(self, key: str) -> None:
        self.stats.add("rmdir")
        os.rmdir(self.full(key))
