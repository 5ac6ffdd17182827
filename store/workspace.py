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

Opening a workspace runs recovery first (``publish.recover``): nothing else
touches a store that has a half-published layer.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import select

from stepfs.store import schema
from stepfs.store.contained import Root
from stepfs.store.db import Database
from stepfs.store.errors import WorkspaceError
from stepfs.store.objects import ObjectStore
from stepfs.store.spares import Spares
from stepfs.store.paths import DB_NAME, STORE_DIR, check_directory, is_workspace  # noqa: F401  (re-exported)

class Workspace:
    """An opened workspace.  Threading: methods may be called from several
    threads; the database serialises writers, :meth:`commit_lock` serialises
    commits across processes."""

    def __init__(self, path: str, db: Database):
        self.path = path
        self.store_dir = os.path.join(path, STORE_DIR)
        self.db = db
        self.objects = ObjectStore()
        self.root = Root(path, hide=STORE_DIR)
        self.tmp_dir = os.path.join(self.store_dir, "tmp")
        self.run_dir = os.path.join(self.store_dir, "run")
        self.spares = Spares(os.path.join(self.store_dir, "spare"), os.path.join(self.store_dir, "retired"))

    @classmethod
    def open(cls, path: str, create: bool = False, recover: bool = True) -> "Workspace":
        """Open the workspace at ``path`` (creating its store if ``create``).

        Raises :class:`WorkspaceError` if ``path`` is not a directory, or has
        no store and ``create`` is false; :class:`StoreFormatError` for a
        foreign or newer store.
        """
        real = check_directory(path)
        if not is_workspace(real) and not create:
            raise WorkspaceError(
                f"{path} is not a stepfs workspace (it has no {STORE_DIR}/{DB_NAME}); "
                f"mount it once with 'stepfs mount' to make it one."
            )
        store_dir = os.path.join(real, STORE_DIR)
        if os.path.islink(store_dir) or (os.path.exists(store_dir) and not os.path.isdir(store_dir)):
            raise WorkspaceError(f"{store_dir} exists but is not a directory; move it away so stepfs can keep its store there.")
        for sub in ("", "tmp", "scratch", "run"):
            os.makedirs(os.path.join(store_dir, sub), mode=0o700, exist_ok=True)
        db = Database.open(os.path.join(store_dir, DB_NAME), create=create)
        ws = cls(real, db)
        ws._ensure_baseline()
        if recover:
            from stepfs.store.publish import recover as _recover

            _recover(ws)
        return ws

    def close(self) -> None:
        self.spares.stop()
        self.root.close()
        self.db.close()

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
        import time

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
        fd = os.open(os.path.join(self.store_dir, "commit.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
