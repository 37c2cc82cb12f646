"""Google Cloud Storage through gcsfs: versions are generations, commits carry
``ifGenerationMatch`` (0: the object must not exist), big files go as resumable uploads.

Chunk fetches (the fetcher's ``read_into``) are the exception: a media GET pinned to the
generation, sent by us with gcsfs's URL and credentials and read from the socket into the
chunk's pooled buffer (gcshttp.py), not gcsfs's ``bytes`` copied in.

Symbolic links follow gcsfuse's standard: an empty object named like the link, whose custom
metadata ``gcsfuse_symlink_target`` is the target. Listings carry each object's metadata, so a
listing shows links without a request more.

gcsfs answers HTTP 412 with FileExistsError, on any request: that is how a failed precondition
is recognised here.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar
from urllib.parse import quote

import fsspec.asyn

from marinfs import posixmeta
from marinfs.errors import PreconditionFailed, StaleVersionError
from marinfs.objects import Copied, ObjectInfo, ObjectVersion, PosixAttrs, gcs_match
from marinfs.remote.base import TruncatedResponse, _exactly, _one_line, _run
from marinfs.remote.gcshttp import GCSHttp, usable
from marinfs.remote.objectstore import ObjectStoreRemote
from marinfs.remote.parts import Counter, Runner
from marinfs.remote.recorded import Recorded

log = logging.getLogger(__name__)

GCS_CHUNK_ALIGN = 256 << 10  # resumable chunks must be multiples of 256 KiB
SYMLINK_METADATA = "gcsfuse_symlink_target"  # gcsfuse's key for a link's target
META_REUSE_SECONDS = 5.0  # object metadata seen this recently spares set_attrs a GET
# What a rewrite that gives the destination new metadata sends again from the source's resource,
# so the copy keeps them (a rewrite's body describes the destination object).
_KEPT_FIELDS = ("contentType", "contentEncoding", "contentLanguage", "contentDisposition", "cacheControl",
                "storageClass")


class GCSRemote(Recorded, ObjectStoreRemote):
    protocols = ("gs", "gcs")
    version_kind = "generation"
    link_objects = False  # gcsfuse's links: SYMLINK_METADATA on an empty object
    lists_posix = True  # listings carry each object's custom metadata
    # GCS keeps 8 KiB of custom metadata per object (names and values), where the attributes go
    # as gcsfuse's and gsutil's keys (posixmeta.to_gcs).
    attrs_limit: ClassVar[int] = 8192

    @classmethod
    def attrs_bytes(cls, attrs: PosixAttrs) -> int:
        return sum(len(k.encode()) + len(v.encode()) for k, v in posixmeta.to_gcs(attrs).items())

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, settings: Any = None) -> None:
        super().__init__(url, storage_options, settings)
        # full path -> (generation, metageneration, custom metadata, when seen, the resource's
        # _KEPT_FIELDS), for set_attrs and a copy that carries new attributes
        self._seen: dict[str, tuple[str, str, dict[str, str], float, dict[str, str]]] = {}
        self._seen_lock = threading.Lock()
        self._direct = self._direct_http()
        self._direct_refused = False  # set once the server refused our GET but not gcsfs's

    def _direct_http(self) -> GCSHttp | None:
        """Chunk fetches sent by us, read into the buffer (gcshttp.py), unless
        MARINFS_DIRECT_GET=0 (``settings.direct_get``) or gcsfs is configured in a way that path
        cannot reproduce."""
        if not self.settings.direct_get:
            return None
        why = usable(self.fs)
        if why is not None:
            log.info("%s: chunk fetches through gcsfs: %s", self.url, why)
            return None
        return GCSHttp(self.fs, connect_timeout=self.settings.connect_timeout,
                       read_timeout=self.settings.read_timeout)

    def close(self) -> None:
        super().close()
        if self._direct is not None:
            self._direct.close()

    def _prepare_environment(self) -> None:
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            # gcsfs otherwise tries gRPC/TLS first and stalls a minute against an emulator.
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Our timeouts (gcsfs's own retries are bypassed: see _instrument)."""
        options = super()._options(options)
        options.setdefault("requests_timeout", self.settings.connect_timeout + self.settings.read_timeout)
        options.setdefault("timeout", self.settings.connect_timeout + self.settings.read_timeout)
        return options

    def _instrument(self) -> bool:
        """Count every HTTP request; and send it once. gcsfs's ``_request`` retries 6 times,
        sleeping 1+2+4+8+16 s, fixed when its class is defined: an unreachable GCS took over
        30 s per attempt of ours whatever --retries and the timeouts said. Ours is the one
        bounded loop, so the undecorated request is the one sent."""
        undecorated = getattr(type(self.fs)._request, "__wrapped__", None)
        request = functools.partial(undecorated, self.fs) if undecorated is not None else self.fs._request
        stats = self.stats

        async def counted(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            stats.add(_gcs_kind(method, str(path), kwargs))
            return await request(method, path, *args, **kwargs)

        self.fs._request = counted
        return True

    def _is_precondition_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, FileExistsError) or super()._is_precondition_failure(exc)

    # -- metadata ------------------------------------------------------------------------------
    def _posix_of(self, raw: dict[str, Any], is_dir: bool) -> PosixAttrs | None:
        return None if is_dir else posixmeta.from_gcs(raw.get("metadata"))

    def _remember(self, raw: dict[str, Any]) -> None:
        generation = raw.get("generation")
        if not generation or "name" not in raw:
            return
        with self._seen_lock:
            if len(self._seen) >= 4096:
                self._seen.clear()
            self._seen[raw["name"]] = (str(generation), str(raw.get("metageneration") or ""),
                                       dict(raw.get("metadata") or {}), time.monotonic(), _kept_fields(raw))

    def _info_of(self, raw: dict[str, Any], key: str | None = None) -> ObjectInfo:
        info = super()._info_of(raw, key)
        if not info.is_dir:
            self._remember(raw)
        target = (raw.get("metadata") or {}).get(SYMLINK_METADATA) if not info.is_dir else None
        if target is None:
            return info
        return replace(info, size=len(target.encode("utf-8", "surrogateescape")), link=True, target=target)

    # -- symbolic links (gcsfuse's) ------------------------------------------------------------
    def symlink(self, key: str, target: str) -> ObjectVersion | None:
        """One upload of an empty object with the target in its metadata; it must not exist
        (``ifGenerationMatch=0``). Answers its generation."""
        self._refuse_record(key)
        try:
            out = self._call("put", self.fs.pipe_file, self.full(key), b"", metadata={SYMLINK_METADATA: target},
                             mode="create")
        except PreconditionFailed:
            raise FileExistsError(errno.EEXIST, "an object of that name exists", key) from None
        generation = (out or {}).get("generation") if isinstance(out, dict) else None
        return ObjectVersion("generation", str(generation)) if generation else None

    def readlink(self, key: str, info: ObjectInfo) -> str:
        if info.target is not None:
            return info.target
        fresh = self.stat(key)
        if not fresh.link or fresh.target is None:
            raise FileNotFoundError(errno.ENOENT, "not a symbolic link any more", key)
        return fresh.target

    def delete_link(self, key: str) -> None:
        self.delete(key)

    def rename_link(self, src: str, dst: str) -> None:
        self.rename(src, dst)  # a copy keeps the object's metadata

    def _head_object(self, full: str) -> dict[str, Any]:
        return fsspec.asyn.sync(self.fs.loop, self.fs._get_object, full)

    folds_attrs = True  # a rewrite whose body gives the destination's metadata

    def copy(self, src: str, dst: str, attrs: PosixAttrs | None = None,
             expect: ObjectVersion | None = None) -> Copied | None:
        """A rewrite of the source's current generation (``ifSourceGenerationMatch``, as S3's
        copy is pinned to its ETag; it keeps the metadata), answering that generation and the
        copy's: readers of that source generation follow a rename to it.

        ``attrs``: the rewrite's body gives the copy its custom metadata (the source's other
        keys kept, ours rewritten as a PATCH would leave them) and the source's content type and
        encoding, pinned to generation ``expect`` (else PreconditionFailed, nothing copied). The
        source's metadata is the one our upload or a stat saw under 5 s ago, else one GET."""
        source, target = self.full(src), self.full(dst)
        body: dict[str, Any] | None = None
        if attrs is not None:
            seen = self._recent(source, expect)
            if seen is not None:
                generation, metadata, kept = seen[0], seen[2], seen[4]
            else:
                raw = self._call("head", self._head_object, source)
                generation = str(raw.get("generation") or "")
                metadata, kept = dict(raw.get("metadata") or {}), _kept_fields(raw)
            if expect is None or not generation or ObjectVersion("generation", generation) != expect:
                raise PreconditionFailed(f"{self.url}/{src} changed since its attributes were set")
            replacing = posixmeta.gcs_replace(metadata, attrs)
            if replacing or not metadata:
                body = {**kept, "metadata": replacing}
        else:
            # The object's own metadata, not stat(): a directory record (dirmeta.py) is copied by
            # a directory rename too, and stat() does not show it.
            generation = str(self._call("head", self._head_object, source).get("generation") or "")
        old = ObjectVersion("generation", generation) if generation else None
        b1, k1, _ = self.fs.split_path(source)
        b2, k2, _ = self.fs.split_path(target)
        match = {"ifSourceGenerationMatch": generation} if generation else {}
        extra: dict[str, Any] = {"json": body} if body is not None else {"headers": {"Content-Type": "application/json"}}

        async def rewrite() -> dict[str, Any]:
            token: dict[str, str] = {}
            while True:
                out = await self.fs._call("POST", "b/{}/o/{}/rewriteTo/b/{}/o/{}", b1, k1, b2, k2, json_out=True,
                                          **extra, **match, **token)
                if out.get("done") is True:
                    return out
                token = {"rewriteToken": out["rewriteToken"]}

        out = self._call("copy", fsspec.asyn.sync, self.fs.loop, rewrite)
        resource = out.get("resource") or {}
        copied = resource.get("generation")
        if isinstance(resource, dict) and resource.get("name"):
            self._remember({**resource, "name": target})
        new = ObjectVersion("generation", str(copied)) if copied else None
        if attrs is not None and body is None:
            # Every key of ours removed, none of anyone else's: a rewrite given no metadata
            # keeps the source's, so the copy's keys go in a PATCH of it (rare: one request more).
            new = self.set_attrs(dst, attrs, new) or new
        if new is None:
            return None
        return Copied(src, dst, old if match else None, new)

    def _prefix_exists(self, full: str) -> bool:
        bucket, key, _ = self.fs.split_path(full)
        out = self.fs.call("GET", "b/{}/o", bucket, prefix=key.rstrip("/") + "/", delimiter="/", maxResults=1,
                           json_out=True)
        return bool(out.get("items") or out.get("prefixes"))

    # -- data ----------------------------------------------------------------------------------
    def _read(self, key: str, start: int, end: int, version: ObjectVersion | None, want: int | None) -> bytes:
        if version is None or version.kind != "generation":
            return super()._read(key, start, end, version, want)
        try:
            return self._call("get", _exactly(want, fsspec.asyn.sync), self.fs.loop, self.fs._cat_file_sequential,
                              self.full(key), start=start, end=end, generation=version.value)
        except FileNotFoundError:  # that generation is gone
            raise StaleVersionError(f"{self.url}: {key} is no longer generation {version.value}") from None

    def read_into(self, key: str, start: int, end: int, version: ObjectVersion | None, buf: memoryview) -> None:
        """A pinned chunk fetch read straight from the socket into ``buf`` (gcshttp.py: no
        intermediate ``bytes``), with every rule of :meth:`_read`: the generation pinned (404:
        ESTALE), the one retry loop (a body cut short is retried), a refusal (401/403) that
        gcsfs does not meet sends this and every later fetch through gcsfs."""
        if version is None or version.kind != "generation" or self._direct is None or self._direct_refused:
            return super().read_into(key, start, end, version, buf)
        if start >= end:
            return
        full, want = self.full(key), end - start

        def ours() -> None:
            self._call("get", self._get_direct_into, full, start, end, version.value, buf)

        def gcsfs() -> None:
            buf[:] = self._read(key, start, end, version, want)

        try:
            self._direct_first(ours, gcsfs)
        except FileNotFoundError:  # that generation is gone
            raise StaleVersionError(f"{self.url}: {key} is no longer generation {version.value}") from None
        self.stats.add_bytes(bytes_in=want)

    def _get_direct_into(self, full: str, start: int, end: int, generation: str, buf: memoryview) -> None:
        assert self._direct is not None
        self.stats.add("get")  # not seen by the gcsfs hook (_instrument): counted here
        n = self._direct.get_into(full, start, end, generation, buf)
        if n != len(buf):
            raise TruncatedResponse(f"short read of {full}: {n} of {len(buf)} bytes at {start}")

    def _direct_first(self, ours: Callable[[], None], gcsfs: Callable[[], None]) -> None:
        """Our GET, or gcsfs's once a server refused ours (401/403) where gcsfs's passes: a
        credential or proxy setup we do not reproduce must cost speed, never a read. A denial
        gcsfs meets as well is the answer (EACCES)."""
        try:
            ours()
        except PermissionError as refused:
            try:
                gcsfs()
            except Exception as exc:  # noqa: BLE001 - a denial is ours to report; anything else is gcsfs's answer
                if _denied(exc):
                    raise refused from None
                raise
            if not self._direct_refused:
                self._direct_refused = True
                log.warning("%s: the server refused our direct GET (%s) but not gcsfs's; chunk fetches go "
                            "through gcsfs from now on", self.url, _one_line(refused))

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        """One media GET: the body and, in ``x-goog-generation``, the generation of that body."""
        bucket, path, _ = self.fs.split_path(self.full(key))
        headers, data = self._call("get", fsspec.asyn.sync, self.fs.loop, self.fs._call, "GET", "b/{}/o/{}",
                                   bucket, path, alt="media")
        generation = _header(headers, "x-goog-generation")
        if not generation:  # a server that does not say: the generation, then a pinned read
            return super().read_small(key)
        self.stats.add_bytes(bytes_in=len(data))
        return bytes(data), ObjectVersion("generation", generation)

    # -- commits -------------------------------------------------------------------------------
    def _put_small(self, data: bytes, key: str, expect: ObjectVersion | None,
                   attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        """A media upload; with ``attrs`` a multipart one (the metadata and the bytes, one request)."""
        bucket, path, _ = self.fs.split_path(self.full(key))
        url = f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o"
        if attrs is None:
            out = self._call("put", fsspec.asyn.sync, self.fs.loop, self.fs._call, "POST", url, uploadType="media",
                             name=path, data=data, json_out=True, **gcs_match(expect))
        else:
            resource = json.dumps({"name": path, "metadata": posixmeta.to_gcs(attrs)})
            body = (f"--==0==\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{resource}\r\n"
                    f"--==0==\r\nContent-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n--==0==--"
            out = self._call("put", fsspec.asyn.sync, self.fs.loop, self.fs._call, "POST", url,
                             uploadType="multipart", headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                             data=body, json_out=True, **gcs_match(expect))
        if isinstance(out, dict):
            self._remember({**out, "name": f"{bucket}/{path}"})
        generation = (out or {}).get("generation")
        return ObjectVersion("generation", str(generation)) if generation else None

    def part_session(self, key: str, expect: ObjectVersion | None, part_size: int | None = None,
                     attrs: PosixAttrs | None = None) -> GCSSession:
        bucket, path, _ = self.fs.split_path(self.full(key))
        return GCSSession(self.fs, bucket, path, expect, part_size or self.settings.upload_part_size,
                          lambda kind, fn: self._call(kind, fn), lambda n: self.stats.add_bytes(bytes_out=n),
                          metadata=posixmeta.to_gcs(attrs) if attrs is not None else None)

    # -- persisted POSIX metadata --------------------------------------------------------------
    def set_attrs(self, key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion | None:
        """One PATCH of the object's custom metadata with ``ifGenerationMatch`` (the bytes are
        still ``expect``) and ``ifMetagenerationMatch`` (its metadata is still what the patch was
        computed from). The generation stays, so cached chunks stay valid. The metadata comes
        from a stat or listing of under 5 s ago, else one GET; a patch from seen metadata that
        another writer's patch overtook is computed again from a fresh GET."""
        if expect is not None and expect.kind != "generation":
            expect = self._current_file(key, expect).version  # a foreign version: compared once
        full = self.full(key)
        bucket, path, _ = self.fs.split_path(full)
        seen = self._recent(full, expect)
        while True:
            if seen is None:
                info = self._current_file(key, expect)  # one GET; FileNotFoundError, PreconditionFailed
                seen = self._recent(full, info.version, fresh=True)
                if seen is None:  # (the stat remembered it, unless another stat overtook it)
                    raise PreconditionFailed(f"{self.url}/{key} changed since it was opened")
                fresh = True
            else:
                fresh = False
            assert seen is not None
            generation, metageneration, metadata = seen[:3]
            patch = posixmeta.gcs_patch(metadata, attrs)
            if not patch:
                return ObjectVersion("generation", generation)
            match = {"ifGenerationMatch": generation}
            if metageneration:  # (every GCS answer has one; fake-gcs-server's PATCH answer does not)
                match["ifMetagenerationMatch"] = metageneration
            try:
                out = self._call("patch", self.fs.call, "PATCH", "b/{}/o/{}", bucket, path, json={"metadata": patch},
                                 json_out=True, **match)
            except PreconditionFailed:
                if fresh:
                    raise
                seen = None  # the seen metadata was overtaken: compute the patch again
                continue
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such object", full) from None
            if isinstance(out, dict):
                self._remember({**out, "name": full})
            return ObjectVersion("generation", str((out or {}).get("generation") or generation))

    def _recent(self, full: str, expect: ObjectVersion | None,
                fresh: bool = False) -> tuple[str, str, dict[str, str], float, dict[str, str]] | None:
        with self._seen_lock:
            seen = self._seen.get(full)
        if seen is None or expect is None or seen[0] != expect.value:
            return None
        if not fresh and time.monotonic() - seen[3] > META_REUSE_SECONDS:
            return None
        return seen


class GCSSession:
    """A resumable upload. Chunks must go in order and cannot be changed once sent, so a write
    behind what was sent ends the stream (the file is then uploaded whole at commit).
    ``ifGenerationMatch`` is set when the session starts and checked by GCS when it completes."""

    ordered = True

    def __init__(self, fs: Any, bucket: str, key: str, expect: ObjectVersion | None, part_size: int,
                 run: Runner, sent: Counter = lambda n: None, metadata: dict[str, str] | None = None) -> None:
        self.fs, self.key, self._run, self._sent = fs, key, run, sent
        if part_size % GCS_CHUNK_ALIGN:
            raise ValueError(f"GCS upload parts must be multiples of 256 KiB, not {part_size}")
        self.part_size = part_size
        self.result: dict[str, Any] | None = None
        self.sent = 0
        params = gcs_match(expect)
        resource: dict[str, Any] = {"name": key, "metadata": metadata} if metadata else {"name": key}

        async def initiate() -> str:
            headers, _ = await fs._call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                                        uploadType="resumable", json=resource,
                                        headers={"X-Upload-Content-Type": "application/octet-stream"},
                                        **params)
            loc = headers["Location"]
            return loc[0] if isinstance(loc, list) else loc

        self.location = run("part", lambda: _run(fs.loop, initiate()))

    def send(self, index: int, data: bytes, total: int | None = None) -> None:
        start = index * self.part_size
        assert start == self.sent, "resumable chunks go in order"
        size = "*" if total is None else str(total)
        rng = f"bytes {start}-{start + len(data) - 1}/{size}" if data else f"bytes */{size}"

        async def put() -> dict[str, Any] | None:
            headers, text = await self.fs._call("POST", self.location, data=data,
                                                headers={"Content-Range": rng, "Content-Length": str(len(data))})
            return _json(text)

        out = self._run("part", lambda: _run(self.fs.loop, put()))  # a 412 is PreconditionFailed
        self.sent = start + len(data)
        self._sent(len(data))
        if total is not None:
            self.result = out

    def complete(self, parts: int, total: int) -> ObjectVersion | None:
        if self.result is None:
            self.send(self.sent // self.part_size, b"", total)  # everything was sent as full chunks
        generation = (self.result or {}).get("generation")
        return ObjectVersion("generation", str(generation)) if generation else None

    def abort(self) -> None:
        async def cancel() -> None:
            await self.fs._call("DELETE", self.location)

        try:
            _run(self.fs.loop, cancel(), timeout=60)
        except Exception:  # noqa: BLE001 - GCS answers 499 to a cancel; expired sessions vanish anyway
            pass


def _denied(exc: BaseException) -> bool:
    """gcsfs's answer to a request it may not send: its 403 is an OSError saying Forbidden, its
    401 an HttpError with that code."""
    return isinstance(exc, PermissionError) or str(exc).startswith("Forbidden") or \
        getattr(exc, "code", None) in (401, 403)


def _header(headers: Any, name: str) -> str | None:
    """One response header, whatever the case (aiohttp's are a case-insensitive multidict)."""
    try:
        value = headers.get(name)
    except AttributeError:
        return None
    if value is None and isinstance(headers, dict):
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return str(value) if value else None


def _json(text: Any) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _gcs_kind(method: str, path: str, params: dict[str, Any]) -> str:
    method = method.upper()
    if method == "DELETE":
        return "delete"
    if "/rewriteTo/" in path or "/copyTo/" in path or "/compose" in path:
        return "copy"
    if "upload_id=" in path or params.get("uploadType") == "resumable":
        return "part"  # a resumable session: its start and every chunk
    if "/upload/" in path or params.get("uploadType"):
        return "put"
    if method == "GET":
        if params.get("alt") == "media" or "alt=media" in path or "/download/" in path:
            return "get"
        return "list" if path.rstrip("/").endswith("/o") else "head"
    return method.lower()


def _kept_fields(raw: dict[str, Any]) -> dict[str, str]:
    """The fields of an object's resource a rewrite that sets the copy's metadata repeats."""
    return {k: raw[k] for k in _KEPT_FIELDS if raw.get(k)}
