"""The read-only ``.stepfs`` tree inside a mount (FUSE-free).

``MOUNT/.stepfs`` is hidden from ``readdir`` of the mount root and reachable
by path, like ZFS's ``.zfs``.  Everything below it is generated from the
store and the view's state and is read-only: the view raises ``ReadOnly``
for any change before it gets here.

Layout:

* ``status``            text: mount, workspace, head layer, the open step's number
                        (head + 1), staged paths, last
                        error per agent with its remedy
* ``conflicts/<path>``  the losing bytes of the latest stale close of
                        ``<path>`` in this mount (``stepfs status --json``
                        lists every conflict)
* ``layers/``           one directory per committed layer, plus ``latest``
* ``layers/latest``     symlink to the number of the head layer
* ``layers/N/...``      the whole workspace as it was after layer N
                        (``store.snapshot``: listing a directory costs that
                        directory plus the entries below it, never the
                        whole workspace)

Each entry is described by :class:`MetaEntry`.  Generated text files are
built whole at ``open`` (one open reads one consistent snapshot); a layer
file's ``data`` is a :class:`LayerFile` that reads only the requested range,
from its object (immutable) or, for a file untouched since the layer, from
the workspace file opened at the first read.

Owners and modes (issue 18): with ``allow_other`` the kernel checks every
access against what ``getattr`` reports (``default_permissions``), so each
entry reports what its original has: a layer's files and directories the
owner and mode the layer recorded, a conflict copy the mode it was closed
with and the owner of the path in the mount, and a directory of
``conflicts/`` the owner and mode of the mount's directory of that name
(0700 of the mount's owner when it is gone).  A 0600 file in a 0700
directory is as private in ``.stepfs`` as in the tree.  ``status`` lists
to each caller (:attr:`MetaTree.caller`) only the staged paths that caller
could list in the mount.

Inode numbers are synthetic and stable: a hash of (layer, path), so the same
file in two layers, or in a layer and in the live tree, never looks like a
hard link to ``tar``, ``cp -a`` or ``du``.

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import xxhash

from stepfs.store import conflicts as store_conflicts, layers as store_layers
from stepfs.store.contained import NODE_KINDS
from stepfs.store.errors import NoSuchLayer
from stepfs.store.snapshot import Item, Snapshot

from stepfs.overlayfs.core.errors import Invalid, NotADirectory, NotFound, ViewError

if TYPE_CHECKING:
    from stepfs.store.workspace import Workspace

ROOT = "/.stepfs"
LAYERS = ROOT + "/layers"
CONFLICTS = ROOT + "/conflicts"
LATEST = "latest"


@dataclass
class MetaEntry:
    kind: str  # dir | file | symlink, or (in layers) fifo | chardev | blockdev | socket
    ino: int
    data: object = b""  # file content (bytes or LayerFile) or symlink target (bytes)
    mode: int | None = None  # permission bits; None: the kind's default
    mtime_ns: int | None = None  # None: now
    rdev: int = 0  # a device's number
    uid: int | None = None  # None: the mount's owner
    gid: int | None = None


def _permits(st: dict, uid: int, gids: frozenset[int], want: int) -> bool:
    """Whether ``uid`` (in ``gids``) has the ``want`` bits (4 read, 1
    search) on a file with attributes ``st``, as the kernel decides it."""
    mode = st["st_mode"]
    if uid == st["st_uid"]:
        bits = mode >> 6
    elif st["st_gid"] in gids:
        bits = mode >> 3
    else:
        bits = mode
    return bits & want == want


def is_meta(path: str) -> bool:
    return path == ROOT or path.startswith(ROOT + "/")


class LayerFile:
    """The bytes of a file as of a layer, read on demand (sliceable).

    Object content is immutable and read chunk-range by chunk-range in its
    own read transaction.  Workspace content (untouched since the layer) is
    read from one descriptor opened at the first read and closed when the
    handle holding this object is dropped, so one open sees one file even if
    a later commit renames a new one over it.
    """

    def __init__(self, ws: "Workspace", path: bytes, item: Item):
        self.ws = ws
        self.path = path
        self.item = item
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.item.size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, _ = key.indices(self.item.size)
        size = max(stop - start, 0)
        if self.item.oid is not None:
            with self.ws.db.read() as conn:
                return self.ws.objects.read_range(conn, self.item.oid, start, size)
        if self._fd is None:
            self._fd = self.ws.root.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            weakref.finalize(self, os.close, self._fd)
        return os.pread(self._fd, size, start)


def layer_ino(number: int, path: bytes) -> int:
    """A stable inode number for ``path`` in layer ``number``, in a range of
    its own (above the tree's fixed entries, below the view's synthetic ones)."""
    h = xxhash.xxh64_intdigest(number.to_bytes(8, "little") + path)
    return MetaTree.LAYER_INO_BASE + h % MetaTree.LAYER_INO_SPAN


class MetaTree:
    """Generated entries below ``/.stepfs``."""

    INO_BASE = 1 << 61
    LAYER_INO_BASE = INO_BASE + (1 << 40)
    LAYER_INO_SPAN = (1 << 61) - (1 << 40)

    def __init__(self, ws: "Workspace", mountpoint: str, await_settled: Callable[[], None],
                 status_text: Callable[[Callable[[str], bool] | None], str], getattr: Callable[[str], dict]):
        """``await_settled()``: waits until no commit of the view is
        completing (history as of the last commit's answer);
        ``status_text(listable)``: the content of ``status``, with only the
        staged paths ``listable(path)`` allows; ``getattr(path)``: the
        mount's own attributes of a path (owners of conflict copies)."""
        self.ws = ws
        self.mountpoint = mountpoint
        self._await_settled = await_settled
        self._status_text = status_text
        self._getattr = getattr
        #: ``() -> (uid, gids)`` of the process making the current request
        #: (set by the FUSE adapter); None: the mount's owner (no filter).
        self.caller: Callable[[], tuple[int, frozenset[int]]] | None = None

    # -- lookup -------------------------------------------------------------

    def entry(self, path: str) -> MetaEntry:
        if path.startswith((LAYERS, CONFLICTS)):
            self._await_settled()  # history as of the last commit's answer
        if path == ROOT:
            return MetaEntry("dir", self.INO_BASE + 1)
        if path == ROOT + "/status":
            return MetaEntry("file", self.INO_BASE + 2, self._status_text(self._listable()).encode())
        if path == LAYERS:
            return MetaEntry("dir", self.INO_BASE + 3)
        if path == LAYERS + "/" + LATEST:
            with self.ws.db.read() as conn:
                head = store_layers.head(conn)
            return MetaEntry("symlink", self.INO_BASE + 4, str(head).encode())
        if path.startswith(LAYERS + "/"):
            return self._layer_entry(path)
        if path == CONFLICTS or path.startswith(CONFLICTS + "/"):
            return self._conflict_entry(path[len(CONFLICTS):] or "/")
        raise NotFound(path)

    def children(self, path: str) -> list[tuple[str, str, int]]:
        """``[(name, kind, ino)]`` of a directory of the tree."""
        if path.startswith((LAYERS, CONFLICTS)):
            self._await_settled()
        if path == ROOT:
            return [("conflicts", "dir", self.INO_BASE + 5), ("layers", "dir", self.INO_BASE + 3),
                    ("status", "file", self.INO_BASE + 2)]
        if path == CONFLICTS or path.startswith(CONFLICTS + "/"):
            sub = path[len(CONFLICTS):] or "/"
            if self._conflict_entry(sub).kind != "dir":
                raise NotADirectory(path)
            prefix = sub.rstrip("/") + "/"
            names: dict[str, str] = {}
            for p in self._conflicts():
                if p.startswith(prefix):
                    head, sep, _rest = p[len(prefix):].partition("/")
                    names[head] = "dir" if sep else names.get(head, "file")
            return [(n, k, self._conflict_ino(prefix + n)) for n, k in sorted(names.items())]
        if path == LAYERS:
            with self.ws.db.read() as conn:
                numbers = store_layers.committed_numbers(conn)
            return [(str(n), "dir", layer_ino(n, b".")) for n in numbers] + [
                (LATEST, "symlink", self.INO_BASE + 4)
            ]
        if path.startswith(LAYERS + "/"):
            number, rel = self._split(path)
            with self.ws.db.read() as conn:
                snap = self._snapshot(conn, number, path)
                item = snap.lookup(rel)
                if item is None:
                    raise NotFound(path)
                if item.kind != "dir":
                    raise NotADirectory(path)
                prefix = b"" if rel == b"." else rel + b"/"
                return [(os.fsdecode(name), kind, layer_ino(number, prefix + name))
                        for name, kind in snap.listdir(rel)]
        self.entry(path)  # NotFound for unknown paths
        raise NotADirectory(path)

    # -- conflicts --------------------------------------------------------------

    def _conflicts(self) -> dict[str, tuple[str | None, int | None]]:
        """Path (view form) -> (oid, mode) of its latest conflict in this mount."""
        with self.ws.db.read() as conn:
            found = store_conflicts.of_mount(conn, self.mountpoint)
        return {"/" + os.fsdecode(path): row for path, row in found.items()}

    def _live(self, path: str) -> dict | None:
        """The mount's own attributes of ``path`` (view form), or None."""
        try:
            return self._getattr(path)
        except (OSError, ViewError):  # gone, or below something that is no directory
            return None

    def _live_owner(self, path: str) -> tuple[int, int]:
        """The owner of ``path`` in the mount, else of its nearest existing parent."""
        while True:
            st = self._live(path)
            if st is not None:
                return st["st_uid"], st["st_gid"]
            if path in ("/", ""):
                return os.getuid(), os.getgid()
            path = path.rpartition("/")[0] or "/"

    def _conflict_ino(self, sub: str) -> int:
        # Below LAYER_INO_BASE and above the fixed entries.
        return self.INO_BASE + 16 + xxhash.xxh32_intdigest(os.fsencode(sub))

    def _conflict_entry(self, sub: str) -> MetaEntry:
        if sub == "/":
            return MetaEntry("dir", self.INO_BASE + 5)
        found = self._conflicts()
        if sub in found:
            oid, mode = found[sub]
            with self.ws.db.read() as conn:
                data = self.ws.objects.read_all(conn, oid) if oid is not None else b""
            uid, gid = self._live_owner(sub)
            # The mode it was closed with (never more than the original's):
            # unknown, owner-only.
            mode = stat_mod.S_IMODE(mode) if mode is not None else 0o400
            return MetaEntry("file", self._conflict_ino(sub), data, mode=mode, uid=uid, gid=gid)
        if any(p.startswith(sub + "/") for p in found):
            live = self._live(sub)
            if live is not None and stat_mod.S_ISDIR(live["st_mode"]):
                return MetaEntry("dir", self._conflict_ino(sub), mode=stat_mod.S_IMODE(live["st_mode"]),
                                 uid=live["st_uid"], gid=live["st_gid"])
            uid, gid = self._live_owner(sub)
            return MetaEntry("dir", self._conflict_ino(sub), mode=0o700, uid=uid, gid=gid)
        raise NotFound(CONFLICTS + sub)

    # -- who may see what ---------------------------------------------------------

    def _listable(self) -> Callable[[str], bool] | None:
        """For the current caller: whether it could list the name ``path``
        (view form) in the mount: search permission on every directory
        above it and read permission on its parent.  None: no filter (the
        mount's owner or root, or no caller known)."""
        if self.caller is None:
            return None
        uid, gids = self.caller()
        if uid == 0 or uid == os.getuid():
            return None
        cache: dict[str, bool] = {}

        def may(d: str, want: int) -> bool:
            key = f"{want}{d}"
            if key not in cache:
                st = self._live(d)
                cache[key] = st is not None and stat_mod.S_ISDIR(st["st_mode"]) and _permits(st, uid, gids, want)
            return cache[key]

        def listable(path: str) -> bool:
            parent = path.rpartition("/")[0] or "/"
            d = parent
            while True:
                if not may(d, 1):
                    return False
                if d == "/":
                    break
                d = d.rpartition("/")[0] or "/"
            return may(parent, 4)

        return listable

    def _split(self, path: str) -> tuple[int, bytes]:
        """``/.stepfs/layers/N/a/b`` -> ``(N, b"a/b")``; the layer root is ``b"."``."""
        rest = path[len(LAYERS) + 1:]
        name, _, below = rest.partition("/")
        # Only the canonical spelling names a layer: '007' or '+7' would give
        # one layer several inode-distinct names.
        if not name.isdigit() or not name.isascii() or (len(name) > 1 and name[0] == "0"):
            raise NotFound(path)
        return int(name), os.fsencode(below) if below else b"."

    def _snapshot(self, conn, number: int, path: str) -> Snapshot:
        try:
            return Snapshot(self.ws, conn, number)
        except NoSuchLayer:
            raise NotFound(path) from None

    def _layer_entry(self, path: str) -> MetaEntry:
        number, rel = self._split(path)
        with self.ws.db.read() as conn:
            item = self._snapshot(conn, number, path).lookup(rel)
        if item is None:
            raise NotFound(path)
        ino = layer_ino(number, rel)
        owner = {"uid": item.uid, "gid": item.gid}
        if item.kind == "dir":
            return MetaEntry("dir", ino, mode=item.mode, mtime_ns=item.mtime_ns, **owner)
        if item.kind == "symlink":
            return MetaEntry("symlink", ino, item.target or b"", mtime_ns=item.mtime_ns, **owner)
        if item.kind in NODE_KINDS:
            return MetaEntry(item.kind, ino, mode=item.mode, mtime_ns=item.mtime_ns, rdev=item.rdev, **owner)
        return MetaEntry("file", ino, LayerFile(self.ws, rel, item), mode=item.mode, mtime_ns=item.mtime_ns,
                         **owner)

    # -- FUSE-shaped helpers used by the view -------------------------------------

    _TYPE = {"dir": stat_mod.S_IFDIR, "file": stat_mod.S_IFREG, "symlink": stat_mod.S_IFLNK, **NODE_KINDS}
    _DEFAULT_MODE = {"dir": 0o555, "file": 0o444, "symlink": 0o777}

    def getattr(self, path: str) -> dict:
        e = self.entry(path)
        when = e.mtime_ns if e.mtime_ns is not None else time.time_ns()
        mode = e.mode if e.mode is not None else self._DEFAULT_MODE[e.kind]
        size = 0 if e.kind == "dir" else len(e.data)
        return {
            "st_mode": self._TYPE[e.kind] | mode, "st_ino": e.ino, "st_nlink": 2 if e.kind == "dir" else 1,
            "st_size": size, "st_uid": os.getuid() if e.uid is None else e.uid,
            "st_gid": os.getgid() if e.gid is None else e.gid,
            "st_atime": when, "st_mtime": when, "st_ctime": when, "st_blocks": (size + 511) // 512,
            "st_rdev": e.rdev,
        }

    def readdir(self, path: str) -> list[tuple[str, int, int]]:
        e = self.entry(path)
        if e.kind != "dir":
            raise NotADirectory(path)
        return [(".", stat_mod.S_IFDIR, e.ino), ("..", stat_mod.S_IFDIR, 1)] + [
            (name, self._TYPE[kind], ino) for name, kind, ino in self.children(path)
        ]

    def readlink(self, path: str) -> str:
        e = self.entry(path)
        if e.kind != "symlink":
            raise Invalid(path)
        return os.fsdecode(e.data)

