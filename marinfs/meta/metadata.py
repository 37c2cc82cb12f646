"""Stat and listing cache with TTLs, a negative cache, and immutable paths.

A listing fills the stat cache, so ``ls -l`` of N objects costs one LIST per 1,000 and no HEADs.
Our own writes invalidate what they change, so the writing node reads its writes at once; other
nodes see them when their TTL expires. Files under an ``immutable`` glob (checkpoint steps,
versioned artifacts: objects that never change once written) keep their stat until evicted.
"""

from __future__ import annotations

import itertools
import posixpath
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from cachetools import LRUCache, TTLCache

from marinfs.objects import ObjectInfo


def compile_glob(pattern: str) -> re.Pattern[str]:
    """A path glob relative to the mount root: ``*`` and ``?`` stay within one path component,
    ``**`` spans any number of them (``checkpoints/*/step-*/**``)."""
    out, i = [], 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


class MetadataCache:
    """Thread-safe caches of stats, listings and known-missing keys.

    ``timer`` is injectable so TTL tests need no sleeps. A TTL of 0 disables that cache.
    """

    def __init__(self, ttl: float = 5.0, negative_ttl: float = 1.0, list_ttl: float | None = None,
                 immutable: Sequence[str] = (), maxsize: int = 200_000,
                 timer: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self.list_ttl = ttl if list_ttl is None else list_ttl
        self._immutable = [compile_glob(g) for g in immutable]
        self._stats: TTLCache[str, ObjectInfo] = TTLCache(maxsize, ttl or 1e-9, timer=timer)
        self._pinned: LRUCache[str, ObjectInfo] = LRUCache(maxsize)
        # A listing maps child key -> stat, so a name absent from a fresh listing is known
        # missing at no cost; our own mkdir/commits update it in place (same expiry).
        self._listings: TTLCache[str, dict[str, ObjectInfo]] = TTLCache(
            max(1, maxsize // 10), self.list_ttl or 1e-9, timer=timer)
        self._missing: TTLCache[str, bool] = TTLCache(maxsize, negative_ttl or 1e-9, timer=timer)
        self._timer = timer
        self._listed_at: LRUCache[str, float] = LRUCache(max(1, maxsize // 10))  # when each listing was cached
        # Whether a key was a directory when last seen, kept past every TTL: a hint that makes
        # revalidating a known directory one request instead of two.
        # (And whether it was a symbolic link: revalidating one asks for its link object first.)
        self._was_dir: LRUCache[str, str] = LRUCache(maxsize)
        # Directory -> tokens of its listings in flight that no local change has overtaken yet
        # (see begin_listing). Entries live only while a listing is in flight.
        self._fetching: dict[str, set[int]] = {}
        # A listing's token -> our own changes in its directory since it was sent, whose outcome
        # we know (a commit's stat; None: a name we removed): laid over its answer, which may
        # predate them (see end_listing). Entries live only while a listing is in flight.
        self._own_since: dict[int, dict[str, ObjectInfo | None]] = {}
        # Key -> tokens of its stats in flight that no local change of it has overtaken yet
        # (see begin_stat). Entries live only while a stat is in flight.
        self._stating: dict[str, set[int]] = {}
        self._tokens = itertools.count(1)

    def was_dir(self, key: str) -> bool:
        with self._lock:
            return self._was_dir.get(key) == "dir"

    def was_link(self, key: str) -> bool:
        with self._lock:
            return self._was_dir.get(key) == "link"

    def is_immutable(self, key: str) -> bool:
        return any(p.match(key) for p in self._immutable)

    def get_stat(self, key: str) -> ObjectInfo | None:
        with self._lock:
            return self._pinned.get(key) or self._stats.get(key)

    def is_missing(self, key: str) -> bool:
        with self._lock:
            return self._missing.get(key, False)

    def _put_locked(self, info: ObjectInfo) -> None:
        self._was_dir[info.name] = "dir" if info.is_dir else "link" if info.link else "file"
        if not info.is_dir and self._immutable and self.is_immutable(info.name):
            self._pinned[info.name] = info
            # Its directories exist as long as it does: resolving its path costs nothing either.
            parent = posixpath.dirname(info.name)
            while parent and parent not in self._pinned:
                self._pinned[parent] = ObjectInfo(name=parent, is_dir=True)
                parent = posixpath.dirname(parent)
        elif self.ttl > 0:
            self._stats[info.name] = info
        self._missing.pop(info.name, None)

    def put_stat(self, info: ObjectInfo) -> None:
        with self._lock:
            self._put_locked(info)

    def put_missing(self, key: str) -> None:
        with self._lock:
            self._put_missing_locked(key)

    def _put_missing_locked(self, key: str) -> None:
        if self.negative_ttl <= 0:
            return
        self._missing[key] = True
        self._stats.pop(key, None)
        self._pinned.pop(key, None)
        parent = posixpath.dirname(key)
        listing = self._listings.get(parent)
        if listing is not None and key in listing:
            del self._listings[parent]  # it listed what is gone

    def begin_stat(self, key: str) -> int:
        """A stat of ``key`` goes to the remote; pass the token to :meth:`end_stat`.

        One sent before our own change of the key (a commit, unlink, rename, chmod) and answered
        after it describes the object before the change: cached, it would show this node the
        old version (or none) of a file it just wrote, for the TTL.
        """
        with self._lock:
            return self._give_locked(self._stating, key)

    def end_stat(self, key: str, token: int, info: ObjectInfo | None, missing: bool = False) -> bool:
        """Whether no local change of ``key`` happened since begin_stat; if none did, cache
        ``info``, or with ``missing`` that there is no such key (neither: the stat failed)."""
        with self._lock:
            if not self._take_locked(self._stating, key, token):
                return False
            if info is not None:
                self._put_locked(info)
            elif missing:
                self._put_missing_locked(key)
            return True

    def get_listing(self, key: str) -> list[ObjectInfo] | None:
        with self._lock:
            children = self._listings.get(key)
            return None if children is None else list(children.values())

    def has_listing(self, key: str) -> bool:
        with self._lock:
            return key in self._listings

    def listing_age(self, key: str) -> float | None:
        """Seconds since ``key``'s listing was cached; None if none is."""
        with self._lock:
            if key not in self._listings:
                return None
            return self._timer() - self._listed_at.get(key, self._timer())

    def _put_listing_locked(self, key: str, children: Iterable[ObjectInfo]) -> None:
        listing = {c.name: c for c in children}
        for info in listing.values():
            self._put_locked(info)
        if self.list_ttl > 0:
            self._listings[key] = listing
            self._listed_at[key] = self._timer()

    def put_listing(self, key: str, children: Iterable[ObjectInfo]) -> None:
        """A listing we know to be current (a directory we just made): it overtakes any in flight."""
        with self._lock:
            self._changed_locked(key)
            self._put_listing_locked(key, children)

    def begin_listing(self, key: str) -> int:
        """A listing of directory ``key`` starts; pass the token to :meth:`end_listing`.

        A listing sent before one of our own changes in that directory (commit, unlink, mkdir,
        rename) and answered after it may lack the change: end_listing then drops it. Our own
        changes whose outcome we know (a commit, an unlink, a file renamed) are laid over
        the answer instead: ``tar -x`` or ``rsync`` commit a file every few milliseconds, and a
        directory they write in would otherwise never be listed again once its listing expired.
        """
        with self._lock:
            token = self._give_locked(self._fetching, key)
            self._own_since[token] = {}
            return token

    def end_listing(self, key: str, token: int, children: Iterable[ObjectInfo] | None) -> bool:
        """Whether no local change in ``key`` whose outcome we do not know happened since
        begin_listing; if none did, cache ``children`` (None: the listing failed, nothing to
        cache) with our own known changes since laid over them. A failed listing answers False
        too once any change of ours was made there since: its error (a directory with no
        object left is "not found" on GCS) may be of before it, as a file created since."""
        with self._lock:
            own = self._own_since.pop(token, {})
            if not self._take_locked(self._fetching, key, token):
                return False
            if children is None:
                return not own
            if own:
                listing = {c.name: c for c in children}
                for name, info in own.items():
                    if info is None:
                        listing.pop(name, None)
                    else:
                        listing[name] = info
                children = listing.values()
            self._put_listing_locked(key, children)
            return True

    def _give_locked(self, in_flight: dict[str, set[int]], key: str) -> int:
        """A token for a request about ``key`` now in flight (a stat, a listing)."""
        token = next(self._tokens)
        in_flight.setdefault(key, set()).add(token)
        return token

    @staticmethod
    def _take_locked(in_flight: dict[str, set[int]], key: str, token: int) -> bool:
        """Whether ``token`` still stands (no own change of ``key`` took it back); spent either way."""
        tokens = in_flight.get(key)
        if tokens is None or token not in tokens:
            return False
        tokens.discard(token)
        if not tokens:
            del in_flight[key]
        return True

    def _changed_locked(self, *dirs: str) -> None:
        """We changed these directories: listings of them in flight may be stale."""
        for d in dirs:
            for token in self._fetching.pop(d, ()):
                self._own_since.pop(token, None)

    def _own_change_locked(self, key: str, info: ObjectInfo | None) -> None:
        """We changed ``key`` and know its outcome (``info``; None: gone): listings of its
        directory in flight will have it laid over their answer."""
        for token in self._fetching.get(posixpath.dirname(key), ()):
            self._own_since[token][key] = info

    def _overtaken_locked(self, *keys: str) -> None:
        """We changed these keys: stats of them in flight may be stale."""
        for k in keys:
            self._stating.pop(k, None)

    def listed_missing(self, key: str) -> bool:
        """Whether the parent's listing, still fresh, lacks ``key``: then it does not exist, and
        asking the remote would cost a HEAD and a LIST (``tar -x`` into a new directory)."""
        with self._lock:
            listing = self._listings.get(posixpath.dirname(key))
            return listing is not None and key not in listing

    def put_own(self, info: ObjectInfo, token: int | None = None) -> None:
        """We just created or committed ``info``: cache its stat and add it to its parent's
        listing if that is cached (instead of dropping the listing, as for others' changes).
        ``token`` (begin_stat, taken before the change was sent): if another change of ours of
        the key overtook it meanwhile, ``info`` may be older than that change: dropped instead."""
        with self._lock:
            if token is not None and token not in self._stating.get(info.name, ()):
                for cache in (self._stats, self._pinned, self._missing):  # the next lookup asks
                    cache.pop(info.name, None)
                self._listings.pop(posixpath.dirname(info.name), None)  # (its entry may be as old)
                self._changed_locked(posixpath.dirname(info.name))
                return
            self._stats.pop(info.name, None)
            self._pinned.pop(info.name, None)
            self._put_locked(info)
            self._overtaken_locked(info.name)
            self._own_change_locked(info.name, info)
            listing = self._listings.get(posixpath.dirname(info.name))
            if listing is not None:
                listing[info.name] = info

    def removed_own(self, key: str) -> None:
        """We removed file ``key`` (an unlink, the source of a rename): it is missing, its
        entry leaves its parent's listing if that is cached (the listing stays valid), and
        listings of its parent in flight drop it too."""
        with self._lock:
            for cache in (self._stats, self._pinned):
                cache.pop(key, None)
            if self.negative_ttl > 0:
                self._missing[key] = True
            self._overtaken_locked(key)
            self._own_change_locked(key, None)
            listing = self._listings.get(posixpath.dirname(key))
            if listing is not None:
                listing.pop(key, None)

    def forget(self, key: str, changed: bool = False) -> None:
        """Forget what we knew of ``key`` alone (its parent's listing stays valid). ``changed``:
        we changed it, so a listing of its parent in flight may carry its stat of before."""
        with self._lock:
            for cache in (self._stats, self._pinned, self._missing):
                cache.pop(key, None)
            self._overtaken_locked(key)
            if changed:
                self._changed_locked(posixpath.dirname(key))

    def invalidate(self, key: str) -> None:
        """Forget ``key`` and its parent's listing (its entry may have appeared or gone)."""
        with self._lock:
            for cache in (self._stats, self._pinned, self._missing, self._listings):
                cache.pop(key, None)
            self._listings.pop(posixpath.dirname(key), None)
            self._overtaken_locked(key)
            self._changed_locked(key, posixpath.dirname(key))

    def invalidate_tree(self, key: str) -> None:
        """Forget ``key`` and everything below it (directory renames and removals)."""
        prefix = key + "/" if key else ""
        with self._lock:
            for cache in (self._stats, self._pinned, self._missing, self._listings):
                for name in [n for n in list(cache.keys()) if n == key or n.startswith(prefix)]:
                    cache.pop(name, None)
            self._listings.pop(posixpath.dirname(key), None)
            self._overtaken_locked(*[k for k in self._stating if k == key or k.startswith(prefix)])
            self._changed_locked(posixpath.dirname(key),
                                 *[d for d in self._fetching if d == key or d.startswith(prefix)])

    def clear(self) -> None:
        with self._lock:
            for cache in (self._stats, self._pinned, self._missing, self._listings, self._was_dir):
                cache.clear()
            self._fetching.clear()
            self._stating.clear()
            self._own_since.clear()
