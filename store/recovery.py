"""Crash recovery of a commit (``store.publish``): every pending layer
finished or voided.

Recovery (:func:`recover`) runs before anything else uses a store
(``Workspace.open``, and the start of every commit): every ``pending`` layer
whose checksum verifies is published again from the store (steps 2, 4 and 5:
every new file rewritten from its object into a new temporary file and
fsynced, every rename and directory fsync redone) and marked committed,
except the paths that hold neither the layer's before nor its after state
(:func:`classify`): changed outside stepfs after the intent, they are left
as they are, named in the log and recorded as ``outside-change`` conflicts
in the transaction that marks the layer committed.  Nothing is overwritten
that the layer did not capture or write.  A
layer whose checksum does not verify (a torn, truncated or garbage intent)
is marked ``void``: it never reached a consistent commit point, the
workspace is left alone and the step's staged rows, never consumed, are
still the open step.  Then every temporary file is removed.  Recovery is
idempotent and may itself be killed at any point and run again.
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod

from sqlalchemy import update

from stepfs.store.completion import OUTSIDE_CHANGE, _complete  # noqa: F401  (OUTSIDE_CHANGE: re-exported)
from stepfs.store.contained import NODE_KINDS, kind_of, rdev_target
from stepfs.store.entrylist import ListDamaged
from stepfs.store.journal import _PENDING, L, _pending_failure, intent_checksum
from stepfs.store.layers import Entry, State, entries as load_entries
from stepfs.store.plan import _blocked, _current_kind, _lstat
from stepfs.store.switch import _NEW_DIR_MODE, _depth, _remove_temps, apply_entries
from stepfs.store.wsparts import WorkspaceParts

log = logging.getLogger("stepfs.publish")

def recover(ws: WorkspaceParts) -> list[int]:
    """Finish or void every pending layer; returns the numbers rolled forward."""
    with ws.commit_lock():
        return _recover_locked(ws)


def _recover_locked(ws: WorkspaceParts) -> list[int]:
    with ws.db.read() as conn:
        pending = conn.execute(_PENDING).all()
    done = []
    for number, checksum, step in pending:
        with ws.db.read() as conn:
            try:
                entries = load_entries(conn, number)
            except ListDamaged:  # its lists do not decode: not an intent either
                entries = None
        if entries is None or intent_checksum(entries, step) != checksum:
            # Never reached a consistent commit point: not committed, and
            # its step's staged rows were never consumed.
            with ws.db.write(durable=True) as conn:
                conn.execute(update(L).where(L.c.number == number).values(state="void"))
            continue
        try:
            with ws.db.read() as conn:
                left = classify(ws, conn, entries)
            for path, why in sorted(left.items()):
                log.warning("recovery of layer %d leaves %s alone: %s; the layer's version of it is kept as an "
                            "'outside-change' conflict", number, os.fsdecode(path), why)
            apply_entries(ws, number, entries, left)
        except OSError as exc:
            raise _pending_failure(number, exc) from None
        _complete(ws, number, step, left=[e for e in entries if e.path in left])
        done.append(number)
    _remove_temps(ws)
    return done


def classify(ws: WorkspaceParts, conn, entries: list[Entry]) -> dict[bytes, str]:
    """The paths of a pending layer that recovery must leave alone, each
    with why.  Recovery publishes a path only while it holds the entry's
    *before* state, its *after* state (published again: the same bytes,
    rewritten from the store and fsynced, as every recovery does), or a
    state the switch itself passes through (absent between removing a path
    and making it again as another kind; a new directory with the mode
    ``mkdir`` gave it).  Any other state was made outside stepfs after the
    intent (during the switch, or after it and before the layer was marked
    committed) and MUST NOT be overwritten.

    States are compared by kind, mode and content (file bytes against the
    object, byte for byte; symlink target; device number), not by owner,
    extended attributes or times.  A directory the layer removes is left
    when it holds anything the layer does not remove; a path below a left
    path that is no directory now is left too (it cannot be published)."""
    paths = {e.path for e in entries}
    left: dict[bytes, str] = {}
    # Deepest first: the children of a directory are decided before it.
    for e in sorted(entries, key=lambda e: -_depth(e.path)):
        st = _lstat(ws, e.path)
        kind = None if st is None else kind_of(st.st_mode)
        if holds(ws, conn, e.path, st, e.before):
            if kind == "dir" and e.after.kind != "dir":
                strays = [name for name, _k, _i in ws.root.listdir(e.path)
                          if _child(e.path, name) not in paths or _child(e.path, name) in left]
                if strays:
                    left[e.path] = (f"it is a directory the layer removes, and holds {len(strays)} name(s) the "
                                    f"layer does not remove ({os.fsdecode(sorted(strays)[0])}, ...)")
            continue  # published as in any run
        if holds(ws, conn, e.path, st, e.after):
            pass  # published again
        elif kind is None and e.before.kind is not None and e.before.kind != e.after.kind:
            pass  # removed by the switch, not yet made again as the other kind
        elif kind == "dir" and e.after.kind == "dir" and e.before.kind != "dir" \
                and stat_mod.S_IMODE(st.st_mode) == _NEW_DIR_MODE:
            pass  # made by the switch, its mode not yet set
        else:
            left[e.path] = _neither(st, kind)
    for path, why in _blocked(ws, [e for e in entries if e.path not in left]).items():
        left.setdefault(path, f"it cannot be reached: {why}")
    for e in sorted(entries, key=lambda e: _depth(e.path)):
        parent = e.path.rpartition(b"/")[0]
        while parent and e.path not in left:
            if parent in left and _current_kind(ws, parent) != "dir":
                left[e.path] = f"it is below {os.fsdecode(parent)}, which recovery leaves alone"
            parent = parent.rpartition(b"/")[0]
    return left


def _child(parent: bytes, name: bytes) -> bytes:
    return name if parent == b"." else parent + b"/" + name


def _neither(st: os.stat_result | None, kind: str | None) -> str:
    if kind is None:
        return "it was removed outside stepfs"
    return f"it holds a {kind} that is neither the layer's before nor its after state (changed outside stepfs)"


def holds(ws: WorkspaceParts, conn, path: bytes, st: os.stat_result | None, s: State) -> bool:
    """Whether the workspace path (``st``: its ``lstat``, None if absent)
    is in state ``s`` by kind, mode and content (bytes compared in full,
    never by hash; also the shared history's pull, ``store.shared.sync``)."""
    if st is None or s.kind is None:
        return st is None and s.kind is None
    kind = kind_of(st.st_mode)
    if s.kind == "special":  # a socket or device as older stores recorded it
        return kind in NODE_KINDS
    if kind != s.kind:
        return False
    if kind == "symlink":
        return ws.root.readlink(path) == s.target
    if stat_mod.S_IMODE(st.st_mode) != s.mode:
        return False
    if kind == "file":
        # O_NONBLOCK: a file swapped for a FIFO since the lstat must not hang us.
        fd = ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            return ws.objects.holds(conn, s.oid, fd)
        finally:
            os.close(fd)
    return kind == "dir" or rdev_target(kind, st.st_rdev) == s.target
