"""Mount lifecycle: checks, foreground serving, background start, unmount."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from marinfs.read.chunkcache import acquire_lock, staging_dir, stats_file
from marinfs.config.mount import SETTINGS, MountConfig, cache_root
from marinfs.errors import MountError, UsageError
from marinfs.app.mounts import live_mounts
from marinfs.app.notify import sd_notify
from marinfs.config.settings import CHILD, ENV
from marinfs import stopsignals
from marinfs.threadnames import start_thread

log = logging.getLogger(__name__)
LOG_FORMAT = "marinfs[%(process)d] %(levelname)s %(name)s: %(message)s"


def runtime_dir() -> Path:
    if os.geteuid() == 0:
        base = Path("/run/marinfs")
    else:
        base = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/marinfs-{os.getuid()}") / "marinfs"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    return base


def state_file(mountpoint: str) -> Path:
    digest = hashlib.sha1(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return runtime_dir() / f"mount-{digest}.json"


def check_mountpoint(mountpoint: str) -> None:
    try:
        os.statvfs(mountpoint)  # not cached by the kernel, unlike a stat of the mount's root
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:  # a FUSE mount whose daemon died (killed, out of memory)
            raise UsageError(f"{mountpoint} is a mount whose daemon is gone (transport endpoint is not "
                             f"connected): `marinfs umount --lazy {mountpoint}` frees it") from None
    if not os.path.lexists(mountpoint):
        raise UsageError(f"mountpoint {mountpoint} does not exist")
    if os.path.ismount(mountpoint):
        raise UsageError(f"{mountpoint} is already a mount point")
    if not os.path.isdir(mountpoint):
        raise UsageError(f"mountpoint {mountpoint} is not a directory")


def check_empty(mountpoint: str, allow_non_empty: bool) -> None:
    """A mount hides what its mountpoint holds: refused, as rclone refuses it, unless asked for
    (then said in the log). Users otherwise met files gone without a word."""
    try:
        names = sorted(os.listdir(mountpoint))
    except OSError:
        return  # unreadable: FUSE itself says whatever is wrong
    if not names:
        return
    what = f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}, such as {names[0]!r}"
    if not allow_non_empty:
        raise UsageError(f"mountpoint {mountpoint} is not empty ({what}): the mount would hide them; "
                         f"empty it, or pass --allow-non-empty")
    log.warning("mountpoint %s is not empty (%s): hidden while mounted (--allow-non-empty)", mountpoint, what)


def check_overlap(remote: str, mountpoint: str) -> None:
    """A local remote must lie apart from its mountpoint. The same directory, a remote inside
    the mountpoint or the mountpoint inside the remote: the daemon would serve the mount from
    the mount itself, each op calling back into its own FUSE connection until libfuse's threads
    are all waiting on each other (the first ``ls`` in state D, unkillable; issue 37)."""
    if "://" in remote:  # an object store or another fsspec URL (local ones are paths by now)
        return
    real_remote, real_mount = os.path.realpath(remote), os.path.realpath(mountpoint)
    if real_remote == real_mount:
        where = f"REMOTE {remote} is the mountpoint {mountpoint} itself"
    elif real_remote.startswith(real_mount.rstrip("/") + "/"):
        where = f"REMOTE {remote} is inside the mountpoint {mountpoint}"
    elif real_mount.startswith(real_remote.rstrip("/") + "/"):
        where = f"the mountpoint {mountpoint} is inside REMOTE {remote}"
    else:
        return
    raise UsageError(f"{where}: the daemon would call into its own mount and hang; "
                     f"mount a directory outside the mountpoint")


def check_shared_dir(cfg: MountConfig) -> None:
    """The shared tier's directory (--shared-cache-dir): made 0700 if missing, refused with one
    line if another user owns it or others can write it (they could feed every node bytes), or
    if it lies inside the mountpoint (the daemon would read its own mount)."""
    if cfg.shared_cache_dir is None:
        return
    from marinfs.read.sharedcache import check_private

    shared, mount = os.path.realpath(cfg.shared_cache_dir), os.path.realpath(cfg.mountpoint)
    if shared == mount or shared.startswith(mount.rstrip("/") + "/"):
        raise UsageError(f"--shared-cache-dir {cfg.shared_cache_dir} is inside the mountpoint {cfg.mountpoint}")
    check_private(Path(cfg.shared_cache_dir))


def setup_logging(level: str, log_file: str | None) -> None:
    handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The binding logs every ENOENT at debug; keep it quiet unless debugging marinfs itself.
    logging.getLogger("fuse").setLevel(logging.WARNING if level != "debug" else logging.DEBUG)


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Few glibc malloc arenas (default 8 per core). Every fetch thread allocating 8 MiB chunks
    in an arena of its own keeps the freed ones there, unused by the other threads: with 8
    parallel readers the daemon's peak RSS was 333 MiB with the default, 263 with 2 arenas, at
    the same CPU. Takes effect only before threads have made arenas: call it first."""
    try:
        ctypes.CDLL(None).mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


def raise_open_files_limit() -> None:
    """The soft limit of open files up to the hard one (as Go programs, rclone among them, do at
    start): a write-back mount keeps a descriptor per staged file, thousands during a `tar -x`,
    past systemd's soft default of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20),
                                                        hard))
        except (ValueError, OSError) as exc:
            log.debug("open files limit stays %d: %s", soft, exc)


def build_filesystem(cfg: MountConfig):  # -> Filesystem, kept lazy so the CLI starts fast
    limit_malloc_arenas()
    from marinfs.read.chunkcache import ChunkCache
    from marinfs.core import Filesystem
    from marinfs.meta.metadata import MetadataCache
    from marinfs.read.reader import ChunkFetcher
    from marinfs.remote import Remote

    remote = Remote(cfg.remote, dict(cfg.storage_options), cfg.remote_settings())
    remote.check()
    cfg.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(cfg.cache_dir, 0o700)
    cache = (ChunkCache(cfg.cache_dir, cfg.cache_size, cfg.cache_min_free, chunk_size=cfg.chunk_size)
             if cfg.cache_size else None)
    if cache is None:  # the directory still holds staged writes: one daemon, as with a cache
        acquire_lock(cfg.cache_dir)  # held (its descriptor open) until the process exits
    warn_of_shared_default(cfg.cache_dir)
    # One memory budget for the whole mount, whatever the number of readers: chunks fetched
    # ahead wait in it until read. The fetches in flight and half as many again keep the
    # workers busy for one reader (96 MiB by default); more readers share it (their windows
    # shrink) instead of multiplying it.
    budget = min(cfg.max_readahead_chunks + cfg.prefetch_workers, 3 * cfg.prefetch_workers // 2) * cfg.chunk_size
    shared = None
    if cfg.shared_cache_dir is not None:
        from marinfs.read.sharedcache import SharedTier, check_private

        check_private(Path(cfg.shared_cache_dir))
        shared = SharedTier(Path(cfg.shared_cache_dir), cfg.shared_cache_size, lease_ttl=cfg.shared_cache_lease,
                            workers=cfg.prefetch_workers)
    fetcher = ChunkFetcher(remote.read_buffer, cache, chunk_size=cfg.chunk_size,
                           workers=cfg.prefetch_workers, memory_bytes=max(4 * cfg.chunk_size, budget),
                           fetch_into=remote.read_into if cfg.fetch_into else None, shared=shared)
    metadata = MetadataCache(ttl=cfg.metadata_ttl, negative_ttl=cfg.negative_ttl, list_ttl=cfg.list_ttl,
                             immutable=cfg.immutable)
    fs = Filesystem(remote, staging_dir=staging_dir(cfg.cache_dir), metadata=metadata,
                    read_only=cfg.read_only, fetcher=fetcher,
                    max_readahead_chunks=cfg.max_readahead_chunks, drain_timeout=cfg.drain_timeout,
                    max_file_size=cfg.max_file_size, write_back=cfg.write_back,
                    write_back_uploads=cfg.write_back_uploads, write_back_delay=cfg.write_back_delay,
                    commit_markers=cfg.commit_markers, write_back_hold=cfg.write_back_hold,
                    write_back_max_bytes=cfg.write_back_max_bytes, write_back_paths=cfg.write_back_paths,
                    list_prefetch=cfg.list_prefetch and remote.object_store,
                    file_mode=cfg.file_mode, dir_mode=cfg.dir_mode, uid=cfg.uid, gid=cfg.gid)
    fs.finish_renames()  # directory renames an earlier run left midway
    fs.recover_staged(at_start=True)  # what an earlier run staged but never committed
    fs.send_kept_attributes()  # attributes an earlier run held back and never sent (after the commits)
    return fs


def warn_of_shared_default(cache_dir: Path) -> None:
    """Before each mount had a default cache directory of its own, they all used cache_root()
    itself: staged writes a daemon of that time left there are committed only by a mount with
    ``--cache-dir`` set to it. Say so once, at start."""
    root = cache_root()
    if cache_dir.parent == root and any((root / "staging").glob("*.journal.json")):
        log.warning("%s holds writes staged by an earlier marinfs that used it for every mount; "
                    "mount once with --cache-dir %s to commit them", root / "staging", root)


def write_stats(fs, cfg: MountConfig, started: float, stopped: bool = False) -> None:  # noqa: ANN001 - Filesystem
    """Publish the daemon's counters for `marinfs cache stats` (atomically, 0600); ``stopped``:
    the last figures, once unmounted and drained (`marinfs umount` reads what is left behind)."""
    data = {"pid": os.getpid(), "remote": cfg.remote, "mountpoint": cfg.mountpoint, "published": time.time(),
            "uptime_s": round(time.monotonic() - started, 1), "stopped": stopped, **fs.stats(),
            **fetcher_stats(fs.fetcher)}
    path = stats_file(cfg.cache_dir)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def fetcher_stats(fetcher) -> dict:  # noqa: ANN001 - a ChunkFetcher
    """Chunk bytes by source and the shared tier's state (which Filesystem.stats does not carry)."""
    shared = getattr(fetcher, "shared", None)
    return {"sources": fetcher.sources(), "shared": shared.snapshot() if shared is not None else None}


# A mount with no read for this long gives its chunk memory and pooled buffers back (up to the
# budget plus ~100 MiB otherwise stay mapped on every node after one big read).
MEMORY_IDLE_SECONDS = 30.0


def _watch_mount(fs, cfg: MountConfig, stop: threading.Event, live: threading.Event) -> None:  # noqa: ANN001
    """Once the mount is live: raise the kernel readahead (root), then publish stats."""
    started = time.monotonic()
    while not stop.is_set() and not os.path.ismount(cfg.mountpoint):
        if time.monotonic() - started > cfg.mount_timeout:
            return
        time.sleep(0.02)
    if stop.is_set():
        return
    live.set()
    try:
        write_stats(fs, cfg, started)  # at once: `marinfs status` right after the mount has figures
    except OSError as exc:
        log.debug("cannot write stats: %s", exc)
    sd_notify(f"READY=1\nSTATUS=mounted {cfg.remote} at {cfg.mountpoint}")
    if cfg.read_ahead_kb:
        set_read_ahead(cfg.mountpoint, cfg.read_ahead_kb)
    start_thread(_retry_commits, "marinfs-retry", fs, cfg, stop)
    trimmed = False
    while not stop.wait(2.0):
        try:
            write_stats(fs, cfg, started)
        except OSError as exc:
            log.debug("cannot write stats: %s", exc)
        quiet = fs.fetcher.trim_idle(MEMORY_IDLE_SECONDS)
        if quiet and not trimmed:
            log.debug("no read for %.0f s: chunk memory and idle buffers given back", MEMORY_IDLE_SECONDS)
        trimmed = quiet


def _retry_commits(fs, cfg: MountConfig, stop: threading.Event) -> None:  # noqa: ANN001 - Filesystem
    """Commit again what failed, every --commit-retry-interval, on a thread of its own: a pass
    over many files while the store is down takes their timeouts one after the other, and the
    stats `marinfs status` and `marinfs sync` read must not stop meanwhile (they did)."""
    last_retry = time.monotonic()
    while not stop.wait(min(2.0, max(cfg.commit_retry_interval, 0.1))):
        if fs.writes.failing() and time.monotonic() - last_retry >= cfg.commit_retry_interval:
            last_retry = time.monotonic()
            try:
                fs.retry_failed_commits()
            except Exception:  # noqa: BLE001 - the retry loop must live on
                log.exception("the commit retry pass failed")


def set_read_ahead(mountpoint: str, kib: int) -> None:
    """Larger kernel readahead makes the kernel send 1 MiB reads instead of 128 KiB ones."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(kib))
        log.info("kernel readahead of %s set to %d KiB", mountpoint, kib)
    except OSError as exc:
        log.info("kernel readahead of %s left as is (%s)", mountpoint, exc.strerror)


def effective_settings(cfg: MountConfig) -> dict[str, object]:
    """What this daemon runs with, for `marinfs status --json` (storage options: names only)."""
    return {s.name: s.to_json(getattr(cfg, s.name)) for s in SETTINGS}


def run_foreground(cfg: MountConfig) -> None:
    """Check everything, then serve the mount until it is unmounted or signalled."""
    stopsignals.leave_to_main_thread()
    setup_logging(cfg.log_level, cfg.log_file)
    raise_open_files_limit()
    check_mountpoint(cfg.mountpoint)
    check_overlap(cfg.remote, cfg.mountpoint)
    check_empty(cfg.mountpoint, cfg.allow_non_empty)
    check_shared_dir(cfg)
    fs = build_filesystem(cfg)
    from marinfs.fuse.ops import FuseAdapter, serve

    adapter = FuseAdapter(fs, cfg.uid, cfg.gid, cfg.file_mode, cfg.dir_mode, passthrough=cfg.passthrough)
    if cfg.metrics_port:
        from marinfs.app.metrics import Metrics

        adapter.metrics = Metrics(fs)
        try:
            adapter.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        except OSError as exc:  # taken, not an address of this machine, a name that does not resolve
            fs.close()
            raise UsageError(f"--metrics-addr {cfg.metrics_addr} --metrics-port {cfg.metrics_port}: cannot serve "
                             f"metrics there ({exc.strerror or exc})") from None
        log.info("metrics on http://%s:%d/metrics", cfg.metrics_addr, cfg.metrics_port)
    state = state_file(cfg.mountpoint)
    state.write_text(json.dumps({"pid": os.getpid(), "remote": cfg.remote, "mountpoint": cfg.mountpoint,
                                 "log_file": cfg.log_file, "cache_dir": str(cfg.cache_dir),
                                 "started": time.time(), "settings": effective_settings(cfg)}))
    adapter.on_destroy = lambda: sd_notify("STOPPING=1")  # unmounting: draining begins
    log.info("mounting %s at %s", cfg.remote, cfg.mountpoint)
    stop, live = threading.Event(), threading.Event()
    # Live from the kernel's INIT on: a stop signal from then on is a normal stop (exit 0), even
    # before the stats loop has seen the mount (it looks every 20 ms).
    adapter.on_init = live.set
    start_thread(_watch_mount, "marinfs-watch", fs, cfg, stop, live)
    start_thread(fs.remote.warm, "warm")
    try:
        serve(adapter, cfg.mountpoint, fsname=cfg.remote, read_only=cfg.read_only,
              allow_other=cfg.allow_other, attr_timeout=min(cfg.metadata_ttl, 1.0),
              negative_timeout=min(cfg.negative_ttl, 1.0), inode_ttl=cfg.inode_ttl)
    except RuntimeError as exc:
        # libfuse answers 8 when its loop ended on a signal (SIGTERM from systemd or kill):
        # that is a normal stop once the mount was live. Anything else is a failed mount.
        if not (live.is_set() and str(exc) == "8"):
            raise MountError(f"FUSE could not mount {cfg.mountpoint} (libfuse said {exc})") from None
    finally:
        stop.set()
        state.unlink(missing_ok=True)
        fs.close()
        try:
            write_stats(fs, cfg, time.monotonic(), stopped=True)
        except OSError:
            pass
    log.info("unmounted %s", cfg.mountpoint)
    left = left_behind(fs.upload_status(), cfg.cache_dir)
    if left:
        log.error("%s", left)
    if not fs.drained:
        # Commits still hang on the remote; their journals are on disk. Do not let Python's
        # exit wait for the upload threads: the drain timeout is the bound we promised.
        logging.shutdown()
        os._exit(0)


def start_background(cfg: MountConfig) -> Path:
    """Start a foreground daemon detached from us; return once the mount is live."""
    check_mountpoint(cfg.mountpoint)
    check_overlap(cfg.remote, cfg.mountpoint)
    check_empty(cfg.mountpoint, cfg.allow_non_empty)
    check_shared_dir(cfg)
    # The remote (URL, bucket, endpoint, credentials) is checked once, by the daemon before it
    # mounts: checking it here too cost every mount a second import of s3fs or gcsfs (1-4 s)
    # and a second request. Bad input still fails with its one line and exit code 2 (below).
    log_file = Path(cfg.log_file) if cfg.log_file else state_file(cfg.mountpoint).with_suffix(".log")
    argv, env = child_command(cfg, os.environ)
    with open(log_file, "ab") as out:
        os.chmod(log_file, 0o600)
        start = out.tell()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + cfg.mount_timeout
    while time.monotonic() < deadline:
        if os.path.ismount(cfg.mountpoint):
            return log_file
        if proc.poll() is not None:
            reason = _failure_reason(log_file, start)
            if proc.returncode == 2 and reason:  # bad input, as the daemon found it
                raise UsageError(reason)
            raise MountError(reason or f"the daemon exited with code {proc.returncode}; see {log_file}")
        time.sleep(0.05)
    proc.terminate()
    raise MountError(f"{cfg.mountpoint} was not mounted within {cfg.mount_timeout:g} s; see {log_file}")


def child_command(cfg: MountConfig, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The foreground daemon's argv and environment, from the settings table: every setting
    reaches the child, and only from us (our MARINFS_* settings are not inherited, so the child
    sees exactly this config). Storage options go by environment, never the command line."""
    argv = [sys.executable, "-m", "marinfs", "mount"]
    argv += [arg for s in SETTINGS if s.positional for arg in s.to_args(getattr(cfg, s.name))]
    argv.append("--foreground")
    ours = {s.env_name for s in SETTINGS if s.allows(ENV)}
    env = {k: v for k, v in environ.items() if k not in ours}
    for s in SETTINGS:
        if s.positional or not s.allows(CHILD):
            continue
        value = getattr(cfg, s.name)
        if s.child_env:
            env[s.env_name] = s.to_text(value)
        else:
            argv += s.to_args(value)
    return argv, env


def _failure_reason(log_file: Path, start: int) -> str | None:
    with open(log_file, "rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        if line.startswith("marinfs: error: "):
            return line[len("marinfs: error: "):]
    for line in reversed(lines):
        if line.strip().startswith("fuse:") or "fusermount" in line:
            return line.strip()
    return None


def left_behind(uploads: Mapping[str, list], cache_dir: str | Path) -> str | None:
    """One line naming the files a stopped daemon leaves uncommitted (their bytes kept in the
    cache directory's staging area), or None when it leaves nothing."""
    failed, pending = list(uploads.get("failed") or []), list(uploads.get("pending") or [])
    if not failed and not pending:
        return None
    what = [f"{f['key']} ({'never retried' if f.get('retry') == 'never' else 'retried at the next start'}"
            f"{': ' + f['error'] if f.get('error') else ''})" for f in failed]
    what += [f"{key} (pending, committed at the next start)" for key in pending]
    n = len(what)
    shown = "; ".join(what[:5]) + (f"; and {n - 5} more" if n > 5 else "")
    return (f"{n} file{'s' if n != 1 else ''} left uncommitted, the bytes kept in {Path(cache_dir) / 'staging'} "
            f"(`marinfs status` of the next mount on that cache directory lists them): {shown}")


def unmount(mountpoint: str, timeout: float = 60.0, lazy: bool = False) -> None:
    """Unmount a marinfs mount and wait for its daemon to finish (it commits what is open).
    A daemon that leaves files uncommitted makes this fail (MountError) with one line saying
    which and where their bytes are, though the mount is gone."""
    mountpoint = os.path.abspath(mountpoint)
    if mountpoint not in {e.mountpoint for e in live_mounts()}:
        raise UsageError(f"{mountpoint} is not a marinfs mount")
    pid, cache_dir = None, None
    state = state_file(mountpoint)
    if state.exists():
        info = json.loads(state.read_text())
        pid, cache_dir = info.get("pid"), info.get("cache_dir")
    was_alive = bool(pid) and alive(pid)  # a killed daemon's figures are stale
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
    result = subprocess.run([tool, "-u", *(["-z"] if lazy else []), mountpoint],
                            capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise MountError(f"cannot unmount {mountpoint}: {reason}")
    if pid:
        deadline = time.monotonic() + timeout
        while alive(pid):
            if time.monotonic() > deadline:
                raise MountError(f"{mountpoint} is unmounted but daemon {pid} is still running")
            time.sleep(0.05)
    if was_alive and cache_dir:
        try:
            published = json.loads(stats_file(Path(cache_dir)).read_text())
        except (OSError, ValueError):
            return
        if published.get("pid") == pid and published.get("stopped"):
            left = left_behind(published.get("uploads") or {}, cache_dir)
            if left:
                raise MountError(f"unmounted {mountpoint}, but {left}")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False

