"""S3 with virtual-hosted addressing on a custom endpoint (CoreWeave: `https://BUCKET.cwobject.com`,
docs/backends.md) keeps the data path of path-style addressing: our presigned requests and
obstore, no fallback to s3fs, and the same request counts, through a mount.

SeaweedFS answers virtual-hosted requests for `-s3.domainName`. Names under `.localhost` do not
resolve here (no nss-myhostname: only `localhost` is in /etc/hosts), so the daemon runs in a
mount namespace of its own whose /etc/hosts also names the endpoint and the bucket's host on
127.0.0.1 (the machine's file is untouched), and mounts onto a shared directory the test reads
and writes through, as the DaemonSet's pod does (tests/test_deploy.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mounting import force_unmount, fsspec_client
from servers import S3Server, start_seaweedfs
from test_deploy import PROPAGATION, _gone, _wait, shared_dir  # noqa: F401 - a fixture
import tiers

DOMAIN = "s3.marinfs.test"  # .test: reserved, never a real host (RFC 2606)
MiB = 1 << 20
LOG_OF_ANOTHER_PATH = ("warming the clients", "reads through obstore failed", "presigning through s3fs",
                       "refused our direct", "reads without obstore")


@pytest.fixture(scope="module")
@tiers.needs("objectstore")
def vhost_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs-vhost"), extra_args=(f"-s3.domainName={DOMAIN}",))
    try:
        yield server
    finally:
        server.stop()


def _mount_and_work(server: S3Server, style: str, shared: Path, tmp: Path, get: str = "socket") -> tuple[dict, str]:
    """Mount a fresh prefix with ``style`` addressing from a namespace that resolves DOMAIN; write
    a file and read another through the mount; stop the daemon (SIGTERM). Returns its request
    counts (published at its stop) and its log."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{server.bucket}/{prefix}"
    client, root = fsspec_client(url, {**server.storage_options(), "use_listings_cache": False})
    data = os.urandom(20 * MiB + 12345)
    client.pipe(f"{root}/model.bin", data)
    port = server.endpoint.rsplit(":", 1)[1]
    env = {**os.environ, **server.env(), "MARINFS_GET": get}
    if style == "virtual":
        env["AWS_ENDPOINT_URL"] = f"http://{DOMAIN}:{port}"
        env["FSSPEC_S3"] = json.dumps({"config_kwargs": {"s3": {"addressing_style": "virtual"}}})
    hosts = tmp / f"hosts-{style}-{get}"
    hosts.write_text(f"127.0.0.1 localhost {DOMAIN} {server.bucket}.{DOMAIN}\n")
    name = f"{style}-{get}"
    mnt, cache, log = shared / name, tmp / f"cache-{name}", tmp / f"daemon-{name}.log"
    mnt.mkdir()
    # The bind over /etc/hosts stays in the namespace: its parent mount is made a slave first
    # (on a host whose / is shared the bind would otherwise reach the host).
    script = (f"mount --make-slave \"$(findmnt -n -o TARGET --target /etc/hosts)\" && "
              f"mount --bind '{hosts}' /etc/hosts && exec '{sys.executable}' -m marinfs mount '{url}' '{mnt}' "
              f"--foreground --cache-dir '{cache}' --log-file '{log}' --log-level debug --chunk-size 4M")
    daemon = subprocess.Popen(["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", script],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: os.path.ismount(mnt) or daemon.poll() is not None, 60), "the mount never showed"
        assert daemon.poll() is None, (daemon.stderr.read() if daemon.stderr else "") + log.read_text()
        assert (mnt / "model.bin").read_bytes() == data  # chunk GETs
        written = os.urandom(3 * MiB)
        (mnt / "out.bin").write_bytes(written)  # committed at its close: one PUT
        assert client.cat_file(f"{root}/out.bin") == written
        assert sorted(os.listdir(mnt)) == ["model.bin", "out.bin"]
        os.kill(daemon.pid, signal.SIGTERM)
        assert _wait(lambda: _gone(daemon.pid), 60) and daemon.wait(10) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        force_unmount(mnt)
    published = json.loads((cache / "stats.json").read_text())
    return published["remote_requests"], log.read_text()


@PROPAGATION
@pytest.mark.mount
def test_virtual_hosted_addressing_keeps_the_data_path_and_the_request_counts(
        vhost_server: S3Server, shared_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    path_counts, path_log = _mount_and_work(vhost_server, "path", shared_dir, tmp_path)
    virtual_counts, virtual_log = _mount_and_work(vhost_server, "virtual", shared_dir, tmp_path)
    # Chunk fetches through obstore too (MARINFS_GET=obstore): its store for a virtual-hosted
    # custom endpoint is BUCKET.HOST, as botocore addresses it.
    obstore_counts, obstore_log = _mount_and_work(vhost_server, "virtual", shared_dir, tmp_path, get="obstore")
    print("path-style", path_counts, "virtual-hosted", virtual_counts)  # for -s: the measured counts
    assert f"mounting s3://{vhost_server.bucket}" in virtual_log
    for log in (path_log, virtual_log, obstore_log):
        assert not [line for line in log.splitlines() if any(m in line for m in LOG_OF_ANOTHER_PATH)]
    assert virtual_counts["requests"] == path_counts["requests"] == obstore_counts["requests"], (
        virtual_counts, path_counts, obstore_counts)
    assert virtual_counts["requests"]["get"] >= 5 and virtual_counts["requests"]["put"] >= 1
    assert not virtual_counts.get("errors"), virtual_counts
