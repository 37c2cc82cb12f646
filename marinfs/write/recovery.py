"""Commit what a previous daemon staged but never committed (crash, kill, failed upload).

Every staged file with uncommitted bytes has a journal beside it (see staging.py): the remote,
the key, the version the writer started from, and the POSIX attributes set on it (journals
written before those existed have none: the file is committed without). At start (and periodically for failed
commits) each journal of this remote is replayed through marinfs.write.commit, the same rule as a
close: if the object is still at that base version, the bytes are committed to the key; if
someone else changed it meanwhile, they are committed next to it as
``KEY.marinfs-conflict-<UTC time>-<id>`` and the other writer's object is left alone. Nothing is
deleted before the remote has the bytes. Failures are returned, not logged: the caller knows
whether it has reported them already.

A failure no retry can change (errors.FINAL_ERRNOS: a key the store cannot hold, access denied)
is noted in the journal (``final``). Such a journal is not replayed again: its bytes stay on
disk and are returned as a failure not tried; only at a daemon's start is a final access
refusal tried once more (credentials may have been fixed meanwhile).

Before a replay, the upload sessions the journal names (``uploads``: S3 multipart uploads its
daemon opened and did not see end, because it was killed or the store was down) are aborted:
an incomplete multipart upload is kept, and billed, until someone does. One that cannot be
aborted yet (the store down) fails the replay; it is tried again with it.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from marinfs import interrupts
from marinfs.write.commit import commit_or_conflict, conflict_name, describe, is_permanent
from marinfs.errors import CURABLE_ERRNOS, final_errno
from marinfs.objects import ObjectVersion, PosixAttrs
from marinfs.remote import Remote
from marinfs.threadnames import name_current
from marinfs.write.staging import JOURNAL_SUFFIX, attrs_from_json, mark_final, note_upload_in_journal

__all__ = ["Recovered", "conflict_name", "recover"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovered:
    key: str
    staged: str  # the staging file that held the bytes
    committed_as: str | None  # None when the commit failed (bytes still kept)
    conflict: bool = False
    error: str | None = None  # why the commit failed (one line)
    permanent: bool = False  # the failure will not pass by retrying (see marinfs.write.commit)
    final: int | None = None  # its errno when no retry can change it (errors.FINAL_ERRNOS)
    tried: bool = True  # False: a final failure left alone this time (nothing was sent)


# Replays at once: a start that finds many kept files (a daemon SIGKILLed with write-back's
# uploads pending) waits for them before it mounts, and one round trip after the other (1,000
# at 50 ms) outlasted `mount`'s 60 s. As many as write-back's uploads by default.
WORKERS = 16


def recover(staging_dir: Path, remote: Remote, skip: frozenset[str] = frozenset(),
            at_start: bool = False, workers: int = WORKERS) -> list[Recovered]:
    """Replay every journal of ``remote`` in ``staging_dir`` whose data file is not in ``skip``
    (files still open in this daemon), but those marked final (``at_start``: but those marked
    final for a bad name, CURABLE_ERRNOS being tried once more). Up to ``workers`` keys at once;
    the journals of one key one after the other, in the order of their names (the first may
    replace the object, the next then meets it and goes beside it). Answers in journal order."""
    results: list[Recovered | None] = []
    replays: dict[str, list[tuple[int, Path, dict, Path, PosixAttrs | None]]] = {}  # key -> its journals
    if not staging_dir.is_dir():
        return []
    for journal in sorted(staging_dir.glob("*" + JOURNAL_SUFFIX)):
        try:
            text = journal.read_text()
            if not text.strip():
                continue  # a spare's, or a file's never written: nothing to commit (write/spares.py)
            entry = json.loads(text)
            data = staging_dir / entry["data"]
            key = entry["key"]
            attrs = attrs_from_json(entry.get("attrs"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("unreadable journal %s (%s); left in place", journal, exc)
            continue
        if entry.get("remote") != remote.url or str(data) in skip:
            continue
        if not data.exists():
            journal.unlink(missing_ok=True)
            continue
        final = entry.get("final")
        if isinstance(final, dict) and not (at_start and final.get("errno") in CURABLE_ERRNOS):
            code = final.get("errno")
            results.append(Recovered(key, str(data), None, error=str(final.get("error") or ""), permanent=True,
                                     final=code if isinstance(code, int) else errno.EIO, tried=False))
            continue
        replays.setdefault(key, []).append((len(results), journal, entry, data, attrs))
        results.append(None)

    def replay_key(jobs: list[tuple[int, Path, dict, Path, PosixAttrs | None]]) -> None:
        for index, journal, entry, data, attrs in jobs:
            results[index] = _replay_journal(journal, entry, data, remote, attrs)

    groups = list(replays.values())
    if len(groups) <= 1 or workers <= 1:
        for jobs in groups:
            replay_key(jobs)
    else:
        with cf.ThreadPoolExecutor(min(workers, len(groups)), thread_name_prefix="marinfs-recover",
                                   initializer=name_current) as pool:
            for done in [pool.submit(replay_key, jobs) for jobs in groups]:
                done.result()
    return [r for r in results if r is not None]


def _replay_journal(journal: Path, entry: dict, data: Path, remote: Remote,
                    attrs: PosixAttrs | None) -> Recovered:
    """Abort the upload sessions ``entry`` (the journal's content) names, then commit its bytes."""
    key, base = entry["key"], entry.get("base_version")
    try:
        _abort_uploads(journal, entry, remote)
    except Exception as exc:  # noqa: BLE001 - the store is down, say: replayed with it later
        return Recovered(key, str(data), None, error=describe(exc), permanent=is_permanent(exc))
    with interrupts.call(key):  # (`marinfs status`: a commit in progress, its bytes sent)
        return _replay(journal, data, key, base, remote, attrs)


def _abort_uploads(journal: Path, entry: dict, remote: Remote) -> None:
    """Abort every upload session ``entry`` (the journal's content) names, then forget them in
    the journal; raises (the rest kept) if the store cannot be asked."""
    uploads = entry.get("uploads")
    if not isinstance(uploads, dict) or not uploads:
        return
    for record in list(uploads.values()):
        remote.abort_upload(record)
        log.info("aborted the upload %s of %s left by an earlier daemon", record.get("id"), record.get("key"))
        note_upload_in_journal(str(journal), record, False)


def _replay(journal: Path, data: Path, key: str, base: str | None, remote: Remote,
            attrs: PosixAttrs | None = None) -> Recovered:
    def upload(k: str, expect: ObjectVersion) -> ObjectVersion | None:
        if attrs is None or attrs.empty:  # (as before attributes existed)
            return remote.upload(str(data), k, expect=expect)
        return remote.upload(str(data), k, expect=expect, attrs=attrs)

    try:
        # Replace exactly the version the writer started from (None: it did not exist).
        done = commit_or_conflict(upload, key, ObjectVersion.parse(base) if base is not None else None, data)
    except Exception as exc:  # noqa: BLE001 - reported by the caller; the bytes stay for the next attempt
        code = final_errno(exc)
        if code is not None:
            mark_final(str(journal), describe(exc), code)
        return Recovered(key, str(data), None, error=describe(exc), permanent=is_permanent(exc), final=code)
    journal.unlink(missing_ok=True)
    data.unlink(missing_ok=True)
    if not done.conflict:
        log.info("recovered %s: committed the bytes a failed or interrupted commit had kept", key)
    return Recovered(key, str(data), done.committed_as, conflict=done.conflict)
