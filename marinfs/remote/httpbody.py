"""The body of a ranged GET read straight into a caller's buffer, for the backends that send their
own data requests over urllib3 (S3: s3http.py, GCS: gcshttp.py).

A chunk fetch hands us a slice of a pooled, page-aligned buffer (buffers.py). http.client's
``readinto`` on urllib3's raw response fills it from the socket (``recv_into``, the GIL released
while it waits): no ``bytes`` of the body is ever made, so Python never touches the bytes. What
cannot be read in place (a 200 of the whole object from a server that ignored the range, an
encoded body) is read and copied in, never refused; bytes of another offset are refused.

One place maps urllib3's and http.client's failures to what the one retry loop (remote/base.py)
expects: a timeout is TimeoutError, a refused, reset or cut-short connection ConnectionError.
"""

from __future__ import annotations

import http.client
from collections.abc import Callable
from typing import Any

import urllib3
import urllib3.exceptions


def request(pool: urllib3.PoolManager, method: str, url: str, what: str, headers: dict[str, str] | None = None,
            body: bytes | None = None, preload: bool = True) -> urllib3.BaseHTTPResponse:
    """One request over ``pool``; urllib3's failures as TimeoutError / ConnectionError. Without
    ``preload`` the body is left unread (:func:`read_into` or :func:`discard` then)."""
    try:
        return pool.request(method, url, headers=headers, body=body, preload_content=preload,
                            decode_content=preload)
    except urllib3.exceptions.TimeoutError as exc:
        raise TimeoutError(f"{method} {what}: {exc}") from None
    except urllib3.exceptions.HTTPError as exc:  # refused, reset, truncated body...
        raise ConnectionError(f"{method} {what}: {exc}") from None


def discard(resp: urllib3.BaseHTTPResponse) -> bytes:
    """An unwanted answer's body (an error's: its first bytes say why), read so the connection
    goes back to the pool; a broken one is closed instead."""
    try:
        return resp.read()
    except Exception:  # noqa: BLE001 - the answer is the status; the connection is dropped
        resp.close()
        return b""
    finally:
        resp.release_conn()


def read_into(resp: urllib3.BaseHTTPResponse, buf: memoryview, start: int, what: str,
              check: Callable[[Any], None] | None = None) -> int:
    """The body of ``resp`` (an unread 200/206/416 answer to a GET of ``start`` to
    ``start + len(buf)``) into ``buf``. Answers how many bytes came: fewer means the body was cut
    short, and the caller decides (the backends raise TruncatedResponse, retried). ``check``
    sees the headers first and raises to refuse the answer (GCS: a generation other than the one
    asked for). The connection goes back to the pool only once its whole body was read."""
    if check is not None:
        try:
            check(resp.headers)
        except BaseException:
            resp.close()  # a refused answer's body is never read, nor its connection reused
            resp.release_conn()
            raise
    raw = getattr(resp, "_fp", None)  # urllib3's http.client response: readinto on the socket
    done = False
    try:
        if resp.status == 416:
            return 0
        sent = range_start(resp.headers.get("Content-Range"))
        if resp.status != 206 or sent not in (None, start) or resp.headers.get("Content-Encoding", "identity") \
                != "identity" or raw is None or not hasattr(raw, "readinto"):
            data = resp.read(decode_content=True)
            if resp.status == 206 and sent not in (None, start):  # never bytes of another offset
                raise OSError(5, f"GET {what}: the server sent {resp.headers.get('Content-Range')} "
                                 f"for {start}-{start + len(buf) - 1}")
            data = data if resp.status == 206 else data[start:start + len(buf)]  # 200: the range was ignored
            n = min(len(data), len(buf))
            buf[:n] = data[:n]
            done = True
            return n
        n = 0
        while n < len(buf):
            got = raw.readinto(buf[n:])
            if not got:
                break
            n += got
        done = n == len(buf) and raw.isclosed()  # all of the body read: the connection is reusable
        return n
    except TimeoutError as exc:  # socket.timeout: the read timeout
        raise TimeoutError(f"GET {what}: {exc}") from None
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        if isinstance(exc, OSError) and exc.errno == 5:
            raise
        raise ConnectionError(f"GET {what}: {exc}") from None
    except http.client.HTTPException as exc:  # IncompleteRead and kin: a body cut short
        raise ConnectionError(f"GET {what}: {exc!r}") from None
    finally:
        if not done:
            resp.close()  # unread body left, or a broken one: never back in the pool
        resp.release_conn()


def range_start(content_range: str | None) -> int | None:
    """The first byte a ``Content-Range: bytes a-b/n`` answer holds (None: no header)."""
    if not content_range:
        return None
    try:
        return int(content_range.split()[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return -1  # unreadable: not the range asked for
