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
    m.add_argument("args", nargs="+", metavar="[REMOTE] MOUNTPOINT")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached (systemd, debugging)")
    m.add_argument("--read-only", action="store_true")
    m.add_argument("--allow-other", action="store_true", help="let other users see the mount")
    m.add_argument("--uid", type=int, default=os.getuid())
    m.add_argument("--gid", type=int, default=os.getgid())
    m.add_argument("--file-mode", type=parse_mode, default=0o644)
    m.add_argument("--dir-mode", type=parse_mode, default=0o755)
    m.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    m.add_argument("--log-file")
    m.add_argument("--cache-dir", type=Path, default=None)
    m.add_argument("--metadata-ttl", type=float, default=5.0, help="seconds a stat or listing is trusted")
    m.add_argument("--negative-ttl", type=float, default=1.0, help="seconds a 'does not exist' is trusted")
    m.add_argument("--list-ttl", type=float, default=None, help="seconds a directory listing is trusted (default: --metadata-ttl)")
    m.add_argument("--immutable", action="append", default=[], metavar="GLOB",
                   help="paths whose objects never change once written (repeatable), e.g. 'checkpoints/*/step-*/**'")
    m.add_argument("--mount-timeout", type=float, default=60.0)
    m.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to connect to the remote")
    m.add_argument("--read-timeout", type=float, default=120.0, help="seconds a remote response may stall")
    m.add_argument("--retries", type=int, default=5, help="attempts per remote call (transient errors)")
    m.add_argument("--chunk-size", type=parse_size, default=8 << 20, help="bytes per ranged GET and cache chunk")
    m.add_argument("--cache-size", type=parse_size, default=20 << 30, help="hard limit of the chunk cache (0: off)")
    m.add_argument("--cache-min-free", type=parse_size, default=1 << 30, help="free space to leave on the cache disk")
    m.add_argument("--prefetch-workers", type=int, default=8, help="parallel ranged GETs")
    m.add_argument("--read-ahead-kb", type=int, default=1024, help="kernel readahead (root only; 0: leave)")
    m.add_argument("-o", "--storage-option", action="append", default=[], type=parse_storage_option,
                   metavar="KEY=VALUE", help="fsspec storage option (repeatable)")

    u = sub.add_parser("umount", help="unmount and wait for the daemon to finish")
    u.add_argument("mountpoint")
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

    p = sub.add_parser("path", help="convert a URL under a mounted prefix to its path, and back")
    p.add_argument("arg")
    return parser


def _mount_config(ns: argparse.Namespace) -> MountConfig:
    if len(ns.args) > 2:
        raise UsageError("mount takes [REMOTE] MOUNTPOINT")
    if len(ns.args) == 2:
        remote, mountpoint = ns.args
    else:
        remote, mountpoint = os.environ.get("MARIN_PREFIX", ""), ns.args[0]
        if not remote:
            raise UsageError("no REMOTE given and $MARIN_PREFIX is not set")
    options = dict(json.loads(os.environ.get("MARINFS_STORAGE_OPTIONS", "{}")) if ns.foreground else {})
    options.update((k, _storage_value(v)) for k, v in ns.storage_option)
    return MountConfig(
        remote=normalize_remote(remote), mountpoint=os.path.abspath(mountpoint),
        read_only=ns.read_only, allow_other=ns.allow_other, uid=ns.uid, gid=ns.gid,
        file_mode=ns.file_mode, dir_mode=ns.dir_mode, log_level=ns.log_level,
        log_file=os.path.abspath(ns.log_file) if ns.log_file else None, foreground=ns.foreground,
        cache_dir=(ns.cache_dir or default_cache_dir()).absolute(), metadata_ttl=ns.metadata_ttl,
        negative_ttl=ns.negative_ttl, list_ttl=ns.list_ttl, immutable=tuple(ns.immutable),
        mount_timeout=ns.mount_timeout,
        connect_timeout=ns.connect_timeout, read_timeout=ns.read_timeout, retries=ns.retries,
        chunk_size=ns.chunk_size, cache_size=ns.cache_size, cache_min_free=ns.cache_min_free,
        prefetch_workers=ns.prefetch_workers, read_ahead_kb=ns.read_ahead_kb,
        storage_options=tuple(sorted(options.items())),
    ).validate()


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
        from marinfs import daemon

        daemon.unmount(ns.mountpoint, timeout=ns.timeout, lazy=ns.lazy)
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
