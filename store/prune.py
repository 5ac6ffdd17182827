"""Retention (``stepfs prune``): drop old layers, folding them into the
oldest kept one, store side, no FUSE.

Folding at layer K (the oldest layer kept): for every path that a layer up
to K touched, K gets one entry whose *before* is the path's before state in
the oldest such layer and whose *after* is its after state in the newest
(K's own entry, if K touched it); a path that ended where it began gets
none.  Then every entry of the dropped layers goes, the dropped layers
become ``pruned`` (their rows, numbers, messages stay: a number is never
reused and answers "pruned"), K's intent checksum is computed again, and
``meta.pruned_below`` records K; all in one durable transaction under the
commit lock, so a crash leaves the history before or after, nothing
between.  The bytes only dropped layers held go at the next gc.

Why this keeps every kept layer as it was: the state of a path as of a
kept layer n >= K (``store.history``) is the after state of its newest
entry <= n, else the before state of its oldest entry > n.  Entries above
K are untouched, and K's entry holds the state as of K of every path a
dropped layer or K touched, so both rules give what they gave before.
K's change card becomes the change from the oldest dropped layer's
before states to K ("everything up to K").
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from sqlalchemy import select

from stepfs.store import baseref, entrytable, keys, linecounts, schema
from stepfs.store.errors import InputError
from stepfs.store.entrytable import entry_from_row
from stepfs.store.layers import Entry
from stepfs.store.workspace import Workspace

L, M = schema.layers, schema.meta


@dataclass
class Result:
    keep_from: int | None  # the oldest kept layer after pruning (None: nothing to prune)
    pruned: list[int] = field(default_factory=list)  # layer numbers dropped by this run
    folded_paths: int = 0  # entries the oldest kept layer holds after folding
    dry_run: bool = False

    def as_dict(self) -> dict:
        return {"keep_from": self.keep_from, "pruned": self.pruned, "folded_paths": self.folded_paths,
                "dry_run": self.dry_run}


def pruned_below(conn) -> int:
    """Layers below this number are pruned (0: none)."""
    value = conn.execute(select(M.c.value).where(M.c.key == "pruned_below")).scalar()
    return int(value or 0)


def _committed(conn) -> list[tuple[int, int]]:
    return [tuple(r) for r in conn.execute(
        select(L.c.number, L.c.created_ns).where(L.c.state == "committed").order_by(L.c.number))]


def oldest_kept_by_count_and_age(layers: list[tuple[int, int]], keep_last: int | None,
                                 keep_within_ns: int | None, now_ns: int | None = None) -> int:
    """The oldest layer ``--keep-last`` and ``--keep-within`` keep among
    ``layers`` ((number, created_ns), oldest first, not empty): the older
    of the two rules' answers, the oldest layer when neither is given.
    Shared by the local and the shared history's prune."""
    candidates = []
    if keep_last is not None:
        candidates.append(layers[max(len(layers) - keep_last, 0)][0])
    if keep_within_ns is not None:
        now = time.time_ns() if now_ns is None else now_ns
        within = [n for n, created in layers if created >= now - keep_within_ns]
        candidates.append(within[0] if within else layers[-1][0])
    return min(candidates) if candidates else layers[0][0]


def choose(conn, keep_last: int | None = None, keep_within_ns: int | None = None,
           max_size: int | None = None, now_ns: int | None = None) -> int | None:
    """The oldest layer to keep under the rules (a layer is kept if any of
    ``keep_last`` / ``keep_within_ns`` keeps it; ``max_size`` then drops the
    oldest more until the bytes the kept layers reference fit), or None if
    nothing would be dropped.  The head is always kept."""
    if keep_last is not None and keep_last < 1:
        raise InputError("--keep-last must be at least 1: the newest layer is always kept.")
    layers = _committed(conn)
    if not layers:
        return None
    keep = oldest_kept_by_count_and_age(layers, keep_last, keep_within_ns, now_ns)
    if max_size is not None:
        numbers = [n for n, _c in layers if n >= keep]
        lo = 0
        # The smallest kept range that fits (the bytes referenced fall as the
        # oldest kept layer moves up: fewer versions are held).
        for i, n in enumerate(numbers):
            lo = i
            if referenced_bytes(conn, n) <= max_size:
                break
        keep = numbers[lo]
    return keep if keep > layers[0][0] else None


def referenced_bytes(conn, keep_from: int) -> int:
    """Stored bytes of the chunks that the layers from ``keep_from`` on, once
    folded, would reference (with staged rows and conflicts): what the
    store would hold after prune and gc, less row overhead."""
    folded = [e for e in _fold(conn, keep_from)]
    oids = {s.oid for e in folded for s in (e.before, e.after) if s.oid}
    oids |= entrytable.referenced_oids(conn, after=keep_from)
    oids.update(conn.execute(select(schema.staged.c.oid).where(schema.staged.c.oid.is_not(None))).scalars())
    oids.update(conn.execute(select(schema.conflicts.c.oid).where(schema.conflicts.c.oid.is_not(None))).scalars())
    if not oids:
        return 0
    conn.exec_driver_sql("DROP TABLE IF EXISTS temp.prune_oids")
    conn.exec_driver_sql("CREATE TEMP TABLE prune_oids (oid BLOB PRIMARY KEY)")
    conn.exec_driver_sql("INSERT INTO prune_oids VALUES (?)", [(keys.to_db(o),) for o in oids])
    total = conn.exec_driver_sql("""
        WITH live AS (SELECT DISTINCT cid FROM object_chunks WHERE oid IN (SELECT oid FROM prune_oids)),
             bases AS (SELECT DISTINCT base AS cid FROM chunks WHERE cid IN (SELECT cid FROM live)
                        AND base IS NOT NULL)
        SELECT coalesce(sum(length(data)), 0) FROM chunks
         WHERE cid IN (SELECT cid FROM live) OR cid IN (SELECT cid FROM bases)""").scalar()
    # Objects stored inline (format 7) hold their own bytes.
    # (Format 10: a delta names its base by a key prefix, store/baseref.py.)
    total += conn.exec_driver_sql(f"""
        SELECT coalesce(sum(length(data)), 0) FROM objects
         WHERE data IS NOT NULL AND (oid IN (SELECT oid FROM prune_oids)
               OR substr(oid, 1, {baseref.BASE_BYTES}) IN (SELECT base FROM objects WHERE base IS NOT NULL
                           AND oid IN (SELECT oid FROM prune_oids)))""").scalar()
    conn.exec_driver_sql("DROP TABLE temp.prune_oids")
    return int(total)


def _fold(conn, keep_from: int) -> list[Entry]:
    """Layer ``keep_from``'s entries after folding every committed layer
    below it into it (see the module doc), sorted by path."""
    rows = entrytable.fold_rows(conn, keep_from)
    out: list[Entry] = []
    newest: dict[bytes, int] = {}  # path -> the layer of its newest entry up to keep_from
    linked: dict[bytes, int] = {}  # path of a folded link -> the layer that made the link
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1].path == rows[i].path:
            j += 1
        first, last = entry_from_row(rows[i]), entry_from_row(rows[j])
        newest[first.path] = rows[j].layer
        if first.before != last.after:
            out.append(Entry(path=first.path, before=first.before, after=last.after,
                             after_mtime_ns=last.after_mtime_ns, after_link=last.after_link))
            if last.after_link is not None:
                linked[first.path] = rows[j].layer
        i = j + 1
    paths = {e.path for e in out}
    for e in out:
        if e.after_link is None:
            continue
        # A link survives the fold as rollback reads it (rollback._restore_links):
        # its partner was not replaced after the layer that made the link, and
        # the partner has an entry of its own in the folded layer.
        partner = bytes(e.after_link)
        if partner not in paths or newest.get(partner, -1) > linked[e.path]:
            e.after_link = None  # its partner ended where it began, or was replaced later
    return out


def prune(ws: Workspace, keep_last: int | None = None, keep_within_ns: int | None = None,
          max_size: int | None = None, dry_run: bool = False) -> Result:
    """Drop the layers the rules do not keep, folding them into the oldest
    kept one (module doc).  Runs under the commit lock; recovery has run
    (``Workspace.open``), so no layer is pending."""
    from stepfs.store.publish import intent_checksum

    if keep_last is None and keep_within_ns is None and max_size is None:
        raise InputError("say what to keep: --keep-last N, --keep-within DURATION or --max-size SIZE.")
    with ws.commit_lock():
        with ws.db.read() as conn:
            keep = choose(conn, keep_last, keep_within_ns, max_size)
            if keep is None:
                return Result(None, dry_run=dry_run)
            dropped = [n for n, _c in _committed(conn) if n < keep]
            if dry_run:
                return Result(keep, dropped, len(_fold(conn, keep)), dry_run=True)
        with ws.db.write(durable=True) as conn:
            folded = _fold(conn, keep)
            step = conn.execute(select(L.c.step).where(L.c.number == keep)).scalar()
            held = linecounts.held_through(conn, keep)
            entrytable.replace_through(conn, keep, folded)
            linecounts.carry(conn, keep, held)  # the counts the folded layer still needs
            conn.execute(L.update().where(L.c.number == keep).values(intent_sum=intent_checksum(folded, step)))
            conn.execute(L.update().where(L.c.number < keep, L.c.state == "committed").values(state="pruned"))
            conn.execute(M.delete().where(M.c.key == "pruned_below"))
            conn.execute(M.insert().values(key="pruned_below", value=str(keep)))
        return Result(keep, dropped, len(folded))


UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SPANS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``2G``, ``500M``, ``1.5GiB``, ``1024``: bytes (binary units).  InputError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise InputError(f"{text!r} is not a size; give bytes or a number with K, M, G or T, e.g. 2G.")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def parse_duration(text: str) -> int:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w``: nanoseconds.  InputError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if m is None:
        raise InputError(f"{text!r} is not a duration; give a number with s, m, h, d or w, e.g. 7d.")
    return int(float(m.group(1)) * SPANS[m.group(2)] * 1_000_000_000)
