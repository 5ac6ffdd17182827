"""Everything stepfs does with libfuse beyond mfusepy's high-level API
(daemon side; the only package besides ``fuse_ops`` that imports mfusepy).

``fuse_ops`` is the operations table; what it needs from libfuse that the
high-level API does not offer lives here, one concern per module:

* ``loop``: ``fuse_main_real`` again, with a hook between the loop and the
  teardown (public API of libfuse 3.12+).
* ``spin``: the request loop itself, polling for the next request for a
  while before it sleeps (public ``fuse_session_*`` API).
* ``notify``: invalidations (``fuse_invalidate_path``) and the raw
  ``FUSE_NOTIFY_INC_EPOCH`` notification written to ``/dev/fuse`` (the
  kernel's ABI, not libfuse's).
* ``lowlevel``: kernel-cached directory listings and FLUSH replies sent
  before their publish, by wrapping entries of the
  low-level operation table inside libfuse's PRIVATE ``struct
  fuse_session``: the one place that depends on libfuse's internal layout,
  and so the one place behind :func:`private_layout_known`.
* ``statbuf``: ``struct stat`` packed in one call where its offsets are the
  known ones (checked against mfusepy's ``c_stat``).
* ``highlevel``: mfusepy's ``FUSE`` class with READDIR/READDIRPLUS replies
  and a few callbacks re-done (public filler API).
* ``bufs``: READ replies spliced from the file and WRITE data copied by
  libfuse (``read_buf``/``write_buf``, public ``fuse_bufvec`` API), so no
  byte of file data passes through a Python ``bytes``.
* ``readahead``: the mount's readahead window raised after INIT (sysfs),
  so a sequential reader costs fewer, larger READs.
"""

from __future__ import annotations

import ctypes
import logging
import os

# libfuse3, not libfuse2 where both exist (fuse_ops.py's docstring says why).
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy  # noqa: E402  (needs the environment variable above)

log = logging.getLogger("stepfs.fuse")

#: libfuse releases whose private ``struct fuse_session`` starts as
#: ``lowlevel`` assumes (lib/fuse_i.h: ``mountpoint, exited, fd, io, mo,
#: debug, deny_others``, then the operation table at byte 40 on a 64-bit
#: build), read in each release's source; 3.14 also runs under the test
#: suite.  3.12 has no ``io`` (the table is at byte 32), and 3.16 passes
#: ``cache_readdir`` through its high-level ``opendir`` by itself.
PRIVATE_LAYOUTS = frozenset({(3, 13), (3, 14), (3, 15)})
#: Set to ``off`` to keep every private structure of libfuse untouched
#: whatever its version (the mount then caches no directory listing).
PRIVATE_ENV = "STEPFS_LIBFUSE_PRIVATE"


def version() -> tuple[int, ...]:
    """The version of the libfuse loaded in this process: its
    ``fuse_pkgversion()`` (``"3.14.0"``), else ``fuse_version()``'s major
    and minor (what the library says, not what its headers said at build)."""
    lib = mfusepy._libfuse
    try:
        fn = lib.fuse_pkgversion
        fn.argtypes, fn.restype = [], ctypes.c_char_p
        return tuple(int(part) for part in fn().decode().split(".")[:3])
    except (AttributeError, ValueError):
        return (mfusepy.fuse_version_major, mfusepy.fuse_version_minor)


def private_layout_known() -> bool:
    """Whether libfuse's private structures may be patched (``lowlevel``):
    only on a release in :data:`PRIVATE_LAYOUTS`, built for 64 bits, and not
    turned off through :data:`PRIVATE_ENV`.  Says why in one log line when
    not, so that a mount without cached listings is explained."""
    running = version()
    text = ".".join(map(str, running))
    if os.environ.get(PRIVATE_ENV, "").lower() == "off":
        why = f"{PRIVATE_ENV}=off"
    elif running[:2] not in PRIVATE_LAYOUTS or ctypes.sizeof(ctypes.c_void_p) != 8:
        why = "a version whose private layout stepfs has not verified"
    else:
        return True
    log.info("libfuse %s: %s; directory listings are not cached (the high-level path serves them)", text, why)
    return False
