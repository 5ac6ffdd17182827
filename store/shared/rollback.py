"""``stepfs rollback --history URL N``: make a workspace attached to a
shared history hold the history's state as of shared layer ``N`` again, as
a new layer (kind ``rollback``) that is then published like a step.

The target state is read from the history, not from the workspace's own
layers: a layer made before the workspace was cloned, or by another
workspace, exists only there, and a local layer number means nothing in
the history.  The caller holds the history's lock and has brought the
workspace to the head first (pull, staged changes committed, pushed), so
the workspace holds the head's state and the layer's entries go from it to
``N``'s; its objects are downloaded before anything is written, and the
layer is written by the atomic publish a pull uses
(``publish.write_layer``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stepfs.store import publish
from stepfs.store.errors import NothingToRollBack
from stepfs.store.records import Entry, State
from stepfs.store.shared import prune, sync
from stepfs.store.shared.attachment import Attachment
from stepfs.store.shared.reads import below, same_state, after_state, require_layer
from stepfs.store.shared.remote import Remote
from stepfs.store.shared.transfer import Downloader


@dataclass
class Rewound:
    number: int  # the shared layer rolled back to
    head: int  # the shared head it was rolled back from
    layer: int | None  # the local rollback layer (None: a dry run)
    paths: list[bytes]  # the paths it changes


def plan(remote: Remote, number: int, paths: list[bytes] | None = None) -> tuple[int, list[tuple]]:
    """(head, [(path, head's row, N's row)]) for every path (below
    ``paths``) whose state differs between the head and layer ``number``."""
    head = require_layer(remote, number, "cannot roll back past the oldest kept layer: ")
    now = remote.state_at(head)
    then = now if number == head else remote.state_at(number)
    prune.require_kept(remote, number, "cannot roll back past the oldest kept layer: ")  # see its doc
    rows = [(p, now.get(p), then.get(p)) for p in sorted(set(now) | set(then))
            if below(p, paths) and not same_state(after_state(now.get(p)), after_state(then.get(p)))]
    if not rows:
        where = " at the given paths" if paths else ""
        raise NothingToRollBack(f"nothing to roll back: the shared history's head (layer {head}) holds layer "
                                f"{number}'s state{where} already.")
    return head, rows


def rollback(ws, remote: Remote, att: Attachment, number: int, paths: list[bytes] | None = None,
             dry_run: bool = False, mount: str = "") -> Rewound:
    """Write the rollback layer here (see the module doc); not published yet."""
    head, rows = plan(remote, number, paths)
    if dry_run:
        return Rewound(number, head, None, [p for p, _, _ in rows])
    publish.recover(ws)
    with ws.commit_lock():
        down = Downloader(ws, remote)  # under the lock: gc cannot sweep what the layer will name
        down.fetch([r for _, a, b in rows for r in (a, b) if r is not None])
        entries = []
        for path, now, then in rows:
            before = down.state(now, "after") if now is not None else State(None)
            after = down.state(then, "after") if then is not None else State(None)
            entries.append(Entry(path, before, after, then["after_mtime_ns"] if then is not None else None))
        sync.check_disk(ws, att, [(head, entries)])  # the disk holds the head's state (or N's)
        # Each path's token as judged: the switch leaves (and records) an edit made outside after it.
        todo, expect = sync.unapplied(ws, entries, {e.path: e.after for e in entries})
        if not todo:
            raise NothingToRollBack(f"nothing to roll back: every path already holds its state as of layer {number} "
                                    f"of the shared history.")
        meta = {"shared_rollback_to": number, "shared_head_before": head}
        if paths:
            meta["paths"] = sorted(os.fsdecode(p) for p in paths)
        layer = publish.write_layer(ws, todo, kind="rollback", message=f"rollback to shared layer {number}",
                                    agent="", mount=mount, meta=meta, consume_step=None, expect=expect)
    return Rewound(number, head, layer, [e.path for e in todo])
