"""The canonical schema of a stepfs store: every table, defined once.

Nothing else in the code base creates or redefines a table; ``store/FORMAT.md``
explains each column and the invariants between them.  The schema is written
in portable SQLAlchemy Core types so that the same definition can later run on
PostgreSQL (paths and symlink targets are ``LargeBinary`` because POSIX names
are bytes and need not be UTF-8).

Bump :data:`FORMAT_VERSION` (``store/version.py``) on any incompatible change and add an upgrade
step plus a line to the change log in FORMAT.md.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from stepfs.store.keys import BaseRef, HexKey
from stepfs.store.version import FORMAT_VERSION  # noqa: F401  (alone there, so --version reads it cheaply)

# FORMAT_VERSION: the one integer format version of a store.  A store whose
# version is newer is refused; an older one is upgraded (``db.UPGRADES``).
#: The content hash that keys objects and chunks.
HASH_ALGORITHM = "xxh3_128"
#: The largest chunk writers make, recorded in ``meta.chunk_size``.  Chunks are
#: content-defined (FastCDC, ``chunking.py``); readers go by the stored
#: chunk offsets, never by this number.
CHUNK_SIZE = 256 * 1024

metadata = MetaData()

# Key/value facts about the store itself: format_version, hash_algorithm,
# chunk_size (informational: the largest chunk writers make; readers go by the
# stored chunk offsets).
meta = Table(
    "meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# Key columns (oids, cids) are ``HexKey``: hex strings in Python, 16 bytes
# (plus a collision suffix) in the database (format 7, store/keys.py).
#
# Content-addressed chunks.  ``cid`` is the hex XXH3-128 of ``data``; when two
# different byte strings share a hash (only crafted input does this) the later
# one gets the suffix ``.1``, ``.2`` … so keys stay unique and nothing is
# deduplicated that is not byte-identical.
chunks = Table(
    "chunks",
    metadata,
    Column("cid", HexKey, primary_key=True),
    Column("size", Integer, nullable=False),  # length of the chunk's bytes (decoded)
    Column("data", LargeBinary, nullable=False),
    # How ``data`` holds the bytes (format 6, store/codec.py): 0 as they
    # are, 1 zstd, 2 zstd with the bytes of chunk ``base`` as dictionary
    # (a delta against an earlier version of the same file).
    Column("codec", Integer, nullable=False, server_default="0"),
    Column("base", HexKey, ForeignKey("chunks.cid")),
)
# Which chunks a base chunk is the dictionary of: gc keeps a base while a
# delta names it.
Index("chunks_base", chunks.c.base)

# Immutable file contents.  ``oid`` is the hex XXH3-128 of the whole content
# (suffixed like chunk ids on a collision).  An object is the concatenation of
# its chunks in ``seq`` order.
objects = Table(
    "objects",
    metadata,
    Column("oid", HexKey, primary_key=True),
    Column("size", BigInteger, nullable=False),
    # The gc generation (meta ``gc_generation``) in which the object was
    # last put, new or found again (format 6, store/gc.py): gc never
    # collects an object of the generation it started.
    Column("gen", Integer, nullable=False, server_default="0"),
    # A small object's bytes inline (format 7): ``data`` encoded as
    # ``codec`` says (0 raw, 1 zstd; store/codec.py) and no object_chunks
    # rows; NULL for an object made of chunks.
    Column("data", LargeBinary),
    Column("codec", Integer),
    # With codec 2: the inline object whose bytes are the zstd dictionary
    # (a delta against an earlier version of the same path, made when the
    # layer is written; store/delta.py).  Never itself a delta.  Format 10:
    # the first 4 bytes of its key (store/baseref.py), so no foreign key.
    Column("base", BaseRef),
    # Set (1) on an object once a delta names it as base, never cleared: such
    # an object is never made a delta (chains stay one link long).  A flag
    # in the row, not an index on ``base`` (which took about 10 % of a
    # session store: 32 bytes a delta).
    Column("is_base", Boolean),
    # Rows are small (a key, two integers, at most INLINE_MAX bytes): kept
    # in the primary key's B-tree, with no rowid and no second index.
    sqlite_with_rowid=False,
)

object_chunks = Table(
    "object_chunks",
    metadata,
    Column("oid", HexKey, ForeignKey("objects.oid"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("cid", HexKey, ForeignKey("chunks.cid"), nullable=False),
    PrimaryKeyConstraint("oid", "seq"),
    sqlite_with_rowid=False,
)
Index("object_chunks_cid", object_chunks.c.cid)

# Numbered layers (committed steps).  Layer 0 is the baseline written when the
# store is created.  ``state`` is 'pending' between the intent record and the
# end of publishing, then 'committed'; 'void' if recovery found its intent
# damaged (never history).  ``intent_sum`` is the checksum of the
# layer's entries, verified before a pending layer is rolled forward.
layers = Table(
    "layers",
    metadata,
    Column("number", Integer, primary_key=True, autoincrement=False),
    Column("state", String(16), nullable=False),  # pending | committed | void | pruned (format 6)
    Column("kind", String(16), nullable=False),  # baseline | step | rollback
    Column("created_ns", BigInteger, nullable=False),
    Column("message", Text, nullable=False, default=""),
    Column("agent", Text, nullable=False, default=""),
    Column("mount", Text, nullable=False, default=""),
    Column("meta", Text, nullable=False, default="{}"),  # JSON object
    Column("intent_sum", String(48), nullable=False, default=""),
    # The open step whose staged rows this layer consumes, in the same
    # transaction that marks it committed (format 2); NULL: none.
    Column("step", Integer),
)
# Every commit asks for a pending layer and history reads ask for the
# committed ones, newest first: without this index each was a scan of all
# layers (about 1 ms per commit at 50,000 layers), with it a lookup (format 5).
Index("layers_state_number", layers.c.state, layers.c.number)

# Every path an entry names and every directory above it, as a tree of
# names (format 8): a node is its parent's id and its own name, the root is
# 0 (no row).  An id never changes and is never reused; "below directory d"
# is the subtree of d's node (a recursive query on ``parent``).
paths = Table(
    "paths",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("parent", Integer, nullable=False),
    Column("name", LargeBinary, nullable=False),
    UniqueConstraint("parent", "name"),
)

# What a layer did to each path it touched: the state before and after, in
# lists of up to 4,096 entries sorted by path id (``first``: the list's
# first path id), each one zstd frame of fixed-width columns
# (store/entrylist.py).  An entry's kinds: NULL means "absent"; file | dir |
# symlink | fifo | chardev | blockdev | socket (a device's number is its
# target, decimal ASCII), and as a before state of layers older than format
# 3 only, special.  A rowid table: lists are kilobytes, a WITHOUT ROWID
# table would spill them to overflow pages (docs/format8.md).
layer_entries = Table(
    "layer_entries",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("layer", Integer, ForeignKey("layers.number"), nullable=False),
    Column("first", Integer, nullable=False),
    Column("n", Integer, nullable=False),
    Column("data", LargeBinary, nullable=False),
    UniqueConstraint("layer", "first"),
)

# Which layers have an entry at a path: the history of one path ("the
# newest entry of p at or before n") and of a subtree, read without
# decoding every layer's lists.
path_layers = Table(
    "path_layers",
    metadata,
    Column("path", Integer, ForeignKey("paths.id"), nullable=False),
    Column("layer", Integer, ForeignKey("layers.number"), nullable=False),
    PrimaryKeyConstraint("path", "layer"),
    sqlite_with_rowid=False,
)

# Open steps: one per mountpoint.  A daemon that restarts on the same
# mountpoint resumes its open step.
steps = Table(
    "steps",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("mountpoint", Text, nullable=False, unique=True),
    Column("agent", Text, nullable=False, default=""),
    Column("created_ns", BigInteger, nullable=False),
)

# The staged state of an open step, one row per path it changed.
#   kind     file | dir | symlink | fifo | chardev | blockdev | socket |
#            whiteout (the path is deleted)
#   opaque   for dir: the workspace directory at this path (if any) is hidden
#            below it; only staged children are visible
#   base     the workspace token of the path when it was first staged
#            ('absent' if it did not exist); checked again at commit
staged = Table(
    "staged",
    metadata,
    Column("step", Integer, ForeignKey("steps.id"), nullable=False),
    Column("path", LargeBinary, nullable=False),
    Column("kind", String(8), nullable=False),
    Column("mode", Integer, nullable=False, default=0),
    Column("oid", HexKey, ForeignKey("objects.oid")),
    Column("target", LargeBinary),
    Column("size", BigInteger, nullable=False, default=0),
    Column("mtime_ns", BigInteger, nullable=False, default=0),
    Column("opaque", Boolean, nullable=False, default=False),
    Column("base", Text, nullable=False),
    Column("uid", Integer),
    Column("gid", Integer),
    Column("xattrs", LargeBinary),
    # Files with the same link_group are one file with several names (hard
    # links made in the mount); NULL for a file with one name.
    Column("link_group", Integer),
    # A file staged by reference (format 4, store/refs.py): the name of its
    # immutable content file in the step's scratch directory and the
    # XXH3-128 of that content; ``oid`` is NULL until the bytes are imported.
    Column("scratch", Text),
    Column("scratch_sum", String(48)),
    PrimaryKeyConstraint("step", "path"),
)

# Bytes that lost a race or were discarded: nothing a user wrote is ever
# dropped without a row here.
conflicts = Table(
    "conflicts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("created_ns", BigInteger, nullable=False),
    Column("path", LargeBinary, nullable=False),
    Column("mount", Text, nullable=False, default=""),
    Column("agent", Text, nullable=False, default=""),
    Column("reason", String(32), nullable=False),  # discarded | stale-close | …
    Column("oid", HexKey, ForeignKey("objects.oid")),
    Column("mode", Integer),
    Column("token_mine", Text, nullable=False, default=""),
    Column("token_theirs", Text, nullable=False, default=""),
)

# Line counts of a layer's file changes, remembered once so that ``log``
# and ``show`` read them instead of reading and diffing both versions
# (store/linecounts.py, format 9).  One row a layer: ``data`` is one zstd
# frame of fixed-width columns naming each counted change by the positions
# of its entries in the layer's list, with a checksum of the object pairs
# they named when written, so a row whose layer's list changed since is
# ignored, never read stale.  Optional: a store without it reads as before
# and gets it when next opened for writing (FORMAT.md, "layer_counts").  A rowid table: a big layer's frame is one row, not overflow
# pages of a WITHOUT ROWID b-tree.
layer_counts = Table(
    "layer_counts",
    metadata,
    Column("layer", Integer, primary_key=True, autoincrement=False),
    Column("data", LargeBinary, nullable=False),
)
#: Tables a store of this format may lack: made when it is next opened to write.
OPTIONAL_TABLES = ("layer_counts",)
#: Tables a store gets from its upgrade to this format (a store of an older
#: version lacks them until then).
INTRODUCED = {"paths": 8, "layer_entries": 8, "path_layers": 8}
