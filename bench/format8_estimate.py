"""What the candidate layouts of store format 8 (docs/format8.md) would
take for a real format-7 store: each layout is built, by SQL and a little
Python, in a throw-away copy of the store, compacted, and measured with
``dbstat`` (``bench/store_bytes.py``).  Nothing here is the store's code:
the copies are never opened by stepfs, and the encodings are only as good
as a size estimate needs (no reader exists for them).

``python -m bench.format8_estimate STORE_DB [--block N]`` prints one line a
layout.  Run it on the agent session's store after gc (``bench/session.py``
keeps it when run with ``--keep DIR``) to compare with shadow-git's
``.git``.  It reads format 7's ``entries`` table: a format-8 store (which
has stage 1, layout B, written) is measured by ``bench/store_bytes.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import zstandard  # noqa: E402

from bench import store_bytes  # noqa: E402

#: The format-7 entry columns after ``layer`` and ``path``, in list order.
COLS = ("before_kind", "before_mode", "before_oid", "before_target", "before_uid", "before_gid", "before_xattrs",
        "after_kind", "after_mode", "after_oid", "after_target", "after_mtime_ns", "after_uid", "after_gid",
        "after_xattrs", "after_link")
KINDS = {None: 0, "file": 1, "dir": 2, "symlink": 3, "fifo": 4, "chardev": 5, "blockdev": 6, "socket": 7,
         "special": 8}
#: Encoded bytes of small objects per pack before it is compressed.
PACK_BYTES = 65536


def varint(n: int) -> bytes:
    n = (n << 1) if n >= 0 else ((-n << 1) - 1)  # zigzag: small negatives stay short
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(v) -> bytes:
    if v is None:
        return b"\x00"
    if isinstance(v, int):
        return b"\x01" + varint(v)
    v = v.encode() if isinstance(v, str) else bytes(v)
    return b"\x02" + varint(len(v)) + v


def entry_list(rows: list[tuple]) -> bytes:
    """A zstd frame of ``rows`` (path id first, then :data:`COLS`) stored
    column by column: like values side by side compress far better than
    rows; path ids are deltas of the sorted ids, kinds small numbers."""
    parts = []
    for i, col in enumerate(zip(*rows)):
        if i == 0:
            prev, buf = 0, bytearray()
            for v in col:
                buf += varint(v - prev)
                prev = v
            parts.append(bytes(buf))
        else:
            parts.append(b"".join(_field(KINDS[v]) if COLS[i - 1].endswith("_kind") else _field(v) for v in col))
    return zstandard.ZstdCompressor(level=3).compress(b"".join(varint(len(p)) + p for p in parts))


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = raw[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return (n >> 1) if not n & 1 else -((n + 1) >> 1), pos


def read_list(blob: bytes) -> list[tuple]:
    """The rows :func:`entry_list` encoded (kinds as their numbers, byte
    values as bytes): the estimate's lists hold everything the entries did."""
    raw = zstandard.ZstdDecompressor().decompress(blob)
    pos, cols = 0, []
    while pos < len(raw):
        length, pos = _read_varint(raw, pos)
        end, col = pos + length, []
        while pos < end:
            if not cols:
                v, pos = _read_varint(raw, pos)
                col.append(v + (col[-1] if col else 0))
                continue
            tag, pos = raw[pos], pos + 1
            if tag == 0:
                col.append(None)
            elif tag == 1:
                v, pos = _read_varint(raw, pos)
                col.append(v)
            else:
                n, pos = _read_varint(raw, pos)
                col.append(raw[pos:pos + n])
                pos += n
        cols.append(col)
    return list(zip(*cols))


def path_ids(paths: list[bytes], tree: bool) -> tuple[dict[bytes, int], list[tuple]]:
    """Ids of ``paths`` (sorted) and the rows of the paths table: flat
    (``(id, path)``) or a tree of names (``(id, parent, name)``, every
    directory a node, the root 0)."""
    if not tree:
        ids = {p: i + 1 for i, p in enumerate(paths)}
        return ids, [(i, p) for p, i in ids.items()]
    node, rows, ids = {b"": 0}, [], {}
    for p in paths:
        parts = p.split(b"/")
        for k in range(1, len(parts) + 1):
            prefix = b"/".join(parts[:k])
            if prefix not in node:
                node[prefix] = len(node)
                rows.append((node[prefix], node[b"/".join(parts[:k - 1])], parts[k - 1]))
        ids[p] = node[p]
    return ids, rows


def _paths_table(c, rows: list[tuple], tree: bool) -> None:
    if tree:
        c.execute("CREATE TABLE paths(id INTEGER PRIMARY KEY, parent INTEGER NOT NULL, name BLOB NOT NULL, "
                  "UNIQUE(parent, name))")
        c.executemany("INSERT INTO paths VALUES (?,?,?)", rows)
    else:
        c.execute("CREATE TABLE paths(id INTEGER PRIMARY KEY, path BLOB NOT NULL UNIQUE)")
        c.executemany("INSERT INTO paths VALUES (?,?)", rows)


def build(src: str, dst: str, layout: str, block: int) -> None:
    """Make ``dst`` a copy of ``src`` in ``layout`` (A-flat, A-tree, B, C, D)."""
    shutil.copy(src, dst)
    c = sqlite3.connect(dst)
    c.execute("PRAGMA foreign_keys = OFF")
    paths = [bytes(r[0]) for r in c.execute("SELECT DISTINCT path FROM entries ORDER BY path")]
    ids, prow = path_ids(paths, tree=layout != "A-flat")
    _paths_table(c, prow, tree=layout != "A-flat")
    c.execute("CREATE TEMP TABLE pid(path BLOB PRIMARY KEY, id INTEGER NOT NULL)")
    c.executemany("INSERT INTO temp.pid VALUES (?,?)", ids.items())
    cols = ", ".join(COLS)
    if layout.startswith("A"):
        c.executescript(f"""
            CREATE TABLE e8(layer INTEGER NOT NULL, path INTEGER NOT NULL, {cols}, PRIMARY KEY(layer, path)) WITHOUT ROWID;
            INSERT INTO e8 SELECT e.layer, p.id, {", ".join("e." + x for x in COLS)}
                FROM entries e JOIN temp.pid p ON p.path = e.path;
            DROP INDEX entries_path_layer; DROP TABLE entries; ALTER TABLE e8 RENAME TO entries;
            CREATE INDEX entries_path_layer ON entries(path, layer);""")
        c.commit()
        c.close()
        return
    number = {}
    if layout in ("C", "D"):
        objs = c.execute("SELECT oid, size, gen, data, codec, base, is_base FROM objects").fetchall()
        number = {r[0]: i + 1 for i, r in enumerate(objs)}
        _pack(c, objs, number if layout == "D" else None)
    # A rowid table: SQLite keeps at most about 1 KB of a WITHOUT ROWID row in
    # its B-tree page and spills the rest to overflow pages (measured on the
    # 200-step session with lists of 64 entries: 5.47 MB against 5.12 MB).
    c.execute("CREATE TABLE layer_entries(layer INTEGER NOT NULL, first INTEGER NOT NULL, n INTEGER NOT NULL, "
              "data BLOB NOT NULL, UNIQUE(layer, first))")
    c.execute("CREATE TABLE path_layers(path INTEGER NOT NULL, layer INTEGER NOT NULL, PRIMARY KEY(path, layer)) "
              "WITHOUT ROWID")
    c.execute("INSERT INTO path_layers SELECT p.id, e.layer FROM entries e JOIN temp.pid p ON p.path = e.path")
    oid_cols = {i + 1 for i, name in enumerate(COLS) if name.endswith("_oid")}
    for (layer,) in c.execute("SELECT DISTINCT layer FROM entries ORDER BY layer").fetchall():
        rows = c.execute(f"SELECT p.id, {', '.join('e.' + x for x in COLS)} FROM entries e "
                         "JOIN temp.pid p ON p.path = e.path WHERE e.layer = ? ORDER BY p.id", (layer,)).fetchall()
        if layout == "D":  # objects named by number, not by their 16-byte key
            rows = [tuple(number.get(v) if i in oid_cols and v is not None else v for i, v in enumerate(r))
                    for r in rows]
        for k in range(0, len(rows), block):
            part = rows[k:k + block]
            c.execute("INSERT INTO layer_entries VALUES (?,?,?,?)", (layer, part[0][0], len(part), entry_list(part)))
    c.executescript("DROP INDEX entries_path_layer; DROP TABLE entries;")
    c.commit()
    c.close()


def _pack(c, objs: list[tuple], number: dict | None) -> None:
    """Small (inline) objects' encoded bytes into zstd packs of about
    :data:`PACK_BYTES`; the object row keeps its key and where its bytes
    are.  With ``number``: rows get an integer id and a delta's base is
    named by id (a rowid table with a unique index on the key)."""
    c.execute("CREATE TABLE packs(id INTEGER PRIMARY KEY, data BLOB NOT NULL)")
    if number is None:
        c.execute("CREATE TABLE o8(oid BLOB PRIMARY KEY, size INTEGER NOT NULL, gen INTEGER NOT NULL, pack INTEGER, "
                  "off INTEGER, len INTEGER, codec INTEGER, base BLOB, is_base BOOLEAN) WITHOUT ROWID")
    else:
        c.execute("CREATE TABLE o8(id INTEGER PRIMARY KEY, oid BLOB NOT NULL UNIQUE, size INTEGER NOT NULL, "
                  "gen INTEGER NOT NULL, pack INTEGER, off INTEGER, len INTEGER, codec INTEGER, base INTEGER, "
                  "is_base BOOLEAN)")
    buf, pack, out = bytearray(), 0, []

    def flush():
        nonlocal buf, pack
        if buf:
            c.execute("INSERT INTO packs VALUES (?,?)", (pack, zstandard.ZstdCompressor(level=3).compress(bytes(buf))))
            buf, pack = bytearray(), pack + 1

    for oid, size, gen, data, codec, base, is_base in objs:
        where = (None, None, None) if data is None else (pack, len(buf), len(data))
        if number is None:
            out.append((oid, size, gen, *where, codec, base, is_base))
        else:
            out.append((number[oid], oid, size, gen, *where, codec, number.get(base), is_base))
        if data is not None:
            buf += data
            if len(buf) >= PACK_BYTES:
                flush()
    flush()
    c.executemany(f"INSERT INTO o8 VALUES ({','.join('?' * len(out[0]))})", out) if out else None
    c.executescript("DROP TABLE objects; ALTER TABLE o8 RENAME TO objects;")


LAYOUTS = {
    "A-flat": "paths table (id, path) and entries keyed by path id",
    "A-tree": "paths as a tree of names (id, parent, name) and entries keyed by path id",
    "B": "A-tree + one zstd column-wise entry list per layer (or block) + (path, layer) pairs",
    "C": "B + small objects packed in zstd packs (rows keep key and place)",
    "D": "C + objects numbered: lists and delta bases name the number, the key stored once",
}


def estimate(src: str, block: int = 1 << 30) -> dict[str, int]:
    out = {"format 7": store_bytes.breakdown(src)["file_bytes"]}
    with tempfile.TemporaryDirectory(prefix="stepfs-fmt8-") as tmp:
        for layout in LAYOUTS:
            dst = os.path.join(tmp, f"{layout}.db")
            build(src, dst, layout, block)
            out[layout] = store_bytes.breakdown(dst)["file_bytes"]
            os.unlink(dst)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("store_db")
    p.add_argument("--block", type=int, default=1 << 30, help="entries per list (default: one list a layer)")
    p.add_argument("--git-bytes", type=int, help="shadow-git's packed .git, to print ratios")
    args = p.parse_args(argv)
    sizes = estimate(args.store_db, args.block)
    base = sizes["format 7"]
    for name, size in sizes.items():
        ratio = f"  {size / args.git_bytes:.2f}x git" if args.git_bytes else ""
        print(f"{name:8s} {size:>10d} B {100 * (size - base) / base:+6.1f}%{ratio}  {LAYOUTS.get(name, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
