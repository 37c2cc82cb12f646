"""Mount settings from a TOML file and MARINFS_* variables, merged under the command-line flags.

A systemd unit or fstab line cannot carry twenty flags readably, so every ``marinfs mount`` flag
also has a key here (the flag's snake_case name). Values come back in the types MountConfig
takes, already validated, so a bad file fails before anything is mounted, with one line that
names the file (or variable), the key and the problem.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from marinfs.config import LOG_LEVELS, normalize_remote, parse_mode, parse_size
from marinfs.errors import UsageError

ENV_PREFIX = "MARINFS_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class _Bad(Exception):
    """A problem with one value; the caller adds where it came from."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bool(v: object, base: str | None) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and base is None:  # from the environment: text is all there is
        if v.strip().lower() in _TRUE:
            return True
        if v.strip().lower() in _FALSE:
            return False
        raise _Bad(f"{v!r} is not a boolean (true/false)")
    raise _Bad(f"expected true or false, got {_show(v)}")


def _int(minimum: int, maximum: int | None = None) -> Callable[[object, str | None], int]:
    def conv(v: object, base: str | None) -> int:
        if isinstance(v, str) and base is None:
            try:
                v = int(v.strip())
            except ValueError:
                raise _Bad(f"{v!r} is not an integer") from None
        if not _is_int(v):
            raise _Bad(f"expected an integer, got {_show(v)}")
        if v < minimum or (maximum is not None and v > maximum):
            raise _Bad(f"{v} is out of range ({minimum}..{maximum})" if maximum is not None
                       else f"must be >= {minimum}, got {v}")
        return v
    return conv


def _seconds(v: object, base: str | None) -> float:
    if isinstance(v, str) and base is None:
        try:
            v = float(v.strip())
        except ValueError:
            raise _Bad(f"{v!r} is not a number of seconds") from None
    if not (_is_int(v) or isinstance(v, float)):
        raise _Bad(f"expected a number of seconds, got {_show(v)}")
    if v < 0 or v != v:
        raise _Bad(f"must be >= 0 seconds, got {v}")
    return float(v)


def _size(v: object, base: str | None) -> int:
    if _is_int(v):
        if v < 0:
            raise _Bad(f"must be >= 0, got {v}")
        return v
    if isinstance(v, str):
        try:
            return parse_size(v)
        except UsageError as exc:
            raise _Bad(str(exc)) from None
    raise _Bad(f'expected a size such as "512M" or an integer, got {_show(v)}')


def _mode(v: object, base: str | None) -> int:
    if isinstance(v, str):
        try:
            mode = parse_mode(v.strip())
        except UsageError as exc:
            raise _Bad(str(exc)) from None
    elif _is_int(v):
        # TOML ints are decimal unless written 0o644; a bare 644 is almost surely a typo for that.
        if v > 0o777:
            raise _Bad(f'{v} is decimal (= {oct(v)}); write "0{v}" or 0o{v}')
        mode = v
    else:
        raise _Bad(f'expected an octal mode such as "0644", got {_show(v)}')
    if not 0 <= mode <= 0o7777:
        raise _Bad(f"{oct(mode)} is not a permission mode")
    return mode


def _text(v: object, base: str | None) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _Bad(f"expected a non-empty string, got {_show(v)}")
    return v.strip()


def _path(v: object, base: str | None) -> str:
    # Relative paths in a file are relative to the file, not to wherever systemd started us.
    return os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(_text(v, base))))


def _dir(v: object, base: str | None) -> Path:
    return Path(_path(v, base))


def _remote(v: object, base: str | None) -> str:
    try:
        return normalize_remote(_text(v, base), cwd=base)
    except UsageError as exc:
        raise _Bad(str(exc)) from None


def _log_level(v: object, base: str | None) -> str:
    level = _text(v, base).lower()
    if level not in LOG_LEVELS:
        raise _Bad(f"{level!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def _globs(v: object, base: str | None) -> tuple[str, ...]:
    if isinstance(v, str) and base is None:  # env: JSON list or comma-separated
        try:
            v = json.loads(v) if v.lstrip().startswith("[") else [g for g in v.split(",") if g.strip()]
        except ValueError as exc:
            raise _Bad(f"not a JSON list ({exc})") from None
    if not isinstance(v, list) or not all(isinstance(g, str) and g.strip() for g in v):
        raise _Bad(f"expected a list of glob strings, got {_show(v)}")
    return tuple(g.strip() for g in v)


def _table(v: object, base: str | None) -> dict[str, Any]:
    if isinstance(v, str) and base is None:  # env: a JSON object, as the daemon hand-off uses
        try:
            v = json.loads(v)
        except ValueError as exc:
            raise _Bad(f"not a JSON object ({exc})") from None
    if not isinstance(v, dict):
        raise _Bad(f"expected a table of fsspec options, got {_show(v)}")
    return dict(v)


def _show(v: object) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)
    return f"{kind} ({v!r})" if not isinstance(v, (list, dict)) else kind


# Key -> converter. The keys are exactly the snake_case names of the `marinfs mount` flags.
SCHEMA: dict[str, Callable[[object, str | None], Any]] = {
    "remote": _remote,
    "mountpoint": _path,
    "read_only": _bool,
    "allow_other": _bool,
    "uid": _int(0),
    "gid": _int(0),
    "file_mode": _mode,
    "dir_mode": _mode,
    "log_level": _log_level,
    "log_file": _path,
    "cache_dir": _dir,
    "metadata_ttl": _seconds,
    "negative_ttl": _seconds,
    "list_ttl": _seconds,
    "list_prefetch": _bool,
    "immutable": _globs,
    "mount_timeout": _seconds,
    "drain_timeout": _seconds,
    "commit_retry_interval": _seconds,
    "connect_timeout": _seconds,
    "read_timeout": _seconds,
    "retries": _int(1),
    "chunk_size": _size,
    "cache_size": _size,
    "cache_min_free": _size,
    "prefetch_workers": _int(1),
    "read_ahead_kb": _int(0),
    "metrics_port": _int(0, 65535),
    "metrics_addr": _text,
    "storage_options": _table,
}
KEYS = tuple(SCHEMA)


def _unknown(key: str) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _convert(where: str, key: str, value: object, base: str | None) -> Any:
    try:
        return SCHEMA[key](value, base)
    except _Bad as exc:
        raise UsageError(f"{where}: {key}: {exc}") from None


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
        if key not in SCHEMA:
            raise UsageError(f"{where}: {_unknown(key)}")
        out[key] = _convert(where, key, value, base)
    return out


def from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """MARINFS_<KEY> variables (MARINFS_CACHE_SIZE=200G), validated like the file.

    Other MARINFS_* names (MARINFS_PYTHON, MARINFS_MOUNT of the Makefile) are not ours to judge
    and are ignored. MARINFS_STORAGE_OPTIONS is a JSON object, as the daemon hand-off writes it.
    """
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key in SCHEMA:
            out[key] = _convert(f"environment {name}", key, value, None)
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
            if key == "storage_options":
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


__all__ = ["KEYS", "SCHEMA", "check", "from_env", "load_file", "merge"]
