"""Steps, syncs and clones of a workspace attached to a shared history,
run in the CLI's process (library calls; ``store.shared`` does the work).

The mount daemon never talks to the history server: a step through a
mount is, here, (1) the history's lock, (2) the daemons' staged rows
written, (3) a pull of what other workspaces published (refused as a
whole if they touched a path this workspace changed), with every live
mount told which paths changed, (4) the local commit through the daemon
as for any step, (5) the push of the new layer by compare-and-swap on the
head.  A server that is unreachable at (1) or (3) fails the step with
nothing written; at (5) the layer is committed here and published by the
next ``stepfs step`` or ``stepfs sync``.
"""

from __future__ import annotations

import os

from stepfs.store.errors import HeadMoved, HistoryError, HistoryUnreachable, NothingToCommit
from stepfs.store.shared import attachment, sync
from stepfs.store.shared.connecting import Connecting
from stepfs.store.shared.remote import Remote
from stepfs.store.shared.url import HistoryURL, from_environment
from stepfs.store.workspace import Workspace

from stepfs.overlayfs.client import manage
from stepfs.overlayfs.client.reads import sync_rows


def _url_for(ws: Workspace, given: str | None) -> HistoryURL:
    att = attachment.read(ws)
    url = from_environment(given)
    if url is None:
        if att is None:
            raise HistoryError(f"{ws.path} is not attached to a shared history; name one with --history URL "
                               f"(or STEPFS_HISTORY).")
        return att.url
    return url


def _connecting(workspace: str, given: str | None) -> Connecting:
    """Start connecting to the history the workspace is likely attached to
    while the caller opens the workspace (``store/shared/connecting.py``)."""
    try:
        guess = from_environment(given) or attachment.peek(workspace)
    except HistoryError:
        guess = None  # the same URL is parsed again, and refused, once the workspace is open
    return Connecting(guess)


def _locked(remote: Remote, ws: Workspace):
    """The history's lock, the head and this workspace's published layers
    read with it (one query) when the workspace is attached already."""
    att = attachment.read(ws)
    return remote.lock(att.workspace if att is not None and att.url.name == remote.name else None)


def _new_workspace_check(workspace: str, url: HistoryURL | None) -> None:
    """A directory that is no workspace yet becomes one only to make a new
    history: refuse before its store is made if the history exists."""
    from stepfs.store.paths import is_workspace

    if url is None or is_workspace(os.path.realpath(workspace)):
        return
    with Remote.open(url) as remote:
        if remote.head() is not None:
            raise HistoryError(f"the shared history {url.display} exists already; make a workspace of it with "
                               f"'stepfs clone URL DIR' (a workspace with its own files cannot join it).")


def attach(workspace: str, given: str | None) -> dict:
    """Attach the workspace to the history (``mount --history``)."""
    _new_workspace_check(workspace, from_environment(given))
    with Workspace.open(workspace, create=True) as ws:
        url = _url_for(ws, given)
        with Remote.open(url) as remote, remote.lock():
            att = sync.attach(ws, url, remote)
            return {"history": url.display, "workspace_id": att.workspace, "head": remote.head()}


def _pull(ws: Workspace, remote: Remote, att) -> list[sync.Pulled]:
    sync_rows(ws)  # what the daemons hold in memory counts as changed here
    pulled = sync.pull(ws, remote, att)
    paths = sorted({p for done in pulled for p in done.paths})
    if paths:
        manage.invalidate_mounts(ws, paths)
    return pulled


def _push(ws: Workspace, remote: Remote, att) -> tuple[list[sync.Pulled], list[tuple[int, int]]]:
    """Publish, taking what another workspace published first when the
    head moved under us (an SQLite history has no lock; a lost
    PostgreSQL lock likewise); returns (pulled meanwhile, pushed)."""
    pulled: list[sync.Pulled] = []
    for _ in range(PUSH_TRIES - 1):
        try:
            return pulled, sync.push(ws, remote, att)
        except HeadMoved:
            pulled += _pull(ws, remote, att)
    return pulled, sync.push(ws, remote, att)


#: How often a push that lost the head's compare-and-swap pulls and tries again.
PUSH_TRIES = 5


def _pulled(pulled: list[sync.Pulled]) -> list[dict]:
    return [{"shared": p.shared, "local": p.local, "paths": [os.fsdecode(x) for x in p.paths]} for p in pulled]


def sync_workspace(target: manage.Target, given: str | None = None) -> dict:
    """``stepfs sync``: pull, then publish what was not published yet
    (with a URL given, a plain directory is made a workspace and attached)."""
    _new_workspace_check(target.workspace, from_environment(given))
    with _connecting(target.workspace, given) as early, \
            Workspace.open(target.workspace, create=from_environment(given) is not None) as ws:
        url = _url_for(ws, given)
        with early.remote(url) as remote, _locked(remote, ws):
            att = sync.attach(ws, url, remote)
            pulled = _pull(ws, remote, att)
            more, pushed = _push(ws, remote, att)
            pulled += more
            return {"history": url.display, "head": remote.head(), "pulled": _pulled(pulled),
                    "published": [{"local": n, "shared": s} for n, s in pushed]}


def step(target: manage.Target, given: str | None = None, **options) -> dict:
    """``stepfs step`` on an attached workspace (see the module doc)."""
    with _connecting(target.workspace, given) as early, Workspace.open(target.workspace) as ws:
        url = _url_for(ws, given)
        with early.remote(url) as remote, _locked(remote, ws):
            att = sync.attach(ws, url, remote)
            pulled = _pull(ws, remote, att)
            nothing = None
            try:
                numbers = manage.step(target, ws=ws, **options)
            except NothingToCommit as exc:
                numbers, nothing = [], exc
            # A daemon answers before its layer's "committed" record, which it
            # writes holding the commit lock: wait for it, or the layer looks pending.
            with ws.commit_lock():
                pass
            try:
                more, pushed = _push(ws, remote, att)
                pulled += more
            except HistoryUnreachable as exc:
                if not numbers:
                    raise
                late = HistoryUnreachable(
                    f"layer {numbers[-1]} is committed in this workspace but not published: {exc}")
                late.committed = numbers  # the caller's step is done (stepfs run says so)
                raise late from None
            if nothing is not None and not pushed:
                raise nothing
            return {"numbers": numbers, "history": url.display, "pulled": _pulled(pulled),
                    "published": [{"local": n, "shared": s} for n, s in pushed]}


def is_attached(workspace: str) -> bool:
    return attachment.attached(workspace)


def rollback(target: manage.Target, given: str | None, number: int, paths: list[str] = (),
             dry_run: bool = False) -> dict:
    """``stepfs rollback --history URL N``: under the history's lock, bring
    the workspace to the head (pull, commit what is staged, publish), then
    write the state of shared layer ``number`` as a local rollback layer,
    tell the live mounts, and publish it.  A dry run reads the history only."""
    from stepfs.store.shared import rollback as shared_rollback
    from stepfs.store.shared.reads import history_path

    rels = [history_path(p, allow_root=True) for p in paths] or None
    with _connecting(target.workspace, given) as early, Workspace.open(target.workspace) as ws:
        url = _url_for(ws, given)
        with early.remote(url) as remote, _locked(remote, ws):
            att = sync.attach(ws, url, remote)
            if dry_run:
                res = shared_rollback.rollback(ws, remote, att, number, rels, dry_run=True)
                return {"number": number, "head_before": res.head, "layer": None, "shared": None, "dry_run": True,
                        "paths": [os.fsdecode(p) for p in res.paths], "history": url.display,
                        "committed_first": [], "pulled": [], "published": []}
            shared_rollback.plan(remote, number, rels)  # refused (no layer, nothing to do) before anything is written
            pulled = _pull(ws, remote, att)
            try:
                committed = manage.step(manage.Target(ws.path), ws=ws,
                                        message=f"staged changes, committed before rollback to shared layer {number}")
            except NothingToCommit:
                committed = []
            with ws.commit_lock():  # the daemon's "committed" record (see step)
                pass
            more, pushed = _push(ws, remote, att)
            res = shared_rollback.rollback(ws, remote, att, number, rels, mount=target.mountpoint or "")
            seen = manage.invalidate_mounts(ws, res.paths)
            try:
                more2, pushed2 = _push(ws, remote, att)
            except HistoryUnreachable as exc:
                late = HistoryUnreachable(f"layer {res.layer} (the rollback) is committed in this workspace but not "
                                          f"published: {exc}")
                late.committed = [res.layer]
                raise late from None
            published = [{"local": n, "shared": s} for n, s in pushed + pushed2]
            return {"number": number, "head_before": res.head, "layer": res.layer,
                    "shared": next((s for n, s in pushed + pushed2 if n == res.layer), None), "dry_run": False,
                    "paths": [os.fsdecode(p) for p in res.paths], "history": url.display,
                    "committed_first": committed, "pulled": _pulled(pulled + more + more2), "published": published,
                    **seen}
