"""Where a workspace keeps its store, and whether a directory is one.

Kept apart from :mod:`store.workspace` (which imports SQLAlchemy) so that
the CLI can trace a path to its workspace or mount without paying for the
database layer: ``stepfs step`` in a mount only talks to the daemon.
"""

from __future__ import annotations

import os

from stepfs.store.errors import WorkspaceError

STORE_DIR = ".stepfs"
DB_NAME = "store.db"
#: The store's directories, made at every open (0700).
SUBDIRS = ("tmp", "scratch", "run", "spare", "retired")
#: What an existing history leaves in ``.stepfs/`` besides the database:
#: any of these without ``store.db`` means the database was lost, not that
#: the workspace is new.
HISTORY_TRACES = ("store.db-wal", "store.db-shm", "commit.lock", *SUBDIRS)


def check_directory(path: str) -> str:
    """The absolute real path of an existing directory, or WorkspaceError."""
    if not os.path.exists(path):
        raise WorkspaceError(f"workspace {path} does not exist; create it or name an existing directory.")
    if not os.path.isdir(path):
        raise WorkspaceError(f"workspace {path} is not a directory; name the directory that holds the project.")
    return os.path.realpath(path)


def is_workspace(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STORE_DIR, DB_NAME))


def lost_database(path: str) -> bool:
    """``path`` has a store directory that an earlier history left without
    its database (see HISTORY_TRACES)."""
    store = os.path.join(path, STORE_DIR)
    return (os.path.isdir(store) and not os.path.lexists(os.path.join(store, DB_NAME))
            and any(os.path.lexists(os.path.join(store, n)) for n in HISTORY_TRACES))


def lost_database_message(store_path: str) -> str:
    """The sentence for a store directory whose database is gone."""
    return (f"{store_path} holds a stepfs store whose database {DB_NAME} is missing, so its history (layers, "
            f"staged changes) is lost; restore {DB_NAME} from a backup, or start a new history at layer 0 "
            f"with 'stepfs mount --new-history WORKSPACE MOUNTPOINT'.")
