"""The tier rule (tests/tiers.py) and the guard that keeps the fast tiers fast: a unit or core
test that tries to mount FUSE or start a server fails, whatever path it takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiers
from mounting import inprocess_mount, subprocess_mount
from servers import start_fake_gcs, start_seaweedfs
from tiers import TierError, tier_of


@pytest.mark.parametrize("explicit, needed, params, want", [
    ((), (), (), {"unit"}),
    ((), ("core",), ("local",), {"core"}),
    ((), ("core", "mount"), ("memory",), {"mount"}),  # conftest's remote, overridden by a mounting one
    ((), ("mount",), ("s3",), {"mount", "objectstore"}),
    ((), ("objectstore",), (), {"objectstore"}),
    (("mount",), (), ("local",), {"mount"}),
    (("mount",), (), ("gcs",), {"mount", "objectstore"}),
    (("core",), (), ("memory",), {"core"}),
    (("core",), (), ("s3",), {"objectstore"}),  # the light mark names the light variants only
    (("unit",), ("core",), (), {"unit"}),
    ((), (), ("s3://bucket/x", 3, None), {"unit"}),  # only the exact backend names select a server
])
def test_tier_rule(explicit: tuple[str, ...], needed: tuple[str, ...], params: tuple[object, ...],
                   want: set[str]) -> None:
    assert tier_of(explicit, needed, params) == want


@pytest.mark.parametrize("explicit", [("unit", "core"), ("core", "mount"), ("unit", "objectstore")])
def test_contradictory_marks_are_refused(explicit: tuple[str, ...]) -> None:
    with pytest.raises(TierError):
        tier_of(explicit, (), ())


def test_this_test_is_unit_and_guarded(request: pytest.FixtureRequest) -> None:
    assert [m.name for m in request.node.iter_markers() if m.name in tiers.TIERS] == ["unit"]
    assert tiers.refuse is not None
    assert os.environ["FUSE_LIBRARY_PATH"] == tiers.NO_FUSE


def test_a_fast_test_cannot_mount_or_start_a_server(tmp_path: Path) -> None:
    refused = pytest.fail.Exception
    with pytest.raises(refused, match="inprocess_mount"):
        with inprocess_mount(str(tmp_path), tmp_path / "mnt", tmp_path / "cache"):
            pass
    with pytest.raises(refused, match="subprocess_mount"):
        with subprocess_mount(str(tmp_path), tmp_path / "mnt", tmp_path / "cache"):
            pass
    with pytest.raises(refused, match="SeaweedFS"):
        start_seaweedfs(tmp_path / "s3")
    with pytest.raises(refused, match="fake-gcs-server"):
        start_fake_gcs(tmp_path / "gcs")
    for argv in (["mount", "-t", "tmpfs", "x", str(tmp_path)], ["/usr/bin/fusermount3", "-u", "x"], "weed mini"):
        with pytest.raises(refused, match="run "):
            subprocess.run(argv, shell=isinstance(argv, str), capture_output=True)
    assert not os.path.ismount(tmp_path / "mnt")


def test_a_daemon_started_by_a_fast_test_finds_no_libfuse() -> None:
    """A `marinfs mount` run by hand (not through the helpers) must fail, not mount."""
    child = subprocess.run([sys.executable, "-c", "import mfusepy"], capture_output=True, text=True)
    assert child.returncode != 0
    assert "marinfs-fast-tier-has-no-libfuse" in child.stderr or "No module named" in child.stderr


def test_other_programs_still_run() -> None:
    assert subprocess.run(["true"]).returncode == 0
    assert tiers.forbidden_program(["umount", "x"]) is None  # not mounting: `marinfs umount` tests
    assert tiers.forbidden_program([sys.executable, "-m", "marinfs", "path", "x"]) is None


def test_the_guard_outlives_the_tests_own_monkeypatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MARINFS_TIERS_PROBE", "1")
    monkeypatch.undo()
    with pytest.raises(pytest.fail.Exception, match="inprocess_mount"):
        with inprocess_mount(str(tmp_path), tmp_path / "mnt", tmp_path / "cache"):
            pass
    assert os.environ["FUSE_LIBRARY_PATH"] == tiers.NO_FUSE
