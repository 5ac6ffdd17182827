"""Version tokens in the overlay core, without a kernel (issue 3).

The :class:`overlayfs.view.Overlay` is driven the way the FUSE adapter
drives it: every namespace and open call carries the calling agent
(``agent=``), a ``close(2)`` is a ``flush`` followed, for the last
descriptor of an open file, by a ``release``.  An editor outside the mount
is plain ``os.*`` on the workspace directory.

The first half is S1 as a model check: 1,000 seeded, deterministic random
interleavings of open / write / dup / close / read / rename / unlink /
external edit / commit with two or three agents, each step compared with a
small reference model of the semantics (DESIGN.md 3-6):

* a path has a *published* version; every change of it (a winning close, an
  external edit, a rename or unlink) gives it a new version number;
* a write-open fails ``Stale`` when the agent last observed another version;
  it starts a draft (shared by the agent's handles, kept while it is the
  current version) from the published one; a new handle never shares a
  draft of an outdated version; a handle remembers the version it was opened
  on and reads the agent's draft only if that draft is of the same version
  (a read handle joins its own agent's draft of its version when the draft
  starts or is reused, and keeps reading it after the draft's close: POSIX
  inside one agent; other agents' handles keep the version they opened);
* a close-write wins iff its draft's base is still the published version,
  publishes the draft's bytes (nothing if they equal the published bytes),
  and otherwise fails ``Stale`` and stores the draft's bytes as a conflict;
  later flushes of the same open file repeat the decision;
* the acting agent's drafts follow its own rename and are detached by its
  own unlink or by its rename over them (its descriptors keep working,
  POSIX-style); an outdated draft or observation stays outdated through it;
* a commit changes no version, except that a staged row equal to the
  workspace file is dropped and the path is at the workspace file's own
  version again (same bytes: whoever held it is current again).

Invariants checked after every step: every flush succeeds or raises
``Stale`` and exactly when the model says; of two drafts from one version at
most one close wins; what a fresh reader sees is the model's published
content; every losing close has a conflict row holding exactly its bytes
(and there are no other rows); after each commit the workspace holds the
model's files.  A failure prints the seed and the trace.

The second half holds the focused scenarios (S1-S4, S6, S7, unchanged
rewrites, ``--require-read``, commits by the same view, racy tokens).
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

import pytest
from sqlalchemy import select

from stepfs.overlayfs.core.errors import NotFound, NotObserved, Stale
from stepfs.overlayfs.core.view import Overlay
from stepfs.store import schema, tokens
from stepfs.store.errors import NothingToCommit
from stepfs.store.workspace import Workspace

from conftest import needs_multigrain

RO, RW = os.O_RDONLY, os.O_RDWR


# -- helpers --------------------------------------------------------------------------


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    w = Workspace.open(str(root), create=True)
    try:
        yield w
    finally:
        w.close()


def put(ws: Workspace, name: str, data: bytes) -> None:
    """Write a workspace file the way a test's setup (or an editor) does."""
    with open(os.path.join(ws.path, name), "wb") as f:
        f.write(data)


def read_ws(ws: Workspace, name: str) -> bytes | None:
    try:
        with open(os.path.join(ws.path, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def cat(ov: Overlay, path: str, agent: str) -> bytes:
    """Open, read whole, close: what ``cat`` in that agent does."""
    fh = ov.open(path, RO, agent=agent)
    try:
        return ov.read(fh, 1 << 20, 0)
    finally:
        ov.release(fh)


def close(ov: Overlay, fh: int) -> None:
    """``close(2)`` of the last descriptor: flush, then release."""
    try:
        ov.flush(fh)
    finally:
        ov.release(fh)


def write_file(ov: Overlay, path: str, data: bytes, agent: str) -> None:
    """``open(O_WRONLY|O_TRUNC)``, write, close: what ``echo > f`` does."""
    fh = ov.open(path, os.O_WRONLY | os.O_TRUNC, agent=agent)
    try:
        ov.write(fh, data, 0)
    except BaseException:
        ov.release(fh)
        raise
    close(ov, fh)


def conflict_rows(ws: Workspace, mount: str) -> list[tuple[str, str, bytes]]:
    """``[(path, agent, losing bytes)]`` of a mount's conflicts, oldest first."""
    c = schema.conflicts
    with ws.db.read() as conn:
        rows = conn.execute(select(c.c.path, c.c.agent, c.c.oid).where(c.c.mount == mount).order_by(c.c.id)).all()
        return [("/" + os.fsdecode(bytes(r.path)), r.agent, ws.objects.read_all(conn, r.oid)) for r in rows]


# -- S1: the model check ------------------------------------------------------------------

TAG_LEN = 12  # every write and every editor save is a fresh tag of this length


class WsFile:
    """A workspace inode: in-place edits change it, a save-by-rename replaces it."""

    def __init__(self, data: bytes):
        self.data = data


@dataclass(eq=False)
class MDraft:
    agent: str
    path: str
    base: int  # the published version it started from (or last published)
    content: bytes
    dirty: bool = False
    stale: bool = False
    detached: bool = False
    opens: int = 0


@dataclass(eq=False)
class MHandle:
    fh: int
    agent: str
    path: str
    writable: bool
    ver: int  # the version it was opened on
    draft: MDraft | None = None
    snap: WsFile | bytes | None = None  # what a handle without a draft reads
    wrote: bool = False
    result: str | None = None
    fds: int = 1  # descriptors sharing this open file (dup / fork)


class Interleaving:
    """One seeded random run against one fresh view; raises AssertionError
    (with the seed and the trace) at the first disagreement with the model."""

    AGENTS = ["default", "x", "y"]
    OBSERVER = "observer"  # only ever reads: what "everybody" sees

    def __init__(self, ws: Workspace, seed: int, steps: int = 30):
        self.ws = ws
        self.seed = seed
        self.rng = random.Random(seed)
        self.steps = steps
        self.agents = self.AGENTS[: self.rng.choice([2, 3])]
        self.dir = f"s{seed}"
        os.mkdir(os.path.join(ws.path, self.dir))
        self.paths = [f"/{self.dir}/{n}" for n in "abc"]
        self.tags = itertools.count(1)
        self.versions = itertools.count(1)
        self.trace: list[str] = []
        self.content: dict[str, bytes | None] = {}
        self.ver: dict[str, int] = {}
        self.wsfile: dict[str, WsFile | None] = {}
        self.wsver: dict[str, int] = {}  # the version the workspace file holds
        for p, initial in zip(self.paths, [self.tag("i"), None, self.tag("i")]):
            self.wsfile[p] = None
            if initial is not None:
                put(ws, p[1:], initial)
                self.wsfile[p] = WsFile(initial)
            self.content[p] = initial
            self.ver[p] = self.wsver[p] = next(self.versions)
        self.mount = f"/mnt/{self.dir}"
        self.ov = Overlay(ws, self.mount)
        self.upper: set[str] = set()  # paths the open step shadows
        self.created: set[str] = set()  # created, not yet closed by the creator (unstaged)
        self.rows: dict[str, bytes | None] = {}  # the step's staged rows: content, or None = deletion
        self.obs: dict[str, dict[str, int]] = {a: {} for a in self.agents}
        self.drafts: dict[tuple[str, str], MDraft] = {}  # the draft each agent's next open shares
        self.handles: list[MHandle] = []
        self.conflicts: list[tuple[str, str, bytes]] = []  # (path, agent, losing bytes), in order
        self.conflicts_checked = 0
        self.wins: set[tuple[str, int]] = set()  # (path, base version) of every winning publish

    # model helpers
    def tag(self, who: str) -> bytes:
        return f"{who}{next(self.tags):0{TAG_LEN - len(who) - 1}d}\n".encode()

    def bump(self, path: str) -> None:
        self.ver[path] = next(self.versions)

    def check(self, cond: bool, what: str) -> None:
        if not cond:
            raise AssertionError(f"seed {self.seed}: {what}\ntrace:\n  " + "\n  ".join(self.trace))

    def expect_raises(self, exc_type, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except exc_type:
            return
        self.check(False, f"expected {exc_type.__name__} from {fn.__name__}{args}")

    # the run
    def run(self) -> None:
        ops = [(self.op_open_write, 22), (self.op_open_read, 10), (self.op_write, 25), (self.op_close, 20),
               (self.op_dup, 3), (self.op_read, 8), (self.op_rename, 5), (self.op_external, 7),
               (self.op_unlink, 2), (self.op_commit, 2)]
        funcs, weights = zip(*ops)
        for _ in range(self.steps):
            self.rng.choices(funcs, weights)[0]()
            self.check_published()
        while self.handles:
            self.op_close(self.handles[0])
            self.check_published()
        self.check(conflict_rows(self.ws, self.mount) == self.conflicts, "conflict rows differ from the losing closes")
        self.op_commit(final=True)
        self.ov.close()

    def check_published(self) -> None:
        for p in self.paths:
            try:
                got = cat(self.ov, p, self.OBSERVER)
            except NotFound:
                got = None
            self.check(got == self.content[p], f"published {p} is {got!r}, model says {self.content[p]!r}")
        if self.conflicts_checked != len(self.conflicts):  # a close lost: its bytes must be a conflict row now
            rows = conflict_rows(self.ws, self.mount)
            self.check(rows == self.conflicts, f"conflict rows {rows} differ from the losing closes {self.conflicts}")
            self.conflicts_checked = len(rows)

    def agent_and_path(self) -> tuple[str, str]:
        return self.rng.choice(self.agents), self.rng.choice(self.paths)

    # operations
    def op_open_write(self) -> None:
        agent, p = self.agent_and_path()
        trunc = self.rng.random() < 0.3
        flags = RW | (os.O_TRUNC if trunc else 0)
        if self.content[p] is None:
            self.trace.append(f"{agent}: create {p}")
            fh = self.ov.create(p, 0o644, flags | os.O_CREAT, agent=agent)
            self.drafts.pop((agent, p), None)  # an orphaned draft loses at its close
            self.content[p] = b""
            self.bump(p)
            self.upper.add(p)
            self.created.add(p)
            d = MDraft(agent, p, self.ver[p], b"", dirty=True)
            self.drafts[(agent, p)] = d
            self.obs[agent][p] = self.ver[p]
            h = MHandle(fh, agent, p, True, self.ver[p], draft=d, wrote=True)
        else:
            seen = self.obs[agent].get(p)
            stale = seen is not None and seen != self.ver[p]
            self.trace.append(f"{agent}: open {p} for writing{' O_TRUNC' if trunc else ''} (expect "
                              f"{'Stale' if stale else 'ok'})")
            if stale:
                self.expect_raises(Stale, self.ov.open, p, flags, agent=agent)
                return
            fh = self.ov.open(p, flags, agent=agent)
            d = self.drafts.get((agent, p))
            if d is not None and (d.stale or d.base != self.ver[p]):
                d = None  # a copy of an outdated version is never shared
            if d is None:
                d = self.drafts[(agent, p)] = MDraft(agent, p, self.ver[p], self.content[p])
            self.obs[agent][p] = d.base
            for r in self.handles:
                # POSIX inside one agent: its readers of this very version
                # hold the same file and read the draft from now on, also
                # after the draft's close.
                if r.agent == agent and r.path == p and not r.writable and r.draft is None and r.ver == d.base:
                    r.draft = d
                    d.opens += 1
            h = MHandle(fh, agent, p, True, d.base, draft=d)
            if trunc:
                d.content, d.dirty, h.wrote = b"", True, True
        h.draft.opens += 1
        self.handles.append(h)

    def op_open_read(self) -> None:
        agent, p = self.agent_and_path()
        self.trace.append(f"{agent}: open {p} for reading")
        if self.content[p] is None:
            self.expect_raises(NotFound, self.ov.open, p, RO, agent=agent)
            return
        fh = self.ov.open(p, RO, agent=agent)
        d = self.drafts.get((agent, p))
        if d is not None and (d.stale or d.base != self.ver[p]):
            if d.opens == 0:
                del self.drafts[(agent, p)]
            d = None  # a new open reads the published version, never an older one
        self.obs[agent][p] = self.ver[p]
        if d is not None:
            d.opens += 1
            h = MHandle(fh, agent, p, False, self.ver[p], draft=d)
        else:
            snap = self.content[p] if p in self.upper else self.wsfile[p]
            h = MHandle(fh, agent, p, False, self.ver[p], snap=snap)
        self.handles.append(h)

    def pick_handle(self, writable: bool = False) -> MHandle | None:
        pool = [h for h in self.handles if h.writable or not writable]
        return self.rng.choice(pool) if pool else None

    def op_write(self) -> None:
        h = self.pick_handle(writable=True)
        if h is None:
            return
        data = self.tag(h.agent[0])
        self.trace.append(f"{h.agent}: write {data!r} to fh {h.fh} ({h.path})")
        self.check(self.ov.write(h.fh, data, 0) == len(data), "short write")
        d = h.draft
        d.content = data + d.content[len(data):]
        d.dirty = h.wrote = True

    def op_dup(self) -> None:
        h = self.pick_handle()
        if h is not None:
            self.trace.append(f"{h.agent}: dup fh {h.fh}")
            h.fds += 1

    def op_read(self) -> None:
        h = self.pick_handle()
        if h is None:
            return
        self.trace.append(f"{h.agent}: read fh {h.fh} ({h.path})")
        if h.draft is None:
            d = self.drafts.get((h.agent, h.path))
            now = self.ver[h.path]
            if d is not None and d.opens > 0 and not d.stale and d.base == now and h.ver == now:
                h.draft = d  # POSIX inside one agent: its own unpublished writes to the same file
                d.opens += 1
        if h.draft is not None:
            want = h.draft.content
        else:
            want = h.snap.data if isinstance(h.snap, WsFile) else h.snap
        got = self.ov.read(h.fh, 1 << 16, 0)
        self.check(got == want, f"fh {h.fh} read {got!r}, model says {want!r}")

    def decide(self, d: MDraft) -> str:
        """The model's compare-and-swap."""
        if d.stale:
            return "stale"
        if d.detached or not d.dirty:
            d.dirty = False
            return "ok"
        d.dirty = False
        if d.base != self.ver[d.path]:
            d.stale = True
            self.conflicts.append((d.path, d.agent, d.content))
            return "stale"
        if d.path in self.created:
            self.created.discard(d.path)
            self.rows[d.path] = d.content  # a new file is a change even when empty
        if d.content != self.content[d.path]:
            self.check((d.path, d.base) not in self.wins, f"two closes won from one version of {d.path}")
            self.wins.add((d.path, d.base))
            self.content[d.path] = d.content
            self.rows[d.path] = d.content
            self.bump(d.path)
            self.upper.add(d.path)
            d.base = self.ver[d.path]
            self.obs[d.agent][d.path] = d.base
        return "ok"

    def op_close(self, h: MHandle | None = None) -> None:
        h = h or self.pick_handle()
        if h is None:
            return
        raised = None
        expect = None
        if h.writable:
            if h.wrote:
                h.wrote = False
                h.result = self.decide(h.draft)
            expect = h.result == "stale" or (h.result is None and h.draft.stale)
        self.trace.append(f"{h.agent}: close fh {h.fh} ({h.path}) (expect {'Stale' if expect else 'ok'})")
        try:
            self.ov.flush(h.fh)
        except Stale:
            raised = "stale"
        # any other exception fails the test as it is: a flush either succeeds or raises Stale
        self.check(bool(raised) == bool(expect), f"flush of fh {h.fh} raised {raised}, expected {expect}")
        h.fds -= 1
        if h.fds:
            return
        self.ov.release(h.fh)  # never raises
        self.handles.remove(h)
        d = h.draft
        if d is not None:
            d.opens -= 1
            if d.opens == 0 and (d.stale or d.detached) and self.drafts.get((d.agent, d.path)) is d:
                del self.drafts[(d.agent, d.path)]

    def detach_own(self, agent: str, path: str) -> None:
        d = self.drafts.pop((agent, path), None)
        if d is not None:
            d.detached = True

    def op_rename(self) -> None:
        agent = self.rng.choice(self.agents)
        src, dst = self.rng.sample(self.paths, 2)
        self.trace.append(f"{agent}: rename {src} -> {dst}")
        if self.content[src] is None:
            self.expect_raises(NotFound, self.ov.rename, src, dst, 0, agent=agent)
            return
        self.ov.rename(src, dst, 0, agent=agent)
        if src not in self.upper:
            # Copy-up first: the same version gets a new representation; whoever
            # holds the current one holds the new one (the workspace file's own
            # version is then held by nobody).
            self.relabel(src, self.ver[src], next(self.versions))
        current = {d: d.base == self.ver[src] for (a, p), d in self.drafts.items() if a == agent and p == src}
        fresh_handles = [h for h in self.handles if h.agent == agent and h.path == src and h.ver == self.ver[src]]
        seen = self.obs[agent].get(src)
        seen_stale = seen is not None and seen != self.ver[src]
        if self.content[dst] is not None:
            self.detach_own(agent, dst)  # it replaced its own file: POSIX keeps the descriptor, drops the bytes
        else:
            self.drafts.pop((agent, dst), None)  # its file was removed by someone else: it loses at its close
        self.content[dst], self.content[src] = self.content[src], None
        self.bump(src)
        self.bump(dst)
        self.upper.add(dst)
        self.rows[dst] = self.content[dst]
        self.created.discard(dst)
        self.created.discard(src)
        self.remove(src)
        for d, was_current in current.items():
            del self.drafts[(agent, src)]
            d.path = dst
            if was_current:
                d.base = self.ver[dst]
            self.drafts[(agent, dst)] = d
        for h in self.handles:
            if h.agent == agent and h.path == src:
                h.path = dst
                if h in fresh_handles:
                    h.ver = self.ver[dst]
        seen = self.obs[agent].pop(src, None)
        # An outdated observation stays outdated at the new name.
        self.obs[agent][dst] = seen if seen_stale else self.ver[dst]

    def op_unlink(self) -> None:
        agent, p = self.agent_and_path()
        self.trace.append(f"{agent}: unlink {p}")
        if self.content[p] is None:
            self.expect_raises(NotFound, self.ov.unlink, p, agent=agent)
            return
        self.ov.unlink(p, agent=agent)
        self.detach_own(agent, p)
        self.content[p] = None
        self.bump(p)
        self.created.discard(p)
        self.remove(p)

    def remove(self, p: str) -> None:
        """A path leaves the view: a staged deletion if the workspace has it."""
        if self.wsfile[p] is not None:
            self.upper.add(p)  # a whiteout
            self.rows[p] = None
        else:
            self.upper.discard(p)
            self.rows.pop(p, None)

    def op_external(self) -> None:
        """An editor working directly in the workspace (only where the mount
        shows the workspace file: the open step shadows the others)."""
        candidates = [p for p in self.paths if p not in self.upper]
        if not candidates:
            return
        p = self.rng.choice(candidates)
        full = os.path.join(self.ws.path, p[1:])
        data = self.tag("e")
        f = self.wsfile[p]
        kind = self.rng.choice(["inplace", "utime", "replace", "delete"] if f is not None else ["create"])
        self.trace.append(f"editor: {kind} {p} {data!r}")
        if kind in ("inplace", "utime"):
            st = os.stat(full)
            fd = os.open(full, os.O_WRONLY)
            try:
                os.pwrite(fd, data, 0)  # same size (all tags are), same inode, same clock tick
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
            if kind == "utime":
                os.utime(full, ns=(st.st_atime_ns, st.st_mtime_ns))
            f.data = data
        elif kind == "delete":
            os.unlink(full)
            self.wsfile[p] = None
            data = None
        else:  # create, or save by rename (new inode)
            tmp = full + ".save~"
            with open(tmp, "wb") as out:
                out.write(data)
            os.rename(tmp, full)
            self.wsfile[p] = WsFile(data)
        self.content[p] = data
        self.bump(p)
        self.wsver[p] = self.ver[p]

    def revert(self, p: str) -> None:
        """A no-op row is dropped and the path's token is the untouched
        workspace file's again: whoever holds that older version is current
        again (same bytes, nothing to lose), and so is whoever held the
        staged one."""
        self.relabel(p, self.ver[p], self.wsver[p])
        self.wins = {(q, base) for q, base in self.wins if q != p or base != self.ver[p]}  # it may win again

    def relabel(self, p: str, old: int, new: int) -> None:
        self.ver[p] = new
        for seen in self.obs.values():
            if seen.get(p) == old:
                seen[p] = new
        for (_a, path), d in self.drafts.items():
            if path == p and d.base == old:
                d.base = new
        for h in self.handles:
            if h.path == p and h.ver == old:
                h.ver = new

    def op_commit(self, final: bool = False) -> None:
        """``stepfs step``: the staged rows become the workspace; files
        created but not closed yet stay in the open step."""
        changes = {p for p, data in self.rows.items() if data != (self.wsfile[p].data if self.wsfile[p] else None)}
        self.trace.append(f"commit (model: {sorted(changes)} change)")
        try:
            self.ov.commit("s1")
            committed = True
        except NothingToCommit:
            committed = False
        self.check(committed == bool(changes), f"commit {'succeeded' if committed else 'refused'}")
        for p, data in self.rows.items():
            if p in changes:
                self.wsfile[p] = WsFile(data) if data is not None else None
                self.wsver[p] = self.ver[p]
            elif data is not None:
                self.revert(p)
        self.upper -= set(self.rows) - self.created
        self.rows.clear()
        for p in self.paths:
            want = self.wsfile[p].data if self.wsfile[p] else None
            self.check(read_ws(self.ws, p[1:]) == want, f"workspace {p} after commit differs from the model")
        # the view's commit must not have moved anybody's version
        if final:
            self.check_published()


@pytest.fixture(scope="module")
def shared_ws(tmp_path_factory):
    """One workspace for all interleavings (each gets its own directory and
    mountpoint name).  Commits here skip ``os.fsync``: durability is tested
    with the commit protocol, and 1,000 runs of fsyncs would cost a minute."""
    root = tmp_path_factory.mktemp("s1") / "ws"
    root.mkdir()
    w = Workspace.open(str(root), create=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        try:
            yield w
        finally:
            w.close()


@pytest.mark.parametrize("block", range(10))
def test_s1_random_interleavings(shared_ws, block):
    """S1 in process: 10 blocks x 100 seeds = 1,000 interleavings."""
    for seed in range(block * 100, block * 100 + 100):
        Interleaving(shared_ws, seed).run()


# -- focused scenarios ----------------------------------------------------------------------

A, B = "agent-a", "agent-b"


@pytest.fixture
def ov(ws):
    put(ws, "x", b"version one\n")
    view = Overlay(ws, "/mnt/one")
    try:
        yield view
    finally:
        view.close()


def test_s1_two_writers_exactly_one_wins_and_the_loser_keeps_its_bytes(ws, ov):
    fa = ov.open("/x", RW, agent=A)
    fb = ov.open("/x", RW, agent=B)
    ov.write(fa, b"written by A\n", 0)
    ov.write(fb, b"written by B, longer\n", 0)
    assert cat(ov, "/x", "observer") == b"version one\n"  # nothing published before a close
    close(ov, fb)
    with pytest.raises(Stale):
        close(ov, fa)
    assert cat(ov, "/x", "observer") == b"written by B, longer\n"
    assert conflict_rows(ws, "/mnt/one") == [("/x", A, b"written by A\n")]
    assert cat(ov, "/.stepfs/conflicts/x", A) == b"written by A\n"
    status = cat(ov, "/.stepfs/status", A).decode()
    assert f"last error ({A}): /x: ESTALE at close" in status and "re-read the file, then retry" in status
    assert read_ws(ws, "x") == b"version one\n"  # staged, not committed
    ov.commit("b wins")
    assert read_ws(ws, "x") == b"written by B, longer\n"


def test_s2_read_then_write_is_stale_until_read_again(ov):
    assert cat(ov, "/x", A) == b"version one\n"
    write_file(ov, "/x", b"B was here\n", B)
    with pytest.raises(Stale):
        ov.open("/x", os.O_WRONLY, agent=A)
    with pytest.raises(Stale):  # O_TRUNC without reading is no way around it
        ov.open("/x", os.O_WRONLY | os.O_TRUNC, agent=A)
    assert "ESTALE at open for writing" in cat(ov, "/.stepfs/status", A).decode()
    assert cat(ov, "/x", A) == b"B was here\n"  # reading refreshes the observation
    write_file(ov, "/x", b"A, after reading B\n", A)
    assert cat(ov, "/x", "observer") == b"A, after reading B\n"


def test_s2_an_agent_that_never_read_may_write_without_require_read(ov):
    write_file(ov, "/x", b"B was here\n", B)
    write_file(ov, "/x", b"A never read x\n", A)
    assert cat(ov, "/x", "observer") == b"A never read x\n"


def _same_size_same_tick(path: str) -> None:
    """Rewrite in place with equal length right away: size, inode and
    (usually) mtime stay; only ctime or the content can tell."""
    with open(path, "r+b") as f:
        f.write(b"VERSION TWO\n")


def _utime_restored(path: str) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"VERSION TWO\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size


def _save_by_rename(path: str) -> None:
    with open(path + ".swp", "wb") as f:
        f.write(b"VERSION TWO\n")
    os.rename(path + ".swp", path)


@pytest.mark.parametrize("edit", [_same_size_same_tick, _utime_restored, _save_by_rename])
def test_s3_editor_in_the_workspace_after_a_read_makes_the_write_stale(ws, ov, edit):
    assert cat(ov, "/x", A) == b"version one\n"
    edit(os.path.join(ws.path, "x"))
    with pytest.raises(Stale):
        ov.open("/x", os.O_WRONLY | os.O_TRUNC, agent=A)
    assert read_ws(ws, "x") == b"VERSION TWO\n"  # the editor's bytes are kept
    assert cat(ov, "/x", A) == b"VERSION TWO\n"
    write_file(ov, "/x", b"A after the editor\n", A)
    assert read_ws(ws, "x") == b"VERSION TWO\n"
    ov.commit("a")
    assert read_ws(ws, "x") == b"A after the editor\n"


@pytest.mark.parametrize("edit", [_same_size_same_tick, _utime_restored, _save_by_rename])
def test_s3_editor_in_the_workspace_while_open_makes_the_close_stale(ws, ov, edit):
    fa = ov.open("/x", RW, agent=A)
    ov.write(fa, b"A's edit of one\n", 0)
    edit(os.path.join(ws.path, "x"))
    with pytest.raises(Stale):
        close(ov, fa)
    assert read_ws(ws, "x") == b"VERSION TWO\n"
    assert cat(ov, "/x", "observer") == b"VERSION TWO\n"
    assert conflict_rows(ws, "/mnt/one") == [("/x", A, b"A's edit of one\n")]
    assert ov.staged_paths() == []


def test_tokens_inside_the_racy_window_carry_a_content_hash(ws, ov, monkeypatch):
    """The hash is what catches the same-size, same-tick rewrite above."""
    # The fixture wrote x "just now": on a busy machine opening the view may
    # take longer than the 2 s window, so the window is made to cover it.
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 3600 * 10**9)
    token = ov.record_token("/x")
    stat_part, sep, digest = token.partition(tokens.HASH_SEP)
    assert sep and digest == ov.ns.lower_digest("/x")
    _same_size_same_tick(os.path.join(ws.path, "x"))
    assert not ov.still(token, "/x")


@pytest.mark.parametrize("racy", [True, False])
def test_a_read_only_open_records_the_token_of_the_file_it_reads(ws, ov, monkeypatch, racy):
    """A read-only open takes its token from the descriptor it reads
    (``fstat``, hashed through it in the racy window): the path's token
    when nothing moved, and the old file's if the path is replaced right
    after the open -- the reader then never saw the new version, so its
    write-open is stale."""
    # Either way whatever the machine's speed (the fixture wrote x just now).
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 3600 * 10**9 if racy else 0)
    fh = ov.open("/x", RO, agent=A)
    assert ov.handles[fh].token == ov.observed[A]["/x"] == ov.record_token("/x")
    assert (tokens.HASH_SEP in ov.handles[fh].token) == racy
    ov.release(fh)
    real_open = ov.root.open

    def open_then_replace(path, flags, mode=0o666):
        fd = real_open(path, flags, mode)
        if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_PATH:
            _save_by_rename(os.path.join(ws.path, "x"))  # an editor saves just after the open
        return fd

    monkeypatch.setattr(ov.root, "open", open_then_replace)
    fh = ov.open("/x", RO, agent=A)
    monkeypatch.setattr(ov.root, "open", real_open)
    try:
        assert ov.read(fh, 100, 0) == b"version one\n"
        token = ov.handles[fh].token
        assert token.partition(tokens.HASH_SEP)[0] == tokens.from_stat(os.fstat(ov.handles[fh].fd))
        assert token != ov.record_token("/x")
    finally:
        ov.release(fh)
    with pytest.raises(Stale):
        ov.open("/x", os.O_WRONLY, agent=A)


def test_s3_save_by_rename_is_caught_without_the_hash(ws, ov, monkeypatch):
    """Outside the racy window the stat token alone decides: ``ino`` moves."""
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 0)
    assert cat(ov, "/x", A) == b"version one\n"
    assert tokens.HASH_SEP not in ov.observed[A]["/x"]
    _save_by_rename(os.path.join(ws.path, "x"))
    with pytest.raises(Stale):
        ov.open("/x", os.O_WRONLY, agent=A)


@needs_multigrain
def test_on_a_device_proven_to_move_ctime_fresh_tokens_carry_no_hash_and_still_catch_same_tick_rewrites(
        ws, ov, monkeypatch):
    """A daemon proves at its start that every change after a stat moves
    ctime on the workspace's device (``tokens.learn_fine_ctime``); tokens
    there then carry no hash however fresh the file.  If that proof were
    wrong (a coarse ctime), most of these rewrites, each made microseconds
    after the read's stat with the same size and the mtime put back, would
    keep the token and the write-open would not be stale."""
    monkeypatch.setattr(tokens, "FINE_CTIME_DEVICES", set())
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 3600 * 10**9)  # every stat here would be racy
    assert tokens.learn_fine_ctime(ws.tmp_dir)
    assert os.stat(ws.tmp_dir).st_dev == os.stat(ws.path).st_dev  # .stepfs/tmp is on the workspace's device
    assert tokens.HASH_SEP not in ov.record_token("/x")
    path = os.path.join(ws.path, "x")
    for i in range(200):
        assert cat(ov, "/x", A) in (b"version one\n", b"VERSION TWO\n")
        assert tokens.HASH_SEP not in ov.observed[A]["/x"]
        (_utime_restored if i % 2 else _same_size_same_tick)(path)
        with pytest.raises(Stale):
            ov.open("/x", os.O_WRONLY, agent=A)
    assert not [name for name in os.listdir(ws.tmp_dir)]  # the probe's file had no name


def test_a_device_not_proven_keeps_the_racy_window(ws, ov, monkeypatch):
    """Only a proven device skips the hash: a file system this kernel does
    not stamp itself (here /proc) is never probed, and until a device is
    proven its fresh tokens are hashed as before."""
    monkeypatch.setattr(tokens, "FINE_CTIME_DEVICES", set())
    monkeypatch.setattr(tokens, "RACY_WINDOW_NS", 3600 * 10**9)
    assert tokens.fs_type(os.stat("/proc").st_dev) == "proc"
    assert not tokens.learn_fine_ctime("/proc")
    assert tokens.FINE_CTIME_DEVICES == set()
    assert tokens.HASH_SEP in ov.record_token("/x")


def test_s6_another_agent_never_sees_a_half_written_file(ov):
    before = ov.open("/x", RO, agent=B)
    fa = ov.open("/x", RW | os.O_TRUNC, agent=A)
    ov.write(fa, b"new ", 0)
    assert cat(ov, "/x", B) == b"version one\n"
    assert cat(ov, "/x", "default") == b"version one\n"
    assert cat(ov, "/x", A) == b"new "  # the writer's own agent sees its writes
    ov.write(fa, b"content, complete\n", 4)
    close(ov, fa)
    assert ov.read(before, 100, 0) == b"version one\n"  # an open reader keeps its version
    ov.release(before)
    assert cat(ov, "/x", B) == b"new content, complete\n"


def test_s7_flush_is_idempotent_and_release_never_raises(ws, ov):
    fa = ov.open("/x", RW | os.O_TRUNC, agent=A)  # one open file, several descriptors (dup, fork)
    fb = ov.open("/x", RW | os.O_TRUNC, agent=B)
    ov.write(fa, b"A\n", 0)
    ov.write(fb, b"B\n", 0)
    ov.flush(fb)
    for _ in range(3):  # every close(2) of a dup'd descriptor flushes again: same answer
        with pytest.raises(Stale):
            ov.flush(fa)
    ov.flush(fb)
    ov.flush(fb)
    ov.release(fa)  # the kernel ignores release's result: it must not raise
    ov.release(fb)
    assert len(conflict_rows(ws, "/mnt/one")) == 1  # one decision, one conflict row
    assert cat(ov, "/x", "observer") == b"B\n"


def test_s7_a_write_after_a_flush_is_a_new_decision(ov):
    fa = ov.open("/x", RW | os.O_TRUNC, agent=A)
    ov.write(fa, b"first\n", 0)
    ov.flush(fa)  # close of a dup: published
    assert cat(ov, "/x", B) == b"first\n"
    ov.write(fa, b"second\n", 0)  # the remaining descriptor writes on
    assert cat(ov, "/x", B) == b"first\n"
    ov.flush(fa)
    ov.release(fa)
    assert cat(ov, "/x", B) == b"second\n"


def test_s7_release_decides_a_write_no_flush_saw_and_records_a_loss(ws, ov):
    """Writes after the last flush (mmap, or a writer whose flush we never
    got) are decided at release; a loss is kept and shown in the status."""
    fa = ov.open("/x", RW | os.O_TRUNC, agent=A)
    ov.write(fa, b"A late\n", 0)
    write_file(ov, "/x", b"B first\n", B)
    ov.release(fa)  # no exception, whatever the outcome
    assert cat(ov, "/x", "observer") == b"B first\n"
    assert conflict_rows(ws, "/mnt/one") == [("/x", A, b"A late\n")]
    assert f"last error ({A}): /x: ESTALE at close" in cat(ov, "/.stepfs/status", A).decode()


def test_unchanged_rewrite_of_a_workspace_file_stages_nothing_and_keeps_the_token(ov):
    assert cat(ov, "/x", B) == b"version one\n"
    token = ov.record_token("/x")
    write_file(ov, "/x", b"version one\n", A)
    assert ov.staged_paths() == []
    assert "/x" not in ov.upper.nodes
    assert ov.still(token, "/x")
    write_file(ov, "/x", b"B, not stale\n", B)  # B's observation survived A's no-op
    assert cat(ov, "/x", "observer") == b"B, not stale\n"


def test_unchanged_rewrite_of_a_staged_file_publishes_nothing(ws, ov):
    write_file(ov, "/x", b"staged\n", A)
    assert cat(ov, "/x", B) == b"staged\n"
    token = ov.record_token("/x")
    with ws.db.read() as conn:
        rows = conn.execute(select(schema.staged)).all()
    write_file(ov, "/x", b"staged\n", A)
    assert ov.record_token("/x") == token
    with ws.db.read() as conn:
        assert conn.execute(select(schema.staged)).all() == rows
    write_file(ov, "/x", b"B, not stale\n", B)


def test_require_read_refuses_writing_an_unread_file_and_allows_new_ones(ws):
    put(ws, "x", b"existing\n")
    ov = Overlay(ws, "/mnt/strict", require_read=True)
    try:
        with pytest.raises(NotObserved):
            ov.open("/x", os.O_WRONLY, agent=A)
        with pytest.raises(NotObserved):  # O_CREAT on an existing file is a write of it
            ov.create("/x", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, agent=A)
        with pytest.raises(NotObserved):
            ov.truncate("/x", 0, agent=A)
        assert "EACCES at open for writing" in cat(ov, "/.stepfs/status", A).decode()
        fh = ov.create("/new", 0o644, os.O_WRONLY | os.O_CREAT, agent=A)
        ov.write(fh, b"new file\n", 0)
        close(ov, fh)
        write_file(ov, "/new", b"rewritten\n", A)  # created by A: A has seen it
        assert cat(ov, "/x", A) == b"existing\n"
        write_file(ov, "/x", b"read first\n", A)
        with pytest.raises(NotObserved):  # B's permission is B's own
            ov.open("/x", os.O_WRONLY, agent=B)
        assert cat(ov, "/x", B) == b"read first\n"
    finally:
        ov.close()


def test_own_commit_does_not_make_observations_or_open_drafts_stale(ws, ov):
    put(ws, "y", b"y one\n")
    write_file(ov, "/x", b"x two\n", A)
    assert cat(ov, "/x", B) == b"x two\n"
    assert cat(ov, "/y", B) == b"y one\n"
    fa = ov.open("/x", RW, agent=A)  # a draft based on the staged version, open across the commit
    ov.commit("one")
    assert read_ws(ws, "x") == b"x two\n"
    ov.write(fa, b"x three\n", 0)
    close(ov, fa)
    assert cat(ov, "/x", "observer") == b"x three\n"
    write_file(ov, "/y", b"y by B\n", B)  # B read y before the commit: still current
    with pytest.raises(Stale):  # B read x two; A's close since then made it stale, commit or not
        ov.open("/x", os.O_WRONLY, agent=B)
    ov.commit("two")
    assert cat(ov, "/x", B) == b"x three\n"
    write_file(ov, "/x", b"x by B\n", B)
    ov.commit("three")
    assert (read_ws(ws, "x"), read_ws(ws, "y")) == (b"x by B\n", b"y by B\n")


def test_s4_two_mounts_of_one_workspace(ws):
    put(ws, "x", b"base\n")
    one, two = Overlay(ws, "/mnt/one"), Overlay(ws, "/mnt/two")
    try:
        assert cat(one, "/x", "default") == b"base\n"
        assert cat(two, "/x", "default") == b"base\n"
        open_in_two = two.open("/x", RW)  # a writer in mount 2 that is open across mount 1's commit
        write_file(one, "/x", b"from mount one\n", "default")
        assert cat(two, "/x", "default") == b"base\n"  # staged in mount 1 only
        one.commit("one")
        assert read_ws(ws, "x") == b"from mount one\n"
        with pytest.raises(Stale):
            two.open("/x", os.O_WRONLY | os.O_TRUNC)
        two.write(open_in_two, b"lost in two\n", 0)
        with pytest.raises(Stale):
            close(two, open_in_two)
        assert conflict_rows(ws, "/mnt/two") == [("/x", "default", b"lost in two\n")]
        assert cat(two, "/x", "default") == b"from mount one\n"  # the next open sees the layer
        write_file(two, "/x", b"from mount two\n", "default")
        two.commit("two")
        assert read_ws(ws, "x") == b"from mount two\n"
        with pytest.raises(Stale):  # and now mount 1 is the one behind
            one.open("/x", os.O_WRONLY)
    finally:
        one.close()
        two.close()


def test_truncate_through_a_path_is_a_close_write(ws, ov):
    assert cat(ov, "/x", A) == b"version one\n"
    write_file(ov, "/x", b"B\n", B)
    with pytest.raises(Stale):
        ov.truncate("/x", 0, agent=A)
    assert cat(ov, "/x", A) == b"B\n"
    ov.truncate("/x", 1, agent=A)
    assert cat(ov, "/x", "observer") == b"B"


def test_copy_up_does_not_make_an_older_same_stat_version_current(ws, ov):
    """A token taken in the racy window names its content too: after an
    in-place rewrite within the same clock tick (same stat fields, other
    bytes) a metadata change that copies the file up must not re-label the
    holder of the old bytes as current."""
    assert cat(ov, "/x", A) == b"version one\n"
    stat_part = ov.current_token("/x")[0]
    # What A holds after an editor's same-size rewrite within A's clock tick:
    ov.observed[A]["/x"] = tokens.with_hash(stat_part, "0" * 32)
    assert cat(ov, "/x", B) == b"version one\n"
    ov.chmod("/x", 0o600)  # copies /x up: same content, new token
    with pytest.raises(Stale):
        ov.open("/x", os.O_WRONLY, agent=A)
    write_file(ov, "/x", b"B read the current bytes\n", B)
