"""The one place a shared history's URL is parsed (``--history URL`` and
``STEPFS_HISTORY``).

Forms (the history's name is the ``name`` query parameter, letters, digits,
``.``, ``_`` and ``-``)::

    postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE?name=NAME
    postgresql://USER@/DATABASE?host=/run/postgresql&name=NAME     (Unix socket)
    sqlite:////ABSOLUTE/PATH.db?name=NAME                          (one machine)

``postgresql://`` is driven by psycopg 3 through SQLAlchemy (``stepfs log``:
by psycopg alone, ``logread``).  Every other
query parameter is handed to the driver; ``connect_timeout`` defaults to
:data:`CONNECT_TIMEOUT` seconds so an unreachable server fails a command
instead of hanging it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, quote_plus, unquote

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

    def connect_kwargs(self) -> dict:
        """PostgreSQL: the arguments of ``psycopg.connect`` the URL gives, as
        SQLAlchemy's psycopg dialect makes them (``user``, ``password``,
        ``host``, ``port``, ``dbname``, then every query parameter but
        ``name``; a repeated one: its last value)."""
        url = _split(self.text)
        out = {k: v for k, v in (("user", url.user), ("password", url.password), ("host", url.host),
                                 ("port", url.port), ("dbname", url.database)) if v}
        out.update({k: v[-1] if isinstance(v, tuple) else v for k, v in url.query.items() if k != "name"})
        return out


# The grammar SQLAlchemy's ``make_url`` reads (so ``engine_url`` and this
# agree on every part), matched here without importing SQLAlchemy: a
# command that only reads the log must not pay for it (tests/test_cli_startup.py).
_URL = re.compile(r"""
    (?P<scheme>[\w+]+)://
    (?:(?P<user>[^:/]*)(?::(?P<password>[^@]*))?@)?
    (?:(?:\[(?P<ipv6>[^/?]+)\]|(?P<host>[^/:?]+))?(?::(?P<port>[^/?]*))?)?
    (?:/(?P<database>[^?]*))?
    (?:\?(?P<query>.*))?
""", re.X)


@dataclass(frozen=True)
class _Parts:
    scheme: str
    user: str | None
    password: str | None
    host: str | None
    port: int | None
    database: str | None
    query: dict  # key -> value, or a tuple of values for a repeated key

    def render(self) -> str:
        """The URL as SQLAlchemy renders it with the password hidden (``display``)."""
        s = self.scheme + "://"
        if self.user is not None:
            s += quote(self.user, safe=" +") + (":***" if self.password is not None else "") + "@"
        if self.host is not None:
            s += f"[{self.host}]" if ":" in self.host else self.host
        if self.port is not None:
            s += f":{self.port}"
        if self.database is not None:
            s += "/" + quote(self.database, safe=" +/")
        if self.query:
            s += "?" + "&".join(f"{quote_plus(k)}={quote_plus(v)}" for k in sorted(self.query)
                                for v in (self.query[k] if isinstance(self.query[k], tuple) else (self.query[k],)))
        return s


def _split(text: str) -> _Parts:
    m = _URL.match(text)
    if m is None:
        raise HistoryError(f"{text!r} is not a history URL; write postgresql://USER@HOST/DATABASE?name=NAME.")
    g = m.groupdict()
    query: dict = {}
    for k, v in parse_qsl(g["query"] or ""):
        if k not in query:
            query[k] = v
        else:
            query[k] = (*query[k], v) if isinstance(query[k], tuple) else (query[k], v)
    try:
        port = int(g["port"]) if g["port"] else None
    except ValueError:
        raise HistoryError(f"the port of the history URL must be a number, not {g['port']!r}.") from None
    user, password, database = (None if v is None else unquote(v) for v in (g["user"], g["password"], g["database"]))
    return _Parts(g["scheme"], user, password, g["host"] or g["ipv6"], port, database, query)


def parse(text: str) -> HistoryURL:
    """Raises :class:`HistoryError` for a URL stepfs cannot use."""
    url = _split(text)
    backend = url.scheme.split("+")[0]
    if backend not in ("postgresql", "sqlite"):
        raise HistoryError(f"a shared history lives in PostgreSQL (postgresql://...) or an SQLite file (sqlite:///...), "
                           f"not {backend}.")
    if url.scheme not in ("postgresql", "postgresql+psycopg", "sqlite"):
        raise HistoryError(f"stepfs reaches PostgreSQL through psycopg 3: write postgresql://..., not {url.scheme}://.")
    name = url.query.get("name")
    if isinstance(name, tuple):
        name = name[-1]
    if not name or not _NAME.fullmatch(name):
        raise HistoryError("the history URL needs the history's name as ?name=NAME (letters, digits, '.', '_', '-', "
                           "at most 64).")
    if backend == "sqlite" and (not url.database or not os.path.isabs(url.database)):
        raise HistoryError("an SQLite history URL names an absolute file: sqlite:////path/to/history.db?name=NAME.")
    return HistoryURL(text, name, backend, url.render())


def from_environment(given: str | None) -> HistoryURL | None:
    """``given`` (a ``--history`` option), else ``STEPFS_HISTORY``, parsed; None if neither."""
    text = given or os.environ.get(ENV)
    return parse(text) if text else None
