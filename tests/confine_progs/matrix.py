"""The predicate matrix, run in a mount (cwd): each operation on each kind
of target, in a directory of its own per operation; prints
``{op: {target: "ok" | errno name}}`` as JSON.  argv: TARGET...
"""

import errno
import json
import os
import sys

OPS = {
    "write": lambda t: _append(t),
    "rename": lambda t: os.rename(t, t + ".renamed"),
    "truncate": lambda t: os.truncate(t, 1),
    "chmod": lambda t: os.chmod(t, 0o640),
}


def _append(path):
    with open(path, "ab") as f:
        f.write(b"w\r\n")


results = {}
for op, fn in OPS.items():
    results[op] = {}
    for target in sys.argv[1:]:
        path = os.path.join(op, {"through_file": "file_in.txt/x", "symlink_out_rel": "sub/symlink_out_rel"}
                            .get(target, target))
        try:
            fn(path)
            results[op][target] = "ok"
        except OSError as exc:
            results[op][target] = errno.errorcode[exc.errno]
print(json.dumps(results))
