"""The open step's nodes at its end: commit, discard and rollback (FUSE-free).

After a commit the workspace holds every staged node: :meth:`StepNodes.after_commit`
drops them and carries tokens over, so nobody's observation goes stale by
the mount's own commit.  A discard drops staged paths (their bytes kept as
conflict rows); a rollback elsewhere makes the view forget what it holds
for the paths it changed.

Lock rule: the public methods take the view's lock; ``before_commit`` and
``after_commit`` are called under it (``committing.ViewCommit``).
"""

from __future__ import annotations

import time

from stepfs.store import publish, refs, staging, tokens

from stepfs.overlayfs.core.content import Content
from stepfs.overlayfs.core.links import Links
from stepfs.overlayfs.core.namespace import Namespace
from stepfs.overlayfs.core.rows import StagedRows
from stepfs.overlayfs.core.scratch import ScratchFiles
from stepfs.overlayfs.core.upper import rel, view_path
from stepfs.overlayfs.core.versions import Versions


class StepNodes:
    """Receives the view's ``lock``, the workspace ``ws``, the open ``step``
    and its ``mountpoint``, the collaborators whose state a step's end
    changes, and ``await_settled`` (a commit completing consumes the
    step's rows)."""

    def __init__(self, *, ws, step: int, mountpoint: str, lock, ns: Namespace, versions: Versions,
                 content: Content, rows: StagedRows, scratch: ScratchFiles, links: Links, await_settled):
        self.ws, self.step, self.mountpoint, self.lock = ws, step, mountpoint, lock
        self.ns, self.versions, self.content, self.rows, self.scratch, self.links = (
            ns, versions, content, rows, scratch, links)
        self._await_settled = await_settled

    def staged(self) -> list[tuple[str, str]]:
        """``[(op, path)]`` with op A (added), M (modified) or D (deleted)."""
        with self.lock:
            out = []
            for path, node in sorted(self.ns.upper.nodes.items()):
                if not node.staged:
                    continue
                if node.kind == "whiteout":
                    op = "D"
                elif node.base == tokens.ABSENT:
                    op = "A"
                else:
                    op = "M"
                out.append((op, path))
            return out

    def before_commit(self) -> tuple[list[str], list[str]]:
        """Under the lock, before the store plans: write the recorded rows
        (the commit reads them from the store) and give files staged by
        reference their objects.  Returns the unclosed nodes over staged
        rows and the staged paths."""
        self.rows.sync()
        if any(n.ref is not None for n in self.ns.upper.nodes.values()):
            # Files staged by reference become objects first (the commit
            # would import them too, but the nodes must learn the oids).
            self.imported(publish.import_refs(self.ws, self.step))
        return self._unstaged_over_rows(), [p for p, n in self.ns.upper.nodes.items() if n.staged]

    def _unstaged_over_rows(self) -> list[str]:
        """Paths of created-but-unclosed nodes that replaced a staged row (a
        file created where this step had staged a deletion): the commit
        publishes that row, under the unclosed node."""
        pending = [p for p, n in self.ns.upper.nodes.items() if not n.staged]
        if not pending:
            return []
        with self.ws.db.read() as conn:
            rows = {view_path(r.path) for r in staging.load(conn, self.step)}
        return [p for p in pending if p in rows]

    def after_commit(self, covered) -> None:
        """The workspace now holds every staged node: drop them, and carry
        tokens over so nobody's observation goes stale by our own commit.
        ``covered``: unclosed nodes whose path the commit changed underneath
        them; their base becomes the new workspace state, or their own
        commit would later be refused as a conflict with ours."""
        for path in covered:
            node = self.ns.upper.get(path)
            if node is not None and not node.staged:
                node.base = self.ns.lower_token(path)
        self.scratch.unlink_retired()  # the commit consumed every staged row
        self.ns.nlink_cache.clear()
        self.ns.dir_times.clear()
        self.links.gone.clear()
        renamed: dict[str, tuple[str, str]] = {}  # path -> (old token, new token)
        for path in list(self.ns.upper.nodes):
            node = self.ns.upper.nodes[path]
            if not node.staged:
                continue  # created but not yet closed: not part of the layer
            old = self.versions.node_token(node)
            self.ns.upper.pop(path)
            self.scratch.drop(node)
            new, st, _digest = self.versions.current_token(path)
            if st is not None and node.oid and tokens.is_racy(st, time.time_ns()):
                new = tokens.with_hash(new, node.oid.split(".", 1)[0])
            if st is not None and node.kind != "whiteout" and st.st_ino != node.ino:
                self.ns.ino_alias[(st.st_dev, st.st_ino)] = node.ino
            if st is not None and node.link_group is not None:
                self.links.shown_name(st, path)  # the kernel holds this name's attributes from the node
            renamed[path] = (old, new)
        self.versions.carry_over(renamed)
        self.content.carry_over(renamed)

    def discard(self, paths: list[str]) -> list[str]:
        """Drop staged paths (and everything below them) from the open step:
        the workspace shows through again.  Staged file bytes are kept as
        ``discarded`` conflict rows only where the workspace path changed
        since they were staged (``store.staging.discard``); other drafts go
        with the next gc.  Drafts in use keep working and lose at their
        close (their version is gone)."""
        with self.lock:
            self._await_settled(writing=True)
            dropped: list[str] = []
            with self.ws.db.write() as conn:
                self.rows.write(conn)  # staging.discard reads the rows it drops
                oids = refs.import_refs(self.ws, conn, self.step)  # discarded bytes are kept as objects
                for path in paths:
                    dropped += [view_path(p) for p in staging.discard(
                        conn, self.step, rel(path), mount=self.mountpoint,
                        token_now=lambda p: tokens.of_workspace(self.ws, p))]
            self.imported(oids)
            self.rows.written()
            for path in dropped:
                node = self.ns.upper.pop(path)
                if node is not None:
                    self.scratch.drop(node)
            self.forget(paths)
            return dropped

    def forget(self, paths: list[str]) -> None:
        """Drop what the view holds for ``paths`` (and below) after the
        workspace changed under it (a rollback): idle drafts and unstaged
        nodes go, so the workspace shows through.  Staged nodes stay: they
        are this mount's own changes, and committing them checks their base
        token against the new workspace state.  Drafts in use stay too, and
        their close fails with ESTALE (the path changed since they opened)."""
        with self.lock:
            self.ns.nlink_cache.clear()
            if self.links.held():
                # The link counts shown for names the kernel may hold change
                # (covered names show again, or the workspace's own changed).
                self.links.renew()
            targets = set()
            for path in paths:
                targets.add(path)
                targets.update(self.ns.upper.below(path))
            for p in targets:
                node = self.ns.upper.get(p)
                if node is None or node.staged or p in self.content.open_drafts:
                    continue
                self.ns.upper.pop(p)
                self.scratch.drop(node)
            self.links.recount(self.ns.covered, self.ns.lower_stat)
            prefixes = tuple(p.rstrip("/") + "/" for p in paths)
            for d in list(self.content.drafts.values()):
                if d.opens == 0 and (d.path in targets or d.path.startswith(prefixes)):
                    self.content.discard_draft(d)

    def imported(self, oids: dict[str, str]) -> None:
        """The store took the by-reference files ``oids`` (scratch name ->
        object id) as objects: their nodes name the objects now, and their
        files are ordinary caches (no row references them any more)."""
        if not oids:
            return
        for node in self.ns.upper.nodes.values():
            if node.ref is not None and node.ref in oids:
                node.oid, node.ref, node.ref_sum = oids[node.ref], None, None
