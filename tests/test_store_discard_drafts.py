"""``stepfs discard`` tells a draft from a losing writer (issue 20, item 1):
the bytes of a staged file whose workspace path is unchanged are a draft
the user threw away and go with the next gc; the bytes of one whose
workspace path changed since it was staged lost a race and are kept as a
``discarded`` conflict (kernel-free tier)."""

from __future__ import annotations

from sqlalchemy import select

from stepfs.store import gc, schema, staging, tokens, verify
from store_kit import Stager, open_workspace


def test_a_discarded_draft_is_garbage_and_a_lost_version_a_conflict(tmp_path):
    root = tmp_path / "ws"
    ws = open_workspace(root, {"changed": ("file", 0o644, b"workspace version\n")})
    try:
        s = Stager(ws)
        draft = s.file("draft.txt", b"a draft nobody wants\n" * 500)  # base: absent, still absent
        lost = s.file("changed", b"the agent's version\n" * 500)
        (root / "changed").write_bytes(b"someone else's newer version\n")  # the race the agent lost
        with ws.db.write() as conn:
            dropped = staging.discard(conn, s.step, b"draft.txt", mount="/m",
                                      token_now=lambda p: tokens.of_workspace(ws, p))
            dropped += staging.discard(conn, s.step, b"changed", mount="/m",
                                       token_now=lambda p: tokens.of_workspace(ws, p))
        assert dropped == [b"draft.txt", b"changed"]
        with ws.db.read() as conn:
            rows = conn.execute(select(schema.conflicts.c.path, schema.conflicts.c.oid,
                                       schema.conflicts.c.reason)).all()
        assert [(bytes(p), o, r) for p, o, r in rows] == [(b"changed", lost, "discarded")]
        report = gc.collect(ws)
        assert report.objects == 1 and report.conflict_objects == 1
        with ws.db.read() as conn:
            assert not ws.objects.exists(conn, draft)
            assert ws.objects.read_all(conn, lost) == b"the agent's version\n" * 500
        assert verify.verify(ws).ok
    finally:
        ws.close()


def test_without_a_token_reader_every_discarded_file_is_kept(tmp_path):
    """The conservative default (a caller that cannot look at the workspace)."""
    ws = open_workspace(tmp_path / "ws")
    try:
        s = Stager(ws)
        oid = s.file("new.txt", b"x" * 3000)
        with ws.db.write() as conn:
            staging.discard(conn, s.step, b"new.txt", mount="/m")
            assert conn.execute(select(schema.conflicts.c.oid)).scalars().all() == [oid]
    finally:
        ws.close()
