"""The two conversions of an object or chunk key between its hex text and
its stored bytes (format 7; the rules are in ``store/keys.py``), alone and
free of SQLAlchemy so that the plain-SQL readers (``store/cardrows.py``,
``stepfs log`` without a mount) can use them without importing it."""

from __future__ import annotations

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
