"""POSIX visibility between the handles of one view (no kernel): handles
of one path share one staged copy; an unlinked or replaced file stays what
the handle opened."""

from __future__ import annotations

import os

import pytest

from conftest import manifest
from stepfs.store import staging
from viewkit import open_view, read_all, read_fh, write_file


@pytest.fixture
def ws_view(tmp_path):
    ws_dir = tmp_path / "ws"
    (ws_dir / "d").mkdir(parents=True)
    (ws_dir / "f").write_bytes(b"old content")
    (ws_dir / "g").write_bytes(b"gee")
    return open_view(tmp_path)


def rows(ws, view):
    with ws.db.read() as conn:
        return {r.path: r for r in staging.load(conn, view.step)}


def test_reader_opened_before_copy_up_sees_new_bytes(ws_view):
    _ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    assert view.read(r, 3, 0) == b"old"
    w = view.open("/f", os.O_WRONLY)
    view.write(w, b"NEW", 0)
    assert view.read(r, 11, 0) == b"NEW content"  # before the writer closes
    view.truncate("/f", 3, w)
    assert read_fh(view, r) == b"NEW"
    view.flush(w)
    view.release(w)
    assert read_fh(view, r) == b"NEW"
    view.release(r)
    assert read_all(view, "/f") == b"NEW"


def test_reader_follows_a_rename_of_its_file(ws_view):
    _ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    view.rename("/f", "/d/moved")
    w = view.open("/d/moved", os.O_RDWR)
    view.write(w, b"X", 0)
    view.flush(w)
    view.release(w)
    assert view.read(r, 3, 0) == b"Xld"
    view.release(r)


def test_reader_of_a_replaced_file_keeps_the_old_file(ws_view):
    """rename(g, f) while f is open: the handle still reads the old f."""
    _ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    view.rename("/g", "/f")
    assert read_all(view, "/f") == b"gee"
    assert read_fh(view, r) == b"old content"
    view.release(r)


def test_reader_of_an_unlinked_and_recreated_file_keeps_the_old_file(ws_view):
    _ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    view.unlink("/f")
    assert read_fh(view, r) == b"old content"
    write_file(view, "/f", b"a new file")
    assert read_fh(view, r) == b"old content"
    view.release(r)
    assert read_all(view, "/f") == b"a new file"


def test_unlinked_open_workspace_file_stays_usable_and_unstaged(ws_view):
    ws, view = ws_view
    w = view.open("/f", os.O_RDWR)
    view.write(w, b"staged?", 0)
    view.unlink("/f")
    view.write(w, b"!", 11)
    assert read_fh(view, w) == b"staged?tent!"
    assert view.getattr("/f", w)["st_size"] == 12
    view.flush(w)
    assert {p: r.kind for p, r in rows(ws, view).items()} == {b"f": "whiteout"}
    view.release(w)
    assert {p: r.kind for p, r in rows(ws, view).items()} == {b"f": "whiteout"}
    assert not os.listdir(view.scratch_dir)  # the scratch copy went with the last handle
    view.commit(message="rm f")
    assert b"f" not in manifest(ws.path)


def test_unlinked_open_new_file_leaves_nothing_staged(ws_view):
    ws, view = ws_view
    w = view.create("/tmpfile", 0o600, os.O_RDWR | os.O_CREAT)
    view.write(w, b"temp", 0)
    view.flush(w)
    assert b"tmpfile" in rows(ws, view)
    view.unlink("/tmpfile")
    view.write(w, b"more", 4)
    view.flush(w)
    assert read_fh(view, w) == b"tempmore"
    view.release(w)
    assert rows(ws, view) == {}
    assert not os.listdir(view.scratch_dir)


def test_two_writers_share_one_copy(ws_view):
    _ws, view = ws_view
    a = view.open("/f", os.O_WRONLY)
    b = view.open("/f", os.O_RDWR)
    view.write(a, b"A", 0)
    view.write(b, b"B", 1)
    assert read_fh(view, b) == b"ABd content"
    view.flush(a)
    view.release(a)
    view.write(b, b"C", 2)
    view.flush(b)
    view.release(b)
    assert read_all(view, "/f") == b"ABC content"


def test_reader_opened_before_a_commit_sees_the_committed_bytes(ws_view):
    ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    write_file(view, "/f", b"committed")
    view.commit(message="f")
    assert read_fh(view, r) == b"committed"
    view.release(r)
    assert read_all(view, "/f") == b"committed"
    assert manifest(ws.path)[b"f"][2] == b"committed"


def test_reader_sees_writes_to_its_file_after_the_file_is_replaced(ws_view):
    """The reader never read between the write and the rename over its
    file: it still holds the written file, not the workspace original."""
    _ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    view.truncate("/f", 3)
    view.rename("/g", "/f")
    assert read_fh(view, r) == b"old"
    assert read_all(view, "/f") == b"gee"
    view.release(r)


def test_fstat_of_an_unlinked_workspace_file(ws_view):
    _ws, view = ws_view
    r = view.open("/f", os.O_RDONLY)
    view.unlink("/f")
    assert view.getattr("/f", r)["st_size"] == 11
    view.rename("/g", "/f")
    assert view.getattr("/f", r)["st_size"] == 11
    assert view.getattr("/f")["st_size"] == 3
    view.release(r)


def _linked_workspace(tmp_path, *names: str):
    """A workspace whose file ``names[0]`` also has the other ``names``."""
    ws_dir = tmp_path / "ws"
    (ws_dir / "sub").mkdir(parents=True, exist_ok=True)
    (ws_dir / names[0]).write_bytes(b"linked")
    for name in names[1:]:
        os.link(ws_dir / names[0], ws_dir / name)
    return ws_dir


def test_removing_a_workspace_link_renews_the_names_the_kernel_may_hold(tmp_path):
    """The kernel can hold attributes only of names the view answered:
    removing one name of a multi-link workspace file renews the kernel's
    names (a new FUSE epoch) exactly when another name was answered, and
    the bookkeeping starts afresh after each renewal."""
    _linked_workspace(tmp_path, "a", "b", "sub/c", "d")
    _ws, view = open_view(tmp_path)
    renewals = []
    view.renew_names = lambda: renewals.append(len(view.lower_shown))
    assert view.getattr("/a")["st_nlink"] == 4
    view.unlink("/a")  # no other name was answered: nothing the kernel holds changed
    assert renewals == [] and view.lower_shown == {}
    assert [view.getattr(p)["st_nlink"] for p in ("/b", "/sub/c")] == [3, 3]
    view.rename("/b", "/e")  # copied up: a file of its own; sub/c was answered
    assert renewals == [0] and view.lower_shown == {}  # cleared before the kernel asks again
    assert view.getattr("/e")["st_nlink"] == 1
    assert view.getattr("/sub/c")["st_nlink"] == 2
    view.chmod("/d", 0o600)  # never answered, but sub/c was (again)
    assert len(renewals) == 2
    assert view.getattr("/sub/c")["st_nlink"] == 1
    assert view.getattr("/d")["st_nlink"] == 1


def test_link_bookkeeping_skips_single_names_and_outside_links(tmp_path):
    """Files with one name are never recorded; a workspace file whose other
    name lies outside the workspace (a package store's hard links) is
    recorded under its one visible name and renews nothing when removed."""
    _linked_workspace(tmp_path, "a")
    os.link(tmp_path / "ws" / "a", tmp_path / "outside")
    (tmp_path / "ws" / "single").write_bytes(b"1")
    _ws, view = open_view(tmp_path)
    renewals = []
    view.renew_names = lambda: renewals.append(1)
    view.getattr("/single")
    view.getattr("/sub")
    assert view.lower_shown == {}
    assert view.getattr("/a")["st_nlink"] == 2
    assert list(view.lower_shown.values()) == [{"/a"}]
    write_file(view, "/a", b"rewritten")  # copied up: the outside name is not the kernel's
    assert renewals == [] and view.lower_shown == {}


def test_names_removed_in_the_view_stay_counted_after_a_discard_or_rollback_elsewhere(tmp_path):
    """``forget`` (a discard, a rollback's invalidation) of other paths
    leaves the link counts of names the step still removes; the names it
    gives back to the workspace count again."""
    ws_dir = _linked_workspace(tmp_path, "a", "b", "sub/c")
    (ws_dir / "other.txt").write_bytes(b"other")
    _ws, view = open_view(tmp_path)
    view.unlink("/b")
    view.rename("/sub/c", "/sub/own")  # copied up: a file of its own
    write_file(view, "/other.txt", b"staged")
    assert view.getattr("/a")["st_nlink"] == 1
    assert view.discard(["/other.txt"]) == ["/other.txt"]
    assert view.getattr("/a")["st_nlink"] == 1  # b and sub/c are still not names of it here
    view.forget(["/other.txt"])  # a rollback of another path
    assert view.getattr("/a")["st_nlink"] == 1
    assert not view.ns.exists("/b") and view.getattr("/sub/own")["st_nlink"] == 1
    assert view.discard(["/b"]) == ["/b"]  # b is the workspace's name again
    assert view.getattr("/a")["st_nlink"] == view.getattr("/b")["st_nlink"] == 2
    view.discard(["/sub"])
    assert [view.getattr(p)["st_nlink"] for p in ("/a", "/b", "/sub/c")] == [3, 3, 3]


def test_link_bookkeeping_is_bounded(tmp_path, monkeypatch):
    """Past the bound nothing more is recorded and the next removal of a
    name of any multi-link file renews (the kernel may hold any name)."""
    from stepfs.overlayfs.core import links

    monkeypatch.setattr(links, "LOWER_SHOWN_LIMIT", 2)
    _linked_workspace(tmp_path, "a", "b", "c")
    _linked_workspace(tmp_path, "x", "y")
    _ws, view = open_view(tmp_path)
    renewals = []
    view.renew_names = lambda: renewals.append(1)
    for path in ("/a", "/b", "/c", "/x"):
        view.getattr(path)
    assert sum(map(len, view.lower_shown.values())) == 2
    view.unlink("/y")  # never answered itself, nor recorded: the bound was hit
    assert renewals == [1] and view.lower_shown == {}
    view.getattr("/x")
    view.unlink("/x")
    assert renewals == [1]  # the bookkeeping started afresh


def test_committed_links_are_recorded_and_a_discard_renews(tmp_path):
    """Names linked in the mount become workspace names at the commit with
    the attributes the kernel got from the staged node: they are recorded
    then.  A discard shows covered names again (link counts change back)."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_bytes(b"f")
    _ws, view = open_view(tmp_path)
    renewals = []
    view.renew_names = lambda: renewals.append(1)
    view.link("/g", "/f")
    assert view.getattr("/g")["st_nlink"] == 2 and view.lower_shown == {}  # staged: not workspace names
    view.commit(message="link")
    assert sorted(n for names in view.lower_shown.values() for n in names) == ["/f", "/g"]
    view.unlink("/f")
    assert renewals == [1] and view.getattr("/g")["st_nlink"] == 1
    view.discard(["/f"])
    assert renewals == [1, 1]
    assert view.getattr("/g")["st_nlink"] == 2


def test_a_kernel_without_fuse_epochs_is_told_once(caplog):
    """The adapter's half: a kernel that refuses FUSE_NOTIFY_INC_EPOCH
    (older than 6.16) is logged once and not asked again."""
    from stepfs.overlayfs.daemon.libfuse.notify import KernelCache

    kc = KernelCache()
    assert kc.new_epoch() is False  # not attached: nothing to tell
    r, w = os.pipe()
    try:
        kc._dev_fd = r  # a write fails as the kernel's refusal would
        assert kc.new_epoch() is False and kc.new_epoch() is False
        assert sum("FUSE_NOTIFY_INC_EPOCH" in rec.getMessage() for rec in caplog.records) == 1
        kc._dev_fd = w
        assert kc.new_epoch() is True and os.read(r, 64) == bytes.fromhex("1000000008000000") + bytes(8)
    finally:
        os.close(r)
        os.close(w)
