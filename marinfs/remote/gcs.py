"""Google Cloud Storage through gcsfs: versions are generations, commits carry
``ifGenerationMatch`` (0: the object must not exist), big files go as resumable uploads.

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
import os
from typing import Any
from urllib.parse import quote

import fsspec.asyn

from marinfs.errors import PreconditionFailed, StaleVersionError
from marinfs.objects import ObjectInfo, ObjectVersion, gcs_match
from marinfs.remote.base import _exactly, _run
from marinfs.remote.objectstore import ObjectStoreRemote
from marinfs.remote.recorded import Recorded
from marinfs.uploads import Counter, Runner

GCS_CHUNK_ALIGN = 256 << 10  # resumable chunks must be multiples of 256 KiB
SYMLINK_METADATA = "gcsfuse_symlink_target"  # gcsfuse's key for a link's target


class GCSRemote(Recorded, ObjectStoreRemote):
    protocols = ("gs", "gcs")
    version_kind = "generation"
    link_objects = False  # gcsfuse's links: SYMLINK_METADATA on an empty object

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
    def _info_of(self, raw: dict[str, Any], key: str | None = None) -> ObjectInfo:
        info = super()._info_of(raw, key)
        target = (raw.get("metadata") or {}).get(SYMLINK_METADATA) if not info.is_dir else None
        if target is None:
            return info
        return ObjectInfo(name=info.name, is_dir=False, size=len(target.encode("utf-8", "surrogateescape")),
                          mtime_ns=info.mtime_ns, version=info.version, link=True, target=target)

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

    # -- commits -------------------------------------------------------------------------------
    def _put_small(self, data: bytes, key: str, expect: ObjectVersion | None) -> ObjectVersion | None:
        bucket, path, _ = self.fs.split_path(self.full(key))
        out = self._call("put", fsspec.asyn.sync, self.fs.loop, self.fs._call, "POST",
                         f"{self.fs._location}/upload/storage/v1/b/{bucket}/o", uploadType="media",
                         name=path, data=data, json_out=True, **gcs_match(expect))
        generation = (out or {}).get("generation")
        return ObjectVersion("generation", str(generation)) if generation else None

    def part_session(self, key: str, expect: ObjectVersion | None, part_size: int | None = None) -> GCSSession:
        bucket, path, _ = self.fs.split_path(self.full(key))
        return GCSSession(self.fs, bucket, path, expect, part_size or self.settings.upload_part_size,
                          lambda kind, fn: self._call(kind, fn), lambda n: self.stats.add_bytes(bytes_out=n))


class GCSSession:
    """A resumable upload. Chunks must go in order and cannot be changed once sent, so a write
    behind what was sent ends the stream (the file is then uploaded whole at commit).
    ``ifGenerationMatch`` is set when the session starts and checked by GCS when it completes."""

    ordered = True

    def __init__(self, fs: Any, bucket: str, key: str, expect: ObjectVersion | None, part_size: int,
                 run: Runner, sent: Counter = lambda n: None) -> None:
        self.fs, self.key, self._run, self._sent = fs, key, run, sent
        if part_size % GCS_CHUNK_ALIGN:
            raise ValueError(f"GCS upload parts must be multiples of 256 KiB, not {part_size}")
        self.part_size = part_size
        self.result: dict[str, Any] | None = None
        self.sent = 0
        params = gcs_match(expect)

        async def initiate() -> str:
            headers, _ = await fs._call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                                        uploadType="resumable", json={"name": key},
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
