"""Real-mount tier: POSIX details that tools rely on."""

from __future__ import annotations

import ctypes
import errno
import os
import stat

import pytest

from conftest import manifest, sh, stepfs

pytestmark = pytest.mark.mount

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def renameat2(a, b, flags) -> int:
    if _libc.renameat2(AT_FDCWD, os.fsencode(str(a)), AT_FDCWD, os.fsencode(str(b)), flags) == 0:
        return 0
    return ctypes.get_errno()


def test_xattrs_fifos_owner_survive_commit(workspace, mount):
    (workspace / "f").write_text("x")
    os.setxattr(workspace / "f", "user.lower", b"L")
    m = mount(workspace)
    assert os.getxattr(m.path("f"), "user.lower") == b"L"
    os.setxattr(m.path("f"), "user.new", b"N")
    os.removexattr(m.path("f"), "user.lower")
    with pytest.raises(OSError) as exc:
        os.getxattr(m.path("f"), "user.lower")
    assert exc.value.errno == errno.ENODATA
    with pytest.raises(OSError) as exc:
        os.setxattr(m.path("f"), "trusted.x", b"1")
    assert exc.value.errno == errno.EOPNOTSUPP
    with pytest.raises(OSError) as exc:
        os.setxattr(m.path("f"), "user.new", b"again", os.XATTR_CREATE)
    assert exc.value.errno == errno.EEXIST
    os.mkfifo(m.path("fifo"), 0o640)
    m.path("d").mkdir()
    os.setxattr(m.path("d"), "user.dir", b"D")
    os.chown(m.path("f"), 1234, 4321)
    assert os.listxattr(workspace / "f") == ["user.lower"], "workspace touched before the step"
    assert stepfs("step", m.mountpoint).returncode == 0
    assert os.listxattr(workspace / "f") == ["user.new"]
    assert os.getxattr(workspace / "d", "user.dir") == b"D"
    st = os.stat(workspace / "f")
    assert (st.st_uid, st.st_gid) == (1234, 4321)
    fst = os.stat(workspace / "fifo")
    assert stat.S_ISFIFO(fst.st_mode) and stat.S_IMODE(fst.st_mode) == 0o640


def test_fifo_works_across_processes(mnt):
    os.mkfifo(mnt.path("pipe"))
    result = sh("(echo through-the-fifo > pipe &) ; cat pipe", mnt.mountpoint, timeout=20)
    assert result.stdout.strip() == b"through-the-fifo"


def test_unlinked_open_file_keeps_working(workspace, mount):
    (workspace / "old").write_text("lower bytes")
    m = mount(workspace)
    fd = os.open(m.path("new"), os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, b"data")
    os.unlink(m.path("new"))
    assert os.fstat(fd).st_nlink == 0
    os.write(fd, b"more")
    assert os.pread(fd, 8, 0) == b"datamore"
    os.close(fd)
    fd = os.open(m.path("old"), os.O_RDONLY)
    os.unlink(m.path("old"))
    assert os.fstat(fd).st_nlink == 0
    assert os.read(fd, 100) == b"lower bytes"
    os.close(fd)
    assert os.listdir(m.mountpoint) == []
    assert stepfs("step", m.mountpoint).returncode == 0
    assert os.listdir(workspace) == [".stepfs"], "a .fuse_hidden file leaked into the workspace"


def test_rename_flags(workspace, mount):
    (workspace / "a").write_text("A")
    (workspace / "d").mkdir()
    (workspace / "d" / "x").write_text("in d")
    m = mount(workspace)
    assert renameat2(m.path("a"), m.path("d"), RENAME_EXCHANGE) == 0
    assert m.path("d").read_text() == "A"
    assert (m.path("a") / "x").read_text() == "in d"
    m.path("b").write_text("B")
    assert renameat2(m.path("a"), m.path("b"), RENAME_NOREPLACE) == errno.EEXIST
    assert m.path("b").read_text() == "B"
    assert renameat2(m.path("a"), m.path("c"), RENAME_NOREPLACE) == 0
    assert renameat2(m.path("c"), m.path("c/x/deeper"), 0) in (errno.EINVAL, errno.ENOTDIR, errno.ENOENT)
    view = manifest(m.mountpoint)
    assert stepfs("step", m.mountpoint).returncode == 0
    assert manifest(workspace) == view


def test_rename_errors(mnt):
    mnt.path("dir").mkdir()
    (mnt.path("dir") / "child").write_text("x")
    mnt.path("empty").mkdir()
    mnt.path("file").write_text("f")
    with pytest.raises(OSError) as exc:
        os.rename(mnt.path("empty"), mnt.path("dir"))
    assert exc.value.errno == errno.ENOTEMPTY
    with pytest.raises(OSError) as exc:
        os.rename(mnt.path("dir"), mnt.path("dir") / "sub")
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(OSError) as exc:
        os.rename(mnt.path("file"), mnt.path("empty"))
    assert exc.value.errno == errno.EISDIR
    os.rename(mnt.path("dir"), mnt.path("empty"))  # over an empty directory
    assert (mnt.path("empty") / "child").read_text() == "x"


def test_inode_numbers_stable_across_copy_up_and_commit(workspace, mount):
    (workspace / "f").write_text("one")
    m = mount(workspace)
    ino = os.stat(m.path("f")).st_ino
    m.path("f").write_text("two")
    assert os.stat(m.path("f")).st_ino == ino
    assert stepfs("step", m.mountpoint).returncode == 0
    assert os.stat(m.path("f")).st_ino == ino
    assert {e.name: e.inode() for e in os.scandir(m.mountpoint)}["f"] == ino


def test_long_names_and_non_utf8(workspace, mount):
    m = mount(workspace)
    name = "n" * 255
    m.path(name).write_text("max")
    with pytest.raises(OSError) as exc:
        open(m.path("n" * 256), "w")
    assert exc.value.errno == errno.ENAMETOOLONG
    raw = b"caf\xe9-\xff.txt"
    with open(os.path.join(os.fsencode(str(m.mountpoint)), raw), "wb") as f:
        f.write(b"latin-1 name")
    assert raw in os.listdir(os.fsencode(str(m.mountpoint)))
    assert stepfs("step", m.mountpoint).returncode == 0
    with open(os.path.join(os.fsencode(str(workspace)), raw), "rb") as f:
        assert f.read() == b"latin-1 name"
    assert (workspace / name).read_text() == "max"


def test_mmap_shared_write_and_locks(mnt):
    import fcntl
    import mmap

    path = mnt.path("mapped")
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 8192)
        mm[0:5] = b"hello"
        mm.flush()
        mm.close()
    assert path.read_bytes()[:5] == b"hello"
    with open(path, "r+b") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        other = sh(f"{os.sys.executable} -c \"import fcntl; f=open('mapped','r+b'); "
                   f"fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\"", mnt.mountpoint, check=False)
        assert other.returncode != 0
        assert b"BlockingIOError" in other.stderr or b"Resource temporarily unavailable" in other.stderr
        fcntl.lockf(f, fcntl.LOCK_UN)


def test_hard_links_share_content_and_commit_as_links(workspace, mount):
    (workspace / "a").write_text("hello\n")
    m = mount(workspace)
    os.link(m.path("a"), m.path("b"))
    with open(m.path("b"), "a") as f:
        f.write("more\n")
    assert m.path("a").read_text() == "hello\nmore\n"  # edits are seen through every name
    os.link(m.path("b"), m.path("c"))
    # every name at once, though the kernel caches each name separately
    assert [os.stat(m.path(n)).st_nlink for n in ("a", "b", "c")] == [3, 3, 3]
    assert os.stat(m.path("c")).st_ino == os.stat(m.path("b")).st_ino
    m.path("sub").mkdir()
    os.link(m.path("c"), m.path("sub", "d"))
    os.unlink(m.path("a"))
    assert [os.stat(m.path(n)).st_nlink for n in ("b", "c")] == [3, 3]
    os.rename(m.path("sub"), m.path("moved"))
    assert os.stat(m.path("moved", "d")).st_nlink == 3
    assert stepfs("step", m.mountpoint).returncode == 0
    st = [os.stat(workspace / p) for p in ("b", "c", "moved/d")]
    assert {s.st_ino for s in st} == {st[0].st_ino} and st[0].st_nlink == 3
    assert not (workspace / "a").exists()
    assert (workspace / "moved" / "d").read_text() == "hello\nmore\n"


def test_hard_links_survive_a_daemon_restart(workspace, mount):
    from stepfs.overlayfs.client import manage

    (workspace / "a").write_text("x")
    m = mount(workspace)
    os.link(m.path("a"), m.path("b"))
    manage.unmount(str(m.mountpoint))
    m2 = mount(workspace, m.mountpoint)
    assert os.stat(m2.path("b")).st_nlink == 2
    with open(m2.path("a"), "a") as f:
        f.write("y")
    assert m2.path("b").read_text() == "xy"
    assert stepfs("step", m2.mountpoint).returncode == 0
    assert os.stat(workspace / "a").st_ino == os.stat(workspace / "b").st_ino


def test_other_names_of_a_workspace_hard_link_update_at_once(workspace, mount):
    """A workspace file with four names: removing, renaming or chmod-ing one
    through the mount changes the link count and ctime the other names show
    at once, though the kernel holds their attributes for the 60 s attribute
    timeout (the view renews the kernel's names: a new FUSE epoch).  Pages
    the kernel holds stay right and an open reader keeps reading."""
    from stepfs.overlayfs.daemon import timeouts

    assert timeouts.ATTR_TIMEOUT >= 60  # the cache this test is about is in force
    (workspace / "sub").mkdir()
    (workspace / "a").write_bytes(b"shared bytes")
    for name in ("b", "sub/c", "d"):
        os.link(workspace / "a", workspace / name)
    m = mount(workspace)
    assert [os.lstat(m.path(n)).st_nlink for n in ("a", "b", "sub/c")] == [4, 4, 4]  # d is never asked
    before = os.lstat(m.path("b")).st_ctime_ns
    with open(m.path("sub", "c"), "rb") as reader:
        assert reader.read(6) == b"shared"
        os.unlink(m.path("a"))
        assert [os.lstat(m.path(n)).st_nlink for n in ("b", "sub/c", "d")] == [3, 3, 3]
        assert os.lstat(m.path("b")).st_ctime_ns > before
        assert reader.read() == b" bytes"
    os.rename(m.path("b"), m.path("e"))  # a file of its own from now on
    assert [os.lstat(m.path(n)).st_nlink for n in ("e", "sub/c", "d")] == [1, 2, 2]
    os.chmod(m.path("d"), 0o600)
    assert [os.lstat(m.path(n)).st_nlink for n in ("sub/c", "d")] == [1, 1]
    assert m.path("sub", "c").read_bytes() == b"shared bytes"
    assert stepfs("step", m.mountpoint).returncode == 0
    assert os.lstat(workspace / "sub" / "c").st_nlink == os.lstat(m.path("sub", "c")).st_nlink == 1


def test_renewing_names_while_another_name_is_read(workspace, mount):
    """Removing names of a workspace file while a reader streams it through
    another name (pages locked by reads queued for the FUSE loop): the
    renewal must not wait for those pages, or the loop would hang."""
    import threading

    data = os.urandom(1 << 22)
    (workspace / "big").write_bytes(data)
    names = [f"n{i}" for i in range(16)]
    for name in names:
        os.link(workspace / "big", workspace / name)
    m = mount(workspace)
    stop, bad = threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            if m.path("big").read_bytes() != data:
                bad.append("a read through another name returned other bytes")
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i, name in enumerate(names):
            assert os.lstat(m.path(name)).st_nlink == len(names) + 1 - i
            os.unlink(m.path(name))
            assert os.lstat(m.path("big")).st_nlink == len(names) - i
    finally:
        stop.set()
        t.join()
    assert bad == []


def test_fallocate_and_punch_hole(workspace, mount):
    (workspace / "f").write_bytes(b"x" * 100_000)
    m = mount(workspace)
    fd = os.open(m.path("f"), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        assert os.fstat(fd).st_size == 1 << 20
        FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, 4096, 8192) == 0
        assert os.pread(fd, 4, 4096) == b"\0\0\0\0" and os.pread(fd, 1, 0) == b"x"
    finally:
        os.close(fd)
    assert stepfs("step", m.mountpoint).returncode == 0
    data = (workspace / "f").read_bytes()
    assert len(data) == 1 << 20 and data[4096:12288] == b"\0" * 8192 and data[12288:12290] == b"xx"


def test_directory_link_counts(workspace, mount):
    (workspace / "top" / "s1").mkdir(parents=True)
    (workspace / "top" / "s2").mkdir()
    m = mount(workspace)
    assert os.stat(m.path("top")).st_nlink == 4  # the workspace's own count
    m.path("top", "s3").mkdir()
    assert os.stat(m.path("top")).st_nlink == 5
    os.rmdir(m.path("top", "s1"))
    m.path("top", "file").write_text("not a directory")
    assert os.stat(m.path("top")).st_nlink == 4
    m.path("new").mkdir()
    m.path("new", "a").mkdir()
    assert os.stat(m.path("new")).st_nlink == 3 and os.stat(m.path("new", "a")).st_nlink == 2
    os.rename(m.path("new", "a"), m.path("top", "a"))
    assert (os.stat(m.path("new")).st_nlink, os.stat(m.path("top")).st_nlink) == (2, 5)
