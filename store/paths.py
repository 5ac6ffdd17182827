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


def check_directory(path: str) -> str:
    """The absolute real path of an existing directory, or WorkspaceError."""
    if not os.path.exists(path):
        raise WorkspaceError(f"workspace {path} does not exist; create it or name an existing directory.")
    if not os.path.isdir(path):
        raise WorkspaceError(f"workspace {path} is not a directory; name the directory that holds the project.")
    return os.path.realpath(path)


def is_workspace(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STORE_DIR, DB_NAME))
