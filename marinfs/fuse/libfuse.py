"""Which libfuse 3 the binding loads: the newest one installed.

mfusepy loads whatever ``find_library("fuse3")`` answers, which on a machine with two of them
(Debian 12's 3.14 and a 3.17 built from source, ``make libfuse``) is the first one the linker's
cache lists. 3.17 and later can pass a file through to the kernel (fuse_ops.py), so the newest
soname that loads wins; ``FUSE_LIBRARY_PATH`` set by the caller is left alone.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess


def pick_libfuse() -> None:
    if os.environ.get("FUSE_LIBRARY_PATH"):
        return
    for path in candidates():
        try:
            ctypes.CDLL(path)
        except OSError:
            continue  # another architecture's, or broken
        os.environ["FUSE_LIBRARY_PATH"] = path
        return


def candidates() -> list[str]:
    """The libfuse 3 libraries the linker's cache knows, newest soname first."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = re.findall(r"libfuse3\.so\.(\d+) \([^)]*\) => (\S+)", out)
    return [path for _, path in sorted(found, key=lambda item: -int(item[0]))]
