"""Real-mount tier: the tools agents run, unchanged, inside a mount.

Each test runs real programs in the mount, then commits a step and checks
that the workspace equals the mount byte for byte (``manifest``).
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from conftest import manifest, sh, stepfs

pytestmark = pytest.mark.mount
GIT = "git -c user.name=t -c user.email=t@example.invalid -c init.defaultBranch=main"


def _commit_and_compare(m):
    view = manifest(m.mountpoint)
    result = stepfs("step", m.mountpoint, "-m", "tools")
    assert result.returncode in (0, 6), result.stderr
    assert manifest(m.workspace) == view


@pytest.mark.timeout(180)
def test_git_clone_branch_rebase_gc(workspace, mount, tmp_path):
    origin = tmp_path / "origin"
    origin.mkdir()
    sh(f"{GIT} init -q && for i in 1 2 3; do echo $i > f$i; {GIT} add f$i; {GIT} commit -qm c$i; done", origin)
    m = mount(workspace)
    sh(f"{GIT} clone -q {origin} repo", m.mountpoint)
    repo = m.path("repo")
    sh(f"{GIT} checkout -q -b feature && echo feature > feat && {GIT} add feat && {GIT} commit -qm feat", repo)
    sh(f"{GIT} checkout -q main && echo more >> f1 && {GIT} commit -qam more", repo)
    sh(f"{GIT} checkout -q feature && {GIT} rebase -q main", repo)
    sh(f"{GIT} gc -q --prune=now", repo)
    assert sh(f"{GIT} status --porcelain", repo).stdout == b""
    assert sh(f"{GIT} log --oneline | wc -l", repo).stdout.strip() == b"5"
    _commit_and_compare(m)
    assert sh(f"{GIT} fsck --no-progress && {GIT} status --porcelain", workspace / "repo").stdout == b""


def _build_wheel(path):
    """A minimal, valid wheel built by hand (no build backend needed)."""
    import base64
    import hashlib
    import zipfile

    files = {
        "tinypkg/__init__.py": b"def answer():\n    return 42\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinypkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")


@pytest.mark.timeout(240)
def test_python_venv_pip_compileall_pytest(workspace, mount, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _build_wheel(wheels / "tinypkg-1.0-py3-none-any.whl")
    m = mount(workspace)
    mp = m.mountpoint
    sh(f"{sys.executable} -m venv --without-pip venv", mp, timeout=120)
    sh(f"{sys.executable} -m pip --python venv/bin/python install -q --no-index {wheels}/*.whl", mp, timeout=120)
    assert sh("venv/bin/python -c 'import tinypkg; print(tinypkg.answer())'", mp).stdout.strip() == b"42"
    (m.path("proj")).mkdir()
    m.path("proj", "calc.py").write_text("def add(a, b):\n    return a + b\n")
    m.path("proj", "test_calc.py").write_text("from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    sh(f"{sys.executable} -m compileall -q proj", mp)
    assert list(m.path("proj", "__pycache__").iterdir())
    result = sh(f"{sys.executable} -m pytest -q -p no:cacheprovider proj", mp, timeout=120)
    assert b"1 passed" in result.stdout
    _commit_and_compare(m)


def test_sqlite3_cli_wal(workspace, mount):
    if shutil.which("sqlite3") is None:
        pytest.fail("sqlite3 CLI missing: make deps installs it", pytrace=False)
    m = mount(workspace)
    sh("sqlite3 app.db 'PRAGMA journal_mode=WAL; CREATE TABLE t(x); "
       "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM c WHERE i<500) INSERT INTO t SELECT i FROM c;'",
       m.mountpoint)
    assert sh("sqlite3 app.db 'SELECT count(*), sum(x) FROM t; PRAGMA integrity_check;'",
              m.mountpoint).stdout.split() == [b"500|125250", b"ok"]
    _commit_and_compare(m)
    assert sh("sqlite3 app.db 'PRAGMA integrity_check; SELECT count(*) FROM t;'",
              workspace).stdout.split() == [b"ok", b"500"]


def test_editor_save_by_rename_sed_and_cp(workspace, mount):
    (workspace / "doc.txt").write_text("line one\nline two\n")
    m = mount(workspace)
    mp = m.mountpoint
    # what editors do: write a temp file, fsync, rename it over the original
    sh(f"{sys.executable} -c \"import os; f=open('.doc.txt.swp','w'); f.write('edited\\n'); f.flush(); "
       f"os.fsync(f.fileno()); f.close(); os.rename('.doc.txt.swp','doc.txt')\"", mp)
    sh("sed -i 's/edited/edited twice/' doc.txt", mp)
    assert m.path("doc.txt").read_text() == "edited twice\n"
    sh("mkdir -p src && echo a > src/a && chmod 750 src && cp -a src copy", mp)
    assert oct(os.stat(m.path("copy")).st_mode & 0o777) == oct(0o750)
    _commit_and_compare(m)


def test_rsync_in_and_tar_round_trip(workspace, mount, tmp_path):
    src = tmp_path / "src"
    for i in range(60):
        d = src / f"d{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(os.urandom(100 + i))
        os.utime(d / f"f{i}", ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_000_000_000 + i))
    os.chmod(src / "d1" / "f1", 0o600)
    os.symlink("d0/f0", src / "link")
    m = mount(workspace)
    sh(f"rsync -a {src}/ copy/", m.mountpoint)
    assert sh(f"diff -r {src} copy", m.mountpoint, check=False).returncode == 0
    sh("tar --format=posix -cf ../archive.tar copy", m.mountpoint)  # pax keeps nanoseconds
    sh(f"mkdir untar && tar xf {tmp_path}/archive.tar -C untar", m.mountpoint)
    st = os.stat(m.path("untar", "copy", "d2", "f7"))
    assert st.st_mtime_ns == 1_600_000_000_000_000_007
    assert oct(os.stat(m.path("untar", "copy", "d1", "f1")).st_mode & 0o777) == oct(0o600)
    _commit_and_compare(m)
    assert os.stat(workspace / "untar" / "copy" / "d2" / "f7").st_mtime_ns == 1_600_000_000_000_000_007


def test_make_and_gcc(workspace, mount):
    m = mount(workspace)
    m.path("hello.c").write_text('#include <stdio.h>\nint main(void){puts("hello from stepfs");return 0;}\n')
    m.path("Makefile").write_text("hello: hello.c\n\tgcc -O0 -o hello hello.c\n")
    sh("make -s", m.mountpoint, timeout=120)
    assert sh("./hello", m.mountpoint).stdout.strip() == b"hello from stepfs"
    assert sh("make -q", m.mountpoint, check=False).returncode == 0  # up to date: mtimes are consistent
    _commit_and_compare(m)
    assert os.access(workspace / "hello", os.X_OK)


@pytest.mark.timeout(300)
def test_hundred_thousand_entries_in_one_directory(workspace, mount):
    big = workspace / "big"
    big.mkdir()
    for i in range(100_000):
        os.close(os.open(big / f"f{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))
    m = mount(workspace)
    names = os.listdir(m.path("big"))
    assert len(names) == 100_000 and "f099999" in names
    m.path("big", "extra").write_text("x")
    os.unlink(m.path("big", "f000000"))
    names = os.listdir(m.path("big"))
    assert len(names) == 100_000 and "extra" in names and "f000000" not in names
