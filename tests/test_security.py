"""Security: a private cache directory, no credentials where others can read them, allow_other
only when asked (and then with default_permissions), and nothing under the mount that leads
outside the mounted prefix (docs/reliability.md has the table)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from marinfs.app.daemon import state_file
from marinfs.errors import UsageError
from marinfs.core import Filesystem
from marinfs.remote import Remote
from marinfs.app.mounts import MountEntry, convert
from mounting import MARINFS, daemon_pid, force_unmount, fsspec_client, inprocess_mount, staging_entries, subprocess_mount

NOBODY = 65534


def private(path: Path) -> list[str]:
    """Everything below ``path`` that group or others could read, write or enter."""
    loose = []
    for p in [path, *path.rglob("*")]:
        mode = p.lstat().st_mode
        if mode & 0o077:
            loose.append(f"{p.relative_to(path)} {stat.filemode(mode)}")
    return loose


def wait_for_file(path: Path, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name} after {within} s"
        time.sleep(0.05)


@pytest.mark.mount
def test_the_cache_dir_is_0700_and_its_files_0600(tmp_path: Path) -> None:
    remote, mnt, cache = tmp_path / "remote", tmp_path / "mnt", tmp_path / "cache"
    remote.mkdir()
    (remote / "data.bin").write_bytes(os.urandom(3 << 20))
    cache.mkdir(mode=0o755)  # made by someone else, too open
    os.chmod(cache, 0o755)
    log = tmp_path / "daemon.log"
    old = os.umask(0o022)
    try:
        with subprocess_mount(str(remote), mnt, cache, "--chunk-size", "1M", "--log-file", str(log)):
            assert (mnt / "data.bin").read_bytes() == (remote / "data.bin").read_bytes()  # chunks
            (mnt / "existing.txt").write_text("v1")
            fd = os.open(mnt / "existing.txt", os.O_WRONLY | os.O_APPEND)  # staged + journal
            try:
                os.write(fd, b" and more")
                # (a wait here, not a child process: a fork + exec closes a copy of fd, and that
                # close commits the file and drops its journal)
                wait_for_file(cache / "stats.json")  # published every 2 s
                assert list((cache / "chunks").rglob("*-*-*")), "no chunk cached"
                assert staging_entries(cache / "staging", "*.journal.json"), "no journal"
                assert (cache / "stats.json").exists()
                assert private(cache) == []
                assert stat.S_IMODE(log.stat().st_mode) == 0o600
                runtime = state_file(str(mnt))
                assert stat.S_IMODE(runtime.parent.stat().st_mode) == 0o700
            finally:
                os.close(fd)
    finally:
        os.umask(old)
    assert private(cache) == []


@pytest.fixture
def secret_s3(s3_server: Any, tmp_path: Path) -> Iterator[tuple[str, dict[str, str], str]]:
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, root = fsspec_client(url, s3_server.storage_options())
    client.pipe_file(f"{root}/present.txt", b"here")
    yield url, s3_server.env(), s3_server.secret_key


@pytest.mark.mount
def test_no_credentials_in_logs_errors_status_or_command_lines(secret_s3: tuple[str, dict[str, str], str],
                                                               s3_server: Any, tmp_path: Path) -> None:
    url, env, option_secret = secret_s3
    env_secret = "env-secret-" + uuid.uuid4().hex  # an option wins over the environment
    env = {**env, "AWS_SECRET_ACCESS_KEY": env_secret}
    mnt, cache, log = tmp_path / "mnt", tmp_path / "cache", tmp_path / "daemon.log"
    mnt.mkdir()
    args = [*MARINFS, "mount", url, str(mnt), "--cache-dir", str(cache), "--log-file", str(log),
            "--log-level", "debug", "-o", f"key={s3_server.access_key}", "-o", f"secret={option_secret}"]
    # SeaweedFS checks signatures: the option holds the right secret, the environment a wrong one
    # that must not be used, and neither may show anywhere.
    result = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    seen: dict[str, str] = {"mount stdout/stderr": result.stdout + result.stderr}
    try:
        assert result.returncode == 0, result.stderr
        pid = daemon_pid(mnt)
        assert (mnt / "present.txt").read_text() == "here"
        (mnt / "written.txt").write_text("w")
        with pytest.raises(OSError):
            (mnt / "missing.txt").read_text()
        wait_for_file(cache / "stats.json")  # published every 2 s
        seen["/proc/PID/cmdline"] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        seen["status"] = subprocess.run([*MARINFS, "status", "--json", str(mnt)], capture_output=True,
                                        text=True, timeout=60).stdout
        seen["state file"] = state_file(str(mnt)).read_text()
        seen["stats.json"] = (cache / "stats.json").read_text()
        environ = Path(f"/proc/{pid}/environ")
        assert environ.stat().st_uid == os.getuid() and stat.S_IMODE(environ.stat().st_mode) == 0o400
    finally:
        subprocess.run([*MARINFS, "umount", str(mnt)], capture_output=True, timeout=120)
        force_unmount(mnt)
    seen["log"] = log.read_text()
    assert "DEBUG" in seen["log"]
    # A mount that fails (no server there) must not quote the secret in its one-line error.
    bad = {**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    result = subprocess.run([*args[:-4], "--retries", "1", "-o", f"secret={option_secret}"], capture_output=True,
                            text=True, env={**os.environ, **bad}, timeout=120)
    assert result.returncode != 0
    seen["failed mount"] = result.stdout + result.stderr
    for where, text in seen.items():
        for secret in (option_secret, env_secret):
            assert secret not in text, f"a secret in {where}"


def mount_options(mnt: Path) -> set[str]:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[1] == str(mnt):
            return set(fields[3].split(","))
    raise AssertionError(f"{mnt} is not mounted")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="marinfs-sec-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        force_unmount(path / "mnt")
        shutil.rmtree(path, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.mount
def test_allow_other_is_off_by_default_and_comes_with_default_permissions(shared_dir: Path) -> None:
    remote, mnt = shared_dir / "remote", shared_dir / "mnt"
    remote.mkdir()
    (remote / "private.txt").write_text("owner only")
    (remote / "public.txt").write_text("everyone")
    with subprocess_mount(str(remote), mnt, shared_dir / "cache"):
        assert "allow_other" not in mount_options(mnt)
        assert as_nobody("cat", str(mnt / "public.txt")).returncode != 0  # not even a lookup
    with subprocess_mount(str(remote), mnt, shared_dir / "cache", "--allow-other", "--file-mode", "0600"):
        options = mount_options(mnt)
        assert {"allow_other", "default_permissions"} <= options
        denied = as_nobody("cat", str(mnt / "private.txt"))  # the kernel checks the 0600 mode
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
        listed = as_nobody("ls", str(mnt))
        assert listed.returncode == 0 and "public.txt" in listed.stdout


def _tree_with_links_out(tmp_path: Path) -> tuple[Path, Path]:
    remote, outside = tmp_path / "remote", tmp_path / "outside"
    (remote / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text("outside the prefix")
    (remote / "sub/inside.txt").write_text("inside")
    os.symlink(outside, remote / "dir-out")
    os.symlink(outside / "secret.txt", remote / "file-out")
    os.symlink("../../outside/secret.txt", remote / "sub/relative-out")
    os.symlink("sub", remote / "dir-in")
    os.symlink("sub/inside.txt", remote / "file-in")
    os.symlink(remote / "nowhere", remote / "dangling")
    return remote, outside


@pytest.mark.core
def test_marinfs_never_reads_or_writes_through_a_link_out_of_a_local_remote(tmp_path: Path) -> None:
    """Links are reported as links, their targets as text; marinfs's own I/O (reads, commits,
    listings, removals, renames) never goes through a link that leads out of the prefix."""
    remote_dir, outside = _tree_with_links_out(tmp_path)
    fs = Filesystem(Remote(str(remote_dir)), tmp_path / "staging")
    listed = {i.name: i for i in fs.readdir("/")}
    assert sorted(listed) == ["dangling", "dir-in", "dir-out", "file-in", "file-out", "sub"]
    assert all(listed[n].link for n in listed if n != "sub")
    assert fs.readlink("/dir-out") == str(outside) and fs.readlink("/dangling") == str(remote_dir / "nowhere")
    assert fs.readlink("/sub/relative-out") == "../../outside/secret.txt"
    for path in ("/dir-out/secret.txt", "/file-out"):
        with pytest.raises(OSError) as info:  # through the link: refused; the link itself: not a file
            fs.read(fs.open(path, os.O_RDONLY).fh, 100, 0)
        assert info.value.errno in (errno.EACCES, errno.ELOOP)
    for path in ("/dir-out", "/dir-out/x"):
        with pytest.raises(OSError):
            fs.readdir(path)
    with pytest.raises(PermissionError):
        fs.create("/dir-out/planted.txt", os.O_CREAT | os.O_WRONLY).fh
    with pytest.raises(PermissionError):
        fs.unlink("/dir-out/secret.txt")
    with pytest.raises(PermissionError):
        fs.rename("/dir-out/secret.txt", "/stolen.txt")
    with pytest.raises(PermissionError):
        fs.symlink("x", "/dir-out/planted-link")
    fs.unlink("/file-out")  # removes the link, never what it leads to
    fs.rename("/dir-out", "/moved-out")
    assert os.readlink(remote_dir / "moved-out") == str(outside)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "outside the prefix"


@pytest.mark.mount
def test_symbolic_links_in_a_local_remote_are_links_the_kernel_resolves(tmp_path: Path) -> None:
    """Through the mount a link is a link (lstat, readlink); following it is the kernel's
    work, with the caller's own rights, as on the disk itself. No write lands outside."""
    remote, outside = _tree_with_links_out(tmp_path)
    mnt = tmp_path / "mnt"
    with subprocess_mount(str(remote), mnt, tmp_path / "cache"):
        assert sorted(os.listdir(mnt)) == ["dangling", "dir-in", "dir-out", "file-in", "file-out", "sub"]
        assert sorted(os.listdir(mnt / "sub")) == ["inside.txt", "relative-out"]
        for name in ("dir-out", "file-out", "sub/relative-out", "dir-in", "file-in", "dangling"):
            assert os.readlink(mnt / name) == os.readlink(remote / name)
            assert stat.S_ISLNK(os.lstat(mnt / name).st_mode)
        assert (mnt / "file-in").read_text() == "inside" and sorted(os.listdir(mnt / "dir-in")) == ["inside.txt", "relative-out"]
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "dangling")
        for tool in (["find", str(mnt)], ["ls", "-lR", str(mnt)], ["du", "-s", str(mnt)]):
            assert subprocess.run(tool, capture_output=True, timeout=60).returncode == 0, tool
        os.unlink(mnt / "dir-out")
    assert not os.path.lexists(remote / "dir-out")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "outside the prefix"


@pytest.mark.mount
def test_nothing_outside_the_prefix_shows_in_an_object_store_mount(s3_server: Any, tmp_path: Path) -> None:
    """A sibling prefix that starts with the same characters, and keys above the prefix."""
    base = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{s3_server.bucket}/{base}"
    client, _ = fsspec_client(f"s3://{s3_server.bucket}", s3_server.storage_options())
    bucket = s3_server.bucket
    client.pipe({f"{bucket}/{base}/mine.txt": b"mine", f"{bucket}/{base}-evil/theirs.txt": b"theirs",
                 f"{bucket}/{base}x": b"sibling object", f"{bucket}/top.txt": b"bucket root"})
    with inprocess_mount(url, tmp_path / "mnt", tmp_path / "cache", storage_options=s3_server.storage_options()):
        mnt = tmp_path / "mnt"
        assert os.listdir(mnt) == ["mine.txt"]
        for name in ("../top.txt", f"../{base}-evil/theirs.txt"):
            assert not (mnt / name).resolve().is_relative_to(mnt)  # the kernel resolves "..": not us
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / f"{base}-evil")


def test_marinfs_path_never_maps_a_url_outside_the_prefix_into_the_mount() -> None:
    mounts = [MountEntry("s3://b/p", "/mnt/m")]
    assert convert("s3://b/p/./a//b", mounts) == "/mnt/m/a/b"
    assert convert("s3://b/p/x/../y", mounts) == "/mnt/m/y"
    for url in ("s3://b/p/../p-evil/x", "s3://b/p/a/../../x", "s3://b/p-other/x", "s3://b/p/.."):
        with pytest.raises(UsageError):
            convert(url, mounts)
    with pytest.raises(UsageError):
        convert("/mnt/m/../etc/passwd", mounts)
