"""``stepfs log --history URL``: a shared history's layers, newest first,
each with its (added, modified, deleted) path counts, in ONE query (the
counts grouped by the server: no entry row crosses the wire).

The query is plain SQL text, run by ``Remote.log`` through SQLAlchemy on
either backend and, for the CLI on PostgreSQL, by :func:`read` through
psycopg alone: SQLAlchemy and its dialect are most of the command's
start-up (tests/test_cli_startup.py checks it is not imported).
:func:`read` bounds its session as ``Remote`` does (``stall``) and
reports the same errors.

This module imports no SQLAlchemy: the layer header and the shared
format's version live here for that reason (``tables`` and ``remote``
re-export them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from stepfs.store.errors import StoreFormatError

#: The newest shared format this stepfs reads (``stepfs_meta.format_version``):
#: 1, or 2 once a history of the database was pruned (``prune.py``).  New
#: databases are made at 1, which older stepfs read too.
SHARED_FORMAT = 2
CREATED_FORMAT = 1
HASH = "sha256"

#: ``stepfs_layers``' columns in table order (tables.py; a test checks they agree).
LAYER_COLUMNS = ("history", "number", "kind", "created_ns", "message", "agent", "mount", "meta", "workspace",
                 "workspace_path", "host", "origin")

FACTS = "SELECT key, value FROM stepfs_meta"

# The page of layers first (the newest LIMIT of them not dropped by
# ``stepfs prune --history``, by the primary key's index), then their entries counted by kind of change.  GROUP BY names
# every column: a subquery's key does not make the others functionally
# dependent on it for PostgreSQL.
_PAGE = ", ".join(f"page.{c}" for c in LAYER_COLUMNS)
_LOG = f"""
SELECT {_PAGE},
  count(e.path) FILTER (WHERE e.before_kind IS NULL),
  count(e.path) FILTER (WHERE e.before_kind IS NOT NULL AND e.after_kind IS NOT NULL),
  count(e.path) FILTER (WHERE e.before_kind IS NOT NULL AND e.after_kind IS NULL)
FROM (SELECT {", ".join(LAYER_COLUMNS)} FROM stepfs_layers WHERE history = {{history}} AND kind <> 'pruned'
      ORDER BY number DESC{{limit}}) AS page
LEFT OUTER JOIN stepfs_entries AS e ON e.history = page.history AND e.layer = page.number
GROUP BY {_PAGE}
ORDER BY page.number DESC
"""


@dataclass
class LayerRecord:
    """A shared layer's header."""

    number: int
    kind: str
    created_ns: int
    message: str
    agent: str
    mount: str
    meta: dict
    workspace: str
    workspace_path: str
    host: str
    origin: int | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def statement(name: str, limit: int | None, paramstyle: str) -> tuple[str, dict]:
    """The log's query of history ``name`` (at most ``limit`` layers) and its
    parameters, for a driver of ``paramstyle`` ("pyformat": psycopg, "named": sqlite3)."""
    mark = (lambda p: f"%({p})s") if paramstyle == "pyformat" else (lambda p: f":{p}")
    sql = _LOG.format(history=mark("history"), limit="" if limit is None else f" LIMIT {mark('limit')}")
    params = {"history": name} if limit is None else {"history": name, "limit": limit}
    return sql, params


def records(rows) -> list[tuple[LayerRecord, tuple[int, int, int]]]:
    """The rows of :func:`statement` as (layer, (added, modified, deleted))."""
    # Unpacked by position, and the usual empty meta not parsed: a long
    # history's log is mostly this loop.
    return [(LayerRecord(number, kind, created, message, agent, mount, {} if meta == "{}" else json.loads(meta),
                         workspace, path, host, origin), (a, m, d))
            for (_h, number, kind, created, message, agent, mount, meta, workspace, path, host, origin, a, m, d)
            in rows]


def check_format(facts: dict, display: str) -> None:
    """Refuse a history written by a newer stepfs (``stepfs_meta``'s rows)."""
    version = int(facts.get("format_version", "0") or 0)
    if version > SHARED_FORMAT or facts.get("hash_algorithm") != HASH:
        raise StoreFormatError(f"the shared history {display} was written by a newer stepfs "
                               f"(format {version}); upgrade stepfs.")


def read(url, limit: int | None = None) -> list[tuple[LayerRecord, tuple[int, int, int]]]:
    """The log of the PostgreSQL history ``url`` (a ``HistoryURL``) through
    psycopg alone: one connection, the format check, the log's query.
    Empty if the history (or its schema) does not exist; a server that
    cannot be reached, or does not answer, is ``HistoryUnreachable``."""
    import psycopg

    from stepfs.store.shared import stall
    from stepfs.store.shared.url import CONNECT_TIMEOUT

    watchdog = stall.Watchdog()
    try:
        # The URL's own parameters first, the session's bounds over them (as
        # SQLAlchemy's connect_args override the URL's query for Remote).
        with psycopg.connect(**{**url.connect_kwargs(), **stall.session_args(CONNECT_TIMEOUT)},
                             autocommit=True) as conn:
            def run(sql: str, params: dict | None = None) -> list[tuple]:
                watchdog.arm(conn.pgconn.socket, stall.STALL_TIMEOUT)
                try:
                    return conn.execute(sql, params).fetchall()
                finally:
                    watchdog.disarm()

            try:
                facts = dict(run(FACTS))
            except psycopg.errors.UndefinedTable:
                return []  # no shared history was ever made in this database
            check_format(facts, url.display)
            return records(run(*statement(url.name, limit, "pyformat")))
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise stall.unreachable(url.display, exc, watchdog.stalled, stall.RETRY_HINT) from None
    finally:
        watchdog.stop()
