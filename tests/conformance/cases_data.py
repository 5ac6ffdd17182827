"""open, truncate/ftruncate, posix_fallocate, and permission checks as an
unprivileged user (read/write/search, access(), SUID/SGID cleared on write)."""

from __future__ import annotations

import errno
import mmap
import os
import stat

from .kit import (FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, GID1, OLD_NS, UID1, T, case, fallocate,
                  process_umask)

LONG = "x" * 256


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_at(path: str, data: bytes, offset: int = 0, flags: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | flags)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _open_close(path: str, flags: int, mode: int = 0o644) -> None:
    os.close(os.open(path, flags, mode))


# -- open -------------------------------------------------------------------------------


@case("open")
def creat_mode_owner(t: T):
    os.chmod(t.d, 0o777)
    t.uok(_open_close, t.p("f"), os.O_CREAT | os.O_WRONLY, 0o666)
    st = t.lst("f")
    t.eq(stat.S_IMODE(st.st_mode), 0o666 & ~process_umask(), "mode")
    t.eq((st.st_uid, st.st_gid), (UID1, GID1), "owner")


@case("open")
def creat_existing_untouched(t: T):
    t.file("f", b"keep", 0o600)
    t.age("f")
    yield
    _open_close(t.p("f"), os.O_CREAT | os.O_RDWR, 0o777)
    t.eq(_read(t.p("f")), b"keep", "content")
    t.eq(t.mode("f"), 0o600, "mode")
    t.eq(t.lst("f").st_mtime_ns, OLD_NS, "mtime")


@case("open")
def creat_parent_times(t: T):
    _parent_times_updated(t, lambda: _open_close(t.p("f"), os.O_CREAT | os.O_WRONLY), ".")


def _parent_times_updated(t: T, op, name: str) -> None:
    t.age(name)
    before = t.ctimes(name)
    t.tick()
    op()
    st = t.lst(name)
    t.check(st.st_mtime_ns != OLD_NS, f"mtime of {name!r} not updated")
    t.check(st.st_ctime_ns != before[0], f"ctime of {name!r} not updated")


@case("open", ("regular", "dir", "symlink", "fifo"))
def excl_eexist(t: T, kind: str):
    t.make(kind, "o")
    yield
    t.expect(errno.EEXIST, os.open, t.p("o"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)


@case("open")
def excl_dangling_symlink(t: T):
    os.symlink("nowhere", t.p("l"))
    yield
    t.expect(errno.EEXIST, os.open, t.p("l"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    t.expect(errno.ENOENT, os.lstat, t.p("nowhere"))


@case("open")
def creat_through_dangling_symlink(t: T):
    os.symlink("made", t.p("l"))
    yield
    _open_close(t.p("l"), os.O_CREAT | os.O_WRONLY)
    t.check(stat.S_ISREG(t.lst("made").st_mode), "target not created")


@case("open")
def trunc(t: T):
    t.file("f", b"0123456789")
    t.age("f")
    yield
    before = t.ctimes("f")
    t.tick()
    _open_close(t.p("f"), os.O_WRONLY | os.O_TRUNC)
    st = t.lst("f")
    t.eq(st.st_size, 0, "size")
    t.check(st.st_mtime_ns != OLD_NS, "mtime not updated by O_TRUNC")
    t.check(st.st_ctime_ns != before[0], "ctime not updated by O_TRUNC")


@case("open")
def append(t: T):
    t.file("f", b"abc")
    yield
    with t.opened("f", os.O_WRONLY | os.O_APPEND) as fd:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"def")
        os.lseek(fd, 1, os.SEEK_SET)
        os.write(fd, b"g")
    t.eq(_read(t.p("f")), b"abcdefg", "content")


@case("open")
def append_two_descriptors(t: T):
    t.file("f")
    yield
    a = os.open(t.p("f"), os.O_WRONLY | os.O_APPEND)
    b = os.open(t.p("f"), os.O_WRONLY | os.O_APPEND)
    try:
        for i in range(4):
            os.write(a if i % 2 == 0 else b, b"ab"[i % 2:i % 2 + 1] * 3)
    finally:
        os.close(a)
        os.close(b)
    t.eq(_read(t.p("f")), b"aaabbbaaabbb", "interleaved appends")


@case("open")
def rdwr_new_file(t: T):
    with t.opened("f", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600) as fd:
        os.write(fd, b"hello")
        t.eq(os.pread(fd, 10, 0), b"hello", "read through the creating descriptor")
        m = mmap.mmap(fd, 5)
        try:
            t.eq(m[:], b"hello", "mmap of the new file")
            m[0:1] = b"J"
            m.flush()
        finally:
            m.close()
    t.eq(_read(t.p("f")), b"Jello", "content")


@case("open")
def directory_flag(t: T):
    t.mkdir("d")
    t.file("f")
    yield
    _open_close(t.p("d"), os.O_RDONLY | os.O_DIRECTORY)
    t.expect(errno.ENOTDIR, os.open, t.p("f"), os.O_RDONLY | os.O_DIRECTORY)


@case("open")
def nofollow(t: T):
    t.file("f")
    os.symlink("f", t.p("l"))
    yield
    t.expect(errno.ELOOP, os.open, t.p("l"), os.O_RDONLY | os.O_NOFOLLOW)
    _open_close(t.p("f"), os.O_RDONLY | os.O_NOFOLLOW)


@case("open")
def eisdir(t: T):
    t.mkdir("d")
    yield
    t.expect(errno.EISDIR, os.open, t.p("d"), os.O_WRONLY)
    t.expect(errno.EISDIR, os.open, t.p("d"), os.O_RDWR)
    t.expect(errno.EISDIR, os.open, t.p("d"), os.O_CREAT | os.O_WRONLY)


@case("open")
def enotdir(t: T):
    t.file("f")
    yield
    t.expect(errno.ENOTDIR, os.open, t.p("f", "x"), os.O_RDONLY)
    t.expect(errno.ENOTDIR, os.open, t.p("f", "x"), os.O_CREAT | os.O_WRONLY)


@case("open")
def enoent(t: T):
    t.expect(errno.ENOENT, os.open, t.p("missing"), os.O_RDONLY)
    t.expect(errno.ENOENT, os.open, t.p("missing", "f"), os.O_CREAT | os.O_WRONLY)


@case("open")
def eloop(t: T):
    os.symlink("b", t.p("a"))
    os.symlink("a", t.p("b"))
    yield
    t.expect(errno.ELOOP, os.open, t.p("a"), os.O_RDONLY)
    t.expect(errno.ELOOP, os.open, t.p("a"), os.O_CREAT | os.O_WRONLY)


@case("open")
def enametoolong(t: T):
    t.expect(errno.ENAMETOOLONG, os.open, t.p(LONG), os.O_CREAT | os.O_WRONLY)
    _open_close(t.p("n" * 255), os.O_CREAT | os.O_WRONLY)
    deep = t.p(*(["d" * 100] * 41))
    t.expect(errno.ENAMETOOLONG, os.open, deep, os.O_RDONLY)


@case("open")
def deep_path(t: T):
    # A path near PATH_MAX inside the filesystem, built component by component.
    path = t.d
    for i in range(30):
        path = os.path.join(path, f"{i:02d}" + "d" * 120)
        os.mkdir(path)
    with open(os.path.join(path, "f"), "wb") as f:
        f.write(b"deep")
    t.eq(_read(os.path.join(path, "f")), b"deep", "content at depth 30")


@case("open")
def enxio_fifo(t: T):
    os.mkfifo(t.p("p"))
    yield
    t.expect(errno.ENXIO, os.open, t.p("p"), os.O_WRONLY | os.O_NONBLOCK)


@case("open")
def eacces_read(t: T):
    t.file("f", b"x", 0o640)
    yield
    t.uexpect(errno.EACCES, os.open, t.p("f"), os.O_RDONLY)


@case("open")
def eacces_write(t: T):
    t.file("f", b"x", 0o644)
    yield
    t.uexpect(errno.EACCES, os.open, t.p("f"), os.O_WRONLY)
    t.uexpect(errno.EACCES, os.open, t.p("f"), os.O_RDONLY | os.O_TRUNC)


@case("open")
def eacces_owner_bits_rule(t: T):
    # The owner class decides even when 'other' would allow.
    t.file("f", b"x", 0o066)
    os.chown(t.p("f"), UID1, GID1)
    yield
    t.uexpect(errno.EACCES, os.open, t.p("f"), os.O_RDONLY)


@case("open")
def eacces_search(t: T):
    t.mkdir("d", 0o666)
    t.file("d/f", b"x", 0o666)
    yield
    t.uexpect(errno.EACCES, os.open, t.p("d", "f"), os.O_RDONLY)


@case("open")
def eacces_create(t: T):
    t.uexpect(errno.EACCES, os.open, t.p("f"), os.O_CREAT | os.O_WRONLY)


@case("open")
def root_ignores_rw_bits(t: T):
    t.file("f", b"secret", 0o000)
    yield
    t.eq(_read(t.p("f")), b"secret", "root reads a mode-0 file")
    _write_at(t.p("f"), b"S")


@case("open")
def write_then_read_other_descriptor(t: T):
    t.file("f", b"0123456789")
    yield
    w = os.open(t.p("f"), os.O_WRONLY)
    r = os.open(t.p("f"), os.O_RDONLY)
    try:
        os.pwrite(w, b"AB", 4)
        t.eq(os.pread(r, 10, 0), b"0123AB6789", "read sees the other descriptor's write")
    finally:
        os.close(w)
        os.close(r)


@case("open")
def mmap_sees_write(t: T):
    t.file("f", b"a" * 8192)
    yield
    with t.opened("f", os.O_RDWR) as fd:
        m = mmap.mmap(fd, 8192, prot=mmap.PROT_READ)
        try:
            os.pwrite(fd, b"WRITE", 4096)
            t.eq(m[4096:4101], b"WRITE", "shared read mapping sees write()")
        finally:
            m.close()


# -- truncate / ftruncate ---------------------------------------------------------------


@case("truncate")
def extend_reads_zeros(t: T):
    t.file("f", b"abc")
    yield
    os.truncate(t.p("f"), 10)
    t.eq(_read(t.p("f")), b"abc" + b"\0" * 7, "content")


@case("truncate")
def shrink(t: T):
    t.file("f", b"abcdefgh")
    yield
    os.truncate(t.p("f"), 3)
    t.eq(_read(t.p("f")), b"abc", "content")


@case("truncate")
def shrink_then_extend_no_stale(t: T):
    t.file("f", b"abcdefgh")
    yield
    os.truncate(t.p("f"), 2)
    os.truncate(t.p("f"), 8)
    t.eq(_read(t.p("f")), b"ab" + b"\0" * 6, "content")


@case("truncate")
def times_updated(t: T):
    t.file("f", b"abc")
    t.age("f")
    yield
    before = t.ctimes("f")
    t.tick()
    os.truncate(t.p("f"), 1)
    st = t.lst("f")
    t.check(st.st_mtime_ns != OLD_NS, "mtime not updated")
    t.check(st.st_ctime_ns != before[0], "ctime not updated")


@case("truncate")
def ftruncate_rdwr(t: T):
    t.file("f", b"abcdef")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.ftruncate(fd, 2)
        t.eq(os.fstat(fd).st_size, 2, "fstat size")
        os.ftruncate(fd, 4)
        t.eq(os.pread(fd, 10, 0), b"ab\0\0", "read through the descriptor")


@case("truncate")
def ftruncate_readonly_fd(t: T):
    t.file("f", b"abc")
    yield
    with t.opened("f", os.O_RDONLY) as fd:
        t.expect((errno.EINVAL, errno.EBADF), os.ftruncate, fd, 1)
    t.eq(t.lst("f").st_size, 3, "size")


@case("truncate")
def ftruncate_after_chmod(t: T):
    # Permission is checked at open: a descriptor opened for writing keeps
    # working after the mode forbids writing.
    t.file("f", b"abc", 0o644)
    os.chown(t.p("f"), UID1, GID1)
    yield

    def shrink(path):
        fd = os.open(path, os.O_RDWR)
        try:
            os.fchmod(fd, 0o444)
            os.ftruncate(fd, 1)
        finally:
            os.close(fd)

    t.uok(shrink, t.p("f"))
    t.eq(t.lst("f").st_size, 1, "size")


@case("truncate")
def einval_negative(t: T):
    t.file("f")
    yield
    t.expect(errno.EINVAL, os.truncate, t.p("f"), -1)


@case("truncate")
def eisdir(t: T):
    t.mkdir("d")
    yield
    t.expect(errno.EISDIR, os.truncate, t.p("d"), 0)


@case("truncate")
def enoent_enotdir_toolong_loop(t: T):
    t.file("f")
    os.symlink("l", t.p("l"))
    yield
    t.expect(errno.ENOENT, os.truncate, t.p("missing"), 0)
    t.expect(errno.ENOTDIR, os.truncate, t.p("f", "x"), 0)
    t.expect(errno.ENAMETOOLONG, os.truncate, t.p(LONG), 0)
    t.expect(errno.ELOOP, os.truncate, t.p("l"), 0)


@case("truncate")
def eacces(t: T):
    t.file("f", b"abc", 0o644)
    yield
    t.uexpect(errno.EACCES, os.truncate, t.p("f"), 0)
    t.eq(t.lst("f").st_size, 3, "size")


@case("truncate")
def unlinked_open_file(t: T):
    t.file("f", b"abcdef")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.unlink(t.p("f"))
        os.ftruncate(fd, 3)
        t.eq(os.pread(fd, 10, 0), b"abc", "content of the unlinked file")


@case("truncate")
def sparse_gigabyte(t: T):
    t.file("f", b"head")
    yield
    os.truncate(t.p("f"), 1 << 30)
    with t.opened("f", os.O_RDONLY) as fd:
        t.eq(os.pread(fd, 8, (1 << 30) - 8), b"\0" * 8, "tail of a 1 GiB sparse file")
        t.eq(os.pread(fd, 4, 0), b"head", "head")


# -- posix_fallocate / fallocate --------------------------------------------------------


@case("fallocate")
def extends(t: T):
    t.file("f", b"abc")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.posix_fallocate(fd, 0, 100)
        t.eq(os.fstat(fd).st_size, 100, "size")
        t.eq(os.pread(fd, 200, 0), b"abc" + b"\0" * 97, "content")


@case("fallocate")
def inside_keeps_content(t: T):
    t.file("f", b"abcdef")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.posix_fallocate(fd, 1, 3)
    t.eq(_read(t.p("f")), b"abcdef", "content")


@case("fallocate")
def keep_size(t: T):
    t.file("f", b"abc")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 8192)
        t.eq(os.fstat(fd).st_size, 3, "size")


@case("fallocate")
def punch_hole(t: T):
    t.file("f", b"x" * 10000)
    yield
    with t.opened("f", os.O_RDWR) as fd:
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 100, 5000)
        t.eq(os.fstat(fd).st_size, 10000, "size")
        data = os.pread(fd, 20000, 0)
    t.eq(data, b"x" * 100 + b"\0" * 5000 + b"x" * 4900, "content after the punch")


@case("fallocate")
def ebadf_readonly(t: T):
    t.file("f")
    yield
    with t.opened("f", os.O_RDONLY) as fd:
        t.expect(errno.EBADF, os.posix_fallocate, fd, 0, 10)


@case("fallocate")
def einval_length(t: T):
    t.file("f")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        t.expect(errno.EINVAL, os.posix_fallocate, fd, 0, 0)
        t.expect(errno.EINVAL, os.posix_fallocate, fd, -1, 10)


# -- permissions as an unprivileged user ------------------------------------------------


@case("perm")
def access_modes(t: T):
    t.file("f", b"x", 0o754)
    os.chown(t.p("f"), 0, GID1)
    yield
    t.uok(os.access, t.p("f"), os.R_OK)
    t.eq(t.user(os.access, t.p("f"), os.R_OK | os.X_OK), True, "group may read and execute")
    t.eq(t.user(os.access, t.p("f"), os.W_OK), False, "group may not write")
    t.eq(t.user(os.access, t.p("f"), os.R_OK, uid=65534, gid=65534), True, "others may read")
    t.eq(t.user(os.access, t.p("f"), os.X_OK, uid=65534, gid=65534), False, "others may not execute")


@case("perm")
def root_execute_needs_a_bit(t: T):
    t.file("f", b"x", 0o644)
    t.file("g", b"x", 0o001)
    yield
    t.eq(os.access(t.p("f"), os.X_OK), False, "root may execute a file without x bits")
    t.eq(os.access(t.p("g"), os.X_OK), True, "root may not execute a file with one x bit")


@case("perm")
def group_member_writes(t: T):
    t.file("f", b"abc", 0o664)
    os.chown(t.p("f"), 0, 4242)
    yield
    t.uok(_write_at, t.p("f"), b"X", 0, groups=(4242,))
    t.eq(_read(t.p("f")), b"Xbc", "content")


@case("perm")
def readdir_needs_read(t: T):
    t.mkdir("d", 0o711)
    t.file("d/f", b"x", 0o644)
    yield
    t.uexpect(errno.EACCES, os.listdir, t.p("d"))
    t.eq(t.uok(_read, t.p("d", "f")), b"x", "lookup with search permission only")


@case("perm")
def search_needed_for_stat(t: T):
    t.mkdir("d", 0o744)
    t.file("d/f")
    yield
    t.uexpect(errno.EACCES, os.stat, t.p("d", "f"))


@case("perm")
def suid_cleared_on_write(t: T):
    t.file("f", b"abc", 0o4777)
    yield
    t.uok(_write_at, t.p("f"), b"X")
    t.eq(t.mode("f") & 0o7777, 0o777, "mode after a write by a non-owner")


@case("perm")
def sgid_cleared_on_write(t: T):
    t.file("f", b"abc", 0o2777)
    yield
    t.uok(_write_at, t.p("f"), b"X")
    t.eq(t.mode("f") & 0o7777, 0o777, "mode after a write by a non-owner")


@case("perm")
def suid_cleared_on_truncate(t: T):
    t.file("f", b"abc", 0o4777)
    yield
    t.uok(os.truncate, t.p("f"), 1)
    t.eq(t.mode("f") & 0o7777, 0o777, "mode after a truncate by a non-owner")


@case("perm")
def suid_cleared_on_owner_write(t: T):
    # Linux clears S_ISUID on any write by a caller without CAP_FSETID,
    # the owner included.
    t.file("f", b"abc", 0o4755)
    os.chown(t.p("f"), UID1, GID1)
    os.chmod(t.p("f"), 0o4755)
    yield
    t.uok(_write_at, t.p("f"), b"X")
    t.eq(t.mode("f") & 0o7777, 0o755, "mode after a write by the owner")


@case("perm")
def suid_kept_on_root_write(t: T):
    t.file("f", b"abc", 0o4755)
    yield
    _write_at(t.p("f"), b"X")
    t.eq(t.mode("f") & 0o7777, 0o4755, "mode after a write by root")


@case("perm")
def new_file_in_user_dir(t: T):
    t.mkdir("home", 0o755)
    os.chown(t.p("home"), UID1, GID1)
    yield
    t.uok(_open_close, t.p("home", "f"), os.O_CREAT | os.O_WRONLY, 0o600)
    t.uok(_write_at, t.p("home", "f"), b"mine")
    t.eq(t.uok(_read, t.p("home", "f")), b"mine", "content read by the owner")
    t.uexpect(errno.EACCES, _read, t.p("home", "f"), uid=65534, gid=65534)
