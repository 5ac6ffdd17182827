"""Automatic steps: ``stepfs mount --auto-step close|idle:SECONDS`` (no FUSE).

A policy thread commits the open step for the agent harness that does not
call ``stepfs step`` itself:

* ``manual`` (default): never.
* ``close``: soon after every close-write or metadata change (the commit
  runs on this thread, not in the FUSE request, so closes stay fast; changes
  arriving during a commit go into the next one).
* ``idle:SECONDS``: once the mount has seen no change for that long.

A commit that is refused (a conflict with an outside edit) is recorded as
the mount's last error (``MOUNT/.stepfs/status``) and retried only after the
next change.  Threading: the view's own lock serialises the commit with FUSE
requests; this thread only waits on an event.
"""

from __future__ import annotations

import logging
import threading
import time

from stepfs.store.errors import NothingToCommit, StepfsError

log = logging.getLogger("stepfs.autostep")


class AutoStepper:
    """Commits ``view``'s open step according to ``delay`` (see ``protocol.parse_auto_step``)."""

    def __init__(self, view, delay: float):
        self.view = view
        self.delay = delay
        self.changed = threading.Event()
        self.last_change = 0.0
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="stepfs-autostep", daemon=True)

    def start(self) -> None:
        self.view.on_change = self.notify
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self.changed.set()
        self.thread.join(timeout=10)

    def notify(self) -> None:
        """Called by the view (under its lock) after each staged change."""
        self.last_change = time.monotonic()
        self.changed.set()

    def _run(self) -> None:
        while not self._stop:
            self.changed.wait()
            if self._stop:
                return
            # Wait until the mount has been quiet for `delay` seconds.
            while not self._stop:
                quiet = time.monotonic() - self.last_change
                if quiet >= self.delay:
                    break
                time.sleep(min(self.delay - quiet, 0.5))
            self.changed.clear()
            try:
                number = self.view.commit(message="auto step", meta={"auto_step": "1"})
                log.info("auto step committed layer %d", number)
            except NothingToCommit:
                pass
            except StepfsError as exc:
                self.view.last_errors["auto-step"] = str(exc)
                log.warning("auto step refused: %s", exc)
