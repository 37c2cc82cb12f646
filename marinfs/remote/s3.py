"""S3 (and S3-compatible stores): s3fs for what it does well, plain HTTP for the hot paths.

Chunk fetches (the fetcher's ``read_into``) read the GET's body from the socket straight into
the chunk's pooled buffer, over urllib3 (s3http.py); other pinned ranged reads go through
obstore where it is installed (s3obstore.py: Rust, the lock released, the body handed on as its
buffer), and chunk fetches too with MARINFS_GET=obstore (its buffer then copied in: measured,
more CPU per GiB than the socket read); other reads, small commits, upload parts and listings
go as presigned URLs over urllib3 on the calling threads (s3http.py: half the CPU per GiB of
s3fs's event loop; parts leave the staging file by sendfile, each with a CRC-32C the server
checks, or with MARINFS_PART_CHECKSUM=md5 a Content-MD5); creating and completing
multipart uploads, HEADs, copies and deletes stay with s3fs. Versions are ETags; every commit
carries ``If-Match``/``If-None-Match: *``, every versioned read ``If-Match``.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import fsspec.asyn

from marinfs import posixmeta
from marinfs.checksums import crc32c_extend
from marinfs.errors import PreconditionFailed, UsageError
from marinfs.objects import Copied, ObjectVersion, PosixAttrs, s3_match
from marinfs.remote.base import LINK_SUFFIX, MiB, OnPage, TruncatedResponse, _exactly, _one_line, _run
from marinfs.remote.objectstore import ObjectStoreRemote
from marinfs.remote.parts import Counter, Runner
from marinfs.remote.recorded import Recorded
from marinfs.remote.s3http import CHECKSUMS, ChecksumNotChecked, Presigner, S3Http
from marinfs.remote.s3obstore import ObstoreGetter, Unusable, representable

log = logging.getLogger(__name__)
T = TypeVar("T")
GiB = 1 << 30
# What a metadata REPLACE must send again, or S3 resets it (HEAD answer -> CopyObject/
# CreateMultipartUpload parameter). StorageClass: a copy without one is STANDARD.
_KEPT_HEADERS = ("ContentType", "ContentEncoding", "ContentLanguage", "ContentDisposition", "CacheControl",
                 "StorageClass", "ServerSideEncryption", "SSEKMSKeyId", "WebsiteRedirectLocation")
PROBE_KEYS = 100  # a miss's one LIST: names beginning with the key, up to its key/ (see _probe)
HEAD_REUSE_SECONDS = 5.0  # a HEAD this recent of the expected ETag spares set_attrs its own


class _Head:
    """What set_attrs keeps from an object's HEAD (or from the PUT we sent): its ETag, size,
    user metadata and the headers a REPLACE must repeat."""

    __slots__ = ("etag", "size", "metadata", "headers", "at")

    def __init__(self, etag: str, size: int, metadata: dict[str, str], headers: dict[str, Any]) -> None:
        self.etag, self.size, self.metadata, self.headers = etag, size, metadata, headers
        self.at = time.monotonic()


class S3Remote(Recorded, ObjectStoreRemote):
    protocols = ("s3", "s3a")
    version_kind = "etag"
    # CopyObject copies up to 5 GiB; past that a copy (set_attrs, rename) is a multipart
    # upload of UploadPartCopy parts. Class attributes, so tests can lower them.
    copy_limit: ClassVar[int] = 5 * GiB
    copy_part_size: ClassVar[int] = 512 * MiB
    # S3 keeps 2 KiB of user metadata per object (each name and value's UTF-8 bytes), where
    # the attributes go as s3fs-fuse's keys (posixmeta.to_s3).
    attrs_limit: ClassVar[int] = 2048

    @classmethod
    def attrs_bytes(cls, attrs: PosixAttrs) -> int:
        return sum(len(k.encode()) + len(v.encode()) for k, v in posixmeta.to_s3(attrs).items())

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(url, storage_options, settings)
        self.fs.retries = 1  # s3fs's own retry loop; ours is the one that retries
        self._direct = self._direct_http()
        self._direct_refused = False  # set once a server refuses our own requests but not s3fs's
        self._heads: dict[str, _Head] = {}  # key -> its latest HEAD (or our PUT), for set_attrs
        self._heads_lock = threading.Lock()
        if self._direct is not None:
            self._direct.on_request = lambda: self.stats.add("list")  # botocore's hook does not see it
        self._obstore = self._obstore_getter()
        self._obstore_refused = False  # set once obstore failed where the other paths did not
        # Chunk fetches into the fetcher's buffers: read from the socket by urllib3 (default), or
        # through obstore and copied in (MARINFS_GET=obstore).
        self.get_into_socket = self.settings.get != "obstore"
        self.part_checksum = self._checksum_setting(self.settings.part_checksum)

    @staticmethod
    def _checksum_setting(wanted: str) -> str:
        """What each part sent by us carries (MARINFS_PART_CHECKSUM, checked by the settings
        table): crc32c (the default, where google-crc32c's C library is there) or md5
        (Content-MD5, for a store that does not check x-amz-checksum-crc32c; 1.8 CPU-s/GiB more)."""
        if wanted not in ("crc32c", "md5"):  # a RemoteSettings built in Python, past the table
            raise UsageError(f"part_checksum {wanted!r}: use crc32c or md5")
        if wanted not in CHECKSUMS:
            log.warning("no CRC-32C in C here (google-crc32c): upload parts carry Content-MD5")
            return "md5"
        return wanted

    def _unchecked(self, why: ChecksumNotChecked) -> None:
        """The server does not check CRC-32C (it did not echo one): MD5 from now on."""
        if self.part_checksum != "md5":
            self.part_checksum = "md5"
            log.warning("%s: %s; upload parts carry Content-MD5 from now on (MARINFS_PART_CHECKSUM=md5 "
                        "says so at once)", self.url, why)

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Our timeouts, and botocore's retries reduced to one attempt: ours is the one loop."""
        options = super()._options(options)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", self.settings.connect_timeout)
        config.setdefault("read_timeout", self.settings.read_timeout)
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
        return options

    def _instrument(self) -> bool:
        client = fsspec.asyn.sync(self.fs.loop, self.fs.set_session)
        stats = self.stats

        def before_send(event_name: str = "", **_: Any) -> None:
            stats.add(_s3_kind(event_name.rsplit(".", 1)[-1]))

        client.meta.events.register("before-send.s3", before_send)
        return True

    def _direct_http(self) -> S3Http | None:
        """Ranged GETs on plain threads (see s3http.py), unless s3fs adds request options a
        presigned URL cannot carry (requester pays, SSE-C) or MARINFS_DIRECT_GET=0."""
        if not self.settings.direct_get or self.fs.req_kw or self.fs.s3_additional_kwargs:
            return None
        config = dict(getattr(self.fs, "config_kwargs", None) or {})
        verify = (getattr(self.fs, "client_kwargs", None) or {}).get("verify")
        if verify is None:
            verify = os.environ.get("AWS_CA_BUNDLE") or True
        self._presigner = Presigner(self.fs)
        return S3Http(self._presigner.url,
                         connect_timeout=float(config.get("connect_timeout", self.settings.connect_timeout)),
                         read_timeout=float(config.get("read_timeout", self.settings.read_timeout)),
                         verify=verify)

    def _obstore_getter(self) -> ObstoreGetter | None:
        """Pinned ranged GETs through obstore (s3obstore.py) where it is installed and can
        describe this filesystem's store; MARINFS_OBSTORE=0 (or MARINFS_DIRECT_GET=0) turns it off."""
        if not (self.settings.direct_get and self.settings.obstore):
            return None
        config = dict(getattr(self.fs, "config_kwargs", None) or {})
        try:
            return ObstoreGetter(self.fs, float(config.get("connect_timeout", self.settings.connect_timeout)),
                                 float(config.get("read_timeout", self.settings.read_timeout)))
        except Unusable as why:
            log.debug("%s: reads without obstore: %s", self.url, why)
            return None

    def warm(self) -> None:
        """The presigning botocore client (about 0.3 s of botocore loading its service model,
        which landed on a fresh mount's first listing) and obstore's store for the bucket."""
        bucket = self.root.split("/", 1)[0]
        try:
            if self._direct is not None:
                self._presigner.listing({"Bucket": bucket, "Prefix": "", "Delimiter": "/"})
            if self._obstore is not None:
                self._obstore.store(bucket)
        except Exception as exc:  # noqa: BLE001 - built (or failing) on first use instead
            log.debug("%s: warming the clients: %s", self.url, exc)

    def close(self) -> None:
        super().close()
        if self._direct is not None:
            self._direct.close()
        if self._obstore is not None:
            self._obstore.close()

    def _direct_first(self, kind: str, direct: Callable[[], T], sdk: Callable[[], T]) -> T:
        """One S3 request sent by us (``direct``), or through s3fs (``sdk``) once a server has
        refused ours (403) where s3fs's passes: a store that signs or checks differently from
        what we expect (an old SigV2-only proxy, a policy on query auth) must cost speed, never
        a commit or a read. A denial that s3fs meets as well is the real answer."""
        if self._direct is None or self._direct_refused:
            return sdk()
        try:
            return direct()
        except PermissionError as refused:
            try:
                result = sdk()
            except PermissionError:
                raise refused from None
            if not self._direct_refused:
                self._direct_refused = True
                log.warning("%s: the server refused our direct %s (%s) but not s3fs's; every request goes "
                            "through s3fs from now on", self.url, kind, _one_line(refused))
            return result

    # -- metadata ------------------------------------------------------------------------------
    def _head_object(self, full: str) -> dict[str, Any]:
        return self._head_both(full)[0]

    def _head_both(self, full: str) -> tuple[dict[str, Any], _Head]:
        """One HEAD: as an fsspec info dict, and as what set_attrs needs (remembered)."""
        bucket, key, _ = self.fs.split_path(full)
        head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        metadata = dict(head.get("Metadata") or {})
        size = head.get("ContentLength", 0)
        seen = _Head((head.get("ETag") or "").strip('"'), size, metadata,
                     {k: head[k] for k in _KEPT_HEADERS if head.get(k)})
        if seen.etag:
            self._remember(full, seen)
        return {"name": full, "type": "file", "size": size, "ETag": head.get("ETag"),
                "LastModified": head.get("LastModified"), "Metadata": metadata}, seen

    def _posix_of(self, raw: dict[str, Any], is_dir: bool) -> PosixAttrs | None:
        """From a HEAD's user metadata; a listing carries none (None: the record's job)."""
        if is_dir or "Metadata" not in raw:
            return None
        return posixmeta.from_s3(raw["Metadata"])

    def _remember(self, full: str, head: _Head) -> None:
        with self._heads_lock:
            if len(self._heads) >= 4096:
                self._heads.clear()
            self._heads[full] = head

    def _recent_head(self, full: str, etag: str | None) -> _Head | None:
        with self._heads_lock:
            head = self._heads.get(full)
        if head is None or etag is None or head.etag != etag or time.monotonic() - head.at > HEAD_REUSE_SECONDS:
            return None
        return head

    def _fresh_head(self, full: str) -> _Head:
        return self._call("head", self._head_both, full)[1]

    def _prefix_exists(self, full: str) -> bool:
        bucket, key, _ = self.fs.split_path(full)
        out = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key.rstrip("/") + "/", Delimiter="/",
                              MaxKeys=1)
        return bool(out.get("Contents") or out.get("CommonPrefixes"))

    def _probe(self, full: str) -> tuple[bool, bool] | None:
        """One delimited LIST of the names beginning with the key: ``key/`` is a common prefix
        if it is a directory, ``key.rclonelink`` an entry if it is a link (both sort before
        ``key0``; only names like ``key-x`` or ``key.a`` come between). None if the page ends
        before it could tell (the caller asks each question apart)."""
        bucket, key, _ = self.fs.split_path(full)
        key = key.rstrip("/")
        out = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, Delimiter="/", MaxKeys=PROBE_KEYS)
        names = [c["Key"] for c in out.get("Contents") or ()] + [p["Prefix"] for p in out.get("CommonPrefixes") or ()]
        is_dir, has_link = key + "/" in names, key + LINK_SUFFIX in names
        if out.get("IsTruncated") and not is_dir and not any(n > key + "/" for n in names):
            return None  # (names between the key and key/ filled the page)
        return is_dir, has_link

    def _list_entries(self, full: str, on_page: OnPage | None = None) -> list[dict[str, Any]]:
        sdk = super()._list_entries
        if self._direct is None:
            return sdk(full, on_page)
        bucket, path, _ = self.fs.split_path(full)
        direct = self._direct
        return self._direct_first(
            "list", lambda: self._call("list", direct.list, bucket, path.rstrip("/") + "/" if path else "",
                                       self._presign_list, on_page),
            lambda: sdk(full, on_page))

    def _presign_list(self, params: dict[str, str]) -> str:
        return self._presigner.listing(params)

    # -- data ----------------------------------------------------------------------------------
    def _read(self, key: str, start: int, end: int, version: ObjectVersion | None, want: int | None) -> Any:
        etag = version.value if version is not None and version.kind == "etag" else None
        if version is not None and not etag:  # a version S3 did not issue: checked around the read
            return super()._read(key, start, end, version, want)
        full = self.full(key)
        if etag:
            sdk = lambda: self._read_call(_exactly(want, self._s3_get_if_match),  # noqa: E731
                                          full, start, end, etag)
        else:
            sdk = lambda: self._call("get", self.fs.cat_file, full, start=start, end=end)  # noqa: E731

        def today() -> bytes:
            return self._direct_first("get", lambda: self._call("get", _exactly(want, self._get_direct),
                                                                full, start, end, etag), sdk)

        if (not etag or self._obstore is None or self._obstore_refused
                or not representable(self.fs.split_path(full)[1])):  # odd keys: obstore refuses them
            return today()
        return self._obstore_first(full, lambda: self._call("get", _exactly(want, self._get_obstore),
                                                            full, start, end, etag), today)

    def read_into(self, key: str, start: int, end: int, version: ObjectVersion | None, buf: memoryview) -> None:
        """A pinned chunk fetch read straight from the socket into ``buf`` (s3http.py's
        ``get_into``: no intermediate ``bytes``), with every rule of :meth:`_read`: ``If-Match``,
        the one retry loop (a body cut short is retried), a 403 falls back to s3fs. Through
        obstore instead (its buffer copied in) when MARINFS_GET=obstore, or for what the
        urllib3 path does not serve (no ETag)."""
        etag = version.value if version is not None and version.kind == "etag" else None
        if not etag or self._direct is None or self._direct_refused or not self.get_into_socket:
            return super().read_into(key, start, end, version, buf)
        if start >= end:
            return
        full = self.full(key)
        want = end - start

        def sdk() -> None:
            data = self._read_call(_exactly(want, self._s3_get_if_match), full, start, end, etag)
            buf[:] = data

        self._direct_first("get", lambda: self._call("get", self._get_direct_into, full, start, end, etag, buf), sdk)
        self.stats.add_bytes(bytes_in=want)

    def _get_direct_into(self, full: str, start: int, end: int, etag: str, buf: memoryview) -> None:
        assert self._direct is not None
        self.stats.add("get")  # not seen by botocore's hook: count it here
        n = self._direct.get_into(full, start, end, etag, buf)
        if n != len(buf):
            raise TruncatedResponse(f"short read of {full}: {n} of {len(buf)} bytes at {start}")

    def _obstore_first(self, full: str, ours: Callable[[], T], other: Callable[[], T]) -> T:
        """A read through obstore, else (a 403 the other paths do not meet, or a store obstore
        could not be built for) through them from now on; as ``_direct_first`` does."""
        assert self._obstore is not None
        try:
            self._obstore.store(self.fs.split_path(full)[0])  # built once, outside the retry loop
            return ours()
        except (PermissionError, Unusable) as refused:
            try:
                result = other()
            except PermissionError:
                if isinstance(refused, Unusable):
                    raise
                raise refused from None
            if not self._obstore_refused:
                self._obstore_refused = True
                log.warning("%s: reads through obstore failed (%s) where the other paths did not; reads "
                            "go without obstore from now on", self.url, _one_line(refused))
            return result

    def _get_obstore(self, full: str, start: int, end: int, etag: str) -> Any:
        assert self._obstore is not None
        bucket, key, _ = self.fs.split_path(full)
        self.stats.add("get")  # not seen by botocore's hook: count it here
        return self._obstore.get(bucket, key, start, end, etag)

    def _get_direct(self, full: str, start: int, end: int, etag: str | None) -> bytes:
        assert self._direct is not None
        self.stats.add("get")  # not seen by botocore's hook: count it here
        return self._direct.get(full, start, end, etag)

    def _s3_get_if_match(self, full: str, start: int, end: int, etag: str) -> bytes:
        bucket, key, _ = self.fs.split_path(full)

        async def get() -> bytes:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, IfMatch=etag,
                                          Range=f"bytes={start}-{end - 1}")
            async with resp["Body"] as body:
                return await body.read()

        return fsspec.asyn.sync(self.fs.loop, get)

    # -- commits -------------------------------------------------------------------------------
    def _put_small(self, data: bytes, key: str, expect: ObjectVersion | None,
                   attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        full = self.full(key)
        bucket, path, _ = self.fs.split_path(full)
        md5 = hashlib.md5(data)
        metadata = posixmeta.to_s3(attrs) if attrs is not None else {}
        extra: dict[str, Any] = {"Metadata": metadata} if metadata else {}

        def sdk_put() -> str | None:
            out = self._call("put", fsspec.asyn.sync, self.fs.loop, self.fs._call_s3, "put_object",
                             Bucket=bucket, Key=path, Body=data, **s3_match(expect), **extra)
            return (out.get("ETag") or "").strip('"') or None

        def direct_put() -> str | None:
            assert self._direct is not None
            self.stats.add("put")  # not seen by botocore's hook: count it here
            return self._call("put", self._direct.put, full, data, s3_match(expect), metadata)

        try:
            etag = self._direct_first("put", direct_put, sdk_put)
        except PreconditionFailed:
            # A retried PUT whose first answer was lost meets its own object: same bytes,
            # so it is ours (or identical), not a conflict.
            try:
                current = self.stat(key)
            except FileNotFoundError:
                raise PreconditionFailed(f"{self.url}/{key} changed since it was opened") from None
            if current.version != ObjectVersion.etag(md5.hexdigest()):
                raise
            etag = md5.hexdigest()
        if etag:
            self._remember(full, _Head(etag, len(data), metadata, {}))  # what we sent is what is there
        return ObjectVersion.etag(etag) if etag else None

    # -- persisted POSIX metadata --------------------------------------------------------------
    def set_attrs(self, key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion | None:
        """CopyObject of the object onto itself with ``MetadataDirective=REPLACE`` and
        ``x-amz-copy-source-if-match``: no bytes leave us, and another writer's bytes are never
        given our metadata. The REPLACE carries the object's other user metadata and the
        headers S3 would reset (Content-Type...), from a HEAD (or the one a stat or our PUT made
        under 5 s ago, of the same ETag). Past ``copy_limit`` (5 GiB) a multipart copy."""
        if expect is not None and expect.kind != "etag":
            expect = self._current_file(key, expect).version  # a foreign version: compared once
        full = self.full(key)
        head = self._recent_head(full, expect.value if expect is not None else None)
        if head is None:
            try:
                head = self._fresh_head(full)
            except FileNotFoundError:
                if self._call("list", self._prefix_exists, full):
                    raise IsADirectoryError(full) from None
                raise
        if expect is not None and ObjectVersion.etag(head.etag) != expect:
            raise PreconditionFailed(f"{self.url}/{key} changed since it was opened")
        metadata = posixmeta.s3_replace(head.metadata, attrs)
        try:
            etag = self._copy_object(full, full, head, metadata)
        except FileNotFoundError:
            raise FileNotFoundError(2, "no such object", full) from None
        self._remember(full, _Head(etag, head.size, metadata, head.headers))
        version = ObjectVersion.etag(etag)
        self._recorded_attrs(key, version, attrs, metadata_only=True)  # the directory record's entry
        return version

    folds_attrs = True  # CopyObject with MetadataDirective=REPLACE

    def copy(self, src: str, dst: str, attrs: PosixAttrs | None = None,
             expect: ObjectVersion | None = None) -> Copied | None:
        """CopyObject (its COPY directive keeps the metadata); past 5 GiB a multipart copy that
        carries the source's metadata (s3fs's would drop it). Pinned to the source's ETag: the
        one our PUT or a stat saw under 5 s ago (no HEAD: rsync renames each file it has just
        written), or a fresh HEAD's if there is none or the object changed since. Answers the
        copy: the source's ETag it was pinned to and its own.

        ``attrs``: ``MetadataDirective=REPLACE`` with them (the source's other user metadata and
        headers kept, as set_attrs sends them), pinned to ETag ``expect``: a source that is not
        that version is PreconditionFailed, nothing copied (rsync's temporary file renamed with
        the mode and time set on it since its PUT: one request for both)."""
        source, target = self.full(src), self.full(dst)
        if attrs is not None:
            return self._copy_replacing(src, dst, attrs, expect)
        with self._heads_lock:
            head: _Head | None = self._heads.get(source)
        etag = None
        if head is not None and head.etag and time.monotonic() - head.at <= HEAD_REUSE_SECONDS:
            try:
                etag = self._copy_object(source, target, head, None)
            except PreconditionFailed:  # changed since: copied as it is now
                head = None
        else:
            head = None
        if head is None:
            head = self._fresh_head(source)
            etag = self._copy_object(source, target, head, None)
        if not etag:
            return None
        self._remember(target, _Head(etag, head.size, head.metadata, head.headers))
        pinned = ObjectVersion.etag(head.etag) if head.etag else None  # (the copy was pinned to head.etag)
        return Copied(src, dst, pinned, ObjectVersion.etag(etag))

    def _copy_replacing(self, src: str, dst: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> Copied:
        source, target = self.full(src), self.full(dst)
        etag = expect.value if expect is not None and expect.kind == "etag" else None
        head = self._recent_head(source, etag) or self._fresh_head(source)  # (FileNotFoundError: gone)
        if etag is None or head.etag != etag:
            raise PreconditionFailed(f"{self.url}/{src} changed since its attributes were set")
        metadata = posixmeta.s3_replace(head.metadata, attrs)
        new = self._copy_object(source, target, head, metadata)  # (If-Match: a 412 is PreconditionFailed)
        if new:
            self._remember(target, _Head(new, head.size, metadata, head.headers))
        return Copied(src, dst, ObjectVersion.etag(head.etag), ObjectVersion.etag(new) if new else None)

    def _copy_object(self, source: str, target: str, head: _Head, metadata: dict[str, str] | None) -> str:
        """Copy ``source`` as it is in ``head`` (If-Match on its ETag) to ``target``; with
        ``metadata``, that user metadata replaces the source's. Answers the new ETag."""
        sbucket, skey, _ = self.fs.split_path(source)
        bucket, key, _ = self.fs.split_path(target)
        src = {"Bucket": sbucket, "Key": skey}
        match = {"CopySourceIfMatch": f'"{head.etag}"'} if head.etag else {}
        replace = {} if metadata is None else {"MetadataDirective": "REPLACE", "Metadata": metadata, **head.headers}
        if head.size > self.copy_limit:
            return self._copy_parts(src, bucket, key, head, head.metadata if metadata is None else metadata, match)
        out = self._call("copy", fsspec.asyn.sync, self.fs.loop, self.fs._call_s3, "copy_object", Bucket=bucket,
                         Key=key, CopySource=src, **match, **replace)
        return (out.get("CopyObjectResult", {}).get("ETag") or "").strip('"')

    def _copy_parts(self, src: dict[str, str], bucket: str, key: str, head: _Head, metadata: dict[str, str],
                    match: dict[str, str]) -> str:
        """A multipart upload of UploadPartCopy parts (S3's way past 5 GiB), each part
        conditional on the source's ETag, parts copied in parallel; aborted on failure."""
        def s3(op: str, **kw: Any) -> Any:
            return self._call("part", fsspec.asyn.sync, self.fs.loop, self.fs._call_s3, op, Bucket=bucket, Key=key, **kw)

        part = max(self.copy_part_size, -(-head.size // 10_000 // MiB) * MiB)
        upload_id = s3("create_multipart_upload", Metadata=metadata, **head.headers)["UploadId"]
        try:
            def one(number: int) -> dict[str, Any]:
                start = (number - 1) * part
                end = min(head.size, start + part) - 1
                out = s3("upload_part_copy", UploadId=upload_id, PartNumber=number, CopySource=src,
                         CopySourceRange=f"bytes={start}-{end}", **match)
                return {"PartNumber": number, "ETag": out["CopyPartResult"]["ETag"]}

            numbers = range(1, -(-head.size // part) + 1)
            parts = list(self.part_pool.map(one, numbers))
            out = s3("complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=key,
                                 UploadId=upload_id)
            except Exception as exc:  # noqa: BLE001 - best effort: a lifecycle rule reaps the rest
                log.warning("could not abort the multipart copy to %s: %s", key, exc)
            raise
        return (out.get("ETag") or "").strip('"')

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        """One GET of the whole object: its body and the ETag of that body."""
        full = self.full(key)
        bucket, path, _ = self.fs.split_path(full)

        def sdk() -> tuple[bytes, str]:
            async def get() -> tuple[bytes, str]:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=path)
                async with resp["Body"] as body:
                    return await body.read(), resp.get("ETag") or ""

            return self._call("get", fsspec.asyn.sync, self.fs.loop, get)

        def direct() -> tuple[bytes, str]:
            assert self._direct is not None

            def get() -> tuple[bytes, str]:
                self.stats.add("get")  # not seen by botocore's hook
                return self._direct.get_whole(full)

            return self._call("get", get)

        data, etag = self._direct_first("get", direct, sdk)
        self.stats.add_bytes(bytes_in=len(data))
        if not etag:
            raise OSError(5, f"GET {full}: no ETag in the answer")
        return data, ObjectVersion.etag(etag)

    def abort_upload(self, record: dict[str, Any]) -> None:
        """Abort the multipart upload ``record`` names (a session's ``record``), retried like
        every request; one already gone (completed, aborted, reaped) is no error."""
        if record.get("store") != "s3":
            return super().abort_upload(record)
        bucket, key, upload_id = record["bucket"], record["key"], record["id"]
        try:
            self._call("part", lambda: _run(self.fs.loop, self.fs._call_s3(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)))
        except FileNotFoundError:  # NoSuchUpload
            pass

    def part_session(self, key: str, expect: ObjectVersion | None, part_size: int | None = None,
                     attrs: PosixAttrs | None = None) -> S3Session:
        """A multipart upload of ``key``: its parts over plain HTTP where the direct path is on,
        sent from the staging file with the checksum of ``part_checksum``."""
        full = self.full(key)
        bucket, path, _ = self.fs.split_path(full)
        put_part = put_range = None
        checksum = None
        if self._direct is not None and not self._direct_refused:
            direct = self._direct
            checksum = self.part_checksum

            def put_part(upload_id: str, number: int, data: bytes) -> str:
                def ours() -> str:
                    self.stats.add("part")  # not seen by botocore's hook: count it here
                    return direct.put_part(full, upload_id, number, data, checksum)

                def sdk() -> str:
                    return fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "upload_part", Bucket=bucket, Key=path,
                                            UploadId=upload_id, PartNumber=number, Body=data,
                                            **_crc_param(data, checksum))["ETag"]

                return self._direct_first("part", ours, sdk)

            def put_range(upload_id: str, number: int, fd: int, offset: int, length: int,
                          checksum: str, known: str | None = None) -> tuple[str, str | None, int]:
                def ours() -> tuple[str, str | None, int]:
                    self.stats.add("part")  # not seen by botocore's hook: count it here
                    try:
                        return direct.put_part_range(full, upload_id, number, fd, offset, length, checksum, known)
                    except ChecksumNotChecked as why:
                        # This part is unchecked: again with Content-MD5, and its CRC-32C still,
                        # for the completion of an upload created with that algorithm.
                        self._unchecked(why)
                        self.stats.add("part")
                        return direct.put_part_range(full, upload_id, number, fd, offset, length, "md5+crc32c")

                def sdk() -> tuple[str, str | None, int]:
                    data = os.pread(fd, length, offset)
                    sums = _crc_param(data, checksum)
                    out = fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "upload_part", Bucket=bucket, Key=path,
                                           UploadId=upload_id, PartNumber=number, Body=data, **sums)
                    return out["ETag"], sums.get("ChecksumCRC32C"), len(data)

                return self._direct_first("part", ours, sdk)

        metadata = posixmeta.to_s3(attrs) if attrs is not None else {}
        return S3Session(self.fs, bucket, path, expect, part_size or self.settings.upload_part_size,
                         lambda kind, fn: self._call(kind, fn), lambda n: self.stats.add_bytes(bytes_out=n),
                         put_part=put_part, metadata=metadata, put_range=put_range, checksum=checksum)


class S3Session:
    """A multipart upload. Parts are fixed ranges of ``part_size``; any part may be sent again,
    so a write that patches bytes already sent (zip writers seek back to fix headers) only marks
    that part for resending. CompleteMultipartUpload carries ``If-Match``/``If-None-Match``.

    With ``checksum="crc32c"`` the upload is created with ``ChecksumAlgorithm=CRC32C`` (AWS
    refuses a part's CRC-32C otherwise), each part carries its CRC-32C, and the completion lists
    them (AWS and SeaweedFS require that, and check them)."""

    ordered = False

    def __init__(self, fs: Any, bucket: str, key: str, expect: ObjectVersion | None, part_size: int,
                 run: Runner, sent: Counter = lambda n: None,
                 put_part: Callable[[str, int, bytes], str] | None = None,
                 metadata: dict[str, str] | None = None,
                 put_range: Callable[..., tuple[str, str | None, int]] | None = None,
                 checksum: str | None = None) -> None:
        self.fs, self.bucket, self.key, self.part_size, self._run = fs, bucket, key, part_size, run
        self._sent = sent
        self._put_part = put_part  # parts sent without s3fs (s3http.py), if given
        self._put_range = put_range  # parts sent from the staging file (s3http.py), if given
        self.checksum = checksum if put_range is not None else None
        self.match = s3_match(expect)
        self.etags: dict[int, str] = {}
        self.sums: dict[int, str | None] = {}  # part index -> its CRC-32C (None: it went with MD5)
        self._lock = threading.Lock()
        extra: dict[str, Any] = {"Metadata": metadata} if metadata else {}
        if self.checksum == "crc32c":
            extra["ChecksumAlgorithm"] = "CRC32C"
        out = run("part", lambda: _run(fs.loop, fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key,
                                                            **extra)))
        self.upload_id = out["UploadId"]

    @property
    def record(self) -> dict[str, str]:
        """What names this upload for ``S3Remote.abort_upload`` (journaled while it is open)."""
        return {"store": "s3", "bucket": self.bucket, "key": self.key, "id": self.upload_id}

    def send(self, index: int, data: bytes, total: int | None = None) -> None:
        if self._put_part is not None:
            put = self._put_part
            etag = self._run("part", lambda: put(self.upload_id, index + 1, data))
        else:
            etag = self._run("part", lambda: _run(self.fs.loop, self.fs._call_s3(
                "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                PartNumber=index + 1, Body=data)))["ETag"]
        with self._lock:
            self.etags[index] = etag
            self.sums[index] = _crc_param(data, self.checksum).get("ChecksumCRC32C") if self._put_part else None
        self._sent(len(data))

    def send_range(self, index: int, fd: int, offset: int, length: int, total: int | None = None,
                   crc32c: int | None = None) -> None:
        """Part ``index``: up to ``length`` bytes of the staging file ``fd`` at ``offset``, sent
        from the file where this session can (never read into ``bytes`` then). ``crc32c``: the
        part's CRC-32C summed as it was written, so the first attempt need not read it back
        (the server checks it; an attempt after a failure sums the file again)."""
        if self._put_range is None:
            self.send(index, os.pread(fd, length, offset), total)
            return
        put, checksum = self._put_range, self.checksum or "md5"
        known = [base64.b64encode(crc32c.to_bytes(4, "big")).decode()
                 if crc32c is not None and checksum == "crc32c" else None]

        def attempt() -> tuple[str, str | None, int]:
            value, known[0] = known[0], None
            return put(self.upload_id, index + 1, fd, offset, length, checksum, value)

        etag, value, n = self._run("part", attempt)
        with self._lock:
            self.etags[index] = etag
            self.sums[index] = value
        self._sent(n)

    def complete(self, parts: int, total: int) -> ObjectVersion | None:
        listed: list[dict[str, Any]] = [{"PartNumber": i + 1, "ETag": self.etags[i]} for i in range(parts)]
        if self.checksum == "crc32c" and all(self.sums.get(i) for i in range(parts)):
            for i, part in enumerate(listed):
                part["ChecksumCRC32C"] = self.sums[i]
        out = self._run("part", lambda: _run(self.fs.loop, self.fs._call_s3(
            "complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
            MultipartUpload={"Parts": listed}, **self.match)))
        etag = out.get("ETag")
        return ObjectVersion.etag(etag) if etag else None

    def abort(self) -> bool:
        """Drop the upload and its parts; True once the store has (or never had) it. A failure
        is logged, not raised: the id stays in the staged file's journal and the next pass over
        it (a retry, the next start) aborts it again."""
        try:
            _run(self.fs.loop, self.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                                                UploadId=self.upload_id), timeout=60)
        except FileNotFoundError:  # NoSuchUpload: already gone
            return True
        except Exception as exc:  # noqa: BLE001 - best effort here; the journal keeps the id
            log.warning("could not abort the multipart upload of %s: %s (it is tried again later)", self.key, exc)
            return False
        return True


def _crc_param(data: bytes, checksum: str | None) -> dict[str, str]:
    """``ChecksumCRC32C`` of ``data`` as botocore takes it (base64), when that is the checksum."""
    if checksum != "crc32c" or crc32c_extend is None:
        return {}
    return {"ChecksumCRC32C": base64.b64encode(crc32c_extend(0, data, len(data)).to_bytes(4, "big")).decode()}  # type: ignore[arg-type]


def _s3_kind(operation: str) -> str:
    if operation.startswith("List"):
        return "list"
    if operation.startswith("Head"):
        return "head"
    if operation == "GetObject":
        return "get"
    if operation == "PutObject":
        return "put"
    if operation in ("CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
                     "AbortMultipartUpload", "UploadPartCopy"):
        return "part"
    if operation == "CopyObject":
        return "copy"
    if operation.startswith("Delete"):
        return "delete"
    return operation
