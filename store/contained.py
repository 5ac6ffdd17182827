"""Contained access to a directory tree: nothing resolves outside it.

Every path under a :class:`Root` is resolved by the kernel with ``openat2``
and ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``: no ``..`` escape, no symlink
followed in any component, no magic links.  A symlink that is itself the last
component is reached with ``O_PATH | O_NOFOLLOW`` (so it can be stat'ed and
read, never followed).  This closes the race where something outside the
mount swaps a directory for a symlink between our check and our use.

The store directory (``.stepfs`` at the top of a workspace) is never
reachable through a Root made with ``hide=".stepfs"``; a path with a ``..``
component is refused outright (``EXDEV``), since ``RESOLVE_BENEATH`` lets
``a/..`` stay inside and ``a/../.stepfs`` would pass the name check.

Paths are relative, ``str`` (surrogate-escaped bytes, as FUSE hands them to
us) or ``bytes``; ``""``, ``"."`` and ``"/"`` mean the root itself.  A path
that is already normalized and has no component starting with a dot (most
of what a lookup asks for) skips :func:`normalize` and the name checks:
no such path can name the store or climb (hence a hidden name must start
with a dot); the kernel's resolve flags apply to every path alike.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat as stat_mod

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_fstat, _close = os.fstat, os.close
_SYS_openat2 = 437  # the same number on every Linux architecture
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_HOW_SIZE = ctypes.sizeof(_OpenHow)
#: ``open_how`` (by reference) per open without ``O_CREAT``, keyed by the
#: caller's flags.  Built once and never written after: the kernel only
#: reads it, so every thread may pass the same one (a fresh struct per call
#: cost about a fifth of an ``lstat``).  A handful of flag sets exist.
_HOWS: dict[int, tuple[_OpenHow, object]] = {}


def _how_for(flags: int) -> object:
    """The shared, read-only ``open_how`` reference for ``flags`` (no O_CREAT)."""
    entry = _HOWS.get(flags)
    if entry is None:
        how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE)
        entry = _HOWS[flags] = (how, ctypes.byref(how))  # the byref keeps ``how`` alive too
    return entry[1]


#: ``open_how`` of :meth:`Root.lstat`.
_LSTAT_HOW = _how_for(os.O_PATH | os.O_NOFOLLOW)


def kind_of(mode: int) -> str:
    """The kind stepfs records for an ``st_mode``: file, dir, symlink, fifo,
    chardev, blockdev or socket (``special`` is only ever read from layers
    of stores written before devices and sockets had kinds of their own)."""
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return _NODE_KIND_OF.get(stat_mod.S_IFMT(mode), "special")


#: Kinds made by ``mknod`` (no content; a device's number is its ``target``)
#: and their file type bits.
NODE_KINDS = {"fifo": stat_mod.S_IFIFO, "chardev": stat_mod.S_IFCHR, "blockdev": stat_mod.S_IFBLK,
              "socket": stat_mod.S_IFSOCK}
_NODE_KIND_OF = {bits: kind for kind, bits in NODE_KINDS.items()}
#: Kinds whose ``target`` is the device number (``st_rdev``) as decimal ASCII.
DEVICE_KINDS = ("chardev", "blockdev")


def rdev_target(kind: str, rdev: int) -> bytes | None:
    """What a state of ``kind`` keeps in ``target`` for device number ``rdev``."""
    return str(rdev).encode() if kind in DEVICE_KINDS else None


def rdev_of(kind: str, target: bytes | None) -> int:
    """The device number a state of ``kind`` records (0 for any other kind)."""
    return int(target) if kind in DEVICE_KINDS and target else 0


def _fsencode(path: str | bytes) -> bytes:
    return path if isinstance(path, bytes) else os.fsencode(path)


def normalize(path: str | bytes) -> bytes:
    """``/a//b/`` -> ``a/b``; the root is ``.``."""
    parts = [p for p in _fsencode(path).split(b"/") if p and p != b"."]
    return b"/".join(parts) or b"."


def _plain(rel: bytes) -> bool:
    """``rel`` is already normalized and no component of it starts with a
    dot: not empty, no leading, trailing or doubled slash, no ``.``, ``..``
    or hidden name (``.stepfs``) anywhere, no NUL byte.  Such a path needs neither
    :func:`normalize` nor the hide and ``..`` checks (most paths a lookup
    asks for); any other path takes the full route."""
    return (bool(rel) and rel[0] != 46 and rel[0] != 47 and rel[-1] != 47 and b"/." not in rel and b"//" not in rel
            and b"\0" not in rel)


#: The ``openat2`` errors :meth:`Root.lstat_or_none` answers None for
#: (what ``lstat`` raises as FileNotFoundError, NotADirectoryError, and
#: the symlink and escape refusals of :func:`_raise_open_error`).
_ABSENT_ERRNOS = frozenset((errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV))


def _raise_open_error(rel: bytes) -> None:
    """Raise the ``OSError`` of the ``openat2`` of ``rel`` that just failed."""
    err = ctypes.get_errno()
    if err == errno.ELOOP:
        # A symlink in the path: from inside the tree this path does
        # not lead anywhere we may go.
        raise OSError(errno.ELOOP, "path goes through a symbolic link", os.fsdecode(rel))
    if err == errno.EXDEV:
        raise OSError(errno.EXDEV, "path leaves the workspace", os.fsdecode(rel))
    raise OSError(err, os.strerror(err), os.fsdecode(rel))


class Root:
    """A directory under which paths are resolved without leaving it."""

    def __init__(self, path: str, hide: str | None = None):
        if hide is not None and (not hide.startswith(".") or "/" in hide):
            # The fast path (_plain) skips the name check for paths in which
            # no component starts with a dot: only a dot name is hidden by it.
            raise ValueError(f"the hidden name must be one component starting with a dot: {hide!r}")
        self.path = os.path.abspath(path)
        self.fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.hide = hide.encode() if hide else None

    @classmethod
    def _of_fd(cls, fd: int, path: str) -> "Root":
        """A Root over an already opened (contained) directory handle."""
        root = cls.__new__(cls)
        root.path, root.fd, root.hide = path, fd, None
        return root

    def subdir(self, name: str, create: bool = False, mode: int = 0o700) -> "Root":
        """A Root over the directory ``name`` (one component) directly
        beneath this one, hidden or not (the store's own handles: a hidden
        name is only hidden from workspace paths), made with ``mode`` first
        if ``create``.  Opened with the same resolve flags: a symlink there
        (or in place of it) is refused with ``ELOOP``, a file with
        ``ENOTDIR``; the handle follows the directory wherever it is renamed."""
        raw = os.fsencode(name)
        if not raw or b"/" in raw or raw in (b".", b"..") or b"\0" in raw:
            raise ValueError(f"not one name: {name!r}")
        if create:
            try:
                os.mkdir(raw, mode, dir_fd=self.fd)
            except FileExistsError:
                pass
        fd = _syscall(_SYS_openat2, self.fd, raw, _how_for(os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW), _HOW_SIZE)
        if fd < 0:
            _raise_open_error(raw)
        return Root._of_fd(fd, os.path.join(self.path, os.fsdecode(raw)))

    @property
    def handle_path(self) -> str:
        """A path name that reaches this directory through its handle
        (``/proc/self/fd/N``), for callers that only take names (SQLite, the
        spare pool): renaming the tree or swapping a parent for a symlink
        after the open does not redirect them.  Valid while the Root is open,
        in this process."""
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _check(self, rel: bytes) -> None:
        """Refuse a normalized path into the hidden store, or with a ``..``
        component: ``RESOLVE_BENEATH`` lets ``a/..`` stay in the tree, so
        ``a/../.stepfs`` would reach the store past the name check.  No
        caller has a reason to send ``..`` (FUSE paths never hold one;
        ``history.user_path`` resolves them itself)."""
        if b"\0" in rel:
            # The kernel would see the path cut at the NUL (ctypes passes a C
            # string): ".stepfs\0x" would pass the name check as ".stepfs".
            raise OSError(errno.EINVAL, "path contains a NUL byte", os.fsdecode(rel))
        if self.hide is not None and (rel == self.hide or rel.startswith(self.hide + b"/")):
            raise FileNotFoundError(errno.ENOENT, "the store is not part of the workspace view", os.fsdecode(rel))
        if b".." in rel and b".." in rel.split(b"/"):
            raise OSError(errno.EXDEV, "path climbs with '..'", os.fsdecode(rel))

    def _rel(self, path: str | bytes) -> bytes:
        """``path`` normalized and checked (:meth:`_check`)."""
        rel = path if isinstance(path, bytes) else os.fsencode(path)
        if _plain(rel):
            return rel
        rel = normalize(rel)
        self._check(rel)
        return rel

    def open(self, path: str | bytes, flags: int, mode: int = 0o666) -> int:
        """``openat2`` beneath the root; raises ``OSError`` like ``os.open``."""
        rel = self._rel(path)
        if flags & os.O_CREAT:
            how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
            ref = ctypes.byref(how)
        else:
            ref = _HOWS[flags][1] if flags in _HOWS else _how_for(flags)
        fd = _syscall(_SYS_openat2, self.fd, rel, ref, _HOW_SIZE)
        if fd < 0:
            _raise_open_error(rel)
        return fd

    def lstat(self, path: str | bytes) -> os.stat_result:
        # open() and _rel() inlined: this is the stat of every lookup.  The
        # fast-path test stays the one _plain (a security check has one copy).
        rel = path if path.__class__ is bytes else os.fsencode(path)
        if not _plain(rel):
            rel = normalize(rel)
            self._check(rel)
        fd = _syscall(_SYS_openat2, self.fd, rel, _LSTAT_HOW, _HOW_SIZE)
        if fd < 0:
            _raise_open_error(rel)
        try:
            return _fstat(fd)
        finally:
            _close(fd)

    def lstat_or_none(self, path: str | bytes) -> os.stat_result | None:
        """``lstat``, or None when nothing is reachable there: absent, or a
        file or symlink in place of a parent directory (the overlay and the
        commit both treat all three as absent, and never follow the link).
        A plain path that is absent costs no ``OSError``: every file
        created in a directory only the mount has asks for the base token
        of a path the workspace cannot have (``tar -x``: once per file)."""
        rel = path if path.__class__ is bytes else os.fsencode(path)
        if _plain(rel):
            fd = _syscall(_SYS_openat2, self.fd, rel, _LSTAT_HOW, _HOW_SIZE)
            if fd < 0:
                if ctypes.get_errno() in _ABSENT_ERRNOS:
                    return None
                _raise_open_error(rel)
            try:
                return _fstat(fd)
            finally:
                _close(fd)
        try:
            return self.lstat(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EXDEV):
                return None
            raise

    def exists(self, path: str | bytes) -> bool:
        return self.lstat_or_none(path) is not None

    def readlink(self, path: str | bytes) -> bytes:
        parent, name = self.parent(path)
        try:
            return os.readlink(name, dir_fd=parent)
        finally:
            os.close(parent)

    def listdir(self, path: str | bytes, decoded: bool = False) -> list[tuple[bytes, int, int]]:
        """``[(name, S_IFMT bits, inode)]`` of a directory (unsorted); with
        ``decoded`` the names are ``str`` as ``os.fsdecode`` gives them (the
        form ``scandir`` reads them in: no round trip through bytes)."""
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        out = []
        hide = None
        if self.hide is not None and normalize(path) == b".":
            hide = os.fsdecode(self.hide)
        reg, dir_, lnk = stat_mod.S_IFREG, stat_mod.S_IFDIR, stat_mod.S_IFLNK
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    # The directory entry's own type (d_type) when the
                    # filesystem gives one: no stat per entry.
                    if entry.is_file(follow_symlinks=False):
                        kind = reg
                    elif entry.is_dir(follow_symlinks=False):
                        kind = dir_
                    elif entry.is_symlink():
                        kind = lnk
                    else:
                        try:
                            kind = stat_mod.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
                        except FileNotFoundError:
                            continue
                    name = entry.name
                    if name == hide:
                        continue
                    out.append((name if decoded else os.fsencode(name), kind, entry.inode()))
        finally:
            os.close(fd)
        return out

    def parent(self, path: str | bytes) -> tuple[int, bytes]:
        """``(fd of the parent directory, last component)``; caller closes fd."""
        rel = self._rel(path)
        if rel == b".":
            raise OSError(errno.EINVAL, "the root has no parent", self.path)
        head, _, name = rel.rpartition(b"/")
        return self.open(head or b".", os.O_PATH | os.O_DIRECTORY), name
