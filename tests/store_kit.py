"""Helpers for the kernel-free store tests: build workspaces and open steps
by hand, the way the overlay would, without FUSE."""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from pathlib import Path

from stepfs.store import staging, tokens
from stepfs.store.workspace import Workspace

MOUNT = "/test/mnt"


def build_tree(root: Path, tree: dict[str, tuple]) -> None:
    """``{path: ("file", mode, bytes) | ("dir", mode) | ("symlink", target)}``,
    created in path order (parents first)."""
    root.mkdir(exist_ok=True)
    for rel in sorted(tree, key=lambda p: p.count("/")):
        spec, full = tree[rel], root / rel
        if spec[0] == "dir":
            full.mkdir()
        elif spec[0] == "file":
            full.write_bytes(spec[2])
        else:
            os.symlink(spec[1], full)
    # Modes last, deepest first, so read-only directories were filled first.
    for rel in sorted(tree, key=lambda p: -p.count("/")):
        if tree[rel][0] != "symlink":
            os.chmod(root / rel, tree[rel][1])


def expected_manifest(tree: dict[str, tuple]) -> dict[bytes, tuple]:
    """The ``conftest.manifest`` form of a ``build_tree`` description."""
    out = {}
    for rel, spec in tree.items():
        if spec[0] == "file":
            out[os.fsencode(rel)] = ("file", spec[1], spec[2])
        elif spec[0] == "dir":
            out[os.fsencode(rel)] = ("dir", spec[1], None)
        else:
            out[os.fsencode(rel)] = ("symlink", None, os.fsencode(spec[1]))
    return out


def token_of(ws: Workspace, path: bytes) -> str:
    """The workspace token of ``path`` now, as the overlay records it
    (``overlayfs.view.Overlay._lower_token``)."""
    try:
        st = ws.root.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return tokens.ABSENT
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV):  # through a symlink: not in the tree
            return tokens.ABSENT
        raise
    target = ws.root.readlink(path) if stat_mod.S_ISLNK(st.st_mode) else None
    return tokens.from_stat(st, target)


class Stager:
    """Stage rows of one open step, each ``base`` taken from the workspace
    at staging time (as the overlay's copy-up does)."""

    def __init__(self, ws: Workspace, mountpoint: str = MOUNT):
        self.ws = ws
        with ws.db.write() as conn:
            self.step = staging.open_step(conn, mountpoint, agent="tester")

    def _put(self, row: staging.StagedRow) -> None:
        with self.ws.db.write() as conn:
            staging.put(conn, self.step, row)

    def file(self, path: str, data: bytes, mode: int = 0o644, mtime_ns: int = 1_600_000_000_123_456_789) -> str:
        p = os.fsencode(path)
        with self.ws.db.write() as conn:
            oid = self.ws.objects.put_bytes(conn, data)
        self._put(staging.StagedRow(p, "file", stat_mod.S_IFREG | mode, oid, None, len(data), mtime_ns,
                                    False, token_of(self.ws, p)))
        return oid

    def dir(self, path: str, mode: int = 0o755, opaque: bool = False) -> None:
        p = os.fsencode(path)
        self._put(staging.StagedRow(p, "dir", stat_mod.S_IFDIR | mode, opaque=opaque, base=token_of(self.ws, p)))

    def symlink(self, path: str, target: str) -> None:
        p = os.fsencode(path)
        t = os.fsencode(target)
        self._put(staging.StagedRow(p, "symlink", stat_mod.S_IFLNK | 0o777, target=t, size=len(t),
                                    mtime_ns=1_600_000_000_000_000_000, base=token_of(self.ws, p)))

    def whiteout(self, path: str) -> None:
        p = os.fsencode(path)
        self._put(staging.StagedRow(p, "whiteout", base=token_of(self.ws, p)))

    def rows(self) -> list[staging.StagedRow]:
        with self.ws.db.read() as conn:
            return staging.load(conn, self.step)


def open_workspace(path: Path, tree: dict[str, tuple] | None = None) -> Workspace:
    build_tree(path, tree or {})
    return Workspace.open(str(path), create=True)


def plain(state):
    """A layer state without owner fields (tests that do not care about
    ownership compare kind, mode, content, target and xattrs only)."""
    import dataclasses

    return None if state is None else dataclasses.replace(state, uid=None, gid=None)


def object_to_file(db, objects, oid: str, out: Path) -> os.stat_result:
    """Write object ``oid`` into the new file ``out`` with
    ``ObjectStore.write_to_fd`` and fsync it; returns its stat (allocated
    blocks included, to check that holes stayed holes)."""
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with db.read() as conn:
            objects.write_to_fd(conn, oid, fd)
        os.fsync(fd)
        return os.fstat(fd)
    finally:
        os.close(fd)


def drop_format_6(raw) -> None:
    """On an open ``sqlite3`` connection to a new store: undo what format 6
    added (chunks.codec and chunks.base, objects.gen), so the file looks as
    a version-5 writer made it (compressed chunks are stored raw again).
    The chunks table is rebuilt: a column in a foreign key cannot be
    dropped.  The caller sets the version and commits."""
    import zstandard

    raw.execute("PRAGMA foreign_keys=OFF")
    rows = raw.execute("SELECT cid, size, data, codec FROM chunks").fetchall()
    raw.execute("DROP INDEX IF EXISTS chunks_base")
    raw.execute("DROP TABLE chunks")
    raw.execute("CREATE TABLE chunks (cid VARCHAR(48) NOT NULL PRIMARY KEY, size INTEGER NOT NULL, data BLOB NOT NULL)")
    for cid, size, data, codec in rows:
        assert codec in (0, 1), "a delta chunk cannot be turned back into format 5 here"
        plain = zstandard.ZstdDecompressor().decompress(data, max_output_size=size) if codec == 1 else data
        raw.execute("INSERT INTO chunks VALUES (?, ?, ?)", (cid, size, plain))
    raw.execute("ALTER TABLE objects DROP COLUMN gen")
