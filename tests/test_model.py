"""Reference-model tests: hypothesis drives random sequences of POSIX calls at a marinfs mount and,
call for call, at a plain local directory (the model). After every step the two must agree on
contents, sizes, listings and errno values. Where docs/semantics.md documents a difference from
a local disk, the test asserts that difference instead of skipping the case.

Open file descriptors are part of the state (open, write, read, truncate, fsync and close happen
in separate steps), so close-to-commit and several handles on one file are exercised; so are
unmount + remount over the same cache directory and, on daemons in their own process, SIGKILL
with files open followed by a new daemon (recovery).

Budget: ``MARINFS_MODEL_EXAMPLES`` sequences of up to ``MARINFS_MODEL_STEPS`` steps per backend
in ``MARINFS_MODEL_BACKENDS`` (CI: local and s3, a bounded budget, derandomized so a run is
reproducible); ``make soak`` sets them high, on every backend, with random seeds. Each run prints
how many examples and steps it ran.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from conftest import object_store
from mounting import force_unmount, fsspec_client, inprocess_mount, subprocess_mount
import tiers

KiB = 1 << 10
CHUNK = 64 * KiB  # the smallest chunk size: files of a few hundred KiB span several chunks
EXAMPLES = int(os.environ.get("MARINFS_MODEL_EXAMPLES", "12"))
STEPS = int(os.environ.get("MARINFS_MODEL_STEPS", "40"))
BACKENDS = os.environ.get("MARINFS_MODEL_BACKENDS", "local,s3").split(",")
RANDOM = os.environ.get("MARINFS_MODEL_RANDOM", "") not in ("", "0")  # soak: fresh seeds each run
REMOUNT_EVERY = 8  # at most one remount or crash per this many steps: each costs a daemon start

NAMES = ("a", "b", "c")  # few names: collisions make the interesting errnos
FLAGS = {
    "r": os.O_RDONLY,
    "w+trunc": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "rw+creat": os.O_RDWR | os.O_CREAT,
    "rw": os.O_RDWR,
    "append": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "excl": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "rw+trunc": os.O_RDWR | os.O_TRUNC,
}

names = st.sampled_from(NAMES)
# Mostly shallow paths; rules also draw existing ones (MountVersusModel.where).
paths = st.one_of(names, names, st.lists(names, min_size=2, max_size=2).map("/".join),
                  st.lists(names, min_size=3, max_size=3).map("/".join))
offsets = st.one_of(st.integers(0, 16), st.sampled_from([CHUNK - 1, CHUNK, 2 * CHUNK + 5]),
                    st.integers(0, 3 * CHUNK))
lengths = st.one_of(st.integers(0, 16), st.sampled_from([4096, CHUNK, CHUNK + 1]), st.integers(0, 3 * CHUNK))
blobs = st.builds(lambda seed, n: random.Random(seed).randbytes(n), st.integers(0, 1 << 30),
                  st.one_of(st.integers(0, 64), st.sampled_from([4096, CHUNK + 3]), st.integers(0, 2 * CHUNK)))
fd_slots = st.integers(0, 7)


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """('ok', value) or ('err', errno name): what a syscall did, comparable across filesystems."""
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno or 0, str(exc.errno)))


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry below ``root``: directories as 'dir', files as (size, bytes). Raises on any error,
    unlike os.walk, which would hide one."""
    out: dict[str, Any] = {}

    def walk(rel: str) -> None:
        base = root / rel if rel else root
        for entry in sorted(os.listdir(base)):
            name = f"{rel}/{entry}" if rel else entry
            st_ = os.stat(root / name)
            if os.path.isdir(root / name):
                out[name] = "dir"
                walk(name)
            else:
                data = (root / name).read_bytes()
                out[name] = (st_.st_size, data)

    walk("")
    return out


def describe(tree: dict[str, Any]) -> dict[str, Any]:
    """A readable form of a snapshot for assertion messages (sizes and a digest, not bytes)."""
    import hashlib

    return {k: v if v == "dir" else (v[0], hashlib.sha1(v[1]).hexdigest()[:8]) for k, v in tree.items()}


# -- the mount under test ----------------------------------------------------------------------
@dataclass
class Target:
    """One mount that the state machine may unmount, remount or kill; always torn down."""

    backend: str
    url: str
    mnt: Path
    cache: Path
    env: dict[str, str]
    _stack: contextlib.ExitStack | None = None
    pid: int | None = None
    mounts: int = 0
    crashes: int = 0

    @property
    def killable(self) -> bool:
        return self.backend != "memory"  # memory:// lives in this process: no daemon to kill

    def mount(self) -> None:
        assert self._stack is None
        stack = contextlib.ExitStack()
        try:
            if self.backend == "memory":
                stack.enter_context(inprocess_mount(self.url, self.mnt, self.cache, chunk_size=CHUNK,
                                                    cache_size=64 << 20))
                self.pid = None
            else:
                self.pid = stack.enter_context(subprocess_mount(
                    self.url, self.mnt, self.cache, "--chunk-size", str(CHUNK), "--cache-size", "64M",
                    "--cache-min-free", "0", env=self.env))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self.mounts += 1

    def unmount(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def kill(self) -> None:
        """SIGKILL the daemon: no flush, no drain, no unmount."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{self.pid}").exists():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        self.crashes += 1


@pytest.fixture(params=BACKENDS)
@tiers.needs("mount")
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    backend = request.param
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    env: dict[str, str] = {}
    if backend == "local":
        (tmp_path / "remote").mkdir()
        url = str(tmp_path / "remote")
    elif backend == "memory":
        url = f"memory://model-{uuid.uuid4().hex[:12]}"
        fs, root = fsspec_client(url)
        fs.mkdir(root)
    else:
        url, _, env = object_store(request, backend)
    t = Target(backend, url, mnt, cache, env)
    t.mount()
    try:
        yield t
    finally:
        try:
            t.unmount()
        finally:  # even when a timeout interrupted the unmount itself
            force_unmount(mnt)
            if t.pid is not None and daemon_of(t.pid, mnt):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(t.pid, signal.SIGKILL)


def daemon_of(pid: int, mnt: Path) -> bool:
    """Whether ``pid`` still is the marinfs daemon we started for ``mnt`` (not a reused PID)."""
    try:
        return str(mnt).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# -- the state machine -------------------------------------------------------------------------
@dataclass
class OpenFile:
    path: str  # where it was opened (files may be renamed or unlinked while open)
    flags: int
    model: int  # the descriptor on the model
    mount: int  # the descriptor on the mount
    # Bytes the file had at open: a read-only handle may keep serving the version it opened
    # (docs/semantics.md: "no mixed versions") once the file changed under it.
    opened: bytes | None = None
    history: list[bytes] = field(default_factory=list)

    @property
    def writable(self) -> bool:
        return self.flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


class Counters:
    examples = 0
    steps = 0
    remounts = 0
    crashes = 0
    errnos: dict[str, int] = {}


def make_machine(target: Target, model_base: Path, counters: Counters) -> type[RuleBasedStateMachine]:
    class MountVersusModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.files: list[OpenFile] = []
            self.since_remount = 0
            self.root = ""

        # -- helpers -------------------------------------------------------------------------
        @property
        def m(self) -> Path:
            return model_base / self.root

        @property
        def t(self) -> Path:
            return target.mnt / self.root

        def both(self, op: Callable[[Path], Any]) -> tuple[tuple[str, Any], tuple[str, Any]]:
            return outcome(lambda: op(self.m)), outcome(lambda: op(self.t))

        def agree(self, what: str, model: tuple[str, Any], mount: tuple[str, Any]) -> None:
            outcome_name = model[1] if model[0] == "err" else "ok"
            counters.errnos[outcome_name] = counters.errnos.get(outcome_name, 0) + 1
            if os.environ.get("MARINFS_MODEL_TRACE"):
                print(what.split("(")[0].split(" ")[0], outcome_name)
            assert mount == model, f"{what}: model {model}, mount {mount}"

        def where(self, data: st.DataObject) -> str:
            """A path: often one that exists, or a name inside an existing directory, so that calls
            meet files and directories rather than ENOENT."""
            existing = sorted(str(p.relative_to(self.m)) for p in self.m.rglob("*"))
            choices = [paths]
            if existing:
                there = st.sampled_from(existing)
                choices += [there, there, st.tuples(there, names).map("/".join)]
            return data.draw(st.one_of(*choices), label="path")

        def pick(self, slot: int) -> OpenFile | None:
            return self.files[slot % len(self.files)] if self.files else None

        def current_bytes(self, f: OpenFile) -> bytes:
            """What the model's file (the inode the descriptor refers to) holds now."""
            size = os.fstat(f.model).st_size
            return os.pread(f.model, size, 0) if size else b""

        def note_change(self) -> None:
            """Record what each read-only descriptor's file holds now: the versions it may serve."""
            for f in self.files:
                if not f.writable and f.opened is not None:
                    now = self.read_model_inode(f)
                    if now is not None and (not f.history or f.history[-1] != now):
                        f.history.append(now)

        def read_model_inode(self, f: OpenFile) -> bytes | None:
            try:
                fd = os.open(f"/proc/self/fd/{f.model}", os.O_RDONLY)
            except OSError:
                return None
            try:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    return None
                size = os.fstat(fd).st_size
                return os.pread(fd, size, 0) if size else b""
            finally:
                os.close(fd)

        # -- setup ---------------------------------------------------------------------------
        @initialize()
        def fresh_root(self) -> None:
            counters.examples += 1
            self.root = f"ex-{uuid.uuid4().hex[:8]}"
            seed = random.Random(counters.examples).randbytes(CHUNK + 100)
            for root in (self.m, self.t):  # something to meet: a directory, a file in it, a file
                os.mkdir(root)
                os.mkdir(root / "a")
                (root / "a/b").write_bytes(seed)
                (root / "c").write_bytes(seed[:10])

        def teardown(self) -> None:
            for f in self.files:
                with contextlib.suppress(OSError):
                    os.close(f.model)
                with contextlib.suppress(OSError):
                    os.close(f.mount)
            self.files.clear()

        # -- descriptors ---------------------------------------------------------------------
        @rule(data=st.data(), how=st.sampled_from(sorted(FLAGS)))
        def open(self, data: st.DataObject, how: str) -> None:
            self.open_path(self.where(data), how)

        def open_path(self, path: str, how: str) -> None:
            flags = FLAGS[how]
            model, mount = self.both(lambda root: os.open(root / path, flags, 0o644))
            if model[0] == "ok" and mount[0] == "ok":
                f = OpenFile(path, flags, model[1], mount[1])
                if not f.writable:
                    f.opened = self.read_model_inode(f)
                    f.history = [f.opened] if f.opened is not None else []
                self.files.append(f)
                self.note_change()
                self.agree(f"open({path!r}, {how})", ("ok", None), ("ok", None))  # (counted)
                return
            for side in (model, mount):  # one side opened, the other did not: close it again
                if side[0] == "ok":
                    os.close(side[1])
            self.agree(f"open({path!r}, {how})", model, mount)

        def handle(self, slot: int, data: st.DataObject) -> OpenFile | None:
            """An open file for a descriptor call; when none is open, open one first (so that
            descriptor calls stay frequent whatever rules hypothesis picks)."""
            if not self.files:
                how = data.draw(st.sampled_from(["rw+creat", "rw", "append", "w+trunc", "r"]), label="open")
                self.open_path(self.where(data), how)
            return self.pick(slot)

        @rule(slot=fd_slots, blob=blobs, offset=offsets, data=st.data())
        def write(self, slot: int, blob: bytes, offset: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            if f.flags & os.O_APPEND:
                model = outcome(lambda: os.write(f.model, blob))
                mount = outcome(lambda: os.write(f.mount, blob))
            else:
                model = outcome(lambda: os.pwrite(f.model, blob, offset))
                mount = outcome(lambda: os.pwrite(f.mount, blob, offset))
            self.agree(f"write {len(blob)} bytes at {offset} to {f.path!r}", model, mount)
            self.note_change()

        @rule(slot=fd_slots, offset=offsets, size=lengths, data=st.data())
        def read(self, slot: int, offset: int, size: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            model = outcome(lambda: os.pread(f.model, size, offset))
            mount = outcome(lambda: os.pread(f.mount, size, offset))
            if mount != model and not f.writable and model[0] == "ok":
                # Documented: once its file changed, a read-only handle fails with ESTALE or
                # keeps serving one version it saw, never a mix (docs/semantics.md, Reading).
                if mount == ("err", "ESTALE") and len(f.history) > 1:
                    return
                if mount[0] == "ok" and any(mount[1] == v[offset:offset + size] for v in f.history):
                    return
            self.agree(f"pread({size}, {offset}) of {f.path!r} ({'rw' if f.writable else 'ro'})", model, mount)

        @rule(slot=fd_slots, length=lengths, data=st.data())
        def ftruncate(self, slot: int, length: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            model = outcome(lambda: os.ftruncate(f.model, length))
            mount = outcome(lambda: os.ftruncate(f.mount, length))
            self.agree(f"ftruncate({f.path!r}, {length})", model, mount)
            self.note_change()

        @rule(slot=fd_slots, data=st.data())
        def fsync(self, slot: int, data: st.DataObject) -> None:
            f = self.handle(slot, data)
            if f is None:
                return
            model = outcome(lambda: os.fsync(f.model))
            mount = outcome(lambda: os.fsync(f.mount))
            self.agree(f"fsync({f.path!r})", model, mount)

        @precondition(lambda self: self.files)
        @rule(slot=fd_slots)
        def close(self, slot: int) -> None:
            f = self.pick(slot)
            assert f is not None
            self.files.remove(f)
            model = outcome(lambda: os.close(f.model))
            mount = outcome(lambda: os.close(f.mount))  # close commits: it must report success
            self.agree(f"close({f.path!r})", model, mount)

        # -- paths ---------------------------------------------------------------------------
        @rule(data=st.data(), length=lengths)
        def truncate(self, data: st.DataObject, length: int) -> None:
            path = self.where(data)
            model, mount = self.both(lambda root: os.truncate(root / path, length))
            self.agree(f"truncate({path!r}, {length})", model, mount)
            self.note_change()

        @rule(data=st.data())
        def mkdir(self, data: st.DataObject) -> None:
            path = self.where(data)
            model, mount = self.both(lambda root: os.mkdir(root / path))
            self.agree(f"mkdir({path!r})", model, mount)

        @rule(data=st.data())
        def rmdir(self, data: st.DataObject) -> None:
            path = self.where(data)
            model, mount = self.both(lambda root: os.rmdir(root / path))
            self.agree(f"rmdir({path!r})", model, mount)

        @rule(data=st.data())
        def unlink(self, data: st.DataObject) -> None:
            path = self.where(data)
            model, mount = self.both(lambda root: os.unlink(root / path))
            self.agree(f"unlink({path!r})", model, mount)
            self.note_change()

        @rule(data=st.data())
        def rename(self, data: st.DataObject) -> None:
            src, dst = self.where(data), self.where(data)
            model, mount = self.both(lambda root: os.rename(root / src, root / dst))
            self.agree(f"rename({src!r}, {dst!r})", model, mount)
            self.note_change()

        @rule(data=st.data())
        def look(self, data: st.DataObject) -> None:
            """stat and listdir (the tree itself is compared after every step anyway)."""
            path = "" if data.draw(st.booleans(), label="the root") else self.where(data)

            def kind_and_size(root: Path) -> tuple[str, int]:
                s = os.stat(root / path)
                return ("dir", 0) if stat.S_ISDIR(s.st_mode) else ("file", s.st_size)

            model, mount = self.both(kind_and_size)
            self.agree(f"stat({path!r})", model, mount)
            model, mount = self.both(lambda root: sorted(os.listdir(root / path)))
            self.agree(f"listdir({path!r})", model, mount)

        # -- the daemon ----------------------------------------------------------------------
        @precondition(lambda self: self.since_remount >= REMOUNT_EVERY)
        @rule()
        def remount(self) -> None:
            """Close everything, unmount, mount again over the same cache directory."""
            for f in list(self.files):
                self.close(self.files.index(f))
            target.unmount()
            target.mount()
            self.since_remount = 0
            counters.remounts += 1

        @precondition(lambda self: target.killable and self.since_remount >= REMOUNT_EVERY)
        @rule()
        def crash(self) -> None:
            """SIGKILL the daemon with files open; a new daemon commits what they held
            (docs/semantics.md, Durability: "as they stood")."""
            target.kill()
            for f in self.files:
                os.close(f.model)
                with contextlib.suppress(OSError):
                    os.close(f.mount)  # the dead mount answers ENOTCONN
            self.files.clear()
            target.unmount()
            target.mount()
            self.since_remount = 0
            counters.crashes += 1

        # -- after every step ----------------------------------------------------------------
        @invariant()
        def same_tree(self) -> None:
            if not self.root:
                return
            counters.steps += 1
            self.since_remount += 1
            model = snapshot(self.m)
            mount = snapshot(self.t)
            if mount != model:
                assert describe(mount) == describe(model), "tree differs"
                assert mount == model, "tree differs"

    return MountVersusModel


def test_mount_agrees_with_a_local_directory(target: Target, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    model_base = tmp_path / "model"
    model_base.mkdir()
    counters = Counters()
    counters.errnos = {}
    machine = make_machine(target, model_base, counters)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if RANDOM else [])
    started = time.monotonic()
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
            derandomize=not RANDOM, phases=phases, suppress_health_check=list(HealthCheck),
            print_blob=True))
    finally:
        with capsys.disabled():
            print(f"\nmodel[{target.backend}]: {counters.examples} examples, {counters.steps} steps, "
                  f"{target.mounts - 1} remounts ({target.crashes} after SIGKILL), "
                  f"outcomes compared {dict(sorted(counters.errnos.items()))}, "
                  f"{time.monotonic() - started:.1f} s")


# -- sequences the state machine found, replayed as plain tests on every backend ------------------
def remote_names(mounted: Any) -> list[str]:
    """Every object below the prefix, as another client sees them."""
    try:
        found = mounted.fs.find(mounted.root, withdirs=True)
    except FileNotFoundError:
        return []
    return sorted(p[len(mounted.root) + 1:] for p in found if p.rstrip("/") != mounted.root)


def test_unlinking_an_open_file_leaves_no_hidden_file(mounted: Any) -> None:
    """open(O_APPEND|O_CREAT); unlink; -> the mount listed (and uploaded) a .fuse_hidden* file:
    libfuse renames an open file on unlink unless told hard_remove."""
    fd = os.open(mounted.mnt / "a", os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"before")
        os.unlink(mounted.mnt / "a")
        assert os.listdir(mounted.mnt) == []
        os.write(fd, b" after")  # an unlinked file stays usable through its descriptor
        assert os.pread(fd, 100, 0) == b"before after"
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.listdir(mounted.mnt) == []
    assert remote_names(mounted) == []


def store(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> tuple[str, dict[str, str], Any, str]:
    """(URL of a fresh prefix, the daemon's environment, a direct client, its root path)."""
    if backend == "local":
        (tmp_path / "remote").mkdir()
        url, env = str(tmp_path / "remote"), {}
        client, root = fsspec_client(url)
    else:
        url, options, env = object_store(request, backend)
        client, root = fsspec_client(url, {**options, "use_listings_cache": False})
    return url, env, client, root


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_a_file_unlinked_or_replaced_while_open_stays_gone_after_a_crash(
        request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    """open; write; unlink; SIGKILL -> the next daemon committed the unlinked file again: its
    journal outlived the name."""
    url, env, client, root = store(request, backend, tmp_path)
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with subprocess_mount(url, mnt, cache, env=env) as pid:
        gone = os.open(mnt / "gone", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(gone, b"unlinked while open")
        os.unlink(mnt / "gone")
        replaced = os.open(mnt / "replaced", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(replaced, b"replaced while open")
        (mnt / "new").write_bytes(b"the new file")
        os.rename(mnt / "new", mnt / "replaced")
        os.kill(pid, signal.SIGKILL)
        for fd in (gone, replaced):
            with contextlib.suppress(OSError):
                os.close(fd)
    with subprocess_mount(url, mnt, cache, env=env):
        assert sorted(os.listdir(mnt)) == ["replaced"]
        assert (mnt / "replaced").read_bytes() == b"the new file"
    assert not list((cache / "staging").glob("*.journal.json"))


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.mount
def test_bytes_written_after_an_fsync_are_recovered_in_place_after_a_crash(
        request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    """write; fsync; write; SIGKILL -> the next daemon saw the object at the version the fsync
    made, not the one the writer opened, called it a conflict and set the bytes aside."""
    url, env, client, root = store(request, backend, tmp_path)
    client.pipe_file(f"{root}/log", b"v1")
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    with subprocess_mount(url, mnt, cache, env=env) as pid:
        fd = os.open(mnt / "log", os.O_WRONLY | os.O_APPEND)
        os.write(fd, b" fsynced")
        os.fsync(fd)
        assert bytes(client.cat_file(f"{root}/log")) == b"v1 fsynced"
        os.write(fd, b" then written")
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(fd)
    with subprocess_mount(url, mnt, cache, env=env):
        assert os.listdir(mnt) == ["log"]
        assert (mnt / "log").read_bytes() == b"v1 fsynced then written"


def test_an_open_file_keeps_its_bytes_after_unlink_or_replace(mounted: Any) -> None:
    """open(O_RDWR) (nothing read or written yet); unlink; ftruncate -> ENOENT: the staged file
    fetched the old bytes only when first needed, and by then the object was gone."""
    m = mounted.mnt
    for how in ("unlink", "replace"):
        (m / "f").write_bytes(b"old bytes")
        fd = os.open(m / "f", os.O_RDWR)
        try:
            if how == "unlink":
                os.unlink(m / "f")
            else:
                (m / "new").write_bytes(b"the new file")
                os.rename(m / "new", m / "f")
            os.ftruncate(fd, 6207)
            assert os.pread(fd, 9, 0) == b"old bytes"
            os.pwrite(fd, b"O", 0)
            assert os.pread(fd, 9, 0) == b"Old bytes" and len(os.pread(fd, 10_000, 0)) == 6207
            if how == "unlink":  # documented: libfuse has no name left to stat it by
                with pytest.raises(OSError) as info:
                    os.fstat(fd)
                assert info.value.errno == errno.ESTALE
        finally:
            os.close(fd)
        if how == "unlink":
            assert os.listdir(m) == [] and remote_names(mounted) == []
        else:
            assert os.listdir(m) == ["f"] and (m / "f").read_bytes() == b"the new file"
            assert mounted.remote_bytes("f") == b"the new file"
            os.unlink(m / "f")
