"""Keys as stored (format 7, store/keys.py): 16 bytes for a hex XXH3-128
key, its collision suffix after them, other text as UTF-8."""

from __future__ import annotations

import sqlite3

from stepfs.store import keys
from stepfs.store.objects import xxh3_hex


def test_a_hash_key_is_16_bytes_and_comes_back():
    key = xxh3_hex(b"x")
    stored = keys.to_db(key)
    assert len(stored) == 16 and stored == bytes.fromhex(key)
    assert keys.from_db(stored) == key


def test_a_suffixed_key_keeps_its_suffix_and_orders_inside_its_family_range():
    digest = xxh3_hex(b"y")
    members = [digest, digest + ".1", digest + ".2", digest + ".10"]
    for key in members:
        assert keys.from_db(keys.to_db(key)) == key
    lo, hi = keys.to_db(digest + "."), keys.to_db(digest + "/")
    assert all(lo < keys.to_db(k) < hi for k in members[1:])
    assert not lo < keys.to_db(digest) < hi
    # SQLite compares BLOBs as memcmp does: the same order.
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (k BLOB PRIMARY KEY)")
    db.executemany("INSERT INTO t VALUES (?)", [(keys.to_db(k),) for k in members + [xxh3_hex(b"z")]])
    got = {keys.from_db(r[0]) for r in db.execute("SELECT k FROM t WHERE k > ? AND k < ?", (lo, hi))}
    assert got == set(members[1:])


def test_other_keys_are_text_and_none_stays_none():
    for key in ("k", "ab", "ab.1", "0" * 31):
        assert keys.from_db(keys.to_db(key)) == key
    assert keys.to_db(None) is None and keys.from_db(None) is None
    assert keys.to_db("ab") == b"ab"
