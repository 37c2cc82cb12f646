"""Small files fetched ahead of a walker that reads a directory's files in name order.

``find | xargs cat``, ``tar -c``, ``cp -r``, ``rsync`` and a tokenizer loading its files open one
file after the next, in the order a listing gives them, and read each whole: on an object store
every small file then costs one first-byte latency in turn (52 ms a file behind 30 ms before).
Once a handle opens the file that follows the one opened before it in the same directory (by the
directory's cached listing, files only), the next files are fetched ahead, a window of ``first``
files that doubles up to ``most`` while the walk goes on; any other open in that directory ends
the window. A single file polled again and again, or files opened at random, start nothing.

Only files of ``small`` bytes at most are fetched (1 MiB: a bigger file has its own readahead once
read, and a tool that opens each file to read its header wastes a window of them at most), one
GET each, into the mount's memory budget without being held for anyone: a chunk fetched ahead
that memory lets go before its walker came is read from the disk cache. A chunk already in
memory, under way or on disk is not fetched again. At most ``in_flight`` fetches run at once,
for every walker together (ChunkFetcher.fetch_ahead), so a walk never takes the workers that big
files' readahead needs; what found no room is asked for at a later open.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from cachetools import TTLCache

from marinfs.objects import ObjectInfo


@dataclass
class _Walk:
    """One directory's walk: the files of its listing in name order, and where the walker is."""

    last: str  # the key opened last
    files: list[ObjectInfo] | None = None  # the listing's files in name order, taken once
    at: dict[str, int] = field(default_factory=dict)  # key -> its place in ``files``
    window: int = 0  # files fetched ahead of the walker; 0: not a walk (yet)
    issued: int = -1  # the last place asked for ahead


class WalkAhead:
    """Per directory, where a walker is; asks ``fetch`` for the files ahead of it.

    ``listing(dir)`` answers the directory's cached listing (None if there is none: nothing is
    fetched); ``fetch(info)`` starts fetching one file and answers False when it found no room
    (the rest of the window waits for the next open)."""

    def __init__(self, listing: Callable[[str], list[ObjectInfo] | None], fetch: Callable[[ObjectInfo], bool],
                 small: int, ttl: float, first: int = 4, most: int = 32) -> None:
        self._listing, self._fetch = listing, fetch
        self.small, self.first, self.most = small, first, most
        self._lock = threading.Lock()
        # Directory -> its walk, for a listing's lifetime: the files it took are as fresh as that.
        self._walks: TTLCache[str, _Walk] = TTLCache(1024, ttl)

    def opened(self, info: ObjectInfo) -> None:
        """A handle opened ``info`` (a file) to read it: fetch the files after it if it follows
        the one opened before it in its directory."""
        key = info.name
        parent = posixpath.dirname(key)
        with self._lock:
            walk = self._walks.get(parent)
            if walk is None:
                self._walks[parent] = _Walk(last=key)
                return
            last, walk.last = walk.last, key
            if walk.files is None:
                children = self._listing(parent)
                if children is None:
                    return
                walk.files = sorted((c for c in children if not c.is_dir and not c.link), key=lambda c: c.name)
                walk.at = {c.name: i for i, c in enumerate(walk.files)}
            here, before = walk.at.get(key), walk.at.get(last)
            if here is None or before is None or not before < here <= before + 1 + walk.window:
                walk.window, walk.issued = 0, -1  # not the next file (give or take those fetched ahead)
                return
            walk.window = min(self.most, max(self.first, 2 * walk.window))
            start = max(here, walk.issued) + 1
            ahead = walk.files[start:here + 1 + walk.window]
        issued = start - 1
        for info_ in ahead:
            if 0 < info_.size <= self.small and info_.version is not None and not self._fetch(info_):
                break
            issued += 1
        with self._lock:
            walk.issued = max(walk.issued, issued)
