"""link, mkdir, mkfifo/mknod, rename, rmdir, symlink, unlink: the namespace."""

from __future__ import annotations

import errno
import os
import stat

from .kit import (GID1, GID2, OLD_NS, RENAME_EXCHANGE, RENAME_NOREPLACE, UID1, UID2, T, case,
                  process_umask, renameat2)

LONG = "x" * 256
NAME255 = "n" * 255


def _parent_times_updated(t: T, op, *names: str) -> None:
    """``op()`` updates mtime and ctime of each directory in ``names``."""
    t.age(*names)
    before = t.ctimes(*names)
    t.tick()
    op()
    for name, old in zip(names, before):
        st = t.lst(name)
        t.check(st.st_mtime_ns != OLD_NS, f"mtime of directory {name!r} not updated")
        t.check(st.st_ctime_ns != old, f"ctime of directory {name!r} not updated")


# -- link -------------------------------------------------------------------------------


@case("link")
def second_name(t: T):
    t.file("f", b"shared")
    yield
    os.link(t.p("f"), t.p("g"))
    a, b = t.lst("f"), t.lst("g")
    t.eq(a.st_ino, b.st_ino, "inode of both names")
    t.eq((a.st_nlink, b.st_nlink), (2, 2), "link counts")
    with open(t.p("g"), "rb") as f:
        t.eq(f.read(), b"shared", "content through the new name")


@case("link")
def write_through_one_name(t: T):
    t.file("f", b"old")
    yield
    os.link(t.p("f"), t.p("g"))
    with open(t.p("g"), "r+b") as f:
        f.write(b"NEW")
    with open(t.p("f"), "rb") as f:
        t.eq(f.read(), b"NEW", "content through the other name")


@case("link")
def chmod_through_one_name(t: T):
    t.file("f")
    os.link(t.p("f"), t.p("g"))
    yield
    os.chmod(t.p("g"), 0o600)
    t.eq(t.mode("f"), 0o600, "mode through the other name")
    os.chown(t.p("f"), 9, 9)
    t.eq(t.lst("g").st_uid, 9, "owner through the other name")


@case("link")
def three_names_then_unlink(t: T):
    t.file("f")
    yield
    os.link(t.p("f"), t.p("g"))
    os.link(t.p("g"), t.p("h"))
    t.eq(t.lst("f").st_nlink, 3, "link count with three names")
    os.unlink(t.p("g"))
    t.eq((t.lst("f").st_nlink, t.lst("h").st_nlink), (2, 2), "link counts after unlink")


@case("link")
def ctime_and_parent_times(t: T):
    t.file("f")
    yield
    before = t.ctimes("f")
    _parent_times_updated(t, lambda: os.link(t.p("f"), t.p("g")), ".")
    t.changed(("f",), before, "st_ctime_ns")


@case("link")
def across_directories(t: T):
    t.mkdir("a")
    t.mkdir("b")
    t.file("a/f", b"x")
    yield
    os.link(t.p("a", "f"), t.p("b", "g"))
    t.eq(t.lst("b/g").st_ino, t.lst("a/f").st_ino, "inode")


@case("link")
def symlink_itself(t: T):
    t.file("f")
    os.symlink("f", t.p("l"))
    yield
    os.link(t.p("l"), t.p("l2"), follow_symlinks=False)
    t.check(stat.S_ISLNK(t.lst("l2").st_mode), "link of a symlink is the symlink")
    t.eq(os.readlink(t.p("l2")), "f", "target")


@case("link", ("regular", "dir", "symlink"))
def eexist(t: T, kind: str):
    t.file("f")
    t.make(kind, "o")
    yield
    t.expect(errno.EEXIST, os.link, t.p("f"), t.p("o"))


@case("link")
def eperm_directory(t: T):
    t.mkdir("d")
    yield
    t.expect(errno.EPERM, os.link, t.p("d"), t.p("d2"))


@case("link")
def enoent(t: T):
    t.expect(errno.ENOENT, os.link, t.p("missing"), t.p("g"))
    t.file("f")
    t.expect(errno.ENOENT, os.link, t.p("f"), t.p("nodir", "g"))


@case("link")
def enotdir(t: T):
    t.file("f")
    yield
    t.expect(errno.ENOTDIR, os.link, t.p("f", "x"), t.p("g"))
    t.expect(errno.ENOTDIR, os.link, t.p("f"), t.p("f", "g"))


@case("link")
def enametoolong(t: T):
    t.file("f")
    t.expect(errno.ENAMETOOLONG, os.link, t.p("f"), t.p(LONG))
    t.ok(os.link, t.p("f"), t.p(NAME255))


@case("link")
def eacces_target_dir(t: T):
    t.file("f", mode=0o644)
    os.chown(t.p("f"), UID1, GID1)
    t.mkdir("ro", 0o755)
    yield
    t.uexpect(errno.EACCES, os.link, t.p("f"), t.p("ro", "g"))


@case("link")
def open_fd_after_link_and_unlink(t: T):
    t.file("f", b"abc")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.link(t.p("f"), t.p("g"))
        os.unlink(t.p("f"))
        os.pwrite(fd, b"XYZ", 0)
        t.eq(os.fstat(fd).st_nlink, 1, "fstat link count")
    with open(t.p("g"), "rb") as f:
        t.eq(f.read(), b"XYZ", "content through the remaining name")


# -- mkdir ------------------------------------------------------------------------------


@case("mkdir")
def mode_and_umask(t: T):
    os.mkdir(t.p("d"), 0o777)
    t.eq(t.mode("d"), 0o777 & ~process_umask(), "mode")
    os.mkdir(t.p("e"), 0o1700)
    t.eq(t.mode("e"), 0o1700 & ~process_umask(), "mode with the sticky bit")


@case("mkdir")
def owner_is_caller(t: T):
    os.chmod(t.d, 0o777)
    t.uok(os.mkdir, t.p("d"), 0o755)
    st = t.lst("d")
    t.eq((st.st_uid, st.st_gid), (UID1, GID1), "owner")


@case("mkdir")
def sgid_parent_inherited(t: T):
    t.mkdir("p", 0o2777)
    os.chown(t.p("p"), 0, GID2)
    yield
    t.uok(os.mkdir, t.p("p", "d"), 0o755)
    t.uok(lambda: os.close(os.open(t.p("p", "f"), os.O_CREAT | os.O_WRONLY, 0o644)))
    t.eq(t.lst("p/d").st_gid, GID2, "group of a new directory in a set-group-ID directory")
    t.check(t.mode("p/d") & stat.S_ISGID, "new directory does not inherit S_ISGID")
    t.eq(t.lst("p/f").st_gid, GID2, "group of a new file in a set-group-ID directory")


@case("mkdir")
def parent_times_and_links(t: T):
    t.mkdir("p")
    yield
    _parent_times_updated(t, lambda: os.mkdir(t.p("p", "d")), "p")
    t.eq(t.lst("p").st_nlink, 3, "parent link count")
    t.eq(t.lst("p/d").st_nlink, 2, "new directory link count")


@case("mkdir")
def new_times_equal(t: T):
    os.mkdir(t.p("d"))
    st = t.lst("d")
    t.check(st.st_mtime_ns == st.st_ctime_ns, "mtime != ctime of a new directory")


@case("mkdir", ("regular", "dir", "symlink", "fifo"))
def eexist(t: T, kind: str):
    t.make(kind, "o")
    yield
    t.expect(errno.EEXIST, os.mkdir, t.p("o"))


@case("mkdir")
def eexist_dangling_symlink(t: T):
    os.symlink("nowhere", t.p("l"))
    yield
    t.expect(errno.EEXIST, os.mkdir, t.p("l"))
    t.expect(errno.ENOENT, os.stat, t.p("nowhere"))


@case("mkdir")
def enoent_enotdir(t: T):
    t.expect(errno.ENOENT, os.mkdir, t.p("missing", "d"))
    t.file("f")
    t.expect(errno.ENOTDIR, os.mkdir, t.p("f", "d"))


@case("mkdir")
def enametoolong(t: T):
    t.expect(errno.ENAMETOOLONG, os.mkdir, t.p(LONG))
    t.ok(os.mkdir, t.p(NAME255))


@case("mkdir")
def eacces_parent(t: T):
    t.mkdir("p", 0o755)
    yield
    t.uexpect(errno.EACCES, os.mkdir, t.p("p", "d"))


@case("mkdir")
def trailing_slash(t: T):
    os.mkdir(t.p("d") + "/")
    t.check(stat.S_ISDIR(t.lst("d").st_mode), "not a directory")


@case("mkdir")
def dotdot_is_parent(t: T):
    t.mkdir("a")
    yield
    os.mkdir(t.p("a", "b"))
    t.eq(os.stat(t.p("a", "b", "..")).st_ino, t.lst("a").st_ino, "inode of b/..")


# -- mkfifo / mknod ---------------------------------------------------------------------


@case("mknod")
def mkfifo_mode_owner(t: T):
    os.chmod(t.d, 0o777)
    t.uok(os.mkfifo, t.p("p"), 0o640)
    st = t.lst("p")
    t.check(stat.S_ISFIFO(st.st_mode), "not a FIFO")
    t.eq(stat.S_IMODE(st.st_mode), 0o640 & ~process_umask(), "mode")
    t.eq((st.st_uid, st.st_gid), (UID1, GID1), "owner")


@case("mknod")
def fifo_carries_data(t: T):
    os.mkfifo(t.p("p"))
    yield
    r = os.open(t.p("p"), os.O_RDONLY | os.O_NONBLOCK)
    try:
        w = os.open(t.p("p"), os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(w, b"through")
            t.eq(os.read(r, 100), b"through", "bytes through the FIFO")
        finally:
            os.close(w)
    finally:
        os.close(r)


@case("mknod")
def fifo_enxio_without_reader(t: T):
    os.mkfifo(t.p("p"))
    yield
    t.expect(errno.ENXIO, os.open, t.p("p"), os.O_WRONLY | os.O_NONBLOCK)


@case("mknod")
def mknod_regular(t: T):
    os.mknod(t.p("f"), stat.S_IFREG | 0o600)
    t.check(stat.S_ISREG(t.lst("f").st_mode), "not a regular file")
    t.eq(t.lst("f").st_size, 0, "size")


@case("mknod")
def mknod_chr_rdev(t: T):
    os.mknod(t.p("c"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    st = t.lst("c")
    t.check(stat.S_ISCHR(st.st_mode), "not a character device")
    t.eq((os.major(st.st_rdev), os.minor(st.st_rdev)), (1, 3), "device numbers")


@case("mknod")
def mknod_chr_eperm_user(t: T):
    os.chmod(t.d, 0o777)
    t.uexpect(errno.EPERM, os.mknod, t.p("c"), stat.S_IFCHR | 0o600, os.makedev(1, 3))


@case("mknod")
def mknod_socket(t: T):
    os.mknod(t.p("s"), stat.S_IFSOCK | 0o600)
    t.check(stat.S_ISSOCK(t.lst("s").st_mode), "not a socket")


@case("mknod")
def parent_times(t: T):
    _parent_times_updated(t, lambda: os.mkfifo(t.p("p")), ".")


@case("mknod", ("regular", "dir", "symlink", "fifo"))
def eexist(t: T, kind: str):
    t.make(kind, "o")
    yield
    t.expect(errno.EEXIST, os.mkfifo, t.p("o"))


@case("mknod")
def enoent_enotdir_toolong(t: T):
    t.file("f")
    t.expect(errno.ENOENT, os.mkfifo, t.p("missing", "p"))
    t.expect(errno.ENOTDIR, os.mkfifo, t.p("f", "p"))
    t.expect(errno.ENAMETOOLONG, os.mkfifo, t.p(LONG))


@case("mknod")
def eacces_parent(t: T):
    t.uexpect(errno.EACCES, os.mkfifo, t.p("p"))


# -- rename -----------------------------------------------------------------------------


@case("rename", ("regular", "dir", "fifo", "symlink"))
def keeps_identity(t: T, kind: str):
    t.make(kind, "a")
    yield
    before = t.lst("a")
    os.rename(t.p("a"), t.p("b"))
    after = t.lst("b")
    t.expect(errno.ENOENT, os.lstat, t.p("a"))
    t.eq((after.st_ino, stat.S_IFMT(after.st_mode), after.st_nlink),
         (before.st_ino, stat.S_IFMT(before.st_mode), before.st_nlink), "inode, type, link count")
    if kind == "symlink":
        t.eq(os.readlink(t.p("b")), "target-of-a", "link target")


@case("rename", ("regular", "dir", "fifo", "symlink"))
def ctime_of_moved(t: T, kind: str):
    t.make(kind, "a")
    yield
    before = t.ctimes("a")
    t.tick()
    os.rename(t.p("a"), t.p("b"))
    t.eq(os.lstat(t.p("b")).st_ctime_ns != before[0], True, "ctime of the renamed object changed")


@case("rename")
def parent_times_both(t: T):
    t.mkdir("s")
    t.mkdir("d")
    t.file("s/f")
    yield
    _parent_times_updated(t, lambda: os.rename(t.p("s", "f"), t.p("d", "f")), "s", "d")


@case("rename")
def over_file(t: T):
    t.file("a", b"A")
    t.file("b", b"B")
    yield
    ino = t.lst("a").st_ino
    os.rename(t.p("a"), t.p("b"))
    t.eq(t.lst("b").st_ino, ino, "inode of the new name")
    with open(t.p("b"), "rb") as f:
        t.eq(f.read(), b"A", "content")


@case("rename")
def over_hardlinked_file(t: T):
    t.file("a", b"A")
    t.file("b", b"B")
    os.link(t.p("b"), t.p("b2"))
    yield
    os.rename(t.p("a"), t.p("b"))
    t.eq(t.lst("b2").st_nlink, 1, "link count of the replaced file's other name")
    with open(t.p("b2"), "rb") as f:
        t.eq(f.read(), b"B", "content of the other name")


@case("rename")
def over_empty_dir(t: T):
    t.mkdir("a")
    t.file("a/inside", b"i")
    t.mkdir("b")
    yield
    os.rename(t.p("a"), t.p("b"))
    with open(t.p("b", "inside"), "rb") as f:
        t.eq(f.read(), b"i", "content under the new name")
    t.expect(errno.ENOENT, os.lstat, t.p("a"))


@case("rename")
def enotempty(t: T):
    t.mkdir("a")
    t.mkdir("b")
    t.file("b/f")
    yield
    t.expect((errno.ENOTEMPTY, errno.EEXIST), os.rename, t.p("a"), t.p("b"))
    t.check(os.path.exists(t.p("b", "f")), "target content gone")


@case("rename")
def eisdir_file_over_dir(t: T):
    t.file("a")
    t.mkdir("b")
    yield
    t.expect(errno.EISDIR, os.rename, t.p("a"), t.p("b"))


@case("rename")
def enotdir_dir_over_file(t: T):
    t.mkdir("a")
    t.file("b")
    yield
    t.expect(errno.ENOTDIR, os.rename, t.p("a"), t.p("b"))


@case("rename")
def einval_into_own_subtree(t: T):
    t.mkdir("a")
    t.mkdir("a/b")
    yield
    t.expect(errno.EINVAL, os.rename, t.p("a"), t.p("a", "b", "c"))
    t.expect(errno.EINVAL, os.rename, t.p("a"), t.p("a", "c"))


@case("rename")
def same_name_noop(t: T):
    t.file("a", b"A")
    yield
    os.rename(t.p("a"), t.p("a"))
    with open(t.p("a"), "rb") as f:
        t.eq(f.read(), b"A", "content")


@case("rename")
def hardlinks_of_one_file_noop(t: T):
    t.file("a", b"A")
    os.link(t.p("a"), t.p("b"))
    yield
    os.rename(t.p("a"), t.p("b"))
    t.check(os.path.lexists(t.p("a")) and os.path.lexists(t.p("b")), "both names stay (POSIX)")
    t.eq(t.lst("b").st_nlink, 2, "link count")


@case("rename")
def dir_across_parents(t: T):
    t.mkdir("p")
    t.mkdir("q")
    t.mkdir("p/d")
    t.file("p/d/f", b"deep")
    yield
    os.rename(t.p("p", "d"), t.p("q", "d"))
    t.eq(os.stat(t.p("q", "d", "..")).st_ino, t.lst("q").st_ino, "inode of d/.. after the move")
    t.eq((t.lst("p").st_nlink, t.lst("q").st_nlink), (2, 3), "parents' link counts")
    with open(t.p("q", "d", "f"), "rb") as f:
        t.eq(f.read(), b"deep", "content under the moved directory")


@case("rename")
def noreplace(t: T):
    t.file("a", b"A")
    t.file("b", b"B")
    yield
    t.expect(errno.EEXIST, renameat2, t.p("a"), t.p("b"), RENAME_NOREPLACE)
    with open(t.p("b"), "rb") as f:
        t.eq(f.read(), b"B", "target content")
    t.ok(renameat2, t.p("a"), t.p("c"), RENAME_NOREPLACE)


@case("rename")
def exchange_files(t: T):
    t.file("a", b"A")
    t.file("b", b"B")
    yield
    t.ok(renameat2, t.p("a"), t.p("b"), RENAME_EXCHANGE)
    with open(t.p("a"), "rb") as fa, open(t.p("b"), "rb") as fb:
        t.eq((fa.read(), fb.read()), (b"B", b"A"), "contents after exchange")


@case("rename")
def exchange_file_and_dir(t: T):
    t.file("a", b"A")
    t.mkdir("b")
    t.file("b/in", b"I")
    yield
    t.ok(renameat2, t.p("a"), t.p("b"), RENAME_EXCHANGE)
    t.check(stat.S_ISDIR(t.lst("a").st_mode) and stat.S_ISREG(t.lst("b").st_mode), "kinds swapped")
    with open(t.p("a", "in"), "rb") as f:
        t.eq(f.read(), b"I", "content under the swapped directory")


@case("rename")
def exchange_enoent(t: T):
    t.file("a")
    yield
    t.expect(errno.ENOENT, renameat2, t.p("a"), t.p("b"), RENAME_EXCHANGE)


@case("rename")
def enoent_enotdir(t: T):
    t.file("f")
    yield
    t.expect(errno.ENOENT, os.rename, t.p("missing"), t.p("x"))
    t.expect(errno.ENOENT, os.rename, t.p("f"), t.p("missing", "x"))
    t.expect(errno.ENOTDIR, os.rename, t.p("f", "x"), t.p("y"))
    t.expect(errno.ENOTDIR, os.rename, t.p("f"), t.p("f", "y"))


@case("rename")
def enametoolong(t: T):
    t.file("f")
    t.expect(errno.ENAMETOOLONG, os.rename, t.p("f"), t.p(LONG))
    t.expect(errno.ENAMETOOLONG, os.rename, t.p(LONG), t.p("g"))


@case("rename")
def open_fd_survives(t: T):
    t.file("a", b"content")
    yield
    with t.opened("a", os.O_RDWR) as fd:
        os.rename(t.p("a"), t.p("b"))
        t.eq(os.pread(fd, 100, 0), b"content", "read through the descriptor")
        os.pwrite(fd, b"C", 0)
    with open(t.p("b"), "rb") as f:
        t.eq(f.read(), b"Content", "content under the new name")


@case("rename")
def replaced_file_stays_open(t: T):
    t.file("a", b"new")
    t.file("b", b"old")
    yield
    with t.opened("b", os.O_RDONLY) as fd:
        os.rename(t.p("a"), t.p("b"))
        t.eq(os.pread(fd, 100, 0), b"old", "read of the replaced file")


@case("rename")
def eacces_source_dir(t: T):
    t.mkdir("s", 0o755)
    t.file("s/f")
    os.chown(t.p("s", "f"), UID1, GID1)
    os.chmod(t.d, 0o777)
    yield
    t.uexpect(errno.EACCES, os.rename, t.p("s", "f"), t.p("g"))


@case("rename")
def eacces_dest_dir(t: T):
    t.mkdir("d", 0o755)
    t.mkdir("s", 0o777)
    t.file("s/f")
    yield
    t.uexpect(errno.EACCES, os.rename, t.p("s", "f"), t.p("d", "f"))


@case("rename")
def eacces_moving_foreign_dir(t: T):
    # Moving a directory to another parent rewrites its '..': that needs
    # write permission on the directory itself.
    t.mkdir("s", 0o777)
    t.mkdir("d", 0o777)
    t.mkdir("s/sub", 0o755)
    yield
    t.uexpect(errno.EACCES, os.rename, t.p("s", "sub"), t.p("d", "sub"))


@case("rename")
def sticky_foreign_file(t: T):
    t.mkdir("s", 0o1777)
    t.file("s/f", mode=0o666)
    os.chown(t.p("s", "f"), UID2, GID2)
    yield
    t.uexpect(errno.EPERM, os.rename, t.p("s", "f"), t.p("s", "g"))
    t.uok(os.rename, t.p("s", "f"), t.p("s", "g"), uid=UID2, gid=GID2)


@case("rename")
def sticky_foreign_target(t: T):
    t.mkdir("s", 0o1777)
    t.file("s/mine")
    os.chown(t.p("s", "mine"), UID1, GID1)
    t.file("s/theirs")
    os.chown(t.p("s", "theirs"), UID2, GID2)
    yield
    t.uexpect(errno.EPERM, os.rename, t.p("s", "mine"), t.p("s", "theirs"))


# -- rmdir ------------------------------------------------------------------------------


@case("rmdir")
def removes_and_counts(t: T):
    t.mkdir("p")
    t.mkdir("p/d")
    yield
    _parent_times_updated(t, lambda: os.rmdir(t.p("p", "d")), "p")
    t.expect(errno.ENOENT, os.lstat, t.p("p", "d"))
    t.eq(t.lst("p").st_nlink, 2, "parent link count")


@case("rmdir", ("regular", "dir", "symlink", "fifo"))
def enotempty(t: T, kind: str):
    t.mkdir("d")
    t.make(kind, "d/o")
    yield
    t.expect((errno.ENOTEMPTY, errno.EEXIST), os.rmdir, t.p("d"))


@case("rmdir")
def emptied_then_removed(t: T):
    t.mkdir("d")
    t.file("d/a")
    t.mkdir("d/b")
    yield
    os.unlink(t.p("d", "a"))
    os.rmdir(t.p("d", "b"))
    t.ok(os.rmdir, t.p("d"))
    t.eq(os.listdir(t.d), [], "listing after rmdir")


@case("rmdir")
def enotdir(t: T):
    t.file("f")
    os.symlink(".", t.p("l"))
    yield
    t.expect(errno.ENOTDIR, os.rmdir, t.p("f"))
    t.expect(errno.ENOTDIR, os.rmdir, t.p("l"))
    t.expect(errno.ENOTDIR, os.rmdir, t.p("f", "x"))


@case("rmdir")
def enoent_toolong(t: T):
    t.expect(errno.ENOENT, os.rmdir, t.p("missing"))
    t.expect(errno.ENAMETOOLONG, os.rmdir, t.p(LONG))


@case("rmdir")
def einval_dot(t: T):
    t.mkdir("d")
    yield
    t.expect(errno.EINVAL, os.rmdir, t.p("d", "."))
    t.expect((errno.ENOTEMPTY, errno.EEXIST), os.rmdir, t.p("d", ".."))


@case("rmdir")
def eacces_parent(t: T):
    t.mkdir("d")
    yield
    t.uexpect(errno.EACCES, os.rmdir, t.p("d"))


@case("rmdir")
def sticky_foreign_dir(t: T):
    t.mkdir("s", 0o1777)
    t.mkdir("s/d", 0o777)
    os.chown(t.p("s", "d"), UID2, GID2)
    yield
    t.uexpect(errno.EPERM, os.rmdir, t.p("s", "d"))
    t.uok(os.rmdir, t.p("s", "d"), uid=UID2, gid=GID2)


# -- symlink ----------------------------------------------------------------------------


@case("symlink")
def creates_link(t: T):
    os.symlink("some/target", t.p("l"))
    st = t.lst("l")
    t.check(stat.S_ISLNK(st.st_mode), "not a symlink")
    t.eq(st.st_size, len("some/target"), "size")
    t.eq(os.readlink(t.p("l")), "some/target", "target")


@case("symlink")
def followed(t: T):
    t.mkdir("d")
    t.file("d/f", b"through")
    os.symlink("d", t.p("ld"))
    os.symlink("ld/f", t.p("lf"))
    yield
    with open(t.p("lf"), "rb") as f:
        t.eq(f.read(), b"through", "content through two links")
    t.eq(sorted(os.listdir(t.p("ld"))), ["f"], "listing through the link")


@case("symlink")
def owner_is_caller(t: T):
    os.chmod(t.d, 0o777)
    t.uok(os.symlink, "x", t.p("l"))
    t.eq((t.lst("l").st_uid, t.lst("l").st_gid), (UID1, GID1), "owner")


@case("symlink")
def long_target(t: T):
    target = "/".join(["d" * 200] * 20)[:4095]
    os.symlink(target, t.p("l"))
    t.eq(os.readlink(t.p("l")), target, "target of 4095 bytes")


@case("symlink")
def enametoolong(t: T):
    t.expect(errno.ENAMETOOLONG, os.symlink, "x", t.p(LONG))
    t.expect(errno.ENAMETOOLONG, os.symlink, "t" * 4096, t.p("l"))


@case("symlink")
def non_utf8_target(t: T):
    target = b"caf\xe9/\xff\xfe"
    os.symlink(target, os.fsencode(t.p("l")))
    t.eq(os.readlink(os.fsencode(t.p("l"))), target, "target bytes")


@case("symlink", ("regular", "dir", "symlink", "fifo"))
def eexist(t: T, kind: str):
    t.make(kind, "o")
    yield
    t.expect(errno.EEXIST, os.symlink, "x", t.p("o"))


@case("symlink")
def enoent_enotdir(t: T):
    t.file("f")
    t.expect(errno.ENOENT, os.symlink, "x", t.p("missing", "l"))
    t.expect(errno.ENOTDIR, os.symlink, "x", t.p("f", "l"))


@case("symlink")
def eacces_parent(t: T):
    t.uexpect(errno.EACCES, os.symlink, "x", t.p("l"))


@case("symlink")
def parent_times(t: T):
    _parent_times_updated(t, lambda: os.symlink("x", t.p("l")), ".")


@case("symlink")
def eloop(t: T):
    os.symlink("l2", t.p("l1"))
    os.symlink("l1", t.p("l2"))
    yield
    t.expect(errno.ELOOP, os.stat, t.p("l1"))
    t.expect(errno.ELOOP, os.open, t.p("l1", "x"), os.O_RDONLY)


# -- unlink -----------------------------------------------------------------------------


@case("unlink", ("regular", "fifo", "symlink", "chr"))
def removes(t: T, kind: str):
    t.make(kind, "o")
    yield
    _parent_times_updated(t, lambda: os.unlink(t.p("o")), ".")
    t.expect(errno.ENOENT, os.lstat, t.p("o"))


@case("unlink")
def symlink_not_target(t: T):
    t.file("f")
    os.symlink("f", t.p("l"))
    yield
    os.unlink(t.p("l"))
    t.check(os.path.exists(t.p("f")), "target removed")


@case("unlink")
def hardlink_count_and_ctime(t: T):
    t.file("f")
    os.link(t.p("f"), t.p("g"))
    yield
    before = t.ctimes("g")
    t.tick()
    os.unlink(t.p("f"))
    t.eq(t.lst("g").st_nlink, 1, "link count of the other name")
    t.changed(("g",), before, "st_ctime_ns")


@case("unlink")
def open_fd_survives(t: T):
    t.file("f", b"abc")
    yield
    with t.opened("f", os.O_RDWR) as fd:
        os.unlink(t.p("f"))
        os.pwrite(fd, b"defg", 3)
        t.eq(os.pread(fd, 100, 0), b"abcdefg", "read through the descriptor")
        t.eq(os.fstat(fd).st_nlink, 0, "fstat link count")
        t.eq(os.fstat(fd).st_size, 7, "fstat size")
        t.eq(os.listdir(t.d), [], "listing")


@case("unlink")
def recreate_is_new(t: T):
    t.file("f", b"old")
    yield
    with t.opened("f", os.O_RDONLY) as fd:
        os.unlink(t.p("f"))
        with open(t.p("f"), "xb") as f:
            f.write(b"new!")
        t.eq(os.pread(fd, 100, 0), b"old", "old descriptor's content")
    with open(t.p("f"), "rb") as f:
        t.eq(f.read(), b"new!", "new file's content")


@case("unlink")
def eisdir(t: T):
    t.mkdir("d")
    yield
    t.expect((errno.EISDIR, errno.EPERM), os.unlink, t.p("d"))


@case("unlink")
def enoent_enotdir_toolong(t: T):
    t.file("f")
    t.expect(errno.ENOENT, os.unlink, t.p("missing"))
    t.expect(errno.ENOTDIR, os.unlink, t.p("f", "x"))
    t.expect(errno.ENAMETOOLONG, os.unlink, t.p(LONG))


@case("unlink")
def eacces_parent(t: T):
    t.file("f", mode=0o666)
    yield
    t.uexpect(errno.EACCES, os.unlink, t.p("f"))


@case("unlink")
def sticky(t: T):
    t.mkdir("s", 0o1777)
    t.file("s/theirs", mode=0o666)
    os.chown(t.p("s", "theirs"), UID2, GID2)
    t.file("s/mine", mode=0o600)
    os.chown(t.p("s", "mine"), UID1, GID1)
    yield
    t.uexpect(errno.EPERM, os.unlink, t.p("s", "theirs"))
    t.uok(os.unlink, t.p("s", "mine"))


@case("unlink")
def sticky_dir_owner_may(t: T):
    t.mkdir("s", 0o1777)
    os.chown(t.p("s"), UID1, GID1)
    t.file("s/theirs", mode=0o666)
    os.chown(t.p("s", "theirs"), UID2, GID2)
    yield
    t.uok(os.unlink, t.p("s", "theirs"))
