"""How an inline delta names its base (format 10, ``objects.base``): by
the first :data:`BASE_BYTES` bytes of the base's stored key, not the whole
key.  A full key took 16 bytes in each of a session's 25,000 delta rows
(docs/format10.md); a prefix is found by a range of the primary key and,
when several objects share it (a collision of 32 bits: rare), the right
one is the one under which the delta decodes to bytes hashing to its own
key.  No SQLAlchemy import: the CLI's reads (``store/cardrows.py``) use it.
"""

from __future__ import annotations

from typing import Callable

from stepfs.store.keytext import to_db

#: Bytes of the base's stored key that ``objects.base`` keeps.
BASE_BYTES = 4
#: Above every key that starts with a prefix: stored keys are 16 bytes and
#: an ASCII suffix, or UTF-8 text, and neither holds a 0xFF byte after it.
_TOP = b"\xff" * 48
#: The rows a delta's base may be (plain SQL, ``?`` placeholders: the
#: bounds of :func:`bounds`): inline objects that are not deltas.
CANDIDATES = ("SELECT oid, data, codec, size FROM objects WHERE oid >= ? AND oid < ? "
              "AND data IS NOT NULL AND (codec IS NULL OR codec != 2)")
#: SQL for the upper bound of the keys under prefix column ``col``.
TOP_SQL = "CAST({col} || x'" + _TOP.hex() + "' AS BLOB)"


def of(key: str) -> bytes:
    """The prefix that names the object ``key`` (hex) as a base."""
    return to_db(key)[:BASE_BYTES]


def bounds(prefix) -> tuple[bytes, bytes]:
    """``(low, high)``: the stored keys starting with ``prefix`` are
    ``low <= key < high``."""
    p = bytes(prefix)
    return p, p + _TOP


def decode(candidates: list[tuple], oid: str, decode_with: Callable[[bytes | None], bytes],
           check: Callable[[bytes], bool] | None) -> tuple[bytes, object] | None:
    """``(bytes, base key)`` of delta ``oid`` decoded against the right one
    of ``candidates`` (``(key, decoded base bytes)``), or None if none
    fits.  ``decode_with(base_bytes)`` decodes the delta; ``check(bytes)``
    says whether they hash to ``oid`` (None: take a lone candidate as it is,
    the caller checks the hash anyway)."""
    for key, base_raw in candidates:
        try:
            data = decode_with(base_raw)
        except ValueError:
            continue
        if (check is None and len(candidates) == 1) or (check is not None and check(data)):
            return data, key
    return None
