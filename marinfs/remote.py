"""The remote store: the only module that imports fsspec.

A :class:`Remote` is a prefix of one fsspec filesystem seen as a tree of keys relative to that
prefix (``""`` is the prefix itself). It hides what differs between backends: how a directory
exists (a real one, a pseudo-dir, or a ``name/`` marker object), what an object's version is,
how a file is committed atomically, and it counts every request it makes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import datetime as _dt
import errno
import hashlib
import logging
import os
import posixpath
import random
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
import fsspec.config

from marinfs.config import RemoteSettings
from marinfs.directget import DirectGet, Presigner
from marinfs.errors import PreconditionFailed, RemoteError, StaleVersionError, UsageError
from marinfs.uploads import (ABSENT, S3_MAX_PARTS, GCSSession, PartSession, S3Session, gcs_match, s3_match,
                             upload_file)

log = logging.getLogger(__name__)

# Temporary names used for atomic commits on hierarchical backends; never shown in listings.
TMP_PREFIX = ".marinfs-tmp-"
# Backends where a directory is only a prefix and an empty one needs a ``name/`` marker object.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})


T = TypeVar("T")
MiB = 1 << 20
NAME_MAX = 255


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reachable(name: str) -> bool:
    """Whether a path can name this listing entry. Object stores allow keys such as ``a/./b``,
    ``a/../b`` or components over NAME_MAX bytes: listing them would show entries that every
    lookup then fails (or that mean something else), so they are left out."""
    return name not in (".", "..") and len(name.encode("utf-8", "surrogateescape")) <= NAME_MAX


@dataclass(frozen=True)
class ObjectInfo:
    """What the remote says about one key. ``version`` changes whenever the content does."""

    name: str  # relative to the prefix, no leading '/'; "" is the prefix itself
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0
    version: str | None = None


class RequestStats:
    """Counts remote requests by kind (list, head, get, put, part, copy, delete), failures and
    bytes moved; thread-safe, resettable by tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

        self.errors: Counter[str] = Counter()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def add_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def add_bytes(self, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def count(self, kind: str) -> int:
        with self._lock:
            return self.counts[kind]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.counts), "errors": dict(self.errors),
                    "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.errors.clear()
            self.bytes_in = self.bytes_out = 0


def _mtime_ns(info: dict[str, Any]) -> int:
    for key in ("mtime", "LastModified", "updated", "created", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return int(value * 1_000_000_000)
        if isinstance(value, str):
            try:
                value = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, _dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=_dt.timezone.utc)
            return int(value.timestamp() * 1_000_000_000)
    return 0


def _version(info: dict[str, Any], mtime_ns: int, size: int) -> str:
    """GCS generation, else S3 ETag, else mtime+size (memory), plus inode and change time for
    local files: a rewrite can keep size and mtime (`cp -p`, `rsync -a`, a clock that jumped
    back, a coarse timestamp), but not its inode and ctime as well."""
    generation = info.get("generation")
    if generation:
        return f"g{generation}"
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"e{str(etag).strip(chr(34))}"
    version = f"m{mtime_ns}:{size}"
    ctime = info.get("created")
    if info.get("ino") and isinstance(ctime, (int, float)):
        version += f":i{info['ino']}:c{int(ctime * 1_000_000_000)}"
    return version


class Remote:
    """A prefix of an fsspec filesystem, addressed by keys relative to the prefix."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 settings: RemoteSettings | None = None) -> None:
        self.settings = settings or RemoteSettings()
        try:
            protocol = fsspec.core.split_protocol(url)[0] or "file"
            if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
                # gcsfs otherwise tries gRPC/TLS first and stalls a minute against an emulator.
                os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            cls = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"cannot mount {url}: {exc}") from None
        self.url = url
        self.protocol = protocol
        self.stats = RequestStats()
        self.hierarchical = protocol in ("file", "local")
        self.object_store = protocol in OBJECT_STORE_PROTOCOLS
        options = _backend_options(cls, protocol, dict(storage_options or {}), self.settings)
        try:
            self.fs = cls(**options)
        except Exception as exc:  # noqa: BLE001 - bad options or credentials: one clear line
            raise UsageError(f"cannot use {url}: {_one_line(exc)}") from None
        self.root = cls._strip_protocol(url).rstrip("/") or ("/" if self.hierarchical else "")
        # Where the prefix really is on a local disk: symbolic links must not lead out of it.
        self._real_root = os.path.realpath(self.root) if self.hierarchical else None
        if protocol in ("s3", "s3a"):
            self.fs.retries = 1  # s3fs's own retry loop; ours is the one that retries
        # Object stores: count real HTTP requests (pages, parts), not our logical calls.
        self._count_http = _instrument(self.fs, protocol, self.stats)
        self._part_pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._direct = self._direct_get() if protocol in ("s3", "s3a") else None
        self._direct_refused = False  # set once a server refuses our own requests but not s3fs's
        if self._direct is not None:
            self._direct.on_request = lambda: self.stats.add("list")  # botocore's hook does not see it

    def _direct_get(self) -> DirectGet | None:
        """Ranged GETs on plain threads (see directget.py), unless s3fs adds request options a
        presigned URL cannot carry (requester pays, SSE-C) or MARINFS_DIRECT_GET=0."""
        if os.environ.get("MARINFS_DIRECT_GET", "1") == "0" or self.fs.req_kw or self.fs.s3_additional_kwargs:
            return None
        config = dict(getattr(self.fs, "config_kwargs", None) or {})
        verify = (getattr(self.fs, "client_kwargs", None) or {}).get("verify")
        if verify is None:
            verify = os.environ.get("AWS_CA_BUNDLE") or True
        self._presigner = Presigner(self.fs)
        return DirectGet(self._presigner.url,
                         connect_timeout=float(config.get("connect_timeout", self.settings.connect_timeout)),
                         read_timeout=float(config.get("read_timeout", self.settings.read_timeout)),
                         verify=verify)

    @property
    def part_pool(self) -> cf.ThreadPoolExecutor:
        """Threads that send upload parts (shared by every file of this mount)."""
        with self._pool_lock:
            if self._part_pool is None:
                self._part_pool = cf.ThreadPoolExecutor(max_workers=2 * self.settings.upload_concurrency + 2,
                                                        thread_name_prefix="marinfs-upload")
            return self._part_pool

    # -- paths ---------------------------------------------------------------------------------
    def full(self, key: str) -> str:
        if not key:
            return self.root
        if self.object_store and not _utf8(key):
            # A name that is not UTF-8 (surrogate-escaped bytes) cannot be a key: a clear errno
            # instead of an encoding error deep in the client.
            raise OSError(errno.EILSEQ, "object store keys are UTF-8; this name is not", key)
        path = f"{self.root.rstrip('/')}/{key}" if self.root else key
        if self._real_root is not None and not self._inside(path):
            raise PermissionError(errno.EACCES, "a symbolic link leads outside the mounted prefix", path)
        return path

    def _inside(self, path: str) -> bool:
        """Whether a local path, symbolic links resolved, stays under the prefix."""
        real, root = os.path.realpath(path), self._real_root or ""
        return real == root or real.startswith(root.rstrip("/") + "/")

    def _followed(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """A local symbolic link as what it leads to, or None when that is outside the prefix
        or nothing: links are followed only within the mounted tree."""
        path = raw["name"]
        try:
            if not self._inside(path):
                return None
            st = os.stat(path)
        except OSError:
            return None
        return {**raw, "type": "directory" if stat.S_ISDIR(st.st_mode) else "file", "size": st.st_size,
                "mtime": st.st_mtime, "created": st.st_ctime, "ino": st.st_ino}

    def key_of(self, full_path: str) -> str:
        full_path = full_path.rstrip("/")
        root = self.root.rstrip("/")
        if full_path == root:
            return ""
        if not root:
            return full_path
        if full_path.startswith(root + "/"):
            return full_path[len(root) + 1 :]
        raise RemoteError(f"{full_path} is outside the mounted prefix")

    def _info_of(self, raw: dict[str, Any], key: str | None = None) -> ObjectInfo:
        name = self.key_of(raw["name"]) if key is None else key
        is_dir = raw.get("type") == "directory"
        size = 0 if is_dir else int(raw.get("size") or 0)
        mtime = _mtime_ns(raw)
        return ObjectInfo(name=name, is_dir=is_dir, size=size, mtime_ns=mtime,
                          version=None if is_dir else _version(raw, mtime, size))

    def _call(self, kind: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one remote operation: count it, retry transient failures with backoff and
        jitter, then fail with RemoteError (EIO). Answers such as 'not found' are not retried."""
        if not self._count_http:
            self.stats.add(kind)
        attempts = max(1, self.settings.attempts)
        for attempt in range(1, attempts + 1):
            try:
                return fn(*args, **kwargs)
            except PreconditionFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - classified right below
                if is_precondition_failure(exc):
                    raise PreconditionFailed(f"{self.url}: the object changed since it was opened") from exc
                if not is_transient(exc):
                    raise
                if attempt == attempts:
                    self.stats.add_error(kind)
                    raise RemoteError(f"{kind} on {self.url} failed after {attempts} attempts: "
                                      f"{_one_line(exc)}") from exc
                delay = random.uniform(0, min(self.settings.backoff_max,
                                              self.settings.backoff_base * 2 ** attempt))
                log.warning("%s on %s failed (%s); retry %d/%d in %.2fs", kind, self.url,
                            _one_line(exc), attempt, attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- checks --------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail fast, with the URL and the cause, if the prefix cannot be used at all."""
        try:
            if self.hierarchical:
                info = self.fs.info(self.root)
                if info.get("type") != "directory":
                    raise UsageError(f"{self.url} is not a directory")
            elif self.object_store:
                bucket = self.root.split("/", 1)[0]
                self._call("list", self.fs.ls, bucket + "/", detail=False)
        except FileNotFoundError:
            raise UsageError(f"{self.url} does not exist") from None
        except PermissionError as exc:
            raise UsageError(f"{self.url}: access denied ({_one_line(exc)})") from None
        except UsageError:
            raise
        except RemoteError as exc:
            raise UsageError(f"cannot reach {self.url}: {_one_line(exc.__cause__ or exc)}") from None
        except Exception as exc:  # noqa: BLE001 - any backend failure becomes one clear line
            raise UsageError(f"cannot reach {self.url}: {_one_line(exc)}") from None

    # -- metadata ------------------------------------------------------------------------------
    def stat(self, key: str, likely_dir: bool = False) -> ObjectInfo:
        """The object or directory at ``key``; FileNotFoundError when neither exists.

        On object stores a file costs one request (a HEAD, or GCS's metadata GET) and a
        directory two (that HEAD, then a one-key delimited LIST), where fsspec's ``info`` spends
        two to three on either. ``likely_dir`` (it was a directory last time) asks the LIST
        first, so revalidating a known directory costs one request.
        """
        if not (self.object_store and key):
            raw = self._call("head", self.fs.info, self.full(key))
            if raw.get("islink"):
                raw = self._followed(raw)
                if raw is None:  # full() let it through: it leads nowhere
                    raise FileNotFoundError(errno.ENOENT, "a dangling symbolic link", self.url + "/" + key)
            return self._info_of(raw, key)
        full = self.full(key)
        if likely_dir and self._call("list", self._prefix_exists, full):
            return ObjectInfo(name=key, is_dir=True)  # was a directory last time: one LIST
        try:
            return self._info_of(self._call("head", self._head_object, full), key)
        except FileNotFoundError:
            pass
        if not likely_dir and self._call("list", self._prefix_exists, full):
            return ObjectInfo(name=key, is_dir=True)
        raise FileNotFoundError(errno.ENOENT, "no such object or prefix", self.url + "/" + key)

    def _head_object(self, full: str) -> dict[str, Any]:
        bucket, key, _ = self.fs.split_path(full)
        if self.protocol in ("gs", "gcs"):
            return fsspec.asyn.sync(self.fs.loop, self.fs._get_object, full)
        head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        return {"name": full, "type": "file", "size": head.get("ContentLength", 0),
                "ETag": head.get("ETag"), "LastModified": head.get("LastModified")}

    def _prefix_exists(self, full: str) -> bool:
        bucket, key, _ = self.fs.split_path(full)
        prefix = key.rstrip("/") + "/"
        if self.protocol in ("gs", "gcs"):
            out = self.fs.call("GET", "b/{}/o", bucket, prefix=prefix, delimiter="/", maxResults=1,
                               json_out=True)
            return bool(out.get("items") or out.get("prefixes"))
        out = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=1)
        return bool(out.get("Contents") or out.get("CommonPrefixes"))

    def list(self, key: str) -> list[ObjectInfo]:
        """The direct children of directory ``key`` (one delimited listing, never recursive)."""
        full = self.full(key)
        if self._direct is not None:
            bucket, path, _ = self.fs.split_path(full)
            direct = self._direct
            entries = self._direct_first(
                "list", lambda: self._call("list", direct.list, bucket, path.rstrip("/") + "/" if path else "",
                                           self._presign_list),
                lambda: self._call("list", self.fs.ls, full, detail=True))
        else:
            entries = self._call("list", self.fs.ls, full, detail=True)
        result: dict[str, ObjectInfo] = {}
        for raw in entries:
            path = raw["name"].rstrip("/")
            if path == full.rstrip("/"):
                continue  # a directory marker or the directory itself
            name = posixpath.basename(path)
            if not name or name.startswith(TMP_PREFIX) or not _reachable(name):
                continue
            if raw.get("islink"):
                raw = self._followed(raw)
                if raw is None:
                    continue  # leads outside the prefix, or nowhere: not shown
            child = key + "/" + name if key else name
            info = self._info_of(raw, child)
            # An object "a" and a prefix "a/" can coexist in object stores: show the directory.
            if name in result and result[name].is_dir:
                continue
            result[name] = info
        if not entries and not self.hierarchical and key:
            # fsspec lists a missing prefix as empty on some backends; a listing is of a dir.
            info = self.stat(key)
            if not info.is_dir:
                raise NotADirectoryError(key)
        return list(result.values())

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

    def _presign_list(self, params: dict[str, str]) -> str:
        return self._presigner.listing(params)

    # -- data ----------------------------------------------------------------------------------
    def read_range(self, key: str, start: int, end: int, version: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key``; with ``version``, of that version only.

        The version is enforced where the store can (S3 ``If-Match``, GCS ``generation``) and
        checked around the read elsewhere; a different version raises StaleVersionError, so a
        cache keyed by version can never be filled with another version's bytes.
        """
        if start >= end:
            return b""
        full = self.full(key)
        # A version fixes the size, and callers ask only within it: fewer bytes than asked is a
        # response cut short, retried like any transient failure, never handed on.
        want = end - start if version else None
        if self.protocol in ("s3", "s3a") and (not version or version.startswith("e")):
            etag = version[1:] if version else None
            if etag:
                sdk = lambda: self._call("get", _exactly(want, self._s3_get_if_match),  # noqa: E731
                                         full, start, end, etag)
            else:
                sdk = lambda: self._call("get", self.fs.cat_file, full, start=start, end=end)  # noqa: E731
            data = self._direct_first("get", lambda: self._call("get", _exactly(want, self._get_direct),
                                                                full, start, end, etag), sdk)
        elif version and self.protocol in ("gs", "gcs") and version.startswith("g"):
            try:
                data = self._call("get", _exactly(want, fsspec.asyn.sync), self.fs.loop,
                                  self.fs._cat_file_sequential, full, start=start, end=end,
                                  generation=version[1:])
            except FileNotFoundError:
                raise StaleVersionError(f"{self.url}: {key} is no longer generation {version[1:]}") from None
        else:
            def changed() -> bool:  # a shorter object is a new version, not a cut-short response
                return bool(version) and self.stat(key).version != version

            data = self._call("get", _exactly(want, self.fs.cat_file, changed), full, start=start, end=end)
            if changed():
                raise StaleVersionError(f"{self.url}/{key} changed while it was read")
        self.stats.add_bytes(bytes_in=len(data))
        return data

    def _get_direct(self, full: str, start: int, end: int, etag: str | None) -> bytes:
        assert self._direct is not None
        self.stats.add("get")  # not seen by botocore's hook: count it here
        return self._direct.get(full, start, end, etag)

    def _s3_get_if_match(self, full: str, start: int, end: int, etag: str) -> bytes:
        bucket, key, _ = self.fs.split_path(full)

        async def get() -> bytes:
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, IfMatch=etag,
                                              Range=f"bytes={start}-{end - 1}")
            except OSError as exc:
                if "PreconditionFailed" in repr(exc.__cause__ or exc) or "412" in str(exc):
                    raise StaleVersionError(f"{self.url}: {key} is no longer version {etag}") from None
                raise
            async with resp["Body"] as body:
                return await body.read()

        return fsspec.asyn.sync(self.fs.loop, get)

    def download(self, key: str, local_path: str) -> None:
        self._call("get", self.fs.get_file, self.full(key), local_path)
        self.stats.add_bytes(bytes_in=os.path.getsize(local_path))

    def upload(self, local_path: str, key: str, expect: str | None = None) -> str | None:
        """Commit a local file as ``key``; readers see the old or the new object, never a part.

        ``expect`` makes the commit conditional: the version the writer started from, or
        ``ABSENT`` for a new file; if the object is not (or no longer) that, nothing is written
        and PreconditionFailed is raised. S3 and GCS check it on the server, atomically; other
        backends compare a stat taken just before the commit. Answers the new version if known.
        """
        size = os.path.getsize(local_path)
        target = self.full(key)
        version: str | None = None
        if self.hierarchical:
            parent = posixpath.dirname(target)
            tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
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
        elif self.object_store and (expect is None or expect == ABSENT or expect[0] in "eg"):
            if size >= self.settings.upload_part_size:  # parts count their own bytes
                # S3 allows 10,000 parts: files past 160 GB get bigger parts, fewer at a time.
                part = max(self.settings.upload_part_size, -(-size // S3_MAX_PARTS // MiB) * MiB)
                in_flight = max(1, min(self.settings.upload_concurrency, (256 * MiB) // part))
                return upload_file(local_path, lambda: self.part_session(key, expect, part),
                                   part, self.part_pool, in_flight)
            version = self._put_small(local_path, key, expect)
        else:
            self._check_expected(key, expect)
            self._call("put", self.fs.put_file, local_path, target)
        self.stats.add_bytes(bytes_out=size)
        return version

    def _check_expected(self, key: str, expect: str | None) -> None:
        if expect is None:
            return
        try:
            current = self.stat(key)
            found = "a directory" if current.is_dir else current.version
        except FileNotFoundError:
            found = ABSENT
        if found != expect:
            raise PreconditionFailed(f"{self.url}/{key} changed since it was opened")

    def _put_small(self, local_path: str, key: str, expect: str | None) -> str | None:
        with open(local_path, "rb") as f:
            data = f.read()
        full = self.full(key)
        bucket, path, _ = self.fs.split_path(full)
        if self.protocol in ("s3", "s3a"):
            md5 = hashlib.md5(data)
            def sdk_put() -> str | None:
                out = self._call("put", fsspec.asyn.sync, self.fs.loop, self.fs._call_s3, "put_object",
                                 Bucket=bucket, Key=path, Body=data, **s3_match(expect))
                return (out.get("ETag") or "").strip('"') or None

            def direct_put() -> str | None:
                assert self._direct is not None
                self.stats.add("put")  # not seen by botocore's hook: count it here
                return self._call("put", self._direct.put, full, data, s3_match(expect))

            try:
                etag = self._direct_first("put", direct_put, sdk_put)
            except PreconditionFailed:
                # A retried PUT whose first answer was lost meets its own object: same bytes,
                # so it is ours (or identical), not a conflict.
                try:
                    current = self.stat(key)
                except FileNotFoundError:
                    raise PreconditionFailed(f"{self.url}/{key} changed since it was opened") from None
                if current.version != f"e{md5.hexdigest()}":
                    raise
                etag = md5.hexdigest()
            return f"e{etag}" if etag else None
        params = gcs_match(expect)
        try:
            out = self._call("put", fsspec.asyn.sync, self.fs.loop, self.fs._call, "POST",
                             f"{self.fs._location}/upload/storage/v1/b/{bucket}/o", uploadType="media",
                             name=path, data=data, json_out=True, **params)
        except FileExistsError:  # gcsfs's translation of HTTP 412
            raise PreconditionFailed(f"{self.url}/{key} changed since it was opened") from None
        generation = (out or {}).get("generation")
        return f"g{generation}" if generation else None

    def part_session(self, key: str, expect: str | None, part_size: int | None = None) -> PartSession:
        """A multipart (S3) or resumable (GCS) upload of ``key``; object stores only."""
        bucket, path, _ = self.fs.split_path(self.full(key))
        run = lambda kind, fn: self._call(kind, fn)  # noqa: E731 - retries and counting
        cls = S3Session if self.protocol in ("s3", "s3a") else GCSSession
        sent = lambda n: self.stats.add_bytes(bytes_out=n)  # noqa: E731
        if cls is S3Session and self._direct is not None:
            direct, full = self._direct, self.full(key)

            def put_part(upload_id: str, number: int, data: bytes) -> str:
                def ours() -> str:
                    self.stats.add("part")  # not seen by botocore's hook: count it here
                    return direct.put_part(full, upload_id, number, data)

                def sdk() -> str:
                    return fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "upload_part", Bucket=bucket, Key=path,
                                            UploadId=upload_id, PartNumber=number, Body=data)["ETag"]

                return self._direct_first("part", ours, sdk)

            return S3Session(self.fs, bucket, path, expect, part_size or self.settings.upload_part_size, run,
                             sent, put_part=put_part)
        return cls(self.fs, bucket, path, expect, part_size or self.settings.upload_part_size, run, sent)

    @property
    def streams(self) -> bool:
        """Whether commits can be sent in parts while a file is being written."""
        return self.object_store

    def copy(self, src: str, dst: str) -> None:
        self._call("copy", self.fs.cp_file, self.full(src), self.full(dst))

    def delete(self, key: str) -> None:
        self._call("delete", self.fs.rm_file, self.full(key))

    def rename(self, src: str, dst: str) -> None:
        """Rename one file: atomic on local disks, copy + delete on object stores."""
        if self.hierarchical:
            self.stats.add("rename")
            os.replace(self.full(src), self.full(dst))
            return
        self.copy(src, dst)
        self.delete(src)

    def walk(self, key: str) -> tuple[list[str], list[str], list[str]]:
        """Everything below ``key`` (recursive; for directory renames): file keys, directory
        keys, and the directories (``key`` itself included) that exist in their own right
        (marker objects, pseudo-dirs) rather than implicitly through their objects."""
        found = self._call("list", self.fs.find, self.full(key), withdirs=True, detail=True)
        files: list[str] = []
        dirs: list[str] = []
        explicit: list[str] = []
        for path, raw in found.items():
            rel = self.key_of(path)
            if posixpath.basename(rel).startswith(TMP_PREFIX):
                continue
            name = str(raw.get("name", path))
            marker = name.endswith("/") if self.object_store else raw.get("type") == "directory"
            if marker or raw.get("type") == "directory":
                if rel not in dirs and rel != key:
                    dirs.append(rel)
                if marker and rel not in explicit:
                    explicit.append(rel)
            elif rel != key:
                files.append(rel)
        return files, dirs, explicit

    # -- directories ---------------------------------------------------------------------------
    def make_dir(self, key: str) -> None:
        full = self.full(key)
        if self.object_store:
            self._call("put", self.fs.pipe_file, full + "/", b"")  # the `dir/` marker object
        else:
            self._call("mkdir", self.fs.mkdir, full, create_parents=False)

    def remove_dir(self, key: str) -> None:
        """Remove an (empty) directory: the real one, the pseudo-dir, or the marker object."""
        full = self.full(key)
        if self.hierarchical:
            self.stats.add("rmdir")
            os.rmdir(full)
            return
        try:
            if self.object_store:
                self._call("delete", self.fs.rm_file, full + "/")
            else:
                self._call("rmdir", self.fs.rmdir, full)
        except FileNotFoundError:
            pass  # an implicit directory: nothing to delete

    def invalidate(self, key: str = "") -> None:
        """Drop any cache fsspec keeps despite our options (some backends keep one anyway)."""
        try:
            self.fs.invalidate_cache(self.full(key) if key else None)
        except Exception:  # noqa: BLE001 - best effort only
            pass


class TruncatedResponse(ConnectionError):
    """A read returned fewer bytes than asked without an error: retried like a dropped connection."""


def _exactly(size: int | None, fn: Callable[..., bytes],
             changed: Callable[[], bool] | None = None) -> Callable[..., bytes]:
    """``fn`` (a ranged read) that fails, retryably, when it returns other than ``size`` bytes
    (None: any number)."""
    if size is None:
        return fn

    def read(*args: Any, **kwargs: Any) -> bytes:
        data = fn(*args, **kwargs)
        if len(data) != size:
            if changed is not None and changed():
                raise StaleVersionError(f"object changed: {len(data)} of {size} bytes")
            raise TruncatedResponse(f"short read: {len(data)} of {size} bytes")
        return data

    return read


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# Failures worth another attempt: the network, timeouts, throttling and server errors.
_TRANSIENT_NAMES = frozenset({
    "ClientError", "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError",
    "ClientOSError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "HTTPClientError", "IncompleteRead", "ResponseParserError",
    "FSTimeoutError", "ChunkedEncodingError",
})
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def is_precondition_failure(exc: BaseException) -> bool:
    """HTTP 412 from S3 (s3fs turns it into EINVAL) or GCS (gcsfs turns it into FileExistsError
    only on uploads, where we catch it ourselves)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


def is_transient(exc: BaseException) -> bool:
    """True for failures that may pass on retry; never for answers ('not found', 'denied')."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError, UsageError, StaleVersionError)):
        return False  # (a StaleVersionError carries the store's 412 in its context: an answer)
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    for cls in type(exc).__mro__:
        if cls.__name__ in _TRANSIENT_NAMES:
            return True
    status = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(status, int) and status in _TRANSIENT_STATUS:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _TRANSIENT_STATUS or response.get("Error", {}).get("Code") in ("SlowDown", "Throttling"):
            return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def _backend_options(cls: type, protocol: str, options: dict[str, Any],
                     settings: RemoteSettings) -> dict[str, Any]:
    """Merge FSSPEC_<PROTOCOL> config, the user's options, and our timeouts and retry bounds.

    marinfs keeps the only metadata cache: fsspec's listing cache and instance reuse would serve
    stale listings and share state between mounts. Retries are ours (one bounded loop), so the
    backend's own retry loops are reduced to a single attempt where they can be (botocore and
    s3fs; gcsfs keeps its own, which are bounded too).
    """
    options = fsspec.config.apply_config(cls, options)
    options.setdefault("skip_instance_cache", True)
    if protocol in ("s3", "s3a"):
        options.setdefault("use_listings_cache", False)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", settings.connect_timeout)
        config.setdefault("read_timeout", settings.read_timeout)
        config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
        options["config_kwargs"] = config
    elif protocol in ("gs", "gcs"):
        options.setdefault("use_listings_cache", False)
        options.setdefault("requests_timeout", settings.connect_timeout + settings.read_timeout)
        options.setdefault("timeout", settings.connect_timeout + settings.read_timeout)
    elif protocol not in ("file", "local", "memory"):
        options.setdefault("use_listings_cache", False)
    return options


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


def _instrument(fs: Any, protocol: str, stats: RequestStats) -> bool:
    """Count every HTTP request the backend sends, by kind. False when we cannot (then the
    Remote counts its own calls, which is exact for local and memory backends)."""
    if protocol in ("s3", "s3a"):
        client = fsspec.asyn.sync(fs.loop, fs.set_session)

        def before_send(event_name: str = "", **_: Any) -> None:
            stats.add(_s3_kind(event_name.rsplit(".", 1)[-1]))

        client.meta.events.register("before-send.s3", before_send)
        return True
    if protocol in ("gs", "gcs"):
        request = fs._request

        async def counted(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            stats.add(_gcs_kind(method, str(path), kwargs))
            return await request(method, path, *args, **kwargs)

        fs._request = counted
        return True
    return False
