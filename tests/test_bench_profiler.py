"""The bench profiler's split of py-spy samples into busy and idle
(``bench/profiler.py``), on stacks shaped like the daemon's today: the
FUSE loop of ``overlayfs/daemon/libfuse/loop.py`` waiting in ``read``, the
watcher in ``poll``, helper threads parked on a condition.  Counted as
busy, those waits made up about 85% of the "busy" samples of a profile of
the tools row and hid the request path.
"""

from __future__ import annotations

import sys

from conftest import ROOT

if str(ROOT) not in sys.path:  # the bench is a directory of the repository, not an installed package
    sys.path.insert(0, str(ROOT))
from bench import profiler  # noqa: E402

MAIN = "<module> (/x/overlayfs/daemon/main.py);serve (/x/overlayfs/daemon/main.py)"
LOOP = MAIN + ";main_with_hook.<locals>.main (/x/overlayfs/daemon/libfuse/loop.py)"
THREAD = "Thread._bootstrap (/usr/lib/threading.py);Thread.run (/usr/lib/threading.py)"
WAIT = "Condition.wait (/usr/lib/threading.py);0x7f00 (libc.so.6)"
RAW = "\n".join([
    f"{LOOP};read (libc.so.6) 50",                                                   # idle: waiting for a request
    f"{THREAD};Watcher._run (/x/overlayfs/daemon/watch.py);poll (libc.so.6) 30",     # idle: watcher
    f"{THREAD};RowTimer._run (/x/store/rows.py);{WAIT} 40",                          # idle: parked helper
    f"{LOOP};FUSE._wrapper (/x/mfusepy.py);Overlay.rename (/x/view.py);{WAIT} 7",    # busy: a request waiting
    f"{LOOP};FUSE._wrapper (/x/mfusepy.py);Overlay.getattr (/x/view.py) 3",          # busy: a request working
])


def test_daemon_waits_are_idle_and_request_stalls_are_busy():
    s = profiler.summarize(RAW)
    assert (s["busy_samples"], s["idle_samples"]) == (10, 120)
    python = {e["frame"]: e["samples"] for e in s["self_python"]}
    assert python == {"Condition.wait (threading.py)": 7, "Overlay.getattr (view.py)": 3}
    inclusive = {e["frame"] for e in s["inclusive"]}
    assert "Overlay.rename (view.py)" in inclusive and "FUSE._wrapper (mfusepy.py)" in inclusive
    assert not inclusive & {"main_with_hook.<locals>.main (loop.py)", "serve (main.py)", "Thread.run (threading.py)"}
