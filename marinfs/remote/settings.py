"""What a remote is told: bounds on every call, the upload's part size and concurrency, and the
read path's switches. config.py's settings table takes the defaults of its rows of the same
meaning from here (``MountConfig.remote_settings`` builds one), so each is written once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteSettings:
    """Bounds on every remote call, so a wedged request fails instead of hanging a syscall."""

    connect_timeout: float = 30.0
    read_timeout: float = 120.0
    attempts: int = 5  # MountConfig's `retries`
    backoff_base: float = 0.25
    backoff_max: float = 10.0
    # Commits to S3/GCS go in parts of this size (S3 allows 10,000 of them: 160 GB at 16 MiB;
    # bigger files get bigger parts, so 10,000 of them cover up to 5 TiB), with at
    # most ``upload_concurrency`` parts in flight per file (S3 sends them from the staging
    # file, 1 MiB of memory each; GCS holds each in memory) and 2x+2 sending threads a mount.
    # Not smaller: against SeaweedFS, 5 and 8 MiB parts cost the server the same CPU per GiB
    # as 16 MiB and the daemon more, and shorten only the close-time tail, a small part of a
    # big write (docs/benchmarks-notebook.md, branch `gcsw`); fewer parts mean fewer requests on S3.
    upload_part_size: int = 16 << 20
    upload_concurrency: int = 4
    # The read path's switches (MountConfig's rows of the same names).
    direct_get: bool = True
    obstore: bool = True
    get: str = "socket"  # S3 chunk fetches: "socket" or "obstore"
    part_checksum: str = "crc32c"  # S3 upload parts: "crc32c" or "md5"
