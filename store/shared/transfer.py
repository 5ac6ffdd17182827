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


#: A batch of uploads or downloads: at most this many objects or bytes.
BATCH_OBJECTS = 500
BATCH_BYTES = 16 << 20
#: A batch smaller than this is sent without first asking which objects the
#: history lacks (one round trip saved; its inserts ignore keys already there).
ASK_FIRST = 256 << 10


class Uploader:
    """Uploads the objects of local states, each once."""

    def __init__(self, ws, remote: Remote, ride: bool = False):
        """``ride``: small batches may be sent with the next publish
        (``Remote.put_objects``): a step's upload, published right after."""
        self.ws, self.remote, self.ride = ws, remote, ride
        self._done: dict[str, str] = {}  # local oid -> shared hash

    def upload(self, entries: list[Entry]) -> None:
        """Upload the objects of ``entries`` in batches: one query for
        which the history lacks, one transaction per batch that puts them."""
        oids = [s.oid for e in entries for s in (e.before, e.after) if s.kind == "file" and s.oid is not None]
        todo = [oid for oid in dict.fromkeys(oids) if oid not in self._done]
        i = 0
        while i < len(todo):
            batch: list[tuple[str, str, list[bytes]]] = []
            size = 0
            with self.ws.db.read() as conn:  # one read transaction per batch, not per object
                while i < len(todo) and size < BATCH_BYTES and len(batch) < BATCH_OBJECTS:
                    oid = todo[i]
                    i += 1
                    pieces = list(self.ws.objects.iter_chunks(conn, oid))
                    h = hashlib.sha256()
                    for p in pieces:
                        h.update(p)
                    batch.append((oid, h.hexdigest(), pieces))
                    size += sum(map(len, pieces))
            self._flush(batch)

    def _flush(self, batch: list[tuple[str, str, list[bytes]]]) -> None:
        if not batch:
            return
        if sum(len(p) for _, _, pieces in batch for p in pieces) <= ASK_FIRST:
            missing = {d for _, d, _ in batch}  # cheaper to send than to ask: the insert ignores what is there
        else:
            missing = self.remote.missing_objects({d for _, d, _ in batch})
        self.remote.put_objects([(d, pieces) for _, d, pieces in batch if d in missing], ride=self.ride)
        for oid, d, _ in batch:
            self._done[oid] = d

    def digest(self, oid: str) -> str:
        if oid not in self._done:
            self.upload([Entry(b"", State(None), State("file", 0, oid))])
        return self._done[oid]

    def rows(self, entries: list[Entry]) -> list[dict]:
        """The shared entry rows of local ``entries`` (their objects uploaded)."""
        self.upload(entries)
        return [self.entry(e) for e in entries]

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

    def fetch(self, rows: list[dict]) -> None:
        """Download the objects ``rows`` name, in batches (one query and
        one local transaction per batch)."""
        digests = [r[k] for r in rows for k in ("before_object", "after_object") if r.get(k)]
        todo = [d for d in dict.fromkeys(digests) if d not in self._done]
        for i in range(0, len(todo), BATCH_OBJECTS):
            got = self.remote.read_objects(todo[i:i + BATCH_OBJECTS])  # each checked against its hash
            with self.ws.db.write() as conn:
                for d, data in got.items():
                    self._done[d] = self.ws.objects.put_bytes(conn, data)

    def oid(self, digest: str) -> str:
        if digest not in self._done:
            self.fetch([{"after_object": digest}])
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
