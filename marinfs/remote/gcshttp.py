"""GCS media GETs sent by us on connections we keep (httpbody.Connections), the body read
straight into the chunk's buffer (part of the GCS backend).

Through gcsfs every body byte passes through fsspec's one asyncio thread (aiohttp reads it into
``bytes``, which marinfs then copies into the chunk's pooled buffer) with the GIL held most of
the time. Here the prefetch threads send the GET themselves and http.client's ``readinto`` fills
the buffer from the socket (httpbody.py, shared with S3's get_into), the GIL released while it
waits.

What is sent is what gcsfs sends for ``_cat_file(path, start, end, generation=N)``: its URL
(``GCSFileSystem.url``: the download form, ``{location}/download/storage/v1/b/{bucket}/o/{quoted
name}?alt=media&generation=N``, so its endpoint handling, ``STORAGE_EMULATOR_HOST`` and
``endpoint_url`` included), its query parameters (``userProject`` of a requester-pays bucket) and
its headers (``_get_headers``: User-Agent, and the credentials' ``Authorization``, refreshed by
gcsfs's credentials object when near expiry; none for ``token=anon``). Users' configuration of
gcsfs is therefore the configuration of this path. What it cannot reproduce (a client
certificate for mTLS, custom aiohttp session options) makes :func:`usable` say no, and gcsfs reads
as before.

Errors become what the rest of marinfs expects: 404 FileNotFoundError (for a pinned read: that
generation is gone, ESTALE), 401 and 403 PermissionError (a 401 first refreshes the credentials
and sends once more), throttling, server errors and broken connections ConnectionError /
TimeoutError (retried by the one retry loop, remote/base.py).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from marinfs.errors import StaleVersionError
import marinfs.remote.httpbody as httpbody
from marinfs.remote.base import TRANSIENT_STATUS


def usable(fs: Any) -> str | None:
    """Why this gcsfs filesystem's reads cannot be sent by :class:`GCSHttp` (None: they can)."""
    for name in ("url", "_get_headers", "_get_params", "credentials", "_location"):
        if not hasattr(fs, name):
            return f"gcsfs has no {name}"
    if getattr(fs, "_use_client_cert", False):
        return "a client certificate (mTLS) is configured"
    if getattr(fs, "session_kwargs", None):
        return "custom aiohttp session options are configured"
    if not str(fs._location).startswith(("http://", "https://")):
        return f"endpoint {fs._location!r} is not an HTTP URL"
    return None


class GCSHttp:
    """Pinned ranged media GETs of one gcsfs filesystem over connections of our own, kept
    between requests (httpbody.Connections: a GET costs half the CPU of urllib3's pool)."""

    def __init__(self, fs: Any, connect_timeout: float, read_timeout: float, max_connections: int = 16) -> None:
        self.fs = fs
        self.pool = httpbody.Connections(connect_timeout, read_timeout, max_idle=max_connections)

    def _url(self, full: str, generation: str) -> str:
        url = self.fs.url(full, generation=generation)
        params = self.fs._get_params({})  # userProject, for a requester-pays bucket
        return f"{url}&{urlencode(params)}" if params else url

    def _refresh(self) -> None:
        """New credentials after a 401 (expired or revoked), through gcsfs's own lock."""
        credentials = self.fs.credentials
        if getattr(credentials, "credentials", None) is None:
            return  # anonymous: nothing to refresh
        try:
            credentials.maybe_refresh(refresh_buffer=float("inf"))
        except (AttributeError, TypeError):  # another gcsfs: its next apply() refreshes near expiry
            pass

    def get_into(self, full: str, start: int, end: int, generation: str, buf: memoryview) -> int:
        """Bytes [start, end) of generation ``generation`` of ``full`` read into ``buf``
        (``len(buf) == end - start``). Answers how many bytes came (fewer: the body was cut
        short; the caller decides). An answer of another generation (``x-goog-generation``) is
        StaleVersionError, never bytes in the buffer; a server that names no generation is
        trusted to have honoured the ``generation`` parameter, as gcsfs's path does."""
        url = self._url(full, generation)

        def same_generation(headers: Any) -> None:
            sent = headers.get("x-goog-generation")
            if sent is not None and sent != generation:
                raise StaleVersionError(f"{full}: the server sent generation {sent} for {generation}")

        for attempt in (1, 2):
            headers = self.fs._get_headers({"Range": f"bytes={start}-{end - 1}"})
            resp = httpbody.request(self.pool, "GET", url, full, headers, preload=False)
            status = resp.status
            if status in (200, 206, 416):
                return httpbody.read_into(resp, buf, start, full, check=same_generation)
            body = httpbody.discard(resp)
            if status == 404:
                raise FileNotFoundError(2, f"no such object (generation {generation})", full)
            if status == 401 and attempt == 1:
                self._refresh()
                continue
            if status in (401, 403):
                raise PermissionError(13, f"access denied (HTTP {status})", full)
            if status in TRANSIENT_STATUS:
                raise ConnectionError(f"GET {full}: HTTP {status}")
            raise OSError(5, f"GET {full}: HTTP {status}: {body[:200]!r}")
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connections kept for reuse (a daemon ends, a test drops its remote)."""
        self.pool.close()
