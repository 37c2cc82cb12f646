"""Directory renames on stores that copy every object: the intent journaled before the first
copy, finished by the next daemon if this one dies (or fails) midway.

A directory rename on an object store copies each object under the source, then deletes the
originals (``Remote.rename_tree``). A daemon killed in between left both trees, silently. So
``rename-<id>.json`` in the staging directory names the remote, the source and the target
before anything is copied, and goes once the rename is whole. At start, each one of this remote
is finished as the rename itself would have gone on, for the objects the journal names (the
source's files when the rename began): each one still under the source is moved (copied,
pinned to the object it copies, then deleted; one copied already and not yet deleted is copied
again, the same bytes). Anything made under the source since (a new tree of the same name) is
left where it is. One that cannot be
finished now (the store down) stays, and is reported (``marinfs status``) with what to do.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from marinfs.objects import Copied
from marinfs.remote import Remote
from marinfs.write.commit import describe
from marinfs.write.staging import write_journal

log = logging.getLogger(__name__)
PREFIX, SUFFIX = "rename-", ".json"


@dataclass(frozen=True)
class UnfinishedRename:
    """A directory rename whose journal stays: both trees may hold objects."""

    src: str
    dst: str
    journal: str
    error: str
    since: float

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "todo": (f"objects of {self.src!r} are in both {self.src!r} and {self.dst!r}; "
                                         "the next start of this mount finishes the move (remount to finish it "
                                         f"now), or delete {self.journal} to leave both trees as they are")}


def journaled_rename_tree(staging_dir: Path, remote: Remote, src: str, dst: str) -> list[Copied]:
    """``remote.rename_tree(src, dst)`` with its intent journaled first; the journal goes once
    it is done, and stays if it fails or the daemon dies (the next start finishes it). The same
    rename of one left midway goes on under its journal."""
    existing = journal_of(staging_dir, remote, src, dst)
    if existing is not None:
        path = str(existing)
    else:
        staging_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, path = tempfile.mkstemp(prefix=PREFIX, suffix=SUFFIX, dir=staging_dir)  # a unique name, 0600
        os.close(fd)
        files, _, explicit = remote.walk(src)  # what this rename moves: all a finish may move
        try:
            write_journal(path, {"remote": remote.url, "src": src, "dst": dst, "since": time.time(),
                                 "files": files, "dirs": explicit})
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise
    copies = remote.rename_tree(src, dst)  # (raises: the journal stays, the next start finishes it)
    Path(path).unlink(missing_ok=True)
    return copies


def journal_of(staging_dir: Path, remote: Remote, src: str, dst: str) -> Path | None:
    """The journal of an unfinished rename of ``src`` to ``dst`` on ``remote``, if any."""
    for path, entry in _journals(staging_dir):
        if entry.get("remote") == remote.url and entry.get("src") == src and entry.get("dst") == dst:
            return path
    return None


def _journals(staging_dir: Path) -> list[tuple[Path, dict]]:
    out = []
    if not staging_dir.is_dir():
        return out
    for path in sorted(staging_dir.glob(PREFIX + "*" + SUFFIX)):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            if path.stat().st_size == 0:  # made, never written: nothing was copied yet
                path.unlink(missing_ok=True)
            else:
                log.error("unreadable rename journal %s (%s); left in place", path, exc)
            continue
        if isinstance(entry, dict) and isinstance(entry.get("src"), str) and isinstance(entry.get("dst"), str):
            out.append((path, entry))
    return out


def finish_renames(staging_dir: Path, remote: Remote) -> list[UnfinishedRename]:
    """Finish every directory rename of ``remote`` an earlier daemon journaled and did not end;
    answers those that still cannot be finished (their journals stay)."""
    left = []
    for path, entry in _journals(staging_dir):
        if entry.get("remote") != remote.url:
            continue
        src, dst = entry["src"], entry["dst"]
        try:
            _finish(remote, src, dst, entry)
        except Exception as exc:  # noqa: BLE001 - reported; tried again at the next start
            error = describe(exc)
            log.error("a directory rename of %s to %s was interrupted and cannot be finished now (%s): "
                      "objects may be in both; the next start tries again", src, dst, error)
            left.append(UnfinishedRename(src, dst, str(path), error, float(entry.get("since") or 0.0)))
            continue
        path.unlink(missing_ok=True)
        log.warning("finished a directory rename of %s to %s that an earlier daemon left midway", src, dst)
    return left


def _finish(remote: Remote, src: str, dst: str, entry: dict) -> None:
    """Move what the journal names and is still under ``src`` to ``dst``; the source's
    directories go once nothing is left in them."""
    named = entry.get("files")
    if not isinstance(named, list):  # (a journal without the list: the whole tree, as the rename)
        remote.rename_tree(src, dst)
        return
    files, dirs, _ = remote.walk(src)
    for d in sorted(x for x in entry.get("dirs") or [] if isinstance(x, str)):
        try:
            remote.make_dir(dst + d[len(src):])
        except FileExistsError:
            pass
    for key in sorted(set(files) & set(named)):
        remote.rename(key, dst + key[len(src):])
    if not remote.walk(src)[0]:  # nothing of anyone's left under it
        for d in sorted(set(dirs) | {src}, reverse=True):
            remote.remove_dir(d)
