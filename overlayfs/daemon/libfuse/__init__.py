"""Everything stepfs does with libfuse beyond mfusepy's high-level API
(daemon side; the only package besides ``fuse_ops`` that imports mfusepy).

``fuse_ops`` is the operations table; what it needs from libfuse that the
high-level API does not offer lives here, one concern per module:

* ``loop``: ``fuse_main_real`` again, with a hook between the loop and the
  teardown (public API of libfuse 3.12+).
* ``notify``: invalidations (``fuse_invalidate_path``) and the raw
  ``FUSE_NOTIFY_INC_EPOCH`` notification written to ``/dev/fuse`` (the
  kernel's ABI, not libfuse's).
* ``lowlevel``: kernel-cached directory listings by wrapping entries of the
  low-level operation table inside libfuse's PRIVATE ``struct
  fuse_session``: the one place that depends on libfuse's internal layout,
  and so the one place behind :func:`private_layout_known`.
* ``statbuf``: ``struct stat`` packed in one call where its offsets are the
  known ones (checked against mfusepy's ``c_stat``).
* ``highlevel``: mfusepy's ``FUSE`` class with READDIR/READDIRPLUS replies
  and a few callbacks re-done (public filler API).
"""

from __future__ import annotations

import os

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy  # noqa: E402,F401  (needs the environment variable above)
