"""GCS chunk fetches sent by us and read into the chunk's buffer (marinfs/remote/gcshttp.py):
gcsfs's very URL and headers, every answer a server can give mapped to the error marinfs
expects (against a tiny scripted server on loopback), and on fake-gcs-server the path that is
used, one GET per fetch, a body cut short retried, a replaced object ESTALE, and gcsfs again when
the path is off or refused."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from marinfs.errors import StaleVersionError
from marinfs.remote import Remote, RemoteSettings, is_transient
from marinfs.remote.gcshttp import GCSHttp, usable

from scripted import ScriptedHandler, serving

BODY = bytes(range(256)) * 4
GENERATION = "1700000000000001"


class Scripted(ScriptedHandler):
    """Answers each media GET with the next scripted behaviour, as GCS does (206, Content-Range,
    x-goog-generation)."""

    script: list[str] = []
    seen: list[tuple[str, dict[str, str]]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Scripted.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        action = Scripted.script.pop(0) if Scripted.script else "206"
        rng = self.headers.get("Range", "bytes=0-")[6:].split("-")
        start, end = int(rng[0]), int(rng[1]) + 1
        span = {"Content-Range": f"bytes {start}-{end - 1}/{len(BODY)}", "x-goog-generation": GENERATION}
        if action == "206":
            self._send(206, BODY[start:end], span)
        elif action == "200":
            self._send(200, BODY, {"x-goog-generation": GENERATION})
        elif action == "other-generation":
            self._send(206, BODY[start:end], {**span, "x-goog-generation": "5"})
        elif action == "other-offset":
            self._send(206, BODY[start + 1:end + 1], {**span, "Content-Range": f"bytes {start + 1}-{end}/{len(BODY)}"})
        elif action == "truncated":
            self.send_response(206)
            self.send_header("Content-Length", str(end - start))
            for name, value in span.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(BODY[start:start + 10])
            self.close_connection = True
        elif action == "slow":
            time.sleep(1.5)
            self._send(206, BODY[start:end], span)
        else:
            self._send(int(action), b'{"error": {"message": "scripted"}}')


@pytest.fixture
def server() -> Iterator[str]:
    Scripted.script, Scripted.seen = [], []
    with serving(Scripted) as url:
        yield url


def gcsfs_of(endpoint: str, **options: Any) -> Any:
    import gcsfs

    return gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", project="test", skip_instance_cache=True,
                               **options)


def test_sends_what_gcsfs_sends_and_reads_the_body_into_the_buffer(server: str) -> None:
    """The URL is gcsfs's own download URL for that generation (the name quoted, the endpoint
    its), with gcsfs's headers and a Range; the body lands in the caller's buffer."""
    fs = gcsfs_of(server)
    g = GCSHttp(fs, connect_timeout=1, read_timeout=0.5)
    buf = memoryview(bytearray(100))
    assert g.get_into("b/dir/a b+c%", 10, 110, GENERATION, buf) == 100 and bytes(buf) == BODY[10:110]
    path, headers = Scripted.seen[-1]
    assert f"{server}{path}" == fs.url("b/dir/a b+c%", generation=GENERATION)
    assert urlsplit(path).path == "/download/storage/v1/b/b/o/dir%2Fa%20b%2Bc%25"
    assert parse_qs(urlsplit(path).query) == {"alt": ["media"], "generation": [GENERATION]}
    assert headers["range"] == "bytes=10-109" and headers["user-agent"].startswith("python-gcsfs/")
    assert "authorization" not in headers  # token=anon
    Scripted.script = ["200"]  # a server that ignored the range: cut to it
    assert g.get_into("b/k", 3, 103, GENERATION, buf) == 100 and bytes(buf) == BODY[3:103]


def test_requester_pays_and_credentials_come_from_gcsfs(server: str) -> None:
    """userProject of a requester-pays bucket and the credentials' Authorization header: what
    gcsfs would send for the same read."""
    fs = gcsfs_of(server, requester_pays="billed-project")

    class Token:  # what gcsfs's credentials object does: headers applied in place
        credentials = None

        def apply(self, out: dict[str, str]) -> None:
            out["Authorization"] = "Bearer t0k3n"

    fs.credentials = Token()
    GCSHttp(fs, connect_timeout=1, read_timeout=0.5).get_into("b/k", 0, 10, GENERATION, memoryview(bytearray(10)))
    path, headers = Scripted.seen[-1]
    assert parse_qs(urlsplit(path).query)["userProject"] == ["billed-project"]
    assert headers["authorization"] == "Bearer t0k3n"


@pytest.mark.parametrize("status, error", [("404", FileNotFoundError), ("403", PermissionError),
                                           ("503", ConnectionError), ("429", ConnectionError),
                                           ("400", OSError)])
def test_statuses_become_the_errors_marinfs_expects(server: str, status: str, error: type) -> None:
    g = GCSHttp(gcsfs_of(server), connect_timeout=1, read_timeout=0.5)
    Scripted.script = [status]
    with pytest.raises(error) as caught:
        g.get_into("b/k", 0, 10, GENERATION, memoryview(bytearray(10)))
    assert is_transient(caught.value) == (error is ConnectionError)


def test_unauthorized_refreshes_the_credentials_and_asks_once_more(server: str) -> None:
    fs = gcsfs_of(server)
    refreshed: list[float] = []

    class Expiring:
        credentials = object()  # not anonymous

        def apply(self, out: dict[str, str]) -> None:
            out["Authorization"] = f"Bearer {len(refreshed)}"

        def maybe_refresh(self, refresh_buffer: float) -> None:
            refreshed.append(refresh_buffer)

    fs.credentials = Expiring()
    g = GCSHttp(fs, connect_timeout=1, read_timeout=0.5)
    Scripted.script = ["401"]
    buf = memoryview(bytearray(10))
    assert g.get_into("b/k", 0, 10, GENERATION, buf) == 10 and bytes(buf) == BODY[:10]
    assert len(refreshed) == 1 and [h["authorization"] for _, h in Scripted.seen] == ["Bearer 0", "Bearer 1"]
    Scripted.script = ["401", "401"]
    with pytest.raises(PermissionError):
        g.get_into("b/k", 0, 10, GENERATION, buf)


def test_a_cut_body_another_generation_or_offset_and_a_stall_are_refused(server: str) -> None:
    """Never bytes of another generation or offset in the buffer; a body cut short answers the
    bytes that came (the caller retries) or a transient error; a stalled body is TimeoutError;
    and the next requests are fine (no half-read connection reused)."""
    g = GCSHttp(gcsfs_of(server), connect_timeout=1, read_timeout=0.5)
    buf = memoryview(bytearray(100))
    Scripted.script = ["other-generation"]
    with pytest.raises(StaleVersionError):
        g.get_into("b/k", 0, 100, GENERATION, buf)
    Scripted.script = ["other-offset"]
    with pytest.raises(OSError) as caught:
        g.get_into("b/k", 0, 100, GENERATION, buf)
    assert caught.value.errno == 5 and not is_transient(caught.value)
    Scripted.script = ["truncated"]
    try:
        n = g.get_into("b/k", 0, 100, GENERATION, buf)
    except ConnectionError as exc:  # http.client may call it an IncompleteRead
        assert is_transient(exc)
    else:
        assert n == 10 and bytes(buf[:10]) == BODY[:10]
    Scripted.script = ["slow"]
    with pytest.raises(TimeoutError):
        g.get_into("b/k", 0, 100, GENERATION, buf)
    for start in (0, 500, 900):
        assert g.get_into("b/k", start, start + 100, GENERATION, buf) == 100 and bytes(buf) == BODY[start:start + 100]


def test_what_the_path_cannot_reproduce_keeps_gcsfs(server: str) -> None:
    assert usable(gcsfs_of(server)) is None
    assert "session" in (usable(gcsfs_of(server, session_kwargs={"trust_env": True})) or "")
    mtls = gcsfs_of(server)
    mtls._use_client_cert = True
    assert "mTLS" in (usable(mtls) or "")


# -- on fake-gcs-server, through GCSRemote ---------------------------------------------------------
def remote_with(gcs_server: Any, monkeypatch: pytest.MonkeyPatch, direct: bool = True) -> Remote:
    for name, value in gcs_server.env().items():
        monkeypatch.setenv(name, value)
    remote = Remote(f"gs://{gcs_server.bucket}/t-{uuid.uuid4().hex[:12]}", gcs_server.storage_options(),
                    RemoteSettings(direct_get=direct))  # MARINFS_DIRECT_GET=0 when not direct
    assert (remote._direct is not None) == direct
    return remote


def gcsfs_reads(remote: Remote, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The ranged reads gcsfs is asked for from now on."""
    asked: list[tuple[int, int]] = []
    real = remote.fs._cat_file_sequential

    async def counted(path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        asked.append((start or 0, end or 0))
        return await real(path, start=start, end=end, **kw)

    monkeypatch.setattr(remote.fs, "_cat_file_sequential", counted)
    return asked


def test_read_into_goes_direct_one_get_each_retries_short_bodies_and_is_stale_when_replaced(
        gcs_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = remote_with(gcs_server, monkeypatch)
    data = os.urandom((3 << 20) + 5)
    remote.fs.pipe_file(remote.full("obj"), data)
    version = remote.stat("obj").version
    asked = gcsfs_reads(remote, monkeypatch)
    remote.stats.reset()
    ranges = ((0, 1), (5, 1 << 20), (1 << 20, len(data)))
    for start, end in ranges:
        buf = memoryview(bytearray(end - start))
        remote.read_into("obj", start, end, version, buf)
        assert bytes(buf) == data[start:end]
    assert remote.stats.count("get") == 3 and asked == []  # ours, never gcsfs's
    assert remote.stats.snapshot()["bytes_in"] == sum(end - start for start, end in ranges)

    real = GCSHttp.get_into
    cut = [True]

    def once_short(self: GCSHttp, full: str, start: int, end: int, generation: str, buf: memoryview) -> int:
        n = real(self, full, start, end, generation, buf)
        return n - 1 if (cut.pop() if cut else False) else n  # as a body cut short would answer

    monkeypatch.setattr(GCSHttp, "get_into", once_short)
    buf = memoryview(bytearray(1000))
    remote.stats.reset()
    remote.read_into("obj", 0, 1000, version, buf)
    assert bytes(buf) == data[:1000] and remote.stats.count("get") == 2  # retried once
    remote.fs.pipe_file(remote.full("obj"), b"replaced")
    remote.stats.reset()
    with pytest.raises(StaleVersionError):
        remote.read_into("obj", 0, 4, version, memoryview(bytearray(4)))
    assert remote.stats.count("get") == 1 and asked == []  # a 404 of that generation: not retried
    remote.close()


def test_direct_get_off_reads_through_gcsfs(gcs_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """MARINFS_DIRECT_GET=0: chunk fetches go through gcsfs as before, pinned the same way."""
    remote = remote_with(gcs_server, monkeypatch, direct=False)
    data = os.urandom(1 << 20)
    remote.fs.pipe_file(remote.full("f"), data)
    version = remote.stat("f").version
    asked = gcsfs_reads(remote, monkeypatch)
    remote.stats.reset()
    buf = memoryview(bytearray(len(data) - 3))
    remote.read_into("f", 3, len(data), version, buf)
    assert bytes(buf) == data[3:] and asked == [(3, len(data))] and remote.stats.count("get") == 1
    remote.fs.pipe_file(remote.full("f"), b"replaced")
    with pytest.raises(StaleVersionError):
        remote.read_into("f", 0, 4, version, memoryview(bytearray(4)))


def test_a_refused_direct_get_falls_back_to_gcsfs_for_good(gcs_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET of ours the server refuses (403) where gcsfs's passes is read through gcsfs into the
    same buffer, and every later fetch goes there at once; a denial gcsfs meets too is EACCES."""
    remote = remote_with(gcs_server, monkeypatch)
    data = os.urandom((1 << 20) + 7)
    remote.fs.pipe_file(remote.full("f"), data)
    version = remote.stat("f").version
    asked = gcsfs_reads(remote, monkeypatch)
    refusals: list[str] = []

    def refused(full: str, *args: Any) -> int:
        refusals.append(full)
        raise PermissionError(13, "access denied (HTTP 403)", full)

    monkeypatch.setattr(remote._direct, "get_into", refused)
    buf = memoryview(bytearray(len(data) - 7))
    remote.read_into("f", 7, len(data), version, buf)
    assert bytes(buf) == data[7:] and remote._direct_refused and len(refusals) == 1 and len(asked) == 1
    remote.read_into("f", 0, 7, version, buf[:7])
    assert bytes(buf[:7]) == data[:7] and len(refusals) == 1 and len(asked) == 2

    other = remote_with(gcs_server, monkeypatch)
    monkeypatch.setattr(other._direct, "get_into", refused)

    async def forbidden(*args: Any, **kwargs: Any) -> bytes:
        raise OSError("Forbidden: b/o\nscripted")  # gcsfs's 403

    monkeypatch.setattr(other.fs, "_cat_file_sequential", forbidden)
    with pytest.raises(PermissionError):
        other.read_into(remote.key_of(remote.full("f")), 0, 4, version, memoryview(bytearray(4)))
    assert not other._direct_refused
