"""Which FLUSH is the writer's close (overlayfs/closers.py), without a
kernel mount: /proc of this very process and of real children stands in for
the mount's callers (a temp directory stands in for the mountpoint)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from stepfs.overlayfs.daemon.closers import Writers, holds, tgid_of


def test_a_threads_process_is_its_thread_group():
    assert tgid_of(os.getpid()) == os.getpid()
    seen = []
    t = threading.Thread(target=lambda: seen.append((threading.get_native_id(), tgid_of(threading.get_native_id()))))
    t.start()
    t.join()
    (tid, tgid), = seen
    assert tid != os.getpid() and tgid == os.getpid()
    assert tgid_of(0) is None and tgid_of(-1) is None


def test_holds_sees_writable_descriptors_of_the_file_only(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    ino = os.stat(f).st_ino
    prefix = str(tmp_path)
    assert holds(os.getpid(), prefix, ino, "/f") is False
    ro = os.open(f, os.O_RDONLY)
    try:
        assert holds(os.getpid(), prefix, ino, "/f") is False  # reading is not writing
        wr = os.open(f, os.O_WRONLY)
        try:
            assert holds(os.getpid(), prefix, ino, "/f") is True
            assert holds(os.getpid(), prefix, ino + 1, "/f") is False  # another file
            assert holds(os.getpid(), prefix, None, "/f") is True  # by name when the inode is unknown
            assert holds(os.getpid(), prefix + "/elsewhere", ino, "/f") is False  # another mount
        finally:
            os.close(wr)
    finally:
        os.close(ro)
    assert holds(os.getpid(), prefix, ino, "/f") is False
    assert holds(2 ** 22 + 12345, prefix, ino, "/f") is None  # no such process: cannot tell


def test_the_rule(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    ino = os.stat(f).st_ino
    w = Writers(str(tmp_path))
    me = threading.get_native_id()
    assert w.is_writers_close(7, me, lambda: ino, "/f") is True  # nothing written: decide (nothing to publish)
    w.wrote(7, me)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert w.is_writers_close(7, child.pid, lambda: ino, "/f") is False  # never wrote through it
    finally:
        child.communicate(b"")
    other = []
    t = threading.Thread(target=lambda: other.append(w.is_writers_close(7, threading.get_native_id(),
                                                                       lambda: ino, "/f")))
    t.start()
    t.join()
    assert other == [True]  # a thread of the writing process
    fd = os.open(f, os.O_WRONLY)
    try:
        assert w.is_writers_close(7, me, lambda: ino, "/f") is False  # the writer still holds a copy
    finally:
        os.close(fd)
    assert w.is_writers_close(7, me, lambda: ino, "/f") is True
    w.wrote(8, 0)  # a write without a pid (mmap writeback): every close decides, as before
    assert w.is_writers_close(8, child.pid, lambda: ino, "/f") is True
    w.forget(7)
    assert w.is_writers_close(7, child.pid, lambda: ino, "/f") is True


def test_the_inode_is_asked_only_for_a_writable_descriptor_in_the_mount(tmp_path):
    # Learning the inode costs the daemon a getattr of the handle: a close
    # that leaves no writable descriptor inside the mount must not ask.
    f = tmp_path / "f"
    f.write_text("x")
    ino = os.stat(f).st_ino
    asked = []

    def ino_of():
        asked.append(1)
        return ino

    assert holds(os.getpid(), str(tmp_path), ino_of, "/f") is False
    assert asked == []
    ro = os.open(f, os.O_RDONLY)
    try:
        assert holds(os.getpid(), str(tmp_path), ino_of, "/f") is False
        assert asked == []  # a read-only descriptor is no writer's
        wr = os.open(f, os.O_WRONLY)
        try:
            assert holds(os.getpid(), str(tmp_path), ino_of, "/f") is True
            assert asked == [1]
        finally:
            os.close(wr)
    finally:
        os.close(ro)


def test_held_descriptor_directories_see_every_change(tmp_path):
    # FdDirs keeps a writer's /proc/<pid>/fd open and reads only the names
    # of its last look while their number matches the directory's size: a
    # descriptor opened since (a dup, here under a number never seen) must
    # still be found, and one closed since must no longer count.
    from stepfs.overlayfs.daemon.closers import FdDirs, links_of

    f = tmp_path / "f"
    f.write_text("x")
    ino = os.stat(f).st_ino
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); sys.stdin.readline()"],
                             stdin=subprocess.PIPE)
    dirs = FdDirs()
    try:
        assert holds(child.pid, str(tmp_path), ino, "/f", dirs) is False
        fd_dir = os.open(f"/proc/{child.pid}/fd", os.O_RDONLY | os.O_DIRECTORY)
        try:
            names = set(os.listdir(fd_dir))
            assert set(links_of(fd_dir, tuple(names), os.fstat(fd_dir).st_size)) == names  # no listing needed
        finally:
            os.close(fd_dir)
        wr = os.open(f, os.O_WRONLY)
        try:
            assert holds(os.getpid(), str(tmp_path), ino, "/f", dirs) is True  # a new process: looked up
            high = os.dup2(wr, 900)  # a number no earlier look saw
            try:
                assert holds(os.getpid(), str(tmp_path), ino, "/f", dirs) is True
                os.close(wr)
                assert holds(os.getpid(), str(tmp_path), ino, "/f", dirs) is True  # the dup alone
            finally:
                os.close(high)
            assert holds(os.getpid(), str(tmp_path), ino, "/f", dirs) is False
        finally:
            try:
                os.close(wr)
            except OSError:
                pass
        child.stdin.write(b"\n\n")
        child.stdin.flush()
        child.wait()
        # Gone: its held directory shows no descriptor, and the pid is looked up again.
        assert holds(child.pid, str(tmp_path), ino, "/f", dirs) is None
    finally:
        child.kill()
        child.wait()
        dirs.close()
