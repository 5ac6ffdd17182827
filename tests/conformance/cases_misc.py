"""Extended attributes (user.*), record locks and flock across processes,
statfs: what tools rely on beyond pjdfstest's syscall list."""

from __future__ import annotations

import errno
import fcntl
import os

from .kit import T, case


# -- xattr --------------------------------------------------------------------------------


@case("xattr", ("regular", "dir"))
def set_get_list_remove(t: T, kind: str):
    t.make(kind, "o")
    yield
    os.setxattr(t.p("o"), "user.a", b"1")
    os.setxattr(t.p("o"), "user.b", b"\0binary\xff")
    t.eq(os.getxattr(t.p("o"), "user.b"), b"\0binary\xff", "value")
    t.eq(sorted(os.listxattr(t.p("o"))), ["user.a", "user.b"], "names")
    os.removexattr(t.p("o"), "user.a")
    t.expect(errno.ENODATA, os.getxattr, t.p("o"), "user.a")


@case("xattr")
def create_replace_flags(t: T):
    t.file("f")
    os.setxattr(t.p("f"), "user.x", b"old")
    yield
    t.expect(errno.EEXIST, os.setxattr, t.p("f"), "user.x", b"new", os.XATTR_CREATE)
    t.expect(errno.ENODATA, os.setxattr, t.p("f"), "user.y", b"new", os.XATTR_REPLACE)
    os.setxattr(t.p("f"), "user.x", b"new", os.XATTR_REPLACE)
    t.eq(os.getxattr(t.p("f"), "user.x"), b"new", "replaced value")


@case("xattr")
def ctime_updated(t: T):
    t.file("f")
    yield
    before = t.ctimes("f")
    t.tick()
    os.setxattr(t.p("f"), "user.c", b"v")
    t.changed(("f",), before, "st_ctime_ns")


@case("xattr")
def enodata_remove_missing(t: T):
    t.file("f")
    yield
    t.expect(errno.ENODATA, os.removexattr, t.p("f"), "user.none")


@case("xattr")
def survives_rename(t: T):
    t.file("f")
    os.setxattr(t.p("f"), "user.keep", b"k")
    yield
    os.rename(t.p("f"), t.p("g"))
    t.eq(os.getxattr(t.p("g"), "user.keep"), b"k", "value after rename")


@case("xattr")
def eacces_user_not_writer(t: T):
    t.file("f", mode=0o644)
    yield
    t.uexpect(errno.EACCES, os.setxattr, t.p("f"), "user.x", b"v")


# -- locks --------------------------------------------------------------------------------


def _try_lock(path: str, kind: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        if kind == "posix":
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


@case("locks", ("posix", "flock"))
def conflict_across_processes(t: T, kind: str):
    t.file("f", b"data", 0o666)
    yield
    with t.opened("f", os.O_RDWR) as fd:
        if kind == "posix":
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        t.uexpect((errno.EAGAIN, errno.EACCES), _try_lock, t.p("f"), kind, uid=0, gid=0)
    t.uok(_try_lock, t.p("f"), kind, uid=0, gid=0)  # released with the descriptor


@case("locks")
def posix_ranges_independent(t: T):
    t.file("f", b"x" * 100, 0o666)
    yield

    def other_range(path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 50, 50)
        finally:
            os.close(fd)

    with t.opened("f", os.O_RDWR) as fd:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 50, 0)
        t.uok(other_range, t.p("f"), uid=0, gid=0)


# -- statfs -------------------------------------------------------------------------------


@case("statfs")
def sane(t: T):
    sv = os.statvfs(t.d)
    t.check(sv.f_bsize > 0 and sv.f_blocks > 0, "no block counts")
    t.check(sv.f_bavail <= sv.f_bfree <= sv.f_blocks, "free counts inconsistent")
    t.eq(sv.f_namemax, 255, "f_namemax")
