"""The schema of a shared history (FORMAT.md, "Shared history"): its own
tables, prefixed ``stepfs_`` so they can share a database with others.

Keys are SHA-256 (hex), not the local store's XXH3-128: ids in a local
store carry collision suffixes that depend on insertion order, so they mean
nothing in another store, and a key many machines trust must be collision
resistant.  A key found present is trusted without comparing bytes.
"""

from __future__ import annotations

from sqlalchemy import (BigInteger, Column, ForeignKey, ForeignKeyConstraint, Index, Integer, LargeBinary,
                        MetaData, PrimaryKeyConstraint, String, Table, Text)

from stepfs.store.shared.logread import CREATED_FORMAT, HASH, SHARED_FORMAT  # noqa: F401  (the shared format, where logread reads it without SQLAlchemy)

metadata = MetaData()

meta = Table(
    "stepfs_meta", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# One row per named history: its head is the newest layer's number (the
# compare-and-swap target of every publish).
histories = Table(
    "stepfs_histories", metadata,
    Column("name", String(64), primary_key=True),
    Column("head", BigInteger, nullable=False),
    Column("created_ns", BigInteger, nullable=False),
)

chunks = Table(
    "stepfs_chunks", metadata,
    Column("hash", String(64), primary_key=True),  # SHA-256 of the bytes
    Column("size", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
)

objects = Table(
    "stepfs_objects", metadata,
    Column("hash", String(64), primary_key=True),  # SHA-256 of the whole content
    Column("size", BigInteger, nullable=False),
)

object_chunks = Table(
    "stepfs_object_chunks", metadata,
    Column("object", String(64), ForeignKey("stepfs_objects.hash"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("chunk", String(64), ForeignKey("stepfs_chunks.hash"), nullable=False),
    PrimaryKeyConstraint("object", "seq"),
)

layers = Table(
    "stepfs_layers", metadata,
    Column("history", String(64), ForeignKey("stepfs_histories.name"), nullable=False),
    Column("number", BigInteger, nullable=False),
    Column("kind", String(16), nullable=False),  # baseline | step | rollback | sync
    Column("created_ns", BigInteger, nullable=False),
    Column("message", Text, nullable=False),
    Column("agent", Text, nullable=False),
    Column("mount", Text, nullable=False),
    Column("meta", Text, nullable=False),  # JSON object, keys sorted
    Column("workspace", String(64), nullable=False),  # the id of the workspace that made it
    Column("workspace_path", Text, nullable=False),
    Column("host", Text, nullable=False),
    Column("origin", BigInteger),  # the layer's number in that workspace's own store
    PrimaryKeyConstraint("history", "number"),
)
Index("stepfs_layers_origin", layers.c.history, layers.c.workspace, layers.c.origin)

entries = Table(
    "stepfs_entries", metadata,
    Column("history", String(64), nullable=False),
    Column("layer", BigInteger, nullable=False),
    Column("path", LargeBinary, nullable=False),
    Column("before_kind", String(8)),
    Column("before_mode", Integer),
    Column("before_object", String(64), ForeignKey("stepfs_objects.hash")),
    Column("before_target", LargeBinary),
    Column("before_xattrs", LargeBinary),
    Column("after_kind", String(8)),
    Column("after_mode", Integer),
    Column("after_object", String(64), ForeignKey("stepfs_objects.hash")),
    Column("after_target", LargeBinary),
    Column("after_xattrs", LargeBinary),
    Column("after_mtime_ns", BigInteger),
    Column("after_link", LargeBinary),
    PrimaryKeyConstraint("history", "layer", "path"),
    ForeignKeyConstraint(["history", "layer"], ["stepfs_layers.history", "stepfs_layers.number"]),
)
Index("stepfs_entries_path", entries.c.history, entries.c.path, entries.c.layer)
# What gc-history's deletes look up: each object or chunk deleted is checked
# against the rows whose foreign keys name it, a scan of the whole table per
# key without these (9.4 s against 0.35 s for the 1,910 objects a prune of
# 190 layers of a 10,000-file history left).  gc makes them on a database
# made before them (``gc.ensure_indexes``).
GC_INDEXES = [
    Index("stepfs_entries_before_object", entries.c.before_object,
          postgresql_where=entries.c.before_object.is_not(None)),
    Index("stepfs_entries_after_object", entries.c.after_object,
          postgresql_where=entries.c.after_object.is_not(None)),
    Index("stepfs_object_chunks_chunk", object_chunks.c.chunk),
]
