"""``stepfs sync``, ``stepfs clone``, ``stepfs verify-history``, and the shared-history forms of
``step``, ``log`` and ``show`` (``--history URL`` or ``STEPFS_HISTORY``;
a step on an attached workspace publishes by itself).  Output only; the
work is ``overlayfs.client.shared`` and ``store.shared``."""

from __future__ import annotations

import json
import os
import time

from stepfs.cli.render import quote

HISTORY_HELP = "a shared history: postgresql://USER@HOST/DATABASE?name=NAME (default: STEPFS_HISTORY)"
SYNC_HELP = "Bring a workspace attached to a shared history to its head, and publish its layers not yet published."
CLONE_HELP = "Make a new workspace in DIR holding a shared history as of layer N (default: its head), attached to it."
GC_HELP = ("Delete the objects and chunks no layer of a shared history's database names (left by steps cut off "
           "between their upload and their layer); waits for the steps in progress.")
VERIFY_HELP = "Check a shared history: re-hash every chunk and object, check that its layers run 0..head."


def _emit(args, obj: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))
    elif text:
        print(text)


def add_history_option(sp) -> None:
    sp.add_argument("--history", metavar="URL", help=HISTORY_HELP)


def wanted(args) -> bool:
    """Whether a log/show names a shared history (option or environment)."""
    return bool(getattr(args, "history", None) or os.environ.get("STEPFS_HISTORY"))


def attach_if_asked(args) -> None:
    """``mount --history URL`` (or STEPFS_HISTORY): attach before mounting."""
    if wanted(args):
        from stepfs.overlayfs.client import shared

        shared.attach(args.workspace, args.history)


def attach_for_run(args) -> None:
    """``stepfs run --history URL`` (or STEPFS_HISTORY): attach the
    workspace the command runs in before it is mounted."""
    if not wanted(args):
        return
    from stepfs.overlayfs.client import manage, shared
    from stepfs.store.errors import WorkspaceError

    where = args.workspace if args.workspace is not None else os.getcwd()
    try:
        where = manage.resolve(where).workspace
    except WorkspaceError:
        pass  # a plain directory: attaching makes it a workspace and the history
    shared.attach(where, args.history)


def step_attached(args, target) -> bool:
    """Whether ``stepfs step`` goes through the shared history."""
    from stepfs.store.shared.attachment import attached  # light: no database layer on a step's fast path

    return wanted(args) or attached(target.workspace)


def _published_text(res: dict) -> list[str]:
    lines = [f"took shared layer {p['shared']} as layer {p['local']} ({len(p['paths'])} path(s))" for p in res["pulled"]]
    lines += [f"published layer {p['local']} as shared layer {p['shared']} of {res['history']}" for p in res["published"]]
    return lines


def cmd_step_shared(args, target, meta: dict) -> int:
    from stepfs.overlayfs.client import shared

    res = shared.step(target, args.history, message=args.message or "", meta=meta, allow_empty=args.allow_empty,
                      overwrite=args.overwrite or [])
    numbers = res["numbers"]
    _emit(args, {"message_type": "step", "number": numbers[-1] if numbers else None, "numbers": numbers, **res},
          "\n".join([*(str(n) for n in numbers), *_published_text(res)]))
    return 0


def cmd_sync(args) -> int:
    from stepfs.overlayfs.client import manage, shared
    from stepfs.store.errors import WorkspaceError

    try:
        target = manage.resolve(args.workspace)
    except WorkspaceError:
        if not (wanted(args) and args.workspace and os.path.isdir(args.workspace)):
            raise
        target = manage.Target(os.path.realpath(args.workspace))  # a plain directory: attaching makes it a workspace
    res = shared.sync_workspace(target, args.history)
    lines = _published_text(res) or [f"up to date with {res['history']} (head: layer {res['head']})"]
    _emit(args, {"message_type": "sync", **res}, "\n".join(lines))
    return 0


def cmd_clone(args) -> int:
    from stepfs.store.shared import sync
    from stepfs.store.shared.url import parse

    path, number, local = sync.clone(parse(args.url), args.directory, args.at)
    _emit(args, {"message_type": "clone", "workspace": path, "layer": number, "local_layer": local},
          f"cloned layer {number} into {quote(path)}")
    return 0


def open_remote(args):
    """The history ``--history`` (or STEPFS_HISTORY) names, opened for a
    command that publishes no step (show, cat, diff, verify, gc, prune)."""
    from stepfs.store.shared import stall
    from stepfs.store.shared.remote import Remote
    from stepfs.store.shared.url import from_environment

    return Remote.open(from_environment(args.history), hint=stall.RETRY_HINT)


_remote = open_remote


def _row(layer, counts) -> dict:
    a, m, d = counts.get(layer.number, (0, 0, 0))
    return {**layer.as_dict(), "added": a, "modified": m, "deleted": d,
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(layer.created_ns / 1e9))}


def cmd_log_shared(args) -> int:
    from stepfs.store.errors import HistoryError
    from stepfs.store.shared.url import from_environment

    url = from_environment(args.history)
    display = url.display
    # One query: a long history costs one round trip (--limit 0 still asks for
    # one layer, to tell an empty answer from a history that does not exist).
    limit = None if args.limit is None else max(args.limit, 1)
    if url.dialect == "postgresql":
        from stepfs.store.shared import logread  # psycopg alone: no SQLAlchemy to import

        found = logread.read(url, limit)
    else:
        from stepfs.store.shared.remote import Remote

        from stepfs.store.shared import stall

        with Remote.open(url, hint=stall.RETRY_HINT) as remote:
            found = remote.log(limit)
    if not found:
        raise HistoryError(f"the shared history {display} does not exist; attach a workspace to make "
                           f"it ('stepfs sync WS --history URL').")
    rows = [_row(r, {r.number: c}) for r, c in found[:args.limit]]
    lines = [f"{r['number']:>4}  {r['time']}  {r['kind']:<8}  files +{r['added']} ~{r['modified']} -{r['deleted']}"
             f"  {quote(r['host'])}:{quote(r['workspace_path'])}"
             f"{'  [' + quote(r['agent']) + ']' if r['agent'] else ''}  {quote(r['message'])}" for r in rows]
    _emit(args, {"message_type": "log", "history": display, "layers": rows}, "\n".join(lines))
    return 0


def _op(e: dict) -> str:
    if e["before_kind"] is None:
        return "added"
    if e["after_kind"] is None:
        return "deleted"
    return "replaced" if e["before_kind"] != e["after_kind"] else "modified"


def cmd_show_shared(args, number: int) -> int:
    from stepfs.store.shared import prune

    with _remote(args) as remote:
        layer = remote.layer(number)
        if layer.kind == prune.PRUNED:
            raise prune.pruned_error(remote, number)
        entries = remote.entries(number)
        counts = remote.counts([number])
    row = _row(layer, counts)
    files = [{"path": os.fsdecode(e["path"]), "op": _op(e), "before_kind": e["before_kind"],
              "after_kind": e["after_kind"]} for e in entries]
    lines = [f"layer {number}  {row['time']}  {row['kind']}  by {quote(row['host'])}:{quote(row['workspace_path'])}"
             f"{'  [' + quote(row['agent']) + ']' if row['agent'] else ''}  {quote(row['message'])}"]
    lines += [f"  {f['op']:<8} {quote(f['path'])}" for f in files]
    _emit(args, {"message_type": "show", **row, "files": files}, "\n".join(lines))
    return 0


def cmd_cat_shared(args, number: int, path: str) -> bytes:
    from stepfs.store.shared import reads

    with _remote(args) as remote:
        return reads.file_bytes(remote, number, path)


def cmd_diff_shared(args, old: int, new: int) -> dict:
    """The changes and patch between two shared layers, as ``cmd_diff`` prints them."""
    from stepfs.store.shared import reads

    rels = [reads.history_path(p, allow_root=True) for p in args.paths] or None
    with _remote(args) as remote:
        return reads.read_changes(remote, old, new, rels)


def cmd_rollback_shared(args, target, number: int) -> int:
    from stepfs.overlayfs.client import shared
    from stepfs.store.errors import InputError

    if args.skip_conflicts:
        raise InputError("--skip-conflicts is for a workspace's own layers; a rollback to a layer of the shared "
                         "history is refused as a whole when a path conflicts.")
    res = shared.rollback(target, args.history, number, paths=args.path or [], dry_run=args.dry_run)
    if res["dry_run"]:
        lines = [f"dry run: rolling back to layer {number} of {res['history']} (head: {res['head_before']}) would "
                 f"change {len(res['paths'])} path(s) (nothing was changed):"]
    else:
        lines = []
        if res["committed_first"]:
            lines.append("committed staged changes first as layer(s) " + ", ".join(map(str, res["committed_first"])))
        lines += _published_text({**res, "published": [p for p in res["published"] if p["local"] != res["layer"]]})
        shared_as = f"shared layer {res['shared']}" if res["shared"] is not None else "not published yet"
        lines.append(f"rolled back to layer {number} of {res['history']} as layer {res['layer']} ({shared_as}; "
                     f"undo with 'stepfs rollback --history URL {res['head_before']}')")
    lines += [f"  {quote(p)}" for p in res["paths"]]
    _emit(args, {"message_type": "rollback", **res}, "\n".join(lines))
    return 0


def cmd_verify_history(args) -> int:
    from stepfs.store.errors import StoreDamaged
    from stepfs.store.shared.verifying import verify

    with _remote(args) as remote:
        counts, problems = verify(remote)
        display = remote.url.display
    text = "\n".join([f"checked {display}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
                     + [f"  problem: {p}" for p in problems])
    _emit(args, {"message_type": "verify-history", "ok": not problems, "history": display, "counts": counts,
                 "problems": problems}, text)
    if problems:
        raise StoreDamaged(f"the shared history {display} has {len(problems)} problem(s), the first: {problems[0]}; "
                           f"restore its database from a backup.", problems)
    return 0


def cmd_gc_history(args) -> int:
    from stepfs.store.shared import gc
    from stepfs.store.units import human

    with _remote(args) as remote:
        done = gc.collect(remote)
        display = remote.url.display
    _emit(args, {"message_type": "gc-history", "history": display, **done.as_dict()},
          f"removed {done.objects} object(s) and {done.chunks} chunk(s) ({human(done.bytes)}) no layer of "
          f"{display}'s database names")
    return 0


def register(add) -> None:
    sp = add("sync", cmd_sync, SYNC_HELP, "stepfs sync ~/project")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    add_history_option(sp)

    sp = add("clone", cmd_clone, CLONE_HELP, "stepfs clone 'postgresql://me@db/stepfs?name=proj' ~/proj --at 3")
    sp.add_argument("url", help="the shared history's URL")
    sp.add_argument("directory", help="a new (or empty) directory")
    sp.add_argument("--at", type=int, metavar="N", help="the layer to clone (default: the head)")

    sp = add("verify-history", cmd_verify_history, VERIFY_HELP, "stepfs verify-history --history URL")
    add_history_option(sp)

    sp = add("gc-history", cmd_gc_history, GC_HELP, "stepfs gc-history --history URL")
    add_history_option(sp)
