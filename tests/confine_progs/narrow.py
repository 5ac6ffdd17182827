"""Run confined with --allow-read ALLOWED and --allow-connect PORT_OK:
read inside and outside the allowed paths, connect to both ports, bind;
prints ``{attempt: "ok" | errno name}`` as JSON.  argv: ALLOWED_FILE DENIED_FILE PORT_OK PORT_DENIED
"""

import errno
import json
import socket
import sys

allowed, denied, port_ok, port_denied = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
results = {}


def attempt(name, fn):
    try:
        fn()
        results[name] = "ok"
    except OSError as exc:
        results[name] = errno.errorcode[exc.errno]


def connect(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass


def bind():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))


attempt("read_allowed", lambda: open(allowed, "rb").read())
attempt("read_denied", lambda: open(denied, "rb").read())
attempt("read_system", lambda: open("/etc/passwd", "rb").read())
attempt("write_mount", lambda: open("in_mount.txt", "w").write("x"))
attempt("connect_allowed", lambda: connect(port_ok))
attempt("connect_denied", lambda: connect(port_denied))
attempt("bind", bind)
print(json.dumps(results))
