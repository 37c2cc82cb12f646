"""`marinfs sync [PATH...]`: return once every file closed under PATH is in the bucket.

The barrier is a read of the ``user.marinfs.sync`` attribute of PATH through the mount: the
daemon answers it once what was closed before is uploaded (write-back), or EIO if a file's
bytes are kept after a failed upload. No channel of our own: the mount is the channel.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

from marinfs.app import status
from marinfs.app.mounts import live_mounts
from marinfs.errors import MarinfsError, UsageError

XATTR_SYNC = "user.marinfs.sync"  # (core/attributes.py's name; app/ reads it through the mount)
PROGRESS_EVERY = 2.0  # seconds between progress lines
PUBLISHED_WITHIN = 3.0  # the daemon publishes its status every 2 s


def sync(paths: list[str], quiet: bool = False) -> str:
    """Sync each path (default: every marinfs mount); the summary line."""
    mounts = {m.mountpoint: m for m in live_mounts()}
    if not paths:
        paths = sorted(mounts)
        if not paths:
            raise UsageError("no marinfs mounts")
    targets = []
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.exists(real):
            raise UsageError(f"{path}: no such file or directory")
        mountpoint = next((m for m in sorted(mounts, key=len, reverse=True)
                           if real == m or real.startswith(m.rstrip("/") + "/")), None)
        if mountpoint is None:
            raise UsageError(f"{path} is not in a marinfs mount")
        targets.append((real, mountpoint))
    # Ctrl-C must end a wait on the mount: only a fatal signal interrupts a FUSE request.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    started = time.monotonic()
    for real, mountpoint in targets:
        _sync_one(real, mountpoint, quiet)
    return f"synced {', '.join(real for real, _ in targets)} in {time.monotonic() - started:.1f} s"


def _sync_one(path: str, mountpoint: str, quiet: bool) -> None:
    outcome: list[BaseException | None] = []

    asked = time.time()

    def barrier() -> None:
        try:
            os.getxattr(path, XATTR_SYNC)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=barrier, daemon=True)
    worker.start()
    while True:
        worker.join(PROGRESS_EVERY)
        if not worker.is_alive():
            break
        if not quiet:
            print(f"marinfs sync: {path}: {_queued(mountpoint)} upload(s) pending", file=sys.stderr, flush=True)
    error = outcome[0]
    if error is None:
        return
    if isinstance(error, OSError) and error.errno == errno.EIO:
        failed, deletes = _failed_under(path, mountpoint, since=time.time())
        keys = sorted(set(failed) | set(deletes))
        what = f"{len(keys)} file{'s' * (len(keys) != 1)}" if keys else "files"
        named = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        kept = "they are" if deletes else "their bytes are"
        raise MarinfsError(f"{path}: {what} failed to upload{' or to delete' if deletes else ''}; {kept} kept "
                           f"and retried" + (f": {named}" if keys else "") + f" (see `marinfs status {mountpoint}`)")
    if isinstance(error, OSError) and error.errno == errno.EEXIST:
        pairs = _conflicts_under(path, mountpoint, since=time.time(), reported_after=asked)
        what = f"{len(pairs)} file{'s' * (len(pairs) != 1)}" if pairs else "files"
        named = ", ".join(f"{key} (ours: {copy})" for key, copy in pairs[:5])
        named += f" and {len(pairs) - 5} more" if len(pairs) > 5 else ""
        raise MarinfsError(f"{path}: {what} changed by someone else before the upload: theirs stay, our bytes "
                           f"are beside" + (f": {named}" if pairs else "") + f" (see `marinfs status {mountpoint}`)")
    if isinstance(error, OSError) and error.errno in (errno.ENODATA, errno.ENOTSUP):
        raise UsageError(f"{path}: this mount's daemon does not know `marinfs sync` (remount it)")
    raise error


def _failed_under(path: str, mountpoint: str, since: float) -> tuple[list[str], list[str]]:
    """The keys under ``path`` whose bytes are kept after a failed upload, and those whose delete
    failed, sorted, as the daemon publishes them (every 2 s): from figures published after
    ``since`` (the barrier's answer), waited for up to PUBLISHED_WITHIN s. (All the mount's were
    named, from figures up to 2 s old.)"""
    tree, items = os.path.relpath(path, mountpoint), _published(mountpoint, since)

    def under(kind: str) -> list[str]:
        keys = {str(f.get("key")) for item in items for f in item.get("uploads", {}).get(kind, [])}
        return sorted(k for k in keys if _in(k, tree))

    return under("failed"), under("failed_deletes")


def _conflicts_under(path: str, mountpoint: str, since: float, reported_after: float) -> list[tuple[str, str]]:
    """(key, where our bytes went) of the conflicts under ``path`` that the daemon reported to
    this sync (marked ``synced`` at or after ``reported_after``; older ones were someone's before)."""
    tree, items = os.path.relpath(path, mountpoint), _published(mountpoint, since)
    pairs = {(str(c.get("key")), str(c.get("committed_as"))) for item in items
             for c in item.get("uploads", {}).get("conflicts", [])
             if float(c.get("synced") or 0) >= reported_after}
    return sorted(p for p in pairs if _in(p[0], tree))


def _in(key: str, tree: str) -> bool:
    return tree == "." or key == tree or key.startswith(tree + "/")


def _published(mountpoint: str, since: float) -> list[dict]:
    """The daemon's status, once published after ``since``, waited for PUBLISHED_WITHIN s at most."""
    deadline = time.monotonic() + PUBLISHED_WITHIN
    while True:
        items = _status(mountpoint)
        if all(item.get("published", 0) >= since for item in items) or time.monotonic() >= deadline:
            return items
        time.sleep(0.1)


def _status(mountpoint: str) -> list[dict]:
    try:
        return status.collect(mountpoint)
    except (UsageError, OSError, ValueError):
        return []


def _queued(mountpoint: str) -> str:
    for item in _status(mountpoint):
        queued = item.get("uploads", {}).get("write_back", {}).get("queued")
        if queued is not None:
            return str(queued)
    return "?"

