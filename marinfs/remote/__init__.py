"""The remote store: the only package that imports fsspec, s3fs, gcsfs, botocore or an HTTP
client. ``Remote(url, storage_options, settings)`` (or :func:`open_remote`) answers the backend
for the URL: local.py, generic.py (memory and any other fsspec filesystem), s3.py, gcs.py.
"""

from __future__ import annotations

from typing import Any

from marinfs.config import RemoteSettings
from marinfs.objects import ABSENT, ObjectInfo, ObjectVersion
from marinfs.remote.base import LINK_SUFFIX, TMP_PREFIX, Remote, RequestStats, is_precondition_failure, is_transient
from marinfs.remote.gcs import GCSRemote
from marinfs.remote.generic import GenericRemote, MemoryRemote
from marinfs.remote.local import LocalRemote
from marinfs.remote.s3 import S3Remote

__all__ = ["ABSENT", "LINK_SUFFIX", "TMP_PREFIX", "GCSRemote", "GenericRemote", "LocalRemote", "MemoryRemote", "ObjectInfo",
           "ObjectVersion", "Remote", "RequestStats", "S3Remote", "is_precondition_failure", "is_transient",
           "open_remote"]


def open_remote(url: str, storage_options: dict[str, Any] | None = None,
                settings: RemoteSettings | None = None) -> Remote:
    """The backend for ``url`` (the same as ``Remote(url, ...)``)."""
    return Remote(url, storage_options, settings)
