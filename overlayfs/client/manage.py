"""Mount management and step operations as library calls (no FUSE import).

Everything the CLI does goes through a function here or in ``store``, so
tests and agent harnesses can call the same code.  A *target* is what a user
names on the command line: a workspace, one of its mountpoints, or a path
inside either (default: the current directory).
"""

from __future__ import annotations

import os
import sys
from collections import namedtuple

# typing itself is not imported: its import was a real share of a
# `stepfs step` start-up, and the hints below are only read by checkers.
TYPE_CHECKING = False

from stepfs.store.errors import (
    InputError,
    CommitConflict, DaemonError, MountpointError, NothingToCommit, NotMountedError, StepfsError, WorkspaceError,
)
from stepfs.store.paths import STORE_DIR, check_directory, is_workspace, lost_database, lost_database_message

from stepfs.overlayfs.client import control, mounts
# status and sync_rows are this module's API too (callers name manage.status).
from stepfs.overlayfs.client.reads import daemon_for, status, sync_rows  # noqa: F401
from stepfs.overlayfs.daemon.protocol import daemon_alive, daemon_alive_settled, log_path, parse_auto_step

if TYPE_CHECKING:
    from typing import NoReturn

    from stepfs.store import staging
    from stepfs.store.workspace import Workspace

# The store and the database layer (SQLAlchemy: most of a CLI start-up) are
# imported inside the functions that open the store: a `stepfs step` or
# `stepfs unmount` of a mountpoint only talks to the daemon.  So are
# subprocess, select, shutil and logging, which only mounting, unmounting
# and the store's paths use: a step through a live mount costs about a bare
# interpreter's start-up (tests/test_cli_startup.py).

READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0


class Target(namedtuple("Target", "workspace mountpoint", defaults=(None,))):
    """A workspace and, if the command named one, its mountpoint (a named
    tuple: no dataclasses import on the CLI's light path)."""

    __slots__ = ()


def resolve(arg: str | None = None) -> Target:
    """Trace a command-line path to its workspace (and mount, if it is one).

    Mount table first, without stat, so a dead mount cannot hang us; then the
    directories upwards from the path, like git looks for ``.git``.
    """
    path = os.path.normpath(os.path.abspath(arg if arg is not None else os.getcwd()))
    entry = mounts.containing(path)
    if entry is not None:
        return Target(entry.workspace, entry.mountpoint)
    if not os.path.exists(path):
        raise WorkspaceError(f"{path} does not exist; name a workspace or one of its mountpoints.")
    probe = os.path.realpath(path)
    while True:
        if is_workspace(probe):
            return Target(probe)
        if lost_database(probe):
            raise WorkspaceError(lost_database_message(os.path.join(probe, STORE_DIR)))
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    raise WorkspaceError(
        f"{path} is not in a stepfs workspace or mount; name one, or mount a workspace first with 'stepfs mount'."
    )


# -- mount / unmount -----------------------------------------------------------------


def check_mount_args(workspace: str, mountpoint: str) -> tuple[str, str]:
    """Validate before touching any store; returns absolute paths."""
    ws = check_directory(workspace)
    mp = os.path.normpath(os.path.abspath(mountpoint))
    entry = mounts.find(mp)
    if entry is not None:
        if entry.workspace is not None:
            raise MountpointError(
                f"{mp} is already a stepfs mount (of {entry.workspace}); unmount it first with 'stepfs unmount {mp}'."
            )
        raise MountpointError(f"{mp} is already a mountpoint ({entry.fstype}); choose an empty directory.")
    if not os.path.exists(mp):
        raise MountpointError(f"mountpoint {mp} does not exist; create it with 'mkdir -p {mp}'.")
    if not os.path.isdir(mp):
        raise MountpointError(f"mountpoint {mp} is not a directory; choose an empty directory.")
    real_mp = os.path.realpath(mp)
    if real_mp == ws or real_mp.startswith(ws.rstrip("/") + "/"):
        raise MountpointError(
            f"mountpoint {mp} is inside the workspace {ws}; choose a directory outside it."
        )
    if os.listdir(mp):
        raise MountpointError(f"mountpoint {mp} is not empty; choose an empty directory.")
    return ws, mp


def reclaim_dead_mount(workspace: str, mountpoint: str) -> bool:
    """Clean up a stepfs mount of ``workspace`` at ``mountpoint`` whose daemon
    died (it stays in the mount table and answers ENOTCONN): abort its FUSE
    connection so no client stays blocked, then detach it lazily.  Returns
    whether there was one.  A live daemon's mount, or another workspace's,
    is left alone (the caller's checks refuse it)."""
    import shutil
    import subprocess

    mp = os.path.normpath(os.path.abspath(mountpoint))
    entry = mounts.find(mp)
    if entry is None or entry.workspace is None:
        return False
    try:
        ws = check_directory(workspace)
    except WorkspaceError:
        return False
    if entry.workspace != ws:
        return False
    # A daemon holds its lock file for its whole life: lock free = daemon
    # gone (one killed a moment ago may still be closing its descriptors).
    if daemon_alive_settled(os.path.join(ws, STORE_DIR, "run"), mp) is not None:
        return False
    abort_connection(mp)
    tool = shutil.which("fusermount3") or "fusermount3"
    result = subprocess.run([tool, "-u", "-z", mp], capture_output=True, text=True)
    if result.returncode != 0 and mounts.find(mp) is not None:
        reason = result.stderr.strip() or "unknown reason"
        raise MountpointError(f"{mp} is a dead stepfs mount that could not be detached ({reason}); "
                              f"run 'fusermount3 -u -z {mp}' as its owner.")
    return True


def _prepare_mount(workspace: str, mountpoint: str, auto_step: str, allow_other: bool,
                   new_history: bool = False) -> tuple[str, str]:
    """What a mount does before its daemon starts: check the arguments
    (refused before anything is touched), detach a dead mount at the same
    place, create the store and run recovery.  The workspace's and the
    mountpoint's absolute paths.  ``new_history``: a store directory whose
    database is gone starts a new history instead of being refused
    (``Workspace.open``)."""
    from stepfs.store.workspace import Workspace

    if allow_other and os.geteuid() != 0:
        raise InputError("--allow-other needs root: mount as root to let other users into the mount.")
    try:
        parse_auto_step(auto_step)
    except ValueError as exc:
        raise InputError(f"{exc}.") from None
    reclaim_dead_mount(workspace, mountpoint)
    ws_path, mp = check_mount_args(workspace, mountpoint)
    Workspace.open(ws_path, create=True, new_history=new_history).close()  # create the store, recover, check the format
    return ws_path, mp


def mount(workspace: str, mountpoint: str, debug: bool = False, require_read: bool = False,
          auto_step: str = "manual", allow_other: bool = False, keep_last: int | None = None,
          warn_size: int | None = None, new_history: bool = False, excludes: list[str] = (),
          default_excludes: bool = True) -> int:
    """Start a daemon for ``workspace`` at ``mountpoint`` and return its pid
    once the mount is ready.  A dead mount of the same workspace at the same
    place (its daemon was killed) is cleaned up first; opening the workspace
    then runs recovery, so the new mount starts from the last committed layer
    plus the open step's staged rows.  Raises a StepfsError with the reason
    otherwise.  ``allow_other`` lets users other than the mounter in (root
    only; the kernel then checks their permissions: default_permissions).
    ``excludes``, ``default_excludes``: the unversioned paths (README
    "Unversioned paths"); a refused pattern raises InputError first."""
    import select
    import subprocess
    import time

    check_excludes(excludes)
    ws_path, mp = _prepare_mount(workspace, mountpoint, auto_step, allow_other, new_history)
    logfile = log_path(ws_path, mp)
    read_end, write_end = os.pipe()
    with open(logfile, "ab") as log:
        log_start = log.tell()  # this run's part of the log (it is appended to across mounts)
        cmd = daemon_command(ws_path, mp, debug, require_read, auto_step, allow_other, keep_last, warn_size,
                             excludes, default_excludes) + ["--ready-fd", str(write_end)]
        # A process group of its own (no terminal signal reaches it: it
        # is never the foreground group), but the caller's session, not a
        # new one: a session is a scheduler autogroup, and a daemon in a
        # group apart from its clients is not run in turn with them on
        # each round trip (the CPU idles and is woken for every request;
        # a first git status of 2,000 files took about twice as long).
        proc = subprocess.Popen(
            cmd, pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            process_group=0, cwd="/",
        )
    os.close(write_end)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        got = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], 0.2)
            if ready:
                chunk = os.read(read_end, 64)
                got += chunk
                if b"ready" in got or not chunk:
                    break
            if proc.poll() is not None:
                break
    finally:
        os.close(read_end)
    if b"ready" in got:
        return proc.pid
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    cause = _fuse_cause(logfile, log_start)
    if cause is not None:
        raise DaemonError(f"the mount daemon could not mount {mp}: {cause}; make sure /dev/fuse exists and this "
                          f"user may open it (install fuse3, join the group that owns /dev/fuse, or give a "
                          f"container --device /dev/fuse) (log: {logfile}).")
    raise DaemonError(f"the mount daemon did not start: {_last_line(logfile)} (log: {logfile}).")


def _fuse_cause(path: str, start: int = 0) -> str | None:
    """libfuse's or fusermount3's own reason for a failed mount, as it
    wrote it to the daemon's stderr (the log) from offset ``start``: the
    daemon itself only learns a return code."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    causes = [ln.strip() for ln in text.splitlines() if ln.startswith(("fuse:", "fusermount"))]
    return causes[-1] if causes else None


def check_excludes(excludes) -> None:
    """Refuse an ``--exclude`` pattern stepfs will not use, with the reason."""
    from stepfs.store.ignorefile import BadPattern, parse
    from stepfs.store.errors import ContainmentError

    try:
        parse(excludes)
    except BadPattern as exc:  # the only refusal: a pattern that reads as leaving the workspace
        raise ContainmentError(f"--exclude: {exc}.") from None


def daemon_command(ws_path: str, mp: str, debug: bool, require_read: bool, auto_step: str,
                   allow_other: bool, keep_last: int | None = None, warn_size: int | None = None,
                   excludes: list[str] = (), default_excludes: bool = True) -> list[str]:
    """The daemon's command line: this interpreter, so it imports the same
    installed ``stepfs`` as this process."""
    cmd = [sys.executable, "-m", "stepfs.overlayfs.daemon.main", ws_path, mp]
    if debug:
        cmd.append("--debug")
    if require_read:
        cmd.append("--require-read")
    if auto_step != "manual":
        cmd += ["--auto-step", auto_step]
    if allow_other:
        cmd.append("--allow-other")
    if keep_last is not None:  # prune after each step (overlayfs/daemon/retention.py)
        cmd += ["--keep-last", str(keep_last)]
    if warn_size is not None:
        cmd += ["--warn-size", str(warn_size)]
    for pattern in excludes:  # '=' keeps a pattern starting with '-' an argument
        cmd.append(f"--exclude={pattern}")
    if not default_excludes:
        cmd.append("--no-default-excludes")
    return cmd


def serve_foreground(workspace: str, mountpoint: str, debug: bool = False, require_read: bool = False,
                     auto_step: str = "manual", allow_other: bool = False, keep_last: int | None = None,
                     warn_size: int | None = None, new_history: bool = False, excludes: list[str] = (),
                     default_excludes: bool = True) -> NoReturn:
    """``stepfs mount --foreground``: check the arguments as :func:`mount`
    does, then become the daemon (exec, same pid), attached to this terminal
    until unmounted."""
    check_excludes(excludes)
    ws_path, mp = _prepare_mount(workspace, mountpoint, auto_step, allow_other, new_history)
    sys.stdout.flush()
    sys.stderr.flush()
    cmd = daemon_command(ws_path, mp, debug, require_read, auto_step, allow_other, keep_last, warn_size,
                         excludes, default_excludes)
    os.execv(cmd[0], cmd)


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith("stepfs:") or "Error" in line or "error" in line:
            return line.strip()
    return lines[-1].strip() if lines else "no output"


def fuse_connection(mountpoint: str) -> str | None:
    """The fusectl connection id (device minor) of a mount, from mountinfo
    (never stat a possibly dead mount)."""
    target = os.path.normpath(os.path.abspath(mountpoint))
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and mounts._unescape(parts[4]) == target:
                return parts[2].split(":")[1]
    return None


def abort_connection(mountpoint: str) -> bool:
    """Abort a FUSE connection through fusectl: every pending and future
    request fails with ENOTCONN, so no client stays stuck."""
    import subprocess

    conn = fuse_connection(mountpoint)
    if conn is None:
        return False
    base = "/sys/fs/fuse/connections"
    if not os.path.exists(os.path.join(base, conn)):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", base], capture_output=True)
    try:
        with open(os.path.join(base, conn, "abort"), "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def unmount(mountpoint: str, force: bool = False) -> None:
    """Unmount a stepfs mount and wait until its daemon has exited."""
    import shutil
    import subprocess
    import time

    mp = os.path.normpath(os.path.abspath(mountpoint))
    entry = mounts.find(mp)
    if entry is None or entry.workspace is None:
        raise NotMountedError(f"{mp} is not a stepfs mount; 'stepfs status' lists the mounts of a workspace.")
    run_dir = os.path.join(entry.workspace, STORE_DIR, "run")
    tool = shutil.which("fusermount3") or "fusermount3"
    # fusermount3 would succeed here while another namespace's copy keeps
    # the daemon serving: refuse as for a busy mount, or cut them all off.
    elsewhere = mounts.holders_elsewhere(mp)
    if elsewhere and not force:
        pids = ", ".join(map(str, elsewhere[:5])) + (", …" if len(elsewhere) > 5 else "")
        raise DaemonError(
            f"cannot unmount {mp}: processes left by 'stepfs run' still use it (pid {pids}); "
            "end them or use 'stepfs unmount --force'."
        )
    if elsewhere:
        abort_connection(mp)
    result = subprocess.run([tool, "-u", mp], capture_output=True, text=True)
    if result.returncode != 0:
        if not force:
            reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "unknown reason"
            raise DaemonError(
                f"cannot unmount {mp} ({reason}); close the programs using it or use 'stepfs unmount --force'."
            )
        abort_connection(mp)
        subprocess.run([tool, "-u", "-z", mp], capture_output=True)
    deadline = time.monotonic() + EXIT_TIMEOUT
    while time.monotonic() < deadline:
        pid = daemon_alive(run_dir, mp)
        if pid is None:
            return
        time.sleep(0.05)
    pid = daemon_alive(run_dir, mp)
    if pid and force:
        os.kill(pid, 9)
        return
    raise DaemonError(f"the daemon of {mp} (pid {pid}) did not exit within {EXIT_TIMEOUT:.0f} s; use --force.")


# -- steps -------------------------------------------------------------------------


def discard(target: Target, paths: list[str]) -> list[str]:
    """Drop staged paths from open steps (the mount's own with a mountpoint
    target, every open step with a workspace target), keeping the bytes of
    those whose workspace path changed since they were staged as
    ``discarded`` conflicts (``store.staging.discard``).  Returns the dropped paths (workspace-relative).
    A path that is not staged is simply not in the result."""
    if target.mountpoint is not None and daemon_for(target) is not None:
        # The daemon checks the paths as below (history.user_path) against
        # the store it has open: nothing to import or open here.
        answer = control.request(target.mountpoint, {"op": "discard", "user_paths": list(paths)})
        return sorted({p.lstrip("/") for p in answer["discarded"]})
    from stepfs.store import refs, staging, tokens
    from stepfs.store.workspace import Workspace

    from stepfs.store import history

    dropped: set[str] = set()
    with Workspace.open(target.workspace) as ws:
        rels = [history.user_path(ws, p, target.mountpoint) for p in paths]
        with ws.db.read() as conn:
            steps = staging.list_steps(conn)
        live = {m.mountpoint for m in mounts.stepfs_mounts(ws.path)}
        for st in steps:
            mp = st["mountpoint"]
            if target.mountpoint is not None and mp != target.mountpoint:
                continue
            if mp in live and daemon_alive(ws.run_dir, mp):
                answer = control.request(mp, {"op": "discard", "paths": ["/" + os.fsdecode(r) for r in rels]})
                dropped.update(p.lstrip("/") for p in answer["discarded"])
            else:
                with ws.commit_lock(), ws.db.write() as conn:
                    refs.import_refs(ws, conn, st["id"])  # discarded bytes are kept as objects
                    for r in rels:
                        dropped.update(os.fsdecode(p) for p in staging.discard(
                            conn, st["id"], r, mount=mp, token_now=lambda p: tokens.of_workspace(ws, p)))
    return sorted(dropped)


def step(target: Target, message: str = "", meta: dict | None = None, allow_empty: bool = False,
         overwrite: list[str] = (), ws=None) -> list[int]:
    """Commit open steps as layers; returns the new layer numbers.

    A mountpoint target commits that mount's step (through its daemon).  A
    workspace target commits every open step that has changes: live mounts
    through their daemons, steps of dead daemons straight from the store
    (``ws``: the target's Workspace, already open in the caller, used
    instead of opening it again).
    """
    over = [os.fsencode(p.strip("/")) for p in overwrite]
    payload = {"op": "commit", "message": message, "meta": meta or {}, "allow_empty": allow_empty,
               "overwrite": [os.fsdecode(p) for p in over]}
    if target.mountpoint is not None:
        answer = control.request(target.mountpoint, payload)
        for warning in answer.get("warnings", []):  # the store over the size set at mount
            print(f"stepfs: warning: {warning}", file=sys.stderr)
        return [answer["number"]]
    numbers = _step_live_mounts(target.workspace, payload)
    if numbers:
        return numbers
    if ws is not None:
        return _step_store(ws, payload, over, message, meta, allow_empty)
    from stepfs.store.workspace import Workspace

    with Workspace.open(target.workspace) as opened:
        return _step_store(opened, payload, over, message, meta, allow_empty)


def _step_store(ws, payload: dict, over: list[bytes], message: str, meta: dict | None,
                allow_empty: bool) -> list[int]:
    """``step`` of a workspace target once no live daemon took it: each open
    step through its live daemon, or straight from the store."""
    from stepfs.store import publish, staging

    numbers: list[int] = []
    nothing: NothingToCommit | None = None
    with ws.db.read() as conn:
        steps = staging.list_steps(conn)
    live = {m.mountpoint for m in mounts.stepfs_mounts(ws.path)}
    for st in steps:
        mp = st["mountpoint"]
        try:
            if mp in live and daemon_alive(ws.run_dir, mp):
                numbers.append(control.request(mp, payload)["number"])
            elif st["staged"]:
                numbers.append(publish.commit_step(
                    ws, st["id"], message=message, mount=mp, meta=meta, allow_empty=allow_empty,
                    overwrite=set(over)))
        except NothingToCommit as exc:
            nothing = exc
    if not numbers and allow_empty:
        numbers.append(publish.record_empty(ws, message=message, meta=meta))
    if not numbers:
        raise nothing or NothingToCommit(
            "nothing to commit: no mount of this workspace has staged changes (use --allow-empty to record an empty layer)."
        )
    return numbers


def _step_live_mounts(workspace: str, payload: dict) -> list[int]:
    """Commit a workspace through its live daemons alone, without opening
    the store here (the database layer is most of a CLI start-up).  Returns
    the new layer numbers, or ``[]`` when this fast path does not apply: no
    live daemon, a daemon that cannot list the open steps, a dead mount's
    step with staged changes (only the store can commit that), or nothing
    committed (the caller then reports it, or records an empty layer)."""
    run_dir = os.path.join(workspace, STORE_DIR, "run")
    alive = [m.mountpoint for m in mounts.stepfs_mounts(workspace) if daemon_alive(run_dir, m.mountpoint)]
    if not alive:
        return []
    try:
        steps = control.request(alive[0], {"op": "steps"}, timeout=10.0)["steps"]
    except (DaemonError, KeyError, TypeError):
        return []
    if any(st["staged"] and st["mountpoint"] not in alive for st in steps):
        return []
    numbers: list[int] = []
    for st in steps:
        if st["mountpoint"] in alive:
            try:
                numbers.append(control.request(st["mountpoint"], payload)["number"])
            except NothingToCommit:
                pass
    return numbers


# -- rollback ----------------------------------------------------------------------


def _open_steps_with_changes(ws: Workspace) -> int:
    from stepfs.store import staging

    sync_rows(ws)
    with ws.db.read() as conn:
        return sum(1 for st in staging.list_steps(conn) if st["staged"])


def invalidate_mounts(ws: Workspace, paths: list[bytes]) -> dict:
    """Tell every live mount of ``ws`` that ``paths`` changed in the
    workspace under it; returns ``{"invalidated": [mountpoints],
    "unreachable": [mountpoints]}``.  A mount that does not answer only
    serves cached attributes until its timeouts expire (the inotify watch
    of a live daemon usually tells it sooner), so this never fails the
    caller."""
    view_paths = ["/" + os.fsdecode(p) for p in paths]
    view_paths += ["/.stepfs/layers", "/.stepfs/layers/latest"]
    out: dict[str, list[str]] = {"invalidated": [], "unreachable": []}
    for m in mounts.stepfs_mounts(ws.path):
        if not daemon_alive(ws.run_dir, m.mountpoint):
            continue
        try:
            control.request(m.mountpoint, {"op": "invalidate", "paths": view_paths}, timeout=60.0)
            out["invalidated"].append(m.mountpoint)
        except DaemonError:
            out["unreachable"].append(m.mountpoint)
    return out


def rollback(target: Target, number: int, paths: list[str] = (), dry_run: bool = False,
             skip_conflicts: bool = False, expect_head: int | None = None) -> dict:
    """Roll the workspace of ``target`` back to layer ``number``.

    Order: check the layer exists; commit every open step with changes (live
    mounts through their daemons, dead ones from the store) so nothing
    staged is thrown away; run ``store.rollback.rollback``; then invalidate
    every live mount so processes in it see the result as soon as this
    returns.  A dry run commits nothing and changes nothing; its card does
    not include staged changes (``open_steps_with_changes`` counts them).
    Paths are user paths (``store.history.user_path``).  With
    ``expect_head`` (the head a preview was made against) it raises
    HeadMoved, changing nothing, if the head is another layer; staged
    changes it commits itself first do not count as a move.
    """
    from stepfs.store import history, layers
    from stepfs.store import rollback as store_rollback
    from stepfs.store.errors import HeadMoved
    from stepfs.store.workspace import Workspace

    with Workspace.open(target.workspace) as ws:
        rels = [history.user_path(ws, p, target.mountpoint, allow_root=True) for p in paths] or None
        with ws.db.read() as conn:
            history.require_layer(conn, number)
            if expect_head is not None and layers.head(conn) != expect_head:
                now = layers.head(conn)
                raise HeadMoved(f"the history moved from layer {expect_head} to layer {now} since this rollback "
                                f"was previewed; nothing was written: look at the new preview and try again.", now)
        committed: list[int] = []
        if not dry_run and _open_steps_with_changes(ws):
            try:
                committed = step(Target(ws.path), message=f"staged changes, committed before rollback to {number}")
            except NothingToCommit:
                pass
        if committed and expect_head is not None:
            expect_head = max(committed)
        pending = _open_steps_with_changes(ws) if dry_run else 0
        result = store_rollback.rollback(ws, number, rels, dry_run=dry_run, skip_conflicts=skip_conflicts,
                                         mount=target.mountpoint or "", expect_head=expect_head)
        seen = {"invalidated": [], "unreachable": []}
        if result.layer is not None:
            # Each mount also makes the kernel look the names up again (a
            # name whose kind changed included: libfuse.notify.KernelCache).
            seen = invalidate_mounts(ws, result.paths)
        return {
            "number": number, "head_before": result.head, "layer": result.layer, "dry_run": dry_run,
            "committed_first": committed, "open_steps_with_changes": pending,
            "skipped": [c.as_dict() for c in result.skipped], "card": result.card, **seen,
        }


__all__ = ["Target", "resolve", "mount", "unmount", "status", "step", "rollback", "invalidate_mounts",
           "abort_connection"]
