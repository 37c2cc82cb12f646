"""Staging files made ahead of the creates that take them (marinfs/write/spares.py): a create
takes one instead of making two files under the mount's lock, and nothing of them outlives the
daemon: its close deletes them, the next start sweeps what a killed one left."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

import marinfs.write.staging as staging
from marinfs.core import Filesystem
from marinfs.remote import Remote
from marinfs.write.recovery import recover
from marinfs.write.spares import Spares, make, sweep
from marinfs.write.staging import JOURNAL_SUFFIX, StagedFile
from mounting import staging_entries
import tiers


def ready(spares: Spares, count: int = 1) -> None:
    """Wait until ``count`` spares are made (the first take starts the thread)."""
    deadline = time.monotonic() + 10
    while len(spares._ready) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(spares._ready) >= count


@tiers.needs("unit")
def test_a_spare_is_an_empty_private_file_with_an_empty_journal_and_close_deletes_those_left(tmp_path: Path) -> None:
    spares = Spares(tmp_path / "staging", keep=4)
    try:
        assert spares.take() is None  # none made before the first ask: a mount that never writes makes none
        ready(spares, 4)
        fd, path = spares.take()
        assert os.fstat(fd).st_size == 0 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.path.getsize(path + JOURNAL_SUFFIX) == 0
        os.write(fd, b"mine")
        os.close(fd)
        for _ in range(2):
            taken_fd, taken = spares.take()
            os.close(taken_fd)
            os.unlink(taken)
            os.unlink(taken + JOURNAL_SUFFIX)
        ready(spares, 4)  # (below half of them: made again)
    finally:
        spares.close()
    assert sorted(os.listdir(tmp_path / "staging")) == sorted([os.path.basename(path), os.path.basename(path) + JOURNAL_SUFFIX])
    assert spares.take() is None  # (closed: the creates make their own)


@tiers.needs("unit")
def test_a_staged_file_made_from_a_spare_journals_in_it_and_is_recovered(tmp_path: Path, remote: Remote) -> None:
    spare = make(tmp_path / "staging")
    staged = StagedFile(tmp_path / "staging", "k", seed=None, dirty=True, remote_url=remote.url, spare=spare)
    assert staged.path == spare[1]
    staged.write(b"abc", 0)
    assert json.loads(Path(staged.journal_path).read_text())["key"] == "k"
    assert [r.committed_as for r in recover(tmp_path / "staging", remote)] == ["k"]  # (as a killed daemon's)
    assert remote.fs.cat_file(remote.full("k")) == b"abc"
    staged.discard()
    assert os.listdir(tmp_path / "staging") == []


@tiers.needs("unit")
def test_recovery_passes_over_empty_journals_and_a_start_sweeps_only_what_no_journal_describes(
        tmp_path: Path, remote: Remote) -> None:
    d = tmp_path / "staging"
    spare_fd, spare = make(d)  # a spare a killed daemon left
    os.close(spare_fd)
    real = StagedFile(d, "real", seed=None, dirty=True, remote_url=remote.url)
    real.write(b"bytes", 0)  # journaled: kept
    unwritten = d / "staged-unwritten1"  # opened for write, never written, no journal
    unwritten.write_bytes(b"")
    (d / ("staged-half" + JOURNAL_SUFFIX + ".tmp")).write_text("{")  # a journal's temporary
    (d / "rename-x.json").write_text("{}")  # not a staged file's: left alone
    assert recover(d, remote, skip=frozenset({real.path})) == []  # a live spare: no error, nothing sent
    assert sweep(d) == 4
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [os.path.basename(real.path), os.path.basename(real.journal_path), "rename-x.json"])


@tiers.needs("unit")
def test_creates_take_spares_and_a_new_daemon_sweeps_those_a_killed_one_left(
        tmp_path: Path, remote: Remote, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = Filesystem(remote, staging_dir=tmp_path / "staging")
    made = []
    real_mkstemp = staging.tempfile.mkstemp
    monkeypatch.setattr(staging.tempfile, "mkstemp", lambda *a, **k: made.append(1) or real_mkstemp(*a, **k))
    opened = fs.create("/warm", os.O_WRONLY)
    fs.release(opened.fh)
    ready(fs.writes.spares, 16)
    made.clear()
    for i in range(10):
        opened = fs.create(f"/f{i}", os.O_WRONLY)
        fs.write(opened.fh, b"x%d" % i, 0)
        fs.release(opened.fh)
    assert made == []  # every create took a spare
    assert [remote.fs.cat_file(remote.full(f"f{i}")) for i in range(10)] == [b"x%d" % i for i in range(10)]
    assert staging_entries(tmp_path / "staging") == [] and len(os.listdir(tmp_path / "staging")) > 0
    # Killed (no close): its spares stay on disk; the next daemon's start deletes them.
    fs.writes.spares._stopping = True
    again = Filesystem(remote, staging_dir=tmp_path / "staging")
    assert again.recover_staged(at_start=True) == []
    assert os.listdir(tmp_path / "staging") == []
    again.close()
