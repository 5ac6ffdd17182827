"""The mount's readahead window, raised once the kernel has the mount, and
the READ size it is cut into (daemon side; Linux sysfs, no libfuse call).

The kernel reads ahead of a sequential reader in windows of the mount's
``read_ahead_kb`` (128 KiB for a new FUSE mount), cut into READ requests
of at most the mount's ``max_read``.  A single-threaded Python daemon pays
its per-request cost 512 times for a 64 MiB file at 128 KiB; at
:data:`READ_KIB` it pays it 128 times.  A READ stays at that size, under
libfuse's splice pipe (1 MiB, the default ``/proc/sys/fs/pipe-max-size``):
a larger one is answered by a ``pread`` and a copy instead of a splice,
which measured slower.

The window is :data:`WINDOW_KIB`, several READs: the kernel queues a
window's READs at once, so the daemon finds the next one waiting when it
has answered one, instead of going to sleep in ``read(/dev/fuse)`` and
being woken (and, on a busy machine, waiting for a CPU) once per READ
while the reader asks for the next window.  Two windows of four READs stay under the kernel's default FUSE congestion threshold (9
background requests of 12), past which it skips the async part of a
window.

The FUSE INIT reply can only lower the window (the kernel keeps the
smaller of its own and the daemon's ``max_readahead``), so it is written
to ``/sys/class/bdi/0:MINOR/read_ahead_kb`` after INIT: from a side
thread whose ``stat`` of the mountpoint returns once INIT is done and
names the mount's device.  Only root may write it; anywhere else (no
sysfs, not root, the mount gone) the default window stays and nothing
is reported, since nothing but speed depends on it.  ``max_read`` is a
mount option (:data:`READ_BYTES`, given by ``fuse_ops.run``), which
libfuse 3.14 also wants set in ``init`` (``StepFS.init_with_config``).
"""

from __future__ import annotations

import os
import threading

#: KiB per READ at most: a READ + its header within libfuse's 1 MiB splice pipe.
READ_KIB = 512
#: The same in bytes: the mount's ``max_read`` option.
READ_BYTES = READ_KIB << 10
#: KiB per readahead window: four READs queued at once (16x the kernel's default window).
WINDOW_KIB = 4 * READ_KIB


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
