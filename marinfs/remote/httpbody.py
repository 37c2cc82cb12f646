"""The body of a ranged GET read straight into a caller's buffer, for the backends that send their
own data requests (S3: s3http.py, GCS: gcshttp.py), and the connections they send them on.

A chunk fetch hands us a slice of a pooled, page-aligned buffer (buffers.py). http.client's
``readinto`` on the raw response fills it from the socket (``recv_into``, the GIL released
while it waits): no ``bytes`` of the body is ever made, so Python never touches the bytes. What
cannot be read in place (a 200 of the whole object from a server that ignored the range, an
encoded body) is read and copied in, never refused; bytes of another offset are refused.

One place maps http.client's failures to what the one retry loop (remote/base.py)
expects: a timeout is TimeoutError, a refused, reset or cut-short connection ConnectionError.

Our requests go over :class:`Connections`, http.client connections of our own kept between
requests, rather than urllib3's pool: a GET costs 750-850 µs of the sending thread's CPU against
1,350 through ``PoolManager.request`` (SeaweedFS loopback, 1,000 GETs of 4 KiB, one thread),
most of the difference urllib3's parsing and re-encoding of the long presigned URL on every
request. A cold read is 131 chunk GETs a GiB, a random reader's twice that, ``tar -x`` of small
files a PUT a file.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

Where = tuple[str, str, int]  # scheme, host, port


class Connections:
    """HTTP/1.1 connections of our own (http.client), kept idle between requests, at most
    ``max_idle``, keyed by scheme, host and port. Over TLS the certificate is checked as urllib3
    checks it (``verify``: True for the system's CAs, a CA bundle's path, or False)."""

    def __init__(self, connect_timeout: float, read_timeout: float, verify: bool | str = True,
                 max_idle: int = 16) -> None:
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self._verify = verify
        self._context: ssl.SSLContext | None = None
        self.max_idle = max_idle
        self._idle: list[tuple[Where, http.client.HTTPConnection]] = []
        self._lock = threading.Lock()
        self.opened = 0  # connections made since the start (a count, for tests)

    def _tls(self) -> ssl.SSLContext:
        if self._context is None:
            if self._verify is False:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            else:
                context = ssl.create_default_context(cafile=self._verify if isinstance(self._verify, str) else None)
            self._context = context
        return self._context

    def get(self, where: Where) -> http.client.HTTPConnection:
        """An idle connection to ``where`` kept from an earlier request, else a new one. A kept
        connection the server has closed meanwhile (readable while idle: EOF) is dropped, as
        urllib3 does, rather than failing the request's first attempt."""
        while True:
            with self._lock:
                found = next((i for i in range(len(self._idle) - 1, -1, -1) if self._idle[i][0] == where), None)
                kept = None if found is None else self._idle.pop(found)[1]
            if kept is None:
                break
            if kept.sock is not None and not _readable(kept.sock):
                return kept
            kept.close()
        scheme, host, port = where
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout, context=self._tls())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.opened += 1
        return conn

    def keep(self, where: Where, conn: http.client.HTTPConnection) -> None:
        """``conn``, its last answer read to the end, back for the next request to ``where``."""
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((where, conn))
                return
        conn.close()

    def request(self, method: str, url: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> "Answer":
        """Send one request and read the answer's status and headers; its body is left unread
        (:func:`read_into`, :meth:`Answer.read`). A failure to send or to read the head is
        OSError or http.client.HTTPException (a kept connection closed under us among them),
        and that connection is closed."""
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        where = (scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80))
        conn = self.get(where)
        try:
            conn.putrequest(method, f"{parts.path or '/'}?{parts.query}" if parts.query else parts.path or "/",
                            skip_accept_encoding=True)
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        return Answer(self, where, conn, resp)

    def close(self) -> None:
        """Close the idle connections (a daemon ends, a test drops its remote)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()


class Answer:
    """An answer on a kept connection, its body unread, shaped as much like urllib3's unread
    response as the callers need (``_fp``: http.client's response, which :func:`read_into`
    reads in place). Its connection goes back to :class:`Connections` once the body was read to
    the end, and is closed otherwise."""

    __slots__ = ("status", "headers", "_fp", "_owner", "_where", "_conn", "_data")

    def __init__(self, owner: Connections, where: Where, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse) -> None:
        self.status, self.headers, self._fp = resp.status, resp.headers, resp
        self._owner, self._where = owner, where
        self._conn: http.client.HTTPConnection | None = conn
        self._data: bytes | None = None

    @property
    def data(self) -> bytes:
        return self.read()

    def read(self, decode_content: bool = True) -> bytes:
        """The body (what is left of it after a read in place; never decoded: we ask for no
        encoding), read once and kept: ``data`` answers it again."""
        if self._data is None:
            try:
                self._data = self._fp.read()
            except BaseException:
                self.close()  # cut short or stalled: never reused
                raise
        return self._data

    def close(self) -> None:
        """The rest of the body is not to be read: the connection is never reused."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def release_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._fp.isclosed() and not self._fp.will_close:
            self._owner.keep(self._where, conn)
        else:
            conn.close()


def request(pool: Connections, method: str, url: str, what: str,
            headers: dict[str, str] | None = None, body: bytes | None = None, preload: bool = True) -> Answer:
    """One request on our kept connections; failures as TimeoutError / ConnectionError. Without
    ``preload`` the body is left unread (:func:`read_into` or :func:`discard` then)."""
    try:
        resp = pool.request(method, url, headers, body)
        if preload:
            resp.read()  # read now, the connection given back
            resp.release_conn()
        return resp
    except TimeoutError as exc:  # socket.timeout
        raise TimeoutError(f"{method} {what}: {exc}") from None
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, closed under us...
        raise ConnectionError(f"{method} {what}: {exc!r}") from None


def discard(resp: Any) -> bytes:
    """An unwanted answer's body (an error's: its first bytes say why), read so the connection
    goes back to the pool; a broken one is closed instead."""
    try:
        return resp.read()
    except Exception:  # noqa: BLE001 - the answer is the status; the connection is dropped
        resp.close()
        return b""
    finally:
        resp.release_conn()


def read_into(resp: Any, buf: memoryview, start: int, what: str,
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
    except OSError as exc:
        if exc.errno == 5:
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


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (an idle connection: the server closed it).
    poll(2), not select(2): select cannot take a descriptor past 1023, and a write-back mount
    with thousands of staged files open has its sockets there."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
