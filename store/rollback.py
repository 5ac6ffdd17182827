"""Compare-and-swap rollback of the workspace to an earlier layer (store side, no FUSE).

``rollback(ws, N)`` makes every path touched after layer N (with ``paths``:
only those paths and what lies below them) equal to its state as of N
(``store.history``), and records that as a new layer of kind ``rollback``
with the message ``rollback to N``.  It goes through the step commit
protocol (``publish.write_layer``: intent, apply, committed), so a crash
leaves either the old workspace or, after ``recovery.recover``, the
rolled-back one.  History is never deleted: rolling back to the head before
a rollback undoes it.

Rules, checked for every candidate path before anything is written:

* **Compare-and-swap.**  The path on disk must still hold what the last
  layer produced (kind, mode, bytes or link target; bytes are compared in
  full, not by hash, because XXH3 collides on crafted input).  Otherwise it
  was changed outside stepfs since: a conflict.
* **Side-effect free.**  A path already equal to its target is not written,
  so it keeps its inode and mtime; so does every path the rollback does not
  touch.  Restored files get the current time as mtime (like ``git
  checkout``), so build tools see them as changed.
* **Structure.**  A path to be created needs its parent to be (or become) a
  directory; a directory to be removed may only hold paths the rollback
  removes too.  A path that fails this is a conflict as well.
* With ``paths``, an ancestor directory that was removed after N is brought
  back too when a restored path needs it.

Conflicts refuse the rollback as a whole (``CommitConflict``, nothing
written) unless ``skip_conflicts``: then the conflicting paths, and the paths
that depend on them, are left as they are and reported.

Lock rule: planning and writing run under ``ws.commit_lock()`` after
recovery, so no commit moves the head or the workspace in between.  Writers
outside stepfs are not excluded; as for a step commit, the remaining window
is the publish step itself.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from stepfs.store import cards, diff, entrytable, publish, recovery, tokens
from stepfs.store.contained import DEVICE_KINDS, kind_of
from stepfs.store.errors import CommitConflict, HeadMoved, LayerPruned, NothingToRollBack
from stepfs.store.entrytable import entry_from_row
from stepfs.store.history import require_layer, state_from_rows
from stepfs.store.layers import Entry, State, head as head_of, next_number
from stepfs.store.workspace import Workspace


@dataclass
class Conflict:
    path: bytes
    reason: str

    def as_dict(self) -> dict:
        return {"path": os.fsdecode(self.path), "reason": self.reason}


@dataclass
class Plan:
    """What a rollback to ``number`` would write (``entries``: before = the
    disk now = the head's state, after = the state as of ``number``)."""

    number: int
    head: int
    entries: list[Entry] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    unchanged: list[bytes] = field(default_factory=list)
    #: Each entry's token when the plan saw it: the switch leaves a path
    #: whose token moved since (changed outside stepfs), as a commit does.
    tokens: dict[bytes, str] = field(default_factory=dict)


@dataclass
class Result:
    number: int  # the layer rolled back to
    head: int  # the head before the rollback
    layer: int | None  # the new layer; None for a dry run
    card: dict
    skipped: list[Conflict]  # conflicts left alone (skip_conflicts)
    dry_run: bool
    paths: list[bytes] = field(default_factory=list)  # what was (or would be) written
    kind_changed: bool = False  # some path turned into another kind (file -> directory, ...)


# -- the disk side ---------------------------------------------------------------


class _Disk:
    """Read-only questions about the workspace now, each path stat'ed once."""

    def __init__(self, ws: Workspace, conn: Connection):
        self.ws = ws
        self.conn = conn
        self._stat: dict[bytes, os.stat_result | None] = {}

    def lstat(self, path: bytes) -> os.stat_result | None:
        if path not in self._stat:
            try:
                self._stat[path] = self.ws.root.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                self._stat[path] = None
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.EXDEV):
                    raise
                self._stat[path] = None  # through a symlink: not a path of the tree
        return self._stat[path]

    def kind(self, path: bytes) -> str | None:
        st = self.lstat(path)
        return None if st is None else kind_of(st.st_mode)

    def token(self, path: bytes) -> str:
        """The version token of ``path`` from the stat the plan judged it by."""
        return tokens.of_path(self.lstat(path), lambda: self.ws.root.readlink(path))

    def children(self, path: bytes) -> list[bytes]:
        try:
            return [path + b"/" + name for name, _fmt, _ino in self.ws.root.listdir(path)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def matches(self, path: bytes, state: State) -> bool:
        st = self.lstat(path)
        if state.kind is None or st is None:
            return state.kind is None and st is None
        kind = kind_of(st.st_mode)
        if kind != state.kind:
            return False
        if kind == "symlink":
            return self.ws.root.readlink(path) == state.target
        if stat_mod.S_IMODE(st.st_mode) != state.mode:
            return False
        if kind in DEVICE_KINDS:
            return str(st.st_rdev).encode() == state.target
        if kind != "file":
            return True
        return st.st_size == self.ws.objects.size(self.conn, state.oid) and self._same_bytes(path, state.oid)

    def _same_bytes(self, path: bytes, oid: str) -> bool:
        fd = self.ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            pos = 0
            for chunk in self.ws.objects.iter_chunks(self.conn, oid):
                if os.pread(fd, len(chunk), pos) != chunk:
                    return False
                pos += len(chunk)
            return os.pread(fd, 1, pos) == b""
        finally:
            os.close(fd)


# -- planning --------------------------------------------------------------------


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0] or b"."


def _ancestors(path: bytes) -> list[bytes]:
    parts = path.split(b"/")
    return [b"/".join(parts[:i]) for i in range(1, len(parts))]


def plan(ws: Workspace, conn: Connection, number: int, paths: list[bytes] | None = None) -> Plan:
    """The entries and conflicts of a rollback to ``number`` (reads only).

    Raises NoSuchLayer (LayerPruned for a layer prune dropped), or
    NothingToRollBack when ``number`` is the head.
    """
    try:
        require_layer(conn, number)
    except LayerPruned as exc:
        raise LayerPruned(f"cannot roll back to layer {number}: {exc}") from None
    head = head_of(conn)
    if number == head:
        raise NothingToRollBack(f"layer {number} is the head already: there is nothing to roll back.")
    by_path: dict[bytes, list] = {}
    for row in entrytable.rows_touched(conn, number, paths=paths):
        by_path.setdefault(bytes(row.path), []).append(row)
    states: dict[bytes, tuple[State, State]] = {}  # path -> (target, head state)
    for path, rows in by_path.items():
        newest = max(rows, key=lambda r: r.layer)
        states[path] = (state_from_rows(rows, number)[0], entry_from_row(newest).after)
    disk = _Disk(ws, conn)
    if paths and b"." not in paths:
        _add_needed_ancestors(conn, disk, number, states)

    result = Plan(number, head)
    planned: dict[bytes, Entry] = {}
    for path in sorted(states):
        target, at_head = states[path]
        if target.kind == "special":
            result.conflicts.append(Conflict(path, f"it was a special file as of layer {number}, which stepfs cannot restore"))
        elif disk.matches(path, target):
            result.unchanged.append(path)
        elif disk.matches(path, at_head):
            planned[path] = Entry(path, at_head, target, None)
        else:
            result.conflicts.append(Conflict(path, f"changed outside stepfs since layer {head}"))
    result.conflicts += _settle_structure(disk, planned)
    _restore_links(conn, number, by_path, planned, set(result.unchanged))
    result.entries = [planned[p] for p in sorted(planned)]
    result.tokens = {e.path: disk.token(e.path) for e in result.entries}
    result.conflicts.sort(key=lambda c: c.path)
    return result


def _defining(rows: list, number: int):
    """The newest committed entry row of a path at or before ``number``."""
    at_or_before = [r for r in rows if r.layer <= number]
    return max(at_or_before, key=lambda r: r.layer) if at_or_before else None


def _restore_links(conn: Connection, number: int, by_path: dict, planned: dict[bytes, Entry],
                   unchanged: set[bytes]) -> None:
    """Hard links come back as hard links: a restored path (file, symlink,
    FIFO, device or socket) whose state as of ``number`` was published by
    layer L as a link to ``q`` (``after_link``) is linked to ``q`` again when
    no layer after L up to ``number`` changed ``q`` (so ``q`` as of
    ``number`` is the file that was linked: made by L itself, or left as
    it was) and ``q`` is restored too, or already on disk in that state."""
    for path, entry in list(planned.items()):
        row = _defining(by_path.get(path, []), number)
        if row is None or row.after_link is None or entry.after.kind in (None, "dir"):
            continue
        q = bytes(row.after_link)
        q_rows = by_path.get(q)
        if q_rows is None:
            q_rows = entrytable.path_rows(conn, q)
        q_row = _defining(q_rows, number)
        if q_row is not None and q_row.layer > row.layer:
            continue  # q was replaced after the link was made
        if q in planned or q in unchanged or q not in by_path:
            planned[path] = Entry(path, entry.before, entry.after, entry.after_mtime_ns, q)


def _add_needed_ancestors(conn: Connection, disk: _Disk, number: int, states: dict) -> None:
    """For a restored path whose ancestor directory is gone since ``number``,
    roll that ancestor back too (only when it must become a directory)."""
    for path in sorted(states):
        target, _ = states[path]
        if target.kind is None:
            continue
        for anc in _ancestors(path):
            if anc in states or disk.kind(anc) == "dir":
                continue
            rows = entrytable.path_rows(conn, anc)
            if not any(r.layer > number for r in rows):
                continue
            anc_target = state_from_rows(rows, number)[0]
            if anc_target.kind == "dir":
                newest = max(rows, key=lambda r: r.layer)
                states[anc] = (anc_target, entry_from_row(newest).after)


def _settle_structure(disk: _Disk, planned: dict[bytes, Entry]) -> list[Conflict]:
    """Drop planned entries that cannot be applied, until none is left to
    drop: a new path whose parent will not be a directory, a directory to
    remove that still holds paths the rollback does not remove."""
    dropped: list[Conflict] = []
    changed = True
    while changed:
        changed = False
        for path in sorted(planned):
            e = planned[path]
            reason = None
            if e.after.kind is not None:
                parent = _parent(path)
                if parent != b".":
                    pe = planned.get(parent)
                    parent_dir = pe.after.kind == "dir" if pe is not None else disk.kind(parent) == "dir"
                    if not parent_dir:
                        reason = f"its directory {os.fsdecode(parent)} cannot be restored"
            if reason is None and disk.kind(path) == "dir" and e.after.kind != "dir":
                for child in disk.children(path):
                    ce = planned.get(child)
                    if ce is None or ce.after.kind is not None:
                        reason = f"the directory holds {os.fsdecode(child)}, which the rollback would not remove"
                        break
            if reason is not None:
                del planned[path]
                dropped.append(Conflict(path, reason))
                changed = True
    return dropped


# -- the whole operation -------------------------------------------------------------------


def rollback(ws: Workspace, number: int, paths: list[bytes] | None = None, *, dry_run: bool = False,
             skip_conflicts: bool = False, agent: str = "", mount: str = "",
             expect_head: int | None = None) -> Result:
    """Roll the workspace back to layer ``number`` (see the module doc).

    With ``expect_head``, raises HeadMoved (nothing written) unless the head
    is still that layer under the commit lock: a rollback previewed against
    one head is never applied to another.

    Raises NoSuchLayer, NothingToRollBack (``number`` is the head, or every
    path already holds its state as of ``number``) and CommitConflict
    (``paths`` lists the conflicts; nothing written).  A dry run checks the
    same and returns the card it would commit, writing nothing.
    """
    with ws.commit_lock():
        recovery._recover_locked(ws)
        with ws.db.read() as conn:
            if expect_head is not None and head_of(conn) != expect_head:
                now = head_of(conn)
                raise HeadMoved(f"the history moved from layer {expect_head} to layer {now} since this rollback "
                                f"was previewed; nothing was written: look at the new preview and try again.", now)
            p = plan(ws, conn, number, paths)
        if p.conflicts and (not skip_conflicts or not p.entries):
            names = ", ".join(f"{os.fsdecode(c.path)} ({c.reason})" for c in p.conflicts[:10])
            more = f" and {len(p.conflicts) - 10} more" if len(p.conflicts) > 10 else ""
            hint = ("nothing else is left to roll back" if skip_conflicts else
                    "nothing was written: commit or undo those changes, or rerun with --skip-conflicts to leave them")
            raise CommitConflict(
                f"rollback to layer {number} conflicts with {len(p.conflicts)} path(s): {names}{more}; {hint}.",
                [os.fsdecode(c.path) for c in p.conflicts],
            )
        if not p.entries:
            if not p.unchanged:
                where = " at the given paths" if paths else ""
                raise NothingToRollBack(f"nothing to roll back: no layer after {number} changed anything{where}.")
            raise NothingToRollBack(
                f"nothing to roll back: every path changed after layer {number} already holds its state as of layer {number}."
            )
        meta = {"rollback_to": number, "head_before": p.head}
        if paths:
            meta["paths"] = sorted(os.fsdecode(x) for x in paths)
        message = f"rollback to {number}"
        if dry_run:
            with ws.db.read() as conn:
                header = {"number": next_number(conn), "kind": "rollback", "created_ns": time.time_ns(),
                          "message": message, "agent": agent, "mount": mount, "meta": meta}
                card = cards.card_for(ws.objects, conn, header, diff.from_entries(conn, p.entries))
            return Result(number, p.head, None, card, p.conflicts, True, [e.path for e in p.entries],
                          _kind_changed(p.entries))
        layer = publish.write_layer(ws, p.entries, kind="rollback", message=message, agent=agent, mount=mount,
                                    meta=meta, consume_step=None, expect=p.tokens)
        with ws.db.read() as conn:
            card = cards.card(ws.objects, conn, layer)
        return Result(number, p.head, layer, card, p.conflicts, False, [e.path for e in p.entries],
                      _kind_changed(p.entries))


def _kind_changed(entries: list[Entry]) -> bool:
    return any(None not in (e.before.kind, e.after.kind) and e.before.kind != e.after.kind for e in entries)
