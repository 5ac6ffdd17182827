"""Where a store's bytes are: pages, payload and rows of every table and
index of a ``store.db``, from SQLite's ``dbstat`` virtual table (the
stdlib's SQLite has it compiled in; ``sqlite3_analyzer`` is rarely
installed).  Sizes are of a ``VACUUM INTO`` copy, so free pages and the WAL
do not blur them.

``python -m bench.store_bytes WORKSPACE_OR_STORE_DB`` prints the table;
``bench/session.py`` reports the same breakdown for the agent session's
store after gc.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
from pathlib import Path

#: The tables whose rows are counted (the ones that grow with history).
#: (``entries`` is format 7's table; format 8 has ``paths``, ``layer_entries``
#: and ``path_layers``: a breakdown reads either.)
COUNTED = ("chunks", "objects", "object_chunks", "entries", "paths", "layer_entries", "path_layers", "layers",
           "staged", "conflicts")


def copy(db_path: str, dest: str) -> None:
    """A compacted copy of the store ``db_path`` (with its WAL's
    transactions) at ``dest``, made through a read-only connection."""
    src = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        src.execute("VACUUM INTO ?", (dest,))
    finally:
        src.close()


def breakdown(db_path: str) -> dict:
    """``{"file_bytes", "page_size", "by_name": {name: {"bytes", "payload", "cells"}}, "other_bytes",
    "rows": {table: n}}``
    of a compacted copy of ``db_path`` (read-only on the original)."""
    with tempfile.TemporaryDirectory(prefix="stepfs-bytes-") as tmp:
        compact = os.path.join(tmp, "copy.db")
        copy(db_path, compact)
        c = sqlite3.connect(compact)
        try:
            page = c.execute("PRAGMA page_size").fetchone()[0]
            out = {"file_bytes": c.execute("PRAGMA page_count").fetchone()[0] * page, "page_size": page,
                   "by_name": {}, "rows": {}}
            for name, size, payload, cells in c.execute(
                    "SELECT name, sum(pgsize), sum(payload), sum(ncell) FROM dbstat GROUP BY name ORDER BY 2 DESC"):
                out["by_name"][name] = {"bytes": size, "payload": payload, "cells": cells}
            # pages no B-tree owns: auto_vacuum's pointer maps (and free pages, none after VACUUM INTO)
            out["other_bytes"] = out["file_bytes"] - sum(v["bytes"] for v in out["by_name"].values())
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
            for t in COUNTED:
                if t in tables:
                    out["rows"][t] = c.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]
            return out
        finally:
            c.close()


def render(b: dict) -> str:
    total = b["file_bytes"]
    lines = [f"store file {total} bytes ({b['page_size']}-byte pages)"]
    for name, s in b["by_name"].items():
        lines.append(f"  {name:28s} {s['bytes']:>11d} B {100 * s['bytes'] / total:5.1f}%  "
                     f"payload {s['payload']:>10d}  cells {s['cells']}")
    lines.append(f"  {'(pointer-map pages)':28s} {b['other_bytes']:>11d} B")
    lines.append("  rows: " + ", ".join(f"{t} {n}" for t, n in b["rows"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.store_bytes WORKSPACE_OR_STORE_DB", file=sys.stderr)
        return 2
    p = Path(args[0])
    if p.is_dir():
        p = p / ".stepfs" / "store.db"
    print(render(breakdown(str(p))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
