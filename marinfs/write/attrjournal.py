"""Attributes set on a committed file and not sent yet: their journals, and their replay at start.

``core/deferred.py`` holds back a moment the attributes set by path on a file this node has just
committed (rsync sets its temporary file's times and mode, then renames it: the rename's copy
carries them). While they wait, ``attrs-<id>.json`` in the staging directory says what they are:
the remote, the key, the version they apply to and the attributes. It goes once they are sent
(or folded into a copy, or the file replaced or removed here). A daemon killed meanwhile leaves
it; the next start applies each one of its remote (a metadata-only update conditional on that
version), after the staged commits are replayed. An object that is no longer that version, or
gone, is left as it is: the attributes were set on bytes nobody has any more (the journal goes).
One that cannot be sent now (the store down) stays for the running daemon to send.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from marinfs.errors import PreconditionFailed
from marinfs.objects import ObjectVersion, PosixAttrs
from marinfs.remote import Remote
from marinfs.write.commit import describe
from marinfs.write.staging import attrs_from_json, attrs_to_json, write_journal

log = logging.getLogger(__name__)
PREFIX, SUFFIX = "attrs-", ".json"


def write(staging_dir: Path, remote_url: str, key: str, version: ObjectVersion, attrs: PosixAttrs,
          path: str | None = None) -> str:
    """Journal ``attrs`` for ``key`` at ``version`` (``path``: rewrite that journal); answers its path."""
    if path is None:
        staging_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, path = tempfile.mkstemp(prefix=PREFIX, suffix=SUFFIX, dir=staging_dir)  # a unique name, 0600
        os.close(fd)
    try:
        write_journal(path, {"remote": remote_url, "key": key, "version": str(version),
                             "attrs": attrs_to_json(attrs)})
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise
    return path


def drop(path: str) -> None:
    Path(path).unlink(missing_ok=True)


@dataclass(frozen=True)
class Kept:
    """A journal of attributes not sent."""

    path: str
    key: str
    version: ObjectVersion
    attrs: PosixAttrs


def journals(staging_dir: Path, remote: Remote) -> Iterator[Kept]:
    """The journals of ``remote`` in ``staging_dir`` (an unreadable one is logged and left)."""
    if not staging_dir.is_dir():
        return
    for path in sorted(staging_dir.glob(PREFIX + "*" + SUFFIX)):
        try:
            entry = json.loads(path.read_text())
            if entry.get("remote") != remote.url:
                continue
            attrs = attrs_from_json(entry["attrs"]) or PosixAttrs()
            kept = Kept(str(path), entry["key"], ObjectVersion.parse(entry["version"]), attrs)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("unreadable attributes journal %s (%s); left in place", path, exc)
            continue
        yield kept


def replay(staging_dir: Path, remote: Remote) -> list[Kept]:
    """Send what a previous daemon journaled and never sent; answers those that could not be
    sent now (kept: the caller sends them later)."""
    left = []
    for kept in journals(staging_dir, remote):
        try:
            remote.set_attrs(kept.key, kept.attrs, kept.version)
        except (PreconditionFailed, FileNotFoundError, IsADirectoryError):
            log.info("attributes set on %s by an earlier daemon were not applied: the object changed or went "
                     "since", kept.key)
        except Exception as exc:  # noqa: BLE001 - the store down, say: sent later
            log.warning("attributes set on %s by an earlier daemon cannot be sent now (%s); tried again",
                        kept.key, describe(exc))
            left.append(kept)
            continue
        else:
            log.info("applied the attributes an earlier daemon set on %s and had not sent", kept.key)
        drop(kept.path)
    return left
