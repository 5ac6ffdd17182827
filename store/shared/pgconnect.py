"""The SQLAlchemy engine of a PostgreSQL history, made for a command that
opens one connection and runs a few statements on it.

SQLAlchemy's dialect learns four facts about the server on the first
connect of every engine, by five queries (``version()``,
``current_schema()``, the isolation level, ``standard_conforming_strings``,
in a transaction of their own): six round trips before the command's
first statement.  The server sends the version and
``standard_conforming_strings`` unasked at the start of each session
(``ParameterStatus`` messages, kept by libpq), so the dialect here reads
them from the connection through its override hooks and asks nothing; the
schema name is looked up only where a table list needs it
(``Remote._ensure_schema``), and the isolation level a connection is reset
to is PostgreSQL's default, READ COMMITTED (a step's transactions are
explicit ``BEGIN`` ... ``COMMIT`` on an autocommit connection, which take
the server's default, whatever it is).
"""

from __future__ import annotations

import types

from sqlalchemy import create_engine
from sqlalchemy.engine import Engine


def _server_version_info(self, connection) -> tuple[int, ...]:
    v = connection.connection.dbapi_connection.info.server_version  # e.g. 160004 for 16.4
    return (v // 10000, v % 10000) if v >= 100000 else (v // 10000, v // 100 % 100, v % 100)


def _default_schema_name(self, connection) -> None:
    return None  # looked up where needed (Remote._ensure_schema)


def _default_isolation_level(self, dbapi_conn) -> str:
    return "READ COMMITTED"


def _set_backslash_escapes(self, connection) -> None:
    std = connection.connection.dbapi_connection.info.parameter_status("standard_conforming_strings")
    self._backslash_escapes = std == "off"


def engine(url, **kwargs) -> Engine:
    """``create_engine(url, **kwargs)`` whose first connect asks the server nothing."""
    eng = create_engine(url, **kwargs)
    d = eng.dialect
    d._get_server_version_info = types.MethodType(_server_version_info, d)
    d._get_default_schema_name = types.MethodType(_default_schema_name, d)
    d.get_default_isolation_level = types.MethodType(_default_isolation_level, d)
    d._set_backslash_escapes = types.MethodType(_set_backslash_escapes, d)
    return eng
