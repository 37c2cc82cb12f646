"""What a file shows when nothing is stored for it: the mount's modes and owner.

A chmod, chown or create mode equal to these is not stored (it changes nothing anyone sees),
and on a local disk the mode and owner the daemon gives its own files show as these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from marinfs.objects import NO_ATTRS, PosixAttrs
from marinfs.remote import Remote


@dataclass(frozen=True)
class Defaults:
    """The mount's ``--file-mode``/``--dir-mode``/``--uid``/``--gid``; ``native``: on a local disk,
    what the daemon gives its own files (euid, egid, file mode, dir mode after its umask)."""

    file_mode: int
    dir_mode: int
    uid: int
    gid: int
    native: tuple[int, int, int, int] | None = None

    @classmethod
    def of(cls, remote: Remote, file_mode: int, dir_mode: int, uid: int | None, gid: int | None) -> Defaults:
        native = None
        if not remote.object_store and remote.lists_posix:
            # A local disk's files always have a mode and owner (see as_mounted).
            umask = os.umask(0o022)
            os.umask(umask)
            native = (os.geteuid(), os.getegid(), 0o666 & ~umask, 0o777 & ~umask)
        return cls(file_mode & 0o7777, dir_mode & 0o7777, os.getuid() if uid is None else uid,
                   os.getgid() if gid is None else gid, native)

    def normalized(self, attrs: PosixAttrs, is_dir: bool, current: PosixAttrs = NO_ATTRS) -> PosixAttrs:
        """What is shown anyway is not stored: a mode, uid or gid that nothing stored yet
        (``current``'s is None) set to the mount's default, so ``cp -a`` of 0644 files owned by
        the mounting user stores only their mtimes. A stored value is replaced, never dropped
        (a local file always has its own)."""
        changes: dict[str, None] = {}
        defaults = (("mode", self.dir_mode if is_dir else self.file_mode), ("uid", self.uid), ("gid", self.gid))
        for name, default in defaults:
            if getattr(attrs, name) == default and getattr(current, name) is None:
                changes[name] = None
        return replace(attrs, **changes) if changes else attrs

    def as_mounted(self, posix: PosixAttrs, is_dir: bool) -> PosixAttrs:
        """A local file always has a mode and an owner; those it got from the daemon itself
        (its own uid and gid, its umask's mode, as every file it wrote) show as the mount's
        ``--uid``/``--gid`` and ``--file-mode``/``--dir-mode``, so these settings mean on a local
        disk what they mean on object stores; a chmod or chown to anything else shows as set."""
        if self.native is None:
            return posix
        uid, gid, file_mode, dir_mode = self.native
        changes: dict[str, None] = {}
        if posix.uid == uid:
            changes["uid"] = None
        if posix.gid == gid:
            changes["gid"] = None
        if posix.mode == (dir_mode if is_dir else file_mode):
            changes["mode"] = None
        return replace(posix, **changes) if changes else posix
