"""A workspace directory and its store (store side, no FUSE).

Layout of ``WORKSPACE/.stepfs/`` (see FORMAT.md):

* ``store.db``      the SQLite database (plus ``-wal`` / ``-shm``)
* ``tmp/``          temporary files of a commit in progress (same filesystem
                    as the workspace, so renames into place are atomic)
* ``scratch/<step>/`` a daemon's working copies of files open for writing
* ``run/``          locks, pid files and logs of mount daemons
* ``spare/``        empty files made ahead of commits (``store.spares``)
* ``retired/``      second names of inodes a commit replaced, deleted after it
                    (``store.spares``)
* ``commit.lock``   held (flock) for the whole of every commit and recovery

Opening a workspace runs recovery first (``recovery.recover``): nothing else
touches a store that has a half-published layer.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat as stat_mod
import time
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import select

from stepfs.store import schema
from stepfs.store.contained import Root
from stepfs.store.db import Database
from stepfs.store.errors import StoreUnavailable, WorkspaceError
from stepfs.store.objects import ObjectStore
from stepfs.store.deltawork import DeltaWork
from stepfs.store.spares import Spares
from stepfs.store.paths import DB_NAME, HISTORY_TRACES, STORE_DIR, SUBDIRS, check_directory, is_workspace  # noqa: F401  (re-exported)
from stepfs.store.paths import lost_database_message


#: Store directories held open for as long as the workspace is.
HELD_SUBDIRS = ("tmp", "spare", "retired")


class Workspace:
    """An opened workspace.  Threading: methods may be called from several
    threads; the database serialises writers, :meth:`commit_lock` serialises
    commits across processes.

    Containment of the store: ``.stepfs`` is opened once, beneath the
    workspace's own handle and without following a symlink (:class:`Root`),
    and every store path (``store_dir`` and what is under it: the database,
    ``tmp/``, ``spare/``, ``retired/``, ``run/``, ``scratch/``,
    ``commit.lock``) is named through that handle (``/proc/self/fd/N/...``).
    Renaming the workspace, or swapping one of its parents for a symlink to
    a look-alike tree, while it is open changes nothing this object
    touches; :attr:`store_path` is the name for messages only."""

    def __init__(self, path: str, db: Database, root: Root, store: Root, held: dict[str, Root]):
        self.path = path
        self.root = root
        self.store = store
        #: ``.stepfs/tmp``, ``spare`` and ``retired`` (:data:`HELD_SUBDIRS`),
        #: opened once beneath ``store``: a commit makes, links, renames and
        #: removes its files relative to these handles (``tmp.fd``, or names
        #: under ``/proc/self/fd/N``), so a symlink swapped in for one of
        #: them later redirects nothing.
        self._held = held
        self.tmp = held["tmp"]
        self.store_path = os.path.join(path, STORE_DIR)
        self.store_dir = store.handle_path
        self.db = db
        self.objects = ObjectStore()
        self.tmp_dir = self.tmp.handle_path  # through the held handle, for listing
        self.run_dir = os.path.join(self.store_dir, "run")
        self.spares = Spares(held["spare"].handle_path, held["retired"].handle_path)
        #: Each committed layer's deltas, made after the commit lock is released.
        self.deltas = DeltaWork(self, self.spares)

    @classmethod
    def open(cls, path: str, create: bool = False, recover: bool = True, new_history: bool = False) -> "Workspace":
        """Open the workspace at ``path`` (creating its store if ``create``).

        Raises :class:`WorkspaceError` if ``path`` is not a directory, has
        no store and ``create`` is false, or has a store directory whose
        database is gone (unless ``new_history``: the leftovers are set
        aside in ``.stepfs/lost-<ns>/`` and a new history starts at layer
        0); :class:`StoreFormatError` for a foreign or newer store;
        :class:`StoreUnavailable` for a store this user cannot write.
        """
        real = check_directory(path)
        root = Root(real, hide=STORE_DIR)
        store = None
        try:
            store = _open_store_dir(root, real, create)
            _check_database(store, real, create, new_history)
            # The database before the directories: a crash in between
            # leaves a store, not directories that look like a lost one.
            db = Database.open(os.path.join(store.handle_path, DB_NAME), create=create,
                               label=os.path.join(real, STORE_DIR, DB_NAME))
            held: dict[str, Root] = {}
            try:
                for sub in SUBDIRS:
                    try:
                        handle = store.subdir(sub, create=True)  # a real directory, not a symlink planted there
                    except OSError as exc:
                        raise _store_os_error(exc, os.path.join(real, STORE_DIR, sub)) from None
                    if sub in HELD_SUBDIRS:
                        held[sub] = handle  # every commit goes through it: a later swap redirects nothing
                    else:
                        handle.close()
            except BaseException:
                for handle in held.values():
                    handle.close()
                db.close()
                raise
        except BaseException:
            if store is not None:
                store.close()
            root.close()
            raise
        ws = cls(real, db, root, store, held)
        try:
            ws._ensure_baseline()
            if recover:
                from stepfs.store.recovery import recover as _recover

                _recover(ws)
        except BaseException:
            ws.close()
            raise
        return ws

    def close(self) -> None:
        self.deltas.stop()
        self.spares.stop()
        self.db.close()  # before the store handle its file names go through
        for handle in self._held.values():
            handle.close()
        self.store.close()
        self.root.close()

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ensure_baseline(self) -> None:
        """Layer 0 is the baseline: no entries; "before" states are captured
        lazily when a later layer first touches a path (mounting stays O(1))."""
        with self.db.read() as conn:
            if conn.execute(select(schema.layers.c.number).where(schema.layers.c.number == 0)).first():
                return
        with self.db.write(durable=True) as conn:
            if conn.execute(select(schema.layers.c.number).where(schema.layers.c.number == 0)).first():
                return
            conn.execute(
                schema.layers.insert().values(
                    number=0, state="committed", kind="baseline", created_ns=time.time_ns(),
                    message="baseline", agent="", mount="", meta="{}", intent_sum="",
                )
            )

    @contextmanager
    def commit_lock(self) -> Iterator[None]:
        """Exclusive across processes for a whole commit or recovery."""
        name = os.path.join(self.store_dir, "commit.lock")
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _store_os_error(exc, os.path.join(self.store_path, "commit.lock")) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _store_os_error(exc: OSError, name: str) -> Exception:
    """The domain error for a store file or directory that cannot be made
    or opened: a read-only or foreign store cannot write (16); anything
    else stays the OSError it is."""
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StoreUnavailable(f"the store cannot write {name} ({exc.strerror}); make the workspace's "
                                f"{STORE_DIR} directory writable by this user (check its permissions and "
                                f"read-only mounts), then try again.")
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return WorkspaceError(f"{name} is a symbolic link or not a directory; move it away so stepfs can "
                              f"keep its store there.")
    return exc


def _open_store_dir(root: Root, real: str, create: bool) -> Root:
    """The handle of ``WORKSPACE/.stepfs`` (made if ``create``)."""
    store_path = os.path.join(real, STORE_DIR)
    try:
        return root.subdir(STORE_DIR, create=create)
    except FileNotFoundError:
        raise WorkspaceError(
            f"{real} is not a stepfs workspace (it has no {STORE_DIR}/{DB_NAME}); "
            f"mount it once with 'stepfs mount' to make it one."
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise WorkspaceError(f"{store_path} exists but is not a directory; move it away so stepfs can "
                                 f"keep its store there.") from None
        raise _store_os_error(exc, store_path) from None


def _check_database(store: Root, real: str, create: bool, new_history: bool) -> None:
    """Refuse a ``.stepfs`` whose database is gone (never silently start
    over: every layer would be lost without a word), or a database that is
    not a regular file (a symlink would take SQLite elsewhere)."""
    store_path = os.path.join(real, STORE_DIR)
    try:
        st = os.stat(DB_NAME, dir_fd=store.fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat_mod.S_ISREG(st.st_mode):
            raise WorkspaceError(f"{os.path.join(store_path, DB_NAME)} is not a regular file; move it away "
                                 f"so stepfs can keep its database there.")
        return
    present = [n for n in HISTORY_TRACES if _exists(store, n)]
    if not present:
        if not create:
            raise WorkspaceError(
                f"{real} is not a stepfs workspace (it has no {STORE_DIR}/{DB_NAME}); "
                f"mount it once with 'stepfs mount' to make it one."
            )
        return  # a new (or never finished) store
    if not new_history:
        raise WorkspaceError(lost_database_message(store_path))
    # Set the old history's leftovers aside, inside the store (never shown
    # in a mount): a stale WAL next to a new database would be replayed
    # into it by SQLite.
    aside = f"lost-{time.time_ns()}"
    os.mkdir(aside, 0o700, dir_fd=store.fd)
    for name in present:
        os.rename(name, f"{aside}/{name}", src_dir_fd=store.fd, dst_dir_fd=store.fd)


def _exists(store: Root, name: str) -> bool:
    try:
        os.stat(name, dir_fd=store.fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
