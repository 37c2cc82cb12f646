"""The command line: bad input gets one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mounting import MARINFS, daemon_pid, force_unmount, freed_if_wedged, fuse_connections, subprocess_mount


def marinfs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*MARINFS, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("marinfs: error: ")
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def remote_dir(tmp_path: Path) -> Path:
    d = tmp_path / "remote"
    d.mkdir()
    (d / "a.txt").write_text("a")
    return d


def test_missing_mountpoint(tmp_path: Path, remote_dir: Path) -> None:
    result = marinfs("mount", str(remote_dir), str(tmp_path / "nope"))
    assert_one_line_error(result, "does not exist")
    assert result.returncode == 2


def test_mountpoint_is_a_file(tmp_path: Path, remote_dir: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(marinfs("mount", str(remote_dir), str(f)), "not a directory")


def test_unknown_url_scheme(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    result = marinfs("mount", "nosuchscheme://bucket/x", str(tmp_path / "mnt"))
    assert_one_line_error(result, "nosuchscheme")
    assert not os.path.ismount(tmp_path / "mnt")


def test_missing_local_remote(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    result = marinfs("mount", str(tmp_path / "absent"), str(tmp_path / "mnt"))
    assert_one_line_error(result, "does not exist")
    assert not os.path.ismount(tmp_path / "mnt")


def test_remote_missing_and_marin_prefix_unset(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MARIN_PREFIX"}
    result = subprocess.run([*MARINFS, "mount", str(tmp_path)], capture_output=True, text=True, env=env)
    assert_one_line_error(result, "MARIN_PREFIX")


def test_bad_flag_values(tmp_path: Path, remote_dir: Path) -> None:
    (tmp_path / "mnt").mkdir()
    assert_one_line_error(marinfs("mount", str(remote_dir), str(tmp_path / "mnt"), "--file-mode", "9z"), "9z")
    assert_one_line_error(marinfs("mount", str(remote_dir), str(tmp_path / "mnt"), "--metadata-ttl", "-1"))
    assert_one_line_error(marinfs("mount", str(remote_dir), str(tmp_path / "mnt"), "-o", "novalue"))
    assert_one_line_error(marinfs("frobnicate"))


@pytest.mark.mount
def test_already_mounted(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache"):
        result = marinfs("mount", str(remote_dir), str(mnt), "--cache-dir", str(tmp_path / "c2"))
        assert_one_line_error(result, "already a mount point")
        assert (mnt / "a.txt").read_text() == "a"  # the first mount is untouched


@pytest.mark.mount
@pytest.mark.parametrize("layout", ["itself", "through a symlink", "remote inside the mountpoint",
                                    "mountpoint inside the remote"])
def test_a_local_remote_overlapping_its_mountpoint_is_refused_with_one_line(tmp_path: Path, layout: str) -> None:
    """Issue 37: such a mount serves itself; the first `ls` hung in state D, unkillable, and
    `umount` said busy. Refused before anything is mounted (the guard frees the old daemon)."""
    d = tmp_path / "d"
    d.mkdir()
    mnt, remote = d, d
    if layout == "through a symlink":
        remote = tmp_path / "link"
        remote.symlink_to(d)
    elif layout == "remote inside the mountpoint":
        remote = d / "sub"
        remote.mkdir()
    elif layout == "mountpoint inside the remote":
        mnt = d / "mnt"
        mnt.mkdir()
    with freed_if_wedged(mnt, after=20):
        pid = None
        try:
            result = marinfs("mount", str(remote), str(mnt), "--cache-dir", str(tmp_path / "cache"))
            if fuse_connections(mnt):  # mounted after all (before the fix): what a user met
                pid = daemon_pid(mnt)
                done = threading.Event()

                def ls() -> None:
                    with contextlib.suppress(OSError):  # ENOTCONN once the guard aborted it
                        os.listdir(mnt)
                        done.set()

                threading.Thread(target=ls, daemon=True).start()
                assert done.wait(10), f"mounted {layout}, and the first ls hangs"
        finally:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert_one_line_error(result, str(mnt), "own mount")
    assert result.returncode == 2
    assert not fuse_connections(mnt)


@pytest.mark.mount
def test_a_non_empty_mountpoint_is_refused_unless_allowed(tmp_path: Path, remote_dir: Path) -> None:
    """Issue 37: a mount over files hid them without a word. Refused as rclone refuses it;
    --allow-non-empty mounts over them, says so in the log, and they are back after."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (mnt / "mine.txt").write_text("mine")
    result = marinfs("mount", str(remote_dir), str(mnt), "--cache-dir", str(tmp_path / "cache"))
    force_unmount(mnt)
    assert_one_line_error(result, str(mnt), "not empty", "mine.txt", "--allow-non-empty")
    assert result.returncode == 2
    log = tmp_path / "daemon.log"
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache", "--allow-non-empty", "--log-file", str(log)):
        assert os.listdir(mnt) == ["a.txt"]
    assert "mountpoint " + str(mnt) + " is not empty (1 entry, such as 'mine.txt'): hidden while mounted" in log.read_text()
    assert (mnt / "mine.txt").read_text() == "mine"


@pytest.mark.mount
def test_status_right_after_a_mount_shows_its_uptime(tmp_path: Path, remote_dir: Path) -> None:
    """Issue 37: `up ? s` until the daemon first published its figures (2 s later)."""
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache"):
        out = marinfs("status", str(mnt))
        assert out.returncode == 0, out.stderr
        assert re.search(r"daemon PID \d+, up \d+(\.\d+)? s", out.stdout), out.stdout


def test_umount_of_a_plain_directory(tmp_path: Path) -> None:
    assert_one_line_error(marinfs("umount", str(tmp_path)), "not a marinfs mount")


@pytest.mark.mount
def test_mount_uses_marin_prefix_and_umount_waits_for_the_daemon(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = marinfs("mount", str(mnt), "--cache-dir", str(tmp_path / "cache"),
                         env={"MARIN_PREFIX": str(remote_dir) + "//"})
        assert result.returncode == 0, result.stderr
        assert "mounted" in result.stdout and str(mnt) in result.stdout
        assert (mnt / "a.txt").read_text() == "a"
        from mounting import daemon_pid

        pid = daemon_pid(mnt)
        result = marinfs("umount", str(mnt))
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mnt)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    finally:
        force_unmount(mnt)


@pytest.mark.mount
def test_relative_remote_is_resolved_at_mount_time(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = subprocess.run([*MARINFS, "mount", "remote", "mnt", "--cache-dir", "cache"],
                                capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert result.returncode == 0, result.stderr
        mounts = Path("/proc/mounts").read_text()
        assert f"{remote_dir} {mnt} fuse.marinfs" in mounts
    finally:
        marinfs("umount", str(mnt))
        force_unmount(mnt)


@pytest.mark.mount
def test_foreground_mount_stops_on_umount(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([*MARINFS, "mount", str(remote_dir), str(mnt), "--foreground",
                             "--cache-dir", str(tmp_path / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert os.path.ismount(mnt)
        assert marinfs("umount", str(mnt)).returncode == 0
        assert proc.wait(timeout=30) == 0
    finally:
        force_unmount(mnt)
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.mount
def test_path_converts_both_ways(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache"):
        out = marinfs("path", str(mnt / "a.txt"))
        assert out.returncode == 0 and out.stdout.strip() == f"{remote_dir}/a.txt"
        out = marinfs("path", f"{remote_dir}/sub/x.json")
        assert out.returncode == 0 and out.stdout.strip() == f"{mnt}/sub/x.json"
        out = marinfs("path", str(mnt))
        assert out.stdout.strip() == str(remote_dir)
        assert_one_line_error(marinfs("path", "/definitely/not/mounted"), "not under any marinfs mount")


@pytest.mark.mount
def test_read_only_mount(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache", "--read-only"):
        assert (mnt / "a.txt").read_text() == "a"
        with pytest.raises(OSError) as info:
            (mnt / "b.txt").write_text("b")
        assert info.value.errno == 30  # EROFS
        with pytest.raises(OSError):
            (mnt / "a.txt").write_text("changed")
    assert (remote_dir / "a.txt").read_text() == "a"


@pytest.mark.mount
def test_owner_and_modes_from_flags(tmp_path: Path, remote_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    (remote_dir / "d").mkdir()
    with subprocess_mount(str(remote_dir), mnt, tmp_path / "cache", "--uid", "1234", "--gid", "4321",
                          "--file-mode", "0600", "--dir-mode", "0700"):
        st = os.stat(mnt / "a.txt")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 4321, 0o600)
        assert os.stat(mnt / "d").st_mode & 0o7777 == 0o700


def test_a_bad_read_path_switch_is_one_line_and_exit_2(tmp_path: Path, remote_dir: Path) -> None:
    """The read path's switches are settings: a bad value fails the mount before anything starts."""
    (tmp_path / "mnt").mkdir()
    try:
        for name, bad in (("MARINFS_PART_CHECKSUM", "sha1"), ("MARINFS_DIRECT_GET", "maybe"), ("MARINFS_GET", "boto")):
            result = marinfs("mount", str(remote_dir), str(tmp_path / "mnt"), env={name: bad})
            assert_one_line_error(result, name, bad)
            assert result.returncode == 2 and not os.path.ismount(tmp_path / "mnt")
    finally:
        if os.path.ismount(tmp_path / "mnt"):  # only if the switch was taken: never leave a mount
            force_unmount(tmp_path / "mnt")
