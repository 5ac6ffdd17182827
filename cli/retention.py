"""``stepfs gc``, ``stepfs prune``, ``stepfs du`` and ``stepfs conflicts
drop``: bounded history, parsing and output only (``store/gc.py``,
``store/prune.py``, ``store/du.py``)."""

from __future__ import annotations

import json
import sys

GC_HELP = "Collect what no layer, staged file or conflict references, and give the space back."
GC_EXAMPLE = """stepfs gc ~/project --dry-run

Safe while the workspace is mounted: live mounts are asked to write down
what they hold first, and bytes put meanwhile are kept for the next run."""
PRUNE_HELP = "Drop old layers (folded into the oldest kept one, which keeps its content); gc frees the bytes."
PRUNE_EXAMPLE = """stepfs prune ~/project --keep-last 20
stepfs prune --keep-within 7d --max-size 2G
stepfs prune --history 'postgresql://me@db/stepfs?name=proj' --keep-last 100

A layer is kept if --keep-last or --keep-within keeps it; --max-size then
drops the oldest more until what the kept layers reference fits.  Layer
numbers stay; a pruned number answers "pruned" (exit 11)."""
DU_HELP = "Show where the store's bytes go: by layer, by top-level directory, staged, conflicts, garbage."
DU_EXAMPLE = "stepfs du ~/project --json"
CONFLICTS_HELP = "Drop kept conflict bytes (losing writers' copies); 'stepfs status' lists them."
CONFLICTS_EXAMPLE = "stepfs conflicts drop 3 4   |   stepfs conflicts drop ~/project --all"


def register(add) -> None:
    sp = add("gc", cmd_gc, GC_HELP, GC_EXAMPLE)
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("--dry-run", action="store_true", help="print what would be freed; change nothing")
    sp.add_argument("--full-vacuum", action="store_true",
                    help="rewrite the whole database file (a store made before format 6 needs it once "
                         "to give space back)")

    sp = add("prune", cmd_prune, PRUNE_HELP, PRUNE_EXAMPLE)
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N layers")
    sp.add_argument("--keep-within", metavar="DURATION", help="keep the layers made within DURATION (7d, 12h)")
    sp.add_argument("--max-size", metavar="SIZE", help="drop more old layers until the kept ones fit in SIZE (2G)")
    sp.add_argument("--dry-run", action="store_true", help="print what would be dropped; change nothing")
    sp.add_argument("--no-gc", action="store_true", help="do not run gc afterwards")
    sp.add_argument("--history", metavar="URL",
                    help="prune this shared history's layers instead of a workspace's (STEPFS_HISTORY is not "
                         "read here: pruning a shared history is asked for by name)")

    sp = add("du", cmd_du, DU_HELP, DU_EXAMPLE)
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")

    sp = add("conflicts", cmd_conflicts, CONFLICTS_HELP, CONFLICTS_EXAMPLE)
    sp.add_argument("action", choices=["drop"], help="what to do with conflicts")
    sp.add_argument("args", nargs="*", metavar="[WS] ID", help="workspace or mountpoint, then conflict ids")
    sp.add_argument("--all", action="store_true", help="drop every conflict")


def _emit(args, obj: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=True))
    elif text:
        print(text)


def _quiesce(ws):
    """Ask every live mount of ``ws`` to write the staged rows it holds."""
    from stepfs.overlayfs.client import manage

    return lambda: manage.sync_rows(ws)


def run_gc(ws, dry_run: bool = False, full_vacuum: bool = False):
    from stepfs.store import gc

    return gc.collect(ws, dry_run=dry_run, quiesce=_quiesce(ws), full_vacuum=full_vacuum)


def gc_text(r) -> str:
    from stepfs.store.units import human

    verb = "would free" if r.dry_run else "freed"
    lines = [f"gc {verb}: {r.objects} objects ({human(r.object_bytes)} of content), "
             f"{r.chunks} chunks ({human(r.chunk_bytes)} stored)"]
    if r.conflict_objects:
        lines.append(f"kept for conflicts: {r.conflict_objects} objects ({human(r.conflict_bytes)}); "
                     f"'stepfs conflicts drop' frees them")
    if r.deltas:
        lines.append(f"deltas: {r.deltas} chunks re-encoded, {human(r.delta_saved)} saved")
    if not r.dry_run:
        lines.append(f"store: {human(r.file_before)} -> {human(r.file_after)} on disk "
                     f"({human(r.freed)} given back, vacuum {r.vacuum})")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def cmd_gc(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store.workspace import Workspace

    with Workspace.open(manage.resolve(args.workspace).workspace) as ws:
        r = run_gc(ws, args.dry_run, args.full_vacuum)
    _emit(args, {"message_type": "gc", **r.as_dict()}, gc_text(r))
    return 0


def cmd_prune(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store import prune
    from stepfs.store.workspace import Workspace

    within = prune.parse_duration(args.keep_within) if args.keep_within else None
    size = prune.parse_size(args.max_size) if args.max_size else None
    if args.history:  # never from STEPFS_HISTORY alone: a shared history is not pruned by accident
        return _prune_shared(args, within, size)
    with Workspace.open(manage.resolve(args.workspace).workspace) as ws:
        result = prune.prune(ws, keep_last=args.keep_last, keep_within_ns=within, max_size=size,
                             dry_run=args.dry_run)
        collected = None
        if result.keep_from is not None and not args.dry_run and not args.no_gc:
            collected = run_gc(ws)
    text = _prune_text(result, args.dry_run)
    if collected is not None:
        text += "\n" + gc_text(collected)
    obj = {"message_type": "prune", **result.as_dict()}
    if collected is not None:
        obj["gc"] = collected.as_dict()
    _emit(args, obj, text)
    return 0


def _prune_text(result, dry_run: bool, where: str = "") -> str:
    if result.keep_from is None:
        return f"nothing to prune{where}: every layer is kept."
    verb = "would drop" if dry_run else "dropped"
    span = f"{result.pruned[0]}..{result.pruned[-1]}" if len(result.pruned) > 1 else str(result.pruned[0])
    return f"{verb} layers {span}{where}; layer {result.keep_from} is the oldest kept ({result.folded_paths} paths)"


def _prune_shared(args, within: int | None, size: int | None) -> int:
    """``stepfs prune --history URL``: the shared history's layers
    (``store/shared/prune.py``), then gc-history frees what they alone named."""
    from stepfs.cli.args import usage_error
    from stepfs.cli.shared import open_remote
    from stepfs.store.shared import gc, prune as shared_prune

    if args.workspace is not None:
        usage_error("with --history, 'stepfs prune' prunes the shared history's layers; it takes no workspace")
    with open_remote(args) as remote:
        result = shared_prune.prune(remote, keep_last=args.keep_last, keep_within_ns=within, max_size=size,
                                    dry_run=args.dry_run)
        collected = None
        if result.keep_from is not None and not args.dry_run and not args.no_gc \
                and remote.url.dialect == "postgresql":
            collected = gc.collect(remote)
    text = _prune_text(result, args.dry_run, f" of {result.history}")
    if collected is not None:
        from stepfs.store.units import human

        text += (f"\ngc-history removed {collected.objects} object(s) and {collected.chunks} chunk(s) "
                 f"({human(collected.bytes)})")
    obj = {"message_type": "prune", **result.as_dict()}
    if collected is not None:
        obj["gc"] = collected.as_dict()
    _emit(args, obj, text)
    return 0


def cmd_du(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store import du
    from stepfs.store.workspace import Workspace

    with Workspace.open(manage.resolve(args.workspace).workspace) as ws:
        u = du.usage(ws)
    h = du.human
    lines = [f"store {u['store']}: {h(u['disk_bytes'])} on disk ({h(u['free_page_bytes'])} free pages), "
             f"{h(u['chunk_bytes'])} in chunks",
             f"  history  {h(u['history_bytes'])}", f"  staged   {h(u['staged_bytes'])}",
             f"  conflicts {h(u['conflict_bytes'])}", f"  garbage  {h(u['garbage_bytes'])} ('stepfs gc' frees it)",
             "by layer (bytes each added):"]
    lines += [f"  {n:>6}  {h(b)}" for n, b in u["layers"].items()]
    lines.append("by top-level path:")
    lines += [f"  {h(b):>10}  {p}" for p, b in list(u["top_level"].items())[:20]]
    _emit(args, {"message_type": "du", **u}, "\n".join(lines))
    return 0


def cmd_conflicts(args) -> int:
    from stepfs.overlayfs.client import manage
    from stepfs.store import gc
    from stepfs.store.errors import InputError
    from stepfs.store.workspace import Workspace

    values = list(args.args)
    ws_arg = None
    if values and not values[0].isdigit():
        ws_arg = values.pop(0)
    if args.all == bool(values):
        print("stepfs: usage: conflicts drop [WS] ID... or conflicts drop [WS] --all", file=sys.stderr)
        raise SystemExit(2)
    try:
        ids = None if args.all else [int(v) for v in values]
    except ValueError:
        raise InputError(f"conflict ids are numbers ('stepfs status' lists them), got {' '.join(values)}.") from None
    with Workspace.open(manage.resolve(ws_arg).workspace) as ws:
        n = gc.drop_conflicts(ws, ids)
    _emit(args, {"message_type": "conflicts", "dropped": n},
          f"dropped {n} conflict(s); 'stepfs gc' frees their bytes.")
    return 0
