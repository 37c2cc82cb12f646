"""Object versions: the string forms earlier releases kept on disk (journals, chunk-cache names)
read back to equal versions and are written byte for byte as before; preconditions per store."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from marinfs.read.chunkcache import ChunkKey
from marinfs.objects import ABSENT, ObjectRef, ObjectVersion
from marinfs.write.recovery import recover
from marinfs.remote import Remote
from marinfs.remote.base import version_of
from marinfs.write.staging import JOURNAL_SUFFIX, StagedFile

# Every form a version string had before ObjectVersion existed, with its kind.
OLD_FORMS = [
    ("e9b2cf535f27731c974343645a3985328", "etag"),  # S3 ETag (an MD5)
    ("e3858f62230ac3c915f300c664312c63f-4", "etag"),  # a multipart ETag
    ("g1733011200123456", "generation"),  # GCS generation
    ("m1733011200123456789:42", "mtime"),  # memory / generic fsspec
    ("m1733011200123456789:42:i1234567:c1733011200987654321", "mtime"),  # local disk
    ("m0:0", "mtime"),
    ("-", "absent"),  # ABSENT: the key must not exist
    ("unversioned-140234567890", "unversioned"),  # a handle on a store that gave no version
    ("v1", "opaque"),  # anything else is kept verbatim
]


@pytest.mark.parametrize("token, kind", OLD_FORMS)
def test_old_version_strings_round_trip(token: str, kind: str) -> None:
    version = ObjectVersion.parse(token)
    assert version.kind == kind and str(version) == token
    assert ObjectVersion.parse(str(version)) == version and hash(ObjectVersion.parse(token)) == hash(version)


def _old_version(info: dict[str, Any], mtime_ns: int, size: int) -> str:
    """remote.py's ``_version`` before ObjectVersion, verbatim: the strings on disk today."""
    generation = info.get("generation")
    if generation:
        return f"g{generation}"
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return f"e{str(etag).strip(chr(34))}"
    version = f"m{mtime_ns}:{size}"
    ctime = info.get("created")
    if info.get("ino") and isinstance(ctime, (int, float)):
        version += f":i{info['ino']}:c{int(ctime * 1_000_000_000)}"
    return version


@pytest.mark.parametrize("info", [
    {"ETag": '"9b2cf535f27731c974343645a3985328"'},  # s3fs
    {"etag": "abc-2"},
    {"generation": "1733011200123456", "etag": "CJD..."},  # gcsfs: the generation wins
    {"generation": 1733011200123456},
    {"created": 1733011200.25},  # memory: no inode
    {"ino": 1234567, "created": 1733011200.123456},  # local disk
    {"ino": 0, "created": 1.5},
])
def test_versions_from_backend_info_keep_their_old_strings(info: dict[str, Any]) -> None:
    assert str(version_of(info, 1733011200123456789, 42)) == _old_version(info, 1733011200123456789, 42)


@pytest.mark.parametrize("token, _kind", OLD_FORMS)
def test_chunk_cache_names_are_unchanged(token: str, _kind: str) -> None:
    """A cache directory written before keeps serving: the object hash is of the old string."""
    url = "s3://bucket/prefix/shard-0001.safetensors"
    old = hashlib.sha256(f"{url}\0{token}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    ref = ObjectRef(url=url, key="shard-0001.safetensors", version=ObjectVersion.parse(token), size=1)
    assert ChunkKey.of(ref, 3).object_id == old == ChunkKey(url, token, 3).object_id


def test_preconditions_per_store() -> None:
    etag, generation = ObjectVersion.etag('"abc"'), ObjectVersion.parse("g17")
    assert str(etag) == "eabc"
    assert etag.s3_precondition() == {"IfMatch": '"abc"'} and ABSENT.s3_precondition() == {"IfNoneMatch": "*"}
    assert generation.gcs_precondition() == {"ifGenerationMatch": "17"}
    assert ABSENT.gcs_precondition() == {"ifGenerationMatch": "0"}
    for wrong, method in ((generation, "s3_precondition"), (etag, "gcs_precondition"),
                          (ObjectVersion.parse("m1:2"), "s3_precondition")):
        with pytest.raises(ValueError):
            getattr(wrong, method)()


@pytest.mark.core
def test_journals_keep_the_old_string_and_old_journals_replay(tmp_path: Path) -> None:
    remote = Remote(f"memory://objects-{uuid.uuid4().hex[:10]}")
    remote.fs.mkdir(remote.root)
    remote.fs.pipe_file(remote.full("k"), b"base")
    base = remote.stat("k").version
    assert isinstance(base, ObjectVersion)
    staged = StagedFile(tmp_path / "staging", "k", seed=None, remote_url=remote.url, base_version=base)
    staged.write(b"new", 0)
    assert json.loads(Path(staged.journal_path).read_text())["base_version"] == str(base)
    os.close(staged.fd)  # the daemon died here

    # A journal as an earlier release wrote it (the same JSON): replayed onto the same version.
    (tmp_path / "staging" / "staged-old").write_bytes(b"older journal")
    remote.fs.pipe_file(remote.full("j"), b"j base")
    (tmp_path / "staging" / ("staged-old" + JOURNAL_SUFFIX)).write_text(json.dumps(
        {"remote": remote.url, "key": "j", "base_version": str(remote.stat("j").version), "data": "staged-old"}))
    results = {r.key: r for r in recover(tmp_path / "staging", remote)}
    assert results["k"].committed_as == "k" and not results["k"].conflict
    assert results["j"].committed_as == "j" and not results["j"].conflict
    assert remote.fs.cat_file(remote.full("k")) == b"new" and remote.fs.cat_file(remote.full("j")) == b"older journal"


@pytest.mark.core
def test_memory_remote_has_generations_and_enforces_preconditions(tmp_path: Path) -> None:
    """The in-memory fake keeps an object store's rules: a new generation per write (even one
    that keeps size and timestamp), and a commit replaces exactly the version it names."""
    import concurrent.futures as cf

    from marinfs.errors import PreconditionFailed, StaleVersionError

    remote = Remote(f"memory://objects-{uuid.uuid4().hex[:10]}")
    remote.fs.mkdir(remote.root)
    src = tmp_path / "src"
    src.write_bytes(b"same")
    first = remote.upload(str(src), "k", ABSENT)
    assert first is not None and first.kind == "generation" and remote.stat("k").version == first
    with pytest.raises(PreconditionFailed):
        remote.upload(str(src), "k", ABSENT)  # it exists now
    second = remote.upload(str(src), "k", first)  # the same bytes again: still a new version
    assert second != first and remote.stat("k").version == second
    assert {i.name: i.version for i in remote.list("")}["k"] == second
    with pytest.raises(PreconditionFailed):
        remote.upload(str(src), "k", first)  # that version is gone
    remote.fs.pipe_file(remote.full("k"), b"same")  # a write that bypasses the Remote
    with pytest.raises(StaleVersionError):
        remote.read_range("k", 0, 4, second)

    base = remote.stat("k").version
    assert base not in (first, second)

    def commit(_: int) -> bool:
        try:
            remote.upload(str(src), "k", base)
            return True
        except PreconditionFailed:
            return False

    with cf.ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(commit, range(16))) == 1  # writers racing from one base: one wins


def test_a_local_version_tells_a_renamed_file_from_a_rewritten_one() -> None:
    """same_file: one inode, size and mtime, another ctime (rename(2)); any other change, or
    another kind of version, is not the same file."""
    v = ObjectVersion.local(10, 5, ino=7, ctime_ns=100)
    assert v.same_file(ObjectVersion.local(10, 5, ino=7, ctime_ns=200))
    assert not v.same_file(ObjectVersion.local(11, 5, ino=7, ctime_ns=200))
    assert not v.same_file(ObjectVersion.local(10, 5, ino=8, ctime_ns=100))
    assert not ObjectVersion.local(10, 5).same_file(ObjectVersion.local(10, 5))  # no inode: cannot tell
    assert not ObjectVersion.etag("x").same_file(ObjectVersion.etag("x"))
