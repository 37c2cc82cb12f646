"""What S3 and GCS share: directories are prefixes, an empty one is a ``name/`` marker object,
keys are UTF-8, commits carry a precondition the server checks, big files go in parts.
"""

from __future__ import annotations

import abc
import errno
import os
from typing import Any, ClassVar

from dataclasses import replace

from marinfs.errors import PreconditionFailed
from marinfs.objects import ABSENT, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote.base import LINK_SUFFIX, MiB, Remote
from marinfs.remote.parts import S3_MAX_PARTS, PartSession, upload_file


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ObjectStoreRemote(Remote, abc.ABC):
    object_store = True
    streams = True
    version_kind: ClassVar[str] = ""  # the kind of ObjectVersion this store issues and checks

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._options(options)
        options.setdefault("use_listings_cache", False)
        return options

    # S3 and GCS keep keys of at most 1024 bytes of UTF-8 (SeaweedFS too: "KeyTooLongError").
    max_key_bytes: ClassVar[int] = 1024

    def full(self, key: str) -> str:
        """The store's path of ``key``; a key the store can never hold is refused here, before
        any request, with its errno: a name that is not UTF-8 is EILSEQ (not an encoding error
        deep in the client), a key over the store's limit ENAMETOOLONG (not a 400 retried)."""
        if key and not _utf8(key):
            raise OSError(errno.EILSEQ, "object store keys are UTF-8; this name is not", key)
        full = super().full(key)
        self._check_length(full)
        return full

    def _check_length(self, full: str) -> None:
        """``full`` (``bucket/key``) as an object's name must fit the store's limit."""
        size = len(full.encode("utf-8", "surrogateescape")) - len(full.split("/", 1)[0]) - 1
        if size > self.max_key_bytes:
            raise OSError(errno.ENAMETOOLONG, f"the object key would be {size} bytes; "
                          f"{self.protocol}:// keeps at most {self.max_key_bytes}", full[-80:])

    def check_key(self, key: str) -> None:
        self.full(key)

    def _check(self) -> None:
        bucket = self.root.split("/", 1)[0]
        self._call("list", self.fs.ls, bucket + "/", detail=False)

    # -- metadata ------------------------------------------------------------------------------
    def stat(self, key: str, likely_dir: bool = False, likely_link: bool = False) -> ObjectInfo:
        """On object stores a file costs one request (a HEAD, or GCS's metadata GET) and a
        directory two (that HEAD, then a one-key delimited LIST), where fsspec's ``info`` spends
        two to three on either. ``likely_dir`` (it was a directory last time) asks the LIST
        first, so revalidating a known directory costs one request. A symbolic link
        (``key.rclonelink``, rclone's convention) is one HEAD after those (S3 asks the LIST and
        whether the link exists in one listing, ``_probe``: a miss costs a HEAD and that LIST);
        ``likely_link`` (a link last time) asks it first, so revalidating a link costs one."""
        if not key:
            return super().stat(key)
        full = self.full(key)
        if likely_link and self.link_objects:  # a link last time: one HEAD of key.rclonelink
            try:
                return replace(self._info_of(self._call("head", self._head_object, full + LINK_SUFFIX), key), link=True)
            except FileNotFoundError:
                pass
        if likely_dir and self._call("list", self._prefix_exists, full):
            return ObjectInfo(name=key, is_dir=True)  # was a directory last time: one LIST
        if not self._reserved(key):
            try:
                return self._info_of(self._call("head", self._head_object, full), key)
            except FileNotFoundError:
                pass
        if not likely_dir and self.link_objects:
            probed = self._call("list", self._probe, full)
            if probed is not None:  # one LIST said both: a miss is two requests, not three
                is_dir, has_link = probed
                if is_dir:
                    return ObjectInfo(name=key, is_dir=True)
                if not has_link:
                    raise FileNotFoundError(errno.ENOENT, "no such object or prefix", self.url + "/" + key)
                likely_dir = True  # (asked: only the link's HEAD is left)
        if not likely_dir and self._call("list", self._prefix_exists, full):
            return ObjectInfo(name=key, is_dir=True)
        if self.link_objects:
            try:
                raw = self._call("head", self._head_object, full + LINK_SUFFIX)
                return replace(self._info_of(raw, key), link=True)
            except FileNotFoundError:
                pass
        raise FileNotFoundError(errno.ENOENT, "no such object or prefix", self.url + "/" + key)

    @abc.abstractmethod
    def _head_object(self, full: str) -> dict[str, Any]:
        """One object's metadata in one request, as an fsspec info dict."""

    @abc.abstractmethod
    def _prefix_exists(self, full: str) -> bool:
        """Whether anything is under ``full/`` (a one-key delimited listing)."""

    def _probe(self, full: str) -> tuple[bool, bool] | None:
        """After a HEAD of ``full`` found nothing: whether ``full/`` holds anything (a
        directory) and whether its link object exists, from one listing of the names that
        begin with ``full``; None where a store cannot say both in one request."""
        return None

    def _is_marker(self, raw: dict[str, Any], name: str) -> bool:
        return name.endswith("/")

    # -- symbolic links ------------------------------------------------------------------------
    def symlink(self, key: str, target: str) -> ObjectVersion | None:
        """One PUT of ``key.rclonelink`` that must not exist yet (checked by the server)."""
        if not self.link_objects:
            raise NotImplementedError
        try:
            return self._put_small(target.encode("utf-8", "surrogateescape"), key + LINK_SUFFIX, ABSENT)
        except PreconditionFailed:
            raise FileExistsError(errno.EEXIST, "a link of that name exists", key) from None

    def _link_body(self, key: str, info: ObjectInfo) -> bytes:
        """One GET of the version the stat saw (S3 ``If-Match``)."""
        return self.read_range(key + LINK_SUFFIX, 0, info.size, info.version) if info.size else b""

    # -- commits -------------------------------------------------------------------------------
    def _native(self, key: str, expect: ObjectVersion | None) -> ObjectVersion | None:
        """``expect`` as the server can check it: a version this store did not issue (a journal
        from another backend) is compared with a stat now, and the write is then unconditional."""
        if expect is not None and expect.kind not in ("absent", self.version_kind):
            self._check_expected(key, expect)
            return None
        return expect

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None,
               attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        """One conditional PUT below a part, else a part session (parts in parallel where the
        store allows); the precondition is checked by the server, atomically. ``attrs`` go as
        the object's metadata in the same request (the PUT, the multipart create, the
        resumable session's start)."""
        expect = self._native(key, expect)
        attrs = None if attrs is None or attrs.empty else attrs
        size = os.path.getsize(local_path)
        if size >= self.settings.upload_part_size:  # parts count their own bytes
            # S3 allows 10,000 parts: files past 160 GB get bigger parts, fewer at a time.
            part = max(self.settings.upload_part_size, -(-size // S3_MAX_PARTS // MiB) * MiB)
            in_flight = max(1, min(self.settings.upload_concurrency, (256 * MiB) // part))
            hook = self.on_upload_session
            note = (lambda record, opened: hook(local_path, record, opened)) if hook is not None else None
            return upload_file(local_path, lambda: self.part_session(key, expect, part, attrs),
                               part, self.part_pool, in_flight, on_session=note)
        with open(local_path, "rb") as f:
            version = self._put_small(f.read(), key, expect, attrs)
        self.stats.add_bytes(bytes_out=size)
        return version

    def put_small(self, key: str, data: bytes, expect: ObjectVersion | None) -> ObjectVersion | None:
        version = self._put_small(data, key, self._native(key, expect))
        self.stats.add_bytes(bytes_out=len(data))
        return version

    @abc.abstractmethod
    def _put_small(self, data: bytes, key: str, expect: ObjectVersion | None,
                   attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        """One conditional PUT of a whole object, ``attrs`` its metadata; its new version if
        the store says."""

    @abc.abstractmethod
    def part_session(self, key: str, expect: ObjectVersion | None, part_size: int | None = None,
                     attrs: PosixAttrs | None = None) -> PartSession:
        """A multipart (S3) or resumable (GCS) upload of ``key``, ``attrs`` its metadata."""

    # -- directories ---------------------------------------------------------------------------
    def make_dir(self, key: str) -> None:
        marker = self.full(key) + "/"  # the `dir/` marker object
        self._check_length(marker)
        self._call("put", self.fs.pipe_file, marker, b"")

    def remove_dir(self, key: str) -> None:
        try:
            self._call("delete", self.fs.rm_file, self.full(key) + "/")
        except FileNotFoundError:
            pass  # an implicit directory: nothing to delete
