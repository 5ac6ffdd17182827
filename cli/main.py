"""The ``stepfs`` command: its parser and the error handling around a command.

Each command (``cli/commands.py`` for the workspace commands, a module of
its own for the others) calls one library function (``overlayfs.client.manage``, ``store.*``)
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
from stepfs.cli.args import add_exclude_args
from stepfs.cli.commands import (ALL_HELP, cmd_cat, cmd_diff, cmd_discard, cmd_log, cmd_mount, cmd_rollback,
                                 cmd_show, cmd_status, cmd_step, cmd_unmount, cmd_verify)
from stepfs.cli.render import escape

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
              "20 shared history refused, 21 store busy, 141 output closed, 1 bug"

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
