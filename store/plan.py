"""Step 1 of a commit (``store.publish``): each staged path's before state
captured from the workspace, and the plan of a layer's entries.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field, replace

from stepfs.store import staging, tokens, xattrs
from stepfs.store.contained import NODE_KINDS, kind_of, rdev_of, rdev_target
from stepfs.store.layers import Entry, State
from stepfs.store.wsparts import WorkspaceParts

#: Kinds published as a temporary file renamed over the path (everything
#: but directories); any of them may be a hard link of another path.
LEAF_KINDS = ("file", "symlink", *NODE_KINDS)


@dataclass
class _Before:
    state: State
    token: str
    uid: int = -1
    gid: int = -1


@dataclass
class Plan:
    entries: list[Entry] = field(default_factory=list)
    conflicts: list[bytes] = field(default_factory=list)
    noop_paths: list[bytes] = field(default_factory=list)
    #: Entries left alone and recorded as outside changes: a path through a
    #: symlink or a non-directory in the workspace (:func:`_blocked`), or
    #: below a directory the step removes and changed outside since the
    #: removal (with the removed directories that hold it).
    outside: list[Entry] = field(default_factory=list)
    #: The token each entry's path had when its before state was captured:
    #: the switch leaves a path whose token moved since (changed outside).
    tokens: dict[bytes, str] = field(default_factory=dict)


def _lstat(ws: WorkspaceParts, path: bytes) -> os.stat_result | None:
    """``lstat`` inside the contained root; None if ``path`` is not in the
    tree (see ``Root.lstat_or_none``): the overlay's tokens treat such a path
    as absent too."""
    return ws.root.lstat_or_none(path)


#: Files smaller than this are captured with one read.
_ONE_READ = 256 << 10


def capture(ws: WorkspaceParts, conn, path: bytes, st: os.stat_result | None = None) -> _Before:
    """The workspace state of ``path`` now (file contents stored as an object).
    ``st``: its ``lstat`` taken just before by the caller, if any."""
    if st is None:
        st = _lstat(ws, path)
    if st is None:
        return _Before(State(None), tokens.ABSENT)
    kind = kind_of(st.st_mode)
    mode = stat_mod.S_IMODE(st.st_mode)
    if kind == "file":
        fd = ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)  # token and content from the same open file
            data = os.pread(fd, st.st_size + 1, 0) if st.st_size < _ONE_READ else None
            if data is not None and len(data) <= st.st_size:
                # One read of the known size (put_fd's 1 MiB buffer costs an
                # mmap, mremap and munmap per small file, as at close-write).
                oid = ws.objects.put_bytes(conn, data)
            else:
                oid, _ = ws.objects.put_fd(conn, fd)
            attrs = xattrs.encode(xattrs.read_fd(fd))
        finally:
            os.close(fd)
        return _Before(State("file", stat_mod.S_IMODE(st.st_mode), oid, None, st.st_uid, st.st_gid, attrs),
                       tokens.from_stat(st), st.st_uid, st.st_gid)
    if kind == "symlink":
        target = ws.root.readlink(path)
        return _Before(State("symlink", None, None, target, st.st_uid, st.st_gid),
                       tokens.from_stat(st, target), st.st_uid, st.st_gid)
    if kind == "dir":
        fd = ws.root.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            attrs = xattrs.encode(xattrs.read_fd(fd))
        finally:
            os.close(fd)
        return _Before(State("dir", mode, None, None, st.st_uid, st.st_gid, attrs), tokens.from_stat(st),
                       st.st_uid, st.st_gid)
    # FIFOs, device nodes and sockets are made again by mknod on publish (a
    # device with its number); "special" is only what older stores recorded.
    return _Before(State(kind, mode, None, rdev_target(kind, st.st_rdev), st.st_uid, st.st_gid),
                   tokens.from_stat(st), st.st_uid, st.st_gid)


def _after_of(row: staging.StagedRow) -> State:
    if row.kind == "whiteout":
        return State(None)
    if row.kind == "file":
        return State("file", stat_mod.S_IMODE(row.mode), row.oid, None, row.uid, row.gid, row.xattrs)
    if row.kind == "symlink":
        return State("symlink", None, None, row.target, row.uid, row.gid)
    if row.kind in NODE_KINDS:
        return State(row.kind, stat_mod.S_IMODE(row.mode), None, rdev_target(row.kind, rdev_of(row.kind, row.target)),
                     row.uid, row.gid)
    return State("dir", stat_mod.S_IMODE(row.mode), None, None, row.uid, row.gid, row.xattrs)


def _walk(ws: WorkspaceParts, path: bytes) -> list[bytes]:
    """Every workspace path strictly below directory ``path``; nothing if
    ``path`` is not a directory (a symlink in particular is never followed:
    listing it would fail with ELOOP under the contained root)."""
    if _current_kind(ws, path) != "dir":
        return []
    out, todo = [], [path]
    while todo:
        d = todo.pop()
        try:
            children = ws.root.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue  # a symlink: nothing below it belongs to the tree
            raise
        for name, kind, _ino in children:
            child = name if d == b"." else d + b"/" + name
            out.append(child)
            if kind == stat_mod.S_IFDIR:
                todo.append(child)
    return out


def precapture(ws: WorkspaceParts, conn, path: bytes) -> _Before | None:
    """The before state of workspace file ``path`` captured ahead of a
    commit (a mount daemon does it when it first stages the path; its
    object is stored through ``conn``), or None when it is not worth it or
    not safe to reuse: not a regular file, :data:`PRECAPTURE_MAX` bytes or
    more, or changed within the racy window (tokens.RACY_WINDOW_NS: a later
    rewrite of the same size in the same timestamp tick would keep the
    token).  :func:`plan_step` reuses it only while the path's token is
    still the one captured here, so it is a cache keyed by the token and
    never stale; anything else is captured at the commit as before."""
    st = _lstat(ws, path)
    if st is None or not stat_mod.S_ISREG(st.st_mode) or st.st_size >= PRECAPTURE_MAX \
            or tokens.is_racy(st, time.time_ns()):
        return None
    before = capture(ws, conn, path, st)
    if before.state.kind != "file" or before.token != tokens.from_stat(st):
        return None  # changed while we looked
    return before


#: Files this big or bigger are captured at the commit only (a close that
#: pre-captured them would copy them into the store on the writer's path).
PRECAPTURE_MAX = 1 << 20


def _before_of(ws: WorkspaceParts, conn, path: bytes, known: dict[bytes, _Before] | None) -> _Before:
    """``capture``, or the pre-captured state of ``path`` if the path still
    has the token it had then: one ``lstat`` instead of reading, hashing and
    storing the file (the object is in the store since the pre-capture)."""
    if known:
        before = known.get(path)
        if before is not None:
            st = _lstat(ws, path)
            # gc may have collected the object since (no row named it): then
            # it is captured again (FORMAT.md, "Garbage collection").
            if st is not None and stat_mod.S_ISREG(st.st_mode) and tokens.from_stat(st) == before.token \
                    and ws.objects.exists(conn, before.state.oid):
                return before
            return capture(ws, conn, path, st)
    return capture(ws, conn, path)


def plan_step(ws: WorkspaceParts, rows: list[staging.StagedRow], overwrite: set[bytes] = frozenset(), conn=None,
              known: dict[bytes, _Before] | None = None) -> Plan:
    """Step 1-2 of the protocol: entries and conflicts for ``rows``.
    ``conn``: a writing transaction of the caller to store before objects
    in (else one of its own); ``known``: before states captured ahead
    (:func:`precapture`), used while their token holds."""
    if conn is None:
        with ws.db.write() as own:
            return plan_step(ws, rows, overwrite, own, known)
    staged = {r.path: r for r in rows}
    after: dict[bytes, tuple[State, int | None, str | None]] = {}
    unseen: set[bytes] = set()  # below a removed directory, changed outside since the removal
    for row in rows:
        after[row.path] = (_after_of(row), row.mtime_ns if row.kind in ("file", "symlink") else None, row.base)
        hides_below = row.kind == "whiteout" or (row.kind == "dir" and row.opaque) or row.kind in ("file", "symlink")
        if hides_below:
            # When the step removed what the workspace has here (a replaced
            # path carries it in its row): a name changed below since then
            # was never seen by the step.
            since = (row.mtime_ns or None) if row.kind == "whiteout" else row.removed_ns
            for child in _walk(ws, row.path):
                if child in staged:
                    continue
                if since is not None and _changed_since(ws, child, since):
                    unseen.add(child)
                    continue
                after.setdefault(child, (State(None), None, None))
    # A directory that holds what the step never saw stays, with every
    # directory above it up to the one the step removed or replaced by a
    # non-directory (a directory made again in its place is published).
    keep_dirs = {parent for path in unseen for parent in _parents(path)
                 if parent in after and after[parent][0].kind != "dir"}
    # Hard links made in the mount (of files, symlinks, FIFOs, devices,
    # sockets): every name of a group but the first (in byte order) is
    # published as a link to the first.
    groups: dict[int, list[bytes]] = {}
    for row in rows:
        if row.kind in LEAF_KINDS and row.link_group is not None:
            groups.setdefault(row.link_group, []).append(row.path)
    link_to: dict[bytes, bytes] = {}
    for names in groups.values():
        names.sort()
        for name in names[1:]:
            link_to[name] = names[0]
    plan = Plan()
    plan.outside = [Entry(path, State(None), State(None)) for path in sorted(unseen - keep_dirs)]
    for path in sorted(after):
        state, mtime, base = after[path]
        before = _before_of(ws, conn, path, known)
        if base is not None and before.token != base and path not in overwrite:
            plan.conflicts.append(path)
            continue
        if path in keep_dirs or path in unseen:
            plan.outside.append(Entry(path, before.state, state, mtime))
            continue
        if state.kind is not None and (state.uid is None or state.gid is None):
            # An owner the view never learned: keep the workspace's.
            state = replace(state, uid=before.uid if state.uid is None else state.uid,
                            gid=before.gid if state.gid is None else state.gid)
        link = link_to.get(path)
        if before.state == state and (link is None or _same_inode(ws, path, link)):
            plan.noop_paths.append(path)
            continue
        plan.entries.append(Entry(path, before.state, state, mtime, link))
        plan.tokens[path] = before.token
    blocked = _blocked(ws, plan.entries)
    if blocked:
        plan.outside += [e for e in plan.entries if e.path in blocked]
        plan.entries = [e for e in plan.entries if e.path not in blocked]
    plan.outside.sort(key=lambda e: e.path)
    return plan


def _changed_since(ws: WorkspaceParts, path: bytes, since_ns: int) -> bool:
    """Whether ``path`` was made or changed after ``since_ns``, a removal
    time the view read from the fine realtime clock, which no earlier
    ``ctime`` passes.  A change in the removal's own coarse clock tick may
    be stamped earlier and count as before it: at worst a name made outside
    within a few milliseconds of the removal is removed with it."""
    st = _lstat(ws, path)
    return st is not None and st.st_ctime_ns > since_ns


def _parents(path: bytes) -> list[bytes]:
    out = []
    while b"/" in path:
        path = path.rpartition(b"/")[0]
        out.append(path)
    return out


def _blocked(ws: WorkspaceParts, entries: list[Entry]) -> dict[bytes, str]:
    """The entries that make something at a path whose parent is not a
    directory in the workspace now and is not made one by ``entries``: a
    directory replaced outside stepfs by a symlink (or a file), or removed.
    Such a path cannot be published (every component is resolved without
    following a symlink) and its "before" was read as absent through the
    link: it is an outside change, never a path to write through."""
    made = {e.path for e in entries if e.after.kind == "dir"}
    seen: dict[bytes, str | None] = {}
    out: dict[bytes, str] = {}
    for e in entries:
        if e.after.kind is None:
            continue
        parent = e.path.rpartition(b"/")[0]
        chain = []
        while parent:
            chain.append(parent)
            parent = parent.rpartition(b"/")[0]
        for d in reversed(chain):  # top down: the first blocked ancestor says why
            if d in made:
                continue
            if d not in seen:
                kind = _current_kind(ws, d)
                seen[d] = None if kind == "dir" else (
                    f"{os.fsdecode(d)} is {'gone' if kind is None else 'a ' + kind} in the workspace, not a "
                    f"directory (changed outside stepfs)")
            if seen[d] is not None:
                out[e.path] = seen[d]
                break
    return out


def _same_inode(ws: WorkspaceParts, a: bytes, b: bytes) -> bool:
    try:
        sa, sb = ws.root.lstat(a), ws.root.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _current_kind(ws: WorkspaceParts, path: bytes) -> str | None:
    st = _lstat(ws, path)
    return None if st is None else kind_of(st.st_mode)
