"""The reads every shared step makes on PostgreSQL, as fixed SQL text run
with ``exec_driver_sql``: the format facts when the history opens, the
history's lock, and the head with this workspace's published layers once
the lock is held.

SQLAlchemy caches a compiled statement per engine, and every command (a
CLI process, a workspace opened by the bench) makes a new engine: each of
these was compiled again by every step, which cost more on the client
than the statement cost the server.  SQLite histories keep ``Remote``'s
SQLAlchemy Core path.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection

from stepfs.store.shared import tables as T

_FACTS = f"SELECT key, value FROM {T.meta.name}"

# Both advisory locks in one statement: the history's own (steps of
# workspaces sharing it take turns) and the objects' lock shared (gc takes
# it alone: no gc between an upload and the layer naming it).
_LOCK = "SELECT pg_advisory_lock(hashtext(%(k)s)), pg_advisory_lock_shared(hashtext(%(o)s))"

# Run after the lock statement, never in it: a statement's snapshot is
# taken when it starts, which would be before a lock it waited for.  The
# two go in one pipeline (``Remote.lock``): the server runs them in order,
# and at READ COMMITTED each statement of the pipeline's implicit
# transaction takes a snapshot of its own when it starts.
_POSITION = f"""
SELECT h.head, l.origin, l.number
FROM {T.histories.name} AS h
LEFT OUTER JOIN {T.layers.name} AS l
  ON l.history = h.name AND l.workspace = %(workspace)s AND l.origin IS NOT NULL
WHERE h.name = %(history)s
"""


def facts(conn: Connection) -> dict[str, str]:
    """The history database's ``stepfs_meta`` rows (raises SQLAlchemy's
    ProgrammingError if the table is not there yet)."""
    return dict(conn.exec_driver_sql(_FACTS).all())


def lock_statement(key: str, objects_key: str) -> tuple[str, dict]:
    """Wait for the session advisory lock ``key``, then take ``objects_key`` shared."""
    return _LOCK, {"k": key, "o": objects_key}


def position_statement(history: str, workspace: str) -> tuple[str, dict]:
    """The head of ``history`` with the layers ``workspace`` published (read :func:`position`)."""
    return _POSITION, {"workspace": workspace, "history": history}


def position(rows: list[tuple]) -> tuple[int | None, dict[int, int]]:
    """The head (None if the history does not exist) and ``{origin: shared
    number}`` of the workspace's published layers, from the rows of
    :func:`position_statement`."""
    if not rows:
        return None, {}
    return rows[0][0], {int(o): int(n) for _h, o, n in rows if o is not None}
