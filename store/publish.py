"""Atomic publish of a step into the workspace: the protocol and its driver.

The protocol is written down here once and its parts live in modules named
for what they hold: ``store.plan`` (step 1: before states and the plan),
``store.journal`` (step 3: the intent's rows and checksum, the failure
messages), ``store.switch`` (steps 2 and 4: temporary files and the
renames), ``store.completion`` (step 5: the directory fsyncs and the
``committed`` record) and ``store.recovery`` (pending layers after a
crash).  This module runs them in order (:class:`Commit`).

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
   commit is refused as a whole and the transaction rolled back.  A path
   below a removed directory that changed outside after the removal (the
   step never saw it) is left alone with the directories above it, and
   recorded as an ``outside-change`` conflict (``store.plan``).
   *Crash:* nothing of the commit; the workspace is OLD, the step open.
2. **Objects and new files first.**  Before-objects are stored
   (after-objects already were, at close-write).  Every new file, symlink,
   FIFO and hard link is made as a temporary file ``.stepfs/tmp/L<layer>-<seq>``
   (same filesystem as the workspace; a regular file is a spare inode from
   ``store.spares`` when one is on hand, or a mount daemon's ready file for
   the entry, written and fsynced ahead: ``store.ready``).  The regular files are then
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
4. **Switch.**  Just before it first changes a path, compare the path's
   token with the plan's: a path changed outside since is left alone and
   recorded as an ``outside-change`` conflict in step 5 (so is a directory
   to remove that received a name).  Remove what the layer removes (deepest first), create
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

Recovery (``store.recovery``) runs before anything else uses a store and
at the start of every commit; its module docstring says what it does.

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

import json
import logging
import os
import time

from stepfs.store import durable, entrytable, refs, staging, tokens  # noqa: F401  (tokens: tests reach it here)
from stepfs.store.errors import CommitConflict, NothingToCommit, StepfsError, StoreUnavailable
from stepfs.store.layers import Entry, next_number
from stepfs.store.ready import ReadyFiles
from stepfs.store.workspace import Workspace
# The protocol's parts, under the names callers and tests have always used.
from stepfs.store.completion import OUTSIDE_CHANGE, _complete, _DirSync, _record_outside  # noqa: F401
from stepfs.store.journal import (  # noqa: F401
    _CONSUME_STEP, _FIRST_IN_STATE, _INSERT_LAYER, _pending_failure,
    _prepare_failure, _withdraw_intent, intent_checksum,
)
from stepfs.store.plan import LEAF_KINDS, PRECAPTURE_MAX, Plan, _Before, capture, plan_step, precapture  # noqa: F401
from stepfs.store.recovery import _recover_locked, classify, recover  # noqa: F401
from stepfs.store.switch import _Prepped, _prepare, _remove_temps, _switch, _switch_prep, apply_entries  # noqa: F401

log = logging.getLogger("stepfs.publish")


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
                 locked: bool = False, expect: dict[bytes, str] | None = None, ready: ReadyFiles | None = None):
        """``step``: plan the open step ``step`` (``allow_empty``,
        ``overwrite``, ``known`` as for :func:`begin`); else ``entries`` is
        the layer and ``consume_step`` the step whose rows it consumes.
        ``locked``: the caller holds the commit lock already.  ``expect``:
        the token each of ``entries`` had when the caller planned it
        (checked just before the path's switch, as a step's own plan's).
        ``ready``: new files a mount daemon wrote ahead (``store/ready.py``)."""
        self.ws = ws
        self.ready = ready
        self.step = step
        self.kind, self.message, self.agent, self.mount, self.meta = kind, message, agent, mount, meta
        self.consume_step = step if step is not None else consume_step
        self.allow_empty, self.overwrite, self.known = allow_empty, overwrite, known
        self.entries = entries if entries is not None else []
        self.number: int | None = None
        #: entries the plan left alone, recorded as outside changes: below
        #: something that is no longer a directory, or made outside inside
        #: a directory the step removes (``Plan.outside``).
        self.outside: list[Entry] = []
        #: Planned tokens of a step's paths (``Plan.tokens``), checked just
        #: before each path's switch; entries it left, changed outside since.
        self._expect: dict[bytes, str] | None = expect
        self.left: list[Entry] = []
        self._locked = locked
        self._held: list = []
        self._dir_sync: _DirSync | None = None  # set once every rename is done
        self._completed = False
        self._committed = False  # step 5 succeeded: the layer's deltas are due

    def __enter__(self) -> "Commit":
        if not self._locked:
            for cm in (self.ws.commit_lock(), self.ws.spares.pausing(), self.ws.deltas.pausing()):
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
        if self._committed:  # format 7: deltas once the lock is released (store/deltawork.py)
            self._committed = False
            self.ws.deltas.submit(self.number)
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
                    f"nothing was committed: {len(self.outside)} path(s) of the step were changed outside stepfs "
                    f"({os.fsdecode(self.outside[0].path)}, ...): made inside a directory the step removes, or "
                    f"below something that is no longer a directory; they are left as they are and kept as "
                    f"'outside-change' conflicts ('stepfs status' lists them)."
                )
            raise NothingToCommit(
                "nothing to commit: the open step has no changes against the workspace "
                "(use --allow-empty to record an empty layer anyway)."
            )
        # Past the commit point: from here a failure leaves the layer pending.
        try:
            self._dir_sync = _switch(ws, self.number, self.entries, wait=False, prepped=prepped,
                                     expect=self._expect, left=self.left)
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
            _complete(self.ws, self.number, self.consume_step, self._dir_sync, left=self.left)
        except OSError as exc:
            raise _pending_failure(self.number, exc) from None
        finally:
            self._dir_sync.close()
        self._committed = True

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
                log.warning("step leaves %s alone: it was changed outside stepfs (below a directory the step "
                            "removes, or below something that is no longer a directory); its staged version is "
                            "kept as an 'outside-change' conflict", os.fsdecode(e.path))
            _record_outside(self.ws, conn, plan.outside, self.mount, self.agent)
        if not plan.entries and not self.allow_empty:
            if rows:  # they all equal the workspace (or are kept as conflicts): drop them with this transaction
                _CONSUME_STEP.execute(conn, {"s": step})
            return False
        self.entries, self.number, self._expect = plan.entries, number, plan.tokens
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
                        unsynced = _prepare(ws, number, entries, conn, ready=self.ready)
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
                    entrytable.insert(conn, number, entries)
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
          known: dict[bytes, _Before] | None = None, ready: ReadyFiles | None = None) -> Commit:
    """The commit of open step ``step`` as the next layer (a
    :class:`Commit`: use it as a context manager; it takes the commit
    lock).  ``known``: before states captured ahead (:func:`precapture`),
    reused for paths whose token has not changed since.  A mount daemon
    writes no row of ``step`` until :meth:`Commit.complete` has ended (step
    5 consumes the step's rows: it would take a later row with it).

    :meth:`Commit.publish` raises :class:`NothingToCommit` (nothing staged,
    or everything staged equals the workspace already; the no-op rows are
    dropped) and :class:`CommitConflict` (nothing written, step left open).
    ``ready``: new files written ahead (``store/ready.py``), used where they
    match."""
    return Commit(ws, step=step, message=message, agent=agent, mount=mount, meta=meta,
                  allow_empty=allow_empty, overwrite=overwrite, known=known, ready=ready)


def commit_step(ws: Workspace, step: int, **options) -> int:
    """Commit open step ``step`` (options as for :func:`begin`); returns
    once the layer is committed."""
    with begin(ws, step, **options) as c:
        number = c.publish()
        c.complete()
        return number


def write_layer(ws: Workspace, entries: list[Entry], *, kind: str, message: str, agent: str, mount: str,
                meta: dict | None, consume_step: int | None, number: int | None = None,
                expect: dict[bytes, str] | None = None) -> int:
    """Steps 2 to 5 for a layer the caller planned (``entries``; the layer
    consumes ``consume_step``'s rows), under the caller's hold of the
    commit lock.  ``number``: the layer's number if the caller already read
    ``next_number`` under this same hold of the lock; ``expect``: the
    planned tokens (:class:`Commit`)."""
    with Commit(ws, entries=entries, kind=kind, message=message, agent=agent, mount=mount, meta=meta,
                consume_step=consume_step, locked=True, expect=expect) as c:
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


def record_empty(ws: Workspace, *, message: str = "", meta: dict | None = None) -> int:
    """Record an empty step layer (``step --allow-empty`` with nothing
    staged anywhere).  Like every commit, it first finishes or voids any
    pending layer under the same hold of the commit lock, so its number can
    never overtake an intent that recovery would still roll forward."""
    with ws.commit_lock():
        _recover_locked(ws)
        return write_layer(ws, [], kind="step", message=message, agent="", mount="", meta=meta, consume_step=None)
