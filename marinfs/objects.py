"""Value types for objects and their versions; no backend is imported here.

A version's string form (``str(version)``) is what journals (staging.py) and the chunk cache
(chunkcache.py, which hashes it into file names) keep on disk, so it stays byte-identical to the
strings earlier releases wrote: ``e<ETag>`` (S3), ``g<generation>`` (GCS, and memory://),
``m<mtime_ns>:<size>[:i<inode>:c<ctime_ns>]`` (local disks, memory, other fsspec backends),
``-`` (the key must not exist) and ``unversioned-<id>`` (a handle on a store that gave none).
:meth:`ObjectVersion.parse` reads each of them back to an equal value.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace

_PREFIXES = {"e": "etag", "g": "generation", "m": "mtime"}
_UNVERSIONED = "unversioned-"


@dataclass(frozen=True)
class ObjectVersion:
    """One version of one object: ``kind`` says who issued ``value`` and so how a store checks it.

    Kinds: ``etag`` (S3), ``generation`` (GCS; the memory backend's counter), ``mtime`` (mtime and size, plus inode and change
    time on local disks), ``absent`` (no object: a commit that must create it), ``unversioned``
    (a stand-in that matches nothing else), ``opaque`` (a string from elsewhere, kept verbatim).
    """

    kind: str
    value: str = ""

    @classmethod
    def parse(cls, token: str) -> ObjectVersion:
        """The version whose ``str`` is ``token`` (the inverse of ``__str__``)."""
        if token == "-":
            return ABSENT
        if token.startswith(_UNVERSIONED):
            return cls("unversioned", token[len(_UNVERSIONED):])
        kind = _PREFIXES.get(token[:1])
        return cls(kind, token[1:]) if kind else cls("opaque", token)

    @classmethod
    def etag(cls, etag: str) -> ObjectVersion:
        """An S3 ETag, with or without the quotes S3 sends around it."""
        return cls("etag", etag.strip('"'))

    @classmethod
    def local(cls, mtime_ns: int, size: int, ino: int | None = None, ctime_ns: int | None = None) -> ObjectVersion:
        """A version made of what a file system tells: a rewrite can keep size and mtime
        (``cp -p``, ``rsync -a``, a clock that jumped back) but not its inode and ctime too."""
        value = f"{mtime_ns}:{size}"
        if ino and ctime_ns is not None:
            value += f":i{ino}:c{ctime_ns}"
        return cls("mtime", value)

    def same_file(self, other: ObjectVersion) -> bool:
        """Both are one file of a local disk with the same inode, size and modification time,
        told apart by their change time only: the file renamed (rename(2) moves ctime on)."""
        if self.kind != "mtime" or other.kind != "mtime" or ":i" not in self.value:
            return False
        return self.value.split(":c", 1)[0] == other.value.split(":c", 1)[0]

    @classmethod
    def unversioned(cls, ident: int) -> ObjectVersion:
        return cls("unversioned", str(ident))

    def __str__(self) -> str:
        if self.kind == "absent":
            return "-"
        if self.kind == "unversioned":
            return _UNVERSIONED + self.value
        if self.kind == "opaque":
            return self.value
        prefix = {v: k for k, v in _PREFIXES.items()}.get(self.kind)
        if prefix is None:
            raise ValueError(f"unknown version kind {self.kind!r}")
        return prefix + self.value

    @property
    def absent(self) -> bool:
        return self.kind == "absent"

    def s3_precondition(self) -> dict[str, str]:
        """S3 API parameters (IfMatch, IfNoneMatch) that make a write replace exactly this version."""
        if self.kind == "absent":
            return {"IfNoneMatch": "*"}
        if self.kind == "etag":
            return {"IfMatch": f'"{self.value}"'}
        raise ValueError(f"not an S3 version: {self}")

    def gcs_precondition(self) -> dict[str, str]:
        """GCS query parameters that make a write replace exactly this version (0: no object)."""
        if self.kind == "absent":
            return {"ifGenerationMatch": "0"}
        if self.kind == "generation":
            return {"ifGenerationMatch": self.value}
        raise ValueError(f"not a GCS version: {self}")


ABSENT = ObjectVersion("absent")  # an expected version meaning "the key must not exist yet"


def s3_match(expect: ObjectVersion | None) -> dict[str, str]:
    """S3 API parameters for a write that replaces ``expect`` (None: anything)."""
    return {} if expect is None else expect.s3_precondition()


def gcs_match(expect: ObjectVersion | None) -> dict[str, str]:
    """Query parameters for a GCS write that replaces ``expect`` (None: anything)."""
    return {} if expect is None else expect.gcs_precondition()


@dataclass(frozen=True)
class Copied:
    """A server-side copy made by a rename: ``dst`` holds ``src`` as its version ``new``.
    ``old`` is the source's version the copy was pinned to (None: not pinned, so which of the
    source's versions it copied is unknown); read handles of exactly that version may follow
    their bytes to ``dst``."""

    src: str
    dst: str
    old: ObjectVersion | None
    new: ObjectVersion | None


@dataclass(frozen=True)
class ObjectRef:
    """One version of one object, as a handle pinned it at open: what reads fetch and what
    cached chunks are keyed by (with the URL, so two mounts never share an entry)."""

    url: str  # the remote URL of the object, for cache keys
    key: str  # the key relative to the mounted prefix, for fetches
    version: ObjectVersion | str  # (a str only from callers outside the remote: tests, fakes)
    size: int

    @functools.cached_property
    def cache_id(self) -> str:
        """The name this version's cached chunks carry (chunkcache.py), made once per handle."""
        return cache_id(self.url, str(self.version))


@functools.lru_cache(maxsize=4096)
def cache_id(url: str, version: str) -> str:
    """The name of a version's chunk files: a SHA-256 of the URL and of the version's string
    form, the one earlier releases wrote, so a cache directory stays valid across upgrades. A
    pure function, kept (a SHA-256 and the string form cost 5 µs a call)."""
    return hashlib.sha256(f"{url}\0{version}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True)
class ObjectInfo:
    """What the remote says about one key. ``version`` changes whenever the content does."""

    name: str  # relative to the prefix, no leading '/'; "" is the prefix itself
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0
    version: ObjectVersion | None = None
    # A symbolic link: ``size`` is its target's length in bytes; ``target`` is the target text
    # when the stat or listing carried it (local disks, GCS metadata), None when it must be
    # read (the body of an S3 ``.rclonelink`` object).
    link: bool = False
    target: str | None = None
    # The persisted POSIX metadata (mode, owner, mtime, user xattrs). None: this answer did not
    # carry it (an S3 listing before its directory record is applied); PosixAttrs(): it did, and
    # nothing is set (the mount's defaults show).
    posix: PosixAttrs | None = None

    def with_posix(self, posix: PosixAttrs | None) -> ObjectInfo:
        """This answer with ``posix`` in place: ``dataclasses.replace`` without its per-call
        field walk, which a listing of 2,000 entries paid 2,000 times (about 5 µs each)."""
        new = object.__new__(ObjectInfo)
        new.__dict__.update(self.__dict__)
        new.__dict__["posix"] = posix
        return new


@dataclass(frozen=True)
class PosixAttrs:
    """What chmod, chown, utimens and setxattr(user.*) stored for one file or directory.

    Only what a tool set is stored; a field left None shows the mount's default (its
    ``--file-mode``/``--dir-mode``, uid, gid; the object's own timestamp). ``mode`` is the
    permission bits with setuid/setgid/sticky (``& 0o7777``), never the file type. ``xattrs`` are
    ``user.*`` names and values, sorted by name, so equal attributes compare equal.
    """

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None
    xattrs: tuple[tuple[str, bytes], ...] = ()

    def __post_init__(self) -> None:
        if self.mode is not None and not 0 <= self.mode <= 0o7777:
            raise ValueError(f"mode {self.mode:o} is not permission bits")
        if list(self.xattrs) != sorted(dict(self.xattrs).items()):
            raise ValueError("xattrs must be unique and sorted by name")

    @property
    def empty(self) -> bool:
        return self == NO_ATTRS

    def with_xattr(self, name: str, value: bytes | None) -> PosixAttrs:
        """A copy with ``name`` set to ``value`` (None: removed)."""
        items = dict(self.xattrs)
        if value is None:
            items.pop(name, None)
        else:
            items[name] = value
        return replace(self, xattrs=tuple(sorted(items.items())))

    def xattr(self, name: str) -> bytes | None:
        return dict(self.xattrs).get(name)


NO_ATTRS = PosixAttrs()
