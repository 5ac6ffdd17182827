"""The close-write compare-and-swap: a draft published, or kept as a conflict (FUSE-free).

The close after writing compares the draft's base token with the path's
token now (``versions.py``).  Equal: the draft is published -- a small
draft over a staged file (a memory draft) is recorded with the staged rows
(``rows.py``: its bytes reach the store with them, no SQL at the close);
otherwise stored as an object and its staged row written in one
transaction (with every row recorded meanwhile), or, for a file of at
least ``store.refs.MIN_SIZE``
bytes, its scratch file handed over as the staged content (staged by
reference) and the draft frozen.  Different: the close fails with
``Stale`` and the draft's bytes are kept as a conflict row.  A rewrite
whose content equals the published content publishes nothing.

Lock rule: called only under the view's lock (by ``content.Content``).
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod
import time
from contextlib import contextmanager
from functools import partial
from typing import Callable

from stepfs.store import publish, ready, refs, schema, staging, tokens
from stepfs.store import xattrs as xattr_codec
from stepfs.store.ready import ReadyFiles

from stepfs.overlayfs.core.drafts import Draft
from stepfs.overlayfs.core.errors import NotFound
from stepfs.overlayfs.core.links import Links
from stepfs.overlayfs.core.namespace import Namespace
from stepfs.overlayfs.core.readcache import ReadCache
from stepfs.overlayfs.core.rows import StagedRows
from stepfs.overlayfs.core.scratch import ScratchFiles
from stepfs.overlayfs.core.upper import Node, rel
from stepfs.overlayfs.core.versions import Versions

log = logging.getLogger("stepfs.view")
#: Before states captured ahead of the commit (:meth:`CompareAndSwap._precapture`)
#: that a view keeps at most; paths staged beyond that are captured by the
#: commit itself.
PRECAPTURED_MAX = 4096
#: Free bytes the store's filesystem must have for a close to leave its
#: content to the next row write (``CompareAndSwap._room``).
RECORD_FREE_MIN = 64 << 20
#: Seconds a measurement of the store's free space is trusted (with what
#: was recorded since taken off).
ROOM_RECHECK = 0.5


def _same_bytes(a: int, b: int) -> bool:
    if os.fstat(a).st_size != os.fstat(b).st_size:
        return False
    off = 0
    while True:
        x, y = os.pread(a, 1 << 20, off), os.pread(b, 1 << 20, off)
        if x != y:
            return False
        if not x:
            return True
        off += len(x)


class CompareAndSwap:
    """Publishes drafts (:class:`drafts.Draft`) at their close.  Receives what it
    reads and writes (``ws``, ``step``, ``mountpoint``, ``ns``, ``versions``,
    ``rows``, ``scratch``, ``links``, ``reads``: the bytes kept for readers), ``guard`` (False only for the
    benchmark of the checks' cost), and callables: ``await_settled`` (a
    commit completing consumes the step's rows), ``changed`` (auto-step),
    ``thaw(draft)`` (move a draft to a scratch file of its own) and
    ``note_error(agent, path, what)`` (the agent's last error)."""

    def __init__(self, *, ws, step: int, mountpoint: str, ns: Namespace, versions: Versions, rows: StagedRows,
                 scratch: ScratchFiles, links: Links, reads: ReadCache, guard: bool, await_settled: Callable[..., None],
                 changed: Callable[[], None], thaw: Callable, note_error: Callable[[str, str, str], None]):
        self.ws, self.step, self.mountpoint = ws, step, mountpoint
        self.ns, self.versions, self.rows, self.scratch, self.links = ns, versions, rows, scratch, links
        self.reads = reads
        self.guard = guard
        self._await_settled, self._changed, self._thaw, self._note_error = await_settled, changed, thaw, note_error
        #: Workspace path -> its before state captured when this step first
        #: staged it (:meth:`_precapture`), for the commit to reuse while the
        #: path's token holds (``publish.precapture``).
        self.precaptured: dict[bytes, object] = {}
        #: New files written ahead of the commit (``store/ready.py``): a
        #: step's first closes of small files.
        self.ready = ReadyFiles(ws.spares)
        self._room_at, self._room_free = -ROOM_RECHECK - 1.0, 0  # see _room

    def close_write(self, d: Draft) -> str:
        """The compare-and-swap; returns "ok" or "stale"."""
        if d.stale:
            return "stale"
        if d.detached or not d.dirty:
            d.dirty = False
            return "ok"
        tok, _st, digest = self.versions.current_token(d.path)
        if self.guard and not tokens.same(d.base, tok, digest):
            self._conflict(d, tok)
            d.stale = True
            d.dirty = False
            return "stale"
        self._publish(d)
        return "ok"

    def publish_later(self, d: Draft) -> Callable[[], None] | None:
        """Before a close's reply: when :meth:`close_write` of ``d`` now
        would return "ok" by a path that cannot fail afterwards, the
        token check is made here and the rest of the publish returned, to
        run after the reply (``Content.flush``); else None (the caller
        runs :meth:`close_write` before replying).  That path: a draft
        that publishes nothing (detached, or not changed), or a small
        memory draft over a staged file whose record (:meth:`_record`)
        writes no row at once (the rows wait for their timer and the
        content fits under ``rows.PENDING_CONTENT_MAX``) with room on the
        store's filesystem.  A store transaction, staging by reference or
        a first staging of a workspace file may fail: those stay before
        the reply.  The caller holds the lock until the returned work ran:
        nothing can change the path's token in between."""
        if d.stale:
            return None
        if d.detached or not d.dirty:
            return partial(self.close_write, d)  # "ok", nothing published
        if d.mem < 0 or not self.rows.waits():
            return None
        node = self.ns.upper.get(d.path)
        if node is None or node.kind != "file" or node.ref is not None or node.oid is None:
            # (oid None: a created file's first close, the middle of a burst
            # -- tar -x, npm install, a build -- whose next request waits
            # for this publish anyway: answering first only wakes the caller
            # to compete with the daemon for the CPU.)
            return None
        st = os.fstat(d.mem)
        if st.st_size >= refs.MIN_SIZE or not self.rows.may_hold(st.st_size):
            return None
        tok, _st, digest = self.versions.current_token(d.path)
        if self.guard and not tokens.same(d.base, tok, digest):
            return None  # stale: decided before the reply, conflict kept
        if not self._room(st.st_size, take=False):
            return None
        # As in _publish: waits out a commit completing, and refuses (before
        # the reply) when that completion failed.
        self._await_settled(writing=True)
        return partial(self._publish_recorded, d, node, st)

    def _publish_recorded(self, d: Draft, node: Node, st: os.stat_result) -> None:
        """The rest of a publish :meth:`publish_later` allowed (after the
        reply, the lock held since, so ``st`` of the draft still holds):
        what :meth:`_publish` does for it."""
        self._changed()
        self._room_free -= st.st_size
        same, data = self._record(d, node, d.mem, st)
        if same is not None:
            self._published(d, node, same, node.scratch, data=data)

    def _publish(self, d: Draft) -> None:
        self._changed()
        st = os.fstat(d.mem) if d.mem >= 0 else None
        if st is not None and st.st_size >= refs.MIN_SIZE:
            self._thaw(d)  # staged by reference below: its content must be a scratch file
            st = None
        node = self.ns.upper.get(d.path)
        # A memory draft is read through its own descriptor (every read
        # here is positional): reopening it through /proc cost a sixth of
        # a small file's close.
        opened = d.mem < 0
        fd = os.open(d.scratch, os.O_RDONLY | os.O_CLOEXEC) if opened else d.mem
        try:
            if st is None:
                st = os.fstat(fd)
            if node is None and self._lower_equals(d.path, fd):
                d.dirty = False  # identical rewrite of a workspace file: nothing to stage
                return
            if d.mem >= 0 and node is not None and node.kind == "file" and node.ref is None \
                    and self._room(st.st_size):
                # As below: a row recorded while an answered commit completes
                # would be lost with the step if that completion fails.
                self._await_settled(writing=True)
                same, data = self._record(d, node, fd, st)
                if same is not None:
                    self._published(d, node, same, node.scratch, data=data)
                return
            # A big file is staged by reference (store/refs.py): its draft's
            # file becomes the node's content, the store takes the bytes at
            # the commit.  Copying them into SQLite here cost more than the
            # writes themselves (issue #7).
            by_ref = st.st_size >= refs.MIN_SIZE
            # The sum kept while the draft was written front to back, if it
            # covers the whole file; else the file is read again for it.
            ref_sum = ((d.sum.hexdigest() if d.sum is not None and d.sum_end == st.st_size
                        else refs.content_sum(fd)) if by_ref else None)
            if by_ref and node is not None and node.kind == "file" and node.staged \
                    and self._same_content(node, fd, ref_sum):
                d.dirty = False  # identical rewrite: same content, same token
                return
            old_scratch = node.scratch if node is not None else None
            self._await_settled(writing=True)  # a commit completing consumes this step's rows
            # A failed transaction, its COMMIT included, undoes what it changed
            # in the view: a failed close keeps the old content, never a node
            # naming bytes the store never got (``_undone_on_failure``).
            with _undone_on_failure() as undo, self.ws.db.write() as conn:
                if by_ref:
                    oid, size, data = None, st.st_size, None
                else:
                    # One read of the known size: put_fd's 1 MiB read buffer
                    # cost an mmap, mremap and munmap per close of a small file.
                    data = os.pread(fd, st.st_size, 0)
                    oid, size = self.ws.objects.put_bytes(conn, data), len(data)
                if not by_ref and node is not None and node.kind == "file" and node.oid == oid and node.staged:
                    d.dirty = False  # identical rewrite: same content, same token
                    return
                # A created file closed still empty: it is staged now, but every
                # agent already saw this empty file, so its token stays.
                same = node is not None and node.kind == "file" and node.oid is None and node.ref is None and size == 0
                if node is None or node.kind != "file":
                    if node is None:
                        lower = self.ns.lower_stat(d.path)
                        if lower is not None:
                            self.links.name_gone(lower, d.path)  # this name is a file of its own now
                            self._precapture(conn, d.path, lower)
                    before = node
                    node = Node("file", d.mode, base=d.node_base if node is None else node.base, ino=d.ino,
                                uid=d.uid, gid=d.gid)
                    node.xattrs = dict(d.xattrs)
                    self.ns.upper.set(d.path, node)
                    undo.append(lambda: self.ns.upper.set(d.path, before) if before is not None
                                else self.ns.upper.pop(d.path))
                undo.append(_fields_restorer(node))
                node.oid, node.size = oid, size
                node.ref = os.path.basename(d.scratch) if by_ref else None
                node.ref_sum = ref_sum
                node.mtime_ns, node.atime_ns = st.st_mtime_ns, st.st_atime_ns
                node.ctime_ns = time.time_ns()
                names = node.names if node.link_group is not None else (d.path,)
                # The rows recorded for these names are superseded by the ones
                # written next: if the transaction fails they are still the
                # view's latest change of those paths.
                undo.append(_rows_restorer(self.rows.pending.rows, [rel(n) for n in names]))
                self.rows.write(conn, superseded=[rel(n) for n in names])  # recorded rows ride along
                for name in names:
                    staging.put(conn, self.step, node.row(name))
            self.rows.written()
        finally:
            if opened:
                os.close(fd)
        self._published(d, node, same, old_scratch, d.scratch if by_ref else None, data)

    def _room(self, size: int, take: bool = True) -> bool:
        """Whether a close of ``size`` bytes may leave its content to the
        next row write: not when the store's filesystem is nearly full,
        where the close itself must be the one to fail (ENOSPC) and keep
        the old content.  The free space is asked at most every
        :data:`ROOM_RECHECK` seconds (a ``statvfs`` cost a third of such a
        close), less what was recorded since (``take``: this close's
        ``size`` is taken off now)."""
        now = time.monotonic()
        if now - self._room_at > ROOM_RECHECK:
            try:
                st = os.statvfs(self.ws.store_dir)
            except OSError:
                return False
            self._room_at, self._room_free = now, st.f_bavail * st.f_frsize
        if take:
            self._room_free -= size
            return self._room_free >= RECORD_FREE_MIN
        return self._room_free - size >= RECORD_FREE_MIN

    def _record(self, d: Draft, node: Node, fd: int, st: os.stat_result) -> tuple[bool | None, bytes]:
        """Publish a small draft over staged file ``node`` without touching
        the store: its bytes wait with the recorded rows (``rows.py``) and
        reach the store in their transaction.  Returns (None for an
        identical rewrite (nothing published), else whether the file was a
        created one closed still empty (its token stays); the bytes)."""
        data = os.pread(fd, st.st_size, 0)
        digest = self.ws.objects.hasher(data).split(".", 1)[0]
        if node.staged and self._holds(node, data, digest):
            d.dirty = False  # identical rewrite: same content, same token
            return None, data
        same = node.oid is None and node.ref is None and not data
        rows = self.rows
        pending = rows.pending
        if node.link_group is None:
            names, paths = (d.path,), (rel(d.path),)
        else:
            names = tuple(node.names)
            paths = tuple(rel(n) for n in names)
        # A batch written at once (delay 0, or too many bytes held) that
        # fails fails this close: it keeps the old content, as one that
        # stores its bytes itself does (the batch's other changes stay pending).
        # What to put back is kept as plain values, not closures: this is
        # every small close's path.
        fields = (node.oid, node.size, node.ref, node.ref_sum, node.mtime_ns, node.atime_ns, node.ctime_ns)
        prior = pending.rows
        kept = [(p, prior[p]) for p in paths if p in prior]
        key = None
        try:
            node.oid = key = rows.record_content(node, digest, data)
            node.size, node.ref, node.ref_sum = len(data), None, None
            node.mtime_ns, node.atime_ns = st.st_mtime_ns, st.st_atime_ns
            node.ctime_ns = time.time_ns()
            for name, path in zip(names, paths):
                pending.put(node.row(name, path))
            rows.recorded()
        except BaseException:
            (node.oid, node.size, node.ref, node.ref_sum, node.mtime_ns, node.atime_ns, node.ctime_ns) = fields
            for p in paths:
                prior.pop(p, None)
            prior.update(kept)
            if key is not None:
                rows.forget_content(key)
            raise
        return same, data

    def _holds(self, node: Node, data: bytes, digest: str) -> bool:
        """Whether staged file ``node`` holds exactly ``data``."""
        if node.oid is None or node.ref is not None or node.size != len(data) \
                or node.oid.split(".", 1)[0] != digest:
            return False
        held = self.reads.get(node)
        return (held if held is not None else self.scratch.content(node)) == data

    def _published(self, d: Draft, node: Node, same: bool, old_scratch: str | None, ref: str | None = None,
                   data: bytes | None = None) -> None:
        """After a publish: the draft is clean, and unless a created file
        was closed still empty, the node has a new version (``ref``: its
        draft's file, now the node's content by reference; ``data``: the
        content, kept for the next readers, or None)."""
        node.staged = True
        d.dirty = False
        if same:
            return
        if data is not None:
            self.reads.put(node, data)  # (too big: only the old entry goes)
            if node.link_group is None:
                self.ready.offer(rel(d.path), ready.key_of(
                    node.oid, node.mode, node.uid, node.gid,
                    xattr_codec.encode(node.xattrs) if node.xattrs else None, node.mtime_ns), data)
        else:
            self.reads.drop(node)
        # The old content: every row naming it was just replaced (or, for a
        # recorded close, a cache of an object: never a reference), so even
        # a file held by reference can go now (readers keep their fds).
        if old_scratch is not None:
            self.scratch.unlink(old_scratch)
        node.scratch = ref
        if ref is not None:
            d.frozen = True
        self.links.invalidate_names(node, except_path=d.path)
        self.versions.bump(node)
        d.base = self.versions.node_token(node)
        self.versions.observe(d.agent, d.path, d.base)

    def _precapture(self, conn, path: str, lower: os.stat_result) -> None:
        """A workspace file is staged for the first time: capture its
        before state now, in the close's transaction, so the commit only
        checks its token instead of reading, hashing and storing it on the
        step's critical path (``publish.precapture``; reused only while the
        token holds).  Small files only, a bounded number of them; a file
        that cannot be read is left to the commit, which reports it."""
        if (not stat_mod.S_ISREG(lower.st_mode) or lower.st_size >= publish.PRECAPTURE_MAX
                or len(self.precaptured) >= PRECAPTURED_MAX):
            return
        try:
            before = publish.precapture(self.ws, conn, rel(path))
        except OSError as exc:
            log.debug("no before state captured ahead for %s: %s", path, exc)
            return
        if before is not None:
            self.precaptured[rel(path)] = before

    def _same_content(self, node: Node, fd: int, digest: str) -> bool:
        """Whether staged file ``node`` holds the bytes of ``fd``, whose
        XXH3-128 is ``digest`` (compared byte for byte when the hash agrees)."""
        if node.size != os.fstat(fd).st_size or digest not in (node.ref_sum, node.oid):
            return False
        self.scratch.materialize(node)
        mine = os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _same_bytes(mine, fd)
        finally:
            os.close(mine)

    def _lower_equals(self, path: str, fd: int) -> bool:
        try:
            node, st = self.ns.resolve(path)
        except NotFound:
            return False
        if node is not None or not stat_mod.S_ISREG(st.st_mode) or st.st_size != os.fstat(fd).st_size:
            return False
        lower = self.ns.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return _same_bytes(lower, fd)
        finally:
            os.close(lower)

    def _conflict(self, d: Draft, theirs: str) -> None:
        """Keep the losing bytes; nothing a user wrote is dropped silently."""
        fd = os.open(d.scratch, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with self.ws.db.write() as conn:
                oid, _size = self.ws.objects.put_fd(conn, fd)
                conn.execute(schema.conflicts.insert().values(
                    created_ns=time.time_ns(), path=rel(d.path), mount=self.mountpoint, agent=d.agent,
                    reason="stale-close", oid=oid, mode=stat_mod.S_IMODE(d.mode), token_mine=d.base,
                    token_theirs=theirs,
                ))
        finally:
            os.close(fd)
        self._note_error(d.agent, d.path, "ESTALE at close: another writer changed the file after you opened it; "
                                          f"your bytes are in .stepfs/conflicts{d.path}")
        log.warning("stale close of %s by agent %s: kept as a conflict", d.path, d.agent)


@contextmanager
def _undone_on_failure():
    """Yields a list of callables, run in reverse order if the block raises
    (then the exception goes on): the in-memory changes of a close whose
    store write failed are put back."""
    undo: list[Callable[[], object]] = []
    try:
        yield undo
    except BaseException:
        for step in reversed(undo):
            step()
        raise


def _fields_restorer(node: Node) -> Callable[[], None]:
    """Puts back ``node``'s content fields as they are now."""
    old = (node.oid, node.size, node.ref, node.ref_sum, node.mtime_ns, node.atime_ns, node.ctime_ns)

    def restore() -> None:
        (node.oid, node.size, node.ref, node.ref_sum, node.mtime_ns, node.atime_ns, node.ctime_ns) = old
    return restore


def _rows_restorer(rows: dict, paths: list[bytes]) -> Callable[[], None]:
    """Puts back the recorded rows of ``paths`` as they are now."""
    kept = {p: rows[p] for p in paths if p in rows}

    def restore() -> None:
        for p in paths:
            rows.pop(p, None)
        rows.update(kept)
    return restore
