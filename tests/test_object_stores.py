"""What object stores make hard, on SeaweedFS (S3) and fake-gcs-server (GCS): implicit and
marker directories, name clashes, paged listings, request counts, endpoints from the standard
environment, bounded failures."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import object_store
from faults import TcpProxy
from marinfs.remote import RemoteSettings
from mounting import MARINFS, daemon_pid, fsspec_client, force_unmount, inprocess_mount
import tiers


@dataclass
class Store:
    """An in-process mount of a fresh prefix (so the test can read the daemon's counters)."""

    mnt: Path
    url: str
    client: Any  # a direct fsspec client of the same bucket
    root: str
    core: Any  # marinfs.core.Filesystem serving the mount
    options: dict
    env: dict[str, str]

    def put(self, rel: str, data: bytes) -> None:
        self.client.pipe_file(f"{self.root}/{rel}", data)

    def names(self) -> set[str]:
        """Names directly under the prefix, as another client sees them."""
        try:
            return {p.rstrip("/").rsplit("/", 1)[-1] for p in self.client.ls(self.root, detail=False)}
        except FileNotFoundError:
            return set()  # an empty prefix does not exist on an object store

    def counts(self) -> dict[str, int]:
        return dict(self.core.remote.stats.snapshot()["requests"])

    def reset(self) -> None:
        self.core.remote.stats.reset()


@pytest.fixture(params=["s3", "gcs"])
@tiers.needs("mount")
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    url, options, env = object_store(request, request.param)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=options) as core:
        yield Store(tmp_path / "mnt", url, client, root, core, options, env)


def test_implicit_directories(store: Store) -> None:
    store.put("imp/a/b/x.txt", b"deep")
    assert "imp" in os.listdir(store.mnt)
    assert os.path.isdir(store.mnt / "imp/a") and os.path.isdir(store.mnt / "imp/a/b")
    assert (store.mnt / "imp/a/b/x.txt").read_bytes() == b"deep"
    assert os.listdir(store.mnt / "imp/a") == ["b"]


def test_mkdir_marker_makes_an_empty_directory_visible_remotely(store: Store) -> None:
    os.mkdir(store.mnt / "empty")
    assert "empty" in store.names()  # only an `empty/` marker object can make an empty prefix exist
    assert os.listdir(store.mnt / "empty") == []
    os.rmdir(store.mnt / "empty")
    assert "empty" not in store.names()


def test_object_and_prefix_with_the_same_name(store: Store) -> None:
    store.put("dup", b"object")
    store.put("dup/x", b"child")
    names = os.listdir(store.mnt)
    assert names.count("dup") == 1  # the directory shadows the object (docs/backends.md)
    assert os.path.isdir(store.mnt / "dup")
    assert (store.mnt / "dup/x").read_bytes() == b"child"
    os.stat(store.mnt / "dup")  # never a crash


def test_listing_of_2001_objects_is_paged_and_fills_the_stat_cache(store: Store) -> None:
    # One object past two full pages of 1,000 (on GCS a page counts objects, not "sub/").
    store.client.pipe({f"{store.root}/big/f{i:05d}": b"x" * (i % 7) for i in range(2001)})
    store.put("big/sub/deep/y", b"y")  # a listing is delimited: this shows as one entry "sub"
    assert "big" in os.listdir(store.mnt)  # the parent listing resolves "big" itself
    store.reset()
    out = subprocess.run(["ls", "-l", str(store.mnt / "big")], capture_output=True, text=True, check=True)
    assert len(out.stdout.splitlines()) == 2002 + 1  # entries + "total"
    counts = store.counts()
    assert counts.get("list") == 3, counts  # ceil(2001 / 1000) pages
    assert counts.get("head", 0) == 0, counts
    store.reset()
    for i in range(0, 2001, 7):
        assert os.stat(store.mnt / f"big/f{i:05d}").st_size == i % 7
    assert store.counts() == {}, store.counts()


def test_cat_of_a_small_file_costs_one_head_and_one_get(store: Store) -> None:
    store.put("small.txt", b"tiny")
    store.reset()
    out = subprocess.run(["cat", str(store.mnt / "small.txt")], capture_output=True, check=True)
    assert out.stdout == b"tiny"
    counts = store.counts()
    assert counts.get("head", 0) <= 1 and counts.get("get") == 1, counts
    assert sum(counts.values()) <= 2, counts


def test_a_stat_that_finds_nothing_costs_a_head_and_one_listing(store: Store) -> None:
    """On S3 a miss was a HEAD, a LIST of ``key/`` and a HEAD of ``key.rclonelink``: one LIST
    of the names beginning with the key answers both (tar -x over an existing tree pays a miss
    for each directory's first new name). A directory and a link still cost what they did."""
    remote = store.core.remote
    for i in range(120):  # names sorting between x and x/ fill the probe's page: it asks apart
        store.put(f"p/x-{i:03d}", b"")
    store.put("p/x/in", b"d")
    store.put("p/y/in", b"d")
    linked = remote.link_objects
    if linked:
        remote.symlink("p/ln", "y/in")
    for key, is_dir, link, most in (("p/nope", False, False, 2), ("p/y", True, False, 2),
                                    ("p/x", True, False, 3), ("p/ln", False, True, 3)):
        if link and not linked:
            continue
        store.reset()
        try:
            info = remote.stat(key)
            assert (info.is_dir, info.link) == (is_dir, link), key
        except FileNotFoundError:
            assert key == "p/nope"
        assert sum(store.counts().values()) <= most, (key, store.counts())


def test_every_stat_carries_the_object_version(store: Store) -> None:
    store.put("v", b"one")
    first = store.core.getattr("/v").version
    assert first and first.kind == ("etag" if store.url.startswith("s3") else "generation")
    (store.mnt / "v").write_bytes(b"two!")  # overwrite an existing object through the mount
    assert store.client.cat_file(f"{store.root}/v") == b"two!"
    assert store.core.getattr("/v").version not in (None, first)


def test_rename_of_a_directory_of_200_files(store: Store) -> None:
    store.client.pipe({f"{store.root}/src/d{i % 4}/f{i}": str(i).encode() for i in range(200)})
    os.rename(store.mnt / "src", store.mnt / "dst")
    assert not (store.mnt / "src").exists()
    left = store.client.find(f"{store.root}/src")
    assert left == [], left[:5]
    moved = store.client.find(f"{store.root}/dst")
    assert len(moved) == 200
    assert (store.mnt / "dst/d3/f199").read_text() == "199"


def test_large_upload_uses_multipart(store: Store, tmp_path: Path) -> None:
    if not store.url.startswith("s3"):
        pytest.skip("GCS objects stay <= 64 MiB against the emulator")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1024 * 1024) * 110)  # 110 MiB: over s3fs's 2 x 50 MiB threshold
    store.reset()
    subprocess.run(["cp", str(src), str(store.mnt / "big.bin")], check=True)
    assert store.counts().get("part", 0) >= 4  # create + 3 parts + complete
    assert store.client.size(f"{store.root}/big.bin") == src.stat().st_size


def test_listing_cache_of_fsspec_is_off(store: Store) -> None:
    os.mkdir(store.mnt / "d")
    assert os.listdir(store.mnt / "d") == []
    store.put("d/new", b"n")
    store.core.metadata.clear()  # as if our TTL expired: only fsspec could still be stale
    assert os.listdir(store.mnt / "d") == ["new"]


# -- the daemon as users run it ------------------------------------------------------------


def marinfs(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*MARINFS, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_missing_bucket_is_one_line_error(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    url, _, env = object_store(request, backend)
    bad = url.replace("://marin/", "://no-such-bucket-xyz/")
    (tmp_path / "mnt").mkdir()
    result = marinfs("mount", bad, str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / "c"), env=env)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "no-such-bucket-xyz" in result.stderr and "does not exist" in result.stderr
    assert not os.path.ismount(tmp_path / "mnt")


def test_wrong_endpoint_port_fails_within_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    (tmp_path / "mnt").mkdir()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}
    started = time.monotonic()
    result = marinfs("mount", "s3://marin/x", str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / "c"),
                     "--retries", "2", env=env)
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert "cannot reach s3://marin/x" in result.stderr
    assert not os.path.ismount(tmp_path / "mnt")


@pytest.fixture
def wedged_endpoint() -> Iterator[str]:
    """A server that accepts connections and never answers: a wedged request."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        server.close()


def test_wedged_endpoint_fails_within_the_read_timeout(wedged_endpoint: str, tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    env = {"AWS_ENDPOINT_URL": wedged_endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
           "AWS_REGION": "us-east-1"}
    started = time.monotonic()
    result = marinfs("mount", "s3://marin/x", str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / "c"),
                     "--connect-timeout", "1", "--read-timeout", "1", "--retries", "2", env=env)
    elapsed = time.monotonic() - started
    assert result.returncode != 0 and elapsed < 20, (elapsed, result.stderr)
    assert "cannot reach" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not os.path.ismount(tmp_path / "mnt")


def test_read_fails_with_eio_when_the_server_wedges_mid_mount(s3_server: Any, tmp_path: Path) -> None:
    """A remote that stops answering fails the syscall with EIO within the timeouts (no hang),
    and the mount works again once the remote is back."""
    host, port = s3_server.endpoint.rsplit("/", 1)[1].split(":")
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, s3_server.storage_options())
    client.pipe_file(f"{root}/f", b"data")
    with TcpProxy(host, int(port)) as proxy:
        options = s3_server.storage_options()
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint}
        options["config_kwargs"] = {**options["config_kwargs"], "connect_timeout": 1, "read_timeout": 1}
        with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=options) as core:
            core.remote.settings = RemoteSettings(attempts=2, backoff_base=0.05)
            assert os.stat(tmp_path / "mnt/f").st_size == 4
            proxy.wedged.set()
            started = time.monotonic()
            with pytest.raises(OSError) as info:
                (tmp_path / "mnt/f").read_bytes()
            assert info.value.errno == errno.EIO
            assert time.monotonic() - started < 15
            assert core.remote.stats.snapshot()["errors"].get("get", 0) >= 1
            proxy.wedged.clear()
            assert (tmp_path / "mnt/f").read_bytes() == b"data"


@pytest.mark.mount
def test_endpoint_from_fsspec_config_and_storage_options(s3_server: Any, tmp_path: Path) -> None:
    """FSSPEC_S3 JSON (what Marin writes) and -o KEY=VALUE both reach s3fs, with no AWS_*
    variables at all; the secret stays out of the daemon's command line and its log."""
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    secret = s3_server.secret_key
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["FSSPEC_S3"] = json.dumps({"client_kwargs": {"endpoint_url": s3_server.endpoint,
                                                     "region_name": "us-east-1"}})
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    result = subprocess.run([*MARINFS, "mount", url, str(mnt), "--cache-dir", str(tmp_path / "cache"),
                             "--log-file", str(log), "-o", f"key={s3_server.access_key}",
                             "-o", f"secret={secret}"], capture_output=True, text=True, env=env, timeout=120)
    try:
        assert result.returncode == 0, result.stderr
        (mnt / "hello").write_text("via FSSPEC_S3")
        cmdline = Path(f"/proc/{daemon_pid(mnt)}/cmdline").read_bytes().decode(errors="replace")
        assert secret not in cmdline
    finally:
        subprocess.run([*MARINFS, "umount", str(mnt)], env=env, capture_output=True, timeout=120)
        force_unmount(mnt)
    client, root = fsspec_client(url, s3_server.storage_options())
    assert client.cat_file(f"{root}/hello") == b"via FSSPEC_S3"
    assert secret not in log.read_text()


@pytest.fixture(params=["s3", "gcs"])
@tiers.needs("mount")
def prefetching(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A mount with background listings on, as the daemon has them on object stores."""
    url, options, env = object_store(request, request.param)
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=options,
                         list_prefetch=True) as core:
        yield Store(tmp_path / "mnt", url, client, root, core, options, env)


def test_stat_of_many_files_costs_a_few_heads_and_one_listing(prefetching: Store) -> None:
    store = prefetching
    # 1,001 files: the listing is two pages, and ~330 stats follow it.
    store.client.pipe({f"{store.root}/d/f{i:04d}": b"x" * (i % 7) for i in range(1001)})
    os.stat(store.mnt / "d")
    store.reset()
    for i in range(3):  # the third lookup that misses starts a background listing of d
        assert os.stat(store.mnt / f"d/f{i:04d}").st_size == i % 7
    store.core.listings.drain()
    for i in range(3, 1001, 3):
        assert os.stat(store.mnt / f"d/f{i:04d}").st_size == i % 7
    assert store.counts() == {"head": 3, "list": 2}, store.counts()  # ceil(1001 / 1000) pages


def test_find_lists_every_directory_once_mostly_ahead_of_it(prefetching: Store) -> None:
    store = prefetching
    store.client.pipe({f"{store.root}/ckpt/a{i:02d}/c.{j}": b"c" for i in range(30) for j in range(3)})
    os.stat(store.mnt / "ckpt")
    store.reset()
    os.listdir(store.mnt / "ckpt")
    os.listdir(store.mnt / "ckpt/a00")  # a walker descends: a01..a29 are listed in the background
    store.core.listings.drain()
    assert store.counts() == {"list": 31}, store.counts()
    out = subprocess.run(["find", str(store.mnt / "ckpt"), "-type", "f"], capture_output=True, text=True,
                         check=True)
    assert len(out.stdout.splitlines()) == 90
    assert store.counts() == {"list": 31}, store.counts()  # find itself needed no request
