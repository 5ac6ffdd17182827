"""Reads of the ``conflicts`` table (FORMAT.md): what ``stepfs status``
lists and what ``MOUNT/.stepfs/conflicts/`` shows.  Rows are written where
the conflict happens (``publish.py``, the view's content code)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Connection, Row

from stepfs.store import schema


def listed(conn: Connection) -> list[Row]:
    """Every recorded conflict, oldest first."""
    return conn.execute(select(schema.conflicts).order_by(schema.conflicts.c.id)).all()


def of_mount(conn: Connection, mountpoint: str) -> dict[bytes, str | None]:
    """Path -> oid of the latest conflict recorded by the mount at ``mountpoint``."""
    c = schema.conflicts
    rows = conn.execute(select(c.c.path, c.c.oid).where(c.c.mount == mountpoint).order_by(c.c.id)).all()
    return {bytes(r.path): r.oid for r in rows}

