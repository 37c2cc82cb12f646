"""Bad input: odd flags and values, odd names, keys that are not POSIX names, huge directories,
empty and huge files. Never a crash, never a hang: an errno or a documented presentation
(docs/reliability.md has the table)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from marinfs import cli
from mounting import MARINFS, force_unmount


# -- flags and values ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [
    ["--chunk-size", "1K"], ["--chunk-size", "2G"], ["--chunk-size", "lots"], ["--cache-size", "-5"],
    ["--cache-min-free", "1Q"], ["--retries", "0"], ["--retries", "many"], ["--metrics-port", "70000"],
    ["--metrics-port", "-1"], ["--uid", "-1"], ["--gid", "x"], ["--file-mode", "10000"],
    ["--dir-mode", "rwx"], ["--log-level", "loud"], ["--prefetch-workers", "0"], ["--read-ahead-kb", "-1"],
    ["--metadata-ttl", "nan"], ["--negative-ttl", "-0.1"], ["--list-ttl", "nan"],
    ["--connect-timeout", "nan"], ["--read-timeout", "-1"], ["--mount-timeout", "nan"],
    ["-o", "=value"], ["-o", "novalue"], ["--unknown-flag"], ["extra", "positional"],
])
def test_bad_mount_flags_are_one_line_and_exit_2(flags: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "remote").mkdir()
    (tmp_path / "mnt").mkdir()
    try:
        code = cli.main(["mount", str(tmp_path / "remote"), str(tmp_path / "mnt"), "--cache-dir",
                         str(tmp_path / "cache"), *flags])
    finally:
        if os.path.ismount(tmp_path / "mnt"):  # accepted after all: never leave it mounted
            subprocess.run([*MARINFS, "umount", str(tmp_path / "mnt")], capture_output=True, timeout=60)
            force_unmount(tmp_path / "mnt")
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("marinfs: error: ") and "Traceback" not in err
    assert not os.path.ismount(tmp_path / "mnt")
