"""Device nodes, sockets and hard links of non-files through the view (no
kernel): made, shown, staged across a daemon restart, committed with the
same kind, mode and device number, and restored by a rollback.  Creating a
device node needs CAP_MKNOD (sessions and CI run as root)."""

from __future__ import annotations

import os
import stat as stat_mod

import pytest

from stepfs.store import cards, diff, layers, rollback
from stepfs.store.contained import kind_of
from store_kit import drop_format_6
from viewkit import open_view, reopen

NULL_RDEV = os.makedev(1, 3)  # /dev/null's numbers
LOOP_RDEV = os.makedev(7, 0)


def kinds_of(path) -> tuple[str, int, int]:
    st = os.lstat(path)
    return kind_of(st.st_mode), stat_mod.S_IMODE(st.st_mode), st.st_rdev


def test_mknod_device_and_socket_are_shown_staged_and_committed(tmp_path):
    ws, view = open_view(tmp_path)
    view.mknod("/null", stat_mod.S_IFCHR | 0o620, NULL_RDEV)
    view.mknod("/loop", stat_mod.S_IFBLK | 0o600, LOOP_RDEV)
    view.mknod("/sock", stat_mod.S_IFSOCK | 0o755)
    st = view.getattr("/null")
    assert stat_mod.S_ISCHR(st["st_mode"]) and stat_mod.S_IMODE(st["st_mode"]) == 0o620
    assert st["st_rdev"] == NULL_RDEV and st["st_size"] == 0
    assert stat_mod.S_ISBLK(view.getattr("/loop")["st_mode"]) and view.getattr("/loop")["st_rdev"] == LOOP_RDEV
    assert stat_mod.S_ISSOCK(view.getattr("/sock")["st_mode"])
    listed = {name: kind for name, kind, _ino in view.readdir("/")[2:]}
    assert listed == {"loop": stat_mod.S_IFBLK, "null": stat_mod.S_IFCHR, "sock": stat_mod.S_IFSOCK}
    assert not os.path.lexists(ws.path + "/null"), "the workspace was touched before the step"

    view = reopen(view)  # the staged rows carry the kind and the device number
    assert view.getattr("/null")["st_rdev"] == NULL_RDEV
    view.commit("devices")
    assert kinds_of(ws.path + "/null") == ("chardev", 0o620, NULL_RDEV)
    assert kinds_of(ws.path + "/loop") == ("blockdev", 0o600, LOOP_RDEV)
    assert kinds_of(ws.path + "/sock")[:2] == ("socket", 0o755)
    # Committed: shown from the workspace, with its device number.
    assert view.getattr("/null")["st_rdev"] == NULL_RDEV
    with ws.db.read() as conn:
        after = {e.path: e.after for e in layers.entries(conn, layers.head(conn))}
    assert after[b"null"].kind == "chardev" and after[b"null"].target == str(NULL_RDEV).encode()
    assert after[b"sock"].kind == "socket" and after[b"sock"].target is None
    with ws.db.read() as conn:  # what 'stepfs show' and 'stepfs diff' print
        card = cards.card(ws.objects, conn, layers.head(conn))
        patch = diff.patch(ws.objects, conn, diff.changes_between(conn, layers.head(conn) - 1, layers.head(conn)))
    files = {f["path"]: f for f in card["files"]}
    assert files["null"]["kind"] == "chardev" and files["null"]["after"]["rdev"] == NULL_RDEV
    assert files["sock"]["op"] == "added" and files["sock"]["kind"] == "socket"
    assert "new file mode 020620" in patch and "new file mode 140755" in patch


def test_workspace_device_chmod_chown_rename_copy_up(tmp_path):
    (tmp_path / "ws").mkdir()
    os.mknod(tmp_path / "ws" / "c", stat_mod.S_IFCHR | 0o644, NULL_RDEV)
    ws, view = open_view(tmp_path)
    assert view.getattr("/c")["st_rdev"] == NULL_RDEV  # untouched: from the workspace
    view.chmod("/c", 0o600)
    view.chown("/c", 1234, 4321)
    st = view.getattr("/c")
    assert stat_mod.S_ISCHR(st["st_mode"]) and stat_mod.S_IMODE(st["st_mode"]) == 0o600
    assert (st["st_uid"], st["st_gid"], st["st_rdev"]) == (1234, 4321, NULL_RDEV)
    view.rename("/c", "/moved")
    view.commit("chmod, chown and move a device")
    assert not os.path.lexists(ws.path + "/c")
    assert kinds_of(ws.path + "/moved") == ("chardev", 0o600, NULL_RDEV)
    assert (os.lstat(ws.path + "/moved").st_uid, os.lstat(ws.path + "/moved").st_gid) == (1234, 4321)


def test_rollback_restores_a_removed_device_and_socket(tmp_path):
    ws, view = open_view(tmp_path)
    view.mknod("/c", stat_mod.S_IFCHR | 0o640, NULL_RDEV)
    view.mknod("/s", stat_mod.S_IFSOCK | 0o600)
    made = view.commit("make")
    view.unlink("/c")
    view.unlink("/s")
    view.mknod("/c", stat_mod.S_IFCHR | 0o640, LOOP_RDEV)  # same path, another device
    view.commit("replace")
    assert kinds_of(ws.path + "/c") == ("chardev", 0o640, LOOP_RDEV) and not os.path.lexists(ws.path + "/s")
    res = rollback.rollback(ws, made)
    assert sorted(res.paths) == [b"c", b"s"]
    assert kinds_of(ws.path + "/c") == ("chardev", 0o640, NULL_RDEV)
    assert kinds_of(ws.path + "/s")[:2] == ("socket", 0o600)


def test_rollback_restores_a_workspace_socket_it_never_staged(tmp_path):
    """A socket that was in the workspace before any layer is recorded as a
    socket (not as an unrestorable special file) when a step removes it."""
    (tmp_path / "ws").mkdir()
    os.mknod(tmp_path / "ws" / "s", stat_mod.S_IFSOCK | 0o640)
    ws, view = open_view(tmp_path)
    with ws.db.read() as conn:
        base = layers.head(conn)
    view.unlink("/s")
    view.commit("remove the socket")
    assert not os.path.lexists(ws.path + "/s")
    rollback.rollback(ws, base)
    assert kinds_of(ws.path + "/s")[:2] == ("socket", 0o640)


def test_mknod_of_other_types_is_refused_and_regular_still_works(tmp_path):
    ws, view = open_view(tmp_path)
    view.mknod("/f", stat_mod.S_IFREG | 0o600)
    assert stat_mod.S_ISREG(view.getattr("/f")["st_mode"])
    from stepfs.overlayfs.core.errors import Exists, Unsupported
    with pytest.raises(Exists):
        view.mknod("/f", stat_mod.S_IFCHR | 0o600, NULL_RDEV)
    with pytest.raises(Unsupported):
        view.mknod("/d", stat_mod.S_IFDIR | 0o700)


@pytest.mark.parametrize("lower", [False, True], ids=["staged", "workspace"])
def test_hard_link_of_a_symlink_is_one_symlink_with_two_names(tmp_path, lower):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "f").write_bytes(b"x")
    if lower:
        os.symlink("f", tmp_path / "ws" / "l")
    ws, view = open_view(tmp_path)
    if not lower:
        view.symlink("/l", "f")
    view.link("/l2", "/l")
    a, b = view.getattr("/l"), view.getattr("/l2")
    assert stat_mod.S_ISLNK(b["st_mode"]) and view.readlink("/l2") == "f"
    assert a["st_ino"] == b["st_ino"] and a["st_nlink"] == b["st_nlink"] == 2
    view = reopen(view)
    assert view.getattr("/l")["st_ino"] == view.getattr("/l2")["st_ino"]
    with ws.db.read() as conn:
        base = layers.head(conn)
    view.commit("link a symlink")
    sa, sb = os.lstat(ws.path + "/l"), os.lstat(ws.path + "/l2")
    assert stat_mod.S_ISLNK(sb.st_mode) and os.readlink(ws.path + "/l2") == "f"
    assert sa.st_ino == sb.st_ino and sb.st_nlink == 2
    # Both names go, then a rollback brings them back as one inode again.
    view.unlink("/l")
    view.unlink("/l2")
    linked = base + 1
    view.commit("remove both")
    rollback.rollback(ws, linked)
    sa, sb = os.lstat(ws.path + "/l"), os.lstat(ws.path + "/l2")
    assert stat_mod.S_ISLNK(sa.st_mode) and os.readlink(ws.path + "/l") == "f"
    assert sa.st_ino == sb.st_ino and sb.st_nlink == 2


def test_hard_link_of_a_device_node(tmp_path):
    ws, view = open_view(tmp_path)
    view.mknod("/c", stat_mod.S_IFCHR | 0o600, NULL_RDEV)
    view.link("/c2", "/c")
    assert view.getattr("/c2")["st_nlink"] == 2 and view.getattr("/c2")["st_rdev"] == NULL_RDEV
    view.commit("linked device")
    sa, sb = os.lstat(ws.path + "/c"), os.lstat(ws.path + "/c2")
    assert sa.st_ino == sb.st_ino and stat_mod.S_ISCHR(sb.st_mode) and sb.st_rdev == NULL_RDEV


def test_special_before_state_of_a_version_2_store_still_reads_and_is_not_restored(tmp_path):
    """Layers written before format 3 recorded a workspace socket or device
    as ``special`` (mode only): after the upgrade they still read, and a
    rollback to such a state is refused as a conflict, not guessed."""
    import sqlite3

    from stepfs.store.errors import CommitConflict
    from stepfs.store.workspace import Workspace

    (tmp_path / "ws").mkdir()
    os.mknod(tmp_path / "ws" / "s", stat_mod.S_IFSOCK | 0o600)
    ws, view = open_view(tmp_path)
    with ws.db.read() as conn:
        base = layers.head(conn)
    view.unlink("/s")
    n = view.commit("remove the socket")
    view.close()
    ws.close()
    raw = sqlite3.connect(str(tmp_path / "ws" / ".stepfs" / "store.db"))
    drop_format_6(raw)  # (format 8's lists become format 7's entries rows on the way)
    raw.execute("UPDATE entries SET before_kind = 'special' WHERE layer = ? AND path = ?", (n, b"s"))
    raw.execute("ALTER TABLE staged DROP COLUMN scratch")  # format 4 added these
    raw.execute("ALTER TABLE staged DROP COLUMN scratch_sum")
    raw.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    raw.commit()
    raw.close()
    ws = Workspace.open(str(tmp_path / "ws"))
    with ws.db.read() as conn:
        assert [e.before.kind for e in layers.entries(conn, n)] == ["special"]
    with pytest.raises(CommitConflict, match="special file"):
        rollback.rollback(ws, base)
    ws.close()


def test_layers_tree_shows_devices_sockets_and_fifos_as_nodes(tmp_path):
    ws, view = open_view(tmp_path)
    view.mknod("/c", stat_mod.S_IFCHR | 0o640, NULL_RDEV)
    view.mknod("/s", stat_mod.S_IFSOCK | 0o600)
    view.mknod("/p", stat_mod.S_IFIFO | 0o644)
    n = view.commit("nodes")
    view.unlink("/c")
    view.commit("remove the device")
    layer = f"/.stepfs/layers/{n}"
    listed = {name: kind for name, kind, _ino in view.readdir(layer)[2:]}
    assert listed == {"c": stat_mod.S_IFCHR, "p": stat_mod.S_IFIFO, "s": stat_mod.S_IFSOCK}
    st = view.getattr(layer + "/c")  # from the store: gone from the workspace since
    assert stat_mod.S_ISCHR(st["st_mode"]) and stat_mod.S_IMODE(st["st_mode"]) == 0o640
    assert st["st_rdev"] == NULL_RDEV
    assert stat_mod.S_ISSOCK(view.getattr(layer + "/s")["st_mode"])  # from the workspace
    assert "c" not in {name for name, _k, _i in view.readdir(f"/.stepfs/layers/{n + 1}")[2:]}
