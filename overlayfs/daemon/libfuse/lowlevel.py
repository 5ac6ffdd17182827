"""Wrapped entries of libfuse's low-level operation table (daemon side,
libfuse internals: the private ``struct fuse_session``): kernel-cached
directory listings (:class:`ListingCache`) and FLUSH replies sent before
the publish they decided (:class:`AfterReply`)."""

from __future__ import annotations

import ctypes
import logging

from stepfs.overlayfs.daemon.libfuse import mfusepy, private_layout_known

log = logging.getLogger("stepfs.fuse")


#: ``struct fuse_lowlevel_ops`` of libfuse 3.x (fuse_lowlevel.h), in order;
#: the high-level API's table (``fuse_path_ops``) leaves ``write`` and
#: ``retrieve_reply`` NULL, which :class:`ListingCache` uses as a fingerprint.
_LL_OPS = ("init", "destroy", "lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink",
           "rmdir", "symlink", "rename", "link", "open", "read", "write", "flush", "release", "fsync", "opendir",
           "readdir", "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr", "removexattr",
           "access", "create", "getlk", "setlk", "bmap", "ioctl", "poll", "write_buf", "retrieve_reply",
           "forget_multi", "flock", "fallocate", "readdirplus", "copy_file_range", "lseek")
#: Offset of ``op`` in the private ``struct fuse_session`` of the releases
#: in ``PRIVATE_LAYOUTS`` (lib/fuse_i.h: ``char *mountpoint; volatile int
#: exited; int fd; struct fuse_custom_io *io; struct mount_opts *mo; int
#: debug; int deny_others;``).
_SE_OP_OFFSET = 40
_SE_FD_OFFSET = 12
_FI_P = ctypes.POINTER(mfusepy.fuse_file_info)
_LL_OPENDIR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, _FI_P)
_LL_READDIR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, _FI_P)
_LL_LOOKUP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p)


def _libfuse_text() -> list[tuple[int, int]]:
    """Address ranges of libfuse3's executable code in this process."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "x" in fields[1] and "libfuse3.so" in fields[5]:
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


#: Addresses of the callbacks :func:`wrap` put in a table (each class
#: checks the table after the other may have wrapped its entries).
_WRAPPED: set[int] = set()


def op_table(fuse: int, consequence: str) -> int | None:
    """The address of the session's low-level operation table
    (``struct fuse_lowlevel_ops`` inside the private ``struct
    fuse_session``), or None when its layout is not proven (see
    :class:`ListingCache`; ``consequence`` completes the log line)."""
    if not private_layout_known():
        return None
    lib = mfusepy._libfuse
    se = lib.fuse_get_session(fuse)
    if not se:
        return None
    if ctypes.c_int.from_address(se + _SE_FD_OFFSET).value != lib.fuse_session_fd(se):
        log.info("libfuse's session layout is not the known one: %s", consequence)
        return None
    ops = (ctypes.c_void_p * len(_LL_OPS)).from_address(se + _SE_OP_OFFSET)
    text = _libfuse_text()
    for i, name in enumerate(_LL_OPS):
        addr = ops[i] or 0
        if name in ("getlk", "setlk"):
            continue  # NULL unless the filesystem has a lock handler
        if addr in _WRAPPED:
            continue  # wrapped by this module already (the other class's entries)
        if (addr == 0) != (name in ("write", "retrieve_reply")) or (
                addr and not any(lo <= addr < hi for lo, hi in text)):
            log.info("libfuse's low-level table is not the known one: %s", consequence)
            return None
    return se + _SE_OP_OFFSET


def wrap(table: int, name: str, hook, slots: list) -> object:
    """Put C callback ``hook`` in entry ``name`` of the table at ``table``;
    returns libfuse's own handler (callable, of ``hook``'s type) and
    appends ``(slot, old address)`` to ``slots`` for :func:`unwrap`."""
    i = _LL_OPS.index(name)
    slot = ctypes.c_void_p.from_address(table + i * ctypes.sizeof(ctypes.c_void_p))
    orig = slot.value
    slots.append((slot, orig))
    slot.value = ctypes.cast(hook, ctypes.c_void_p).value
    _WRAPPED.add(slot.value)
    return type(hook)(orig)


def unwrap(slots: list) -> None:
    """Put libfuse's own handlers back (what :func:`wrap` recorded)."""
    for slot, addr in slots:
        _WRAPPED.discard(slot.value)
        slot.value = addr
    slots.clear()


class ListingCache:
    """Lets the kernel cache directory listings (``FOPEN_CACHE_DIR`` with
    ``FOPEN_KEEP_CACHE`` on an opendir reply), which libfuse 3.14's
    high-level API cannot ask for: its ``fuse_lib_opendir`` hands the
    filesystem a private ``fuse_file_info`` and replies with its own, copying
    only ``fh`` (3.16 copies ``cache_readdir`` and ``keep_cache`` too).

    So the session's low-level ``opendir`` entry is wrapped: the wrapper
    sets both flags on the reply's ``fuse_file_info``, then calls libfuse's
    own ``opendir`` (which leaves them alone).  The wrapper sees a node id,
    not a path; the directories that must not be cached (``MOUNT/.stepfs``
    and below: generated from the store, they change with no event) are
    learned by node id at their first uncached read, through wrapped
    ``readdir``/``readdirplus`` entries (:attr:`dir_node` names the node
    while ``_FUSE.readdir_fuse_3`` runs).  Caching on that first open is
    harmless: it is filled by fresh reads, and every later open of the node
    goes without ``keep_cache``, which drops it.  Node ids name one node
    until libfuse reuses them after 2**32 others, so :attr:`uncached` is
    never pruned (it holds the ``.stepfs`` directories visited).

    The table is private to libfuse, so it is patched only when its layout
    is proven: a release whose ``struct fuse_session`` prefix was verified
    (:func:`private_layout_known`, asked of the loaded library), the
    session's ``fd`` field equal to
    ``fuse_session_fd()``, every handler of the high-level table inside
    libfuse's code and exactly ``write`` and ``retrieve_reply`` NULL.
    Otherwise nothing is patched and listings are simply not cached.  The
    loop is single-threaded (``nothreads``), so plain attributes suffice.

    What keeps a cached listing true (the kernel drops it when the
    directory's mtime or change counter moved, or its pages are
    invalidated): changes through the mount bump the directory's counter in
    the kernel; outside edits reach :class:`KernelCache.invalidate` of the
    parent directory through the watcher; rollback and discard invalidate
    every ancestor of what they changed (``daemon.py``).  A change whose
    event was lost stays hidden no longer than a name would: at the start
    of a listing the kernel refreshes the directory's expired attributes
    (libfuse asks for ``auto_inval_data``) and drops the cached listing when
    its mtime moved.  Nothing is cached once the mount cannot watch (:attr:`enabled` cleared by
    :meth:`StepFS.short_timeouts`): an opendir without ``keep_cache`` drops
    the directory's cached listing."""

    def __init__(self) -> None:
        self.enabled = False  # set by StepFS once installed and watching
        self.dir_node = 0  # node id of the directory whose readdir is in flight
        self.uncached: set[int] = set()  # node ids of .stepfs directories
        # A LOOKUP is being answered (the high-level API asks getattr for
        # both LOOKUP and GETATTR): see StepFS.getattr's gone paths.  True
        # while the hook is not installed: a request that may be a LOOKUP
        # must get the truth, never ESTALE (issue 18 item 6).
        self.in_lookup = True
        self.installed = False
        # The LOOKUP being answered (parent node id, name), and libfuse's live
        # ``struct fuse_config``: a negative answer may set its
        # ``negative_timeout`` for that one reply (StepFS.getattr); it is put
        # back to 0 as soon as the reply is sent.
        self.lookup_parent = 0
        self._lookup_name: bytes | int = b""  # or the address of the name in the request
        self.config = None
        # The request loop tells LOOKUPs from their kernel header
        # (``spin.loop``): the ``lookup`` entry is then left as it is.
        self.told_by_loop = False
        self._slots: list[tuple[ctypes.c_void_p, int]] = []
        self._orig: dict[str, object] = {}
        # C callbacks, kept alive as long as the session.
        self._hooks = {"opendir": _LL_OPENDIR(self._opendir), "readdir": _LL_READDIR(self._reading("readdir")),
                       "readdirplus": _LL_READDIR(self._reading("readdirplus")), "lookup": _LL_LOOKUP(self._lookup)}

    # The wrappers are C callbacks: whatever happens, libfuse's own handler
    # must run, or the request would never be answered.
    def _opendir(self, req, ino, llfi):
        try:
            if self.enabled and ino not in self.uncached:
                fi = llfi.contents
                fi.cache_readdir = 1
                fi.keep_cache = 1
        finally:
            self._orig["opendir"](req, ino, llfi)

    @property
    def lookup_name(self) -> bytes:
        """The name the LOOKUP being answered asks for (read from the
        request only when asked: most LOOKUPs never need it)."""
        name = self._lookup_name
        if name.__class__ is int:
            name = self._lookup_name = ctypes.string_at(name)
        return name

    def loop_tells(self, on: bool) -> None:
        """The request loop tells each LOOKUP from now on (``on``), before
        any request is read, or stopped (``spin.loop``): the ``lookup``
        entry is then not wrapped, and :attr:`in_lookup` is exact."""
        self.told_by_loop = on
        self.in_lookup = False

    def lookup_begins(self, parent: int, name: bytes | int) -> None:
        """A LOOKUP of ``name`` (or the address of its NUL-terminated bytes,
        valid until :meth:`lookup_ends`) in node ``parent`` is processed."""
        self.in_lookup = True
        self.lookup_parent, self._lookup_name = parent, name

    def lookup_ends(self) -> None:
        """Its reply is sent: a negative timeout raised for it is put back."""
        self.in_lookup = False
        self._lookup_name = b""
        config = self.config
        if config is not None and config.negative_timeout:
            config.negative_timeout = 0.0

    def _lookup(self, req, parent, name):
        self.lookup_begins(parent, name)
        try:
            self._orig["lookup"](req, parent, name)
        finally:
            self.lookup_ends()

    def _reading(self, op: str):
        """The wrapper of libfuse's ``readdir`` or ``readdirplus``: names
        the directory (:attr:`dir_node`) while libfuse's handler runs."""
        def wrapper(req, ino, size, off, llfi):
            self.dir_node = ino
            try:
                self._orig[op](req, ino, size, off, llfi)
            finally:
                self.dir_node = 0
        return wrapper

    def install(self, fuse: int) -> bool:
        """Wrap the session's low-level ``opendir``, ``readdir`` and
        ``readdirplus`` (from ``init``, on the loop thread, before any of
        them can arrive); returns whether listings can now be cached."""
        ops = op_table(fuse, "directory listings are not cached")
        if ops is None:
            return False
        for name, hook in self._hooks.items():
            if name != "lookup" or not self.told_by_loop:
                self._orig[name] = wrap(ops, name, hook, self._slots)
        self.installed = True
        self.in_lookup = False
        return True

    def uninstall(self) -> None:
        """Put libfuse's own handlers back (from ``destroy``)."""
        self.enabled = self.in_lookup = self.installed = False
        self.config = None
        unwrap(self._slots)


_LL_FLUSH = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, _FI_P)


class AfterReply:
    """Work a FLUSH leaves for after its reply: the session's low-level
    ``flush`` entry is wrapped, the wrapper calls libfuse's own (which
    calls ``StepFS.flush`` and sends the reply), then runs what that
    ``flush`` handed to :meth:`later`, on the loop thread, before the next
    request is read.  So ``close(2)`` returns while the daemon still
    publishes what the close decided (``content.Content.flush`` says what
    may wait and why that is safe).

    Only a FLUSH request may leave work (:attr:`in_flush`: libfuse's
    ``release`` calls the filesystem's ``flush`` too, with no wrapper
    around it to run the work).  Installed only where libfuse's private
    layout is proven (:func:`op_table`); otherwise :attr:`in_flush` is
    never set and every FLUSH does all its work before its reply."""

    def __init__(self) -> None:
        self.in_flush = False  # a wrapped FLUSH is being answered
        self.installed = False
        #: Called with the exception when the work after a reply failed
        #: (the caller was answered 0 already: the mount turns read-only).
        self.on_failure = None
        self._work = None
        self._orig = None
        self._slots: list = []
        self._hook = _LL_FLUSH(self._flush)  # kept alive as long as the session

    def later(self, work) -> None:
        """Run ``work()`` once this FLUSH's reply is sent (only while
        :attr:`in_flush`)."""
        self._work = work

    def _flush(self, req, ino, llfi):
        # A C callback: libfuse's handler must run whatever happens, or the
        # request would never be answered; the work must run once it has.
        self.in_flush = True
        try:
            self._orig(req, ino, llfi)
        finally:
            self.in_flush = False
            work, self._work = self._work, None
            if work is not None:
                try:
                    work()
                except BaseException as exc:  # noqa: B036 (a C callback: nothing may escape)
                    log.exception("the work after a FLUSH reply failed")
                    if self.on_failure is not None:
                        try:
                            self.on_failure(exc)
                        except Exception:
                            log.exception("tripping the failsafe failed")

    def install(self, fuse: int) -> bool:
        """Wrap the session's low-level ``flush`` (from ``init``, on the
        loop thread); returns whether FLUSH replies now come first."""
        table = op_table(fuse, "a close waits for its publish")
        if table is None:
            return False
        self._orig = wrap(table, "flush", self._hook, self._slots)
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put libfuse's own handler back (teardown)."""
        self.installed = self.in_flush = False
        unwrap(self._slots)
