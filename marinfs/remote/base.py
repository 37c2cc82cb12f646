"""What every backend shares: keys under the prefix, the one retry loop, the one classification
of transient and precondition failures, and request counting.

A :class:`Remote` is a prefix of one fsspec filesystem seen as a tree of keys relative to that
prefix (``""`` is the prefix itself). ``Remote(url, ...)`` answers the backend class that serves
the URL's protocol (local.py, generic.py, s3.py, gcs.py); each backend holds its own listing,
ranged read, upload session and conditional commit. The methods here are what a plain fsspec
filesystem does; backends override what their store does differently or better.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import datetime as _dt
import errno
import logging
import os
import posixpath
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, TypeVar

import fsspec
import fsspec.config

from marinfs.errors import FsError, PreconditionFailed, RemoteError, StaleVersionError, UsageError
from marinfs.errors import is_final as errors_is_final
from marinfs.objects import ABSENT, Copied, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote.parts import PartSession, PartStream
from marinfs.remote.settings import RemoteSettings
from marinfs.remote.stats import RequestStats
from marinfs.threadnames import each_at_once, name_current

log = logging.getLogger(__name__)

# Temporary names used for atomic commits on local disks; never shown in listings.
TMP_PREFIX = ".marinfs-tmp-"
# rclone's convention for a symbolic link on a store without them (``rclone --links``): an
# object ``NAME.rclonelink`` whose body is the link's target. Its key says what it is, so a
# listing shows links without a request more; its size is the target's length.
LINK_SUFFIX = ".rclonelink"

T = TypeVar("T")
OnPage = Callable[[list[dict[str, Any]]], None]  # sees one page of raw listing entries
MiB = 1 << 20
NAME_MAX = 255

# Failures worth another attempt: the network, timeouts, throttling and server errors.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
PRECONDITION_STATUS = 412
_TRANSIENT_NAMES = frozenset({
    "ClientError", "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError",
    "ClientOSError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "HTTPClientError", "IncompleteRead", "ResponseParserError",
    "FSTimeoutError", "ChunkedEncodingError",
})

_BACKENDS: dict[str, type[Remote]] = {}


def protocol_of(url: str) -> str:
    return fsspec.core.split_protocol(url)[0] or "file"


def _reachable(name: str) -> bool:
    """Whether a path can name this listing entry. Object stores allow keys such as ``a/./b``,
    ``a/../b`` or components over NAME_MAX bytes: listing them would show entries that every
    lookup then fails (or that mean something else), so they are left out."""
    return name not in (".", "..") and len(name.encode("utf-8", "surrogateescape")) <= NAME_MAX


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


def version_of(info: dict[str, Any], mtime_ns: int, size: int) -> ObjectVersion:
    """The version an fsspec info dict carries: GCS generation, else S3 ETag, else mtime+size
    (memory), plus inode and change time for local files (see ObjectVersion.local)."""
    generation = info.get("generation")
    if generation:
        return ObjectVersion("generation", str(generation))
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return ObjectVersion.etag(str(etag))
    ctime = info.get("created")
    if info.get("ino") and isinstance(ctime, (int, float)):
        return ObjectVersion.local(mtime_ns, size, info["ino"], int(ctime * 1_000_000_000))
    return ObjectVersion.local(mtime_ns, size)


class Remote:
    """A prefix of an fsspec filesystem, addressed by keys relative to the prefix.

    ``Remote(url, storage_options, settings)`` builds the backend for the URL's protocol
    (registered by each subclass's ``protocols``); unknown protocols get the generic one.
    """

    protocols: ClassVar[tuple[str, ...]] = ()
    object_store: ClassVar[bool] = False  # directories are prefixes, empty ones need a marker
    streams: ClassVar[bool] = False  # commits can be sent in parts while a file is written
    _root_default: ClassVar[str] = ""  # what an empty path after the protocol means
    # Symbolic links are ``NAME.rclonelink`` objects (rclone's convention); local disks have
    # real ones and GCS keeps gcsfuse's (an empty object with the target in its metadata).
    link_objects: ClassVar[bool] = True
    # Persisted POSIX metadata (objects.PosixAttrs; docs/architecture.md): whether files can
    # hold it (upload's ``attrs``, set_attrs), and whether list() carries it (else its entries
    # have posix=None and the directory record fills them in).
    stores_posix: ClassVar[bool] = True
    lists_posix: ClassVar[bool] = False
    # A rename moves the object itself (rename(2) on a local disk): every file is the same file
    # under the new name, so a reader open here keeps reading it there (fs.Filesystem.rename).
    renames_in_place: ClassVar[bool] = False
    # The bytes of user.* attributes a file can keep (attrs_bytes counts them): here all names
    # and values together, as ext4 keeps in its attribute block; a store that encodes them into
    # its object metadata keeps what that holds (S3 2 KiB, GCS 8 KiB).
    attrs_limit: ClassVar[int] = 65536
    # A copy can carry new POSIX attributes in the request that copies (``copy(..., attrs=)``:
    # S3 CopyObject with MetadataDirective=REPLACE, GCS rewrite with the destination's metadata,
    # memory:// under the key's lock), so attributes set on a file just before its rename cost no
    # request of their own (core/deferred.py). Not on local disks: a rename(2) moves the file.
    folds_attrs: ClassVar[bool] = False

    def __init_subclass__(cls, fallback: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for protocol in cls.protocols:
            _BACKENDS[protocol] = cls
        if fallback:
            _BACKENDS[""] = cls  # any protocol no backend claims

    def __new__(cls, url: str, storage_options: dict[str, Any] | None = None,
                settings: RemoteSettings | None = None) -> Remote:
        if cls is Remote:
            cls = backend_class(protocol_of(url))
        return super().__new__(cls)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 settings: RemoteSettings | None = None) -> None:
        self.settings = settings or RemoteSettings()
        # Told when an upload of a local file opens or ends a session the store keeps apart
        # (an S3 multipart upload): (the local file, the session's record, opened?), so the
        # file's journal names it and the next daemon can abort it (set by fs.Filesystem).
        self.on_upload_session: Callable[[str, dict[str, Any], bool], None] | None = None
        try:
            protocol = protocol_of(url)
            self._prepare_environment()
            cls = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise UsageError(f"cannot mount {url}: {exc}") from None
        self.url = url
        self.protocol = protocol
        self.stats = RequestStats()
        options = self._options(fsspec.config.apply_config(cls, dict(storage_options or {})))
        try:
            self.fs = cls(**options)
        except Exception as exc:  # noqa: BLE001 - bad options or credentials: one clear line
            raise UsageError(f"cannot use {url}: {_one_line(exc)}") from None
        self.root = cls._strip_protocol(url).rstrip("/") or self._root_default
        # Object stores count real HTTP requests (pages, parts), not our logical calls.
        self._count_http = self._instrument()
        self._part_pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- construction hooks --------------------------------------------------------------------
    def _prepare_environment(self) -> None:
        """Set what the backend's library reads from the environment when it is imported."""

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The storage options (FSSPEC_<PROTOCOL> config and the user's already merged) plus
        ours. marinfs keeps the only metadata cache: fsspec's listing cache and instance reuse
        would serve stale listings and share state between mounts."""
        options.setdefault("skip_instance_cache", True)
        return options

    def _instrument(self) -> bool:
        """Count every HTTP request the backend sends, by kind. False when we cannot: then each
        logical call is counted, which is exact for local and memory backends."""
        return False

    @property
    def part_pool(self) -> cf.ThreadPoolExecutor:
        """Threads that send upload parts (shared by every file of this mount)."""
        with self._pool_lock:
            if self._part_pool is None:
                self._part_pool = cf.ThreadPoolExecutor(max_workers=2 * self.settings.upload_concurrency + 2,
                                                        thread_name_prefix="upload",
                                                        initializer=name_current)
            return self._part_pool

    def close(self) -> None:
        """Release the upload threads and connections once nothing will be asked any more.
        Never waits: after a drain timeout an upload may still hang on the network."""
        with self._pool_lock:
            pool, self._part_pool = self._part_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

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
                          version=None if is_dir else version_of(raw, mtime, size),
                          posix=self._posix_of(raw, is_dir))

    def _posix_of(self, raw: dict[str, Any], is_dir: bool) -> PosixAttrs | None:
        """The POSIX metadata an fsspec info dict carries (None: it does not say). A plain
        fsspec store keeps none, so a file's is PosixAttrs(); directories are the record's."""
        return None if is_dir else PosixAttrs()

    # -- the one retry loop --------------------------------------------------------------------
    def _call(self, kind: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one remote operation: count it, retry transient failures with backoff and
        jitter, then fail with RemoteError (EIO). Answers such as 'not found' are not retried;
        a failed precondition is PreconditionFailed."""
        if not self._count_http:
            self.stats.add(kind)
        attempts = max(1, self.settings.attempts)
        for attempt in range(1, attempts + 1):
            try:
                return fn(*args, **kwargs)
            except (PreconditionFailed, StaleVersionError):
                raise
            except Exception as exc:  # noqa: BLE001 - classified right below
                if self._is_precondition_failure(exc):
                    raise PreconditionFailed(f"{self.url}: the object changed since it was opened") from exc
                if not self._is_transient(exc):
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

    def _read_call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``_call`` of a read pinned to a version: a failed precondition means the object is
        no longer that version (ESTALE), never a conflict."""
        try:
            return self._call("get", fn, *args, **kwargs)
        except PreconditionFailed as exc:
            raise StaleVersionError(f"{self.url}: the object is no longer the version opened") from exc

    def _is_precondition_failure(self, exc: BaseException) -> bool:
        return is_precondition_failure(exc)

    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    # -- checks --------------------------------------------------------------------------------
    def check_key(self, key: str) -> None:
        """Raise the errno (EILSEQ, ENAMETOOLONG) if this store can never hold ``key``, before
        anything is staged or sent: a create, mkdir, link or rename onto such a name fails at
        once instead of at every commit. Local disks answer for themselves."""

    def check(self) -> None:
        """Fail fast, with the URL and the cause, if the prefix cannot be used at all."""
        try:
            self._check()
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

    def _check(self) -> None:
        """Nothing to probe on a generic backend: its first request tells."""

    def warm(self) -> None:
        """Build what the first requests would otherwise build on the way (clients, signers):
        called once in the background as the mount starts, so a user's first ``ls`` does not
        wait for it. Never raises: whatever fails here is built, or fails, on first use."""

    # -- metadata ------------------------------------------------------------------------------
    def stat(self, key: str, likely_dir: bool = False, likely_link: bool = False) -> ObjectInfo:
        """The object or directory at ``key``; FileNotFoundError when neither exists.
        ``likely_dir`` (it was a directory last time) lets object stores ask the cheaper
        question first; ``likely_link`` (a link last time) asks for its link object first."""
        if likely_link:
            link = self._stat_link(key)
            if link is not None:
                return link
        try:
            if self._reserved(key):
                raise FileNotFoundError(errno.ENOENT, "a link's own object is not a file", key)
            raw = self._call("head", self.fs.info, self.full(key))
        except FileNotFoundError:
            link = self._stat_link(key)
            if link is None:
                raise
            return link
        return self._info_of(raw, key)

    def _reserved(self, key: str) -> bool:
        """Whether ``key`` names a link's own object (``x.rclonelink`` is the link ``x``), which
        is never shown as a file of that name."""
        return self.link_objects and key.endswith(LINK_SUFFIX)

    def _stat_link(self, key: str) -> ObjectInfo | None:
        """The link ``key`` (its ``key.rclonelink`` object), or None when there is none."""
        if not self.link_objects or not key:
            return None
        try:
            raw = self._call("head", self.fs.info, self.full(key) + LINK_SUFFIX)
        except FileNotFoundError:
            return None
        if raw.get("type") == "directory":
            return None
        return replace(self._info_of(raw, key), link=True)

    def _list_entries(self, full: str, on_page: OnPage | None = None) -> list[dict[str, Any]]:
        """The fsspec entries of one delimited listing of ``full``; ``on_page`` sees them as
        they land, page by page where the backend pages (else once, all of them)."""
        entries = self._call("list", self.fs.ls, full, detail=True)
        if on_page is not None:
            on_page(entries)
        return entries

    def list(self, key: str, on_page: OnPage | None = None) -> list[ObjectInfo]:
        """The direct children of directory ``key`` (one delimited listing, never recursive).
        ``on_page`` sees the raw entries of each page as it lands (see ``_list_entries``)."""
        full = self.full(key)
        try:
            entries = self._list_entries(full, on_page)
        except FileNotFoundError:
            if key:
                raise
            entries = []  # the mount's root is there with no object under its prefix (gcsfs: not found)
        result: dict[str, ObjectInfo] = {}
        links: dict[str, ObjectInfo] = {}
        for raw in entries:
            path = raw["name"].rstrip("/")
            if path == full.rstrip("/"):
                continue  # a directory marker or the directory itself
            name = posixpath.basename(path)
            if not name or name.startswith(TMP_PREFIX) or not _reachable(name):
                continue
            if self._reserved(name) and raw.get("type") != "directory":
                name = name[: -len(LINK_SUFFIX)]  # x.rclonelink is the link x
                if name and _reachable(name) and not name.startswith(TMP_PREFIX):
                    child = key + "/" + name if key else name
                    links[name] = replace(self._info_of(raw, child), link=True)
                continue
            child = key + "/" + name if key else name
            info = self._link_info(raw, child) if raw.get("islink") else self._info_of(raw, child)
            # An object "a" and a prefix "a/" can coexist in object stores: show the directory.
            if name in result and result[name].is_dir:
                continue
            result[name] = info
        for name, link in links.items():
            # A directory or a regular object of the same name wins, as stat() finds it first.
            result.setdefault(name, link)
        if not entries and key:
            self._confirm_dir(key)
        if not self.lists_posix:  # what the entries carried is not the whole truth here
            return [info.with_posix(None) if info.posix is not None else info for info in result.values()]
        return list(result.values())

    def _link_info(self, raw: dict[str, Any], key: str) -> ObjectInfo:
        """A listing entry the filesystem reports as a symbolic link (local disks)."""
        return self._info_of(raw, key)

    # -- symbolic links ------------------------------------------------------------------------
    # A link's target is text: nothing here ever follows one.
    def symlink(self, key: str, target: str) -> ObjectVersion | None:
        """Make ``key`` a symbolic link to ``target``; FileExistsError if ``key.rclonelink``
        exists (the caller checked ``key`` itself). Answers the new version if known."""
        full = self.full(key) + LINK_SUFFIX
        if self._call("head", self.fs.exists, full):
            raise FileExistsError(errno.EEXIST, "a link of that name exists", key)
        self._call("put", self.fs.pipe_file, full, target.encode("utf-8", "surrogateescape"))
        return None

    def readlink(self, key: str, info: ObjectInfo) -> str:
        """The target of link ``key`` as ``info`` (its stat) found it: from the stat where it
        carried the target, else one GET of the link object's small body."""
        if info.target is not None:
            return info.target
        return self._link_body(key, info).decode("utf-8", "surrogateescape")

    def _link_body(self, key: str, info: ObjectInfo) -> bytes:
        data = self._call("get", self.fs.cat_file, self.full(key) + LINK_SUFFIX)
        self.stats.add_bytes(bytes_in=len(data))
        return data

    def delete_link(self, key: str) -> None:
        self._call("delete", self.fs.rm_file, self.full(key) + LINK_SUFFIX)

    def rename_link(self, src: str, dst: str) -> None:
        """Rename link ``src`` (copy then delete of its object)."""
        self._call("copy", self.fs.cp_file, self.full(src) + LINK_SUFFIX, self.full(dst) + LINK_SUFFIX)
        self.delete_link(src)

    def _confirm_dir(self, key: str) -> None:
        """fsspec lists a missing prefix as empty on some backends; a listing is of a dir."""
        info = self.stat(key)
        if not info.is_dir:
            raise NotADirectoryError(key)

    # -- data ----------------------------------------------------------------------------------
    def read_range(self, key: str, start: int, end: int, version: ObjectVersion | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key``; with ``version``, of that version only.

        The version is enforced where the store can (S3 ``If-Match``, GCS ``generation``) and
        checked around the read elsewhere; a different version raises StaleVersionError, so a
        cache keyed by version can never be filled with another version's bytes.
        """
        data = self.read_buffer(key, start, end, version)
        return data if isinstance(data, bytes) else bytes(data)

    def read_buffer(self, key: str, start: int, end: int, version: ObjectVersion | None = None) -> Any:
        """:meth:`read_range`'s bytes as whatever buffer the backend received them in (S3
        through obstore: its ``Bytes``, no copy into a ``bytes``), for the chunk fetcher, which
        only takes ``len``, slices through a ``memoryview`` and writes it to the cache."""
        if start >= end:
            return b""
        # A version fixes the size, and callers ask only within it: fewer bytes than asked is a
        # response cut short, retried like any transient failure, never handed on.
        data = self._read(key, start, end, version, end - start if version else None)
        self.stats.add_bytes(bytes_in=len(data))
        return data

    def read_into(self, key: str, start: int, end: int, version: ObjectVersion | None, buf: memoryview) -> None:
        """:meth:`read_buffer`'s bytes into ``buf`` (``len(buf) == end - start``, a pooled chunk
        buffer). Here a copy of what the backend answered; backends that can read a body
        straight into memory (S3 and GCS over urllib3) do that instead. Fewer bytes than asked is
        EOFError (with a version, already retried as a response cut short)."""
        data = self.read_buffer(key, start, end, version)
        if len(data) != len(buf):
            raise EOFError(f"short read of {key}: {len(data)} of {len(buf)} bytes at {start}")
        view = memoryview(data)
        buf[:] = view if view.format == "B" else view.cast("B")

    def _read(self, key: str, start: int, end: int, version: ObjectVersion | None, want: int | None) -> bytes:
        """A ranged read checked around: the stat after it must still show ``version``."""
        def changed() -> bool:  # a shorter object is a new version, not a cut-short response
            return bool(version) and self.stat(key).version != version

        data = self._call("get", _exactly(want, self.fs.cat_file, changed), self.full(key), start=start, end=end)
        if changed():
            raise StaleVersionError(f"{self.url}/{key} changed while it was read")
        return data

    def download(self, key: str, local_path: str) -> None:
        self._call("get", self.fs.get_file, self.full(key), local_path)
        self.stats.add_bytes(bytes_in=os.path.getsize(local_path))

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None,
               attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        """Commit a local file as ``key``; readers see the old or the new object, never a part.

        ``expect`` makes the commit conditional: the version the writer started from, or
        ``ABSENT`` for a new file; if the object is not (or no longer) that, nothing is written
        and PreconditionFailed is raised. S3 and GCS check it on the server, atomically; other
        backends compare a stat taken just before the commit. Answers the new version if known.

        ``attrs`` (the file's POSIX metadata, complete) go with the bytes, in the same request
        where the store allows; None or empty sends exactly what a plain commit sends. A plain
        fsspec store cannot keep them: ENOTSUP, before anything is written.
        """
        self._require_posix(attrs)
        self._check_expected(key, expect)
        self._call("put", self.fs.put_file, local_path, self.full(key))
        self.stats.add_bytes(bytes_out=os.path.getsize(local_path))
        return None

    def _check_expected(self, key: str, expect: ObjectVersion | None) -> None:
        if expect is None:
            return
        try:
            current = self.stat(key)
            found: ObjectVersion | str | None = "a directory" if current.is_dir else current.version
        except FileNotFoundError:
            found = ABSENT
        if found != expect:
            raise PreconditionFailed(f"{self.url}/{key} changed since it was opened")

    def part_session(self, key: str, expect: ObjectVersion | None, part_size: int | None = None,
                     attrs: PosixAttrs | None = None) -> Any:
        """A multipart (S3) or resumable (GCS) upload of ``key``; only where ``streams``."""
        raise NotImplementedError(f"{self.protocol} uploads are not sent in parts")

    def part_stream(self, fd: int, key: str, expect: ObjectVersion | None,
                    attrs: PosixAttrs | None = None) -> PartStream:
        """The parts of a new or truncated file ``key``, sent from ``fd`` while it is written
        (only where ``streams``; the session opens with the first full part): parts of
        ``upload_part_size``, at most ``upload_concurrency`` in flight, on ``part_pool``'s
        threads. ``attrs`` (a create's mode) go with the session."""

        def session() -> PartSession:
            if attrs is None:
                return self.part_session(key, expect)
            return self.part_session(key, expect, attrs=attrs)

        return PartStream(fd, session, self.settings.upload_part_size, self.part_pool,
                          self.settings.upload_concurrency)

    def abort_upload(self, record: dict[str, Any]) -> None:
        """Abort the upload a session's ``record`` names (journaled while it was open; the
        daemon that opened it may have been killed). Records of other stores are dropped."""
        log.debug("no upload of this kind to abort on %s: %s", self.url, record.get("store"))

    # -- persisted POSIX metadata --------------------------------------------------------------
    @classmethod
    def attrs_bytes(cls, attrs: PosixAttrs) -> int:
        """What ``attrs`` take of ``attrs_limit``: here their xattrs' names and values."""
        return sum(len(n.encode()) + len(v) for n, v in attrs.xattrs)

    @classmethod
    def attrs_fit(cls, attrs: PosixAttrs) -> bool:
        """Whether a file here can keep ``attrs``: asked before anything is sent, so a value
        too big fails its setxattr (ENOSPC), not a later close (EIO)."""
        return cls.attrs_bytes(attrs) <= cls.attrs_limit

    def _require_posix(self, attrs: PosixAttrs | None) -> None:
        if attrs is not None and not attrs.empty and not self.stores_posix:
            raise FsError(errno.ENOTSUP, f"{self.protocol}:// keeps no POSIX metadata")

    def set_attrs(self, key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion | None:
        """Make ``attrs`` (the complete new value, not a change) the stored POSIX metadata of
        file ``key`` without sending its bytes, only while it is ``expect`` (None: whatever it
        is): else PreconditionFailed and nothing changed; FileNotFoundError if it is gone.
        Answers its version after the update (None if the store did not say)."""
        raise FsError(errno.ENOTSUP, f"{self.protocol}:// keeps no POSIX metadata")

    def _current_file(self, key: str, expect: ObjectVersion | None) -> ObjectInfo:
        """The stat of file ``key`` as a metadata update finds it: FileNotFoundError if gone,
        PreconditionFailed if it is not ``expect`` (any version when None)."""
        info = self.stat(key)
        if info.is_dir:
            raise IsADirectoryError(errno.EISDIR, "a directory's metadata is set with set_dir_attrs", key)
        if expect is not None and info.version != expect:
            raise PreconditionFailed(f"{self.url}/{key} changed since it was opened")
        return info

    def set_dir_attrs(self, key: str, attrs: PosixAttrs) -> None:
        """The POSIX metadata of directory ``key``: local disks only; on object stores a
        directory's are in its parent's directory record (dirmeta.py)."""
        raise NotImplementedError(f"{self.protocol}:// directories keep their metadata in the directory record")

    # -- small whole objects (the directory record) --------------------------------------------
    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        """The whole of a small object and the version those bytes are. Here a stat, then a
        read pinned to its version; object stores answer both from one GET."""
        info = self.stat(key)
        if info.is_dir or info.version is None:
            raise IsADirectoryError(errno.EISDIR, "not an object", key)
        return self.read_range(key, 0, info.size, info.version) if info.size else b"", info.version

    def put_small(self, key: str, data: bytes, expect: ObjectVersion | None) -> ObjectVersion | None:
        """Write ``data`` as ``key`` in one request, conditional like upload (``expect``, None:
        unconditional), retried and counted like every request. Answers the new version."""
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return self.upload(tmp, key, expect)
        finally:
            os.unlink(tmp)

    # -- namespace -----------------------------------------------------------------------------
    def copy(self, src: str, dst: str, attrs: PosixAttrs | None = None,
             expect: ObjectVersion | None = None) -> Copied | None:
        """A server-side copy; what it copied, where the store says (None: it does not).

        ``attrs`` (where ``folds_attrs``): the copy carries them as its POSIX metadata (the
        complete new value; the object's other metadata as the source's), and is made only of
        the source's version ``expect``: else PreconditionFailed, and nothing was copied."""
        self._no_fold(attrs)
        self._call("copy", self.fs.cp_file, self.full(src), self.full(dst))
        return None

    def _no_fold(self, attrs: PosixAttrs | None) -> None:
        if attrs is not None:
            raise FsError(errno.ENOTSUP, f"{self.protocol}:// cannot give a copy new attributes")

    def delete(self, key: str) -> None:
        self._call("delete", self.fs.rm_file, self.full(key))

    def rename(self, src: str, dst: str, attrs: PosixAttrs | None = None,
               expect: ObjectVersion | None = None) -> list[Copied]:
        """Rename one file: a copy then a delete (local disks rename atomically). Answers the
        copy made, if the store said what it copied (the filesystem moves its readers).
        ``attrs``/``expect``: the copy carries new attributes (see copy); PreconditionFailed
        (the source is not ``expect``) leaves both names as they were."""
        copied = self.copy(src, dst) if attrs is None else self.copy(src, dst, attrs, expect)
        self.delete(src)
        return [copied] if copied is not None else []

    def _is_marker(self, raw: dict[str, Any], name: str) -> bool:
        """Whether a recursive listing's entry is a directory in its own right."""
        return raw.get("type") == "directory"

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
            marker = self._is_marker(raw, str(raw.get("name", path)))
            if marker or raw.get("type") == "directory":
                if rel not in dirs and rel != key:
                    dirs.append(rel)
                if marker and rel not in explicit:
                    explicit.append(rel)
            elif rel != key:
                files.append(rel)
        return files, dirs, explicit

    def rename_tree(self, src: str, dst: str) -> list[Copied]:
        """Move directory ``src`` and everything under it to ``dst``. Not atomic here: every
        object is copied, then the originals are deleted (documented); local disks override.
        Answers the copies whose store said what they copied."""
        files, dirs, explicit = self.walk(src)
        for f in files:  # a name the store cannot hold fails the rename before anything moved
            self.check_key(dst + f[len(src):])

        def make(d: str) -> None:
            try:
                self.make_dir(dst + d[len(src):])
            except FileExistsError:
                pass  # a rename left midway, finished now (write/renames.py): made the first time

        # Each step's requests at once (a round trip each, not one per object), each step whole
        # before the next: every copy is made before the first delete.
        each_at_once(make, sorted(explicit))  # implicit directories come along with their objects
        copies = each_at_once(lambda f: self.copy(f, dst + f[len(src):]), files)
        each_at_once(self.delete, files)
        # Every directory, implicit ones too (some stores, SeaweedFS, keep empty folders): the
        # deepest first, as a folder with folders in it is not empty.
        by_depth: dict[int, list[str]] = {}
        for d in set(dirs) | {src}:
            by_depth.setdefault(d.count("/"), []).append(d)
        for depth in sorted(by_depth, reverse=True):
            each_at_once(self.remove_dir, sorted(by_depth[depth]))
        return [c for c in copies if c is not None]

    def make_dir(self, key: str) -> None:
        self._call("mkdir", self.fs.mkdir, self.full(key), create_parents=False)

    def remove_dir(self, key: str) -> None:
        """Remove an (empty) directory: the real one, the pseudo-dir, or the marker object."""
        try:
            self._call("rmdir", self.fs.rmdir, self.full(key))
        except FileNotFoundError:
            pass  # an implicit directory: nothing to delete


def backend_class(protocol: str) -> type[Remote]:
    """The backend registered for ``protocol``; the generic one for any other fsspec protocol."""
    return _BACKENDS.get(protocol) or _BACKENDS[""]


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


def _run(loop: asyncio.AbstractEventLoop, coro: Any, timeout: float | None = None) -> Any:
    """Run a coroutine on fsspec's event loop from a worker thread (the S3 and GCS sessions)."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def is_precondition_failure(exc: BaseException) -> bool:
    """HTTP 412: botocore's answer (s3fs turns it into EINVAL, the response is in the cause
    chain) or an error that carries the status itself."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        if getattr(current, "status", None) == PRECONDITION_STATUS:
            return True
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == PRECONDITION_STATUS:
                return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


# S3 error codes that no retry changes, besides errors.FINAL_ERRNOS. Checked before the cause
# chain, which may hold a botocore ClientError (whose class name is also aiohttp's transient one).
FINAL_CODES = frozenset({"KeyTooLongError", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                         "AllAccessDisabled", "NoSuchBucket", "InvalidBucketName"})


def is_final(exc: BaseException) -> bool:
    """An answer that retrying can never change (a key too long or not UTF-8, access denied, the
    bucket gone): errors.is_final, or an S3 error code saying so anywhere in its chain."""
    if errors_is_final(exc):
        return True
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in FINAL_CODES:
            return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


def is_transient(exc: BaseException) -> bool:
    """True for failures that may pass on retry; never for answers ('not found', 'denied')."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError, UsageError, StaleVersionError)):
        return False  # (a StaleVersionError carries the store's 412 in its context: an answer)
    if is_final(exc):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    for cls in type(exc).__mro__:
        if cls.__name__ in _TRANSIENT_NAMES:
            return True
    status = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(status, int) and status in TRANSIENT_STATUS:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in TRANSIENT_STATUS or response.get("Error", {}).get("Code") in ("SlowDown", "Throttling"):
            return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)
