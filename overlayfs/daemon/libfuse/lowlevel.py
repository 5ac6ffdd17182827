"""Kernel-cached directory listings through libfuse's low-level operation
table (daemon side, libfuse internals: the private ``struct fuse_session``)."""

from __future__ import annotations

import ctypes
import logging
import struct

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
_LL_LOOKUP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
#: ``struct fuse_in_header`` (the kernel's ABI): len, opcode, unique, nodeid;
#: a LOOKUP's argument, its name, follows the 40-byte header.
_IN_HEADER = struct.Struct("=IIQQ")
_IN_HEADER_SIZE = 40
_FUSE_LOOKUP = 1
#: Offsets in libfuse's private structures of :data:`PRIVATE_LAYOUTS`
#: (lib/fuse.c ``struct fuse_context_i``: the public ``struct fuse_context``,
#: 40 bytes, then ``fuse_req_t req``; lib/fuse_i.h ``struct fuse_req``:
#: ``se``, then ``uint64_t unique``).
_CTX_REQ_OFFSET = 40
_REQ_UNIQUE_OFFSET = 8
_U64_AT = ctypes.c_uint64.from_address
_PTR_AT = ctypes.c_void_p.from_address


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
        self.installed = False
        # Set by the lookup hook while it answers a LOOKUP (before the
        # request buffer is known, or where it cannot be: see in_lookup).
        self._hook_lookup = False
        self.lookup_parent = 0
        self.lookup_name = b""
        # libfuse's request buffer (its ``struct fuse_in_header``) and the
        # loop thread's ``struct fuse_context_i`` field naming the request
        # being answered: learned and checked at the first LOOKUP (_learn),
        # 0 until then.
        self._header = 0
        self._header_mem = None
        self._ctx_req = 0
        self._learnable = True  # until learned, or found not to fit once
        # libfuse's live ``struct fuse_config``: a negative answer may set
        # its ``negative_timeout`` for that one reply (StepFS._negative).
        self.config = None
        self._slots: list[tuple[ctypes.c_void_p, int]] = []
        self._lookup_slot: ctypes.c_void_p | None = None
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

    def _lookup(self, req, parent, name):
        """The LOOKUP hook, until :meth:`_learn` finds libfuse's request
        buffer (then libfuse's own handler is put back, and the request
        being answered is read from that buffer: :attr:`in_lookup`)."""
        self._hook_lookup = True
        learning = False
        try:
            self.lookup_parent, self.lookup_name = parent, ctypes.string_at(name)
            learning = self._learnable and self._header_fits(req, parent, name)
        except Exception:
            log.exception("reading a LOOKUP request failed")
        try:
            self._orig["lookup"](req, parent, name)
        finally:
            self._hook_lookup = False
            config = self.config
            if config is not None and config.negative_timeout:
                config.negative_timeout = 0.0
            if learning:
                self._learn(req, name)

    def _header_fits(self, req: int, parent: int, name: int) -> bool:
        """Whether the ``struct fuse_in_header`` in front of a LOOKUP's
        name is this request's: a LOOKUP of ``parent`` whose ``unique`` is
        the one of libfuse's ``struct fuse_req``."""
        _len, opcode, unique, nodeid = _IN_HEADER.unpack(ctypes.string_at(name - _IN_HEADER_SIZE, _IN_HEADER.size))
        if opcode == _FUSE_LOOKUP and nodeid == parent and _U64_AT(req + _REQ_UNIQUE_OFFSET).value == unique:
            return True
        self._learnable = False
        log.info("libfuse's request buffer is not the known one: LOOKUPs keep their hook")
        return False

    def _learn(self, req: int, name: int) -> None:
        """After the first LOOKUP whose header fit (:meth:`_header_fits`):
        if the loop thread's context names that request (libfuse set it
        while answering), keep the buffer's address (the single-threaded
        loop receives every request into one buffer, allocated once:
        lib/fuse_loop.c) and put libfuse's own LOOKUP handler back, so a
        LOOKUP no longer passes through Python twice.  Otherwise the hook
        stays."""
        self._learnable = False
        try:
            ctx = ctypes.addressof(mfusepy._libfuse.fuse_get_context().contents) + _CTX_REQ_OFFSET
            if _PTR_AT(ctx).value != req or self._lookup_slot is None:
                log.info("libfuse's request context is not the known one: LOOKUPs keep their hook")
                return
            head = name - _IN_HEADER_SIZE
            self._header_mem = (ctypes.c_char * _IN_HEADER.size).from_address(head)
            self._ctx_req, self._header = ctx, head
            self._lookup_slot.value = ctypes.cast(self._orig["lookup"], ctypes.c_void_p).value
        except Exception:
            log.exception("finding libfuse's request buffer failed: LOOKUPs keep their hook")

    def _request(self) -> tuple[int, int] | None:
        """``(opcode, node id)`` of the request being answered, read from
        libfuse's request buffer; None when that buffer does not hold it
        (its ``unique`` is not the current request's)."""
        _len, opcode, unique, nodeid = _IN_HEADER.unpack(self._header_mem)
        req = _PTR_AT(self._ctx_req).value
        if not req or _U64_AT(req + _REQ_UNIQUE_OFFSET).value != unique:
            return None
        return opcode, nodeid

    @property
    def requests_read(self) -> bool:
        """Whether the request being answered is read from libfuse's buffer
        (the LOOKUP hook is gone)."""
        return bool(self._header)

    @property
    def in_lookup(self) -> bool:
        """Whether the request being answered may be a LOOKUP (the
        high-level API asks getattr for both LOOKUP and GETATTR): see
        StepFS.getattr's gone paths.  True when that cannot be told (the
        hook not installed, a request not found in the buffer): a request
        that may be a LOOKUP must get the truth, never ESTALE (issue 18
        item 6).  Loop thread only."""
        if self._header:
            req = self._request()
            return req is None or req[0] == _FUSE_LOOKUP
        return self._hook_lookup or not self.installed

    def lookup_target(self) -> tuple[int, bytes] | None:
        """``(parent node id, name)`` of the LOOKUP being answered, None
        when the request is not a LOOKUP or cannot be told (loop thread)."""
        if self._header:
            req = self._request()
            if req is None or req[0] != _FUSE_LOOKUP:
                return None
            return req[1], ctypes.string_at(self._header + _IN_HEADER_SIZE)
        if self._hook_lookup:
            return self.lookup_parent, self.lookup_name
        return None

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
        if not private_layout_known():
            return False
        lib = mfusepy._libfuse
        se = lib.fuse_get_session(fuse)
        if not se:
            return False
        if ctypes.c_int.from_address(se + _SE_FD_OFFSET).value != lib.fuse_session_fd(se):
            log.info("libfuse's session layout is not the known one: directory listings are not cached")
            return False
        ops = (ctypes.c_void_p * len(_LL_OPS)).from_address(se + _SE_OP_OFFSET)
        text = _libfuse_text()
        for i, name in enumerate(_LL_OPS):
            addr = ops[i] or 0
            if name in ("getlk", "setlk"):
                continue  # NULL unless the filesystem has a lock handler
            if (addr == 0) != (name in ("write", "retrieve_reply")) or (
                    addr and not any(lo <= addr < hi for lo, hi in text)):
                log.info("libfuse's low-level table is not the known one: directory listings are not cached")
                return False
        size = ctypes.sizeof(ctypes.c_void_p)
        for name, hook in self._hooks.items():
            i = _LL_OPS.index(name)
            self._orig[name] = type(hook)(ops[i])
            slot = ctypes.c_void_p.from_address(se + _SE_OP_OFFSET + i * size)
            self._slots.append((slot, ops[i]))
            if name == "lookup":
                self._lookup_slot = slot
            slot.value = ctypes.cast(hook, ctypes.c_void_p).value
        self.installed = True
        return True

    def uninstall(self) -> None:
        """Put libfuse's own handlers back (from ``destroy``)."""
        self.enabled = self.installed = False
        self._header = 0
        self._header_mem = None
        self._lookup_slot = None
        self._learnable = False
        self.config = None
        for slot, addr in self._slots:
            slot.value = addr
        self._slots.clear()
