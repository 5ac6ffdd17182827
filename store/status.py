"""What ``stepfs status`` reads from the store, in one read transaction: the
head, every open step with its staged paths, and the conflicts.

One implementation for both places that answer ``status``: the CLI when no
mount is live (it opens the store) and a mount's daemon (which has it open),
asked over the control channel.  Whether a mount is live, its pid and why
it went read-only are not in the store; the client adds them
(``overlayfs/client/manage.status``).  The answer is JSON-ready: it crosses
the control channel as it is.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from stepfs.store import conflicts, layers, staging, tokens

if TYPE_CHECKING:
    from stepfs.store.workspace import Workspace


def op_letter(row: staging.StagedRow) -> str:
    """``A`` (added), ``M`` (modified) or ``D`` (deleted) for a staged row."""
    if row.kind == "whiteout":
        return "D"
    return "A" if row.base == tokens.ABSENT else "M"


def read_status(ws: Workspace, mountpoint: str | None = None) -> dict:
    """``{"workspace", "head", "steps": [{"mountpoint", "step", "staged"}],
    "conflicts"}``; with ``mountpoint``, only that mount's open step.  The
    caller makes the daemons write their pending staged rows first
    (``manage.sync_rows``), so the rows here are what the mounts show."""
    out: dict = {"workspace": ws.path, "steps": [], "conflicts": []}
    with ws.db.read() as conn:
        out["head"] = layers.head(conn)
        for step in staging.list_steps(conn):
            mp = step["mountpoint"]
            if mountpoint and mp != mountpoint:
                continue
            rows = staging.load(conn, step["id"])
            out["steps"].append({
                "mountpoint": mp, "step": step["id"],
                "staged": [{"op": op_letter(r), "path": os.fsdecode(r.path), "kind": r.kind} for r in rows],
            })
        for c in conflicts.listed(conn):
            path = os.fsdecode(bytes(c.path))
            out["conflicts"].append({
                "id": c.id, "path": path, "reason": c.reason, "mount": c.mount,
                "agent": c.agent, "oid": c.oid, "created_ns": c.created_ns,
                "token_mine": c.token_mine, "token_theirs": c.token_theirs,
                # How to get the losing bytes back.
                "bytes": f"read {c.mount}/.stepfs/conflicts/{path} while that mount is up",
            })
    return out
