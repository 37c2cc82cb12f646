"""Every setting of the table reaches a running daemon by each route it may come by.

One mount per route (flags, a TOML file, MARINFS_* variables, fstab options through the mount
helper, the background start that re-executes a child), each with every setting that route may
carry set to a value that is not its default; the daemon's effective settings, read back with
``marinfs status --json``, must be exactly those values. How each route spells a setting is
written here, not taken from the code under test, so a route that drops or misreads one fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from marinfs.config.mount import SETTINGS
from marinfs.config.settings import CHILD, ENV, FLAG, FSTAB, TOML
from mounting import MARINFS, _stop_pid, daemon_pid, force_unmount

# How flags, variables and fstab options write a value when str() would not do.
TEXT = {"file_mode": "0600", "dir_mode": "0700", "chunk_size": "1M", "cache_size": "64M",
        "cache_min_free": "2M", "max_file_size": "1T"}


# The GLOBS settings: each flag given once per glob.
GLOBS_FLAGS = {"immutable": "--immutable", "commit_markers": "--commit-marker", "write_back_hold": "--write-back-hold",
               "write_back_paths": "--write-back-path"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(tmp: Path) -> dict[str, Any]:
    """A value for every setting that is not its default, as `status --json` shows it."""
    return {
        "remote": str(tmp / "remote"), "mountpoint": str(tmp / "mnt"), "foreground": True,
        "read_only": True, "allow_other": True, "allow_non_empty": True, "uid": 1234, "gid": 4321,
        "file_mode": 0o600, "dir_mode": 0o700, "log_level": "debug", "log_file": str(tmp / "daemon.log"),
        "cache_dir": str(tmp / "cache"), "metadata_ttl": 7.5, "negative_ttl": 2.5, "list_ttl": 3.5,
        "inode_ttl": 60.0,
        "immutable": ["ckpt/**", "*.bin"], "list_prefetch": False, "max_file_size": 1 << 40, "chunk_size": 1 << 20,
        "cache_size": 64 << 20, "cache_min_free": 2 << 20, "prefetch_workers": 3,
        "shared_cache_dir": str(tmp / "shared"), "shared_cache_size": 1 << 30, "shared_cache_lease": 2.5,
        "max_readahead_chunks": 5, "read_ahead_kb": 512, "passthrough": False, "metrics_port": free_port(),
        "metrics_addr": "127.0.0.2", "connect_timeout": 11.5, "read_timeout": 12.5, "retries": 3,
        "mount_timeout": 45.5, "drain_timeout": 100.5, "commit_retry_interval": 10.5,
        "write_back": True, "write_back_uploads": 4, "write_back_delay": 0.5, "commit_markers": ["**/DONE"],
        "write_back_hold": ["**/*.tmp/**"], "write_back_max_bytes": 1 << 30, "write_back_paths": ["ckpt/**", "*.bin"],
        # Only the names of storage options are published (they may hold credentials).
        "storage_options": {"auto_mkdir": True},
        # The read path's switches: a local remote has none of those paths, so they change nothing else.
        "direct_get": False, "obstore": False, "get": "obstore", "part_checksum": "md5", "fetch_into": False,
    }


def shown(name: str, value: Any) -> Any:
    return sorted(value) if name == "storage_options" else value


def text(name: str, value: Any) -> str:
    return TEXT.get(name, str(value))


def dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def on(route: str) -> list[str]:
    return [s.name for s in SETTINGS if s.allows(route)]


def flag_args(values: dict[str, Any], names: list[str]) -> list[str]:
    args = [values["remote"], values["mountpoint"]]
    for name in names:
        value = values[name]
        if name in ("remote", "mountpoint"):
            continue
        if isinstance(value, bool):
            args.append(dashed(name) if value else "--no-" + dashed(name)[2:])
        elif name in GLOBS_FLAGS:  # (GLOBS: the flag repeated)
            flag = GLOBS_FLAGS[name]
            args += [a for glob in value for a in (flag, glob)]
        elif name == "storage_options":
            args += [a for k, v in value.items() for a in ("-o", f"{k}={json.dumps(v)}")]
        else:
            args += [dashed(name), text(name, value)]
    return args


def toml_text(values: dict[str, Any], names: list[str]) -> str:
    lines, table = [], []
    for name in names:
        value = values[name]
        if name == "storage_options":
            table = ["[storage_options]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
        elif name in TEXT:
            lines.append(f'{name} = "{TEXT[name]}"')  # sizes and modes as strings, as people write them
        else:  # TOML's literals for these are JSON's
            lines.append(f"{name} = {json.dumps(value)}")
    return "\n".join(lines + table) + "\n"


def env_vars(values: dict[str, Any], names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        value = values[name]
        if isinstance(value, bool):
            out["MARINFS_" + name.upper()] = "true" if value else "false"
        elif name in GLOBS_FLAGS:
            out["MARINFS_" + name.upper()] = ",".join(value)
        elif name == "storage_options":
            out["MARINFS_STORAGE_OPTIONS"] = json.dumps(value)
        else:
            out["MARINFS_" + name.upper()] = text(name, value)
    return out


def fstab_options(values: dict[str, Any], names: list[str]) -> str:
    opts = []
    for name in names:
        value = values[name]
        if name in ("remote", "mountpoint"):
            continue
        if name == "read_only":
            opts.append("ro" if value else "rw")
        elif isinstance(value, bool):
            opts.append(name if value else f"no_{name}")
        else:
            opts.append(f"{name}={text(name, value)}")
    return ",".join(["_netdev", *opts])


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment without MARINFS_* settings a developer may have exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARINFS_") or k == "MARINFS_PYTHON"}
    return {**env, **extra}


def effective(mnt: Path) -> dict[str, Any]:
    out = subprocess.run([*MARINFS, "status", str(mnt), "--json"], capture_output=True, text=True,
                         timeout=60, env=clean_env())
    assert out.returncode == 0, out.stderr
    (item,) = json.loads(out.stdout)
    assert "settings" in item, f"the daemon publishes no settings: {item}"
    return item["settings"]


@contextlib.contextmanager
def started(command: list[str], mnt: Path, env: dict[str, str], foreground: bool) -> Iterator[None]:
    """Run a mount command; foreground ones stay our child, background ones return once live.
    Always unmounted afterwards, and only the daemon we started is stopped (by PID)."""
    proc = pid = None
    try:
        if foreground:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
            deadline = time.monotonic() + 60
            while not os.path.ismount(mnt) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if not os.path.ismount(mnt):
                proc.kill()
                pytest.fail(f"mount failed: {proc.communicate(timeout=30)[1]}")
            pid = proc.pid
        else:
            out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
            assert out.returncode == 0 and os.path.ismount(mnt), f"mount failed: {out.stderr}"
            pid = daemon_pid(mnt)
        yield
    finally:
        if os.path.ismount(mnt):
            subprocess.run([*MARINFS, "umount", str(mnt), "--timeout", "60"], capture_output=True,
                           timeout=120, env=clean_env())
        force_unmount(mnt)
        if proc is not None:
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=30)
        elif pid is not None:
            _stop_pid(pid)


@pytest.fixture
def values(tmp_path: Path) -> dict[str, Any]:
    if os.geteuid() != 0 and "user_allow_other" not in Path("/etc/fuse.conf").read_text(errors="replace"):
        pytest.skip("allow_other needs root or user_allow_other in /etc/fuse.conf")
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote/a.txt").write_text("a")
    (tmp_path / "mnt").mkdir()
    return samples(tmp_path)


def test_every_setting_has_a_sample_that_is_not_its_default(tmp_path: Path) -> None:
    """So a new setting fails here until the route tests below carry it."""
    values = samples(tmp_path)
    assert sorted(values) == sorted(s.name for s in SETTINGS)
    for s in SETTINGS:
        default = s.to_json(s.kind.freeze(s.default_value())) if not s.required else None
        assert shown(s.name, values[s.name]) != default, s.name


ROUTES = {
    # route: how its mount is started
    FLAG: "flags, in the foreground: the process that parses them is the daemon",
    TOML: "a --config file, in the foreground",
    ENV: "MARINFS_* variables, in the foreground",
    FSTAB: "mount.marinfs SOURCE MOUNTPOINT -o ..., which starts marinfs in the background",
    CHILD: "marinfs mount in the background (flags, and variables for what has no flag): the child gets "
           "its settings from us",
}


@pytest.mark.mount
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_setting_reaches_the_daemon(route: str, values: dict[str, Any], tmp_path: Path) -> None:
    names = on(route)
    mnt = Path(values["mountpoint"])
    env, foreground = clean_env(), route in (FLAG, TOML, ENV)
    if route in (FLAG, CHILD):
        flagged = [name for name in names if name in on(FLAG)]
        command = [*MARINFS, "mount", *flag_args(values, flagged)]
        command += ["--foreground"] if route == FLAG else []
        # What no flag carries (the read path's switches) comes by environment.
        env = clean_env(**env_vars(values, [name for name in names if name not in flagged]))
    elif route == TOML:
        config = tmp_path / "marinfs.toml"
        config.write_text(toml_text(values, names))
        command = [*MARINFS, "mount", "--config", str(config), "--foreground"]
    elif route == ENV:
        env = clean_env(**env_vars(values, names))
        command = [*MARINFS, "mount", "--foreground"]
    else:
        command = [sys.executable, "-m", "marinfs.app.mount_helper", values["remote"], str(mnt),
                   "-o", fstab_options(values, names)]
    want = {name: shown(name, values[name]) for name in names}
    if route in (FSTAB, CHILD):
        want["foreground"] = True  # the daemon itself always runs in the foreground
    with started(command, mnt, env, foreground):
        got = effective(mnt)
        assert {name: got.get(name) for name in want} == want
        # The settings took effect, not only their record: owner, modes and read-only.
        st = os.stat(mnt / "a.txt")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1234, 4321, 0o600)
        with pytest.raises(OSError):
            (mnt / "b.txt").write_text("b")


def test_the_child_command_reads_back_as_the_same_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mounting: the background child's argv and environment, parsed as the child
    parses them, give back exactly the parent's config, whatever MARINFS_* the parent had."""
    from marinfs.app.cli import _mount_config, build_parser
    from marinfs.config.mount import MountConfig
    from marinfs.app.daemon import child_command

    values = samples(tmp_path)
    values.pop("foreground")
    values["storage_options"] = (("auto_mkdir", True), ("token", "secret-value"))
    values["cache_dir"] = Path(values["cache_dir"])
    values["shared_cache_dir"] = Path(values["shared_cache_dir"])
    cfg = MountConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}).validate()
    argv, env = child_command(cfg, {"MARINFS_CACHE_SIZE": "1G", "MARINFS_PYTHON": "/bin/py", "PATH": "/bin"})
    assert env["MARINFS_PYTHON"] == "/bin/py" and "MARINFS_CACHE_SIZE" not in env  # ours are flags now
    assert "secret-value" not in " ".join(argv)  # storage options never on a command line
    for name in [k for k in os.environ if k.startswith("MARINFS_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert argv[1:4] == ["-m", "marinfs", "mount"]
    child = _mount_config(build_parser().parse_args(argv[3:]))
    assert child == MountConfig(**{**cfg.__dict__, "foreground": True})


READ_PATH = {  # MARINFS_<KEY>: a value that is not the default, one that is bad
    "MARINFS_DIRECT_GET": ("0", "maybe"), "MARINFS_OBSTORE": ("0", "2"), "MARINFS_GET": ("obstore", "boto"),
    "MARINFS_PART_CHECKSUM": ("md5", "sha1"), "MARINFS_FETCH_INTO": ("0", "no way"),
}


def test_the_read_path_switches_are_settings_of_the_environment_only() -> None:
    """MARINFS_DIRECT_GET, _OBSTORE, _GET, _PART_CHECKSUM and _FETCH_INTO are rows of the table
    read by the environment route (no flag, no file key, no fstab option), reach the remote
    through its RemoteSettings, and a bad value is one line that names the variable."""
    from marinfs.config import file as configfile
    from marinfs.config.mount import BY_NAME, MountConfig
    from marinfs.remote import RemoteSettings
    from marinfs.errors import UsageError

    for name in READ_PATH:
        s = BY_NAME[name.removeprefix("MARINFS_").lower()]
        assert s.env_name == name and s.routes == frozenset({ENV, CHILD}) and s.child_env
    got = configfile.from_env({name: good for name, (good, _) in READ_PATH.items()})
    assert got == {"direct_get": False, "obstore": False, "get": "obstore", "part_checksum": "md5",
                   "fetch_into": False}
    cfg = MountConfig(remote="/r", mountpoint="/m", **got).validate()
    assert cfg.remote_settings() == RemoteSettings(direct_get=False, obstore=False, get="obstore",
                                                   part_checksum="md5")
    assert RemoteSettings() == MountConfig(remote="/r", mountpoint="/m").remote_settings()
    assert (RemoteSettings().direct_get, RemoteSettings().obstore, RemoteSettings().get,
            RemoteSettings().part_checksum) == (True, True, "socket", "crc32c")  # today's defaults
    assert configfile.from_env({"MARINFS_GET": " OBSTORE ", "MARINFS_FETCH_INTO": "1"}) == {
        "get": "obstore", "fetch_into": True}
    for name, (_, bad) in READ_PATH.items():
        with pytest.raises(UsageError, match=f"^environment {name}: .*{bad!r}"):
            configfile.from_env({name: bad})
