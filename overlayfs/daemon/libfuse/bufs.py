"""READ replies and WRITE data without Python copies (daemon side, public
libfuse API: ``struct fuse_bufvec`` and ``fuse_buf_copy`` of fuse_common.h).

mfusepy's ``read`` makes a ``bytes`` of every reply and copies it into the
buffer libfuse allocated, and its ``write`` copies every request's data
into a ``bytes`` before the view writes it out: two user-space copies of
every byte of a sequential read or write, plus the allocations.  libfuse's
``read_buf`` and ``write_buf`` callbacks avoid both:

* :func:`reply_fd`: a READ is answered with a ``fuse_bufvec`` naming a
  descriptor and offset; with ``FUSE_CAP_SPLICE_WRITE`` (asked for in
  ``StepFS.init_with_config``) libfuse splices the bytes from the file's
  page cache through a pipe to ``/dev/fuse``: one copy (into the FUSE
  inode's pages) instead of three (file -> ``bytes``, ``bytes`` -> libfuse's
  buffer, buffer -> request).  libfuse reads the descriptor after the
  callback returned, outside the view's lock, so it is a duplicate that
  the caller closes at the next READ or RELEASE (``_FUSE.read_buf``): another thread
  that closes or replaces the handle's own descriptor meanwhile (a draft
  moved to a new scratch file) cannot make libfuse read another file.
* :func:`reply_buffer`: a small READ, or one of a handle whose bytes are
  in memory (``MOUNT/.stepfs`` files), is read into ``malloc`` memory that
  the ``fuse_bufvec`` names, which libfuse writes to ``/dev/fuse`` as it
  is and frees (``fuse_free_buf``).
* :func:`write_data`: a WRITE's data is handed to the view as a view of
  libfuse's receive buffer (no ``bytes`` copy); the view ``pwrite``s it
  to the draft and feeds the draft's running sum from it.

Only READs of at least ``highlevel.SPLICE_MIN`` bytes are spliced: a
small one is read under the view's lock, with no ``dup``/``close`` of a
descriptor (libfuse splices nothing under two pages anyway).
Receiving requests by ``splice`` (``FUSE_CAP_SPLICE_READ``, which libfuse
turns on by itself once ``write_buf`` exists) is turned off: it costs every
request, however small, a ``splice`` and a ``read`` instead of one ``read``
(the small-file rows were slower with it).

``struct fuse_bufvec`` ends in an array of one ``struct fuse_buf`` (not a
pointer, which is how mfusepy 3.1 declares it), so it is declared here.
"""

from __future__ import annotations

import ctypes
import errno
import struct

from stepfs.overlayfs.daemon.libfuse import mfusepy

#: ``enum fuse_buf_flags`` (fuse_common.h).
FUSE_BUF_IS_FD = 1 << 1
FUSE_BUF_FD_SEEK = 1 << 2


class FuseBuf(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("flags", ctypes.c_int), ("mem", ctypes.c_void_p),
                ("fd", ctypes.c_int), ("pos", ctypes.c_int64)]


class FuseBufvec(ctypes.Structure):
    _fields_ = [("count", ctypes.c_size_t), ("idx", ctypes.c_size_t), ("off", ctypes.c_size_t),
                ("buf", FuseBuf * 1)]


_libc = ctypes.CDLL(None, use_errno=True)
_malloc = _libc.malloc
_malloc.argtypes, _malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
_calloc = _libc.calloc
_calloc.argtypes, _calloc.restype = [ctypes.c_size_t, ctypes.c_size_t], ctypes.c_void_p
_free = _libc.free
_free.argtypes, _free.restype = [ctypes.c_void_p], None
_lib = mfusepy._libfuse
_buf_copy = _lib.fuse_buf_copy
_buf_copy.argtypes, _buf_copy.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_ssize_t
_buf_size = _lib.fuse_buf_size
_buf_size.argtypes, _buf_size.restype = [ctypes.c_void_p], ctypes.c_size_t
_VEC_SIZE = ctypes.sizeof(FuseBufvec)
#: ``struct fuse_bufvec`` of one ``struct fuse_buf``, packed: count, idx,
#: off; size, flags, mem, fd, pos (``FuseBufvec``'s layout, checked below).
_VEC = struct.Struct("=QQQQi4xQi4xq")
assert _VEC.size == _VEC_SIZE and FuseBuf.pos.offset == 32 and FuseBufvec.buf.offset == 24
#: Bytes allocated for a bufvec handed to libfuse (see :func:`_give`).
_VEC_ALLOC = 128
_VEC_BYTES = ctypes.c_char * _VEC_SIZE
_VOIDP_AT = ctypes.c_void_p.from_address
#: One array type laid over any of libfuse's memory (see :func:`_memory`).
_ANY_BYTES = ctypes.c_ubyte * (1 << 40)


def _memory(addr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of C memory at ``addr``
    (valid as long as that memory is).  Not ``(c_char * size).from_address``:
    ctypes makes a new array class for every new ``size`` and caches it
    only weakly, and making a class cost 20-200 us in the daemon, more
    than the copy it saves on a small WRITE (most WRITE sizes are new)."""
    return memoryview(_ANY_BYTES.from_address(addr)).cast("B")[:size]


def _give(bufpp, size: int, flags: int, mem: int, fd: int, pos: int) -> int:
    """Hand libfuse a new one-buffer ``fuse_bufvec`` through ``*bufpp``
    (libfuse frees it, and ``mem`` if set, after the reply); 0 or
    ``-ENOMEM``.  The block is zeroed and bigger than 3.14's struct, so a
    libfuse that appends fields (3.17's ``mem_size``) reads zeros there."""
    vec = _calloc(1, _VEC_ALLOC)
    if not vec:
        return -errno.ENOMEM
    # Packed in place: each foreign call (a memmove, a field set through a
    # ctypes struct) costs microseconds here, once per READ.
    _VEC.pack_into(_VEC_BYTES.from_address(vec), 0, 1, 0, 0, size, flags, mem, fd, pos)
    _VOIDP_AT(ctypes.addressof(bufpp.contents)).value = vec
    return 0


def reply_buffer(bufpp, size: int, fill) -> int:
    """A ``read_buf`` callback's work: ``fill(buffer)`` writes up to
    ``size`` bytes into a writable buffer over fresh ``malloc`` memory and
    returns how many; that memory goes to libfuse through ``*bufpp``, which
    frees it after the reply.  Returns 0, or ``-ENOMEM``.  If ``fill``
    raises, the memory is freed and ``*bufpp`` left NULL (libfuse then
    replies with the error and frees nothing)."""
    mem = _malloc(size or 1)
    if not mem:
        return -errno.ENOMEM
    try:
        n = fill(_memory(mem, size)) if size else 0
    except BaseException:
        _free(mem)
        raise
    rc = _give(bufpp, n, 0, mem, -1, 0)
    if rc:
        _free(mem)
    return rc


def reply_fd(bufpp, fd: int, size: int, offset: int) -> int:
    """A ``read_buf`` callback's reply of ``size`` bytes of ``fd`` from
    ``offset``: libfuse splices them from the file to ``/dev/fuse`` after
    the callback returns (``FUSE_CAP_SPLICE_WRITE``; else it reads them
    into its own memory), so ``fd`` must stay open until then; libfuse
    never closes it.  Returns 0, or ``-ENOMEM``."""
    return _give(bufpp, size, FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK, 0, fd, offset)


def write_data(buf):
    """The data of a WRITE as a byte buffer, from libfuse's ``fuse_bufvec``
    ``buf``: a view of libfuse's own receive buffer (valid while the
    callback runs; no copy), or, when the data is not one piece of memory
    (a pipe: libfuse received the request by ``splice``, which
    ``StepFS.init_with_config`` turns off), a copy made by ``fuse_buf_copy``."""
    addr = _VOIDP_AT(ctypes.addressof(buf)).value  # the struct fuse_bufvec *
    count, idx, off, size, flags, mem, _fd, _pos = _VEC.unpack_from(_VEC_BYTES.from_address(addr))
    if count == 1 and idx == 0 and mem and not flags & FUSE_BUF_IS_FD:
        return _memory(mem + off, size - off)
    total = _buf_size(addr)
    out = ctypes.create_string_buffer(total)
    dst = FuseBufvec(1, 0, 0)
    b = dst.buf[0]
    b.size, b.flags, b.mem, b.fd, b.pos = total, 0, ctypes.addressof(out), -1, 0
    n = _buf_copy(ctypes.addressof(dst), addr, 0)
    if n < 0:
        raise OSError(-n, "fuse_buf_copy")
    return memoryview(out).cast("B")[:n]
