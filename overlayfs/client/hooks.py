"""Agent CLI hooks: a tool call's hook payload becomes a step (no FUSE import).

Claude Code runs a ``PostToolUse`` hook command after every successful tool
call and writes one JSON object to its stdin: ``session_id``,
``transcript_path``, ``cwd``, ``hook_event_name``, ``tool_name``,
``tool_input``, ``tool_response`` and ``tool_use_id`` (other harnesses send
a subset; missing fields are simply not recorded).  :func:`hook_step`
commits the open step of the mount the payload's ``cwd`` lies in, with the
tool name and call id as layer metadata, so every layer can be traced back
to the tool call that made it.

The mount must be named by the payload or the caller: a hook whose ``cwd``
is the bare workspace (the agent is not working through stepfs) is refused
rather than committing other mounts' work under this tool call's name.
"""

from __future__ import annotations

import json
import os

from stepfs.store.errors import InputError, NothingToCommit, NotMountedError

from stepfs.overlayfs.client import manage

#: Payload field -> layer metadata key.
META_FIELDS = {
    "tool_name": "tool_name",
    "tool_use_id": "tool_use_id",
    "session_id": "session_id",
    "hook_event_name": "hook_event",
}
MESSAGE_LIMIT = 200


def parse_payload(text: str | bytes) -> dict:
    try:
        payload = json.loads(text or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"the hook payload on stdin is not JSON ({exc}); "
                               f"pipe the agent's hook JSON object into 'stepfs hook-commit'.") from None
    if not isinstance(payload, dict):
        raise InputError("the hook payload on stdin is not a JSON object; "
                               "pipe the agent's hook JSON object into 'stepfs hook-commit'.")
    return payload


def meta_of(payload: dict) -> dict:
    """Layer metadata from a payload: the non-empty scalar fields of META_FIELDS."""
    return {key: str(payload[field]) for field, key in META_FIELDS.items()
            if isinstance(payload.get(field), (str, int)) and str(payload[field])}


def message_of(payload: dict) -> str:
    """``"Edit: src/app.py"``, ``"Bash: make test"``, or the tool name."""
    tool = str(payload.get("tool_name") or "tool call")
    args = payload.get("tool_input") if isinstance(payload.get("tool_input"), dict) else {}
    detail = ""
    for key in ("command", "file_path", "notebook_path", "path"):
        if isinstance(args.get(key), str) and args[key]:
            detail = args[key]
            break
    cwd = payload.get("cwd")
    if detail and isinstance(cwd, str) and cwd and os.path.isabs(detail) and detail.startswith(cwd.rstrip("/") + "/"):
        detail = os.path.relpath(detail, cwd)
    text = f"{tool}: {detail}" if detail else tool
    text = text.splitlines()[0] if text.strip() else tool
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT - 1] + "\u2026"


def hook_step(payload: dict, target: str | None = None, meta: dict | None = None,
              message: str | None = None) -> list[int]:
    """Commit the step behind one tool call; returns the new layer numbers
    (``[]`` when the call changed nothing: no layer is made).

    ``target`` (a workspace or mountpoint) overrides the payload's ``cwd``;
    a workspace target commits every open step of that workspace.
    """
    if target is not None:
        where = manage.resolve(target)
    else:
        cwd = payload.get("cwd") if isinstance(payload.get("cwd"), str) and payload.get("cwd") else os.getcwd()
        where = manage.resolve(cwd)
        if where.mountpoint is None:
            raise NotMountedError(
                f"{cwd} is not in a stepfs mount, so the agent's writes do not go through stepfs; "
                f"start the agent inside one (e.g. 'stepfs run {where.workspace} -- claude')."
            )
    layer_meta = {**meta_of(payload), **(meta or {})}
    try:
        return manage.step(where, message=message if message is not None else message_of(payload),
                           meta=layer_meta)
    except NothingToCommit:
        return []
