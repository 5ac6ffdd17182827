"""Namespace and metadata operations of the overlay view (no kernel):
create, mkdir, rmdir, unlink, symlink, chmod, utimens, rename."""

from __future__ import annotations

import os
import stat as stat_mod

import pytest

from conftest import manifest
from stepfs.overlayfs.core.errors import Exists, Invalid, IsADirectory, NotADirectory, NotEmpty, NotFound
from stepfs.overlayfs.core.view import RENAME_NOREPLACE, Overlay
from stepfs.store import staging
from viewkit import open_view, read_all, reopen, view_manifest, write_file

UTIME_NOW = Overlay.UTIME_NOW
UTIME_OMIT = Overlay.UTIME_OMIT


@pytest.fixture
def ws_view(tmp_path):
    ws_dir = tmp_path / "ws"
    (ws_dir / "d" / "sub").mkdir(parents=True)
    (ws_dir / "d" / "one").write_bytes(b"one")
    (ws_dir / "d" / "sub" / "two").write_bytes(b"two")
    (ws_dir / "top").write_bytes(b"top")
    (ws_dir / "empty").mkdir()
    return open_view(tmp_path)


def names(view, path):
    return [n for n, _k, _i in view.readdir(path)[2:]]


def rows(ws, view):
    with ws.db.read() as conn:
        return {r.path: r for r in staging.load(conn, view.step)}


def test_create_mkdir_symlink(ws_view):
    ws, view = ws_view
    view.mkdir("/new", 0o750)
    assert stat_mod.S_IMODE(view.getattr("/new")["st_mode"]) == 0o750
    write_file(view, "/new/f", b"data", mode=0o600)
    view.symlink("/new/l", "f")
    assert names(view, "/new") == ["f", "l"]
    assert view.readlink("/new/l") == "f"
    st = view.getattr("/new/l")
    assert stat_mod.S_ISLNK(st["st_mode"]) and st["st_size"] == 1
    assert stat_mod.S_IMODE(view.getattr("/new/f")["st_mode"]) == 0o600
    with pytest.raises(Invalid):
        view.readlink("/new/f")
    with pytest.raises(NotADirectory):
        view.mkdir("/top/x", 0o755)
    with pytest.raises(NotFound):
        view.create("/nope/x", 0o644)
    assert {p: r.kind for p, r in rows(ws, view).items()} == {b"new": "dir", b"new/f": "file", b"new/l": "symlink"}


def test_create_without_write_is_still_a_new_empty_file(ws_view):
    ws, view = ws_view
    fh = view.create("/empty-file", 0o644, os.O_WRONLY | os.O_CREAT)
    view.flush(fh)
    view.release(fh)
    assert read_all(view, "/empty-file") == b""
    assert rows(ws, view)[b"empty-file"].kind == "file"


def test_rmdir(ws_view):
    ws, view = ws_view
    with pytest.raises(NotEmpty):
        view.rmdir("/d")
    with pytest.raises(NotADirectory):
        view.rmdir("/top")
    view.rmdir("/empty")
    with pytest.raises(NotFound):
        view.getattr("/empty")
    view.unlink("/d/sub/two")
    view.rmdir("/d/sub")
    assert names(view, "/d") == ["one"]
    assert rows(ws, view)[b"d/sub"].kind == "whiteout"
    assert b"d/sub/two" not in rows(ws, view)  # folded into the directory's whiteout


def test_unlink(ws_view):
    _ws, view = ws_view
    with pytest.raises(IsADirectory):
        view.unlink("/d")
    with pytest.raises(NotFound):
        view.unlink("/missing")
    view.unlink("/top")
    assert "top" not in names(view, "/")
    write_file(view, "/top", b"again")
    assert read_all(view, "/top") == b"again"


def test_chmod_workspace_file_dir_and_staged_file(ws_view):
    ws, view = ws_view
    view.chmod("/top", 0o600)
    view.chmod("/d", 0o700)
    write_file(view, "/n", b"n")
    view.chmod("/n", 0o640)
    assert stat_mod.S_IMODE(view.getattr("/top")["st_mode"]) == 0o600
    assert stat_mod.S_IMODE(view.getattr("/d")["st_mode"]) == 0o700
    assert stat_mod.S_IMODE(view.getattr("/n")["st_mode"]) == 0o640
    assert read_all(view, "/top") == b"top"
    assert names(view, "/d") == ["one", "sub"]  # a chmod'ed directory still merges
    r = rows(ws, view)
    assert stat_mod.S_IMODE(r[b"top"].mode) == 0o600 and r[b"top"].oid is not None
    assert r[b"d"].kind == "dir" and not r[b"d"].opaque


def test_chmod_of_a_file_open_for_writing_keeps_its_content(ws_view):
    """A copy-up that has not written yet has no object: a metadata change
    must not stage an empty file."""
    ws, view = ws_view
    fh = view.open("/top", os.O_RDWR)
    view.chmod("/top", 0o600)
    view.flush(fh)
    view.release(fh)
    view2 = reopen(view)
    assert read_all(view2, "/top") == b"top"
    view2.commit(message="chmod")
    assert manifest(ws.path)[b"top"] == ("file", 0o600, b"top")


def test_utimens(ws_view):
    ws, view = ws_view
    a, m = 1_000_000_123, 2_000_000_456
    view.utimens("/top", (a, m))
    st = view.getattr("/top")
    assert (st["st_atime"], st["st_mtime"]) == (a, m)
    view.utimens("/top", (UTIME_OMIT, 3_000_000_789))
    st = view.getattr("/top")
    assert (st["st_atime"], st["st_mtime"]) == (a, 3_000_000_789)
    view.utimens("/top", (5_000_000_001, UTIME_OMIT))
    st = view.getattr("/top")
    assert (st["st_atime"], st["st_mtime"]) == (5_000_000_001, 3_000_000_789)
    before = st["st_ctime"]
    view.utimens("/top", (UTIME_NOW, UTIME_NOW))
    st = view.getattr("/top")
    assert st["st_mtime"] > 3_000_000_789 and st["st_mtime"] == st["st_atime"]
    assert st["st_ctime"] >= before
    view.utimens("/top", None)  # utimes(path, NULL): both now
    assert view.getattr("/top")["st_mtime"] >= st["st_mtime"]
    # On a file open for writing, the scratch file carries the times.
    fh = view.open("/d/one", os.O_RDWR)
    view.write(fh, b"ONE", 0)
    view.utimens("/d/one", (UTIME_OMIT, 7_000_000_007))
    assert view.getattr("/d/one")["st_mtime"] == 7_000_000_007
    view.flush(fh)
    view.release(fh)
    assert view.getattr("/d/one")["st_mtime"] == 7_000_000_007
    assert read_all(view, "/d/one") == b"ONE"
    assert reopen(view).getattr("/d/one")["st_mtime"] == 7_000_000_007


def test_rename_file(ws_view):
    ws, view = ws_view
    view.rename("/top", "/moved")
    assert read_all(view, "/moved") == b"top"
    with pytest.raises(NotFound):
        view.getattr("/top")
    # over an existing file
    write_file(view, "/other", b"other")
    view.rename("/other", "/d/one")
    assert read_all(view, "/d/one") == b"other"
    assert names(view, "/d") == ["one", "sub"]
    # onto a directory
    with pytest.raises(IsADirectory):
        view.rename("/moved", "/empty")
    # RENAME_NOREPLACE
    with pytest.raises(Exists):
        view.rename("/moved", "/d/one", RENAME_NOREPLACE)
    view.rename("/moved", "/fresh", RENAME_NOREPLACE)
    assert read_all(view, "/fresh") == b"top"
    # a missing source, a missing target directory
    with pytest.raises(NotFound):
        view.rename("/nope", "/x")
    with pytest.raises(NotFound):
        view.rename("/fresh", "/nodir/x")
    # a directory over a file
    with pytest.raises(NotADirectory):
        view.rename("/empty", "/fresh")
    view.commit(message="renames")
    m = manifest(ws.path)
    assert m[b"fresh"] == ("file", 0o644, b"top")
    assert m[b"d/one"] == ("file", 0o644, b"other")
    assert b"top" not in m and b"other" not in m and b"moved" not in m


def test_rename_symlink(ws_view):
    ws, view = ws_view
    os.symlink("top", os.path.join(ws.path, "wl"))
    view.rename("/wl", "/d/wl")
    assert view.readlink("/d/wl") == "top"
    with pytest.raises(NotFound):
        view.readlink("/wl")


def test_rename_directory_moves_the_whole_subtree(ws_view):
    ws, view = ws_view
    write_file(view, "/d/sub/staged", b"staged")   # a staged child
    fh = view.open("/d/one", os.O_RDWR)              # an open, written child
    view.write(fh, b"ONE", 0)
    view.unlink("/d/sub/two")                       # a whiteout inside
    view.rename("/d", "/e")
    assert names(view, "/") == ["e", "empty", "top"]
    assert names(view, "/e") == ["one", "sub"]
    assert names(view, "/e/sub") == ["staged"]
    assert read_all(view, "/e/sub/staged") == b"staged"
    assert read_all(view, "/e/one") == b"ONE"
    view.write(fh, b"!", 3)  # the handle follows the rename
    view.flush(fh)
    view.release(fh)
    assert read_all(view, "/e/one") == b"ONE!"
    with pytest.raises(NotFound):
        view.getattr("/d")
    view.commit(message="move d")
    assert manifest(ws.path) == {
        b"e": ("dir", 0o755, None), b"e/one": ("file", 0o644, b"ONE!"), b"e/sub": ("dir", 0o755, None),
        b"e/sub/staged": ("file", 0o644, b"staged"), b"empty": ("dir", 0o755, None),
        b"top": ("file", 0o644, b"top"),
    }


def test_rename_directory_refusals(ws_view):
    _ws, view = ws_view
    with pytest.raises(Invalid):
        view.rename("/d", "/d/sub/inside")
    with pytest.raises(NotEmpty):
        view.rename("/empty", "/d")
    with pytest.raises(Exists):
        view.rename("/d", "/empty", RENAME_NOREPLACE)
    with pytest.raises(Exists):
        view.rename("/d", "/d", RENAME_NOREPLACE)  # renameat2(2) checks the target first
    with pytest.raises(NotEmpty):
        view.rename("/d/one", "/d")  # onto its own ancestor
    with pytest.raises(NotEmpty):
        view.rename("/d/sub", "/d")
    view.rename("/d", "/d")  # onto itself: nothing happens
    view.rename("/d", "/empty")  # over an empty directory
    assert names(view, "/empty") == ["one", "sub"]


def test_rename_directory_with_an_unwritten_open_copy_up(ws_view):
    """A file opened for writing but not yet written has no object; moving
    its directory must carry its content, not an empty file."""
    ws, view = ws_view
    fh = view.open("/d/one", os.O_RDWR)
    view.rename("/d", "/e")
    view.flush(fh)
    view.release(fh)
    assert read_all(view, "/e/one") == b"one"
    view = reopen(view)
    assert read_all(view, "/e/one") == b"one"
    view.commit(message="move")
    assert manifest(ws.path)[b"e/one"] == ("file", 0o644, b"one")


def test_rename_of_an_unwritten_open_copy_up(ws_view):
    ws, view = ws_view
    fh = view.open("/top", os.O_RDWR)
    view.rename("/top", "/renamed")
    view.release(fh)
    view = reopen(view)
    assert read_all(view, "/renamed") == b"top"
    view.commit(message="rename")
    assert manifest(ws.path)[b"renamed"] == ("file", 0o644, b"top")


def test_non_utf8_names_round_trip(ws_view):
    ws, view = ws_view
    raw_dir = b"dir-\xff"
    raw_file = b"caf\xe9.txt"
    os.mkdir(os.path.join(os.fsencode(ws.path), b"ws-\xfe"))
    ws_name = os.fsdecode(b"ws-\xfe")
    d = "/" + os.fsdecode(raw_dir)
    f = d + "/" + os.fsdecode(raw_file)
    view.mkdir(d, 0o755)
    write_file(view, f, b"latin-1 name")
    view.symlink("/" + os.fsdecode(b"l\x80"), os.fsdecode(raw_file))
    view.rename("/" + ws_name, "/" + os.fsdecode(b"ws-\xfd"))
    assert os.fsdecode(raw_dir) in names(view, "/")
    assert read_all(view, f) == b"latin-1 name"
    assert os.fsencode(view.readlink("/" + os.fsdecode(b"l\x80"))) == raw_file
    assert set(rows(ws, view)) >= {raw_dir, raw_dir + b"/" + raw_file, b"l\x80", b"ws-\xfd", b"ws-\xfe"}
    expected = view_manifest(view)
    view = reopen(view)
    assert view_manifest(view) == expected
    view.commit(message="bytes")
    assert manifest(ws.path) == expected
    assert os.path.isfile(os.path.join(os.fsencode(ws.path), raw_dir, raw_file))


@pytest.mark.parametrize("replaced", ["file", "symlink"])
def test_names_below_a_replaced_file_or_symlink(ws_view, replaced):
    """The workspace has a file or symlink where the view has a directory:
    paths below it exist only in the view (no whiteouts needed)."""
    ws, view = ws_view
    if replaced == "symlink":
        os.symlink("d", os.path.join(ws.path, "p"))
    else:
        with open(os.path.join(ws.path, "p"), "wb") as f:
            f.write(b"p")
    view.unlink("/p")
    view.mkdir("/p", 0o755)
    write_file(view, "/p/x", b"x")
    write_file(view, "/p/y", b"y")
    view.mkdir("/p/sub", 0o755)
    view.unlink("/p/x")
    view.rename("/p/y", "/p/z")
    view.rename("/p/sub", "/p/sub2")
    view.rmdir("/p/sub2")
    assert names(view, "/p") == ["z"]
    assert {p: r.kind for p, r in rows(ws, view).items()} == {b"p": "dir", b"p/z": "file"}
    expected = view_manifest(view)
    view.commit(message="replace")
    assert manifest(ws.path) == expected


def test_rename_of_a_directory_takes_staged_paths_below_unchanged_directories(ws_view):
    """/d/sub has no node of its own; the staged /d/sub/two below it must
    move with /d and leave nothing behind at the old place."""
    ws, view = ws_view
    write_file(view, "/d/sub/two", b"TWO")
    view.rename("/d", "/e")
    assert read_all(view, "/e/sub/two") == b"TWO"
    assert all(not p.startswith("/d/") for p in view.upper.nodes), sorted(view.upper.nodes)
    view.mkdir("/d", 0o755)
    view.mkdir("/d/sub", 0o755)
    assert names(view, "/d/sub") == []
    with pytest.raises(NotFound):
        view.getattr("/d/sub/two")
    assert [op for op, p in view.staged_paths() if p.startswith("/d/sub/")] == []
    expected = view_manifest(view)
    view.commit(message="move")
    assert manifest(ws.path) == expected
    assert len(view.upper) == 0 and view.upper.children == {}


def test_directory_link_counts_follow_subdirectories(ws_view, tmp_path):
    # A directory the step changed counts its subdirectories itself, and
    # keeps the count through changes of files (a tar sets three attributes
    # per file): it must still follow every change of a subdirectory, made
    # through the view or outside in the workspace.
    ws, view = ws_view
    assert view.getattr("/d")["st_nlink"] == 3  # ., .. and sub
    write_file(view, "/d/new", b"x")
    view.chmod("/d/new", 0o600)
    view.utimens("/d/new", (10**9, 10**9))
    assert view.getattr("/d")["st_nlink"] == 3
    view.mkdir("/d/sub2", 0o755)
    assert view.getattr("/d")["st_nlink"] == 4
    view.chmod("/d/new", 0o644)
    assert view.getattr("/d")["st_nlink"] == 4
    (tmp_path / "ws" / "d" / "outside").mkdir()  # the workspace directory's mtime changes
    assert view.getattr("/d")["st_nlink"] == 5
    view.rmdir("/d/sub2")
    assert view.getattr("/d")["st_nlink"] == 4
    # Removing files keeps the count (an rm -rf asks it before each
    # unlink); removing a directory, a workspace one too, does not.
    view.unlink("/d/new")
    view.unlink("/d/one")
    assert view.getattr("/d")["st_nlink"] == 4
    view.rmdir("/d/outside")
    assert view.getattr("/d")["st_nlink"] == 3
    view.mkdir("/d/outside", 0o755)
    assert view.getattr("/d")["st_nlink"] == 4
    view.rename("/d/sub", "/sub")
    assert view.getattr("/d")["st_nlink"] == 3
    view.mkdir("/new", 0o755)
    view.mkdir("/new/a", 0o755)
    write_file(view, "/new/f", b"y")
    view.chmod("/new/f", 0o600)
    assert view.getattr("/new")["st_nlink"] == 3
    view.mkdir("/new/b", 0o755)
    assert view.getattr("/new")["st_nlink"] == 4
