"""Cache directories: each mount with default settings has its own (named after its remote and
mountpoint), so two mounts on one node work side by side; an explicit one is one daemon's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mounting import MARINFS, subprocess_mount

from marinfs.app.cachecli import only_cache_under
from marinfs.config.mount import MountConfig, cache_root, default_cache_dir
from marinfs.errors import UsageError


def test_the_default_cache_dir_is_per_remote_and_mountpoint() -> None:
    a = default_cache_dir("s3://a", "/mnt/marin")
    assert a == default_cache_dir("s3://a", "/mnt/marin")  # a restart finds its cache and staging again
    others = {default_cache_dir("gs://b", "/mnt/marin"), default_cache_dir("s3://a", "/mnt/other"),
              default_cache_dir("s3://a/p", "/mnt/marin"), a}
    assert len(others) == 4
    assert all(d.parent == cache_root() for d in others)
    assert a.name.startswith("s3_a_mnt_marin-")  # readable in `ls /var/cache/marinfs`
    long = default_cache_dir("s3://" + "b" * 300, "/mnt/" + "m" * 300)
    assert len(long.name) < 100
    assert MountConfig(remote="s3://a", mountpoint="/mnt/marin").cache_dir == a
    assert MountConfig(remote="s3://a", mountpoint="/mnt/marin", cache_dir=Path("/x")).cache_dir == Path("/x")


def test_cache_commands_without_cache_dir_take_the_only_one(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no marinfs cache directory"):
        only_cache_under(tmp_path)
    one = tmp_path / "s3_a_mnt-0123"
    one.mkdir()
    (one / "lock").touch()
    (tmp_path / "not-a-cache").mkdir()
    assert only_cache_under(tmp_path) == one
    two = tmp_path / "gs_b_mnt-4567"
    two.mkdir()
    (two / "lock").touch()
    with pytest.raises(UsageError, match="2 cache directories .* give --cache-dir"):
        only_cache_under(tmp_path)


@pytest.mark.mount
def test_two_mounts_with_default_settings_each_get_their_own_cache(tmp_path: Path) -> None:
    """Two daemons, no --cache-dir: both mount, each with its own cache directory; before,
    the second refused ("cache directory ... is in use by marinfs PID ...")."""
    remotes, mounts = [tmp_path / "ra", tmp_path / "rb"], [tmp_path / "ma", tmp_path / "mb"]
    dirs = [default_cache_dir(str(r), str(m)) for r, m in zip(remotes, mounts)]
    for r in remotes:
        r.mkdir()
        (r / "f").write_text(r.name)
    try:
        with subprocess_mount(str(remotes[0]), mounts[0], None) as pid_a, \
                subprocess_mount(str(remotes[1]), mounts[1], None) as pid_b:
            assert pid_a != pid_b
            assert [(m / "f").read_text() for m in mounts] == ["ra", "rb"]
            (mounts[1] / "g").write_text("written")
            for m, d in zip(mounts, dirs):
                status = json.loads(subprocess.run([*MARINFS, "status", str(m), "--json"], capture_output=True,
                                                   text=True, check=True).stdout)
                assert status[0]["settings"]["cache_dir"] == str(d), status
        assert (remotes[1] / "g").read_text() == "written"
        assert all((d / "lock").exists() for d in dirs)
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.mount
def test_an_explicit_cache_dir_belongs_to_one_daemon(tmp_path: Path) -> None:
    for r in ("ra", "rb"):
        (tmp_path / r).mkdir()
    cache = tmp_path / "cache"
    with subprocess_mount(str(tmp_path / "ra"), tmp_path / "ma", cache, "--cache-size", "0"):
        (tmp_path / "mb").mkdir()
        second = subprocess.run([*MARINFS, "mount", str(tmp_path / "rb"), str(tmp_path / "mb"),
                                 "--cache-dir", str(cache)], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and second.stderr.count("\n") == 1, second.stderr
        assert "is in use by marinfs PID" in second.stderr and "Traceback" not in second.stderr
        assert not os.path.ismount(tmp_path / "mb")
