"""Real mounts for tests: a subprocess daemon (what users run) and an in-process one (fast).

Every mount is unmounted on exit, even when the test failed: a stale FUSE mount hangs
anything that touches it. Only processes we started are stopped, by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

import tiers

MARINFS = [sys.executable, "-m", "marinfs"]


@dataclass
class Mounted:
    """A live mount plus a direct fsspec client of the same prefix, to check what the remote holds."""

    mnt: Path
    url: str
    fs: Any
    root: str
    cache_dir: Path
    pid: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Called with an object's remote path and bytes once put_remote stored it: conftest's
    # shared-tier variant has another node read it (and check it) into the tier, so the mount
    # then reads it from there.
    warm: Callable[[str, bytes], None] | None = None

    def remote_path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def remote_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.remote_path(rel))

    def remote_exists(self, rel: str) -> bool:
        return self.fs.exists(self.remote_path(rel))

    def put_remote(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self.remote_path(rel), data)
        if self.warm is not None:
            self.warm(self.remote_path(rel), data)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made 0700; root only: skips the test if the mount
    is refused), lazily unmounted after, also if the test stacked mounts on it."""
    import pytest

    path.mkdir(mode=0o700, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        for _ in range(3):
            if not os.path.ismount(path):
                break
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def weed_mount(filer: str, path: str, where: Path, work: Path) -> Iterator[Path]:
    """``weed mount`` (SeaweedFS's FUSE client of its filer) of the filer directory ``path`` at
    ``where``: two of one directory stand for a filesystem two nodes mount (NFS). ``filer``:
    ``S3Server.filer()``; ``work`` holds its chunk cache, socket and log. Unmounted after
    (fusermount3, lazily if busy), its process waited for and killed by PID if it stays."""
    tiers.check("mount FUSE (weed mount)")
    from servers import weed_binary

    where.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "weed-mount.log", "ab")
    proc = subprocess.Popen(
        [str(weed_binary()), f"-logdir={work}", "mount", f"-filer={filer}", f"-filer.path={path}", f"-dir={where}",
         f"-cacheDir={work / 'cache'}", f"-localSocket={work / 'w.sock'}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not fuse_connections(where):  # (mountinfo: a stat of a mount coming up may hang)
            if proc.poll() is not None:
                raise AssertionError(f"weed mount exited {proc.returncode}: "
                                     f"{(work / 'weed-mount.log').read_text(errors='replace')[-2000:]}")
            assert time.monotonic() < deadline, "weed mount not up after 60 s"
            time.sleep(0.05)
        yield where
    finally:
        force_unmount(where)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()


def force_unmount(mnt: Path) -> None:
    """Unmount, lazily if busy; never leaves a mount behind (a killed daemon's too, whose
    mountpoint no stat answers: os.path.ismount says False there)."""
    def mounted() -> bool:
        return os.path.ismount(mnt) or bool(fuse_connections(Path(os.path.realpath(mnt))))

    for args in (["-u"], ["-u", "-z"]):
        if not mounted():
            return
        subprocess.run(["fusermount3", *args, str(mnt)], capture_output=True, timeout=60)
        for _ in range(100):
            if not mounted():
                return
            time.sleep(0.05)


def _mountinfo_path(field: str) -> str:
    """A path as /proc/self/mountinfo spells it: space, tab, newline and backslash in octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def fuse_connections(mnt: Path) -> list[int]:
    """The FUSE connection numbers (the device's minor) of the mounts at ``mnt``, read from
    /proc/self/mountinfo: never a stat of ``mnt``, which may hang on a wedged daemon."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1].startswith("fuse") and _mountinfo_path(fields[4]) == str(mnt):
                found.append(int(fields[2].split(":")[1]))
    return found


def abort_fuse(mnt: Path) -> bool:
    """Free every process waiting on the FUSE mounts at ``mnt`` (state D, beyond SIGKILL) by
    writing 1 to their connections' ``abort`` file: every pending and later request fails with
    ENOTCONN, so the daemon, its callers and ``fusermount3 -u`` return. The control filesystem
    (fusectl) is mounted in a directory of our own for that, and unmounted after."""
    conns = fuse_connections(mnt)
    if not conns:
        return False
    ctl = Path(tempfile.mkdtemp(prefix="fusectl-"))
    try:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(ctl)], check=True, capture_output=True,
                       timeout=30)
        try:
            for conn in conns:
                with contextlib.suppress(OSError):
                    (ctl / str(conn) / "abort").write_text("1")
        finally:
            subprocess.run(["umount", str(ctl)], capture_output=True, timeout=30)
    finally:
        with contextlib.suppress(OSError):
            ctl.rmdir()
    return True


@contextlib.contextmanager
def freed_if_wedged(mnt: Path, after: float = 30.0) -> Iterator[None]:
    """For tests of mounts that may deadlock (a mount serving itself): after ``after`` seconds,
    or at the end if a mount is still at ``mnt``, its FUSE connection is aborted and the mount
    detached, so a wedged daemon never hangs the test run. Paths are not stat-ed here."""
    timer = threading.Timer(after, abort_fuse, (mnt,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if fuse_connections(mnt):
            abort_fuse(mnt)
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, timeout=60)


def _running(pid: int) -> bool:
    """Alive and not a zombie: an exited daemon is no longer our child, so whoever adopted it
    (PID 1 in a container may reap only now and then) decides when it disappears."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _stop_pid(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def subprocess_mount(url: str, mnt: Path, cache_dir: Path | None, *extra: str,
                     env: dict[str, str] | None = None, storage_options: dict | None = None,
                     ) -> Iterator[int]:
    """``marinfs mount`` exactly as a user runs it (background); yields the daemon PID.
    ``cache_dir`` None: no ``--cache-dir``, the mount's default one."""
    tiers.check("mount FUSE (subprocess_mount)")
    mnt.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    args = [*MARINFS, "mount", url, str(mnt), *(["--cache-dir", str(cache_dir)] if cache_dir else []), *extra]
    for key, value in (storage_options or {}).items():
        args += ["-o", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    result = subprocess.run(args, capture_output=True, text=True, env=full_env, timeout=120)
    try:
        assert result.returncode == 0, f"mount failed: {result.stderr}"
        assert os.path.ismount(mnt)
        pid = daemon_pid(mnt)
        try:
            yield pid
        finally:
            unmount(mnt)
            force_unmount(mnt)
            _stop_pid(pid)
    finally:
        force_unmount(mnt)


def unmount(mnt: Path, timeout: float = 60) -> None:
    """What ``marinfs umount MNT`` does (unmount, wait for the daemon to finish), run here: a
    ``marinfs umount`` process would cost every mount another interpreter start. The command
    itself is tested in test_cli.py and wherever a test runs it on purpose."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from marinfs.app.daemon import unmount as marinfs_unmount
    from marinfs.errors import MarinfsError

    with contextlib.suppress(MarinfsError, OSError):  # what is left: force_unmount, _stop_pid
        marinfs_unmount(str(mnt), timeout=timeout)


def daemon_pid(mnt: Path) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from marinfs.app.daemon import state_file

    return int(json.loads(state_file(str(mnt)).read_text())["pid"])


@contextlib.contextmanager
def inprocess_mount(url: str, mnt: Path, cache_dir: Path, storage_options: dict | None = None,
                    cache_size: int = 0, chunk_size: int = 8 << 20, metadata_ttl: float = 5.0,
                    negative_ttl: float = 1.0, list_ttl: float | None = None,
                    immutable: tuple[str, ...] = (), shared_dir: Path | None = None,
                    **fs_kwargs: Any) -> Iterator[Any]:
    """Serve the mount from a thread of this process; yields the core Filesystem (whose
    ``remote.stats`` and ``fetcher.cache`` count what the test's syscalls caused). With
    ``cache_size`` the mount has an on-disk chunk cache in ``cache_dir``; with ``shared_dir``
    a shared chunk tier there, as ``--shared-cache-dir`` gives the daemon (its default limits)."""
    tiers.check("mount FUSE (inprocess_mount)")
    from marinfs.read.chunkcache import ChunkCache
    from marinfs.config.mount import MountConfig
    from marinfs.core import Filesystem
    from marinfs.fuse.ops import FuseAdapter, serve
    from marinfs.meta.metadata import MetadataCache
    from marinfs.read.reader import ChunkFetcher
    from marinfs.read.sharedcache import SharedTier, check_private
    from marinfs.remote import Remote

    mnt.mkdir(parents=True, exist_ok=True)
    remote = Remote(url, storage_options)
    cache = ChunkCache(cache_dir, cache_size, chunk_size=chunk_size) if cache_size else None
    shared = None
    if shared_dir is not None:
        check_private(shared_dir)
        shared = SharedTier(shared_dir, MountConfig.shared_cache_size, lease_ttl=MountConfig.shared_cache_lease)
    fetcher = ChunkFetcher(remote.read_range, cache, chunk_size=chunk_size, fetch_into=remote.read_into,
                           shared=shared)
    fs = Filesystem(remote, staging_dir=cache_dir / "staging", fetcher=fetcher,
                    metadata=MetadataCache(ttl=metadata_ttl, negative_ttl=negative_ttl, list_ttl=list_ttl,
                                           immutable=immutable),
                    **fs_kwargs)
    adapter = FuseAdapter(fs, os.getuid(), os.getgid(), 0o644, 0o755)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            serve(adapter, str(mnt), fsname=url, read_only=fs.read_only, allow_other=False,
                  attr_timeout=min(metadata_ttl, 1.0), negative_timeout=min(negative_ttl, 1.0),
                  inode_ttl=MountConfig.inode_ttl)
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    thread = threading.Thread(target=run, name=f"fuse-{mnt.name}", daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if os.path.ismount(mnt) or errors:
                break
            time.sleep(0.025)
        assert os.path.ismount(mnt), f"in-process mount failed: {errors}"
        yield fs
    finally:
        force_unmount(mnt)
        thread.join(timeout=30)
        fs.close()  # as the daemon ends: the fetcher, the cache and the remote (its directory records flushed)
        # libfuse replaced the process's signal handlers; give Ctrl-C back to pytest.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)


def fsspec_client(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **(storage_options or {}))
    return fs, root.rstrip("/")


def remote_find(fs: Any, path: str, **kwargs: Any) -> Any:
    """``fs.find`` as another client sees it. fsspec's memory store is one dict shared by
    every instance, and its find iterates it while a mount's own threads (the directory
    record's flusher) write to it: "dictionary changed size during iteration" now and then,
    which says nothing of what is stored. Asked again then."""
    for attempt in range(10):
        try:
            return fs.find(path, **kwargs)
        except RuntimeError:
            if attempt == 9:
                raise
            time.sleep(0.02)
    raise AssertionError("unreachable")


def daemon_ended(*filesystems: Any) -> None:
    """Those daemons ended (or were killed): their spare-making threads stop, as a dead daemon's
    would. Else a next start's sweep of the same staging directory races an earlier Filesystem's
    thread: a journal swept between its two files leaves an empty staging file no journal
    describes (a clean-clone CI run saw one)."""
    for fs in filesystems:
        fs.writes.spares.close()


def staging_entries(staging: Path, pattern: str = "*") -> list[Path]:
    """The staging directory's entries matching ``pattern``, but the daemon's spares
    (marinfs/write/spares.py): an empty staging file with an empty journal, made ahead of the
    creates that take them, holds nobody's bytes."""
    if not staging.is_dir():
        return []
    found = sorted(staging.glob(pattern))
    spares = set()
    for journal in staging.glob("*.journal.json"):  # (a spare's journal is made first)
        data = journal.with_name(journal.name.removesuffix(".journal.json"))
        try:
            if journal.stat().st_size == 0 and (not data.exists() or data.stat().st_size == 0):
                spares |= {journal, data}
        except FileNotFoundError:
            continue
    return [p for p in found if p not in spares and p.exists()]
