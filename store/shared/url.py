"""The one place a shared history's URL is parsed (``--history URL`` and
``STEPFS_HISTORY``).

Forms (the history's name is the ``name`` query parameter, letters, digits,
``.``, ``_`` and ``-``)::

    postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE?name=NAME
    postgresql://USER@/DATABASE?host=/run/postgresql&name=NAME     (Unix socket)
    sqlite:////ABSOLUTE/PATH.db?name=NAME                          (one machine)

``postgresql://`` is driven by psycopg 3 through SQLAlchemy.  Every other
query parameter is handed to the driver; ``connect_timeout`` defaults to
:data:`CONNECT_TIMEOUT` seconds so an unreachable server fails a command
instead of hanging it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from stepfs.store.errors import HistoryError

ENV = "STEPFS_HISTORY"
CONNECT_TIMEOUT = 5
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class HistoryURL:
    text: str  # as given (may hold a password: never printed)
    name: str  # the history's name
    dialect: str  # "postgresql" or "sqlite"
    display: str  # for messages: the password hidden

    def engine_url(self):
        """The SQLAlchemy URL (without ``name``), for ``create_engine``."""
        from sqlalchemy.engine import make_url

        url = make_url(self.text)
        query = {k: v for k, v in url.query.items() if k != "name"}
        if self.dialect == "postgresql":
            return url.set(drivername="postgresql+psycopg", query=query)
        return url.set(query=query)


def parse(text: str) -> HistoryURL:
    """Raises :class:`HistoryError` for a URL stepfs cannot use."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
    except ArgumentError:
        raise HistoryError(f"{text!r} is not a history URL; write postgresql://USER@HOST/DATABASE?name=NAME.") from None
    backend = url.get_backend_name()
    if backend not in ("postgresql", "sqlite"):
        raise HistoryError(f"a shared history lives in PostgreSQL (postgresql://...) or an SQLite file (sqlite:///...), "
                           f"not {backend}.")
    if url.drivername not in ("postgresql", "postgresql+psycopg", "sqlite"):
        raise HistoryError(f"stepfs reaches PostgreSQL through psycopg 3: write postgresql://..., not {url.drivername}://.")
    name = url.query.get("name")
    if isinstance(name, tuple):
        name = name[-1]
    if not name or not _NAME.fullmatch(name):
        raise HistoryError("the history URL needs the history's name as ?name=NAME (letters, digits, '.', '_', '-', "
                           "at most 64).")
    if backend == "sqlite" and (not url.database or not os.path.isabs(url.database)):
        raise HistoryError("an SQLite history URL names an absolute file: sqlite:////path/to/history.db?name=NAME.")
    return HistoryURL(text, name, backend, url.render_as_string(hide_password=True))


def from_environment(given: str | None) -> HistoryURL | None:
    """``given`` (a ``--history`` option), else ``STEPFS_HISTORY``, parsed; None if neither."""
    text = given or os.environ.get(ENV)
    return parse(text) if text else None
