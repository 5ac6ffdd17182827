"""``stepfs cat`` and ``stepfs diff`` against a shared history
(``--history URL``): a file's bytes as of a shared layer, and the changes
and unified diff between two shared layers, read from the history alone
(no workspace needed; the layer numbers are the history's).

A path is relative to the history's root (the workspace root of every
workspace attached to it); ``..`` may not climb above it.  The diff is the
local one's (``store/diff.py``) with the history's objects in place of the
local store's.
"""

from __future__ import annotations

import os
import posixpath

from stepfs.store import diff, records
from stepfs.store.errors import ContainmentError, NoSuchLayer, NoSuchPath
from stepfs.store.records import Change, State
from stepfs.store.shared import prune
from stepfs.store.shared.remote import Remote


def history_path(text: str, allow_root: bool = False) -> bytes:
    """A user's path as a path of the history (``b"a/b"``; ``b"."`` for
    the root with ``allow_root``), or :class:`ContainmentError`."""
    raw = os.fsencode(text)
    norm = posixpath.normpath(raw.lstrip(b"/")) if raw.strip(b"/") else b"."
    if raw.startswith(b"/") or norm == b".." or norm.startswith(b"../"):
        raise ContainmentError(f"{text} is not a path of the shared history; give a path relative to its root "
                               f"(the workspace's root), e.g. src/main.py.")
    if norm == b"." and not allow_root:
        raise ContainmentError(f"{text} names the history's root, not a file; give a path below it.")
    if norm.split(b"/")[0] == b".stepfs":
        raise ContainmentError(f"{text} is inside the store, which no history records.")
    return norm


def require_layer(remote: Remote, number: int, doing: str = "") -> int:
    """The history's head, if layer ``number`` is in it and kept; else
    NoSuchLayer (LayerPruned for a layer ``stepfs prune`` dropped, its
    message after ``doing``)."""
    head = remote.head()
    if head is None or not 0 <= number <= head:
        raise NoSuchLayer(f"layer {number} does not exist in the shared history {remote.url.display}"
                          f"{'' if head is None else f' (its head is {head})'}; 'stepfs log --history URL' "
                          f"lists its layers.")
    prune.require_kept(remote, number, doing)
    return head


def file_bytes(remote: Remote, number: int, path: str) -> bytes:
    """``stepfs cat --history URL N PATH``."""
    rel = history_path(path)
    require_layer(remote, number)
    with remote.objects_held():  # a prune then gc-history between the entry and its bytes: no missing object
        row = remote.path_at(rel, number)
        kind = None if row is None else row["after_kind"]
        if kind is None:
            prune.require_kept(remote, number)  # pruned since require_layer: its entries are gone
            raise NoSuchPath(f"{path} did not exist as of layer {number} of the shared history; 'stepfs show N "
                             f"--history URL' lists what each layer changed.")
        if kind != "file":
            raise NoSuchPath(f"{path} was a {kind} as of layer {number} of the shared history, not a file.")
        return remote.read_object(row["after_object"])


def after_state(row: dict | None) -> State:
    """A shared entry's after state, its object named by its SHA-256."""
    if row is None or row["after_kind"] is None:
        return State(None)
    return State(row["after_kind"], row["after_mode"], row["after_object"], row["after_target"], None, None,
                 row["after_xattrs"])


def same_state(a: State, b: State) -> bool:
    return (a.kind, a.mode, a.oid, a.target, a.xattrs) == (b.kind, b.mode, b.oid, b.target, b.xattrs)


def below(path: bytes, roots: list[bytes] | None) -> bool:
    return not roots or b"." in roots or any(path == r or path.startswith(r + b"/") for r in roots)


def changes_between(remote: Remote, old: int, new: int, paths: list[bytes] | None = None) -> list[Change]:
    """Every path (below ``paths``) whose state differs between shared
    layers ``old`` and ``new``, in path order."""
    require_layer(remote, max(old, new))
    require_layer(remote, min(old, new))
    before, after = remote.state_at(old), remote.state_at(new)
    for n in (old, new):
        prune.require_kept(remote, n)  # not pruned while its state was read (see prune.require_kept)
    out = []
    for path in sorted(set(before) | set(after)):
        if not below(path, paths):
            continue
        a, b = after_state(before.get(path)), after_state(after.get(path))
        if not same_state(a, b):
            out.append(Change(path, a, b))
    return out


class _Objects:
    """The history's objects where ``store.diff`` reads the local store's
    (``read_all``, ``size``; ``conn`` unused), each read once."""

    def __init__(self, remote: Remote):
        self.remote = remote
        self._cache: dict[str, bytes] = {}

    def read_all(self, _conn, digest: str) -> bytes:
        if digest not in self._cache:
            self._cache[digest] = self.remote.read_object(digest)
        return self._cache[digest]

    def size(self, conn, digest: str) -> int:
        return len(self.read_all(conn, digest))


def read_changes(remote: Remote, old: int, new: int, paths: list[bytes] | None = None) -> tuple[list[Change], str]:
    """``stepfs diff --history URL N [M]``: the changes and their patch."""
    objects = _Objects(remote)
    with remote.objects_held():  # as file_bytes: the states, then their objects
        changes = records.pair_renames(changes_between(remote, old, new, paths), lambda d: objects.size(None, d))
        return changes, diff.patch(objects, None, changes)
