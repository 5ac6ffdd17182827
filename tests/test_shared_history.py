"""A shared history (store/shared/, overlayfs/client/shared.py), kernel-free:
the contract suite runs on both backends (an SQLite file and a real
PostgreSQL server started by tests/pgserver.py); workspaces in temp dirs
share one history through the library calls the CLI makes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from conftest import manifest
from store_kit import Stager
from stepfs.overlayfs.client import manage
from stepfs.overlayfs.client import shared as client
from stepfs.store import layers
from stepfs.store.errors import (CorruptObject, HeadMoved, HistoryError, HistoryUnreachable, NoSuchLayer,
                                 SharedConflict)
from stepfs.store.shared import sync, tables as T
from stepfs.store.shared.remote import LayerRecord, Remote, sha256_hex
from stepfs.store.shared.url import parse
from stepfs.store.shared.verifying import verify as verify_history
from stepfs.store.workspace import Workspace


def _record(n=0, kind="step", origin=None):
    return LayerRecord(n, kind, 1, "m", "agent", "/mnt", {"k": "v"}, "w" * 32, "/ws", "host", origin)


def _entry(path: bytes, after_object=None):
    return {"path": path, "before_kind": None, "before_mode": None, "before_object": None, "before_target": None,
            "before_xattrs": None, "after_kind": "file", "after_mode": 0o644, "after_object": after_object,
            "after_target": None, "after_xattrs": None, "after_mtime_ns": 5, "after_link": None}


# -- the contract: the same assertions on both backends -----------------------------------------


def test_objects_are_content_addressed_and_idempotent(history_url):
    with Remote.open(parse(history_url)) as r:
        pieces = [b"a" * 1000, b"b" * 10, b"a" * 1000]
        digest = sha256_hex(b"".join(pieces))
        assert r.missing_objects({digest}) == {digest}
        r.put_object(digest, pieces)
        r.put_object(digest, pieces)  # a retried upload changes nothing
        assert r.missing_objects({digest}) == set()
        assert r.read_object(digest) == b"".join(pieces)
        with r.tx() as conn:
            assert conn.execute(T.chunks.select()).all().__len__() == 2  # equal chunks stored once
        r.put_object(sha256_hex(b""), [])
        assert r.read_object(sha256_hex(b"")) == b""


def test_damaged_chunk_is_never_served_and_verify_names_it(history_url):
    with Remote.open(parse(history_url)) as r:
        digest = sha256_hex(b"payload")
        r.put_object(digest, [b"payload"])
        r.create(_record(0, "baseline"), [_entry(b"f", digest)])
        counts, problems = verify_history(r)
        assert problems == [] and counts["objects"] == 1 and counts["layers"] == 1
        with r.tx() as conn:
            conn.execute(update(T.chunks).values(data=b"paylaod"))
        with pytest.raises(CorruptObject):
            r.read_object(digest)
        _, problems = verify_history(r)
        assert any("does not hash" in p for p in problems)


def test_publish_is_a_compare_and_swap_on_the_head(history_url):
    with Remote.open(parse(history_url)) as r, Remote.open(parse(history_url)) as other:
        assert r.head() is None
        r.create(_record(0, "baseline"), [])
        with pytest.raises(HistoryError):
            other.create(_record(0, "baseline"), [])
        assert r.publish(0, _record(), [_entry(b"a")]) == 1
        with pytest.raises(HeadMoved):
            other.publish(0, _record(), [_entry(b"b")])  # the loser writes nothing
        assert r.head() == 1 and [x.number for x in r.layers()] == [0, 1]
        assert [e["path"] for e in r.entries(1)] == [b"a"]
        assert other.publish(1, _record(origin=7), [_entry(b"b")]) == 2
        assert r.origins("w" * 32) == {7: 2}
        assert verify_history(r)[1] == []


def test_entries_must_name_stored_objects(history_url):
    with Remote.open(parse(history_url)) as r:
        r.create(_record(0, "baseline"), [])
        with pytest.raises(IntegrityError):
            r.publish(0, _record(), [_entry(b"a", "f" * 64)])  # never uploaded
        assert r.head() == 0 and r.entries(1) == []


def test_layers_listing_counts_and_state_as_of_a_layer(history_url):
    with Remote.open(parse(history_url)) as r:
        one, two = sha256_hex(b"1"), sha256_hex(b"2")
        r.put_objects([(one, [b"1"]), (two, [b"2"])])
        r.create(_record(0, "baseline"), [_entry(b"a", one), _entry(b"d/b", one)])
        changed = dict(_entry(b"a", two), before_kind="file", before_mode=0o644, before_object=one)
        gone = dict(_entry(b"d/b"), before_kind="file", before_mode=0o644, before_object=one,
                    after_kind=None, after_mode=None, after_mtime_ns=None)
        r.publish(0, _record(), [changed, gone, _entry(b"c", one)])
        assert [x.number for x in r.layers(newest_first=True, limit=1)] == [1]
        assert r.counts([0, 1]) == {0: (2, 0, 0), 1: (1, 1, 1)}
        at0, at1 = r.state_at(0), r.state_at(1)
        assert {p: e["after_object"] for p, e in at0.items()} == {b"a": one, b"d/b": one}
        assert at1[b"a"]["after_object"] == two and at1[b"d/b"]["after_kind"] is None
        assert r.read_objects([one, two]) == {one: b"1", two: b"2"}
        with pytest.raises(NoSuchLayer):
            r.layer(5)


# -- workspaces sharing one history ----------------------------------------------------------------------


def _ws(root: Path, files: dict[str, bytes] | None = None) -> Path:
    root.mkdir()
    for rel, data in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    Workspace.open(str(root), create=True).close()
    return root


def _stage(ws_path: Path, files: dict[str, bytes], mount: str = "/test/mnt") -> None:
    with Workspace.open(str(ws_path)) as ws:
        st = Stager(ws, mount)
        for rel, data in files.items():
            st.file(rel, data)


def _step(ws_path: Path, message: str = "", url: str | None = None) -> dict:
    return client.step(manage.Target(str(ws_path)), url, message=message)


def test_attach_then_clone_matches_the_workspace_at_each_layer(history_url, tmp_path):
    a = _ws(tmp_path / "a", {"README": b"hello\n", "src/main.py": b"print(1)\n"})
    client.attach(str(a), history_url)
    at0 = manifest(a)
    _stage(a, {"src/main.py": b"print(2)\n", "src/new.py": b"x = 1\n"})
    res = _step(a, "two")
    assert res["published"] == [{"local": res["numbers"][0], "shared": 1}]
    at1 = manifest(a)
    path, number, _ = sync.clone(parse(history_url), str(tmp_path / "c1"))
    assert number == 1 and manifest(Path(path)) == at1
    path, number, _ = sync.clone(parse(history_url), str(tmp_path / "c0"), at=0)
    assert number == 0 and manifest(Path(path)) == at0
    with Remote.open(parse(history_url)) as r:
        top = r.layer(1)
        assert top.workspace_path == str(a) and top.host and top.message == "two"


def test_disjoint_steps_of_two_workspaces_both_land(history_url, tmp_path):
    a = _ws(tmp_path / "a", {"shared.txt": b"base\n"})
    client.attach(str(a), history_url)
    b, _, _ = sync.clone(parse(history_url), str(tmp_path / "b"))
    b = Path(b)
    _stage(a, {"from_a.txt": b"A\n"})
    _stage(b, {"from_b.txt": b"B\n"})
    assert _step(a, "a1")["published"][0]["shared"] == 1
    res = _step(b, "b1")  # the head moved: b takes a's layer first, then publishes on top
    assert [p["shared"] for p in res["pulled"]] == [1] and res["published"][0]["shared"] == 2
    assert (b / "from_a.txt").read_bytes() == b"A\n"
    out = client.sync_workspace(manage.Target(str(a)))
    assert [p["shared"] for p in out["pulled"]] == [2] and out["published"] == []
    assert manifest(a) == manifest(b)
    with Workspace.open(str(a)) as ws, ws.db.read() as conn:
        kinds = [layer.kind for layer in layers.list_layers(conn)]
    assert kinds.count("sync") == 1
    assert client.sync_workspace(manage.Target(str(b)))["pulled"] == []  # nothing left to take


def test_overlapping_steps_conflict_and_nothing_is_written(history_url, tmp_path):
    a = _ws(tmp_path / "a", {"app.py": b"v0\n", "other.txt": b"o\n"})
    client.attach(str(a), history_url)
    b = Path(sync.clone(parse(history_url), str(tmp_path / "b"))[0])
    _stage(a, {"app.py": b"from a\n"})
    _stage(b, {"app.py": b"from b\n", "b_only.txt": b"b\n"})
    _step(a, "a wins")
    before_b = manifest(b)
    with Remote.open(parse(history_url)) as r:
        head = r.head()
    with pytest.raises(SharedConflict) as info:
        _step(b, "b loses")
    assert info.value.paths == ["app.py"] and info.value.layers == [1]
    assert "app.py" in str(info.value) and "shared layer 1" in str(info.value)
    assert manifest(b) == before_b  # nothing written here...
    with Remote.open(parse(history_url)) as r:
        assert r.head() == head  # ...nor there
    with Workspace.open(str(b)) as ws, ws.db.read() as conn:
        from stepfs.store import staging

        staged = {r.path for st in staging.list_steps(conn) for r in staging.load(conn, st["id"])}
    assert staged == {b"app.py", b"b_only.txt"}  # the step stays open, to discard or redo


def test_server_stopped_mid_step_loses_nothing(pg_server, pg_url, tmp_path, monkeypatch):
    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    _stage(a, {"f.txt": b"1\n"})
    real_push = sync.push

    def stop_then_push(ws, remote, att):
        pg_server.stop()  # between the local commit and the publish
        remote.engine.dispose()
        return real_push(ws, remote, att)

    monkeypatch.setattr(sync, "push", stop_then_push)
    with pytest.raises(HistoryUnreachable) as info:
        _step(a, "while down")
    assert "committed in this workspace but not published" in str(info.value)
    assert (a / "f.txt").read_bytes() == b"1\n"
    monkeypatch.setattr(sync, "push", real_push)
    with pytest.raises(HistoryUnreachable):
        client.sync_workspace(manage.Target(str(a)))  # still down: a clear error, nothing lost
    pg_server.start()
    out = client.sync_workspace(manage.Target(str(a)))
    assert [p["shared"] for p in out["published"]] == [1]
    c = Path(sync.clone(parse(pg_url), str(tmp_path / "c"))[0])
    assert (c / "f.txt").read_bytes() == b"1\n"


def test_server_down_before_the_step_writes_nothing(pg_server, pg_url, tmp_path):
    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    _stage(a, {"f.txt": b"1\n"})
    pg_server.stop()
    try:
        with pytest.raises(HistoryUnreachable) as info:
            _step(a, "down")
        assert "cannot be reached" in str(info.value)
        assert (a / "f.txt").read_bytes() == b"0\n"  # the step is still open
    finally:
        pg_server.start()
    assert _step(a, "up")["published"][0]["shared"] == 1
    assert (a / "f.txt").read_bytes() == b"1\n"


def test_history_url_is_parsed_in_one_place():
    u = parse("postgresql://me:secret@db.example:5433/stepfs?name=team-1")
    assert u.name == "team-1" and "secret" not in u.display
    assert u.engine_url().drivername == "postgresql+psycopg" and "name" not in u.engine_url().query
    for bad in ("postgresql://me@db/stepfs", "mysql://me@db/x?name=a", "sqlite:///rel.db?name=a",
                "postgresql://me@db/s?name=bad/name", "postgresql+asyncpg://me@db/s?name=a"):
        with pytest.raises(HistoryError):
            parse(bad)


def test_attaching_a_second_workspace_to_an_existing_history_is_refused(history_url, tmp_path):
    a = _ws(tmp_path / "a", {"x": b"1"})
    client.attach(str(a), history_url)
    b = _ws(tmp_path / "b", {"y": b"2"})
    with pytest.raises(HistoryError, match="clone"):
        client.attach(str(b), history_url)
    assert not os.path.exists(b / ".stepfs" / "history.json")


def test_format_md_documents_every_shared_table_and_column():
    from stepfs.store import schema

    doc = Path(schema.__file__).with_name("FORMAT.md").read_text()
    for table in T.metadata.sorted_tables:
        line = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{table.name}` |")), None)
        assert line is not None, table.name
        documented = set(re.findall(r"`([a-z_]+)`", line.split("|")[2]))
        assert documented == {c.name for c in table.columns}, table.name


def test_connection_killed_inside_the_head_transaction_publishes_nothing(pg_url, tmp_path):
    """The objects are uploaded, then the server drops the connection while
    the publish waits inside its transaction (another connection holds the
    history's row): no layer, head unchanged, and the next sync publishes
    the layer (the orphan uploads are reused)."""
    import threading

    from pglock import head_row_locked, terminate, waiting_publisher

    a = _ws(tmp_path / "a", {"f.txt": b"0\n"})
    client.attach(str(a), pg_url)
    _stage(a, {"f.txt": b"1\n", "g.txt": b"new\n"})
    failed: list[BaseException] = []

    def step():
        try:
            _step(a, "killed")
        except BaseException as exc:
            failed.append(exc)

    with head_row_locked(pg_url):
        stepper = threading.Thread(target=step)
        stepper.start()
        terminate(pg_url, waiting_publisher(pg_url))
        stepper.join(60)
    assert not stepper.is_alive() and len(failed) == 1 and isinstance(failed[0], HistoryUnreachable), failed
    with Remote.open(parse(pg_url)) as r:
        assert r.head() == 0 and r.entries(1) == []
        assert r.missing_objects({sha256_hex(b"new\n")}) == set()  # uploaded before the head's transaction
    out = client.sync_workspace(manage.Target(str(a)))
    assert [p["shared"] for p in out["published"]] == [1]
    with Remote.open(parse(pg_url)) as r:
        assert sorted(e["path"] for e in r.entries(1)) == [b"f.txt", b"g.txt"] and verify_history(r)[1] == []


def test_two_processes_racing_on_one_path_one_wins(pg_url, tmp_path):
    """Two `stepfs step` processes of two workspaces, same path, at once:
    the history's lock makes them take turns; one publishes, the other
    gets exit code 7 with nothing written."""
    import subprocess
    import sys

    a = _ws(tmp_path / "a", {"same.txt": b"0\n"})
    client.attach(str(a), pg_url)
    b = Path(sync.clone(parse(pg_url), str(tmp_path / "b"))[0])
    _stage(a, {"same.txt": b"a\n"})
    _stage(b, {"same.txt": b"b\n"})
    procs = [subprocess.Popen([sys.executable, "-m", "stepfs.cli.main", "step", str(w), "-m", w.name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for w in (a, b)]
    codes = sorted(p.wait(timeout=120) for p in procs)
    assert codes == [0, 7], [p.stderr.read() for p in procs]
    with Remote.open(parse(pg_url)) as r:
        assert r.head() == 1
        winner = r.layer(1).workspace_path
    loser = b if winner == str(a) else a
    assert (loser / "same.txt").read_bytes() == b"0\n"


def test_a_push_that_loses_the_head_takes_the_other_layer_and_publishes(history_url, tmp_path, monkeypatch):
    """Another workspace publishes between this one's pull and its push
    (no lock held: what the compare-and-swap alone must handle)."""
    a = _ws(tmp_path / "a", {"base.txt": b"0\n"})
    client.attach(str(a), history_url)
    b = Path(sync.clone(parse(history_url), str(tmp_path / "b"))[0])
    _stage(a, {"a.txt": b"A\n"})
    _stage(b, {"b.txt": b"B\n"})
    real_push = sync.push
    calls = []

    def push_after_b(ws, remote, att):
        if not calls:
            calls.append(1)
            manage.step(manage.Target(str(b)), message="b sneaks in")
            with Workspace.open(str(b)) as wb, Remote.open(parse(history_url)) as rb:
                from stepfs.store.shared import attachment

                real_push(wb, rb, attachment.read(wb))  # publishes shared layer 1 first, without the lock a holds
        return real_push(ws, remote, att)

    monkeypatch.setattr(sync, "push", push_after_b)
    res = _step(a, "a")
    assert [p["shared"] for p in res["pulled"]] == [1] and res["published"][0]["shared"] == 2
    assert (a / "b.txt").read_bytes() == b"B\n"
