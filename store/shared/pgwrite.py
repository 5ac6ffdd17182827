"""The two writes of a step on PostgreSQL, each ONE statement with array
parameters (``unnest``), whatever the number of rows (FORMAT.md,
"Ordering rules"):

* the upload: chunks, objects and chunk lists of a batch, every insert
  ignoring a key already there (idempotent), its own transaction,
  committed without waiting for the server's disk (see ``_PUT_OBJECTS``).
  :func:`put_objects` runs it alone on the command's autocommit
  connection; :func:`put_statements` gives it, between a BEGIN and a
  COMMIT of its own, to send in the publish's pipeline ahead of the
  publish's own BEGIN (``Remote.put_objects``);
* the publish (:func:`publish_statement`): the head's compare-and-swap
  and, only if it moved, the layer row and its entries.  Data-modifying
  CTEs of one statement commit or roll back together, and the foreign
  keys are checked at its end, so a crash or a dropped connection leaves
  no layer or the whole layer.  ``Remote.publish`` sends BEGIN and it
  (after the uploads that ride along) in one round trip, and COMMIT in
  another once it answered: the server may still run a statement that was
  sent before the connection was cut, and must then roll it back, not
  commit it on its own.

The SQL text is fixed whatever the number of rows: nothing is compiled per
step (SQLAlchemy's compiling of a multi-row VALUES cost more than the round
trips it saved).  SQLite histories keep ``Remote``'s SQLAlchemy Core path.
"""

from __future__ import annotations

import json

from sqlalchemy.engine import Connection

from stepfs.store.shared import tables as T

# The columns of an entry row after (history, layer), with their array types.
_ENTRY_TYPES = {
    "path": "bytea", "before_kind": "text", "before_mode": "int", "before_object": "text",
    "before_target": "bytea", "before_xattrs": "bytea", "after_kind": "text", "after_mode": "int",
    "after_object": "text", "after_target": "bytea", "after_xattrs": "bytea", "after_mtime_ns": "bigint",
    "after_link": "bytea",
}
assert list(_ENTRY_TYPES) == [c.name for c in T.entries.columns if c.name not in ("history", "layer")]

# set_config(..., true): synchronous_commit off until the end of this
# statement's own transaction, so its commit does not wait for the server's
# disk.  The publish naming these objects commits synchronously, and the
# server flushes its log in order: the objects are on disk before any layer
# naming them is; a crash before may lose them, and then no layer names them.
_PUT_OBJECTS = f"""
WITH nosync AS (
  SELECT set_config('synchronous_commit', 'off', true)
), c AS (
  INSERT INTO {T.chunks.name} (hash, size, data)
  SELECT * FROM unnest(%(chunk_hash)s::text[], %(chunk_size)s::int[], %(chunk_data)s::bytea[])
  ON CONFLICT DO NOTHING
), o AS (
  INSERT INTO {T.objects.name} (hash, size)
  SELECT * FROM unnest(%(object_hash)s::text[], %(object_size)s::bigint[])
  ON CONFLICT DO NOTHING
)
INSERT INTO {T.object_chunks.name} (object, seq, "offset", chunk)
SELECT l.* FROM nosync, unnest(%(link_object)s::text[], %(link_seq)s::int[], %(link_offset)s::bigint[],
                             %(link_chunk)s::text[]) AS l
ON CONFLICT DO NOTHING
"""

_LAYER_COLUMNS = [c.name for c in T.layers.columns if c.name not in ("history", "number")]
_LAYER_TYPES = {"created_ns": "bigint", "origin": "bigint"}

def _layer_statement(moved: str) -> str:
    """The layer row and its entries, inserted only if CTE ``moved`` (which
    returns the layer's number as ``head``) returned a row."""
    return f"""
WITH moved AS ({moved}
), layer AS (
  INSERT INTO {T.layers.name} (history, number, {", ".join(_LAYER_COLUMNS)})
  SELECT %(history)s, head, {", ".join(f"%({c})s::{_LAYER_TYPES.get(c, 'text')}" for c in _LAYER_COLUMNS)}
  FROM moved
  RETURNING number
), rows AS (
  INSERT INTO {T.entries.name} (history, layer, {", ".join(_ENTRY_TYPES)})
  SELECT %(history)s, layer.number, e.*
  FROM layer, unnest({", ".join(f"%(e_{c})s::{t}[]" for c, t in _ENTRY_TYPES.items())})
    AS e({", ".join(_ENTRY_TYPES)})
)
SELECT count(*) FROM layer
"""


# The head's compare-and-swap.
_PUBLISH = _layer_statement(f"""
  UPDATE {T.histories.name} SET head = %(number)s WHERE name = %(history)s AND head = %(expect)s
  RETURNING head""")
# A new history with its layer 0 (nothing if the name is taken).
_CREATE = _layer_statement(f"""
  INSERT INTO {T.histories.name} (name, head, created_ns) VALUES (%(history)s, 0, %(history_created_ns)s)
  ON CONFLICT DO NOTHING
  RETURNING head""")


def _put_params(chunks: list[dict], objects: list[dict], links: list[dict]) -> dict:
    return {
        "chunk_hash": [r["hash"] for r in chunks], "chunk_size": [r["size"] for r in chunks],
        "chunk_data": [r["data"] for r in chunks],
        "object_hash": [r["hash"] for r in objects], "object_size": [r["size"] for r in objects],
        "link_object": [r["object"] for r in links], "link_seq": [r["seq"] for r in links],
        "link_offset": [r["offset"] for r in links], "link_chunk": [r["chunk"] for r in links],
    }


def put_objects(conn: Connection, chunks: list[dict], objects: list[dict], links: list[dict]) -> None:
    """Insert a batch's rows (as ``Remote.put_objects`` builds them) in one
    statement, its own transaction (run on an autocommit connection)."""
    conn.exec_driver_sql(_PUT_OBJECTS, _put_params(chunks, objects, links))


def put_statements(chunks: list[dict], objects: list[dict], links: list[dict]) -> list[tuple[str, dict | None]]:
    """The same batch as statements for a pipeline (``Remote._pipeline``,
    where statements without a Sync between them share one implicit
    transaction): the insert between a BEGIN and a COMMIT of its own."""
    return [("BEGIN", None), (_PUT_OBJECTS, _put_params(chunks, objects, links)), ("COMMIT", None)]


def publish_statement(history: str, expect: int, layer: dict, entries: list[dict]) -> tuple[str, dict]:
    """The statement that moves ``history``'s head from ``expect`` to
    ``expect + 1`` and inserts the layer (``LayerRecord.as_dict()``) and its
    entries; it returns one row, ``1`` if it did and ``0`` if the head was
    not ``expect`` (nothing of the layer written)."""
    return _PUBLISH, _params(history, expect + 1, layer, entries, expect=expect)


def create(conn: Connection, history: str, layer: dict, entries: list[dict], created_ns: int) -> bool:
    """Make ``history`` with ``layer`` as its layer 0, in one statement;
    False if a history of that name exists (nothing written)."""
    return conn.exec_driver_sql(_CREATE, _params(history, 0, layer, entries, history_created_ns=created_ns)).scalar() == 1


def _params(history: str, number: int, layer: dict, entries: list[dict], **more) -> dict:
    params = {"history": history, "number": number, **more}
    for c in _LAYER_COLUMNS:
        params[c] = json.dumps(layer[c] or {}, sort_keys=True) if c == "meta" else layer[c]
    for c in _ENTRY_TYPES:
        params[f"e_{c}"] = [e[c] for e in entries]
    return params
