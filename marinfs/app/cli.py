"""Command line: argument parsing, exit codes and messages; the work happens elsewhere.

Exit codes: 0 success, 1 the operation failed, 2 bad input. Every failure is one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from marinfs import __version__
from marinfs.config.mount import BY_NAME, SETTINGS, MountConfig, cache_root, normalize_remote
from marinfs.errors import MarinfsError, UsageError
from marinfs.config.settings import BOOL, FLAG, Bad, Setting

log = logging.getLogger("marinfs")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message)


def _flag_type(s: Setting) -> Callable[[str], Any]:
    """argparse ``type=`` for one setting: the table's converter, its error as one line."""
    def convert(text: str) -> Any:
        try:
            return s.parse_element(text) if s.kind.element is not None else s.parse(text)
        except Bad as exc:
            raise UsageError(f"{s.flag_name}: {exc}") from None
    return convert


def _add_setting_flags(m: argparse.ArgumentParser) -> None:
    """One flag per setting of the table that flags may set. Each defaults to None, "not given",
    so the config file and MARINFS_* variables can supply it; MountConfig holds the defaults."""
    for s in SETTINGS:
        if s.positional or not s.allows(FLAG):
            continue
        names = [s.flag_name, *([s.short] if s.short else [])]
        default = s.describe_default().replace("`", "")
        text = f"{s.help} ({default})" if default not in ("none", "required") else s.help
        if s.kind is BOOL:
            m.add_argument(*names, dest=s.name, action=argparse.BooleanOptionalAction, default=None,
                           help=text.replace("%", "%%"))
        else:
            m.add_argument(*names, dest=s.name, type=_flag_type(s), metavar=s.kind.metavar,
                           action="append" if s.kind.element is not None else "store",
                           help=text.replace("%", "%%"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="marinfs", description="Mount a Marin storage prefix through FUSE.")
    parser.add_argument("--version", action="version", version=f"marinfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("mount", help="mount REMOTE (default $MARIN_PREFIX) at MOUNTPOINT")
    m.add_argument("args", nargs="*", metavar="[REMOTE] MOUNTPOINT")
    m.add_argument("--config", help="TOML file with any of the settings below (flags win)")
    _add_setting_flags(m)

    u = sub.add_parser("umount", help="unmount and wait for the daemon to finish")
    u.add_argument("mountpoint", nargs="?")
    u.add_argument("--config", help="take the mountpoint from this TOML file")
    u.add_argument("--timeout", type=float, default=600.0)
    u.add_argument("--lazy", "-z", action="store_true", help="detach now even if busy")

    c = sub.add_parser("cache", help="inspect, empty or pre-fill the chunk cache")
    csub = c.add_subparsers(dest="cache_command", required=True, parser_class=_Parser)
    for name, text in (("stats", "what is cached and how it is used"),
                       ("clear", "delete every cached chunk (not while mounted)")):
        one = csub.add_parser(name, help=text)
        one.add_argument("--cache-dir", type=Path, default=None)
        if name == "stats":
            one.add_argument("--json", action="store_true")
    g = csub.add_parser("gc", help="keep a shared tier within its limit (run on one node, from a timer)")
    g.add_argument("--shared", type=Path, required=True, metavar="DIR", help="the --shared-cache-dir")
    g.add_argument("--limit", type=_flag_type(BY_NAME["shared_cache_size"]), default=None, metavar="SIZE",
                   help="its limit (default: the shared_cache_size default)")
    g.add_argument("--json", action="store_true")
    w = csub.add_parser("warm", help="read files or trees under a mount into its cache")
    w.add_argument("paths", nargs="+", metavar="PATH")
    w.add_argument("--workers", type=int, default=4)
    w.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    st = sub.add_parser("status", help="what each running mount is doing")
    st.add_argument("mountpoint", nargs="?")
    st.add_argument("--json", action="store_true")

    cf = sub.add_parser("config", help="check a config file")
    cfsub = cf.add_subparsers(dest="config_command", required=True, parser_class=_Parser)
    cfsub.add_parser("check", help="validate FILE and print a summary").add_argument("file")

    sy = sub.add_parser("sync", help="return once every file closed under PATH is in the bucket (--write-back)")
    sy.add_argument("paths", nargs="*", metavar="PATH", help="files or directories in mounts (default: every mount)")
    sy.add_argument("--quiet", "-q", action="store_true", help="no progress lines")

    p = sub.add_parser("path", help="convert a URL under a mounted prefix to its path, and back")
    p.add_argument("arg")
    return parser


def _mount_config(ns: argparse.Namespace) -> MountConfig:
    """Settings from the config file < MARINFS_* variables < flags, then MountConfig defaults."""
    from marinfs.config import file as configfile

    if len(ns.args) > 2:
        raise UsageError("mount takes [REMOTE] MOUNTPOINT")
    flags: dict[str, Any] = {}
    for s in SETTINGS:
        value = getattr(ns, s.name, None)
        if value is not None and not s.positional:
            flags[s.name] = s.kind.gather(value) if s.kind.element is not None else value
    for name, text in zip(("mountpoint",) if len(ns.args) == 1 else ("remote", "mountpoint"), ns.args):
        try:
            flags[name] = BY_NAME[name].parse(text)
        except Bad as exc:
            raise UsageError(f"{name.upper()}: {exc}") from None
    file = configfile.load_file(ns.config) if ns.config else {}
    values = configfile.merge(file, configfile.from_env(os.environ), flags)
    if "remote" not in values:
        if not os.environ.get("MARIN_PREFIX"):
            raise UsageError("no REMOTE given and $MARIN_PREFIX is not set")
        values["remote"] = normalize_remote(os.environ["MARIN_PREFIX"])
    if "mountpoint" not in values:
        raise UsageError("no MOUNTPOINT given")
    values = {name: BY_NAME[name].kind.freeze(value) for name, value in values.items()}
    return MountConfig(**values).validate()


def run(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "mount":
        cfg = _mount_config(ns)
        from marinfs.app import daemon

        if cfg.foreground:
            daemon.run_foreground(cfg)
        else:
            log_file = daemon.start_background(cfg)
            print(f"mounted {cfg.remote} at {cfg.mountpoint} (log: {log_file}); "
                  f"stop with: marinfs umount {cfg.mountpoint}")
        return 0
    if ns.command == "umount":
        from marinfs.config import file as configfile
        from marinfs.app import daemon

        mountpoint = ns.mountpoint
        if mountpoint is None and ns.config:
            mountpoint = configfile.load_file(ns.config).get("mountpoint")
        if not mountpoint:
            raise UsageError("umount takes MOUNTPOINT (or --config FILE naming one)")
        daemon.unmount(mountpoint, timeout=ns.timeout, lazy=ns.lazy)
        return 0
    if ns.command == "status":
        from marinfs.app import status

        data = status.collect(ns.mountpoint)
        print(json.dumps(data, indent=2) if ns.json else status.format_status(data))
        return 0
    if ns.command == "config":
        from marinfs.config import file as configfile

        print(configfile.check(ns.file))
        return 0
    if ns.command == "cache":
        from marinfs.app import cachecli

        if ns.cache_command == "warm":
            if ns.workers < 1:
                raise UsageError("--workers must be >= 1")
            print(cachecli.warm(ns.paths, workers=ns.workers, quiet=ns.quiet))
            return 0
        if ns.cache_command == "gc":
            limit = ns.limit if ns.limit is not None else BY_NAME["shared_cache_size"].default
            data = cachecli.gc_shared(ns.shared.absolute(), limit)
            print(json.dumps(data, indent=2) if ns.json else cachecli.format_gc(data))
            return 0
        cache_dir = ns.cache_dir.absolute() if ns.cache_dir else cachecli.only_cache_under(cache_root())
        if ns.cache_command == "stats":
            data = cachecli.stats(cache_dir)
            print(json.dumps(data, indent=2) if ns.json else cachecli.format_stats(data))
        else:
            print(f"removed {cachecli.clear(cache_dir)} chunks from {cache_dir}")
        return 0
    if ns.command == "sync":
        from marinfs.app import synccli

        print(synccli.sync(ns.paths, quiet=ns.quiet))
        return 0
    if ns.command == "path":
        from marinfs.app.mounts import convert, live_mounts

        print(convert(ns.arg, live_mounts()))
        return 0
    raise UsageError(f"unknown command {ns.command}")


def main(argv: list[str] | None = None) -> int:
    # Until a daemon sets up its own logging, library warnings (retries...) must not add lines
    # to the one-line error contract.
    logging.getLogger().addHandler(logging.NullHandler())
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"marinfs: error: {exc}", file=sys.stderr)
        return 2
    except MarinfsError as exc:
        print(f"marinfs: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"marinfs: error: {exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}",
              file=sys.stderr)
        return 1
