"""The behaviour suite: real tools and syscalls through a real mount, on every backend.

After each write the bytes are checked in the remote through fsspec, not only through the mount.
Tests that only write through the mount share one mount per backend, a directory each
(mounted_dir); those that write behind its back (put_remote) get a fresh mount (mounted).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from mounting import Mounted


def sh(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, f"{args} failed: {result.stderr}"
    return result


def test_write_read_and_remote_bytes(mounted_dir: Mounted) -> None:
    path = mounted_dir.mnt / "hello.txt"
    path.write_bytes(b"hello marin\n")
    assert mounted_dir.remote_bytes("hello.txt") == b"hello marin\n"
    assert path.read_bytes() == b"hello marin\n"
    assert os.stat(path).st_size == 12


def test_cp_and_sha256sum_of_a_large_file(mounted_dir: Mounted, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(20 * 1024 * 1024 + 123))
    sh("cp", str(src), str(mounted_dir.mnt / "big.bin"))
    expect = hashlib.sha256(src.read_bytes()).hexdigest()
    out = sh("sha256sum", str(mounted_dir.mnt / "big.bin")).stdout.split()[0]
    assert out == expect
    assert hashlib.sha256(mounted_dir.remote_bytes("big.bin")).hexdigest() == expect


def test_dd_and_partial_reads(mounted: Mounted) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    mounted.put_remote("r.bin", data)
    sh("dd", f"if={mounted.mnt / 'r.bin'}", f"of={mounted.mnt / 'copy.bin'}", "bs=1M", "status=none")
    assert mounted.remote_bytes("copy.bin") == data
    with open(mounted.mnt / "r.bin", "rb") as f:
        for offset, size in [(0, 1), (1_000_000, 4096), (len(data) - 10, 100), (len(data) + 5, 10)]:
            f.seek(offset)
            assert f.read(size) == data[offset:offset + size]


def test_mkdir_p_ls_find_du_rm_r(mounted_dir: Mounted) -> None:
    sh("mkdir", "-p", str(mounted_dir.mnt / "a/b/c"))
    (mounted_dir.mnt / "a/b/c/f.txt").write_text("x" * 5000)
    (mounted_dir.mnt / "a/top.txt").write_text("y")
    assert sorted(os.listdir(mounted_dir.mnt / "a")) == ["b", "top.txt"]
    listing = sh("ls", "-l", str(mounted_dir.mnt / "a")).stdout
    assert "top.txt" in listing and listing.count("\n") == 3
    found = sh("find", str(mounted_dir.mnt), "-type", "f").stdout.split()
    assert sorted(found) == sorted([str(mounted_dir.mnt / "a/b/c/f.txt"), str(mounted_dir.mnt / "a/top.txt")])
    du = int(sh("du", "-sb", str(mounted_dir.mnt / "a")).stdout.split()[0])
    assert du >= 5001
    assert mounted_dir.remote_bytes("a/b/c/f.txt") == b"x" * 5000
    sh("rm", "-r", str(mounted_dir.mnt / "a"))
    assert not (mounted_dir.mnt / "a").exists()
    assert not mounted_dir.remote_exists("a/top.txt") and not mounted_dir.remote_exists("a/b/c/f.txt")


def test_empty_directory_persists(mounted_dir: Mounted) -> None:
    os.mkdir(mounted_dir.mnt / "empty")
    assert mounted_dir.remote_exists("empty")
    assert os.listdir(mounted_dir.mnt / "empty") == []
    os.rmdir(mounted_dir.mnt / "empty")
    assert not (mounted_dir.mnt / "empty").exists()


def test_tar_extract_into_and_create_from(mounted_dir: Mounted, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    for i in range(30):
        d = src / f"d{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
    archive = tmp_path / "t.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(src, arcname="tree")
    sh("tar", "-xf", str(archive), "-C", str(mounted_dir.mnt))
    for path in src.rglob("*.txt"):
        rel = "tree/" + str(path.relative_to(src))
        assert mounted_dir.remote_bytes(rel) == path.read_bytes()
    out = tmp_path / "back.tar"
    sh("tar", "-cf", str(out), "-C", str(mounted_dir.mnt), "tree")
    with tarfile.open(out) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert len(names) == 30


def test_rsync_archive_into_mount(mounted_dir: Mounted, tmp_path: Path) -> None:
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(100_000))
    (src / "sub/b.txt").write_text("bee")
    sh("rsync", "-a", f"{src}/", str(mounted_dir.mnt / "dst"))
    assert mounted_dir.remote_bytes("dst/a.bin") == (src / "a.bin").read_bytes()
    assert mounted_dir.remote_bytes("dst/sub/b.txt") == b"bee"
    # A second run finds nothing to do and must not fail.
    sh("rsync", "-a", f"{src}/", str(mounted_dir.mnt / "dst"))


MMAP_CHECK = """
import hashlib, mmap, sys
path, offsets = sys.argv[1], [int(x) for x in sys.argv[2:]]
with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    print(len(m), hashlib.sha256(m).hexdigest())
    for offset in offsets:
        print(m[offset:offset + 1000].hex())
"""


def test_mmap_read(mounted: Mounted) -> None:
    # In a child process: a page fault on an in-process mount would wait for this very process.
    data = os.urandom(5 * 1024 * 1024)
    mounted.put_remote("m.bin", data)
    offsets = [0, 4096 * 7 + 3, len(data) - 1000]
    out = sh(sys.executable, "-c", MMAP_CHECK, str(mounted.mnt / "m.bin"), *map(str, offsets))
    lines = out.stdout.split()
    assert lines[:2] == [str(len(data)), hashlib.sha256(data).hexdigest()]
    assert lines[2:] == [data[o:o + 1000].hex() for o in offsets]


def test_zipfile_written_straight_onto_the_mount(mounted_dir: Mounted) -> None:
    # zipfile seeks back to patch local headers, like torch.save does.
    path = mounted_dir.mnt / "model.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for i in range(5):
            with z.open(f"tensor{i}", "w") as member:
                member.write(bytes([i]) * 200_000)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assert z.read("tensor3") == bytes([3]) * 200_000
    local = mounted_dir.cache_dir.parent / "model-copy.zip"
    local.write_bytes(mounted_dir.remote_bytes("model.zip"))
    with zipfile.ZipFile(local) as z:
        assert z.read("tensor4") == bytes([4]) * 200_000


def test_tmp_then_rename_replaces_target(mounted_dir: Mounted) -> None:
    (mounted_dir.mnt / "x").write_text("old")
    tmp = mounted_dir.mnt / "x.tmp"
    tmp.write_text("new content")
    os.rename(tmp, mounted_dir.mnt / "x")
    assert (mounted_dir.mnt / "x").read_text() == "new content"
    assert not tmp.exists()
    assert mounted_dir.remote_bytes("x") == b"new content"
    assert not mounted_dir.remote_exists("x.tmp")


def test_mv_directory_moves_every_object(mounted_dir: Mounted) -> None:
    for i in range(20):
        (mounted_dir.mnt / "src" / f"s{i % 2}").mkdir(parents=True, exist_ok=True)
        (mounted_dir.mnt / "src" / f"s{i % 2}" / f"f{i}").write_text(str(i))
    sh("mv", str(mounted_dir.mnt / "src"), str(mounted_dir.mnt / "dst"))
    assert not (mounted_dir.mnt / "src").exists()
    for i in range(20):
        assert mounted_dir.remote_bytes(f"dst/s{i % 2}/f{i}") == str(i).encode()
        assert not mounted_dir.remote_exists(f"src/s{i % 2}/f{i}")
    assert sorted(os.listdir(mounted_dir.mnt / "dst")) == ["s0", "s1"]


def test_inode_numbers_stay_when_the_kernel_forgets_the_inodes(mounted_dir: Mounted) -> None:
    # tar -x compares a directory's number at mkdir and at its end ("Directory renamed before
    # its status could be extracted"), find at each step; memory pressure makes the kernel
    # forget idle inodes meanwhile, as drop_caches does here.
    m = mounted_dir.mnt
    (m / "d/e").mkdir(parents=True)
    (m / "d/e/f").write_text("x")
    os.symlink("e/f", m / "d/link")
    names = ["d", "d/e", "d/e/f", "d/link"]
    before = {n: os.lstat(m / n).st_ino for n in names}
    assert len(set(before.values())) == len(names)
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert {n: os.lstat(m / n).st_ino for n in names} == before
    for _ in range(2):  # readdirplus, then (attributes cached) a plain readdir: d_ino agrees
        assert {e.name: e.inode() for e in os.scandir(m / "d")} == {"e": before["d/e"], "link": before["d/link"]}
    os.rename(m / "d/e/f", m / "d/g")  # a rename keeps the number, as on a disk
    assert os.lstat(m / "d/g").st_ino == before["d/e/f"]
    (m / "d/e/f").write_text("new")  # a new file under the old name is another inode
    assert os.lstat(m / "d/e/f").st_ino not in before.values()


def test_append_overwrite_middle_truncate(mounted_dir: Mounted) -> None:
    path = mounted_dir.mnt / "f.bin"
    path.write_bytes(b"0123456789")
    with open(path, "ab") as f:
        f.write(b"abc")
    assert mounted_dir.remote_bytes("f.bin") == b"0123456789abc"
    with open(path, "r+b") as f:
        f.seek(3)
        f.write(b"XYZ")
        f.seek(0)
        assert f.read() == b"012XYZ6789abc"  # O_RDWR really reads
    assert mounted_dir.remote_bytes("f.bin") == b"012XYZ6789abc"
    os.truncate(path, 4)
    assert mounted_dir.remote_bytes("f.bin") == b"012X"
    os.truncate(path, 8)
    assert mounted_dir.remote_bytes("f.bin") == b"012X\0\0\0\0"
    with open(path, "r+b") as f:
        f.truncate(2)
        f.seek(0, 2)
        f.write(b"!")
    assert mounted_dir.remote_bytes("f.bin") == b"01!"
    assert path.stat().st_size == 3


def test_append_to_remote_object_with_shell(mounted: Mounted) -> None:
    mounted.put_remote("log.txt", b"line1\n")
    subprocess.run(f"echo line2 >> {mounted.mnt / 'log.txt'}", shell=True, check=True)
    assert mounted.remote_bytes("log.txt") == b"line1\nline2\n"


def test_empty_file_and_touch(mounted_dir: Mounted) -> None:
    sh("touch", str(mounted_dir.mnt / "empty"))
    assert mounted_dir.remote_bytes("empty") == b""
    assert (mounted_dir.mnt / "empty").stat().st_size == 0
    sh("touch", str(mounted_dir.mnt / "empty"))  # utimens on an existing file succeeds


def test_chmod_chown_utime_succeed(mounted_dir: Mounted) -> None:
    path = mounted_dir.mnt / "p.txt"
    path.write_text("p")
    os.chmod(path, 0o600)
    os.chown(path, os.getuid(), os.getgid())
    os.utime(path, (1, 1))
    sh("cp", "-p", str(path), str(mounted_dir.mnt / "q.txt"))
    assert mounted_dir.remote_bytes("q.txt") == b"p"


def test_hard_links_are_eperm(mounted_dir: Mounted) -> None:
    (mounted_dir.mnt / "t").write_text("t")
    with pytest.raises(OSError) as info:
        os.link(mounted_dir.mnt / "t", mounted_dir.mnt / "l")
    assert info.value.errno == errno.EPERM
    assert not (mounted_dir.mnt / "l").exists()


def test_errors_through_the_mount(mounted_dir: Mounted) -> None:
    m = mounted_dir.mnt
    with pytest.raises(FileNotFoundError):
        open(m / "missing")
    with pytest.raises(FileNotFoundError):
        os.stat(m / "no/such/path")
    (m / "f").write_text("f")
    with pytest.raises(FileExistsError):
        os.open(m / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.mkdir(m / "d")
    (m / "d/child").write_text("c")
    with pytest.raises(OSError) as info:
        os.rmdir(m / "d")
    assert info.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        open(m / "d", "w")
    with pytest.raises(NotADirectoryError):
        os.listdir(m / "f")
    with pytest.raises(NotADirectoryError):
        open(m / "f/x", "w")
    with pytest.raises(FileExistsError):
        os.mkdir(m / "d")
    with pytest.raises(OSError) as info:
        (m / ("n" * 256)).write_text("x")
    assert info.value.errno == errno.ENAMETOOLONG
    (m / ("n" * 255)).write_text("x")  # 255 bytes is allowed
    assert mounted_dir.remote_bytes("n" * 255) == b"x"


def test_statfs_and_access(mounted_dir: Mounted) -> None:
    st = os.statvfs(mounted_dir.mnt)
    assert st.f_bavail > 0 and st.f_namemax == 255
    assert os.access(mounted_dir.mnt, os.W_OK)
    sh("df", str(mounted_dir.mnt))


def test_remote_changes_become_visible(mounted: Mounted) -> None:
    mounted.put_remote("outside.txt", b"from another node")
    # Not listed before: the negative cache is short; a fresh name is looked up remotely.
    assert (mounted.mnt / "outside.txt").read_bytes() == b"from another node"
