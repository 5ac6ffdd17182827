"""Open files of the view: drafts, handles and the close's compare-and-swap (FUSE-free).

Model
-----
* The **published** state of a path is what every agent sees: an upper
  ``Node`` (content = object ``oid``; ``scratch`` is an immutable cache of it,
  replaced, never rewritten, on each publish) or the workspace file.
* An agent that opens a path for writing gets a **draft**: its own working
  copy (a scratch file; in memory while smaller than
  :data:`MEMORY_DRAFT_MAX`).  All handles of one agent share the draft (POSIX
  visibility inside an agent); another agent writing the same path gets its
  own draft, so exactly one of them wins.  A draft with no open handle is
  kept as a cache of its version if it is a file, dropped if in memory.
* Every open records the published token (``versions.py``) in the agent's
  observations.  Opening for writing fails with ``Stale`` if the path moved
  on since the agent last observed it (read it again to refresh).
* The close after writing (``flush``) is the **compare-and-swap**: the draft's
  base token must still be the path's token; then the draft is published
  (stored as an object and its staged row written, or for a small draft
  over a staged file both recorded for the next row write; new token; a big draft's
  scratch file becomes the node's content instead, staged by reference,
  and the draft is frozen: a later write first moves it to a copy).  Otherwise the close
  fails with ``Stale``, the path keeps the other writer's content, and the
  draft's bytes are kept as a conflict object.  The decision is made once per
  batch of writes and repeated by every later flush of the same handle
  (``dup``, ``fork``), because ``release``'s result is ignored by the kernel.
* A rewrite whose content equals the published content publishes nothing and
  changes no token.

Lock rule: every public method of :class:`Content` takes the view's lock.

Why one module of about 770 lines: drafts and handles are one unit (a
thaw moves every handle of a draft to its new file, an open attaches the
agent's read handles to its draft, a release decides and drops it), so
both live in one object, and so does how they follow the agent's own
renames and removals; the close's compare-and-swap (``cas.py``), the
records (``drafts.py``) and the page-cache rule (``pagecache.py``) are apart.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import logging
import os
import stat as stat_mod
import time
from functools import partial
from typing import Callable


from stepfs.store import refs, tokens
from stepfs.store import xattrs as xattr_codec

from stepfs.overlayfs.core.agents import DEFAULT
from stepfs.overlayfs.core.drafts import Draft, Handle, sparse_copy
from stepfs.overlayfs.core.cas import CompareAndSwap
from stepfs.overlayfs.core.errors import BadHandle, Invalid, IsADirectory, NotFound, NotObserved, ReadOnly, Stale
from stepfs.overlayfs.core.metatree import is_meta
from stepfs.overlayfs.core.pagecache import needs_direct_io
from stepfs.overlayfs.core.readcache import ReadCache
from stepfs.overlayfs.core.upper import Node, parent_name, rel

log = logging.getLogger("stepfs.view")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
#: A draft smaller than this starts in memory (a memfd) instead of a scratch
#: file, and moves to a scratch file (:meth:`Content.thaw`) before a change
#: makes it this big: creating a file on the workspace's filesystem waits
#: for the journal.  An idle memory draft whose bytes are published (or
#: unchanged) is dropped at its last release, so memory is held by open
#: files only: at most this much per open draft (plus the bounded bytes
#: kept for readers, ``readcache.py``).
MEMORY_DRAFT_MAX = 256 << 10
#: A running sum of a draft (``Draft.sum``) starts only at a first write at
#: least this big: a file written in small pieces is most likely small,
#: and only files staged by reference (``refs.MIN_SIZE``) use the sum.
SUM_FIRST_WRITE = 64 << 10
#: A memory draft is reopened by name through /proc, so every handle gets
#: its own open file (its own O_APPEND), as with a scratch file.
_PROC_FD = "/proc/self/fd"
_MEMORY = hasattr(os, "memfd_create") and os.path.isdir(_PROC_FD)


class Content:
    """Drafts and handles of one view (see the module doc).

    Receives what it works on: ``ns`` (lookup), ``versions`` (tokens and
    observations), ``scratch``, ``rows``, ``links``, the view's ``lock``
    (held by every public method), ``ws`` (objects and conflicts),
    ``meta`` (the ``.stepfs`` tree's files), and callables: ``check_writable``
    and ``check_new_name`` (the view's refusals), ``await_settled``
    (a commit completing consumes the step's rows) and ``changed`` (an
    auto-step policy is told of every staged change)."""

    def __init__(self, *, ws, step: int, mountpoint: str, lock, ns, versions, scratch, rows, links, meta,
                 check_writable, check_new_name, await_settled, changed, guard: bool, require_read: bool):
        self.ws, self.step, self.mountpoint, self.lock = ws, step, mountpoint, lock
        self.ns, self.versions, self.scratch, self.rows, self.links, self.meta = ns, versions, scratch, rows, links, meta
        self._check_writable, self._check_new_name = check_writable, check_new_name
        self._await_settled, self._changed = await_settled, changed
        self.guard, self.require_read = guard, require_read
        self.drafts: dict[tuple[str, str], Draft] = {}
        self.open_drafts: dict[str, int] = {}  # path -> drafts of it with open handles
        self.last_errors: dict[str, str] = {}
        self.handles: dict[int, Handle] = {}
        self._fh = itertools.count(1)
        # ".fuse_hidden<N>" name -> (draft or None, attributes at unlink)
        self.hidden: dict[str, tuple[Draft | None, dict]] = {}
        # The bytes of small staged files lately published or read (readcache.py).
        self.reads = ReadCache(MEMORY_DRAFT_MAX)
        self.cas = CompareAndSwap(ws=ws, step=step, mountpoint=mountpoint, ns=ns, versions=versions, rows=rows,
                                  scratch=scratch, links=links, reads=self.reads, guard=guard,
                                  await_settled=await_settled, changed=changed, thaw=self.thaw,
                                  note_error=self._note_error)

    # -- drafts ---------------------------------------------------------------

    def _new_draft(self, path: str, agent: str) -> Draft:
        node, st = self.ns.resolve(path)
        if self.ns.kind(node, st) == "dir":
            raise IsADirectory(path)
        if self.ns.kind(node, st) != "file":
            raise Invalid(path)
        scratch, mem = self._draft_storage(node.size if node is not None else st.st_size)
        dst = mem if mem >= 0 else os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if node is not None:
                if node.scratch is not None:
                    src = os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        sparse_copy(src, dst, os.fstat(src).st_size)
                    finally:
                        os.close(src)
                else:
                    self.scratch.fill(dst, node)  # its object, or its bytes not stored yet
                os.utime(dst, ns=(node.atime_ns, node.mtime_ns))
                d = Draft(agent, path, scratch, self.versions.node_token(node), node.base, node.mode, node.ino,
                          node.uid, node.gid)
            else:
                src = self.ns.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    st = os.fstat(src)  # token and content from the same open file
                    sparse_copy(src, dst, st.st_size)
                    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
                    attrs = xattr_codec.read_fd(src)
                finally:
                    os.close(src)
                base = tokens.from_stat(st)
                recorded = base
                if tokens.is_racy(st, time.time_ns()):
                    recorded = tokens.with_hash(base, self.ns.lower_digest(path))
                d = Draft(agent, path, scratch, recorded, base, st.st_mode, st.st_ino, st.st_uid, st.st_gid,
                          xattrs=attrs)
        except BaseException:
            os.close(dst)
            if mem < 0:
                os.unlink(scratch)
            raise
        if mem < 0:
            os.close(dst)
        d.mem = mem  # the draft owns the memfd from here on
        self.drafts[(agent, path)] = d
        return d

    def _snapshot(self, node: Node) -> bytes | None:
        """A read handle's snapshot of small staged file ``node`` that has
        no scratch file (its idle memory draft was dropped), or None:
        reading a file just written then costs no file on disk, and works
        on a full disk; the bytes come from the read cache when the file
        was published or read lately (``readcache.py``), else from the
        store.  Bigger files get a scratch file (``ScratchFiles.materialize``)."""
        if node.scratch is not None or node.ref is not None or node.size >= MEMORY_DRAFT_MAX:
            return None
        data = self.reads.get(node)
        if data is None:
            data = self.scratch.content(node)  # CorruptObject: never served
            self.reads.put(node, data)
        return data

    def _draft_storage(self, size: int) -> tuple[str, int]:
        """Where a new draft of ``size`` bytes lives: ``(name, memfd)`` in
        memory when it is small (see :data:`MEMORY_DRAFT_MAX`), else
        ``(scratch file name, -1)`` (the file is not created here)."""
        if _MEMORY and size < MEMORY_DRAFT_MAX:
            try:
                mem = os.memfd_create("stepfs-draft", os.MFD_CLOEXEC)
            except OSError:
                pass  # out of descriptors or memory: a scratch file may still do
            else:
                return f"{_PROC_FD}/{mem}", mem
        return self.scratch.new(), -1

    def discard_draft(self, d: Draft) -> None:
        if self.drafts.get((d.agent, d.path)) is d:
            del self.drafts[(d.agent, d.path)]
        if d.frozen:
            return  # the file is a node's content
        if d.mem >= 0:
            os.close(d.mem)  # handles still open keep the memory through their own descriptors
            # The number may be handed out again: nothing may reopen it by name.
            d.mem, d.scratch = -1, ""
            return
        try:
            os.unlink(d.scratch)
        except FileNotFoundError:
            pass

    def thaw(self, d: Draft) -> None:
        """Before a frozen draft changes, or a memory draft grows past
        :data:`MEMORY_DRAFT_MAX`: copy its content (a node's content, or
        memory) into a new scratch file and move every handle of it there."""
        mine = [h for h in self.handles.values() if h.draft is d]
        new = self.scratch.new()
        dst = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        opened = d.mem < 0 and not mine
        try:
            # Through an open descriptor if there is one: the name may be gone.
            src = d.mem if d.mem >= 0 else mine[0].fd if mine else os.open(d.scratch, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(src)
                sparse_copy(src, dst, st.st_size)
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                if opened:
                    os.close(src)
        except BaseException:
            os.close(dst)
            os.unlink(new)
            raise
        os.close(dst)
        for h in mine:
            flags = fcntl.fcntl(h.fd, fcntl.F_GETFL) & (os.O_ACCMODE | os.O_APPEND)
            fd = os.open(new, flags | os.O_CLOEXEC)
            os.close(h.fd)
            h.fd = fd
        if d.mem >= 0:
            os.close(d.mem)
            d.mem = -1
        d.scratch, d.frozen = new, False

    def _writable(self, d: Draft, end: int = 0) -> Draft:
        """``d``, ready for a change that reaches byte ``end``.  Every
        change of a draft's bytes comes here first, so its running sum
        ends here (``write_with`` carries it over a write that extends it)."""
        d.sum, d.sum_end = None, -1
        if d.frozen or (d.mem >= 0 and end >= MEMORY_DRAFT_MAX):
            self.thaw(d)
        return d

    def _draft_for_write(self, path: str, agent: str) -> Draft:
        """The agent's draft of ``path``, after the read-then-write check."""
        seen = self.versions.observed.get(agent, {}).get(path)
        if seen is not None and self.guard and not self.versions.still(seen, path):
            self._note_error(agent, path, "ESTALE at open for writing: the file changed since you last read it")
            raise Stale(path)
        if seen is None and self.require_read and self.ns.exists(path):
            self._note_error(agent, path, "EACCES at open for writing: --require-read and you never read it")
            raise NotObserved(path)
        d = self.drafts.get((agent, path))
        if d is not None and d.frozen and not d.stale and not d.detached and self.versions.still(d.base, path):
            if d.opens:
                self.thaw(d)  # shared with its open descriptors, as before its close
            else:
                self.discard_draft(d)  # a new draft copies the node anyway
                d = None
        if d is not None and (d.stale or d.detached or not self.versions.still(d.base, path)):
            # A copy of an outdated version is never shared with a new open
            # (the agent has seen the current version, or it would have got
            # Stale above): its own descriptors keep it and lose at close.
            if d.opens:
                del self.drafts[(agent, path)]
            else:
                self.discard_draft(d)
            d = None
        if d is None:
            d = self._new_draft(path, agent)
        self.versions.observe(agent, path, d.base)
        self._attach_readers(d)
        return d

    def _attach_readers(self, d: Draft) -> None:
        """POSIX inside one agent: its read handles of the very version this
        draft starts from hold the same file, so from now on they read the
        draft -- its writes before and after its close (a publish keeps the
        draft).  Handles of an older version (the path was replaced since
        they opened) and other agents' handles keep what they opened."""
        for h in self.handles.values():
            if (h.agent == d.agent and h.path == d.path and h.draft is None and not h.writable and h.data is None
                    and h.token and self.versions.still(h.token, d.path)):
                self._read_draft(h, d)

    def _open_drafts_add(self, d: Draft, n: int) -> None:
        d.opens += n
        count = self.open_drafts.get(d.path, 0) + n
        if count > 0:
            self.open_drafts[d.path] = count
        else:
            self.open_drafts.pop(d.path, None)

    def reindex_draft(self, d: Draft, new_path: str) -> None:
        """Move a draft to another path (rename by its own agent)."""
        if d.opens:
            count = self.open_drafts.get(d.path, 0) - d.opens
            if count > 0:
                self.open_drafts[d.path] = count
            else:
                self.open_drafts.pop(d.path, None)
            self.open_drafts[new_path] = self.open_drafts.get(new_path, 0) + d.opens
        d.path = new_path

    def _note_error(self, agent: str, path: str, what: str) -> None:
        self.last_errors[agent] = f"{path}: {what}; re-read the file, then retry"

    # -- handles ------------------------------------------------------------------

    def _add_handle(self, h: Handle) -> int:
        fh = next(self._fh)
        self.handles[fh] = h
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise BadHandle(str(fh)) from None

    def handle_direct_io(self, fh: int) -> bool:
        h = self.handles.get(fh)
        return h is not None and h.direct

    def open(self, path: str, flags: int, agent: str = DEFAULT) -> int:
        with self.lock:
            if is_meta(path):
                if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
                    raise ReadOnly(path)
                entry = self.meta.entry(path)
                if entry.kind == "dir":
                    raise IsADirectory(path)
                return self._add_handle(Handle(path, -1, agent, False, data=entry.data, direct=True))
            direct = needs_direct_io(self.ns, self.handles.values(), self.versions.observed, path, agent)
            writable = flags & os.O_ACCMODE != os.O_RDONLY
            if writable or flags & os.O_TRUNC:
                self._check_writable(path)
                d = self._draft_for_write(path, agent)
                fd = os.open(d.scratch, os.O_RDWR | os.O_CLOEXEC | (flags & os.O_APPEND))
                h = Handle(path, fd, agent, True, draft=d, direct=direct, token=d.base)
                if flags & os.O_TRUNC:
                    os.ftruncate(fd, 0)
                    d.dirty = h.wrote = True
                    d.sum, d.sum_end = None, 0  # empty: a running sum may start
                self._open_drafts_add(d, 1)
                return self._add_handle(h)
            node, st = self.ns.resolve(path)
            if self.ns.kind(node, st) == "dir":
                raise IsADirectory(path)
            d = self.drafts.get((agent, path))
            if d is not None and (d.stale or not self.versions.still(d.base, path)):
                # An outdated copy (still open elsewhere, or idle): a new open
                # reads the published version, never an older one.
                if d.opens == 0:
                    self.discard_draft(d)
                d = None
            if d is not None:
                h = Handle(path, os.open(d.scratch, os.O_RDONLY | os.O_CLOEXEC), agent, False, draft=d, direct=direct,
                           token=d.base)
                self._open_drafts_add(d, 1)
            elif node is not None:
                snap = self._snapshot(node)
                if snap is None:
                    self.scratch.materialize(node)
                    fd = os.open(node.scratch, os.O_RDONLY | os.O_CLOEXEC)
                else:
                    fd = -1
                h = Handle(path, fd, agent, False, node=node, direct=direct, token=self.versions.node_token(node),
                           snap=snap)
            else:
                fd = self.ns.root.open(rel(path), os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    token = self.versions.open_token(fd)
                except BaseException:
                    os.close(fd)
                    raise
                h = Handle(path, fd, agent, False, direct=direct, token=token)
            self.versions.observe(agent, path, h.token)
            return self._add_handle(h)

    def create(self, path: str, mode: int, flags: int = os.O_RDWR, owner: tuple[int, int] | None = None,
               agent: str = DEFAULT) -> int:
        with self.lock:
            self._check_new_name(path)  # first: creating /.stepfs itself is EEXIST, not EROFS
            self._check_writable(path)
            self.ns.require_dir(parent_name(path)[0])
            if self.ns.exists(path):
                if flags & os.O_EXCL:
                    from stepfs.overlayfs.core.errors import Exists

                    raise Exists(path)
                return self.open(path, flags & ~os.O_CREAT, agent)
            node = Node("file", stat_mod.S_IFREG | stat_mod.S_IMODE(mode), base=self.ns.base_for(path),
                        ino=self.ns.new_ino(), uid=owner[0] if owner else os.getuid(),
                        gid=owner[1] if owner else os.getgid())
            self.ns.inherit_group(path, node)
            self.versions.bump(node)
            self.ns.upper.set(path, node)  # unstaged until the first close publishes it
            self.ns.entries_changed(path)
            old = self.drafts.get((agent, path))
            if old is not None:
                if old.opens:
                    # Still open (its file was removed by another agent): its
                    # descriptors keep the scratch file and lose at their close.
                    del self.drafts[(agent, path)]
                else:
                    self.discard_draft(old)
            scratch, mem = self._draft_storage(0)
            try:
                if mem >= 0 and not flags & os.O_APPEND:
                    # A second descriptor of the memory file without a walk
                    # through /proc (a tenth of a create): it shares the
                    # file offset, which no access here uses (every read and
                    # write is positional), and the flags, the same.
                    fd = os.dup(mem)
                else:
                    fd = os.open(scratch, os.O_RDWR | os.O_CLOEXEC | (flags & os.O_APPEND)
                                 | (0 if mem >= 0 else os.O_CREAT | os.O_EXCL), 0o600)
            except BaseException:
                if mem >= 0:
                    os.close(mem)
                raise
            d = Draft(agent, path, scratch, self.versions.node_token(node), node.base, node.mode, node.ino, node.uid, node.gid,
                      mem=mem)
            d.dirty = True  # a new file is a change even if nothing is written
            d.sum_end = 0  # empty: a running sum may start
            self.drafts[(agent, path)] = d
            self._open_drafts_add(d, 1)
            self.versions.observe(agent, path, d.base)
            return self._add_handle(Handle(path, fd, agent, True, draft=d, wrote=True,
                                           direct=needs_direct_io(self.ns, self.handles.values(), self.versions.observed, path, agent), token=d.base))

    def read(self, fh: int, size: int, offset: int) -> bytes:
        with self.lock:
            h = self._reader(fh)
            if h.data is not None:
                return h.data[offset:offset + size]
            if h.snap is not None:
                return h.snap[offset:offset + size]
            return os.pread(h.fd, size, offset)

    def readinto(self, fh: int, buf: memoryview, offset: int) -> int:
        """:meth:`read` into ``buf`` (a writable byte buffer, its length the
        size asked): the bytes read, with no ``bytes`` object made."""
        with self.lock:
            h = self._reader(fh)
            held = h.data if h.data is not None else h.snap
            if held is not None:
                chunk = held[offset:offset + len(buf)]
                memoryview(buf).cast("B")[:len(chunk)] = chunk
                return len(chunk)
            return os.preadv(h.fd, (buf,), offset)

    def read_fd(self, fh: int) -> int | None:
        """A new descriptor (the caller closes it) of the file handle
        ``fh`` reads, for a read the caller does itself (the FUSE adapter
        lets the kernel splice it); None for a handle whose bytes are in
        memory (use :meth:`readinto`)."""
        with self.lock:
            h = self._reader(fh)
            return None if h.data is not None or h.snap is not None else os.dup(h.fd)

    def _reader(self, fh: int) -> Handle:
        """Handle ``fh``, ready for a read (lock held)."""
        h = self._handle(fh)
        if h.draft is None and h.data is None:
            # The same agent may have started a draft since this handle
            # was opened: POSIX says it reads those bytes -- if the draft
            # is of the very version this handle was opened on (not of a
            # file that replaced it since).
            d = self.drafts.get((h.agent, h.path))
            if (d is not None and d.opens > 0 and not d.stale and self.versions.still(h.token, h.path)
                    and self.versions.still(d.base, h.path)):
                self._read_draft(h, d)
        return h

    def _read_draft(self, h: Handle, d: Draft) -> None:
        """Read handle ``h`` reads draft ``d`` from now on (lock held)."""
        if h.fd >= 0:  # -1: a snapshot (``_snapshot``)
            os.close(h.fd)
        h.fd = os.open(d.scratch, os.O_RDONLY | os.O_CLOEXEC)
        h.draft, h.node, h.snap = d, None, None
        self._open_drafts_add(d, 1)

    def write(self, fh: int, data, offset: int) -> int:
        """Write ``data`` (any byte buffer: the FUSE adapter passes libfuse's
        own memory, valid during the call only) at ``offset``.  A write
        that continues the draft's running sum adds the bytes to it."""
        with self.lock:
            h = self._handle(fh)
            if not h.writable:
                raise BadHandle(str(fh))
            d = h.draft
            s, end = d.sum, d.sum_end
            size = len(data)
            self._writable(d, offset + size)  # ends the sum: a failed write leaves none
            n = os.pwrite(h.fd, data, offset)
            h.wrote = True
            d.dirty = True
            if end == offset and n == size and (end or size >= SUM_FIRST_WRITE):
                if s is None:
                    s = refs.running_sum()
                s.update(data)
                d.sum, d.sum_end = s, end + n
            return n

    def truncate(self, path: str, length: int, fh: int | None = None, agent: str = DEFAULT) -> None:
        """``truncate(2)``, or ``ftruncate(2)`` (libfuse3's high-level API
        through mfusepy does not pass the handle): a write plus its close."""
        with self.lock:
            self._check_writable(path)
            if path in self.hidden:
                d = self.hidden[path][0]
                if d is not None:
                    os.truncate(self._writable(d, length).scratch, length)
                return
            if fh is not None and fh in self.handles and self.handles[fh].writable:
                h = self.handles[fh]
                self._writable(h.draft, length)
                os.ftruncate(h.fd, length)
                h.wrote = True
                h.draft.dirty = True
                return
            tmp = self.open(path, os.O_WRONLY, agent)
            try:
                self._writable(self.handles[tmp].draft, length)
                os.ftruncate(self.handles[tmp].fd, length)
                self.handles[tmp].wrote = True
                self.handles[tmp].draft.dirty = True
                self.flush(tmp)
            finally:
                self.release(tmp)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """``fallocate(2)`` on the draft (mode 0 extends; KEEP_SIZE, PUNCH_HOLE
        and ZERO_RANGE as the scratch filesystem supports them).  A write."""
        with self.lock:
            h = self._handle(fh)
            if not h.writable:
                raise BadHandle(str(fh))
            self._writable(h.draft, offset + length)
            if _libc.fallocate(h.fd, mode, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            h.wrote = True
            h.draft.dirty = True

    def flush(self, fh: int, publish: bool | Callable[[], bool] = True, later=None) -> None:
        """The close of one descriptor (see the module doc for the CAS).
        ``publish`` False: a close that does not end the writer's use of the
        handle (a forked child's copy, a dup; the adapter tells them apart,
        ``closers.py``): nothing is decided, the last decision is repeated,
        and what was written waits for the writer's close or ``release``.
        ``publish`` may be a callable giving that answer, asked only when
        it matters.

        ``later``: given by the adapter while it can run work after the
        reply (``libfuse.lowlevel.AfterReply.later``; None: everything is
        done before it returns).  The caller learns only 0 or an error;
        when that is decided to be 0 whoever the closer is -- the last
        decision was not ``stale`` and the draft would be published by a
        path that cannot fail (``cas.publish_later``, which makes the
        token check here) -- the closers decision and the publish are
        handed to ``later`` and this returns 0 at once.  Safe because:

        * the lock is taken once more here and released only by that work,
          so no other thread (a step's commit, a rollback, the row timer)
          runs between the token check and the publish: ``stepfs step``
          run right after the close includes its content;
        * the FUSE loop is single-threaded and runs the work right after
          the reply, before it reads the next request: every later OPEN,
          READ, GETATTR or WRITE of any agent sees the published file;
        * which process closes, and whether it wrote, is decided before
          the reply (``closers.Writers.closer``: once answered it may exit,
          and a process gone cannot be told from a writer); only the look
          at a writer's descriptors (``Writers.done``) runs after it.
          Meanwhile the writer can only have closed more (its FLUSHes
          queue behind this one) or exited, so the answer is the one it
          would have been, or the publish its next FLUSH would have made;
          a descriptor it gains without an OPEN (``dup`` of another
          writable one, which it held already, or one passed over a
          socket) leaves the publish to that descriptor's close, as at
          any close that has one;
        * writes reach the daemon before the FLUSH (no writeback cache).

        A failure of that work is logged and turns the mount read-only
        (``AfterReply.on_failure``); the handle stays as having written,
        so its ``release`` publishes the bytes."""
        with self.lock:
            h = self._handle(fh)
            if h.draft is None or not h.writable:
                return
            if h.wrote and later is not None and h.result != "stale" and publish is not False:
                work = self.cas.publish_later(h.draft)
                if work is not None:
                    self.lock.acquire()  # released by the work (same thread: the lock is re-entrant)
                    later(partial(self._after_reply, h, publish, work))
                    return
            if h.wrote and (publish() if callable(publish) else publish):
                h.wrote = False
                h.result = self.cas.close_write(h.draft)
            if h.result == "stale" or (h.result is None and h.draft.stale):
                raise Stale(h.path)

    def _after_reply(self, h: Handle, publish, work) -> None:
        """The part of a close :meth:`flush` left for after its reply
        (the lock still held from there, released here)."""
        try:
            if publish() if callable(publish) else publish:
                work()
                h.wrote = False
                h.result = "ok"
        finally:
            self.lock.release()

    def fsync(self, fh: int, datasync: bool) -> None:
        """Durability means staged in the store: the same decision as a
        close, and every recorded staged row written (view.py).  Content
        staged by reference lives in its scratch file: that is synced too."""
        self.flush(fh)
        self.rows.sync()
        with self.lock:
            h = self.handles.get(fh)
            if h is not None and h.draft is not None and h.draft.frozen:
                os.fsync(h.fd)

    def release(self, fh: int) -> None:
        """Never fails (the kernel ignores its result): a handle that still
        wrote after its last flush is decided here and the outcome recorded."""
        with self.lock:
            h = self.handles.pop(fh, None)
            if h is None:
                return
            if h.fd >= 0:
                os.close(h.fd)
            d = h.draft
            if d is None:
                return
            if h.writable and h.wrote:
                try:
                    self.cas.close_write(d)
                except Exception:
                    log.exception("publishing %s at release failed", d.path)
            self._open_drafts_add(d, -1)
            if d.opens == 0 and (d.stale or d.detached or d.frozen or self.drafts.get((d.agent, d.path)) is not d):
                self.discard_draft(d)  # lost, unlinked, published by reference, or replaced by a newer draft
            elif d.opens == 0 and d.mem >= 0 and not d.dirty:
                # Its bytes are published (or were never changed): memory is
                # held for open files only; a later open copies them again.
                self.discard_draft(d)

    def close(self) -> None:
        """Decide every open handle (unmount)."""
        with self.lock:
            for fh in list(self.handles):
                self.release(fh)
            self.reads.clear()

    # -- drafts following namespace changes ----------------------------------------

    def removed(self, agent: str | Callable[[], str], path: str, heir: str | None, subtree: bool = True) -> None:
        """``agent`` removed ``path`` (and everything below it): its drafts
        there are detached (its open descriptors keep working, POSIX-style),
        except that a draft of a hard-linked file moves to ``heir``, the
        file's remaining name.  Other agents' drafts lose at their close.
        ``agent`` may be a callable, asked only when there are drafts;
        ``subtree`` False: ``path`` is no directory, so only its own key is
        looked up (an ``rm -rf`` after an untar would scan every draft per
        unlink)."""
        if not self.drafts:
            return
        if callable(agent):
            agent = agent()
        prefix = path + "/"
        for (a, p), d in self._drafts_at(agent, path, subtree):
            if a == agent and p == path and heir is not None and (a, heir) not in self.drafts:
                del self.drafts[(a, p)]
                self.reindex_draft(d, heir)
                self.drafts[(a, heir)] = d
            elif a == agent and (p == path or p.startswith(prefix)):
                d.detached = True
                if d.opens == 0:
                    self.discard_draft(d)
                else:
                    del self.drafts[(a, p)]

    def hide(self, old: str, new: str, d: Draft | None, attrs: dict) -> None:
        """An open file unlinked as ``old`` lives on as the hidden name
        ``new`` (``d``: the agent's draft of it, ``attrs``: shown for it)."""
        self.hidden[new] = (d, attrs)
        for h in self.handles.values():
            if h.path == old:
                h.path = new

    def _drafts_at(self, agent: str, path: str, subtree: bool) -> list[tuple[tuple[str, str], Draft]]:
        """The acting agent's drafts at ``path``, and below it if ``subtree``:
        a file's rename looks up one key instead of scanning every draft
        (rsync and ``sed -i`` rename once a file, and a mount holds
        thousands of drafts after an untar)."""
        if not subtree:
            d = self.drafts.get((agent, path))
            return [] if d is None else [((agent, path), d)]
        prefix = path + "/"
        return [(k, d) for k, d in self.drafts.items()
                if k[0] == agent and (k[1] == path or k[1].startswith(prefix))]

    def _seen_at(self, agent: str, path: str, subtree: bool) -> list[str]:
        """The acting agent's observed paths at ``path`` (and below it if ``subtree``)."""
        seen = self.versions.observed.get(agent, {})
        if not subtree:
            return [path] if path in seen else []
        prefix = path + "/"
        return [p for p in seen if p == path or p.startswith(prefix)]

    def unkey(self, agent: str, path: str, subtree: bool = True) -> None:
        """Forget the acting agent's drafts at (or below, if ``subtree``) a
        path that is absent in the view (someone else removed their files)
        before a rename puts new files there: a later open must not share
        those dead copies.  Their own descriptors keep them, and they lose
        at their close."""
        for key, d in self._drafts_at(agent, path, subtree):
            if d.opens:
                del self.drafts[key]
            else:
                self.discard_draft(d)

    def fresh_under(self, agent: str, old: str, subtree: bool = True) -> tuple[set[int], set[str]]:
        """Before a rename: which of the acting agent's drafts and handles
        (by id) and observations at ``old`` (and below it when ``subtree``:
        a directory's rename) still match the published version."""
        prefix = old + "/"
        fresh = {id(d) for (_a, p), d in self._drafts_at(agent, old, subtree)
                 if not d.stale and self.versions.still(d.base, p)}
        fresh |= {id(h) for h in self.handles.values()
                  if h.agent == agent and h.token and (h.path == old or (subtree and h.path.startswith(prefix)))
                  and self.versions.still(h.token, h.path)}
        observed = self.versions.observed.get(agent, {})
        seen = {p for p in self._seen_at(agent, old, subtree) if self.versions.still(observed[p], p)}
        return fresh, seen

    def moved(self, agent: str, old: str, new: str, fresh: tuple[set[int], set[str]], subtree: bool = True) -> None:
        """The acting agent's drafts, handles and observations follow a
        rename (of a file, or with ``subtree`` of a directory and what is
        below it); other agents' stay at the old path and lose at their close.
        Only what was current before the move (``fresh``, from
        :meth:`fresh_under`) is re-based on the moved version: an outdated
        draft, handle or observation stays outdated, or a rename would turn
        a stale writer into a winner that overwrites another agent's bytes."""
        fresh_ids, fresh_seen = fresh  # ids of fresh drafts and handles; fresh observed paths
        prefix = old + "/"
        for (a, path), d in self._drafts_at(agent, old, subtree):
            del self.drafts[(a, path)]
            self.reindex_draft(d, new + path[len(old):])
            if id(d) in fresh_ids:
                d.base = self.versions.current_token(d.path)[0]
            self.drafts[(a, d.path)] = d
        for h in self.handles.values():
            if h.agent == agent and (h.path == old or (subtree and h.path.startswith(prefix))):
                h.path = new + h.path[len(old):]
                if id(h) in fresh_ids:
                    h.token = self.versions.current_token(h.path)[0]
        seen = self.versions.observed.get(agent, {})
        outdated = {}
        for path in self._seen_at(agent, old, subtree):
            tok = seen.pop(path)
            if path not in fresh_seen:
                outdated[new + path[len(old):]] = tok  # never equal to a moved node's new token
        self.versions.observe(agent, new, self.versions.current_token(new)[0])
        seen = self.versions.observed[agent]
        seen.update(outdated)

    def exchanged(self, agent: str, a: str, b: str) -> None:
        """``agent`` swapped paths ``a`` and ``b``: its drafts and handles
        swap with them, re-based on what each path shows now."""
        swap = {a: b, b: a}
        moved = [self.drafts.pop(key) for key in list(self.drafts) if key[0] == agent and key[1] in swap]
        for d in moved:
            self.reindex_draft(d, swap[d.path])
        for d in moved:
            d.base = self.versions.current_token(d.path)[0]
            self.drafts[(d.agent, d.path)] = d
        for h in self.handles.values():
            if h.agent == agent and h.path in swap:
                h.path = swap[h.path]
        self.versions.observe(agent, a, self.versions.current_token(a)[0])
        self.versions.observe(agent, b, self.versions.current_token(b)[0])

    def sync_draft_meta(self, path: str, node: Node) -> None:
        """A metadata change keeps the path's token, so every agent's draft of
        it stays current and may publish later, perhaps after a commit has
        dropped ``node`` (a draft then publishes with its own metadata): it
        must carry the new mode, owner and xattrs, or its close would put
        the old ones back."""
        for d in self.drafts_at(path):
            d.mode, d.uid, d.gid, d.xattrs = node.mode, node.uid, node.gid, dict(node.xattrs)

    def draft_of(self, agent: str, path: str) -> Draft | None:
        """``agent``'s draft of ``path``, if it has one."""
        return self.drafts.get((agent, path))

    def drafts_at(self, path: str) -> list[Draft]:
        """Every agent's draft of ``path``, looked up agent by agent (an agent
        with a draft has observed its path, so it is a key of ``observed``).
        Idle drafts stay cached, so scanning them all made ``tar -x``, which
        changes the metadata of every file it writes, O(n^2)."""
        drafts = self.drafts
        return [d for d in (drafts.get((agent, path)) for agent in self.versions.observed) if d is not None]

    def retoken(self, path: str, old: str, new: str, digest) -> None:
        """Same content, new token representation (copy-up for a metadata
        change): nobody's observation of the current version goes stale.
        ``old`` is the workspace token without hash, ``digest()`` the
        content's; a token taken in the racy window must match both (its
        stat fields alone may also describe an older, same-size version)."""
        for seen in self.versions.observed.values():
            tok = seen.get(path)
            if tok is not None and tokens.same(tok, old, digest):
                seen[path] = new
        for (_a, p), d in self.drafts.items():
            if p == path and tokens.same(d.base, old, digest):
                d.base = new
        for h in self.handles.values():
            if h.path == path and h.token and tokens.same(h.token, old, digest):
                h.token = new

    def carry_over(self, renamed: dict[str, tuple[str, str]]) -> None:
        """A commit gave paths new tokens for the same content (``path ->
        (old, new)``): drafts and handles based on the old one move along."""
        for d in self.drafts.values():
            if d.path in renamed and d.base == renamed[d.path][0]:
                d.base = renamed[d.path][1]
                d.node_base = renamed[d.path][1].partition(tokens.HASH_SEP)[0]
        for h in self.handles.values():
            if h.path in renamed and h.token == renamed[h.path][0]:
                h.token = renamed[h.path][1]

    # -- attributes of open content ---------------------------------------------

    def stat_handle(self, fh: int) -> dict | None:
        """Attributes of what open handle ``fh`` holds, or None (a file of
        the ``.stepfs`` tree, or no such handle: the path decides)."""
        h = self.handles.get(fh)
        if h is None:
            return None
        if h.draft is not None:
            out = self.stat_draft(h.draft, self.ns.upper.get(h.path))
            if self.hidden and h.path in self.hidden:
                out["st_nlink"] = self.hidden[h.path][1]["st_nlink"]
            return out
        if h.node is not None:
            out = self.ns.stat_node(h.node)
            if self.ns.upper.get(h.path) is not h.node:
                out["st_nlink"] = 0  # unlinked or replaced while open
            return out
        if h.fd >= 0 and h.data is None:
            return self._stat_lower_handle(h)
        return None

    def stat_open(self, path: str, agent) -> dict | None:
        """Attributes of a hidden name (an unlinked open file) or of the
        agent's open draft of ``path``, or None.  ``agent`` may be a
        callable, asked only when the path has open drafts."""
        if self.hidden and path in self.hidden:
            d, attrs = self.hidden[path]
            out = self.stat_draft(d, None) if d is not None else dict(attrs)
            out["st_nlink"] = attrs["st_nlink"]
            return out
        if path in self.open_drafts:
            d = self.drafts.get((agent() if callable(agent) else agent, path))
            if d is not None and d.opens > 0:
                return self.stat_draft(d, self.ns.upper.get(path))
        return None

    def _stat_lower_handle(self, h: Handle) -> dict:
        """``fstat`` of a handle reading a workspace file: the file it holds,
        whatever its path shows now (unlinked, or replaced by a rename:
        ``st_nlink`` 0).  Copied up for a metadata change, it is still the
        same file, shown with its node's attributes."""
        st = os.fstat(h.fd)
        try:
            node, cur = self.ns.resolve(h.path)
        except NotFound:
            node = cur = None
        if cur is not None and (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
            return self.ns.stat_lower(h.path, cur)
        if node is not None and node.kind == "file" and h.token == self.versions.node_token(node):
            return self.ns.stat_node(node)
        out = self.ns.stat_lower(h.path, st)
        out["st_nlink"] = 0
        return out

    def release_scratch(self, path: str) -> None:
        """Before scratch file ``path`` goes: a draft still open on it (its
        close published it by reference: ``Draft.frozen``) first moves to a
        copy, so it can keep reading, and writing, by name too."""
        for d in {id(h.draft): h.draft for h in self.handles.values()
                  if h.draft is not None and h.draft.frozen and h.draft.scratch == path}.values():
            self.thaw(d)

    def stat_draft(self, d: Draft, node: Node | None) -> dict:
        st = os.fstat(d.mem) if d.mem >= 0 else os.stat(d.scratch)
        mode = node.mode if node is not None else d.mode
        return {
            "st_mode": stat_mod.S_IFREG | stat_mod.S_IMODE(mode), "st_ino": node.ino if node else d.ino,
            "st_nlink": node.nlink if node is not None else 0 if d.detached else 1,
            "st_uid": node.uid if node else d.uid, "st_gid": node.gid if node else d.gid,
            "st_size": st.st_size, "st_blocks": st.st_blocks, "st_blksize": 4096,
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
            "st_ctime": max(st.st_ctime_ns, node.ctime_ns if node else 0),
        }


__all__ = ["Content", "Draft", "Handle", "sparse_copy"]
