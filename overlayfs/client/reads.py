"""``status``, ``log`` and ``show`` as library calls, answered by a live
mount's daemon when there is one (no FUSE import, no database import on
that path).

A daemon has the store open; asking it over the control channel costs a
round trip, where opening the store here costs the database layer's
imports (most of a CLI start-up).  Each answer has one implementation, a
store function (``store.status.read_status``, ``store.cards.read_log``,
``store.cards.read_card``); the daemon's handler and the direct path below
call the same one, and this module only decides where it runs.  A daemon
that cannot answer (gone meanwhile, or older and without the request) is
not an error: the store is opened here instead.  With no daemon, ``log``
and ``show`` read the store through stdlib ``sqlite3`` (``store.cardrows``)
when it can be read as it is, with the same card functions.  A *target* is
``manage.Target`` (workspace, mountpoint or None).
"""

from __future__ import annotations

import os
TYPE_CHECKING = False  # no typing import on the CLI's light path

from stepfs.store.errors import DaemonError, StepfsError
from stepfs.store.paths import STORE_DIR

from stepfs.overlayfs.client import control, mounts
from stepfs.overlayfs.daemon.protocol import daemon_alive

if TYPE_CHECKING:
    from stepfs.store.workspace import Workspace


def live_daemons(workspace: str) -> dict[str, int | None]:
    """Mountpoint -> daemon pid (None: dead) of every mount of ``workspace``
    in the mount table; a file lock per mount, no store opened."""
    run_dir = os.path.join(workspace, STORE_DIR, "run")
    return {m.mountpoint: daemon_alive(run_dir, m.mountpoint) for m in mounts.stepfs_mounts(workspace)}


def daemon_for(target, alive: dict[str, int | None] | None = None) -> str | None:
    """The mount whose daemon answers for ``target``: its own mount if that
    daemon is alive, else (a workspace target) any live mount of the
    workspace, else None.  ``STEPFS_DIRECT=1`` in the environment makes it
    None always: the store is opened here, as with no mount live (to rule
    a daemon out when something looks wrong; the tests compare the two)."""
    if os.environ.get("STEPFS_DIRECT"):
        return None
    alive = live_daemons(target.workspace) if alive is None else alive
    if target.mountpoint is not None:
        return target.mountpoint if alive.get(target.mountpoint) else None
    return next((mp for mp in sorted(alive) if alive[mp]), None)


def _ask(mountpoint: str, payload: dict) -> dict | None:
    """The daemon's answer, or None if it cannot give one (the caller then
    opens the store); a domain error it raised is raised here."""
    try:
        return control.request(mountpoint, payload)
    except DaemonError:
        return None


def sync_rows(ws: Workspace, mountpoint: str | None = None) -> None:
    """Ask every live daemon of ``ws`` (or the one of ``mountpoint``) to
    write the staged rows it recorded but has not written yet, so that the
    store shows what the mounts show (``view.py``, "Staged rows and
    crashes").  A daemon that does not answer has nothing to add."""
    _sync(ws.path, mountpoint)


def _sync(workspace: str, mountpoint: str | None, skip: str | None = None) -> None:
    for mp, pid in live_daemons(workspace).items():
        if (mountpoint is not None and mp != mountpoint) or mp == skip or not pid:
            continue
        try:
            control.request(mp, {"op": "sync"}, timeout=60.0)
        except StepfsError as exc:
            import logging

            logging.getLogger("stepfs.manage").warning("could not sync the staged rows of %s: %s", mp, exc)


def daemon_state(mountpoint: str, alive) -> dict:
    """Asked of a live mount's daemon: why it went read-only (kept in memory:
    the disk may be too full to write it anywhere), the runs started in it
    and whether they are confined (``runs.py``): ``confined`` is True if
    every live run is, False if one is not, None if no run is live."""
    answer = {}
    if alive:
        try:
            answer = control.request(mountpoint, {"op": "ping"}, timeout=5.0)
        except DaemonError:
            pass
    runs = answer.get("runs") or []
    return {"readonly": answer.get("readonly"), "runs": runs, "unversioned": answer.get("unversioned"),
            "confined": all(r.get("confined") for r in runs) if runs else None}


def status(target) -> dict:
    """Mounts of the workspace, each open step's staged paths, the conflicts."""
    alive = live_daemons(target.workspace)
    raw, asked = None, daemon_for(target, alive)
    if asked is not None:
        _sync(target.workspace, target.mountpoint, skip=asked)  # the asked daemon writes its own
        answer = _ask(asked, {"op": "read_status", "mountpoint": target.mountpoint})
        if answer is not None:
            raw = answer["status"]
    if raw is None:
        from stepfs.store.status import read_status
        from stepfs.store.workspace import Workspace

        with Workspace.open(target.workspace) as ws:
            _sync(ws.path, target.mountpoint)
            raw = read_status(ws, target.mountpoint)
    out = {"workspace": raw["workspace"], "mounts": [], "conflicts": raw["conflicts"], "head": raw["head"]}
    for step in raw["steps"]:
        mp = step["mountpoint"]
        live = mp in alive
        pid = alive[mp] if live else daemon_alive(os.path.join(target.workspace, STORE_DIR, "run"), mp)
        if not live and not step["staged"]:
            continue
        out["mounts"].append({
            "mountpoint": mp, "mounted": live, "pid": pid, "step": step["step"],
            **daemon_state(mp, live and pid), "staged": step["staged"],
        })
    return out


def log(target, limit: int | None = None, fold: bool = True) -> list[dict]:
    """``store.cards.read_log`` of the target's workspace."""
    asked = daemon_for(target)
    answer = _ask(asked, {"op": "log", "limit": limit, "fold": fold}) if asked else None
    if answer is not None:
        return answer["layers"]
    from stepfs.store import cards

    direct = _read_only(target.workspace, lambda rows: cards.log_of(rows, limit=limit, fold=fold))
    if direct is not None:
        return direct
    from stepfs.store.workspace import Workspace

    with Workspace.open(target.workspace) as ws:
        return cards.read_log(ws, limit=limit, fold=fold)


def card(target, number: int, with_patch: bool = False, fold: bool = True) -> tuple[dict, str | None]:
    """``store.cards.read_card`` of the target's workspace."""
    asked = daemon_for(target)
    answer = _ask(asked, {"op": "card", "number": number, "patch": with_patch, "fold": fold}) if asked else None
    if answer is not None:
        return answer["card"], answer["patch"]
    from stepfs.store import cards

    if not with_patch:  # the patch is made by store.diff, on the workspace
        direct = _read_only(target.workspace, lambda rows: cards.card_at(rows, number, fold=fold))
        if direct is not None:
            return direct, None
    from stepfs.store.workspace import Workspace

    with Workspace.open(target.workspace) as ws:
        return cards.read_card(ws, number, with_patch=with_patch, fold=fold)


def _read_only(workspace: str, answer):
    """``answer(rows)`` on a read-only stdlib ``sqlite3`` connection to the
    store of ``workspace`` (``store.cardrows``: no database layer to import),
    or None when the store has to be opened as a workspace: a store that
    needs recovery, another format, or a database ``sqlite3`` cannot read
    as it is (that path then reports or repairs it).  A domain error
    (no such layer) is the answer and is raised."""
    import sqlite3

    from stepfs.store.cardrows import open_readonly

    session = open_readonly(workspace)
    if session is None:
        return None
    try:
        with session as rows:
            return answer(rows)
    except sqlite3.Error:
        return None
