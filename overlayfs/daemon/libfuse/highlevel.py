"""mfusepy's ``FUSE`` with some replies re-done (daemon side, libfuse
internals: READDIR/READDIRPLUS through libfuse 3.14's filler, rename
flags, getattr packed by :mod:`statbuf`)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os

from stepfs.overlayfs.core.metatree import ROOT as META_ROOT, is_meta
from stepfs.overlayfs.daemon.libfuse import bufs, mfusepy
from stepfs.overlayfs.daemon.libfuse.statbuf import _fill_stat


#: The name of ``MOUNT/.stepfs`` in the root's listing.
META_NAME = META_ROOT[1:]
#: libfuse3's ``FUSE_READDIR_PLUS`` (readdir flags) and ``FUSE_FILL_DIR_PLUS`` (filler flags).
FUSE_READDIR_PLUS = 1
FUSE_FILL_DIR_PLUS = 2
#: ``offsetof(struct fuse_direntplus, dirent.name)``: a READDIRPLUS entry
#: takes this plus its name's length, rounded up to 8 bytes.
_DIRENTPLUS_NAME_OFFSET = 128 + 24
#: Bytes of entries put in one READDIRPLUS reply: the kernel asks with a
#: buffer of at least one page (fs/fuse/readdir.c); a smaller reply is
#: fine, the kernel asks again from the last offset.
_RDPLUS_BUDGET = 4096
#: READs of at least this many bytes are answered by splice from a
#: duplicate descriptor (``bufs.reply_fd``); smaller ones are read into
#: memory (``bufs.reply_buffer``): the dup/close pair pays only where the
#: copies it saves are big (the kernel's readahead asks 128 KiB at a time).
SPLICE_MIN = 128 << 10
#: libfuse's ``getattr`` entry with its pointers as integers (see _FUSE._direct_getattr).
_GETATTR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p)
_STAT_AT = mfusepy.c_stat.from_address
_FILE_INFO_AT = mfusepy.fuse_file_info.from_address

log = logging.getLogger("stepfs.fuse")


class _FUSE(mfusepy.FUSE):
    """mfusepy's FUSE with rename flags passed through (mfusepy 3.1 drops
    them, which would turn RENAME_NOREPLACE into a silent overwrite), and
    ``getxattr`` answering the names the view never holds without going
    through it (``ls -l`` asks every file for two of them).

    Its ``readdir`` also tells :class:`ListingCache` which directories are
    generated (``MOUNT/.stepfs``) and must not be cached."""

    #: ``(path, offset, entries)``: the rest of a READDIRPLUS listing that
    #: did not fit its reply (see _readdir_plus; loop thread only).
    _rdplus_resume = None

    def rename_fuse_3(self, old, new, flags):
        return self.operations.rename(old.decode(self.encoding, self.errors),
                                      new.decode(self.encoding, self.errors), flags)

    def readdir_fuse_3(self, path, buf, filler, offset, fip, flags):
        # mfusepy builds a dict per entry and sets its fields by name; a
        # listing of a large directory is thousands of these.
        st = mfusepy.c_stat()
        enc, errs = self.encoding, self.errors
        path = path.decode(enc, errs)
        if is_meta(path):  # generated from the store: never cached (ListingCache)
            listings = self.operations.listings
            if listings.dir_node:
                listings.uncached.add(listings.dir_node)
        elif flags & FUSE_READDIR_PLUS:
            return self._readdir_plus(path, buf, filler, st, offset)
        elif offset:
            return self._readdir_on(path, buf, filler, st, offset)
        for name, kind, ino in self.operations.readdir_entries(path):
            st.st_mode = kind
            st.st_ino = ino
            if filler(buf, name.encode(enc, errs), st, 0, 0) != 0:
                break
        return 0

    def _listing(self, path: str, offset: int) -> list:
        """The listing a request at ``offset`` continues: the one kept by
        the previous request of ``path`` if it stopped at ``offset``, else
        read anew.  Entry ``i`` has offset ``i + 1`` in every mode (libfuse
        numbers the list it keeps itself the same way)."""
        resume = self._rdplus_resume
        self._rdplus_resume = None
        if offset and resume is not None and resume[0] == path and resume[1] == offset:
            return resume[2]
        return self.operations.readdir_entries(path)

    def _readdir_on(self, path, buf, filler, st, offset):
        """A plain READDIR at a nonzero offset: libfuse asks the filesystem
        only when it keeps no list of its own, i.e. after a READDIRPLUS
        listing in offset mode (the kernel continues a listing begun with
        attributes without them).  So it continues in offset mode, from the
        listing that READDIRPLUS kept: typically the request after the
        last entry, whose empty reply ends the listing, without reading
        the directory again."""
        enc, errs = self.encoding, self.errors
        entries = self._listing(path, offset)
        i = offset
        n = len(entries)
        while i < n:
            name, kind, ino = entries[i]
            st.st_mode = kind
            st.st_ino = ino
            i += 1
            if filler(buf, name.encode(enc, errs), st, i, 0) != 0:
                self._rdplus_resume = (path, i - 1, entries)  # that entry did not fit: the next request's
                return 0
        self._rdplus_resume = (path, n, entries)
        return 0

    def _readdir_plus(self, path, buf, filler, st, offset):
        """A READDIRPLUS listing: every entry but ``.``/``..`` carries the
        attributes :meth:`StepFS.getattr` answers for its path, with
        ``FUSE_FILL_DIR_PLUS``, so the kernel needs no LOOKUP per entry.

        libfuse 3.14 uses such attributes only in its offset mode (a
        nonzero offset to the filler; with offset 0 it stores the entry
        and replies without attributes), where each request fills one
        reply buffer and the next one resumes at the offset of the last
        entry sent: entry ``i`` of the listing has offset ``i + 1``.  Its
        ``fill_dir_plus`` looks an entry up (nlookup+1) BEFORE it checks
        that the entry fits, and a lookup the kernel never receives is
        never forgotten; so entries are counted against
        :data:`_RDPLUS_BUDGET` here and the filler never sees one that
        does not fit.  The listing is kept for the next request of the same
        directory at the next offset (:meth:`_listing`; one at a time:
        interleaved listings of two directories list again), also after
        its last entry, for the request whose empty reply ends it.

        The attributes of one reply's entries come from one
        ``StepFS.listed_attrs`` call, which keeps ``getattr``'s invariants:
        a directory is watched before the kernel holds it, a name of a
        multi-link workspace file is recorded (``links.Links.shown_name``).
        A name in the kernel-cache ``gone`` set, or whose attributes fail,
        is listed as a plain entry: the kernel then looks it up as before
        (a LOOKUP, which gets the truth and ends the gone mark).  ``MOUNT/.stepfs`` in the root's
        listing too, and a name the kernel was already given attributes
        for (``StepFS._held``): a plain entry leaves the kernel's binding
        as it is, and costs at most a lookup if the kernel dropped it
        since."""
        enc, errs = self.encoding, self.errors
        ops = self.operations
        gone = ops._gone
        held = ops._held
        entries = self._listing(path, offset)
        prefix = path if path.endswith("/") else path + "/"
        budget = _RDPLUS_BUDGET
        i = offset
        n = len(entries)
        batch = []  # (bname, kind, ino, name or None: plain)
        ask = []
        # The one name of a listing that is .stepfs (``path`` itself never
        # is: readdir_fuse_3 lists those plainly).
        meta = META_NAME if path == "/" else None
        while i < n:
            name, kind, ino = entries[i]
            bname = name.encode(enc, errs)
            need = (_DIRENTPLUS_NAME_OFFSET + len(bname) + 7) & ~7
            if need > budget:
                break
            budget -= need
            i += 1
            if name != "." and name != ".." and name != meta:
                full = prefix + name
                if full not in held and not (gone and full in gone):
                    ask.append(name)
                    batch.append((bname, kind, ino, name))
                    continue
            batch.append((bname, kind, ino, None))
        self._rdplus_resume = (path, i, entries)
        attrs = dict(zip(ask, ops.listed_attrs(path, ask))) if ask else {}
        plain = mfusepy.c_stat()  # only its type and inode are ever set: no zeroing per entry
        off = offset
        for bname, kind, ino, name in batch:
            a = attrs.get(name) if name is not None else None
            if a is None:
                plain.st_mode = kind
                plain.st_ino = ino
                out, fill = plain, 0
            else:
                _fill_stat(st, a)
                out, fill = st, FUSE_FILL_DIR_PLUS
            off += 1
            if filler(buf, bname, out, off, fill) != 0:
                self._rdplus_resume = (path, off - 1, entries)
                break  # not expected: the budget keeps every entry within the buffer
        return 0

    # READ and WRITE through libfuse's buffer callbacks (libfuse/bufs.py):
    # no ``bytes`` copy of the data in either direction.
    #: The descriptor the last READ reply named (libfuse reads it after
    #: read_buf returned): closed at the next READ, the next RELEASE (so
    #: no file outlives its last handle here) or when the loop ends.
    _lent = -1
    #: Whether libfuse was last told to splice READ replies.
    _splicing = False

    def __init__(self, *args, **kwargs):
        # mfusepy hands its operation table to ``fuse_main_real`` (loop.py's
        # while hooked); getattr's entry is replaced on the way (_direct_getattr).
        main = mfusepy.fuse_main_real

        def patched_main(argc, argv, ops, size, user_data):
            self._direct_getattr(ops)
            return main(argc, argv, ops, size, user_data)

        mfusepy.fuse_main_real = patched_main
        try:
            super().__init__(*args, **kwargs)  # serves until unmounted
        finally:
            mfusepy.fuse_main_real = main
            self._return_lent()

    def _direct_getattr(self, ops) -> None:
        """Point the table's ``getattr`` (every LOOKUP and GETATTR) at
        :meth:`_getattr_raw` directly: mfusepy's entry goes through a
        ``functools.partial``, its generic error wrapper and ``fgetattr``,
        and makes a ctypes pointer object of each argument, about a
        microsecond per request that this one spends on nothing."""
        table = ops.contents
        if not table.getattr:
            return
        self._getattr_entry = _GETATTR(self._getattr_raw)  # kept alive with the session
        ctypes.c_void_p.from_address(ctypes.addressof(table) + mfusepy.fuse_operations.getattr.offset).value = \
            ctypes.cast(self._getattr_entry, ctypes.c_void_p).value

    def _getattr_raw(self, path, buf, fip):
        """libfuse's ``getattr(path, struct stat *, struct fuse_file_info *)``
        with both pointers as plain addresses; errors as mfusepy's wrapper
        turns them into return codes (``StepFS.getattr`` already maps every
        view error to a ``FuseOSError``)."""
        try:
            a = self.operations.getattr(None if path is None else path.decode(self.encoding, self.errors),
                                        _FILE_INFO_AT(fip) if fip else None)
            _fill_stat(_STAT_AT(buf), a)
            return 0
        except OSError as exc:
            return -exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else -errno.EINVAL
        except Exception:
            log.exception("getattr of %r failed unexpectedly", path)
            return -errno.EINVAL
        except BaseException:  # as mfusepy: stop serving rather than unwind through libfuse
            log.critical("getattr of %r raised a critical exception; stopping", path, exc_info=True)
            mfusepy.fuse_exit()
            return -errno.EFAULT

    def _return_lent(self):
        lent, self._lent = self._lent, -1
        if lent >= 0:
            os.close(lent)

    def read_buf(self, path, bufpp, size, offset, fip):
        self._return_lent()  # its reply was sent before this request was read (single-threaded loop)
        ops, fi = self.operations, fip.contents
        path = None if path is None else path.decode(self.encoding, self.errors)
        fd = ops.read_buf(path, fi) if size >= SPLICE_MIN else None
        if (fd is not None) != self._splicing:  # libfuse splices replies only while asked to (StepFS.splice_replies)
            self._splicing = fd is not None
            ops.splice_replies(self._splicing)
        if fd is not None:
            self._lent = fd
            return bufs.reply_fd(bufpp, fd, size, offset)
        return bufs.reply_buffer(bufpp, size, lambda buf: ops.readinto(path, buf, offset, fi))

    def release(self, path, fip):
        self._return_lent()
        return super().release(path, fip)

    def write_buf(self, path, buf, offset, fip):
        return self.operations.write_buf(None if path is None else path.decode(self.encoding, self.errors),
                                     bufs.write_data(buf), offset, fip.contents)

    def getxattr(self, path, name, value, size, *args):
        # Only user.* attributes exist in the view (store/xattrs.py); ls -l
        # asks every file for security.selinux and system.posix_acl_access.
        if not name.startswith(b"user."):
            return -errno.ENODATA
        return super().getxattr(path, name, value, size, *args)
