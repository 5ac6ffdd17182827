"""The ``stepfs`` command: argument parsing and output only.

Each command calls one library function (``overlayfs.manage``, ``store.*``)
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
import time

from . import exitcodes

EPILOG_EXIT = "exit codes: 0 ok, 2 usage, 3 workspace, 4 mountpoint, 5 store format, 6 nothing to commit, " \
              "7 conflict, 8 not mounted, 9 daemon, 10 containment, 11 no such layer, 12 corrupt object, 13 bad input, " \
              "14 store damaged, 15 store cannot write, 16 publish failed, 1 bug"


def _emit(args, obj: dict, text: str, essential: bool = True) -> None:
    """One JSON object with --json, else the text; --quiet drops text that
    is not the command's result (a confirmation such as "mounted ...")."""
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))
    elif text and (essential or not getattr(args, "quiet", False)):
        print(text)


def _usage(message: str) -> None:
    print(f"stepfs: usage: {message}", file=sys.stderr)
    raise SystemExit(exitcodes.USAGE)


def _split_ws(values: list[str], want: int, usage: str) -> tuple[str | None, list[str]]:
    """Commands shaped ``[WS] A B``: the optional leading workspace."""
    if len(values) == want:
        return None, values
    if len(values) == want + 1:
        return values[0], values[1:]
    _usage(usage)


def _layer_number(text: str) -> int:
    from store.errors import NoSuchLayer

    try:
        return int(text)
    except ValueError:
        raise NoSuchLayer(f"{text!r} is not a layer number; 'stepfs log' lists the layers.") from None


def _parse_meta(items: list[str]) -> dict:
    meta = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _usage(f"--meta takes KEY=VALUE, got {item!r}")
        meta[key] = value
    return meta


# -- commands -------------------------------------------------------------------------


def cmd_mount(args) -> int:
    from overlayfs import manage

    if args.foreground:
        from overlayfs import daemon

        manage.reclaim_dead_mount(args.workspace, args.mountpoint)
        manage.check_mount_args(args.workspace, args.mountpoint)
        return daemon.serve(args.workspace, args.mountpoint, debug=args.debug, require_read=args.require_read)
    pid = manage.mount(args.workspace, args.mountpoint, debug=args.debug, require_read=args.require_read)
    mp = os.path.abspath(args.mountpoint)
    _emit(args, {"message_type": "mount", "mountpoint": mp, "workspace": os.path.realpath(args.workspace), "pid": pid},
          f"mounted {os.path.realpath(args.workspace)} at {mp} (daemon pid {pid})", essential=False)
    return 0


def cmd_unmount(args) -> int:
    from overlayfs import manage

    manage.unmount(args.mountpoint, force=args.force)
    _emit(args, {"message_type": "unmount", "mountpoint": os.path.abspath(args.mountpoint)},
          f"unmounted {os.path.abspath(args.mountpoint)}", essential=False)
    return 0


def cmd_status(args) -> int:
    from overlayfs import manage

    st = manage.status(manage.resolve(args.workspace))
    lines = [f"workspace {st['workspace']}  (head: layer {st['head']})"]
    if not st["mounts"]:
        lines.append("no mounts, nothing staged")
    for m in st["mounts"]:
        state = f"mounted, pid {m['pid']}" if m["mounted"] else "not mounted"
        lines.append(f"mount {m['mountpoint']}  ({state}, {len(m['staged'])} staged)")
        if m.get("readonly"):
            lines.append(f"  read-only: {m['readonly']}")
        lines += [f"  {s['op']} {s['path']}" for s in m["staged"]]
    if st["conflicts"]:
        lines.append(f"conflicts: {len(st['conflicts'])}")
        lines += [f"  #{c['id']} {c['path']} ({c['reason']})" for c in st["conflicts"]]
    _emit(args, {"message_type": "status", **st}, "\n".join(lines))
    return 0


def cmd_step(args) -> int:
    from overlayfs import manage

    numbers = manage.step(manage.resolve(args.workspace), message=args.message or "",
                          meta=_parse_meta(args.meta), allow_empty=args.allow_empty,
                          overwrite=args.overwrite or [])
    _emit(args, {"message_type": "step", "number": numbers[-1], "numbers": numbers},
          "\n".join(str(n) for n in numbers))
    return 0


def cmd_log(args) -> int:
    from overlayfs import manage
    from store import layers
    from store.workspace import Workspace

    with Workspace.open(manage.resolve(args.workspace).workspace) as ws, ws.db.read() as conn:
        items = layers.list_layers(conn, limit=args.limit)
    rows = []
    for layer in items:
        rows.append({
            "number": layer.number, "kind": layer.kind, "created_ns": layer.created_ns,
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(layer.created_ns / 1e9)),
            "agent": layer.agent, "mount": layer.mount, "message": layer.message, "meta": layer.meta,
            "added": layer.added, "modified": layer.modified, "deleted": layer.deleted,
        })
    text = "\n".join(
        f"{r['number']:>4}  {r['time']}  +{r['added']} ~{r['modified']} -{r['deleted']}  {r['message']}"
        + (f"  {json.dumps(r['meta'], sort_keys=True)}" if r["meta"] else "")
        for r in rows
    )
    _emit(args, {"message_type": "log", "layers": rows}, text)
    return 0


def cmd_show(args) -> int:
    from overlayfs import manage
    from store import cards
    from store.workspace import Workspace

    ws_arg, (n,) = _split_ws(args.args, 1, "stepfs show [WS] N")
    number = _layer_number(n)
    with Workspace.open(manage.resolve(ws_arg).workspace) as ws, ws.db.read() as conn:
        card = cards.card(ws.objects, conn, number)
    lines = [
        f"layer {card['number']} ({card['kind']})  {card['time']}",
        f"message: {card['message']}" if card["message"] else "message: (none)",
    ]
    if card["mount"]:
        lines.append(f"mount: {card['mount']}" + (f"  agent: {card['agent']}" if card["agent"] else ""))
    for key, value in sorted(card["meta"].items()):
        lines.append(f"meta: {key}={value}")
    lines.append(f"files: +{card['added']} ~{card['modified']} -{card['deleted']}   "
                 f"lines: +{card['lines_added']} -{card['lines_removed']}")
    for f in card["files"]:
        if f.get("binary"):
            detail = f"binary {f['bytes_before']} -> {f['bytes_after']} bytes"
        elif "lines_added" in f:
            detail = f"+{f['lines_added']} -{f['lines_removed']}"
        else:
            detail = f["kind"] or ""
        lines.append(f"  {f['op']:<9} {f['path']}  {detail}")
    _emit(args, {"message_type": "show", **card}, "\n".join(lines))
    return 0


def cmd_verify(args) -> int:
    from overlayfs import manage
    from store import verify
    from store.errors import StoreDamaged
    from store.workspace import Workspace

    from . import progress

    with Workspace.open(manage.resolve(args.workspace).workspace) as ws:
        with progress.for_args(args, "verifying chunks and objects") as bar:
            report = verify.verify(ws, progress=bar)
        label = ws.db.label
    counts = ", ".join(f"{n} {what}" for what, n in sorted(report.counts.items()))
    text = "\n".join([f"checked {label}: {counts}"] + [f"  problem: {p}" for p in report.problems])
    _emit(args, {"message_type": "verify", "ok": report.ok, "store": label, "counts": report.counts,
                 "problems": report.problems}, text)
    if not report.ok:
        raise StoreDamaged(
            f"the store {label} has {len(report.problems)} problem(s), the first: {report.problems[0]}; "
            f"copy the workspace's files somewhere safe, then restore the store from a backup.",
            report.problems,
        )
    return 0


def cmd_cat(args) -> int:
    from overlayfs import manage
    from store import history
    from store.workspace import Workspace

    ws_arg, (n, path) = _split_ws(args.args, 2, "stepfs cat [WS] N PATH")
    number = _layer_number(n)
    with Workspace.open(manage.resolve(ws_arg).workspace) as ws:
        data = history.file_bytes(ws, number, path)
    if args.json:
        try:
            content, encoding = data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            import base64

            content, encoding = base64.b64encode(data).decode("ascii"), "base64"
        _emit(args, {"message_type": "cat", "number": number, "path": path, "size": len(data),
                     "encoding": encoding, "content": content}, "")
        return 0
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


# -- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepfs",
        description="Stage an agent's writes in a FUSE mount and commit them to the workspace as numbered layers.",
        epilog=EPILOG_EXIT,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_, example):
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
    sp.add_argument("--require-read", action="store_true",
                    help="refuse (EACCES) writing an existing file the agent never read")

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

    sp = add("log", cmd_log, "List the layers, newest first.", "stepfs log --limit 5")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("--limit", type=int, help="show at most N layers")

    sp = add("show", cmd_show, "Show the change card of layer N: every path with its operation and line counts.",
             "stepfs show 3")
    sp.add_argument("args", nargs="+", metavar="[WS] N",
                    help="workspace or mountpoint (default: current directory), then the layer number")

    sp = add("verify", cmd_verify,
             "Check the store: re-hash every chunk and object, check every layer's references and SQLite's integrity.",
             "stepfs verify ~/project")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")

    sp = add("cat", cmd_cat, "Print a file's bytes as of layer N.", "stepfs cat 3 src/main.py")
    sp.add_argument("args", nargs="+", metavar="[WS] N PATH",
                    help="workspace or mountpoint (default: current directory), layer number, path in the workspace")

    from . import completion, hooks, run

    run.register(add)
    hooks.register(add)
    completion.register(add)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("stepfs: interrupted.", file=sys.stderr)
        return 130
    except Exception as exc:
        from store.errors import StepfsError

        if os.environ.get("STEPFS_DEBUG"):
            raise
        code = exitcodes.code_for(exc)
        if isinstance(exc, StepfsError):
            message = str(exc)
        else:
            message = (f"internal error ({type(exc).__name__}: {exc}); this is a bug in stepfs, "
                       f"rerun with STEPFS_DEBUG=1 for the traceback and report it.")
        print(f"stepfs: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"message_type": "error", "error": type(exc).__name__, "message": message,
                              "exit_code": code, "paths": getattr(exc, "paths", [])}), file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
