"""A mount daemon's bounded history: prune after each step (``stepfs mount
--keep-last N``), gc now and then in the background, and a warning when
the store passes the size the user set (``--warn-size``).

Runs after a commit has completed (``view.commit`` returned), on the thread
that committed; gc runs as a ``stepfs gc`` process started from a thread of
its own, one at a time, which asks every live mount (this one included) to
write its staged rows first (``store/gc.py``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

from stepfs.store import gc, prune
from stepfs.store.units import human
from stepfs.store.errors import StepfsError

log = logging.getLogger("stepfs.retention")

#: Steps between two background gc runs when pruning drops layers.
GC_EVERY = 10
#: Seconds a background gc may take.
GC_TIMEOUT = 600


class AfterStep:
    def __init__(self, view, ws, keep_last: int | None = None, warn_size: int | None = None,
                 gc_every: int = GC_EVERY):
        self.view = view
        self.ws = ws
        self.keep_last = keep_last
        self.warn_size = warn_size
        self.gc_every = gc_every
        self._steps = 0
        self._gc: threading.Thread | None = None

    def wrap(self, commit):
        """``view.commit`` followed by this (the daemon's commit requests and
        its auto-stepper both call ``view.commit``)."""

        def committed(*args, **kwargs):
            result = commit(*args, **kwargs)
            try:
                self()
            except StepfsError as exc:  # never fails the step that just committed
                log.warning("retention after the step failed: %s", exc)
            return result

        return committed

    def __call__(self) -> None:
        self._steps += 1
        if self.keep_last is not None:
            result = prune.prune(self.ws, keep_last=self.keep_last)
            if result.keep_from is not None:
                log.info("pruned layers %s; layer %d is the oldest kept", result.pruned, result.keep_from)
            if self._steps % self.gc_every == 0:
                self.start_gc()
        self.check_size()

    def start_gc(self) -> None:
        if self._gc is not None and self._gc.is_alive():
            return
        self._gc = threading.Thread(target=self._run_gc, name="stepfs-gc", daemon=True)
        self._gc.start()

    def _run_gc(self) -> None:
        # As a separate ``stepfs gc``: it asks every live mount of the
        # workspace (this one too, over the control socket, whose thread is
        # free by now) to write its staged rows before the sweep, which a
        # daemon cannot do itself (it does not import the client).
        cmd = [sys.executable, "-m", "stepfs.cli.main", "gc", self.ws.path, "--json"]
        try:
            result = subprocess.run(cmd, capture_output=True, timeout=GC_TIMEOUT, stdin=subprocess.DEVNULL)
            if result.returncode != 0:
                log.warning("background gc failed: %s", result.stderr.decode(errors="replace").strip())
            else:
                log.info("background gc: %s", result.stdout.decode(errors="replace").strip())
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("background gc did not run: %s", exc)
        self.check_size()

    def check_size(self) -> None:
        if self.warn_size is None:
            return
        size = gc.store_bytes(self.ws)
        warnings = [w for w in self.view.warnings if not w.startswith("store size")]
        if size > self.warn_size:
            text = (f"store size {human(size)} is over the {human(self.warn_size)} set at mount; "
                    f"'stepfs prune --keep-last N' and 'stepfs gc' make room")
            warnings.append(text)
            log.warning("%s", text)
        self.view.warnings = warnings
