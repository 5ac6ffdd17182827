"""Real-mount tier: the foundation's promises, driven with real programs."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest

from conftest import manifest, sh, stepfs
from stepfs.overlayfs.client import manage, mounts

pytestmark = pytest.mark.mount


def _fill(ws):
    (ws / "src").mkdir()
    (ws / "src" / "main.py").write_text("print('hi')\n")
    (ws / "README.md").write_text("# readme\n")
    (ws / "data.bin").write_bytes(os.urandom(300_000))
    os.symlink("README.md", ws / "link")


def test_mount_shows_workspace_and_hides_store(workspace, mount):
    _fill(workspace)
    m = mount(workspace)
    entry = mounts.find(str(m.mountpoint))
    assert entry.fstype == "fuse.stepfs"
    assert entry.source == f"stepfs:{workspace}"
    assert sorted(os.listdir(m.mountpoint)) == ["README.md", "data.bin", "link", "src"]
    assert (m.path("src", "main.py")).read_text() == "print('hi')\n"
    assert m.path("data.bin").read_bytes() == (workspace / "data.bin").read_bytes()
    assert os.readlink(m.path("link")) == "README.md"
    # the store is unreachable; the .stepfs tree is the read-only meta tree
    assert not m.path(".stepfs", "store.db").exists()
    assert "workspace:" in m.path(".stepfs", "status").read_text()
    with pytest.raises(OSError) as exc:
        m.path(".stepfs", "new").write_text("x")
    assert exc.value.errno in (30, 13)  # EROFS (or EACCES from the 0555 dir)


def test_writes_are_staged_until_step(workspace, mount):
    _fill(workspace)
    before = manifest(workspace)
    m = mount(workspace)
    with open(m.path("README.md"), "a") as f:
        f.write("more\n")
    with open(m.path("data.bin"), "r+b") as f:
        f.seek(1000)
        f.write(b"XYZ")
        f.truncate(200_000)
    m.path("new.txt").write_text("new\n")
    m.path("src", "main.py").unlink()
    m.path("empty").mkdir()
    os.symlink("new.txt", m.path("newlink"))
    os.chmod(m.path("README.md"), 0o600)
    assert manifest(workspace) == before, "the workspace changed before a step"
    status = stepfs("status", m.mountpoint, "--json")
    assert status.returncode == 0, status.stderr
    assert b'"op": "A"' in status.stdout and b'"op": "D"' in status.stdout
    result = stepfs("step", m.mountpoint, "-m", "edits", "--json")
    assert result.returncode == 0, result.stderr
    assert manifest(workspace) == manifest(m.mountpoint)
    assert (workspace / "README.md").read_text() == "# readme\nmore\n"
    assert oct((workspace / "README.md").stat().st_mode & 0o777) == oct(0o600)
    assert not (workspace / "src" / "main.py").exists()
    assert (workspace / "empty").is_dir()
    assert os.readlink(workspace / "newlink") == "new.txt"
    data = (workspace / "data.bin").read_bytes()
    assert len(data) == 200_000 and data[1000:1003] == b"XYZ"


def test_real_tools_git_python_sed_tar_mv(workspace, mount, tmp_path):
    _fill(workspace)
    tarball = tmp_path / "many.tar"
    src = tmp_path / "many"
    for i in range(300):
        d = src / f"d{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text(f"file {i}\n" * (i % 5 + 1))
    with tarfile.open(tarball, "w") as t:
        t.add(src, arcname="many")
    m = mount(workspace)
    mp = m.mountpoint
    git = "git -c user.name=t -c user.email=t@example.invalid"
    sh(f"git init -q && git add -A && {git} commit -q -m one", mp)
    assert sh("git status --porcelain", mp).stdout == b""
    sh("sed -i 's/hi/bye/' src/main.py", mp)
    assert m.path("src", "main.py").read_text() == "print('bye')\n"
    sh(f"{sys.executable} -c \"open('gen.py','w').write('x = 1\\n'); import os; os.makedirs('pkg/sub', exist_ok=True); "
       f"open('pkg/sub/m.py','w').write('y = 2\\n')\"", mp)
    sh(f"tar xf {tarball}", mp)
    sh("mv many moved && mv moved/d3 d3top", mp)
    sh(f"git add -A && {git} commit -q -m two", mp)
    assert sh("git status --porcelain", mp).stdout == b""
    assert sh("git log --oneline | wc -l", mp).stdout.strip() == b"2"
    view = manifest(mp)
    assert stepfs("step", mp, "-m", "tools").returncode == 0
    assert manifest(workspace) == view
    assert sh("git status --porcelain && git fsck --no-progress", workspace).returncode == 0
    assert len(list((workspace / "moved").rglob("*.txt"))) + len(list((workspace / "d3top").glob("*.txt"))) == 300


def test_restart_resumes_open_step(workspace, mount):
    _fill(workspace)
    m = mount(workspace)
    m.path("staged.txt").write_text("kept across restarts\n")
    m.path("README.md").unlink()
    m.path("dir").mkdir()
    manage.unmount(str(m.mountpoint))
    assert not (workspace / "staged.txt").exists()
    m2 = mount(workspace, m.mountpoint)
    assert m2.path("staged.txt").read_text() == "kept across restarts\n"
    assert not m2.path("README.md").exists()
    assert m2.path("dir").is_dir()
    assert stepfs("step", m2.mountpoint).returncode == 0
    assert (workspace / "staged.txt").read_text() == "kept across restarts\n"
    assert not (workspace / "README.md").exists()


def test_metadata_ops_statfs_utimens_fsync(workspace, mount):
    (workspace / "f").write_text("x")
    m = mount(workspace)
    f = m.path("f")
    os.utime(f, ns=(1_000_000_123, 2_000_000_456))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
    sh("touch -m -d '2020-01-02 03:04:05.123456789' f", m.mountpoint)  # UTIME_OMIT for atime
    st2 = os.stat(f)
    assert st2.st_atime_ns == 1_000_000_123
    assert st2.st_mtime_ns % 1_000_000_000 == 123_456_789
    sv = os.statvfs(m.mountpoint)
    assert sv.f_blocks > 0 and sv.f_namemax == 255
    fd = os.open(m.path("g"), os.O_CREAT | os.O_WRONLY, 0o640)
    os.write(fd, b"durable")
    os.fsync(fd)
    os.close(fd)
    assert os.stat(m.path("g")).st_mode & 0o777 == 0o640


def test_mounting_is_o1_in_workspace_size(workspace, mount):
    """Mounting reads no workspace directory: a tree we make unreadable is
    only ever touched when the agent looks at it."""
    big = workspace / "big"
    big.mkdir()
    for i in range(2000):
        (big / f"f{i}").write_bytes(b"")
    m = mount(workspace)
    status = stepfs("status", m.mountpoint, "--json")
    assert b'"staged": []' in status.stdout
    assert len(os.listdir(m.path("big"))) == 2000


def test_unmount_leaves_no_daemon(workspace, mount):
    m = mount(workspace)
    pid = m.pid
    result = stepfs("unmount", m.mountpoint)
    assert result.returncode == 0, result.stderr
    assert mounts.find(str(m.mountpoint)) is None
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(pid, 0)
            # a zombie still answers kill(0); reap it if it is our child
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            subprocess.run(["sleep", "0.05"])
        raise AssertionError("daemon still running")
