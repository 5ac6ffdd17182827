"""``stepfs serve``: its arguments and what it prints (CLI side)."""

from __future__ import annotations

import json
import sys


def cmd_serve(args) -> int:
    from stepfs.overlayfs.client import manage

    from stepfs.cli.web.app import create_app
    from stepfs.cli.web.security import new_token
    from stepfs.cli.web.server import Server, is_local

    target = manage.resolve(args.workspace)
    token = new_token()
    app = create_app(target.workspace, token, read_only=args.read_only)
    server = Server(app, args.host, args.port)
    if not is_local(args.host):
        print(f"stepfs: warning: listening on {args.host}, which is not a local address: anyone who can reach it "
              f"and learns the token can read this workspace's history{'' if args.read_only else ' and roll it back'}.",
              file=sys.stderr)
    url = server.url(token)

    def announce() -> None:
        if args.json:
            print(json.dumps({"message_type": "serve", "url": url, "host": args.host, "port": server.port,
                              "workspace": target.workspace, "read_only": args.read_only}, sort_keys=True),
                  flush=True)
        else:
            print(f"serving the history of {target.workspace}{' (read-only)' if args.read_only else ''}; "
                  f"Ctrl-C stops it", flush=True)
            print(f"open {url}", flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(url)

    # Announced once the server serves (its Ctrl-C handler in place): a
    # client that reads the announcement and sends Ctrl-C at once (a
    # harness, a test) gets a clean stop, never a server that goes on.
    try:
        server.run(on_ready=announce)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a server is stopped: uvicorn has shut down cleanly by now
    if not args.json:
        print("stopped", flush=True)
    return 0


def register(add) -> None:
    sp = add("serve", cmd_serve,
             "Serve a local web page of the history: timeline, change cards with diffs, files as of any layer, "
             "live state and undo. Prints a URL with a secret token; every request needs it.",
             "stepfs serve ~/project --port 8765")
    sp.add_argument("workspace", nargs="?", help="workspace or mountpoint (default: current directory)")
    sp.add_argument("--port", type=int, default=8765, help="TCP port (default 8765; 0 picks a free one)")
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; anything else prints a warning)")
    sp.add_argument("--read-only", action="store_true", help="no undo: the page can only look")
    sp.add_argument("--open", action="store_true", help="open the page in a web browser")
