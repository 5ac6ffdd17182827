"""Directory listings as the FUSE adapter hands them to libfuse
(``libfuse.highlevel._FUSE.readdir_fuse_3``), driven without a mount: a filler made
from a Python function records what libfuse would get.

Pins: entry ``i`` has offset ``i + 1`` whatever the request; a listing is
read once per open of a directory even when the kernel continues a
READDIRPLUS listing with plain READDIR requests (the one after the last
entry included); the attributes a READDIRPLUS entry carries are exactly
what ``getattr`` answers for its path (``Overlay.getattr_listed``)."""

from __future__ import annotations

import ctypes
import os
import stat

import mfusepy
import pytest

from stepfs.overlayfs.daemon import fuse_ops
from stepfs.overlayfs.daemon.fuse_ops import StepFS
from stepfs.overlayfs.daemon.libfuse import statbuf
from stepfs.overlayfs.daemon.libfuse.highlevel import FUSE_FILL_DIR_PLUS, FUSE_READDIR_PLUS, _FUSE
from viewkit import open_view, write_file


class Replies:
    """A libfuse filler that records ``(name, offset, flags, st_mode,
    st_size)`` and accepts at most ``room`` entries per request."""

    def __init__(self, room: int = 10_000):
        self.room = room
        self.got: list[tuple[str, int, int, int, int]] = []
        self._taken = 0
        self.filler = mfusepy.fuse_fill_dir_t(self._fill)

    def _fill(self, buf, name, stp, off, flags):
        if self._taken >= self.room:
            return 1
        self._taken += 1
        st = stp.contents
        self.got.append((name.decode(), off, flags, st.st_mode, st.st_size))
        return 0

    def request(self, fuse: _FUSE, path: str, offset: int, plus: bool) -> list[tuple]:
        """One READDIR(PLUS) request; returns the entries of its reply."""
        self.got, self._taken = [], 0
        fuse.readdir_fuse_3(path.encode(), None, self.filler, offset, None, FUSE_READDIR_PLUS if plus else 0)
        return self.got


@pytest.fixture
def adapter(tmp_path):
    """``(workspace dir, view, fuse adapter, listings read so far)``."""
    ws, view = open_view(tmp_path, row_delay=None)
    ops = StepFS(view, None, None)
    fuse = object.__new__(_FUSE)
    fuse.operations, fuse.encoding, fuse.errors = ops, "utf-8", "surrogateescape"
    reads: list[str] = []
    listing = ops.readdir_entries

    def counted(path):
        reads.append(path)
        return listing(path)

    ops.readdir_entries = counted
    try:
        yield tmp_path / "ws", view, fuse, reads
    finally:
        view.close()
        ws.close()


def test_the_request_after_a_readdirplus_listing_ends_it_without_reading_it_again(adapter):
    root, _view, fuse, reads = adapter
    (root / "d").mkdir()
    for i in range(5):
        (root / "d" / f"f{i}").write_bytes(b"x" * i)
    rep = Replies()
    first = rep.request(fuse, "/d", 0, plus=True)
    assert [(n, off) for n, off, *_ in first] == [(".", 1), ("..", 2)] + [(f"f{i}", i + 3) for i in range(5)]
    assert [(n, flags, size) for n, _off, flags, _mode, size in first[2:]] == [
        (f"f{i}", FUSE_FILL_DIR_PLUS, i) for i in range(5)]
    # The kernel goes on with a plain READDIR at the last offset: an empty
    # reply (the end), and the directory is not read again for it.
    assert rep.request(fuse, "/d", 7, plus=False) == []
    assert reads == ["/d"]


def test_a_plain_readdir_continues_a_long_listing_from_its_offset(adapter):
    root, _view, fuse, reads = adapter
    (root / "big").mkdir()
    names = sorted(f"n{i:03d}" + "y" * 120 for i in range(60))
    for name in names:
        (root / "big" / name).write_bytes(b"")
    rep = Replies()
    first = rep.request(fuse, "/big", 0, plus=True)  # as much as one reply's budget takes
    k = len(first)
    assert 2 < k < 62 and [off for _n, off, *_ in first] == list(range(1, k + 1))
    rest = rep.request(fuse, "/big", k, plus=False)
    assert [(n, off, flags) for n, off, flags, *_ in rest] == [
        (name, k - 1 + j, 0) for j, name in enumerate(names[k - 2:], start=2)]
    assert rep.request(fuse, "/big", 62, plus=False) == []
    assert reads == ["/big"]
    # A reply that fills up: the next request resumes at the entry that
    # did not fit, from the same listing.
    small = Replies(room=5)
    assert [off for _n, off, *_ in small.request(fuse, "/big", 20, plus=False)] == [21, 22, 23, 24, 25]
    assert [n for n, *_ in small.request(fuse, "/big", 25, plus=False)] == names[23:28]
    assert reads == ["/big", "/big"]
    # With no listing kept for that offset (another directory was listed
    # meanwhile), it is read again and continues at the same place.
    (root / "other").mkdir()
    rep.request(fuse, "/other", 0, plus=True)
    again = rep.request(fuse, "/big", k, plus=False)
    assert again == rest
    assert reads == ["/big", "/big", "/other", "/big"]


def test_a_plain_listing_from_the_start_is_left_to_libfuse(adapter):
    """Offset 0 of a plain READDIR: every entry with offset 0 (libfuse keeps
    the list and serves later offsets itself)."""
    root, _view, fuse, _reads = adapter
    (root / "d").mkdir()
    (root / "d" / "a").write_bytes(b"")
    got = Replies().request(fuse, "/d", 0, plus=False)
    assert [(n, off, flags) for n, off, flags, *_ in got] == [(".", 0, 0), ("..", 0, 0), ("a", 0, 0)]


def _getattr_or_none(view, path):
    try:
        return view.getattr(path)
    except Exception:
        return None


def test_listed_attributes_are_what_getattr_answers(adapter, monkeypatch):
    root, view, fuse, _reads = adapter
    d = root / "d"
    (d / "sub").mkdir(parents=True)
    (d / "plain").write_bytes(b"p" * 17)
    os.chmod(d / "plain", 0o640)
    (d / "linked").write_bytes(b"l")
    os.link(d / "linked", d / "linked2")
    os.symlink("plain", d / "sym")
    (d / "removed").write_bytes(b"r")
    (d / "changed").write_bytes(b"old")
    write_file(view, "/d/changed", b"new bytes")
    write_file(view, "/d/staged", b"staged", mode=0o600)
    view.unlink("/d/removed")
    names = ["sub", "plain", "linked", "linked2", "sym", "removed", "changed", "staged", "absent"]
    expected = [_getattr_or_none(view, "/d/" + n) for n in names]
    assert expected[names.index("removed")] is None and expected[names.index("absent")] is None

    # Workspace names are stat'ed relative to the directory, not resolved
    # from the root one by one.
    resolved = []
    lstat = view.root.lstat
    monkeypatch.setattr(view.root, "lstat", lambda p: resolved.append(p) or lstat(p))
    assert view.getattr_listed("/d", names) == expected
    assert resolved == []
    assert view.lower_shown[(os.stat(d / "linked").st_dev, os.stat(d / "linked").st_ino)] == {
        "/d/linked", "/d/linked2"}

    # A directory whose workspace content is covered (removed, then made
    # anew through the view): every name goes through getattr.
    view.unlink("/d/sym")
    for n in ("plain", "linked", "linked2", "changed", "staged"):
        view.unlink("/d/" + n)
    view.rmdir("/d/sub")
    view.rmdir("/d")
    view.mkdir("/d", 0o755)
    write_file(view, "/d/plain", b"a new file")
    monkeypatch.undo()
    assert view.getattr_listed("/d", ["plain", "sub"]) == [view.getattr("/d/plain"), None]

    # Through the adapter: the entries carry those attributes.
    got = {n: (flags, mode, size) for n, _off, flags, mode, size in Replies().request(fuse, "/d", 0, plus=True)}
    assert got["plain"] == (FUSE_FILL_DIR_PLUS, stat.S_IFREG | 0o644, len(b"a new file"))


def test_listed_names_are_held_and_their_directories_watched(adapter):
    root, view, fuse, _reads = adapter
    (root / "d" / "sub").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"")
    watched = []
    fuse.operations._watch = watched.append
    Replies().request(fuse, "/d", 0, plus=True)
    assert watched == ["/d/sub"]
    assert {"/d/sub", "/d/f"} <= fuse.operations._held
    # Held names go without attributes next time (the kernel has them).
    again = Replies().request(fuse, "/d", 0, plus=True)
    assert {n: (flags, mode) for n, _o, flags, mode, _size in again} == {
        ".": (0, stat.S_IFDIR), "..": (0, stat.S_IFDIR), "f": (0, stat.S_IFREG), "sub": (0, stat.S_IFDIR)}
    assert fuse_ops.HELD_LIMIT > 2


@pytest.mark.parametrize("attrs", [
    {"st_mode": stat.S_IFREG | 0o644, "st_ino": 12345, "st_nlink": 3, "st_size": 1234, "st_uid": 1000,
     "st_gid": 100, "st_atime": 1_700_000_000_123_456_789, "st_mtime": 1_600_000_000_000_000_001,
     "st_ctime": -5, "st_blocks": 8, "st_blksize": 4096, "st_rdev": 0},
    {"st_mode": stat.S_IFCHR | 0o600, "st_ino": 2 ** 63, "st_nlink": 1, "st_size": 0, "st_uid": 0, "st_gid": 0,
     "st_atime": 0, "st_mtime": 10 ** 18, "st_ctime": 1, "st_blocks": 0, "st_blksize": 4096, "st_rdev": 0x0501},
    {"st_mode": stat.S_IFDIR | 0o755, "st_ino": 7, "st_nlink": 2, "st_size": 4096, "st_uid": 5, "st_gid": 6,
     "st_atime": 1, "st_mtime": 2, "st_ctime": 3, "st_blocks": 8, "st_blksize": 4096},
    # A value out of its field's range takes the field-by-field way.
    {"st_mode": stat.S_IFREG, "st_ino": 1, "st_nlink": 1, "st_size": 1, "st_uid": 2 ** 40, "st_gid": 0,
     "st_atime": 0, "st_mtime": 0, "st_ctime": 0, "st_blocks": 0, "st_blksize": 512},
])
def test_packed_stat_fill_gives_the_bytes_of_field_by_field(attrs, monkeypatch):
    assert statbuf._STAT_PACKED  # this machine's layout is the known one
    packed = mfusepy.c_stat()
    ctypes.memset(ctypes.byref(packed), 0xAB, ctypes.sizeof(packed))  # every byte must be written
    statbuf._fill_stat(packed, attrs)
    monkeypatch.setattr(statbuf, "_STAT_PACKED", False)
    fields = mfusepy.c_stat()
    ctypes.memset(ctypes.byref(fields), 0xCD, ctypes.sizeof(fields))
    statbuf._fill_stat(fields, attrs)
    assert bytes(packed) == bytes(fields)
    assert (packed.st_mode, packed.st_ino, packed.st_rdev) == (attrs["st_mode"], attrs["st_ino"],
                                                               attrs.get("st_rdev", 0))


@pytest.mark.parametrize("attrs", [
    {"st_mode": stat.S_IFREG | 0o644, "st_ino": 5, "st_nlink": 1, "st_size": 3, "st_uid": 1, "st_gid": 2},
    # Twelve keys, but another twelfth than st_rdev; eleven with one of the usual missing.
    {"st_mode": stat.S_IFREG | 0o644, "st_ino": 5, "st_nlink": 1, "st_size": 3, "st_uid": 1, "st_gid": 2,
     "st_atime": 1, "st_mtime": 2, "st_ctime": 3, "st_blocks": 0, "st_blksize": 4096, "st_dev": 77},
    {"st_mode": stat.S_IFREG | 0o644, "st_ino": 5, "st_nlink": 1, "st_size": 3, "st_uid": 1, "st_gid": 2,
     "st_atime": 1, "st_mtime": 2, "st_ctime": 3, "st_rdev": 9, "st_blksize": 4096},
])
def test_stat_fill_of_other_key_sets_is_mfusepys(attrs):
    """A dict without exactly the view's keys is filled as mfusepy would
    (zeroed, then set by name): absent fields are zero, extra ones kept."""
    got = mfusepy.c_stat()
    ctypes.memset(ctypes.byref(got), 0xAB, ctypes.sizeof(got))
    statbuf._fill_stat(got, attrs)
    want = mfusepy.c_stat()
    mfusepy.set_st_attrs(want, attrs, use_ns=True)
    assert bytes(got) == bytes(want)


def test_listed_attributes_never_stat_the_store_or_leave_the_directory(adapter):
    root, view, _fuse, _reads = adapter
    (root / "d").mkdir()
    (root / "top.txt").write_bytes(b"t")
    meta, top = view.getattr_listed("/", [".stepfs", "top.txt"])
    assert top == view.getattr("/top.txt")
    # The generated tree's attributes, not the store directory's.
    assert meta["st_ino"] == view.getattr("/.stepfs")["st_ino"] != os.stat(root / ".stepfs").st_ino
    # Not one plain component: answered by getattr, which resolves beneath the root.
    odd = ["..", "../top.txt", "../../x"]
    assert view.getattr_listed("/d", odd) == [_getattr_or_none(view, "/d/" + n) for n in odd]
    assert view.getattr_listed("/d", odd)[2] is None


def test_the_roots_readdirplus_lists_stepfs_without_attributes(adapter):
    """``MOUNT/.stepfs`` goes out as a plain entry (the kernel looks it up
    and gets the generated tree's attributes from getattr); a workspace
    name of the same spelling below the root is an ordinary entry."""
    root, view, fuse, _reads = adapter
    (root / "top.txt").write_bytes(b"t")
    (root / "d").mkdir()
    (root / "d" / ".stepfs").write_bytes(b"not the store")
    assert ".stepfs" not in [n for n, _k, _i in view.readdir("/")]  # hidden from listings, reachable by name
    listing = fuse.operations.readdir_entries
    fuse.operations.readdir_entries = lambda path: listing(path) + (
        [(".stepfs", stat.S_IFDIR, 99)] if path == "/" else [])  # were it ever listed
    got = {n: flags for n, _off, flags, _mode, _size in Replies().request(fuse, "/", 0, plus=True)}
    assert got[".stepfs"] == 0 and got["top.txt"] == FUSE_FILL_DIR_PLUS and got["d"] == FUSE_FILL_DIR_PLUS
    below = {n: (flags, size) for n, _off, flags, _mode, size in Replies().request(fuse, "/d", 0, plus=True)}
    assert below[".stepfs"] == (FUSE_FILL_DIR_PLUS, len(b"not the store"))
