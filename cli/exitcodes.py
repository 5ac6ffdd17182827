"""Exit codes of the ``stepfs`` command: one table, one code per kind of error.

Documented in README.md ("Scripting"); changing a number breaks scripts.
"""

from __future__ import annotations

from stepfs.store import errors

OK = 0
UNEXPECTED = 1  # a bug: the message says so and where the log is
USAGE = 2  # argparse's own code for bad arguments
#: The reader of the output went away (``stepfs log | head``): the code a
#: shell shows for a tool killed by SIGPIPE (128 + 13), as git and coreutils
#: give; the command's own work is done or was read-only.
OUTPUT_CLOSED = 141

#: Error class -> exit code, most specific first.
CODES: list[tuple[type, int]] = [
    (errors.WorkspaceError, 3),
    (errors.MountpointError, 4),
    (errors.StoreFormatError, 5),
    (errors.NothingToCommit, 6),
    (errors.CommitConflict, 7),
    (errors.NotMountedError, 8),
    (errors.DaemonError, 9),
    (errors.ContainmentError, 10),
    (errors.NoSuchLayer, 11),
    (errors.CorruptObject, 12),
    (errors.InputError, 13),
    (errors.NoSuchPath, 14),
    (errors.StoreDamaged, 15),
    (errors.StoreUnavailable, 16),  # StoreFull included
    (errors.PublishFailed, 17),
    (errors.ConfinementUnavailable, 18),
    (errors.HistoryUnreachable, 19),
    (errors.HistoryError, 20),
    (errors.StoreBusy, 21),
]


def code_for(exc: BaseException) -> int:
    for cls, code in CODES:
        if isinstance(exc, cls):
            return code
    return UNEXPECTED
