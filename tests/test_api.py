"""The Python API for harnesses (``stepfs.api``), over real mounts —
including the complete example in docs/API.md, run exactly as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from mountguard import mounts_under, private_tmp  # noqa: F401
from stepfs import api
from stepfs.overlayfs.client import manage, mounts

pytestmark = pytest.mark.mount


def docs_example() -> str:
    text = (ROOT / "docs" / "API.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/API.md should hold exactly one complete Python example"
    return blocks[0]


def test_docs_example_runs_as_written(workspace, private_tmp, tmp_path):
    script = tmp_path / "harness.py"
    script.write_text(docs_example())
    r = subprocess.run([sys.executable, str(script), str(workspace)], capture_output=True, timeout=120,
                       env=dict(os.environ), cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[:3] == ["toolu_01 -> layer 1", "toolu_02 -> no change", "toolu_03 -> layer 2"]
    assert lines[3:6] == ["2 toolu_03 +2 ~1 -0", "1 toolu_01 +1 ~0 -0", "0 - +0 ~0 -0"]
    assert lines[6:9] == ["modified calc.py +1 -1", "added tests +0 -0", "added tests/test_calc.py +1 -0"]
    assert lines[9] == "    return a + b"
    assert lines[10] == "exit 0 layer 3"
    assert (workspace / "calc.py").read_text() == "def add(a, b):\n    return b + a\n"
    ws = api.open_workspace(workspace)
    assert ws.card(3)["meta"] == {"exit_code": "0", "tool_use_id": "toolu_04"}
    assert not (workspace / "NOTES.md").exists(), "the example's rollback did not undo the last call"
    assert ws.head() == 4 and lines[11] == "rolled back as layer 4"
    assert mounts_under(private_tmp) == [] and os.listdir(private_tmp) == []


def test_mount_context_unmounts_on_error_and_keeps_staged_work(workspace, private_tmp):
    ws = api.open_workspace(workspace, create=True)
    with pytest.raises(RuntimeError, match="harness crashed"):
        with ws.mount() as m:
            with open(os.path.join(m.path, "draft.txt"), "w") as f:
                f.write("unfinished\n")
            assert m.staged() == [{"op": "A", "path": "draft.txt", "kind": "file"}]
            raise RuntimeError("harness crashed")
    assert not m.mounted and not os.path.exists(m.path)
    assert not (workspace / "draft.txt").exists()
    # The staged file survived the unmount as an open step; the workspace commits it.
    staged = [s for mt in ws.status()["mounts"] for s in mt["staged"]]
    assert staged == [{"op": "A", "path": "draft.txt", "kind": "file"}]
    assert ws.step("recovered draft", meta={"source": "crash"}) == [1]
    assert (workspace / "draft.txt").read_text() == "unfinished\n"
    assert ws.card(1)["meta"] == {"source": "crash"}
    assert ws.step("again") == []


def test_step_conflict_then_overwrite(workspace, private_tmp):
    (workspace / "a.txt").write_text("base\n")
    ws = api.open_workspace(workspace, create=True)
    with ws.mount() as m:
        with open(m.map_path(workspace / "a.txt"), "a") as f:
            f.write("agent\n")
        (workspace / "a.txt").write_text("human\n")  # someone edits the real file meanwhile
        with pytest.raises(api.CommitConflict) as err:
            m.step("agent edit")
        assert err.value.paths == ["a.txt"]
        assert (workspace / "a.txt").read_text() == "human\n"
        assert m.step("agent edit", overwrite=["a.txt"]) == 1
    assert (workspace / "a.txt").read_text() == "base\nagent\n"
    assert [layer.message for layer in ws.log()] == ["agent edit", "baseline"]


def test_reused_mount_is_left_alone(workspace, mount, private_tmp):
    (workspace / "sub").mkdir()
    fixture_mount = mount(workspace)
    ws = api.open_workspace(fixture_mount.mountpoint)  # a mountpoint names its workspace
    assert ws.path == str(workspace)
    with ws.mount(reuse=True) as m:
        assert not m.owned and m.path == str(fixture_mount.mountpoint)
        assert m.map_path(workspace / "sub") == str(fixture_mount.mountpoint / "sub")
        (fixture_mount.mountpoint / "sub" / "x").write_text("x")
        assert m.step("x") == 1
    assert mounts.find(str(fixture_mount.mountpoint)) is not None
    assert [x.path for x in ws.mounts()] == [str(fixture_mount.mountpoint)]


def test_rollback_through_the_api(workspace):
    ws = api.open_workspace(workspace, create=True)
    (workspace / "f").write_text("v0")
    with ws.mount() as m:
        with open(os.path.join(m.path, "f"), "w") as f:
            f.write("v1")
        assert m.step("one") == 1
    result = ws.rollback(0)
    assert (workspace / "f").read_text() == "v0"
    assert ws.head() == result["layer"] == 2


def test_open_workspace_refuses_a_plain_directory_without_create(tmp_path):
    with pytest.raises(api.WorkspaceError, match="not in a stepfs workspace"):
        api.open_workspace(tmp_path)
    assert api.open_workspace(tmp_path, create=True).path == str(tmp_path.resolve())
    assert (tmp_path / ".stepfs" / "store.db").is_file()
