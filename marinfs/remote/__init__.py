"""The remote store: the only package that imports fsspec, s3fs, gcsfs, botocore or an HTTP
client. ``Remote(url, storage_options, settings)`` (or :func:`open_remote`) answers the backend
for the URL: local.py, generic.py (memory and any other fsspec filesystem), s3.py, gcs.py.

The backends, and the libraries with them, load at the first use of a name below that needs
them, not at ``import marinfs.remote``: what the layers above take from the package's ground
floor (settings.py for config.py, parts.py for the writer) comes without them, so ``marinfs
status``, ``mount.marinfs`` and the CLI's checks start without s3fs and gcsfs
(tests/test_layering.py checks it).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from marinfs.objects import ABSENT, ObjectInfo, ObjectVersion
from marinfs.remote.settings import RemoteSettings

if TYPE_CHECKING:
    from marinfs.remote.base import (LINK_SUFFIX, TMP_PREFIX, Remote, RequestStats, is_precondition_failure,
                                     is_transient)
    from marinfs.remote.gcs import GCSRemote
    from marinfs.remote.generic import GenericRemote, MemoryRemote
    from marinfs.remote.local import LocalRemote
    from marinfs.remote.s3 import S3Remote

# The names that need the backends, and the module of each.
_BACKEND_NAMES = {"LINK_SUFFIX": "base", "TMP_PREFIX": "base", "Remote": "base", "RequestStats": "base",
                  "is_precondition_failure": "base", "is_transient": "base", "GCSRemote": "gcs",
                  "GenericRemote": "generic", "MemoryRemote": "generic", "LocalRemote": "local", "S3Remote": "s3"}

__all__ = ["ABSENT", "LINK_SUFFIX", "TMP_PREFIX", "GCSRemote", "GenericRemote", "LocalRemote", "MemoryRemote", "ObjectInfo",
           "ObjectVersion", "Remote", "RemoteSettings", "RequestStats", "S3Remote", "is_precondition_failure",
           "is_transient", "open_remote"]


def _load_backends() -> None:
    """Import every backend: each registers its protocols with ``Remote`` as its class is made,
    so ``Remote(url)`` finds them all."""
    import marinfs.remote.gcs  # noqa: F401
    import marinfs.remote.generic  # noqa: F401
    import marinfs.remote.local  # noqa: F401
    import marinfs.remote.s3  # noqa: F401


def __getattr__(name: str) -> Any:
    """A name that needs the backends (PEP 562: asked only for names not yet in the module)."""
    home = _BACKEND_NAMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_backends()
    value = getattr(sys.modules[f"{__name__}.{home}"], name)
    globals()[name] = value  # later lookups do not come here
    return value


def open_remote(url: str, storage_options: dict[str, Any] | None = None,
                settings: RemoteSettings | None = None) -> Remote:
    """The backend for ``url`` (the same as ``Remote(url, ...)``)."""
    _load_backends()
    from marinfs.remote.base import Remote

    return Remote(url, storage_options, settings)
