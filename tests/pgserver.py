"""A throwaway PostgreSQL cluster for the shared-history tests (never a mock).

``PgServer`` runs Debian's PostgreSQL binaries (``docker/install-system-deps.sh``
installs the ``postgresql`` package): ``initdb`` into a temp directory as an
unprivileged user (the ``postgres`` system user when the tests run as root:
the server refuses to run as root), listening on a Unix socket in that
directory only (no TCP port to collide with another run), ``pg_ctl start -w``
and ``pg_ctl stop -m fast``.  Each test gets a database of its own
(:meth:`new_database`).  Every step has a timeout: a server that does not
come up fails the test instead of hanging it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time

PG_USER = "stepfs"
START_TIMEOUT = 60


def pg_bindir() -> str | None:
    """The directory of ``initdb`` and ``pg_ctl`` (Debian keeps them out of PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    which = shutil.which("pg_ctl")
    return os.path.dirname(which) if which else None


def pg_problem() -> str | None:
    """Why a server cannot be started here, or None."""
    if pg_bindir() is None:
        return "PostgreSQL's server binaries are missing (install Debian's postgresql package: make deps)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root needs the 'postgres' system user (Debian's postgresql package makes it)"
    return None


class PgServer:
    """One cluster in ``self.dir``; :meth:`start` / :meth:`stop` may be
    called again (the fault tests stop the server in the middle of a step)."""

    def __init__(self, durable: bool = False) -> None:
        self.bindir = pg_bindir()
        # Right under /tmp, not the (maybe private) TMPDIR: the postgres user
        # must reach it, and the socket's path must stay short.
        self.dir = tempfile.mkdtemp(prefix="stepfs-pg-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "server.log")
        self._run_as: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._run_as = ["runuser", "-u", "postgres", "--"]
        self._databases = 0
        self._cmd([os.path.join(self.bindir, "initdb"), "-D", self.data, "-U", PG_USER, "-A", "trust",
                   "--no-sync", "-E", "UTF8", "--locale=C"], timeout=120)
        with open(os.path.join(self.data, "postgresql.auto.conf"), "a") as f:
            # Unix socket in our directory only; fsync off: the tests stop the
            # server, they do not cut its power.  ``durable`` (the benchmark)
            # keeps PostgreSQL's defaults: every commit flushed to disk.
            f.write(f"listen_addresses = ''\nunix_socket_directories = '{self.dir}'\nmax_connections = 60\n")
            if not durable:
                f.write("fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n")

    def _cmd(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        result = subprocess.run(self._run_as + argv, capture_output=True, timeout=timeout, cwd=self.dir)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: "
                               f"{result.stderr.decode(errors='replace')}{self._log_tail()}")
        return result

    def _log_tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "\nserver log:\n" + f.read()[-2000:]
        except OSError:
            return ""

    def start(self) -> None:
        self._cmd([os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-l", self.log, "-w",
                   "-t", str(START_TIMEOUT), "start"], timeout=START_TIMEOUT + 10)

    def stop(self) -> None:
        self._cmd([os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-m", "fast", "-w",
                   "-t", str(START_TIMEOUT), "stop"], timeout=START_TIMEOUT + 10)

    def running(self) -> bool:
        result = subprocess.run(self._run_as + [os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "status"],
                                capture_output=True, timeout=30)
        return result.returncode == 0

    def url(self, database: str = "postgres", name: str = "proj") -> str:
        """A history URL as a user writes it (``--history``)."""
        return f"postgresql://{PG_USER}@/{database}?host={self.dir}&name={name}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its name."""
        self._databases += 1
        name = f"t{os.getpid()}_{self._databases}_{time.monotonic_ns() % 100000}"
        self._cmd([os.path.join(self.bindir, "psql"), "-h", self.dir, "-U", PG_USER, "-d", "postgres",
                   "-v", "ON_ERROR_STOP=1", "-c", f'CREATE DATABASE "{name}"'], timeout=60)
        return name

    def destroy(self) -> None:
        try:
            if self.running():
                self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


# -- fixtures (imported by tests/conftest.py) ----------------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def pg_server():
    """One throwaway PostgreSQL cluster for the session; stopped and
    removed in ``finally``."""
    problem = pg_problem()
    if problem is not None:
        pytest.fail(f"the shared-history tests need a PostgreSQL server: {problem}")
    server = PgServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(params=["sqlite", "postgresql"])
def history_url(request, tmp_path) -> str:
    """A new, empty shared history on each backend (the contract suite)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/history.db?name=proj"
    server = request.getfixturevalue("pg_server")
    if not server.running():
        server.start()  # a fault test stopped it
    return server.url(server.new_database())


@pytest.fixture
def pg_url(pg_server) -> str:
    """A new, empty shared history in PostgreSQL."""
    if not pg_server.running():
        pg_server.start()
    return pg_server.url(pg_server.new_database())
