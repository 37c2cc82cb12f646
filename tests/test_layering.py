"""The packages of docs/architecture.md, checked: every module belongs to a package and imports
(no cycle, function-level imports included), a package imports only the packages its rule
allows, and only marinfs/remote/ touches fsspec, the cloud clients or an HTTP client."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "marinfs"

# The ground floor: value types, errors and small helpers every package may use; they import
# nothing of ours but each other.
GROUND = {"marinfs", "errors", "objects", "checksums", "threadnames", "stopsignals", "posixmeta", "interrupts"}
# What each package may import besides itself and the ground floor. Keep in step with the table
# in docs/architecture.md. No exceptions: a module that needs more belongs elsewhere.
RULES: dict[str, set[str]] = {
    "remote": set(),  # the backends: only the ground floor
    "config": {"remote"},  # the settings table (and the remote's settings it carries)
    "meta": {"remote"},  # metadata caches, background listings
    "read": set(),  # chunk cache, fetcher, buffers: no remote (the fetcher is given read_range)
    "write": {"remote"},  # staged files, commits, recovery
    "core": {"remote", "meta", "read", "write"},  # the Filesystem facade and its rooms
    "fuse": {"core"},  # the adapter: libfuse's calls to the core's
    "app": {"config", "remote", "meta", "read", "write", "core", "fuse"},  # daemon, CLIs
    "__main__": {"app"},
}
# Only marinfs/remote/ may import these.
BACKEND_LIBRARIES = {"fsspec", "s3fs", "gcsfs", "botocore", "aiobotocore", "obstore", "urllib3", "aiohttp",
                     "requests", "httpx"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        found[name or "marinfs"] = path
    return found


def _package(name: str) -> str:
    """The package a module name belongs to ("ground" for the ground floor)."""
    return "ground" if name in GROUND else name.split(".", 1)[0]


def _imports(path: Path) -> set[str]:
    """Every marinfs module named by an import anywhere in the file (inside functions too), as
    a _modules() name; other modules as they are named."""
    names: set[str] = set()
    modules = _modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for alias in node.names:  # from marinfs.core import writes: a module, not a name
                inner = f"{node.module}.{alias.name}".removeprefix("marinfs.")
                if inner in modules:
                    names.add(f"marinfs.{inner}")
    return names


def _ours(name: str) -> str | None:
    """The _modules() name of a marinfs module (None for anything else)."""
    if name == "marinfs":
        return "marinfs"
    return name.removeprefix("marinfs.") if name.startswith("marinfs.") else None


def test_every_module_belongs_to_a_package_with_a_rule() -> None:
    for name in _modules():
        assert _package(name) in RULES or _package(name) == "ground", \
            f"{name}: put it in a package of RULES (and docs/architecture.md), or on the ground floor"


# __main__ runs the CLI; fuse.ops loads libfuse, which the fast tiers do not have.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.mount) if n == "fuse.ops" else n
                                  for n in sorted(set(_modules()) - {"__main__"})])
def test_module_imports_on_its_own(name: str) -> None:
    importlib.import_module("marinfs" if name == "marinfs" else f"marinfs.{name}")


@pytest.mark.parametrize("name", sorted(_modules()))
def test_a_package_imports_only_what_its_rule_allows(name: str) -> None:
    package = _package(name)
    allowed = {package, "ground"} | (set() if package == "ground" else RULES[package])
    for imported in _imports(_modules()[name]):
        ours = _ours(imported)
        if ours is None:
            continue
        assert ours in _modules(), f"{name} imports unknown module {imported}"
        assert _package(ours) in allowed, \
            f"{name} ({package}) imports {imported} ({_package(ours)}); {package} may import {sorted(allowed)}"


def test_no_import_cycle() -> None:
    """Between modules, counting every import (inside functions too): a package's __init__
    may re-export its modules, but no module imports its package's __init__ back."""
    graph = {name: {o for i in _imports(path) if (o := _ours(i)) and o != name and o in _modules()}
             for name, path in _modules().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("name", sorted(n for n in _modules() if _package(n) != "remote"))
def test_only_the_remote_package_imports_backend_libraries(name: str) -> None:
    used = {imported.split(".", 1)[0] for imported in _imports(_modules()[name])} & BACKEND_LIBRARIES
    assert not used, f"marinfs/{name} imports {sorted(used)}: route it through marinfs/remote/"


def test_the_remote_packages_ground_floor_comes_without_the_backends() -> None:
    """config/ takes RemoteSettings and the writer PartStream from marinfs/remote/; the
    package loads its backends (and fsspec, s3fs, gcsfs...) only when a name needs them, so the
    CLI, mount.marinfs and marinfs status start without them."""
    code = ("import sys, marinfs.app.cli, marinfs.app.mount_helper, marinfs.write.staging, marinfs.app.status\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1:]"
            " or m == 'marinfs.remote.base')))")
    loaded = subprocess.run([sys.executable, "-c", code, *sorted(BACKEND_LIBRARIES)], capture_output=True,
                            text=True, check=True, cwd=PACKAGE.parent).stdout.split()
    assert loaded == []


def test_the_architecture_page_names_every_module_and_these_rules() -> None:
    """docs/architecture.md has a line for each module (its path in backticks) and the import
    rules as RULES has them."""
    text = (PACKAGE.parent / "docs/architecture.md").read_text()
    for name, path in _modules().items():
        if name in ("marinfs", "__main__") or path.name == "__init__.py":
            continue
        rel = path.relative_to(PACKAGE).as_posix()
        assert f"`{rel}`" in text, f"docs/architecture.md: no line for `{rel}`"
    rules = {}
    for package, allowed in re.findall(r"^\| `(\w+)/` \| ([^|]*) \|", text, re.M):
        rules[package] = {a.strip("` ").rstrip("/") for a in allowed.split(",") if a.strip() and "ground" not in a}
    assert rules == {p: r for p, r in RULES.items() if p != "__main__"}
