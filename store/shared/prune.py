"""``stepfs prune --history URL``: retention for a shared history, with the
local prune's semantics (``store/prune.py``): the layers the rules do not
keep are folded into the oldest kept one, K.

Folding, in ONE transaction on the history's database:

* K's entries become, for every path, the after state of its newest entry
  at or below K (with that entry's ``after_mtime_ns``, and its
  ``after_link`` while the partner is folded too and was not replaced
  later, as locally), with no before state; a path absent as of K gets no
  entry.  Layer 0 named every path, so K becomes a snapshot of the state
  as of K, and the state as of every kept layer n >= K (the newest entry
  at or below n) is what it was;
* every entry of the layers below K is deleted; their rows stay, with
  kind ``pruned`` (numbers never reused, headers kept, so the layers
  still run 0..head without a gap and a workspace's published layers are
  still its own), and K's meta gains ``shared_pruned_below`` = K, which
  tells a pull that K is a snapshot (``store/shared/catchup.py``);
* ``stepfs_meta.format_version`` becomes 2 (a stepfs of format 1 would
  read a pruned layer as an empty tree): the transaction's last write.

Locks (PostgreSQL): the history's advisory lock, as a step's, so steps
take turns with it; inside the transaction the history's row is locked
first (``FOR UPDATE``), so a publish whose lock was lost waits at its
compare-and-swap for the commit and then lands on the folded history,
whose kept states are unchanged: its entries stay right.  Readers without
the lock (clone, cat, diff) see the history before or after; each checks
that its layer is not pruned after reading it.  The bytes only dropped
layers named are freed by ``stepfs gc-history`` (run after by the CLI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import func, select

from stepfs.store import prune as local_prune
from stepfs.store.errors import HistoryError, InputError, LayerPruned
from stepfs.store.shared import tables as T
from stepfs.store.shared.remote import ENTRY_COLUMNS, Remote, _entry_dict

#: The kind of a layer row whose entries were folded away.
PRUNED = "pruned"
#: K's meta key: layers below it were folded into it (K is a snapshot).
FOLD_KEY = "shared_pruned_below"
#: The format a pruned history's database is raised to.
FORMAT_PRUNED = 2
#: Entry rows per INSERT statement.
BATCH = 2000

E, Lr = T.entries, T.layers


@dataclass
class Result:
    history: str
    keep_from: int | None  # the oldest kept layer after pruning (None: nothing to prune)
    pruned: list[int] = field(default_factory=list)  # layer numbers dropped by this run
    folded_paths: int = 0  # entries the oldest kept layer holds after folding
    dry_run: bool = False

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _layers(conn, name: str) -> list[tuple[int, str, int]]:
    """(number, kind, created_ns) of every layer row, oldest first."""
    return [tuple(r) for r in conn.execute(select(Lr.c.number, Lr.c.kind, Lr.c.created_ns)
                                           .where(Lr.c.history == name).order_by(Lr.c.number))]


def choose(conn, name: str, keep_last: int | None = None, keep_within_ns: int | None = None,
           max_size: int | None = None, now_ns: int | None = None) -> int | None:
    """The oldest layer to keep (rules as ``store.prune.choose``: kept if
    ``keep_last`` or ``keep_within_ns`` keeps it, then ``max_size`` drops
    the oldest more until what the kept layers name fits), or None."""
    if keep_last is not None and keep_last < 1:
        raise InputError("--keep-last must be at least 1: the newest layer is always kept.")
    kept = [(n, created) for n, kind, created in _layers(conn, name) if kind != PRUNED]
    if not kept:
        return None
    keep = local_prune.oldest_kept_by_count_and_age(kept, keep_last, keep_within_ns, now_ns)
    if max_size is not None:
        numbers = [n for n, _c in kept if n >= keep]
        for n in numbers:
            keep = n
            if referenced_bytes(conn, name, n) <= max_size:
                break
    return keep if keep > kept[0][0] else None


def fold(conn, name: str, keep: int) -> list[dict]:
    """Layer ``keep``'s entry rows after folding every layer below it into
    it (module doc), by path."""
    rows = conn.execute(select(E.c.layer, *[E.c[c] for c in ENTRY_COLUMNS])
                        .where(E.c.history == name, E.c.layer <= keep).order_by(E.c.path, E.c.layer)).all()
    newest: dict[bytes, tuple[int, dict]] = {}
    for r in rows:
        newest[bytes(r.path)] = (r.layer, _entry_dict(r))
    out = []
    for path, (layer, e) in newest.items():
        if e["after_kind"] is None:
            continue
        row = {c: e[c] for c in ENTRY_COLUMNS}
        for c in ("kind", "mode", "object", "target", "xattrs"):
            row[f"before_{c}"] = None
        link = e["after_link"]
        if link is not None:
            partner = newest.get(bytes(link))
            if partner is None or partner[1]["after_kind"] is None or partner[0] > layer:
                row["after_link"] = None  # the partner is gone or was replaced after the link was made
        out.append(row)
    return out


def referenced_bytes(conn, name: str, keep: int) -> int:
    """Stored bytes of the chunks the layers from ``keep`` on would name
    once folded: what this history would hold after prune and gc-history."""
    objs = {r["after_object"] for r in fold(conn, name, keep) if r["after_object"]}
    for b, a in conn.execute(select(E.c.before_object, E.c.after_object)
                             .where(E.c.history == name, E.c.layer > keep)):
        objs.update(x for x in (b, a) if x)
    if not objs:
        return 0
    chunks: set[str] = set()
    listed = sorted(objs)
    for i in range(0, len(listed), BATCH):
        chunks.update(conn.execute(select(T.object_chunks.c.chunk)
                                   .where(T.object_chunks.c.object.in_(listed[i:i + BATCH]))).scalars())
    total, names = 0, sorted(chunks)
    for i in range(0, len(names), BATCH):
        total += conn.execute(select(func.coalesce(func.sum(T.chunks.c.size), 0))
                              .where(T.chunks.c.hash.in_(names[i:i + BATCH]))).scalar()
    return int(total)


def prune(remote: Remote, keep_last: int | None = None, keep_within_ns: int | None = None,
          max_size: int | None = None, dry_run: bool = False) -> Result:
    """Fold the layers the rules do not keep into the oldest kept one (module doc)."""
    if keep_last is None and keep_within_ns is None and max_size is None:
        raise InputError("say what to keep: --keep-last N, --keep-within DURATION or --max-size SIZE.")
    name, pg = remote.name, remote.url.dialect == "postgresql"
    with remote.lock(), remote.tx() as conn:
        q = select(T.histories.c.head).where(T.histories.c.name == name)
        head = conn.execute(q.with_for_update() if pg else q).scalar()  # a publish waits for our commit
        if head is None:
            raise HistoryError(f"the shared history {remote.url.display} does not exist; attach a workspace to "
                               f"make it ('stepfs sync WS --history URL').")
        keep = choose(conn, name, keep_last, keep_within_ns, max_size)
        if keep is None:
            return Result(remote.url.display, None, dry_run=dry_run)
        dropped = [n for n, kind, _c in _layers(conn, name) if n < keep and kind != PRUNED]
        folded = fold(conn, name, keep)
        if dry_run:
            return Result(remote.url.display, keep, dropped, len(folded), dry_run=True)
        conn.execute(E.delete().where(E.c.history == name, E.c.layer <= keep))
        for i in range(0, len(folded), BATCH):
            conn.execute(E.insert(), [{"history": name, "layer": keep, **r} for r in folded[i:i + BATCH]])
        meta = json.loads(conn.execute(select(Lr.c.meta).where(Lr.c.history == name, Lr.c.number == keep)).scalar()
                          or "{}")
        meta[FOLD_KEY] = keep
        conn.execute(Lr.update().where(Lr.c.history == name, Lr.c.number == keep)
                     .values(meta=json.dumps(meta, sort_keys=True)))
        conn.execute(Lr.update().where(Lr.c.history == name, Lr.c.number < keep, Lr.c.kind != PRUNED)
                     .values(kind=PRUNED))
        # Last: an older stepfs must not read the pruned layers as empty trees.
        conn.execute(T.meta.update().where(T.meta.c.key == "format_version")
                     .values(value=str(FORMAT_PRUNED)))
    return Result(remote.url.display, keep, dropped, len(folded))


def oldest_kept(remote: Remote) -> int | None:
    """The oldest layer not pruned (None: no history)."""
    with remote.read() as conn:
        return conn.execute(select(func.min(Lr.c.number)).where(Lr.c.history == remote.name,
                                                                 Lr.c.kind != PRUNED)).scalar()


def pruned_error(remote: Remote, number: int, doing: str = "") -> LayerPruned:
    oldest = oldest_kept(remote)
    return LayerPruned(f"{doing}layer {number} of the shared history {remote.url.display} was pruned; the oldest "
                       f"layer kept is {oldest} ('stepfs log --history URL' lists the layers kept).")


def is_pruned(remote: Remote, number: int) -> bool:
    with remote.read() as conn:
        kind = conn.execute(select(Lr.c.kind).where(Lr.c.history == remote.name, Lr.c.number == number)).scalar()
    return kind == PRUNED


def require_kept(remote: Remote, number: int, doing: str = "") -> None:
    """LayerPruned if layer ``number`` was pruned.  Callers reading a
    layer's state call it after the read: a prune committed before the
    read is seen here (the rows are read in statements of their own)."""
    if is_pruned(remote, number):
        raise pruned_error(remote, number, doing)
