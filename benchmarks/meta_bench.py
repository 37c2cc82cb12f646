"""Persisted POSIX metadata on S3: what tools that keep modes and times cost, in requests and time.

One SeaweedFS on loopback, optionally behind the latency proxy (``--latency-ms``: every request
held that long, a cloud's first byte). Each step runs through a marinfs mount and reads the
daemon's request counters from its metrics port:

  cp -a     of a tree of ``--files`` small files with modes 0640/0750 and 2020 mtimes (+ a link)
  chmod     of one committed file
  ls -l     of a directory of ``--ls-files`` such files, from a fresh mount with an empty cache
            (another node's view): LIST / GET / HEAD, and that the modes and times show
  rsync -a  of the tree into the mount, then again after a remount: PUTs the second time
  s3fs-fuse ``ls -l`` of the same directory, if ``s3fs`` is installed (it HEADs each object)
  ``--gcs``: the same ``ls -l`` directory written to fake-gcs-server and listed from a fresh mount

    python benchmarks/meta_bench.py --latency-ms 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import bench  # noqa: E402  (start_proxy, stop_proc)
import peers_bench as pb  # noqa: E402  (scrape, counts_delta, unmount, _fusermount_u, _wait_gone, _wait_mounted)
import servers  # noqa: E402  (tests/servers.py)

from marinfs.app.daemon import state_file  # noqa: E402

MARINFS = [sys.executable, "-m", "marinfs"]
OLD = 1577923200  # 2020-01-02T00:00:00Z


def make_tree(root: Path, files: int) -> None:
    """Small files, alternately 0640 and 0750, each with its own 2020 mtime; one symlink."""
    root.mkdir(parents=True)
    for i in range(files):
        p = root / f"f{i:05d}"
        p.write_bytes(f"{i}\n".encode() * 8)
        p.chmod(0o640 if i % 2 else 0o750)
        os.utime(p, (OLD + i, OLD + i))
    (root / "link").symlink_to("f00000")
    os.utime(root, (OLD, OLD))


@contextmanager
def marinfs_mount(url: str, env: dict[str, str], tmp: Path, name: str) -> Iterator[pb.Mount]:
    mnt = Path(tempfile.mkdtemp(prefix=f"mnt-{name}-", dir=tmp))
    cache = tmp / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    port = servers.free_port()
    pid = None
    try:
        r = subprocess.run([*MARINFS, "mount", url, str(mnt), "--cache-dir", str(cache),
                            "--log-file", str(tmp / f"{name}.log"), "--metrics-port", str(port)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise SystemExit(f"meta_bench: marinfs mount failed: {r.stderr.strip()}")
        pid = int(json.loads(state_file(str(mnt)).read_text())["pid"])
        yield pb.Mount("marinfs", mnt, metrics_port=port)
    finally:
        pb.unmount(mnt, pid, None, cache, marinfs=True)


def counted(m: pb.Mount, args: list[str], cwd: Path | None = None) -> tuple[float, dict[str, int]]:
    """Run a tool; answer its wall time and the remote requests it caused (by kind)."""
    before = pb.scrape(m)
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=1800)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"meta_bench: {' '.join(args[:2])} failed: {r.stderr.strip()[:300]}")
    time.sleep(0.5)  # the directory record's flush window (0.2 s) is counted with its cause
    now = pb.scrape(m)
    assert before is not None and now is not None
    return secs, pb.counts_delta(before, now).get("requests", {})


def check_ls(out: str, files: int) -> None:
    """The listing shows what cp -a kept: modes and 2020 times (else the numbers mean nothing)."""
    lines = [ln for ln in out.splitlines() if ln.startswith("-")]
    if len(lines) != files:
        raise SystemExit(f"meta_bench: ls -l showed {len(lines)} files, expected {files}")
    bad = [ln for ln in lines if not (ln.startswith(("-rwxr-x---", "-rw-r-----")) and " 2020 " in ln)]
    if bad:
        raise SystemExit(f"meta_bench: {len(bad)} entries lost their mode or mtime, e.g. {bad[0]!r}")


def s3fs_fuse_ls(s3: Any, endpoint: str, prefix: str, tmp: Path, files: int) -> float | None:
    if shutil.which("s3fs") is None:
        return None
    pw = tmp / "s3fs.passwd"
    pw.write_text(f"{s3.access_key}:{s3.secret_key}\n")
    pw.chmod(0o600)
    mnt = Path(tempfile.mkdtemp(prefix="mnt-s3fs-", dir=tmp))
    log = tmp / "s3fs.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(["s3fs", f"{s3.bucket}:/{prefix}", str(mnt), "-f", "-o",
                                 f"passwd_file={pw},url={endpoint},use_path_request_style,dbglevel=warn"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        pb._wait_mounted(mnt, proc, log, "s3fs-fuse")
        t0 = time.perf_counter()
        subprocess.run(["ls", "-l", str(mnt / "ls")], capture_output=True, check=True, timeout=1800)
        return time.perf_counter() - t0
    finally:
        pb._fusermount_u(mnt)
        pb._wait_gone(proc.pid, proc)
        mnt.rmdir()


def behind_proxy(endpoint: str, latency_ms: float, log: Path) -> tuple[bench.Proxy | None, str]:
    """The latency proxy in front of ``endpoint`` (none at 0 ms) and the endpoint to use."""
    if not latency_ms:
        return None, endpoint
    proxy = bench.start_proxy(endpoint, latency_ms, log)
    return proxy, proxy.endpoint


def gcs_ls(a: argparse.Namespace, tmp: Path) -> tuple[str, float, dict[str, int]]:
    """The ``ls -l`` row on fake-gcs-server behind the same latency: GCS listings carry each
    object's metadata, so no record GET for the files."""
    gcs = servers.start_fake_gcs(tmp / "gcs")
    proxy = None
    try:
        proxy, endpoint = behind_proxy(gcs.endpoint, a.latency_ms, tmp / "gcs-proxy.log")
        url = f"gs://{gcs.bucket}/meta-{os.getpid()}"
        with marinfs_mount(url, {**os.environ, **gcs.env()}, tmp, "g-w") as m:
            subprocess.run(["cp", "-a", str(tmp / "lsrc"), str(m.path / "ls")], check=True, timeout=1800)
        with marinfs_mount(url, {**os.environ, **gcs.env(), "STORAGE_EMULATOR_HOST": endpoint}, tmp, "g-r") as m:
            secs, reqs = counted(m, ["ls", "-l", str(m.path / "ls")])
            out = subprocess.run(["ls", "-l", str(m.path / "ls")], capture_output=True, text=True, check=True).stdout
            check_ls(out, a.ls_files)
        return f"GCS: ls -l of {a.ls_files}, fresh mount", secs, reqs
    finally:
        if proxy is not None:
            bench.stop_proc(proxy.proc)
        gcs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latency-ms", type=float, default=0)
    ap.add_argument("--files", type=int, default=1000, help="files in the cp -a and rsync tree (1000)")
    ap.add_argument("--ls-files", type=int, default=2000, help="files in the ls -l directory (2000)")
    ap.add_argument("--gcs", action="store_true", help="also the ls -l row on fake-gcs-server")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meta-bench-"))
    s3 = servers.start_seaweedfs(tmp / "weed")
    proxy = None
    try:
        proxy, endpoint = behind_proxy(s3.endpoint, a.latency_ms, tmp / "proxy.log")
        env = {**os.environ, **s3.env(), "AWS_ENDPOINT_URL": endpoint}
        prefix = f"meta-{os.getpid()}"
        url = f"s3://{s3.bucket}/{prefix}"
        make_tree(tmp / "src", a.files)
        make_tree(tmp / "lsrc", a.ls_files)
        rows: list[tuple[str, float, dict[str, int]]] = []
        with marinfs_mount(url, env, tmp, "a") as m:
            rows.append((f"cp -a of {a.files} files", *counted(m, ["cp", "-a", str(tmp / "src"), str(m.path / "cp")])))
            rows.append(("chmod of one file", *counted(m, ["chmod", "600", str(m.path / "cp" / "f00001")])))
            subprocess.run(["cp", "-a", str(tmp / "lsrc"), str(m.path / "ls")], check=True, timeout=1800)
            rows.append((f"rsync -a of {a.files} files, first", *counted(
                m, ["rsync", "-a", f"{tmp / 'src'}/", f"{m.path / 'rs'}/"])))
        with marinfs_mount(url, env, tmp, "b") as m:
            secs, reqs = counted(m, ["ls", "-l", str(m.path / "ls")])
            out = subprocess.run(["ls", "-l", str(m.path / "ls")], capture_output=True, text=True, check=True).stdout
            check_ls(out, a.ls_files)
            rows.append((f"ls -l of {a.ls_files}, fresh mount", secs, reqs))
            rows.append((f"rsync -a of {a.files} files, again after a remount", *counted(
                m, ["rsync", "-a", f"{tmp / 'src'}/", f"{m.path / 'rs'}/"])))
        peer = s3fs_fuse_ls(s3, endpoint, prefix, tmp, a.ls_files)
        if a.gcs:
            rows.append(gcs_ls(a, tmp))
        print(f"\nmarinfs persisted metadata on S3 (SeaweedFS; GCS rows: fake-gcs-server), latency {a.latency_ms:.0f} ms\n")
        print("| step | s | requests |\n|---|---:|---|")
        for name, secs, reqs in rows:
            print(f"| {name} | {secs:.2f} | {', '.join(f'{k} {v}' for k, v in sorted(reqs.items())) or 'none'} |")
        if peer is not None:
            print(f"| s3fs-fuse ls -l of {a.ls_files} (same objects) | {peer:.2f} | (HEAD per object) |")
    finally:
        if proxy is not None:
            bench.stop_proc(proxy.proc)
        s3.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
