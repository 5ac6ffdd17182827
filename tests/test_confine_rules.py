"""Confinement rules (``overlayfs/client/confine.py``, ``landlock.py``)
without a mount: which rights each Landlock ABI handles, what each path of
the policy is allowed, what the policy refuses; and a ruleset built on the
running kernel."""

from __future__ import annotations

import ctypes
import os

import pytest

from stepfs.overlayfs.client import confine, landlock as ll
from stepfs.store.errors import ConfinementUnavailable, ContainmentError, InputError

WRITE_BITS = (ll.FS_WRITE_FILE | ll.FS_REMOVE_DIR | ll.FS_REMOVE_FILE | ll.FS_MAKE_DIR | ll.FS_MAKE_REG
              | ll.FS_MAKE_SYM | ll.FS_TRUNCATE | ll.FS_REFER)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "mnt").mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "tmp").mkdir()
    return tmp_path


def rules(p: confine.Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, access in p.paths:
        out[path] = out.get(path, 0) | access
    return out


@pytest.mark.parametrize("abi, refer, truncate, ioctl", [
    (1, False, False, False), (2, True, False, False), (3, True, True, False), (4, True, True, False),
    (5, True, True, True), (7, True, True, True)])
def test_each_abi_handles_the_rights_it_has(tree, abi, refer, truncate, ioctl):
    p = confine.plan(confine.Policy(str(tree / "mnt"), str(tree / "ws")), abi, str(tree / "tmp"))
    assert bool(p.handled_fs & ll.FS_REFER) is refer
    assert bool(p.handled_fs & ll.FS_TRUNCATE) is truncate
    assert bool(p.handled_fs & ll.FS_IOCTL_DEV) is ioctl
    assert p.handled_fs & ll.FS_MAKE_SYM and p.handled_fs < (1 << 16)
    assert p.handled_net == 0 and p.ports == []  # no network option: TCP is not restricted
    r = rules(p)
    # The mount and the private TMPDIR get every handled right, the rest of
    # the system reading only; nothing else is writable.
    assert r[str(tree / "mnt")] == p.handled_fs and r[str(tree / "tmp")] == p.handled_fs
    assert r["/"] == ll.FS_READ
    writable = {path for path, access in r.items() if access & WRITE_BITS}
    assert writable == {str(tree / "mnt"), str(tree / "tmp")} | {d for d in confine.DEVICES if os.path.exists(d)}
    assert r["/dev/null"] & ll.FS_WRITE_FILE and not r["/dev/null"] & (ll.FS_MAKE_REG | ll.FS_REMOVE_FILE)
    assert r["/dev/null"] & ~p.handled_fs == 0, "a right the ABI lacks is an error there"


def test_network_rules_need_abi_4(tree):
    pol = confine.Policy(str(tree / "mnt"), str(tree / "ws"), no_network=True, allow_connect=[443, 443, 8080])
    p = confine.plan(pol, 4, str(tree / "tmp"))
    assert p.handled_net == ll.NET_BIND_TCP | ll.NET_CONNECT_TCP
    assert p.ports == [(443, ll.NET_CONNECT_TCP), (8080, ll.NET_CONNECT_TCP)]
    assert p.describe()["tcp_connect"] == [443, 8080]
    assert confine.plan(confine.Policy(str(tree / "mnt"), no_network=True), 6, str(tree / "tmp")
                        ).describe()["tcp_connect"] == "none"
    with pytest.raises(ConfinementUnavailable, match="ABI 4"):
        confine.plan(pol, 3, str(tree / "tmp"))
    with pytest.raises(ConfinementUnavailable, match="has none"):
        confine.check_abi(confine.Policy(str(tree / "mnt")), 0, "ENOSYS")


def test_allow_write_and_allow_read(tree):
    pol = confine.Policy(str(tree / "mnt"), str(tree / "ws"), allow_write=[str(tree / "cache")],
                         allow_read=[str(tree / "cache")])
    p = confine.plan(pol, 7, str(tree / "tmp"))
    r = rules(p)
    assert r[str(tree / "cache")] == p.handled_fs
    assert "/" not in r, "--allow-read: no longer everywhere"
    assert r["/usr"] == ll.FS_READ and str(tree / "ws") not in r
    assert p.describe()["readable"] != "everywhere" and str(tree / "cache") in p.describe()["readable"]


@pytest.mark.parametrize("bad, error", [
    ("ws", ContainmentError), ("ws/.stepfs", ContainmentError), (".", ContainmentError),
    ("missing", InputError)])
def test_refused_allow_write(tree, bad, error):
    (tree / "ws" / ".stepfs").mkdir()
    pol = confine.Policy(str(tree / "mnt"), str(tree / "ws"), allow_write=[str(tree / bad)])
    with pytest.raises(error):
        confine.check(pol)


def test_refused_port(tree):
    with pytest.raises(InputError, match="not a TCP port"):
        confine.check(confine.Policy(str(tree / "mnt"), allow_connect=[70000]))


def test_kernel_struct_layouts():
    # The kernel's landlock_path_beneath_attr is packed (12 bytes); the others are not.
    assert ctypes.sizeof(ll._PathBeneathAttr) == 12
    assert ctypes.sizeof(ll._NetPortAttr) == 16
    assert ctypes.sizeof(ll._RulesetAttr) == 24


def test_ruleset_on_this_kernel(tree):
    """The running kernel accepts every rule the plan makes (file rules
    masked to file rights), for its own ABI."""
    abi = ll.abi_version()
    assert abi >= 1, "this machine's kernel has Landlock (DESIGN.md: ABI 7)"
    pol = confine.Policy(str(tree / "mnt"), str(tree / "ws"), no_network=abi >= 4, allow_connect=[443])
    with confine.Confinement(pol, abi) as c:
        assert c.ruleset.fd >= 0 and os.path.isdir(c.tmpdir)
        assert c.argv(["true"])[-2:] == ["--", "true"]
        tmpdir = c.tmpdir
    assert not os.path.exists(tmpdir), "the private TMPDIR goes with the confinement"


def test_cli_refuses_confine_options_without_confine_and_a_non_mount(tmp_path):
    from conftest import stepfs

    r = stepfs("run", tmp_path, "--allow-write", tmp_path, "--", "true")
    assert r.returncode == 2 and b"add --confine" in r.stderr, r.stderr
    assert not (tmp_path / ".stepfs").exists(), "nothing was touched"
    r = stepfs("confine", tmp_path, "--", "true")
    assert r.returncode == 8 and b"is not a stepfs mount" in r.stderr, r.stderr
    r = stepfs("confine", tmp_path, "true")
    assert r.returncode == 2 and b"put -- before the command" in r.stderr, r.stderr
