"""Tools for the crash and fault tests (kernel-free): steps to commit, hooks
for ``store.durable``, a fork-and-kill runner, the OLD/NEW checks and a
power-loss model.

A *template* is a directory holding a workspace (the OLD tree) whose store
has one open step staged through an :class:`overlayfs.view.Overlay`.  Each
crash run copies it, so every run starts from the same bytes.  The copy has
other inode numbers than the template, so the file tokens recorded at
staging no longer match: the runs commit with ``overwrite`` = every staged
path, which skips only the conflict check (not exercised here).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sqlite3
import stat as stat_mod
import subprocess
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import select

from conftest import manifest
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import durable, publish, schema, staging
from stepfs.store.layers import entries as load_entries
from stepfs.store.workspace import Workspace

#: The durability calls a crash may land on (the issue's list, plus the
#: symlink and rmdir variants of "create" and "remove").
CRASH_OPS = frozenset({"fsync", "rename", "unlink", "rmdir", "mkdir", "symlink", "commit"})

MOUNTPOINT = "/crashkit/mnt"


# -- where to run -------------------------------------------------------------------

@contextmanager
def tmpfs(path: Path, size: str = "1g"):
    """A private tmpfs mounted at ``path`` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def fast_tmp(tmp_path):
    """A directory under ``tmp_path`` on a private tmpfs.  The fork-and-kill
    tests model a killed *process*, whose writes the page cache keeps, so
    they do not need the disk, and ``fsync`` on tmpfs costs nothing (on this
    disk it costs milliseconds, times thousands of crash points).  The
    power-loss model does not rely on real fsyncs either."""
    if os.geteuid() != 0:
        yield tmp_path  # same tests, only slower
        return
    with tmpfs(tmp_path / "tmpfs") as path:
        yield path


# -- steps --------------------------------------------------------------------------

def _content(i: int, salt: str, size: int | None = None) -> bytes:
    size = (i * 131 + len(salt) * 17) % 3000 if size is None else size
    unit = f"{salt}:{i}:".encode()
    return (unit * (size // len(unit) + 1))[:size]


#: Kind of change for change number c (c % 8), so that 1 change is a modify,
#: 8 changes are one of each kind, 200 are 25 rounds of all kinds.
KINDS = ["modify", "add", "delete", "rename_file", "rename_dir", "mode", "symlink", "dirs"]


def _rounds(n: int) -> list[list[str]]:
    out: list[list[str]] = []
    for c in range(n):
        if c % 8 == 0:
            out.append([])
        out[-1].append(KINDS[c % 8])
    return out


def make_old_tree(root: Path, n: int) -> None:
    """The OLD workspace for a step of ``n`` changes (plus untouched paths)."""
    (root / "top.txt").write_bytes(b"untouched top\n")
    for i, kinds in enumerate(_rounds(n)):
        r = root / f"r{i:03d}"
        r.mkdir()
        (r / "keep.txt").write_bytes(_content(i, "keep"))
        for kind in kinds:
            if kind == "modify":
                (r / "mod.txt").write_bytes(_content(i, "old"))
            elif kind == "delete":
                (r / "del.txt").write_bytes(_content(i, "del"))
            elif kind == "rename_file":
                (r / "ren_src.txt").write_bytes(_content(i, "ren"))
            elif kind == "rename_dir":
                (r / "dir_src" / "sub").mkdir(parents=True)
                (r / "dir_src" / "f1").write_bytes(_content(i, "f1"))
                (r / "dir_src" / "sub" / "f2").write_bytes(_content(i, "f2", 0))
            elif kind == "mode":
                (r / "mode.sh").write_bytes(b"#!/bin/sh\necho " + str(i).encode() + b"\n")
                os.chmod(r / "mode.sh", 0o644)
                (r / "modedir").mkdir(mode=0o755)
                (r / "modedir" / "inside").write_bytes(b"in")
            elif kind == "symlink":
                os.symlink("keep.txt", r / "oldlink")
            elif kind == "dirs":
                (r / "emptyold").mkdir()
                (r / "f2d").write_bytes(b"becomes a directory")


def apply_changes(view: Overlay, n: int) -> None:
    """The step: ``n`` changes made through the overlay (as a mount would)."""

    def write(path: str, data: bytes, create: bool) -> None:
        fh = view.create(path, 0o644) if create else view.open(path, os.O_WRONLY | os.O_TRUNC)
        view.write(fh, data, 0)
        view.flush(fh)
        view.release(fh)

    for i, kinds in enumerate(_rounds(n)):
        r = f"/r{i:03d}"
        for kind in kinds:
            if kind == "modify":
                write(f"{r}/mod.txt", _content(i, "new"), create=False)
            elif kind == "add":
                write(f"{r}/new.txt", _content(i, "add"), create=True)
            elif kind == "delete":
                view.unlink(f"{r}/del.txt")
            elif kind == "rename_file":
                view.rename(f"{r}/ren_src.txt", f"{r}/ren_dst.txt")
            elif kind == "rename_dir":
                view.rename(f"{r}/dir_src", f"{r}/dir_dst")
            elif kind == "mode":
                view.chmod(f"{r}/mode.sh", 0o755)
                view.chmod(f"{r}/modedir", 0o700)
            elif kind == "symlink":
                view.symlink(f"{r}/link", "keep.txt")
                view.unlink(f"{r}/oldlink")
                view.symlink(f"{r}/oldlink", "dir_dst/f1")
            elif kind == "dirs":
                view.mkdir(f"{r}/emptynew", 0o750)
                view.rmdir(f"{r}/emptyold")
                view.unlink(f"{r}/f2d")
                view.mkdir(f"{r}/f2d", 0o755)
                write(f"{r}/f2d/now_a_file_inside", b"replaced", create=True)


@dataclass
class Template:
    dir: Path  # holds ws/
    step: int
    paths: set[bytes]  # every staged path (the commit's overwrite set)
    staged: list[tuple]  # the open step's rows, for "nothing lost"
    old: dict
    new: dict = field(default_factory=dict)

    @property
    def ws(self) -> Path:
        return self.dir / "ws"


def staged_rows(ws: Workspace, step: int) -> list[tuple]:
    with ws.db.read() as conn:
        return [(r.path, r.kind, r.mode, r.oid, r.target, r.opaque) for r in staging.load(conn, step)]


def make_template(base: Path, n: int) -> Template:
    """A workspace with the OLD tree of ``n`` changes and that step staged;
    ``new`` is filled by committing a copy once without faults."""
    ws_path = base / "template" / "ws"
    ws_path.mkdir(parents=True)
    make_old_tree(ws_path, n)
    old = manifest(ws_path)
    with Workspace.open(str(ws_path), create=True) as ws:
        view = Overlay(ws, MOUNTPOINT)
        apply_changes(view, n)
        step = view.step
        rows = staged_rows(ws, step)
    t = Template(base / "template", step, {r[0] for r in rows}, rows, old)
    probe = base / "probe"
    copy_template(t, probe)
    with Workspace.open(str(probe / "ws")) as ws:
        commit(ws, t)
    t.new = manifest(probe / "ws")
    shutil.rmtree(probe)
    assert t.new != t.old
    return t


def copy_template(t: Template, dst: Path) -> Path:
    shutil.copytree(t.dir, dst, symlinks=True)
    return dst / "ws"


def commit(ws: Workspace, t: Template) -> int:
    return publish.commit_step(ws, t.step, message="crash test", mount=MOUNTPOINT, overwrite=t.paths)


# -- hooks for store.durable ------------------------------------------------------------

class Counter:
    """Counts durability calls (``CRASH_OPS``) and every call by op."""

    def __init__(self, ops: frozenset[str] = CRASH_OPS):
        self.ops = ops
        self.n = 0
        self.by_op: dict[str, int] = {}
        self.trace: list[str] = []
        self.durable_commits: list[int] = []  # positions (1-based) in trace of durable database commits

    def before(self, op: str, args: tuple) -> None:
        self.by_op[op] = self.by_op.get(op, 0) + 1
        if op in self.ops:
            self.n += 1
            self.trace.append(op)
            if op == "commit" and args[0]:
                self.durable_commits.append(self.n)

    def after(self, op: str, args: tuple) -> None:
        pass


class KillAt(Counter):
    """SIGKILL this process just before the k-th durability call."""

    def __init__(self, k: int, ops: frozenset[str] = CRASH_OPS):
        super().__init__(ops)
        self.k = k

    def before(self, op: str, args: tuple) -> None:
        super().before(op, args)
        if op in self.ops and self.n == self.k:
            os.kill(os.getpid(), signal.SIGKILL)


class FailAt(Counter):
    """Make the n-th call of ``op`` (and, if ``persistent``, every later
    one) raise ``OSError(code)`` before it happens."""

    def __init__(self, op: str, n: int, code: int = errno.EIO, persistent: bool = False):
        super().__init__(frozenset({op}))
        self.op, self.at, self.code, self.persistent = op, n, code, persistent
        self.failed = 0

    def before(self, op: str, args: tuple) -> None:
        super().before(op, args)
        if op == self.op and (self.n == self.at or (self.persistent and self.n > self.at)):
            self.failed += 1
            raise OSError(self.code, f"injected {os.strerror(self.code)} on {op} #{self.n}")


# -- fork and kill ------------------------------------------------------------------

def fork_run(body) -> str:
    """Run ``body()`` in a forked child.  Returns ``"killed"`` (SIGKILL) or
    ``"completed"``; any other end fails the test with the child's output."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        code = 0
        try:
            body()
        except BaseException:
            os.write(w, traceback.format_exc().encode())
            code = 3
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        output = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "completed"
    raise AssertionError(f"crash child ended with status {status:#x}:\n{output}")


def crash_commit(t: Template, dst: Path, hook, do=None) -> str:
    """Commit a copy of the template at ``dst`` in a forked child, under
    ``hook``; ``do(ws, t)`` commits instead of :func:`commit`."""
    ws_path = copy_template(t, dst)

    def body() -> None:
        ws = Workspace.open(str(ws_path), recover=False)
        with durable.installed(hook):
            (do or commit)(ws, t)

    return fork_run(body)


def crash_recovery(ws_path: Path, hook) -> str:
    def body() -> None:
        ws = Workspace.open(str(ws_path), recover=False)
        with durable.installed(hook):
            publish.recover(ws)

    return fork_run(body)


# -- checks -----------------------------------------------------------------------------

def state_of(tree: dict, path: bytes) -> tuple | None:
    return tree.get(path)


def check_recovered(ws_path: Path, t: Template) -> str:
    """Open (= recover) the workspace; assert it is exactly OLD or NEW, that no
    temporary file is left, and that the layer table and the open step agree
    with the tree.  Returns ``"OLD"`` or ``"NEW"``."""
    with Workspace.open(str(ws_path)) as ws:
        tree = manifest(ws_path)
        leftovers = os.listdir(ws.tmp_dir)
        assert leftovers == [], f"temporary files left after recovery: {leftovers}"
        with ws.db.read() as conn:
            layer_rows = [tuple(r) for r in conn.execute(
                select(schema.layers.c.number, schema.layers.c.state).order_by(schema.layers.c.number))]
        if tree == t.old:
            which = "OLD"
            assert [r for r in layer_rows if r[1] != "void"] == [(0, "committed")], layer_rows
            assert staged_rows(ws, t.step) == t.staged, "the open step lost staged rows"
        elif tree == t.new:
            which = "NEW"
            assert layer_rows == [(0, "committed"), (1, "committed")], layer_rows
            assert staged_rows(ws, t.step) == [], "the committed step is still staged"
            with ws.db.read() as conn:
                for e in load_entries(conn, 1):
                    assert _tree_state(ws, conn, e.after) == tree.get(e.path), e.path
        else:
            raise AssertionError(f"workspace is neither OLD nor NEW after recovery: {_diff(tree, t)}")
    return which


def _tree_state(ws: Workspace, conn, s) -> tuple | None:
    if s.kind is None:
        return None
    if s.kind == "file":
        return ("file", s.mode, ws.objects.read_all(conn, s.oid))
    if s.kind == "symlink":
        return ("symlink", None, s.target)
    return ("dir", s.mode, None)


def _diff(tree: dict, t: Template, limit: int = 6) -> str:
    out = []
    for name, ref in (("OLD", t.old), ("NEW", t.new)):
        paths = sorted(p for p in set(tree) | set(ref) if tree.get(p) != ref.get(p))
        shown = [f"{p!r}: {_short(tree.get(p))} vs {_short(ref.get(p))}" for p in paths[:limit]]
        out.append(f"{len(paths)} path(s) differ from {name}: " + "; ".join(shown))
    return " | ".join(out)


def _short(v) -> str:
    if v is None:
        return "absent"
    kind, mode, data = v
    return f"{kind} {oct(mode) if mode is not None else ''} {len(data) if kind == 'file' else data!r}"


# -- power-loss model -------------------------------------------------------------------

def _db_image(db_path: str) -> bytes:
    """The committed content of a store database, as one file image."""
    src = sqlite3.connect(db_path)
    dst = sqlite3.connect(":memory:")
    try:
        src.backup(dst)
        return dst.serialize()
    finally:
        src.close()
        dst.close()


def _site() -> str:
    """``function:line`` of the first caller outside the seam and this module."""
    frame = sys._getframe(2)
    skip = {durable.__file__, __file__}
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname not in skip and "contextlib" not in fname and not fname.endswith("store/db.py"):
            return f"{os.path.basename(fname)}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class ProcessCrash(BaseException):
    """Stops the code under test at a durability call, like a kill would:
    nothing catches a BaseException, so no clean-up runs."""


class PowerLoss:
    """A ``store.durable`` hook that models what survives a power loss.

    Model (what POSIX promises, and what ext4 with ``data=ordered`` can
    actually lose): a file's bytes and mode are durable once the file was
    fsynced; a directory's entries and mode are durable once the directory
    was fsynced; a symlink's target is fixed at creation and durable with the
    entry that names it; a file never fsynced comes back empty, a directory
    never fsynced comes back empty.  The database is durable as of its last
    durable (``synchronous=FULL``) commit.  Everything starts durable.

    Inodes are identified by number plus a generation bumped whenever the
    seam removes or replaces a path, so a reused inode number is a new file.

    At each durability call (before it happens) and once at the end,
    :attr:`images` gets the tree and database a power loss would leave.
    ``ignore`` names call sites (``file:function:line`` from :func:`_site`)
    whose fsync or durable commit the model treats as never having happened:
    the mutation check.  ``crash_at`` raises :class:`ProcessCrash` at that
    durability call, so a recovery can then run under the same model (a
    process crash first, the power cut later).
    """

    def __init__(self, ws_path: Path, ignore: frozenset[str] = frozenset(), crash_at: int | None = None):
        self.crash_at = crash_at
        self.root = os.fsencode(str(ws_path))
        self.db_path = str(ws_path / ".stepfs" / "store.db")
        self.ignore = ignore
        self.gen: dict[int, int] = {}
        self.dirs: dict[tuple, dict[bytes, tuple]] = {}  # dir id -> {name: (child id, kind)}
        self.files: dict[tuple, tuple[int, bytes]] = {}  # file id -> (mode, bytes)
        self.links: dict[tuple, bytes] = {}
        self.dir_modes: dict[tuple, int] = {}
        self.sites: dict[str, str] = {}  # site -> op, of every fsync / durable commit seen
        self.images: list[tuple[str, dict, bytes]] = []  # (label, tree, db image)
        self._victim: int | None = None
        self._skip = False
        self.root_id = self._id(os.lstat(self.root).st_ino)
        self._record_tree(self.root)
        self.db = _db_image(self.db_path)

    def _id(self, ino: int) -> tuple:
        return (ino, self.gen.get(ino, 0))

    def _record_tree(self, path: bytes) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._record_dir(fd)
        finally:
            os.close(fd)
        for name, (cid, kind) in self.dirs[self._id(os.lstat(path).st_ino)].items():
            full = os.path.join(path, name)
            if kind == "dir":
                self._record_tree(full)
            elif kind == "file":
                with open(full, "rb") as f:
                    self.files[cid] = (stat_mod.S_IMODE(os.fstat(f.fileno()).st_mode), f.read())

    def _record_dir(self, fd: int) -> None:
        st = os.fstat(fd)
        entries = {}
        with os.scandir(fd) as it:
            for entry in it:
                name = os.fsencode(entry.name)
                if st.st_ino == os.lstat(self.root).st_ino and name == b".stepfs":
                    continue
                mode = entry.stat(follow_symlinks=False).st_mode
                kind = "dir" if stat_mod.S_ISDIR(mode) else "symlink" if stat_mod.S_ISLNK(mode) else "file"
                cid = self._id(entry.inode())
                entries[name] = (cid, kind)
                if kind == "symlink" and cid not in self.links:
                    self.links[cid] = os.readlink(name, dir_fd=fd)
        did = self._id(st.st_ino)
        self.dirs[did] = entries
        self.dir_modes[did] = stat_mod.S_IMODE(st.st_mode)

    # -- hook ------------------------------------------------------------------

    def before(self, op: str, args: tuple) -> None:
        if op in CRASH_OPS:
            self.images.append((f"before {op} #{len(self.images) + 1}", self.tree(), self.db))
            if len(self.images) == self.crash_at:
                self.crash_at = None
                raise ProcessCrash(f"crash before {op} #{len(self.images)}")
        self._victim = None
        self._skip = False
        if op in ("fsync", "commit"):
            site = _site()
            if op == "fsync" or args[0]:
                self.sites[site] = op
            self._skip = site in self.ignore
        elif op in ("unlink", "rmdir"):
            self._victim = os.lstat(args[0], dir_fd=args[1]).st_ino
        elif op == "rename":
            try:
                self._victim = os.lstat(args[1], dir_fd=args[3]).st_ino
            except FileNotFoundError:
                pass

    def after(self, op: str, args: tuple) -> None:
        if self._victim is not None:
            self.gen[self._victim] = self.gen.get(self._victim, 0) + 1
        if self._skip:
            return
        if op == "fsync":
            fd = args[0]
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                self._record_dir(fd)
            else:
                # The commit's descriptor is write-only: read through /proc.
                with open(f"/proc/self/fd/{fd}", "rb") as f:
                    data = f.read()
                self.files[self._id(st.st_ino)] = (stat_mod.S_IMODE(st.st_mode), data)
        elif op == "commit" and args[0]:
            self.db = _db_image(self.db_path)

    def finish(self) -> None:
        self.images.append(("after the commit returned", self.tree(), self.db))

    # -- the tree a power loss leaves -------------------------------------------

    def tree(self) -> dict:
        out: dict[bytes, tuple] = {}

        def walk(did: tuple, prefix: bytes) -> None:
            for name, (cid, kind) in self.dirs.get(did, {}).items():
                path = prefix + name
                if kind == "dir":
                    out[path] = ("dir", self.dir_modes.get(cid, 0o700), None)
                    walk(cid, path + b"/")
                elif kind == "symlink":
                    out[path] = ("symlink", None, self.links[cid])
                else:
                    out[path] = ("file", *self.files.get(cid, (0o600, b"")))

        walk(self.root_id, b"")
        return out


def recover_images(model: PowerLoss, t: Template, base: Path) -> tuple[list[str], dict[str, int]]:
    """Recover every image; returns (failures, how many ended OLD / NEW)."""
    failures, seen = [], {"OLD": 0, "NEW": 0}
    for i, (label, tree, db) in enumerate(model.images):
        ws_path = base / f"img{i}" / "ws"
        materialize(tree, db, ws_path)
        try:
            seen[check_recovered(ws_path, t)] += 1
        except AssertionError as exc:
            failures.append(f"power loss {label}: {exc}")
        shutil.rmtree(ws_path.parent)
    return failures, seen


def materialize(tree: dict, db_image: bytes, ws_path: Path) -> None:
    """Write a modelled post-power-loss workspace (tree plus store) to disk."""
    ws_path.mkdir(parents=True)
    root = os.fsencode(str(ws_path))
    dirs = []
    for path in sorted(tree):
        kind, mode, data = tree[path]
        full = os.path.join(root, path)
        if kind == "dir":
            os.mkdir(full, 0o755)
            dirs.append((full, mode))
        elif kind == "symlink":
            os.symlink(data, full)
        else:
            with open(full, "wb") as f:
                f.write(data)
            os.chmod(full, mode)
    for full, mode in reversed(dirs):
        os.chmod(full, mode)
    store = ws_path / ".stepfs"
    store.mkdir()
    (store / "store.db").write_bytes(db_image)


@contextmanager
def opened_upgraded(root: Path, snapshot, before):
    """The older store at ``root`` opened (which upgrades it) and checked:
    it records the current version, ``snapshot(ws)`` equals ``before``,
    and verify finds nothing wrong.  Yields the workspace."""
    from stepfs.store import verify

    with Workspace.open(str(root)) as ws:
        assert store_version(root) == str(schema.FORMAT_VERSION)
        assert snapshot(ws) == before
        report = verify.verify(ws)
        assert report.ok, report.problems
        yield ws


def store_version(root: Path) -> str:
    """The ``format_version`` a workspace's store records (read without stepfs)."""
    raw = sqlite3.connect(root / ".stepfs" / "store.db")
    try:
        return raw.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone()[0]
    finally:
        raw.close()


def upgrade_killed_at_every_durable_call(old_store: Path, tmp: Path, old: str, new: str, snapshot, want) -> None:
    """Open a copy of the workspace ``old_store`` (format ``old``) once per
    durable call of its upgrade, killed at that call: each leaves format
    ``old`` or ``new``, and reopened (upgraded then) it gives ``snapshot``
    equal to ``want`` and a clean verify; the last run completes."""
    from stepfs.store import verify

    def open_store(root: Path) -> None:
        Workspace.open(str(root), recover=False).close()

    counter = Counter()
    count = tmp / "count"
    shutil.copytree(old_store, count, symlinks=True)
    with durable.installed(counter):
        open_store(count)
    assert store_version(count) == new and counter.durable_commits, counter.trace
    seen = set()
    for k in range(1, counter.n + 2):
        run = tmp / f"run{k}"
        shutil.copytree(old_store, run, symlinks=True)

        def body() -> None:
            with durable.installed(KillAt(k)):
                open_store(run)

        outcome = fork_run(body)
        assert outcome == ("completed" if k == counter.n + 1 else "killed"), k
        got = store_version(run)
        assert got in (old, new), (k, got)
        seen.add(got)
        with Workspace.open(str(run)) as ws:  # an old store is upgraded now
            assert snapshot(ws) == want, k
            assert verify.verify(ws).ok, k
        shutil.rmtree(run)
    assert seen == {old, new}  # killed before the COMMIT, and completed
