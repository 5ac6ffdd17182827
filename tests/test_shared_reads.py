"""``stepfs cat``, ``diff`` and ``rollback`` against a shared history
(``--history URL``), through the ``stepfs`` command and a real PostgreSQL
server (tests/pgserver.py): the layer numbers are the history's, a layer
that exists only in the history (made before a clone, or by another
workspace) is read from it, and a rollback is published like a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import stepfs
from test_shared_cli import _ok, _stage, _workspace

from stepfs.store.shared.remote import Remote
from stepfs.store.workspace import Workspace
from store_kit import Stager
from stepfs.store.shared.url import parse


def _history(tmp_path: Path, url: str) -> Path:
    """Workspace a made the history: 0 baseline, 1 edits app.py and adds
    new.txt, 2 edits app.py again and deletes new.txt."""
    a = _workspace(tmp_path / "a", {"app.py": b"v0\n", "keep.txt": b"same\n"})
    _ok(stepfs("sync", a, "--history", url))
    _stage(a, {"app.py": b"v1\n", "new.txt": b"new\n"})
    _ok(stepfs("step", a, "-m", "one"))
    with Workspace.open(str(a)) as w:
        st = Stager(w)
        st.file("app.py", b"v2\n")
        st.whiteout("new.txt")
    _ok(stepfs("step", a, "-m", "two"))
    return a


def test_cat_and_diff_read_the_shared_history_without_a_workspace(pg_url, tmp_path):
    a = _history(tmp_path, pg_url)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args):
        return stepfs(args[0], "--history", pg_url, *args[1:], cwd=elsewhere)

    assert _ok(run("cat", "0", "app.py")) == "v0\n"
    assert _ok(run("cat", "1", "new.txt")) == "new\n"
    assert _ok(run("cat", "2", "./app.py")) == "v2\n"
    res = _ok(run("cat", "1", "app.py", "--json"))
    assert res["content"] == "v1\n" and res["layer"] == 1 and res["encoding"] == "utf-8"
    gone = run("cat", "2", "new.txt")
    assert gone.returncode == 14 and "did not exist as of layer 2" in gone.stderr.decode()
    assert run("cat", "9", "app.py").returncode == 11
    escape = run("cat", "1", "../outside")
    assert escape.returncode == 10 and "relative to its root" in escape.stderr.decode()
    assert run("cat", "1", "/etc/passwd").returncode == 10
    assert run("cat", "1", ".stepfs/store.db").returncode == 10
    assert run("cat", "1", "nowhere.txt").returncode == 14

    patch = _ok(run("diff", "2"))  # layer 1 to layer 2
    assert "-v1\n+v2\n" in patch and "deleted file mode" in patch
    assert patch == _ok(stepfs("diff", a, "2"))  # a's own layers 1 and 2 are shared layers 1 and 2
    assert "keep.txt" not in patch
    res = _ok(run("diff", "2", "0", "--json"))
    assert [(c["path"], c["op"]) for c in res["changes"]] == [("app.py", "modified")]
    res = _ok(run("diff", "1", "0", "--json", "--", "new.txt"))
    assert [(c["path"], c["op"]) for c in res["changes"]] == [("new.txt", "added")]
    assert "+new" in res["patch"]
    assert run("diff", "7").returncode == 11
    assert stepfs("diff", "--history", pg_url, str(tmp_path / "a"), "2", "1").returncode == 2  # no WS with --history


def _shared(url: str):
    with Remote.open(parse(url)) as remote:
        return remote.layers()


def test_rollback_to_a_layer_only_in_the_shared_history_is_applied_and_published(pg_url, tmp_path):
    a = _history(tmp_path, pg_url)
    c = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])  # holds layer 2 only
    assert not (c / "new.txt").exists()

    dry = _ok(stepfs("rollback", c, "1", "--history", pg_url, "--dry-run", "--json"))
    assert dry["dry_run"] is True and dry["paths"] == ["app.py", "new.txt"] and dry["head_before"] == 2
    assert (c / "app.py").read_bytes() == b"v2\n" and len(_shared(pg_url)) == 3  # nothing changed

    _stage(c, {"other.txt": b"staged in c\n"})  # committed and published first, then rolled back too
    res = _ok(stepfs("rollback", c, "1", "--history", pg_url, "--json"))
    assert res["committed_first"] and res["paths"] == ["app.py", "new.txt", "other.txt"]
    assert (c / "app.py").read_bytes() == b"v1\n" and (c / "new.txt").read_bytes() == b"new\n"
    assert not (c / "other.txt").exists()
    assert _ok(stepfs("cat", "--history", pg_url, "3", "other.txt")) == "staged in c\n"  # kept in the history
    layers = _shared(pg_url)
    assert [r.kind for r in layers][-2:] == ["step", "rollback"] and res["shared"] == layers[-1].number == 4
    assert layers[-1].workspace_path == str(c) and layers[-1].meta["shared_rollback_to"] == 1
    # The other workspace takes the rollback like any layer.
    _ok(stepfs("sync", a))
    assert (a / "app.py").read_bytes() == b"v1\n" and (a / "new.txt").read_bytes() == b"new\n"
    assert _ok(stepfs("cat", "4", "app.py", "--history", pg_url)) == "v1\n"

    # Only some paths; nothing to do; a layer that does not exist; a path outside.
    res = _ok(stepfs("rollback", c, "0", "--history", pg_url, "--path", "app.py", "--json"))
    assert res["paths"] == ["app.py"] and (c / "app.py").read_bytes() == b"v0\n"
    assert (c / "new.txt").exists()
    same = stepfs("rollback", c, "5", "--history", pg_url)
    assert same.returncode == 6 and "nothing to roll back" in same.stderr.decode()
    assert stepfs("rollback", c, "42", "--history", pg_url).returncode == 11
    assert stepfs("rollback", c, "0", "--history", pg_url, "--path", "../x").returncode == 10
    assert stepfs("rollback", c, "0", "--history", pg_url, "--skip-conflicts").returncode == 13
    text = _ok(stepfs("rollback", c, "2", "--history", pg_url))
    assert "rolled back to layer 2" in text and "shared layer 6" in text
    assert (c / "app.py").read_bytes() == b"v2\n" and not (c / "new.txt").exists()


def test_rollback_that_conflicts_with_an_unpublished_change_writes_nothing(pg_url, tmp_path):
    a = _history(tmp_path, pg_url)
    c = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    _stage(a, {"app.py": b"a's newer\n"})
    _ok(stepfs("step", a, "-m", "a moves on"))  # shared 3
    _stage(c, {"app.py": b"c's own\n"})  # staged in c: the pull before the rollback refuses
    refused = stepfs("rollback", c, "0", "--history", pg_url)
    assert refused.returncode == 7, refused.stderr.decode()
    assert "app.py" in refused.stderr.decode() and "shared layer 3" in refused.stderr.decode()
    assert (c / "app.py").read_bytes() == b"v2\n" and len(_shared(pg_url)) == 4


@pytest.mark.mount
def test_rollback_through_a_live_mount_shows_at_once(pg_url, mount, tmp_path):
    _history(tmp_path, pg_url)
    c = Path(_ok(stepfs("clone", pg_url, tmp_path / "c", "--json"))["workspace"])
    mp = mount(c).mountpoint
    assert (mp / "app.py").read_bytes() == b"v2\n"
    res = _ok(stepfs("rollback", mp, "1", "--history", pg_url, "--json"))
    assert str(mp) in res["invalidated"]
    assert (mp / "app.py").read_bytes() == b"v1\n" and (mp / "new.txt").read_bytes() == b"new\n"
    assert json.loads(stepfs("status", mp, "--json").stdout)["mounts"]
