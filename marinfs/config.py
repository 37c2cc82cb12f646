"""Mount configuration: one frozen dataclass, defaults in one place, checked by validate()."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from marinfs.errors import UsageError

LOG_LEVELS = ("debug", "info", "warning", "error")


def default_cache_dir() -> Path:
    """Root uses /var/cache/marinfs, everyone else the XDG cache dir."""
    if os.geteuid() == 0:
        return Path("/var/cache/marinfs")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "marinfs"


def normalize_remote(remote: str, cwd: str | None = None) -> str:
    """Normalize a prefix the way Marin does: no trailing '/', no '//', local paths absolute.

    ``s3://b//p/`` -> ``s3://b/p``; ``./data`` -> ``/current/dir/data``; ``file:///x`` -> ``/x``.
    """
    remote = remote.strip()
    if not remote:
        raise UsageError("the remote prefix is empty")
    if "://" in remote:
        scheme, _, rest = remote.partition("://")
        scheme = scheme.lower()
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
            raise UsageError(f"bad URL scheme in {remote!r}")
        if scheme in ("file", "local"):
            return normalize_remote(rest or "/", cwd)
        rest = re.sub(r"/{2,}", "/", rest).rstrip("/")
        if not rest:
            raise UsageError(f"{remote!r} names no bucket")
        return f"{scheme}://{rest}"
    path = os.path.normpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(remote)))
    return re.sub(r"/{2,}", "/", path)


@dataclass(frozen=True)
class RemoteSettings:
    """Bounds on every remote call, so a wedged request fails instead of hanging a syscall."""

    connect_timeout: float = 30.0
    read_timeout: float = 120.0
    attempts: int = 5
    backoff_base: float = 0.25
    backoff_max: float = 10.0
    # Commits to S3/GCS go in parts of this size (S3 allows 10,000 of them: 160 GB at 16 MiB;
    # bigger files get bigger parts, so 10,000 of them cover up to 5 TiB), with at
    # most ``upload_concurrency`` parts in memory and in flight per file.
    upload_part_size: int = 16 << 20
    upload_concurrency: int = 4


@dataclass(frozen=True)
class MountConfig:
    """Everything one mount needs. Build it from flags, then call validate()."""

    remote: str
    mountpoint: str
    read_only: bool = False
    allow_other: bool = False
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    file_mode: int = 0o644
    dir_mode: int = 0o755
    log_level: str = "info"
    log_file: str | None = None
    foreground: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Metadata cache: how long a stat / listing / "does not exist" answer is trusted.
    metadata_ttl: float = 5.0
    negative_ttl: float = 1.0
    list_ttl: float | None = None  # None: the same as metadata_ttl
    # Globs of paths whose objects never change once written: cached without revalidation.
    immutable: tuple[str, ...] = ()
    # Object stores: list a directory in the background once its lookups keep missing, and
    # list a walker's next subdirectories ahead of it (docs/semantics.md).
    list_prefetch: bool = True
    # Reads: objects are fetched and cached in chunks of this size, one ranged GET each.
    chunk_size: int = 8 << 20
    # The on-disk chunk cache: a hard limit (0 disables it) and a free-space floor.
    cache_size: int = 20 << 30
    cache_min_free: int = 1 << 30
    # Parallel ranged GETs ahead of sequential readers, and how far ahead (chunks) at most.
    prefetch_workers: int = 8
    max_readahead_chunks: int = 32
    # Kernel readahead of the mount (KiB): 1024 makes the kernel send 1 MiB reads. Root only.
    read_ahead_kb: int = 1024
    # Prometheus metrics on METRICS_ADDR:PORT; 0 is off. Local only unless asked otherwise.
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    # Remote calls: bounded time and attempts, so a wedged request never hangs a syscall.
    connect_timeout: float = 30.0
    read_timeout: float = 120.0
    retries: int = 5
    mount_timeout: float = 60.0
    # Unmount and SIGTERM wait this long for pending commits; what is left keeps its journal
    # and is committed by the next start. Failed commits are retried every interval.
    drain_timeout: float = 300.0
    commit_retry_interval: float = 30.0
    storage_options: tuple[tuple[str, str], ...] = ()

    def remote_settings(self) -> RemoteSettings:
        return RemoteSettings(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                              attempts=self.retries)

    def validate(self) -> "MountConfig":
        if self.log_level not in LOG_LEVELS:
            raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        for name in ("file_mode", "dir_mode"):
            value = getattr(self, name)
            if not 0 <= value <= 0o7777:
                raise UsageError(f"--{name.replace('_', '-')} {oct(value)} is not a permission mode")
        for name in ("uid", "gid"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name} must be >= 0")
        for name in ("metadata_ttl", "negative_ttl", "list_ttl", "connect_timeout", "read_timeout",
                     "mount_timeout"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # NaN too: a TTL of NaN never expires
                raise UsageError(f"{name.replace('_', '-')} must be a number >= 0, not {value}")
        if self.retries < 1:
            raise UsageError("--retries must be >= 1")
        if not 64 << 10 <= self.chunk_size <= 1 << 30:
            raise UsageError("--chunk-size must be between 64K and 1G")
        if self.cache_size < 0 or self.cache_min_free < 0:
            raise UsageError("cache sizes must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise UsageError("--metrics-port must be a TCP port (0: off)")
        if self.prefetch_workers < 1 or self.max_readahead_chunks < 0 or self.read_ahead_kb < 0:
            raise UsageError("prefetch workers must be >= 1, readahead >= 0")
        return self


def parse_mode(text: str) -> int:
    """Parse an octal permission mode such as ``0644`` or ``755``."""
    try:
        return int(text, 8)
    except ValueError:
        raise UsageError(f"{text!r} is not an octal mode such as 0644") from None


def parse_storage_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"storage option {text!r} is not KEY=VALUE")
    return key, value


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``200G``, ``512M``, ``8MiB``, ``1048576`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise UsageError(f"{text!r} is not a size such as 512M or 200G")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
