"""Domain errors of stepfs (store side; no FUSE, no CLI).

Every error a user can meet is a subclass of :class:`StepfsError` whose
message is one sentence the user can act on.  The CLI maps each class to a
distinct exit code in one table (``cli/exitcodes.py``); the FUSE adapter maps
the view's errors to errno values in one table (``overlayfs/daemon/fuse_ops.py``).
Nothing here knows about either.
"""

from __future__ import annotations


class StepfsError(Exception):
    """Base class: ``str(err)`` is the one-sentence message for the user."""


class WorkspaceError(StepfsError):
    """The workspace argument is missing, not a directory, or not a workspace."""


class MountpointError(StepfsError):
    """The mountpoint is missing, not a directory, not empty, inside the
    workspace, or already mounted."""


class NotMountedError(StepfsError):
    """A path that should be a live stepfs mount is not one."""


class StoreFormatError(StepfsError):
    """The store is of a newer format, or is not a stepfs store at all."""


class NothingToCommit(StepfsError):
    """``step`` found nothing staged and ``--allow-empty`` was not given."""


class CommitConflict(StepfsError):
    """A step changes paths that were changed in the workspace since the step
    copied them up; nothing was written.  ``paths`` lists them."""

    def __init__(self, message: str, paths: list[str]):
        super().__init__(message)
        self.paths = paths


class HeadMoved(CommitConflict):
    """A rollback was asked for against a head the history has moved past
    (a preview made before another layer was committed); nothing written."""

    def __init__(self, message: str, head: int):
        super().__init__(message, [])
        self.head = head


class NothingToRollBack(NothingToCommit):
    """``rollback N`` found nothing to change: N is the head, or every path
    touched after N already holds its state as of N."""


class DaemonError(StepfsError):
    """The mount daemon did not start, did not answer, or did not exit."""


class ContainmentError(StepfsError):
    """A path argument leaves the workspace or reaches into its store."""


class NoSuchLayer(StepfsError):
    """A layer number that does not exist."""


class LayerPruned(NoSuchLayer):
    """A layer number that existed and was dropped by ``stepfs prune``."""


class NoSuchPath(StepfsError):
    """A path that did not exist (or was not a file) as of the layer asked for."""


class CorruptObject(StepfsError):
    """Stored bytes no longer hash to their key."""


class MissingStagedContent(CorruptObject):
    """The scratch file a staged row references (a big file staged by
    reference, ``store/refs.py``) is gone or no longer holds what was closed."""


class ConfinementUnavailable(StepfsError):
    """``--confine`` was asked for where the kernel cannot confine (no
    Landlock, or an ABI too old for an option); nothing was started."""


class InputError(StepfsError):
    """Data a command reads (a hook payload on stdin) is not in the form it
    expects."""


class StoreUnavailable(StepfsError):
    """The store cannot write (an I/O error under SQLite): nothing new can be
    kept, so a mount goes read-only."""


class StoreFull(StoreUnavailable):
    """The store's filesystem is full (``SQLITE_FULL``); the writer gets ENOSPC."""


class StoreBusy(StepfsError):
    """Another process held the store's write lock for the whole busy
    timeout (a long gc, prune or commit); nothing was written, and the same
    command succeeds once that process is done."""


class PublishFailed(StepfsError):
    """A step could not be written into the workspace (a failed write, rename
    or fsync).  ``errno`` is the system error; ``pending`` is the number of the
    layer left pending (recovery finishes it) or None when nothing in the
    workspace was changed."""

    def __init__(self, message: str, errno: int | None = None, pending: int | None = None):
        super().__init__(message)
        self.errno = errno
        self.pending = pending


class StoreDamaged(StepfsError):
    """``stepfs verify`` found problems; ``problems`` names each one."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []


class HistoryUnreachable(StepfsError):
    """The shared history's server (``--history URL``) cannot be reached or
    dropped the connection; nothing was published, and what the workspace
    committed is kept and published by the next ``stepfs sync``."""


class SharedConflict(CommitConflict):
    """Another workspace changed, in the shared history, a path this
    workspace also changed: nothing was written on either side.  ``paths``
    lists the paths, ``layers`` the shared layers that changed them."""

    def __init__(self, message: str, paths: list[str], layers: list[int]):
        super().__init__(message, paths)
        self.layers = layers


class HistoryError(StepfsError):
    """A shared history cannot be used as asked: a bad URL, a history that
    already exists (clone it instead), a workspace attached elsewhere."""
