"""Process-level faults for tests: a TCP proxy in front of a real server that can be wedged
(connections accepted, nothing forwarded) and healed. Loopback only; stops its own threads."""

from __future__ import annotations

import select
import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; ``wedged`` stalls every byte in both directions."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.wedged = threading.Event()
        self._stop = threading.Event()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self._server.settimeout(0.2)
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
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([a, b], [], [], 0.1)
                if self.wedged.is_set():
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
