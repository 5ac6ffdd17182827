"""``struct stat`` filled from the view's attribute dicts (daemon side,
libfuse internals: mfusepy's ``c_stat`` packed by its offsets)."""

from __future__ import annotations

import ctypes
import struct

from stepfs.overlayfs.daemon.libfuse import mfusepy


_STAT_SIZE = ctypes.sizeof(mfusepy.c_stat)
_STAT_KEYS = {"st_mode", "st_ino", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime",
              "st_blocks", "st_blksize"}
#: ... and with the device number (every workspace file's attributes carry it).
_STAT_KEYS_RDEV = _STAT_KEYS | {"st_rdev"}


#: ``struct stat`` of Linux x86-64 and arm64-compatible layouts as one
#: ``struct`` pack: dev, ino, nlink, mode, uid, gid, (pad), rdev, size,
#: blksize, blocks, then atime, mtime and ctime as (sec, nsec), then the
#: reserved tail.  Used only when mfusepy's ``c_stat`` has exactly these
#: offsets (:data:`_STAT_PACKED`); one ``pack_into`` costs about a third
#: of setting the fields one by one through ctypes (0.4 against 1.4 µs,
#: once per lookup and per listed entry).
_STAT_LAYOUT = struct.Struct("=QQQIIIiQqqqqqqqqq")
_STAT_OFFSETS = (("st_dev", 0), ("st_ino", 8), ("st_nlink", 16), ("st_mode", 24), ("st_uid", 28), ("st_gid", 32),
                 ("st_rdev", 40), ("st_size", 48), ("st_blksize", 56), ("st_blocks", 64), ("st_atimespec", 72),
                 ("st_mtimespec", 88), ("st_ctimespec", 104))
_STAT_PACKED = (_STAT_LAYOUT.size <= _STAT_SIZE
                and all(hasattr(mfusepy.c_stat, name) and getattr(mfusepy.c_stat, name).offset == off
                        for name, off in _STAT_OFFSETS))
#: The zeroed bytes after the packed fields (``reserved``).
_STAT_TAIL = _STAT_SIZE - _STAT_LAYOUT.size
#: The layout with the tail as pad bytes, which ``pack_into`` writes as zeros.
_STAT_FULL = struct.Struct(_STAT_LAYOUT.format + f"{max(_STAT_TAIL, 0)}x")


def _fill_stat(st, a: dict) -> None:
    """Set the ``c_stat`` ``st`` from the attribute dict ``a`` (every field
    not in ``a`` zero).  mfusepy's set_st_attrs looks every key up by name
    (about twice the cost); the view's attribute dicts have the eleven
    :data:`_STAT_KEYS`, and st_rdev (tests/test_mount_warm.py keeps it so).

    Which of the two key sets ``a`` has is told by its length and the
    ``KeyError`` of a missing key (comparing the key sets cost a third of
    this function); the reserved tail is zeroed by the pack's pad bytes."""
    n = len(a)
    try:
        if n == 12 and "st_rdev" in a:
            rdev = a["st_rdev"]
        elif n == 11:
            rdev = 0
        else:
            raise KeyError
        if _STAT_PACKED:
            asec, ansec = divmod(a["st_atime"], 1_000_000_000)
            msec, mnsec = divmod(a["st_mtime"], 1_000_000_000)
            csec, cnsec = divmod(a["st_ctime"], 1_000_000_000)
            try:
                _STAT_FULL.pack_into(st, 0, 0, a["st_ino"], a["st_nlink"], a["st_mode"], a["st_uid"], a["st_gid"], 0,
                                     rdev, a["st_size"], a["st_blksize"], a["st_blocks"], asec, ansec, msec, mnsec,
                                     csec, cnsec)
            except struct.error:
                pass  # a value out of its field's range: ctypes below truncates it as it always did
            else:
                return
        mode, ino, nlink, size = a["st_mode"], a["st_ino"], a["st_nlink"], a["st_size"]
        uid, gid, blocks, blksize = a["st_uid"], a["st_gid"], a["st_blocks"], a["st_blksize"]
        atime, mtime, ctime = a["st_atime"], a["st_mtime"], a["st_ctime"]
    except KeyError:  # another key set
        ctypes.memset(ctypes.byref(st), 0, _STAT_SIZE)
        mfusepy.set_st_attrs(st, a, use_ns=True)
        return
    ctypes.memset(ctypes.byref(st), 0, _STAT_SIZE)
    st.st_rdev = rdev
    st.st_mode = mode
    st.st_ino = ino
    st.st_nlink = nlink
    st.st_size = size
    st.st_uid = uid
    st.st_gid = gid
    st.st_blocks = blocks
    st.st_blksize = blksize
    ts = st.st_atimespec
    ts.tv_sec, ts.tv_nsec = divmod(atime, 1_000_000_000)
    ts = st.st_mtimespec
    ts.tv_sec, ts.tv_nsec = divmod(mtime, 1_000_000_000)
    ts = st.st_ctimespec
    ts.tv_sec, ts.tv_nsec = divmod(ctime, 1_000_000_000)
