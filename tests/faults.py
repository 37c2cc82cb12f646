"""Faults for tests.

- ``TcpProxy``: a TCP proxy in front of a real server that can be wedged (connections accepted,
  nothing forwarded) and healed.
- ``HttpFaultProxy``: an HTTP proxy in front of a real server that fails a seeded fraction of
  requests with 503, or behaves like a server that stops in the middle of a response, an
  upload or a listing (connections dropped, new ones refused) and comes back later.
- ``FaultPlan`` + ``FaultyFS``: an in-process fault-injecting wrapper of the fsspec filesystem
  under a ``marinfs.remote.Remote``: latency, transient and permanent errors, timeouts,
  truncated responses, lost acknowledgements.

Loopback only; each proxy stops its own threads and sockets.
"""

from __future__ import annotations

import random
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any


def listener(backlog: int) -> socket.socket:
    """A loopback socket on a free port whose accept() wakes up to check for a stop."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(backlog)
    server.settimeout(0.2)
    return server


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``wedged`` stalls every byte in both directions."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.wedged = threading.Event()
        self._stop = threading.Event()
        self._server = listener(64)
        self.port = self._server.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "TcpProxy":
        self._spawn(self._accept)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        with self._lock:
            for s in self._sockets:
                s.close()
        self._server.close()
        for t in self._threads:
            t.join(timeout=5)

    def _spawn(self, target, *args) -> None:  # noqa: ANN001
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            self._spawn(self._pump, client, upstream)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        poller = select.poll()  # (select() fails past descriptor 1023: a worker with many tests' files open)
        for s in peers:
            poller.register(s, select.POLLIN)
        by_fd = {s.fileno(): s for s in peers}
        try:
            while not self._stop.is_set():
                readable = [by_fd[fd] for fd, _ in poller.poll(100)]
                if self.wedged.is_set():
                    time.sleep(0.01)  # (poll answers at once while data waits unread)
                    continue  # hold everything: the client sees a server that never answers
                for s in readable:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    peers[s].sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()


# -- in-process: a fault-injecting remote ----------------------------------------------------------

# fsspec methods marinfs.remote calls, by request kind (what the fault plan is keyed on).
FS_METHOD_KINDS = {
    "info": "head", "ls": "list", "find": "list", "cat_file": "get", "get_file": "get",
    "put_file": "put", "pipe_file": "put", "cp_file": "copy", "rm_file": "delete", "rmdir": "delete",
    "mkdir": "mkdir", "mv": "rename",
}


class FaultPlan:
    """What goes wrong, per request kind (head, list, get, put, copy, delete, mkdir, rename).

    Seeded and thread-safe. For each call of a kind, in this order: ``latency`` seconds pass;
    a queued exception (``fail_next``) is raised; ``always`` raises a fresh exception from its
    factory on every call; with probability ``fail_rate`` a transient error is raised; ``down``
    raises a connection error for every kind; ``truncate`` makes the next reads return fewer
    bytes than asked, as a response cut short without an error would. ``after`` faults let the
    call reach the store first (a lost acknowledgement).

    The kernel retries a failed read once by itself (readahead, then the page it needs), so a
    fault meant to fail a read() must last: use ``always`` rather than one queued error.
    """

    def __init__(self, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.latency: dict[str, float] = {}
        self.fail_rate: dict[str, float] = {}
        self.fail_next: dict[str, list[BaseException]] = {}
        self.fail_after: dict[str, list[BaseException]] = {}
        self.always: dict[str, Callable[[], BaseException]] = {}
        self.truncate = 0  # how many of the next reads come back short
        self.down = False
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()

    def clear(self) -> None:
        with self._lock:
            self.latency.clear()
            self.fail_rate.clear()
            self.fail_next.clear()
            self.fail_after.clear()
            self.always.clear()
            self.truncate = 0
            self.down = False

    def queue(self, kind: str, *errors: BaseException, after: bool = False) -> None:
        with self._lock:
            (self.fail_after if after else self.fail_next).setdefault(kind, []).extend(errors)

    def before(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] += 1
            delay = self.latency.get(kind, self.latency.get("*", 0.0))
            error: BaseException | None = None
            queued = self.fail_next.get(kind)
            if queued:
                error = queued.pop(0)
            elif kind in self.always:
                error = self.always[kind]()
            elif self.down:
                error = ConnectionResetError(104, "injected: the server is down")
            elif self._rng.random() < self.fail_rate.get(kind, self.fail_rate.get("*", 0.0)):
                error = ConnectionResetError(104, f"injected: transient {kind} failure")
            if error is not None:
                self.injected[kind] += 1
        if delay:
            time.sleep(delay)
        if error is not None:
            raise error

    def after(self, kind: str) -> None:
        with self._lock:
            queued = self.fail_after.get(kind)
            error = queued.pop(0) if queued else None
            if error is not None:
                self.injected[kind + "-after"] += 1
        if error is not None:
            raise error

    def cut(self, data: bytes) -> bytes:
        with self._lock:
            if self.truncate <= 0 or not data:
                return data
            self.truncate -= 1
            self.injected["truncated"] += 1
        return data[: len(data) // 2]


class FaultyFS:
    """Wraps an fsspec filesystem: the calls marinfs.remote makes go through a FaultPlan; every
    other attribute is the wrapped filesystem's. Install with ``remote.fs = FaultyFS(remote.fs, plan)``."""

    def __init__(self, fs: Any, plan: FaultPlan) -> None:
        self._fs = fs
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        kind = FS_METHOD_KINDS.get(name)
        if kind is None or not callable(attr):
            return attr
        plan = self._plan

        def call(*args: Any, **kwargs: Any) -> Any:
            plan.before(kind)
            result = attr(*args, **kwargs)
            plan.after(kind)
            if name == "cat_file" and isinstance(result, bytes):
                result = plan.cut(result)
            return result

        return call


# -- process level: an HTTP proxy that fails requests --------------------------------------------

S3_503 = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
          b"<Message>Please reduce your request rate.</Message><RequestId>injected</RequestId></Error>")
S3_403 = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
          b"<Message>Access Denied</Message><RequestId>injected</RequestId></Error>")
ANSWERS = {503: (b"Slow Down", S3_503), 403: (b"Forbidden", S3_403)}


class HttpRequest:
    """One request as the proxy read it: ``method``, ``target`` (path and query), lower-case
    ``headers``, and ``body`` (the whole of it, de-chunked as sent)."""

    def __init__(self, head: bytes, body: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self.method, self.target, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
        self.headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                self.headers[name.strip().lower()] = value.strip()
        self.head = head
        self.body = body

    def __repr__(self) -> str:
        return f"{self.method} {self.target} ({len(self.body)} bytes)"


class HttpFaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``target`` (one request per connection).

    - ``fail_fraction``: that fraction of requests (seeded) matching ``fail_match`` is answered
      ``503 SlowDown`` (``fail_status`` 403: ``AccessDenied``) without reaching the server.
    - ``delay``: seconds each request matching ``delay_match`` waits before it is forwarded
      (a slow store); ``arrivals`` lists every request as it arrives (monotonic time, method,
      target), so a test can count what was sent after a moment.
    - ``stop_when``: a one-shot trigger; the first matching request makes the server "stop":
      with ``stop_at="request"`` the request is dropped unanswered (the connection is reset, as
      when a server dies during an upload); with ``"response"`` the server's response is cut
      after ``cut_after`` bytes. From then on every connection is reset at once (a stopped
      server) for ``outage`` seconds, or until :meth:`restart`.

    A response that names the server in its head (a resumable session's ``Location``) names
    the proxy instead, so every request of an upload meets the faults.
    """

    def __init__(self, target_host: str, target_port: int, seed: int = 0) -> None:
        self.target = (target_host, target_port)
        self.fail_fraction = 0.0
        self.fail_match = lambda req: True
        self.fail_status = 503
        self.stop_when = None  # Callable[[HttpRequest], bool] | None
        self.delay = 0.0
        self.delay_match = lambda req: True
        self.arrivals: list[tuple[float, str, str]] = []
        self.stop_at = "response"
        self.cut_after = 1024
        self.outage = float("inf")
        self.requests: list[str] = []  # "METHOD target -> status or fault", in arrival order
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = listener(128)
        self.port = self._server.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def stop_server(self, seconds: float = float("inf")) -> None:
        """From now on, behave like a stopped server for ``seconds``."""
        with self._lock:
            self._down_until = time.monotonic() + seconds
            live = list(self._sockets)
        for s in live:
            _reset(s)

    def restart(self) -> None:
        with self._lock:
            self._down_until = 0.0

    def __enter__(self) -> "HttpFaultProxy":
        t = threading.Thread(target=self._accept, daemon=True)
        self._threads.append(t)
        t.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        with self._lock:
            live = list(self._sockets)
        for s in live:
            _reset(s)
        self._server.close()
        for t in self._threads:
            t.join(timeout=5)

    # -- plumbing ----------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            if self.down:
                _reset(client)
                self.counts["refused"] += 1
                continue
            with self._lock:
                self._sockets.add(client)
            t = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _own_urls(self, response: bytes) -> bytes:
        """URLs in the response head that name the server name the proxy instead: a resumable
        upload's session (GCS's ``Location``) must go through the proxy too."""
        end = response.index(b"\r\n\r\n")
        server = f"http://{self.target[0]}:{self.target[1]}".encode()
        return response[:end].replace(server, self.endpoint.encode()) + response[end:]

    def _record(self, req: HttpRequest, what: str) -> None:
        with self._lock:
            self.requests.append(f"{req.method} {req.target} -> {what}")
            self.counts[what] += 1

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            client.settimeout(60)
            req = _read_request(client)
            if req is None or self.down:
                return
            with self._lock:
                self.arrivals.append((time.monotonic(), req.method, req.target))
                delay = self.delay if self.delay and self.delay_match(req) else 0.0
            if delay:
                time.sleep(delay)
                if self.down:  # it stopped while the request waited: never served
                    self._record(req, "server stopped (request dropped)")
                    return
            with self._lock:
                stopping = self.stop_when is not None and self.stop_when(req)
                if stopping:
                    self.stop_when = None
                failing = not stopping and self.fail_match(req) and self._rng.random() < self.fail_fraction
            if failing:
                status = self.fail_status
                reason, answer = ANSWERS[status]
                self._record(req, str(status))
                body = b"" if req.method == "HEAD" else answer
                client.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (status, reason, len(answer)) + body)
                return
            if stopping and self.stop_at == "request":
                self._record(req, "server stopped (request dropped)")
                self.stop_server(self.outage)
                return
            upstream = socket.create_connection(self.target, timeout=60)
            with self._lock:
                self._sockets.add(upstream)
            upstream.sendall(_rewrite_head(req.head) + req.body)
            sent = 0
            head: bytes | None = b""
            while True:
                data = upstream.recv(1 << 16)
                if not data:
                    if head:
                        client.sendall(head)
                    break
                if head is not None:  # still in the response head: hold it until it is whole
                    head += data
                    if b"\r\n\r\n" not in head:
                        continue
                    data, head = self._own_urls(head), None
                if stopping and sent + len(data) >= self.cut_after:
                    client.sendall(data[: max(0, self.cut_after - sent)])
                    self._record(req, f"server stopped after {self.cut_after} response bytes")
                    self.stop_server(self.outage)
                    return
                client.sendall(data)
                sent += len(data)
            self._record(req, "forwarded")
        except OSError:
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    with self._lock:
                        self._sockets.discard(s)
                    s.close()


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset, as the kernel does for a process that died."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _recv_until(sock: socket.socket, buf: bytearray, marker: bytes) -> int:
    while True:
        i = buf.find(marker)
        if i >= 0:
            return i
        data = sock.recv(1 << 16)
        if not data:
            return -1
        buf += data


def _recv_exactly(sock: socket.socket, buf: bytearray, n: int) -> bool:
    while len(buf) < n:
        data = sock.recv(1 << 16)
        if not data:
            return False
        buf += data
    return True


def _read_request(sock: socket.socket) -> HttpRequest | None:
    buf = bytearray()
    end = _recv_until(sock, buf, b"\r\n\r\n")
    if end < 0:
        return None
    head, rest = bytes(buf[: end + 4]), bytearray(buf[end + 4:])
    req = HttpRequest(head, b"")
    if req.headers.get("expect", "").lower() == "100-continue":
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # we want the body before deciding
    if "content-length" in req.headers:
        n = int(req.headers["content-length"])
        if not _recv_exactly(sock, rest, n):
            return None
        req.body = bytes(rest[:n])
    elif "chunked" in req.headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            i = _recv_until(sock, rest, b"\r\n")
            if i < 0:
                return None
            size = int(bytes(rest[:i]).split(b";")[0], 16)
            if not _recv_exactly(sock, rest, i + 2 + size + 2):
                return None
            body += rest[: i + 2 + size + 2]
            del rest[: i + 2 + size + 2]
            if size == 0:
                break
        req.body = bytes(body)
    return req


def _rewrite_head(head: bytes) -> bytes:
    """One request per upstream connection, and no 100-continue dance (answered already)."""
    lines = head.split(b"\r\n")
    kept = [ln for ln in lines[1:] if ln and not ln.lower().startswith((b"connection:", b"expect:"))]
    return b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])
