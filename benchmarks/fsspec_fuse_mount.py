"""Serve ``python -m fsspec.fuse`` over an S3 endpoint, in the foreground, for peers_bench.py.

fsspec.fuse imports fusepy as ``fuse``; mfusepy has the same API and is what the marinfs venv
already has, so it stands in for it here (like fusepy, mfusepy picks libfuse2 when
``libfuse.so.2`` exists). The mount is multithreaded, as ``python -m fsspec.fuse`` is by default.

    python benchmarks/fsspec_fuse_mount.py ENDPOINT BUCKET/PREFIX MOUNTPOINT
"""

from __future__ import annotations

import sys

import mfusepy

sys.modules.setdefault("fuse", mfusepy)

import fsspec.fuse  # noqa: E402
import s3fs  # noqa: E402


def main() -> None:
    endpoint, root, mountpoint = sys.argv[1:4]
    fs = s3fs.S3FileSystem(key="bench", secret="bench", client_kwargs={"endpoint_url": endpoint},
                           config_kwargs={"s3": {"addressing_style": "path"}})
    print(f"fsspec.fuse {fsspec.__version__} on libfuse{mfusepy.fuse_version_major}", flush=True)
    fsspec.fuse.run(fs, root.rstrip("/") + "/", mountpoint, foreground=True, threads=True)


if __name__ == "__main__":
    main()
