"""``stepfs gc``, ``prune``, ``du`` and ``conflicts drop`` as a user runs them
on an unmounted workspace (kernel-free: no mount is made)."""

from __future__ import annotations

import json

from conftest import stepfs
from stepfs.store import publish, staging
from store_kit import Stager, open_workspace


def make(tmp_path):
    path = tmp_path / "ws"
    ws = open_workspace(path, {"a.txt": ("file", 0o644, b"a0\n" * 5000)})
    for i in range(1, 5):
        s = Stager(ws)
        s.file("a.txt", b"a%d\n" % i * 5000)
        s.file(f"f{i}", b"f%d\n" % i * 3000)
        publish.commit_step(ws, s.step, message=f"s{i}", overwrite={r.path for r in s.rows()})
    s = Stager(ws)
    s.file("gone", b"never reaches a layer\n" * 4000)
    s.file("lost", b"discarded bytes\n" * 4000)
    with ws.db.write() as conn:
        staging.remove(conn, s.step, b"gone")
        staging.discard(conn, s.step, b"lost", mount="/m")
    ws.close()
    return path


def test_du_gc_prune_and_conflicts_drop(tmp_path):
    ws = make(tmp_path)
    du = json.loads(stepfs("du", ws, "--json").stdout)
    assert set(du["layers"]) == {"1", "2", "3", "4"} and du["garbage_bytes"] > 0 and du["conflict_bytes"] > 0
    assert du["history_bytes"] == sum(du["layers"].values())

    dry = stepfs("gc", ws, "--dry-run")
    assert dry.returncode == 0 and b"gc would free: 1 objects" in dry.stdout
    r = stepfs("gc", ws, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["objects"] == 1 and report["conflict_objects"] == 1
    assert json.loads(stepfs("du", ws, "--json").stdout)["garbage_bytes"] == 0

    r = stepfs("prune", ws, "--keep-last", "2", "--dry-run", "--json")
    assert json.loads(r.stdout) == {"message_type": "prune", "keep_from": 3, "pruned": [0, 1, 2],
                                    "folded_paths": 4, "dry_run": True}
    r = stepfs("prune", ws, "--keep-last", "2")
    assert r.returncode == 0 and b"dropped layers 0..2; layer 3 is the oldest kept" in r.stdout
    assert b"gc freed" in r.stdout
    log = json.loads(stepfs("log", ws, "--json").stdout)["layers"]
    assert [layer["number"] for layer in log] == [4, 3] and all(layer["stored_bytes"] >= 0 for layer in log)
    r = stepfs("show", ws, "1")
    assert r.returncode == 11 and r.stderr.startswith(b"stepfs: layer 1 was pruned; the oldest layer kept is 3")
    r = stepfs("rollback", ws, "2")
    assert r.returncode == 11 and b"pruned" in r.stderr
    assert stepfs("cat", ws, "3", "a.txt").stdout == b"a3\n" * 5000
    r = stepfs("prune", ws, "--keep-last", "5")
    assert r.returncode == 0 and b"nothing to prune" in r.stdout

    status = json.loads(stepfs("status", ws, "--json").stdout)
    [conflict] = status["conflicts"]
    r = stepfs("conflicts", "drop", ws, "999")
    assert r.returncode == 13 and b"no conflict #999" in r.stderr
    r = stepfs("conflicts", "drop", ws, str(conflict["id"]))
    assert r.returncode == 0 and b"dropped 1 conflict" in r.stdout
    report = json.loads(stepfs("gc", ws, "--json").stdout)
    assert report["objects"] == 1 and report["conflict_objects"] == 0
    assert stepfs("verify", ws).returncode == 0


def test_bad_arguments_get_a_sentence_and_their_exit_code(tmp_path):
    ws = make(tmp_path)
    for args, code, text in [
        (("prune", ws), 13, b"say what to keep"),
        (("prune", ws, "--keep-last", "0"), 13, b"at least 1"),
        (("prune", ws, "--keep-within", "soon"), 13, b"is not a duration"),
        (("prune", ws, "--max-size", "lots"), 13, b"is not a size"),
        (("conflicts", "drop", ws), 2, b"usage"),
    ]:
        r = stepfs(*args)
        assert r.returncode == code and text in r.stderr, (args, r.stderr)
