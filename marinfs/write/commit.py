"""Committing staged bytes: the one no-blind-overwrite rule, and what a failed commit looks like.

A commit replaces exactly the version its writer started from (or creates the key if it did not
exist). If the remote holds anything else (HTTP 412), someone else changed the object: our bytes
go beside it under a new conflict name, created only if absent, and their object is left alone.
The open-file commit (fs.py) and the replay of journals (recovery.py) both go through
:func:`commit_or_conflict`, so they cannot disagree on that rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from marinfs.errors import CURABLE_ERRNOS, PreconditionFailed, is_final
from marinfs.objects import ABSENT, ObjectVersion

log = logging.getLogger(__name__)

# (key, expected version) -> the new version if the store answered one. The expected version is
# the writer's base, or ABSENT ("must not exist yet").
Upload = Callable[[str, ObjectVersion], ObjectVersion | None]


def conflict_name(key: str, staged: Path, now: float | None = None) -> str:
    """Where clashing bytes go. The staging file's own unique name is part of it: two kept
    commits of one key recovered in the same second (or after a clock jump) must not share it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return f"{key}.marinfs-conflict-{stamp}-{staged.name.removeprefix('staged-')}"


@dataclass(frozen=True)
class Committed:
    """Where the bytes went: ``key`` itself, or ``committed_as`` beside it after a conflict."""

    key: str
    committed_as: str
    version: ObjectVersion | None

    @property
    def conflict(self) -> bool:
        return self.committed_as != self.key


def commit_or_conflict(upload: Upload, key: str, base: ObjectVersion | None, staged: Path) -> Committed:
    """Commit to ``key`` expecting ``base`` (None: the key must not exist); on PreconditionFailed
    commit to a fresh conflict name expecting ABSENT, so not even a conflict copy is overwritten.
    Raises the upload's error (the conflict copy's, if that failed: the bytes stay staged)."""
    try:
        return Committed(key, key, upload(key, base if base is not None else ABSENT))
    except PreconditionFailed:
        pass
    target = conflict_name(key, staged)
    try:
        committed = Committed(key, target, upload(target, ABSENT))
    except Exception:
        log.error("%s changed on the remote since it was staged, and saving our bytes as %s failed; "
                  "they stay staged in %s", key, target, staged)
        raise
    log.warning("%s changed on the remote since it was staged; our bytes were committed as %s", key, target)
    return committed


def is_permanent(exc: BaseException) -> bool:
    """A commit failure that retrying will not cure by itself: a final one (errors.is_final: a
    key the store cannot hold, access denied), or the bucket or prefix gone (FileNotFoundError:
    someone may recreate it, so that one is still retried, quietly)."""
    return isinstance(exc, (PermissionError, FileNotFoundError)) or is_final(exc)


# When a failed commit is tried again (FailedCommit.retry): every --commit-retry-interval; for a
# final failure someone may cure (access denied), once when the next daemon starts; for a name
# the store can never hold, never (the bytes stay on disk for whoever wants them).
RETRY_INTERVAL, RETRY_NEXT_START, RETRY_NEVER = "every interval", "at the next start", "never"


def retry_of(code: int | None) -> str:
    """How a failed commit whose final errno is ``code`` (None: not final) is tried again."""
    if code is None:
        return RETRY_INTERVAL
    return RETRY_NEXT_START if code in CURABLE_ERRNOS else RETRY_NEVER


def describe(exc: BaseException) -> str:
    """One line for a log or `marinfs status`."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class FailedCommit:
    """Staged bytes that could not be committed yet: kept on disk and retried."""

    key: str
    staged: str  # the staging file that holds the bytes
    error: str = ""
    permanent: bool = False
    attempts: int = 1
    since: float = 0.0  # wall-clock time of the first failure
    retry: str = RETRY_INTERVAL  # when it is tried again (see retry_of)

    @property
    def final(self) -> bool:
        """Not tried again by this daemon: the error is one no retry changes."""
        return self.retry != RETRY_INTERVAL

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "final": self.final}
