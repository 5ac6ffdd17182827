"""Version tokens and the agents' observations of them (FUSE-free).

* **Version tokens** identify published versions: ``u:<epoch>:<gen>`` for an
  upper node (``gen`` changes on every publish or metadata change),
  ``store.tokens.from_stat`` for a workspace path (plus a content hash when
  the stat is inside the racy window), ``absent``.  Tokens are compared only
  with :func:`store.tokens.same`.
* Every open records the published token in the agent's **observation
  registry** (:attr:`Versions.observed`); opening for writing fails with
  ``Stale`` if the path moved on since the agent last observed it.

Lock rule: called only under the view's lock.
"""

from __future__ import annotations

import itertools
import os
import stat as stat_mod
import time

from stepfs.store import tokens

from stepfs.overlayfs.core.errors import NotFound
from stepfs.overlayfs.core.namespace import Namespace, fd_digest
from stepfs.overlayfs.core.upper import Node, rel


class Versions:
    """Tokens of what ``ns`` shows, and who observed which."""

    def __init__(self, ns: Namespace):
        self.ns = ns
        self.epoch = time.time_ns()  # makes upper tokens unique across daemon runs
        self._gen = itertools.count(1)
        self.observed: dict[str, dict[str, str]] = {}  # agent -> path -> token

    def node_token(self, node: Node) -> str:
        if node.kind == "whiteout":
            return tokens.ABSENT
        return f"u:{self.epoch}:{node.gen}"

    def current_token(self, path: str):
        """``(token without hash, stat or None, digest())`` of ``path`` now."""
        try:
            node, st = self.ns.resolve(path)
        except NotFound:
            return tokens.ABSENT, None, lambda: ""
        if node is not None:
            return self.node_token(node), None, lambda: ""
        target = self.ns.root.readlink(rel(path)) if stat_mod.S_ISLNK(st.st_mode) else None
        return tokens.from_stat(st, target), st, lambda: self.ns.lower_digest(path)

    def record_token(self, path: str) -> str:
        """A token worth remembering: hashed when taken inside the racy window."""
        tok, st, digest = self.current_token(path)
        if st is not None and tokens.is_racy(st, time.time_ns()):
            return tokens.with_hash(tok, digest())
        return tok

    @staticmethod
    def open_token(fd: int) -> str:
        """:meth:`record_token` of the workspace file open at ``fd``: from
        its ``fstat``, hashed through ``fd`` inside the racy window.  The
        token of the very file the handle reads, even if the path was
        replaced since it was opened (a token of the path would credit the
        reader with a version it never read); and no second resolution of
        the path."""
        st = os.fstat(fd)
        tok = tokens.from_stat(st)
        if tokens.is_racy(st, time.time_ns()):
            return tokens.with_hash(tok, fd_digest(fd))
        return tok

    def still(self, recorded: str, path: str) -> bool:
        tok, _st, digest = self.current_token(path)
        return tokens.same(recorded, tok, digest)

    def observe(self, agent: str, path: str, token: str) -> None:
        self.observed.setdefault(agent, {})[path] = token

    def bump(self, node: Node) -> None:
        node.gen = next(self._gen)

    def carry_over(self, renamed: dict[str, tuple[str, str]]) -> None:
        """A commit gave ``path`` a new token for the same content (``path ->
        (old, new)``): an observation of the old one holds the new one."""
        for seen in self.observed.values():
            for path, (old, new) in renamed.items():
                if seen.get(path) == old:
                    seen[path] = new
