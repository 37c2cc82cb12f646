"""The directory record (dirmeta.py) wired into the backends whose listings carry no POSIX
metadata: S3 and memory:// for files, every object store for directories (a prefix has no
metadata of its own).

:class:`Recorded` goes first among a backend's bases, so its methods wrap the generic ones
(``list``, ``stat``, ``upload``, ``delete``, ``rename``...): a listing has the record applied
and hidden, a change queues the entry. A backend that defines one of those itself (memory's
``upload``, S3's ``set_attrs``) calls the hook (``_recorded_*``) in it; tests/test_dirmeta.py
checks that each does. The record's name is reserved: nothing is created or renamed onto it,
and no stat or listing shows it.

Of remote/ this module imports only dirmeta.py, the record itself (it sits beside base.py):
what it calls on ``self`` is the Remote interface, through ``super()``.
"""

from __future__ import annotations

import errno
import logging
import posixpath
import threading
from typing import Any

from marinfs.errors import FsError
from marinfs.objects import Copied, ObjectInfo, ObjectVersion, PosixAttrs
from marinfs.remote.dirmeta import RECORD_NAME, DirRecords, is_record, record_key, split_key

log = logging.getLogger(__name__)

# What Recorded wraps; a backend that defines one of these itself must call the hook in it.
HOOKED = ("list", "stat", "upload", "set_attrs", "set_dir_attrs", "delete", "rename", "rename_tree",
          "remove_dir", "make_dir", "symlink", "close")

CLOSE_TIMEOUT = 10.0  # seconds close() waits for the last records (each PUT retried as every request)
_records_lock = threading.Lock()  # creating one DirRecords per Remote (rare: once each)


class Recorded:
    """Mixin for a Remote: the directory records of this prefix, applied and kept."""

    lists_posix: bool  # (the Remote's) whether listings carry the files' own metadata

    @property
    def records(self) -> DirRecords:
        """This prefix's records; its flusher thread starts with the first change."""
        records = self.__dict__.get("_dir_records")
        if records is None:
            with _records_lock:
                records = self.__dict__.get("_dir_records")
                if records is None:
                    records = self.__dict__["_dir_records"] = DirRecords(self)  # type: ignore[arg-type]
        return records

    # -- hooks ---------------------------------------------------------------------------------
    @staticmethod
    def _refuse_record(key: str) -> None:
        """EPERM for the record's name: nothing is created or renamed onto it."""
        if is_record(key):
            raise FsError(errno.EPERM, f"{RECORD_NAME} is reserved for marinfs's directory records")

    def _recorded_stat(self, info: ObjectInfo) -> ObjectInfo:
        """A stat with what this node knows of its record entry, where the object said nothing
        (directories; files whose HEAD had no metadata). No request; a HEAD that carried
        attributes a known record lacks queues the entry (the record's repair)."""
        return self.records.fill(info, repair=not self.lists_posix)

    def _recorded_attrs(self, key: str, version: ObjectVersion | None, attrs: PosixAttrs | None,
                        metadata_only: bool = False) -> None:
        """``key`` now is ``version`` with ``attrs`` (None: a plain commit): queue its entry.
        Listings that carry file metadata need none. A metadata-only update keeps the version
        on some stores, so an entry it empties is removed even if this node never saw it."""
        if self.lists_posix:
            return
        if version is None:  # the store did not say: no entry can match it
            self.records.forget_key(key)
        elif metadata_only and (attrs is None or attrs.empty):
            self.records.forget_key(key)
        else:
            self.records.set_key(key, version, attrs)

    # -- wrapped ---------------------------------------------------------------------------------
    def list(self, key: str, on_page: Any = None) -> list[ObjectInfo]:
        """The listing with the record applied (one GET when it changed) and hidden. The GET
        starts as soon as the page that holds the record has landed (it sorts early: ``.``),
        while the listing's later pages still come."""
        records = self.records
        wanted = self.full(record_key(key))  # type: ignore[attr-defined]

        def page(entries: list[dict[str, Any]]) -> None:
            for raw in entries:
                if raw.get("type") != "directory" and raw["name"].rstrip("/") == wanted:
                    records.prefetch(key, self._info_of(raw, record_key(key)).version)  # type: ignore[attr-defined]
                    break
            if on_page is not None:
                on_page(entries)

        sent = records.tick()
        return records.apply(key, super().list(key, page), files=not self.lists_posix, sent=sent)  # type: ignore[misc]

    def stat(self, key: str, likely_dir: bool = False, likely_link: bool = False) -> ObjectInfo:
        if is_record(key):
            raise FileNotFoundError(errno.ENOENT, "the directory record is not a file", key)
        return self._recorded_stat(super().stat(key, likely_dir, likely_link))  # type: ignore[misc]

    def upload(self, local_path: str, key: str, expect: ObjectVersion | None = None,
               attrs: PosixAttrs | None = None) -> ObjectVersion | None:
        self._refuse_record(key)
        version = super().upload(local_path, key, expect, attrs=attrs)  # type: ignore[misc]
        self._recorded_attrs(key, version, attrs)
        return version

    def set_attrs(self, key: str, attrs: PosixAttrs, expect: ObjectVersion | None) -> ObjectVersion | None:
        version = super().set_attrs(key, attrs, expect)  # type: ignore[misc]
        self._recorded_attrs(key, version, attrs, metadata_only=True)
        return version

    def set_dir_attrs(self, key: str, attrs: PosixAttrs) -> None:
        """A directory's attributes are its entry ``name/`` in its parent's record (the prefix
        itself has no parent: not kept)."""
        if not key:
            super().set_dir_attrs(key, attrs)  # type: ignore[misc]
            return
        self.records.set_key(key, None, attrs, is_dir=True)

    def symlink(self, key: str, target: str) -> ObjectVersion | None:
        self._refuse_record(key)
        return super().symlink(key, target)  # type: ignore[misc]

    def make_dir(self, key: str) -> None:
        self._refuse_record(key)
        super().make_dir(key)  # type: ignore[misc]

    def delete(self, key: str) -> None:
        super().delete(key)  # type: ignore[misc]
        if not is_record(key):  # (a record is deleted only with its directory: rename_tree)
            self.records.forget_key(key)

    def remove_dir(self, key: str) -> None:
        """The directory's record first (it would keep the prefix alive, and memory:// calls
        the directory not empty), its queued changes dropped (their flush would make it
        again), then the directory and its entry in the parent."""
        if self.records.drop(key):
            try:
                super().delete(record_key(key))  # type: ignore[misc]
            except FileNotFoundError:
                pass
        super().remove_dir(key)  # type: ignore[misc]
        self.records.forget_key(key, is_dir=True)

    def rename(self, src: str, dst: str, attrs: PosixAttrs | None = None,
               expect: ObjectVersion | None = None) -> list[Copied]:
        """The backend's copy, the entry moved to the copy's version, the backend's delete. The
        copy's version, where copy() does not answer it, costs a HEAD, and only when the source
        has (or may have: its record never read) an entry. A copy that carries new ``attrs``
        (``folds_attrs``) gives the new name an entry of those instead."""
        self._refuse_record(dst)
        if attrs is not None:
            copied: Copied | None = self.copy(src, dst, attrs, expect)  # type: ignore[attr-defined]
            if self.records.may_have(src):
                self.records.forget_key(src)
            self._recorded_attrs(dst, copied.new if copied is not None else None, attrs, metadata_only=True)
            super().delete(src)  # type: ignore[misc]
            return [copied] if copied is not None else []
        copied = self.copy(src, dst)  # type: ignore[attr-defined]
        if self.records.may_have(src):
            version = copied.new if copied is not None else None
            if version is None:
                try:
                    version = self.stat(dst).version
                except FileNotFoundError:
                    pass
            self.records.move_key(src, dst, version)
        elif self.records.may_have(dst):  # a file replaced: its entry must not outlive it
            self.records.forget_key(dst)
        super().delete(src)  # type: ignore[misc]
        return [copied] if copied is not None else []

    def rename_tree(self, src: str, dst: str) -> list[Copied]:
        """The tree moved as the backend moves it (copy + delete, records included), then the
        directory's own entry, and each copied record's entries given their copies' versions
        (a copy is a new version on some stores): per directory with a record, a LIST before
        and after and the record's GET and PUT."""
        self._refuse_record(dst)
        # Queued changes written first: a directory's first ones would otherwise be written
        # under the old name after the move (and make its prefix again); now the walk sees them.
        self.records.flush(CLOSE_TIMEOUT)
        before = {} if self.lists_posix else self._tree_records(src)  # (else entries are directories': kept)
        self.records.move_key(src, dst, None, is_dir=True)  # first: removing src forgets its entry
        copies: list[Copied] = super().rename_tree(src, dst)  # type: ignore[misc]
        for old_dir, valid in before.items():
            new_dir = dst + old_dir[len(src):]
            self.records.drop(old_dir)
            if not valid:
                continue
            sent = self.records.tick()
            raw = super().list(new_dir)  # type: ignore[misc]
            self.records.apply(new_dir, [i for i in raw if i.name == record_key(new_dir)], sent=sent)  # the copy: cached
            listed = {split_key(i.name)[1]: i.version for i in raw if not i.is_dir}
            for name, attrs in valid.items():
                if listed.get(name) is not None:
                    self.records.set(new_dir, name, listed[name], attrs)
        return copies

    def _tree_records(self, src: str) -> dict[str, dict[str, PosixAttrs]]:
        """Directory -> its record's file entries that match its objects now, for each
        directory under ``src`` (itself included) that has a record."""
        files, _, _ = self.walk(src)  # type: ignore[attr-defined]
        out: dict[str, dict[str, PosixAttrs]] = {}
        for key in files:
            if posixpath.basename(key) != RECORD_NAME:
                continue
            dir_key = split_key(key)[0]
            sent = self.records.tick()
            listing = self.records.apply(dir_key, super().list(dir_key), files=True, sent=sent)  # type: ignore[misc]
            out[dir_key] = {split_key(i.name)[1]: i.posix for i in listing
                            if not i.is_dir and i.posix is not None and not i.posix.empty}
        return out

    def close(self) -> None:
        """Write what is queued (a bounded wait), then release the backend."""
        records: DirRecords | None = self.__dict__.get("_dir_records")
        if records is not None and not records.close(CLOSE_TIMEOUT):
            log.warning("directory records not all written at close; their objects keep the metadata")
        super().close()  # type: ignore[misc]


def hooks_missing(cls: type[Any]) -> list[str]:
    """The HOOKED methods ``cls`` or a base above Recorded defines itself without calling a
    hook or ``super()``: they would bypass the records (a check for tests). Where listings
    carry the files' metadata (GCS), commits and ``set_attrs`` need no entry."""
    import inspect

    missing = []
    names = [n for n in HOOKED if not (cls.lists_posix and n in ("upload", "set_attrs"))]
    for klass in cls.__mro__:
        if klass is Recorded:
            break
        for name in names:
            fn = klass.__dict__.get(name)
            if fn is None:
                continue
            source = inspect.getsource(fn)
            if not any(hook in source for hook in ("self._recorded_", "self._refuse_record(", f"super().{name}(")):
                missing.append(f"{klass.__name__}.{name}")
    return missing
