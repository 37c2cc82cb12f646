"""The cache directory's layout and ownership, in one place: where chunks, data files, staged
writes and the last run's counters live, how a chunk's record is named, and the lock that gives
the directory to one daemon. It exists apart from the chunk cache because the daemon, `marinfs
cache` (`cachecli.py`) and `marinfs status` read the directory without building a
``ChunkCache``, and a second copy of the names would drift. It keeps no table in memory; the
one lock is an ``flock`` on ``<cache>/lock``, held by the daemon for its lifetime
(``acquire_lock``) and only tested by everyone else (``lock_holder``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from marinfs.errors import UsageError


# The cache directory's layout (the daemon, `marinfs cache` and `status` use it):
# data/<2 hex>/<object id> (a version's chunks at their offsets, sparse), chunks/<2 hex>/<object
# id>-<index>-<crc>+<offset>+<size> (empty: the record that a chunk is there; older daemons'
# chunk files have no "+" and hold the chunk), staging/ (staged writes and journals, never a
# cache: unsaved data), lock (the daemon's PID, flocked), stats.json (the daemon's counters).
def chunks_dir(cache_dir: Path) -> Path:
    return cache_dir / "chunks"


def data_dir(cache_dir: Path) -> Path:
    return cache_dir / "data"


def staging_dir(cache_dir: Path) -> Path:
    return cache_dir / "staging"


def stats_file(cache_dir: Path) -> Path:
    return cache_dir / "stats.json"


def data_file(data: Path, object_id: str) -> Path:
    """The data file of version ``object_id`` under ``data`` (``data_dir``)."""
    return data / object_id[:2] / object_id


def record_name(object_id: str, index: int, crc: int, c: bool, offset: int, size: int) -> str:
    """The name of the record of chunk ``index`` of a version: its checksum (``c``: CRC-32C,
    written with a "c"; else zlib's CRC-32), and where its bytes are in the data file."""
    return f"{object_id}-{index}-{'c' if c else ''}{crc:08x}+{offset}+{size}"


def parse_record(name: str) -> tuple[str, int, int, bool, int, int]:
    """(object id, index, checksum, CRC-32C?, offset, size) of a record's name (``record_name``);
    ValueError for an older daemon's chunk file, which does not say the chunk size it was cut
    with, and for anything else that is no record."""
    object_id, index, rest = name.rsplit("-", 2)
    crc, _, place = rest.partition("+")
    if not place:
        raise ValueError("an older daemon's chunk file, of a chunk size it does not say")
    c = len(crc) == 9 and crc[0] == "c"  # zlib CRC-32 names are 8 hex digits, never 9
    offset, size = (int(v) for v in place.split("+"))
    return object_id, int(index), int(crc[1:] if c else crc, 16), c, offset, size


def unfinished(name: str) -> bool:
    return name.startswith("tmp")  # a chunk write that never finished (tempfile prefix)


def chunk_size_of(name: str, path: Path) -> int:
    """How many bytes of chunk the record ``name`` (at ``path``) stands for."""
    _, _, place = name.rpartition("-")[2].partition("+")
    return int(place.split("+")[1]) if place else path.stat().st_size


def disk_usage(cache_dir: Path) -> tuple[int, int]:
    """(chunks, bytes) of the chunks recorded under ``cache_dir``, daemon or not."""
    chunks = total = 0
    root = chunks_dir(cache_dir)
    if root.is_dir():
        for sub in root.iterdir():
            for path in sub.iterdir() if sub.is_dir() else ():
                if not unfinished(path.name):
                    try:
                        total += chunk_size_of(path.name, path)
                    except (ValueError, IndexError, OSError):
                        continue
                    chunks += 1
    return chunks, total


def wipe(cache_dir: Path) -> int:
    """Delete every chunk and the last run's counters (never the staging directory); answers
    how many chunks there were. The caller makes sure no daemon uses the directory."""
    chunks, _ = disk_usage(cache_dir)
    shutil.rmtree(chunks_dir(cache_dir), ignore_errors=True)
    shutil.rmtree(data_dir(cache_dir), ignore_errors=True)
    stats_file(cache_dir).unlink(missing_ok=True)
    return chunks


def acquire_lock(cache_dir: Path) -> int:
    """Take the cache directory's lock, or fail with the PID that holds it."""
    path = cache_dir / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UsageError(f"cache directory {cache_dir} is in use by marinfs PID {holder}; "
                         f"give this mount its own --cache-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def lock_holder(cache_dir: Path) -> int | None:
    """The PID of the daemon using ``cache_dir``, or None when it is free."""
    path = cache_dir / "lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
