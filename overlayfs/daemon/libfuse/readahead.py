"""The mount's readahead window, raised once the kernel has the mount
(daemon side; Linux sysfs, no libfuse call).

The kernel reads ahead of a sequential reader in windows of the mount's
``read_ahead_kb`` (128 KiB for a new FUSE mount), and each window is one
READ request.  A single-threaded Python daemon pays its per-request cost
512 times for a 64 MiB file at that size; at :data:`WINDOW_KIB` it pays it
128 times.  The size stays under libfuse's splice pipe (1 MiB, the
default ``/proc/sys/fs/pipe-max-size``): a larger READ is answered by a
``pread`` and a copy instead of a splice, which measured slower.

The FUSE INIT reply can only lower the window (the kernel keeps the
smaller of its own and the daemon's ``max_readahead``), so it is written
to ``/sys/class/bdi/0:MINOR/read_ahead_kb`` after INIT: from a side
thread whose ``stat`` of the mountpoint returns once INIT is done and
names the mount's device.  Only root may write it; anywhere else (no
sysfs, not root, the mount gone) the default window stays and nothing
is reported, since nothing but speed depends on it.
"""

from __future__ import annotations

import os
import threading

#: KiB per readahead window: 4x the kernel's default, a READ + header within a 1 MiB pipe.
WINDOW_KIB = 512


def set_window(mountpoint: str, kib: int = WINDOW_KIB) -> bool:
    """Write the window of the FUSE mount at ``mountpoint``; False when it
    could not, or when what is there is not a FUSE mount (``fusectl`` names
    each connection by its device's minor number): a mount already gone
    must not have the directory below it, or its disk, retuned."""
    try:
        dev = os.stat(mountpoint).st_dev  # returns once the kernel has processed INIT
        if os.major(dev) != 0 or not os.path.isdir(f"/sys/fs/fuse/connections/{os.minor(dev)}"):
            return False
        with open(f"/sys/class/bdi/0:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(f"{kib}\n")
        return True
    except OSError:
        return False


def raise_after_init(mountpoint: str, kib: int = WINDOW_KIB) -> threading.Thread:
    """Start the side thread (call from libfuse's init callback, before the
    INIT reply: a ``stat`` on the loop thread there would wait for itself)."""
    t = threading.Thread(target=set_window, args=(mountpoint, kib), name="stepfs-readahead", daemon=True)
    t.start()
    return t
