"""The read-only ``.stepfs`` tree inside a mount (FUSE-free).

``MOUNT/.stepfs`` is hidden from ``readdir`` of the mount root and reachable
by path, like ZFS's ``.zfs``.  Everything below it is generated from the
store and the view's state and is read-only: the view raises ``ReadOnly``
for any change before it gets here.

Layout (grows with the browse and version-token work):

* ``status``     text: mount, workspace, open step, staged paths, last error
  per agent with its remedy
* ``conflicts/<path>``  the losing bytes of the latest stale close of
  ``<path>`` in this mount (``stepfs status --json`` lists every conflict)

Each entry is described by :class:`MetaEntry`; files are generated whole at
``open`` (so one open reads one consistent snapshot).

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import select

from store import schema

from .errors import NotFound

if TYPE_CHECKING:
    from .view import Overlay

ROOT = "/.stepfs"


@dataclass
class MetaEntry:
    kind: str  # dir | file | symlink
    ino: int
    data: bytes = b""  # file content or symlink target


def is_meta(path: str) -> bool:
    return path == ROOT or path.startswith(ROOT + "/")


class MetaTree:
    """Generated entries below ``/.stepfs``."""

    INO_BASE = (1 << 61)

    def __init__(self, view: "Overlay"):
        self.view = view

    # -- lookup -------------------------------------------------------------

    CONFLICTS = ROOT + "/conflicts"

    def entry(self, path: str) -> MetaEntry:
        if path == ROOT:
            return MetaEntry("dir", self.INO_BASE + 1)
        if path == ROOT + "/status":
            return MetaEntry("file", self.INO_BASE + 2, self.view.status_text().encode())
        if path == self.CONFLICTS or path.startswith(self.CONFLICTS + "/"):
            return self._conflict_entry(path[len(self.CONFLICTS):] or "/")
        raise NotFound(path)

    def children(self, path: str) -> list[tuple[str, str, int]]:
        """``[(name, kind, ino)]`` of a directory of the tree."""
        if path == ROOT:
            return [("status", "file", self.INO_BASE + 2), ("conflicts", "dir", self.INO_BASE + 3)]
        if path == self.CONFLICTS or path.startswith(self.CONFLICTS + "/"):
            sub = path[len(self.CONFLICTS):] or "/"
            prefix = sub.rstrip("/") + "/"
            names: dict[str, str] = {}
            for p in self._conflicts():
                if p.startswith(prefix):
                    head, sep, _rest = p[len(prefix):].partition("/")
                    names[head] = "dir" if sep else names.get(head, "file")
            return [(n, k, self._ino(prefix + n)) for n, k in sorted(names.items())]
        raise NotFound(path)

    # -- conflicts --------------------------------------------------------------

    def _conflicts(self) -> dict[str, str]:
        """Path (view form) -> oid of its latest conflict in this mount."""
        c = schema.conflicts
        with self.view.ws.db.read() as conn:
            rows = conn.execute(
                select(c.c.path, c.c.oid).where(c.c.mount == self.view.mountpoint).order_by(c.c.id)
            ).all()
        return {"/" + os.fsdecode(bytes(r.path)): r.oid for r in rows}

    def _ino(self, sub: str) -> int:
        return self.INO_BASE + 16 + (hash(sub) & 0xFFFFFFFF)

    def _conflict_entry(self, sub: str) -> MetaEntry:
        if sub == "/":
            return MetaEntry("dir", self.INO_BASE + 3)
        found = self._conflicts()
        if sub in found:
            with self.view.ws.db.read() as conn:
                data = self.view.ws.objects.read_all(conn, found[sub])
            return MetaEntry("file", self._ino(sub), data)
        if any(p.startswith(sub + "/") for p in found):
            return MetaEntry("dir", self._ino(sub))
        raise NotFound(self.CONFLICTS + sub)

    # -- FUSE-shaped helpers used by the view -------------------------------------

    _TYPE = {"dir": stat_mod.S_IFDIR | 0o555, "file": stat_mod.S_IFREG | 0o444, "symlink": stat_mod.S_IFLNK | 0o777}

    def getattr(self, path: str) -> dict:
        e = self.entry(path)
        now = time.time_ns()
        return {
            "st_mode": self._TYPE[e.kind], "st_ino": e.ino, "st_nlink": 2 if e.kind == "dir" else 1,
            "st_size": len(e.data), "st_uid": os.getuid(), "st_gid": os.getgid(),
            "st_atime": now, "st_mtime": now, "st_ctime": now, "st_blocks": (len(e.data) + 511) // 512,
        }

    def readdir(self, path: str) -> list[tuple[str, int, int]]:
        e = self.entry(path)
        if e.kind != "dir":
            from .errors import NotADirectory

            raise NotADirectory(path)
        kinds = {"dir": stat_mod.S_IFDIR, "file": stat_mod.S_IFREG, "symlink": stat_mod.S_IFLNK}
        return [(".", stat_mod.S_IFDIR, e.ino), ("..", stat_mod.S_IFDIR, 1)] + [
            (name, kinds[kind], ino) for name, kind, ino in self.children(path)
        ]

    def readlink(self, path: str) -> str:
        e = self.entry(path)
        if e.kind != "symlink":
            from .errors import Invalid

            raise Invalid(path)
        return os.fsdecode(e.data)
