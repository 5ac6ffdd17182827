"""Run confined in a mount (cwd): try to write outside it every way the
issue names, and inside it; print ``{attempt: "ok" | errno name}`` as JSON.

argv: DECOYS_DIR WORKSPACE
"""

import errno
import json
import os
import subprocess
import sys

decoys, ws = sys.argv[1], sys.argv[2]
tmp = os.environ["TMPDIR"]
results = {}


def attempt(name, fn):
    try:
        out = fn()
        results[name] = "ok" if out is None else out
    except OSError as exc:
        results[name] = errno.errorcode[exc.errno]


def append(path):
    with open(path, "ab") as f:
        f.write(b"ESCAPED\n")


def run(cmd):
    r = subprocess.run(cmd, capture_output=True)
    return "ok" if r.returncode == 0 else ("EACCES" if b"Permission denied" in r.stderr else r.stderr.decode())


attempt("inside", lambda: append("inside.txt"))
attempt("inside_subdir", lambda: (os.makedirs("new/deeper"), append("new/deeper/f")) and None)
attempt("absolute", lambda: append(os.path.join(decoys, "abs")))
attempt("symlink_absolute", lambda: append("link_abs"))
attempt("symlink_relative", lambda: append("sub/link_rel"))
attempt("dotdot", lambda: append(os.path.join("..", os.path.basename(decoys), "abs")))
attempt("hardlink_in_mount", lambda: append("hl"))
attempt("hardlink_in_workspace", lambda: append(os.path.join(ws, "hl")))
attempt("workspace_file", lambda: append(os.path.join(ws, "a.txt")))
attempt("store", lambda: append(os.path.join(ws, ".stepfs", "escape")))
attempt("rename_out", lambda: os.rename("a.txt", os.path.join(decoys, "stolen")))
attempt("mv_out", lambda: run(["mv", "b.txt", os.path.join(decoys, "moved")]))
attempt("rename_decoy", lambda: os.rename(os.path.join(decoys, "abs"), os.path.join(decoys, "abs.moved")))
attempt("unlink_decoy", lambda: os.unlink(os.path.join(decoys, "abs")))
attempt("truncate_decoy", lambda: os.truncate(os.path.join(decoys, "abs"), 0))
attempt("mkdir_outside", lambda: os.mkdir(os.path.join(decoys, "newdir")))
attempt("link_decoy_into_tmp", lambda: os.link(os.path.join(decoys, "abs"), os.path.join(tmp, "hl")))
attempt("child_process", lambda: run(["bash", "-c", f"echo ESCAPED >> {decoys}/abs"]))
attempt("grandchild_process", lambda: run(["bash", "-c", f"bash -c 'echo ESCAPED > {decoys}/rel'"]))
attempt("tmpdir", lambda: append(os.path.join(tmp, "scratch")))
attempt("dev_null", lambda: append("/dev/null"))
with open(".stepfs/status") as f:
    results["status"] = f.read()
print(json.dumps(results))
