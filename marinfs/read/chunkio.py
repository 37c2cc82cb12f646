"""A chunk's bytes in its version's data file: the checksum its record carries (CRC-32C in C,
taken at a buffer's address without a copy or the interpreter lock; zlib's CRC-32 where
google-crc32c is missing), writes with ``O_DIRECT`` from a page-aligned buffer, whole reads
that check the checksum, and how much one readahead advice reads. It exists apart from the chunk
cache's bookkeeping so that the system calls and their fallbacks, measured for speed, can be
read and changed without the index around them. No lock guards anything here: ``DirectIO``'s
two flags only ever go from True to False, set by whichever thread meets ``EINVAL`` (a write or
open racing it tries ``O_DIRECT`` once more and falls back the same way), and each writing
thread has an aligned buffer of its own (thread-local).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from marinfs.checksums import crc32c_extend

try:  # CRC-32C in C with the CPU's crc32 instruction (google-crc32c, which gcsfs installs)
    import google_crc32c

    _crc32c: Callable[[bytes], int] | None = google_crc32c.value if google_crc32c.implementation == "c" else None
except ImportError:  # pragma: no cover - then chunks keep zlib CRC-32 names
    _crc32c = None

HAS_CRC32C = _crc32c is not None  # new chunks are named for CRC-32C; without it, "c" records are fetched again

# google-crc32c's C ``crc32c_extend(crc, pointer, length)`` (checksums.py): checksums any memory,
# such as the aligned buffer a chunk is written from, without a copy into a ``bytes``, and
# without the interpreter lock.
_crc32c_extend = crc32c_extend if _crc32c is not None else None

log = logging.getLogger("marinfs.read.chunkcache")  # one name for the chunk cache's lines, as before its split
Buffer = Any  # anything with the buffer protocol: bytes, obstore's Bytes

ALIGN = 4096  # O_DIRECT wants block-aligned sizes and buffers; 4 KiB suits every common disk


def checksum(data: Buffer, c: bool) -> int:
    """The checksum a chunk name carries: CRC-32C (``c`` names) or zlib's CRC-32 (older names)."""
    if c:
        if _crc32c is None:
            raise LookupError("no CRC-32C here")
        return _crc32c(data if isinstance(data, bytes) else bytes(data))
    return zlib.crc32(data)


def checksum_at(view: memoryview, size: int, c: bool) -> int:
    """The checksum of ``view[:size]``, a writable buffer: CRC-32C taken at its address where
    the C library is there (no copy, the GIL released), else through ``checksum``."""
    if c and _crc32c_extend is not None:
        return _crc32c_extend(0, ctypes.addressof(ctypes.c_char.from_buffer(view)), size)
    return checksum(view[:size], c)


def aligned_address(view: memoryview) -> int | None:
    """Where a writable, contiguous buffer starts, if that is page-aligned (what O_DIRECT
    needs: a pooled buffer from buffers.py is); None for anything else (``bytes``, obstore's
    ``Bytes``: read-only, copied into an aligned buffer first)."""
    if view.readonly or not view.c_contiguous or not view.nbytes:
        return None
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return addr if addr % mmap.PAGESIZE == 0 else None


def write_all(fd: int, view: memoryview, offset: int = 0) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def read_whole(path: Path, offset: int, size: int, crc: int, c: bool) -> bytes | None:
    """The ``size`` bytes of a chunk at ``offset`` of data file ``path`` if they are all there
    and match its checksum ``crc`` (CRC-32C if ``c``), else None."""
    with open(path, "rb", buffering=0) as f:
        data = os.pread(f.fileno(), size, offset)
    if len(data) != size or checksum(data, c) != crc:
        return None
    return data


def readahead_limit(path: Path) -> int:
    """The most one POSIX_FADV_WILLNEED reads on the disk ``path`` is on: the kernel
    (force_page_cache_ra) caps it at the larger of the device's largest request
    (``max_sectors_kb``) and its ``read_ahead_kb``. 128 KiB, the default read_ahead_kb, where
    sysfs does not say (tmpfs, a filesystem on no single block device)."""
    try:
        dev = os.stat(path).st_dev
        block = Path(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
        queue = block / "queue" if (block / "queue").is_dir() else block.parent / "queue"  # a partition's disk
        kib = max(int((queue / name).read_text()) for name in ("max_sectors_kb", "read_ahead_kb"))
    except (OSError, ValueError):
        kib = 0
    return max(128, kib) << 10


class DirectIO:
    """``O_DIRECT`` on the cache's filesystem: whether it takes it, for writes and for reads, and
    each writing thread's page-aligned buffer.

    Chunks are written with O_DIRECT where the filesystem allows it. Buffered writes of a cold
    read's 1 GiB dirty the page cache faster than writeback drains it, and the kernel then
    throttles every writer to the disk's writeback speed: measured here, 4.4 GB/s for the first
    ~800 MiB, then 400 MiB/s, which capped cold reads. O_DIRECT writes ran at 1.7-2.0 GB/s
    sustained, and the page cache is left to the FUSE files themselves (no second copy of every
    chunk in memory). A chunk handed over in a writable page-aligned buffer (the fetcher's
    pooled buffers, buffers.py) is written from that buffer and checksummed at its address; any
    other buffer is copied into the writing thread's aligned buffer first. The file is the same
    either way.
    """

    def __init__(self, where: Path) -> None:
        self.where = where  # the chunks directory, as the log names the cache
        self.write_direct = hasattr(os, "O_DIRECT")  # False once a write met EINVAL: buffered from then on
        self.read_direct = self.write_direct  # likewise for reads (open_for_read)
        self.aligned = threading.local()  # .buf, .addr: this thread's aligned buffer, made at its first copy

    def open_for_read(self, path: Path) -> int:
        """A read-only descriptor of ``path``, with O_DIRECT where the filesystem takes it."""
        if self.read_direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.read_direct = False  # this filesystem has no O_DIRECT: buffered from now on
        return os.open(path, os.O_RDONLY)

    def write(self, fd: int, data: Buffer, c: bool, direct: bool, offset: int = 0, crc: int | None = None) -> int:
        """All of ``data`` to ``fd`` at ``offset``: the block-aligned bulk with O_DIRECT (from an
        aligned buffer, as it requires: ``data`` itself when it is a writable page-aligned
        buffer, such as the pooled buffer a chunk was fetched into, else a copy in this thread's
        aligned buffer), the tail and any filesystem without O_DIRECT buffered. Answers the
        checksum of what was written (CRC-32C if ``c``), taken at the aligned buffer's address
        where it can be (ctypes releases the GIL): any buffer is checksummed without a copy more.
        ``crc``: that checksum, already known (a chunk the shared tier checked as it read it):
        answered as it is, not taken again."""
        view = memoryview(data)
        bulk = len(view) - len(view) % ALIGN if direct and offset % ALIGN == 0 else 0
        known = crc
        if bulk:
            addr = aligned_address(view)
            if addr is not None:  # a pooled buffer (buffers.py): written from where it is
                src = view
            else:
                buf = getattr(self.aligned, "buf", None)
                if buf is None or len(buf) < bulk:
                    buf = self.aligned.buf = mmap.mmap(-1, max(bulk, 8 << 20))  # page-aligned
                    self.aligned.addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
                buf[:bulk] = view[:bulk]
                src, addr = memoryview(buf), self.aligned.addr
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                write_all(fd, src[:bulk], offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.write_direct = False  # this filesystem does not do O_DIRECT: buffered from now on
                log.info("chunk cache %s: no O_DIRECT (%s); buffered writes", self.where, exc)
                bulk = 0
            finally:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            if bulk and c and _crc32c_extend is not None and known is None:
                crc = _crc32c_extend(0, addr, bulk)
                tail = view[bulk:].tobytes()
                crc = _crc32c_extend(crc, tail, len(tail)) if tail else crc
        write_all(fd, view[bulk:], offset + bulk)
        if known is not None:
            return known
        if crc is None and c and not bulk and view.nbytes and not view.readonly and view.c_contiguous:
            crc = checksum_at(view, view.nbytes, c)  # written buffered (a random read's): no copy either
        return crc if crc is not None else checksum(data, c)
