"""A copy that carries new POSIX attributes in the request that copies (Remote.copy and
rename with ``attrs=``): S3 CopyObject with MetadataDirective=REPLACE, a GCS rewrite given the
copy's metadata, memory:// under the keys' locks; pinned to the source's version."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from marinfs.remote import Remote

T0 = 1_600_000_000 * 10**9


@pytest.fixture(params=["memory", "s3", "gcs"])
def folding(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    from conftest import object_store

    if request.param == "memory":
        url, options = f"memory://fold-{uuid.uuid4().hex}", {}
    else:
        url, options, _ = object_store(request, request.param)
    remote = Remote(url, options)
    try:
        yield remote
    finally:
        remote.close()


def test_a_rename_whose_copy_carries_attributes_keeps_the_rest_and_is_pinned(folding: Remote,
                                                                             tmp_path: Path) -> None:
    """Remote.rename(..., attrs=, expect=): one copy gives the new name the attributes, the
    object's other metadata as it was (a tool's own key, S3's and GCS's content type); a source
    that is not ``expect`` is PreconditionFailed with both names as they were."""
    from marinfs.errors import PreconditionFailed
    from marinfs.objects import PosixAttrs

    remote = folding
    assert remote.folds_attrs
    local = tmp_path / "bytes"
    local.write_bytes(b"payload")
    version = remote.upload(str(local), "src", attrs=PosixAttrs(mode=0o600))
    assert version is not None
    if remote.protocol in ("s3", "s3a"):  # another tool's metadata and headers, kept by the copy
        bucket, key, _ = remote.fs.split_path(remote.full("tagged"))
        remote.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"tagged", ContentType="text/x-mine",
                          Metadata={"origin": "other-tool", "mode": "33152"})
        tagged = remote.stat("tagged").version
    elif remote.protocol in ("gs", "gcs"):
        remote.fs.pipe_file(remote.full("tagged"), b"tagged", content_type="text/x-mine",
                            metadata={"origin": "other-tool", "goog-reserved-posix-mode": "600"})
        tagged = remote.stat("tagged").version
    else:
        tagged = None
    new = PosixAttrs(mode=0o640, mtime_ns=T0, xattrs=(("user.k", b"v"),))
    remote.stats.reset()
    copies = remote.rename("src", "dst", attrs=new, expect=version)
    assert remote.stats.snapshot()["requests"].get("copy") == 1
    assert [c.old for c in copies] == [version] and copies[0].new is not None
    assert remote.stat("dst").posix == new and remote.read_range("dst", 0, 7) == b"payload"
    assert not remote.fs.exists(remote.full("src"))
    local.write_bytes(b"other bytes")
    remote.upload(str(local), "changed")
    with pytest.raises(PreconditionFailed):  # "changed" is not the version the attributes were set on
        remote.rename("changed", "elsewhere", attrs=PosixAttrs(mode=0o700), expect=version)
    assert remote.stat("changed").posix.mode is None and not remote.fs.exists(remote.full("elsewhere"))
    if tagged is not None:
        remote.rename("tagged", "tagged2", attrs=PosixAttrs(mode=0o644), expect=tagged)
        info = remote.fs.info(remote.full("tagged2"))
        meta = {k.lower(): v for k, v in (info.get("Metadata") or info.get("metadata") or {}).items()}
        if not meta and remote.protocol in ("s3", "s3a"):
            bucket, key, _ = remote.fs.split_path(remote.full("tagged2"))
            head = remote.fs.call_s3("head_object", Bucket=bucket, Key=key)
            meta, ctype = {k.lower(): v for k, v in head["Metadata"].items()}, head.get("ContentType")
        else:
            ctype = info.get("ContentType") or info.get("contentType")
        assert meta.get("origin") == "other-tool" and ctype == "text/x-mine", info
        assert remote.stat("tagged2").posix.mode == 0o644


@pytest.mark.parametrize("remote", ["local"], indirect=True)
def test_a_local_rename_carries_no_attributes(remote: Remote) -> None:
    from marinfs.objects import PosixAttrs

    assert not remote.folds_attrs
    remote.fs.pipe_file(remote.full("a"), b"x")
    with pytest.raises(OSError):
        remote.rename("a", "b", attrs=PosixAttrs(mode=0o600), expect=remote.stat("a").version)
    assert remote.fs.exists(remote.full("a"))
