"""The settings table: every ``marinfs mount`` setting once, and how each route spells it.

``MountConfig`` (config.py) declares each setting as a dataclass field whose metadata is a
``Setting``: the field gives the name, the type and the default; the ``Setting`` gives how text
and TOML values become that type, the bounds, the help, and the routes it may come by.
``config.SETTINGS`` is read from those fields, and every route walks it: argparse (cli.py), the
TOML file and ``MARINFS_*`` variables (configfile.py), fstab ``-o`` options (mount_helper.py),
the background child's arguments (daemon.py), the settings a daemon publishes for
``marinfs status`` and the settings table of docs/usage.md. Five hand-kept lists drifted apart
before (the background child lost ``--mount-timeout``); a new field now reaches every route.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from marinfs.errors import UsageError

FLAG, TOML, ENV, FSTAB, CHILD = "flag", "toml", "env", "fstab", "child"
ALL_ROUTES = frozenset({FLAG, TOML, ENV, FSTAB, CHILD})
ENV_PREFIX = "MARINFS_"
LOG_LEVELS = ("debug", "info", "warning", "error")
_KEY = "marinfs.setting"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Bad(Exception):
    """A problem with one value; the caller says where it came from (file, variable, flag)."""


# -- text parsers, also used on their own -------------------------------------------------------
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``200G``, ``512M``, ``8MiB``, ``1048576`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise UsageError(f"{text!r} is not a size such as 512M or 200G")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def format_size(n: int) -> str:
    """The shortest exact spelling parse_size reads back: 20G, 8M, 1000."""
    for unit in "TGMK":
        if n and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return str(n)


def human_size(n: int) -> str:
    """A size for people: 0 B, 8.0 MiB, 20.0 GiB (binary units, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def parse_mode(text: str) -> int:
    """Parse an octal permission mode such as ``0644`` or ``755``."""
    try:
        return int(text, 8)
    except ValueError:
        raise UsageError(f"{text!r} is not an octal mode such as 0644") from None


def parse_storage_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"storage option {text!r} is not KEY=VALUE")
    return key, value


def _storage_value(text: str) -> object:
    """Storage option values are JSON when they parse as JSON (true, 30, {...}), else strings."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# -- kinds: raw value -> typed value. ``base`` is the TOML file's directory, or None for text
# (flags, MARINFS_* variables, fstab options), which is all those routes can carry. ---------------
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: object) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)
    return f"{kind} ({v!r})" if not isinstance(v, (list, dict)) else kind


def _bool(v: object, base: str | None) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and base is None:
        if v.strip().lower() in _TRUE:
            return True
        if v.strip().lower() in _FALSE:
            return False
        raise Bad(f"{v!r} is not a boolean (true/false)")
    raise Bad(f"expected true or false, got {_show(v)}")


def _int(v: object, base: str | None) -> int:
    if isinstance(v, str) and base is None:
        try:
            v = int(v.strip())
        except ValueError:
            raise Bad(f"{v!r} is not an integer") from None
    if not _is_int(v):
        raise Bad(f"expected an integer, got {_show(v)}")
    return v  # type: ignore[return-value]


def _seconds(v: object, base: str | None) -> float:
    if isinstance(v, str) and base is None:
        try:
            v = float(v.strip())
        except ValueError:
            raise Bad(f"{v!r} is not a number of seconds") from None
    if not (_is_int(v) or isinstance(v, float)):
        raise Bad(f"expected a number of seconds, got {_show(v)}")
    return float(v)  # type: ignore[arg-type]


def _size(v: object, base: str | None) -> int:
    if _is_int(v):
        return v  # type: ignore[return-value]
    if isinstance(v, str):
        try:
            return parse_size(v)
        except UsageError as exc:
            raise Bad(str(exc)) from None
    raise Bad(f'expected a size such as "512M" or an integer, got {_show(v)}')


def _mode(v: object, base: str | None) -> int:
    if isinstance(v, str):
        try:
            return parse_mode(v.strip())
        except UsageError as exc:
            raise Bad(str(exc)) from None
    if _is_int(v):
        # TOML ints are decimal unless written 0o644; a bare 644 is almost surely a typo for that.
        if v > 0o777:  # type: ignore[operator]
            raise Bad(f'{v} is decimal (= {oct(v)}); write "0{v}" or 0o{v}')  # type: ignore[arg-type]
        return v  # type: ignore[return-value]
    raise Bad(f'expected an octal mode such as "0644", got {_show(v)}')


def _text(v: object, base: str | None) -> str:
    if not isinstance(v, str) or not v.strip():
        raise Bad(f"expected a non-empty string, got {_show(v)}")
    return v.strip()


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _address(v: object, base: str | None) -> str:
    """An IP address (``127.0.0.1``, ``::1``) or a host name by RFC 1123. ``999.1.1.1`` is
    neither: a name whose last label is all digits is an IPv4 address or nothing."""
    text = _text(v, base)
    try:
        ipaddress.ip_address(text.strip("[]"))
        return text.strip("[]")
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if len(text) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit():
        return text
    raise Bad(f"{text!r} is not an IP address or a host name")


def _path(v: object, base: str | None) -> str:
    # Relative paths in a file are relative to the file, not to wherever systemd started us.
    return os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(_text(v, base))))


def _dir(v: object, base: str | None) -> Path:
    return Path(_path(v, base))


def normalize_remote(remote: str, cwd: str | None = None) -> str:
    """Normalize a prefix the way Marin does: no trailing '/', no '//', local paths absolute.

    ``s3://b//p/`` -> ``s3://b/p``; ``./data`` -> ``/current/dir/data``; ``file:///x`` -> ``/x``.
    """
    remote = remote.strip()
    if not remote:
        raise UsageError("the remote prefix is empty")
    if "://" in remote:
        scheme, _, rest = remote.partition("://")
        scheme = scheme.lower()
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
            raise UsageError(f"bad URL scheme in {remote!r}")
        if scheme in ("file", "local"):
            return normalize_remote(rest or "/", cwd)
        rest = re.sub(r"/{2,}", "/", rest).rstrip("/")
        if not rest:
            raise UsageError(f"{remote!r} names no bucket")
        return f"{scheme}://{rest}"
    path = os.path.normpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(remote)))
    return re.sub(r"/{2,}", "/", path)


def _remote(v: object, base: str | None) -> str:
    try:
        return normalize_remote(_text(v, base), cwd=base)
    except UsageError as exc:
        raise Bad(str(exc)) from None


def _lower_text(v: object, base: str | None) -> str:
    return _text(v, base).lower()


def _globs(v: object, base: str | None) -> tuple[str, ...]:
    if isinstance(v, str) and base is None:  # text: a JSON list or comma-separated
        try:
            v = json.loads(v) if v.lstrip().startswith("[") else [g for g in v.split(",") if g.strip()]
        except ValueError as exc:
            raise Bad(f"not a JSON list ({exc})") from None
    if not isinstance(v, (list, tuple)) or not all(isinstance(g, str) and g.strip() for g in v):
        raise Bad(f"expected a list of glob strings, got {_show(v)}")
    return tuple(g.strip() for g in v)


def _options(v: object, base: str | None) -> dict[str, Any]:
    if isinstance(v, str) and base is None:  # text: a JSON object
        try:
            v = json.loads(v)
        except ValueError as exc:
            raise Bad(f"not a JSON object ({exc})") from None
    if not isinstance(v, dict):
        raise Bad(f"expected a table of fsspec options, got {_show(v)}")
    return dict(v)


def _glob_element(text: str) -> str:
    if not text.strip():
        raise Bad("expected a glob, got an empty string")
    return text.strip()


def _option_element(text: str) -> tuple[str, object]:
    try:
        key, value = parse_storage_option(text)
    except UsageError as exc:
        raise Bad(str(exc)) from None
    return key, _storage_value(value)


@dataclass(frozen=True)
class Kind:
    """One type of value: how text and TOML values become it, and how it is written back as
    text that reads the same (the child's argv, MARINFS_* variables, the docs)."""

    metavar: str
    parse: Callable[[object, str | None], Any]
    show: Callable[[Any], str] = str
    to_json: Callable[[Any], Any] = lambda v: v
    unit: str = ""  # in messages about bounds: "must be >= 0 seconds"
    # Kinds given once per element on the command line (--immutable GLOB, -o KEY=VALUE):
    element: Callable[[str], Any] | None = None      # one flag's text -> one element
    gather: Callable[[list[Any]], Any] = tuple        # the elements -> the value
    elements: Callable[[Any], list[str]] = list       # the value -> one text per element
    freeze: Callable[[Any], Any] = lambda v: v        # merged value -> MountConfig's (hashable) type


BOOL = Kind("", _bool, show=lambda v: "true" if v else "false")
INT = Kind("N", _int)
SECONDS = Kind("SECONDS", _seconds, show=lambda v: f"{v:g}" if float(f"{v:g}") == v else repr(v), unit=" seconds")
SIZE = Kind("SIZE", _size, show=format_size)
MODE = Kind("MODE", _mode, show=lambda v: f"0{v:o}")
TEXT = Kind("TEXT", _text)
ADDRESS = Kind("ADDR", _address)
CHOICE = Kind("NAME", _lower_text)
PATH = Kind("PATH", _path)
DIR = Kind("DIR", _dir, to_json=str)
REMOTE = Kind("URL", _remote)
GLOBS = Kind("GLOB", _globs, show=lambda v: json.dumps(list(v)), to_json=list, element=_glob_element,
             gather=tuple, elements=list)
OPTIONS = Kind("KEY=VALUE", _options, show=lambda v: json.dumps(dict(v)),
               # Storage options may hold credentials: only their names are published.
               to_json=lambda v: sorted(dict(v)), element=_option_element, gather=dict,
               elements=lambda v: [f"{k}={json.dumps(x)}" for k, x in dict(v).items()],
               freeze=lambda v: tuple(sorted(dict(v).items())))


@dataclass(frozen=True)
class Setting:
    """One row of the table. ``name`` and the default are filled in from MountConfig's field."""

    kind: Kind
    help: str
    doc: str | None = None                  # docs/usage.md's longer text (markdown); else help
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    routes: frozenset[str] = ALL_ROUTES
    flag: str | None = None                 # default: --dashed-name
    short: str | None = None
    positional: bool = False                # REMOTE and MOUNTPOINT are arguments, not --flags
    child_env: bool = False                 # reaches the child by environment, so not in `ps`
    fstab_aliases: Mapping[str, bool] = field(default_factory=dict)  # bools: ro -> True, rw -> False
    doc_default: str | None = None          # when the default is not a constant ("the mounting user")
    name: str = ""
    default: Any = None
    factory: Callable[[], Any] | None = None
    required: bool = False

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def allows(self, route: str) -> bool:
        return route in self.routes

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def parse(self, raw: object, base: str | None = None) -> Any:
        """Raw value (text when ``base`` is None, else a TOML value) -> the field's type, checked."""
        value = self.kind.parse(raw, base)
        self.check(value)
        return value

    def parse_element(self, text: str) -> Any:
        assert self.kind.element is not None
        return self.kind.element(text)

    def check(self, value: Any) -> None:
        """The bounds, on a typed value: every route and MountConfig.validate() use this."""
        if value is None and self.default is None and not self.required:
            return
        if self.choices and value not in self.choices:
            raise Bad(f"{value!r} is not one of {', '.join(self.choices)}")
        show, unit = self.kind.show, self.kind.unit
        if self.low is not None and not value >= self.low:  # NaN too: a TTL of NaN never expires
            if self.high is None:
                raise Bad(f"must be >= {show(self.low)}{unit}, got {show(value)}")
            raise Bad(f"{show(value)} is out of range ({show(self.low)}..{show(self.high)})")
        if self.high is not None and not value <= self.high:
            raise Bad(f"{show(value)} is out of range ({show(self.low)}..{show(self.high)})")

    def to_args(self, value: Any) -> list[str]:
        """Command-line arguments that give ``value`` (the background child's argv)."""
        if value is None:
            return []
        if self.positional:
            return [str(value)]
        if self.kind is BOOL:
            return [self.flag_name if value else "--no-" + self.flag_name[2:]]
        # --flag=VALUE: a value that starts with "-" (a glob, an address) is not taken for a flag.
        if self.kind.element is not None:
            return [f"{self.flag_name}={text}" for text in self.kind.elements(value)]
        return [f"{self.flag_name}={self.kind.show(value)}"]

    def to_text(self, value: Any) -> str:
        """``value`` as a MARINFS_* variable (or fstab value) spells it."""
        return self.kind.show(value)

    def to_json(self, value: Any) -> Any:
        return None if value is None else self.kind.to_json(value)

    def describe_default(self) -> str:
        if self.doc_default is not None:
            return self.doc_default
        if self.required:
            return "required"
        value = self.default_value()
        if value in ((), None):
            return "none"
        if self.kind is BOOL:
            return "on" if value else "off"
        return f"`{self.kind.show(value)}`" + (" s" if self.kind is SECONDS else "")


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, **spec: Any) -> Any:
    """A MountConfig field that is a row of the settings table (no default: required)."""
    meta = {_KEY: Setting(**spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def table(cls: type) -> tuple[Setting, ...]:
    """The rows of a dataclass's fields, named and defaulted by them. Every field must be one."""
    rows = []
    for f in fields(cls):
        if _KEY not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with settings.setting()")
        has_default, has_factory = f.default is not MISSING, f.default_factory is not MISSING
        rows.append(replace(f.metadata[_KEY], name=f.name, default=f.default if has_default else None,
                            factory=f.default_factory if has_factory else None,  # type: ignore[arg-type]
                            required=not (has_default or has_factory)))
    return tuple(rows)


def markdown_table(rows: tuple[Setting, ...]) -> str:
    """docs/usage.md's settings reference (tests/test_docs.py keeps the two equal)."""
    out = ["| key (TOML, `MARINFS_<KEY>`) | flag | fstab | default | meaning |", "|---|---|---|---|---|"]
    for s in rows:
        if s.positional:
            flag = f"`{s.name.upper()}` argument"
        elif not s.allows(FLAG):
            flag = "—"
        elif s.kind is BOOL:
            flag = f"`{s.flag_name}`" + (f", `{s.short}`" if s.short else "") + f" / `--no-{s.flag_name[2:]}`"
        else:
            flag = f"`{s.flag_name} {s.kind.metavar}`" + (f", `{s.short}`" if s.short else "")
        if s.positional and s.allows(FSTAB):
            fstab = "the " + ("source" if s.name == "remote" else "mountpoint") + " field"
        elif not s.allows(FSTAB):
            fstab = "—"
        elif s.kind is BOOL:
            fstab = f"`{s.name}` / `no_{s.name}`" + "".join(f", `{a}`" for a in s.fstab_aliases)
        else:
            fstab = f"`{s.name}=`"
        key = f"`{s.name}`" if s.allows(TOML) or s.allows(ENV) else "—"
        if s.allows(TOML) != s.allows(ENV):
            key += " (file only)" if s.allows(TOML) else " (environment only)"
        out.append(f"| {key} | {flag} | {fstab} | {s.describe_default()} | {s.doc or s.help} |")
    return "\n".join(out)

