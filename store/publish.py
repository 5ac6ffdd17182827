"""Atomic publish of a step into the workspace, and crash recovery.

Commit protocol (the order is the whole point; FORMAT.md repeats it):

1. **Plan.**  Under the workspace's commit lock, read the step's staged rows,
   expand deleted or replaced directories into the workspace paths below
   them, and capture each path's *before* state from the workspace (file
   contents go into the object store).  A staged path whose workspace token
   differs from the token recorded when it was staged is a conflict: the
   commit is refused as a whole and nothing is written.
2. **Objects first.**  Before-objects are stored (after-objects already were,
   at close-write).  A crash here leaves only unreferenced objects.
3. **Intent = commit point.**  One durable transaction inserts the layer with
   ``state='pending'``, its entries, and the checksum of the entries, and
   removes the step's staged rows.  Before it commits, a crash leaves the old
   workspace and the open step intact; after it, recovery rolls forward.
4. **Publish.**  Remove what the layer removes (deepest first), create
   directories (shallowest first), write each new file or symlink to a
   temporary file in ``.stepfs/tmp`` (same filesystem), ``fsync`` it, and
   ``rename`` it over the target; then set directory modes and ``fsync``
   every touched directory.  A crash here leaves a mix of old and new paths
   that recovery completes to NEW.
5. **Done.**  A durable transaction sets ``state='committed'``.

Recovery (:func:`recover`) runs before anything else uses a store: every
``pending`` layer whose checksum verifies is published again (each step is
idempotent: a file is rewritten, an absent path is skipped, an existing
directory kept) and marked committed; a layer whose checksum does not verify
is marked ``void`` (it never reached a consistent commit point).  Recovery is
itself safe to kill and re-run.  Temporary files are removed.

A failing ``fsync`` raises and the layer stays ``pending``: it is never
reported as committed until a later publish has fsynced every byte again.
"""

from __future__ import annotations

import errno
import json
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field

import xxhash
from sqlalchemy import select, update

from . import schema, staging, tokens
from .errors import CommitConflict, NothingToCommit
from .layers import Entry, State, entries as load_entries, next_number
from .workspace import Workspace

L, E = schema.layers, schema.entries


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


def _kind_of(mode: int) -> str | None:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "special"


def _lstat(ws: Workspace, path: bytes) -> os.stat_result | None:
    """``lstat`` of a workspace path, or None when nothing is reachable
    there: absent, or a file or a symlink in place of a parent directory
    (the overlay view treats all three as absent, so the plan must too)."""
    try:
        return ws.root.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


def capture(ws: Workspace, conn, path: bytes) -> _Before:
    """The workspace state of ``path`` now (file contents stored as an object)."""
    st = _lstat(ws, path)
    if st is None:
        return _Before(State(None), tokens.ABSENT)
    kind = _kind_of(st.st_mode)
    if kind == "file":
        fd = ws.root.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)  # token and content from the same open file
            oid, _ = ws.objects.put_fd(conn, fd)
        finally:
            os.close(fd)
        return _Before(State("file", stat_mod.S_IMODE(st.st_mode), oid), tokens.from_stat(st), st.st_uid, st.st_gid)
    if kind == "symlink":
        target = ws.root.readlink(path)
        return _Before(State("symlink", None, None, target), tokens.from_stat(st, target), st.st_uid, st.st_gid)
    if kind == "dir":
        return _Before(State("dir", stat_mod.S_IMODE(st.st_mode)), tokens.from_stat(st), st.st_uid, st.st_gid)
    # FIFOs, sockets, devices: recorded as present but without content.
    return _Before(State("special", stat_mod.S_IMODE(st.st_mode)), tokens.from_stat(st), st.st_uid, st.st_gid)


def _after_of(row: staging.StagedRow) -> State:
    if row.kind == "whiteout":
        return State(None)
    if row.kind == "file":
        return State("file", stat_mod.S_IMODE(row.mode), row.oid)
    if row.kind == "symlink":
        return State("symlink", None, None, row.target)
    return State("dir", stat_mod.S_IMODE(row.mode))


def _walk(ws: Workspace, path: bytes) -> list[bytes]:
    """Every workspace path strictly below directory ``path``."""
    out, todo = [], [path]
    while todo:
        d = todo.pop()
        try:
            children = ws.root.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink, not a directory
                continue
            raise
        for name, kind, _ino in children:
            child = name if d == b"." else d + b"/" + name
            out.append(child)
            if kind == stat_mod.S_IFDIR:
                todo.append(child)
    return out


def plan_step(ws: Workspace, rows: list[staging.StagedRow], overwrite: set[bytes] = frozenset()) -> Plan:
    """Step 1-2 of the protocol: entries and conflicts for ``rows``."""
    staged = {r.path: r for r in rows}
    after: dict[bytes, tuple[State, int | None, str | None]] = {}
    for row in rows:
        after[row.path] = (_after_of(row), row.mtime_ns if row.kind in ("file", "symlink") else None, row.base)
        hides_below = row.kind == "whiteout" or (row.kind == "dir" and row.opaque) or row.kind in ("file", "symlink")
        if hides_below:
            for child in _walk(ws, row.path):
                if child not in staged:
                    after.setdefault(child, (State(None), None, None))
    plan = Plan()
    with ws.db.write() as conn:
        for path in sorted(after):
            state, mtime, base = after[path]
            before = capture(ws, conn, path)
            if base is not None and before.token != base and path not in overwrite:
                plan.conflicts.append(path)
                continue
            if before.state == state:
                plan.noop_paths.append(path)
                continue
            plan.entries.append(Entry(path, before.state, state, mtime))
    return plan


def intent_checksum(entries: list[Entry]) -> str:
    h = xxhash.xxh3_128()
    for e in sorted(entries, key=lambda e: e.path):
        for part in (e.path, *_state_parts(e.before), *_state_parts(e.after), str(e.after_mtime_ns).encode()):
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    return h.hexdigest()


def _state_parts(s: State) -> tuple[bytes, ...]:
    return (str(s.kind).encode(), str(s.mode).encode(), str(s.oid).encode(), s.target if s.target is not None else b"\0")


def _entry_row(layer: int, e: Entry) -> dict:
    return {
        "layer": layer, "path": e.path,
        "before_kind": e.before.kind, "before_mode": e.before.mode,
        "before_oid": e.before.oid, "before_target": e.before.target,
        "after_kind": e.after.kind, "after_mode": e.after.mode,
        "after_oid": e.after.oid, "after_target": e.after.target,
        "after_mtime_ns": e.after_mtime_ns,
    }


def write_layer(ws: Workspace, entries: list[Entry], *, kind: str, message: str, agent: str, mount: str,
                meta: dict | None, consume_step: int | None) -> int:
    """Steps 3-5: intent record, publish, mark committed.  Caller holds the
    commit lock and has checked for conflicts.  Returns the layer number."""
    with ws.db.write(durable=True) as conn:
        number = next_number(conn)
        conn.execute(
            L.insert().values(
                number=number, state="pending", kind=kind, created_ns=time.time_ns(), message=message,
                agent=agent, mount=mount, meta=json.dumps(meta or {}, sort_keys=True),
                intent_sum=intent_checksum(entries),
            )
        )
        if entries:
            conn.execute(E.insert(), [_entry_row(number, e) for e in entries])
        if consume_step is not None:
            conn.execute(schema.staged.delete().where(schema.staged.c.step == consume_step))
    apply_entries(ws, number, entries)
    with ws.db.write(durable=True) as conn:
        conn.execute(update(L).where(L.c.number == number).values(state="committed"))
    return number


def commit_step(ws: Workspace, step: int, *, message: str = "", agent: str = "", mount: str = "",
                meta: dict | None = None, allow_empty: bool = False, overwrite: set[bytes] = frozenset()) -> int:
    """Commit open step ``step`` as the next layer and publish it.

    Raises :class:`NothingToCommit` (nothing staged, or everything staged
    equals the workspace already; no-op rows are dropped) and
    :class:`CommitConflict` (nothing written, step left open).
    """
    with ws.commit_lock():
        _recover_locked(ws)
        with ws.db.read() as conn:
            rows = staging.load(conn, step)
        plan = plan_step(ws, rows, overwrite)
        if plan.conflicts:
            names = ", ".join(os.fsdecode(p) for p in plan.conflicts[:10])
            more = f" and {len(plan.conflicts) - 10} more" if len(plan.conflicts) > 10 else ""
            raise CommitConflict(
                f"{len(plan.conflicts)} path(s) changed in the workspace since this step staged them "
                f"({names}{more}); nothing was written: discard them with 'stepfs discard' or commit over "
                f"them with 'stepfs step --overwrite PATH'.",
                [os.fsdecode(p) for p in plan.conflicts],
            )
        if not plan.entries and not allow_empty:
            if rows:
                with ws.db.write() as conn:
                    conn.execute(schema.staged.delete().where(schema.staged.c.step == step))
            raise NothingToCommit(
                "nothing to commit: the open step has no changes against the workspace "
                "(use --allow-empty to record an empty layer anyway)."
            )
        return write_layer(ws, plan.entries, kind="step", message=message, agent=agent, mount=mount,
                           meta=meta, consume_step=step)


# -- publishing -----------------------------------------------------------------


def _depth(path: bytes) -> int:
    return path.count(b"/")


def _current_kind(ws: Workspace, path: bytes) -> str | None:
    st = _lstat(ws, path)
    return None if st is None else _kind_of(st.st_mode)


def apply_entries(ws: Workspace, number: int, entries: list[Entry]) -> None:
    """Step 4: make the workspace match every entry's after state.

    Idempotent: running it again after a crash at any point completes the
    same result.  Raises ``OSError`` on any failure (including fsync);
    the layer then stays pending.
    """
    root = ws.root
    dirs_to_sync: set[bytes] = set()

    def parent_of(p: bytes) -> bytes:
        return p.rpartition(b"/")[0] or b"."

    # 1. removals, deepest first
    for e in sorted(entries, key=lambda e: -_depth(e.path)):
        cur = _current_kind(ws, e.path)
        if cur is None or cur == e.after.kind:
            continue
        pfd, name = root.parent(e.path)
        try:
            if cur == "dir":
                os.rmdir(name, dir_fd=pfd)
            else:
                os.unlink(name, dir_fd=pfd)
        finally:
            os.close(pfd)
        dirs_to_sync.add(parent_of(e.path))

    # 2. new directories, shallowest first
    for e in sorted((e for e in entries if e.after.kind == "dir"), key=lambda e: _depth(e.path)):
        if _current_kind(ws, e.path) == "dir":
            continue
        pfd, name = root.parent(e.path)
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
        finally:
            os.close(pfd)
        dirs_to_sync.add(parent_of(e.path))
        dirs_to_sync.add(e.path)

    # 3. files and symlinks: temp file, fsync, rename over
    tmp_fd = os.open(ws.tmp_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for seq, e in enumerate(entries):
            if e.after.kind not in ("file", "symlink"):
                continue
            tmp_name = f"L{number}-{seq}".encode()
            try:
                os.unlink(tmp_name, dir_fd=tmp_fd)
            except FileNotFoundError:
                pass
            owner = _owner_for(ws, e.path)
            if e.after.kind == "file":
                fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=tmp_fd)
                try:
                    with ws.db.read() as conn:
                        ws.objects.write_to_fd(conn, e.after.oid, fd)
                    if owner is not None:
                        os.fchown(fd, *owner)
                    os.fchmod(fd, e.after.mode)
                    if e.after_mtime_ns:
                        os.utime(fd, ns=(e.after_mtime_ns, e.after_mtime_ns))
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                os.symlink(e.after.target, tmp_name, dir_fd=tmp_fd)
                if owner is not None:
                    os.chown(tmp_name, *owner, dir_fd=tmp_fd, follow_symlinks=False)
            pfd, name = root.parent(e.path)
            try:
                os.rename(tmp_name, name, src_dir_fd=tmp_fd, dst_dir_fd=pfd)
            finally:
                os.close(pfd)
            dirs_to_sync.add(parent_of(e.path))
    finally:
        os.close(tmp_fd)

    # 4. directory modes (last, so a read-only directory is filled first)
    for e in entries:
        if e.after.kind == "dir":
            fd = root.open(e.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if stat_mod.S_IMODE(os.fstat(fd).st_mode) != e.after.mode:
                    os.fchmod(fd, e.after.mode)
            finally:
                os.close(fd)

    # 5. make every directory entry change durable
    for d in sorted(dirs_to_sync):
        try:
            fd = root.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed later in this same layer
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue  # replaced by a symlink later in this same layer
            raise
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _owner_for(ws: Workspace, path: bytes) -> tuple[int, int] | None:
    """Keep the owner of the file being replaced (or of the directory a new
    file lands in) when we run as root, so a commit never hands a user's
    files to root."""
    if os.geteuid() != 0:
        return None
    for candidate in (path, path.rpartition(b"/")[0] or b"."):
        try:
            st = ws.root.lstat(candidate)
            return st.st_uid, st.st_gid
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


# -- recovery -----------------------------------------------------------------


def recover(ws: Workspace) -> list[int]:
    """Finish or void every pending layer; returns the numbers rolled forward."""
    with ws.commit_lock():
        return _recover_locked(ws)


def _recover_locked(ws: Workspace) -> list[int]:
    with ws.db.read() as conn:
        pending = conn.execute(
            select(L.c.number, L.c.intent_sum).where(L.c.state == "pending").order_by(L.c.number)
        ).all()
    done = []
    for number, checksum in pending:
        with ws.db.read() as conn:
            entries = load_entries(conn, number)
        if intent_checksum(entries) != checksum:
            with ws.db.write(durable=True) as conn:
                conn.execute(update(L).where(L.c.number == number).values(state="void"))
            continue
        apply_entries(ws, number, entries)
        with ws.db.write(durable=True) as conn:
            conn.execute(update(L).where(L.c.number == number).values(state="committed"))
        done.append(number)
    for name in os.listdir(ws.tmp_dir):
        try:
            os.unlink(os.path.join(ws.tmp_dir, name))
        except IsADirectoryError:
            pass
    return done
