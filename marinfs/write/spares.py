"""Staging files made ahead of the creates that take them.

A new file's staging file and its journal are two inode creations on the cache disk: ~250 µs
of kernel CPU on this ext4 (mkstemp 130-270 µs, the journal's temp + rename ~175 µs), made
while the create held the mount's table lock — most of a create's 0.4-0.7 ms, and the largest
single cost of a ``tar -x`` through a write-back mount. A thread of its own makes a few dozen
pairs (an empty data file, an empty journal beside it) ahead; a create takes one, and its
journal is written by one pwrite into the empty file (write_journal). When none is left the
create makes its own, as before.

An empty journal is a spare's, or a file's that was never written (nothing to commit):
recovery ignores it while the daemon runs and deletes it with its data file at the next start.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections import deque
from pathlib import Path

from marinfs.threadnames import start_thread
from marinfs.write.staging import JOURNAL_SUFFIX, STAGED_PREFIX

log = logging.getLogger(__name__)

KEEP = 32  # spares kept ready: a tar -x takes ~700 a second, the thread makes ~4,000


class Spares:
    """Ready staging files of one staging directory; ``take`` never waits for one."""

    def __init__(self, staging_dir: Path, keep: int = KEEP) -> None:
        self.dir = staging_dir
        self.keep = keep
        self._lock = threading.Lock()
        self._ready: deque[str] = deque()  # GUARDED_BY(_lock): their paths (no descriptor held)
        self._want = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None  # GUARDED_BY(_lock): made at the first take
        self._stopping = False  # GUARDED_BY(_lock)

    def take(self) -> tuple[int, str] | None:
        """An empty staging file (descriptor, path) with an empty journal at its path +
        JOURNAL_SUFFIX, now the caller's; None when none is ready."""
        with self._lock:
            if self._stopping:
                return None
            path = self._ready.popleft() if self._ready else None
            if len(self._ready) < self.keep // 2:
                if self._thread is None:
                    self._thread = start_thread(self._run, "marinfs-spares")
                self._want.notify()
        if path is None:
            return None
        try:  # (an open of a file that is there: a few µs, where making it took hundreds)
            return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), path
        except OSError as exc:  # (gone under us: the create makes its own)
            log.warning("spare staging file %s: %s", path, exc)
            _drop(path)
            return None

    def close(self) -> None:
        """Stop making them and delete those not taken."""
        with self._lock:
            self._stopping = True
            self._want.notify()
            thread = self._thread
        if thread is not None:
            thread.join(5.0)
        with self._lock:
            left, self._ready = list(self._ready), deque()
        for path in left:
            _drop(path)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and len(self._ready) >= self.keep:
                    self._want.wait()
                if self._stopping:
                    return
            try:
                fd, spare = make(self.dir)
                os.close(fd)
            except OSError as exc:  # a full or gone cache disk: the creates say so themselves
                log.debug("cannot make a spare staging file: %s", exc)
                with self._lock:
                    self._want.wait(1.0)
                continue
            with self._lock:
                if self._stopping:
                    _drop(spare)
                    return
                self._ready.append(spare)


def make(staging_dir: Path) -> tuple[int, str]:
    """A new empty staging file (0600) and its empty journal, the journal first: an empty
    journal alone, or beside an empty file, is a spare to whoever looks (tests, a sweep)."""
    while True:
        path = str(staging_dir / (STAGED_PREFIX + secrets.token_hex(6)))
        try:
            os.close(os.open(path + JOURNAL_SUFFIX, os.O_WRONLY | _NEW, 0o600))
        except FileNotFoundError:  # (the directory is there but for the first file)
            staging_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            continue
        except FileExistsError:
            continue
        try:
            return os.open(path, os.O_RDWR | _NEW, 0o600), path
        except BaseException:
            _drop(path)
            raise


_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _drop(path: str) -> None:
    """The file, then its journal (the reverse of ``make``): an empty journal alone, never a
    staging file without one, is what anyone looking meanwhile sees."""
    for name in (path, path + JOURNAL_SUFFIX):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


def sweep(staging_dir: Path) -> int:
    """At start, before anything is staged: delete what no journal describes — spares and
    files never written (an empty journal), staging files without one (a killed daemon's file
    opened and not written), a journal's temporary. Answers how many files went."""
    if not staging_dir.is_dir():
        return 0
    gone = 0
    for entry in os.scandir(staging_dir):
        name = entry.name
        if not name.startswith(STAGED_PREFIX):
            continue
        try:
            if name.endswith(JOURNAL_SUFFIX + ".tmp"):
                os.unlink(entry.path)
            elif name.endswith(JOURNAL_SUFFIX):
                if entry.stat().st_size:
                    continue
                os.unlink(entry.path)
                data = entry.path[:-len(JOURNAL_SUFFIX)]
                if os.path.exists(data):
                    os.unlink(data)
                    gone += 1
            elif "." in name or os.path.exists(entry.path + JOURNAL_SUFFIX):
                continue
            else:
                os.unlink(entry.path)
            gone += 1
        except FileNotFoundError:
            continue
    return gone
