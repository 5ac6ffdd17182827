"""libfuse's ``fuse_main_real`` with a hook between the loop and the teardown
(daemon side, FUSE adapter; imports mfusepy).

libfuse 3.14's ``fuse_main_real`` runs the loop, then ``fuse_unmount``
(closes the session's ``/dev/fuse`` descriptor), then ``fuse_destroy``
(frees the node table and its lock, then calls the filesystem's
``destroy``).  Other threads of the daemon call into libfuse:
``fuse_invalidate_path`` (the watcher thread on outside edits, the control
thread on rollback and discard; ``notify.KernelCache``), which walks the
node table under its lock and writes to that descriptor.  libfuse's own
example of it (``example/invalidate_path.c``) calls it from a thread of its
own, which is what makes it safe off the loop thread while the session
lives; but a call still running once ``fuse_unmount`` or ``fuse_destroy``
has begun writes to a closed (maybe reused) descriptor and walks freed
nodes: the segfaults at unmount of issue 18 item 5.  ``destroy`` is too
late to stop them: it runs after the nodes are freed.

So mfusepy's call of ``fuse_main_real`` is replaced by the same sequence
(``fuse_parse_cmdline``, ``fuse_new``, ``fuse_mount``, signal handlers,
the loop, ``fuse_unmount``, ``fuse_destroy``, as in libfuse 3.14's
``lib/helper.c``; the loop is ``spin.loop``, which polls briefly before it
sleeps; single-threaded and in the foreground, which is all the
daemon asks for), with ``before_teardown()`` called when the loop has
returned and before anything is torn down: it closes the gate of every
libfuse call made off the loop thread and waits for the calls in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

import mfusepy

from stepfs.overlayfs.daemon.libfuse import spin

log = logging.getLogger("stepfs.fuse")


class _Args(ctypes.Structure):
    _fields_ = [("argc", ctypes.c_int), ("argv", ctypes.POINTER(ctypes.c_char_p)), ("allocated", ctypes.c_int)]


class _CmdlineOpts(ctypes.Structure):
    """``struct fuse_cmdline_opts`` of libfuse 3.12+ (fuse_lowlevel.h), with
    room to spare for fields a later version might append."""

    _fields_ = [("singlethread", ctypes.c_int), ("foreground", ctypes.c_int), ("debug", ctypes.c_int),
                ("nodefault_subtype", ctypes.c_int), ("mountpoint", ctypes.c_void_p),
                ("show_version", ctypes.c_int), ("show_help", ctypes.c_int), ("clone_fd", ctypes.c_int),
                ("max_idle_threads", ctypes.c_uint), ("max_threads", ctypes.c_uint),
                ("_spare", ctypes.c_char * 64)]


def supported() -> bool:
    """libfuse 3.12 or later (the ``fuse_cmdline_opts`` layout above, and
    ``fuse_new_31``)."""
    return mfusepy.fuse_version_major == 3 and mfusepy.fuse_version_minor >= 12


def _lib():
    lib = mfusepy._libfuse
    fn = lib.fuse_parse_cmdline_312
    fn.argtypes, fn.restype = [ctypes.POINTER(_Args), ctypes.POINTER(_CmdlineOpts)], ctypes.c_int
    fn = lib.fuse_new_31
    fn.argtypes, fn.restype = [ctypes.POINTER(_Args), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], \
        ctypes.c_void_p
    for name in ("fuse_mount",):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    for name in ("fuse_loop",):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_void_p], ctypes.c_int
    for name in ("fuse_unmount", "fuse_destroy", "fuse_remove_signal_handlers"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_void_p], None
    lib.fuse_set_signal_handlers.argtypes, lib.fuse_set_signal_handlers.restype = [ctypes.c_void_p], ctypes.c_int
    lib.fuse_get_session.argtypes, lib.fuse_get_session.restype = [ctypes.c_void_p], ctypes.c_void_p
    lib.fuse_opt_free_args.argtypes, lib.fuse_opt_free_args.restype = [ctypes.POINTER(_Args)], None
    return lib


def main_with_hook(before_teardown, lookups=None):
    """A replacement of mfusepy's ``fuse_main_real`` (same arguments, same
    return codes) that calls ``before_teardown()`` once the loop returned;
    ``lookups``: told of each LOOKUP by the loop (``spin.loop``)."""
    lib = _lib()
    libc = ctypes.CDLL(None)
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None

    def main(argc, argv, ops, ops_size, user_data) -> int:
        args = _Args(argc, ctypes.cast(argv, ctypes.POINTER(ctypes.c_char_p)), 0)
        opts = _CmdlineOpts()
        if lib.fuse_parse_cmdline_312(ctypes.byref(args), ctypes.byref(opts)) != 0:
            return 1
        try:
            if not opts.mountpoint or not opts.singlethread or not opts.foreground:
                log.error("fuse_main: a mountpoint, -s and -f are required")
                return 2
            fuse = lib.fuse_new_31(ctypes.byref(args), ctypes.cast(ops, ctypes.c_void_p), ops_size, user_data)
            if not fuse:
                return 3
            res = 0
            try:
                if lib.fuse_mount(fuse, opts.mountpoint) != 0:
                    return 4
                try:
                    se = lib.fuse_get_session(fuse)
                    if lib.fuse_set_signal_handlers(se) != 0:
                        return 6
                    try:
                        res = 8 if spin.loop(lib, libc, fuse, se, spin.limit_ns(), lookups) else 0
                    finally:
                        lib.fuse_remove_signal_handlers(se)
                        try:
                            before_teardown()
                        except Exception:  # the teardown must go on: the mount would stay behind
                            log.exception("stopping the daemon's threads before the teardown failed")
                finally:
                    lib.fuse_unmount(fuse)
            finally:
                lib.fuse_destroy(fuse)
            return res
        finally:
            if opts.mountpoint:
                libc.free(opts.mountpoint)
            lib.fuse_opt_free_args(ctypes.byref(args))

    return main


@contextlib.contextmanager
def hooked(before_teardown, lookups=None):
    """While in the block, mfusepy's ``FUSE(...)`` runs :func:`main_with_hook`
    (nothing changes where libfuse is older than 3.12: the hook then runs
    from ``destroy``, as late as before)."""
    if not supported():
        yield False
        return
    saved = mfusepy.fuse_main_real
    mfusepy.fuse_main_real = main_with_hook(before_teardown, lookups)
    try:
        yield True
    finally:
        mfusepy.fuse_main_real = saved
