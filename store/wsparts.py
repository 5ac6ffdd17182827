"""What the commit protocol uses of an opened workspace, as a
``typing.Protocol`` (store side, no FUSE).

``store.workspace.Workspace`` is the one implementation.  The protocol's
modules (``store.plan``, ``store.journal``, ``store.switch``,
``store.completion``, ``store.recovery``) name this instead of importing
it: ``Workspace.open`` runs recovery, so that import would be a cycle.
"""

from __future__ import annotations

from typing import ContextManager, Protocol

from stepfs.store.contained import Root
from stepfs.store.db import Database
from stepfs.store.objects import ObjectStore
from stepfs.store.spares import Spares


class WorkspaceParts(Protocol):
    root: Root
    db: Database
    objects: ObjectStore
    spares: Spares
    #: ``.stepfs/tmp``, where a commit makes its new files (held open).
    tmp: Root
    tmp_dir: str

    def commit_lock(self) -> ContextManager[None]: ...
