"""The Python API for agent harnesses (no FUSE import).

A thin layer over ``overlayfs.client.manage`` and ``store``: the CLI and this API
call the same functions, so both behave the same way and fail with the same
one-sentence :class:`StepfsError` subclasses (re-exported here)::

    from stepfs.overlayfs.client import api

    ws = api.open_workspace("/home/me/project", create=True)
    with ws.mount() as m:                   # a private mountpoint, always unmounted
        subprocess.run(["sh", "-c", "echo hi > a.txt"], cwd=m.path, check=True)
        n = m.step("write a.txt", meta={"tool_use_id": "toolu_01"})   # None: nothing changed
    print(ws.card(n)["files"])

Invariants:

* A :class:`WorkspaceClient` holds no open store between calls: each method opens
  the store, does one thing and closes it.  Objects are cheap, may live as
  long as the harness, and may be used from several threads (the store and
  the daemons serialise the work).
* A :class:`Mount` used as a context manager unmounts on exit what it
  mounted, whatever happened (falling back to a forced unmount when the
  mount is busy), and removes the private mountpoint directory it made.  A
  reused mount (someone else's) is left alone.
* Staged changes that were not committed are not lost at unmount: they stay
  in the store as an open step; :meth:`WorkspaceClient.step` commits them later.
"""

from __future__ import annotations

import logging
import os
import shlex
import tempfile
from dataclasses import dataclass
from typing import Callable

from stepfs.store import cards, history, layers

from stepfs.store.errors import (  # noqa: F401  (re-exported for harnesses)
    CommitConflict, ConfinementUnavailable, ContainmentError, CorruptObject, DaemonError, HistoryUnreachable,
    MountpointError, NoSuchLayer, NothingToCommit, NotMountedError, StepfsError, StoreFormatError, WorkspaceError,
)
from stepfs.store.workspace import Workspace as Store
from stepfs.store.workspace import is_workspace

from stepfs.overlayfs.client import manage, mounts
from stepfs.overlayfs.client import confine as confine_mod
from stepfs.overlayfs.client.runner import RunResult, Signals, run_in

log = logging.getLogger("stepfs.api")

#: Prefix of the private mountpoints made by :meth:`WorkspaceClient.mount`.
PRIVATE_PREFIX = "stepfs-mnt-"


def open_workspace(path: str | os.PathLike | None = None, create: bool = False) -> "WorkspaceClient":
    """The workspace that ``path`` names: the workspace directory, one of its
    mountpoints, or a path inside either (default: the current directory).

    With ``create``, a directory that is in no workspace becomes one (its
    store ``.stepfs/`` is made).  Opens the store once to run recovery and
    check the format, so a foreign or newer store fails here.
    """
    raw = os.path.expanduser(os.fspath(path)) if path is not None else os.getcwd()
    try:
        ws_path = manage.resolve(raw).workspace
    except WorkspaceError:
        if not create or not os.path.isdir(raw):
            raise
        ws_path = os.path.realpath(raw)
    Store.open(ws_path, create=create and not is_workspace(ws_path)).close()
    return WorkspaceClient(ws_path)


@dataclass(frozen=True)
class WorkspaceClient:
    """A stepfs workspace, by its absolute real path."""

    path: str

    # -- mounts ---------------------------------------------------------------------

    def mount(self, mountpoint: str | os.PathLike | None = None, *, reuse: bool = False,
              require_read: bool = False, excludes: list[str] = (), default_excludes: bool = True) -> "Mount":
        """Mount the workspace and return the live :class:`Mount`.

        ``mountpoint`` None makes a private empty directory under the temp
        directory (removed again at unmount); a named directory that does not
        exist is created (and removed at unmount).  With ``reuse``, an existing
        live mount of this workspace is returned instead (the named one, or
        any one), and leaving its ``with`` block does not unmount it.
        ``excludes`` / ``default_excludes``: the mount's unversioned paths
        (README "Unversioned paths"; a reused mount keeps its own).
        """
        if reuse:
            found = self._live_mount(mountpoint)
            if found is not None:
                return found
        made_dir = False
        if mountpoint is None:
            mp = tempfile.mkdtemp(prefix=PRIVATE_PREFIX)
            made_dir = True
        else:
            mp = os.path.normpath(os.path.abspath(os.fspath(mountpoint)))
            if mounts.find(mp) is None and not os.path.lexists(mp):
                os.mkdir(mp, 0o755)
                made_dir = True
        try:
            pid = manage.mount(self.path, mp, require_read=require_read, excludes=list(excludes),
                               default_excludes=default_excludes)
        except BaseException:
            if made_dir:
                _rmdir(mp)
            raise
        return Mount(self, mp, pid=pid, owned=True, made_dir=made_dir)

    def mounts(self) -> list["Mount"]:
        """The live stepfs mounts of this workspace (not owned: never unmounted by us)."""
        return [Mount(self, m.mountpoint, pid=None, owned=False) for m in mounts.stepfs_mounts(self.path)]

    def _live_mount(self, mountpoint: str | os.PathLike | None) -> "Mount | None":
        live = mounts.stepfs_mounts(self.path)
        if mountpoint is not None:
            mp = os.path.normpath(os.path.abspath(os.fspath(mountpoint)))
            live = [m for m in live if m.mountpoint == mp]
        return Mount(self, live[0].mountpoint, pid=None, owned=False) if live else None

    # -- steps and history ---------------------------------------------------------

    def status(self) -> dict:
        """Mounts, their staged paths and the conflicts (as ``stepfs status --json``)."""
        return manage.status(manage.Target(self.path))

    def step(self, message: str = "", meta: dict | None = None, *, allow_empty: bool = False,
             overwrite: list[str] | tuple[str, ...] = ()) -> list[int]:
        """Commit every open step of the workspace (live mounts through their
        daemons, steps of dead daemons from the store); returns the new layer
        numbers, ``[]`` when nothing was staged anywhere."""
        try:
            return _step(manage.Target(self.path), message=message, meta=meta, allow_empty=allow_empty,
                         overwrite=list(overwrite))
        except NothingToCommit:
            return []

    def log(self, limit: int | None = None) -> list[layers.Layer]:
        """Committed layers, newest first (``layers.Layer``: number, kind,
        created_ns, message, agent, mount, meta, added/modified/deleted)."""
        with Store.open(self.path) as ws, ws.db.read() as conn:
            return layers.list_layers(conn, limit=limit)

    def head(self) -> int:
        """The newest committed layer number (0: only the baseline)."""
        with Store.open(self.path) as ws, ws.db.read() as conn:
            return layers.head(conn)

    def card(self, number: int, fold: bool = True) -> dict:
        """The change card of layer ``number`` (as ``stepfs show --json``;
        ``fold=False`` lists the paths inside ``.git`` too, as ``--all``)."""
        with Store.open(self.path) as ws, ws.db.read() as conn:
            return cards.card(ws.objects, conn, number, fold)

    def read(self, number: int, path: str) -> bytes:
        """A file's bytes as of layer ``number`` (as ``stepfs cat``)."""
        with Store.open(self.path) as ws:
            return history.file_bytes(ws, number, path)

    def rollback(self, number: int, paths: list[str] | None = None, dry_run: bool = False):
        """Make layer ``number``'s state current again, as a new layer.

        Staged changes of open steps are committed first; see
        ``overlayfs.manage.rollback``.  Returns its result (the new layer's
        layer number under "layer", and its change card).
        """
        return manage.rollback(manage.Target(self.path), number, paths=list(paths or ()), dry_run=dry_run)

    def run(self, command: list[str], **kwargs) -> RunResult:
        """Run ``command`` in a mount of this workspace and commit what it
        changed as one step; see :func:`run_command`."""
        return run_command(command, self, **kwargs)


class Mount:
    """A live stepfs mount of a workspace.

    ``path`` is the mountpoint; run the agent's tools with their working
    directory there (:meth:`map_path` maps workspace paths into it).
    """

    def __init__(self, workspace: WorkspaceClient, path: str, pid: int | None, owned: bool, made_dir: bool = False):
        self.workspace = workspace
        self.path = path
        self.pid = pid
        self.owned = owned
        self.made_dir = made_dir

    def __repr__(self) -> str:
        return f"Mount({self.workspace.path!r} at {self.path!r}, owned={self.owned})"

    def __enter__(self) -> "Mount":
        return self

    def __exit__(self, *exc) -> None:
        if self.owned:
            self.unmount()

    def step(self, message: str = "", meta: dict | None = None, *, allow_empty: bool = False,
             overwrite: list[str] | tuple[str, ...] = ()) -> int | None:
        """Commit this mount's open step as the next layer and return its
        number; None if nothing was staged (no layer is made).  Raises
        :class:`CommitConflict` (nothing written) if the workspace changed
        under a staged path; ``overwrite`` names paths to commit anyway."""
        try:
            numbers = _step(manage.Target(self.workspace.path, self.path), message=message, meta=meta,
                            allow_empty=allow_empty, overwrite=list(overwrite))
        except NothingToCommit:
            return None
        return numbers[-1] if numbers else None

    def staged(self) -> list[dict]:
        """This mount's staged paths: ``[{"op": "A"|"M"|"D", "path", "kind"}]``."""
        st = manage.status(manage.Target(self.workspace.path, self.path))
        return [s for m in st["mounts"] if m["mountpoint"] == self.path for s in m["staged"]]

    def map_path(self, path: str | os.PathLike) -> str:
        """The path in this mount that shows ``path`` (a path in the
        workspace, in another mount of it, or relative to the workspace)."""
        return os.path.join(self.path, relative_to_workspace(self.workspace, os.fspath(path)) or "")

    @property
    def mounted(self) -> bool:
        return mounts.find(self.path) is not None

    def unmount(self, force: bool = False) -> None:
        """Unmount and wait for the daemon to exit.  When the mount is busy
        (a process left behind still uses it) fall back to a forced unmount,
        so the mount never outlives its owner."""
        try:
            if self.mounted:
                try:
                    manage.unmount(self.path, force=force)
                except DaemonError as exc:
                    if force:
                        raise
                    log.warning("%s; forcing the unmount", exc)
                    manage.unmount(self.path, force=True)
        finally:
            if self.made_dir and not self.mounted:
                _rmdir(self.path)
                self.made_dir = False


def relative_to_workspace(workspace: WorkspaceClient, path: str) -> str | None:
    """``path`` relative to the workspace root if it lies in the workspace
    or in one of its live mounts (``""`` for the root itself), else None.
    Paths inside the store (``.stepfs``) count as outside."""
    p = os.path.normpath(os.path.abspath(path))
    entry = mounts.containing(p)  # mounts first, without stat (a dead mount must not hang us)
    if entry is not None:
        if entry.workspace != workspace.path:
            return None
        rel = os.path.relpath(p, entry.mountpoint)
    else:
        real = os.path.realpath(p)
        if real != workspace.path and not real.startswith(workspace.path.rstrip("/") + "/"):
            return None
        rel = os.path.relpath(real, workspace.path)
    if rel == ".":
        return ""
    if rel.split(os.sep)[0] == ".stepfs":
        return None
    return rel


# -- ``stepfs run`` as a call ----------------------------------------------------------
#
# run_command picks a mount of the workspace (the one the caller named or
# stands in, else any live one, else a new private one), runs the command
# with its working directory mapped into the mount (WS/sub becomes
# MOUNT/sub), commits the mount's open step when the command exits
# (message: the command line; meta exit_code), and unmounts what it
# mounted, whatever happened.  A command that changed nothing makes no
# layer.  Caveat: a reused mount commits its whole open step, including what
# other writers staged there before the command started; private=True
# always mounts afresh.  The child process and its signals: runner.py.


def _step(target: manage.Target, **options) -> list[int]:
    """``manage.step``; on a workspace attached to a shared history, through
    it (pull, commit, publish: ``client/shared.py``), as ``stepfs step`` does.

    Unlike ``stepfs step``, a server that cannot be reached before the
    commit does not stop it: the command whose changes these are has run,
    so they are committed here as a layer (as the daemon's auto-steps are)
    and :class:`HistoryUnreachable` says so (``exc.committed``); the next
    step or ``stepfs sync`` publishes them."""
    from stepfs.store.shared.attachment import attached  # one stat; the database layer only when attached

    if not attached(target.workspace):
        return manage.step(target, **options)
    from stepfs.overlayfs.client import shared

    try:
        return shared.step(target, None, **options)["numbers"]
    except HistoryUnreachable as exc:
        if getattr(exc, "committed", None):
            raise
        numbers = manage.step(target, **options)
        late = HistoryUnreachable(f"layer {numbers[-1]} is committed in this workspace but not published: {exc}")
        late.committed = numbers
        raise late from None


def run_command(command: list[str], workspace: "WorkspaceClient | str | os.PathLike | None" = None, *,
                message: str | None = None, meta: dict | None = None,
                mountpoint: str | os.PathLike | None = None, private: bool = False,
                cwd: str | os.PathLike | None = None, env: dict | None = None,
                stdin=None, stdout=None, stderr=None,
                forward_signals: bool = False,
                on_phase: Callable[[str], None] | None = None,
                confine: "confine_mod.Policy | None" = None,
                excludes: list[str] = (), default_excludes: bool = True) -> RunResult:
    """Run ``command`` in a mount of ``workspace`` and commit what it changed.

    ``workspace``: a :class:`WorkspaceClient`, or a path (workspace, mount, or
    a path inside either; a plain directory becomes a workspace); None means
    the one ``cwd`` is in.  ``cwd`` (default: the current directory) is
    mapped into the mount; outside the workspace the command runs at the
    mount's root.  ``env`` is added to the environment, with
    ``STEPFS_WORKSPACE`` and ``STEPFS_MOUNT`` set.  ``on_phase`` is called
    with "mounting", "running", "committing", "unmounting".  ``confine``
    (a :class:`confine.Policy`; its mountpoint is filled in) runs the
    command under Landlock; the kernel is checked before anything is
    touched (``ConfinementUnavailable``).  ``excludes`` /
    ``default_excludes``: unversioned paths of a mount made here.

    Raises :class:`StepfsError` if the mount or the commit fails; a failed
    commit carries the command's status as ``exc.command_exit_code`` (its
    changes stay staged in the store, see :meth:`WorkspaceClient.step`).
    """
    if not command:
        raise ValueError("run_command needs a command")
    command = [os.fspath(c) for c in command]
    phase = on_phase or (lambda _name: None)
    start_dir = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    if confine is not None:
        confine_mod.require(confine)  # first: where the kernel cannot, touch nothing
    ws, standing_in = _resolve(workspace, start_dir)
    if confine is not None:
        confine.workspace = ws.path
        confine_mod.check(confine)  # before mounting
    with Signals(forward_signals) as sig:
        phase("mounting")
        how = {"excludes": excludes, "default_excludes": default_excludes}
        if mountpoint is not None:
            m = ws.mount(mountpoint, reuse=True, **how)
        elif private:
            m = ws.mount(**how)
        else:
            m = standing_in or ws._live_mount(None) or ws.mount(**how)
        if not m.owned and (excludes or not default_excludes):
            log.warning("the live mount %s is reused with its own unversioned paths; --exclude and "
                        "--no-default-excludes apply to a mount 'stepfs run' makes (add --private)", m.path)
        try:
            run_cwd = _map_cwd(ws, m, start_dir)
            result = RunResult(command, 0, None, m.path, reused=not m.owned, cwd=run_cwd, workspace=ws.path)
            child_env = {**os.environ, **(env or {}), "STEPFS_WORKSPACE": ws.path, "STEPFS_MOUNT": m.path,
                         "PWD": run_cwd}
            if sig.received:
                result.started = False
                result.exit_code = 128 + sig.received[0]
            else:
                result.exit_code, result.started, result.confined = run_in(
                    m.path, command, confine, sig, phase, cwd=run_cwd, env=child_env, stdin=stdin,
                    stdout=stdout, stderr=stderr)
            result.signals, result.forwarded = list(sig.received), list(sig.forwarded)
            if result.started:
                phase("committing")
                step_meta = {"exit_code": str(result.exit_code), **(meta or {})}
                try:
                    result.number = m.step(message if message is not None else shlex.join(command),
                                           meta=step_meta)
                except StepfsError as exc:
                    exc.command_exit_code = result.exit_code
                    raise
        finally:
            if m.owned:
                phase("unmounting")
                m.unmount()
    return result


def run_confined(mountpoint: str | os.PathLike, command: list[str], policy: "confine_mod.Policy", *,
                 cwd: str | os.PathLike | None = None, env: dict | None = None, stdin=None, stdout=None,
                 stderr=None, forward_signals: bool = False) -> RunResult:
    """``stepfs confine``: run ``command`` confined to an existing mount
    (which a harness manages: nothing is mounted, committed or unmounted).
    ``cwd`` defaults to the current directory if it is inside the mount,
    else the mount's root."""
    mp = os.path.abspath(os.fspath(mountpoint))
    entry = mounts.find(mp)
    if entry is None or entry.workspace is None:
        raise NotMountedError(f"{mp} is not a stepfs mount; mount the workspace there first ('stepfs mount WS {mp}').")
    policy.mountpoint, policy.workspace = mp, entry.workspace
    confine_mod.check(policy)
    confine_mod.require(policy)
    here = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    run_cwd = here if here == mp or here.startswith(mp.rstrip("/") + "/") else mp
    command = [os.fspath(c) for c in command]
    result = RunResult(command, 0, None, mp, reused=True, cwd=run_cwd, workspace=entry.workspace)
    child_env = {**os.environ, **(env or {}), "STEPFS_WORKSPACE": entry.workspace, "STEPFS_MOUNT": mp,
                 "PWD": run_cwd}
    with Signals(forward_signals) as sig:
        result.exit_code, result.started, result.confined = run_in(
            mp, command, policy, sig, lambda _name: None, cwd=run_cwd, env=child_env, stdin=stdin,
            stdout=stdout, stderr=stderr)
        result.signals, result.forwarded = list(sig.received), list(sig.forwarded)
    return result


def _resolve(workspace, start_dir: str) -> tuple[WorkspaceClient, "Mount | None"]:
    """The workspace, and the live mount of it that the caller named or
    stands in (to be reused), if any."""
    named = None
    if isinstance(workspace, WorkspaceClient):
        ws = workspace
    else:
        named = os.path.abspath(os.path.expanduser(os.fspath(workspace))) if workspace is not None else None
        ws = open_workspace(named if named is not None else start_dir, create=named is not None)
    for probe in (named, start_dir):
        entry = mounts.containing(probe) if probe is not None else None
        if entry is not None and entry.workspace == ws.path:
            return ws, Mount(ws, entry.mountpoint, pid=None, owned=False)
    return ws, None


def _map_cwd(ws: WorkspaceClient, m: Mount, start_dir: str) -> str:
    rel = relative_to_workspace(ws, start_dir)
    if rel is None:
        return m.path
    mapped = os.path.join(m.path, rel) if rel else m.path
    if not os.path.isdir(mapped):
        log.warning("%s does not exist in the mount; running at its root", mapped)
        return m.path
    return mapped


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError as exc:  # not empty or already gone: leave it, say so
        log.warning("could not remove mountpoint directory %s: %s", path, exc.strerror)


__all__ = [
    "open_workspace", "WorkspaceClient", "Mount", "relative_to_workspace", "run_command", "RunResult",
    "StepfsError", "WorkspaceError", "MountpointError", "NotMountedError", "StoreFormatError",
    "NothingToCommit", "CommitConflict", "DaemonError", "ContainmentError", "NoSuchLayer", "CorruptObject",
]
