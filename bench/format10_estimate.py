"""What format 10's candidate layouts (docs/format10.md) would take for a
real format-9 store: each is built in a throw-away copy of the store,
compacted and measured (``bench/store_bytes.py``).  The copies are never
opened by stepfs.

* E: an entry's ``before_oid`` that equals the ``after_oid`` of the path's
  previous entry (newest committed layer below) is not stored (a marker:
  the size of a NULL, measured as one);
* F: ``objects.base`` keeps only the first ``--prefix`` bytes of its key.

``python -m bench.format10_estimate STORE_DB [--prefix N]``.
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

from bench import store_bytes  # noqa: E402
from stepfs.store import entrylist  # noqa: E402


def marker_lists(c: sqlite3.Connection) -> tuple[int, int]:
    """Rewrite every list with E's markers (as NULLs); (entries, marked)."""
    committed = {n for (n,) in c.execute("SELECT number FROM layers WHERE state = 'committed'")}
    prev: dict[int, object] = {}
    total = marked = 0
    rows_by = c.execute("SELECT id, layer, data FROM layer_entries ORDER BY layer, first").fetchall()
    pending_prev: dict[int, object] = {}
    last_layer = None
    for id_, layer, data in rows_by:
        if layer != last_layer:
            prev.update(pending_prev)
            pending_prev = {}
            last_layer = layer
        rows = [list(r) for r in entrylist.decode(data)]
        for r in rows:
            total += 1
            if r[3] is not None and prev.get(r[0]) == r[3]:
                r[3] = None
                marked += 1
            if layer in committed:
                pending_prev[r[0]] = r[10]
        c.execute("UPDATE layer_entries SET data = ? WHERE id = ?", (entrylist.encode([tuple(r) for r in rows]), id_))
    return total, marked


def measure(src: str, e: bool, prefix: int | None) -> int:
    with tempfile.TemporaryDirectory(prefix="stepfs-f10-") as tmp:
        db = os.path.join(tmp, "s.db")
        shutil.copy(src, db)
        c = sqlite3.connect(db)
        note = ""
        if e:
            note += " E %d entries, %d marked" % marker_lists(c)
        if prefix is not None:
            c.execute("UPDATE objects SET base = substr(base, 1, ?) WHERE base IS NOT NULL", (prefix,))
            note += f" F base prefix {prefix}"
        c.commit()
        c.close()
        b = store_bytes.breakdown(db)
        print(f"{b['file_bytes']:>10d}{note}  " + ", ".join(f"{k}={v['bytes']}" for k, v in b["by_name"].items()
                                                           if v["bytes"] > 8192))
        return b["file_bytes"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("db")
    p.add_argument("--prefix", type=int, default=4)
    a = p.parse_args(argv)
    measure(a.db, False, None)
    measure(a.db, True, None)
    measure(a.db, False, a.prefix)
    measure(a.db, False, 8)
    measure(a.db, True, a.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
