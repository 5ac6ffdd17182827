"""A stand-in for an agent CLI with a PostToolUse hook: three tool calls,
each followed by the hook command Claude Code would run ('stepfs
hook-commit' with the call's JSON payload on stdin).  The second call
tries to write outside the mount.  Prints what happened as JSON.

argv: DECOY
"""

import errno
import json
import os
import subprocess
import sys

decoy = sys.argv[1]
hook = [sys.executable, "-m", "stepfs.cli.main", "hook-commit"]
out = {"hooks": []}


def tool_call(call_id, name, tool_input):
    payload = {"session_id": "s1", "hook_event_name": "PostToolUse", "cwd": os.getcwd(), "tool_name": name,
               "tool_input": tool_input, "tool_use_id": call_id}
    r = subprocess.run(hook, input=json.dumps(payload).encode(), capture_output=True)
    if r.returncode:
        sys.stderr.write(r.stderr.decode())
    out["hooks"].append(r.returncode)


with open("app.py", "w") as f:
    f.write("print('v2')\n")
tool_call("toolu_1", "Edit", {"file_path": os.path.join(os.getcwd(), "app.py")})
try:
    with open(decoy, "a") as f:
        f.write("escaped\n")
    out["escape"] = "ok"
except OSError as exc:
    out["escape"] = errno.errorcode[exc.errno]
tool_call("toolu_2", "Write", {"file_path": decoy})
subprocess.run(["bash", "-c", "echo notes > notes.txt"], check=True)
tool_call("toolu_3", "Bash", {"command": "echo notes > notes.txt"})
print(json.dumps(out))
