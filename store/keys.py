"""Object and chunk keys: hex strings in Python, compact bytes in the
database (format 7).

Every key the code passes around is the lowercase hex XXH3-128 of some
bytes (32 digits), optionally suffixed ``.<n>`` after a hash collision.
Stored as text that is 33 bytes a key, in the row and again in every index
that holds it; stored as bytes it is 16 (plus the suffix).  The conversion
happens only here, at the database boundary: :class:`HexKey` is the column
type (SQLAlchemy applies it to Core statements, ``db.Prepared`` applies the
same two functions), so the rest of the code, and another backend, keeps
seeing hex strings.

Encoding, ``to_db``: a key whose first 32 characters are lowercase hex
digits followed by nothing, ``.`` or ``/`` (the upper bound of a family
range, ``objects._key_family``) is those 16 bytes followed by the rest as
ASCII; any other string (the weak test hashers' short keys) is its UTF-8.
``from_db`` reverses it: 16 bytes, or more whose 17th is ``.``, are a hash
with its suffix; anything else is text.  Byte order equals the order of the
hex text within a family, so range queries on a family work unchanged.
"""

from __future__ import annotations

from sqlalchemy import LargeBinary
from sqlalchemy.types import TypeDecorator

_HEX = frozenset("0123456789abcdef")
#: Bytes of a binary hash (XXH3-128).
HASH_BYTES = 16
_DIGITS = 2 * HASH_BYTES


def to_db(key: str | None) -> bytes | None:
    """The stored form of ``key`` (None stays None)."""
    if key is None:
        return None
    if len(key) >= _DIGITS and (len(key) == _DIGITS or key[_DIGITS] in "./") and _HEX.issuperset(key[:_DIGITS]):
        return bytes.fromhex(key[:_DIGITS]) + key[_DIGITS:].encode("ascii")
    return key.encode()


def from_db(raw) -> str | None:
    """The hex key of stored bytes ``raw`` (None stays None)."""
    if raw is None:
        return None
    raw = bytes(raw)
    if len(raw) == HASH_BYTES or (len(raw) > HASH_BYTES and raw[HASH_BYTES] == 0x2E):
        return raw[:HASH_BYTES].hex() + raw[HASH_BYTES:].decode("ascii")
    return raw.decode()


class HexKey(TypeDecorator):
    """A key column: ``LargeBinary`` in the database (``BLOB`` in SQLite,
    ``BYTEA`` in PostgreSQL), a hex ``str`` in Python."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return to_db(value)

    def process_result_value(self, value, dialect):
        return from_db(value)

    def process_literal_param(self, value, dialect):  # pragma: no cover - never rendered inline
        return value


def is_key(type_) -> bool:
    """Whether a column or bind of type ``type_`` holds keys."""
    return isinstance(type_, HexKey)
