"""The text of ``MOUNT/.stepfs/status``: what an agent needs to know about
itself (FUSE-free)."""

from __future__ import annotations


def status_text(mountpoint: str, workspace: str, head: int, readonly: str | None,
                last_errors: dict[str, str], staged: list[tuple[str, str]], warnings: list[str] = (),
                runs: list[str] = (), unversioned: dict | None = None) -> str:
    """``head``: the workspace's last committed layer (the staging row's id
    means nothing to a reader; layer numbers do); ``staged``: ``[(op, path)]``
    as ``Overlay.staged_paths`` gives them (already filtered for the reader);
    ``warnings``: the daemon's (``overlayfs/daemon/retention.py``);
    ``runs``: lines about the commands started in the mount (``runs.py``);
    ``unversioned``: ``Overlay.unversioned_state()``."""
    lines = [f"mount: {mountpoint}", f"workspace: {workspace}",
             f"head: layer {head} (the workspace's last committed layer)",
             f"open step: {head + 1} (the layer number it gets if it is the next one committed)"]
    if readonly:
        lines.append(f"read-only: {readonly}")
    for agent, error in sorted(last_errors.items()):
        lines.append(f"last error ({agent}): {error}")
    lines += [f"warning: {w}" for w in warnings]
    lines += runs
    if unversioned is not None:
        trees = unversioned["trees"]
        lines.append(f"unversioned (never staged, written to the workspace directly): {len(trees)}")
        lines += [f"  {t}/" for t in trees]
        patterns = unversioned["stepfsignore"] + unversioned["excludes"]
        lines.append("  patterns: " + " ".join((["(defaults)"] if unversioned["defaults"] else []) + patterns))
    lines.append(f"staged: {len(staged)}")
    lines += [f"  {op} {path}" for op, path in staged]
    return "\n".join(lines) + "\n"
