"""Persisted POSIX metadata in the remote layer (issue #16): posixmeta.py's conversions, read
and written as s3fs-fuse, rclone, gcsfuse and gsutil do; and each backend's upload with attrs,
set_attrs (metadata only, conditional, no bytes sent), listings, renames, read_small/put_small."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from conftest import object_store
from marinfs import posixmeta as pm
from marinfs.errors import FsError, PreconditionFailed
from marinfs.objects import ABSENT, NO_ATTRS, ObjectVersion, PosixAttrs
from marinfs.remote import GCSRemote, GenericRemote, LocalRemote, MemoryRemote, Remote, RemoteSettings, S3Remote
from mounting import fsspec_client

T2020 = 1577923200_000000000  # 2020-01-02T00:00:00Z
FULL = PosixAttrs(mode=0o4750, uid=1234, gid=5678, mtime_ns=T2020 + 123456789,
                  xattrs=(("user.a", b"\x00\xff bin"), ("user.comment", "héllo".encode())))


# -- conversions (unit) ----------------------------------------------------------------------
def test_s3_keys_as_s3fs_fuse_writes_them() -> None:
    meta = pm.to_s3(PosixAttrs(mode=0o755, uid=1000, gid=100, mtime_ns=T2020))
    assert meta == {"mode": "33261", "uid": "1000", "gid": "100", "mtime": "1577923200.000000000"}
    assert pm.to_s3(PosixAttrs(mode=0o755), is_dir=True) == {"mode": str(stat.S_IFDIR | 0o755)}
    assert pm.to_s3(NO_ATTRS) == {}  # nothing set, nothing written
    assert pm.to_s3(PosixAttrs(mtime_ns=-1)) == {"mtime": "-0.000000001"}


def test_xattr_value_is_s3fs_fuses_encoding() -> None:
    value = pm.to_s3(PosixAttrs(xattrs=(("user.k", b"v1"),)))["xattr"]
    # s3fs-fuse: urlEncodeGeneral('{"user.k":"djE="}'), only A-Za-z0-9.-_~ kept
    assert value == "%7B%22user.k%22%3A%22djE%3D%22%7D"
    assert pm.decode_xattrs(value) == {"user.k": b"v1"}


def test_round_trips() -> None:
    for attrs in (FULL, NO_ATTRS, PosixAttrs(mode=0), PosixAttrs(mtime_ns=0), PosixAttrs(uid=0, gid=0)):
        assert pm.from_s3(pm.to_s3(attrs)) == attrs
        assert pm.from_gcs(pm.to_gcs(attrs)) == attrs


def test_gcs_keys_as_gcsfuse_and_gsutil_write_them() -> None:
    meta = pm.to_gcs(PosixAttrs(mode=0o755, uid=1, gid=2, mtime_ns=T2020 + 500_000_000))
    assert meta == {"gcsfuse_mtime": "2020-01-02T00:00:00.5Z", "goog-reserved-file-mtime": "1577923200",
                    "goog-reserved-posix-mode": "755", "goog-reserved-posix-uid": "1",
                    "goog-reserved-posix-gid": "2"}
    assert pm.rfc3339(T2020) == "2020-01-02T00:00:00Z"
    assert pm.rfc3339(T2020 + 1) == "2020-01-02T00:00:00.000000001Z"


@pytest.mark.parametrize("value, mode", [
    ("33261", 0o755),  # s3fs-fuse: decimal st_mode of a regular file
    ("16877", 0o755),  # s3fs-fuse: a directory (S_IFDIR | 0755)
    ("35309", 0o4755),  # setuid
    ("100644", 0o644),  # rclone: octal with the type (as decimal it has bits above S_IFMT)
    ("40755", 0o755),  # rclone: an octal directory (as decimal no valid type)
    ("644", 0o644), ("0644", 0o644), ("1777", 0o1777),  # octal permission bits (gsutil)
    ("33261 ", 0o755),
    ("", None), ("rwxr-xr-x", None), ("999", None), ("-1", None), ("0x1ff", None), ("12345678901", None),
])
def test_mode_parsing(value: str, mode: int | None) -> None:
    assert pm.parse_mode(value) == mode


@pytest.mark.parametrize("value, ns", [
    ("1577923200.000000000", T2020),  # ours, rclone's on S3
    ("1577923200", T2020),  # s3fs-fuse
    ("1577923200.5", T2020 + 500_000_000),
    ("1577923200.123456789", T2020 + 123456789),
    ("2020-01-02T00:00:00Z", T2020),  # gcsfuse, rclone --metadata
    ("2020-01-02T00:00:00.123456789Z", T2020 + 123456789),
    ("2020-01-02T01:00:00+01:00", T2020),
    ("2020-01-01T19:00:00.5-05:00", T2020 + 500_000_000),
    ("garbage", None), ("", None), ("nan", None), ("inf", None), ("1e300", None), ("2020-13-45T00:00:00Z", None),
])
def test_mtime_parsing(value: str, ns: int | None) -> None:
    assert pm.parse_mtime(value) == ns


def test_reading_s3_metadata_written_by_s3fs_fuse_and_rclone() -> None:
    s3fs_fuse = {"mode": "33188", "uid": "1000", "gid": "1000", "mtime": "1577923200", "ctime": "1577923200",
                 "atime": "1577923200",
                 "xattr": quote('{"user.mime":"dGV4dC9wbGFpbg==","system.posix_acl_access":"AgAAAA=="}', safe="")}
    assert pm.from_s3(s3fs_fuse) == PosixAttrs(mode=0o644, uid=1000, gid=1000, mtime_ns=T2020,
                                               xattrs=(("user.mime", b"text/plain"),))
    rclone = {"Mtime": "1577923200.250000000", "Mode": "100600", "Uid": "7", "Gid": "8", "btime": "x"}
    assert pm.from_s3(rclone) == PosixAttrs(mode=0o600, uid=7, gid=8, mtime_ns=T2020 + 250_000_000)
    assert pm.from_s3({"mtime": "2020-01-02T00:00:00Z"}).mtime_ns == T2020  # rclone --metadata
    garbage = {"mode": "x", "uid": "-3", "gid": "99999999999", "mtime": "yesterday", "xattr": "%7Bnot json"}
    assert pm.from_s3(garbage) == NO_ATTRS
    assert pm.from_s3({"xattr": quote('{"user.a":"!!notbase64"}', safe="")}) == NO_ATTRS
    assert pm.from_s3(None) == NO_ATTRS


def test_reading_an_xattr_value_the_way_s3fs_fuse_does_when_it_is_not_json() -> None:
    # s3fs-fuse writes names unescaped: a backslash in a name is not valid JSON.
    value = quote('{"user.a\\q":"eA==","user.c":"eQ=="}', safe="")
    assert pm.decode_xattrs(value) == {"user.a\\q": b"x", "user.c": b"y"}


def test_reading_gcs_metadata_of_gcsfuse_gsutil_and_rclone() -> None:
    gsutil = {"goog-reserved-file-mtime": "1577923200", "goog-reserved-posix-mode": "640",
              "goog-reserved-posix-uid": "3", "goog-reserved-posix-gid": "4"}
    assert pm.from_gcs(gsutil) == PosixAttrs(mode=0o640, uid=3, gid=4, mtime_ns=T2020)
    both = {**gsutil, "gcsfuse_mtime": "2020-01-02T00:00:00.000000007Z"}
    assert pm.from_gcs(both).mtime_ns == T2020 + 7  # gcsfuse's has the nanoseconds
    rclone = {"mtime": "2020-01-02T00:00:00.1Z", "mode": "100755", "uid": "5", "gid": "6"}
    assert pm.from_gcs(rclone) == PosixAttrs(mode=0o755, uid=5, gid=6, mtime_ns=T2020 + 100_000_000)
    assert pm.from_gcs({"gcsfuse_symlink_target": "x"}) == NO_ATTRS


def test_ours_and_foreign_keys() -> None:
    assert pm.is_ours("Mode", "s3") and pm.is_ours("xattr", "gcs") and pm.is_ours("goog-reserved-posix-uid", "gcs")
    assert not pm.is_ours("gcsfuse_symlink_target", "gcs") and not pm.is_ours("atime", "s3")
    meta = {"Mode": "33188", "atime": "1", "content-language": "fr", "xattr": "%7B%7D"}
    assert pm.foreign(meta, "s3") == {"atime": "1", "content-language": "fr"}


def test_s3_replace_keeps_foreign_keys_and_non_user_xattrs() -> None:
    acl = quote('{"system.posix_acl_access":"AgAAAA==","user.old":"eA=="}', safe="")
    meta = {"mode": "33188", "uid": "1", "ctime": "5", "xattr": acl}
    new = pm.s3_replace(meta, PosixAttrs(mode=0o600, xattrs=(("user.new", b"y"),)))
    assert new["ctime"] == "5" and new["mode"] == str(stat.S_IFREG | 0o600) and "uid" not in new
    assert pm.decode_xattrs(new["xattr"]) == {"system.posix_acl_access": b"\x02\x00\x00\x00", "user.new": b"y"}


def test_gcs_patch_sets_ours_and_removes_ours_now_unset() -> None:
    meta = {"gcsfuse_mtime": "2020-01-02T00:00:00Z", "goog-reserved-file-mtime": "1577923200",
            "goog-reserved-posix-uid": "9", "gcsfuse_symlink_target": "t", "mode": "100644", "mtime": "x"}
    patch = pm.gcs_patch(meta, PosixAttrs(mode=0o700))
    assert patch == {"goog-reserved-posix-mode": "700", "gcsfuse_mtime": None, "goog-reserved-file-mtime": None,
                     "goog-reserved-posix-uid": None, "mode": "100700", "mtime": None}
    assert pm.from_gcs({**meta, **patch}) == PosixAttrs(mode=0o700)  # (None: the key removed)


# -- what each backend can keep (unit) -------------------------------------------------------------
def _one_xattr(size: int) -> PosixAttrs:
    return PosixAttrs(xattrs=(("user.v", b"x" * size),))


def _largest_that_fits(backend: type[Remote], base: PosixAttrs = NO_ATTRS) -> int:
    """The longest value of one xattr beside ``base`` that ``backend`` keeps."""
    low, high = 0, 1 << 17  # fits, does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if backend.attrs_fit(replace(base, xattrs=_one_xattr(mid).xattrs)) else (low, mid)
    return low


@pytest.mark.parametrize("backend", [LocalRemote, MemoryRemote, GenericRemote])
def test_a_file_keeps_64_kib_of_xattrs_where_the_store_says_no_less(backend: type[Remote]) -> None:
    """As ext4's attribute block: every user.* name and value together; mode, owner and times
    are not counted."""
    assert backend.attrs_limit == 65536
    assert _largest_that_fits(backend) == 65536 - len("user.v")
    assert backend.attrs_bytes(FULL) == sum(len(n.encode()) + len(v) for n, v in FULL.xattrs)
    assert backend.attrs_fit(replace(_one_xattr(65536 - len("user.v")), mode=0o644, uid=1, mtime_ns=T2020))


@pytest.mark.parametrize(("backend", "limit", "encode"), [(S3Remote, 2048, pm.to_s3), (GCSRemote, 8192, pm.to_gcs)])
def test_an_object_store_keeps_what_its_object_metadata_holds(backend: type[Remote], limit: int, encode: Any) -> None:
    """S3 keeps 2 KiB of user metadata, GCS 8 KiB: the attributes count as the keys they are
    written as (posixmeta.py), mode, owner and times included, every name and value in UTF-8."""
    assert backend.attrs_limit == limit
    for attrs in (FULL, NO_ATTRS, _one_xattr(100)):
        assert backend.attrs_bytes(attrs) == sum(len(k.encode()) + len(v.encode()) for k, v in encode(attrs).items())
    alone, beside = _largest_that_fits(backend), _largest_that_fits(backend, FULL)
    assert 0 < beside < alone < limit  # encoded values are longer, and mode, owner, times take their share
    assert backend.attrs_bytes(_one_xattr(alone)) <= limit < backend.attrs_bytes(_one_xattr(alone + 1))
    assert not backend.attrs_fit(_one_xattr(alone + 1))


def test_a_value_s3_cannot_keep_fits_gcs_and_the_rest() -> None:
    attrs = _one_xattr(4000)
    assert [b.attrs_fit(attrs) for b in (S3Remote, GCSRemote, MemoryRemote, LocalRemote)] == [False, True, True, True]


# -- backends without servers (core) -------------------------------------------------------------
def _src(tmp_path: Path, data: bytes = b"hello world") -> str:
    path = tmp_path / f"src-{uuid.uuid4().hex[:8]}"
    path.write_bytes(data)
    return str(path)


def _local(remote: Remote) -> bool:
    return remote.protocol in ("file", "local")


def _stored(remote: Remote, key: str) -> PosixAttrs:
    """What is stored, compared the way the backend keeps it (a local file always has every
    field: only those set are compared)."""
    posix = remote.stat(key).posix
    assert posix is not None
    return posix


def _quiet(remote: Remote) -> None:
    """No background write of a directory record (remote/recorded.py) inside a counted window:
    what is queued is written now, what is queued next waits for close()."""
    records = getattr(remote, "records", None)
    if records is not None:
        assert records.flush(10)
        records.flush_delay = 3600


def _matches(found: PosixAttrs, want: PosixAttrs, local: bool) -> bool:
    if not local:
        return found == want
    return all(getattr(want, f) is None or getattr(found, f) == getattr(want, f)
               for f in ("mode", "uid", "gid", "mtime_ns")) and found.xattrs == want.xattrs


def test_upload_with_attrs_then_stat_shows_them(remote: Remote, tmp_path: Path) -> None:
    version = remote.upload(_src(tmp_path), "f", ABSENT, attrs=FULL)
    info = remote.stat("f")
    assert _matches(info.posix, FULL, _local(remote))
    if version is not None:
        assert info.version == version
    remote.upload(_src(tmp_path), "plain", ABSENT)
    plain = remote.stat("plain").posix
    assert plain == NO_ATTRS if not _local(remote) else plain.xattrs == ()


def test_set_attrs_changes_metadata_only_and_checks_the_version(remote: Remote, tmp_path: Path) -> None:
    remote.upload(_src(tmp_path, b"data"), "f", ABSENT, attrs=PosixAttrs(mode=0o644, xattrs=(("user.x", b"1"),)))
    before = remote.stat("f")
    _quiet(remote)
    remote.stats.reset()
    new = PosixAttrs(mode=0o600, mtime_ns=T2020, xattrs=(("user.y", b"2"),))
    after = remote.set_attrs("f", new, before.version)
    counts = remote.stats.snapshot()["requests"]
    assert counts.get("put", 0) == 0 and remote.stats.bytes_out == 0  # no bytes sent
    assert _matches(remote.stat("f").posix, new, _local(remote))
    assert remote.read_range("f", 0, 4) == b"data"
    if _local(remote):
        assert after == remote.stat("f").version  # mtime and ctime changed: a new local version
    else:
        assert after == before.version  # memory keeps the generation, as GCS does
    # A stale version changes nothing.
    stale = ObjectVersion("generation", "1") if not _local(remote) else ObjectVersion.local(1, 4)
    with pytest.raises(PreconditionFailed):
        remote.set_attrs("f", PosixAttrs(mode=0o777), stale)
    assert _matches(remote.stat("f").posix, new, _local(remote))
    with pytest.raises(FileNotFoundError):
        remote.set_attrs("gone", new, None)


def test_rename_and_copy_keep_attrs(remote: Remote, tmp_path: Path) -> None:
    attrs = PosixAttrs(mode=0o640, mtime_ns=T2020, xattrs=(("user.k", b"v"),))
    remote.upload(_src(tmp_path), "a", ABSENT, attrs=attrs)
    remote.rename("a", "b")
    assert _matches(remote.stat("b").posix, attrs, _local(remote))
    if not _local(remote):
        remote.copy("b", "c")
        assert remote.stat("c").posix == attrs
    remote.make_dir("dir")
    remote.rename("b", "dir/b")
    remote.rename_tree("dir", "dir2")
    assert _matches(remote.stat("dir2/b").posix, attrs, _local(remote))


def test_list_carries_posix_only_where_the_listing_has_it(remote: Remote, tmp_path: Path) -> None:
    remote.upload(_src(tmp_path), "f", ABSENT, attrs=PosixAttrs(mode=0o600, xattrs=(("user.k", b"v"),)))
    remote.make_dir("d")
    entries = {i.name: i for i in remote.list("")}
    assert remote.lists_posix == _local(remote)
    if _local(remote):
        assert entries["f"].posix.mode == 0o600 and entries["f"].posix.xattrs == (("user.k", b"v"),)
        assert entries["d"].posix is not None and entries["d"].posix.mtime_ns == os.stat(remote.full("d")).st_mtime_ns
    else:
        # The LIST carries none: the directory record (remote/recorded.py) fills it in.
        assert entries["f"].posix == PosixAttrs(mode=0o600, xattrs=(("user.k", b"v"),))
        assert entries["d"].posix == NO_ATTRS
        assert remote.stat("f").posix.mode == 0o600


def test_read_small_and_put_small(remote: Remote) -> None:
    v1 = remote.put_small("r.json", b'{"v": 1}', ABSENT)
    data, version = remote.read_small("r.json")
    assert data == b'{"v": 1}' and (v1 is None or version == v1)
    with pytest.raises(PreconditionFailed):
        remote.put_small("r.json", b"x", ABSENT)
    v2 = remote.put_small("r.json", b'{"v": 2}', version)
    with pytest.raises(PreconditionFailed):
        remote.put_small("r.json", b"y", version)  # that version is gone
    data, version = remote.read_small("r.json")
    assert data == b'{"v": 2}' and (v2 is None or version == v2)
    with pytest.raises(FileNotFoundError):
        remote.read_small("nope")


@pytest.mark.core
def test_local_directories_and_stat_from_lstat(tmp_path: Path) -> None:
    root = tmp_path / "remote"
    root.mkdir()
    remote = Remote(str(root))
    remote.make_dir("d")
    attrs = PosixAttrs(mode=0o750, mtime_ns=T2020, xattrs=(("user.d", b"1"),))
    remote.set_dir_attrs("d", attrs)
    st = os.stat(root / "d")
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_mtime_ns == T2020
    assert os.getxattr(root / "d", "user.d") == b"1"
    info = remote.stat("d")
    assert info.is_dir and info.posix == PosixAttrs(mode=0o750, uid=st.st_uid, gid=st.st_gid, mtime_ns=T2020,
                                                    xattrs=(("user.d", b"1"),))
    # A file another tool chmod'ed shows it: the file is the truth.
    (root / "f").write_bytes(b"x")
    os.chmod(root / "f", 0o611)
    os.setxattr(root / "f", "user.tool", b"t")
    posix = remote.stat("f").posix
    assert posix.mode == 0o611 and posix.xattrs == (("user.tool", b"t"),)
    # set_attrs replaces the user.* xattrs as a whole.
    remote.set_attrs("f", PosixAttrs(xattrs=(("user.new", b"n"),)), None)
    assert [n for n in os.listxattr(root / "f") if n.startswith("user.")] == ["user.new"]
    with pytest.raises(NotADirectoryError):
        remote.set_dir_attrs("f", attrs)


@pytest.mark.core
def test_memory_directories_are_the_records_and_plain_writes_carry_nothing() -> None:
    remote = Remote(f"memory://t-{uuid.uuid4().hex}")
    remote.fs.mkdir(remote.root)
    with pytest.raises(NotImplementedError):
        remote.set_dir_attrs("", NO_ATTRS)
    remote.fs.pipe_file(remote.full("f"), b"x")  # another writer
    assert remote.stat("f").posix == NO_ATTRS
    remote.set_attrs("f", PosixAttrs(uid=5), None)
    remote.fs.pipe_file(remote.full("f"), b"y")  # rewritten by a plain PUT: its metadata is gone
    assert remote.stat("f").posix == NO_ATTRS


@pytest.mark.core
def test_generic_fsspec_keeps_no_posix_metadata(tmp_path: Path) -> None:
    remote = GenericRemote(f"memory://t-{uuid.uuid4().hex}")
    remote.fs.mkdir(remote.root)
    remote.fs.pipe_file(remote.full("f"), b"x")
    assert remote.stat("f").posix == NO_ATTRS and not remote.stores_posix
    with pytest.raises(FsError) as err:
        remote.set_attrs("f", PosixAttrs(mode=0o600), None)
    assert err.value.errno == errno.ENOTSUP
    with pytest.raises(FsError):
        remote.upload(_src(tmp_path), "g", None, attrs=PosixAttrs(mode=0o600))
    assert not remote.fs.exists(remote.full("g"))  # nothing written
    remote.upload(_src(tmp_path), "g", None, attrs=NO_ATTRS)  # empty attrs: a plain upload
    assert [i.posix for i in remote.list("")] == [None, None]


# -- S3 (SeaweedFS) and GCS (fake-gcs-server) ------------------------------------------------------
MiB = 1 << 20


@pytest.fixture(params=["s3", "gcs"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[Remote, Any, str]]:
    """(a Remote of a fresh prefix with 5 MiB parts, a direct fsspec client, the prefix's path)."""
    from marinfs.remote import RemoteSettings

    url, options, _ = object_store(request, request.param)
    remote = Remote(url, options, RemoteSettings(upload_part_size=5 * MiB))
    client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    try:
        yield remote, client, root
    finally:
        remote.close()


def raw_metadata(remote: Remote, client: Any, path: str) -> dict[str, str]:
    """The object's user/custom metadata as the store holds it (another client's view)."""
    if remote.protocol.startswith("s3"):
        bucket, key = path.split("/", 1)
        return dict(client.call_s3("head_object", Bucket=bucket, Key=key).get("Metadata") or {})
    return dict(client.info(path).get("metadata") or {})


def put_raw(remote: Remote, client: Any, path: str, data: bytes, metadata: dict[str, str],
            content_type: str = "text/plain") -> None:
    """Write an object the way another tool would, with its own metadata."""
    if remote.protocol.startswith("s3"):
        bucket, key = path.split("/", 1)
        client.call_s3("put_object", Bucket=bucket, Key=key, Body=data, Metadata=metadata, ContentType=content_type)
    else:
        client.pipe_file(path, data, metadata=metadata, content_type=content_type)


def record_gcs(remote: Remote) -> list[tuple[str, dict[str, Any]]]:
    """Every GCS request the remote sends from now on, as (method, its keyword arguments):
    fake-gcs-server ignores preconditions (ifGenerationMatch, ifMetagenerationMatch) and keeps
    a key PATCHed to null as "" instead of removing it, so those are checked as asked."""
    seen: list[tuple[str, dict[str, Any]]] = []
    request = remote.fs._request

    async def recording(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((method.upper(), kwargs))
        return await request(method, path, *args, **kwargs)

    remote.fs._request = recording
    return seen


def content_type(remote: Remote, client: Any, path: str) -> str | None:
    if remote.protocol.startswith("s3"):
        bucket, key = path.split("/", 1)
        return client.call_s3("head_object", Bucket=bucket, Key=key).get("ContentType")
    return client.info(path).get("contentType")


@pytest.mark.parametrize("size", [11, 6 * MiB], ids=["put", "parts"])
def test_store_upload_with_attrs_writes_the_other_tools_keys(store: Any, tmp_path: Path, size: int) -> None:
    remote, client, root = store
    data = os.urandom(size)
    version = remote.upload(_src(tmp_path, data), "f", ABSENT, attrs=FULL)
    info = remote.stat("f")
    assert info.posix == FULL and info.version == version
    raw = raw_metadata(remote, client, f"{root}/f")
    if remote.protocol.startswith("s3"):
        assert raw["mode"] == str(stat.S_IFREG | 0o4750) and raw["mtime"] == "1577923200.123456789"
        assert raw["uid"] == "1234" and raw["gid"] == "5678" and set(raw) == {"mode", "uid", "gid", "mtime", "xattr"}
    else:
        assert raw["gcsfuse_mtime"] == "2020-01-02T00:00:00.123456789Z" and raw["goog-reserved-posix-mode"] == "4750"
        assert raw["goog-reserved-file-mtime"] == "1577923200" and raw["goog-reserved-posix-uid"] == "1234"
    assert pm.decode_xattrs(raw["xattr"]) == dict(FULL.xattrs)
    assert client.cat_file(f"{root}/f") == data
    # No attrs: no metadata at all, as before.
    remote.upload(_src(tmp_path, data), "plain", ABSENT)
    assert raw_metadata(remote, client, f"{root}/plain") == {} and remote.stat("plain").posix == NO_ATTRS


def test_store_set_attrs_is_metadata_only_and_conditional(store: Any, tmp_path: Path) -> None:
    remote, client, root = store
    s3 = remote.protocol.startswith("s3")
    put_raw(remote, client, f"{root}/f", b"the bytes", {"custom": "kept", "mode": "33188"})
    before = remote.stat("f")
    assert before.posix == PosixAttrs(mode=0o644)
    _quiet(remote)
    remote.stats.reset()
    sent = [] if s3 else record_gcs(remote)
    new = PosixAttrs(mode=0o600, uid=42, mtime_ns=T2020, xattrs=(("user.k", b"v"),))
    after = remote.set_attrs("f", new, before.version)
    counts = remote.stats.snapshot()["requests"]
    assert counts == ({"copy": 1} if s3 else {"patch": 1}), counts  # the stat's HEAD/GET was reused
    if not s3:
        (method, kwargs), = sent
        assert method == "PATCH" and kwargs["ifGenerationMatch"] == before.version.value
        assert kwargs["ifMetagenerationMatch"] and kwargs["json"]["metadata"]["mode"] == "100600"  # rclone's, rewritten
    assert remote.stats.bytes_out == 0
    info = remote.stat("f")
    assert info.posix == new and info.version == after
    if not s3:
        assert after == before.version  # the generation stays: cached chunks stay valid
    raw = raw_metadata(remote, client, f"{root}/f")
    assert raw["custom"] == "kept" and content_type(remote, client, f"{root}/f") == "text/plain"
    assert client.cat_file(f"{root}/f") == b"the bytes"

    # Without a recent stat: one HEAD/GET more. Fields now unset are removed.
    remote._heads.clear() if s3 else remote._seen.clear()
    remote.stats.reset()
    again = remote.set_attrs("f", PosixAttrs(mode=0o640), after)
    counts = remote.stats.snapshot()["requests"]
    assert counts == ({"head": 1, "copy": 1} if s3 else {"head": 1, "patch": 1}), counts
    assert remote.stat("f").posix == PosixAttrs(mode=0o640)
    assert raw_metadata(remote, client, f"{root}/f").get("custom") == "kept"

    # A stale version: PreconditionFailed, nothing changed. (fake-gcs-server would let a PATCH
    # with a stale ifGenerationMatch through: forget what the stat saw, so the GET tells.)
    remote.fs.pipe_file(f"{remote.root}/f", b"other bytes")  # another writer
    if not s3:
        remote._seen.clear()
    for stale in (again, before.version):
        with pytest.raises(PreconditionFailed):
            remote.set_attrs("f", PosixAttrs(mode=0o777), stale)
    assert remote.stat("f").posix == NO_ATTRS and client.cat_file(f"{root}/f") == b"other bytes"
    with pytest.raises(FileNotFoundError):
        remote.set_attrs("gone", new, None)
    with pytest.raises(NotImplementedError):
        remote.set_dir_attrs("", new)


def test_store_list_carries_posix_on_gcs_only(store: Any, tmp_path: Path) -> None:
    remote, client, root = store
    remote.upload(_src(tmp_path), "d/f", ABSENT, attrs=PosixAttrs(mode=0o600, uid=7))
    entries = {i.name: i for i in remote.list("d")}
    if remote.protocol.startswith("s3"):
        # The LIST carries none: the directory record (remote/recorded.py) fills it in.
        assert not remote.lists_posix and entries["d/f"].posix == PosixAttrs(mode=0o600, uid=7)
    else:
        assert remote.lists_posix and entries["d/f"].posix == PosixAttrs(mode=0o600, uid=7)


def test_store_rename_and_rename_tree_keep_attrs(store: Any, tmp_path: Path) -> None:
    remote, client, root = store
    attrs = PosixAttrs(mode=0o640, mtime_ns=T2020, xattrs=(("user.k", b"v"),))
    remote.upload(_src(tmp_path), "a", ABSENT, attrs=attrs)
    remote.rename("a", "b")
    assert remote.stat("b").posix == attrs
    remote.upload(_src(tmp_path), "t/x", ABSENT, attrs=attrs)
    remote.rename_tree("t", "u")
    assert remote.stat("u/x").posix == attrs


def test_store_reads_what_s3fs_fuse_rclone_gcsfuse_and_gsutil_wrote(store: Any) -> None:
    remote, client, root = store
    if remote.protocol.startswith("s3"):
        xattr = quote('{"user.mime":"dGV4dA=="}', safe="")
        put_raw(remote, client, f"{root}/s3fs", b"x", {"mode": "33261", "uid": "1000", "gid": "1000",
                                                      "mtime": "1577923200", "xattr": xattr})
        put_raw(remote, client, f"{root}/rclone", b"x", {"mtime": "1577923200.5", "mode": "100600"})
        assert remote.stat("s3fs").posix == PosixAttrs(mode=0o755, uid=1000, gid=1000, mtime_ns=T2020,
                                                       xattrs=(("user.mime", b"text"),))
        assert remote.stat("rclone").posix == PosixAttrs(mode=0o600, mtime_ns=T2020 + 500_000_000)
    else:
        put_raw(remote, client, f"{root}/gcsfuse", b"x", {"gcsfuse_mtime": "2020-01-02T00:00:00.25Z"})
        put_raw(remote, client, f"{root}/gsutil", b"x", {"goog-reserved-file-mtime": "1577923200",
                                                        "goog-reserved-posix-mode": "750",
                                                        "goog-reserved-posix-uid": "3"})
        put_raw(remote, client, f"{root}/rclone", b"x", {"mtime": "2020-01-02T00:00:00Z", "mode": "100644"})
        assert remote.stat("gcsfuse").posix == PosixAttrs(mtime_ns=T2020 + 250_000_000)
        assert remote.stat("gsutil").posix == PosixAttrs(mode=0o750, uid=3, mtime_ns=T2020)
        assert remote.stat("rclone").posix == PosixAttrs(mode=0o644, mtime_ns=T2020)
        # A patch rewrites rclone's keys in rclone's format, so rclone sees the new values too.
        remote.set_attrs("rclone", PosixAttrs(mode=0o600), None)
        raw = raw_metadata(remote, client, f"{root}/rclone")
        assert raw.get("mode") == "100600" and raw.get("mtime") in (None, "")  # fake-gcs keeps a removed key as ""
        assert remote.stat("rclone").posix == PosixAttrs(mode=0o600)


def test_store_read_small_and_put_small(store: Any) -> None:
    remote, client, root = store
    s3 = remote.protocol.startswith("s3")
    sent = [] if s3 else record_gcs(remote)
    v1 = remote.put_small("d/.rec", b"one", ABSENT)
    remote.stats.reset()
    assert remote.read_small("d/.rec") == (b"one", v1)
    assert remote.stats.snapshot()["requests"] == {"get": 1}  # body and version from one GET
    if s3:  # (fake-gcs-server ignores ifGenerationMatch: what was asked is checked below)
        with pytest.raises(PreconditionFailed):
            remote.put_small("d/.rec", b"two", ABSENT)
    remote.stats.reset()
    v2 = remote.put_small("d/.rec", b"two", v1)
    assert remote.stats.snapshot()["requests"] == {"put": 1}
    if s3:
        with pytest.raises(PreconditionFailed):
            remote.put_small("d/.rec", b"three", v1)
    else:
        puts = [kw.get("ifGenerationMatch") for method, kw in sent if method == "POST"]
        assert puts == ["0", v1.value]
    assert remote.read_small("d/.rec") == (b"two", v2)
    with pytest.raises(FileNotFoundError):
        remote.read_small("d/nothing")


@pytest.mark.objectstore
@pytest.mark.parametrize("direct", ["1", "0"], ids=["presigned", "s3fs"])
def test_s3_put_metadata_is_signed_into_the_presigned_url_or_sent_by_s3fs(request: pytest.FixtureRequest,
                                                                       tmp_path: Path, direct: str) -> None:
    url, options, _ = object_store(request, "s3")
    remote = Remote(url, options, RemoteSettings(direct_get=direct == "1"))  # MARINFS_DIRECT_GET=direct
    assert (remote._direct is not None) == (direct == "1")
    remote.upload(_src(tmp_path), "f", ABSENT, attrs=FULL)
    assert not remote._direct_refused  # a signature mismatch would be a 403, then s3fs's PUT
    assert remote.stat("f").posix == FULL
    remote.close()


@pytest.mark.objectstore
def test_s3_past_the_copy_limit_set_attrs_and_copy_are_multipart_copies(request: pytest.FixtureRequest,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from marinfs.remote import S3Remote

    url, options, _ = object_store(request, "s3")
    remote = Remote(url, options)
    monkeypatch.setattr(S3Remote, "copy_limit", 4 * MiB)
    monkeypatch.setattr(S3Remote, "copy_part_size", 5 * MiB)
    data = os.urandom(12 * MiB)
    version = remote.upload(_src(tmp_path, data), "big", ABSENT, attrs=PosixAttrs(mode=0o600))
    _quiet(remote)
    remote.stats.reset()
    after = remote.set_attrs("big", PosixAttrs(mode=0o640, uid=3), version)
    counts = remote.stats.snapshot()["requests"]
    assert counts.get("copy", 0) == 0 and counts["part"] == 5 and "put" not in counts, counts  # create, 3 parts, complete
    info = remote.stat("big")
    assert info.posix == PosixAttrs(mode=0o640, uid=3) and info.version == after
    assert remote.read_range("big", 0, len(data)) == data
    remote.rename("big", "big2")
    assert remote.stat("big2").posix == PosixAttrs(mode=0o640, uid=3)
    assert remote.read_range("big2", 0, len(data)) == data
    with pytest.raises(PreconditionFailed):
        remote.set_attrs("big2", NO_ATTRS, version)
    remote.close()


def test_a_memory_listing_that_meets_a_concurrent_write_is_asked_again() -> None:
    """fsspec's memory store is one dict for the process: a walk iterating it while another
    thread commits failed with 'dictionary changed size during iteration' (a rename was EIO)."""
    remote = Remote(f"memory://t-{uuid.uuid4().hex}")
    assert isinstance(remote, MemoryRemote)
    remote.fs.pipe_file(remote.full("d/a"), b"x")
    real, calls = remote.fs.find, []

    def racing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("dictionary changed size during iteration")
        return real(*args, **kwargs)

    remote.fs.find = racing  # type: ignore[method-assign]
    try:
        files, _, _ = remote.walk("d")
        assert list(files) == ["d/a"] and len(calls) == 2
        remote.fs.find = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("another bug"))  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="another bug"):
            remote.walk("d")  # (any other error is not retried)
    finally:
        remote.fs.find = real  # type: ignore[method-assign]
        remote.fs.rm(remote.root, recursive=True)
