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

from stepfs.store import baseref
from stepfs.store.keytext import HASH_BYTES, from_db, to_db  # noqa: F401  (re-exported)


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


class BaseRef(TypeDecorator):
    """``objects.base`` (format 10, ``store/baseref.py``): bound as a hex
    key, stored as the first ``BASE_BYTES`` bytes of its stored form, read
    back as those bytes (a prefix, not a key)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if value is None else baseref.of(value)

    def process_result_value(self, value, dialect):
        return None if value is None else bytes(value)

    def process_literal_param(self, value, dialect):  # pragma: no cover - never rendered inline
        return value


def is_key(type_) -> bool:
    """Whether a column or bind of type ``type_`` holds keys."""
    return isinstance(type_, HexKey)


def bind_converter(type_):
    """What ``db.Prepared`` applies to a bind of type ``type_`` (a key
    column's, or ``objects.base``'s: format 10), or None."""
    if isinstance(type_, HexKey):
        return to_db
    if isinstance(type_, BaseRef):
        return _base_of
    return None


def _base_of(value):
    return None if value is None else baseref.of(value)
