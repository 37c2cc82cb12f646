"""Write-back: staged files uploaded in the background after their close, in the order they
were closed, and barriers that return once what they cover is in the bucket.

A closed file is a task with a sequence number; ``workers`` threads take tasks in that order,
each once it has waited ``delay`` seconds (rclone's ``--vfs-write-back``: a file renamed or
written again meanwhile, a temporary checkpoint directory renamed into place, is sent once, to
its final name) or once a barrier asks for it, and run ``upload`` then ``done`` on each (a failed upload's bytes are kept by ``done``, as a
failed close's are). A barrier taken after task N waits until every task numbered N or lower
(or only those under a key prefix) is done. A task whose key ``hold`` answers True (a file under
a temporary checkpoint directory: it is about to be renamed) waits for a barrier or until its
key no longer does (the rename re-targets it), while the tasks behind it go on. ``_tasks`` (queued and uploading tasks, by number) is guarded by ``_lock``, a
leaf: nothing is called while it is held.

Picking the next task costs O(1) a close however long the queue: a `tar -x` closes thousands of
files within the delay, and each close used to wake all 16 workers to scan every task (and glob
every held key) — quadratic, most of the daemon's CPU during the tar. A close wakes one idle
worker; held tasks wait aside (``_held``) and are looked at again on a rename, a barrier or once
a second; the fences (deletes) are counted apart.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from marinfs.threadnames import start_thread
from marinfs.write.staging import StagedFile

log = logging.getLogger(__name__)

HELD_LOOK = 1.0  # seconds between looks at the held tasks (a rename that frees them says so, mostly)


@dataclass(eq=False)
class _Task:
    seq: int
    staged: StagedFile | None  # an upload's file; None for an operation (``op``)
    ready_at: float
    size: int = 0  # the staged bytes when queued (the bound on what waits: ``room``)
    started: bool = False
    last: bool = False  # a commit marker: starts once every task before it is done
    op: Callable[[], None] | None = None  # a fence (a delete): after all before it (but the deletes of
    # other names), before all after it
    op_key: str = ""
    held_key: str | None = None  # the key ``held`` was answered for (a rename changes it)
    held: bool = False

    @property
    def key(self) -> str:
        return self.staged.key if self.staged is not None else self.op_key


class WriteBack:
    """The background upload queue of one mount."""

    def __init__(self, upload: Callable[[StagedFile], None], done: Callable[[StagedFile], None],
                 workers: int = 16, delay: float = 0.0, hold: Callable[[str], bool] | None = None) -> None:
        self._upload, self._done = upload, done
        self.delay = delay
        self._hold = hold or (lambda key: False)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # barriers and room() wait here
        self._work = threading.Condition(self._lock)  # idle workers wait here
        self._seq = itertools.count(1)
        self._queue: deque[_Task] = deque()  # GUARDED_BY(_lock): not started, in closing order
        self._tasks: dict[int, _Task] = {}  # GUARDED_BY(_lock): queued and uploading, by number
        self._waiting: set[int] = set()  # GUARDED_BY(_lock): id() of the staged files queued, not begun
        self._held: list[_Task] = []  # GUARDED_BY(_lock): not begun, waiting for their rename, by number
        self._held_seen = 0.0  # GUARDED_BY(_lock): when _held was last looked at (0: look again now)
        self._ops: set[int] = set()  # GUARDED_BY(_lock): the numbers of the fences in _tasks
        self._lasts: set[int] = set()  # GUARDED_BY(_lock): the numbers of the markers not begun
        self._bytes = 0  # GUARDED_BY(_lock): the sizes of the tasks in _tasks, summed
        self._last = 0  # GUARDED_BY(_lock): the last number given
        self._hurry = 0  # GUARDED_BY(_lock): tasks up to this number start without waiting their delay
        self._stopping = False
        self.uploaded = 0  # files whose upload ended, landed or kept after failing (for status)
        self._threads = [start_thread(self._run, f"marinfs-wb{i}") for i in range(max(1, workers))]

    def enqueue(self, staged: StagedFile) -> bool:
        """Queue ``staged`` for upload; False if it is queued already and not begun (that task
        uploads it as it is then). The caller holds a reference for the queue when True."""
        with self._lock:
            if id(staged) in self._waiting:
                return False
            self._waiting.add(id(staged))
            task = _Task(next(self._seq), staged, time.monotonic() + self.delay, staged.known_size())
            self._last = task.seq
            self._queue.append(task)
            self._tasks[task.seq] = task
            self._bytes += task.size
            self._work.notify()
            return True

    def enqueue_op(self, key: str, op: Callable[[], None]) -> None:
        """Queue ``op`` (a delete of ``key``) as a fence: it runs once every task before it is
        done (but those held for a rename: they are not closed files of their final name yet),
        and no task after it starts before it ends. It waits no delay."""
        with self._lock:
            task = _Task(next(self._seq), None, time.monotonic(), op=op, op_key=key)
            self._last = task.seq
            self._queue.append(task)
            self._tasks[task.seq] = task
            self._ops.add(task.seq)
            self._work.notify()

    def barrier(self, under: str | None = None, timeout: float | None = None) -> None:
        """Wait until every task queued so far (of a key ``under`` a prefix, or all) is done.
        Raises TimeoutError past ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            upto = self._last
            if upto > self._hurry:  # what the barrier waits for starts now
                self._hurry_locked(upto)
            while True:
                if not self._covered_locked(upto, under):
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    waiting = sum(n <= upto and _covers(under, t.key) for n, t in self._tasks.items())
                    raise TimeoutError(f"{waiting} upload(s) still pending")
                self._changed.wait(left)

    def _covered_locked(self, upto: int, under: str | None) -> bool:
        """A task numbered ``upto`` or lower (under the prefix) is not done."""
        for n, task in self._tasks.items():  # (in number order: inserted so, never moved)
            if n > upto:
                return False
            if _covers(under, task.key):
                return True
        return False

    def _hurry_locked(self, upto: int) -> None:
        """Tasks up to ``upto`` start without their delay or hold."""
        self._hurry = upto
        self._held_seen = 0.0
        self._work.notify_all()

    def room(self, limit: int) -> None:
        """Wait until the files queued or uploading hold at most ``limit`` bytes (a writer's close
        when the staging area is full: it waits, never ENOSPC); what waits starts at once."""
        with self._lock:
            while self._bytes > limit and len(self._tasks) > 1:
                if self._last > self._hurry:
                    self._hurry_locked(self._last)
                self._changed.wait()

    def pending(self) -> int:
        """Files queued or uploading."""
        with self._lock:
            return len(self._tasks)

    def close(self, timeout: float) -> bool:
        """Stop the workers once the queue is empty (or ``timeout`` passed): True if all was
        uploaded. What is left keeps its journal, for the next start."""
        try:
            self.barrier(timeout=timeout)
            drained = True
        except TimeoutError:
            drained = False
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        for thread in self._threads:
            thread.join(1.0 if drained else 0.1)
        return drained

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._stopping:
                        return  # (unmount gave up waiting: what is left keeps its journal)
                    task, wait = self._next_locked()
                    if task is not None:
                        break
                    self._work.wait(wait)
                self._queue.remove(task)
                task.started = True
                self._waiting.discard(id(task.staged))
                self._lasts.discard(task.seq)
                if self._queue:
                    self._work.notify()  # (another may be ready too: its worker looks)
            if task.op is not None:
                try:
                    task.op()
                except Exception as exc:  # noqa: BLE001 - kept by the op itself, retried later
                    log.warning("the delete of %s failed: %s; it is kept and tried again", task.key, exc)
            else:
                self._run_upload(task.staged)
            with self._lock:
                del self._tasks[task.seq]
                self._ops.discard(task.seq)
                self._bytes -= task.size
                self.uploaded += task.op is None
                self._changed.notify_all()
                if task.op is not None or self._blocked_locked():
                    self._work.notify_all()  # (a fence or a marker waited for it)

    def _run_upload(self, staged: StagedFile) -> None:
        try:
            self._upload(staged)
        except Exception as exc:  # noqa: BLE001 - kept and reported by the release below
            log.warning("background upload of %s failed: %s; its bytes are kept and retried", staged.key, exc)
        try:
            self._done(staged)
        except Exception:  # noqa: BLE001 - a worker never dies
            log.exception("after the upload of %s", staged.key)


    def _next_locked(self) -> tuple[_Task | None, float | None]:
        """The first task in closing order that may start now, else how long until one may (None:
        until something changes). Held tasks are set aside; their rename or a barrier frees them."""
        now, wait = time.monotonic(), None
        if self._held and now - self._held_seen >= HELD_LOOK:
            self._unhold_locked(now)
        fence = min(self._ops, default=None)
        first = next(iter(self._tasks), None)
        held = []
        found = None
        for task in self._queue:
            if task.op is not None:
                # A delete: after every task before it, but those held and the deletes of other
                # names (rm -r: its deletes go together, its rmdir after them).
                if any(not self._held_locked(t) and not (t.op is not None and apart(t.key, task.key))
                       for t in self._before_locked(task.seq)):
                    break
                found = task
                break
            if fence is not None and task.seq > fence:
                break  # (nothing passes a delete not yet done)
            if task.last and first is not None and first < task.seq:
                continue  # (a marker: after everything closed before it)
            if task.seq <= self._hurry:
                found = task
                break
            if self._held_locked(task):
                held.append(task)
                continue
            if task.ready_at <= now:
                found = task
                break
            wait = task.ready_at - now
            break  # (the ones behind are ready no sooner)
        for task in held:
            self._queue.remove(task)
            self._held.append(task)
        if held:
            self._held.sort(key=lambda t: t.seq)
        if found is None and wait is None and self._held:
            wait = HELD_LOOK  # (held ones: look again now and then, a rename may not say so)
        return found, wait

    def _before_locked(self, seq: int):
        """The tasks numbered below ``seq``, in number order."""
        for n, task in self._tasks.items():
            if n >= seq:
                return
            yield task

    def _blocked_locked(self) -> bool:
        """Something queued waits for other tasks to end (a fence, a marker)."""
        return bool(self._ops or self._lasts)

    def _unhold_locked(self, now: float) -> None:
        """Held tasks whose hold is over go back into the queue, in number order."""
        self._held_seen = now
        free = [t for t in self._held if not self._held_locked(t)]
        if not free:
            return
        self._held = [t for t in self._held if t not in free]
        self._queue = deque(sorted([*self._queue, *free], key=lambda t: t.seq))

    def _held_locked(self, task: _Task) -> bool:
        """Waiting for the rename of its temporary directory (not begun, not hurried)."""
        if task.staged is None or task.started or task.seq <= self._hurry:
            return False
        key = task.staged.key
        if task.held_key != key:  # (asked once a key: a glob match each time was most of a scan)
            task.held_key, task.held = key, self._hold(key)
        return task.held

    def mark_last(self, staged: StagedFile) -> bool:
        """``staged``'s queued upload is a commit marker's (renamed into place): it starts only
        once every upload queued before it is done. False if it has none queued."""
        with self._lock:
            for task in [*self._queue, *self._held]:
                if task.staged is staged:
                    task.last = True
                    self._lasts.add(task.seq)
                    self._held_seen = 0.0
                    self._work.notify_all()
                    return True
        return False

    def changed(self) -> None:
        """Something a held task waits for changed (a rename): look again."""
        with self._lock:
            self._held_seen = 0.0
            self._work.notify_all()


def apart(a: str, b: str) -> bool:
    """Neither key is the other nor inside it."""
    return a != b and not a.startswith(b + "/") and not b.startswith(a + "/")


def _covers(under: str | None, key: str) -> bool:
    return not under or key == under or key.startswith(under + "/")
