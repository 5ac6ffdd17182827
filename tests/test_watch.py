"""The workspace watcher without a mount: inotify events -> what the kernel
is told to forget (overlayfs/daemon/watch.py).  A fake kernel cache records the
calls; the real-mount behaviour is in test_mount_watch.py."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time

import pytest

from stepfs.overlayfs.daemon import watch
from stepfs.overlayfs.daemon.watch import (
    IN_ATTRIB, IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_IGNORED, IN_ISDIR, IN_MODIFY, IN_MOVE_SELF, IN_MOVED_FROM,
    IN_MOVED_TO, IN_Q_OVERFLOW, Watcher, interpret, parse,
)
from stepfs.store.contained import Root

DIRS = {1: "/", 2: "/src", 3: "/src/pkg"}


def eventually(cond, deadline_s: float = 30.0) -> bool:
    """Poll ``cond`` until true or the deadline (the watcher thread acts
    asynchronously; there is no event to wait on from outside)."""
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def changes(*events):
    return interpret(events, DIRS.get)


def test_parse_reads_packed_events_with_padded_names():
    def event(wd, mask, name):
        padded = name + b"\0" * (16 - len(name) % 16)
        return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

    buf = event(2, IN_MODIFY, b"a.py") + struct.pack("iIII", 3, IN_ATTRIB, 0, 0) + event(1, IN_CREATE, b"\xff")
    assert parse(buf) == [(2, IN_MODIFY, b"a.py"), (3, IN_ATTRIB, b""), (1, IN_CREATE, b"\xff")]


def test_a_content_or_mode_change_forgets_the_name_only():
    ch = changes((2, IN_MODIFY, b"a.py"), (3, IN_ATTRIB, b"b"))
    assert ch.invalidate == {"/src/a.py", "/src/pkg/b"}
    assert not ch.gone and not ch.new_dirs and not ch.lost_dirs


def test_a_new_name_also_forgets_its_directory():
    ch = changes((1, IN_CREATE, b"new"))
    assert ch.invalidate == {"/new", "/"} and not ch.gone


def test_a_removed_name_is_gone():
    ch = changes((2, IN_DELETE, b"old"), (3, IN_MOVED_FROM, b"moved"))
    assert ch.gone == {"/src/old", "/src/pkg/moved"}
    assert ch.invalidate == {"/src/old", "/src", "/src/pkg/moved", "/src/pkg"}


def test_a_name_renamed_over_is_replaced():
    ch = changes((2, IN_MOVED_TO, b"a.py"))
    assert ch.replaced == {"/src/a.py"} and not ch.gone


def test_directories_appearing_and_vanishing():
    ch = changes((1, IN_CREATE | IN_ISDIR, b"lib"), (2, IN_MOVED_TO | IN_ISDIR, b"tmp"),
                 (2, IN_MOVED_FROM | IN_ISDIR, b"pkg"), (1, IN_DELETE | IN_ISDIR, b"build"))
    assert ch.new_dirs == {"/lib", "/src/tmp"}
    assert ch.lost_dirs == {"/src/pkg", "/build"}
    assert {"/src/pkg", "/build"} <= ch.gone


def test_events_of_a_watched_directory_itself():
    ch = changes((3, IN_ATTRIB, b""), (2, IN_MOVE_SELF, b""), (1, IN_DELETE_SELF, b""))
    assert ch.invalidate == {"/src/pkg"}
    assert ch.lost_dirs == {"/src"}  # the workspace root is never dropped


def test_the_store_unknown_watches_overflow_and_ignored():
    ch = changes((1, IN_CREATE, b".stepfs"), (9, IN_MODIFY, b"x"), (2, IN_IGNORED, b""), (-1, IN_Q_OVERFLOW, b""))
    assert not ch.invalidate and ch.dead_wds == {2} and ch.overflow


def test_non_utf8_names_map_like_fuse_paths():
    ch = changes((2, IN_MODIFY, b"caf\xe9"))
    assert ch.invalidate == {os.fsdecode(b"/src/caf\xe9")}


class FakeKernel:
    """Stands in for libfuse.notify.KernelCache: records what it is told to
    forget; ``known`` is what the kernel has cached."""

    def __init__(self, known=()):
        self.known = set(known)
        self.gone: set[str] = set()
        self.forgot: list[str] = []
        self.renewed = 0  # new_epoch calls: every name looked up again
        self.changed = threading.Condition()

    def new_epoch(self) -> bool:
        self.renewed += 1
        return True

    def forget(self, path: str) -> bool:
        with self.changed:
            self.forgot.append(path)
            self.changed.notify_all()
        return path in self.known

    def wait_for(self, path: str, deadline_s: float = 30.0) -> bool:
        end = time.monotonic() + deadline_s
        with self.changed:
            while path not in self.forgot:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True


@pytest.fixture
def tree(tmp_path):
    ws = tmp_path / "ws"
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "a.py").write_text("a\n")
    (ws / ".stepfs").mkdir()
    root = Root(str(ws), hide=".stepfs")
    yield ws, root
    root.close()


@pytest.fixture
def running(tree):
    ws, root = tree
    kernel = FakeKernel(known={"/", "/src", "/src/a.py"})
    fallbacks = []
    w = Watcher(root, kernel, lambda: fallbacks.append(1))
    w.start()
    yield ws, w, kernel, fallbacks
    w.stop()


def test_real_events_reach_the_kernel_cache(running):
    ws, w, kernel, _ = running
    w.watch("/src")
    assert w.watching("/") and w.watching("/src")
    (ws / "src" / "a.py").write_text("changed\n")
    assert kernel.wait_for("/src/a.py")
    os.unlink(ws / "src" / "a.py")
    assert kernel.wait_for("/src")
    assert "/src/a.py" in kernel.gone


def test_a_moved_directory_is_unwatched_and_its_new_name_adopted(running):
    ws, w, kernel, _ = running
    w.watch("/src")
    w.watch("/src/pkg")
    kernel.known |= {"/lib", "/lib/pkg"}
    os.rename(ws / "src", ws / "lib")
    # Adopted: known to the kernel, so watched with its subdirectories.
    assert eventually(lambda: w.watching("/lib") and w.watching("/lib/pkg"))
    assert not w.watching("/src") and not w.watching("/src/pkg")
    assert "/src" in kernel.gone
    (ws / "lib" / "pkg" / "m.py").write_text("m\n")
    assert kernel.wait_for("/lib/pkg/m.py")


def test_a_directory_removed_or_moved_away_renews_every_name(tree):
    ws, root = tree
    kernel, own = FakeKernel(known={"/", "/src", "/src/pkg"}), set()
    w = Watcher(root, kernel, lambda: None, own=own)
    w.start()
    try:
        w.watch("/src")
        w.watch("/src/pkg")
        # Files come and go: the names the kernel holds stay as they are.
        (ws / "src" / "b.py").write_text("b\n")
        os.unlink(ws / "src" / "a.py")
        assert kernel.wait_for("/src/a.py")
        assert kernel.renewed == 0
        # A directory renamed away from outside: held names below it are stale.
        os.rename(ws / "src" / "pkg", ws / "pkg-aside")
        assert eventually(lambda: kernel.renewed == 1)
        # The mount's own commit removing a directory renews nothing.
        own.add("/src/mine")
        w.apply(interpret([(w._wd_of["/src"], IN_DELETE | IN_ISDIR, b"mine")], w._dir_of.get))
        assert kernel.renewed == 1
        w.apply(interpret([(w._wd_of["/src"], IN_DELETE | IN_ISDIR, b"theirs")], w._dir_of.get))
        assert kernel.renewed == 2
    finally:
        w.stop()


def test_the_store_and_absent_directories_are_never_watched(running):
    _ws, w, _kernel, fallbacks = running
    w.watch("/.stepfs")
    w.watch("/nope")
    w.watch("/src/a.py")
    assert not w.watching("/.stepfs") and not w.watching("/nope") and not w.watching("/src/a.py")
    assert not fallbacks


def test_out_of_watches_falls_back_once_and_stops_adding(running, monkeypatch, caplog):
    _ws, w, _kernel, fallbacks = running
    monkeypatch.setattr(w, "_add_watch", lambda path: (-1, errno.ENOSPC))
    w.watch("/src")
    w.watch("/src/pkg")
    assert fallbacks == [1] and w.degraded and not w.active
    assert not w.watching("/src")
    assert w.watching("/")  # existing watches keep working
    assert sum("watch limit" in r.getMessage() for r in caplog.records) == 1


def test_overflow_forgets_every_watched_directory_and_falls_back(tree):
    ws, root = tree
    kernel = FakeKernel()
    fallbacks = []
    w = Watcher(root, kernel, lambda: fallbacks.append(1))
    w.start()
    try:
        w.watch("/src")
        w.apply(interpret([(-1, IN_Q_OVERFLOW, b"")], w._dir_of.get))
        assert {"/", "/src", "/src/a.py", "/src/pkg"} <= set(kernel.forgot)
        assert fallbacks == [1] and w.degraded
    finally:
        w.stop()


def test_a_replaced_name_unknown_to_the_kernel_is_not_gone(tree):
    _ws, root = tree
    kernel = FakeKernel(known={"/src/a.py"})
    w = Watcher(root, kernel, lambda: None)
    w.apply(interpret([(2, IN_MOVED_TO, b"a.py"), (2, IN_MOVED_TO, b"b.py")], DIRS.get))
    assert kernel.gone == {"/src/a.py"}


def test_stop_joins_the_thread_and_closes_its_descriptors(tree):
    _ws, root = tree
    before = set(os.listdir("/proc/self/fd"))
    # The watcher's own thread, not a count of all threads: a thread an
    # earlier test stopped (a view's row timer, a cancelled watchdog) may
    # end in between on a loaded machine.
    threads = set(threading.enumerate())
    w = Watcher(root, FakeKernel(), lambda: None)
    w.start()
    assert [t.name for t in threading.enumerate() if t not in threads] == ["stepfs-watch"]
    w.stop()
    w.stop()  # idempotent
    assert [t for t in threading.enumerate() if t not in threads] == []
    assert set(os.listdir("/proc/self/fd")) == before
