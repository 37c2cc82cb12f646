"""Mount settings from a TOML file and MARINFS_* variables, merged under the command-line flags.

A systemd unit or fstab line cannot carry twenty flags readably, so every ``marinfs mount`` flag
also has a key here (the flag's snake_case name); the settings table (config.SETTINGS) has the
keys, their converters and bounds. Values come back in the types MountConfig takes, validated,
so a bad file fails before anything is mounted, with one line that names the file (or
variable), the key and the problem.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from marinfs.config.mount import SETTINGS
from marinfs.errors import UsageError
from marinfs.config.settings import ENV, OPTIONS, TOML, Bad, Setting

FILE_SETTINGS: dict[str, Setting] = {s.name: s for s in SETTINGS if s.allows(TOML)}
ENV_SETTINGS: dict[str, Setting] = {s.env_name: s for s in SETTINGS if s.allows(ENV)}
KEYS = tuple(FILE_SETTINGS)


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _convert(where: str, setting: Setting, value: object, base: str | None) -> Any:
    try:
        return setting.parse(value, base)
    except Bad as exc:
        raise UsageError(f"{where}: {setting.name}: {exc}") from None


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a mount's TOML file; raises UsageError with one line on any problem.

    Returned types match MountConfig: remote/mountpoint/log_file str (absolute), cache_dir Path,
    sizes/modes int, TTLs float, immutable tuple[str, ...], storage_options dict.
    """
    where = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:  # its message already says "(at line N, column M)"
        raise UsageError(f"{where}: bad TOML: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{where}: cannot read config: {exc.strerror or exc}") from None
    base = os.path.dirname(os.path.abspath(path))
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in FILE_SETTINGS:
            raise UsageError(f"{where}: {_unknown(key)}")
        out[key] = _convert(where, FILE_SETTINGS[key], value, base)
    return out


def from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """MARINFS_<KEY> variables (MARINFS_CACHE_SIZE=200G), validated like the file.

    Other MARINFS_* names (MARINFS_PYTHON, MARINFS_MOUNT of the Makefile) are not ours to judge
    and are ignored. MARINFS_STORAGE_OPTIONS is a JSON object, as the daemon hand-off writes it.
    """
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if name in ENV_SETTINGS:
            setting = ENV_SETTINGS[name]
            out[setting.name] = _convert(f"environment {name}", setting, value, None)
    return out


def merge(file: Mapping[str, Any], env: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """file < env < flags. ``flags`` holds only the flags actually given (None values are skipped).

    storage_options merge key by key, so ``-o anon=true`` adds to the file's table instead of
    replacing it.
    """
    out: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for layer in (file, env, flags):
        for key, value in layer.items():
            if value is None:
                continue
            if key in FILE_SETTINGS and FILE_SETTINGS[key].kind is OPTIONS:
                options.update(value)
            else:
                out[key] = value
    if options:
        out["storage_options"] = options
    return out


def check(path: str | os.PathLike[str]) -> str:
    """`marinfs config check FILE`: one summary line, or UsageError naming the problem."""
    data = load_file(path)
    remote = data.get("remote", "unset (give it on the command line or $MARIN_PREFIX)")
    mountpoint = data.get("mountpoint", "unset (give it on the command line)")
    n = len(data)
    return f"ok: {n} key{'s' * (n != 1)}; remote {remote}, mountpoint {mountpoint}"


__all__ = ["ENV_SETTINGS", "FILE_SETTINGS", "KEYS", "check", "from_env", "load_file", "merge"]
