"""The rows a change card is made of, read with plain SQL (no SQLAlchemy
import): layers with their counts, a layer's entries, objects' sizes and
bytes, and what each layer added to the store.

One set of queries for two connections: :meth:`Rows.over` runs them on the
SQLAlchemy connection of an open :class:`~stepfs.store.workspace.Workspace`
(the daemon, the library, the CLI after recovery), :func:`open_readonly` on
a read-only stdlib ``sqlite3`` connection to a workspace's store (the CLI's
``log`` and ``show`` with no mount live: importing SQLAlchemy costs more than
the answer).  ``store.cards`` builds every card from a :class:`Rows`, so both
paths give the same answer from the same code.

:func:`open_readonly` answers only for a store it can read as it is: the
format it was written for, no layer pending (recovery writes, so it needs
``Workspace.open``), a real ``.stepfs`` directory holding the database.
Anything else returns None and the caller opens the workspace as always,
which reports or repairs what is wrong.
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
from typing import Callable, Iterator

from stepfs.store.errors import CorruptObject, LayerPruned, NoSuchLayer
from stepfs.store.keytext import from_db, to_db
from stepfs.store.paths import DB_NAME, STORE_DIR
from stepfs.store import baseref, entryrows
from stepfs.store.records import Entry, Layer

#: Store formats whose tables these queries were written for: a store of
#: another format is read through ``Workspace.open`` (which upgrades or refuses it).
FORMATS = frozenset({11})
HASH_ALGORITHM = "xxh3_128"
#: Object ids per ``IN`` list (SQLite bounds the variables of one statement).
BATCH = 5000


def xxh3_hex(data) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


#: A stored key as hex and back (format 7: keys are bytes in the database).
_key = from_db
_db = to_db


#: Prefix of an inline object's id among the pieces :meth:`Rows.stored` counts.
INLINE = "inline:"


def decode_chunk(base_row: Callable[[str], tuple | None], cid: str, data, codec_: int, size: int,
                 base: str | None) -> bytes:
    """The decoded bytes of chunk ``cid`` from its row's fields; a delta's
    base is read with ``base_row(cid) -> (data, codec, size, base)`` or None.
    Raises :class:`CorruptObject` for undecodable data."""
    from stepfs.store import codec

    base_raw = None
    if codec_ == codec.DELTA:
        row = base_row(base) if base is not None else None
        if row is None or row[1] == codec.DELTA:
            raise CorruptObject(f"chunk {cid} is a delta whose base chunk {base} is missing; "
                                f"run 'stepfs verify' for a full report.")
        bdata, bcodec, bsize, _bbase = row
        base_raw = decode_chunk(base_row, base, bdata, bcodec, bsize, None)
    try:
        return codec.decode(codec_, data, size, base_raw)
    except ValueError as exc:
        raise CorruptObject(f"chunk {cid} is corrupt: it cannot be decoded ({exc}); run 'stepfs verify' for a full report.") from None


def inline_with_base(fetch, oid: str, data, codec_: int | None, size: int, base,
                     check: Callable[[bytes], bool] | None = None) -> tuple[bytes, str | None]:
    """``(bytes, base key or None)`` of inline object ``oid`` from its row's
    fields; a delta's base is found by its prefix (format 10,
    ``store/baseref.py``) with ``fetch(sql, params)``, ``check(bytes)``
    telling apart objects that share it.  Raises :class:`CorruptObject`."""
    from stepfs.store import codec

    try:
        if codec_ != codec.DELTA:
            return codec.decode(codec_ or codec.RAW, data, size, None), None
    except ValueError as exc:
        raise CorruptObject(f"object {oid} is corrupt: it cannot be decoded ({exc}); "
                            f"run 'stepfs verify' for a full report.") from None
    candidates = []
    for key, bdata, bcodec, bsize in (fetch(baseref.CANDIDATES, baseref.bounds(base)) if base is not None else []):
        try:
            candidates.append((_key(key), codec.decode(bcodec or codec.RAW, bdata, bsize)))
        except ValueError:
            continue  # a damaged object is no base (verify reports it)
    if not candidates:
        raise CorruptObject(f"object {oid} is a delta whose base object is missing; "
                            f"run 'stepfs verify' for a full report.")
    got = baseref.decode(candidates, oid, lambda b: codec.decode(codec.DELTA, data, size, b), check)
    if got is None:
        raise CorruptObject(f"object {oid} is corrupt: it does not decode against its base; "
                            f"run 'stepfs verify' for a full report.")
    return got


def object_chunks(rows, oid: str, base_row: Callable[[str], tuple | None], hasher: Callable[[bytes], str],
                  verify: bool = True) -> Iterator[bytes]:
    """An object's bytes chunk by chunk from its ``(cid, offset, data,
    codec, size, base)`` rows in order; with ``verify`` each chunk is
    re-hashed and :class:`CorruptObject` raised on a mismatch, so corrupt
    bytes are never served.  A missing chunk row or a gap in the offsets
    raises too (even without ``verify``): a short read would otherwise pass
    for the file's content."""
    pos = 0
    for cid, offset, stored, how, size, base in rows:
        if stored is None or offset != pos:
            raise CorruptObject(
                f"object {oid} is missing its bytes at offset {pos}; run 'stepfs verify' for a full report."
            )
        data = decode_chunk(base_row, cid, stored, how, size, base)
        if verify and hasher(data) != cid.split(".", 1)[0]:
            raise CorruptObject(f"chunk {cid} of object {oid} is corrupt; run 'stepfs verify' for a full report.")
        pos += len(data)
        yield data


class Rows:
    """Read-only queries on one open transaction.  ``fetch(sql, params)``
    runs one statement (``?`` placeholders) and returns its rows as
    tuples; ``hasher`` verifies chunks (``ObjectStore.hasher``)."""

    def __init__(self, fetch: Callable[[str, tuple], list], hasher: Callable[[bytes], str] = xxh3_hex,
                 table_exists: Callable[[str], bool] | None = None):
        self.fetch = fetch
        self.hasher = hasher
        self._table_exists = table_exists
        self._tables: dict[str, bool] = {}
        self._last_entries: tuple[int, tuple] | None = None
        #: Line counts the cards computed because the store had none for
        #: them, by committed layer (``store/linecounts.py``): a writer may
        #: remember them.
        self.computed: dict[int, dict[tuple[str, str], tuple]] = {}

    @classmethod
    def over(cls, conn, hasher: Callable[[bytes], str] = xxh3_hex) -> "Rows":
        """Queries on a SQLAlchemy connection (its driver's placeholders)."""
        qmark = conn.dialect.paramstyle == "qmark"

        def fetch(sql: str, params: tuple = ()) -> list:
            return conn.exec_driver_sql(sql if qmark else sql.replace("?", "%s"), tuple(params)).all()

        return cls(fetch, hasher, lambda name: conn.dialect.has_table(conn, name))

    def has_table(self, name: str) -> bool:
        """Whether the store has table ``name`` (an optional one, FORMAT.md)."""
        if name not in self._tables:
            self._tables[name] = (self._table_exists(name) if self._table_exists is not None else bool(
                self.fetch("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))))
        return self._tables[name]

    # -- layers ------------------------------------------------------------------

    def layers(self, limit: int | None = None, number: int | None = None) -> list[Layer]:
        """Committed layers (or just ``number``), newest first, with counts of
        added / modified / deleted paths.  The layers are chosen first and
        only their entries are counted (through the entries' primary key):
        listing a few layers, or one, costs what those layers hold."""
        sql = "SELECT number, state, kind, created_ns, message, agent, mount, meta FROM layers WHERE state = 'committed'"
        params: tuple = ()
        if number is not None:
            sql += " AND number = ?"
            params += (number,)
        sql += " ORDER BY number DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params += (limit,)
        rows = self.fetch(sql, params)
        by_layer: dict[int, tuple[int, int, int]] = {}
        if limit is not None or number is not None:
            numbers = [r[0] for r in rows]
            for i in range(0, len(numbers), BATCH):
                by_layer.update(entryrows.layer_counts(self.fetch, numbers[i:i + BATCH]))
        else:
            by_layer = entryrows.layer_counts(self.fetch)
        out = []
        for number_, state, kind, created_ns, message, agent, mount, meta in rows:
            a, d, t = by_layer.get(number_, (0, 0, 0))
            out.append(Layer(number=number_, state=state, kind=kind, created_ns=created_ns, message=message,
                             agent=agent, mount=mount, meta=json.loads(meta or "{}"), added=a, deleted=d,
                             modified=t - a - d))
        return out

    def layer(self, number: int) -> Layer:
        for layer in self.layers(number=number):
            return layer
        raise self.missing(number)

    def missing(self, number: int) -> NoSuchLayer:
        """The error for a layer number that is not a committed layer: pruned
        ones say so (and which layer is the oldest kept)."""
        rows = self.fetch("SELECT state FROM layers WHERE number = ?", (number,))
        if rows and rows[0][0] == "pruned":
            oldest = self.fetch("SELECT MIN(number) FROM layers WHERE state = 'committed'", ())[0][0]
            return LayerPruned(f"layer {number} was pruned; the oldest layer kept is {oldest} "
                               f"('stepfs log' lists the layers kept).")
        return NoSuchLayer(f"layer {number} does not exist; 'stepfs log' lists the layers.")

    def entries(self, number: int) -> list[Entry]:
        """Layer ``number``'s entries in path order.  The last layer's are
        kept for this transaction: a card reads them for its changes and
        again for its remembered line counts (``store/linecounts.py``)."""
        if self._last_entries is not None and self._last_entries[0] == number:
            return list(self._last_entries[1])
        got = entryrows.layer_entries(self.fetch, number)
        self._last_entries = (number, tuple(got))
        return got

    # -- objects -----------------------------------------------------------------

    def size(self, oid: str) -> int:
        rows = self.fetch("SELECT size FROM objects WHERE oid = ?", (_db(oid),))
        if len(rows) != 1:
            raise CorruptObject(f"object {oid} is missing; run 'stepfs verify' for a full report.")
        return rows[0][0]

    def _chunk_row(self, cid: str) -> tuple | None:
        rows = self.fetch("SELECT data, codec, size, base FROM chunks WHERE cid = ?", (_db(cid),))
        return (*rows[0][:3], _key(rows[0][3])) if rows else None

    def read_all(self, oid: str) -> bytes:
        """An object's bytes, every chunk verified."""
        inline = self.fetch("SELECT data, codec, size, base FROM objects WHERE oid = ?", (_db(oid),))
        if inline and inline[0][0] is not None:  # stored in its row (format 7)
            stored, how, size, base = inline[0]
            digest = oid.split(".", 1)[0]
            data, _base = inline_with_base(self.fetch, oid, stored, how, size, base,
                                           lambda d: self.hasher(d) == digest)
            if self.hasher(data) != digest:
                raise CorruptObject(f"object {oid} is corrupt; run 'stepfs verify' for a full report.")
            return data
        rows = [(_key(r[0]), r[1], r[2], r[3], r[4], _key(r[5])) for r in self.fetch(
            'SELECT oc.cid, oc."offset", c.data, c.codec, c.size, c.base FROM object_chunks oc '
            "LEFT JOIN chunks c ON c.cid = oc.cid WHERE oc.oid = ? ORDER BY oc.seq", (_db(oid),))]
        return b"".join(object_chunks(rows, oid, self._chunk_row, self.hasher))

    # -- what each layer added to the store (store/du.py) -------------------------

    def chunks_of(self, oids: set[str]) -> dict[str, list[str]]:
        """``{oid: [cid, ...]}`` with each delta's base listed after it."""
        out: dict[str, list[str]] = {}
        ordered = sorted(oids)
        rows = []
        for i in range(0, len(ordered), BATCH):
            part = ordered[i:i + BATCH]
            keys = tuple(_db(o) for o in part)
            rows += self.fetch("SELECT oc.oid, oc.cid, c.base FROM object_chunks oc JOIN chunks c ON c.cid = oc.cid "
                               f"WHERE oc.oid IN ({', '.join('?' * len(part))})", keys)
            # An object stored inline (format 7) is its own piece (and its base's).
            for oid, base in self.fetch("SELECT oid, base FROM objects WHERE data IS NOT NULL AND "
                                        f"oid IN ({', '.join('?' * len(part))})", keys):
                # a delta's base (format 10: by prefix; every object under it, a collision counted too)
                bases = [r[0] for r in self.fetch(baseref.CANDIDATES.replace("oid, data, codec, size", "oid"),
                                                  baseref.bounds(base))] if base is not None else []
                out[_key(oid)] = [INLINE + _key(oid)] + [INLINE + _key(b) for b in bases]
        for oid, cid, base in rows:
            oid = _key(oid)
            out.setdefault(oid, []).append(_key(cid))
            if base is not None:
                out[oid].append(_key(base))
        return out

    def stored(self) -> dict[str, int]:
        """Stored bytes of every chunk."""
        sizes = {_key(cid): n for cid, n in self.fetch("SELECT cid, length(data) FROM chunks", ())}
        sizes.update((INLINE + _key(oid), n) for oid, n in
                     self.fetch("SELECT oid, length(data) FROM objects WHERE data IS NOT NULL", ()))
        return sizes

    def added_bytes(self, numbers: list[int] | None = None) -> dict[int, int]:
        """Stored bytes each committed layer added (the first layer to
        reference a chunk gets its bytes), for ``numbers`` (default: every
        one).  Reads the entries of every layer up to the newest asked, in
        one statement (``entryrows.added_bytes``; row by row in Python this was
        about a third of a 20-layer ``log``); :meth:`added_bytes_by_rows`
        is the same answer computed row by row."""
        top = max(numbers) if numbers else 2 ** 62
        out = {int(layer): int(total or 0) for layer, total in entryrows.added_bytes(self.fetch, top)}
        wanted = numbers if numbers is not None else [
            r[0] for r in self.fetch("SELECT number FROM layers WHERE state = 'committed'", ())]
        return {n: out.get(n, 0) for n in wanted}

    def added_bytes_by_rows(self, numbers: list[int] | None = None) -> dict[int, int]:
        """:meth:`added_bytes` from the rows, in Python (the reference the
        tests compare the statement with)."""
        rows = entryrows.committed_refs(self.fetch)
        if numbers is not None and numbers:
            top = max(numbers)
            rows = [r for r in rows if r[0] <= top]
        by_layer: dict[int, set[str]] = {}
        for layer, b, a in rows:
            by_layer.setdefault(layer, set()).update(x for x in (b, a) if x)
        chunks = self.chunks_of(set().union(*by_layer.values()) if by_layer else set())
        sizes = self.stored()
        seen: set[str] = set()
        out: dict[int, int] = {}
        for layer in sorted(by_layer):
            total = 0
            for oid in by_layer[layer]:
                for cid in chunks.get(oid, ()):
                    if cid not in seen:
                        seen.add(cid)
                        total += sizes.get(cid, 0)
            out[layer] = total
        wanted = numbers if numbers is not None else [
            r[0] for r in self.fetch("SELECT number FROM layers WHERE state = 'committed'", ())]
        return {n: out.get(n, 0) for n in wanted}


def open_readonly(workspace: str):
    """A context manager giving :class:`Rows` on one read transaction of the
    store of ``workspace`` through stdlib ``sqlite3``, or None when the store
    must be opened as a :class:`Workspace` instead (module docstring)."""
    import contextlib
    import sqlite3

    try:
        dfd = os.open(os.path.join(workspace, STORE_DIR), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.stat(DB_NAME, dir_fd=dfd, follow_symlinks=False)
        if not stat_mod.S_ISREG(st.st_mode):
            raise OSError
        conn = sqlite3.connect(f"file:/proc/self/fd/{dfd}/{DB_NAME}?mode=ro", uri=True, timeout=30.0,
                               isolation_level=None, check_same_thread=False)
    except (OSError, sqlite3.Error):
        os.close(dfd)
        return None

    def fetch(sql: str, params: tuple = ()) -> list:
        return conn.execute(sql, params).fetchall()

    try:
        conn.execute("BEGIN")
        facts = dict(fetch("SELECT key, value FROM meta"))
        usable = (facts.get("format_version", "").isdigit() and int(facts["format_version"]) in FORMATS
                  and facts.get("hash_algorithm") == HASH_ALGORITHM
                  and fetch("SELECT 1 FROM layers WHERE number = 0") != []
                  and fetch("SELECT 1 FROM layers WHERE state = 'pending' LIMIT 1") == [])
    except sqlite3.Error:
        usable = False
    if not usable:
        conn.close()
        os.close(dfd)
        return None

    @contextlib.contextmanager
    def session():
        try:
            yield Rows(fetch)
        finally:
            conn.close()  # ends the read transaction
            os.close(dfd)

    return session()
