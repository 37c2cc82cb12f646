"""Operations: TOML config, sd_notify, the mount(8) helper and the systemd unit. No FUSE needed."""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from marinfs.config import file as configfile

from marinfs.app import mount_helper
from marinfs.errors import UsageError
from marinfs.app.notify import sd_notify

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "marinfs@.service"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(UsageError) as info:
        configfile.load_file(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


# --- configfile -----------------------------------------------------------------------------

def test_full_file_is_normalized(tmp_path: Path) -> None:
    path = write(tmp_path, """
remote = "gs://bucket//prefix/"
mountpoint = "mnt"
read_only = true
file_mode = "0640"
dir_mode = 0o750
cache_size = "200G"
cache_min_free = 1048576
chunk_size = "512M"
metadata_ttl = 5
log_level = "DEBUG"
immutable = ["checkpoints/**", "*.parquet"]
[storage_options]
project = "p"
client_kwargs = {endpoint_url = "http://x"}
""")
    cfg = configfile.load_file(path)
    assert cfg["remote"] == "gs://bucket/prefix"
    assert cfg["mountpoint"] == str(tmp_path / "mnt")  # relative to the file
    assert cfg["read_only"] is True
    assert (cfg["file_mode"], cfg["dir_mode"]) == (0o640, 0o750)
    assert cfg["cache_size"] == 200 << 30 and cfg["chunk_size"] == 512 << 20
    assert cfg["cache_min_free"] == 1 << 20
    assert cfg["metadata_ttl"] == 5.0 and isinstance(cfg["metadata_ttl"], float)
    assert cfg["log_level"] == "debug"
    assert cfg["immutable"] == ("checkpoints/**", "*.parquet")
    assert cfg["storage_options"] == {"project": "p", "client_kwargs": {"endpoint_url": "http://x"}}


def test_every_cli_key_is_known() -> None:
    """Every `marinfs mount` flag has a config key, and every key is a MountConfig field."""
    import dataclasses

    from marinfs.app.cli import build_parser
    from marinfs.config.mount import MountConfig

    mount = build_parser()._subparsers._group_actions[0].choices["mount"]  # noqa: SLF001
    flags = {a.dest for a in mount._actions} - {"help", "args", "config", "foreground", "storage_option"}
    assert flags <= set(configfile.KEYS), flags - set(configfile.KEYS)
    fields = {f.name for f in dataclasses.fields(MountConfig)}
    assert set(configfile.KEYS) <= fields, set(configfile.KEYS) - fields


def test_example_file_loads(tmp_path: Path) -> None:
    text = (ROOT / "systemd" / "marinfs.toml.example").read_text()
    # Uncomment every "# key = value" line: the documented defaults must all be valid.
    lines = [line[2:] if line.startswith("# ") and (" = " in line.split("#")[1] or line[2] == "[")
             else line for line in text.splitlines()]
    cfg = configfile.load_file(write(tmp_path, "\n".join(lines)))
    assert set(cfg) == set(configfile.KEYS)


@pytest.mark.parametrize("text, expected", [
    ('cache_sise = "1G"', "unknown key 'cache_sise' (did you mean 'cache_size'?)"),
    ("frobnicate = 1", "unknown key 'frobnicate'"),
    ('cache_size = "200X"', "cache_size: '200X' is not a size such as 512M or 200G"),
    ("metadata_ttl = -1", "metadata_ttl: must be >= 0 seconds, got -1"),
    ("negative_ttl = -0.5", "negative_ttl: must be >= 0 seconds"),
    ('read_only = "yes"', "read_only: expected true or false, got a string ('yes')"),
    ('retries = "3"', "retries: expected an integer, got a string ('3')"),
    ("retries = 0", "retries: must be >= 1, got 0"),
    ("uid = 1.5", "uid: expected an integer, got a number (1.5)"),
    ("file_mode = 644", 'file_mode: 644 is decimal (= 0o1204); write "0644" or 0o644'),
    ('dir_mode = "rwx"', "dir_mode: 'rwx' is not an octal mode"),
    ('log_level = "loud"', "log_level: 'loud' is not one of debug, info, warning, error"),
    ("immutable = \"*.bin\"", "immutable: expected a list of glob strings"),
    ('storage_options = "anon"', "storage_options: expected a table of fsspec options"),
    ("metrics_port = 70000", "metrics_port: 70000 is out of range (0..65535)"),
    ('remote = ""', "remote: expected a non-empty string"),
])
def test_bad_values(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text + "\n")
    assert error_of(path).startswith(f"{path}: {expected}")


def test_bad_toml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'remote = "gs://b"\ncache_size = 200G\n')
    message = error_of(path)
    assert message.startswith(f"{path}: bad TOML: ") and "line 2" in message


def test_missing_file(tmp_path: Path) -> None:
    assert "cannot read config" in error_of(tmp_path / "nope.toml")


def test_from_env() -> None:
    env = {"MARINFS_CACHE_SIZE": "200G", "MARINFS_READ_ONLY": "true", "MARINFS_ALLOW_OTHER": "0",
           "MARINFS_METADATA_TTL": "2.5", "MARINFS_UID": "1000", "MARINFS_FILE_MODE": "0600",
           "MARINFS_IMMUTABLE": "a/**,*.bin", "MARINFS_STORAGE_OPTIONS": '{"anon": true}',
           "MARINFS_PYTHON": "/usr/bin/python3", "PATH": "/bin"}
    assert configfile.from_env(env) == {
        "cache_size": 200 << 30, "read_only": True, "allow_other": False, "metadata_ttl": 2.5,
        "uid": 1000, "file_mode": 0o600, "immutable": ("a/**", "*.bin"),
        "storage_options": {"anon": True}}


@pytest.mark.parametrize("name, value, expected", [
    ("MARINFS_CACHE_SIZE", "200X", "environment MARINFS_CACHE_SIZE: cache_size: '200X' is not a size"),
    ("MARINFS_READ_ONLY", "maybe", "environment MARINFS_READ_ONLY: read_only: 'maybe' is not a boolean"),
    ("MARINFS_NEGATIVE_TTL", "-1", "environment MARINFS_NEGATIVE_TTL: negative_ttl: must be >= 0"),
    ("MARINFS_STORAGE_OPTIONS", "{bad", "environment MARINFS_STORAGE_OPTIONS: storage_options: not a JSON"),
])
def test_from_env_errors(name: str, value: str, expected: str) -> None:
    with pytest.raises(UsageError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        configfile.from_env({name: value})


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    file = configfile.load_file(write(tmp_path, """
remote = "gs://b/p"
cache_size = "1G"
chunk_size = "4M"
metadata_ttl = 9
[storage_options]
project = "p"
anon = false
"""))
    env = configfile.from_env({"MARINFS_CACHE_SIZE": "2G", "MARINFS_CHUNK_SIZE": "16M",
                               "MARINFS_STORAGE_OPTIONS": '{"anon": true}'})
    flags = {"cache_size": 3 << 30, "read_only": True, "log_file": None,
             "storage_options": {"token": "t"}}
    merged = configfile.merge(file, env, flags)
    assert merged["cache_size"] == 3 << 30          # flag beats env beats file
    assert merged["chunk_size"] == 16 << 20         # env beats file
    assert merged["metadata_ttl"] == 9.0            # file alone
    assert merged["read_only"] is True              # flag alone
    assert "log_file" not in merged                 # a None flag was not given
    assert merged["storage_options"] == {"project": "p", "anon": True, "token": "t"}
    assert configfile.merge({}, {}, {}) == {}


def test_check(tmp_path: Path) -> None:
    path = write(tmp_path, 'remote = "gs://bucket/x"\nmountpoint = "/mnt/marin"\nretries = 3\n')
    assert configfile.check(path) == "ok: 3 keys; remote gs://bucket/x, mountpoint /mnt/marin"
    with pytest.raises(UsageError, match="unknown key"):
        configfile.check(write(tmp_path, "nope = 1\n"))


# --- sd_notify ------------------------------------------------------------------------------

@pytest.fixture
def short_dir() -> Iterator[Path]:
    """AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="mfs-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_notify_path_socket(short_dir: Path) -> None:
    address = str(short_dir / "notify")
    with _receiver(address) as sock:
        assert sd_notify("READY=1\nSTATUS=mounted", {"NOTIFY_SOCKET": address})
        assert sock.recv(4096) == b"READY=1\nSTATUS=mounted"


def test_notify_abstract_socket() -> None:
    name = f"marinfs-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as sock:
        assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_unset_or_broken(short_dir: Path) -> None:
    assert sd_notify("READY=1", {}) is False
    assert sd_notify("READY=1", {"NOTIFY_SOCKET": ""}) is False
    assert sd_notify("READY=1", {"NOTIFY_SOCKET": str(short_dir / "nobody")}) is False


# --- mount helper ---------------------------------------------------------------------------

def fstab(line: str) -> list[str]:
    source, mountpoint, _type, options, *_ = line.split()
    return mount_helper.translate(source, mountpoint, options)


def test_translate_fstab_line() -> None:
    argv = fstab("gs://bucket/prefix /mnt/marin marinfs "
                 "_netdev,allow_other,cache_dir=/mnt/nvme/marinfs,cache_size=200G 0 0")
    assert argv == ["mount", "gs://bucket/prefix", "/mnt/marin",
                    "--cache-dir", "/mnt/nvme/marinfs", "--cache-size", "200G", "--allow-other"]


def test_translate_every_option() -> None:
    opts = ("defaults,nofail,noauto,user,users,rw,x-systemd.automount,x-systemd.idle-timeout=60,"
            "comment=hi,nodev,nosuid,noexec,exec,suid,dev,relatime,noatime,user=alice,"
            "ro,uid=1000,gid=1000,file_mode=0640,dir_mode=0750,cache_min_free=5G,chunk_size=16M,"
            "metadata_ttl=30,negative_ttl=2,config=/etc/marinfs/m.toml,log_file=/var/log/m.log,"
            "log_level=debug")
    assert mount_helper.translate("marinfs#s3://b", "/mnt/m", [opts]) == [
        "mount", "s3://b", "/mnt/m", "--uid", "1000", "--gid", "1000", "--file-mode", "0640",
        "--dir-mode", "0750", "--cache-min-free", "5G", "--chunk-size", "16M",
        "--metadata-ttl", "30", "--negative-ttl", "2", "--config", "/etc/marinfs/m.toml",
        "--log-file", "/var/log/m.log", "--log-level", "debug", "--read-only"]


def test_translate_ro_rw_last_wins_and_placeholder_source() -> None:
    assert mount_helper.translate("marinfs", "/m", "read_only,rw,config=/c.toml") == [
        "mount", "/m", "--config", "/c.toml"]
    assert mount_helper.translate("/data", "/m", ["rw", "ro"])[-1] == "--read-only"


@pytest.mark.parametrize("options, message", [
    ("cache_sise=1G", "unknown mount option 'cache_sise=1G'"),
    ("sync", "unknown mount option 'sync'"),
    ("cache_size", "option cache_size needs a value"),
    ("allow_other=1", "option allow_other takes no value"),
])
def test_translate_rejects(options: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        mount_helper.translate("gs://b", "/m", options)


def test_sloppy_reports_but_continues(capsys: pytest.CaptureFixture[str]) -> None:
    assert mount_helper.translate("gs://b", "/m", "sync", sloppy=True) == ["mount", "gs://b", "/m"]
    assert "ignoring unknown option 'sync'" in capsys.readouterr().err


def test_helper_main(capsys: pytest.CaptureFixture[str]) -> None:
    assert mount_helper.main(["gs://b", "/m", "-o", "bogus"]) == 1
    assert capsys.readouterr().err == "mount.marinfs: error: unknown mount option 'bogus'\n"
    assert mount_helper.main(["gs://b"]) == 1
    assert "usage:" in capsys.readouterr().err
    # -f (fake) with -v prints the command mount(8) would run, and runs nothing.
    assert mount_helper.main(["gs://b", "/m", "-o", "_netdev,ro", "-n", "-fv"]) == 0
    assert capsys.readouterr().err.strip().endswith("-m marinfs mount gs://b /m --read-only")


def test_shell_wrapper_runs_helper(tmp_path: Path) -> None:
    wrapper = ROOT / "systemd" / "mount.marinfs"
    result = subprocess.run(["sh", str(wrapper), "gs://b", "/m", "-o", "nope"], capture_output=True,
                            text=True, env={**os.environ, "MARINFS_PYTHON": sys.executable})
    assert (result.returncode, result.stderr) == (1, "mount.marinfs: error: unknown mount option 'nope'\n")
    # Without MARINFS_PYTHON it finds the interpreter next to `marinfs` on PATH.
    env = {k: v for k, v in os.environ.items() if k != "MARINFS_PYTHON"}
    env["PATH"] = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    result = subprocess.run(["sh", str(wrapper), "gs://b", "/m", "-f"], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 0, result.stderr


# --- systemd unit ---------------------------------------------------------------------------

def test_unit_file_parses() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(UNIT)
    service = parser["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["Restart"] == "on-failure"
    assert service["ExecStart"] == "/usr/local/bin/marinfs mount --foreground --config /etc/marinfs/%i.toml"
    assert service["ExecStop"].startswith("/usr/local/bin/marinfs umount --config /etc/marinfs/%i.toml")
    assert service["TimeoutStopSec"] == "600" and service["KillMode"] == "mixed"
    assert service["CacheDirectory"] == "marinfs/%i"
    assert service["EnvironmentFile"] == "-/etc/marinfs/%i.env"
    assert parser["Unit"]["After"] == "network-online.target" == parser["Unit"]["Wants"]
    # Any mount namespace would hide the mount from everyone else.
    for key in ("PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts"):
        assert key not in service


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(short_dir: Path) -> None:
    text = UNIT.read_text().replace("/usr/local/bin/marinfs", shutil.which("true") or "/bin/true")
    text = text.replace("/etc/marinfs/", f"{short_dir}/")
    unit = short_dir / "marinfs@test.service"
    unit.write_text(text)
    (short_dir / "test.toml").write_text('remote = "memory://x"\n')
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, timeout=120)
    # verify exits 0 even for unknown keys; its warnings name the file.
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr
