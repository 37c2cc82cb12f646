"""PosixAttrs <-> the object metadata other tools read and write (see docs/architecture.md,
"Persisted POSIX metadata"); no backend is imported here, so every conversion is unit-tested.

S3 (user metadata, keys without ``x-amz-meta-``, as boto3's ``Metadata``) is written the way
s3fs-fuse writes it: ``mode`` the decimal ``st_mode`` with its file type, ``uid``/``gid``
decimal, ``mtime`` seconds with 9 decimals (rclone reads the fraction, s3fs-fuse the integer),
``xattr`` percent-encoded JSON of base64 values. GCS (custom metadata) as gcsfuse and gsutil
write it: ``gcsfuse_mtime`` (RFC 3339, nanoseconds), ``goog-reserved-file-mtime`` (seconds),
``goog-reserved-posix-mode`` (octal), ``-uid``, ``-gid``; ``xattr`` as on S3. Reading also
takes rclone's ``mtime`` (float seconds or RFC 3339), octal ``mode``, ``uid``, ``gid``.

Only fields that are set are written. Reading never raises: a value no tool could have meant
is ignored (logged at debug level), so one odd object never makes a directory unreadable.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import json
import logging
import re
import stat
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from urllib.parse import quote, unquote

from marinfs.objects import PosixAttrs

log = logging.getLogger(__name__)

NS = 1_000_000_000
MAX_ID = (1 << 32) - 1
XATTR_PREFIX = "user."  # the only namespace PosixAttrs carries

# -- keys ------------------------------------------------------------------------------------
S3_MODE, S3_UID, S3_GID, S3_MTIME, XATTR = "mode", "uid", "gid", "mtime", "xattr"
GCSFUSE_MTIME = "gcsfuse_mtime"
GSUTIL_MTIME = "goog-reserved-file-mtime"
GSUTIL_MODE = "goog-reserved-posix-mode"
GSUTIL_UID = "goog-reserved-posix-uid"
GSUTIL_GID = "goog-reserved-posix-gid"
RCLONE_MTIME, RCLONE_MODE, RCLONE_UID, RCLONE_GID = "mtime", "mode", "uid", "gid"

S3_KEYS = frozenset({S3_MODE, S3_UID, S3_GID, S3_MTIME, XATTR})
GCS_WRITTEN = frozenset({GCSFUSE_MTIME, GSUTIL_MTIME, GSUTIL_MODE, GSUTIL_UID, GSUTIL_GID, XATTR})
GCS_RCLONE = frozenset({RCLONE_MTIME, RCLONE_MODE, RCLONE_UID, RCLONE_GID})
GCS_KEYS = GCS_WRITTEN | GCS_RCLONE

_FILE_TYPES = frozenset({stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR,
                         stat.S_IFBLK})


def is_ours(key: str, store: str) -> bool:
    """Whether metadata ``key`` holds POSIX metadata we read (``store``: "s3" or "gcs"), so a
    metadata REPLACE rewrites it; every other key (``gcsfuse_symlink_target``, a tool's own
    ``atime``/``ctime``, anything a user put) is kept as it was."""
    return key.lower() in (S3_KEYS if store == "s3" else GCS_KEYS)


def foreign(metadata: Mapping[str, str] | None, store: str) -> dict[str, str]:
    """``metadata`` without the keys that are ours: what a REPLACE must carry over unchanged."""
    return {k: v for k, v in (metadata or {}).items() if not is_ours(k, store)}


# -- xattrs ----------------------------------------------------------------------------------
def encode_xattrs(items: Mapping[str, bytes]) -> str:
    """s3fs-fuse's ``xattr`` value: ``{"name":"<base64>",...}`` percent-encoded with only
    ``A-Za-z0-9.-_~`` left as they are (its ``urlEncodeGeneral``). Names are JSON strings, which
    for every name s3fs-fuse itself can store is the very text it writes."""
    text = json.dumps({name: base64.b64encode(value).decode("ascii") for name, value in sorted(items.items())},
                      separators=(",", ":"), ensure_ascii=False)
    return quote(text, safe="")


def decode_xattrs(value: str | None) -> dict[str, bytes]:
    """Every name in an ``xattr`` value (all namespaces; s3fs-fuse also keeps ACLs there).
    JSON first; else s3fs-fuse's own reading (split at commas, then at the first colon), which
    accepts what it writes for names JSON would have escaped."""
    if not value:
        return {}
    text = unquote(value, errors="surrogateescape")
    try:
        raw = json.loads(text)
        pairs = list(raw.items()) if isinstance(raw, dict) else None
    except ValueError:
        pairs = None
    if pairs is None:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            log.debug("ignoring an xattr value that is not JSON: %.80r", value)
            return {}
        pairs = []
        for pair in text[start + 1:end].split(","):
            name, sep, encoded = pair.partition(":")
            if sep:
                pairs.append((name.strip().strip('"'), encoded.strip().strip('"')))
    out: dict[str, bytes] = {}
    for name, encoded in pairs:
        if not isinstance(name, str) or not isinstance(encoded, str) or not name:
            continue
        try:
            out[name] = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            log.debug("ignoring xattr %r: its value is not base64", name)
    return out


def _user_xattrs(value: str | None) -> tuple[tuple[str, bytes], ...]:
    return tuple(sorted((k, v) for k, v in decode_xattrs(value).items() if k.startswith(XATTR_PREFIX)))


def _xattr_value(attrs: PosixAttrs, previous: str | None = None) -> str | None:
    """The ``xattr`` value for ``attrs``, keeping the names outside ``user.*`` that
    ``previous`` (the value stored now) holds: s3fs-fuse's ACLs are not ours to drop."""
    items = {k: v for k, v in decode_xattrs(previous).items() if not k.startswith(XATTR_PREFIX)}
    items.update(attrs.xattrs)
    return encode_xattrs(items) if items else None


# -- times -----------------------------------------------------------------------------------
_RFC3339 = re.compile(r"(\d{4})-(\d\d)-(\d\d)[Tt ](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(Z|z|[+-]\d\d:?\d\d)?")


def seconds_text(mtime_ns: int) -> str:
    """``1577923200.000000000``: seconds with 9 decimals (rclone's and s3fs-fuse's S3 ``mtime``)."""
    sign = "-" if mtime_ns < 0 else ""
    whole, frac = divmod(abs(mtime_ns), NS)
    return f"{sign}{whole}.{frac:09d}"


def rfc3339(mtime_ns: int) -> str:
    """UTC, as Go's ``time.RFC3339Nano`` writes it (gcsfuse, rclone): trailing zeros of the
    fraction dropped, no fraction at all for whole seconds."""
    whole, frac = divmod(mtime_ns, NS)
    when = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(seconds=whole)
    fraction = f".{frac:09d}".rstrip("0").rstrip(".")
    return when.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"


def parse_mtime(value: str | None) -> int | None:
    """Nanoseconds from seconds (integer or fractional: s3fs-fuse, rclone on S3, gsutil) or
    RFC 3339 (gcsfuse, rclone on GCS and with --metadata); None for anything else."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = Decimal(text)
        if seconds.is_finite() and abs(seconds) < 1 << 40:
            return int(seconds * NS)
    except InvalidOperation:
        pass
    m = _RFC3339.fullmatch(text)
    if m is None:
        log.debug("ignoring an mtime that is neither seconds nor RFC 3339: %.80r", value)
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    zone = m.group(8) or "Z"
    try:
        if zone in "Zz":
            tz = _dt.timezone.utc
        else:
            digits = zone[1:].replace(":", "")
            delta = _dt.timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
            tz = _dt.timezone(delta if zone[0] == "+" else -delta)
        when = _dt.datetime(year, month, day, hour, minute, min(second, 59), tzinfo=tz)
    except ValueError:
        log.debug("ignoring an mtime that is no date: %.80r", value)
        return None
    epoch = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
    delta = when - epoch
    frac = int(((m.group(7) or "") + "000000000")[:9])
    return (delta.days * 86400 + delta.seconds) * NS + frac


# -- modes and ids ---------------------------------------------------------------------------
def parse_mode(value: str | None, decimal: bool = True) -> int | None:
    """Permission bits (``& 0o7777``) of a ``mode``: s3fs-fuse's decimal ``st_mode`` when the
    text is one (no bits above the file type, and the type is a real one), else octal
    (rclone's ``100644``, gsutil's ``755``); None for anything else. ``decimal=False`` where
    only octal is ever written (GCS: ``4750`` would read as a decimal FIFO)."""
    if value is None:
        return None
    text = value.strip()
    if decimal and text.isdigit():
        number = int(text)
        if number <= 0o177777 and stat.S_IFMT(number) in _FILE_TYPES:
            return number & 0o7777
    if text and all(c in "01234567" for c in text) and len(text) <= 7:
        return int(text, 8) & 0o7777
    log.debug("ignoring a mode that is neither s3fs's decimal nor octal: %.80r", value)
    return None


def parse_id(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if text.isdigit() and int(text) <= MAX_ID:
        return int(text)
    log.debug("ignoring a uid/gid that is no number: %.80r", value)
    return None


def _lower(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Keys case-insensitively (HTTP headers; S3 servers send them lower- or title-case)."""
    out: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if isinstance(key, str) and isinstance(value, str):
            out.setdefault(key.lower(), value)
    return out


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


# -- S3 ----------------------------------------------------------------------------------------
def to_s3(attrs: PosixAttrs, is_dir: bool = False, previous: Mapping[str, str] | None = None) -> dict[str, str]:
    """S3 user metadata for ``attrs`` (only the set fields). ``previous``: the object's
    metadata now, whose ``xattr`` names outside ``user.*`` are kept."""
    out: dict[str, str] = {}
    if attrs.mode is not None:
        out[S3_MODE] = str((stat.S_IFDIR if is_dir else stat.S_IFREG) | attrs.mode)
    if attrs.uid is not None:
        out[S3_UID] = str(attrs.uid)
    if attrs.gid is not None:
        out[S3_GID] = str(attrs.gid)
    if attrs.mtime_ns is not None:
        out[S3_MTIME] = seconds_text(attrs.mtime_ns)
    xattr = _xattr_value(attrs, _lower(previous).get(XATTR))
    if xattr is not None:
        out[XATTR] = xattr
    return out


def from_s3(metadata: Mapping[str, str] | None) -> PosixAttrs:
    """What S3 user metadata says (PosixAttrs() when nothing of ours is there)."""
    meta = _lower(metadata)
    return PosixAttrs(mode=parse_mode(meta.get(S3_MODE)), uid=parse_id(meta.get(S3_UID)),
                      gid=parse_id(meta.get(S3_GID)), mtime_ns=parse_mtime(meta.get(S3_MTIME)),
                      xattrs=_user_xattrs(meta.get(XATTR)))


def s3_replace(metadata: Mapping[str, str] | None, attrs: PosixAttrs, is_dir: bool = False) -> dict[str, str]:
    """The whole user metadata a ``MetadataDirective=REPLACE`` copy sends: the object's other
    keys as they are, ours rewritten from ``attrs``."""
    return {**foreign(metadata, "s3"), **to_s3(attrs, is_dir, metadata)}


# -- GCS -------------------------------------------------------------------------------------
def to_gcs(attrs: PosixAttrs, previous: Mapping[str, str] | None = None) -> dict[str, str]:
    """GCS custom metadata for ``attrs`` (only the set fields), as gcsfuse and gsutil write it."""
    out: dict[str, str] = {}
    if attrs.mtime_ns is not None:
        out[GCSFUSE_MTIME] = rfc3339(attrs.mtime_ns)
        out[GSUTIL_MTIME] = str(attrs.mtime_ns // NS)
    if attrs.mode is not None:
        out[GSUTIL_MODE] = f"{attrs.mode:o}"
    if attrs.uid is not None:
        out[GSUTIL_UID] = str(attrs.uid)
    if attrs.gid is not None:
        out[GSUTIL_GID] = str(attrs.gid)
    xattr = _xattr_value(attrs, _lower(previous).get(XATTR))
    if xattr is not None:
        out[XATTR] = xattr
    return out


def from_gcs(metadata: Mapping[str, str] | None) -> PosixAttrs:
    """What GCS custom metadata says: gcsfuse's and gsutil's keys first, then rclone's (also
    s3fs-fuse's, which writes the same names through GCS's S3 API)."""
    meta = _lower(metadata)
    gcsfuse = parse_mtime(meta.get(GCSFUSE_MTIME))
    return PosixAttrs(
        # rclone's ``mode`` (octal with its type), or s3fs-fuse's decimal through GCS's S3 API
        mode=_first(parse_mode(meta.get(GSUTIL_MODE), decimal=False), parse_mode(meta.get(RCLONE_MODE))),
        uid=_first(parse_id(meta.get(GSUTIL_UID)), parse_id(meta.get(RCLONE_UID))),
        gid=_first(parse_id(meta.get(GSUTIL_GID)), parse_id(meta.get(RCLONE_GID))),
        mtime_ns=_first(gcsfuse, parse_mtime(meta.get(GSUTIL_MTIME)), parse_mtime(meta.get(RCLONE_MTIME))),
        xattrs=_user_xattrs(meta.get(XATTR)))


def gcs_replace(metadata: Mapping[str, str] | None, attrs: PosixAttrs) -> dict[str, str]:
    """The whole custom metadata of a copy that carries ``attrs`` (a rewrite whose body gives
    the destination's metadata): the object's other keys as they are, ours (and rclone's that
    are there) as :func:`gcs_patch` leaves them."""
    patch = gcs_patch(metadata, attrs)
    kept = {k: v for k, v in (metadata or {}).items() if k not in patch}
    return {**kept, **{k: v for k, v in patch.items() if v is not None}}


def gcs_patch(metadata: Mapping[str, str] | None, attrs: PosixAttrs) -> dict[str, str | None]:
    """The ``metadata`` of a GCS PATCH that makes the object's POSIX metadata ``attrs``: our
    keys set, ours now unset given None (a PATCH removes a key given null), rclone's keys that
    are there rewritten in rclone's format or removed, so that no stale value of another
    tool's shows through; every other key left out (a PATCH keeps it)."""
    new = to_gcs(attrs, metadata)
    present = {k.lower(): k for k in (metadata or {})}
    patch: dict[str, str | None] = dict(new)
    for key in GCS_WRITTEN:
        if key not in new and key in present:
            patch[present[key]] = None
    rclone = {RCLONE_MTIME: None if attrs.mtime_ns is None else rfc3339(attrs.mtime_ns),
              RCLONE_MODE: None if attrs.mode is None else f"{stat.S_IFREG | attrs.mode:o}",
              RCLONE_UID: None if attrs.uid is None else str(attrs.uid),
              RCLONE_GID: None if attrs.gid is None else str(attrs.gid)}
    for key, value in rclone.items():
        if key in present:
            patch[present[key]] = value
    return patch
