"""``stepfs verify-history``: every chunk and object of a shared history
re-hashed, and its layers checked for the shape the rest of the code
relies on (``--history URL``; read-only)."""

from __future__ import annotations

import hashlib

from sqlalchemy import func, select

from stepfs.store.errors import CorruptObject
from stepfs.store.shared import tables as T
from stepfs.store.shared.remote import Remote, sha256_hex


def verify(remote: Remote) -> tuple[dict[str, int], list[str]]:
    """Re-hash every chunk and object; check that the layers run 0..head
    without a gap, that pruned ones come first and have no entries, and
    every entry names stored objects."""
    problems: list[str] = []
    counts = {"chunks": 0, "objects": 0, "layers": 0, "entries": 0}
    with remote.tx() as conn:
        for h, size, data in conn.execute(select(T.chunks.c.hash, T.chunks.c.size, T.chunks.c.data)):
            counts["chunks"] += 1
            if sha256_hex(data) != h or len(data) != size:
                problems.append(f"chunk {h} does not hash to its key")
        objects = conn.execute(select(T.objects.c.hash, T.objects.c.size)).all()
        head = conn.execute(select(T.histories.c.head).where(T.histories.c.name == remote.name)).scalar()
        numbers = conn.execute(select(T.layers.c.number).where(T.layers.c.history == remote.name)
                               .order_by(T.layers.c.number)).scalars().all()
        # Pruned layers (prune.py): a prefix of the history, with no entries left.
        pruned = conn.execute(select(T.layers.c.number).where(T.layers.c.history == remote.name,
                                                              T.layers.c.kind == "pruned")).scalars().all()
        kept_from = min((n for n in numbers if n not in set(pruned)), default=None)
        pruned_named = conn.execute(select(func.count()).select_from(T.entries).where(
            T.entries.c.history == remote.name, T.entries.c.layer.in_(pruned))).scalar() if pruned else 0
        named = conn.execute(select(func.count()).select_from(T.entries).where(T.entries.c.history == remote.name)).scalar()
    for digest, size in objects:
        counts["objects"] += 1
        h, n = hashlib.sha256(), 0
        try:
            for piece in remote.iter_object(digest):
                h.update(piece)
                n += len(piece)
        except CorruptObject as exc:
            problems.append(str(exc))
            continue
        if h.hexdigest() != digest or n != size:
            problems.append(f"object {digest} does not hash to its key")
    counts["layers"], counts["entries"] = len(numbers), int(named or 0)
    if head is None:
        problems.append(f"the history {remote.name} does not exist")
    elif list(numbers) != list(range(head + 1)):
        problems.append(f"the layers of {remote.name} do not run 0..{head} without a gap")
    if pruned and (kept_from is None or max(pruned) > kept_from):
        problems.append(f"a pruned layer of {remote.name} is newer than a kept one")
    if pruned_named:
        problems.append(f"{pruned_named} entries of {remote.name} belong to pruned layers")
    return counts, problems
