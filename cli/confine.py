"""``stepfs confine``: argument parsing and output only (the work is
``overlayfs.runner.run_confined``)."""

from __future__ import annotations

import argparse
import json
import sys

from stepfs.cli import run as run_cli

USAGE = ("stepfs confine MOUNTPOINT [--allow-write PATH]... [--allow-read PATH]... [--no-network] "
         "[--allow-connect PORT]... -- COMMAND...")
HELP = "Run COMMAND confined by Linux Landlock to a stepfs mount that a harness manages."
EXAMPLE = """stepfs confine /mnt/agent --allow-write ~/.cache -- claude

COMMAND (and every process it starts) may write only beneath MOUNTPOINT, a
private TMPDIR (removed afterwards), /dev/null, /dev/tty, /dev/pts and the
--allow-write paths; a write elsewhere, through a symlink or not, fails with
EACCES.  Reads stay allowed everywhere unless --allow-read narrows them.
Nothing is mounted or committed: the harness steps the mount itself (a hook
per tool call, 'stepfs step').  COMMAND runs in the current directory if it
is inside the mount, else at the mount's root.

exit status: the command's (128+N if signal N ended it, 127/126 if it could
not be started); 8 if MOUNTPOINT is not a stepfs mount; 18 where the kernel
cannot confine (no Landlock, or too old for --no-network): nothing started."""


def register(add) -> None:
    sp = add("confine", cmd_confine, HELP, EXAMPLE)
    sp.usage = USAGE
    run_cli.confine_options(sp)
    sp.add_argument("rest", nargs=argparse.REMAINDER, metavar="MOUNTPOINT -- COMMAND...",
                    help="the stepfs mount, then -- and the command")


def _head_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stepfs confine", usage=USAGE)
    p.add_argument("mountpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    run_cli.confine_options(p)
    return p


def _usage(why: str) -> None:
    print(f"stepfs: usage: {USAGE} ({why}).", file=sys.stderr)
    raise SystemExit(2)


def cmd_confine(args) -> int:
    from stepfs.overlayfs.client import api

    rest = list(args.rest)
    if "--" not in rest:
        _usage("put -- before the command")
    i = rest.index("--")
    head, command = rest[:i], rest[i + 1:]
    if not command:
        _usage("the command after -- is missing")
    args.mountpoint = None
    _head_parser().parse_args(head, namespace=args)
    run_cli.setup_logging(args)
    result = api.run_confined(args.mountpoint, command, run_cli.policy_of(args, args.mountpoint),
                                 forward_signals=True)
    if args.json:
        print(json.dumps({"message_type": "confine", "command": result.command, "exit_code": result.exit_code,
                          "mountpoint": result.mountpoint, "cwd": result.cwd, "confined": result.confined,
                          "signals": result.signals, "forwarded": result.forwarded}, sort_keys=True))
    return result.exit_code
