"""The staged view survives a daemon restart (no kernel): a new Overlay on
the same workspace and mountpoint shows exactly what the old one showed,
minus writes that were never closed."""

from __future__ import annotations

import os

from viewkit import open_view, read_all, reopen, view_manifest, write_file


def populate(tmp_path):
    ws_dir = tmp_path / "ws"
    (ws_dir / "src" / "pkg").mkdir(parents=True)
    (ws_dir / "src" / "pkg" / "mod.py").write_bytes(b"x = 1\n")
    (ws_dir / "src" / "main.py").write_bytes(b"import pkg\n")
    (ws_dir / "docs").mkdir()
    (ws_dir / "docs" / "index.md").write_bytes(b"# docs\n")
    (ws_dir / "old.txt").write_bytes(b"old\n")
    os.symlink("src/main.py", ws_dir / "entry")


def test_restart_shows_the_same_staged_view(tmp_path):
    populate(tmp_path)
    ws, view = open_view(tmp_path)
    write_file(view, "/src/main.py", b"import pkg\nprint(pkg)\n")
    view.mkdir("/build", 0o700)
    write_file(view, "/build/out.bin", bytes(range(256)) * 100, mode=0o755)
    view.symlink("/build/latest", "out.bin")
    view.unlink("/old.txt")
    view.rename("/src", "/lib")                    # a directory with a staged child
    view.rename("/entry", "/lib/entry")            # a workspace symlink
    view.chmod("/docs", 0o750)
    view.truncate("/docs/index.md", 2)
    view.utimens("/docs/index.md", (1_111_111_111, 2_222_222_222))
    view.mkdir("/gone", 0o755)
    view.rmdir("/gone")
    # A closed write, then an open handle that wrote more without closing.
    fh = view.create("/notes", 0o644, os.O_RDWR | os.O_CREAT)
    view.write(fh, b"closed part", 0)
    view.flush(fh)
    view.write(fh, b" and unflushed part", 11)
    # A new file that was never closed at all.
    fh2 = view.create("/never-closed", 0o644, os.O_RDWR | os.O_CREAT)
    view.write(fh2, b"lost", 0)

    before = view_manifest(view, with_stat=True)
    assert before[b"notes"][2] == b"closed part and unflushed part"

    view = reopen(view)
    after = view_manifest(view, with_stat=True)
    expected = dict(before)
    expected[b"notes"] = ("file", 0o644, b"closed part", 11, after[b"notes"][4])
    del expected[b"never-closed"]
    assert after == expected
    assert after[b"docs/index.md"][4] == 2_222_222_222
    assert read_all(view, "/lib/main.py") == b"import pkg\nprint(pkg)\n"
    assert [n for n, _k, _i in view.readdir("/")[2:]] == ["build", "docs", "lib", "notes"]
    # Nothing reached the workspace.
    assert sorted(os.listdir(ws.path)) == [".stepfs", "docs", "entry", "old.txt", "src"]


def test_restart_then_keep_working_and_commit(tmp_path):
    populate(tmp_path)
    ws, view = open_view(tmp_path)
    write_file(view, "/a", b"a")
    view.mkdir("/dir", 0o755)
    view = reopen(view)
    write_file(view, "/dir/b", b"b")
    view.unlink("/a")
    view.rename("/dir", "/dir2")
    expected = view_manifest(view)
    view = reopen(view)
    assert view_manifest(view) == expected
    view.commit(message="after restarts")
    from conftest import manifest

    assert manifest(ws.path) == expected


def test_clean_unmount_stages_unflushed_writes(tmp_path):
    populate(tmp_path)
    ws, view = open_view(tmp_path)
    fh = view.open("/old.txt", os.O_RDWR)
    view.write(fh, b"NEW", 0)        # never flushed (an mmap'ed write, say)
    view.open("/docs/index.md", os.O_RDONLY)  # a reader still open at unmount
    view.close()
    assert view.handles == {}
    view = reopen(view)
    assert read_all(view, "/old.txt") == b"NEW\n"
    assert [p for _op, p in view.staged_paths()] == ["/old.txt"]
