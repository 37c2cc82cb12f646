"""Any fsspec filesystem without a backend of its own, and the in-memory one tests use.

Versions are mtime and size (or what the backend's info carries); a conditional commit compares
a stat taken just before it, which is as close as a store without preconditions allows.
"""

from __future__ import annotations

from typing import Any

from marinfs.remote.base import Remote


class GenericRemote(Remote, fallback=True):
    """A plain fsspec filesystem: every operation is the fsspec call of the same name."""

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._options(options)
        options.setdefault("use_listings_cache", False)
        return options


class MemoryRemote(Remote):
    """fsspec's process-wide ``memory://`` store (tests, and trees that need no persistence),
    built with the options given and no listing-cache option of ours."""

    protocols = ("memory",)
