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
from pathlib import Path
from typing import NoReturn

from marinfs import __version__
from marinfs.config import (LOG_LEVELS, MountConfig, default_cache_dir, normalize_remote, parse_mode,
                            parse_size, parse_storage_option)
from marinfs.errors import MarinfsError, UsageError

log = logging.getLogger("marinfs")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage dump
        raise UsageError(message)


def _storage_value(text: str) -> object:
    """Storage option values are JSON when they parse as JSON (true, 30, {...}), else strings."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="marinfs", description="Mount a Marin storage prefix through FUSE.")
    parser.add_argument("--version", action="version", version=f"marinfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("mount", help="mount REMOTE (default $MARIN_PREFIX) at MOUNTPOINT")
    m.add_argument("args", nargs="*", metavar="[REMOTE] MOUNTPOINT")
    m.add_argument("--config", help="TOML file with any of the settings below (flags win)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached (systemd, debugging)")
    # Every setting defaults to None here: "not given", so the config file and MARINFS_*
    # variables can supply it; MountConfig holds the real defaults.
    m.add_argument("--read-only", action="store_true", default=None)
    m.add_argument("--allow-other", action="store_true", default=None, help="let other users see the mount")
    m.add_argument("--uid", type=int)
    m.add_argument("--gid", type=int)
    m.add_argument("--file-mode", type=parse_mode)
    m.add_argument("--dir-mode", type=parse_mode)
    m.add_argument("--log-level", choices=LOG_LEVELS)
    m.add_argument("--log-file")
    m.add_argument("--cache-dir", type=Path)
    m.add_argument("--metadata-ttl", type=float, help="seconds a stat is trusted (5)")
    m.add_argument("--negative-ttl", type=float, help="seconds a 'does not exist' is trusted (1)")
    m.add_argument("--list-ttl", type=float, help="seconds a directory listing is trusted (--metadata-ttl)")
    m.add_argument("--list-prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="list directories ahead of lookups and walkers, object stores only (on)")
    m.add_argument("--immutable", action="append", metavar="GLOB",
                   help="paths whose objects never change once written (repeatable), e.g. 'checkpoints/*/step-*/**'")
    m.add_argument("--mount-timeout", type=float)
    m.add_argument("--drain-timeout", type=float, help="seconds unmount waits for pending commits (300)")
    m.add_argument("--commit-retry-interval", type=float, help="seconds between retries of failed commits (30)")
    m.add_argument("--connect-timeout", type=float, help="seconds to connect to the remote (30)")
    m.add_argument("--read-timeout", type=float, help="seconds a remote response may stall (120)")
    m.add_argument("--retries", type=int, help="attempts per remote call for transient errors (5)")
    m.add_argument("--chunk-size", type=parse_size, help="bytes per ranged GET and cache chunk (8M)")
    m.add_argument("--cache-size", type=parse_size, help="hard limit of the chunk cache, 0: off (20G)")
    m.add_argument("--cache-min-free", type=parse_size, help="free space to leave on the cache disk (1G)")
    m.add_argument("--prefetch-workers", type=int, help="parallel ranged GETs (8)")
    m.add_argument("--read-ahead-kb", type=int, help="kernel readahead, root only, 0: leave (1024)")
    m.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on PORT (0: off)")
    m.add_argument("--metrics-addr", help="address the metrics server binds (127.0.0.1)")
    m.add_argument("-o", "--storage-option", action="append", default=[], type=parse_storage_option,
                   metavar="KEY=VALUE", help="fsspec storage option (repeatable)")

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

    p = sub.add_parser("path", help="convert a URL under a mounted prefix to its path, and back")
    p.add_argument("arg")
    return parser


def _mount_config(ns: argparse.Namespace) -> MountConfig:
    """Settings from the config file < MARINFS_* variables < flags, then MountConfig defaults."""
    from marinfs import configfile

    if len(ns.args) > 2:
        raise UsageError("mount takes [REMOTE] MOUNTPOINT")
    flags = {k: v for k, v in vars(ns).items() if k in configfile.KEYS and v is not None}
    if ns.immutable:
        flags["immutable"] = tuple(ns.immutable)
    if ns.storage_option:
        flags["storage_options"] = {k: _storage_value(v) for k, v in ns.storage_option}
    if len(ns.args) == 2:
        flags["remote"], flags["mountpoint"] = ns.args
    elif len(ns.args) == 1:
        flags["mountpoint"] = ns.args[0]
    file = configfile.load_file(ns.config) if ns.config else {}
    values = configfile.merge(file, configfile.from_env(os.environ), flags)
    remote = values.pop("remote", None) or os.environ.get("MARIN_PREFIX", "")
    if not remote:
        raise UsageError("no REMOTE given and $MARIN_PREFIX is not set")
    mountpoint = values.pop("mountpoint", None)
    if not mountpoint:
        raise UsageError("no MOUNTPOINT given")
    values["storage_options"] = tuple(sorted(values.get("storage_options", {}).items()))
    if "cache_dir" in values:
        values["cache_dir"] = Path(values["cache_dir"]).absolute()
    if values.get("log_file"):
        values["log_file"] = os.path.abspath(values["log_file"])
    return MountConfig(remote=normalize_remote(remote), mountpoint=os.path.abspath(mountpoint),
                       foreground=ns.foreground, **values).validate()


def run(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "mount":
        cfg = _mount_config(ns)
        from marinfs import daemon

        if cfg.foreground:
            daemon.run_foreground(cfg)
        else:
            log_file = daemon.start_background(cfg)
            print(f"mounted {cfg.remote} at {cfg.mountpoint} (log: {log_file}); "
                  f"stop with: marinfs umount {cfg.mountpoint}")
        return 0
    if ns.command == "umount":
        from marinfs import configfile, daemon

        mountpoint = ns.mountpoint
        if mountpoint is None and ns.config:
            mountpoint = configfile.load_file(ns.config).get("mountpoint")
        if not mountpoint:
            raise UsageError("umount takes MOUNTPOINT (or --config FILE naming one)")
        daemon.unmount(mountpoint, timeout=ns.timeout, lazy=ns.lazy)
        return 0
    if ns.command == "status":
        from marinfs import status

        data = status.collect(ns.mountpoint)
        print(json.dumps(data, indent=2) if ns.json else status.format_status(data))
        return 0
    if ns.command == "config":
        from marinfs import configfile

        print(configfile.check(ns.file))
        return 0
    if ns.command == "cache":
        from marinfs import cachecli

        if ns.cache_command == "warm":
            if ns.workers < 1:
                raise UsageError("--workers must be >= 1")
            print(cachecli.warm(ns.paths, workers=ns.workers, quiet=ns.quiet))
            return 0
        cache_dir = (ns.cache_dir or default_cache_dir()).absolute()
        if ns.cache_command == "stats":
            data = cachecli.stats(cache_dir)
            print(json.dumps(data, indent=2) if ns.json else cachecli.format_stats(data))
        else:
            print(f"removed {cachecli.clear(cache_dir)} chunks from {cache_dir}")
        return 0
    if ns.command == "path":
        from marinfs.mounts import convert, live_mounts

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
