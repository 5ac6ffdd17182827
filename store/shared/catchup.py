"""A pull of a workspace whose position is below a shared history's oldest
kept layer K (``stepfs prune --history``, ``prune.py``): the layers it
would have taken are folded into K, whose entries are a snapshot of the
state as of K (no before states), so the workspace syncs from the fold's
result instead:

* every path of K's snapshot whose state the workspace's disk does not
  hold (kind, mode, symlink target, and the SHA-256 of a file's bytes
  against the shared object's key) becomes an entry from what the disk
  holds (captured into the local store, so the local layer can be rolled
  back) to K's state;
* every path the workspace's own layers ever named that K's snapshot
  lacks and the disk still has becomes an entry to "absent";
* a path one of its unpublished layers changed is judged by the state it
  held before that layer (its position's state): only if K's differs did
  the history change it too, and then the pull refuses it.

These entries then go through the pull's usual checks and its atomic
publish as one local ``sync`` layer (``shared_layer`` = K); the layers
above K follow as usual.  A path among them that the workspace staged or
changed in a layer not yet published is refused as a whole (exit 7), as
in any pull.  What
this cannot see: a path created before the workspace's position and
deleted in the pruned range that no layer of this workspace named is left
on its disk (untracked); an edit made outside stepfs to a path K also
changed is taken as the starting point rather than refused (the state it
should be compared with was pruned).
"""

from __future__ import annotations

import hashlib
import os
import stat as stat_mod


from stepfs.store import entrytable, layers as local_layers
from stepfs.store.contained import kind_of
from stepfs.store.plan import capture
from stepfs.store.records import Entry, State
from stepfs.store.shared.prune import FOLD_KEY, PRUNED
from stepfs.store.shared.remote import LayerRecord

_READ = 1 << 20


def fold_layer(listed: list[LayerRecord]) -> LayerRecord | None:
    """K's header, if the layers after a workspace's position (``listed``,
    oldest first) start with pruned ones or with K itself; else None."""
    for r in listed:
        if r.kind != PRUNED:
            return r if FOLD_KEY in (r.meta or {}) else None
    return None


def _sha256(ws, path: bytes) -> str | None:
    try:
        fd = ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    h = hashlib.sha256()
    try:
        while True:
            piece = os.read(fd, _READ)
            if not piece:
                return h.hexdigest()
            h.update(piece)
    finally:
        os.close(fd)


def disk_holds(ws, row: dict) -> bool:
    """Whether the disk holds the after state of shared entry ``row``."""
    path = row["path"]
    st = ws.root.lstat_or_none(path)
    kind = row["after_kind"]
    if st is None or kind is None:
        return st is None and kind is None
    if kind_of(st.st_mode) != kind:
        return False
    if kind == "symlink":
        return ws.root.readlink(path) == row["after_target"]
    if stat_mod.S_IMODE(st.st_mode) != row["after_mode"]:
        return False
    if kind == "file":
        return _sha256(ws, path) == row["after_object"]
    return True


def known_paths(ws) -> set[bytes]:
    """Every path a local layer of the workspace ever named."""
    with ws.db.read() as conn:
        return entrytable.every_path(conn)


def own_bases(ws, unpublished: list[int]) -> dict[bytes, State]:
    """The state each path held before this workspace's unpublished layers
    changed it (the before state of its oldest entry among them): the state
    as of its position, which its disk no longer shows."""
    out: dict[bytes, State] = {}
    with ws.db.read() as conn:
        for n in unpublished:
            for e in local_layers.entries(conn, n):
                out.setdefault(e.path, e.before)
    return out


def _state_is(ws, s: State, row: dict) -> bool:
    """Whether local state ``s`` is shared entry ``row``'s after state."""
    kind = row["after_kind"]
    if s.kind is None or kind is None:
        return s.kind is None and kind is None
    if s.kind != kind:
        return False
    if kind == "symlink":
        return s.target == row["after_target"]
    if s.mode != row["after_mode"]:
        return False
    if kind == "file":
        h = hashlib.sha256()
        with ws.db.read() as conn:
            for piece in ws.objects.iter_chunks(conn, s.oid):
                h.update(piece)
        return h.hexdigest() == row["after_object"]
    return kind == "dir" or s.target == row["after_target"]


_ABSENT = {"after_kind": None, "after_mode": None, "after_object": None, "after_target": None,
           "after_xattrs": None, "after_mtime_ns": None, "after_link": None}


def changed_rows(ws, snapshot: list[dict], unpublished: list[int]) -> list[dict]:
    """The rows of K's snapshot the workspace does not hold as of its
    position, and a deletion row for each known path K lacks that it has
    (module doc).  A path an unpublished layer of its own changed is judged
    by the state it held before (``own_bases``): only if that differs from
    K's did the history change it too (and the pull refuses it)."""
    bases = own_bases(ws, unpublished)
    out = []
    for row in snapshot:
        base = bases.get(row["path"])
        if not (disk_holds(ws, row) if base is None else _state_is(ws, base, row)):
            out.append(row)
    named = {row["path"] for row in snapshot}
    for path in sorted((known_paths(ws) | set(bases)) - named):
        base = bases.get(path)
        if (ws.root.lstat_or_none(path) is not None) if base is None else base.kind is not None:
            out.append({"path": path, **_ABSENT})
    return out


def entries(ws, down, rows: list[dict]) -> list[Entry]:
    """Local entries for ``changed_rows``: from the disk's state (captured
    now, under the caller's commit lock) to K's; K's objects downloaded."""
    down.fetch([r for r in rows if r["after_object"]])
    out = []
    with ws.db.write() as conn:
        for row in rows:
            before = capture(ws, conn, row["path"]).state
            after = down.state(row, "after") if row["after_kind"] is not None else State(None)
            out.append(Entry(row["path"], before, after, row["after_mtime_ns"]))
    return out
