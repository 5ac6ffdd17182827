"""Helpers for the kernel-free store tests: build workspaces and open steps
by hand, the way the overlay would, without FUSE."""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from pathlib import Path

from stepfs.store import staging, tokens
from stepfs.store.workspace import Workspace

MOUNT = "/test/mnt"


def build_tree(root: Path, tree: dict[str, tuple]) -> None:
    """``{path: ("file", mode, bytes) | ("dir", mode) | ("symlink", target)}``,
    created in path order (parents first)."""
    root.mkdir(exist_ok=True)
    for rel in sorted(tree, key=lambda p: p.count("/")):
        spec, full = tree[rel], root / rel
        if spec[0] == "dir":
            full.mkdir()
        elif spec[0] == "file":
            full.write_bytes(spec[2])
        else:
            os.symlink(spec[1], full)
    # Modes last, deepest first, so read-only directories were filled first.
    for rel in sorted(tree, key=lambda p: -p.count("/")):
        if tree[rel][0] != "symlink":
            os.chmod(root / rel, tree[rel][1])


def expected_manifest(tree: dict[str, tuple]) -> dict[bytes, tuple]:
    """The ``conftest.manifest`` form of a ``build_tree`` description."""
    out = {}
    for rel, spec in tree.items():
        if spec[0] == "file":
            out[os.fsencode(rel)] = ("file", spec[1], spec[2])
        elif spec[0] == "dir":
            out[os.fsencode(rel)] = ("dir", spec[1], None)
        else:
            out[os.fsencode(rel)] = ("symlink", None, os.fsencode(spec[1]))
    return out


def token_of(ws: Workspace, path: bytes) -> str:
    """The workspace token of ``path`` now, as the overlay records it
    (``overlayfs.view.Overlay._lower_token``)."""
    try:
        st = ws.root.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return tokens.ABSENT
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV):  # through a symlink: not in the tree
            return tokens.ABSENT
        raise
    target = ws.root.readlink(path) if stat_mod.S_ISLNK(st.st_mode) else None
    return tokens.from_stat(st, target)


class Stager:
    """Stage rows of one open step, each ``base`` taken from the workspace
    at staging time (as the overlay's copy-up does)."""

    def __init__(self, ws: Workspace, mountpoint: str = MOUNT):
        self.ws = ws
        with ws.db.write() as conn:
            self.step = staging.open_step(conn, mountpoint, agent="tester")

    def _put(self, row: staging.StagedRow) -> None:
        with self.ws.db.write() as conn:
            staging.put(conn, self.step, row)

    def file(self, path: str, data: bytes, mode: int = 0o644, mtime_ns: int = 1_600_000_000_123_456_789) -> str:
        p = os.fsencode(path)
        with self.ws.db.write() as conn:
            oid = self.ws.objects.put_bytes(conn, data)
        self._put(staging.StagedRow(p, "file", stat_mod.S_IFREG | mode, oid, None, len(data), mtime_ns,
                                    False, token_of(self.ws, p)))
        return oid

    def dir(self, path: str, mode: int = 0o755, opaque: bool = False) -> None:
        p = os.fsencode(path)
        self._put(staging.StagedRow(p, "dir", stat_mod.S_IFDIR | mode, opaque=opaque, base=token_of(self.ws, p)))

    def symlink(self, path: str, target: str) -> None:
        p = os.fsencode(path)
        t = os.fsencode(target)
        self._put(staging.StagedRow(p, "symlink", stat_mod.S_IFLNK | 0o777, target=t, size=len(t),
                                    mtime_ns=1_600_000_000_000_000_000, base=token_of(self.ws, p)))

    def whiteout(self, path: str) -> None:
        p = os.fsencode(path)
        self._put(staging.StagedRow(p, "whiteout", base=token_of(self.ws, p)))

    def rows(self) -> list[staging.StagedRow]:
        with self.ws.db.read() as conn:
            return staging.load(conn, self.step)


def open_workspace(path: Path, tree: dict[str, tuple] | None = None) -> Workspace:
    build_tree(path, tree or {})
    return Workspace.open(str(path), create=True)


def plain(state):
    """A layer state without owner fields (tests that do not care about
    ownership compare kind, mode, content, target and xattrs only)."""
    import dataclasses

    return None if state is None else dataclasses.replace(state, uid=None, gid=None)


def object_to_file(db, objects, oid: str, out: Path) -> os.stat_result:
    """Write object ``oid`` into the new file ``out`` with
    ``ObjectStore.write_to_fd`` and fsync it; returns its stat (allocated
    blocks included, to check that holes stayed holes)."""
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with db.read() as conn:
            objects.write_to_fd(conn, oid, fd)
        os.fsync(fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


#: The version-6 tables that format 7 rebuilt (text keys, every table with
#: a rowid), as a version-6 stepfs created them.
V6_TABLES = {
    "chunks": """CREATE TABLE chunks (cid VARCHAR(48) NOT NULL, size INTEGER NOT NULL, data BLOB NOT NULL,
        codec INTEGER DEFAULT '0' NOT NULL, base VARCHAR(48), PRIMARY KEY (cid),
        FOREIGN KEY(base) REFERENCES chunks (cid))""",
    "objects": """CREATE TABLE objects (oid VARCHAR(48) NOT NULL, size BIGINT NOT NULL,
        gen INTEGER DEFAULT '0' NOT NULL, PRIMARY KEY (oid))""",
    "object_chunks": """CREATE TABLE object_chunks (oid VARCHAR(48) NOT NULL, seq INTEGER NOT NULL,
        "offset" BIGINT NOT NULL, cid VARCHAR(48) NOT NULL, PRIMARY KEY (oid, seq),
        FOREIGN KEY(oid) REFERENCES objects (oid), FOREIGN KEY(cid) REFERENCES chunks (cid))""",
    "entries": """CREATE TABLE entries (layer INTEGER NOT NULL, path BLOB NOT NULL, before_kind VARCHAR(8),
        before_mode INTEGER, before_oid VARCHAR(48), before_target BLOB, after_kind VARCHAR(8), after_mode INTEGER,
        after_oid VARCHAR(48), after_target BLOB, after_mtime_ns BIGINT, before_uid INTEGER, before_gid INTEGER,
        before_xattrs BLOB, after_uid INTEGER, after_gid INTEGER, after_xattrs BLOB, after_link BLOB,
        PRIMARY KEY (layer, path), FOREIGN KEY(layer) REFERENCES layers (number),
        FOREIGN KEY(before_oid) REFERENCES objects (oid), FOREIGN KEY(after_oid) REFERENCES objects (oid))""",
    "staged": """CREATE TABLE staged (step INTEGER NOT NULL, path BLOB NOT NULL, kind VARCHAR(8) NOT NULL,
        mode INTEGER NOT NULL, oid VARCHAR(48), target BLOB, size BIGINT NOT NULL, mtime_ns BIGINT NOT NULL,
        opaque BOOLEAN NOT NULL, base TEXT NOT NULL, uid INTEGER, gid INTEGER, xattrs BLOB, link_group INTEGER,
        scratch TEXT, scratch_sum VARCHAR(48), PRIMARY KEY (step, path), FOREIGN KEY(step) REFERENCES steps (id),
        FOREIGN KEY(oid) REFERENCES objects (oid))""",
    "conflicts": """CREATE TABLE conflicts (id INTEGER NOT NULL, created_ns BIGINT NOT NULL, path BLOB NOT NULL,
        mount TEXT NOT NULL, agent TEXT NOT NULL, reason VARCHAR(32) NOT NULL, oid VARCHAR(48), mode INTEGER,
        token_mine TEXT NOT NULL, token_theirs TEXT NOT NULL, PRIMARY KEY (id),
        FOREIGN KEY(oid) REFERENCES objects (oid))""",
}
V6_INDEXES = ["CREATE INDEX chunks_base ON chunks (base)", "CREATE INDEX object_chunks_cid ON object_chunks (cid)",
              "CREATE INDEX entries_path_layer ON entries (path, layer)"]


def rewrite_layer(conn, number: int, change) -> None:
    """Store layer ``number``'s entries as ``change(entries)`` returns them,
    in the caller's transaction (a test's damage to an intent: format 8
    keeps a layer's entries in lists, rewritten whole)."""
    from stepfs.store import entrytable

    entries = entrytable.layer_entries(conn, number)
    entrytable.delete_layer(conn, number)
    entrytable.insert(conn, number, change(entries))


def drop_format_11(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: every entry list
    as a version-10 writer made it (explicit before oids, no markers).
    The caller sets the version and commits."""
    from stepfs.store import entrylist, entryrows

    def fetch(sql, params=()):
        return raw.execute(sql, params).fetchall()

    lists = fetch("SELECT id, layer, data FROM layer_entries ORDER BY layer, first")
    decoded = entryrows.resolve(fetch, [(layer, entrylist.decode(data)) for _i, layer, data in lists], prefix=True)
    for (id_, _layer, data), (_l, rows) in zip(lists, decoded):
        if rows is not entrylist.decode(data):
            raw.execute("UPDATE layer_entries SET data = ? WHERE id = ?", (entrylist.encode(rows), id_))


def drop_format_10(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: ``objects`` as a
    version-9 writer made it (``base`` the whole key of a delta's base,
    with its foreign key), and the lists as :func:`drop_format_11` leaves
    them.  The caller sets the version and commits."""
    import xxhash

    drop_format_11(raw)

    from stepfs.store import cardrows
    from stepfs.store.keytext import from_db, to_db

    def fetch(sql, params=()):
        return raw.execute(sql, params).fetchall()

    whole = {}
    for oid, data, how, size, base in fetch("SELECT oid, data, codec, size, base FROM objects WHERE base IS NOT NULL"):
        key = from_db(oid)
        digest = key.split(".", 1)[0]
        _data, found = cardrows.inline_with_base(fetch, key, data, how, size, base,
                                                 lambda d: xxhash.xxh3_128_hexdigest(d) == digest)
        whole[bytes(oid)] = to_db(found)
    raw.execute("CREATE TABLE objects_v9 (oid BLOB NOT NULL, size BIGINT NOT NULL, gen INTEGER DEFAULT '0' NOT NULL, "
                "data BLOB, codec INTEGER, base BLOB, is_base BOOLEAN, PRIMARY KEY (oid), "
                "FOREIGN KEY(base) REFERENCES objects (oid)) WITHOUT ROWID")
    raw.execute("INSERT INTO objects_v9 SELECT oid, size, gen, data, codec, NULL, is_base FROM objects")
    raw.executemany("UPDATE objects_v9 SET base = ? WHERE oid = ?", [(b, o) for o, b in whole.items()])
    raw.execute("DROP TABLE objects")
    raw.execute("ALTER TABLE objects_v9 RENAME TO objects")


def drop_format_9(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: the line counts as
    a version-8 writer kept them (``line_counts``, one row per object pair,
    from the counts each layer's ``layer_counts`` row holds), and deltas
    as whole zstd frames.  The caller sets the version and commits."""
    from sqlalchemy.dialects import sqlite
    from sqlalchemy.schema import CreateTable

    from stepfs.store import cardrows, linecounts, upgrade9
    from stepfs.store.keytext import to_db

    drop_format_10(raw)
    rows = cardrows.Rows(lambda sql, params=(): raw.execute(sql, params).fetchall())
    raw.execute(str(CreateTable(upgrade9.LINE_COUNTS).compile(dialect=sqlite.dialect())))

    def size(oid):
        return raw.execute("SELECT size FROM objects WHERE oid = ?", (to_db(oid),)).fetchone()[0] if oid else 0

    for (number,) in raw.execute("SELECT layer FROM layer_counts ORDER BY layer").fetchall():
        for (b, a), (added, removed, n_old, n_new) in linecounts.lookup(rows, number).items():
            raw.execute("INSERT OR IGNORE INTO line_counts VALUES (?, ?, ?, ?, ?, ?)",
                        (to_db(b), to_db(a), added, removed,
                         size(b) if n_old is None else n_old, size(a) if n_new is None else n_new))
    raw.execute("DROP TABLE layer_counts")
    from stepfs.store import codec

    for table, key in (("objects", "oid"), ("chunks", "cid")):  # deltas as whole frames
        for k, size, data in raw.execute(f"SELECT {key}, size, data FROM {table} "
                                         "WHERE codec = 2 AND data IS NOT NULL").fetchall():
            if not bytes(data).startswith(codec.MAGIC):
                raw.execute(f"UPDATE {table} SET data = ? WHERE {key} = ?", (codec.frame_head(size) + data, k))


def drop_format_8(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: the entry tables
    as a version-7 writer made them (one ``entries`` row per entry, no
    lists, no ``paths`` or ``path_layers``; format 8's ``line_counts``, see
    :func:`drop_format_9`).  The caller sets the version and commits."""
    if raw.execute("SELECT 1 FROM sqlite_master WHERE name = 'layer_counts'").fetchone():
        drop_format_9(raw)
    from sqlalchemy.dialects import sqlite
    from sqlalchemy.schema import CreateIndex, CreateTable

    from stepfs.store import entrylist, entryrows, upgrade7
    from stepfs.store.keytext import to_db

    def fetch(sql, params=()):
        return raw.execute(sql, params).fetchall()

    raw.execute(str(CreateTable(upgrade7.ENTRIES).compile(dialect=sqlite.dialect())))
    for index in upgrade7.ENTRIES.indexes:
        raw.execute(str(CreateIndex(index).compile(dialect=sqlite.dialect())))
    cols = ("layer",) + entrylist.COLUMNS
    insert = f"INSERT INTO entries ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    for layer, rows in entryrows.decoded(fetch):
        paths = entryrows.names(fetch, [r[0] for r in rows])
        raw.executemany(insert, [(layer, paths[r[0]]) + tuple(
            to_db(v) if name in entrylist.OIDS else v for name, v in zip(entrylist.COLUMNS[1:], r[1:]))
            for r in rows])
    for name in ("path_layers", "layer_entries", "paths"):
        raw.execute(f"DROP TABLE {name}")


def drop_format_7(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: rebuild the tables
    format 7 changed as a version-6 writer made them (hex text keys, a
    rowid everywhere; an object stored inline becomes one chunk).  The caller
    sets the version and commits."""
    from stepfs.store import keys, schema, upgrade7

    raw.execute("PRAGMA foreign_keys=OFF")
    drop_format_8(raw)
    raw.create_function("hexkey", 1, keys.from_db)
    for name in ("chunks_base", "object_chunks_cid", "entries_path_layer"):
        raw.execute(f"DROP INDEX IF EXISTS {name}")
    for name, ddl in V6_TABLES.items():
        raw.execute(f"ALTER TABLE {name} RENAME TO v7_{name}")
        raw.execute(ddl)
        cols = [r[1] for r in raw.execute(f"PRAGMA table_info({name})")]
        table = upgrade7.ENTRIES if name == "entries" else schema.metadata.tables[name]
        values = ", ".join(f'hexkey("{c}")' if keys.is_key(table.c[c].type) else f'"{c}"' for c in cols)
        names = ", ".join(f'"{c}"' for c in cols)
        raw.execute(f"INSERT INTO {name} ({names}) SELECT {values} FROM v7_{name}")
    # An object stored inline becomes one chunk keyed by its own id.
    raw.execute("""INSERT OR IGNORE INTO chunks (cid, size, data, codec, base)
                   SELECT hexkey(oid), size, data, codec, NULL FROM v7_objects WHERE data IS NOT NULL AND size > 0""")
    raw.execute("""INSERT INTO object_chunks (oid, seq, "offset", cid)
                   SELECT hexkey(oid), 0, 0, hexkey(oid) FROM v7_objects WHERE data IS NOT NULL AND size > 0""")
    for name in reversed(list(V6_TABLES)):
        raw.execute(f"DROP TABLE v7_{name}")
    for ddl in V6_INDEXES:
        raw.execute(ddl)


def drop_format_6(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: undo what format 6
    added (chunks.codec and chunks.base, objects.gen), so the file looks as
    a version-5 writer made it (compressed chunks are stored raw again).
    The chunks table is rebuilt: a column in a foreign key cannot be
    dropped.  The caller sets the version and commits."""
    import zstandard

    drop_format_7(raw)
    rows = raw.execute("SELECT cid, size, data, codec FROM chunks").fetchall()
    raw.execute("DROP INDEX IF EXISTS chunks_base")
    raw.execute("DROP TABLE chunks")
    raw.execute("CREATE TABLE chunks (cid VARCHAR(48) NOT NULL PRIMARY KEY, size INTEGER NOT NULL, data BLOB NOT NULL)")
    for cid, size, data, codec in rows:
        assert codec in (0, 1), "a delta chunk cannot be turned back into format 5 here"
        plain = zstandard.ZstdDecompressor().decompress(data, max_output_size=size) if codec == 1 else data
        raw.execute("INSERT INTO chunks VALUES (?, ?, ?)", (cid, size, plain))
    raw.execute("ALTER TABLE objects DROP COLUMN gen")
