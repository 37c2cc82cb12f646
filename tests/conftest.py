"""Fixtures: one behaviour suite on every backend. Each mount is torn down even on failure;
the object-store servers run once per session and are stopped by PID. Every test gets its
tier here (tests/tiers.py); a unit or core test that tries to mount or start a server fails."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# gcsfs reads this when imported: without it, it tries gRPC/TLS first and stalls a minute.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# libfuse's fuse_main moves the whole process to "/" (even in the foreground), so after the
# first in-process mount `python -m marinfs` would import the marinfs installed in the venv
# (maybe another checkout) instead of this one: put this checkout first for every subprocess.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402

from mounting import Mounted, fsspec_client, inprocess_mount, subprocess_mount, tmpfs  # noqa: E402
from servers import GCSServer, S3Server, start_fake_gcs, start_seaweedfs  # noqa: E402
import tiers  # noqa: E402

from marinfs.remote import Remote  # noqa: E402

BACKENDS = ["local", "memory", "s3", "gcs"]
# S3 with a shared chunk tier (--shared-cache-dir, docs/caching.md): issue 35 asks that every
# semantic test pass with one configured. In this variant `mounted` and `module_mount` mount S3
# with a tier, beside another node (a second daemon on the same tier) that reads each object a
# test stores with put_remote before the test's mount does, so the mount reads it from the
# tier, as in a cluster, and a version the bucket no longer has may still be there. Only in the
# files below: the POSIX contract of docs/semantics.md where files' bytes are read through
# chunks (the tier is consulted for nothing else): real tools and syscalls, mmap, partial and
# concurrent reads, remote rewrites (test_behaviour), fallocate, xattrs, mknod (test_posix),
# readers that follow renames to copies pinned to their version (test_rename_readers), links
# (test_symlinks). test_coherence runs its reading tests in the variant of its own two-node
# fixture (both nodes on one tier). The other users of `mounted` (test_bad_input's names,
# test_model's unlink sequences) write through the mount and read back what it wrote: they
# would repeat the S3 variant at two daemon starts a test. The variant adds about 45 s to the
# suite's wall time with two workers (90 s of test time).
SHARED = "s3+shared"
SHARED_TIER_FILES = frozenset({"test_behaviour.py", "test_posix.py", "test_rename_readers.py", "test_symlinks.py"})
MOUNT_BACKENDS = [*BACKENDS, SHARED]
TIER_KEY = pytest.StashKey[frozenset]()


def fixture_tiers(item: pytest.Item) -> set[str]:
    """The tiers declared (tiers.needs) by the fixtures in the test's closure."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    declared = (getattr(defs[-1].func, "marinfs_tier", None) for defs in info.name2fixturedefs.values() if defs)
    return {t for t in declared if t}


def shared_variant_elsewhere(item: pytest.Item) -> bool:
    """The shared tier's variant of `mounted` or `module_mount` outside SHARED_TIER_FILES."""
    callspec: Any = getattr(item, "callspec", None)
    return (callspec is not None and item.path.name not in SHARED_TIER_FILES
            and SHARED in (callspec.params.get("mounted"), callspec.params.get("module_mount")))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test its tiers (tests/tiers.py): from its fixtures and parameters, and its
    explicit marks where those cannot tell (a mount made inside the test body). A light mark
    on a parametrized test names its light variants: the heavy ones lose it, so that ``-m``
    selects each variant by the tier it really has. The shared tier's variant of `mounted` and
    `module_mount` runs only in SHARED_TIER_FILES."""
    elsewhere = [item for item in items if shared_variant_elsewhere(item)]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if not shared_variant_elsewhere(item)]
    errors = []
    for item in items:
        explicit = {m.name for m in item.iter_markers() if m.name in tiers.TIERS}
        callspec: Any = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        try:
            found = tiers.tier_of(explicit, fixture_tiers(item), params)
        except tiers.TierError as exc:
            errors.append(f"{item.nodeid}: {exc}")
            continue
        if found & tiers.HEAVY:
            item.own_markers = [m for m in item.own_markers if m.name not in tiers.FAST]
        for tier in sorted(found - {m.name for m in item.iter_markers()}):
            item.add_marker(tier)
        have = frozenset(m.name for m in item.iter_markers() if m.name in tiers.TIERS)
        if have != found:  # a light mark on a module or class, where one item cannot drop it
            errors.append(f"{item.nodeid}: marked {sorted(have - found)}, but needs {sorted(found)}")
            continue
        item.stash[TIER_KEY] = found
    if errors:
        raise pytest.UsageError("tests with contradictory tiers:\n" + "\n".join(errors))


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """A unit or core test that tries to mount FUSE or start a server fails, in every run:
    the fast tier must pass on a machine without fuse3 or the servers."""
    found = request.node.stash.get(TIER_KEY, frozenset())
    if not found or not found <= tiers.FAST:
        yield
        return
    tier = "/".join(sorted(found))

    def refuse(what: str) -> None:
        pytest.fail(f"a {tier} test tried to {what}: mark it mount or objectstore (tests/tiers.py)",
                    pytrace=False)

    with pytest.MonkeyPatch.context() as patch:  # its own: a test's monkeypatch.undo() keeps it
        yield from tiers.fast_guard(refuse, patch.setattr, patch.setenv)


@pytest.fixture(scope="session")
@tiers.needs("objectstore")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
@tiers.needs("objectstore")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    server = start_fake_gcs(tmp_path_factory.mktemp("fake-gcs"))
    try:
        yield server
    finally:
        server.stop()


def check_shared_tier(stats: dict) -> dict:
    """A mount's shared tier, as its last figures say (``stats.json``), never failed: a
    degraded tier would have sent every read to the bucket, and the test would have tested no
    tier. Answers the figures."""
    tier = stats["shared"]
    assert tier is not None, "no shared tier"
    assert tier["state"] == "ok" and not (tier["errors"] or tier["timeouts"] or tier["corrupt"]), tier
    return stats


def object_store(request: pytest.FixtureRequest, backend: str) -> tuple[str, dict, dict[str, str]]:
    """(URL of a fresh prefix, direct-client storage options, environment for the daemon)."""
    backend = backend.split("+")[0]
    server = request.getfixturevalue("s3_server" if backend == "s3" else "gcs_server")
    scheme = "s3" if backend == "s3" else "gs"
    url = f"{scheme}://{server.bucket}/t-{uuid.uuid4().hex[:12]}"
    return url, server.storage_options(), server.env()


@contextlib.contextmanager
def mount_backend(request: pytest.FixtureRequest, backend: str, base: Path) -> Iterator[Mounted]:
    """A live mount of a fresh, empty prefix on ``backend``, in directory ``base``."""
    mnt, cache = base / "mnt", base / "cache"
    if backend == "local":
        root = base / "remote"
        root.mkdir()
        url = str(root)
        fs, path = fsspec_client(url)
        with subprocess_mount(url, mnt, cache) as pid:
            yield Mounted(mnt=mnt, url=url, fs=fs, root=path, cache_dir=cache, pid=pid)
    elif backend == "memory":
        url = f"memory://marinfs-test-{uuid.uuid4().hex[:12]}"
        fs, path = fsspec_client(url)
        fs.mkdir(path)
        with inprocess_mount(url, mnt, cache):
            yield Mounted(mnt=mnt, url=url, fs=fs, root=path, cache_dir=cache)
    else:
        # Object stores: the daemon finds its endpoint and credentials in the standard
        # environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, STORAGE_EMULATOR_HOST...).
        url, options, env = object_store(request, backend)
        fs, path = fsspec_client(url, {**options, "use_listings_cache": False})
        warmed: list[str] = []
        with contextlib.ExitStack() as stack:
            warm = None
            extra: list[str] = []
            if backend == SHARED:
                tier = base / "tier"
                tier.mkdir(mode=0o700)
                extra = ["--shared-cache-dir", str(tier)]
                peer = base / "peer"
                stack.enter_context(subprocess_mount(url, peer, base / "peer-cache", *extra, "--metadata-ttl", "0",
                                                     "--negative-ttl", "0", env=env))
                warm = functools.partial(warm_tier, peer, path, tier, warmed)
            pid = stack.enter_context(subprocess_mount(url, mnt, cache, *extra, env=env))
            yield Mounted(mnt=mnt, url=url, fs=fs, root=path, cache_dir=cache, pid=pid, env=env, warm=warm)
        if backend == SHARED:  # both unmounted: their last figures
            check_shared_tier(json.loads((base / "peer-cache" / "stats.json").read_text()))
            sources = check_shared_tier(json.loads((cache / "stats.json").read_text()))["sources"]
            if warmed and sources["bucket"] + sources["shared"]:  # it read chunks the peer had published
                assert sources["shared"], f"no chunk came from the shared tier: {sources}"


def warm_tier(peer: Path, root: str, tier: Path, warmed: list[str], remote_path: str, data: bytes) -> None:
    """Another node (``peer``, a mount of the same prefix on the same tier that trusts no
    cached stat) reads the object at ``remote_path`` whole, and its chunks are published, before
    the test's mount reads it: so that mount reads it from the tier, not the bucket. What the
    peer read must be ``data``, the bytes just stored (not an older version's, from the tier)."""
    with open(peer / os.path.relpath(remote_path, root), "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(8 << 20), b""))
    assert got == data, f"another node read {len(got)} bytes of {remote_path}, not the {len(data)} just stored"
    deadline = time.monotonic() + 30
    while any((tier / "leases").iterdir()) or any((tier / "tmp").iterdir()):  # publishes under way
        assert time.monotonic() < deadline, "the peer's chunks never landed in the shared tier"
        time.sleep(0.01)
    warmed.append(remote_path)


@pytest.fixture(params=MOUNT_BACKENDS)
@tiers.needs("mount")
def mounted(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mounted]:
    """A live mount of a fresh, empty prefix on each backend: a daemon of the test's own."""
    with mount_backend(request, request.param, tmp_path) as m:
        yield m


@pytest.fixture(scope="module", params=MOUNT_BACKENDS)
@tiers.needs("mount")
def module_mount(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mounted]:
    """One live mount per backend for the tests of a module (see mounted_dir)."""
    with mount_backend(request, request.param, tmp_path_factory.mktemp(f"mount-{request.param}")) as m:
        yield m


@pytest.fixture
@tiers.needs("mount")
def mounted_dir(module_mount: Mounted) -> Mounted:
    """A fresh, empty directory, made through the mount, of a mount the module's tests share on
    each backend: a mount costs a daemon start (seconds on an object store). For tests that
    write only through the mount and look only inside their directory. Not for a test that
    writes behind the mount's back (the mount knows the directory it made is empty, for the
    listing TTL), counts the daemon's requests, or needs a fresh daemon or cache: use mounted."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    (module_mount.mnt / name).mkdir()
    return dataclasses.replace(module_mount, mnt=module_mount.mnt / name, url=f"{module_mount.url}/{name}",
                               root=module_mount.remote_path(name))


@pytest.fixture
@tiers.needs("mount")
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem for the cache directory: it fills at once (root only)."""
    with tmpfs(tmp_path / "tiny", "1m") as path:
        yield path


@pytest.fixture(params=["memory", "local"])
@tiers.needs("core")
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    """An empty prefix without FUSE: a unique memory:// root (the store is class-level) or a
    local tmp dir. Files that need another kind of remote define their own fixture."""
    if request.param == "memory":
        r = Remote(f"memory://t-{uuid.uuid4().hex}")
        r.fs.mkdir(r.root)
        yield r
        r.close()  # its directory records are written, their flusher stopped
        for attempt in range(5):  # the store is shared: another test's flusher may write meanwhile
            try:
                r.fs.rm(r.root, recursive=True)
                break
            except RuntimeError:  # fsspec's memory find(): "dictionary changed size during iteration"
                time.sleep(0.05)
    else:
        (tmp_path / "remote").mkdir()
        yield Remote(str(tmp_path / "remote"))
