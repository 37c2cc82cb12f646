"""The layers of docs/architecture.md, checked: every module imports (no cycle), nothing imports
a module above it (function-level imports included), and only marinfs/remote/ touches fsspec,
the cloud clients or an HTTP client."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "marinfs"

# Lowest first; a module may import only modules of a lower layer. Keep in step with the table
# in docs/architecture.md.
LAYERS: list[set[str]] = [
    {"marinfs", "errors", "objects", "notify", "metrics", "buffers", "checksums", "threadnames", "libfuse"},
    {"settings", "mounts", "uploads", "chunkcache", "metadata", "commit", "dirmeta", "posixmeta", "walkahead",
     "sharedcache"},
    {"config", "cachecli", "reader", "staging"},
    {"configfile", "mount_helper", "remote.base", "remote.recorded", "remote.httpbody"},
    {"remote.generic", "remote.local", "remote.objectstore", "remote.s3http", "remote.s3obstore",
     "remote.gcshttp"},
    {"remote.s3", "remote.gcs"},
    {"remote"},
    {"recovery", "listings"},
    {"fs"},
    {"fuse_ops"},
    {"daemon"},
    {"status"},
    {"cli"},
    {"__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# Known upward imports, each with its reason; the list should only shrink.
UPWARD = {
    # settings.py defers to config.py from inside functions (the remote converter reuses
    # config.normalize_remote; `python -m marinfs.settings` prints config.SETTINGS): config
    # imports settings at the top, so the two are one unit in two files.
    ("settings", "config"),
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


def _imports(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "marinfs":  # from marinfs import daemon (not: import __version__)
                names.update(f"marinfs.{alias.name}" for alias in node.names
                             if (PACKAGE / f"{alias.name}.py").exists() or (PACKAGE / alias.name).is_dir())
    return names


def _ours(name: str) -> str | None:
    """The LAYERS name of a marinfs module (None for anything else)."""
    if name == "marinfs":
        return "marinfs"
    if not name.startswith("marinfs."):
        return None
    inner = name.removeprefix("marinfs.")
    while inner not in RANK and "." in inner:
        inner = inner.rsplit(".", 1)[0]
    return inner


def test_every_module_has_a_layer() -> None:
    assert set(_modules()) == set(RANK), "add new modules to LAYERS (and docs/architecture.md)"


# __main__ runs the CLI; fuse_ops loads libfuse, which the fast tiers do not have.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.mount) if n == "fuse_ops" else n
                                  for n in sorted(set(_modules()) - {"__main__"})])
def test_module_imports_on_its_own(name: str) -> None:
    importlib.import_module("marinfs" if name == "marinfs" else f"marinfs.{name}")


@pytest.mark.parametrize("name", sorted(_modules()))
def test_nothing_imports_a_layer_above(name: str) -> None:
    path = _modules()[name]
    for imported in _imports(path):
        ours = _ours(imported)
        if ours is None or ours == name or (name, ours) in UPWARD:
            continue
        assert ours in RANK, f"{name} imports unknown module {imported}"
        assert RANK[ours] < RANK[name], f"{name} (layer {RANK[name]}) imports {imported} (layer {RANK[ours]})"


@pytest.mark.parametrize("name", sorted(n for n in _modules() if n != "remote" and not n.startswith("remote.")))
def test_only_the_remote_package_imports_backend_libraries(name: str) -> None:
    used = {imported.split(".", 1)[0] for imported in _imports(_modules()[name])} & BACKEND_LIBRARIES
    assert not used, f"marinfs/{name} imports {sorted(used)}: route it through marinfs/remote/"
