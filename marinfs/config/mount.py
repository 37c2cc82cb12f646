"""Mount configuration: one frozen dataclass whose fields are the settings table (settings.py).

Each field's default is the only place that default is written (the rows a remote is told take
theirs from RemoteSettings, remote/settings.py); flags, the TOML file, MARINFS_* variables,
fstab options, the background child and docs/usage.md read it from here.

``python -m marinfs.config.mount > table.md`` prints docs/usage.md's settings table.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from marinfs.errors import UsageError
from marinfs.remote.settings import RemoteSettings
from marinfs.config.settings import (ADDRESS, BOOL, CHILD, CHOICE, DIR, ENV, FLAG, GLOBS, INT, LOG_LEVELS, MODE, OPTIONS,
                              PATH, REMOTE, SECONDS, SIZE, TOML, Bad, Setting, markdown_table, normalize_remote,
                              parse_mode, parse_size, parse_storage_option, setting, table)

def cache_root() -> Path:
    """Where default cache directories live: /var/cache/marinfs for root, else the XDG cache dir."""
    if os.geteuid() == 0:
        return Path("/var/cache/marinfs")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "marinfs"


def default_cache_dir(remote: str, mountpoint: str) -> Path:
    """The cache directory of one mount when none is given: its own, under cache_root(), named
    after the remote and the mountpoint (readable) and a hash of both (unique), so any number
    of mounts with default settings work side by side (one daemon per cache directory) and a
    mount finds its own cache, and what it staged, again after a restart."""
    key = f"{remote}\0{os.path.abspath(mountpoint)}"
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{remote}/{mountpoint}").strip("_.")[:80]
    return cache_root() / f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# uid_t and gid_t are 32 bits, and (uid_t) -1 means "unchanged" to chown(2): never an owner.
UID_MAX = 2**32 - 2

_NOT_FSTAB = frozenset({FLAG, TOML, ENV, CHILD})  # a list or table has no place in a comma-separated -o
_ENV_ONLY = frozenset({ENV, CHILD})  # MARINFS_<KEY> only; a background daemon gets it by environment
_REMOTE = RemoteSettings()  # the defaults of the rows remote_settings() passes on


@dataclass(frozen=True)
class MountConfig:
    """Everything one mount needs: the settings table. Build it from flags, then call validate()."""

    remote: str = setting(
        kind=REMOTE, positional=True, doc_default="`$MARIN_PREFIX`",
        help="what to mount: an fsspec URL (gs://, s3://, memory://) or a local path")
    mountpoint: str = setting(kind=PATH, positional=True, help="an existing directory, where the remote appears")
    foreground: bool = setting(
        False, kind=BOOL, short="-f", routes=frozenset({FLAG}),
        help="stay attached (systemd, debugging); Ctrl-C unmounts")
    read_only: bool = setting(False, kind=BOOL, fstab_aliases={"ro": True, "rw": False},
                              help="every write fails with EROFS")
    allow_other: bool = setting(
        False, kind=BOOL, help="let other users see the mount",
        doc="let other users use the mount (adds `default_permissions`; non-root needs "
            "`user_allow_other` in `/etc/fuse.conf`)")
    allow_non_empty: bool = setting(
        False, kind=BOOL, fstab_aliases={"nonempty": True},
        help="mount over a directory that holds files (hidden while mounted)",
        doc="mount over a directory that holds files: they are hidden, untouched, while mounted "
            "(rclone's `--allow-non-empty`, libfuse 2's `nonempty`); without it such a mount is refused "
            "with one line")
    uid: int = setting(factory=os.getuid, kind=INT, low=0, high=UID_MAX, doc_default="the mounting user",
                       help="owner shown for every file and directory")
    gid: int = setting(factory=os.getgid, kind=INT, low=0, high=UID_MAX, doc_default="the mounting user's group",
                       help="group shown for every file and directory")
    file_mode: int = setting(
        0o644, kind=MODE, low=0, high=0o777, help="permissions shown for files (octal)",
        doc="permissions shown for files (octal, up to `0777`: setuid, setgid or sticky on every file is "
            "never meant; `chmod` of one file still keeps its own)")
    dir_mode: int = setting(0o755, kind=MODE, low=0, high=0o7777, help="permissions shown for directories (octal)")
    log_level: str = setting("info", kind=CHOICE, choices=LOG_LEVELS, help="debug, info, warning or error")
    log_file: str | None = setting(
        None, kind=PATH, help="where the daemon logs",
        doc_default="stderr with `--foreground` (the journal under systemd), else `mount-<id>.log` "
                    "in the runtime directory (see above)")
    # None until __post_init__: the default depends on the remote and the mountpoint.
    cache_dir: Path = setting(
        None, kind=DIR,
        doc_default="one per mount, named after the remote and the mountpoint, under `/var/cache/marinfs` "
                    "(root), else `$XDG_CACHE_HOME/marinfs`",
        help="chunk cache and staged writes; created 0700; one daemon per directory")
    # Metadata cache: how long a stat / listing / "does not exist" answer is trusted.
    metadata_ttl: float = setting(5.0, kind=SECONDS, low=0, help="seconds a stat is trusted")
    negative_ttl: float = setting(1.0, kind=SECONDS, low=0, help="seconds a 'does not exist' is trusted")
    list_ttl: float | None = setting(None, kind=SECONDS, low=0, doc_default="`metadata_ttl`",
                                     help="seconds a directory listing is trusted")
    # Inode numbers: how long libfuse keeps a node the kernel forgot, so its number stays.
    inode_ttl: float = setting(
        3600.0, kind=SECONDS, low=0, high=2**31 - 1,
        help="seconds a file or directory keeps its inode number once the kernel forgot it",
        doc="seconds a file or directory keeps its inode number once the kernel forgot it (`tar -x` "
            "and `find` compare them; see [semantics.md](semantics.md#namespace)); 0 renumbers at once")
    # Globs of paths whose objects never change once written: cached without revalidation.
    immutable: tuple[str, ...] = setting(
        (), kind=GLOBS, routes=_NOT_FSTAB,
        help="paths whose objects never change once written (repeatable), e.g. 'checkpoints/*/step-*/**'",
        doc="paths whose objects never change once written (repeatable; in a file a list): cached "
            "without revalidation, e.g. `'checkpoints/*/step-*/**'`")
    # Object stores: list a directory in the background once its lookups keep missing, and
    # list a walker's next subdirectories ahead of it (docs/semantics.md).
    list_prefetch: bool = setting(
        True, kind=BOOL, doc_default="on (object stores)",
        help="list directories ahead of lookups and walkers, and fetch a walker's next small files; object stores only",
        doc="list directories in the background: after repeated lookup misses in one directory, "
            "and ahead of a walker such as `find`; and fetch a walker's next small files ahead of its opens "
            "(see [semantics.md](semantics.md#caching-and-other-nodes))")
    # Reads: objects are fetched and cached in chunks of this size, one ranged GET each.
    chunk_size: int = setting(8 << 20, kind=SIZE, low=64 << 10, high=1 << 30,
                              help="bytes per ranged GET and per cached chunk")
    # Writes: no file grows past this (EFBIG at the write, truncate or fallocate that would
    # cross it): a `truncate -s 10T` by mistake is refused, not uploaded as 10 TiB of zeros.
    max_file_size: int = setting(
        5 << 40, kind=SIZE, low=1, doc_default="5 TiB (S3's and GCS's largest object)",
        help="the largest file a write, truncate or fallocate may make (EFBIG past it)")
    # The on-disk chunk cache: a hard limit (0 disables it) and a free-space floor.
    cache_size: int = setting(20 << 30, kind=SIZE, low=0, help="hard limit of the chunk cache (0: no disk cache)")
    cache_min_free: int = setting(1 << 30, kind=SIZE, low=0, help="free space the cache leaves on its disk")
    # The shared chunk tier (sharedcache.py, docs/caching.md): a directory every node mounts; a
    # chunk missing here is looked for there before the bucket, and fetched once for all nodes.
    shared_cache_dir: Path | None = setting(
        None, kind=DIR, doc_default="none (off)",
        help="a directory on a filesystem every node mounts, shared as a second chunk cache tier",
        doc="a directory on a filesystem every node mounts (NFS, Filestore, Lustre): a second chunk "
            "cache tier, so each chunk is fetched from the bucket once for all nodes; created 0700, refused "
            "if another user owns it or others can write it (see "
            "[caching.md](caching.md#the-shared-tier-one-bucket-read-for-many-nodes))")
    shared_cache_size: int = setting(100 << 30, kind=SIZE, low=0,
                                     help="limit of the shared tier (each node evicts to keep it)")
    shared_cache_lease: float = setting(
        10.0, kind=SECONDS, low=0.1, high=3600,
        help="seconds a node's claim to fetch a shared chunk holds; others wait that long at most, then fetch")
    # Parallel ranged GETs ahead of sequential readers, and how far ahead (chunks) at most.
    prefetch_workers: int = setting(
        8, kind=INT, low=1, help="parallel ranged GETs ahead of sequential readers",
        doc="parallel ranged GETs ahead of sequential readers (real networks need the streams; on a "
            "2-core box that also runs the object store, fewer read faster: "
            "[benchmarks.md](benchmarks.md#where-marinfs-loses-and-what-would-fix-it))")
    max_readahead_chunks: int = setting(
        32, kind=INT, low=0, help="how many chunks a sequential reader's readahead may run ahead (0: none)")
    # Kernel readahead of the mount (KiB): 1024 makes the kernel send 1 MiB reads. Root only.
    read_ahead_kb: int = setting(1024, kind=INT, low=0,
                                 help="kernel readahead of the mount in KiB (root only; 0 leaves it)")
    # FUSE passthrough: the kernel reads a file the chunk cache holds whole from its data file.
    passthrough: bool = setting(
        True, kind=BOOL, doc_default="on (where libfuse and the kernel have it)",
        help="let the kernel read files the chunk cache holds whole by itself (libfuse >= 3.17, Linux >= 6.9, root)",
        doc="let the kernel read a file the chunk cache holds whole straight from the cache, without the "
            "daemon (FUSE passthrough: libfuse ≥ 3.17, Linux ≥ 6.9, as root; see "
            "[caching.md](caching.md#passthrough-files-cached-whole-are-read-by-the-kernel))")
    # Prometheus metrics on METRICS_ADDR:PORT; 0 is off. Local only unless asked otherwise.
    metrics_port: int = setting(0, kind=INT, low=0, high=65535, doc_default="0 (off)",
                                help="serve Prometheus metrics on ADDR:PORT/metrics (0: off)")
    metrics_addr: str = setting("127.0.0.1", kind=ADDRESS,
                                help="address the metrics server binds (local only unless you change it)")
    # Remote calls: bounded time and attempts, so a wedged request never hangs a syscall.
    connect_timeout: float = setting(_REMOTE.connect_timeout, kind=SECONDS, low=0,
                                     help="seconds to connect to the remote")
    read_timeout: float = setting(_REMOTE.read_timeout, kind=SECONDS, low=0,
                                  help="seconds a remote response may stall")
    retries: int = setting(_REMOTE.attempts, kind=INT, low=1,
                           help="attempts per remote call for transient failures")
    mount_timeout: float = setting(60.0, kind=SECONDS, low=0,
                                   help="seconds `mount` (and the daemon) wait for the mount to come up")
    # Write-back (docs/semantics.md#write-back): close returns once the bytes are staged and
    # journaled; uploads run in the background; deletes, renames, commit markers, `marinfs sync`
    # and unmount wait for what was closed before them.
    write_back: bool = setting(
        False, kind=BOOL, help="close returns once the bytes are staged; uploads run in the background",
        doc="close returns once the bytes are staged and journaled; uploads run in the background, in "
            "closing order; unlink, rmdir, rename, a commit marker's close, `marinfs sync` and unmount "
            "wait for what was closed before them (see [semantics.md](semantics.md#write-back))")
    # Write-back for some paths only (docs/semantics.md#write-back-for-some-paths): alone it turns
    # write-back on for the files matching; with --write-back too, it still narrows it to them.
    write_back_paths: tuple[str, ...] = setting(
        (), kind=GLOBS, flag="--write-back-path", routes=_NOT_FSTAB,
        doc_default="none (`--write-back`: every path)",
        help="write back only files matching (repeatable); given alone it turns write-back on for them",
        doc="paths (repeatable; in a file a list) whose files are written back; every other file keeps "
            "the default mode (close returns once it is in the bucket). Given alone it turns write-back "
            "on for them; with `--write-back` too, write-back is still for them only (see "
            "[semantics.md](semantics.md#write-back-for-some-paths))")
    write_back_uploads: int = setting(16, kind=INT, low=1, high=256,
                                      help="background uploads at once (--write-back)")
    # rclone's --vfs-write-back: a file renamed meanwhile (a temporary checkpoint directory) is sent
    # once, to its final name; a barrier (sync, a marker, a delete, unmount) starts them at once.
    write_back_delay: float = setting(
        5.0, kind=SECONDS, low=0, high=3600,
        help="seconds a closed file waits before its upload starts (--write-back), unless a barrier asks",
        doc="seconds a closed file waits before its upload starts (`--write-back`; rclone's "
            "`--vfs-write-back`), so a file renamed meanwhile (a temporary checkpoint directory "
            "renamed into place) is sent once, to its final name; a barrier starts what it waits for at once")
    # Bytes closed and not yet uploaded (write-back): past it a writer's close waits for room.
    write_back_max_bytes: int = setting(
        10 << 30, kind=SIZE, low=0, doc_default="10 GiB",
        help="bytes closed and not yet uploaded (--write-back) past which a close waits (0: no bound)",
        doc="bytes closed and not yet uploaded (`--write-back`) past which a writer's close waits for "
            "uploads to make room (the staging disk never fills with them; 0: no bound)")
    # Temporary directories a writer renames into place when it is done (Orbax's checkpoints):
    # their files' uploads wait for that rename (or a barrier), so nothing is copied in the bucket.
    write_back_hold: tuple[str, ...] = setting(
        ("**/*.orbax-checkpoint-tmp*/**",), kind=GLOBS, flag="--write-back-hold", routes=_NOT_FSTAB,
        doc_default="Orbax's temporary checkpoint directories",
        help="paths whose uploads wait for their rename or a barrier (repeatable; --write-back)",
        doc="paths (repeatable; in a file a list) of temporary directories a writer renames into place "
            "when done: with `--write-back` their files' uploads wait for that rename or a barrier, so "
            "nothing of them is copied in the bucket")
    # Files others take as "everything before me is there": in write-back, committed at their
    # close after every file closed before them. Marin's executor and Hadoop/Spark markers.
    commit_markers: tuple[str, ...] = setting(
        ("**/.executor_status", "**/_SUCCESS", "**/commit_success.txt"), kind=GLOBS, flag="--commit-marker",
        routes=_NOT_FSTAB, doc_default="Marin's `.executor_status`, `_SUCCESS`, `commit_success.txt`",
        help="paths of commit markers (repeatable): with --write-back committed at close after all closed before",
        doc="paths of files others take as commit points (repeatable; in a file a list): with "
            "`--write-back` each is committed at its close, after every file closed before it")
    # Unmount and SIGTERM wait this long for pending commits; what is left keeps its journal
    # and is committed by the next start. Failed commits are retried every interval.
    drain_timeout: float = setting(
        300.0, kind=SECONDS, low=0, help="seconds unmount/SIGTERM wait for pending commits",
        doc="seconds unmount/SIGTERM wait for pending commits (the rest keep their journal and are "
            "committed by the next start)")
    commit_retry_interval: float = setting(30.0, kind=SECONDS, low=0,
                                           help="seconds between retries of failed commits while mounted")
    storage_options: tuple[tuple[str, object], ...] = setting(
        (), kind=OPTIONS, flag="--storage-option", short="-o", routes=_NOT_FSTAB, child_env=True,
        help="fsspec storage option (repeatable); values that parse as JSON are JSON (-o anon=true)",
        doc="an fsspec storage option (repeatable; in a file a `[storage_options]` table, in the "
            "environment a JSON object); values that parse as JSON are JSON (`-o anon=true`). They "
            "reach the daemon through its environment, never its command line, so they do not show in `ps`")
    # The read path's switches (docs/backends.md): for comparisons, and for a store that refuses
    # one of our paths. Environment only, and passed to a background daemon the same way.
    direct_get: bool = setting(
        _REMOTE.direct_get, kind=BOOL, routes=_ENV_ONLY, child_env=True,
        help="requests sent by marinfs itself (S3: presigned URLs, obstore; GCS: chunk fetches); `0`: "
             "everything through s3fs or gcsfs",
        doc="requests sent by marinfs itself (S3: reads, small PUTs, parts and listings as presigned URLs, "
            "and obstore; GCS: chunk fetches); `0`: every request through s3fs or gcsfs (see "
            "[backends.md](backends.md#what-object-stores-change))")
    obstore: bool = setting(
        _REMOTE.obstore, kind=BOOL, routes=_ENV_ONLY, child_env=True, doc_default="on (where obstore is installed)",
        help="S3: pinned ranged reads through obstore (Rust, the lock released); `0`: never obstore")
    get: str = setting(
        _REMOTE.get, kind=CHOICE, choices=("socket", "obstore"), routes=_ENV_ONLY, child_env=True,
        help="S3 chunk fetches: `socket` (the body read into the chunk's buffer) or `obstore` (its answer "
             "copied in)")
    part_checksum: str = setting(
        _REMOTE.part_checksum, kind=CHOICE, choices=("crc32c", "md5"), routes=_ENV_ONLY, child_env=True,
        doc_default="`crc32c` (`md5` without google-crc32c's C library)",
        help="S3: what each upload part sent by marinfs carries: `crc32c` or `md5` (`Content-MD5`, for a store "
             "that does not check CRC-32C)")
    fetch_into: bool = setting(
        True, kind=BOOL, routes=_ENV_ONLY, child_env=True,
        help="chunk fetches read into pooled buffers; `0`: fetched as `bytes` and copied in (every backend)")

    def __post_init__(self) -> None:
        if self.cache_dir is None and self.remote and self.mountpoint:
            object.__setattr__(self, "cache_dir", default_cache_dir(self.remote, self.mountpoint))

    def remote_settings(self) -> RemoteSettings:
        return RemoteSettings(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                              attempts=self.retries, direct_get=self.direct_get, obstore=self.obstore,
                              get=self.get, part_checksum=self.part_checksum)

    def validate(self) -> "MountConfig":
        """The table's bounds, for configs built in Python (every route already checked its input)."""
        for s in SETTINGS:
            try:
                s.check(getattr(self, s.name))
            except Bad as exc:
                raise UsageError(f"{s.name}: {exc}") from None
        return self


SETTINGS: tuple[Setting, ...] = table(MountConfig)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
__all__ = ["BY_NAME", "LOG_LEVELS", "SETTINGS", "MountConfig", "cache_root", "default_cache_dir",
           "normalize_remote", "parse_mode", "parse_size", "parse_storage_option"]


if __name__ == "__main__":  # python -m marinfs.config.mount > table.md: regenerate the docs table
    print(markdown_table(SETTINGS))
