"""Test tiers: which test needs what, decided once at collection, and a guard that holds the
fast tiers to it.

- ``unit``: one function or class, with fakes; no remote, no FUSE, no server.
- ``core``: ``marinfs.core.Filesystem`` or a ``Remote`` over memory:// or a local directory.
- ``mount``: a real FUSE mount (in-process or a daemon), or mount(8).
- ``objectstore``: SeaweedFS or fake-gcs-server (with or without a mount).

``unit`` and ``core`` are the fast tiers (``make test-fast``): they need the venv only.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

TIERS = ("unit", "core", "mount", "objectstore")
FAST = frozenset({"unit", "core"})
HEAVY = frozenset({"mount", "objectstore"})

# A parameter with one of these values selects an object store: conftest's object_store()
# starts the server through request.getfixturevalue, which the fixture closure cannot show.
SERVER_PARAMS = frozenset({"s3", "gcs", "s3+shared"})

# Executables a fast test may not start: they mount, or they are the object-store servers.
FORBIDDEN_PROGRAMS = frozenset({"mount", "fusermount", "fusermount3", "mount.marinfs", "mount.fuse.marinfs",
                                "weed", "fake-gcs-server"})
# mfusepy loads libfuse from here when set: a daemon started by a fast test cannot mount.
NO_FUSE = "/nonexistent/marinfs-fast-tier-has-no-libfuse/libfuse3.so"


class TierError(Exception):
    """Marks that contradict each other or what the test's fixtures need."""


def needs(tier: str) -> Callable[[F], F]:
    """Declare, under ``@pytest.fixture``, the tier a fixture brings to every test that uses it
    (directly or through other fixtures)."""
    assert tier in TIERS, tier

    def tag(fn: F) -> F:
        fn.marinfs_tier = tier  # type: ignore[attr-defined]
        return fn

    return tag


def tier_of(explicit: Iterable[str], needed: Iterable[str], params: Iterable[Any]) -> frozenset[str]:
    """The tiers of one test: what its fixtures (``needed``) and parameters need, plus its
    explicit heavy marks; else its explicit light mark (which so names the tier of the light
    variants of a parametrized test); else the light tier its fixtures need, or unit."""
    marked = frozenset(explicit)
    wanted = frozenset(needed)
    light = marked & FAST
    if len(light) > 1:
        raise TierError(f"marked both {sorted(light)}")
    if light and marked & HEAVY:
        raise TierError(f"marked {sorted(light)} and {sorted(marked & HEAVY)}")
    heavy = set((marked | wanted) & HEAVY)
    if any(isinstance(p, str) and p in SERVER_PARAMS for p in params):
        heavy.add("objectstore")
    if heavy:
        return frozenset(heavy)
    if light:
        return light
    return frozenset({"core"}) if "core" in wanted else frozenset({"unit"})


def forbidden_program(args: Any) -> str | None:
    """The program in a Popen argument list that a fast test may not run, or None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        words = os.fsdecode(args).split()
        first = words[0] if words else ""
    else:
        seq = list(args)
        first = os.fsdecode(seq[0]) if seq else ""
    name = os.path.basename(first)
    return name if name in FORBIDDEN_PROGRAMS else None


def guarded_popen_init(original: Callable[..., None], refuse: Callable[[str], None]) -> Callable[..., None]:
    """subprocess.Popen.__init__ that refuses the forbidden programs."""

    def init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = forbidden_program(args)
        if program is not None:
            refuse(f"run {program}")
        original(self, args, *rest, **kwargs)

    return init


# Set by conftest for the duration of a fast test: mounting.py and servers.py call it first.
refuse: Callable[[str], None] | None = None


def check(what: str) -> None:
    """Called by the mount helpers and server starters: fails a fast-tier test that got here."""
    if refuse is not None:
        refuse(what)


def fast_guard(refuse_with: Callable[[str], None], setattr_: Callable[..., None],
               setenv: Callable[[str, str], None]) -> Iterator[None]:
    """What the autouse fixture does for a fast test; the MonkeyPatch it passes undoes it."""
    import sys

    setattr_(sys.modules[__name__], "refuse", refuse_with)
    setattr_(subprocess.Popen, "__init__", guarded_popen_init(subprocess.Popen.__init__, refuse_with))
    setenv("FUSE_LIBRARY_PATH", NO_FUSE)
    mfusepy = sys.modules.get("mfusepy")
    if mfusepy is not None:  # already loaded by an earlier mount test in this session
        def no_fuse(*args: Any, **kwargs: Any) -> None:
            refuse_with("mount FUSE (mfusepy.FUSE)")

        setattr_(mfusepy.FUSE, "__init__", no_fuse)
    yield
