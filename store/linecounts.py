"""Remembered line counts of file changes: what a change card needs of a
changed file (lines added and removed, or the byte sizes of binary
content), kept once so that ``log``, ``show`` and the web pages read them
instead of reading, decoding and diffing both versions every time.

Format 9: one row a layer in ``layer_counts (layer, data)``, ``data`` one
zstd frame of fixed-width columns (:func:`encode`).  A counted change is
named by the positions of its entries in the layer's entry list (the entry
whose ``before`` is the change's old file and the one whose ``after`` is
its new file, the same entry unless a rename paired two), not by its two
16-byte object keys: the keys are already in the layer's list, and
repeating them per change made format 8's pair-keyed ``line_counts`` table
1.27 MB of a 5.6 MB store.  The frame also holds a checksum of the
``(before, after)`` key pairs those positions named when it was written; a
reader resolves the positions against the layer's entries as they are now
and uses the counts only if the checksum matches, so counts are never
stale, whatever rewrote the layer's list (prune's fold carries what still
applies, :func:`carry`).  A layer's row goes with the layer (prune,
``stepfs gc`` deletes any row of a layer that is not committed).

Rows are written after a commit by the mount daemon's background pass
(:func:`fill_layer`, from ``store/deltawork.py``, after the commit lock is
released), and by a reader with a workspace open that computed some that
were missing (:func:`remember`).  The CLI's read-only path
(``cardrows.open_readonly``) computes what is missing and writes nothing.
The plain-SQL half (:func:`pair_of`, :func:`lookup`, :func:`compute`,
:func:`decode`) imports no SQLAlchemy.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import sys
from array import array
from itertools import accumulate
from typing import TYPE_CHECKING

from stepfs.store import records
from stepfs.store.records import Change, Entry, State

if TYPE_CHECKING:
    from stepfs.store.cardrows import Rows

log = logging.getLogger("stepfs.store")

#: ``(lines_added, lines_removed, bytes_before, bytes_after)``; the line
#: counts are None for binary content or content too large to count.  A
#: remembered text change has no byte sizes (None): cards do not show them.
Counts = tuple
TABLE = "layer_counts"
#: The format-8 table the upgrade to 9 converts (store/upgrade9.py).
OLD_TABLE = "line_counts"
#: First byte of a frame's content: the layout of what follows.
VERSION = 1
#: version, count, checksum of the named pairs.
_HEAD = struct.Struct("<BI8s")
TEXT, BINARY = 1, 2
LEVEL = 9
_BIG = sys.byteorder == "big"


class Damaged(ValueError):
    """A ``layer_counts`` row that cannot be decoded."""


def pair_of(c: Change) -> tuple[str, str] | None:
    """The ``(before, after)`` object pair whose counts the card entry of
    ``c`` needs, or None when it needs none (no file on either side, or the
    same content on both)."""
    if "file" not in (c.before.kind, c.after.kind):
        return None
    if c.before.kind == c.after.kind and c.before.oid == c.after.oid:
        return None
    before = c.before.oid if c.before.kind == "file" else None
    after = c.after.oid if c.after.kind == "file" else None
    return before or "", after or ""


def compute(rows: Rows, pair: tuple[str, str]) -> Counts:
    """The counts of ``pair`` from the objects' bytes (the rules of
    ``records.lines_of``); raises ``CorruptObject``."""
    before, after = pair
    change = Change(b"", State("file", oid=before) if before else State(None),
                    State("file", oid=after) if after else State(None))
    a, b, n_old, n_new = records.lines_of(change, rows.size, rows.read_all)
    if a is None or b is None:
        return None, None, n_old, n_new
    added, removed = records.count_lines(a, b)
    return added, removed, n_old, n_new


# -- the frame -----------------------------------------------------------------------


def _checksum(pairs) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    h.update("\n".join(f"{b}/{a}" for b, a in pairs).encode())
    return h.digest()


def encode(entries: list[Entry], counts: dict[tuple[str, str], Counts]) -> bytes | None:
    """The frame of those of ``counts`` whose objects ``entries`` (a layer's
    list) name, or None if none is.  Columns, each fixed-width: the after
    position + 1 as a difference from the previous one (int32), the before
    position + 1 minus the after position + 1 (int32; 0 + 1 = "no file"
    is kept exact by storing positions + 1), the kind (1 text, 2 binary;
    uint8), then two int64: lines added and removed, or bytes before and
    after."""
    before_at: dict[str, int] = {}
    after_at: dict[str, int] = {}
    for i, e in enumerate(entries):
        if e.before.kind == "file" and e.before.oid:
            before_at.setdefault(e.before.oid, i)
        if e.after.kind == "file" and e.after.oid:
            after_at.setdefault(e.after.oid, i)
    named = []
    for (b, a), c in counts.items():
        ib = before_at.get(b, -2) if b else -1
        ia = after_at.get(a, -2) if a else -1
        if ib == -2 or ia == -2 or (ib == -1 and ia == -1):
            continue
        named.append((ia + 1, ib + 1, (b, a), c))
    if not named:
        return None
    named.sort(key=lambda t: (t[0], t[1]))
    col_a, col_b, kinds, u, v = array("i"), array("i"), bytearray(), array("q"), array("q")
    prev = 0
    for pa, pb, _pair, c in named:
        col_a.append(pa - prev)
        col_b.append(pb - pa)
        prev = pa
        added, removed, n_old, n_new = c
        if added is None or removed is None:
            kinds.append(BINARY)
            u.append(n_old or 0)
            v.append(n_new or 0)
        else:
            kinds.append(TEXT)
            u.append(added)
            v.append(removed)
    if _BIG:  # pragma: no cover  (the columns are little-endian)
        for col in (col_a, col_b, u, v):
            col.byteswap()
    raw = (_HEAD.pack(VERSION, len(named), _checksum(t[2] for t in named))
           + col_a.tobytes() + col_b.tobytes() + bytes(kinds) + u.tobytes() + v.tobytes())
    from stepfs.store import codec  # noqa: PLC0415

    return codec.compressor(LEVEL).compress(raw)


def decode(data, entries: list[Entry]) -> dict[tuple[str, str], Counts] | None:
    """The counts a frame holds for ``entries`` (the layer's list as it is
    now), or None when the positions no longer name the pairs they were
    written for (the list changed since).  Raises :class:`Damaged`."""
    from stepfs.store import codec  # noqa: PLC0415

    try:
        raw = codec.decompressor().decompress(bytes(data))
        version, n, checksum = _HEAD.unpack_from(raw, 0)
    except Exception as exc:  # zstd's and struct's errors
        raise Damaged(f"undecodable ({exc})") from None
    if version != VERSION or len(raw) != _HEAD.size + n * (4 + 4 + 1 + 8 + 8):
        raise Damaged(f"version {version} with {len(raw)} bytes for {n} counts")
    pos = _HEAD.size
    cols = []
    for code, width in (("i", 4), ("i", 4)):
        col = array(code)
        col.frombytes(raw[pos:pos + n * width])
        cols.append(col)
        pos += n * width
    kinds = raw[pos:pos + n]
    pos += n
    u, v = array("q"), array("q")
    u.frombytes(raw[pos:pos + 8 * n])
    v.frombytes(raw[pos + 8 * n:pos + 16 * n])
    if _BIG:  # pragma: no cover
        for col in (*cols, u, v):
            col.byteswap()
    # Position + 1 -> the file key there; position 0 is "no file" ("").
    befores = [""] + [e.before.oid if e.before.kind == "file" and e.before.oid else None for e in entries]
    afters = [""] + [e.after.oid if e.after.kind == "file" and e.after.oid else None for e in entries]
    out: dict[tuple[str, str], Counts] = {}
    pairs = []
    n_entries = len(entries)
    try:
        for pa, d, kind, x, y in zip(accumulate(cols[0]), cols[1], kinds, u, v):
            pb = pa + d
            if not (0 <= pa <= n_entries and 0 <= pb <= n_entries) or pa == pb == 0:
                return None
            pair = (befores[pb], afters[pa])
            if pair[0] is None or pair[1] is None or kind not in (TEXT, BINARY):
                return None
            pairs.append(pair)
            out[pair] = (x, y, None, None) if kind == TEXT else (None, None, x, y)
    except IndexError:
        return None
    if _checksum(pairs) != checksum:
        return None
    return out


# -- reading (plain SQL) -------------------------------------------------------------


def lookup(rows: Rows, number: int) -> dict[tuple[str, str], Counts]:
    """The remembered counts of layer ``number``'s changes by object pair
    (none if it has no row, or its row no longer names its entries)."""
    if not rows.has_table(TABLE):
        return {}
    got = rows.fetch(f"SELECT data FROM {TABLE} WHERE layer = ?", (number,))
    if not got:
        return {}
    try:
        return decode(got[0][0], rows.entries(number)) or {}
    except Damaged:
        return {}  # stepfs verify names it; the counts are computed


# -- writing (SQLAlchemy; never on the CLI's read-only path) ----------------------


def remember(ws, computed: dict[int, dict[tuple[str, str], Counts]]) -> int:
    """Write the counts ``computed`` by layer in one short write transaction
    of ``ws`` (merged with what each layer's row holds).  Returns the counts
    written.  Failing to write (a full or busy store) only logs: the counts
    are computed again."""
    if not any(computed.values()):
        return 0
    from stepfs.store.errors import StepfsError  # noqa: PLC0415

    try:
        with ws.db.write() as conn:
            return sum(write_layer(conn, number, counts, ws.objects.hasher)
                       for number, counts in sorted(computed.items()) if counts)
    except StepfsError as exc:
        log.info("line counts not remembered now: %s", exc)
        return 0


def write_layer(conn, number: int, counts: dict[tuple[str, str], Counts], hasher=None) -> int:
    """Merge ``counts`` into layer ``number``'s row inside the caller's
    write transaction ``conn`` (a pair the layer's entries do not name, or
    a layer that is not committed, is skipped).  Returns the counts the row
    holds now that it did not before."""
    from stepfs.store.cardrows import Rows  # noqa: PLC0415

    if not conn.dialect.has_table(conn, TABLE):
        return 0
    rows = Rows.over(conn, hasher) if hasher is not None else Rows.over(conn)
    if not rows.fetch("SELECT 1 FROM layers WHERE number = ? AND state = 'committed'", (number,)):
        return 0
    old = lookup(rows, number)
    merged = {**counts, **old}
    if len(merged) == len(old):
        return 0
    entries = rows.entries(number)
    data = encode(entries, merged)
    if data is None:
        return 0
    held = decode(data, entries) or {}
    _put(conn, number, data)
    return len(held) - len(old)


def _put(conn, number: int, data: bytes) -> None:
    conn.exec_driver_sql(f"DELETE FROM {TABLE} WHERE layer = ?" if conn.dialect.paramstyle == "qmark"
                         else f"DELETE FROM {TABLE} WHERE layer = %s", (number,))
    conn.exec_driver_sql(f"INSERT INTO {TABLE} (layer, data) VALUES (?, ?)" if conn.dialect.paramstyle == "qmark"
                         else f"INSERT INTO {TABLE} (layer, data) VALUES (%s, %s)", (number, data))


def held_through(conn, keep: int) -> dict[tuple[str, str], Counts]:
    """Prune's first half: every count the rows of layers up to ``keep``
    hold (read before the fold rewrites their lists)."""
    from stepfs.store.cardrows import Rows  # noqa: PLC0415

    if not conn.dialect.has_table(conn, TABLE):
        return {}
    rows = Rows.over(conn)
    out: dict[tuple[str, str], Counts] = {}
    for (number,) in rows.fetch(f"SELECT layer FROM {TABLE} WHERE layer <= ? ORDER BY layer", (keep,)):
        out.update(lookup(rows, number))
    return out


def carry(conn, keep: int, held: dict[tuple[str, str], Counts]) -> int:
    """Prune's second half, after the fold wrote layer ``keep``'s new list:
    the rows of the layers before it go, and ``keep``'s row holds those of
    ``held`` (:func:`held_through`) that its new changes still need (the
    rest is counted again by a reader).  Returns the counts carried."""
    from stepfs.store.cardrows import Rows  # noqa: PLC0415

    if not conn.dialect.has_table(conn, TABLE):
        return 0
    p = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    conn.exec_driver_sql(f"DELETE FROM {TABLE} WHERE layer <= {p}", (keep,))
    rows = Rows.over(conn)
    changes = records.pair_renames([Change(e.path, e.before, e.after) for e in rows.entries(keep)], rows.size)
    wanted = {p_: held[p_] for c in changes if (p_ := pair_of(c)) is not None and p_ in held}
    data = encode(rows.entries(keep), wanted) if wanted else None
    if data is None:
        return 0
    _put(conn, keep, data)
    return len(wanted)


def fill_layer(ws, number: int, go=None, writing=None) -> int:
    """Remember the counts of every file change of layer ``number`` that has
    none yet: read in one read transaction, written in one write
    transaction (held inside ``writing``, as the delta pass's are).  ``go``:
    asked before each file; False stops (what was counted is written).
    Returns the counts written; an unreadable object is left to the readers
    (``stepfs verify`` names it)."""
    from contextlib import nullcontext  # noqa: PLC0415

    from stepfs.store.cardrows import Rows  # noqa: PLC0415
    from stepfs.store.errors import CorruptObject, StepfsError  # noqa: PLC0415

    counts: dict[tuple[str, str], Counts] = {}
    try:
        with ws.db.read() as conn:
            rows = Rows.over(conn, ws.objects.hasher)
            changes = records.pair_renames([Change(e.path, e.before, e.after) for e in rows.entries(number)],
                                           rows.size)
            pairs = {p for c in changes if (p := pair_of(c)) is not None}
            for pair in sorted(pairs - set(lookup(rows, number))):
                if go is not None and not go():
                    break
                try:
                    counts[pair] = compute(rows, pair)
                except CorruptObject:
                    continue
        if not counts:
            return 0
        with writing or nullcontext(), ws.db.write() as conn:
            return write_layer(conn, number, counts, ws.objects.hasher)
    except StepfsError as exc:
        log.warning("line counts of layer %d not remembered now: %s", number, exc)
        return 0


def problems(conn) -> list[str]:
    """What ``stepfs verify`` reports of the rows: one that cannot be
    decoded, one of a layer that is not committed, one whose positions no
    longer name the pairs it was written for."""
    from stepfs.store.cardrows import Rows  # noqa: PLC0415

    if not conn.dialect.has_table(conn, TABLE):
        return []
    rows = Rows.over(conn)
    committed = {n for (n,) in rows.fetch("SELECT number FROM layers WHERE state = 'committed'", ())}
    out = []
    for number, data in rows.fetch(f"SELECT layer, data FROM {TABLE} ORDER BY layer", ()):
        if number not in committed:
            out.append(f"line counts of layer {number} remain but the layer is not committed")
            continue
        try:
            if decode(data, rows.entries(number)) is None:
                out.append(f"line counts of layer {number} no longer match its entries")
        except Damaged as exc:
            out.append(f"line counts of layer {number} are damaged: {exc}")
    return out
