"""An open file keeps reading after a rename made on this node, as on a local disk: its
handle follows the bytes to their new name (local disks: the same file; S3 and GCS: the
rename's copy, pinned to the version read; docs/semantics.md, Rename)."""

from __future__ import annotations

import errno
import os

import pytest

from mounting import Mounted

MiB = 1 << 20


def _backend(m: Mounted) -> str:
    return m.url.split("://")[0] if "://" in m.url else "local"


def _read_rest(f, data: bytes) -> None:  # noqa: ANN001 - a raw file
    f.seek(30 * MiB)
    assert f.read(MiB) == data[30 * MiB:31 * MiB]
    f.seek(MiB)
    assert f.read() == data[MiB:]


def test_a_reader_keeps_reading_a_file_renamed_here(mounted: Mounted) -> None:
    data = os.urandom(40 * MiB + 11)
    mounted.put_remote("a.bin", data)
    with open(mounted.mnt / "a.bin", "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]
        os.rename(mounted.mnt / "a.bin", mounted.mnt / "b.bin")
        _read_rest(f, data)
    assert (mounted.mnt / "b.bin").read_bytes() == data and not (mounted.mnt / "a.bin").exists()


def test_a_reader_keeps_reading_a_file_whose_directory_was_renamed_here(mounted: Mounted) -> None:
    data = os.urandom(40 * MiB + 11)
    mounted.fs.makedirs(mounted.remote_path("d/sub"), exist_ok=True)
    mounted.put_remote("d/sub/a.bin", data)
    with open(mounted.mnt / "d/sub/a.bin", "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]
        os.rename(mounted.mnt / "d", mounted.mnt / "e")
        _read_rest(f, data)
    assert (mounted.mnt / "e/sub/a.bin").read_bytes() == data


def test_a_reader_of_an_older_version_does_not_follow_a_rename(mounted: Mounted) -> None:
    """A handle of a version the source no longer is (replaced behind our back) is not moved
    onto the copy of the newer one: its reads past what it fetched fail, never mix. With a
    shared tier that another node read the old version into, they read that version there."""
    if _backend(mounted) not in ("s3", "gs"):
        pytest.skip("a pinned copy is the object stores'")
    old, new = os.urandom(40 * MiB), os.urandom(40 * MiB)
    mounted.put_remote("c.bin", old)
    with open(mounted.mnt / "c.bin", "rb", buffering=0) as f:
        assert f.read(MiB) == old[:MiB]
        mounted.put_remote("c.bin", new)  # another node's new version (the copy HEADs it afresh)
        os.rename(mounted.mnt / "c.bin", mounted.mnt / "d.bin")
        f.seek(35 * MiB)  # a chunk this node never fetched
        if mounted.warm is not None:  # the shared tier holds the old version whole: its bytes
            assert f.read(MiB) == old[35 * MiB:36 * MiB]
            return
        with pytest.raises(OSError) as exc:
            f.read(MiB)
        assert exc.value.errno in (errno.ESTALE, errno.ENOENT, errno.EIO)


def test_a_directory_with_attributes_set_here_renames_whole(mounted: Mounted) -> None:
    """A directory whose subdirectory had its mode set here (a directory record on object
    stores) moves whole, its record included (a review found GCS's pinned copy asking stat()
    for the record's generation, which stat never shows: the rename failed midway)."""
    (mounted.mnt / "t/sub").mkdir(parents=True)
    (mounted.mnt / "t/sub/f").write_bytes(b"x")
    os.chmod(mounted.mnt / "t/sub", 0o700)
    os.rename(mounted.mnt / "t", mounted.mnt / "u")
    assert (mounted.mnt / "u/sub/f").read_bytes() == b"x"
    assert not (mounted.mnt / "t").exists()


def test_a_renamed_reader_never_reads_the_replaced_targets_pending_writes(mounted: Mounted) -> None:
    """mv a b while b is open for writing here with bytes not yet committed: a reader of a
    reads a's bytes after the rename, never b's writer's (the window during the rename and an
    unlinked name's next writer: test_core's pending-writes test)."""
    data = os.urandom(20 * MiB)
    mounted.put_remote("a.bin", data)
    with open(mounted.mnt / "b.bin", "wb") as w, open(mounted.mnt / "a.bin", "rb", buffering=0) as r:
        w.write(b"w" * MiB)
        w.flush()
        assert r.read(MiB) == data[:MiB]
        os.rename(mounted.mnt / "a.bin", mounted.mnt / "b.bin")
        r.seek(0)
        assert r.read(2 * MiB) == data[:2 * MiB]
        r.seek(15 * MiB)
        assert r.read(MiB) == data[15 * MiB:16 * MiB]
