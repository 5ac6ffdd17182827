"""Committing a view's open step, in the store's two phases (FUSE-free).

:class:`Commits` holds what a view needs to commit while it keeps serving:
the events other threads wait on and the failsafe reason.  A commit is a
:class:`ViewCommit`, used as a context manager around the store's
:class:`store.publish.Commit`::

    with view.begin_commit(message) as c:
        number = c.publish()   # under the view's lock: the layer is on disk
        reply(number)          # a daemon answers its caller here
        c.complete()           # bookkeeping, then the lock is released
                               # while the store writes the "committed" record

Threading: the view's lock is taken by ``publish`` and held until
``complete`` has done the view's bookkeeping (in memory and scratch files,
nothing in the store); it is released while the store completes the layer,
so requests that need no store write go on at once.  Until the completion
has ended :attr:`Commits.settled` is clear: writes of the step's rows wait
for it (a row written before the "committed" record would be consumed with
the layer it is not part of: that record deletes the step's rows), and so
do reads of history.  A completion that fails turns the view read-only
before ``settled`` is set, and is raised from ``complete``: the caller was
answered already.  Namespace and metadata changes wait for ``settled`` too
(:meth:`Failsafe.check_writable`), so one made in that window is refused
with EROFS if the completion fails, never accepted and then dropped.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

from stepfs.store import publish
from stepfs.store.ready import ReadyFiles
from stepfs.store.errors import NothingToCommit, PublishFailed, StoreUnavailable
from stepfs.store.workspace import Workspace

from stepfs.overlayfs.core.errors import ReadOnly
from stepfs.overlayfs.core.metatree import is_meta

log = logging.getLogger("stepfs.view")


class Failsafe:
    """Read-only once the store could not keep a write (as s3ql's
    failsafe): sticky until the next mount; the first reason is kept."""

    def __init__(self, mountpoint: str):
        self.mountpoint = mountpoint
        self.reason: str | None = None
        #: :attr:`Commits.settled` of the view, once it has one.
        self.settled: threading.Event | None = None

    def check_writable(self, path: str) -> None:
        """Refuse a change of ``path``: the ``.stepfs`` tree is read-only,
        and so is everything once the failsafe tripped.  Called under the
        view's lock before a change is made; while a commit that answered
        already completes, it waits for the completion first (which never
        takes the view's lock): a change made meanwhile would be consumed
        with that layer's step if the completion fails and recovery
        finishes the layer, so it is refused then instead of lost."""
        if is_meta(path):
            raise ReadOnly(path)
        if self.settled is not None and not self.settled.is_set():
            self.settled.wait()
        if self.reason is not None:
            raise ReadOnly(self.reason)

    def trip(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            log.error("mount %s is now read-only: %s", self.mountpoint, reason)


class Commits:
    """The commit state of one view: ``settled``, ``commit_idle`` and the
    paths the running commit publishes (read by the watcher thread)."""

    def __init__(self, ws: Workspace, step: int, agent: str, mountpoint: str, lock: threading.RLock,
                 failsafe: Failsafe):
        self.ws, self.step, self.agent, self.mountpoint = ws, step, agent, mountpoint
        self.lock = lock
        self.failsafe = failsafe
        #: Clear while a commit that already published (and answered its
        #: caller) completes without the view's lock.
        self.settled = threading.Event()
        self.settled.set()
        failsafe.settled = self.settled
        #: Clear while a commit runs: the watcher holds its handling of
        #: workspace events (mostly this commit's own renames) until it ends.
        self.commit_idle = threading.Event()
        self.commit_idle.set()
        #: View paths the last commit published (set operations are atomic
        #: under the GIL).
        self.own_publishes: set[str] = set()

    def await_settled(self, writing: bool = False) -> None:
        """Wait until no commit of this view is completing.  ``writing``:
        the caller writes this step's rows next, which a read-only view
        refuses (a completion that failed made it so).  Called under the
        view's lock (the completion never takes it)."""
        if self.settled.is_set():
            return
        self.settled.wait()
        if writing and self.failsafe.reason is not None:
            raise ReadOnly(self.failsafe.reason)


class ViewCommit:
    """One commit of the view's open step (see the module doc).

    ``prepare()``: called under the lock before the store plans; writes
    the recorded rows and returns ``(covered, staged paths)``.
    ``after(covered)``: the view's bookkeeping once the layer is published
    (``covered`` empty when there was nothing to commit).
    ``precaptured``: before states captured ahead, cleared once the
    commit made their tokens useless."""

    def __init__(self, commits: Commits, prepare: Callable[[], tuple[list[str], Iterable[str]]],
                 after: Callable[[list[str]], None], precaptured: dict, *, message: str = "",
                 meta: dict | None = None, allow_empty: bool = False, overwrite: set[bytes] = frozenset(),
                 ready: ReadyFiles | None = None):
        self.commits = commits
        self._prepare, self._after, self._precaptured = prepare, after, precaptured
        self._ready = ready
        self._unused: list = []  # ready files the commit did not take, given back after the answer
        self._options = dict(message=message, agent=commits.agent, mount=commits.mountpoint, meta=meta,
                             allow_empty=allow_empty, overwrite=overwrite)
        self._pausing = None
        self._store: publish.Commit | None = None
        self._held = False
        self._covered: list[str] = []
        self._published = False

    def __enter__(self) -> "ViewCommit":
        # The spare filler (which also frees the inodes the commit retired)
        # waits until the layer is complete, not only published.
        self._pausing = self.commits.ws.spares.pausing()
        self._pausing.__enter__()
        return self

    def publish(self) -> int:
        """Steps 1 to 4 under the view's lock; returns the layer number."""
        c = self.commits
        c.lock.acquire()
        self._held = True
        c.await_settled()  # another thread's commit (auto-step) may still be completing
        if c.failsafe.reason is not None:
            raise StoreUnavailable(f"this mount is read-only ({c.failsafe.reason}); "
                                   f"unmount and mount again once the cause is fixed.")
        self._covered, staged = self._prepare()
        # The names this commit is about to replace in the workspace keep
        # their inode numbers in the view: the watcher must not take our own
        # renames for outside replacements.
        c.own_publishes.clear()
        c.own_publishes.update(staged)
        c.commit_idle.clear()
        self._store = publish.begin(c.ws, c.step, known=self._precaptured, ready=self._ready, **self._options)
        self._store.__enter__()
        try:
            number = self._store.publish()
        except NothingToCommit:
            self._precaptured.clear()
            self._detach_ready()
            self._after([])  # the no-op rows were dropped from the store
            raise
        except PublishFailed as exc:
            self._failed(exc)
            raise
        self._published = True
        # The paths just committed have new tokens: nothing captured is of
        # use, and the next step readies its own files.
        self._precaptured.clear()
        self._detach_ready()
        return number

    def _detach_ready(self) -> None:
        if self._ready is not None:
            self._unused = self._ready.detach()

    def complete(self) -> None:
        """The view's bookkeeping, while the directory fsyncs run; then the
        lock is released and the store completes the layer."""
        self._store.start_completion()
        try:
            self._after(self._covered)
        finally:
            self._release()
        try:
            self._store.complete()
        except PublishFailed as exc:
            self._failed(exc)
            raise

    def _release(self) -> None:
        if self._held:
            self.commits.settled.clear()
            self._held = False
            self.commits.lock.release()

    def _failed(self, exc: PublishFailed) -> None:
        if exc.pending is not None:  # past the commit point: only recovery may finish it
            self.commits.failsafe.trip(str(exc))

    def __exit__(self, exc_type, exc, tb) -> bool:
        c = self.commits
        try:
            if self._published:
                self._release()  # the store completes the layer without the view's lock
            if self._store is not None:
                try:
                    self._store.__exit__(exc_type, exc, tb)
                except PublishFailed as failed:
                    self._failed(failed)
                    raise
        finally:
            c.commit_idle.set()
            c.settled.set()
            if self._held:
                self._held = False
                c.lock.release()
            if self._unused:
                self._ready.give_back(self._unused)
                self._unused = []
            self._pausing.__exit__(None, None, None)
        return False
