"""The shared chunk tier: chunks kept in a directory on a filesystem every node mounts (NFS,
Filestore, Lustre, a CoreWeave shared volume), so that a chunk is fetched from the bucket once
for a whole cluster. The local :class:`ChunkCache` stays the first tier; this is the second.

The shared filesystem is the only channel between nodes: no coordinator, no protocol of ours.

- **Immutable chunks.** A chunk's file name is a hash of (object URL, version, start, size):
  once published it never changes, so readers need no lock. A chunk file is the chunk's bytes
  followed by a trailer (magic, size, checksum); it is written under a temporary name and
  renamed into place, so a name holds a whole chunk or nothing. Every read checks the size and
  the checksum before a byte is handed on: a truncated, flipped or half-evicted chunk is a miss
  (and removed), never wrong bytes.
- **Fetch once.** A node that misses takes a lease on the chunk by creating ``leases/<name>``
  with ``O_EXCL`` (atomic on local filesystems and NFSv3+), holding its holder and expiry. It
  fetches, publishes, and removes the lease. Others that miss while the lease is live wait for
  the chunk to appear; once it has expired (the holder died or is slow), one of them breaks it
  and fetches; after ``lease_ttl`` of waiting at most, a waiter fetches for itself. A lease
  saves GETs; it never guards correctness (two nodes publishing one chunk publish the same bytes).
- **Bounded size.** Publishing keeps the tier within ``limit`` as this node sees it (its last
  scan plus what it published since; scans every ``rescan`` seconds), evicting the chunks used
  longest ago (a read refreshes a chunk's mtime at most once a minute) first. Any node may
  evict: a reader that loses its chunk under it gets a short or failed read, which is a miss.
- **Never on the path to an error.** Every operation on the shared directory runs in this
  tier's own threads and is waited for ``io_timeout`` at most: a hung NFS server costs a read
  that much once, then the tier is *degraded* (skipped) for ``retry_after`` seconds and reads
  go to the bucket. A read-only or full directory keeps serving what it holds, publishing
  nothing. A directory that is gone (unmounted) is degraded the same way.
- **Trust.** Whoever can write the directory can feed every node bytes (a checksum catches
  accidents, not forgery): :func:`check_private` refuses a directory owned by another user or
  writable by group or others, and a new one is made ``0700``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import queue
import socket
import stat
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marinfs.checksums import crc32c_extend
from marinfs.errors import UsageError
from marinfs.objects import ObjectRef
from marinfs.read.chunkio import ALIGN, HAS_CRC32C, DirectIO, aligned_address, write_all
from marinfs.threadnames import name_current

log = logging.getLogger(__name__)

# A chunk file is its bytes, then this trailer: magic, the chunk's size, its checksum, and which
# checksum it is (1: CRC-32C, 0: zlib's CRC-32 where google-crc32c's C library is missing).
MAGIC = b"MFSCHNK1"
TRAILER = struct.Struct("<8sQIB3x")
CRC32C, CRC32 = 1, 0
# Errors that mean "this directory takes no writes now"; the tier still serves what it holds.
NO_WRITE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM})
TMP_MAX_AGE = 600.0  # a temporary file this old was left by a crash: gc removes it
TOUCH_EVERY = 60.0  # a read refreshes its chunk's mtime (the eviction order) at most this often


class SharedDirError(UsageError):
    """The shared directory cannot be trusted or used (one line for the user)."""


def check_private(root: Path, create: bool = True) -> None:
    """Make ``root`` if missing (0700), and refuse it unless it is a directory owned by this
    user that nobody else can write: whoever writes it feeds every node's reads."""
    try:
        if create and not root.exists():
            # Another node starting at the same moment may make it first: then it is theirs
            # to check below like any existing directory, not a failure to mount.
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(root)
    except OSError as exc:
        raise SharedDirError(f"shared cache directory {root}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SharedDirError(f"shared cache directory {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise SharedDirError(f"shared cache directory {root} is owned by uid {st.st_uid}, not this daemon's "
                             f"{os.geteuid()}: whoever owns it could feed every node bytes")
    if st.st_mode & 0o022:
        raise SharedDirError(f"shared cache directory {root} is writable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}): whoever writes it feeds every node's "
                             f"reads; chmod 700 {root}")


def chunk_name(obj: ObjectRef, start: int, size: int) -> str:
    """The name of one chunk in the tier: its object URL, version and byte range, hashed. The
    range, not an index, so that nodes cutting chunks of other sizes never share a wrong one."""
    text = f"{obj.url}\0{obj.version}\0{start}\0{size}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:40]


def shareable(obj: ObjectRef) -> bool:
    """Whether chunks of ``obj`` may be shared: its version must mean the same on every node
    (an ``unversioned`` one is a counter of this daemon's)."""
    return not str(obj.version).startswith("unversioned-")


def checksum(data: Any) -> tuple[int, int]:
    """(kind, checksum) of any buffer, in C without a copy where it can."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    if crc32c_extend is not None:
        if isinstance(data, bytes):
            return CRC32C, crc32c_extend(0, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, len(data))
        if not view.readonly and len(view):
            return CRC32C, crc32c_extend(0, ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view))
        if len(view):
            return CRC32C, crc32c_extend(0, ctypes.cast(ctypes.c_char_p(bytes(view)), ctypes.c_void_p).value,
                                         len(view))
        return CRC32C, 0
    return CRC32, zlib.crc32(view)


def _check(data: Any, kind: int, crc: int) -> bool:
    if kind == CRC32C and crc32c_extend is None:  # pragma: no cover - checked with zlib's instead
        import google_crc32c

        return google_crc32c.value(bytes(data)) == crc
    return checksum(data) == (kind, crc) if kind == CRC32C else zlib.crc32(memoryview(data).cast("B")) == crc


class _Corrupt(Exception):
    pass


@dataclass(frozen=True)
class Sound:
    """A chunk read from the tier whole and checked: its CRC-32C (None where it carries zlib's
    CRC-32), which the disk cache then keeps without a pass of its own over the bytes."""

    crc32c: int | None

    def __bool__(self) -> bool:
        return True


def crc32c_of(data: Any) -> int | None:
    """``data``'s CRC-32C, the checksum chunks are published with; None without google-crc32c's C
    library (then each writer takes zlib's CRC-32 itself)."""
    if not HAS_CRC32C:
        return None
    kind, crc = checksum(data)
    return crc if kind == CRC32C else None


class _DaemonPool:
    """Worker threads that never hold up the interpreter's exit: a thread hung in a call to a
    dead NFS server stays hung, and ThreadPoolExecutor joins its threads at exit."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._closed = False
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise RuntimeError("shut down")
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def _work(self) -> None:
        name_current()
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def shutdown(self, workers: int) -> None:
        self._closed = True
        for _ in range(workers):
            self._tasks.put(None)


@dataclass
class _State:
    """Why the tier is skipped, and until when (monotonic seconds); 0: it is not."""

    until: float = 0.0
    reason: str = ""


class SharedTier:
    """A chunk tier in ``root`` shared by every node's daemon (see the module)."""

    def __init__(self, root: Path, limit: int, *, lease_ttl: float = 10.0, io_timeout: float = 3.0,
                 retry_after: float = 30.0, rescan: float = 30.0, workers: int = 8,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, holder: str | None = None) -> None:
        self.root = Path(root)
        self.limit = limit
        self.lease_ttl = lease_ttl
        self.io_timeout = io_timeout
        self.retry_after = retry_after
        self.rescan = rescan
        self.clock, self.monotonic, self.sleep = clock, monotonic, sleep
        # Unique per daemon (a PID alone is reused, and every node has a PID 1 in a pod).
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        # O_DIRECT where the directory's filesystem takes it (its flags only go from True to
        # False), and each I/O thread's aligned scratch (_scratch).
        self._direct = DirectIO(self.root / "chunks")
        self._local = threading.local()
        self._down = _State()  # the whole tier skipped (slow, gone, failing reads)
        self._no_writes = _State()  # read-only, full, refused: served from, not published to
        self.counts = {"hits": 0, "misses": 0, "hit_bytes": 0, "published": 0, "published_bytes": 0,
                       "lease_waits": 0, "lease_timeouts": 0, "leases_broken": 0, "corrupt": 0,
                       "evicted": 0, "evicted_bytes": 0, "timeouts": 0, "errors": 0, "publish_skipped": 0}
        self._used = 0  # bytes in the tier: the last scan plus what this node published since
        self._scanned_at: float | None = None
        self._workers = workers
        self._io = _DaemonPool(workers, "shared-io")
        self._publisher = _DaemonPool(2, "shared-put")
        self._publishing = 0
        self._writing = 0  # bytes this node is writing into the tier now (not seen by a scan yet)
        self._room = threading.Lock()  # one make-room step at a time on this node
        self._slot_freed = threading.Condition(self._lock)
        self.max_publishing = max(2, workers)  # chunks waiting to be published; past that, skipped
        for sub in ("chunks", "leases", "tmp"):
            with contextlib.suppress(OSError):  # a read-only tier is still read
                (self.root / sub).mkdir(mode=0o700, exist_ok=True)

    # -- the read path's entry ---------------------------------------------------------------
    def get(self, obj: ObjectRef, start: int, end: int, fetch: Callable[[], Any],
            take: Callable[[int], memoryview]) -> tuple[Any, str]:
        """Bytes ``[start, end)`` of ``obj``: from the tier (into a buffer from ``take``), else
        from ``fetch()`` (the bucket) and published for the other nodes; nodes missing it
        together send one fetch between them. Answers (data, "shared" or "bucket"). Never raises
        for the tier's sake: only ``fetch``'s own errors come out."""
        data, source, _ = self.get_checked(obj, start, end, fetch, take)
        return data, source

    def get_checked(self, obj: ObjectRef, start: int, end: int, fetch: Callable[[], Any],
                    take: Callable[[int], memoryview]) -> tuple[Any, str, int | None]:
        """``get``, and the chunk's CRC-32C where it was taken on the way (checked as it was
        read from the tier, or taken to publish it): the disk cache keeps it without taking it
        again. None where it was not (or the tier uses zlib's CRC-32)."""
        size = end - start
        if size <= 0 or not shareable(obj) or not self.usable():
            return fetch(), "bucket", None
        name = chunk_name(obj, start, size)
        found = self._lookup(name, size, take)
        if found is not None:
            return found[0], "shared", found[1]
        if not self.writable():
            return fetch(), "bucket", None
        deadline = self.monotonic() + self.lease_ttl
        delay = 0.002
        first = True
        while True:
            mine = self._call(self._take_lease, name)
            if mine is None:  # the tier failed us just now: the bucket
                return fetch(), "bucket", None
            if mine:
                # Another node may have published it and let its lease go since our last look.
                found = self._lookup(name, size, take, count=False)
                if found is not None:
                    self._call(self._release, name)
                    return found[0], "shared", found[1]
                data, crc = self._fetch_and_publish(name, fetch, leased=True)
                return data, "bucket", crc
            if first:
                first = False
                self._count("lease_waits")
            if self.monotonic() >= deadline:
                self._count("lease_timeouts")
                log.info("shared chunk %s: lease still held after %.1f s; fetching it here", name, self.lease_ttl)
                data, crc = self._fetch_and_publish(name, fetch, leased=False)
                return data, "bucket", crc
            self.sleep(delay)
            delay = min(delay * 2, 0.02)
            found = self._lookup(name, size, take, count=False)
            if found is not None:
                return found[0], "shared", found[1]
            if not self.usable():
                return fetch(), "bucket", None

    def _fetch_and_publish(self, name: str, fetch: Callable[[], Any], leased: bool) -> tuple[Any, int | None]:
        try:
            data = fetch()
        except BaseException:
            if leased:
                self._call(self._release, name)
            raise
        # Taken here once for both copies, the tier's and the disk cache's (a pass over 8 MiB:
        # about a millisecond), where each writer took its own before.
        crc = crc32c_of(data) if self.writable() else None
        self.publish(name, data, leased=leased, crc32c=crc)
        return data, crc

    # -- state -------------------------------------------------------------------------------
    def usable(self) -> bool:
        return self.monotonic() >= self._down.until

    def writable(self) -> bool:
        return self.usable() and self.monotonic() >= self._no_writes.until

    def _degrade(self, state: _State, reason: str) -> None:
        with self._lock:
            first = state.until <= self.monotonic()
            state.until = self.monotonic() + self.retry_after
            state.reason = reason
        if first:
            log.warning("shared cache tier %s: %s; reads go to the bucket for %.0f s", self.root, reason,
                        self.retry_after)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the tier's threads, waited for ``io_timeout`` at most. None when it
        failed or took too long (the tier is degraded then); its own answer otherwise."""
        try:
            future = self._io.submit(fn, *args)
        except RuntimeError:  # shut down
            return None
        what = fn.__name__.strip("_").replace("_", " ")
        try:
            return future.result(timeout=self.io_timeout)
        except FutureTimeout:
            self._count("timeouts")
            self._degrade(self._down, f"slow: {what} took over {self.io_timeout:g} s")
        except OSError as exc:
            self._failed(what, exc, writing=fn.__name__ in ("_take_lease", "_write_chunk", "_release"))
        except Exception as exc:  # noqa: BLE001 - the tier never fails a read
            self._count("errors")
            log.exception("shared cache tier: %s", what)
            self._degrade(self._down, f"{what} failed: {exc}")
        return None

    def _failed(self, what: str, exc: OSError, writing: bool) -> None:
        self._count("errors")
        if writing and exc.errno in NO_WRITE_ERRNOS:
            self._degrade(self._no_writes, f"takes no writes ({os.strerror(exc.errno)})")
        else:
            self._degrade(self._down, f"{what} failed: {exc.strerror or exc}")

    # -- chunks ------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        return self.root / "chunks" / name[:2] / name

    def _lookup(self, name: str, size: int, take: Callable[[int], memoryview],
                count: bool = True) -> tuple[Any, int | None] | None:
        """(the chunk in a buffer from ``take``, its CRC-32C if it carries one) or None."""
        buf = take(size)
        got = self._call(self._read_chunk, name, buf)
        if got:
            self._count("hits")
            self._count("hit_bytes", size)
            return buf, getattr(got, "crc32c", None)
        if count and got is not None:
            self._count("misses")
        return None

    def _read_chunk(self, name: str, buf: memoryview) -> Sound | bool:
        """Fill ``buf`` with chunk ``name``: a ``Sound`` if it was there whole and checked, False
        if the tier has no sound copy of it. A copy of the wrong size or checksum is removed (it
        is fetched and published again)."""
        path = self._path(name)
        try:
            fd = self._direct.open_for_read(path)
        except (FileNotFoundError, NotADirectoryError):
            if not (self.root / "chunks").is_dir():
                raise FileNotFoundError(errno.ENOENT, "the shared directory is gone", str(self.root)) from None
            return False
        try:
            st = os.fstat(fd)
            size = len(buf)
            try:
                if st.st_size != size + TRAILER.size:
                    raise _Corrupt(f"{st.st_size} bytes, not {size + TRAILER.size}")
                tail = self._read_into(fd, buf)
                magic, length, crc, kind = TRAILER.unpack(tail)
                if magic != MAGIC or length != size:
                    raise _Corrupt("no trailer")
                if not _check(buf, kind, crc):
                    raise _Corrupt("checksum mismatch")
            except _Corrupt as exc:
                self._count("corrupt")
                log.warning("shared chunk %s is damaged (%s): removed, fetched again", path, exc)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                return False
            except OSError as exc:
                if exc.errno in (errno.ESTALE, errno.ENOENT):  # evicted by another node under us
                    return False
                raise
            if self.clock() - st.st_mtime > TOUCH_EVERY:  # keep it from eviction: used lately
                with contextlib.suppress(OSError):
                    os.utime(fd)
            return Sound(crc if kind == CRC32C else None)
        finally:
            os.close(fd)

    def _read_into(self, fd: int, buf: memoryview) -> bytes:
        """Read the chunk file open at ``fd`` (``len(buf)`` bytes, then the trailer) with one
        ``preadv``: the bytes straight into ``buf``, the trailer answered. With ``O_DIRECT`` (the
        descriptor has it where the filesystem takes it) the block-aligned bulk lands in ``buf``
        (a pooled, page-aligned buffer) from the disk or the server with no copy in the page
        cache, and the last partial block with the trailer in this thread's aligned scratch."""
        size = len(buf)
        direct = bool(os.O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        if direct and aligned_address(buf) is not None:
            bulk = size - size % ALIGN
            scratch = self._scratch()
            try:
                got = os.preadv(fd, [buf[:bulk], scratch] if bulk else [scratch], 0)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct.read_direct = False  # this filesystem refuses our O_DIRECT reads
                log.info("shared cache tier %s: no O_DIRECT reads (%s); buffered", self.root, exc)
            else:
                if got != size + TRAILER.size:
                    raise _Corrupt(f"read {got} bytes of {size + TRAILER.size}")
                rest = size - bulk
                if rest:
                    buf[bulk:] = scratch[:rest]
                return bytes(scratch[rest:rest + TRAILER.size])
        if direct:  # an unaligned buffer (no pool): the same file read through the page cache
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        tail = bytearray(TRAILER.size)
        got = os.preadv(fd, [buf, tail], 0)
        if got != size + TRAILER.size:
            raise _Corrupt(f"read {got} bytes of {size + TRAILER.size}")
        return bytes(tail)

    def _scratch(self) -> memoryview:
        """This thread's page-aligned two pages: a chunk's last partial block and its trailer
        (less than a block of data and 24 bytes) under O_DIRECT."""
        view = getattr(self._local, "scratch", None)
        if view is None:
            view = self._local.scratch = memoryview(mmap.mmap(-1, 2 * ALIGN))
        return view

    def publish(self, name: str, data: Any, leased: bool = False, crc32c: int | None = None) -> None:
        """Write chunk ``name`` into the tier in the background (then let its lease go, so the
        nodes waiting for it find it). When ``max_publishing`` chunks wait already, the caller
        (a fetch) waits for a slot, ``io_timeout`` at most: a node fetches no faster than the
        shared directory takes what it fetched (skipping would send every other node to the
        bucket for it). Past that, skipped, and the lease let go. ``crc32c``: the chunk's, if
        the caller took it already."""
        busy = not self.writable()
        if not busy:
            with self._slot_freed:
                busy = not self._slot_freed.wait_for(lambda: self._publishing < self.max_publishing,
                                                     self.io_timeout)
                if not busy:
                    self._publishing += 1
        if busy:
            self._count("publish_skipped")
            if leased:
                self._call(self._release, name)
            return
        try:
            self._publisher.submit(self._publish, name, data, leased, crc32c)
        except RuntimeError:  # shut down
            with self._lock:
                self._publishing -= 1
                self._slot_freed.notify()
            if leased:
                self._call(self._release, name)

    def _publish(self, name: str, data: Any, leased: bool, crc32c: int | None = None) -> None:
        size = len(data) + TRAILER.size
        room = False
        try:
            room = self._make_room(size)
            if room and self._call(self._write_chunk, name, data, crc32c):
                self._count("published")
                self._count("published_bytes", len(data))
        except OSError as exc:  # the scan, here (it may take long on a big tier: no timeout)
            self._failed("making room", exc, writing=True)
        finally:
            with self._lock:
                if room:
                    self._writing -= size
                self._publishing -= 1
                self._slot_freed.notify()
            if leased:
                self._call(self._release, name)

    def _write_chunk(self, name: str, data: Any, crc32c: int | None = None) -> bool:
        """Write chunk ``name`` under a temporary name and rename it into place. The bulk goes
        with ``O_DIRECT`` from the buffer it was fetched into (chunkio's ``DirectIO``, the disk
        cache's writer: buffered where the filesystem refuses it, and for any other buffer):
        no copy into the page cache, no dirty pages for writeback to throttle the next fetch
        on. Not synced: a chunk a crash left short or wrong fails its size or checksum check
        and is fetched again."""
        size = len(data)
        final = self._path(name)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = self.root / "tmp" / f"{name}.{self.holder.replace(':', '_').replace('/', '_')}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            c = HAS_CRC32C and crc32c_extend is not None
            # Only from a page-aligned buffer: any other would be copied into an aligned one first.
            direct = self._direct.write_direct and aligned_address(memoryview(data).cast("B")) is not None
            crc = self._direct.write(fd, data, c, direct=direct, crc=crc32c if c else None)
            write_all(fd, memoryview(TRAILER.pack(MAGIC, size, crc, CRC32C if c else CRC32)), size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)  # a whole chunk under its name, or nothing
        with self._lock:
            self._used += size + TRAILER.size  # (its reservation in _writing is let go by _publish)
        return True

    # -- leases ------------------------------------------------------------------------------
    def _lease_path(self, name: str) -> Path:
        return self.root / "leases" / name

    def _take_lease(self, name: str) -> bool:
        """True if this node now holds the lease on ``name``; False if a live one is held. An
        expired lease is broken (moved aside; put back if it turns out to be a fresh one)."""
        path = self._lease_path(name)
        body = json.dumps({"holder": self.holder, "expires": self.clock() + self.lease_ttl}).encode()
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                seen = self._lease_body(path)
                if seen is None or not self._expired(seen):
                    return False
                if not self._break(path, seen[0]):
                    return False
                continue
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            return True
        return False

    def _lease_body(self, path: Path) -> tuple[bytes, float] | None:
        """(the lease's bytes, when it expires) or None if it is gone."""
        try:
            with open(path, "rb") as f:
                raw = f.read(4096)
                mtime = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        try:
            return raw, float(json.loads(raw)["expires"])
        except (ValueError, KeyError, TypeError):  # created, not yet written (or its writer died)
            return raw, mtime + self.lease_ttl

    def _expired(self, seen: tuple[bytes, float]) -> bool:
        return self.clock() >= seen[1]

    def _break(self, path: Path, stale: bytes) -> bool:
        """Remove the expired lease whose bytes are ``stale``. It is moved to a name of ours
        first: if what we moved is another, fresh lease (taken since we looked), it is put back."""
        aside = self.root / "tmp" / f"{path.name}.lease.{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return True  # gone meanwhile: try to create it
        try:
            moved = aside.read_bytes()
        except OSError:
            moved = b""
        if moved != stale:
            with contextlib.suppress(OSError):
                os.link(aside, path)  # fails if yet another was taken: then that one stands
            with contextlib.suppress(OSError):
                os.unlink(aside)
            return False
        with contextlib.suppress(OSError):
            os.unlink(aside)
        self._count("leases_broken")
        log.info("shared chunk %s: broke an expired lease (%s)", path.name, stale[:200].decode(errors="replace"))
        return True

    def _release(self, name: str) -> None:
        path = self._lease_path(name)
        seen = self._lease_body(path)
        try:
            holder = json.loads(seen[0]).get("holder") if seen is not None else None
        except (ValueError, AttributeError):
            holder = None
        if holder == self.holder:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- size --------------------------------------------------------------------------------
    def _make_room(self, size: int) -> bool:
        """Reserve ``size`` bytes within the limit, evicting to make them fit (as this node sees
        the tier: rescanned when the last scan is older than ``rescan``). False: it never fits."""
        if size > self.limit:
            return False
        with self._room:
            now = self.monotonic()
            with self._lock:
                fresh = self._scanned_at is not None and now - self._scanned_at < self.rescan
                if fresh and self._used + self._writing + size <= self.limit:
                    self._writing += size
                    return True
            self.evict(self.limit - size)
            with self._lock:
                self._writing += size
            return True

    def scan(self) -> list[tuple[float, int, str]]:
        """Every chunk file: (mtime, size, path); the tier's size noted."""
        found = []
        for shard in os.scandir(self.root / "chunks"):
            if not shard.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(shard.path):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime, st.st_size, entry.path))
        with self._lock:
            self._used = sum(f[1] for f in found)
            self._scanned_at = self.monotonic()
        return found

    def evict(self, target: int) -> int:
        """Remove the chunks used longest ago until the tier holds ``target`` bytes at most (a
        tenth of the limit lower, so that not every publish scans); answers the bytes removed.
        Safe while others read: a chunk removed under a reader is a miss for it."""
        found = self.scan()
        with self._lock:
            used = sum(f[1] for f in found) + self._writing  # this node's writes under way count
        if used <= target:
            return 0
        goal = max(0, min(target, self.limit - self.limit // 10))
        removed = 0
        for _, size, path in sorted(found):
            if used - removed <= goal:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another node evicted it
            removed += size
            self._count("evicted")
            self._count("evicted_bytes", size)
        with self._lock:
            self._used = max(0, sum(f[1] for f in found) - removed)
        return removed

    def gc(self) -> dict[str, int]:
        """What a timer runs on one node (`marinfs cache gc --shared`): evict down to the
        limit, remove temporary files left by crashes and leases long expired."""
        removed = self.evict(self.limit)
        tmps = leases = 0
        now = self.clock()
        for entry in os.scandir(self.root / "tmp"):
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat(follow_symlinks=False).st_mtime > TMP_MAX_AGE:
                    os.unlink(entry.path)
                    tmps += 1
        for entry in os.scandir(self.root / "leases"):
            seen = self._lease_body(Path(entry.path))
            if seen is not None and now > seen[1] + self.lease_ttl:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    leases += 1
        with self._lock:
            used = self._used
        return {"evicted_bytes": removed, "used_bytes": used, "limit_bytes": self.limit, "tmp_removed": tmps,
                "leases_removed": leases}

    def check_invariants(self) -> None:
        """INVARIANT (one node's view, after its publishes settled): the tier holds at most
        ``limit`` bytes."""
        used = sum(f[1] for f in self.scan())
        assert used <= self.limit, f"shared tier holds {used} bytes, limit {self.limit}"

    # -- reporting ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = self.monotonic()
        with self._lock:
            out: dict[str, Any] = {"dir": str(self.root), "limit": self.limit, "used_estimate": self._used,
                                   **self.counts}
            if self._down.until > now:
                out["state"], out["reason"] = "degraded", self._down.reason
            elif self._no_writes.until > now:
                out["state"], out["reason"] = "read-only", self._no_writes.reason
            else:
                out["state"] = "ok"
        return out

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until every publish queued has finished (tests, unmount)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._publishing:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Publish what is queued (for a bounded time), then stop the threads; one hung on the
        directory stays hung, and does not hold up the daemon's exit."""
        self.settle(max(1.0, 2 * self.io_timeout))
        self._publisher.shutdown(2)
        self._io.shutdown(self._workers)

