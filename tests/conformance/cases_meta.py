"""chmod, chown, utimensat: metadata changes, their ctime, their refusals."""

from __future__ import annotations

import errno
import os
import stat

from .kit import GID1, GID2, GID_EXTRA, OLD_NS, UID1, UID2, T, case

TYPES = ("regular", "dir", "fifo", "chr")
LONG = "x" * 256


# -- chmod ------------------------------------------------------------------------------


@case("chmod", TYPES)
def mode_set(t: T, kind: str):
    t.make(kind, "o")
    yield
    for mode in (0o111, 0o640, 0o755, 0o4755 if kind != "dir" else 0o2755, 0o1777 if kind == "dir" else 0o600):
        t.ok(os.chmod, t.p("o"), mode)
        t.eq(t.mode("o"), mode, f"mode after chmod {mode:o}")


@case("chmod", TYPES)
def ctime_updated(t: T, kind: str):
    t.make(kind, "o")
    yield
    before = t.ctimes("o")
    t.tick()
    os.chmod(t.p("o"), 0o600)
    t.changed(("o",), before, "st_ctime_ns")


@case("chmod")
def mtime_kept(t: T):
    t.file("f", b"abc")
    t.age("f")
    yield
    os.chmod(t.p("f"), 0o600)
    t.eq(t.lst("f").st_mtime_ns, OLD_NS, "mtime after chmod")


@case("chmod")
def follows_symlink(t: T):
    t.file("f", mode=0o644)
    os.symlink("f", t.p("l"))
    yield
    os.chmod(t.p("l"), 0o600)
    t.eq(t.mode("f"), 0o600, "target mode")
    t.check(stat.S_ISLNK(t.lst("l").st_mode), "the link is still a symlink")


@case("chmod")
def fchmod(t: T):
    t.file("f")
    yield
    with t.opened("f", os.O_RDONLY) as fd:
        os.fchmod(fd, 0o604)
        t.eq(stat.S_IMODE(os.fstat(fd).st_mode), 0o604, "fstat mode")
    t.eq(t.mode("f"), 0o604, "mode")


@case("chmod")
def enoent(t: T):
    t.expect(errno.ENOENT, os.chmod, t.p("missing"), 0o644)
    t.expect(errno.ENOENT, os.chmod, t.p("missing", "x"), 0o644)


@case("chmod")
def enotdir(t: T):
    t.file("f")
    yield
    t.expect(errno.ENOTDIR, os.chmod, t.p("f", "x"), 0o644)


@case("chmod")
def enametoolong(t: T):
    t.expect(errno.ENAMETOOLONG, os.chmod, t.p(LONG), 0o644)


@case("chmod")
def eloop(t: T):
    os.symlink("b", t.p("a"))
    os.symlink("a", t.p("b"))
    yield
    t.expect(errno.ELOOP, os.chmod, t.p("a"), 0o644)
    t.expect(errno.ELOOP, os.chmod, t.p("a", "x"), 0o644)


@case("chmod")
def eperm_not_owner(t: T):
    t.file("f", mode=0o666)
    yield
    t.uexpect(errno.EPERM, os.chmod, t.p("f"), 0o777)
    t.eq(t.mode("f"), 0o666, "mode")


@case("chmod")
def owner_may(t: T):
    t.file("f", mode=0o644)
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uok(os.chmod, t.p("f"), 0o600)
    t.eq(t.mode("f"), 0o600, "mode")


@case("chmod")
def eacces_search(t: T):
    t.mkdir("d", 0o700)
    t.file("d/f")
    os.chown(t.p("d/f"), UID1, GID1)
    yield
    t.uexpect(errno.EACCES, os.chmod, t.p("d", "f"), 0o600)


@case("chmod")
def sgid_dropped_for_foreign_group(t: T):
    # Linux: a non-root owner setting S_ISGID on a file of a group it is
    # not in gets the bit silently cleared.
    t.file("f", mode=0o644)
    os.chown(t.p("f"), UID1, GID2)
    yield
    t.uok(os.chmod, t.p("f"), 0o2755)
    t.eq(t.mode("f"), 0o755, "mode")


@case("chmod")
def sgid_kept_for_own_group(t: T):
    t.file("f", mode=0o644)
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uok(os.chmod, t.p("f"), 0o2755)
    t.eq(t.mode("f"), 0o2755, "mode")


# -- chown (the caller is root unless a case says otherwise) ----------------------------


@case("chown", TYPES + ("symlink",))
def uid_gid_set(t: T, kind: str):
    t.make(kind, "o")
    yield
    t.ok(lambda: os.chown(t.p("o"), 123, 456, follow_symlinks=kind != "symlink"))
    st = t.lst("o")
    t.eq((st.st_uid, st.st_gid), (123, 456), "owner")


@case("chown", TYPES)
def ctime_updated(t: T, kind: str):
    t.make(kind, "o")
    yield
    before = t.ctimes("o")
    t.tick()
    os.chown(t.p("o"), 321, 654)
    t.changed(("o",), before, "st_ctime_ns")


@case("chown")
def follows_symlink(t: T):
    t.file("f")
    os.symlink("f", t.p("l"))
    yield
    os.chown(t.p("l"), 77, 88)
    t.eq((os.stat(t.p("f")).st_uid, os.stat(t.p("f")).st_gid), (77, 88), "target owner")
    t.eq(t.lst("l").st_uid, 0, "link owner")


@case("chown")
def lchown_leaves_target(t: T):
    t.file("f")
    os.symlink("f", t.p("l"))
    yield
    os.lchown(t.p("l"), 77, 88)
    t.eq((t.lst("l").st_uid, t.lst("l").st_gid), (77, 88), "link owner")
    t.eq(t.lst("f").st_uid, 0, "target owner")


@case("chown")
def minus_one_keeps(t: T):
    t.file("f")
    os.chown(t.p("f"), 11, 22)
    yield
    os.chown(t.p("f"), -1, 33)
    t.eq((t.lst("f").st_uid, t.lst("f").st_gid), (11, 33), "owner after chown(-1, 33)")
    os.chown(t.p("f"), 44, -1)
    t.eq((t.lst("f").st_uid, t.lst("f").st_gid), (44, 33), "owner after chown(44, -1)")


@case("chown")
def clears_suid_sgid(t: T):
    # Linux clears S_ISUID and (with group exec) S_ISGID on chown of a
    # regular file, root included.
    t.file("f", mode=0o6755)
    yield
    os.chown(t.p("f"), 5, 5)
    t.eq(t.mode("f"), 0o755, "mode after chown")


@case("chown")
def dir_keeps_sgid(t: T):
    t.mkdir("d", 0o2755)
    yield
    os.chown(t.p("d"), 5, 5)
    t.eq(t.mode("d"), 0o2755, "directory mode after chown")


@case("chown")
def eperm_give_away(t: T):
    t.file("f")
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uexpect(errno.EPERM, os.chown, t.p("f"), UID2, -1)


@case("chown")
def eperm_not_owner(t: T):
    t.file("f", mode=0o666)
    yield
    t.uexpect(errno.EPERM, os.chown, t.p("f"), -1, GID1)


@case("chown")
def owner_chgrp_member(t: T):
    t.file("f")
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uok(os.chown, t.p("f"), -1, GID_EXTRA, groups=(GID_EXTRA,))
    t.eq(t.lst("f").st_gid, GID_EXTRA, "group")


@case("chown")
def owner_chgrp_nonmember(t: T):
    t.file("f")
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uexpect(errno.EPERM, os.chown, t.p("f"), -1, GID2)
    t.eq(t.lst("f").st_gid, GID1, "group")


@case("chown")
def owner_chgrp_clears_suid(t: T):
    t.file("f", mode=0o644)
    os.chown(t.p("f"), UID1, GID1)
    os.chmod(t.p("f"), 0o6755)
    yield
    t.uok(os.chown, t.p("f"), -1, GID_EXTRA, groups=(GID_EXTRA,))
    t.eq(t.mode("f"), 0o755, "mode after chgrp by the owner")


@case("chown")
def enoent_enotdir(t: T):
    t.file("f")
    yield
    t.expect(errno.ENOENT, os.chown, t.p("missing"), 1, 1)
    t.expect(errno.ENOTDIR, os.chown, t.p("f", "x"), 1, 1)
    t.expect(errno.ENAMETOOLONG, os.chown, t.p(LONG), 1, 1)


# -- utimensat ----------------------------------------------------------------------------


@case("utimensat", ("regular", "dir", "fifo"))
def set_ns(t: T, kind: str):
    t.make(kind, "o")
    yield
    os.utime(t.p("o"), ns=(1_500_000_000_111_111_111, 1_600_000_000_222_222_222))
    st = t.lst("o")
    t.eq((st.st_atime_ns, st.st_mtime_ns), (1_500_000_000_111_111_111, 1_600_000_000_222_222_222), "times")


@case("utimensat")
def symlink_nofollow(t: T):
    t.file("f")
    os.symlink("f", t.p("l"))
    t.age("f")
    yield
    os.utime(t.p("l"), ns=(1_000_000_000, 2_000_000_000), follow_symlinks=False)
    t.eq(t.lst("l").st_mtime_ns, 2_000_000_000, "link mtime")
    t.eq(t.lst("f").st_mtime_ns, OLD_NS, "target mtime")


@case("utimensat")
def now_both(t: T):
    t.file("f")
    t.age("f")
    yield
    t0 = os.lstat(t.d).st_ctime_ns  # a time of this filesystem's clock, before
    os.utime(t.p("f"))
    st = t.lst("f")
    t.check(st.st_mtime_ns >= t0 - 10**9 and st.st_atime_ns >= t0 - 10**9, "times not set to now")


def _utimensat(path: str, atime: tuple[int, int], mtime: tuple[int, int]) -> None:
    import ctypes

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    libc = ctypes.CDLL(None, use_errno=True)
    times = (Timespec * 2)(Timespec(*atime), Timespec(*mtime))
    if libc.utimensat(-100, os.fsencode(path), times, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)


UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


@case("utimensat")
def omit_atime(t: T):
    t.file("f")
    t.age("f")
    yield
    _utimensat(t.p("f"), (0, UTIME_OMIT), (1234, 5678))
    st = t.lst("f")
    t.eq((st.st_atime_ns, st.st_mtime_ns), (OLD_NS, 1234 * 10**9 + 5678), "times")


@case("utimensat")
def omit_mtime(t: T):
    t.file("f")
    t.age("f")
    yield
    _utimensat(t.p("f"), (1234, 5678), (0, UTIME_OMIT))
    st = t.lst("f")
    t.eq((st.st_atime_ns, st.st_mtime_ns), (1234 * 10**9 + 5678, OLD_NS), "times")


@case("utimensat")
def now_mtime_only(t: T):
    t.file("f")
    t.age("f")
    yield
    _utimensat(t.p("f"), (0, UTIME_OMIT), (0, UTIME_NOW))
    st = t.lst("f")
    t.eq(st.st_atime_ns, OLD_NS, "atime")
    t.check(st.st_mtime_ns != OLD_NS, "mtime not set to now")


@case("utimensat")
def omit_both_keeps(t: T):
    t.file("f")
    t.age("f")
    yield
    _utimensat(t.p("f"), (0, UTIME_OMIT), (0, UTIME_OMIT))
    st = t.lst("f")
    t.eq((st.st_atime_ns, st.st_mtime_ns), (OLD_NS, OLD_NS), "times")


@case("utimensat")
def ctime_updated(t: T):
    t.file("f")
    yield
    before = t.ctimes("f")
    t.tick()
    os.utime(t.p("f"), ns=(5, 6))
    t.changed(("f",), before, "st_ctime_ns")


@case("utimensat")
def futimens(t: T):
    t.file("f")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.utime(fd, ns=(7_000_000_007, 8_000_000_008))
        t.eq(os.fstat(fd).st_mtime_ns, 8_000_000_008, "fstat mtime")
    t.eq(t.lst("f").st_mtime_ns, 8_000_000_008, "mtime")


@case("utimensat")
def before_epoch(t: T):
    t.file("f")
    yield
    os.utime(t.p("f"), ns=(-10**9, -2 * 10**9))
    t.eq(t.lst("f").st_mtime_ns, -2 * 10**9, "mtime")


@case("utimensat")
def eperm_explicit_not_owner(t: T):
    t.file("f", mode=0o666)
    yield
    t.uexpect(errno.EPERM, lambda: os.utime(t.p("f"), ns=(1, 1)))


@case("utimensat")
def now_with_write_permission(t: T):
    t.file("f", mode=0o666)
    t.age("f")
    yield
    t.uok(lambda: os.utime(t.p("f")))
    t.check(t.lst("f").st_mtime_ns != OLD_NS, "mtime not set to now")


@case("utimensat")
def eacces_now_without_write(t: T):
    t.file("f", mode=0o644)
    yield
    t.uexpect(errno.EACCES, lambda: os.utime(t.p("f")))


@case("utimensat")
def owner_explicit(t: T):
    t.file("f", mode=0o644)
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uok(lambda: os.utime(t.p("f"), ns=(3_000_000_003, 4_000_000_004)))
    t.eq(t.lst("f").st_mtime_ns, 4_000_000_004, "mtime")


@case("utimensat")
def enoent_enotdir(t: T):
    t.file("f")
    yield
    t.expect(errno.ENOENT, os.utime, t.p("missing"))
    t.expect(errno.ENOTDIR, os.utime, t.p("f", "x"))
    t.expect(errno.ENAMETOOLONG, os.utime, t.p(LONG))

