"""A scripted HTTP server on loopback, for the tests of our own HTTP paths (S3's s3http.py,
GCS's gcshttp.py): each test's handler answers with what its script says, the shared parts
(a plain answer, quiet logs, a server on a free port that is always shut down) live here."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class ScriptedHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler],
            tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """``handler`` on 127.0.0.1 at a free port, in a thread; yields its base URL. With ``tls``
    (a certificate and its key, :func:`self_signed`), over HTTPS."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself (openssl), and its key, in ``where``."""
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key
