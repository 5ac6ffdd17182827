"""Attach, pull, push and clone: a workspace and its shared history.

* **position**: the shared layer a workspace holds (``at``) and its own
  layers not yet published, derived from the local layers (a layer of kind
  ``sync`` records ``shared_layer`` in its meta) and from the history (which
  layers carry this workspace's id and their local ``origin`` number): a
  crash between a local write and a shared one leaves nothing to reconcile.
* **pull** brings the workspace to the history's head: the layers other
  workspaces published since ``at`` are applied, one local ``sync`` layer
  each, through the atomic publish rollback uses (``publish.write_layer``).
  Refused as a whole (:class:`SharedConflict`, nothing written) when one of
  their paths (or one above or below it) is staged in an open step of this
  workspace or changed by a layer not yet published, or when the disk no
  longer holds the state they start from.
* **push** publishes this workspace's unpublished layers, oldest first,
  each by compare-and-swap on the head (``Remote.publish``).
* **clone** makes a new workspace holding the history as of a layer.

Callers hold the history's lock (``Remote.lock``) around a pull, the local
commit and the push of one step.
"""

from __future__ import annotations

import json
import os
import socket
import stat as stat_mod
import time
import uuid
from dataclasses import dataclass, field

from sqlalchemy import select

from stepfs.store import layers as local_layers, publish, schema, staging, tokens
from stepfs.store.errors import HistoryError, SharedConflict
from stepfs.store.layers import Entry, State
from stepfs.store.recovery import holds
from stepfs.store.shared import attachment, catchup, prune as shared_prune
from stepfs.store.shared.attachment import Attachment
from stepfs.store.shared.remote import LayerRecord, Remote
from stepfs.store.shared.transfer import Downloader, Uploader
from stepfs.store.shared.url import HistoryURL

L = schema.layers
SYNC = "sync"


@dataclass
class Position:
    at: int  # the newest shared layer the workspace holds
    unpublished: list[int] = field(default_factory=list)  # own local layers, oldest first


@dataclass
class Pulled:
    shared: int  # the shared layer applied
    local: int  # the local sync layer that applied it
    paths: list[bytes]


# -- attach ----------------------------------------------------------------------------


def attach(ws, url: HistoryURL, remote: Remote) -> Attachment:
    """Attach ``ws`` to the history (the caller holds ``remote.lock()``).
    A new history starts with a snapshot of the workspace's tree as layer
    0; an existing one is refused (clone it instead) unless this workspace
    made it.  Attaching again to the same history is a no-op."""
    att = attachment.read(ws)
    if att is not None:
        if att.url.name != url.name or att.url.display != url.display:
            raise HistoryError(f"{ws.path} is attached to the shared history {att.url.display}, not "
                               f"{url.display}; clone {url.display} into a new directory instead.")
        if remote.head() is None:
            _create(ws, remote, att)  # the attachment was written, the history never made: make it now
        return att
    if remote.head() is not None:
        raise HistoryError(f"the shared history {url.display} exists already; make a workspace of it with "
                           f"'stepfs clone URL DIR' (a workspace with its own files cannot join it).")
    with ws.db.read() as conn:
        base = local_layers.head(conn)
    att = Attachment(url, uuid.uuid4().hex, base, 0)
    attachment.write(ws, att)  # first: a history made without it would belong to no workspace
    _create(ws, remote, att)
    return att


def _walk(ws) -> list[bytes]:
    out, todo = [], [b"."]
    while todo:
        d = todo.pop()
        for name, fmt, _ino in ws.root.listdir(d):
            child = name if d == b"." else d + b"/" + name
            out.append(child)
            if fmt == stat_mod.S_IFDIR:
                todo.append(child)
    return sorted(out)


def _create(ws, remote: Remote, att: Attachment) -> None:
    up = Uploader(ws, remote)
    entries = []
    with ws.commit_lock():
        with ws.db.write() as conn:
            befores = {p: publish.capture(ws, conn, p) for p in _walk(ws)}
    for path, before in befores.items():
        if before.state.kind is not None:
            s = before.state
            entries.append(Entry(path, State(None), State(s.kind, s.mode, s.oid, s.target, None, None, s.xattrs)))
    entries = up.rows(entries)
    remote.create(_record(ws, att, 0, "baseline", f"workspace {ws.path} attached", "", "", {}, att.base), entries)


def _record(ws, att: Attachment, number: int, kind: str, message: str, agent: str, mount: str, meta: dict,
            origin: int | None) -> LayerRecord:
    return LayerRecord(number, kind, time.time_ns(), message, agent, mount, meta, att.workspace, ws.path,
                       socket.gethostname(), origin)


# -- position ---------------------------------------------------------------------------


def position(ws, remote: Remote, att: Attachment) -> Position:
    published = remote.origins(att.workspace)
    # Only the local layers above the newest one published: a push
    # publishes oldest first, so every own layer below it is published, and
    # every sync layer below it applied a shared layer older than it.
    newest = max([att.base, *published])
    with ws.db.read() as conn:
        rows = conn.execute(select(L.c.number, L.c.kind, L.c.meta).where(
            L.c.state == "committed", L.c.number > newest).order_by(L.c.number)).all()
    at = max([att.at, *published.values()])
    unpublished = []
    for number, kind, meta in rows:
        if kind == SYNC:
            at = max(at, int(json.loads(meta or "{}").get("shared_layer", -1)))
        elif number not in published:
            unpublished.append(number)
    return Position(at, unpublished)


# -- pull ---------------------------------------------------------------------------------


def _overlap(p: bytes, q: bytes) -> bool:
    return p == q or p.startswith(q + b"/") or q.startswith(p + b"/")


def _local_paths(ws, unpublished: list[int]) -> set[bytes]:
    """What this workspace changed that the history has not seen: the
    paths staged in its open steps and those of its unpublished layers."""
    out: set[bytes] = set()
    with ws.db.read() as conn:
        for st in staging.list_steps(conn):
            out.update(r.path for r in staging.load(conn, st["id"]))
        for n in unpublished:
            out.update(e.path for e in local_layers.entries(conn, n))
    return out


def pull(ws, remote: Remote, att: Attachment) -> list[Pulled]:
    """Apply the layers other workspaces published since this one's
    position (see the module doc); returns what was applied."""
    pos = position(ws, remote, att)
    head = remote.head()
    if head is None:
        raise HistoryError(f"the shared history {att.url.display} does not exist (any more); "
                           f"attach a workspace to make it again with 'stepfs mount --history URL'.")
    if head <= pos.at:
        return []
    listed = remote.layers(after=pos.at)
    fold = catchup.fold_layer(listed)  # behind the oldest kept layer: sync from the fold's result
    incoming = [r for r in listed if (r.workspace != att.workspace or r.origin is None)
                and r.kind != shared_prune.PRUNED and r is not fold]
    rows = remote.entries_of([r.number for r in incoming] + ([fold.number] if fold is not None else []))
    if fold is not None:
        rows[fold.number] = catchup.changed_rows(ws, rows[fold.number], pos.unpublished)
    mine = _local_paths(ws, pos.unpublished)
    clashes: dict[bytes, int] = {}
    for r in ([fold] if fold is not None else []) + incoming:
        for e in rows[r.number]:
            if any(_overlap(e["path"], q) for q in mine):
                clashes.setdefault(e["path"], r.number)
    if clashes:
        _refuse(att, clashes, "changed in this workspace too (staged or not yet published)")
    publish.recover(ws)
    done: list[Pulled] = []
    with ws.commit_lock():
        down = Downloader(ws, remote)  # under the lock: gc cannot sweep what the layer will name
        down.fetch([row for r in incoming for row in rows[r.number]])
        plans = [(r, [down.entry(row) for row in rows[r.number]]) for r in incoming]
        if fold is not None:
            plans.insert(0, (fold, catchup.entries(ws, down, rows[fold.number])))
        check_disk(ws, att, [(r.number, entries) for r, entries in plans])
        final = {e.path: e.after for _r, entries in plans for e in entries}
        for r, entries in plans:
            todo, expect = unapplied(ws, entries, final)
            meta = {**r.meta, "shared_layer": r.number, "shared_host": r.host, "shared_workspace": r.workspace_path}
            number = publish.write_layer(ws, todo, kind=SYNC, message=r.message, agent=r.agent, mount=r.mount,
                                         meta=meta, consume_step=None, expect=expect)
            done.append(Pulled(r.number, number, [e.path for e in todo]))
    return done


def _refuse(att: Attachment, clashes: dict[bytes, int], why: str) -> None:
    names = ", ".join(f"{os.fsdecode(p)} (shared layer {n})" for p, n in sorted(clashes.items())[:10])
    more = f" and {len(clashes) - 10} more" if len(clashes) > 10 else ""
    raise SharedConflict(
        f"{len(clashes)} path(s) changed in the shared history {att.url.display} by another workspace were {why}: "
        f"{names}{more}; nothing was written here or there: re-read those files, discard or roll back this "
        f"workspace's change to them ('stepfs discard'), then step again.",
        sorted(os.fsdecode(p) for p in clashes), sorted(set(clashes.values())))


def check_disk(ws, att: Attachment, plans: list[tuple[int, list[Entry]]]) -> None:
    """Before anything is written: every path the layers to apply touch
    (``plans``: each shared layer's number, named in a conflict, and its
    entries, oldest first) holds the state the first of them starts from
    (or the state the last leaves)."""
    first: dict[bytes, tuple[State, int]] = {}
    last: dict[bytes, State] = {}
    for number, entries in plans:
        for e in entries:
            first.setdefault(e.path, (e.before, number))
            last[e.path] = e.after
    clashes = {}
    with ws.db.read() as conn:
        for path, (before, number) in first.items():
            if not (_holds(ws, conn, path, before) or _holds(ws, conn, path, last[path])):
                clashes[path] = number
    if clashes:
        _refuse(att, clashes, "changed in this workspace outside stepfs")


#: The planned token of a path that no longer holds what the pull checked:
#: no token equals it, so the switch leaves the path (an outside change).
_CHANGED = "changed-outside-since-the-check"


def unapplied(ws, entries: list[Entry], final: dict[bytes, State]) -> tuple[list[Entry], dict[bytes, str]]:
    """The entries whose path does not hold their after state already, and
    the token each has now, taken with the stat its state was judged by:
    the switch checks it just before the path's rename (as a commit does),
    so an edit made outside between this check and the switch is left and
    recorded, never overwritten.  A path holding neither the entry's
    before state nor the pull's final one changed outside since
    :func:`check_disk`."""
    todo, expect = [], {}
    with ws.db.read() as conn:
        for e in entries:
            st = ws.root.lstat_or_none(e.path)
            if holds(ws, conn, e.path, st, e.after):
                continue
            todo.append(e)
            if holds(ws, conn, e.path, st, e.before) or holds(ws, conn, e.path, st, final[e.path]):
                expect[e.path] = tokens.of_path(st, lambda: ws.root.readlink(e.path))
            else:
                expect[e.path] = _CHANGED
    return todo, expect


def _holds(ws, conn, path: bytes, s: State) -> bool:
    return holds(ws, conn, path, ws.root.lstat_or_none(path), s)


# -- push --------------------------------------------------------------------------------------


def push(ws, remote: Remote, att: Attachment) -> list[tuple[int, int]]:
    """Publish this workspace's unpublished layers, oldest first; returns
    ``[(local number, shared number)]``.  Raises HeadMoved (nothing of that
    layer written) if another workspace published first: pull, then push."""
    pos = position(ws, remote, att)
    up = Uploader(ws, remote, ride=True)  # each layer's small batches travel in its publish's round trip
    out = []
    at = pos.at
    for n in pos.unpublished:
        with ws.db.read() as conn:
            layer = local_layers.get(conn, n)
            entries = local_layers.entries(conn, n)
        rows = up.rows(entries)  # uploaded before the head's transaction
        record = _record(ws, att, 0, layer.kind, layer.message, layer.agent, layer.mount, layer.meta, n)
        at = remote.publish(at, record, rows)
        out.append((n, at))
    return out


# -- clone ----------------------------------------------------------------------------------------


def clone(url: HistoryURL, directory: str, at: int | None = None) -> tuple[str, int, int]:
    """Make ``directory`` (absent or empty) a workspace holding the history
    as of layer ``at`` (default: the head), attached to it
    (``store.shared.cloning``).  Returns (workspace path, shared layer,
    local layer)."""
    from stepfs.store.shared import cloning

    return cloning.clone(url, directory, at)
