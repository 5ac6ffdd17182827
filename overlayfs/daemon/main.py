"""The mount daemon: one process per mountpoint.

``python -m stepfs.overlayfs.daemon.main WORKSPACE MOUNTPOINT [--ready-fd N]`` opens the
workspace (running recovery), takes the mountpoint's lock file
(``.stepfs/run/<mount key>.lock``, holding the daemon's pid) so a second
daemon for the same mountpoint is refused, starts the control server, and
serves FUSE until unmounted.  When the kernel has finished the FUSE
handshake it writes ``ready`` to the ready pipe, which is what
``stepfs mount`` waits for.  The lock is released only when the process
exits, so "lock free" means "daemon gone".
"""

from __future__ import annotations

import argparse
import faulthandler
import fcntl
import gc
import logging
import os
import sys
from typing import Callable

from stepfs.store import staging, tokens
from stepfs.store.db import Prepared
from stepfs.store.workspace import Workspace

from stepfs.overlayfs.daemon.control import ControlServer
from stepfs.overlayfs.daemon.protocol import mount_key
from stepfs.overlayfs.core.rows import ROW_DELAY
from stepfs.overlayfs.core.view import Overlay

log = logging.getLogger("stepfs.daemon")


def ancestors(paths: list[str]) -> set[str]:
    """Every directory above the view paths ``paths``, up to ``/``.  Their
    cached listings (libfuse.lowlevel.ListingCache) and attributes are invalidated
    when something changes below them without going through the kernel."""
    out: set[str] = set()
    for path in paths:
        while path != "/":
            path = path.rpartition("/")[0] or "/"
            if path in out:
                break
            out.add(path)
    return out


#: Longest a mount waits at start-up for its first round of spare inodes
#: (a disk that slow only delays the mount; ``manage.READY_TIMEOUT`` is 30 s).
SPARES_WAIT = 10.0


def settle(ws: Workspace) -> None:
    """Finish the daemon's start-up work before the mount reports ready,
    so that none of it lands in the first commands run in the mount:

    * the first round of spare inodes (``store.spares``), whose creates
      would compete with those commands for the CPU, the GIL and the
      journal; waited for at most :data:`SPARES_WAIT` seconds (a slow disk
      only delays the mount, never blocks it);
    * the cyclic garbage collector's start-up heap (``gc.freeze``), whose
      first full pass would otherwise walk it all inside the first
      requests.  Frozen objects are never walked again; the few garbage
      cycles alive at this point are never collected;
    * the store's prepared statements (``db.Prepared.warm``), compiled
      while the spares are still being made instead of at the first
      close-write and the first commit."""
    Prepared.warm(ws.db)
    ws.spares.wait_filled(SPARES_WAIT)
    gc.freeze()


def lock_path(ws: Workspace, mountpoint: str) -> str:
    return os.path.join(ws.run_dir, mount_key(mountpoint) + ".lock")


def handler(view: Overlay, ws: Workspace, kernel_cache,
            after_step: Callable[[], None] | None = None,
            loop_counts=None) -> Callable[[dict, Callable[[dict], None]], dict | None]:
    """The control channel's handler of a daemon serving ``view``
    (``control.ControlServer``; ``kernel_cache``: the FUSE adapter's
    ``KernelCache``; ``loop_counts``: the request loop's ``spin.Counts``).
    Runs on the control thread, one request at a time."""

    def handle(req: dict, reply) -> dict | None:
        op = req.get("op")
        if op == "ping":  # never takes the view's lock: answers even while a commit runs
            return {"pid": os.getpid(), "step": view.step, "readonly": view.readonly_reason,
                    "listings_cached": kernel_cache.listings_cached, "negatives_cached": kernel_cache.negatives_cached,
                    "negatives_noted": kernel_cache.negatives_noted(), "runs": view.runs.live(),
                    "unversioned": view.unversioned_state(),
                    "loop": loop_counts.as_dict() if loop_counts is not None else None}
        if op == "run":  # a command started in this mount, and its confinement (runs.py)
            confinement = req.get("confinement") if isinstance(req.get("confinement"), dict) else {}
            return {"recorded": view.runs.add(int(req["pid"]), list(req.get("command") or []), confinement)}
        if op == "commit":
            # Answered as soon as the layer is published (intent durable,
            # renames done: a crash from here recovers to it).  The view
            # then does its bookkeeping under its lock, so the caller's next
            # request through the mount sees it done, and releases the lock
            # while the directory fsyncs and the "committed" record end
            # (this thread, the commit lock held: the next control request,
            # and any other process's commit or open, comes after them).
            # A failure there is logged, turns the mount read-only and
            # fails the next step (core/committing.py).
            with view.begin_commit(message=req.get("message", ""), meta=req.get("meta") or {},
                                   allow_empty=bool(req.get("allow_empty")),
                                   overwrite={os.fsencode(p) for p in req.get("overwrite", [])}) as c:
                number = c.publish()
                # Warnings only when there are some (the store over --warn-size).
                reply({"number": number, **({"warnings": list(view.warnings)} if view.warnings else {})})
                c.complete()
            if after_step is not None:
                after_step()
            return None
        if op == "sync":  # before someone reads this step's rows from the store
            view.sync_rows()
            return {}
        if op == "status":
            return {"staged": [[op_, p] for op_, p in view.staged_paths()]}
        # The CLI's reads, answered here when a mount is live because this
        # process has the store open (the CLI would pay the database
        # layer's imports for a few rows): the same store functions the
        # CLI calls when no mount is live (client/reads.py).
        if op == "read_status":
            from stepfs.store.status import read_status

            view.sync_rows()  # this mount's pending rows; the client syncs the others
            return {"status": read_status(ws, req.get("mountpoint"))}
        if op == "log":
            from stepfs.store import cards

            limit = req.get("limit")
            return {"layers": cards.read_log(ws, limit=limit if isinstance(limit, int) else None,
                                                fold=req.get("fold", True) is not False)}
        if op == "card":
            from stepfs.store import cards

            card, patch = cards.read_card(ws, int(req["number"]), with_patch=bool(req.get("patch")),
                                           fold=req.get("fold", True) is not False)
            return {"card": card, "patch": patch}
        if op == "steps":
            # Every open step of the workspace (any mount's): lets the CLI
            # commit a workspace without opening the store itself.
            with ws.db.read() as conn:
                return {"steps": [{"mountpoint": st["mountpoint"], "staged": st["staged"]}
                                  for st in staging.list_steps(conn)]}
        if op == "discard":
            paths = [p for p in req.get("paths", []) if isinstance(p, str) and p.startswith("/")]
            if "user_paths" in req:  # as typed by the user: checked as the CLI checks them (history.user_path)
                from stepfs.store import history

                paths = ["/" + os.fsdecode(history.user_path(ws, p, view.mountpoint))
                         for p in req["user_paths"] if isinstance(p, str)]
            dropped = view.discard(paths)
            # Gone: the workspace's file shows through again, maybe of
            # another kind than the staged one (libfuse.notify.KernelCache).
            kernel_cache.invalidate(sorted(set(dropped)), gone=True)
            kernel_cache.invalidate(sorted(ancestors(dropped) - set(dropped)))
            return {"discarded": dropped}
        if op == "invalidate":
            # The workspace changed under this mount (a rollback): first the
            # view forgets its copies, then (outside the view's lock) the
            # kernel forgets attributes and pages of each path and its
            # ancestors (their cached listings: a rollback may add or remove
            # whole directories).
            # The paths are marked gone: their files were replaced, maybe by
            # another kind (the kernel must look the names up again).
            paths = [p for p in req.get("paths", []) if isinstance(p, str) and p.startswith("/")]
            view.forget(paths)
            parents = sorted(ancestors(paths) - set(paths))
            done = kernel_cache.invalidate(sorted(set(paths)), gone=True)
            return {"invalidated": done + kernel_cache.invalidate(parents)}
        raise ValueError(f"unknown op {op!r}")

    return handle


def serve(workspace: str, mountpoint: str, ready_fd: int | None = None, debug: bool = False,
          require_read: bool = False, auto_step: str = "manual", allow_other: bool = False,
          keep_last: int | None = None, warn_size: int | None = None, excludes: list[str] = (),
          default_excludes: bool = True) -> int:
    from stepfs.overlayfs.daemon import fuse_ops  # imports mfusepy (and libfuse) only in the daemon
    from stepfs.overlayfs.daemon.libfuse import readahead, spin

    mountpoint = os.path.abspath(mountpoint)
    ws = Workspace.open(workspace, create=True)
    lock_fd = os.open(lock_path(ws, mountpoint), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"stepfs: another daemon already serves {mountpoint}.", file=sys.stderr)
        return 9
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    # Before the first token: on a file system whose ctime moves with every
    # change after a stat, a file changed just now is not hashed at its open.
    tokens.learn_fine_ctime(ws.tmp_dir)

    view = Overlay(ws, mountpoint, agent=os.environ.get("STEPFS_AGENT", ""), require_read=require_read,
                   row_delay=ROW_DELAY, excludes=excludes, default_excludes=default_excludes)
    kernel_cache = fuse_ops.KernelCache()
    # Empty files made ahead, so a commit renames them into place instead
    # of allocating inodes (store.spares): refilled after every commit
    # (paused during one); the thread ends with ws.close().
    ws.spares.start_filling()
    # Each committed layer's deltas on a thread of their own, once the
    # commit lock is released (store.deltawork); it ends with ws.close().
    ws.deltas.start()

    if keep_last is not None or warn_size is not None:
        from stepfs.overlayfs.daemon.retention import AfterStep

        after = AfterStep(view, ws, keep_last=keep_last, warn_size=warn_size)
        view.commit = after.wrap(view.commit)  # the auto-stepper commits here
        # The control thread commits in two phases (view.begin_commit): the
        # same retention runs once its commit has completed.
        after_step = after.wrap(lambda: None)
        after.check_size()
    else:
        after_step = None
    handle = handler(view, ws, kernel_cache, after_step, loop_counts=spin.COUNTS)

    from stepfs.overlayfs.daemon.publisher import Publisher

    # The auto-stepper's layers go to the shared history, if any; a step the
    # CLI or the API asks for publishes in the caller's process.
    publisher = Publisher(view, ws)
    view.commit = publisher.wrap(view.commit)

    from stepfs.overlayfs.daemon.autostep import AutoStepper
    from stepfs.overlayfs.daemon.protocol import parse_auto_step

    delay = parse_auto_step(auto_step)
    stepper = AutoStepper(view, delay) if delay is not None else None
    if stepper is not None:
        stepper.start()

    control = ControlServer(mountpoint, handle)
    control.start()

    def ready() -> None:
        # From libfuse's init, on the loop thread: no request is served yet.
        settle(ws)
        readahead.raise_after_init(mountpoint)
        if ready_fd is not None:
            try:
                os.write(ready_fd, b"ready\n")
                os.close(ready_fd)
            except OSError:
                pass

    try:
        fuse_ops.run(view, mountpoint, on_ready=ready, debug=debug, kernel_cache=kernel_cache,
                     allow_other=allow_other, watch=os.environ.get("STEPFS_WATCH", "1") != "0")
    finally:
        control.stop()
        if stepper is not None:
            stepper.stop()
        publisher.stop()
        view.close()
        ws.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepfs-daemon")
    parser.add_argument("workspace")
    parser.add_argument("mountpoint")
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--require-read", action="store_true")
    parser.add_argument("--auto-step", default="manual")
    parser.add_argument("--allow-other", action="store_true")
    parser.add_argument("--keep-last", type=int)
    parser.add_argument("--warn-size", type=int)
    parser.add_argument("--exclude", action="append", default=[])
    parser.add_argument("--no-default-excludes", action="store_true")
    args = parser.parse_args(argv)
    # A crash (a signal, a fatal error) leaves its traceback, every
    # thread's, in the log (stderr is the log file: manage.mount); the
    # tests fail a test whose daemon logged one (tests/mountguard.py).
    faulthandler.enable(file=sys.stderr, all_threads=True)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return serve(args.workspace, args.mountpoint, args.ready_fd, args.debug, args.require_read, args.auto_step,
                     args.allow_other, keep_last=args.keep_last, warn_size=args.warn_size, excludes=args.exclude,
                     default_excludes=not args.no_default_excludes)
    except Exception as exc:  # reported to the parent through the log file
        log.exception("daemon failed")
        print(f"stepfs: the mount daemon failed: {exc}", file=sys.stderr)
        return 9


if __name__ == "__main__":
    sys.exit(main())
