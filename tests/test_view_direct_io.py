"""Which handles bypass the kernel's page cache (``core.pagecache.needs_direct_io``),
without a kernel.

The kernel keeps one page cache per inode, shared by every process whatever
its agent, and a rename moves the inode to the new name.  So a handle opened
while another agent holds the same file open -- under whatever name that
agent opened it -- must be direct I/O, or the two agents' views of the file
would meet in the cache.
"""

from __future__ import annotations

import os

import pytest

from viewkit import open_view, write_file


@pytest.fixture
def view(tmp_path):
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "f.txt").write_bytes(b"workspace\n")
    ws, view = open_view(tmp_path)
    write_file(view, "/staged.txt", b"staged\n")
    yield view
    ws.close()


def test_one_agent_keeps_the_cache(view):
    a = view.open("/f.txt", os.O_RDONLY, agent="a")
    a2 = view.open("/f.txt", os.O_RDWR, agent="a")
    assert not view.handle_direct_io(a) and not view.handle_direct_io(a2)


def test_another_agent_on_the_same_name_bypasses_the_cache(view):
    view.open("/f.txt", os.O_RDONLY, agent="a")
    b = view.open("/f.txt", os.O_RDONLY, agent="b")
    assert view.handle_direct_io(b)
    other = view.open("/staged.txt", os.O_RDONLY, agent="b")
    assert not view.handle_direct_io(other)  # nobody else has that one open


@pytest.mark.parametrize("path", ["/f.txt", "/staged.txt"])
@pytest.mark.parametrize("mode", [os.O_RDONLY, os.O_RDWR])
def test_another_agent_on_a_renamed_file_bypasses_the_cache(view, path, mode):
    """Agent a holds the file open under its old name; agent b renames it
    and opens it under the new one: the same kernel inode."""
    held = view.open(path, mode, agent="a")
    view.rename(path, "/moved", agent="b")
    b = view.open("/moved", os.O_RDONLY, agent="b")
    assert view.handle_direct_io(b)
    bw = view.open("/moved", os.O_RDWR, agent="b")
    assert view.handle_direct_io(bw)
    view.release(held)
    c = view.open("/moved", os.O_RDONLY, agent="c")
    assert view.handle_direct_io(c)  # b still has it open
    for fh in (b, bw, c):
        view.release(fh)
    d = view.open("/moved", os.O_RDONLY, agent="d")
    assert not view.handle_direct_io(d)  # nobody else has it open any more


def test_a_new_file_at_the_old_name_is_another_file(view):
    """After the rename a new file at the old name is another inode: a
    handle on it shares nothing with the renamed file's holder (only
    handles opened under that very name still count, as before)."""
    view.open("/staged.txt", os.O_RDONLY, agent="a")
    view.rename("/staged.txt", "/moved", agent="b")
    write_file(view, "/other.txt", b"other\n")
    other = view.open("/other.txt", os.O_RDONLY, agent="b")
    assert not view.handle_direct_io(other)
