"""The Python API for agent harnesses (docs/API.md)::

    from stepfs import api

    ws = api.open_workspace("/home/me/project", create=True)

This module only names what harnesses use; the code is in
``overlayfs/client/api.py`` (workspaces, mounts, ``stepfs run`` as a
call).
"""

from stepfs.overlayfs.client.api import (
    CommitConflict, ContainmentError, CorruptObject, DaemonError, Mount, MountpointError, NoSuchLayer,
    NothingToCommit, NotMountedError, StepfsError, StoreFormatError, WorkspaceClient, WorkspaceError,
    RunResult, open_workspace, relative_to_workspace, run_command,
)

__all__ = [
    "open_workspace", "WorkspaceClient", "Mount", "relative_to_workspace", "run_command", "RunResult",
    "StepfsError", "WorkspaceError", "MountpointError", "NotMountedError", "StoreFormatError",
    "NothingToCommit", "CommitConflict", "DaemonError", "ContainmentError", "NoSuchLayer", "CorruptObject",
]
