"""Ranged GETs and small PUTs on plain threads (marinfs/remote/s3http.py): every answer a server
can give becomes the error the rest of marinfs expects, against a tiny HTTP server on loopback;
and on SeaweedFS the same bytes, version checks and preconditions as the s3fs path."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from marinfs.config import file as configfile
from marinfs.remote.s3http import S3Http
import tiers
from marinfs.errors import PreconditionFailed, RemoteError, StaleVersionError, UsageError
from marinfs.remote import Remote, RemoteSettings
from marinfs.objects import ABSENT

from scripted import ScriptedHandler, serving

BODY = bytes(range(256)) * 4


class Scripted(ScriptedHandler):
    """Answers each GET with the next scripted behaviour."""

    script: list[str] = []
    seen: list[dict[str, str]] = []
    bodies: list[bytes] = []  # of PUTs

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        Scripted.seen.append(dict(self.headers))
        action = Scripted.script.pop(0) if Scripted.script else "206"
        rng = self.headers.get("Range", "bytes=0-")[6:].split("-")
        start, end = int(rng[0]), int(rng[1]) + 1
        span = {"Content-Range": f"bytes {start}-{end - 1}/{len(BODY)}"}  # as S3 answers a range
        if action == "206":
            self._send(206, BODY[start:end], span)
        elif action == "200":
            self._send(200, BODY)
        elif action == "truncated":
            self.send_response(206)
            self.send_header("Content-Length", str(end - start))
            self.send_header("Content-Range", span["Content-Range"])
            self.end_headers()
            self.wfile.write(BODY[start:start + 10])
            self.close_connection = True
        elif action == "slow":
            time.sleep(1.5)
            self._send(206, BODY[start:end], span)
        else:
            self._send(int(action), b"<Error/>")

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        Scripted.seen.append(dict(self.headers))
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Scripted.bodies.append(body)
        action = Scripted.script.pop(0) if Scripted.script else "200"
        if action in ("200", "200-no-echo", "200-wrong-echo"):  # "200" echoes a CRC-32C, as S3 does
            self.send_response(200)
            self.send_header("ETag", f'"etag-of-{len(body)}"')
            crc = self.headers.get("x-amz-checksum-crc32c")
            if crc and action == "200":
                self.send_header("x-amz-checksum-crc32c", crc)
            elif crc and action == "200-wrong-echo":
                self.send_header("x-amz-checksum-crc32c", "AAAAAA==")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif action == "bad-digest":
            self._send(400, b"<Error><Code>BadDigest</Code></Error>")
        else:
            self._send(int(action), b"<Error/>")


@pytest.fixture
def server() -> Iterator[str]:
    Scripted.script, Scripted.seen, Scripted.bodies = [], [], []
    with serving(Scripted) as url:
        yield url


def getter(base: str, signed: list[str], params: list[dict[str, Any]] | None = None) -> S3Http:
    def presign(full: str, expires: int, method: str, **signed_params: Any) -> str:
        signed.append(full if method == "get_object" else f"{method} {full}")
        if params is not None:
            params.append(signed_params)
        return f"{base}/{full}?X-Amz-Signature={len(signed)}"

    return S3Http(presign, connect_timeout=1, read_timeout=0.5)


def direct_and_plain(s3_server: Any) -> tuple[Remote, Remote]:
    """Two Remotes over one fresh prefix: one with the direct requests, one through s3fs only."""
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    plain = Remote(url, s3_server.storage_options(), RemoteSettings(direct_get=False))  # MARINFS_DIRECT_GET=0
    direct = Remote(url, s3_server.storage_options())
    assert direct._direct is not None and plain._direct is None
    return direct, plain


def test_ranges_versions_and_signing(server: str) -> None:
    signed: list[str] = []
    g = getter(server, signed)
    assert g.get("b/k", 10, 20, "abc") == BODY[10:20]
    sent = {k.lower(): v for k, v in Scripted.seen[-1].items()}
    assert sent["range"] == "bytes=10-19" and sent["if-match"] == '"abc"'
    assert g.get("b/k", 0, 5, None) == BODY[:5] and "If-Match" not in Scripted.seen[-1]
    assert signed == ["b/k"]  # one signature serves many reads
    Scripted.script = ["200"]
    assert g.get("b/k", 3, 7, None) == BODY[3:7]  # a server that ignores Range


@pytest.mark.parametrize("status, error", [("412", StaleVersionError), ("404", FileNotFoundError),
                                           ("503", ConnectionError), ("500", ConnectionError),
                                           ("429", ConnectionError), ("400", OSError)])
def test_statuses_become_the_errors_marinfs_expects(server: str, status: str, error: type) -> None:
    Scripted.script = [status]
    with pytest.raises(error):
        getter(server, []).get("b/k", 0, 10, "v")


def test_forbidden_signs_again_once(server: str) -> None:
    signed: list[str] = []
    g = getter(server, signed)
    Scripted.script = ["403"]
    assert g.get("b/k", 0, 4, None) == BODY[:4] and len(signed) == 2
    Scripted.script = ["403", "403"]
    with pytest.raises(PermissionError):
        g.get("b/k", 0, 4, None)


def test_truncated_body_and_timeout_are_transient_errors(server: str) -> None:
    from marinfs.remote import is_transient

    g = getter(server, [])
    Scripted.script = ["truncated"]
    with pytest.raises(ConnectionError) as info:
        g.get("b/k", 0, 100, None)
    assert is_transient(info.value)
    Scripted.script = ["slow"]
    started = time.monotonic()
    with pytest.raises(TimeoutError) as timeout:
        g.get("b/k", 0, 100, None)
    assert is_transient(timeout.value) and time.monotonic() - started < 1.4
    assert g.get("b/k", 0, 100, None) == BODY[:100]  # and the next request is fine


def test_same_bytes_and_version_checks_as_s3fs(s3_server: Any) -> None:
    direct, plain = direct_and_plain(s3_server)
    data = os.urandom(3 << 20)
    direct.fs.pipe_file(direct.full("obj"), data)
    version = direct.stat("obj").version
    for start, end in ((0, 1), (5, 1 << 20), ((3 << 20) - 7, 3 << 20)):
        assert direct.read_range("obj", start, end, version) == plain.read_range("obj", start, end, version) \
            == data[start:end]
    direct.stats.reset()
    direct.read_range("obj", 0, 10, version)
    assert direct.stats.count("get") == 1
    direct.fs.pipe_file(direct.full("obj"), b"replaced")
    with pytest.raises(StaleVersionError):
        direct.read_range("obj", 0, 4, version)


def test_put_answers_the_etag_and_maps_statuses(server: str) -> None:
    signed: list[str] = []
    params: list[dict[str, Any]] = []
    g = getter(server, signed, params)
    assert g.put("b/new", b"12345", {"IfNoneMatch": "*"}) == "etag-of-5"
    assert Scripted.seen[-1]["If-None-Match"] == "*" and signed == ["put_object b/new"]
    # Every header sent is signed into the URL: a store that checks signatures sees what was signed.
    md5 = "gnzLDuqKcGxMNKFokfhOew=="  # base64 of md5(b"12345")
    assert Scripted.seen[-1]["Content-MD5"] == md5 and params[-1] == {"ContentMD5": md5, "IfNoneMatch": "*"}
    for status, error in (("412", PreconditionFailed), ("503", ConnectionError), ("409", ConnectionError),
                          ("404", FileNotFoundError), ("400", OSError)):
        Scripted.script = [status]
        with pytest.raises(error):
            g.put("b/new", b"x", {})
    Scripted.script = ["403"]
    before = len(signed)  # a PUT is signed for its own body (Content-MD5): every PUT signs anew
    assert g.put("b/new", b"xy", {}) == "etag-of-2" and len(signed) == before + 2  # signed again once


def test_small_commits_go_direct_with_preconditions(s3_server: Any, tmp_path: Any) -> None:
    """The direct PUT keeps every rule of the s3fs one: the version it answers is the one a
    stat sees, If-None-Match/If-Match are enforced by the server, and a PUT retried after its
    answer was lost (it finds its own bytes) is not a conflict."""
    direct, plain = direct_and_plain(s3_server)
    src = tmp_path / "src"
    for remote, name in ((direct, "d"), (plain, "p")):
        src.write_bytes(b"first " + name.encode())
        remote.stats.reset()
        v1 = remote.upload(str(src), name, ABSENT)
        assert remote.stats.count("put") == 1 and remote.stats.count("head") == 0
        assert v1 == remote.stat(name).version and remote.fs.cat_file(remote.full(name)) == b"first " + name.encode()
        remote.upload(str(src), name, ABSENT)  # the same bytes again: ours, not a conflict
        src.write_bytes(b"second")
        with pytest.raises(PreconditionFailed):
            remote.upload(str(src), name, ABSENT)  # someone else's bytes are there
        v2 = remote.upload(str(src), name, v1)
        assert v2 == remote.stat(name).version != v1
        src.write_bytes(b"third")
        with pytest.raises(PreconditionFailed):
            remote.upload(str(src), name, v1)  # the version it started from is gone
        assert remote.fs.cat_file(remote.full(name)) == b"second"
    # Signed in this thread by a botocore client that signs exactly like s3fs here.
    assert direct._presigner._clients[s3_server.bucket] is not None


def test_presigner_falls_back_to_s3fs_when_its_client_would_sign_differently(
        s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib.parse import urlsplit

    from marinfs.remote.s3http import Presigner

    remote = Remote(f"s3://{s3_server.bucket}/t", s3_server.storage_options())
    p = Presigner(remote.fs)
    ours = p.url(f"{s3_server.bucket}/a b/c", 60, "get_object")
    assert p._clients[s3_server.bucket] is not None
    assert urlsplit(ours).path == urlsplit(remote.fs.url(f"{s3_server.bucket}/a b/c", expires=60)).path
    real_url = remote.fs.url
    monkeypatch.setattr(remote.fs, "url", lambda path, **kw: real_url(path, **kw).replace("127.0.0.1", "localhost"))
    other = Presigner(remote.fs)
    assert "localhost" in other.url(f"{s3_server.bucket}/k", 60, "get_object")  # s3fs's own URL
    assert other._clients[s3_server.bucket] is None
    # Other credentials (a session handed to s3fs that we cannot see): s3fs signs.
    monkeypatch.setattr(remote.fs, "url", lambda path, **kw: re.sub("AWSAccessKeyId=[^&]*", "AWSAccessKeyId=OTHER",
                                                                   real_url(path, **kw)))
    third = Presigner(remote.fs)
    assert "AWSAccessKeyId=OTHER" in third.url(f"{s3_server.bucket}/k", 60, "get_object")
    assert third._clients[s3_server.bucket] is None


def test_listings_match_s3fs_entry_for_entry(s3_server: Any) -> None:
    """The direct ListObjectsV2 (ElementTree, URL-encoded keys, every page) gives the very
    ObjectInfos the s3fs listing gives: files, prefixes, markers, odd names, 1,000+ keys."""
    direct, plain = direct_and_plain(s3_server)
    odd = ["sp ace", "ü-é", "a+b", "%41", "q?x=1", "semi;colon", "amp&lt", "<tag>", "quote\"s", "star*"]
    blobs = {f"d/{n}": n.encode() for n in odd}
    blobs |= {f"many/f{i:05d}": b"x" * (i % 7) for i in range(1203)}
    blobs |= {"d/sub/inner": b"1", "d/marker/": b"", "d/x": b"file", "d/x/y": b"under"}
    direct.fs.pipe({direct.full(k): v for k, v in blobs.items()})

    def listing(remote: Remote, key: str) -> list[tuple]:
        return sorted((i.name, i.is_dir, i.size, i.version, i.mtime_ns) for i in remote.list(key))

    direct.stats.reset()
    many = listing(direct, "many")
    assert direct.stats.count("list") == 2  # two pages, counted
    assert many == listing(plain, "many") and len(many) == 1203
    got = listing(direct, "d")
    assert got == listing(plain, "d")
    assert {n for n, *_ in got} >= {f"d/{n}" for n in odd} | {"d/sub", "d/marker", "d/x"}
    assert listing(direct, "") == listing(plain, "")
    with pytest.raises(FileNotFoundError):
        direct.list("nothing-here")
    with pytest.raises(NotADirectoryError):
        direct.list("many/f00001")


def test_a_truncated_page_without_a_token_is_an_error_not_a_short_listing() -> None:
    from marinfs.remote.s3http import parse_listing

    page = (b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>true'
            b'</IsTruncated><EncodingType>url</EncodingType><Contents><Key>p/a%20b</Key><Size>3</Size>'
            b'<ETag>&quot;e&quot;</ETag><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>'
            b'<CommonPrefixes><Prefix>p/c%2Bd/</Prefix></CommonPrefixes>'
            b'<CommonPrefixes><Prefix>p/e+f/</Prefix></CommonPrefixes></ListBucketResult>')  # "+": a space
    with pytest.raises(OSError):
        parse_listing(page, "b")
    entries, token = parse_listing(page.replace(b"</ListBucketResult>", b"<NextContinuationToken>t"
                                                b"</NextContinuationToken></ListBucketResult>"), "b")
    assert token == "t" and [e["name"] for e in entries] == ["b/p/a b", "b/p/c+d", "b/p/e f"]
    assert entries[0]["ETag"] == '"e"' and entries[0]["size"] == 3 and entries[2]["type"] == "directory"


def test_parts_are_signed_per_part_and_carry_their_md5(server: str) -> None:
    import base64
    import hashlib

    calls: list[tuple] = []

    def presign(full: str, expires: int, method: str, **params: Any) -> str:
        calls.append((method, full, params))
        return f"{server}/{full}?partNumber={params.get('PartNumber')}"

    g = S3Http(presign, connect_timeout=1, read_timeout=0.5)
    assert g.put_part("b/k", "up-1", 3, b"abcd") == '"etag-of-4"'
    md5 = base64.b64encode(hashlib.md5(b"abcd").digest()).decode()
    assert calls == [("upload_part", "b/k", {"UploadId": "up-1", "PartNumber": 3, "ContentMD5": md5})]
    assert Scripted.seen[-1]["Content-MD5"] == md5
    Scripted.script = ["500"]
    with pytest.raises(ConnectionError):
        g.put_part("b/k", "up-1", 4, b"x")


def test_multipart_commits_go_direct(s3_server: Any, tmp_path: Any) -> None:
    from marinfs.remote import RemoteSettings

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options(), RemoteSettings(upload_part_size=5 << 20))
    assert remote._direct is not None
    src = tmp_path / "big"
    data = os.urandom((12 << 20) + 5)
    src.write_bytes(data)
    remote.stats.reset()
    version = remote.upload(str(src), "big", ABSENT)
    assert remote.stats.count("part") >= 5  # create, 3 parts (counted here), complete
    assert remote.fs.cat_file(remote.full("big")) == data and remote.stat("big").version == version
    with pytest.raises(PreconditionFailed):
        remote.upload(str(src), "big", ABSENT)


def test_requests_are_signed_with_sigv4_by_our_own_client(s3_server: Any) -> None:
    """The test server checks signatures: every direct request (GET, conditional PUT with its
    Content-MD5, part, listing) passes, signed by our client in the calling thread with SigV4
    (botocore's presign default, SigV2, signs neither a listing's query nor an unsent MD5)."""
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options())
    assert remote._presigner._client(s3_server.bucket) is not None  # not s3fs's fallback signer
    signed = remote._presigner.url(remote.full("x"), 60, "put_object", ContentMD5="abc")
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in signed and "content-md5" in signed.lower()
    src = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"marinfs-sig-{uuid.uuid4().hex}")
    try:
        with open(src, "wb") as f:
            f.write(b"signed bytes")
        version = remote.upload(src, "d/f", ABSENT)
    finally:
        os.unlink(src)
    assert [i.name for i in remote.list("d")] == ["d/f"]
    assert remote.read_range("d/f", 0, 6, version) == b"signed"
    assert not remote._direct_refused


def test_a_refused_direct_request_falls_back_to_s3fs(s3_server: Any, tmp_path: Any) -> None:
    """A store that refuses what we sign ourselves (403) but takes s3fs's requests costs speed,
    never a commit, a read or a listing: the request is sent again through s3fs, and every later
    one goes there at once."""
    from marinfs.remote import RemoteSettings

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options(), RemoteSettings(upload_part_size=5 << 20))
    presign = remote._presigner.url

    def badly_signed(full: str, expires: int, method: str, **params: Any) -> str:
        return presign(full, expires, method, **params).replace("X-Amz-Signature=", "X-Amz-Signature=0")

    remote._direct._presign = badly_signed
    src = tmp_path / "f"
    src.write_bytes(b"kept")
    version = remote.upload(str(src), "f", ABSENT)  # direct PUT refused twice, then s3fs's PUT
    assert remote._direct_refused
    assert remote.fs.cat_file(remote.full("f")) == b"kept" and version == remote.stat("f").version
    remote.stats.reset()
    assert remote.read_range("f", 0, 4, version) == b"kept"
    assert [i.name for i in remote.list("")] == ["f"]
    big = os.urandom((11 << 20) + 3)
    src.write_bytes(big)
    remote.upload(str(src), "big", ABSENT)
    # After the first refusal nothing is sent our way any more: s3fs's hook counted every request.
    assert remote.stats.count("get") == 1 and remote.stats.count("list") == 1
    assert remote.fs.cat_file(remote.full("big")) == big

    # A denial that s3fs meets too is the real answer, raised as it was.
    other = Remote(url, {**s3_server.storage_options(), "secret": "wrong"})
    with pytest.raises(PermissionError):
        other.read_range("f", 0, 4)


def test_threads_that_ask_at_once_share_one_signing_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh mount's FUSE and fetch threads all ask for the signer at once: one builds it and
    the others wait (each used to build its own, most of 8 cold readers' CPU)."""
    from marinfs.remote.s3http import Presigner

    built: list[str] = []

    def slow_build(self: Presigner, bucket: str) -> object:
        built.append(bucket)
        time.sleep(0.2)
        return object()

    monkeypatch.setattr(Presigner, "_build", slow_build)
    signer = Presigner(fs=None)
    start = threading.Barrier(16)
    got: list[object] = []

    def ask() -> None:
        start.wait()
        got.append(signer._client("b"))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert built == ["b"] and len(got) == 16 and len({id(c) for c in got}) == 1


# -- ranged GETs through obstore (marinfs/remote/s3obstore.py) ---------------------------------------
obstore = pytest.importorskip("obstore")


def obstore_getter(base: str, secret: str = "s") -> Any:
    """An ObstoreGetter whose store for bucket ``b`` talks to ``base`` (no s3fs behind it)."""
    from obstore.store import S3Store

    from marinfs.remote.s3obstore import ObstoreGetter

    class FS:
        req_kw: dict[str, Any] = {}
        s3_additional_kwargs: dict[str, Any] = {}

    getter = ObstoreGetter(FS(), connect_timeout=1, read_timeout=0.5)
    getter._stores["b"] = S3Store("b", endpoint=base, region="us-east-1", access_key_id="k", secret_access_key=secret,
                                  virtual_hosted_style_request=False,
                                  client_options={"allow_http": True, "read_timeout": "500ms"},
                                  retry_config={"max_retries": 0})
    return getter


def test_obstore_ranges_and_if_match(server: str) -> None:
    g = obstore_getter(server)
    data = g.get("b", "k", 10, 20, "abc")
    assert not isinstance(data, bytes) and bytes(data) == BODY[10:20]  # obstore's buffer, no copy
    sent = {k.lower(): v for k, v in Scripted.seen[-1].items()}
    assert sent["range"] == "bytes=10-19" and sent["if-match"] == '"abc"'


@pytest.mark.parametrize("status, error", [("412", StaleVersionError), ("404", FileNotFoundError),
                                           ("403", PermissionError), ("503", ConnectionError),
                                           ("500", ConnectionError), ("429", ConnectionError), ("400", OSError)])
def test_obstore_statuses_become_the_errors_marinfs_expects(server: str, status: str, error: type) -> None:
    from marinfs.remote import is_transient

    Scripted.script = [status]
    with pytest.raises(error) as info:
        obstore_getter(server).get("b", "k", 0, 10, "v")
    assert is_transient(info.value) == (status in ("503", "500", "429"))
    assert len(Scripted.seen) == 1  # obstore retries nothing: base.py's loop is the one


def test_obstore_truncated_body_and_timeout_are_transient(server: str) -> None:
    from marinfs.remote import is_transient
    from marinfs.remote.s3obstore import Unusable

    g = obstore_getter(server)
    Scripted.script = ["truncated"]
    with pytest.raises(ConnectionError) as info:
        g.get("b", "k", 0, 100, "v")
    assert is_transient(info.value)
    Scripted.script = ["slow"]
    started = time.monotonic()
    with pytest.raises((TimeoutError, ConnectionError)) as timeout:
        g.get("b", "k", 0, 100, "v")
    assert is_transient(timeout.value) and time.monotonic() - started < 1.4
    assert bytes(g.get("b", "k", 0, 100, "v")) == BODY[:100]  # and the next request is fine
    Scripted.script = ["200"]  # a server that ignores Range: the urllib3 path serves (it copes)
    with pytest.raises(Unusable) as unusable:
        g.get("b", "k", 3, 7, "v")
    assert not is_transient(unusable.value)


def test_pinned_reads_go_through_obstore_on_seaweedfs(s3_server: Any) -> None:
    """With obstore installed a pinned read is one GET through it (counted, same bytes as s3fs),
    and a changed object is StaleVersionError (the server's 412), never other bytes."""
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options())
    assert remote._obstore is not None

    def not_this_way(*args: Any) -> bytes:
        raise AssertionError("the urllib3 path was used")

    remote._direct.get = not_this_way
    data = os.urandom((3 << 20) + 5)
    remote.fs.pipe_file(remote.full("obj"), data)
    version = remote.stat("obj").version
    remote.stats.reset()
    buf = remote.read_buffer("obj", 5, 3 << 20, version)
    assert isinstance(buf, obstore.Bytes) and bytes(buf) == data[5:3 << 20]
    assert remote.read_range("obj", 0, len(data), version) == data  # bytes for every other caller
    assert remote.stats.count("get") == 2
    remote.fs.pipe_file(remote.full("obj"), b"replaced")
    with pytest.raises(StaleVersionError):
        remote.read_range("obj", 0, 4, version)
    assert remote.stats.count("get") == 3  # a 412 is an answer: not retried
    assert not remote._obstore_refused


def test_a_read_obstore_is_refused_falls_back(s3_server: Any) -> None:
    """A server that refuses obstore's request (403) where the urllib3 path passes costs speed,
    never a read: the read goes that way, and every later one at once; a denial both paths meet
    is the answer. MARINFS_OBSTORE=0 (or obstore missing) is today's path from the start."""
    from obstore.store import S3Store

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options())
    remote.fs.pipe_file(remote.full("f"), b"kept")
    version = remote.stat("f").version
    remote._obstore._stores[s3_server.bucket] = S3Store(
        s3_server.bucket, endpoint=s3_server.endpoint, region=s3_server.region, access_key_id=s3_server.access_key,
        secret_access_key="wrong", virtual_hosted_style_request=False, client_options={"allow_http": True},
        retry_config={"max_retries": 0})
    remote.stats.reset()
    assert remote.read_range("f", 0, 4, version) == b"kept"
    assert remote._obstore_refused and remote.stats.count("get") == 2  # obstore's refused GET, then ours
    remote.stats.reset()
    assert remote.read_range("f", 1, 4, version) == b"ept" and remote.stats.count("get") == 1

    other = Remote(url, {**s3_server.storage_options(), "secret": "wrong"})
    with pytest.raises(PermissionError):
        other.read_range("f", 0, 4, version)

    assert Remote(url, s3_server.storage_options(), RemoteSettings(obstore=False))._obstore is None  # MARINFS_OBSTORE=0


ODD_KEYS = ["d/new\nline", "d/tab\tx", "d/b\\c", "d/./b", "d/../b", "d//b", "d/%41", "d/x y", "d/\x7f",
            "d/\x01", "d/é", "d/*?#"]


@pytest.mark.parametrize("key", ODD_KEYS)
def test_obstore_representable_agrees_with_obstores_own_path_rules(key: str) -> None:
    """Keys obstore would refuse (ValueError, before any request) go through the other path:
    the check must say exactly what obstore's Path parser says."""
    obstore = pytest.importorskip("obstore")
    from obstore.store import MemoryStore

    from marinfs.remote.s3obstore import representable

    try:
        obstore.put(MemoryStore(), key, b"x")
        takes = True
    except ValueError:
        takes = False
    assert representable(key) == takes


def test_a_key_obstore_cannot_parse_is_read_through_the_other_path(s3_server: Any) -> None:
    remote = Remote(f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}", s3_server.storage_options())
    try:
        remote.fs.pipe_file(remote.full("nl/new\nline"), b"odd key")
        info = remote.stat("nl/new\nline")
        assert remote.read_range("nl/new\nline", 0, 7, info.version) == b"odd key"
        assert not remote._obstore_refused  # noqa: SLF001 - the other keys still go through obstore
    finally:
        remote.close()


def test_warm_builds_the_signing_client_and_the_store_without_a_request(
        s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fresh mount's first listing and first read used to build on the way (about 0.3 s
    of botocore) is built by warm(), which sends nothing and never raises."""
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options())
    try:
        assert not remote._presigner._clients and not remote._obstore._stores
        remote.stats.reset()
        remote.warm()
        assert remote._presigner._clients.get(s3_server.bucket) is not None
        assert remote._obstore._stores.get(s3_server.bucket) is not None
        assert remote.stats.snapshot()["requests"] == {}
    finally:
        remote.close()
    broken = Remote(url, s3_server.storage_options())
    try:
        def fail(bucket: str) -> Any:
            raise RuntimeError("no store today")

        monkeypatch.setattr(broken._obstore, "_build", fail)
        broken.warm()  # logged at debug, built (or failing) on first use instead
        broken.fs.pipe_file(broken.full("obj"), b"still readable")
        assert broken.read_range("obj", 0, 14, broken.stat("obj").version) == b"still readable"
    finally:
        broken.close()


def test_get_into_reads_the_body_into_the_buffer_and_maps_every_answer(server: str) -> None:
    """``get_into``: the ranged body lands in the caller's buffer; a cut-short body answers the
    bytes that came (or a transient error), a 412 is StaleVersionError, a 200 of the whole
    object is cut to the range, a stalled body is TimeoutError; the connection stays usable."""
    from marinfs.remote import is_transient

    g = getter(server, [])
    buf = memoryview(bytearray(100))
    assert g.get_into("b/k", 10, 110, "abc", buf) == 100 and bytes(buf) == BODY[10:110]
    sent = {k.lower(): v for k, v in Scripted.seen[-1].items()}
    assert sent["range"] == "bytes=10-109" and sent["if-match"] == '"abc"'
    Scripted.script = ["200"]
    assert g.get_into("b/k", 3, 103, None, buf) == 100 and bytes(buf) == BODY[3:103]
    Scripted.script = ["412"]
    with pytest.raises(StaleVersionError):
        g.get_into("b/k", 0, 100, "abc", buf)
    Scripted.script = ["truncated"]
    try:
        n = g.get_into("b/k", 0, 100, None, buf)
    except ConnectionError as exc:  # http.client may call it an IncompleteRead
        assert is_transient(exc)
    else:
        assert n == 10 and bytes(buf[:10]) == BODY[:10]
    Scripted.script = ["slow"]
    with pytest.raises(TimeoutError):
        g.get_into("b/k", 0, 100, None, buf)
    Scripted.script = ["503"]
    with pytest.raises(ConnectionError):
        g.get_into("b/k", 0, 100, None, buf)
    for start in (0, 500, 900):  # and the next requests are fine
        assert g.get_into("b/k", start, start + 100, None, buf) == 100 and bytes(buf) == BODY[start:start + 100]


def test_chunk_gets_keep_their_connection_and_drop_a_broken_one(server: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_into`` goes over connections of our own (httpbody.Connections): one connection
    serves GET after GET, an error's answer read to its end leaves it usable, and one left
    unusable (a body cut short, a timeout, a server closing it while idle) is never reused: the
    next GET opens another and succeeds on its first try."""
    monkeypatch.setattr(Scripted, "protocol_version", "HTTP/1.1")  # keep-alive, as S3 answers
    g = getter(server, [])
    buf = memoryview(bytearray(100))
    for start in (0, 100, 200):
        assert g.get_into("b/k", start, start + 100, None, buf) == 100 and bytes(buf) == BODY[start:start + 100]
    assert g.kept.opened == 1
    Scripted.script = ["404"]
    with pytest.raises(FileNotFoundError):
        g.get_into("b/k", 0, 100, None, buf)
    assert g.get_into("b/k", 300, 400, None, buf) == 100 and g.kept.opened == 1
    Scripted.script = ["truncated"]
    try:
        assert g.get_into("b/k", 0, 100, None, buf) == 10
    except ConnectionError:
        pass
    assert g.get_into("b/k", 400, 500, None, buf) == 100 and bytes(buf) == BODY[400:500] and g.kept.opened == 2
    Scripted.script = ["slow"]
    with pytest.raises(TimeoutError):
        g.get_into("b/k", 0, 100, None, buf)
    assert g.get_into("b/k", 500, 600, None, buf) == 100 and g.kept.opened == 3
    (_, idle), = g.kept._idle
    idle.sock.shutdown(2)  # as a server closing an idle connection looks: readable, EOF
    assert g.get_into("b/k", 600, 700, None, buf) == 100 and bytes(buf) == BODY[600:700] and g.kept.opened == 4
    g.close()
    assert not g.kept._idle


def test_chunk_gets_over_tls_check_the_certificate_as_urllib3_does(tmp_path: Any) -> None:
    """Over HTTPS the kept connections check the server's certificate against the system's CAs,
    a CA bundle given as ``verify``, or not at all with ``verify=False``: a self-signed server
    is refused by the first and read by the other two."""
    from marinfs.remote import is_transient
    from scripted import self_signed

    Scripted.script, Scripted.seen = [], []
    cert, key = self_signed(tmp_path)
    with serving(Scripted, tls=(cert, key)) as base:
        def presign(full: str, expires: int, method: str, **_: Any) -> str:
            return f"{base}/{full}?X-Amz-Signature=1"

        buf = memoryview(bytearray(100))
        with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED") as refused:
            S3Http(presign, connect_timeout=1, read_timeout=2).get_into("b/k", 0, 100, None, buf)
        assert is_transient(refused.value)  # as urllib3's SSLError is: the retry loop decides
        for verify in (str(cert), False):
            g = S3Http(presign, connect_timeout=1, read_timeout=2, verify=verify)
            assert g.get_into("b/k", 10, 110, None, buf) == 100 and bytes(buf) == BODY[10:110]
            g.close()


def test_read_into_on_s3_matches_read_range_retries_short_bodies_and_is_stale_on_412(
        s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3Remote.read_into (the chunk fetcher's path): the same bytes as read_range, read from the
    socket (obstore not used), one GET each, a body cut short retried by the one retry loop, a
    replaced object ESTALE."""
    from marinfs.remote.s3http import S3Http

    direct, _ = direct_and_plain(s3_server)
    if direct._obstore is not None:
        monkeypatch.setattr(direct._obstore, "get", lambda *a: (_ for _ in ()).throw(AssertionError("obstore")))
    data = os.urandom((3 << 20) + 5)
    direct.fs.pipe_file(direct.full("obj"), data)
    version = direct.stat("obj").version
    direct.stats.reset()
    for start, end in ((0, 1), (5, 1 << 20), (1 << 20, len(data))):
        buf = memoryview(bytearray(end - start))
        direct.read_into("obj", start, end, version, buf)
        assert bytes(buf) == data[start:end]
    assert direct.stats.count("get") == 3
    real = S3Http.get_into
    cut = [True]

    def once_short(self: S3Http, full: str, start: int, end: int, etag: str | None, buf: memoryview) -> int:
        n = real(self, full, start, end, etag, buf)
        if cut.pop() if cut else False:
            return n - 1  # as a body cut short would answer
        return n

    monkeypatch.setattr(S3Http, "get_into", once_short)
    buf = memoryview(bytearray(1000))
    direct.stats.reset()
    direct.read_into("obj", 0, 1000, version, buf)
    assert bytes(buf) == data[:1000] and direct.stats.count("get") == 2  # retried once
    direct.fs.pipe_file(direct.full("obj"), b"replaced")
    with pytest.raises(StaleVersionError):
        direct.read_into("obj", 0, 4, version, memoryview(bytearray(4)))


def test_a_refused_read_into_falls_back_to_s3fs_into_the_same_buffer(s3_server: Any) -> None:
    """A chunk fetch our signature cannot get (403) is read through s3fs, pinned the same way,
    into the caller's buffer; later ones go there at once. A denial s3fs meets too is the answer."""
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options())
    data = os.urandom((1 << 20) + 7)
    remote.fs.pipe_file(remote.full("f"), data)
    version = remote.stat("f").version
    presign = remote._presigner.url
    remote._direct._presign = lambda *a, **kw: presign(*a, **kw).replace("X-Amz-Signature=", "X-Amz-Signature=0")
    buf = memoryview(bytearray(len(data) - 7))
    remote.read_into("f", 7, len(data), version, buf)
    assert bytes(buf) == data[7:] and remote._direct_refused
    remote.fs.pipe_file(remote.full("f"), b"replaced")
    with pytest.raises(StaleVersionError):  # s3fs's GET carries If-Match too
        remote.read_into("f", 0, 4, version, memoryview(bytearray(4)))
    other = Remote(url, {**s3_server.storage_options(), "secret": "wrong"})
    with pytest.raises(PermissionError):
        other.read_into("f", 0, 4, version, memoryview(bytearray(4)))


# -- parts sent from the staging file ---------------------------------------------------------
def _crc(data: bytes) -> str:
    import base64

    import google_crc32c

    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


@pytest.mark.parametrize("sendfile", [True, False], ids=["sendfile", "blocks"])
def test_a_part_leaves_the_staging_file_with_its_crc32c(server: str, tmp_path: Any, sendfile: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The part is read from the file (sendfile, or 1 MiB blocks as over TLS), never passed as
    bytes; its CRC-32C is signed into the URL and sent; fewer bytes where the file ends. Our
    own connections are kept between parts, and one the server closed while idle is dropped."""
    import base64
    import hashlib

    monkeypatch.setattr(Scripted, "protocol_version", "HTTP/1.1")  # keep-alive, as S3 answers

    calls: list[tuple] = []

    def presign(full: str, expires: int, method: str, **params: Any) -> str:
        calls.append((method, full, params))
        return f"{server}/{full}?partNumber={params.get('PartNumber')}"

    data = os.urandom(3 * (1 << 20) + 11)  # more than one block
    path = tmp_path / "staged"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        g = S3Http(presign, connect_timeout=1, read_timeout=2)
        g.sendfile = sendfile
        etag, crc, n = g.put_part_range("b/k", "up-1", 2, fd, 5, 2 * (1 << 20), "crc32c")
        part = data[5:5 + 2 * (1 << 20)]
        assert (etag, crc, n) == (f'"etag-of-{len(part)}"', _crc(part), len(part)) and Scripted.bodies[-1] == part
        assert calls[-1] == ("upload_part", "b/k", {"UploadId": "up-1", "PartNumber": 2, "ChecksumCRC32C": crc})
        assert Scripted.seen[-1]["x-amz-checksum-crc32c"] == crc and "Content-MD5" not in Scripted.seen[-1]
        tail = g.put_part_range("b/k", "up-1", 3, fd, 3 * (1 << 20), 1 << 20, "crc32c")  # the file ends first
        assert tail[1:] == (_crc(data[3 << 20:]), 11) and Scripted.bodies[-1] == data[3 << 20:]
        etag, crc, n = g.put_part_range("b/k", "up-1", 4, fd, 0, 100, "md5")  # MARINFS_PART_CHECKSUM=md5
        md5 = base64.b64encode(hashlib.md5(data[:100]).digest()).decode()
        assert crc is None and Scripted.seen[-1]["Content-MD5"] == md5 and calls[-1][2]["ContentMD5"] == md5
        assert "x-amz-checksum-crc32c" not in Scripted.seen[-1]
        for _ in range(3):  # the connection is kept and reused between parts
            g.put_part_range("b/k", "up-1", 5, fd, 0, 10, "crc32c")
        assert Scripted.bodies[-1] == data[:10]
        if sendfile:
            (_, kept), = g.kept._idle
            kept.sock.shutdown(2)  # as a server closing an idle connection looks: readable, EOF
            assert g.put_part_range("b/k", "up-1", 6, fd, 0, 10, "crc32c")[2] == 10  # a new one, first try
            assert g.kept._idle[0][1] is not kept
    finally:
        os.close(fd)


def test_a_part_whose_checksum_the_server_does_not_check_or_refuses(server: str, tmp_path: Any) -> None:
    """No echo of the CRC-32C: the server does not check it (ChecksumNotChecked; the caller
    sends the part again with MD5 too). An echo of another sum, or BadDigest: transient, sent
    again by the retry loop."""
    from marinfs.remote.s3http import ChecksumNotChecked

    path = tmp_path / "staged"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDONLY)
    try:
        g = getter(server, [])
        Scripted.script = ["200-no-echo"]
        with pytest.raises(ChecksumNotChecked):
            g.put_part_range("b/k", "u", 1, fd, 0, 10, "crc32c")
        Scripted.script = ["200-no-echo"]  # with MD5 as well: checked by that, no echo needed
        assert g.put_part_range("b/k", "u", 1, fd, 0, 10, "md5+crc32c")[1] == _crc(b"0123456789")
        assert Scripted.seen[-1]["Content-MD5"] and Scripted.seen[-1]["x-amz-checksum-crc32c"]
        for action in ("200-wrong-echo", "bad-digest", "503"):
            Scripted.script = [action]
            with pytest.raises(ConnectionError):
                g.put_part_range("b/k", "u", 1, fd, 0, 10, "crc32c")
        Scripted.script = ["404"]
        with pytest.raises(FileNotFoundError):
            g.put_part_range("b/k", "u", 1, fd, 0, 10, "crc32c")
    finally:
        os.close(fd)


def _spy_parts(remote: Remote) -> list[dict[str, str]]:
    """The headers of every part our direct path sends from a file."""
    sent: list[dict[str, str]] = []
    real = remote._direct._put_from_file

    def spy(url: str, headers: dict[str, str], *args: Any) -> Any:
        sent.append(dict(headers))
        return real(url, headers, *args)

    remote._direct._put_from_file = spy
    return sent


def test_multipart_parts_carry_a_crc32c_seaweedfs_checks(s3_server: Any, tmp_path: Any) -> None:
    """SeaweedFS checks a part's CRC-32C (a wrong one is BadDigest: sent again, then an error);
    the completion lists every part's. MARINFS_PART_CHECKSUM=md5 sends Content-MD5 instead."""
    from marinfs.remote import RemoteSettings

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    settings = RemoteSettings(upload_part_size=5 << 20, attempts=2, backoff_base=0.01)
    remote = Remote(url, s3_server.storage_options(), settings)
    assert remote.part_checksum == "crc32c"
    sent = _spy_parts(remote)
    src = tmp_path / "big"
    data = os.urandom((12 << 20) + 5)
    src.write_bytes(data)
    remote.stats.reset()
    version = remote.upload(str(src), "big", ABSENT)
    assert remote.stats.count("part") == 5  # create, 3 parts, complete: exact
    assert remote.fs.cat_file(remote.full("big")) == data and remote.stat("big").version == version
    assert len(sent) == 3 and all("x-amz-checksum-crc32c" in h and "Content-MD5" not in h for h in sent)

    digest = remote._direct._digest
    remote._direct._digest = lambda *a: ({"crc32c": _crc(b"other bytes")}, digest(*a)[1])
    remote.stats.reset()
    with pytest.raises(RemoteError, match="BadDigest"):  # after the retries
        remote.upload(str(src), "refused", ABSENT)
    assert not remote.fs.exists(remote.full("refused"))
    remote._direct._digest = digest

    md5_remote = Remote(url, s3_server.storage_options(), replace(settings, part_checksum="md5"))
    sent = _spy_parts(md5_remote)
    md5_remote.upload(str(src), "md5", ABSENT)
    assert md5_remote.fs.cat_file(md5_remote.full("md5")) == data
    assert len(sent) == 3 and all("Content-MD5" in h and "x-amz-checksum-crc32c" not in h for h in sent)
    md5_remote._direct._digest = lambda *a: ({"md5": "1B2M2Y8AsgTpgAmY7PhCfg=="}, digest(*a)[1])
    with pytest.raises(RemoteError, match="BadDigest"):  # after the retries
        md5_remote.upload(str(src), "refused", ABSENT)
    with pytest.raises(UsageError, match="MARINFS_PART_CHECKSUM"):  # the settings table refuses it
        configfile.from_env({"MARINFS_PART_CHECKSUM": "sha1"})
    with pytest.raises(UsageError, match="part_checksum"):  # and so does a Remote built in Python
        Remote(url, s3_server.storage_options(), replace(settings, part_checksum="sha1"))


def test_a_server_that_does_not_echo_the_crc32c_gets_md5(s3_server: Any, tmp_path: Any) -> None:
    """A store that takes x-amz-checksum-crc32c without echoing it (so, presumably, without
    checking it) must not cost us the integrity check: that part goes again with Content-MD5,
    the upload completes, and later uploads use MD5 from the start."""
    from marinfs.remote import RemoteSettings

    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    remote = Remote(url, s3_server.storage_options(), RemoteSettings(upload_part_size=5 << 20))
    real = remote._direct._put_from_file

    def no_echo(*args: Any) -> Any:
        answer = real(*args)
        del answer.headers["x-amz-checksum-crc32c"]
        return answer

    remote._direct._put_from_file = no_echo
    src = tmp_path / "big"
    data = os.urandom((11 << 20) + 1)
    src.write_bytes(data)
    remote.stats.reset()
    remote.upload(str(src), "a", ABSENT)
    assert remote.fs.cat_file(remote.full("a")) == data and remote.part_checksum == "md5"
    # create, 3 parts, the first sent again with MD5 (the others too if they were in flight), complete
    assert 6 <= remote.stats.count("part") <= 8
    sent = _spy_parts(remote)
    remote.stats.reset()
    remote.upload(str(src), "b", ABSENT)
    assert remote.fs.cat_file(remote.full("b")) == data and remote.stats.count("part") == 5
    assert all("Content-MD5" in h and "x-amz-checksum-crc32c" not in h for h in sent)


@tiers.needs("unit")
def test_a_kept_connection_past_descriptor_1023_is_checked_without_select() -> None:
    """A write-back mount holds a descriptor per staged file: during a tar -x of 2,000 files its
    new sockets were past 1023, where select() fails ("filedescriptor out of range"), and every
    upload that reused a kept connection failed."""
    import resource
    import socket

    from marinfs.remote.httpbody import _readable

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        pytest.skip("the open files limit is below 1100")
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1050)
    sock = socket.socket(fileno=high)
    try:
        assert not _readable(sock)
        b.sendall(b"x")
        assert _readable(sock)
    finally:
        sock.close()
        a.close()
        b.close()


@tiers.needs("unit")
def test_the_daemon_raises_its_open_files_limit_to_the_hard_one() -> None:
    import resource
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[1])); from marinfs.app.daemon import raise_open_files_limit; "
            "raise_open_files_limit(); s, h = resource.getrlimit(resource.RLIMIT_NOFILE); print(s == h or s >= 1 << 20)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
