"""The two conversions of an object or chunk key between its hex text and
its stored bytes (format 7; the rules are in ``store/keys.py``), alone and
free of SQLAlchemy so that the plain-SQL readers (``store/cardrows.py``,
``stepfs log`` without a mount) can use them without importing it."""

from __future__ import annotations

#: Bytes of a binary hash (XXH3-128).
HASH_BYTES = 16
_DIGITS = 2 * HASH_BYTES


def to_db(key: str | None) -> bytes | None:
    """The stored form of ``key`` (None stays None)."""
    if key is None:
        return None
    if len(key) >= _DIGITS and (len(key) == _DIGITS or key[_DIGITS] in "./"):
        # Lower-case hex digits only: ``fromhex`` also takes upper case and
        # skips spaces, which the round trip and the length refuse (all in
        # C: a row write converts several keys per file).
        head = key[:_DIGITS]
        try:
            raw = bytes.fromhex(head)
        except ValueError:
            return key.encode()
        if len(raw) == HASH_BYTES and raw.hex() == head:
            return raw + key[_DIGITS:].encode("ascii") if len(key) > _DIGITS else raw
    return key.encode()


def from_db(raw) -> str | None:
    """The hex key of stored bytes ``raw`` (None stays None)."""
    if raw is None:
        return None
    raw = bytes(raw)
    if len(raw) == HASH_BYTES or (len(raw) > HASH_BYTES and raw[HASH_BYTES] == 0x2E):
        return raw[:HASH_BYTES].hex() + raw[HASH_BYTES:].decode("ascii")
    return raw.decode()
