"""Staged writes: a local file that holds an object's new content until it is committed.

Object stores cannot write part of an object, so every write lands in a staging file in the
cache directory and the whole file is uploaded on flush/fsync. Random writes, appends,
truncation and ``O_RDWR`` therefore work as on a local disk; only the commit is remote.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class StagedFile:
    """The new content of one remote key, shared by every handle open on it.

    ``seed`` copies the current remote content into the staging file; it runs lazily, the first
    time old bytes are needed, and never for a new or truncated file. ``dirty`` means the staging
    file holds bytes the remote does not have yet.
    """

    def __init__(self, staging_dir: Path, key: str, seed: Callable[[str, str], None] | None,
                 base_size: int = 0, dirty: bool = False) -> None:
        staging_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, self.path = tempfile.mkstemp(prefix="staged-", dir=staging_dir)  # mode 0600
        self.fd = fd
        self.key = key
        self.lock = threading.RLock()
        self._seed = seed
        self.seeded = seed is None
        self.base_size = base_size  # the remote size, valid until seeded
        self.dirty = dirty  # True for a new or truncated file: it is committed even if unwritten
        self.mtime_ns = time.time_ns()
        self.refs = 0
        self.unlinked = False
        self.kept = False

    def _ensure_seeded(self) -> None:
        if self.seeded:
            return
        assert self._seed is not None
        self._seed(self.key, self.path)  # the current key: the file may have been renamed
        self.seeded = True

    def known_size(self) -> int:
        """The current size without fetching anything (stat must not download the object)."""
        with self.lock:
            return os.fstat(self.fd).st_size if self.seeded else self.base_size

    def read(self, size: int, offset: int) -> bytes:
        with self.lock:
            self._ensure_seeded()
            return os.pread(self.fd, size, offset)

    def write(self, data: bytes, offset: int | None) -> int:
        """Write at ``offset``; ``None`` appends at the current end (O_APPEND)."""
        with self.lock:
            self._ensure_seeded()
            if offset is None:
                offset = os.fstat(self.fd).st_size
            written = os.pwrite(self.fd, data, offset)
            self.dirty = True
            self.mtime_ns = time.time_ns()
            return written

    def truncate(self, length: int) -> None:
        with self.lock:
            if length == 0:
                self.seeded = True  # old bytes are not needed
            else:
                self._ensure_seeded()
            os.ftruncate(self.fd, length)
            self.dirty = True
            self.mtime_ns = time.time_ns()

    def commit(self, upload: Callable[[str, str], None]) -> None:
        """Upload the staged bytes if the remote lacks them; raises the upload's error."""
        with self.lock:
            if not self.dirty or self.unlinked:
                return
            self._ensure_seeded()
            upload(self.path, self.key)
            self.dirty = False

    def discard(self) -> None:
        """Drop the staging file, unless it holds uncommitted bytes: those are kept on disk."""
        with self.lock:
            os.close(self.fd)
            if self.dirty and not self.unlinked:
                self.kept = True
                log.error("commit of %s failed; its staged bytes are kept in %s", self.key, self.path)
                return
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
