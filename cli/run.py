"""``stepfs run``: argument parsing and output only (the work is
``overlayfs/client/api.py``: ``run_command``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from stepfs.cli.args import add_exclude_args


USAGE = ("stepfs run [WS] [-m MSG] [--meta K=V]... [--mountpoint DIR] [--private] "
         "[--confine [--allow-write PATH]... [--allow-read PATH]... [--no-network] [--allow-connect PORT]...] "
         "-- COMMAND...")
HELP = "Run COMMAND in a mount of the workspace and commit what it changed as one step."
EXAMPLE = """stepfs run ~/project -m 'agent turn 1' --meta run=7 -- claude -p 'fix the tests'

The command runs with its working directory mapped into the mount (started
in WS/sub, it runs in MOUNT/sub; started outside WS, at the mount's root),
with STEPFS_WORKSPACE and STEPFS_MOUNT set.  An existing mount of WS is
reused (and left mounted); otherwise WS is mounted at a private temporary
mountpoint (or --mountpoint) and unmounted afterwards.  When the command
exits its changes are committed as one layer (message: the command line;
meta exit_code=N) and the change card is printed; no change, no layer.
SIGINT, SIGTERM and SIGHUP are forwarded to the command.

Started in a directory that is no workspace yet, with no WS named, that
directory becomes one (as with 'stepfs run .'; stepfs says so once on
stderr), except your home directory and /: there, name it to insist
('stepfs run ~ -- COMMAND').

With --confine the command (and every process it starts) can write only
beneath the mount, a private TMPDIR, /dev/null, /dev/tty, /dev/pts and the
--allow-write paths (Linux Landlock); a write elsewhere, through a symlink
or not, fails with EACCES.  Where Landlock is missing, --confine refuses
(exit 18) before anything starts.

exit status: the command's (128+N if signal N ended it, 127/126 if it could
not be started); a stepfs error code if mounting or the commit failed."""


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--message", help="the layer's message (default: the command line)")
    p.add_argument("--meta", action="append", metavar="KEY=VALUE",
                   help="metadata stored with the layer (repeatable)")
    p.add_argument("--mountpoint", metavar="DIR",
                   help="mount here instead of a private temporary directory (reused if already a mount of WS)")
    p.add_argument("--private", action="store_true",
                   help="always mount afresh, even if WS is already mounted")
    p.add_argument("--confine", action="store_true",
                   help="run the command under Linux Landlock: it may write only beneath the mount (and the "
                        "paths below); exit 18 where the kernel cannot")
    add_exclude_args(p)
    confine_options(p)
    from stepfs.cli.shared import add_history_option

    add_history_option(p)  # attach first (as 'stepfs mount --history'); the step then publishes


def confine_options(p: argparse.ArgumentParser) -> None:
    """The options of --confine (shared with 'stepfs confine')."""
    p.add_argument("--allow-write", action="append", default=None, metavar="PATH",
                   help="with confinement: also allow writing beneath PATH (repeatable; not the workspace)")
    p.add_argument("--allow-read", action="append", default=None, metavar="PATH",
                   help="with confinement: read only the system, the mount, the writable paths and these "
                        "(repeatable; default: read everywhere)")
    p.add_argument("--no-network", action="store_true",
                   help="with confinement: deny TCP bind and connect (Landlock ABI 4, Linux 6.7)")
    p.add_argument("--allow-connect", action="append", type=int, default=None, metavar="PORT",
                   help="with confinement: deny TCP except connecting to PORT (repeatable; implies --no-network)")


def policy_of(args, mountpoint: str = ""):
    """The confinement policy the options ask for."""
    from stepfs.overlayfs.client.confine import Policy

    return Policy(mountpoint=mountpoint, allow_write=list(args.allow_write or []),
                  allow_read=list(args.allow_read) if args.allow_read else None,
                  no_network=args.no_network, allow_connect=list(args.allow_connect or []))


def register(add) -> None:
    sp = add("run", cmd_run, HELP, EXAMPLE)
    sp.usage = USAGE
    _options(sp)
    sp.add_argument("rest", nargs=argparse.REMAINDER, metavar="[WS] -- COMMAND...",
                    help="workspace or mountpoint (default: current directory), then -- and the command")
    sp.set_defaults(workspace=None)


def _head_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stepfs run", usage=USAGE)
    p.add_argument("workspace", nargs="?")
    p.add_argument("--json", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    _options(p)
    return p


def split_command(args) -> None:
    """Argparse's REMAINDER keeps everything from WS on; split it at the
    first ``--`` into WS with its options, and the command."""
    rest = list(args.rest)
    if "--" not in rest:
        _usage("put -- before the command")
    i = rest.index("--")
    head, args.command = rest[:i], rest[i + 1:]
    if not args.command:
        _usage("the command after -- is missing")
    if head:
        _head_parser().parse_args(head, namespace=args)


def _usage(why: str) -> None:
    print(f"stepfs: usage: {USAGE} ({why}).", file=sys.stderr)
    raise SystemExit(2)


def implicit_workspace(args) -> None:
    """With no WS named, the current directory is the workspace: a plain
    directory becomes one (said once on stderr), as ``stepfs run .`` would
    make it; the home directory and ``/`` only when named, since a store
    there would record everything below them."""
    from stepfs.overlayfs.client import manage
    from stepfs.store.errors import WorkspaceError

    target = args.workspace if args.workspace is not None else os.getcwd()
    try:
        manage.resolve(target)
        return
    except WorkspaceError:
        if not os.path.isdir(target):
            raise
    here = os.path.realpath(target)
    if args.workspace is None and here in (os.path.realpath(os.path.expanduser("~")), "/"):
        what = "/" if here == "/" else "your home directory"
        raise WorkspaceError(
            f"{here} is {what} and not a stepfs workspace; 'stepfs run' makes only a named directory there a "
            f"workspace, since its history would record everything below it: cd into a project directory, or "
            f"insist with 'stepfs run {here} -- COMMAND'.")
    if args.workspace is None:
        args.workspace = here
    if not args.quiet and not args.json:
        print(f"stepfs: {here} is not a workspace yet; making it one (its history goes to {here}/.stepfs).",
              file=sys.stderr)


def setup_logging(args) -> None:
    """Library log lines (warnings, "command not found") as ``stepfs: ...`` on stderr."""
    import logging  # here: the other commands' start-up never needs it

    logging.basicConfig(format="stepfs: %(message)s",
                        level=logging.ERROR if getattr(args, "quiet", False) else logging.WARNING)


def cmd_run(args) -> int:
    from stepfs.overlayfs.client import api
    from stepfs.store.errors import StepfsError

    from stepfs.cli.args import parse_meta
    from stepfs.cli.render import card_text

    split_command(args)
    meta = parse_meta(args.meta)
    from stepfs.overlayfs.client.manage import check_excludes

    check_excludes(args.exclude)  # refused before a workspace is made or announced
    asked = [o for o, v in (("--allow-write", args.allow_write), ("--allow-read", args.allow_read),
                            ("--no-network", args.no_network), ("--allow-connect", args.allow_connect)) if v]
    if asked and not args.confine:
        _usage(f"{asked[0]} restricts a confined command; add --confine")
    if args.confine:
        from stepfs.overlayfs.client import confine

        confine.require(policy_of(args))  # refused before a workspace is made or announced
    implicit_workspace(args)
    from stepfs.cli import shared as shared_cli

    shared_cli.attach_for_run(args)
    from stepfs.cli import progress  # here: the other commands' start-up never needs it

    setup_logging(args)
    bar = progress.for_args(args, "mounting")

    def on_phase(name: str) -> None:
        if name == "running":
            bar.close()  # the terminal belongs to the command now
            sys.stdout.flush()
        else:
            bar.phase(name)

    try:
        result = api.run_command(args.command, args.workspace, message=args.message, meta=meta,
                                    mountpoint=args.mountpoint, private=args.private,
                                    forward_signals=True, on_phase=on_phase,
                                    confine=policy_of(args) if args.confine else None,
                                    excludes=args.exclude, default_excludes=not args.no_default_excludes)
    except StepfsError as exc:
        bar.close()
        code = getattr(exc, "command_exit_code", None)
        if code is not None and getattr(exc, "committed", None):  # committed here, not published
            print(f"stepfs: {shlex.join(args.command)} exited {code}; its changes were committed as layer "
                  f"{exc.committed[-1]}.", file=sys.stderr)
        elif code is not None:
            print(f"stepfs: {shlex.join(args.command)} exited {code}; its changes were not committed and "
                  f"stay staged in the store.", file=sys.stderr)
        raise
    finally:
        bar.close()
    card = api.WorkspaceClient(result.workspace).card(result.number) if result.number is not None else None
    if args.json:
        print(json.dumps({
            "message_type": "run", "command": result.command, "exit_code": result.exit_code,
            "number": result.number, "mountpoint": result.mountpoint, "reused": result.reused,
            "cwd": result.cwd, "workspace": result.workspace, "started": result.started, "card": card,
            "signals": result.signals, "forwarded": result.forwarded, "confined": result.confined,
        }, sort_keys=True))
    elif card is not None:
        if not args.quiet:
            print(card_text(card))
    elif result.started and not args.quiet:
        print("stepfs: the command changed nothing; no layer was made.", file=sys.stderr)
    return result.exit_code
