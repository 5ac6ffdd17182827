"""The suite fails a test whose mount daemon crashed, even if its assertions
passed (issue 18 item 5): a pytest inside this pytest runs
``crashcheck_segv.py``, whose tests kill their real daemons with SIGSEGV."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from mountguard import daemon_crashes, fatal_lines

pytestmark = pytest.mark.mount


@pytest.mark.timeout(240)
def test_a_daemon_killed_by_sigsegv_fails_its_test(tmp_path):
    inner = tmp_path / "inner"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--basetemp",
                        str(inner), str(ROOT / "tests" / "crashcheck_segv.py")],
                       cwd=ROOT, capture_output=True, text=True, timeout=200)
    out = r.stdout + r.stderr
    try:
        assert r.returncode == 1, out
        for name in ("test_the_mount_fixtures_daemon_segfaults", "test_a_self_mounting_commands_daemon_segfaults"):
            reported = [ln for ln in out.splitlines() if name in ln and ln.startswith(("ERROR", "FAILED"))]
            assert reported, f"{name} was not failed:\n{out}"
        assert out.count("a mount daemon of this test crashed") >= 2, out
        assert "Fatal Python error: Segmentation fault" in out, out
        crashed = daemon_crashes(inner)
        assert len(crashed) == 2, crashed
    finally:
        shutil.rmtree(inner, ignore_errors=True)  # its crash logs are this test's evidence, not its failure


def test_a_clean_log_has_no_fatal_lines(tmp_path):
    log = tmp_path / "ws" / ".stepfs" / "run" / "m.log"
    log.parent.mkdir(parents=True)
    log.write_text("2026-01-01 stepfs.daemon INFO ready\nstepfs: fine\n")
    assert fatal_lines(log) == [] and daemon_crashes(tmp_path) == []
    log.write_text(log.read_text() + "Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n")
    assert daemon_crashes(tmp_path) == [f"{log}: Fatal Python error: Aborted"]
    log.unlink()  # a made-up log: not a crash of this test's
