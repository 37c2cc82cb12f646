"""Which marinfs mounts are live, read from /proc/mounts, and the path <-> URL mapping."""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

from marinfs.errors import UsageError

FSTYPE = "fuse.marinfs"


@dataclass(frozen=True)
class MountEntry:
    remote: str
    mountpoint: str


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def live_mounts(proc_mounts: str = "/proc/mounts") -> list[MountEntry]:
    entries = []
    with open(proc_mounts, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == FSTYPE:
                entries.append(MountEntry(_unescape(fields[0]), _unescape(fields[1])))
    return entries


def _under(path: str, base: str) -> str | None:
    """The part of ``path`` below ``base`` ('' for base itself), or None if it is not below."""
    base = base.rstrip("/") or "/"
    if path == base:
        return ""
    prefix = base if base.endswith("/") else base + "/"
    return path[len(prefix):] if path.startswith(prefix) else None


def convert(arg: str, entries: list[MountEntry]) -> str:
    """A path under a mount -> the URL it stands for; a URL under a mounted prefix -> its path."""
    if "://" not in arg:
        path = os.path.abspath(arg)
        for entry in sorted(entries, key=lambda e: -len(e.mountpoint)):
            rest = _under(path, entry.mountpoint)
            if rest is not None:
                return f"{entry.remote}/{rest}" if rest else entry.remote
    if "://" in arg:
        # "." and ".." resolved as a path would be: s3://b/p/../q is not under s3://b/p.
        scheme, _, rest = arg.partition("://")
        url = f"{scheme}://{posixpath.normpath(rest).lstrip('/')}" if rest else arg
    else:
        url = os.path.abspath(arg)
    for entry in sorted(entries, key=lambda e: -len(e.remote)):
        rest = _under(url, entry.remote)
        if rest is not None:
            return os.path.join(entry.mountpoint, rest) if rest else entry.mountpoint
    raise UsageError(f"{arg} is not under any marinfs mount")
