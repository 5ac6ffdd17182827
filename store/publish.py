"""Atomic publish of a step into the workspace, and crash recovery.

Why one module of about 1,250 lines: the commit, the switch and recovery
share the temporary-file names, the durable seam and the crash invariants
written below; a reader checks the protocol against FORMAT.md in one place.

Commit protocol (the order is the whole point; FORMAT.md repeats it).  Every
call that moves or persists state goes through ``store.durable`` (the seam
the crash tests count, fail and kill at).  What a crash (process kill or
power loss) at each point leaves behind is given with the step:

Steps 1 to 3 of a step commit are one durable writing transaction (from
the pending check to the intent's COMMIT): what the plan stores is written,
and made durable, with the intent or not at all.

1. **Plan.**  Under the workspace's commit lock, read the step's staged rows,
   expand deleted or replaced directories into the workspace paths below
   them, and capture each path's *before* state from the workspace (file
   contents go into the object store).  A state a mount daemon captured
   ahead (:func:`precapture`, at the path's first close-write) is used
   instead while the path's token is still the one it was captured with.
   A staged path whose workspace token
   differs from the token recorded when it was staged is a conflict: the
   commit is refused as a whole and the transaction rolled back.
   *Crash:* nothing of the commit; the workspace is OLD, the step open.
2. **Objects and new files first.**  Before-objects are stored
   (after-objects already were, at close-write).  Every new file, symlink,
   FIFO and hard link is made as a temporary file ``.stepfs/tmp/L<layer>-<seq>``
   (same filesystem as the workspace; a regular file is a spare inode from
   ``store.spares`` when one is on hand).  The regular files are then
   ``fsync``-ed together on a thread pool (``durable.start_fsync_all``: one
   journal commit for all of them instead of one each) *while* step 3
   records the intent; all have ended before step 4.  A failure here
   (``ENOSPC``, ``EDQUOT``, ``EIO`` on write, a failed ``fsync``) removes
   the temporary files and fails the commit with that errno
   (:class:`PublishFailed`, ``pending`` None): nothing in the workspace
   changed and the step stays open.  An fsync that fails after the intent
   was recorded first deletes the intent again (durably; it was never
   acted on), so the outcome is the same.
   *Crash:* leftover temporary files (recovery deletes them); OLD.
3. **Intent = the single commit point.**  One durable transaction
   (``synchronous=FULL``) inserts the layer with ``state='pending'``, its
   entries, the step it consumes and ``intent_sum``, a checksum over the
   entries and the step.  The step's staged rows stay until step 5.
   The intent does not need the new files on disk: the objects they are
   made from are durable with it, and recovery rewrites every new file.
   *Crash before it commits:* OLD, step open.  *After:* recovery rolls
   forward to NEW (whether or not the new files' fsyncs had ended).
4. **Switch.**  Remove what the layer removes (deepest first), create
   directories (shallowest first), ``rename`` each temporary file over its
   target, set directory owners, modes and attributes, then ``fsync`` the
   parent of every entry and every directory entry (each directory once,
   all together on the pool), on every run (a run that
   finishes a killed one finds removals, new directories and modes already
   done, maybe not yet durable).  A replaced or removed file with one link
   is first linked into ``.stepfs/retired/`` (``store.spares``), so the
   rename or unlink does not free its inode on the commit's path; it is
   freed after the switch (by the daemon's background thread, if any).  *Crash:* a mix of old and new paths (each
   path replaced atomically) that recovery completes to NEW.
5. **Done.**  One durable transaction sets ``state='committed'`` and deletes
   the consumed step's staged rows.  A commit runs its statements while the
   switch's directory fsyncs are still running, and COMMITs only once all
   of them ended (a failed one rolls it back: the layer stays pending).
   *Crash before it:* recovery publishes the layer again (idempotent) and
   then does this step.

The API follows the steps: ``with begin(ws, step) as c`` takes the commit
lock; ``c.publish()`` runs steps 1 to 4 and returns the layer's number;
``c.complete()`` runs step 5 (:class:`Commit`).  The lock is held from step
1 to the end of step 5.  A mount daemon answers its caller between the two
(every rename done, the directory fsyncs and step 5 still to come): past
the intent a crash recovers to the layer anyway, so the answer promises
nothing that is not on disk.  Until step 5 ends, the daemon writes no row
of the step (step 5 deletes the step's rows: it would take a later row with
it) and the commit lock keeps every other commit, recovery and
``Workspace.open`` out, so none of them sees the layer pending.  A failure
after the answer leaves the layer pending as below, and the daemon's mount
read-only with its message (``overlayfs.committing``).

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

Failures after the commit point (the fsyncgate rule).  A failed ``fsync``
(or rename, unlink, mkdir) in step 4 raises :class:`PublishFailed` naming
the layer, which stays ``pending``.  The failed call is never retried:
pages whose write-back failed may have been dropped, so a second ``fsync``
of the same file could "succeed" with the bytes not on disk.  The layer
becomes committed only through recovery, which rewrites every byte from the
store into new files and fsyncs those; until then history does not list it,
and a mount whose commit failed goes read-only (``overlayfs.view``).  If the
disk keeps failing, recovery keeps failing loudly and the layer stays
pending: it is never marked committed after a failed call.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field, replace

import xxhash
from sqlalchemy import bindparam, func, select, update

from stepfs.store import durable, refs, schema, staging, tokens, xattrs
from stepfs.store.contained import NODE_KINDS, kind_of, rdev_of, rdev_target
from stepfs.store.db import Prepared
from stepfs.store.errors import CommitConflict, NothingToCommit, PublishFailed, StepfsError, StoreUnavailable
from stepfs.store.layers import Entry, State, entries as load_entries, next_number
from stepfs.store.workspace import Workspace

L, E = schema.layers, schema.entries
log = logging.getLogger("stepfs.publish")

# The statements every commit runs, built once (building a Core statement
# costs more than SQLite takes to run it); the inserts go through
# ``db.Prepared`` (plain str, int and bytes values, every column given).
_LAYER_COLUMNS = ["number", "state", "kind", "created_ns", "message", "agent", "mount", "meta", "intent_sum", "step"]
_INSERT_LAYER = Prepared(L.insert(), _LAYER_COLUMNS)
_ENTRY_COLUMNS = [c.name for c in E.columns]
_INSERT_ENTRIES = Prepared(E.insert(), _ENTRY_COLUMNS)
_MARK_COMMITTED = Prepared(update(L).where(L.c.number == bindparam("n")).values(state=bindparam("state")))
_CONSUME_STEP = Prepared(schema.staged.delete().where(schema.staged.c.step == bindparam("s")))
_PENDING = select(L.c.number, L.c.intent_sum, L.c.step).where(L.c.state == "pending").order_by(L.c.number)
_FIRST_IN_STATE = Prepared(select(func.min(L.c.number)).where(L.c.state == bindparam("state")))

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
    #: Entries whose path goes through a symlink or a non-directory in the
    #: workspace (:func:`_blocked`): left alone, recorded as outside changes.
    outside: list[Entry] = field(default_factory=list)


def _lstat(ws: Workspace, path: bytes) -> os.stat_result | None:
    """``lstat`` inside the contained root; None if ``path`` is not in the
    tree (see ``Root.lstat_or_none``): the overlay's tokens treat such a path
    as absent too."""
    return ws.root.lstat_or_none(path)


#: Files smaller than this are captured with one read.
_ONE_READ = 256 << 10


def capture(ws: Workspace, conn, path: bytes, st: os.stat_result | None = None) -> _Before:
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


def _walk(ws: Workspace, path: bytes) -> list[bytes]:
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


def precapture(ws: Workspace, conn, path: bytes) -> _Before | None:
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


def _before_of(ws: Workspace, conn, path: bytes, known: dict[bytes, _Before] | None) -> _Before:
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


def plan_step(ws: Workspace, rows: list[staging.StagedRow], overwrite: set[bytes] = frozenset(), conn=None,
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
    for row in rows:
        after[row.path] = (_after_of(row), row.mtime_ns if row.kind in ("file", "symlink") else None, row.base)
        hides_below = row.kind == "whiteout" or (row.kind == "dir" and row.opaque) or row.kind in ("file", "symlink")
        if hides_below:
            for child in _walk(ws, row.path):
                if child not in staged:
                    after.setdefault(child, (State(None), None, None))
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
    for path in sorted(after):
        state, mtime, base = after[path]
        before = _before_of(ws, conn, path, known)
        if base is not None and before.token != base and path not in overwrite:
            plan.conflicts.append(path)
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
    blocked = _blocked(ws, plan.entries)
    if blocked:
        plan.outside = [e for e in plan.entries if e.path in blocked]
        plan.entries = [e for e in plan.entries if e.path not in blocked]
    return plan


def _blocked(ws: Workspace, entries: list[Entry]) -> dict[bytes, str]:
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


def _same_inode(ws: Workspace, a: bytes, b: bytes) -> bool:
    try:
        sa, sb = ws.root.lstat(a), ws.root.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def intent_checksum(entries: list[Entry], step: int | None = None) -> str:
    """The checksum stored with an intent: any torn, truncated or altered
    intent (an entry missing, changed or added, another step) fails it.
    Without a step it is the format-1 checksum of the entries alone."""
    h = xxhash.xxh3_128()
    for e in sorted(entries, key=lambda e: e.path):
        parts = (e.path, *_state_parts(e.before), *_state_parts(e.after), str(e.after_mtime_ns).encode())
        if e.after_link is not None:
            parts += (b"link", e.after_link)
        for part in parts:
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    if step is not None:
        for part in (b"step", str(step).encode()):
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    return h.hexdigest()


def _state_parts(s: State) -> tuple[bytes, ...]:
    return (str(s.kind).encode(), str(s.mode).encode(), str(s.oid).encode(),
            s.target if s.target is not None else b"\0", str(s.uid).encode(), str(s.gid).encode(),
            s.xattrs if s.xattrs is not None else b"\0")


def _entry_row(layer: int, e: Entry) -> dict:
    return {
        "layer": layer, "path": e.path,
        "before_kind": e.before.kind, "before_mode": e.before.mode,
        "before_oid": e.before.oid, "before_target": e.before.target,
        "after_kind": e.after.kind, "after_mode": e.after.mode,
        "after_oid": e.after.oid, "after_target": e.after.target,
        "after_mtime_ns": e.after_mtime_ns,
        "before_uid": e.before.uid, "before_gid": e.before.gid, "before_xattrs": e.before.xattrs,
        "after_uid": e.after.uid, "after_gid": e.after.gid, "after_xattrs": e.after.xattrs,
        "after_link": e.after_link,
    }


class Commit:
    """One layer's commit in two phases, on one hold of the commit lock.

    ``with begin(ws, step, ...) as c`` (a step) or ``with Commit(ws,
    entries=..., ...) as c`` (a layer the caller planned, under its own
    hold of the lock: rollback, an empty layer), then:

    1. ``number = c.publish()``: steps 1 to 4 (module docstring): plan,
       new files and intent durable, every rename done.  From its return a
       crash recovers to the layer, so a mount daemon may answer its
       caller now.
    2. ``c.start_completion()`` (optional): begin the switch's last
       directory fsyncs, once the answer is out (started before, the
       pool's threads took the GIL from it); the caller's own bookkeeping
       then runs while they do.
    3. ``c.complete()``: step 5, the ``committed`` record; its COMMIT
       waits for those fsyncs.

    Leaving the block runs step 5 if the layer was published and
    :meth:`complete` was not called (a failure between the phases, say
    of the caller's answer: the layer is on disk all the same); a failure
    of step 5 is raised over the block's own.  Then the lock is released.
    Raises :class:`NothingToCommit`, :class:`CommitConflict`,
    :class:`PublishFailed` and :class:`StoreUnavailable`; the module
    docstring says what each leaves behind."""

    def __init__(self, ws: Workspace, *, step: int | None = None, entries: list[Entry] | None = None,
                 kind: str = "step", message: str = "", agent: str = "", mount: str = "",
                 meta: dict | None = None, consume_step: int | None = None, allow_empty: bool = False,
                 overwrite: set[bytes] = frozenset(), known: dict[bytes, _Before] | None = None,
                 locked: bool = False):
        """``step``: plan the open step ``step`` (``allow_empty``,
        ``overwrite``, ``known`` as for :func:`begin`); else ``entries`` is
        the layer and ``consume_step`` the step whose rows it consumes.
        ``locked``: the caller holds the commit lock already."""
        self.ws = ws
        self.step = step
        self.kind, self.message, self.agent, self.mount, self.meta = kind, message, agent, mount, meta
        self.consume_step = step if step is not None else consume_step
        self.allow_empty, self.overwrite, self.known = allow_empty, overwrite, known
        self.entries = entries if entries is not None else []
        self.number: int | None = None
        #: staged entries below something that is no longer a directory
        #: (:func:`_blocked`): left alone, recorded as outside changes.
        self.outside: list[Entry] = []
        self._locked = locked
        self._held: list = []
        self._dir_sync: _DirSync | None = None  # set once every rename is done
        self._completed = False

    def __enter__(self) -> "Commit":
        if not self._locked:
            for cm in (self.ws.commit_lock(), self.ws.spares.pausing()):
                cm.__enter__()
                self._held.append(cm)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._dir_sync is not None and not self._completed:
                self.complete()
        finally:
            while self._held:
                self._held.pop().__exit__(None, None, None)
        return False

    def publish(self) -> int:
        """Steps 1 to 4; returns the layer's number."""
        ws = self.ws
        while True:
            if self.step is not None:
                _remove_temps(ws)  # what a commit killed before its intent left (recovery would)
            try:
                prepped = self._write_intent()
            except _PendingFound:
                _recover_locked(ws)  # may consume this step's rows: the plan reads them again
                continue
            break
        if self.number is None:
            if self.outside:
                raise NothingToCommit(
                    f"nothing was committed: {len(self.outside)} staged path(s) lie below something that is no "
                    f"longer a directory in the workspace ({os.fsdecode(self.outside[0].path)}, ...); their "
                    f"versions are kept as 'outside-change' conflicts ('stepfs status' lists them)."
                )
            raise NothingToCommit(
                "nothing to commit: the open step has no changes against the workspace "
                "(use --allow-empty to record an empty layer anyway)."
            )
        # Past the commit point: from here a failure leaves the layer pending.
        try:
            self._dir_sync = _switch(ws, self.number, self.entries, wait=False, prepped=prepped)
        except OSError as exc:
            raise _pending_failure(self.number, exc) from None
        return self.number

    def start_completion(self) -> None:
        """Begin the directory fsyncs step 5 waits for (after the answer)."""
        if self._dir_sync is not None:
            self._dir_sync.start()

    def complete(self) -> None:
        """Step 5: the layer is committed and its step's rows consumed."""
        if self._dir_sync is None or self._completed:
            return
        self._completed = True
        try:
            _complete(self.ws, self.number, self.consume_step, self._dir_sync)
        except OSError as exc:
            raise _pending_failure(self.number, exc) from None
        finally:
            self._dir_sync.close()
        from stepfs.store import delta  # noqa: PLC0415  (delta imports objects; publish stays light)

        delta.after_commit(self.ws, self.number)  # format 7: deltas when the layer is written

    def _plan(self, conn) -> bool:
        """Step 1 at the start of the intent's transaction: sets
        ``entries`` and ``number``; False for "nothing to record" (the
        transaction then commits the no-op rows' removal)."""
        if self.step is None:
            if self.number is None:
                self.number = next_number(conn)
            return True
        step = self.step
        # Everything from the pending check to the intent is one writing
        # transaction: nobody else can add a layer or an intent while we
        # hold the commit lock, and the before objects become durable with
        # the intent.
        if _FIRST_IN_STATE.execute(conn, {"state": "pending"})[0][0] is not None:
            raise _PendingFound()
        rows = staging.load(conn, step)
        if any(r.scratch is not None for r in rows):
            refs.import_refs(self.ws, conn, step)  # files staged by reference become objects first
            rows = staging.load(conn, step)
        number = next_number(conn)  # numbers are only allocated under the commit lock
        plan = plan_step(self.ws, rows, self.overwrite, conn, self.known)
        if plan.conflicts:
            names = ", ".join(os.fsdecode(p) for p in plan.conflicts[:10])
            more = f" and {len(plan.conflicts) - 10} more" if len(plan.conflicts) > 10 else ""
            raise CommitConflict(
                f"{len(plan.conflicts)} path(s) changed in the workspace since this step staged them "
                f"({names}{more}); nothing was written: discard them with 'stepfs discard' or commit over "
                f"them with 'stepfs step --overwrite PATH'.",
                [os.fsdecode(p) for p in plan.conflicts],
            )
        self.outside = plan.outside  # a plan run again after recovery starts over
        if plan.outside:
            for e in plan.outside:
                log.warning("step leaves %s alone: its parent is not a directory in the workspace; its "
                            "staged version is kept as an 'outside-change' conflict", os.fsdecode(e.path))
            _record_outside(self.ws, conn, plan.outside, self.mount, self.agent)
        if not plan.entries and not self.allow_empty:
            if rows:  # they all equal the workspace (or are kept as conflicts): drop them with this transaction
                _CONSUME_STEP.execute(conn, {"s": step})
            return False
        self.entries, self.number = plan.entries, number
        return True

    def _write_intent(self) -> _Prepped | None:
        """Steps 1 to 3: plan, new files, intent; returns what the switch
        was prepared with meanwhile.  ``number`` stays None if there is
        nothing to record."""
        ws = self.ws
        # The new files are fsynced while the intent is committed: neither
        # needs the other (recovery rewrites every new file from the store),
        # and both are done before the first rename.  The fsyncs start once
        # the intent's rows are in, just before its COMMIT syncs the WAL.
        syncing: durable.Syncing | None = None
        prep = None  # the switch's preparation, run while the intent commits
        unsynced: list[int] = []
        try:
            try:
                # No WAL checkpoint at the intent's COMMIT: step 5's does it.
                with ws.db.write(durable=True, checkpoint=False) as conn:
                    if not self._plan(conn):
                        return None
                    number, entries = self.number, self.entries
                    try:
                        unsynced = _prepare(ws, number, entries, conn)
                    except StepfsError:  # a corrupt object, an unreadable store: before the commit point
                        _remove_temps(ws)
                        raise
                    except OSError as exc:
                        _remove_temps(ws)
                        raise _prepare_failure(exc) from None
                    _INSERT_LAYER.executemany(conn, [dict(
                        number=number, state="pending", kind=self.kind, created_ns=time.time_ns(),
                        message=self.message, agent=self.agent, mount=self.mount,
                        meta=json.dumps(self.meta or {}, sort_keys=True),
                        intent_sum=intent_checksum(entries, self.consume_step), step=self.consume_step,
                    )])
                    _INSERT_ENTRIES.executemany(conn, [_entry_row(number, e) for e in entries])
                    syncing = durable.start_fsync_all(unsynced)
                    prep = durable.run_meanwhile(_switch_prep, ws, entries)
            except BaseException as exc:
                if syncing is not None:
                    syncing.abandon()
                if prep is not None:
                    _close_prepped(_prepped(prep))
                if isinstance(exc, StoreUnavailable):
                    _remove_temps(ws)
                raise
            try:
                syncing.wait()
            except OSError as exc:
                # A new file did not reach the disk: take the intent back, so
                # the commit fails as a whole with nothing changed.
                _close_prepped(_prepped(prep))
                _withdraw_intent(ws, number, exc)
                _remove_temps(ws)
                raise _prepare_failure(exc) from None
        finally:
            for fd in unsynced:
                os.close(fd)
        return _prepped(prep)


def begin(ws: Workspace, step: int, *, message: str = "", agent: str = "", mount: str = "",
          meta: dict | None = None, allow_empty: bool = False, overwrite: set[bytes] = frozenset(),
          known: dict[bytes, _Before] | None = None) -> Commit:
    """The commit of open step ``step`` as the next layer (a
    :class:`Commit`: use it as a context manager; it takes the commit
    lock).  ``known``: before states captured ahead (:func:`precapture`),
    reused for paths whose token has not changed since.  A mount daemon
    writes no row of ``step`` until :meth:`Commit.complete` has ended (step
    5 consumes the step's rows: it would take a later row with it).

    :meth:`Commit.publish` raises :class:`NothingToCommit` (nothing staged,
    or everything staged equals the workspace already; the no-op rows are
    dropped) and :class:`CommitConflict` (nothing written, step left open)."""
    return Commit(ws, step=step, message=message, agent=agent, mount=mount, meta=meta,
                  allow_empty=allow_empty, overwrite=overwrite, known=known)


def commit_step(ws: Workspace, step: int, **options) -> int:
    """Commit open step ``step`` (options as for :func:`begin`); returns
    once the layer is committed."""
    with begin(ws, step, **options) as c:
        number = c.publish()
        c.complete()
        return number


def write_layer(ws: Workspace, entries: list[Entry], *, kind: str, message: str, agent: str, mount: str,
                meta: dict | None, consume_step: int | None, number: int | None = None) -> int:
    """Steps 2 to 5 for a layer the caller planned (``entries``; the layer
    consumes ``consume_step``'s rows), under the caller's hold of the
    commit lock.  ``number``: the layer's number if the caller already read
    ``next_number`` under this same hold of the lock."""
    with Commit(ws, entries=entries, kind=kind, message=message, agent=agent, mount=mount, meta=meta,
                consume_step=consume_step, locked=True) as c:
        c.number = number
        published = c.publish()
        c.complete()
        return published


def _prepped(prep) -> _Prepped | None:
    """The outcome of :func:`_switch_prep` run on the pool: None (the
    switch does everything itself) if it failed in an unforeseen way."""
    try:
        return prep.result()
    except Exception:
        log.exception("preparing the switch failed; it does all of it itself")
        return None


def _close_prepped(prepped: _Prepped | None) -> None:
    if prepped is not None:
        prepped.close()


def _prepare_failure(exc: OSError) -> PublishFailed:
    return PublishFailed(
        f"could not write the step's new files ({_why(exc)}); nothing in the workspace was changed and "
        f"the step is still open: fix the cause and run 'stepfs step' again.", exc.errno,
    )


def _withdraw_intent(ws: Workspace, number: int, cause: OSError) -> None:
    """Delete the intent of layer ``number`` (nothing of it was published:
    no rename happened), durably, so it is as if it was never recorded.
    If that fails too, the layer stays pending and recovery publishes it
    (rewriting every new file from the store)."""
    try:
        with ws.db.write(durable=True) as conn:
            conn.execute(E.delete().where(E.c.layer == number))
            conn.execute(L.delete().where((L.c.number == number) & (L.c.state == "pending")))
    except StoreUnavailable:
        raise _pending_failure(number, cause) from None


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f": {os.fsdecode(exc.filename)}" if exc.filename else "")


def _pending_failure(number: int, exc: OSError) -> PublishFailed:
    return PublishFailed(
        f"layer {number} could not be written into the workspace ({_why(exc)}); it stays pending and is "
        f"rewritten from the store by the next stepfs command or mount once the cause is fixed.",
        exc.errno, number,
    )


def _complete(ws: Workspace, number: int, step: int | None, dir_sync: _DirSync | None = None,
              left: list[Entry] = ()) -> None:
    """Step 5: the layer is committed and its step's staged rows consumed.

    ``dir_sync``: the switch's last directory fsyncs, still running; the
    statements are run meanwhile and the COMMIT only once every one of them
    has ended (SQLite writes nothing of a transaction to the WAL as
    committed before its COMMIT).  If one failed, the transaction is rolled
    back and the ``OSError`` raised: the layer stays pending.

    ``left``: entries recovery did not publish (:func:`classify`), each
    recorded in the same transaction as an ``outside-change`` conflict of
    the layer's mount holding the layer's after state (what ``stepfs
    status`` lists and ``MOUNT/.stepfs/conflicts/PATH`` shows)."""
    with ws.db.write(durable=True) as conn:
        _MARK_COMMITTED.execute(conn, {"n": number, "state": "committed"})
        if step is not None:
            _CONSUME_STEP.execute(conn, {"s": step})
        if left:
            mount, agent = conn.execute(select(L.c.mount, L.c.agent).where(L.c.number == number)).one()
            _record_outside(ws, conn, left, mount, agent)
        if dir_sync is not None:
            dir_sync.start().wait()


def _record_outside(ws: Workspace, conn, entries: list[Entry], mount: str, agent: str) -> None:
    """Each entry as an ``outside-change`` conflict of ``mount`` holding
    its after state (what ``stepfs status`` lists)."""
    now = time.time_ns()
    conn.execute(schema.conflicts.insert(), [dict(
        created_ns=now, path=e.path, mount=mount, agent=agent, reason=OUTSIDE_CHANGE,
        oid=e.after.oid if e.after.kind == "file" else None, mode=e.after.mode, token_mine="",
        token_theirs=_token_now(ws, e.path),
    ) for e in entries])


def _token_now(ws: Workspace, path: bytes) -> str:
    st = _lstat(ws, path)
    if st is None:
        return tokens.ABSENT
    return tokens.from_stat(st, ws.root.readlink(path) if stat_mod.S_ISLNK(st.st_mode) else None)


def import_refs(ws: Workspace, step: int) -> dict[str, str]:
    """Take the files ``step`` staged by reference into the object store
    (``store/refs.py``), in one transaction: before the plan, so the
    protocol below only ever sees rows that name objects.  A crash here is
    before the commit point: the rows keep their references or name the
    new objects, and the workspace is OLD.  Returns ``{scratch name: oid}``."""
    with ws.db.read() as conn:
        if not refs.referenced(conn, step):
            return {}
    with ws.db.write() as conn:
        return refs.import_refs(ws, conn, step)


class _PendingFound(Exception):
    """A pending layer turned up at the start of a commit: recover first."""


# -- publishing -----------------------------------------------------------------


def _depth(path: bytes) -> int:
    return path.count(b"/")


def _current_kind(ws: Workspace, path: bytes) -> str | None:
    st = _lstat(ws, path)
    return None if st is None else kind_of(st.st_mode)


def _temp_name(number: int, seq: int) -> bytes:
    return f"L{number}-{seq}".encode()


#: Temporary files written before their fsyncs are issued together (and
#: descriptors held open at once): bounded so a huge layer cannot run out
#: of file descriptors.
SYNC_BATCH = 256


def _prepare(ws: Workspace, number: int, entries: list[Entry], conn=None, keep: set[bytes] = frozenset()) -> list[int]:
    """Step 2: every new file, symlink, FIFO, device node, socket and hard
    link as a temporary file in ``.stepfs/tmp``.  Returns the open descriptors of the regular
    files not fsynced yet; the caller fsyncs them (``durable.fsync_all`` or
    ``start_fsync_all``) before any of them is renamed into place, and
    closes them.  Files beyond a batch of :data:`SYNC_BATCH` are fsynced
    here, together, a batch at a time (one journal commit per batch instead
    of one per file, and a bounded number of open descriptors).

    A name depends only on the entry's position, so a re-run replaces the
    files of an interrupted one.  A hard link is made to the temporary file
    of the name it links to when that is in this layer, else to the
    workspace path (unchanged by the layer).  ``conn``: a transaction of
    the caller to read the objects in (else one of its own).  ``keep``:
    paths recovery leaves alone (:func:`classify`): no temporary file, and
    a hard link of one is made as a copy of its after state (the path
    itself holds something else).  Raises ``OSError``."""
    if conn is None:
        with ws.db.read() as own:
            return _prepare(ws, number, entries, own, keep)
    root = ws.root
    seq_of = {e.path: seq for seq, e in enumerate(entries)}
    tmp_fd = os.open(ws.tmp_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    unsynced: list[int] = []

    def sync_batch() -> None:
        try:
            durable.fsync_all(unsynced)
        finally:
            for fd in unsynced:
                os.close(fd)
            unsynced.clear()

    try:
        # Links last: the files they link to must exist first.
        for seq in sorted(range(len(entries)), key=lambda i: entries[i].after_link is not None):
            e = entries[seq]
            if e.after.kind not in LEAF_KINDS or e.path in keep:
                continue
            tmp_name = _temp_name(number, seq)
            try:
                os.unlink(tmp_name, dir_fd=tmp_fd)
            except FileNotFoundError:
                pass
            owner = _owner_for(ws, e.path, e.after)
            if e.after_link is not None and e.after_link not in keep:
                if e.after_link in seq_of:
                    os.link(_temp_name(number, seq_of[e.after_link]), tmp_name, src_dir_fd=tmp_fd,
                            dst_dir_fd=tmp_fd, follow_symlinks=False)
                else:
                    sfd, sname = root.parent(e.after_link)
                    try:
                        os.link(sname, tmp_name, src_dir_fd=sfd, dst_dir_fd=tmp_fd, follow_symlinks=False)
                    finally:
                        os.close(sfd)
            elif e.after.kind == "file":
                # A spare inode when there is one (``store.spares``: creating
                # is the dearest call here on some filesystems), else a new file.
                fd = ws.spares.take(tmp_name, tmp_fd)
                if fd is None:
                    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600,
                                 dir_fd=tmp_fd)
                unsynced.append(fd)
                ws.objects.write_to_fd(conn, e.after.oid, fd)
                if owner is not None:
                    os.fchown(fd, *owner)
                os.fchmod(fd, e.after.mode)
                if e.after.xattrs:
                    xattrs.apply_fd(fd, xattrs.decode(e.after.xattrs))
                if e.after_mtime_ns:
                    os.utime(fd, ns=(e.after_mtime_ns, e.after_mtime_ns))
                if len(unsynced) >= SYNC_BATCH:
                    sync_batch()
            elif e.after.kind in NODE_KINDS:
                # A socket too is an S_IFSOCK node (what bind() leaves behind);
                # a device needs CAP_MKNOD, as it did to be made in the mount.
                os.mknod(tmp_name, NODE_KINDS[e.after.kind] | 0o600, rdev_of(e.after.kind, e.after.target),
                         dir_fd=tmp_fd)
                if owner is not None:
                    os.chown(tmp_name, *owner, dir_fd=tmp_fd, follow_symlinks=False)
                os.chmod(tmp_name, e.after.mode, dir_fd=tmp_fd)
            else:
                durable.symlink(e.after.target, tmp_name, dir_fd=tmp_fd)
                if owner is not None:
                    os.chown(tmp_name, *owner, dir_fd=tmp_fd, follow_symlinks=False)
    except BaseException:
        for fd in unsynced:  # never fsynced: the commit fails anyway
            os.close(fd)
        raise
    finally:
        os.close(tmp_fd)
    return unsynced


def _remove_temps(ws: Workspace) -> None:
    """Delete every temporary file (only commits use ``.stepfs/tmp``, and the
    caller holds the commit lock)."""
    for name in os.listdir(ws.tmp_dir):
        try:
            os.unlink(os.path.join(ws.tmp_dir, name))
        except (FileNotFoundError, IsADirectoryError):
            pass


class _Prepped:
    """What :func:`_switch_prep` found and opened for a layer of files
    only (no directory made, removed or replaced): each distinct parent
    directory opened once (``O_RDONLY``: the renames' ``dir_fd`` and the
    directory fsyncs), and each entry's current kind."""

    def __init__(self) -> None:
        self.parents: dict[bytes, int] = {}
        self.kinds: dict[bytes, str | None] = {}

    def close(self) -> None:
        for fd in self.parents.values():
            os.close(fd)
        self.parents.clear()


def _split(path: bytes) -> tuple[bytes, bytes]:
    parent, _, name = path.rpartition(b"/")
    return parent or b".", name


def _switch_prep(ws: Workspace, entries: list[Entry]) -> _Prepped | None:
    """The part of :func:`_switch` that changes nothing in the workspace,
    done while the intent is being committed (a commit runs it on the fsync
    pool meanwhile): open every parent once and look at what each path is
    now.  Retiring is left to the switch: a second name moves the file's
    ctime, so its token, and a commit that fails before its commit point
    must leave every token as it was (a retry would see a conflict).
    None for a layer that makes, removes or replaces a
    directory, or when anything here fails: :func:`_switch` then does all
    of it itself, in its own order."""
    if any(e.after.kind == "dir" for e in entries):
        return None
    prepped = _Prepped()
    try:
        for e in entries:
            parent, name = _split(e.path)
            pfd = prepped.parents.get(parent)
            if pfd is None:
                pfd = prepped.parents[parent] = ws.root.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                kind = kind_of(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                kind = None
            if kind == "dir":
                prepped.close()
                return None
            prepped.kinds[e.path] = kind
    except OSError as exc:
        log.debug("switch not prepared ahead (%s); it does all of it itself", exc)
        prepped.close()
        return None
    return prepped


#: The mode the switch makes a new directory with; its own mode is set last.
_NEW_DIR_MODE = 0o700


def _switch(ws: Workspace, number: int, entries: list[Entry], wait: bool = True,
            prepped: _Prepped | None = None, keep: set[bytes] = frozenset()) -> _DirSync | None:
    """Step 4: make the workspace match every entry's after state, using the
    temporary files of :func:`_prepare`.

    Idempotent: running it again (after :func:`_prepare`) following a crash
    at any point completes the same result.  Raises ``OSError`` on any
    failure, a failed fsync included, which is never retried here.

    ``wait=False``: the last batch of directory fsyncs is returned (a
    :class:`_DirSync`, begun by its ``start``) instead of done; the caller
    MUST wait for it before it marks the layer committed, and close it.

    ``prepped``: what :func:`_switch_prep` did ahead for a layer of files
    only (taken over: its descriptors are closed here or handed to the
    result): the same durable calls run in the same order on the parents
    it opened and the kinds it found.

    ``keep``: paths left as they are (recovery: they hold something the
    layer must not overwrite, :func:`classify`); the directories that hold
    them are fsynced all the same.
    """
    root = ws.root
    try:
        # Every parent of a touched path, and every directory whose mode the
        # layer sets, is fsynced at the end, whether or not this run changed
        # it: after a crash the re-run finds a removal or chmod already done
        # (in the page cache, maybe not on disk) and must still make it
        # durable before the layer is marked committed.
        dirs_to_sync: set[bytes] = {_split(e.path)[0] for e in entries}
        dirs_to_sync.update(e.path for e in entries if e.after.kind == "dir")
        if keep:
            entries_all, entries = entries, [e for e in entries if e.path not in keep]
            seq_of = {id(e): seq for seq, e in enumerate(entries_all)}  # temporary names follow the whole list
        else:
            seq_of = None

        def parent(path: bytes) -> tuple[int, bytes, bool]:
            """``(directory fd, name, whether the caller closes the fd)``.
            Without ``prepped`` each is opened when needed: a directory of
            the layer may have been made or removed since."""
            if prepped is not None:
                parent_path, name = _split(path)
                return prepped.parents[parent_path], name, False
            pfd, name = root.parent(path)
            return pfd, name, True

        def kind_now(path: bytes) -> str | None:
            return prepped.kinds[path] if prepped is not None else _current_kind(ws, path)

        # 1. removals, deepest first
        for e in sorted(entries, key=lambda e: -_depth(e.path)):
            cur = kind_now(e.path)
            if cur is None or cur == e.after.kind:
                continue
            pfd, name, owned = parent(e.path)
            try:
                if cur == "dir":
                    durable.rmdir(name, dir_fd=pfd)
                else:
                    ws.spares.retire(name, pfd)  # freed after the commit, not in the unlink
                    durable.unlink(name, dir_fd=pfd)
            finally:
                if owned:
                    os.close(pfd)

        # 2. new directories, shallowest first (none in a prepared layer)
        for e in sorted((e for e in entries if e.after.kind == "dir"), key=lambda e: _depth(e.path)):
            if _current_kind(ws, e.path) == "dir":
                continue
            pfd, name = root.parent(e.path)
            try:
                durable.mkdir(name, _NEW_DIR_MODE, dir_fd=pfd)
            finally:
                os.close(pfd)

        # 3. files, symlinks, FIFOs, devices, sockets and links: each
        # temporary file renamed over its path
        tmp_fd = os.open(ws.tmp_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for seq, e in enumerate(entries):
                if e.after.kind not in LEAF_KINDS:
                    continue
                if seq_of is not None:
                    seq = seq_of[id(e)]
                pfd, name, owned = parent(e.path)
                try:
                    # The replaced inode is freed after the commit, not inside
                    # the rename (``store.spares``: freeing is the dearest part).
                    ws.spares.retire(name, pfd)
                    durable.rename(_temp_name(number, seq), name, src_dir_fd=tmp_fd, dst_dir_fd=pfd)
                finally:
                    if owned:
                        os.close(pfd)
        finally:
            os.close(tmp_fd)
            ws.spares.release()

        # 4. directory metadata (last, so a read-only directory is filled first)
        for e in entries:
            if e.after.kind == "dir":
                fd = root.open(e.path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    st = os.fstat(fd)
                    owner = _owner_for(ws, e.path, e.after)
                    if owner is not None and (st.st_uid, st.st_gid) != owner:
                        os.fchown(fd, *owner)
                    if stat_mod.S_IMODE(st.st_mode) != e.after.mode:
                        os.fchmod(fd, e.after.mode)
                    xattrs.apply_fd(fd, xattrs.decode(e.after.xattrs))
                finally:
                    os.close(fd)

        # 5. make every directory entry and metadata change durable: each
        # distinct directory once, all of a batch together (one journal
        # commit), a prepared parent on the descriptor it was opened with
        dir_fds: list[int] = []
        try:
            for d in sorted(dirs_to_sync):
                fd = prepped.parents.pop(d, None) if prepped is not None else None
                if fd is None:
                    try:
                        fd = root.open(d, os.O_RDONLY | os.O_DIRECTORY)
                    except OSError as exc:
                        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            continue  # removed, or replaced by a file or symlink, in this same layer
                        raise
                dir_fds.append(fd)
                if len(dir_fds) >= SYNC_BATCH:  # bounded: a big layer never holds every directory open
                    batch, dir_fds = dir_fds, []
                    _sync_closing(batch)
            last, dir_fds = dir_fds, []
        finally:
            for fd in dir_fds:
                os.close(fd)
        return _sync_dirs(last, wait)
    finally:
        if prepped is not None:
            prepped.close()


def _sync_closing(fds: list[int]) -> None:
    """fsync ``fds`` together, then close them (closed on failure too)."""
    try:
        durable.fsync_all(fds)
    finally:
        for fd in fds:
            os.close(fd)


def _sync_dirs(fds: list[int], wait: bool) -> _DirSync | None:
    """Step 4's directory fsyncs, on descriptors this call owns: every
    batch of :data:`SYNC_BATCH` but the last is fsynced and closed; the
    last is fsynced and closed too (``wait``) or returned still syncing as
    a :class:`_DirSync` (not yet begun) for :func:`_complete` to wait for.  Raises the
    first failed fsync's ``OSError``; every descriptor not handed over is
    closed either way."""
    try:
        while len(fds) > SYNC_BATCH:
            batch, fds = fds[:SYNC_BATCH], fds[SYNC_BATCH:]
            _sync_closing(batch)
        if not wait:
            last, fds = _DirSync(fds), []
            return last
        batch, fds = fds, []
        _sync_closing(batch)
        return None
    finally:
        for fd in fds:
            os.close(fd)


class _DirSync:
    """The last batch of a switch's directory fsyncs, not yet waited for:
    begun on the pool (``durable.start_fsync_all``) by :meth:`start`, once
    a daemon's answer is out (:func:`write_layer`), and waited for by the
    completion before its COMMIT (:func:`_complete`), which builds its
    transaction meanwhile.  Owns the descriptors; :meth:`close` once done."""

    def __init__(self, fds: list[int]):
        self.fds = fds
        #: ``.wait()``: every fsync has ended; raises the first failure
        #: (never retried).  None until :meth:`start`.
        self.syncing: durable.Syncing | None = None

    def start(self) -> durable.Syncing:
        if self.syncing is None:
            self.syncing = durable.start_fsync_all(self.fds)
        return self.syncing

    def close(self) -> None:
        if self.syncing is not None:
            self.syncing.abandon()  # nothing left to wait for once waited
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def apply_entries(ws: Workspace, number: int, entries: list[Entry], left: dict[bytes, str] | None = None) -> None:
    """Steps 2 and 4 together: publish a layer whose intent is recorded
    (recovery).  Idempotent.  ``left`` (:func:`classify`): paths not
    touched (the directories holding them are fsynced all the same).
    Raises ``OSError``; the layer then stays pending."""
    keep = set(left or ())
    fds = _prepare(ws, number, entries, keep=keep)
    try:
        durable.fsync_all(fds)
    finally:
        for fd in fds:
            os.close(fd)
    _switch(ws, number, entries, keep=keep)


def _owner_for(ws: Workspace, path: bytes, state: State | None = None) -> tuple[int, int] | None:
    """The owner to give a published path when we run as root: the one the
    view recorded, else that of the file being replaced or of the directory
    a new file lands in, so a commit never hands a user's files to root."""
    if os.geteuid() != 0:
        return None
    if state is not None and state.uid is not None and state.gid is not None:
        return state.uid, state.gid
    for candidate in (path, path.rpartition(b"/")[0] or b"."):
        st = _lstat(ws, candidate)
        if st is not None:
            return st.st_uid, st.st_gid
    return None


# -- recovery -----------------------------------------------------------------


def recover(ws: Workspace) -> list[int]:
    """Finish or void every pending layer; returns the numbers rolled forward."""
    with ws.commit_lock():
        return _recover_locked(ws)


def record_empty(ws: Workspace, *, message: str = "", meta: dict | None = None) -> int:
    """Record an empty step layer (``step --allow-empty`` with nothing
    staged anywhere).  Like every commit, it first finishes or voids any
    pending layer under the same hold of the commit lock, so its number can
    never overtake an intent that recovery would still roll forward."""
    with ws.commit_lock():
        _recover_locked(ws)
        return write_layer(ws, [], kind="step", message=message, agent="", mount="", meta=meta, consume_step=None)


def _recover_locked(ws: Workspace) -> list[int]:
    with ws.db.read() as conn:
        pending = conn.execute(_PENDING).all()
    done = []
    for number, checksum, step in pending:
        with ws.db.read() as conn:
            entries = load_entries(conn, number)
        if intent_checksum(entries, step) != checksum:
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


#: ``conflicts.reason`` of a path recovery left alone (see :func:`classify`).
OUTSIDE_CHANGE = "outside-change"


def classify(ws: Workspace, conn, entries: list[Entry]) -> dict[bytes, str]:
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
        if _holds(ws, conn, e.path, st, e.before):
            if kind == "dir" and e.after.kind != "dir":
                strays = [name for name, _k, _i in ws.root.listdir(e.path)
                          if _child(e.path, name) not in paths or _child(e.path, name) in left]
                if strays:
                    left[e.path] = (f"it is a directory the layer removes, and holds {len(strays)} name(s) the "
                                    f"layer does not remove ({os.fsdecode(sorted(strays)[0])}, ...)")
            continue  # published as in any run
        if _holds(ws, conn, e.path, st, e.after):
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


def _holds(ws: Workspace, conn, path: bytes, st: os.stat_result | None, s: State) -> bool:
    """Whether the workspace path (``st``: its ``lstat``, None if absent)
    is in state ``s`` by kind, mode and content."""
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
        fd = ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return ws.objects.holds(conn, s.oid, fd)
        finally:
            os.close(fd)
    return kind == "dir" or rdev_target(kind, st.st_rdev) == s.target
