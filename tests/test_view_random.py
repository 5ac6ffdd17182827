"""Seeded random operation sequences against the overlay view and a plain
shadow directory (no kernel).

Every operation is applied to the :class:`Overlay` the way ``fuse_ops.py``
would, and to a shadow directory on disk with ``os.*``; both must succeed,
or fail with the same errno.  Every few operations the whole view (walked
with readdir/getattr/read/readlink) must equal the shadow; handles kept
open across operations must read what the shadow's descriptors read.  Now
and then the step is committed (the workspace must then equal the shadow)
or the view is restarted.  At the end everything is committed and the
workspace must equal the shadow.  Each seed also draws its own mix of
operations, and half of the picks aim at open files and their directories.

A failure prints the seed and the operations that led to it.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat as stat_mod
from pathlib import Path

import pytest

from conftest import manifest
from stepfs.overlayfs.core import errors as view_errors
from stepfs.overlayfs.core.view import RENAME_NOREPLACE
from stepfs.store.errors import NothingToCommit
from viewkit import open_view, orphan_scratch, read_fh, reopen, view_manifest

#: The view's refusals as the errno the FUSE adapter turns them into.
ERRNO = {
    view_errors.NotFound: errno.ENOENT, view_errors.Exists: errno.EEXIST,
    view_errors.NotEmpty: errno.ENOTEMPTY, view_errors.NotADirectory: errno.ENOTDIR,
    view_errors.IsADirectory: errno.EISDIR, view_errors.Invalid: errno.EINVAL,
    view_errors.ReadOnly: errno.EROFS, view_errors.Unsupported: errno.EPERM,
    view_errors.Reserved: errno.EEXIST, view_errors.BadHandle: errno.EBADF,
}

NAMES = ["a", "b", "c", "dd", os.fsdecode(b"n\xff")]  # one name that is not UTF-8
MAX_DEPTH = 3
OPS = 300
CHECK_EVERY = 20
SEEDS = list(range(1, 13))


def errno_of(exc: BaseException) -> int:
    if isinstance(exc, OSError):
        return exc.errno
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]
    raise exc


def random_bytes(rng: random.Random) -> bytes:
    n = rng.choice([0, 1, 7, 100, 1000, 5000, 70_000])
    if rng.random() < 0.3:
        return bytes(n)  # zeros: holes and deduplicated chunks
    return rng.randbytes(n)


class Run:
    """One random sequence: the view, the shadow, open handle pairs."""

    def __init__(self, tmp_path: Path, seed: int, deferred: bool = False):
        self.rng = random.Random(seed)
        self.seed = seed
        ws_dir = tmp_path / "ws"
        ws_dir.mkdir()
        self.shadow = os.fsencode(str(tmp_path / "shadow"))
        self._seed_tree(ws_dir)
        shutil.copytree(ws_dir, tmp_path / "shadow", symlinks=True)
        # Staged rows written at every change, or recorded and written at
        # close-writes and commits only (view.py, "Staged rows and crashes").
        self.deferred = deferred
        self.ws, self.view = open_view(tmp_path, row_delay=None if deferred else 0.0)
        self.handles: list[tuple[int, int, bool, str]] = []  # (fh, shadow fd, writable, opened as)
        self.log: list[str] = []
        self.commits = 0

    # -- the tree -----------------------------------------------------------

    def _seed_tree(self, root: Path) -> None:
        rng = self.rng
        for top in ("a", "b", "c"):
            d = root / top
            d.mkdir()
            for name in rng.sample(NAMES, 3):
                p = os.path.join(os.fsencode(str(d)), os.fsencode(name))
                kind = rng.choice(["file", "file", "dir", "symlink"])
                if kind == "file":
                    with open(p, "wb") as f:
                        f.write(random_bytes(rng))
                elif kind == "dir":
                    os.mkdir(p)
                    with open(os.path.join(p, b"leaf"), "wb") as f:
                        f.write(b"leaf " + name.encode(errors="surrogateescape"))
                else:
                    os.symlink(b"../" + os.fsencode(rng.choice(NAMES)), p)
        (root / "dd").write_bytes(b"top-level file\n")

    def s(self, path: str) -> bytes:
        """Shadow path of a view path."""
        return self.shadow + os.fsencode(path) if path != "/" else self.shadow

    def entries(self) -> dict[str, str]:
        """``{view path: kind}`` of everything in the shadow (root included)."""
        out = {"/": "dir"}
        for dirpath, dirnames, filenames in os.walk(self.shadow):
            rel = os.fsdecode(dirpath[len(self.shadow):]) or ""
            for name in dirnames + filenames:
                path = rel + "/" + os.fsdecode(name)
                st = os.lstat(self.s(path))
                out[path] = ("dir" if stat_mod.S_ISDIR(st.st_mode) else
                             "symlink" if stat_mod.S_ISLNK(st.st_mode) else "file")
        return out

    def pick(self, kinds: tuple[str, ...]) -> str | None:
        """An existing path of one of ``kinds``; often a file that is open, or
        the directory of one, since that is where the view is subtle."""
        entries = self.entries()
        if self.handles and self.rng.random() < 0.5:
            path = self.view.handles[self.rng.choice(self.handles)[0]].path
            if self.rng.random() < 0.4:  # the directory of an open file, or one above it
                parts = path.split("/")
                path = "/".join(parts[:self.rng.randrange(2, len(parts))]) if len(parts) > 2 else path
            if entries.get(path) in kinds:
                return path
        cands = sorted(p for p, k in entries.items() if k in kinds and p != "/")
        return self.rng.choice(cands) if cands else None

    def new_path(self) -> str:
        """A name in an existing directory: new, or sometimes an existing one."""
        parents = [p for p, k in self.entries().items() if p == "/" or (k == "dir" and p.count("/") < MAX_DEPTH)]
        parent = self.rng.choice(sorted(parents))
        return (parent if parent != "/" else "") + "/" + self.rng.choice(NAMES)

    # -- running an operation on both sides ---------------------------------------

    def both(self, desc: str, on_view, on_shadow) -> None:
        """Run one operation on both sides; same success or same errno."""
        self.log.append(desc)
        view_err = shadow_err = None
        try:
            on_shadow()
        except OSError as exc:
            shadow_err = exc.errno
        try:
            on_view()
        except (view_errors.ViewError, OSError) as exc:
            view_err = errno_of(exc)
        if shadow_err is not None:
            self.log[-1] += f" -> {errno.errorcode[shadow_err]}"
        assert view_err == shadow_err, self.report(
            f"{desc}: view errno {view_err and errno.errorcode[view_err]}, "
            f"shadow errno {shadow_err and errno.errorcode[shadow_err]}")

    def report(self, what: str) -> str:
        tail = "\n  ".join(self.log[-40:])
        return f"seed {self.seed}, op {len(self.log)}: {what}\nlast operations:\n  {tail}"

    # -- operations ---------------------------------------------------------------

    def op_write_new(self) -> None:
        path, data = self.new_path(), random_bytes(self.rng)
        mode = self.rng.choice([0o644, 0o600, 0o755])
        if self.entries().get(path) == "symlink":
            return  # open() would follow it; the kernel resolves symlinks before the view sees them

        def v():
            fh = self.view.create(path, mode, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                self.view.write(fh, data, 0)
                self.view.flush(fh)
            finally:
                self.view.release(fh)

        def s():
            existed = os.path.lexists(self.s(path))
            fd = os.open(self.s(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            try:
                if not existed:
                    os.fchmod(fd, mode)  # no umask, like the mode FUSE hands over
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)

        self.both(f"write {path!r} {len(data)} bytes mode {mode:o}", v, s)

    def op_write_at(self) -> None:
        path = self.pick(("file",))
        if path is None:
            return
        data = random_bytes(self.rng)[:3000] or b"x"
        size = os.lstat(self.s(path)).st_size
        offset = self.rng.randrange(0, size + 2000)

        def v():
            fh = self.view.open(path, os.O_RDWR)
            try:
                self.view.write(fh, data, offset)
                self.view.flush(fh)
            finally:
                self.view.release(fh)

        def s():
            fd = os.open(self.s(path), os.O_RDWR)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        self.both(f"pwrite {path!r} {len(data)} at {offset}", v, s)

    def op_append(self) -> None:
        path = self.pick(("file",))
        if path is None:
            return
        data = self.rng.randbytes(self.rng.randrange(1, 500))

        def v():
            fh = self.view.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                self.view.write(fh, data, self.view.getattr(path, fh)["st_size"])
                self.view.flush(fh)
            finally:
                self.view.release(fh)

        def s():
            fd = os.open(self.s(path), os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

        self.both(f"append {path!r} {len(data)}", v, s)

    def op_truncate(self) -> None:
        path = self.pick(("file", "dir"))
        if path is None:
            return
        length = self.rng.choice([0, 1, 10, 4096, 100_000])
        self.both(f"truncate {path!r} {length}", lambda: self.view.truncate(path, length),
                  lambda: os.truncate(self.s(path), length))

    def op_rename(self, kinds: tuple[str, ...]) -> None:
        src = self.pick(kinds)
        if src is None:
            return
        if self.rng.random() < 0.4:
            dst = self.pick(("file", "dir", "symlink")) or self.new_path()
        else:
            dst = self.new_path()
        if self.rng.random() < 0.15 and stat_mod.S_ISDIR(os.lstat(self.s(src)).st_mode):
            dst = src + "/" + self.rng.choice(NAMES)  # into itself
        noreplace = self.rng.random() < 0.2

        def s():
            if noreplace and os.path.lexists(self.s(dst)):
                raise OSError(errno.EEXIST, "exists")
            os.rename(self.s(src), self.s(dst))

        self.both(f"rename {src!r} -> {dst!r}{' NOREPLACE' if noreplace else ''}",
                  lambda: self.view.rename(src, dst, RENAME_NOREPLACE if noreplace else 0), s)

    def op_unlink(self) -> None:
        path = self.pick(("file", "symlink", "file", "dir"))
        if path is None:
            return
        self.both(f"unlink {path!r}", lambda: self.view.unlink(path), lambda: os.unlink(self.s(path)))

    def op_mkdir(self) -> None:
        path = self.new_path()
        mode = self.rng.choice([0o755, 0o700, 0o750])

        def s():
            os.mkdir(self.s(path), mode)
            os.chmod(self.s(path), mode)

        self.both(f"mkdir {path!r} {mode:o}", lambda: self.view.mkdir(path, mode), s)

    def op_rmdir(self) -> None:
        path = self.pick(("dir", "dir", "file"))
        if path is None:
            return
        self.both(f"rmdir {path!r}", lambda: self.view.rmdir(path), lambda: os.rmdir(self.s(path)))

    def op_symlink(self) -> None:
        path = self.new_path()
        target = self.rng.choice(["a", "../b", "/etc/passwd", os.fsdecode(b"t\xfe"), "dd/a"])
        self.both(f"symlink {path!r} -> {target!r}", lambda: self.view.symlink(path, target),
                  lambda: os.symlink(os.fsencode(target), self.s(path)))

    def op_chmod(self) -> None:
        path = self.pick(("file", "dir"))
        if path is None:
            return
        is_dir = stat_mod.S_ISDIR(os.lstat(self.s(path)).st_mode)
        mode = self.rng.choice([0o700, 0o755, 0o750] if is_dir else [0o600, 0o644, 0o755, 0o400])
        self.both(f"chmod {path!r} {mode:o}", lambda: self.view.chmod(path, mode),
                  lambda: os.chmod(self.s(path), mode))

    def op_replace_open_file(self) -> None:
        """Rename another file over a file that is open (the save-by-rename
        of an editor while a reader holds the old file)."""
        entries = self.entries()
        open_files = sorted({self.view.handles[fh].path for fh, *_ in self.handles} & {
            p for p, k in entries.items() if k == "file"})
        srcs = sorted(p for p, k in entries.items() if k == "file" and p not in open_files)
        if not open_files or not srcs:
            return
        path, src = self.rng.choice(open_files), self.rng.choice(srcs)
        self.both(f"rename {src!r} -> {path!r} (over an open file)", lambda: self.view.rename(src, path),
                  lambda: os.rename(self.s(src), self.s(path)))

    # -- long-lived handles ----------------------------------------------------------

    def op_open_keep(self) -> None:
        if len(self.handles) >= 4:
            return
        path = self.pick(("file",))
        if path is None:
            return
        writable = self.rng.random() < 0.6
        flags = os.O_RDWR if writable else os.O_RDONLY
        self.log.append(f"open {path!r} {'rw' if writable else 'ro'} (kept)")
        fd = os.open(self.s(path), flags)
        fh = self.view.open(path, flags)
        self.handles.append((fh, fd, writable, path))

    def _handle(self) -> tuple[int, int, bool, str] | None:
        return self.rng.choice(self.handles) if self.handles else None

    def op_handle_write(self) -> None:
        h = self._handle()
        if h is None or not h[2]:
            return
        fh, fd, _w, opened = h
        data = self.rng.randbytes(self.rng.randrange(1, 300))
        offset = self.rng.randrange(0, os.fstat(fd).st_size + 100)
        self.log.append(f"handle write ({opened!r}) {len(data)} at {offset}")
        os.pwrite(fd, data, offset)
        self.view.write(fh, data, offset)

    def op_handle_truncate(self) -> None:
        h = self._handle()
        if h is None or not h[2]:
            return
        fh, fd, _w, opened = h
        length = self.rng.choice([0, 5, 50, 3000])
        self.log.append(f"handle truncate ({opened!r}) {length}")
        os.ftruncate(fd, length)
        # ftruncate(2) on a FUSE file: setattr with the handle and the path it has now.
        self.view.truncate(self.view.handles[fh].path, length, fh)

    def op_handle_read(self) -> None:
        h = self._handle()
        if h is None:
            return
        fh, fd, _w, opened = h
        self.log.append(f"handle read ({opened!r})")
        expected = os.pread(fd, 1 << 24, 0)
        assert read_fh(self.view, fh) == expected, self.report(f"handle on {opened!r} reads other bytes")
        # fstat(2) through the handle, whatever happened to its path
        assert self.view.getattr(self.view.handles[fh].path, fh)["st_size"] == len(expected), \
            self.report(f"fstat of the handle on {opened!r}")

    def op_handle_flush(self) -> None:
        """close() of a dup'ed descriptor: a flush without release."""
        h = self._handle()
        if h is None:
            return
        self.log.append(f"handle flush ({h[3]!r})")
        self.view.flush(h[0])

    def op_handle_close(self) -> None:
        h = self._handle()
        if h is None:
            return
        self.handles.remove(h)
        fh, fd, _w, opened = h
        self.log.append(f"handle close ({opened!r})")
        os.close(fd)
        self.view.flush(fh)
        self.view.release(fh)

    def close_all(self) -> None:
        while self.handles:
            fh, fd, _w, opened = self.handles.pop()
            self.log.append(f"handle close ({opened!r})")
            os.close(fd)
            self.view.flush(fh)
            self.view.release(fh)

    # -- step and restart ----------------------------------------------------------

    def op_commit(self) -> None:
        # Writes through open handles reach a step at their close; flush
        # them (as a dup'ed descriptor's close would) so the step holds
        # what the shadow holds.
        for fh, _fd, writable, _o in self.handles:
            if writable:
                self.view.flush(fh)
        self.log.append("commit")
        try:
            self.view.commit(message=f"step {self.commits}")
            self.commits += 1
        except NothingToCommit:
            pass
        assert manifest(Path(os.fsdecode(self.ws.path))) == manifest(Path(os.fsdecode(self.shadow))), \
            self.report("workspace differs from the shadow after a commit")
        open_nodes = {h.path for h in self.view.handles.values() if h.node is not None}
        left = set(self.view.upper.nodes) - open_nodes
        assert not left, self.report(f"upper not empty after commit: {sorted(left)} (open: {sorted(open_nodes)})")

    def op_restart(self) -> None:
        self.close_all()
        self.log.append("restart")
        if self.deferred:
            # A daemon that died after writing its rows: the store must then
            # hold exactly the view, however the recorded changes coalesced.
            self.view.sync_rows()
        self.view = reopen(self.view)

    # -- checking -------------------------------------------------------------------

    def check(self) -> None:
        got = view_manifest(self.view)
        want = manifest(Path(os.fsdecode(self.shadow)))
        if got != want:
            diff = [f"{p!r}: view {got.get(p)!r:.120} shadow {want.get(p)!r:.120}"
                    for p in sorted(set(got) | set(want)) if got.get(p) != want.get(p)]
            raise AssertionError(self.report("view differs from the shadow:\n    " + "\n    ".join(diff)))

    def run(self, n_ops: int) -> None:
        ops = [
            (self.op_write_new, 10), (self.op_write_at, 6), (self.op_append, 4), (self.op_truncate, 4),
            (lambda: self.op_rename(("file", "symlink")), 8), (lambda: self.op_rename(("dir",)), 5),
            (self.op_unlink, 6), (self.op_mkdir, 6), (self.op_rmdir, 4), (self.op_symlink, 3),
            (self.op_chmod, 4), (self.op_open_keep, 6), (self.op_handle_write, 3),
            (self.op_handle_truncate, 1), (self.op_handle_read, 6), (self.op_handle_flush, 2),
            (self.op_handle_close, 2), (self.op_commit, 2), (self.op_restart, 1),
            (self.op_replace_open_file, 3),
        ]
        funcs = [f for f, _w in ops]
        # Each seed also draws its own mix of operations, so that the seeds
        # explore different corners (many open handles, many commits, ...).
        weights = [w * self.rng.choice([0.3, 1, 3]) for _f, w in ops]
        for i in range(1, n_ops + 1):
            try:
                self.rng.choices(funcs, weights)[0]()
            except AssertionError:
                raise
            except Exception as exc:  # a crash inside the view: show how we got there
                raise AssertionError(self.report(f"{type(exc).__name__}: {exc}")) from exc
            if i % CHECK_EVERY == 0:
                self.check()
        self.check()
        self.close_all()
        self.check()
        try:
            self.view.commit(message="final")
        except NothingToCommit:
            pass
        self.log.append("final commit")
        assert manifest(Path(os.fsdecode(self.ws.path))) == manifest(Path(os.fsdecode(self.shadow))), \
            self.report("workspace differs from the shadow after the final commit")
        self.check()
        assert len(self.view.upper) == 0
        assert orphan_scratch(self.view) == [], self.report("scratch files nothing refers to")


@pytest.mark.parametrize("rows", ["at-once", "deferred"])
@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_match_a_plain_directory(tmp_path, seed, rows):
    Run(tmp_path, seed, deferred=rows == "deferred").run(OPS)
