"""The database behind a store: engine, pragmas, transactions, format check.

SQLite (WAL) through SQLAlchemy Core.  Rules every caller relies on:

* Every writing transaction starts with ``BEGIN IMMEDIATE`` (:meth:`Database.write`):
  a deferred transaction that reads and then writes can fail with
  ``SQLITE_BUSY_SNAPSHOT`` under concurrency, an immediate one waits for the
  write lock instead (up to the busy timeout).
* ``synchronous=NORMAL`` is the default, which in WAL mode survives a crash of
  the process but may lose the last transactions on power loss; transactions
  that must survive power loss (a layer's intent record and its completion)
  ask for ``durable=True`` and run with ``synchronous=FULL``.
* Memory-mapped I/O stays off: an I/O error under mmap is a SIGBUS that kills
  the daemon instead of an error we can report.
* Every COMMIT of a writing transaction goes through ``durable.commit`` (the
  seam tests use to count, fail or crash at it).
* ``SQLITE_FULL`` becomes :class:`StoreFull`, any other I/O error of SQLite
  :class:`StoreUnavailable`; a failed *write* also calls every function in
  :attr:`Database.on_failure` (a mount goes read-only from there).

Threading: a :class:`Database` may be shared by threads; each transaction
takes its own pooled connection.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from contextlib import contextmanager
from typing import Callable, Iterator

from sqlalchemy import create_engine, event, inspect, select
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError
from sqlalchemy.pool import StaticPool

from stepfs.store import durable as durable_calls
from stepfs.store import keys, schema
from stepfs.store.errors import StepfsError, StoreBusy, StoreDamaged, StoreFormatError, StoreFull, StoreUnavailable

log = logging.getLogger("stepfs.store")

BUSY_TIMEOUT_MS = 30_000
#: WAL pages after which a durable commit checkpoints (SQLite's default).
CHECKPOINT_PAGES = 1000
#: WAL pages after which any commit checkpoints: bounds the WAL (1 GiB of
#: 4 KiB pages) when content is staged for long without a step.
WAL_LIMIT_PAGES = 262144

# Primary result codes (the low byte of an extended code) that mean "the
# store cannot keep what it is asked to write".
SQLITE_PERM = 3
SQLITE_BUSY = 5
SQLITE_READONLY = 8
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_CANTOPEN = 14
SQLITE_NOTADB = 26
#: Most rows one INSERT of :meth:`Prepared.executemany` carries (SQLite
#: binds at most 999 values in old builds: 32 rows of 16 columns is 512).
MULTI_ROWS = 32


class Database:
    """One store database.  Use :meth:`open` (a file) or :meth:`memory`."""

    def __init__(self, engine: Engine, label: str):
        self.engine = engine
        self.label = label
        #: Called with the StepfsError of every write that failed because the
        #: store cannot write (full, I/O error).  Must not raise.
        self.on_failure: list[Callable[[StepfsError], None]] = []

    # -- construction -------------------------------------------------------

    @classmethod
    def open(cls, path: str, create: bool = True, label: str | None = None) -> "Database":
        """Open (and, if ``create`` and empty, initialise) the store at ``path``.

        Raises :class:`StoreFormatError` for a file that is not a stepfs
        store, or one written by a newer stepfs.  ``label``: the name
        messages give the store (default ``path``; a path through a
        directory handle is no name for a person).
        """
        # URL.create, not an f-string URL: a path is a file name, and '?',
        # '#' or '%' in a workspace name must not be parsed as URL syntax.
        engine = create_engine(
            URL.create("sqlite", database=path),
            connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
        )
        _install_sqlite_hooks(engine, wal=True)
        db = cls(engine, label or path)
        try:
            db._check_or_create(create)
        except BaseException:
            engine.dispose()  # a refused store keeps no file open
            raise
        return db

    @classmethod
    def memory(cls) -> "Database":
        """A private in-memory store (tests, scratch work)."""
        engine = create_engine(
            "sqlite://",
            connect_args={"check_same_thread": False},
            poolclass=StaticPool,
        )
        _install_sqlite_hooks(engine, wal=False)
        db = cls(engine, ":memory:")
        db._check_or_create(True)
        return db

    def close(self) -> None:
        self.engine.dispose()

    # -- transactions -------------------------------------------------------

    @contextmanager
    def write(self, durable: bool = False, checkpoint: bool | None = None,
              foreign_keys: bool = True) -> Iterator[Connection]:
        """A writing transaction (``BEGIN IMMEDIATE``); commits on success,
        rolls back on any exception.  Raises :class:`StoreFull` /
        :class:`StoreUnavailable` when SQLite cannot write.  ``checkpoint``
        (default: ``durable``): whether its COMMIT may checkpoint a WAL
        past :data:`CHECKPOINT_PAGES` (see ``_install_sqlite_hooks``).
        ``foreign_keys=False``: SQLite does not check references in this
        transaction (gc's sweep, which deletes only what no row names and
        would otherwise search every referring table per deleted row)."""
        if checkpoint is None:
            checkpoint = durable
        with self._translated(notify=True):
            with self.engine.connect() as conn:
                conn.execution_options(stepfs_begin="BEGIN IMMEDIATE", stepfs_durable=durable,
                                       stepfs_checkpoint=checkpoint)
                raw = conn.connection.dbapi_connection if not foreign_keys else None
                if raw is not None:
                    raw.execute("PRAGMA foreign_keys=OFF").close()  # outside a transaction, or a no-op
                try:
                    trans = conn.begin()
                    try:
                        yield conn
                        durable_calls.commit(trans.commit, durable)
                    finally:
                        if trans.is_active:
                            trans.rollback()
                finally:
                    if raw is not None:
                        raw.execute("PRAGMA foreign_keys=ON").close()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction on one consistent snapshot; ended with a
        rollback (it has nothing to commit, and a rollback cannot fail on a
        store whose pages turned out damaged)."""
        with self._translated(notify=False):
            with self.engine.connect() as conn:
                conn.execution_options(stepfs_begin="BEGIN", stepfs_durable=False)
                trans = conn.begin()
                try:
                    yield conn
                finally:
                    if trans.is_active:
                        trans.rollback()

    @contextmanager
    def _translated(self, notify: bool) -> Iterator[None]:
        """SQLite's full-disk and I/O errors as StoreFull / StoreUnavailable;
        a failed write also tells ``on_failure`` (the view goes read-only)."""
        try:
            yield
        except DBAPIError as exc:
            err = store_error(exc, self.label, self.engine.url.database)
            if err is None:
                raise
            if notify and isinstance(err, StoreUnavailable):
                for listener in list(self.on_failure):
                    listener(err)
            raise err from None
        except UnicodeDecodeError as exc:
            # Text the store keeps (a message, a path name stored as text,
            # JSON metadata) that no longer decodes: flipped bytes in a
            # page SQLite itself still reads.
            raise damaged(self.label, f"a stored text does not decode: {exc}") from None

    # -- format ---------------------------------------------------------------

    def _check_or_create(self, create: bool) -> None:
        try:
            names = set(inspect(self.engine).get_table_names())
        except DatabaseError as exc:
            err = store_error(exc, self.label)
            if err is not None and getattr(exc.orig, "sqlite_errorcode", 0) & 0xFF != SQLITE_NOTADB:
                raise err from None  # a store we cannot open or write, or a damaged one: not a foreign file
            raise StoreFormatError(
                f"{self.label} is not a stepfs store (SQLite says: {_orig(exc)}); move it away or point at another workspace."
            ) from None
        if "meta" not in names:
            if names:
                raise StoreFormatError(
                    f"{self.label} is an SQLite database but not a stepfs store; move it away or point at another workspace."
                )
            if not create:
                raise StoreFormatError(f"{self.label} holds no stepfs store.")
            with self.write(durable=True) as conn:
                # Look again under the write lock: another process may have
                # created the store since we looked (two first mounts at once).
                names = set(inspect(conn).get_table_names())
                if "meta" not in names:
                    schema.metadata.create_all(conn)
                    conn.execute(
                        schema.meta.insert(),
                        [
                            {"key": "format_version", "value": str(schema.FORMAT_VERSION)},
                            {"key": "hash_algorithm", "value": schema.HASH_ALGORITHM},
                            {"key": "chunk_size", "value": str(schema.CHUNK_SIZE)},
                        ],
                    )
                    return
        with self.read() as conn:
            facts = dict(conn.execute(select(schema.meta.c.key, schema.meta.c.value)).all())
        try:
            version = int(facts.get("format_version", ""))
        except ValueError:
            version = 0
        if version < 1:  # no stepfs ever wrote a version below 1
            raise StoreFormatError(f"{self.label} has no readable format version; it is not a stepfs store.")
        if version > schema.FORMAT_VERSION:
            raise StoreFormatError(
                f"{self.label} was written by a newer stepfs (format {version}, this one reads up to "
                f"{schema.FORMAT_VERSION}); upgrade stepfs to use it."
            )
        if facts.get("hash_algorithm") != schema.HASH_ALGORITHM:
            raise StoreFormatError(
                f"{self.label} uses hash {facts.get('hash_algorithm')!r}, this stepfs only knows {schema.HASH_ALGORITHM}."
            )
        missing = ({t.name for t in schema.metadata.sorted_tables} - names - set(schema.OPTIONAL_TABLES)
                   - {name for name, since in schema.INTRODUCED.items() if since > version})
        if missing:
            raise StoreFormatError(f"{self.label} is damaged: tables {sorted(missing)} are missing.")
        if version < schema.FORMAT_VERSION:
            self._upgrade(version)
        if not names.issuperset(schema.OPTIONAL_TABLES):
            self._add_optional()

    def _add_optional(self) -> None:
        """Make the optional tables an older stepfs did not (FORMAT.md,
        ``layer_counts``: no format number).  A store that cannot be written now is
        read without them (their readers look for them first)."""
        try:
            with self.write() as conn:
                for name in schema.OPTIONAL_TABLES:
                    schema.metadata.tables[name].create(conn, checkfirst=True)
        except StepfsError as exc:
            log.warning("%s: table(s) %s not made now: %s", self.label, ", ".join(schema.OPTIONAL_TABLES), exc)

    def _upgrade(self, version: int) -> None:
        """Bring an older store to this format: each step and the new version
        number in one durable transaction (under the write lock, looking at
        the version again: another process may have just upgraded it)."""
        # Version 7 rebuilds tables that others refer to: without foreign-key
        # checks for that transaction (SQLite's recipe for a table rebuild).
        # Version 10 rebuilds objects (store/upgrade10.py) likewise.
        with self.write(durable=True, foreign_keys=version >= 10 or schema.FORMAT_VERSION < 7) as conn:
            row = conn.execute(select(schema.meta.c.value).where(schema.meta.c.key == "format_version")).scalar()
            current = int(row)
            for target in range(current + 1, schema.FORMAT_VERSION + 1):
                for statement in UPGRADES[target]:
                    if callable(statement):
                        statement(conn)
                    else:
                        conn.exec_driver_sql(statement)
            if current < schema.FORMAT_VERSION:
                conn.execute(
                    schema.meta.update().where(schema.meta.c.key == "format_version")
                    .values(value=str(schema.FORMAT_VERSION))
                )


#: SQL that turns a store of version ``n - 1`` into version ``n`` (FORMAT.md,
#: "Change log").
UPGRADES: dict[int, list[str]] = {
    # Staged rows are consumed when the layer is committed, not at its
    # intent.  A pending version-1 layer consumed its rows already: NULL.
    2: ["ALTER TABLE layers ADD COLUMN step INTEGER"],
    # New kinds (chardev, blockdev, socket) and hard links of non-files: no
    # table changes; the version alone keeps older stepfs off such a store.
    3: [],
    # Big files staged by reference to a scratch file (store/refs.py).
    4: ["ALTER TABLE staged ADD COLUMN scratch TEXT", "ALTER TABLE staged ADD COLUMN scratch_sum VARCHAR(48)"],
    # Layers looked up by state (the pending check of every commit, history).
    5: ["CREATE INDEX IF NOT EXISTS layers_state_number ON layers (state, number)"],
    # Compressed and delta chunks, gc generations of objects, pruned layers
    # (store/codec.py, store/gc.py, store/prune.py).
    6: ["ALTER TABLE chunks ADD COLUMN codec INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE chunks ADD COLUMN base VARCHAR(48) REFERENCES chunks (cid)",
        "ALTER TABLE objects ADD COLUMN gen INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX IF NOT EXISTS chunks_base ON chunks (base)"],
    # Binary keys, inline objects, tables without rowid: every table that
    # holds a key is rebuilt (store/upgrade7.py).
    7: [lambda conn: _upgrade7(conn)],
    # Entry lists per layer, a tree of paths, path_layers (store/upgrade8.py).
    8: [lambda conn: _upgrade8(conn)],
    # Line counts per layer instead of per object pair (store/upgrade9.py).
    9: [lambda conn: _upgrade9(conn)],
    # A delta's base named by a key prefix (store/upgrade10.py).
    10: [lambda conn: _upgrade10(conn)],
    # Before states that repeat the path's previous after as markers (store/upgrade11.py).
    11: [lambda conn: _upgrade11(conn)],
}


def _upgrade7(conn) -> None:
    from stepfs.store import upgrade7  # imports schema's tables; only an old store needs it

    upgrade7.upgrade(conn)


def _upgrade8(conn) -> None:
    from stepfs.store import upgrade8  # only an old store needs it

    upgrade8.upgrade(conn)


def _upgrade9(conn) -> None:
    from stepfs.store import upgrade9  # only an old store needs it

    upgrade9.upgrade(conn)


def _upgrade10(conn) -> None:
    from stepfs.store import upgrade10  # only an old store needs it

    upgrade10.upgrade(conn)


def _upgrade11(conn) -> None:
    from stepfs.store import upgrade11  # only an old store needs it

    upgrade11.upgrade(conn)


def _orig(exc: Exception) -> str:
    return str(getattr(exc, "orig", exc))


def store_error(exc: DBAPIError, label: str,
                db_path: str | None = None) -> StoreUnavailable | StoreDamaged | StoreBusy | None:
    """The domain error for an SQLite error that means "cannot write",
    "damaged" or "busy past the timeout", else None.  ``db_path``: the
    database file, to name who held the write lock."""
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if code is None:
        return None
    if code & 0xFF == SQLITE_BUSY:
        return busy(label, db_path)
    if code & 0xFF == SQLITE_FULL:
        return StoreFull(
            f"the store {label} is full (SQLite: {_orig(exc)}); free space on its filesystem, then unmount and mount again."
        )
    if code & 0xFF == SQLITE_IOERR:
        return StoreUnavailable(
            f"the store {label} cannot write (SQLite: {_orig(exc)}); check the disk, then unmount and mount again."
        )
    if code & 0xFF in (SQLITE_READONLY, SQLITE_CANTOPEN, SQLITE_PERM):
        return StoreUnavailable(
            f"the store {label} cannot be opened for writing (SQLite: {_orig(exc)}); make its directory and "
            f"files writable by this user (check permissions and read-only mounts), then try again."
        )
    if code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB):
        return damaged(label, f"SQLite: {_orig(exc)}")
    return None


def damaged(label: str, detail: str) -> StoreDamaged:
    """The error for a database whose pages no longer read back as written."""
    return StoreDamaged(
        f"the store {label} is damaged ({detail}); copy the workspace's files somewhere safe, then restore "
        f"the store from a backup or start a new history with 'stepfs mount --new-history'.",
        [detail],
    )


def busy(label: str, db_path: str | None) -> StoreBusy:
    """The error for a write that waited the whole busy timeout."""
    from stepfs.store import lockholders  # only on this rare path

    who = "another process"
    if db_path:
        pids = lockholders.write_holders(db_path, os.path.join(os.path.dirname(db_path), "commit.lock"))
        if pids:
            who = ", ".join(lockholders.describe(p) for p in pids)
    return StoreBusy(
        f"the store {label} stayed busy for {BUSY_TIMEOUT_MS // 1000} s: {who} held its write lock; nothing "
        f"was written, run the command again once that process has finished."
    )


def _install_sqlite_hooks(engine: Engine, wal: bool) -> None:
    """Pragmas on every new connection; our own BEGIN on every transaction."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, record) -> None:
        # Autocommit at the driver level: SQLAlchemy's "begin" event below
        # emits the BEGIN we want instead of pysqlite's implicit one.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            # Free pages go back to the file system in place (gc's
            # incremental_vacuum): set on a new, empty file only (before the
            # WAL header is written); on an existing one the pragma waits
            # for the write lock, which would make every new connection wait
            # for a running commit.  An older store gets it at its one
            # VACUUM (``store/gc.py``).
            if cur.execute("PRAGMA page_count").fetchone()[0] == 0:
                cur.execute("PRAGMA auto_vacuum=INCREMENTAL")
            if wal:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            record.info["stepfs_synchronous"] = "NORMAL"
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA mmap_size=0")
        except sqlite3.DatabaseError:
            # Not a database at all: let the format check report it.
            pass
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        opts = conn.get_execution_options()
        durable = bool(opts.get("stepfs_durable"))
        # The pragmas are per connection and outside transactions: set them
        # only when this pooled connection has another value (a statement
        # per transaction was a tenth of a staged-row write).
        want = "FULL" if durable else "NORMAL"
        info = conn.connection.info
        # The pragmas go straight to the driver (as db.Prepared does):
        # through SQLAlchemy each cost several times SQLite's own time, and a
        # step flips both twice.  A driver error is raised wrapped, as
        # SQLAlchemy would, so _translated still sees a full disk.
        dbapi = conn.connection.dbapi_connection

        def run(sql: str) -> None:
            try:
                dbapi.execute(sql).close()
            except sqlite3.Error as exc:
                raise DBAPIError.instance(sql, (), exc, sqlite3.Error, dialect=conn.dialect) from None

        if info.get("stepfs_synchronous") != want:
            info.pop("stepfs_synchronous", None)  # unknown until the pragma ran
            run(f"PRAGMA synchronous={want}")
            info["stepfs_synchronous"] = want
        # Checkpoints (which fsync the WAL and the database file) run at the
        # commit of a durable transaction, where the caller pays for
        # durability anyway, not at every close-write: a non-durable commit
        # checkpoints only once the WAL holds more than WAL_LIMIT_PAGES.
        # A step's intent does not either (checkpoint=False): a mount
        # daemon answers after it, and the completion that follows, after
        # the answer, checkpoints instead.
        pages = CHECKPOINT_PAGES if opts.get("stepfs_checkpoint", durable) else WAL_LIMIT_PAGES
        if info.get("stepfs_autocheckpoint") != pages:
            run(f"PRAGMA wal_autocheckpoint={pages}")
            info["stepfs_autocheckpoint"] = pages
        conn.exec_driver_sql(opts.get("stepfs_begin", "BEGIN"))


class Prepared:
    """A Core statement compiled once per dialect and run straight on the
    DBAPI cursor of a connection inside :meth:`Database.read` /
    :meth:`Database.write`, in that transaction.

    Why: SQLAlchemy's per-execution work (execution context, cache-key
    lookup, result set-up) costs about 50 µs, several times what SQLite
    takes to run the small statements of the object store, and a step
    runs dozens of them.  What it gives up, and so the rules for using it:
    parameters and results get no type processing, so only statements
    whose bound values and columns are ``str``, ``int``, ``bytes`` (or
    buffers) qualify; inserts list their columns and every row gives all
    of them (no column defaults); results are plain tuples.  A DBAPI error
    is raised as SQLAlchemy's wrapped ``DBAPIError``, so
    :meth:`Database._translated` still turns a full disk or an I/O error
    into :class:`StoreFull` / :class:`StoreUnavailable`.  A dialect with a
    named paramstyle (not SQLite's) runs the statement through
    SQLAlchemy as before.

    At most one ``expanding`` bind parameter (an ``IN`` list, passed as a
    list) is rendered with one placeholder per value, cached per length.

    Every instance is listed in :attr:`ALL` (they are module constants), so
    that a mount daemon can compile them all before it serves anything
    (:meth:`warm`): compiling took 0.1-0.6 ms per statement, about 1 ms in
    the first close-write after a mount and 2.5 ms in its first commit.
    """

    #: Every statement made so far (import time: module constants).
    ALL: list["Prepared"] = []

    def __init__(self, stmt, columns: list[str] | None = None):
        self.stmt = stmt
        self.columns = columns
        self._by_dialect: dict[str, tuple | None] = {}
        self._expanded: dict[tuple[str, int], str] = {}
        self._groups: dict[str, str | None] = {}  # sql -> _values_group
        Prepared.ALL.append(self)

    @classmethod
    def warm(cls, db: "Database") -> int:
        """Compile every statement of :attr:`ALL` for ``db``'s dialect now
        (no database access); returns how many were compiled.  Compiling
        is idempotent and the cache is only ever added to, so a statement
        some other thread compiles meanwhile is at worst compiled twice."""
        dialect = db.engine.dialect
        done = 0
        for prepared in list(cls.ALL):
            if dialect.name not in prepared._by_dialect:
                prepared._compiled(dialect)
                done += 1
        return done

    def _compiled(self, dialect) -> tuple | None:
        try:
            return self._by_dialect[dialect.name]
        except KeyError:
            pass
        compiled = self.stmt.compile(dialect=dialect, column_keys=self.columns)
        entry = None
        if compiled.positional and dialect.paramstyle == "qmark":
            names = list(compiled.positiontup)
            # Key columns are bytes in the database, hex in Python (format 7,
            # store/keys.py): the two conversions SQLAlchemy would apply.
            to_db = {n: keys.bind_converter(compiled.binds[n].type) for n in names
                     if keys.bind_converter(compiled.binds[n].type) is not None}
            selected = getattr(self.stmt, "selected_columns", None)
            from_db = [i for i, c in enumerate(selected or ()) if keys.is_key(c.type)]
            entry = (compiled.string, names, to_db, from_db)
        self._by_dialect[dialect.name] = entry
        return entry

    def _values_group(self, sql: str, columns: int) -> str | None:
        """The ``VALUES (?, ...)`` of an INSERT of one row, or None for any
        other statement (run once per row)."""
        try:
            return self._groups[sql]
        except KeyError:
            pass
        group = " VALUES (" + ", ".join("?" * columns) + ")"
        ok = sql.startswith("INSERT INTO ") and sql.count(group) == 1 and sql.count("?") == columns
        self._groups[sql] = group if ok else None
        return self._groups[sql]

    def _multi_sql(self, sql: str, group: str, rows: int) -> str:
        """``sql`` inserting ``rows`` rows (cached per count)."""
        key = ("\0rows", rows)
        text = self._expanded.get(key)
        if text is None:
            row = group[len(" VALUES "):]
            text = self._expanded[key] = sql.replace(group, " VALUES " + ", ".join([row] * rows), 1)
        return text

    @staticmethod
    def _rows(rows: list, from_db: list[int]) -> list:
        if not from_db or not rows:
            return rows
        out = []
        for row in rows:
            row = list(row)
            for i in from_db:
                row[i] = keys.from_db(row[i])
            out.append(tuple(row))
        return out

    def _sql(self, sql: str, names: list[str], params: dict, to_db=()) -> tuple[str, list]:
        values: list = []
        for name in names:
            value = params[name]
            convert = to_db.get(name) if to_db else None
            if convert is not None:
                value = [convert(v) for v in value] if isinstance(value, (list, tuple)) else convert(value)
            if isinstance(value, (list, tuple)):  # an expanding IN list
                key = (name, len(value))
                text = self._expanded.get(key)
                if text is None:
                    text = self._expanded[key] = sql.replace(f"__[POSTCOMPILE_{name}]",
                                                             ", ".join("?" * len(value)) or "NULL")
                sql = text
                values.extend(value)
            else:
                values.append(value)
        return sql, values

    def execute(self, conn: Connection, params: dict | None = None) -> list[tuple]:
        """Run with one set of ``params``; returns every result row."""
        params = params or {}
        entry = self._compiled(conn.dialect)
        if entry is None:
            return [tuple(r) for r in conn.execute(self.stmt, params)]
        sql, values = self._sql(entry[0], entry[1], params, entry[2])
        cur = conn.connection.dbapi_connection.cursor()
        try:
            cur.execute(sql, values)
            return self._rows(cur.fetchall(), entry[3])
        except conn.dialect.loaded_dbapi.Error as exc:
            raise DBAPIError.instance(sql, values, exc, conn.dialect.loaded_dbapi.Error,
                                      dialect=conn.dialect) from None
        finally:
            cur.close()

    def iterate(self, conn: Connection, params: dict | None = None, batch: int = 16) -> Iterator[tuple]:
        """Run with ``params``; yields the result rows as they are fetched
        (``batch`` at a time: an object's chunks are not all held at once).
        The caller iterates inside the same transaction."""
        params = params or {}
        entry = self._compiled(conn.dialect)
        if entry is None:
            yield from (tuple(r) for r in conn.execute(self.stmt, params))
            return
        sql, values = self._sql(entry[0], entry[1], params, entry[2])
        cur = conn.connection.dbapi_connection.cursor()
        try:
            try:
                cur.execute(sql, values)
                while rows := cur.fetchmany(batch):
                    yield from self._rows(rows, entry[3])
            except conn.dialect.loaded_dbapi.Error as exc:
                raise DBAPIError.instance(sql, values, exc, conn.dialect.loaded_dbapi.Error,
                                          dialect=conn.dialect) from None
        finally:
            cur.close()

    def executemany(self, conn: Connection, rows: list[dict]) -> None:
        """Run once per row (no expanding parameters)."""
        if not rows:
            return
        entry = self._compiled(conn.dialect)
        if entry is None:
            conn.execute(self.stmt, rows)
            return
        sql, names, to_db = entry[0], entry[1], entry[2]
        values = [[keys.to_db(row[name]) if name in to_db else row[name] for name in names] for row in rows]
        cur = conn.connection.dbapi_connection.cursor()
        try:
            group = self._values_group(sql, len(names)) if len(values) > 1 else None
            if group is None:
                cur.executemany(sql, values)
            else:
                # Several rows per INSERT (runs of a power of two): the
                # DBAPI releases the GIL once per statement run, and the row
                # timer's thread inserts a batch while the FUSE loop serves
                # requests (every hand-over of the GIL costs the loop).
                start, n = 0, len(values)
                while start < n:
                    k = min(MULTI_ROWS, 1 << ((n - start).bit_length() - 1))
                    cur.execute(self._multi_sql(sql, group, k),
                                [v for row in values[start:start + k] for v in row])
                    start += k
        except conn.dialect.loaded_dbapi.Error as exc:
            raise DBAPIError.instance(sql, values, exc, conn.dialect.loaded_dbapi.Error,
                                      dialect=conn.dialect, ismulti=True) from None
        finally:
            cur.close()


__all__ = ["Database", "OperationalError", "Prepared"]
