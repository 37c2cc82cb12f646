"""Setting up: `make test` installs what its tests need (none skips for a missing package),
and `make libfuse` takes its source from the Debian mirror apt is configured with, naming no
host in the repository (tools/fetch_from_apt_mirror.py)."""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import fetch_from_apt_mirror as apt  # noqa: E402

POOL = "pool/main/f/fuse3/fuse3_3.17.2.orig.tar.gz"


def _dist(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_package_a_test_may_skip_for_is_installed_by_make_test() -> None:
    """`pytest.importorskip(X)` in a test skips where X is missing: X must be a dependency or in
    the test extra, which `make test` installs (its venv is rebuilt when pyproject.toml changes)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_dist(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    wanted = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                wanted.add((path.name, node.args[0].value.split(".")[0].replace("_", "-").lower()))
    assert wanted  # the scan finds them
    assert not [w for w in wanted if w[1] not in declared]
    assert "matplotlib" in declared and "kubernetes-validate" in declared
    makefile = (ROOT / "Makefile").read_text()
    assert "$(VENV)/.installed: pyproject.toml" in makefile and "pip install -q -e '.[test]'" in makefile
    assert re.search(r"^test: .*\bvenv\b", makefile, re.M)


def test_pyproject_names_only_what_exists() -> None:
    """The entry points, the packages found (every directory of marinfs/ that holds modules),
    pytest's paths, and every file a comment names (one named marinfs/directget.py long after
    it was gone)."""
    text = (ROOT / "pyproject.toml").read_text()
    config = tomllib.loads(text)
    for target in config["project"]["scripts"].values():
        module, _, name = target.partition(":")
        assert hasattr(importlib.import_module(module), name), target
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]  # what find_packages takes
    packages = [d for d in (ROOT / "marinfs").rglob("*") if d.is_dir() and any(d.glob("*.py"))]
    for package in [ROOT / "marinfs", *packages]:
        name = ".".join(package.relative_to(ROOT).parts)
        assert (package / "__init__.py").is_file() and any(fnmatch.fnmatch(name, i) for i in include), name
    pytest_ini = config["tool"]["pytest"]["ini_options"]
    assert all((ROOT / p).is_dir() for p in pytest_ini["testpaths"] + pytest_ini["pythonpath"])
    ours = [ROOT / d for d in ("marinfs", "tests", "benchmarks", "tools")]
    named = set(re.findall(r"[\w/.-]+\.py\b", text))
    assert named  # the scan finds them
    def exists(name: str) -> bool:  # a bare name (bench.py's) is a file of ours somewhere
        return (ROOT / name).is_file() if "/" in name else any(next(d.rglob(name), None) for d in ours)

    assert [n for n in named if not exists(n)] == []


def test_no_debian_or_ubuntu_host_is_named_in_the_build() -> None:
    files = [ROOT / "Makefile", *(ROOT / ".ci").rglob("*"), *(ROOT / "tools").rglob("*.py")]
    hosts = re.compile(r"[a-z0-9-]+\.(debian|ubuntu)\.(org|com)")
    assert not [(f.name, m.group()) for f in files if f.is_file() for m in hosts.finditer(f.read_text())]
    assert "tools/fetch_from_apt_mirror.py $(LIBFUSE_POOL) $(LIBFUSE_SHA256)" in (ROOT / "Makefile").read_text()


def test_mirrors_are_read_from_both_source_formats_in_apt_order(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n"
        "deb-src http://mirror.example/debian/ bookworm main\n#deb http://commented.example/debian x main\n"
        "deb cdrom:[Debian]/ bookworm main\n")
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (parts / "b.sources").write_text(
        "Types: deb\nURIs: https://b1.example/debian\n https://b2.example/debian\nSuites: bookworm\n\n"
        "Types: deb\nEnabled: no\nURIs: http://off.example/debian\nSuites: bookworm\n\n"
        "# only a comment\n")
    (parts / "a.list").write_text("deb file:/srv/mirror bookworm main\n")
    (parts / "c.list.disabled").write_text("deb http://ignored.example/debian bookworm main\n")
    assert apt.mirrors(tmp_path / "sources.list", parts) == [
        "http://mirror.example/debian", "file:/srv/mirror", "https://b1.example/debian", "https://b2.example/debian"]
    assert apt.mirrors(tmp_path / "none", tmp_path / "none.d") == []


def test_the_first_mirror_with_the_right_bytes_wins(tmp_path: Path) -> None:
    """file:// mirrors: one without the file, one with other bytes, one with the right ones."""
    good, bad = b"libfuse source", b"something else"
    for name, body in (("bad", bad), ("good", good)):
        (tmp_path / name / Path(POOL).parent).mkdir(parents=True)
        (tmp_path / name / POOL).write_bytes(body)
    (tmp_path / "empty").mkdir()
    uris = [f"file://{tmp_path / n}" for n in ("empty", "bad", "good")]
    out = tmp_path / "src.tar.gz"
    url = apt.fetch(uris, POOL, hashlib.sha256(good).hexdigest(), out)
    assert url == f"{uris[2]}/{POOL}" and out.read_bytes() == good
    out.unlink()
    with pytest.raises(LookupError, match="SHA-256"):
        apt.fetch(uris[:2], POOL, hashlib.sha256(good).hexdigest(), out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.is_file()] == []  # nothing half-written


def test_the_command_fails_with_one_line(tmp_path: Path) -> None:
    """apt's configuration (APT_CONFIG) names a mirror that lacks the file: one line, exit 1."""
    sources = tmp_path / "sources.list"
    sources.write_text(f"deb file://{tmp_path}/nothing bookworm main\n")
    (tmp_path / "parts").mkdir()
    (tmp_path / "apt.conf").write_text(f'Dir::Etc::sourcelist "{sources}";\nDir::Etc::sourceparts "{tmp_path}/parts";\n')
    run = subprocess.run([sys.executable, str(ROOT / "tools/fetch_from_apt_mirror.py"), POOL, "00" * 32,
                          str(tmp_path / "out")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "APT_CONFIG": str(tmp_path / "apt.conf")}, timeout=60)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert f"file://{tmp_path}/nothing/{POOL}" in run.stderr
