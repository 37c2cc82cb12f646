"""S3 ranged GETs through obstore (Rust ``object_store``; part of the S3 backend).

The request, the TLS and the body all stay in native code with the interpreter lock released,
and the body comes back as one ``obstore.Bytes`` buffer (the Python buffer protocol, no copy into
a ``bytes``). The store is built from the s3fs filesystem's own configuration: the endpoint and
region of s3fs's client for the bucket (so ``endpoint_url``, ``AWS_ENDPOINT_URL``, config files
and bucket regions mean what they mean to s3fs), its key/secret/token, else the botocore
credential chain as a credential provider, its TLS verification, our timeouts. obstore's own
retries are off: the one retry loop is remote/base.py's.

Only pinned reads (``If-Match`` on the ETag) come here, and chunk fetches only with
MARINFS_GET=obstore (by default they read the socket into the chunk's buffer, s3http.py:
obstore cannot fill a caller's buffer); everything else, and every store this
cannot describe (requester pays, SSE-C, a bucket with dots addressed virtual-hosted), keeps
the urllib3 path (s3http.py) or s3fs. Answers become what the rest of marinfs expects: 412
StaleVersionError, 404 FileNotFoundError, 403/401 PermissionError (the caller falls back),
throttling, server errors, broken or cut-short bodies and timeouts ConnectionError/TimeoutError.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import fsspec.asyn

from marinfs.errors import StaleVersionError
from marinfs.remote.base import TRANSIENT_STATUS

try:
    import obstore
    import obstore.exceptions as _obx
    from obstore.store import S3Store
except ImportError:  # pragma: no cover - the urllib3 path serves instead
    obstore = None

log = logging.getLogger(__name__)

REFRESH = _dt.timedelta(minutes=15)  # botocore keeps refreshable credentials valid 10+ minutes ahead
_STATUS = re.compile(r"(?:status(?: code)?[:=]?\s*|Status \{ status: |\bHTTP )(\d{3})\b", re.IGNORECASE)


def available() -> bool:
    """Whether obstore is installed (MARINFS_OBSTORE=0 is the S3 backend's to honour)."""
    return obstore is not None


def representable(key: str) -> bool:
    """Whether obstore's ``Path`` takes ``key`` as it is: it refuses ASCII control characters,
    empty segments and ``.``/``..`` segments (ValueError before any request), all of which S3
    keys may hold; those keys are read through the other path."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return False
    return all(part and part not in (".", "..") for part in key.rstrip("/").split("/"))


class Unusable(Exception):
    """This filesystem's configuration cannot be described to obstore: use the other path."""


class ObstoreGetter:
    """Ranged, ETag-pinned GETs of one s3fs filesystem's objects through obstore, one store per
    bucket (built on first use from what s3fs's client for that bucket uses)."""

    def __init__(self, fs: Any, connect_timeout: float, read_timeout: float) -> None:
        if not available():
            raise Unusable("obstore is not installed")
        if fs.req_kw or fs.s3_additional_kwargs:
            raise Unusable("request options obstore cannot carry (requester pays, SSE-C)")
        self.fs = fs
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.on_request: Callable[[], None] | None = None

    def store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                why = None
                try:
                    store = self._build(bucket)
                except Exception as exc:  # noqa: BLE001 - then the other paths serve
                    why = exc if isinstance(exc, Unusable) else f"no obstore store for {bucket}: {_first_line(exc)}"
                if why is not None:  # raised outside the handler: no transient cause chained to it
                    raise why if isinstance(why, Unusable) else Unusable(why)
                self._stores[bucket] = store
        return store

    def _build(self, bucket: str) -> Any:
        fs = self.fs

        async def aio_client() -> Any:
            await fs.set_session()
            return await fs.get_s3(bucket)

        meta = fsspec.asyn.sync(fs.loop, aio_client).meta
        client_kwargs = dict(fs.client_kwargs or {})
        s3_config = (dict(getattr(fs, "config_kwargs", None) or {}).get("s3") or {})
        endpoint = meta.endpoint_url or ""
        host = urlsplit(endpoint).hostname or ""
        aws = host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")
        kw: dict[str, Any] = {"region": meta.region_name or "us-east-1"}
        if s3_config.get("addressing_style") == "virtual":
            kw["virtual_hosted_style_request"] = True
            if not aws:
                # object_store takes a virtual-hosted endpoint with the bucket in it, as botocore
                # builds it from the endpoint (CoreWeave: https://BUCKET.cwobject.com).
                parts = urlsplit(endpoint)
                if not parts.hostname or "." in bucket:
                    raise Unusable(f"virtual-hosted addressing of {bucket!r} on {endpoint!r}")
                kw["endpoint"] = parts._replace(netloc=f"{bucket}.{parts.netloc}").geturl().rstrip("/")
        elif not aws:
            kw["endpoint"] = endpoint
            kw["virtual_hosted_style_request"] = False
        client: dict[str, Any] = {"allow_http": endpoint.startswith("http:"),
                                  "connect_timeout": _dt.timedelta(seconds=self.connect_timeout),
                                  "read_timeout": _dt.timedelta(seconds=self.read_timeout),
                                  "timeout": "1h",  # a stalled body is the read timeout's job
                                  "pool_max_idle_per_host": "64"}
        verify = client_kwargs.get("verify")
        if verify is None:
            verify = os.environ.get("AWS_CA_BUNDLE") or True
        if verify is False:
            client["allow_invalid_certificates"] = True
        elif isinstance(verify, str):
            with open(verify, "rb") as f:
                client["root_certificate"] = f.read()
        provider = None
        if fs.anon:
            kw["skip_signature"] = True
        else:
            provider = _credential_provider(fs, client_kwargs)
        return S3Store(bucket, client_options=client, credential_provider=provider,
                       retry_config={"max_retries": 0, "retry_timeout": _dt.timedelta(seconds=1)}, **kw)

    def get(self, bucket: str, key: str, start: int, end: int, etag: str) -> Any:
        """Bytes [start, end) of ``bucket/key``, of the version with this ETag only, as a buffer."""
        store = self.store(bucket)
        if self.on_request is not None:
            self.on_request()
        try:
            result = obstore.get(store, key, options={"range": (start, end), "if_match": f'"{etag}"'})
            if result.range[0] != start:  # never bytes of another offset
                raise OSError(5, f"GET {bucket}/{key}: the server sent {result.range} for {(start, end)}")
            return result.bytes()
        except _obx.PreconditionError:
            raise StaleVersionError(f"{bucket}/{key} is no longer version {etag}") from None
        except _obx.NotFoundError:
            raise FileNotFoundError(2, "no such object", f"{bucket}/{key}") from None
        except (_obx.PermissionDeniedError, _obx.UnauthenticatedError) as exc:
            raise PermissionError(13, f"access denied: {_first_line(exc)}", f"{bucket}/{key}") from None
        except _obx.BaseError as exc:
            raise _classify(exc, f"GET {bucket}/{key}") from None

    def close(self) -> None:
        with self._lock:
            self._stores.clear()


def _classify(exc: BaseException, what: str) -> Exception:
    """An obstore error that carries no type of its own: its HTTP status (if the text names one)
    decides; without one it is the network (refused, reset, cut short, timed out): transient."""
    text = str(exc)
    if "non-partial response" in text or "Content-Range" in text:
        # A server that ignores ranges (or does not say which it sent): the urllib3 path copes.
        return Unusable(f"{what}: {_first_line(exc)}")
    match = _STATUS.search(text)
    status = int(match.group(1)) if match else None
    if status is not None and status not in TRANSIENT_STATUS and 400 <= status < 500:
        return OSError(5, f"{what}: HTTP {status}: {_first_line(exc)}")
    if status is None and ("timed out" in text.lower() or "timeout" in text.lower()):
        return TimeoutError(f"{what}: {_first_line(exc)}")
    return ConnectionError(f"{what}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def _credential_provider(fs: Any, client_kwargs: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """s3fs's own key/secret/token if it was given them, else the botocore chain (environment,
    profile, container, instance metadata) with s3fs's profile: what its client signs with."""
    key = fs.key or client_kwargs.get("aws_access_key_id")
    secret = fs.secret or client_kwargs.get("aws_secret_access_key")
    token = fs.token or client_kwargs.get("aws_session_token")
    if key and secret:
        static = {"access_key_id": key, "secret_access_key": secret, "token": token, "expires_at": None}
        return lambda: static
    import botocore.session

    session = botocore.session.Session(**{k: v for k, v in (fs.kwargs or {}).items() if k == "profile"})
    credentials = session.get_credentials()
    if credentials is None:
        raise Unusable("no credentials in botocore's chain")
    refreshes = hasattr(credentials, "refresh_needed")

    def provide() -> dict[str, Any]:
        frozen = credentials.get_frozen_credentials()
        expires = _dt.datetime.now(_dt.timezone.utc) + REFRESH if refreshes else None
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}

    return provide
