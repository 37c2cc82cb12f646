"""Commit what a previous daemon staged but never committed (crash, kill, failed upload).

Every staged file with uncommitted bytes has a journal beside it (see writer.py): the remote,
the key, and the version the writer started from. At start (and periodically for failed
commits) each journal of this remote is replayed: if the object is still at that base version,
the bytes are committed to the key; if someone else changed it meanwhile, they are committed
next to it as ``KEY.marinfs-conflict-<UTC time>-<id>`` and the other writer's object is left alone.
Nothing is deleted before the remote has the bytes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from marinfs.errors import PreconditionFailed
from marinfs.objects import ABSENT, ObjectVersion
from marinfs.remote import Remote
from marinfs.writer import JOURNAL_SUFFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovered:
    key: str
    staged: str  # the staging file that held the bytes
    committed_as: str | None  # None when the commit failed (bytes still kept)
    conflict: bool = False
    error: str | None = None


def conflict_name(key: str, staged: Path, now: float | None = None) -> str:
    """Where clashing bytes go. The staging file's own unique name is part of it: two kept
    commits of one key recovered in the same second (or after a clock jump) must not share it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return f"{key}.marinfs-conflict-{stamp}-{staged.name.removeprefix('staged-')}"


def recover(staging_dir: Path, remote: Remote, skip: frozenset[str] = frozenset()) -> list[Recovered]:
    """Replay every journal of ``remote`` in ``staging_dir`` whose data file is not in ``skip``
    (files still open in this daemon)."""
    results = []
    if not staging_dir.is_dir():
        return results
    for journal in sorted(staging_dir.glob("*" + JOURNAL_SUFFIX)):
        try:
            entry = json.loads(journal.read_text())
            data = staging_dir / entry["data"]
            key, base = entry["key"], entry.get("base_version")
        except (OSError, ValueError, KeyError) as exc:
            log.error("unreadable journal %s (%s); left in place", journal, exc)
            continue
        if entry.get("remote") != remote.url or str(data) in skip:
            continue
        if not data.exists():
            journal.unlink(missing_ok=True)
            continue
        results.append(_replay(journal, data, key, base, remote))
    return results


def _replay(journal: Path, data: Path, key: str, base: str | None, remote: Remote) -> Recovered:
    target = key
    try:
        try:
            # Replace exactly the version the writer started from (None: it did not exist).
            remote.upload(str(data), key, expect=ObjectVersion.parse(base) if base is not None else ABSENT)
        except PreconditionFailed:
            target = conflict_name(key, data)
            remote.upload(str(data), target, expect=ABSENT)
    except Exception as exc:  # noqa: BLE001 - reported; the bytes stay for the next attempt
        log.error("recovering %s from %s failed: %s", key, data, exc)
        return Recovered(key, str(data), None, error=str(exc))
    journal.unlink(missing_ok=True)
    data.unlink(missing_ok=True)
    clash = target != key
    if clash:
        log.warning("%s changed since it was staged; the staged bytes were committed as %s", key, target)
    else:
        log.info("recovered %s: committed the bytes a previous run had staged", key)
    return Recovered(key, str(data), target, conflict=clash)
