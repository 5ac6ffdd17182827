"""Local objects and states to and from the shared history.

A local oid means nothing in another store (collision suffixes depend on
insertion order), so content crosses by its bytes: an upload hashes a
local object's bytes with SHA-256 and puts it unless the history has that
key; a download puts the bytes into the local store, which gives them a
local oid.  Owners (uid, gid) do not cross machines: a state taken from
the history gets the committer's, as a new file would.
"""

from __future__ import annotations

import hashlib

from stepfs.store.layers import Entry, State
from stepfs.store.shared.remote import Remote


class Uploader:
    """Uploads the objects of local states, each once."""

    def __init__(self, ws, remote: Remote):
        self.ws, self.remote = ws, remote
        self._done: dict[str, str] = {}  # local oid -> shared hash

    def digest(self, oid: str) -> str:
        if oid in self._done:
            return self._done[oid]
        with self.ws.db.read() as conn:
            pieces = list(self.ws.objects.iter_chunks(conn, oid))
        h = hashlib.sha256()
        for p in pieces:
            h.update(p)
        digest = h.hexdigest()
        if self.remote.missing_objects({digest}):
            self.remote.put_object(digest, pieces)
        self._done[oid] = digest
        return digest

    def entry(self, e: Entry) -> dict:
        """The shared entry row of local entry ``e`` (its objects uploaded)."""
        def obj(s: State):
            return self.digest(s.oid) if s.kind == "file" and s.oid is not None else None

        return {
            "path": e.path,
            "before_kind": e.before.kind, "before_mode": e.before.mode, "before_object": obj(e.before),
            "before_target": e.before.target, "before_xattrs": e.before.xattrs,
            "after_kind": e.after.kind, "after_mode": e.after.mode, "after_object": obj(e.after),
            "after_target": e.after.target, "after_xattrs": e.after.xattrs,
            "after_mtime_ns": e.after_mtime_ns, "after_link": e.after_link,
        }


class Downloader:
    """Puts the objects of shared states into the local store, each once."""

    def __init__(self, ws, remote: Remote):
        self.ws, self.remote = ws, remote
        self._done: dict[str, str] = {}  # shared hash -> local oid

    def oid(self, digest: str) -> str:
        if digest not in self._done:
            data = self.remote.read_object(digest)
            if hashlib.sha256(data).hexdigest() != digest:
                from stepfs.store.errors import CorruptObject

                raise CorruptObject(f"object {digest} of the shared history does not hash to its key.")
            with self.ws.db.write() as conn:
                self._done[digest] = self.ws.objects.put_bytes(conn, data)
        return self._done[digest]

    def state(self, row: dict, side: str) -> State:
        kind = row[f"{side}_kind"]
        if kind is None:
            return State(None)
        digest = row[f"{side}_object"]
        return State(kind, row[f"{side}_mode"], self.oid(digest) if digest else None, row[f"{side}_target"],
                     None, None, row[f"{side}_xattrs"])

    def entry(self, row: dict) -> Entry:
        return Entry(row["path"], self.state(row, "before"), self.state(row, "after"), row["after_mtime_ns"],
                     row["after_link"])
