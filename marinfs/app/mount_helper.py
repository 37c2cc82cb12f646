"""``mount.marinfs`` / ``mount.fuse.marinfs``: let fstab and mount(8) mount a marinfs prefix.

mount(8) runs ``mount.marinfs SOURCE MOUNTPOINT [-o OPTS] [-n] [-s] [-f] [-v]``. We turn the
fstab options into ``marinfs mount`` flags and exec it in background mode, so mount(8) returns
once the mount is live. An option we do not know is an error, never silently dropped: a typo in
``cache_size`` must not quietly mount with a 20G cache.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable

from marinfs.config.mount import SETTINGS
from marinfs.errors import UsageError
from marinfs.config.settings import BOOL, FSTAB

PROG = "mount.marinfs"

# From the settings table: fstab option -> marinfs mount flag, for options that take a value
# (config=FILE is the one that is not a setting: everything else from a TOML file) ...
VALUE_OPTIONS = {s.name: s.flag_name for s in SETTINGS
                 if s.allows(FSTAB) and not s.positional and s.kind is not BOOL}
VALUE_OPTIONS["config"] = "--config"
# ... and boolean options: NAME sets it, no_NAME clears it, and aliases such as ro/rw.
SWITCH_OPTIONS: dict[str, tuple[str, bool]] = {}
for _s in SETTINGS:
    if _s.allows(FSTAB) and _s.kind is BOOL:
        SWITCH_OPTIONS.update({_s.name: (_s.name, True), f"no_{_s.name}": (_s.name, False),
                               **{alias: (_s.name, on) for alias, on in _s.fstab_aliases.items()}})
_FLAGS = {s.name: s.flag_name for s in SETTINGS}

# Options mount(8), systemd or fstab conventions pass along that mean nothing to marinfs.
# ("user=NAME" is what mount(8) adds when a user mounts a `user` entry.)
GENERIC_OPTIONS = frozenset((
    "_netdev", "nofail", "auto", "noauto", "user", "users", "nouser", "owner", "group", "defaults",
    "nodev", "nosuid", "noexec", "exec", "suid", "dev",
    "atime", "noatime", "relatime", "norelatime", "strictatime", "nodiratime", "diratime", "lazytime"))
GENERIC_PREFIXES = ("x-systemd.", "comment=", "user=")

# Sources that stand for "take the remote from config= (or $MARIN_PREFIX)".
PLACEHOLDER_SOURCES = frozenset(("marinfs", "none", "-"))


def split_options(options: str | Iterable[str]) -> list[str]:
    """``"a,b=c"`` or ``["a,b=c", "d"]`` (several -o) -> ``["a", "b=c", "d"]``."""
    parts = [options] if isinstance(options, str) else list(options)
    return [o.strip() for part in parts for o in part.split(",") if o.strip()]


def translate(source: str, mountpoint: str, options: str | Iterable[str] = (),
              sloppy: bool = False) -> list[str]:
    """fstab entry -> argv after ``marinfs`` (starting with "mount"); UsageError on a bad option.

    With ``sloppy`` (mount -s) unknown options are reported on stderr and skipped instead.
    """
    if source.startswith("marinfs#"):  # old mount.fuse style: "marinfs#gs://bucket/prefix"
        source = source[len("marinfs#"):]
    flags: list[str] = []
    switches: dict[str, bool] = {}  # the last of ro/rw (or NAME/no_NAME) wins, as for any filesystem
    for opt in split_options(options):
        name, eq, value = opt.partition("=")
        if name in VALUE_OPTIONS:
            if not eq or not value:
                raise UsageError(f"option {name} needs a value ({name}=...)")
            flags += [VALUE_OPTIONS[name], value]
        elif opt in SWITCH_OPTIONS:
            setting, on = SWITCH_OPTIONS[opt]
            switches[setting] = on
        elif opt in GENERIC_OPTIONS or opt.startswith(GENERIC_PREFIXES):
            continue
        elif name in SWITCH_OPTIONS or name in GENERIC_OPTIONS:
            raise UsageError(f"option {name} takes no value (got {opt!r})")
        elif sloppy:
            print(f"{PROG}: ignoring unknown option {opt!r} (sloppy mode)", file=sys.stderr)
        else:
            raise UsageError(f"unknown mount option {opt!r}")
    # A switch that only says "rw" (the default of every mount) adds nothing.
    flags += [_FLAGS[name] if on else "--no-" + _FLAGS[name][2:] for name, on in switches.items()
              if on or name != "read_only"]
    positional = [mountpoint] if source in PLACEHOLDER_SOURCES else [source, mountpoint]
    return ["mount", *positional, *flags]


def parse_argv(argv: list[str]) -> tuple[str, str, list[str], dict[str, bool]]:
    """mount(8) helper argv -> (source, mountpoint, option strings, {fake, verbose, sloppy})."""
    positional: list[str] = []
    options: list[str] = []
    switches = {"fake": False, "verbose": False, "sloppy": False}
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            value = next(args, None)
            if value is None:
                raise UsageError("-o needs a value")
            options.append(value)
        elif arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("nsfv"):
            switches["fake"] |= "f" in arg
            switches["verbose"] |= "v" in arg
            switches["sloppy"] |= "s" in arg
            # -n (do not write /etc/mtab) needs nothing: there is no mtab to write.
        elif arg.startswith("-") and len(arg) > 1:
            raise UsageError(f"unknown switch {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise UsageError(f"usage: {PROG} SOURCE MOUNTPOINT [-o OPTIONS] [-n] [-s] [-f] [-v]")
    return positional[0], positional[1], options, switches


def main(argv: list[str] | None = None) -> int:
    """Translate and exec ``python -m marinfs mount ...``; 1 with one stderr line on bad input."""
    try:
        source, mountpoint, options, sw = parse_argv(sys.argv[1:] if argv is None else argv)
        args = translate(source, mountpoint, options, sloppy=sw["sloppy"])
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    command = [sys.executable, "-m", "marinfs", *args]
    if sw["verbose"] or sw["fake"]:
        print(shlex.join(command), file=sys.stderr)
    if sw["fake"]:
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
