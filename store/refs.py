"""Staged files held by reference (store side, no FUSE).

A close that publishes a big file (at least :data:`MIN_SIZE` bytes) does not
copy its bytes into the object store: the staged row names the file's
scratch file instead (``staged.scratch``, with ``scratch_sum``, the
XXH3-128 of its content, and ``size``), and the daemon never writes that
file again (a later writer copies it into a new draft).  The bytes are taken
into the object store by :func:`import_refs` before anything reads the
rows as content: a commit (``publish.commit_step``) and a discard.

Invariants:

* A referenced file lives in :func:`scratch_dir` of the row's step, under
  the name in ``scratch``; it is removed only after no staged row names it
  any more (the daemon, ``overlayfs/core/view.py``), and a daemon starting on
  the step keeps every referenced file and removes the other leftovers.
* :func:`import_refs` runs in the caller's write transaction: the object and
  the rewritten rows (``oid`` set, ``scratch`` NULL) commit together or not
  at all, so a crash leaves either the reference or the object, never
  neither.  It does not remove the file (the daemon may still serve it).
* A referenced file whose size or sum does not match its row (lost in a
  power cut, or changed by hand) is never imported: :class:`MissingStagedContent`.
"""

from __future__ import annotations

import os

import xxhash
from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from stepfs.store import schema
from stepfs.store.errors import MissingStagedContent
from stepfs.store.objects import xxh3_hex

S = schema.staged

#: Files of at least this size are staged by reference at close; smaller ones
#: are stored at once (a transaction per close costs little next to the
#: scratch file a reference keeps, and small files dominate tar and git).
MIN_SIZE = 1 << 20


def scratch_dir(store_dir: str, step: int) -> str:
    """Where the daemon of open step ``step`` keeps its scratch files."""
    return os.path.join(store_dir, "scratch", str(step))


def running_sum():
    """A hash object whose ``hexdigest()`` after ``update`` with a file's
    bytes, front to back, equals :func:`content_sum` of the file."""
    return xxhash.xxh3_128()


def content_sum(fd: int) -> str:
    """XXH3-128 (hex) of the whole open file ``fd``.  Read with pread, not
    mapped: a file cut short meanwhile (by hand) must not kill the reader
    with SIGBUS; it just gives another sum."""
    h = xxhash.xxh3_128()
    offset = 0
    while piece := os.pread(fd, 1 << 20, offset):
        h.update(piece)
        offset += len(piece)
    return h.hexdigest()


def referenced(conn: Connection, step: int) -> set[str]:
    """Names of the scratch files the staged rows of ``step`` reference."""
    return {r[0] for r in conn.execute(
        select(S.c.scratch).where(S.c.step == step, S.c.scratch.is_not(None)).distinct())}


def import_refs(ws, conn: Connection, step: int) -> dict[str, str]:
    """Store every file the rows of ``step`` reference as an object and make
    the rows name that object instead, through ``conn`` (a write
    transaction of the caller).  Returns ``{scratch name: oid}``.  Raises
    :class:`MissingStagedContent` if a referenced file is gone or damaged
    (nothing is rewritten then: the transaction is the caller's to roll
    back)."""
    rows = conn.execute(
        select(S.c.scratch, S.c.scratch_sum, S.c.size, S.c.path)
        .where(S.c.step == step, S.c.scratch.is_not(None))
    ).all()
    done: dict[str, str] = {}
    where = scratch_dir(ws.store_dir, step)
    for name, want, size, path in rows:
        if name in done:
            continue
        try:
            fd = os.open(os.path.join(where, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise MissingStagedContent(
                f"the staged content of {os.fsdecode(bytes(path))} (scratch file {name} of step {step}) is "
                f"missing; discard that path with 'stepfs discard' and write it again.") from None
        try:
            # An object id is the content's XXH3-128 (plus a collision
            # suffix): with that hasher the put itself checks the sum, in
            # the same read.  A mismatch raises inside the caller's
            # transaction, so the chunks just put go with it.
            same_hash = ws.objects.hasher is xxh3_hex
            if os.fstat(fd).st_size != size or (not same_hash and content_sum(fd) != want):
                raise _damaged(path, name, step)
            oid, _size = ws.objects.put_fd(conn, fd)
            if same_hash and oid.split(".", 1)[0] != want:
                raise _damaged(path, name, step)
        finally:
            os.close(fd)
        conn.execute(update(S).where(S.c.step == step, S.c.scratch == name)
                     .values(oid=oid, scratch=None, scratch_sum=None))
        done[name] = oid
    return done


def _damaged(path, name: str, step: int) -> MissingStagedContent:
    return MissingStagedContent(
        f"the staged content of {os.fsdecode(bytes(path))} (scratch file {name} of step {step}) no longer "
        f"matches what was closed; discard that path with 'stepfs discard' and write it again.")
