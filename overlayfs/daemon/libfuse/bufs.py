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
  the caller closes at the next READ (``_FUSE.read_buf``): another thread
  that closes or replaces the handle's own descriptor meanwhile (a draft
  moved to a new scratch file) cannot make libfuse read another file.
* :func:`reply_buffer`: a READ of a handle whose bytes are in memory
  (``MOUNT/.stepfs`` files) copies them into ``malloc`` memory that the
  ``fuse_bufvec`` names, which libfuse writes to ``/dev/fuse`` as it is
  and frees (``fuse_free_buf``).
* :func:`copy_to_fd`: a WRITE's data (in libfuse's receive buffer, or in a
  pipe when libfuse received the request by ``splice``) is copied by
  ``fuse_buf_copy`` to the draft's descriptor at the offset: ``pwrite``
  from libfuse's memory, or ``splice`` from the pipe.

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
_free = _libc.free
_free.argtypes, _free.restype = [ctypes.c_void_p], None
_lib = mfusepy._libfuse
_buf_copy = _lib.fuse_buf_copy
_buf_copy.argtypes, _buf_copy.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_ssize_t
_buf_size = _lib.fuse_buf_size
_buf_size.argtypes, _buf_size.restype = [ctypes.c_void_p], ctypes.c_size_t
_VEC_SIZE = ctypes.sizeof(FuseBufvec)
_BYTE = ctypes.c_char
_memmove = ctypes.memmove
#: ``struct fuse_bufvec`` of one ``struct fuse_buf``, packed: count, idx,
#: off; size, flags, mem, fd, pos (``FuseBufvec``'s layout, checked below).
_FD_VEC = struct.Struct("=QQQQi4xQi4xq")
assert _FD_VEC.size == _VEC_SIZE and FuseBuf.pos.offset == 32 and FuseBufvec.buf.offset == 24
_VOIDP_AT = ctypes.c_void_p.from_address


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
        n = fill((_BYTE * size).from_address(mem)) if size else 0
        vec = _malloc(_VEC_SIZE)
        if not vec:
            raise MemoryError
    except BaseException:
        _free(mem)
        raise
    v = FuseBufvec.from_address(vec)
    v.count, v.idx, v.off = 1, 0, 0
    b = v.buf[0]
    b.size, b.flags, b.mem, b.fd, b.pos = n, 0, mem, -1, 0
    _VOIDP_AT(ctypes.addressof(bufpp.contents)).value = vec
    return 0


def reply_fd(bufpp, fd: int, size: int, offset: int) -> int:
    """A ``read_buf`` callback's reply of ``size`` bytes of ``fd`` from
    ``offset``: libfuse splices them from the file to ``/dev/fuse`` after
    the callback returns (``FUSE_CAP_SPLICE_WRITE``; else it reads them
    into its own memory), so ``fd`` must stay open until then; libfuse
    never closes it.  Returns 0, or ``-ENOMEM``."""
    vec = _malloc(_VEC_SIZE)
    if not vec:
        return -errno.ENOMEM
    # One copy of the packed struct: a field-by-field ctypes fill costs
    # several times more, once per READ.
    _memmove(vec, _FD_VEC.pack(1, 0, 0, size, FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK, 0, fd, offset), _VEC_SIZE)
    _VOIDP_AT(ctypes.addressof(bufpp.contents)).value = vec
    return 0


def data_of(buf) -> tuple[int, int]:
    """``(size, address)`` of the WRITE data in libfuse's ``fuse_bufvec``
    ``buf``; address 0 unless the data is one piece of memory (not a pipe,
    as when libfuse received the request by ``splice``).  Read before
    :func:`copy_to_fd`, which moves the bufvec's position."""
    v = FuseBufvec.from_address(ctypes.addressof(buf.contents))
    if v.count != 1 or v.idx:
        return _buf_size(ctypes.addressof(buf.contents)), 0
    b = v.buf[0]
    return b.size - v.off, (0 if b.flags & FUSE_BUF_IS_FD or not b.mem else b.mem + v.off)


def view(address: int, size: int):
    """``size`` bytes of memory at ``address`` as a buffer (valid while the callback runs)."""
    return (_BYTE * size).from_address(address)


def copy_to_fd(buf, fd: int, offset: int, size: int) -> int:
    """Copy ``size`` bytes of WRITE data ``buf`` (libfuse's
    ``fuse_bufvec``) to ``fd`` at ``offset``; returns the bytes copied,
    raises ``OSError`` if none could be."""
    dst = FuseBufvec(1, 0, 0)
    b = dst.buf[0]
    b.size, b.flags, b.mem, b.fd, b.pos = size, FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK, None, fd, offset
    n = _buf_copy(ctypes.addressof(dst), ctypes.addressof(buf.contents), 0)
    if n < 0:
        raise OSError(-n, "fuse_buf_copy")
    return n
