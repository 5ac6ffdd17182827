"""The ``stepfs`` command: argument parsing and output only.

Each command calls one library function (``overlayfs.client.manage``, ``store.*``)
and prints its result: human text by default, one JSON object with
``--json``.  Errors are one sentence on stderr prefixed ``stepfs:`` and exit
with the code of their class (``cli/exitcodes.py``); a traceback is shown
only with ``STEPFS_DEBUG=1``.  Heavy modules are imported inside the command
that needs them so ``stepfs --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

from stepfs.cli import exitcodes
from stepfs.cli.args import add_exclude_args, parse_meta, usage_error
from stepfs.cli.render import escape, folded_text, quote

#: Shown by ``stepfs --help``; tests/test_cli_help_examples.py runs each line.
EPILOG_EXAMPLES = """examples (in a project directory):
  stepfs run -m 'tests' -- pytest -q   # run a command in a mount, commit its changes as one layer
  stepfs log                           # the layers, newest first
  stepfs show 1 --patch                # what layer 1 changed
  stepfs rollback 0 --dry-run          # what undoing every layer would change
"""

EPILOG_EXIT = "exit codes: 0 ok, 2 usage, 3 workspace, 4 mountpoint, 5 store format, 6 nothing to commit " \
              "(or roll back), 7 conflict, 8 not mounted, 9 daemon, 10 containment, 11 no such layer, " \
              "12 corrupt object, 13 bad input, 14 no such path in that layer, 15 store damaged, " \
              "16 store cannot write, 17 publish failed, 18 cannot confine, 19 history server unreachable, " \
              "20 shared history refused, 141 output closed, 1 bug"

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


def _count(text: str) -> int:
    """A count argument (``--limit``): a non-negative 64-bit integer, as
    SQLite can bind (argparse reports anything else as a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"{text} is not a count between 0 and {(1 << 63) - 1}")
    return value


def _auto_step(text: str) -> str:
    from stepfs.overlayfs.client.manage import parse_auto_step

    try:
        parse_auto_step(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


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


# -- parser -----------------------------------------------------------------------------


class _Unbuilt:
    """Stands in for the subparser of a command that is not being run:
    argparse builds a help formatter for every argument it adds, and
    building every command's parser was a real share of a ``stepfs step``
    start-up.  Accepts and drops whatever a command adds to it."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: self


def _command_word(argv: list[str]) -> str | None:
    """The command a command line runs, if its parser alone can parse it:
    the first word, with no top-level option before it (``-h``,
    ``--version`` and a mistyped command need the whole parser)."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI's parser, or with ``only`` one that knows the other
    commands' names and help lines but not their arguments (the whole one
    if ``only`` names no command)."""
    from stepfs.cli import shared as shared_cli

    registered: set[str] = set()
    p = argparse.ArgumentParser(
        prog="stepfs",
        description="Stage an agent's writes in a FUSE mount and commit them to the workspace as numbered layers.",
        epilog=EPILOG_EXAMPLES + "\n" + textwrap.fill(EPILOG_EXIT, 100),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="store_true",
                   help="print the version and exit (with --json: the store format and libfuse versions too)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_, example):
        registered.add(name)
        if only is not None and name != only:
            return _Unbuilt()
        sp = sub.add_parser(name, help=help_, description=help_, epilog=f"example: {example}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(func=func)
        sp.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        sp.add_argument("-q", "--quiet", action="store_true", help="print only the result and errors")
        return sp

    sp = add("mount", cmd_mount, "Mount WORKSPACE at MOUNTPOINT; returns once the mount is ready.",
             "stepfs mount ~/project /mnt/agent")
    sp.add_argument("workspace", help="the project directory (becomes a workspace at the first mount)")
    sp.add_argument("mountpoint", help="an empty directory outside the workspace")
    sp.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C unmounts")
    sp.add_argument("--debug", action="store_true", help="log every FUSE call to the daemon log")
    sp.add_argument("--auto-step", default="manual", metavar="manual|close|idle:SECONDS", type=_auto_step,
                    help="commit steps by themselves: after each close-write, or after SECONDS without changes")
    sp.add_argument("--require-read", action="store_true",
                    help="refuse (EACCES) writing an existing file the agent never read")
    sp.add_argument("--new-history", action="store_true",
                    help="the workspace's .stepfs lost its store.db: set the leftovers aside and start at layer 0")
    sp.add_argument("--allow-other", action="store_true",
                    help="let other users into the mount, with the kernel checking file modes (root only)")
    sp.add_argument("--keep-last", type=int, metavar="N",
                    help="after each step, prune all but the newest N layers (gc runs every 10 steps)")
    shared_cli.add_history_option(sp)
    sp.add_argument("--warn-size", metavar="SIZE",
                    help="warn (stderr of 'stepfs step', MOUNT/.stepfs/status) once the store is over SIZE (2G)")
    add_exclude_args(sp)

    sp = add("unmount", cmd_unmount, "Flush, unmount MOUNTPOINT and wait for its daemon to exit.",
             "stepfs unmount /mnt/agent")
    sp.add_argument("mountpoint", help="a stepfs mountpoint")
    sp.add_argument("--force", action="store_true", help="abort the connection if the mount is busy or dead")

    sp = add("status", cmd_status, "Show the mounts of a workspace, their staged paths, and conflicts.",
             "stepfs status /mnt/agent --json")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")

    sp = add("step", cmd_step, "Commit the open step as the next layer and print its number.",
             "stepfs step /mnt/agent -m 'add parser' --meta tool_call=42")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("-m", "--message", help="the layer's message")
    sp.add_argument("--meta", action="append", metavar="KEY=VALUE", help="metadata stored with the layer (repeatable)")
    sp.add_argument("--allow-empty", action="store_true", help="record a layer even if nothing changed")
    sp.add_argument("--overwrite", nargs="+", metavar="PATH", help="commit over outside changes to these paths")
    shared_cli.add_history_option(sp)

    sp = add("discard", cmd_discard,
             "Drop staged paths from the open step (their bytes are kept as conflicts) so the rest can be "
             "committed.", "stepfs discard /mnt/agent src/generated.py")
    sp.add_argument("args", nargs="+", metavar="[WS] PATH",
                    help="workspace or mountpoint (default: current directory), then paths relative to the workspace")

    sp = add("log", cmd_log, "List the layers, newest first.", "stepfs log --limit 5")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("--limit", type=_count, help="show at most N layers")
    shared_cli.add_history_option(sp)
    sp.add_argument("--all", action="store_true", help=ALL_HELP)

    sp = add("show", cmd_show, "Show the change card of layer N: every path with its operation and line counts.",
             "stepfs show 3 --patch")
    sp.add_argument("args", nargs="+", metavar="[WS] N",
                    help="workspace or mountpoint (default: current directory), then the layer number")
    sp.add_argument("--patch", action="store_true", help="add the unified diff of the layer")
    shared_cli.add_history_option(sp)
    sp.add_argument("--all", action="store_true", help=ALL_HELP)

    sp = add("diff", cmd_diff, "Unified diff from layer M (default N-1) to layer N, optionally only below PATHs.",
             "stepfs diff 5 2 -- src/")
    sp.add_argument("args", nargs="+", metavar="[WS] N [M]",
                    help="workspace or mountpoint (default: current directory), layer N, optional layer M")
    sp.set_defaults(paths=[])
    shared_cli.add_history_option(sp)

    sp = add("verify", cmd_verify,
             "Check the store: re-hash every chunk and object, check every layer's references and SQLite's integrity.",
             "stepfs verify ~/project")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("--workspace", dest="workspace_check", action="store_true",
                    help="also compare every committed path's kind, mode and content in the workspace with "
                         "the head layer")

    sp = add("cat", cmd_cat, "Print a file's bytes as of layer N.", "stepfs cat 3 src/main.py")
    sp.add_argument("args", nargs="+", metavar="[WS] N PATH",
                    help="workspace or mountpoint (default: current directory), layer number, path in the workspace")
    shared_cli.add_history_option(sp)

    sp = add("rollback", cmd_rollback,
             "Make every path changed after layer N equal to its state as of N, recorded as a new layer "
             "(staged changes are committed first; paths changed outside stepfs are never overwritten).",
             "stepfs rollback 3 --path src/app.py --dry-run")
    sp.add_argument("args", nargs="+", metavar="[WS] N",
                    help="workspace or mountpoint (default: current directory), then the layer to roll back to")
    sp.add_argument("--path", action="extend", nargs="+", metavar="PATH",
                    help="roll back only these paths (and what is below them)")
    sp.add_argument("--dry-run", action="store_true", help="print the change card it would commit; change nothing")
    sp.add_argument("--skip-conflicts", action="store_true",
                    help="leave paths changed outside stepfs as they are and roll back the rest")
    sp.add_argument("--history", metavar="URL",
                    help="N is a layer of this shared history (default: STEPFS_HISTORY), to which the workspace "
                         "is attached: its state is taken from the history and the rollback published")

    from stepfs.cli import completion, confine, hooks, retention, run
    from stepfs.cli.web import command as web_command

    run.register(add)
    confine.register(add)
    retention.register(add)
    web_command.register(add)
    shared_cli.register(add)
    hooks.register(add)
    completion.register(add, build_parser)
    if only is not None and only not in registered:
        return build_parser()  # a mistyped command: argparse lists the real ones
    return p


def _split_paths(argv: list[str]) -> tuple[list[str], list[str]]:
    """``stepfs diff ... -- PATH...``: the paths after ``--`` belong to diff."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "diff" and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _stdout_closed() -> bool:
    """Standard output is a pipe or socket whose reader has gone (POLLERR on
    the write end), as opposed to a broken pipe somewhere else (which is a
    bug and reported as one)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _fd, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _leading_options(argv: list[str]) -> list[str]:
    """The options before the command (``stepfs --version --json``)."""
    lead = []
    for a in argv:
        if not a.startswith("-"):
            break
        lead.append(a)
    return lead


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = _leading_options(argv)
    if "--version" in lead:  # before the parser: no command needed, nothing heavy imported
        from stepfs.cli.version import print_version

        return print_version("--json" in lead)
    argv, paths = _split_paths(argv)
    parser = build_parser(only=_command_word(argv))
    args = parser.parse_args(argv)
    if paths:
        args.paths = paths
    try:
        try:
            code = args.func(args) or 0
            sys.stdout.flush()  # here, not at exit: a closed reader is handled below
            return code
        except BrokenPipeError:
            if not _stdout_closed():
                raise  # not our output: a bug, reported below
            # The reader went away (`stepfs log | head`): say nothing, as a
            # tool killed by SIGPIPE would; later writes (the exit's flush)
            # go nowhere.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return exitcodes.OUTPUT_CLOSED
    except KeyboardInterrupt:
        print("stepfs: interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:
        from stepfs.store.errors import StepfsError

        if os.environ.get("STEPFS_DEBUG"):
            raise
        code = exitcodes.code_for(exc)
        if isinstance(exc, StepfsError):
            message = str(exc)
        else:
            message = (f"internal error ({type(exc).__name__}: {exc}); this is a bug in stepfs, "
                       f"rerun with STEPFS_DEBUG=1 for the traceback and report it.")
        print(f"stepfs: {escape(message)}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"message_type": "error", "error": type(exc).__name__, "message": message,
                              "exit_code": code, "paths": getattr(exc, "paths", [])}), file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
