"""Any fsspec filesystem without a backend of its own, and the in-memory one tests use.

Generic backends: versions are mtime and size (or what the backend's info carries); a
conditional commit compares a stat taken just before it, as close as a store without
preconditions allows. The memory backend does better, so tests have a faithful fake of an
object store's rules: every stored object gets its own generation, and a commit's precondition
is checked and applied under a lock no other commit of that key can pass.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from typing import Any

from marinfs.errors import PreconditionFailed
from marinfs.objects import Copied, ABSENT, NO_ATTRS, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote.base import Remote
from marinfs.remote.recorded import Recorded


class GenericRemote(Remote, fallback=True):
    """A plain fsspec filesystem: every operation is the fsspec call of the same name. It keeps
    no POSIX metadata (set_attrs and upload with attrs: ENOTSUP)."""

    stores_posix = False

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._options(options)
        options.setdefault("use_listings_cache", False)
        return options


_GENERATION_ATTR = "_marinfs_generation"
_POSIX_ATTR = "_marinfs_posix"  # the PosixAttrs stored with one object, as S3 user metadata is
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


class MemoryRemote(Recorded, Remote):
    """fsspec's process-wide ``memory://`` store with real versions and preconditions.

    Writes that bypass the Remote (a test's ``remote.fs.pipe_file``, another Remote) still make
    new objects, so they get new generations too, and no POSIX metadata (as a plain PUT).
    Listings carry no POSIX metadata, as on S3: the directory record (remote/recorded.py) is
    tested without servers."""

    protocols = ("memory",)

    def _lock(self, full: str) -> threading.Lock:
        return _commit_locks[hash(self.fs._strip_protocol(full)) % len(_commit_locks)]

    def _is_transient(self, exc: BaseException) -> bool:
        """fsspec's memory store is one dict for the process: a ``find`` or ``ls`` iterating it
        while another thread writes (a commit, a directory record) fails with "dictionary
        changed size during iteration"; asked again, it answers (a rename's walk was EIO)."""
        if isinstance(exc, RuntimeError) and "changed size during iteration" in str(exc):
            return True
        return super()._is_transient(exc)

    def _stored(self, key: str) -> Any:
        return self.fs.store.get(self.fs._strip_protocol(self.full(key)))

    def _version(self, stored: Any) -> ObjectVersion:
        return ObjectVersion("generation", str(_generation(stored)))

    def _info_of(self, raw: dict[str, Any], key: str | None = None) -> ObjectInfo:
        info = super()._info_of(raw, key)
        if info.is_dir:
            return info
        stored = self.fs.store.get(raw["name"])
        if stored is None:  # removed since it was listed: keep what the listing said
            return info
        return ObjectInfo(name=info.name, is_dir=False, size=info.size, mtime_ns=info.mtime_ns,
                          version=self._version(stored), posix=getattr(stored, _POSIX_ATTR, NO_ATTRS))

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None,
               attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        """The precondition checked and the object replaced with no other commit of this key in
        between (like S3's If-Match); answers the new object's generation. ``attrs`` are
        stored with the new object."""
        self._refuse_record(key)
        full = self.full(key)
        with self._lock(full):
            self._check_expected(key, expect)
            self._call("put", self.fs.put_file, local_path, full)
            stored = self._stored(key)
            version = None
            if stored is not None:
                version = self._version(stored)
                if attrs is not None and not attrs.empty:
                    setattr(stored, _POSIX_ATTR, attrs)
        self.stats.add_bytes(bytes_out=os.path.getsize(local_path))
        self._recorded_attrs(key, version, attrs)
        return version

    def set_attrs(self, key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion | None:
        """The stored attributes replaced under the key's commit lock; the generation stays
        (the bytes did), as on GCS."""
        full = self.full(key)
        with self._lock(full):
            info = self._current_file(key, expect)
            self.stats.add("patch")
            stored = self._stored(key)
            if stored is None or info.version != self._version(stored):
                raise PreconditionFailed(f"{self.url}/{key} changed since it was opened")
            setattr(stored, _POSIX_ATTR, attrs)
        self._recorded_attrs(key, info.version, attrs, metadata_only=True)
        return info.version

    folds_attrs = True  # a copy is given its attributes under the keys' commit locks

    def copy(self, src: str, dst: str, attrs: PosixAttrs | None = None,
             expect: ObjectVersion | None = None) -> Copied | None:
        """fsspec's copy, keeping the POSIX metadata (as S3 and GCS copies keep metadata), of
        the source's generation as it was under its commit lock: its readers follow a rename,
        as on S3 and GCS. ``attrs``: the copy carries those instead, made only of generation
        ``expect`` (else PreconditionFailed, nothing copied), as S3's REPLACE copy."""
        locks = sorted({self._lock(self.full(src)), self._lock(self.full(dst))}, key=id)  # no commit between
        with contextlib.ExitStack() as held:
            for lock in locks:
                held.enter_context(lock)
            source = self._stored(src)
            old = self._version(source) if source is not None else None
            if attrs is not None and (old is None or old != expect):
                if source is None and not self.fs.isfile(self.full(src)):
                    raise FileNotFoundError(errno.ENOENT, "no such object", self.full(src))
                raise PreconditionFailed(f"{self.url}/{src} changed since its attributes were set")
            super().copy(src, dst)
            stored = self._stored(dst)
            if attrs is None:
                attrs = getattr(source, _POSIX_ATTR, None)
            if attrs is not None and stored is not None:
                setattr(stored, _POSIX_ATTR, attrs)
        return Copied(src, dst, old, self._version(stored)) if stored is not None else None

    def read_small(self, key: str) -> tuple[bytes, ObjectVersion]:
        """Bytes and generation read together, under the key's commit lock."""
        full = self.full(key)
        with self._lock(full):
            self.stats.add("get")
            stored = self._stored(key)
            if stored is None:
                if self.fs.isdir(full):
                    raise IsADirectoryError(full)
                raise FileNotFoundError(full)
            data = bytes(stored.getbuffer())
            version = self._version(stored)
        self.stats.add_bytes(bytes_in=len(data))
        return data, version

    def put_small(self, key: str, data: bytes, expect: ObjectVersion | None) -> ObjectVersion | None:
        """The precondition checked on the stored object itself, under its commit lock (a stat
        would not see the directory record, which stat hides)."""
        full = self.full(key)
        with self._lock(full):
            stored = self._stored(key)
            if expect is not None and (ABSENT if stored is None else self._version(stored)) != expect:
                raise PreconditionFailed(f"{self.url}/{key} changed since it was read")
            self._call("put", self.fs.pipe_file, full, data)
            stored = self._stored(key)
        self.stats.add_bytes(bytes_out=len(data))
        return None if stored is None else self._version(stored)
