"""The mount-side predicate matrix, through a real mount, with and without
confinement: symlink inside, symlink outside (absolute and relative
``../..``), dangling symlink, directory, a path through a file, an
unreadable file, an empty file, a 50 MB sparse file and CRLF content, each
written, renamed, truncated and chmod-ed.

Unconfined, the kernel follows a symlink out of the mount and the outside
decoy changes: that is the hole confinement closes.  Confined, writes and
truncates through those links fail with EACCES and the decoys keep their
bytes.  Landlock does not cover metadata (ABIs up to 7): chmod through a
link out of the mount still changes the decoy's mode, confined or not
(README, "Confinement").  The tests run as root (the real-mount tier
does), so the unreadable file is writable as the kernel decides for root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import stepfs
from stepfs.overlayfs.client import manage

pytestmark = pytest.mark.mount
PROGS = Path(__file__).parent / "confine_progs"
OPS = ("write", "rename", "truncate", "chmod")
TARGETS = ("symlink_in", "symlink_out_abs", "symlink_out_rel", "dangling", "dir", "through_file", "unreadable",
           "empty", "sparse", "crlf")
SPARSE = 50 * 1024 * 1024
CRLF = b"a\r\nb\r\n"


def expected(confined: bool) -> dict[str, dict[str, str]]:
    table = {op: {t: "ok" for t in TARGETS} for op in OPS}
    for op in OPS:
        table[op]["through_file"] = "ENOTDIR"
    table["write"]["dir"] = table["truncate"]["dir"] = "EISDIR"
    table["truncate"]["dangling"] = table["chmod"]["dangling"] = "ENOENT"  # only write creates the target
    if confined:
        for op in ("write", "truncate"):
            table[op]["symlink_out_abs"] = table[op]["symlink_out_rel"] = "EACCES"
    return table


def _populate(ws: Path, decoys: Path) -> dict[Path, bytes]:
    decoys.mkdir()
    originals = {}
    for op in OPS:
        d = ws / op
        (d / "sub").mkdir(parents=True)
        (d / "file_in.txt").write_bytes(b"inside\r\n")
        (d / "symlink_in").symlink_to("file_in.txt")
        for kind in ("abs", "rel"):
            decoy = decoys / f"{op}_{kind}"
            decoy.write_bytes(f"decoy {op} {kind}\r\n".encode())
            decoy.chmod(0o644)
            originals[decoy] = decoy.read_bytes()
        (d / "symlink_out_abs").symlink_to(decoys / f"{op}_abs")
        # From MOUNT/op/sub (and WS/op/sub) ../../.. is the directory that holds both.
        (d / "sub" / "symlink_out_rel").symlink_to(f"../../../{decoys.name}/{op}_rel")
        (d / "dangling").symlink_to("nowhere")
        (d / "dir").mkdir()
        (d / "unreadable").write_bytes(b"secret\n")
        (d / "unreadable").chmod(0)
        (d / "empty").write_bytes(b"")
        with open(d / "sparse", "wb") as f:
            f.truncate(SPARSE)
        (d / "crlf").write_bytes(CRLF)
    return originals


@pytest.mark.parametrize("confined", [False, True], ids=["unconfined", "confined"])
def test_predicate_matrix(tmp_path, mount, confined):
    ws = tmp_path / "ws"
    ws.mkdir()
    decoys = tmp_path / "decoys"
    originals = _populate(ws, decoys)
    m = mount(ws, tmp_path / "mnt")
    assert os.path.realpath(m.mountpoint.parent) == os.path.realpath(decoys.parent)
    prog = [sys.executable, str(PROGS / "matrix.py"), *TARGETS]
    if confined:
        r = stepfs("confine", m.mountpoint, "--", *prog, timeout=90)
    else:
        r = subprocess.run(prog, cwd=m.mountpoint, capture_output=True, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout)
    want = expected(confined)
    wrong = [f"{op} {t}: got {got[op][t]}, expected {want[op][t]}" for op in OPS for t in TARGETS
             if got[op][t] != want[op][t]]
    assert not wrong, "\n".join(wrong)

    # Outside: confined, no decoy's bytes changed; unconfined, writes and
    # truncates through the links reached them.  chmod reached them both ways.
    for decoy, data in originals.items():
        op = decoy.name.split("_")[0]
        changed = not confined and op in ("write", "truncate")
        assert (decoy.read_bytes() != data) is changed, decoy
        assert (decoy.stat().st_mode & 0o777) == (0o640 if op == "chmod" else 0o644), decoy

    # Inside: everything that succeeded was staged and is committed as one layer.
    manage.step(manage.resolve(str(m.mountpoint)), message="matrix")
    assert (ws / "write" / "file_in.txt").read_bytes() == b"inside\r\nw\r\n"
    assert (ws / "write" / "nowhere").read_bytes() == b"w\r\n"
    assert (ws / "write" / "empty").read_bytes() == b"w\r\n"
    assert (ws / "write" / "crlf").read_bytes() == CRLF + b"w\r\n"
    assert (ws / "write" / "unreadable").read_bytes() == b"secret\nw\r\n"
    assert (ws / "write" / "sparse").stat().st_size == SPARSE + 3
    renamed = {p.name for p in (ws / "rename").iterdir()}
    assert {f"{t}.renamed" for t in TARGETS if t not in ("through_file", "symlink_out_rel")} <= renamed
    assert os.readlink(ws / "rename" / "symlink_out_abs.renamed") == str(decoys / "rename_abs")
    assert (ws / "rename" / "sub" / "symlink_out_rel.renamed").is_symlink()
    assert (ws / "truncate" / "crlf").read_bytes() == b"a"
    assert (ws / "truncate" / "file_in.txt").read_bytes() == b"i"
    assert (ws / "truncate" / "sparse").stat().st_size == 1
    assert (ws / "chmod" / "empty").stat().st_mode & 0o777 == 0o640
    assert (ws / "chmod" / "dir").stat().st_mode & 0o777 == 0o640
