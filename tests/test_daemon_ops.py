"""Operating the daemon as an operator would: systemd notify, mount(8) and fstab through the
mount helper, config files, `marinfs status` and Prometheus metrics against live mounts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mounting import MARINFS, force_unmount, subprocess_mount
from servers import free_port
import tiers

pytestmark = pytest.mark.mount  # every test here mounts


@pytest.fixture
def remote_dir(tmp_path: Path) -> Path:
    d = tmp_path / "remote"
    d.mkdir()
    (d / "data.bin").write_bytes(os.urandom(3 << 20))
    return d


def test_sd_notify_ready_only_once_mounted_and_stopping_on_sigterm(tmp_path: Path, remote_dir: Path) -> None:
    """Also: a mount and its stop print nothing from libfuse (3.14 warned about max threads at
    every mount)."""
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(30)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([*MARINFS, "mount", str(remote_dir), str(mnt), "--foreground",
                             "--cache-dir", str(tmp_path / "cache")],
                            env={**os.environ, "NOTIFY_SOCKET": sock_path},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        message = sock.recv(4096).decode()
        assert message.startswith("READY=1")
        assert os.path.ismount(mnt)  # READY is only sent once the mount is live
        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in sock.recv(4096).decode()
        assert proc.wait(timeout=30) == 0
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
        force_unmount(mnt)
        sock.close()
    foreign = [line for line in err.decode().splitlines() if line and not line.startswith("marinfs[")]
    assert foreign == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_that_lands_on_a_python_thread_still_ends_the_daemon(
        tmp_path: Path, remote_dir: Path, sig: signal.Signals) -> None:
    """kill(2) of a process hands the signal to any thread not blocking it. One that a Python
    thread took set libfuse's exit flag and woke nobody: the daemon served on (a CI run's
    SIGTERM, 1 in 10 here under load). kill(2) of a thread's id makes that thread the first
    choice, so this test gives the signal to the stats loop's thread every time."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([*MARINFS, "mount", str(remote_dir), str(mnt), "--foreground",
                             "--cache-dir", str(tmp_path / "cache")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        tasks = Path(f"/proc/{proc.pid}/task")
        def named(task: Path) -> str:
            try:
                return (task / "comm").read_text().strip()
            except FileNotFoundError:  # (a short-lived thread ended meanwhile)
                return ""

        # (a thread it starts has its name too, until that thread names itself: the oldest)
        watch = sorted(int(t.name) for t in tasks.iterdir() if named(t) == "marinfs-watch")
        assert watch, "the stats loop runs as a thread of its own"
        os.kill(watch[0], sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        force_unmount(mnt)


def test_ctrl_c_while_the_daemon_starts_ends_it_at_once(tmp_path: Path) -> None:
    """A store that never answers holds the start (the daemon's first request); Ctrl-C there ends
    it at once with 130 and no traceback: the stop signals are left to the main thread, not
    blocked through the start (a first version of that fix waited for the start to end)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        silent.settimeout(60)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        proc = subprocess.Popen([*MARINFS, "mount", "s3://bucket/prefix", str(mnt), "--foreground",
                                 "--cache-dir", str(tmp_path / "cache")],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            conn, _ = silent.accept()  # the daemon is asking, and waits
            with conn:
                sent = time.monotonic()
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=30)
                assert proc.returncode == 130 and time.monotonic() - sent < 5, err.decode()
                assert "Traceback" not in err.decode() and not os.path.ismount(mnt)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
            force_unmount(mnt)


@pytest.fixture
@tiers.needs("mount")
def mount_helper_installed() -> Iterator[Path]:
    """/sbin/mount.marinfs for this test (mount(8) looks for helpers only in /sbin)."""
    if os.geteuid() != 0:
        pytest.skip("installing a mount helper needs root")
    helper = Path("/sbin/mount.marinfs")
    if helper.exists():
        pytest.skip("a mount.marinfs helper is already installed on this machine")
    helper.write_text(f"#!/bin/sh\nexec {sys.executable} -m marinfs.app.mount_helper \"$@\"\n")
    helper.chmod(0o755)
    try:
        yield helper
    finally:
        helper.unlink(missing_ok=True)


def test_mount_t_marinfs_and_umount(mount_helper_installed: Path, tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        out = subprocess.run(["mount", "-t", "marinfs", str(remote_dir), str(mnt), "-o",
                              f"cache_dir={tmp_path / 'cache'},cache_size=64M,ro"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert (mnt / "data.bin").read_bytes() == (remote_dir / "data.bin").read_bytes()
        with pytest.raises(OSError):
            (mnt / "new").write_text("x")  # ro reached the daemon
        assert subprocess.run(["umount", str(mnt)], capture_output=True, timeout=120).returncode == 0
        assert not os.path.ismount(mnt)
        bad = subprocess.run(["mount", "-t", "marinfs", str(remote_dir), str(mnt), "-o", "bogus_option=1"],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "bogus_option" in bad.stderr and not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)


def test_fstab_line(mount_helper_installed: Path, tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{remote_dir} {mnt} marinfs _netdev,nofail,cache_dir={tmp_path / 'cache'},"
                     f"cache_size=200M,metadata_ttl=2 0 0\n")
    try:
        out = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert os.path.ismount(mnt) and (mnt / "data.bin").stat().st_size == 3 << 20
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=120)
        force_unmount(mnt)


def test_config_file_flags_win_and_bad_config_is_one_line(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    config = tmp_path / "m.toml"
    config.write_text(f'remote = "{remote_dir}"\nmountpoint = "{mnt}"\ncache_dir = "{tmp_path / "cache"}"\n'
                      'file_mode = "0600"\nread_only = true\n')
    check = subprocess.run([*MARINFS, "config", "check", str(config)], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.startswith("ok:")
    try:
        out = subprocess.run([*MARINFS, "mount", "--config", str(config), "--file-mode", "0640"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "MARINFS_FILE_MODE": "0444"})
        assert out.returncode == 0, out.stderr
        assert os.stat(mnt / "data.bin").st_mode & 0o777 == 0o640  # flag > environment > file
        with pytest.raises(OSError):
            (mnt / "x").write_text("read-only from the file")
    finally:
        subprocess.run([*MARINFS, "umount", "--config", str(config)], capture_output=True, timeout=120)
        force_unmount(mnt)
    config.write_text('cache_size = "200X"\n')
    bad = subprocess.run([*MARINFS, "config", "check", str(config)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "200X" in bad.stderr
    config.write_text('cache_sise = "2G"\n')
    bad = subprocess.run([*MARINFS, "mount", "--config", str(config), str(mnt)], capture_output=True, text=True)
    assert bad.returncode == 2 and "cache_size" in bad.stderr and "Traceback" not in bad.stderr


def test_status_and_metrics_match_what_was_done(tmp_path: Path, remote_dir: Path) -> None:
    mnt, port = tmp_path / "mnt", free_port()
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache", "--metrics-port", str(port),
                          "--chunk-size", "1M"):
        data = (mnt / "data.bin").read_bytes()
        assert len(data) == 3 << 20
        (mnt / "out.txt").write_text("written")
        time.sleep(2.5)  # the daemon publishes its counters every 2 s
        out = subprocess.run([*MARINFS, "status", str(mnt), "--json"], capture_output=True, text=True, check=True)
        (item,) = json.loads(out.stdout)
        assert item["remote"] == str(remote_dir) and item["cache"]["bytes_fetched"] == 3 << 20
        assert item["remote_requests"]["requests"]["get"] == 3 and item["remote_requests"]["bytes_out"] == 7
        assert item["uploads"] == {"pending": [], "failed": [], "conflicts": [], "committing": [], "renames": []}
        human = subprocess.run([*MARINFS, "status"], capture_output=True, text=True, check=True).stdout
        assert str(mnt) in human and "hit ratio" in human
        assert "cache 3.0 MiB / 20.0 GiB" in human and "out 7 B" in human  # (not "0.0 GiB")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'marinfs_remote_requests_total{kind="get"} 3.0' in body
        assert "marinfs_cache_fetched_bytes_total 3.145728e+06" in body
        assert 'marinfs_fuse_op_seconds_count{op="read"}' in body
        assert 'marinfs_fuse_op_seconds_count{op="flush"}' in body
