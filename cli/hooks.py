"""``stepfs hooks`` (print ready-made hook configurations for agent CLIs) and
``stepfs hook-commit`` (the command those hooks run): parsing and output only."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys

#: Claude Code tools that can change files.  Read, Grep, Glob, WebFetch... cannot,
#: and a hook after them would only find nothing to commit.
CLAUDE_CODE_MATCHER = "Write|Edit|MultiEdit|NotebookEdit|Bash"
HOOK_TIMEOUT = 120  # seconds; Claude Code kills a hook that runs longer

HOOKS_HELP = "Print a ready-made hook configuration that commits a step after each agent tool call."
HOOKS_EXAMPLE = """stepfs hooks claude-code > .claude/settings.local.json

claude-code  settings JSON for Claude Code: a PostToolUse hook that pipes
             each tool call's payload into 'stepfs hook-commit' (merge the
             "hooks" key into an existing settings file); start the agent
             confined so it cannot write outside the mount:
             stepfs run --confine --allow-write ~/.claude --allow-write ~/.claude.json -- claude
shell        a wrapper script for shell harnesses: 'stepfs-tool COMMAND...'
             runs one tool call through 'stepfs run' and tags the layer with
             $STEPFS_TOOL_CALL_ID (save it, chmod +x, call it per tool call);
             STEPFS_CONFINE=1 runs each call confined to the mount"""

HOOK_COMMIT_HELP = "Commit the step behind one agent tool call, reading the hook's JSON payload on stdin."
HOOK_COMMIT_EXAMPLE = """stepfs hook-commit < payload.json
         (payload.json: {"cwd": "/mnt/agent", "tool_name": "Edit", "tool_use_id": "toolu_01"})

Commits the open step of the mount the payload's "cwd" lies in (or of WS),
with meta tool_name, tool_use_id, session_id and hook_event taken from the
payload; the message names the tool and its file or command.  A tool call
that changed nothing makes no layer and exits 0."""


def register(add) -> None:
    sp = add("hooks", cmd_hooks, HOOKS_HELP, HOOKS_EXAMPLE)
    sp.add_argument("agent", choices=["claude-code", "shell"], help="the harness to configure")
    sp.add_argument("--command", metavar="CMD",
                    help="how the hook calls stepfs (default: this stepfs's absolute path)")
    sp.add_argument("--matcher", default=CLAUDE_CODE_MATCHER,
                    help=f"claude-code: the tools to commit after, a regex (default: {CLAUDE_CODE_MATCHER}; '*' for all)")
    sp.add_argument("--no-feedback", action="store_true",
                    help="claude-code: do not show stepfs errors (a conflict, a dead mount) to the agent")

    sp = add("hook-commit", cmd_hook_commit, HOOK_COMMIT_HELP, HOOK_COMMIT_EXAMPLE)
    sp.add_argument("workspace", nargs="?",
                    help="workspace or mountpoint (default: the payload's cwd, which must be in a mount)")
    sp.add_argument("-m", "--message", help="the layer's message (default: tool name and its file or command)")
    sp.add_argument("--meta", action="append", metavar="KEY=VALUE",
                    help="more metadata stored with the layer (repeatable)")


def stepfs_command() -> str:
    """The absolute path of the running ``stepfs`` (hooks run with another
    PATH), or plain ``stepfs``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "stepfs" and os.path.isfile(argv0):
        return os.path.abspath(argv0)
    return shutil.which("stepfs") or "stepfs"


def claude_code_settings(command: str, matcher: str = CLAUDE_CODE_MATCHER, feedback: bool = True) -> dict:
    """Claude Code settings (``.claude/settings.json`` shape) with one
    PostToolUse hook.  With ``feedback`` a failed commit exits 2, which makes
    Claude Code show stepfs's one-sentence error to the agent."""
    hook = f"{command} hook-commit" + (" || exit 2" if feedback else "")
    return {"hooks": {"PostToolUse": [
        {"matcher": matcher, "hooks": [{"type": "command", "command": hook, "timeout": HOOK_TIMEOUT}]},
    ]}}


SHELL_WRAPPER = r"""#!/usr/bin/env bash
# stepfs-tool: run one tool call of a shell agent harness through stepfs and
# commit what it changed as one layer, tagged with the tool call.
#
#   STEPFS_TOOL_CALL_ID=call_42 stepfs-tool make test
#
# Environment (all optional):
#   STEPFS_WORKSPACE     the workspace or one of its mounts (default: the current directory)
#   STEPFS_TOOL_CALL_ID  the harness's id of this call      -> layer meta tool_use_id
#   STEPFS_TOOL_NAME     the tool's name (default: the command's name) -> meta tool_name
#   STEPFS_SESSION_ID    the agent session                  -> meta session_id
#   STEPFS_CONFINE       1: run the call confined (stepfs run --confine: it can
#                        write nothing outside the mount; refused, exit 18,
#                        where the kernel has no Landlock)
#   STEPFS               the stepfs command to use
#
# The command runs in the workspace's live mount if there is one (else in a
# private mount made for this call), with its working directory mapped into
# the mount; the script exits with the command's status.  A call that
# changed nothing makes no layer.
set -euo pipefail
STEPFS=${STEPFS:-@STEPFS@}
if [ $# -eq 0 ]; then
  echo "usage: stepfs-tool COMMAND [ARG...]" >&2
  exit 2
fi
meta=(--meta "tool_name=${STEPFS_TOOL_NAME:-$(basename -- "$1")}")
if [ -n "${STEPFS_TOOL_CALL_ID:-}" ]; then meta+=(--meta "tool_use_id=$STEPFS_TOOL_CALL_ID"); fi
if [ -n "${STEPFS_SESSION_ID:-}" ]; then meta+=(--meta "session_id=$STEPFS_SESSION_ID"); fi
if [ "${STEPFS_CONFINE:-0}" != 0 ]; then meta+=(--confine); fi
exec "$STEPFS" run ${STEPFS_WORKSPACE:+"$STEPFS_WORKSPACE"} --quiet "${meta[@]}" -- "$@"
"""


def shell_wrapper(command: str) -> str:
    return SHELL_WRAPPER.replace("@STEPFS@", shlex.quote(command))


def cmd_hooks(args) -> int:
    command = args.command or stepfs_command()
    if args.agent == "claude-code":
        settings = claude_code_settings(command, args.matcher, feedback=not args.no_feedback)
        if args.json:
            print(json.dumps({"message_type": "hooks", "agent": args.agent, "settings": settings}, sort_keys=True))
        else:
            print(json.dumps(settings, indent=2))
        return 0
    script = shell_wrapper(command)
    if args.json:
        print(json.dumps({"message_type": "hooks", "agent": args.agent, "script": script}, sort_keys=True))
    else:
        sys.stdout.write(script)
    return 0


def cmd_hook_commit(args) -> int:
    from stepfs.overlayfs.client import hooks

    from stepfs.cli.args import parse_meta

    meta = parse_meta(args.meta)
    payload = hooks.parse_payload(sys.stdin.buffer.read())
    numbers = hooks.hook_step(payload, target=args.workspace, meta=meta, message=args.message)
    if args.json:
        print(json.dumps({"message_type": "hook-commit", "numbers": numbers,
                          "number": numbers[-1] if numbers else None,
                          "meta": {**hooks.meta_of(payload), **meta}}, sort_keys=True))
    elif numbers and not args.quiet:
        print("\n".join(str(n) for n in numbers))
    return 0
