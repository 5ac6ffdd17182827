"""The workspace commands of ``stepfs`` (mount, unmount, status, step,
discard, log, show, diff, verify, cat, rollback): each calls one library
function and prints its result, as ``cli/main.py`` describes."""

from __future__ import annotations

import json
import os
import sys

from stepfs.cli.args import parse_meta, usage_error
from stepfs.cli.render import folded_text, quote

ALL_HELP = "list every path inside .git directories too (by default each .git is one line: '.git/  +59 files')"


def _emit(args, obj: dict, text: str, essential: bool = True) -> None:
    """One JSON object with --json, else the text; --quiet drops text that
    is not the command's result (a confirmation such as "mounted ...")."""
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))
    elif text and (essential or not getattr(args, "quiet", False)):
        print(text)


def _split_ws(values: list[str], want: int, usage: str) -> tuple[str | None, list[str]]:
    """Commands shaped ``[WS] A B``: the optional leading workspace."""
    if len(values) == want:
        return None, values
    if len(values) == want + 1:
        return values[0], values[1:]
    usage_error(usage)


def _layer_number(text: str) -> int:
    from stepfs.store.errors import NoSuchLayer

    try:
        number = int(text)
    except ValueError:
        raise NoSuchLayer(f"{text!r} is not a layer number; 'stepfs log' lists the layers.") from None
    if abs(number) >= 1 << 63:
        # SQLite's integers are 64-bit: a longer number is no layer and
        # would fail inside the query (OverflowError) instead of here.
        usage_error(f"{text} is too large to be a layer number; 'stepfs log' lists the layers.")
    return number


# -- commands -------------------------------------------------------------------------


def cmd_mount(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store.errors import InputError
    from stepfs.store.prune import parse_size

    if args.keep_last is not None and args.keep_last < 1:
        raise InputError("--keep-last must be at least 1: the newest layer is always kept.")
    warn_size = parse_size(args.warn_size) if args.warn_size else None

    from stepfs.cli import shared

    shared.attach_if_asked(args)  # here, not in the daemon: it never waits on the network
    if args.foreground:
        if args.allow_other and os.geteuid() != 0:
            usage_error("--allow-other needs root: mount as root to let other users into the mount")
        manage.serve_foreground(args.workspace, args.mountpoint, debug=args.debug, require_read=args.require_read,
                                auto_step=args.auto_step, allow_other=args.allow_other, keep_last=args.keep_last,
                                warn_size=warn_size, new_history=args.new_history, excludes=args.exclude,
                                default_excludes=not args.no_default_excludes)
    pid = manage.mount(args.workspace, args.mountpoint, debug=args.debug, require_read=args.require_read,
                       auto_step=args.auto_step, allow_other=args.allow_other, keep_last=args.keep_last,
                       warn_size=warn_size, new_history=args.new_history, excludes=args.exclude,
                       default_excludes=not args.no_default_excludes)
    mp = os.path.abspath(args.mountpoint)
    _emit(args, {"message_type": "mount", "mountpoint": mp, "workspace": os.path.realpath(args.workspace), "pid": pid},
          f"mounted {os.path.realpath(args.workspace)} at {mp} (daemon pid {pid})", essential=False)
    return 0


def cmd_unmount(args) -> int:
    from stepfs.overlayfs.client import manage

    manage.unmount(args.mountpoint, force=args.force)
    _emit(args, {"message_type": "unmount", "mountpoint": os.path.abspath(args.mountpoint)},
          f"unmounted {os.path.abspath(args.mountpoint)}", essential=False)
    return 0


def cmd_status(args) -> int:
    from stepfs.overlayfs.client import manage

    st = manage.status(manage.resolve(args.workspace))
    lines = [f"workspace {quote(st['workspace'])}  (head: layer {st['head']})"]
    if not st["mounts"]:
        lines.append("no mounts, nothing staged")
    for m in st["mounts"]:
        state = f"mounted, pid {m['pid']}" if m["mounted"] else "not mounted"
        lines.append(f"mount {quote(m['mountpoint'])}  ({state}, {len(m['staged'])} staged)")
        if m.get("readonly"):
            lines.append(f"  read-only: {quote(m['readonly'])}")
        for r in m.get("runs", []):
            how = (f"confined (Landlock ABI {r.get('abi')}, writes only beneath "
                   f"{', '.join(quote(w) for w in r.get('writable', []))})"
                   if r["confined"] else "not confined")
            lines.append(f"  run pid {r['pid']}: {quote(' '.join(r['command'])[:80])}  {how}")
        unv = m.get("unversioned")
        if unv:
            lines.append(f"  unversioned (never staged): {', '.join(quote(p) for p in unv['trees']) or 'no tree yet'}")
            patterns = unv["stepfsignore"] + unv["excludes"] + (["(defaults)"] if unv["defaults"] else [])
            lines.append(f"    patterns: {' '.join(quote(p) for p in patterns)}")
        lines += [f"  {s['op']} {quote(s['path'])}" for s in m["staged"]]
    if st["conflicts"]:
        lines.append(f"conflicts: {len(st['conflicts'])}")
        lines += [f"  #{c['id']} {quote(c['path'])} ({quote(c['reason'])})" for c in st["conflicts"]]
    _emit(args, {"message_type": "status", **st}, "\n".join(lines))
    return 0


def cmd_step(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.cli import shared

    target = manage.resolve(args.workspace)
    if shared.step_attached(args, target):
        return shared.cmd_step_shared(args, target, parse_meta(args.meta))
    numbers = manage.step(target, message=args.message or "",
                          meta=parse_meta(args.meta), allow_empty=args.allow_empty,
                          overwrite=args.overwrite or [])
    _emit(args, {"message_type": "step", "number": numbers[-1], "numbers": numbers},
          "\n".join(str(n) for n in numbers))
    return 0


def cmd_discard(args) -> int:
    from stepfs.overlayfs.client import manage

    values = args.args
    ws_arg = None
    if len(values) >= 2 and (os.path.isdir(values[0]) and manage_is_target(values[0])):
        ws_arg, values = values[0], values[1:]
    dropped = manage.discard(manage.resolve(ws_arg), values)
    _emit(args, {"message_type": "discard", "discarded": dropped},
          "\n".join(f"discarded {quote(p)}" for p in dropped)
          or "nothing staged at those paths")
    return 0


def manage_is_target(path: str) -> bool:
    """Whether ``path`` names a workspace or mount (the optional leading WS)."""
    from stepfs.overlayfs.client import manage
    from stepfs.store.errors import WorkspaceError

    try:
        target = manage.resolve(path)
    except WorkspaceError:
        return False
    real = os.path.realpath(path)
    return real in (target.workspace, os.path.realpath(target.mountpoint or ""))


def cmd_log(args) -> int:
    from stepfs.overlayfs.client import manage, reads
    from stepfs.store.units import human
    from stepfs.cli import shared

    if shared.wanted(args):
        return shared.cmd_log_shared(args)
    rows = reads.log(manage.resolve(args.workspace), limit=args.limit, fold=not args.all)
    lines = []
    for r in rows:
        who = f"  [{quote(r['agent'])}]" if r["agent"] else ""
        renamed = f" >{r['renamed']}" if r["renamed"] else ""
        line = (f"{r['number']:>4}  {r['time']}  {r['kind']:<8}  files +{r['added']} ~{r['modified']} -{r['deleted']}"
                f"{renamed}{''.join('  ' + folded_text(f) for f in r['folded'])}"
                f"  lines +{r['lines_added']} -{r['lines_removed']}  +{human(r['stored_bytes'])} stored"
                f"{who}  {quote(r['message'])}")
        if r["meta"]:
            line += "  " + " ".join(f"{quote(k)}={quote(v)}" for k, v in sorted(r["meta"].items()))
        if r.get("unreadable"):
            line += f"  ({r['unreadable']} file(s) unreadable: run 'stepfs verify')"
        lines.append(line)
    _emit(args, {"message_type": "log", "layers": rows}, "\n".join(lines))
    return 0


def cmd_show(args) -> int:
    from stepfs.overlayfs.client import manage, reads

    from stepfs.cli.render import card_text

    ws_arg, (n,) = _split_ws(args.args, 1, "stepfs show [WS] N")
    number = _layer_number(n)
    from stepfs.cli import shared

    if shared.wanted(args):
        return shared.cmd_show_shared(args, number)
    card, patch = reads.card(manage.resolve(ws_arg), number, with_patch=args.patch, fold=not args.all)
    text = card_text(card)
    out = {"message_type": "show", **card}
    if patch is not None:
        out["patch"] = patch
        text += "\n\n" + patch.rstrip("\n")
    _emit(args, out, text)
    return 0


def cmd_diff(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store import diff, history
    from stepfs.store.workspace import Workspace

    values = list(args.args)
    ws_arg = None
    if len(values) == 3 or (len(values) == 2 and not values[0].lstrip("-").isdigit()):
        ws_arg = values.pop(0)
    if len(values) not in (1, 2):
        raise SystemExit("stepfs: usage: stepfs diff [WS] N [M] [-- PATH...]")
    new = _layer_number(values[0])
    if len(values) == 1 and new == 0:
        from stepfs.store.errors import NoSuchLayer

        raise NoSuchLayer("layer 0 is the baseline and has no layer before it; name two layers: 'stepfs diff N M'.")
    old = _layer_number(values[1]) if len(values) == 2 else new - 1
    from stepfs.cli import shared

    if shared.wanted(args):  # the history's layers, no workspace
        if ws_arg is not None:
            usage_error("with --history, 'stepfs diff' takes layer numbers of the shared history, no workspace")
        changes, patch = shared.cmd_diff_shared(args, old, new)
    else:
        target = manage.resolve(ws_arg)
        with Workspace.open(target.workspace) as ws:
            rels = [history.user_path(ws, p, target.mountpoint, allow_root=True) for p in args.paths] or None
            changes, patch = diff.read_changes(ws, old, new, rels)
    obj = {
        "message_type": "diff", "old": old, "new": new,
        "changes": [{"path": os.fsdecode(c.path), "op": c.op,
                     **({"from": os.fsdecode(c.old_path)} if c.old_path is not None else {}),
                     "before_kind": c.before.kind, "after_kind": c.after.kind} for c in changes],
        "patch": patch,
    }
    if args.json:
        _emit(args, obj, "")
    else:
        sys.stdout.write(patch)
    return 0


def cmd_verify(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store import verify
    from stepfs.store.errors import StoreDamaged
    from stepfs.store.workspace import Workspace

    from stepfs.cli import progress

    with Workspace.open(manage.resolve(args.workspace).workspace) as ws:
        with progress.for_args(args, "verifying chunks and objects") as bar:
            report = verify.verify(ws, progress=bar, workspace=args.workspace_check)
        label = ws.db.label
    counts = ", ".join(f"{n} {what}" for what, n in sorted(report.counts.items()))
    text = "\n".join([f"checked {label}: {counts}"] + [f"  problem: {p}" for p in report.problems])
    _emit(args, {"message_type": "verify", "ok": report.ok, "store": label, "counts": report.counts,
                 "problems": report.problems}, text)
    if not report.ok and set(report._per_kind) == {"workspace"}:
        raise StoreDamaged(
            f"the workspace differs from its head layer at {report._per_kind['workspace']} path(s), the first: "
            f"{report.problems[0]}; edits made outside stepfs are recorded by the next step, anything else "
            f"can be restored from its layer with 'stepfs cat' or 'stepfs rollback'.",
            report.problems,
        )
    if not report.ok:
        raise StoreDamaged(
            f"the store {label} has {len(report.problems)} problem(s), the first: {report.problems[0]}; "
            f"copy the workspace's files somewhere safe, then restore the store from a backup.",
            report.problems,
        )
    return 0


def cmd_cat(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store import history
    from stepfs.store.workspace import Workspace

    from stepfs.cli import shared

    if shared.wanted(args):  # the history's layers, no workspace
        _, (n, path) = _split_ws(args.args, 2, "stepfs cat --history URL N PATH")
        if len(args.args) != 2:
            usage_error("with --history, 'stepfs cat' takes a layer of the shared history and a path, no workspace")
        number = _layer_number(n)
        data = shared.cmd_cat_shared(args, number, path)
    else:
        ws_arg, (n, path) = _split_ws(args.args, 2, "stepfs cat [WS] N PATH")
        number = _layer_number(n)
        target = manage.resolve(ws_arg)
        with Workspace.open(target.workspace) as ws:
            data = history.file_bytes(ws, number, path, target.mountpoint)
    if args.json:
        try:
            content, encoding = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            import base64

            content, encoding = base64.b64encode(data).decode("ascii"), "base64"
        _emit(args, {"message_type": "cat", "layer": number, "path": path, "size": len(data),
                     "encoding": encoding, "content": content}, "")
        return 0
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


def cmd_rollback(args) -> int:
    from stepfs.overlayfs.client import manage

    ws_arg, (n,) = _split_ws(args.args, 1, "stepfs rollback [WS] N [--path PATH...] [--dry-run]")
    number = _layer_number(n)
    from stepfs.cli import shared

    if shared.wanted(args):  # N is a layer of the shared history, as 'stepfs log' then lists them
        return shared.cmd_rollback_shared(args, manage.resolve(ws_arg), number)
    res = manage.rollback(manage.resolve(ws_arg), number, paths=args.path or [], dry_run=args.dry_run,
                          skip_conflicts=args.skip_conflicts)
    lines = []
    if res["committed_first"]:
        lines.append("committed staged changes first as layer(s) " + ", ".join(map(str, res["committed_first"])))
    if res["dry_run"]:
        lines.append(f"dry run: rolling back to layer {number} would commit this layer (nothing was changed):")
        if res["open_steps_with_changes"]:
            lines.append(f"note: {res['open_steps_with_changes']} open step(s) with staged changes would be "
                         f"committed first, and their changes rolled back too.")
    else:
        lines.append(f"rolled back to layer {number} as layer {res['layer']} "
                     f"(undo with 'stepfs rollback {res['head_before']}')")
    from stepfs.cli.render import card_text

    for c in res["skipped"]:
        lines.append(f"skipped (conflict): {quote(c['path'])}: {quote(c['reason'])}")
    for mp in res["unreachable"]:
        lines.append(f"warning: the mount {quote(mp)} did not answer; it may show old attributes for a second")
    lines.append(card_text(res["card"]))
    _emit(args, {"message_type": "rollback", **res}, "\n".join(lines))
    return 0
