"""The remote store: the only module that imports fsspec.

A :class:`Remote` is a prefix of one fsspec filesystem seen as a tree of keys relative to that
prefix (``""`` is the prefix itself). It hides what differs between backends: how a directory
exists (a real one, a pseudo-dir, or a ``name/`` marker object), what an object's version is,
how a file is committed atomically, and it counts every request it makes.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import posixpath
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import fsspec

from marinfs.errors import RemoteError, UsageError

log = logging.getLogger(__name__)

# Temporary names used for atomic commits on hierarchical backends; never shown in listings.
TMP_PREFIX = ".marinfs-tmp-"
# Backends where a directory is only a prefix and an empty one needs a ``name/`` marker object.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})


@dataclass(frozen=True)
class ObjectInfo:
    """What the remote says about one key. ``version`` changes whenever the content does."""

    name: str  # relative to the prefix, no leading '/'; "" is the prefix itself
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0
    version: str | None = None


class RequestStats:
    """Counts remote requests by kind and bytes moved; thread-safe, resettable by tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

    def add(self, kind: str, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.counts), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
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
    """GCS generation, else S3 ETag, else mtime+size (local files, memory)."""
    generation = info.get("generation")
    if generation:
        return f"g{generation}"
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"e{str(etag).strip(chr(34))}"
    return f"m{mtime_ns}:{size}"


class Remote:
    """A prefix of an fsspec filesystem, addressed by keys relative to the prefix."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})
        try:
            protocol = fsspec.core.split_protocol(url)[0] or "file"
            cls = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"cannot mount {url}: {exc}") from None
        # marinfs keeps the only metadata cache: fsspec's listing cache and instance reuse would
        # serve stale listings and share state between mounts.
        options.setdefault("skip_instance_cache", True)
        if protocol not in ("file", "local", "memory"):
            options.setdefault("use_listings_cache", False)
        self.url = url
        self.protocol = protocol if isinstance(protocol, str) else protocol[0]
        self.fs = cls(**options)
        self.root = cls._strip_protocol(url).rstrip("/") or ("/" if self.protocol in ("file", "local") else "")
        self.stats = RequestStats()
        self.hierarchical = self.protocol in ("file", "local")
        self.object_store = self.protocol in OBJECT_STORE_PROTOCOLS

    # -- paths ---------------------------------------------------------------------------------
    def full(self, key: str) -> str:
        if not key:
            return self.root
        return f"{self.root.rstrip('/')}/{key}" if self.root else key

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
                self.stats.add("list")
                self.fs.ls(bucket, detail=False)
        except FileNotFoundError:
            raise UsageError(f"{self.url} does not exist") from None
        except PermissionError as exc:
            raise UsageError(f"{self.url}: access denied ({_one_line(exc)})") from None
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure becomes one clear line
            raise UsageError(f"cannot reach {self.url}: {_one_line(exc)}") from None

    # -- metadata ------------------------------------------------------------------------------
    def stat(self, key: str) -> ObjectInfo:
        """The object or directory at ``key``; FileNotFoundError when neither exists."""
        self.stats.add("head")
        raw = self.fs.info(self.full(key))
        return self._info_of(raw, key)

    def list(self, key: str) -> list[ObjectInfo]:
        """The direct children of directory ``key`` (one delimited listing, never recursive)."""
        self.stats.add("list")
        full = self.full(key)
        entries = self.fs.ls(full, detail=True)
        result: dict[str, ObjectInfo] = {}
        for raw in entries:
            path = raw["name"].rstrip("/")
            if path == full.rstrip("/"):
                continue  # a directory marker or the directory itself
            name = posixpath.basename(path)
            if not name or name.startswith(TMP_PREFIX):
                continue
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

    # -- data ----------------------------------------------------------------------------------
    def read_range(self, key: str, start: int, end: int) -> bytes:
        data = self.fs.cat_file(self.full(key), start=start, end=end)
        self.stats.add("get", bytes_in=len(data))
        return data

    def download(self, key: str, local_path: str) -> None:
        self.fs.get_file(self.full(key), local_path)
        self.stats.add("get", bytes_in=os.path.getsize(local_path))

    def upload(self, local_path: str, key: str) -> None:
        """Commit a local file as ``key``; readers see the old or the new object, never a part."""
        size = os.path.getsize(local_path)
        target = self.full(key)
        if self.hierarchical:
            parent = posixpath.dirname(target)
            tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
            try:
                self.fs.put_file(local_path, tmp)
                self.fs.mv(tmp, target)
            except BaseException:
                try:
                    self.fs.rm_file(tmp)
                except OSError:
                    pass
                raise
        else:
            self.fs.put_file(local_path, target)
        self.stats.add("put", bytes_out=size)

    def copy(self, src: str, dst: str) -> None:
        self.stats.add("copy")
        self.fs.cp_file(self.full(src), self.full(dst))

    def delete(self, key: str) -> None:
        self.stats.add("delete")
        self.fs.rm_file(self.full(key))

    def rename(self, src: str, dst: str) -> None:
        """Rename one file: atomic on local disks, copy + delete on object stores."""
        if self.hierarchical:
            self.stats.add("rename")
            os.replace(self.full(src), self.full(dst))
            return
        self.copy(src, dst)
        self.delete(src)

    def walk(self, key: str) -> tuple[list[str], list[str]]:
        """All file keys and directory keys below ``key`` (recursive; for directory renames)."""
        self.stats.add("list")
        found = self.fs.find(self.full(key), withdirs=True, detail=True)
        files, dirs = [], []
        for path, raw in found.items():
            rel = self.key_of(path)
            if rel == key or posixpath.basename(rel).startswith(TMP_PREFIX):
                continue
            (dirs if raw.get("type") == "directory" else files).append(rel)
        return files, dirs

    # -- directories ---------------------------------------------------------------------------
    def make_dir(self, key: str) -> None:
        self.stats.add("mkdir")
        full = self.full(key)
        if self.object_store:
            self.fs.pipe_file(full + "/", b"")
        else:
            self.fs.mkdir(full, create_parents=False)

    def remove_dir(self, key: str) -> None:
        """Remove an (empty) directory: the real one, the pseudo-dir, or the marker object."""
        self.stats.add("rmdir")
        full = self.full(key)
        if self.hierarchical:
            os.rmdir(full)
            return
        if self.object_store:
            try:
                self.fs.rm_file(full + "/")
            except FileNotFoundError:
                pass  # an implicit directory: nothing to delete
            return
        try:
            self.fs.rmdir(full)
        except FileNotFoundError:
            pass

    def invalidate(self, key: str = "") -> None:
        """Drop any cache fsspec keeps despite our options (some backends keep one anyway)."""
        try:
            self.fs.invalidate_cache(self.full(key) if key else None)
        except Exception:  # noqa: BLE001 - best effort only
            pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
