"""Any fsspec filesystem without a backend of its own, and the in-memory one tests use.

Generic backends: versions are mtime and size (or what the backend's info carries); a
conditional commit compares a stat taken just before it, as close as a store without
preconditions allows. The memory backend does better, so tests have a faithful fake of an
object store's rules: every stored object gets its own generation, and a commit's precondition
is checked and applied under a lock no other commit of that key can pass.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from marinfs.objects import ObjectInfo, ObjectVersion
from marinfs.remote.base import Remote


class GenericRemote(Remote, fallback=True):
    """A plain fsspec filesystem: every operation is the fsspec call of the same name."""

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._options(options)
        options.setdefault("use_listings_cache", False)
        return options


_GENERATION_ATTR = "_marinfs_generation"
_generation_lock = threading.Lock()
_last_generation = 0
_commit_locks = tuple(threading.Lock() for _ in range(64))  # striped by key: bounded, never shared by one key


def _generation(stored: Any) -> int:
    """The generation of one stored object (fsspec makes a new MemoryFile for every write),
    given at first sight: strictly increasing, and microseconds since the epoch like GCS's, so
    a generation from an earlier process (whose chunks a cache directory may still hold) is
    never handed out again."""
    global _last_generation
    generation = getattr(stored, _GENERATION_ATTR, None)
    if generation is None:
        with _generation_lock:
            generation = getattr(stored, _GENERATION_ATTR, None)
            if generation is None:
                generation = _last_generation = max(_last_generation + 1, time.time_ns() // 1000)
                setattr(stored, _GENERATION_ATTR, generation)
    return generation


class MemoryRemote(Remote):
    """fsspec's process-wide ``memory://`` store with real versions and preconditions.

    Writes that bypass the Remote (a test's ``remote.fs.pipe_file``, another Remote) still make
    new objects, so they get new generations too."""

    protocols = ("memory",)

    def _info_of(self, raw: dict[str, Any], key: str | None = None) -> ObjectInfo:
        info = super()._info_of(raw, key)
        if info.is_dir:
            return info
        stored = self.fs.store.get(raw["name"])
        if stored is None:  # removed since it was listed: keep what the listing said
            return info
        return ObjectInfo(name=info.name, is_dir=False, size=info.size, mtime_ns=info.mtime_ns,
                          version=ObjectVersion("generation", str(_generation(stored))))

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None) -> ObjectVersion | None:
        """The precondition checked and the object replaced with no other commit of this key in
        between (like S3's If-Match); answers the new object's generation."""
        full = self.full(key)
        with _commit_locks[hash(full) % len(_commit_locks)]:
            self._check_expected(key, expect)
            self._call("put", self.fs.put_file, local_path, full)
            stored = self.fs.store.get(self.fs._strip_protocol(full))
            version = None if stored is None else ObjectVersion("generation", str(_generation(stored)))
        self.stats.add_bytes(bytes_out=os.path.getsize(local_path))
        return version
