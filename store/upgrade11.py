"""The upgrade of a version-10 store to format 11 (a ``before_oid`` that
repeats the path's previous ``after_oid`` is a marker, ``store/entrylist.py``;
docs/format11.md), run by ``db.Database._upgrade`` inside its one durable
transaction.

Every list is written again with its markers
(``entrytable.mark_every_list``: in layer order, in memory; the SQL on the
entry tables stays in the entry seam).  No table changes.  A crash before
the COMMIT leaves the version-10 store.
"""

from __future__ import annotations

from stepfs.store import entrytable


def upgrade(conn) -> None:
    entrytable.mark_every_list(conn)
