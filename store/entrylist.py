"""A layer's entry list as bytes (format 8, ``layer_entries.data``): no
database import, the CLI's SQLAlchemy-free ``log`` and ``show`` decode it.

A list is one zstd frame of its entries stored column by column, each
column fixed-width so that decoding is a few C-level array conversions,
not a Python loop over varints (docs/format8.md: 9.7 ms for a 3,606-entry
list, against 30-66 ms for varints):

* a header: version byte, entry count (u32), the kind names the list uses
  (count byte, then each as length byte + ASCII); a kind column holds the
  1-based index of its kind in that table, 0 for absent;
* the integer columns (:data:`INTS`) as little-endian int64, ``NULL`` as
  :data:`NULL_INT`; the path column holds ``paths.id``;
* the two kind columns, one byte an entry;
* the byte columns (:data:`BYTES`) as little-endian int32 lengths (-1 for
  NULL) followed by the values concatenated; oids are their stored keys
  (``keytext.to_db``);
* format 11: a ``before_oid`` length of -2 is a marker (:data:`PREVIOUS`),
  "the ``after_oid`` of this path's entry in the newest committed layer
  below this one" (docs/format11.md): most befores repeat it, and a random
  16-byte key does not compress.  This module only carries the marker;
  ``store/entryrows.py`` resolves it, ``store/entrytable.py`` writes it.

Decoded lists are cached by the bytes of their frame (content-addressed, so
never stale, whatever connection or store asks).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict

import xxhash
import zstandard

from stepfs.store.codec import compressor, decompressor
from stepfs.store.keytext import from_db, to_db

#: The list a decoded row carries, in this order (path is the path id).
COLUMNS = ("path", "before_kind", "before_mode", "before_oid", "before_target", "before_uid", "before_gid",
           "before_xattrs", "after_kind", "after_mode", "after_oid", "after_target", "after_uid", "after_gid",
           "after_xattrs", "after_mtime_ns", "after_link")
INTS = ("path", "before_mode", "before_uid", "before_gid", "after_mode", "after_uid", "after_gid", "after_mtime_ns")
KINDS = ("before_kind", "after_kind")
BYTES = ("before_oid", "before_target", "before_xattrs", "after_oid", "after_target", "after_xattrs", "after_link")
OIDS = ("before_oid", "after_oid")
NULL_INT = -(1 << 63)


class _Previous:
    """The type of :data:`PREVIOUS` (one instance; never a key: a leak into
    ``keytext.to_db`` fails loudly)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PREVIOUS"


#: A decoded ``before_oid`` that is a marker (format 11): the path's
#: previous ``after_oid``, resolved by ``store/entryrows.py``.
PREVIOUS = _Previous()
#: A byte column's stored length for :data:`PREVIOUS` (-1 is NULL).
_MARK = -2
#: Entries in one list at most (a layer with more has several lists).
LIST_MAX = 4096
VERSION = 1
#: zstd level of a list: written once per commit, read by every history query.
LEVEL = 6

_BIG = sys.byteorder == "big"


def _ints(values, code: str) -> bytes:
    a = array(code, values)
    if _BIG:  # pragma: no cover - little-endian on disk whatever the machine
        a.byteswap()
    return a.tobytes()


def encode(rows: list[tuple]) -> bytes:
    """One list from ``rows``: tuples in :data:`COLUMNS` order (oids hex,
    path an id), already sorted by path id."""
    cols = dict(zip(COLUMNS, zip(*rows))) if rows else {c: () for c in COLUMNS}
    kinds: list[str] = []
    for name in KINDS:
        for k in cols[name]:
            if k is not None and k not in kinds:
                kinds.append(k)
    index = {k: i + 1 for i, k in enumerate(kinds)}
    out = [bytes([VERSION]), len(rows).to_bytes(4, "little"), bytes([len(kinds)])]
    for k in kinds:
        b = k.encode("ascii")
        out += [bytes([len(b)]), b]
    for name in INTS:
        out.append(_ints([NULL_INT if v is None else v for v in cols[name]], "q"))
    for name in KINDS:
        out.append(bytes(0 if k is None else index[k] for k in cols[name]))
    for name in BYTES:
        vals = cols[name]
        if name in OIDS:
            vals = [to_db(v) if v is not None and v is not PREVIOUS else v for v in vals]
        vals = [bytes(v) if v is not None and v is not PREVIOUS else v for v in vals]
        out.append(_ints([-1 if v is None else _MARK if v is PREVIOUS else len(v) for v in vals], "i"))
        out.append(b"".join(v for v in vals if v is not None and v is not PREVIOUS))
    return compressor(LEVEL).compress(b"".join(out))


#: What a MemoryError while decoding means (it carries no message).
_HUGE = "its frame header declares an impossible size"


class ListDamaged(ValueError):
    """A list's bytes do not decode (a damaged store or intent)."""


def _decode(blob: bytes) -> list[tuple]:
    try:
        rows = _columns(blob)
    # MemoryError: a damaged frame header declaring an impossible size.
    except (zstandard.ZstdError, IndexError, ValueError, UnicodeDecodeError, MemoryError) as exc:
        raise ListDamaged(f"an entry list does not decode: {str(exc) or _HUGE}") from None
    return rows


def _open(blob) -> tuple[memoryview, int, list[str | None], int]:
    """A list's decompressed bytes, its entry count, its kind table (index
    0: absent) and the offset of its first column."""
    raw = memoryview(decompressor().decompress(bytes(blob)))
    if raw[0] != VERSION:
        raise ValueError(f"entry list of version {raw[0]}, this stepfs reads {VERSION}")
    n = int.from_bytes(raw[1:5], "little")
    at = 6
    kinds: list[str | None] = [None]
    for _ in range(raw[5]):
        size = raw[at]
        kinds.append(bytes(raw[at + 1:at + 1 + size]).decode("ascii"))
        at += 1 + size
    return raw, n, kinds, at


def _array(raw: memoryview, at: int, n: int, code: str) -> array:
    """``n`` little-endian integers of type ``code`` at ``at`` (``_ints``'s inverse)."""
    a = array(code)
    a.frombytes(raw[at:at + a.itemsize * n])
    if _BIG:  # pragma: no cover
        a.byteswap()
    return a


def _byte_column(raw: memoryview, at: int, n: int, keep: bool = True) -> tuple[list | None, int]:
    """A byte column's values (None for NULL, :data:`PREVIOUS` for a
    marker; None for all when not ``keep``: skipped) and the offset after it."""
    lengths = _array(raw, at, n, "i")
    at += 4 * n
    if not keep:
        return None, at + sum(size for size in lengths if size > 0)
    vals: list = []
    for size in lengths:
        if size < 0:
            vals.append(PREVIOUS if size == _MARK else None)
        else:
            vals.append(bytes(raw[at:at + size]))
            at += size
    return vals, at


def _columns(blob: bytes) -> list[tuple]:
    raw, n, kinds, at = _open(blob)
    cols: dict[str, list] = {}
    for name in INTS:
        cols[name] = [None if v == NULL_INT else v for v in _array(raw, at, n, "q")]
        at += 8 * n
    for name in KINDS:
        cols[name] = [kinds[i] for i in raw[at:at + n]]
        at += n
    for name in BYTES:
        vals, at = _byte_column(raw, at, n)
        if name != "before_oid" and PREVIOUS in vals:
            raise ValueError(f"a marker in column {name}")
        if name in OIDS:
            vals = [from_db(v) if v is not None and v is not PREVIOUS else v for v in vals]
        cols[name] = vals
    if at != len(raw):
        raise ValueError(f"{len(raw) - at} bytes after the last column")
    return list(zip(*(cols[c] for c in COLUMNS)))


def stored_oids(blob) -> list[tuple[bytes | None, bytes | None]]:
    """``(before_oid, after_oid)`` of each entry of a list as stored keys
    (``keytext.to_db`` form), reading only those columns: the cards'
    stored bytes name every object of a history, and converting every
    column of every list cost more than the rest of ``show``.  A marker
    (:data:`PREVIOUS`) gives None: the object it stands for is named by
    the previous entry it points at."""
    try:
        raw, n, _kinds, at = _open(blob)
        at += 8 * n * len(INTS) + n * len(KINDS)
        out: dict[str, list] = {}
        for name in BYTES:
            vals, at = _byte_column(raw, at, n, keep=name in OIDS)
            if vals is not None:
                out[name] = vals
            if len(out) == len(OIDS):
                break
    except (zstandard.ZstdError, IndexError, ValueError, MemoryError) as exc:
        raise ListDamaged(f"an entry list does not decode: {str(exc) or _HUGE}") from None
    befores = [None if v is PREVIOUS else v for v in out["before_oid"]]
    if PREVIOUS in out["after_oid"]:
        raise ListDamaged("an entry list does not decode: a marker in column after_oid")
    return list(zip(befores, out["after_oid"]))


_CACHE: OrderedDict[bytes, list[tuple]] = OrderedDict()
_CACHE_LOCK = threading.Lock()
#: Decoded entries kept, all lists together (a mount daemon lives long: a
#: decoded entry takes a few hundred bytes, so this is about 10 MB).
CACHE_ENTRIES = 32768
_cached = [0]


def _keep(key: bytes, rows: list[tuple]) -> None:
    """Cache ``rows`` under ``key``, dropping the least recently used lists
    beyond :data:`CACHE_ENTRIES` (caller holds the lock)."""
    old = _CACHE.pop(key, None)
    _cached[0] -= len(old) if old is not None else 0
    _CACHE[key] = rows
    _cached[0] += len(rows)
    while _cached[0] > CACHE_ENTRIES and len(_CACHE) > 1:
        _k, dropped = _CACHE.popitem(last=False)
        _cached[0] -= len(dropped)


def decode(blob) -> list[tuple]:
    """The rows of one list (tuples in :data:`COLUMNS` order), cached."""
    blob = bytes(blob)
    key = xxhash.xxh3_128_digest(blob)
    with _CACHE_LOCK:
        rows = _CACHE.get(key)
        if rows is not None:
            _CACHE.move_to_end(key)
            return rows
    rows = _decode(blob)
    with _CACHE_LOCK:
        _keep(key, rows)
    return rows


def remember(blob: bytes, rows: list[tuple]) -> None:
    """Cache ``rows`` as the decoding of ``blob`` (a writer that just
    encoded them: the commit's delta pass reads the layer next)."""
    key = xxhash.xxh3_128_digest(blob)
    rows = [tuple(r) for r in rows]
    with _CACHE_LOCK:
        _keep(key, rows)


def has_markers(rows: list[tuple]) -> bool:
    """Whether a decoded list holds a marker (:data:`PREVIOUS`)."""
    return any(r[3] is PREVIOUS for r in rows)


def split(rows: list[tuple]) -> list[list[tuple]]:
    """``rows`` (sorted by path id) in lists of at most :data:`LIST_MAX`."""
    return [rows[i:i + LIST_MAX] for i in range(0, len(rows), LIST_MAX)]
