"""Step 3 of a commit (``store.publish``): the intent's rows, their
checksum, taking an intent back, and the messages of a failed commit.

The intent is the single commit point: a ``pending`` layer whose
:func:`intent_checksum` verifies is rolled forward by ``store.recovery``.
"""

from __future__ import annotations

import os

import xxhash
from sqlalchemy import bindparam, func, select, update

from stepfs.store import entrytable, schema
from stepfs.store.db import Prepared
from stepfs.store.errors import PublishFailed, StoreUnavailable
from stepfs.store.layers import Entry, State
from stepfs.store.wsparts import WorkspaceParts

L = schema.layers


# The statements every commit runs, built once (building a Core statement
# costs more than SQLite takes to run it); the inserts go through
# ``db.Prepared`` (plain str, int and bytes values, every column given).
_LAYER_COLUMNS = ["number", "state", "kind", "created_ns", "message", "agent", "mount", "meta", "intent_sum", "step"]


_INSERT_LAYER = Prepared(L.insert(), _LAYER_COLUMNS)


_MARK_COMMITTED = Prepared(update(L).where(L.c.number == bindparam("n")).values(state=bindparam("state")))


_CONSUME_STEP = Prepared(schema.staged.delete().where(schema.staged.c.step == bindparam("s")))


_PENDING = select(L.c.number, L.c.intent_sum, L.c.step).where(L.c.state == "pending").order_by(L.c.number)


_FIRST_IN_STATE = Prepared(select(func.min(L.c.number)).where(L.c.state == bindparam("state")))


def intent_checksum(entries: list[Entry], step: int | None = None) -> str:
    """The checksum stored with an intent: any torn, truncated or altered
    intent (an entry missing, changed or added, another step) fails it.
    Without a step it is the format-1 checksum of the entries alone."""
    h = xxhash.xxh3_128()
    for e in sorted(entries, key=lambda e: e.path):
        parts = (e.path, *_state_parts(e.before), *_state_parts(e.after), str(e.after_mtime_ns).encode())
        if e.after_link is not None:
            parts += (b"link", e.after_link)
        for part in parts:
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    if step is not None:
        for part in (b"step", str(step).encode()):
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
    return h.hexdigest()


def _state_parts(s: State) -> tuple[bytes, ...]:
    return (str(s.kind).encode(), str(s.mode).encode(), str(s.oid).encode(),
            s.target if s.target is not None else b"\0", str(s.uid).encode(), str(s.gid).encode(),
            s.xattrs if s.xattrs is not None else b"\0")


def _prepare_failure(exc: OSError) -> PublishFailed:
    return PublishFailed(
        f"could not write the step's new files ({_why(exc)}); nothing in the workspace was changed and "
        f"the step is still open: fix the cause and run 'stepfs step' again.", exc.errno,
    )


def _withdraw_intent(ws: WorkspaceParts, number: int, cause: OSError) -> None:
    """Delete the intent of layer ``number`` (nothing of it was published:
    no rename happened), durably, so it is as if it was never recorded.
    If that fails too, the layer stays pending and recovery publishes it
    (rewriting every new file from the store)."""
    try:
        with ws.db.write(durable=True) as conn:
            entrytable.delete_layer(conn, number)
            conn.execute(L.delete().where((L.c.number == number) & (L.c.state == "pending")))
    except StoreUnavailable:
        raise _pending_failure(number, cause) from None


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f": {os.fsdecode(exc.filename)}" if exc.filename else "")


def _pending_failure(number: int, exc: OSError) -> PublishFailed:
    return PublishFailed(
        f"layer {number} could not be written into the workspace ({_why(exc)}); it stays pending and is "
        f"rewritten from the store by the next stepfs command or mount once the cause is fixed.",
        exc.errno, number,
    )
