"""A path's state as of any layer (store side, no FUSE).

The state of path ``p`` after layer ``n`` is, in order of precedence:

1. the *after* state of the newest committed entry for ``p`` in a layer <= n;
2. else the *before* state of the oldest committed entry for ``p`` in a
   layer > n (layers record "before" lazily, so an untouched path's baseline
   is captured by the first layer that touches it);
3. else the path was never touched: its state is the workspace's now.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod

from sqlalchemy import select

from stepfs.store import entrytable, schema
from stepfs.store.errors import ContainmentError, NoSuchPath
from stepfs.store.entrytable import entry_from_row
from stepfs.store.records import State
from stepfs.store.workspace import STORE_DIR, Workspace

L = schema.layers


#: Symbolic links followed while resolving one user path (as the kernel's MAXSYMLINKS).
MAX_SYMLINK_HOPS = 40


def user_path(ws: Workspace, path: str, mountpoint: str | None = None, allow_root: bool = False) -> bytes:
    """A user-supplied path as a workspace path (``b"a/b"``), or ContainmentError.

    The path is relative to the workspace; an absolute path must lie in the
    workspace (or in ``mountpoint``, a mount of it).  Components are resolved
    one by one against the workspace as it is now: ``..`` may not climb above
    the workspace, a symbolic link is followed only while it stays inside it,
    a regular file cannot be passed through, and nothing may reach into the
    store.  The last component is not followed (history records links as
    links).  Components that do not exist now are taken literally, so paths
    that only existed in older layers can still be named.  With
    ``allow_root`` the workspace itself is ``b"."``.
    """
    raw = os.fsencode(path)
    if raw.startswith(b"/"):
        for root in (ws.path, mountpoint):
            if not root:
                continue
            prefix = os.fsencode(root).rstrip(b"/")
            if raw == prefix or raw.startswith(prefix + b"/"):
                raw = raw[len(prefix):]
                break
        else:
            raise ContainmentError(f"{path} is outside the workspace {ws.path}; give a path relative to the workspace.")
    # A stack of (component, the symlink whose target it came from or None).
    todo: list[tuple[bytes, bytes | None]] = [(p, None) for p in reversed(raw.split(b"/"))]
    done: list[bytes] = []
    hops = 0
    while todo:
        part, origin = todo.pop()
        if part in (b"", b"."):
            continue
        if part == b"..":
            if not done:
                if origin is not None:
                    raise ContainmentError(
                        f"{path} goes through the symbolic link {os.fsdecode(origin)}, which points outside the "
                        f"workspace; give a path inside the workspace."
                    )
                raise ContainmentError(f"{path} leaves the workspace through '..'; give a path inside it.")
            done.pop()
            continue
        if not done and part == STORE_DIR.encode():
            raise ContainmentError(f"{path} is inside the stepfs store, which is not part of the workspace.")
        here = b"/".join(done + [part])
        if not any(p not in (b"", b".") for p, _o in todo):
            done.append(part)  # the last component: never followed
            continue
        try:
            st = ws.root.lstat(here)
        except (FileNotFoundError, NotADirectoryError):
            done.append(part)  # gone from the workspace; may still be in history
            continue
        except OSError as exc:
            raise ContainmentError(f"{path} cannot be resolved inside the workspace ({exc.strerror}).") from None
        if stat_mod.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise ContainmentError(f"{path} goes through too many symbolic links; give the path without them.")
            target = ws.root.readlink(here)
            if target.startswith(b"/"):
                prefix = os.fsencode(ws.path).rstrip(b"/")
                if target != prefix and not target.startswith(prefix + b"/"):
                    raise ContainmentError(
                        f"{path} goes through the symbolic link {os.fsdecode(here)}, which points outside the "
                        f"workspace ({os.fsdecode(target)}); give a path inside the workspace."
                    )
                done = []
                target = target[len(prefix):]
            # A relative target climbing out is caught by the '..' rule above.
            todo.extend((p, here) for p in reversed(target.split(b"/")))
            continue
        if not stat_mod.S_ISDIR(st.st_mode):
            raise ContainmentError(
                f"{path} goes through {os.fsdecode(here)}, which is a file and not a directory; check the path."
            )
        done.append(part)
    if not done:
        if allow_root:
            return b"."
        raise ContainmentError(f"{path!r} names the workspace itself; give a path inside it.")
    return b"/".join(done)


def require_layer(conn, number: int) -> None:
    """NoSuchLayer unless ``number`` is a committed layer."""
    if number < 0 or conn.execute(
        select(L.c.number).where(L.c.number == number, L.c.state == "committed")
    ).first() is None:
        from stepfs.store.layers import missing

        raise missing(conn, number)


def state_at(conn, path: bytes, number: int) -> State | None:
    """The state of ``path`` after layer ``number``; None if it was never
    touched by any layer (then the workspace holds it as it is now)."""
    row = entrytable.newest_at_or_before(conn, path, number)
    if row is not None:
        return entry_from_row(row).after
    row = entrytable.oldest_after(conn, path, number)
    if row is not None:
        return entry_from_row(row).before
    return None


def state_from_rows(rows: list, number: int) -> tuple[State, int | None] | None:
    """The state after layer ``number`` from one path's committed entry rows
    (any order), with the recorded mtime when the state is an *after* state;
    None for no rows.  Same precedence as :func:`state_at`."""
    if not rows:
        return None
    at_or_before = [r for r in rows if r.layer <= number]
    if at_or_before:
        row = max(at_or_before, key=lambda r: r.layer)
        return entry_from_row(row).after, row.after_mtime_ns
    row = min(rows, key=lambda r: r.layer)
    return entry_from_row(row).before, None


def file_bytes(ws: Workspace, number: int, path: str, mountpoint: str | None = None) -> bytes:
    """A file's bytes as of layer ``number`` (``stepfs cat``)."""
    rel = user_path(ws, path, mountpoint)
    with ws.db.read() as conn:
        require_layer(conn, number)
        state = state_at(conn, rel, number)
        if state is not None:
            if state.kind is None:
                raise NoSuchPath(f"{path} did not exist as of layer {number}; 'stepfs show' lists what each layer changed.")
            if state.kind != "file":
                raise NoSuchPath(f"{path} was a {state.kind} as of layer {number}, not a file.")
            return ws.objects.read_all(conn, state.oid)
    st = ws.root.lstat_or_none(rel)
    if st is not None and stat_mod.S_IFMT(st.st_mode) in (stat_mod.S_IFCHR, stat_mod.S_IFBLK, stat_mod.S_IFSOCK):
        # Never opened: opening a device can act on the device (a tape rewinds).
        raise NoSuchPath(f"{path} was a special file as of layer {number}, not a file.")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = ws.root.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise NoSuchPath(f"{path} did not exist as of layer {number}; 'stepfs show' lists what each layer changed.") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NoSuchPath(f"{path} was a symlink as of layer {number}, not a file.") from None
        if exc.errno == errno.EISDIR:
            raise NoSuchPath(f"{path} was a dir as of layer {number}, not a file.") from None
        raise ContainmentError(f"{path} cannot be read inside the workspace ({exc.strerror}).") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat_mod.S_ISREG(mode):
            kind = "dir" if stat_mod.S_ISDIR(mode) else "special file"
            raise NoSuchPath(f"{path} was a {kind} as of layer {number}, not a file.")
        chunks = []
        while True:
            data = os.read(fd, 1 << 20)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)
    finally:
        os.close(fd)
