"""Publishing a daemon's own commits to the workspace's shared history
(``--auto-step close|idle:N`` on a workspace attached with ``--history``).

A step the CLI or the API asks for publishes in the caller's process
(``client/shared.py``: pull, commit, push under the history's lock).  A
commit the daemon makes by itself has no such caller, so after it the
daemon runs ``stepfs sync WORKSPACE`` as a process of its own, from a
thread of its own, one at a time: the daemon never talks to the history
server itself, so no FUSE request or control request can wait on the
network, and the sync asks every live mount (this one too, over the control
socket) to write its staged rows first, which a daemon cannot do itself.

A commit made while a sync runs is published by a sync run after it (one
more, however many commits came in meanwhile).  An unreachable server
(exit 19) leaves the layer committed here and is retried with a growing
pause (up to :data:`RETRY_MAX` seconds) while the daemon lives; the next
``stepfs step`` or ``stepfs sync`` publishes it too.  A conflict (exit 7:
another workspace changed a path this one's layer changed) is not retried:
it is recorded as the mount's last error (``MOUNT/.stepfs/status``) until a
later sync succeeds.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

from stepfs.store.shared.attachment import attached

log = logging.getLogger("stepfs.publisher")

#: Seconds one ``stepfs sync`` may take (its own statements are bounded too).
SYNC_TIMEOUT = 300
#: First and longest pause before a sync that found the server unreachable is tried again.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
#: ``cli/exitcodes.py``: the history server cannot be reached.
UNREACHABLE = 19
KEY = "shared history"


class Publisher:
    """Runs ``stepfs sync`` after the daemon's own commits (see the module doc)."""

    def __init__(self, view, ws):
        self.view = view
        self.ws = ws
        self._lock = threading.Lock()
        self._wanted = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def wrap(self, commit):
        """``commit`` followed by a publish when the workspace is attached
        (one stat; a workspace may be attached while it is mounted)."""

        def committed(*args, **kwargs):
            result = commit(*args, **kwargs)
            self.request()
            return result

        return committed

    def request(self) -> None:
        if not attached(self.ws.path):
            return
        with self._lock:
            self._wanted = True
            if self._thread is not None and self._thread.is_alive():
                return  # the running thread loops once more
            self._thread = threading.Thread(target=self._run, name="stepfs-publish", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No more syncs; one running is left to finish in its own process
        (an unmount never waits on the network)."""
        self._stop.set()

    def _run(self) -> None:
        pause = RETRY_FIRST
        while not self._stop.is_set():
            with self._lock:
                if not self._wanted:
                    self._thread = None
                    return
                self._wanted = False
            code = self._sync()
            if code == UNREACHABLE:
                with self._lock:
                    self._wanted = True  # the layer stays to be published
                if self._stop.wait(pause):
                    return
                pause = min(pause * 2, RETRY_MAX)
            else:
                pause = RETRY_FIRST

    def _sync(self) -> int:
        cmd = [sys.executable, "-m", "stepfs.cli.main", "sync", self.ws.path, "--json"]
        try:
            result = subprocess.run(cmd, capture_output=True, timeout=SYNC_TIMEOUT, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.view.last_errors[KEY] = f"publishing to the shared history did not run: {exc}"
            log.warning("publishing to the shared history did not run: %s", exc)
            return UNREACHABLE
        if result.returncode == 0:
            self.view.last_errors.pop(KEY, None)
            log.info("published to the shared history: %s", result.stdout.decode(errors="replace").strip())
        else:
            why = result.stderr.decode(errors="replace").strip().removeprefix("stepfs: ")
            self.view.last_errors[KEY] = why
            log.warning("publishing to the shared history failed (exit %d): %s", result.returncode, why)
        return result.returncode
