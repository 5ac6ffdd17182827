"""Issue 18 item 2: with ``--allow-other``, the ``.stepfs`` views of a mount
(conflict and discard copies, layers, status) let another user see no more
than the tree itself does.  The other user is a real unprivileged uid
(``os.setuid`` in a forked child); all paths are temp dirs."""

from __future__ import annotations

import os
import stat

import pytest

from conftest import stepfs
from userkit import NOBODY, as_user, shared_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.mount

SECRET = b"password=hunter2\n"


def _try(fn):
    """``fn()`` as nobody: "ok:<result>" or the errno name it failed with."""
    def run() -> int:
        try:
            out = fn()
            print("ok:" + (out.decode(errors="replace") if isinstance(out, bytes) else repr(out)))
        except OSError as exc:
            import errno

            print("err:" + errno.errorcode.get(exc.errno, str(exc.errno)))
        return 0

    code, out, err = as_user(run, NOBODY)
    assert code == 0, err
    return out.strip()


def _read(path):
    return lambda: open(path, "rb").read()


def test_private_files_stay_private_in_the_meta_tree(mount, shared_dir):
    ws = shared_dir / "ws"
    (ws / "priv").mkdir(parents=True)
    os.chmod(ws / "priv", 0o700)
    (ws / "priv" / "secret").write_bytes(b"old\n")
    os.chmod(ws / "priv" / "secret", 0o600)
    (ws / "pub.txt").write_text("public\n")
    os.chmod(ws / "pub.txt", 0o644)
    m = mount(ws, shared_dir / "mnt", allow_other=True)
    meta = m.mountpoint / ".stepfs"

    # A committed private file: its layer copy keeps owner and mode.
    (m.mountpoint / "priv" / "secret").write_bytes(SECRET)
    assert stepfs("step", m.mountpoint, "-m", "secret").returncode == 0
    layer_copy = meta / "layers" / "1" / "priv" / "secret"
    st = os.stat(layer_copy)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.S_IMODE(os.stat(meta / "layers" / "1" / "priv").st_mode) == 0o700

    # A discarded private file: its conflict copy too.
    (m.mountpoint / "priv" / "secret").write_bytes(SECRET + b"more\n")
    (m.mountpoint / "pub.txt").write_text("public 2\n")
    # Touched in the workspace meanwhile: the staged version lost, and a
    # discard keeps such bytes as a conflict (a plain draft would just go).
    os.utime(ws / "priv" / "secret", ns=(1_500_000_000_000_000_000,) * 2)
    r = stepfs("discard", m.mountpoint, "priv/secret")
    assert r.returncode == 0, r.stderr
    conflict_copy = meta / "conflicts" / "priv" / "secret"
    assert open(conflict_copy, "rb").read() == SECRET + b"more\n"  # the owner reads it
    st = os.stat(conflict_copy)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.S_IMODE(os.stat(meta / "conflicts" / "priv").st_mode) == 0o700

    # Staged again, so status has a private path to (not) show.
    (m.mountpoint / "priv" / "other").write_bytes(b"x\n")

    # Another user: none of it.
    assert _try(_read(m.mountpoint / "pub.txt")) == "ok:public 2"  # the mount is open to them
    assert _try(_read(m.mountpoint / "priv" / "secret")) == "err:EACCES"
    assert _try(_read(layer_copy)) == "err:EACCES"
    assert _try(_read(conflict_copy)) == "err:EACCES"
    assert _try(lambda: os.listdir(meta / "conflicts" / "priv")) == "err:EACCES"
    assert _try(lambda: os.listdir(meta / "layers" / "1" / "priv")) == "err:EACCES"
    status = _try(_read(meta / "status"))
    assert status.startswith("ok:") and "pub.txt" in status
    assert "priv" not in status, status
    # The owner still sees everything staged.
    own = (meta / "status").read_text()
    assert "/priv/other" in own and "/pub.txt" in own
