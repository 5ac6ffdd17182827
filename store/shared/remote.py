"""The shared side of a history: one connection pool, the schema, uploads,
the head's compare-and-swap, reads and verify (SQLAlchemy Core; PostgreSQL
through psycopg 3, or an SQLite file).

Rules (FORMAT.md, "Shared history"):

* Objects and chunks are put idempotently (insert, ignoring a key already
  there), a batch of objects per transaction, *before* the layer that
  names them: a crash or a dropped connection between the two leaves
  unreferenced objects, never a layer naming a missing one (foreign keys).
* A layer is published in ONE transaction that first moves the head by
  compare-and-swap (``UPDATE ... SET head = N+1 WHERE name = ? AND head =
  N``), then inserts the layer and its entries.  Zero rows updated: the
  head moved, nothing is written (:class:`HeadMoved`).  On PostgreSQL each
  of these writes is one statement (``pgwrite``).
* On PostgreSQL a session advisory lock per history (:meth:`Remote.lock`)
  serialises whole steps of workspaces sharing it, so the compare-and-swap
  normally succeeds; it stays the rule that makes a lost lock harmless.
* Any failure to reach the server is :class:`HistoryUnreachable`.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import create_engine, event, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError, ProgrammingError

from stepfs.store.errors import CorruptObject, HeadMoved, HistoryError, HistoryUnreachable, NoSuchLayer
from stepfs.store.shared import logread, pgconnect, pgread, pgwrite, stall, tables as T
from stepfs.store.shared.logread import LayerRecord
from stepfs.store.shared.stall import STALL_TIMEOUT, STATEMENT_TIMEOUT, Watchdog
from stepfs.store.shared.url import CONNECT_TIMEOUT, HistoryURL

__all__ = ["LayerRecord", "Remote", "STALL_TIMEOUT", "STATEMENT_TIMEOUT", "sha256_hex"]

#: The lock's wait gets longer than any other answer (stall.STALL_TIMEOUT).
LOCK_STALL_TIMEOUT = STATEMENT_TIMEOUT + 10
#: At most this many bytes of a step's upload wait to ride in its publish's
#: round trip (``Remote.put_objects``); more is sent ahead of it.
RIDE_BYTES = 1 << 20
#: The advisory lock's key that steps share and gc takes alone.
OBJECTS_LOCK = "stepfs:objects"
ENTRY_COLUMNS = [c.name for c in T.entries.columns if c.name not in ("history", "layer")]


def sha256_hex(data) -> str:
    return hashlib.sha256(data).hexdigest()


class Remote:
    """One history URL's database.  Use :meth:`open`; close when done."""

    def __init__(self, url: HistoryURL, hint: str = stall.PUBLISH_HINT):
        self.url = url
        self.name = url.name
        #: What a lost connection's message tells the user to do: a command
        #: that does not publish a step passes ``stall.RETRY_HINT``.
        self.hint = hint
        if url.dialect == "postgresql":
            # No pre-ping (a round trip per checkout): a dropped connection fails its
            # transaction as HistoryUnreachable, and each command has a pool of its own.
            # use_native_hstore=False: no hstore type lookup (three statements) on the first connect.
            # pgconnect: the dialect asks the server nothing at the first connect.
            engine = pgconnect.engine(url.engine_url(), use_native_hstore=False,
                                      connect_args=stall.session_args(CONNECT_TIMEOUT))
        else:
            engine = create_engine(url.engine_url(), connect_args={"timeout": STATEMENT_TIMEOUT})

            # Every transaction takes SQLite's write lock at BEGIN: a read
            # then a write in one transaction cannot fail on a stale snapshot.
            @event.listens_for(engine, "connect")
            def _connect(dbapi_conn, _record):
                dbapi_conn.isolation_level = None
                dbapi_conn.execute("PRAGMA foreign_keys=ON").close()  # entries name stored objects, as on PostgreSQL

            @event.listens_for(engine, "begin")
            def _begin(conn):
                conn.exec_driver_sql("BEGIN IMMEDIATE")
        self.engine = engine
        self.stall_timeout = STALL_TIMEOUT
        self._watchdog = Watchdog()
        if url.dialect == "postgresql":
            event.listen(engine, "before_cursor_execute", self._arm)
            event.listen(engine, "after_cursor_execute", self._disarm)
            event.listen(engine, "handle_error", self._disarm)
        self._conn: Connection | None = None  # PostgreSQL: the command's one connection (see _pinned)
        # PostgreSQL: small upload batches held back to ride ahead of the
        # next publish in its round trip, each its own transaction (put_objects).
        self._riding: list[tuple[str, dict]] = []
        self._riding_bytes = 0
        # While the history's lock is held no other workspace publishes, so the
        # head and this workspace's published layers read once stay true
        # (this process's own publishes update them): a step reads each once.
        self._locked = False
        self._head: int | None = None
        self._origins: dict[str, dict[int, int]] = {}

    # -- every answer bounded (PostgreSQL) --------------------------------------

    def _arm(self, conn, _cursor, statement, *_rest) -> None:
        bound = LOCK_STALL_TIMEOUT if "pg_advisory_lock(" in statement else self.stall_timeout
        self._watchdog.arm(conn.connection.driver_connection.pgconn.socket, bound)

    def _disarm(self, *_args) -> None:
        self._watchdog.disarm()

    @classmethod
    def open(cls, url: HistoryURL, hint: str = stall.PUBLISH_HINT) -> "Remote":
        remote = cls(url, hint)
        try:
            remote._ensure_schema()
        except BaseException:
            remote.close()
            raise
        return remote

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass  # a broken connection: disposing the engine drops it
            self._conn = None
        self.engine.dispose()
        self._watchdog.stop()

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- transactions ------------------------------------------------------------

    def _pinned(self) -> Connection:
        """PostgreSQL: one connection for the whole command, in autocommit,
        so a read is one round trip (no BEGIN and COMMIT around it), a
        write transaction is an explicit BEGIN ... COMMIT on it, and the
        history's lock is held on it (no second connection to open)."""
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _send_riding(self) -> None:
        """Uploads held back for a publish that another statement comes
        before: sent now (the caller may read them)."""
        if self._riding:
            riding, self._riding, self._riding_bytes = self._riding, [], 0
            self._pipeline(riding, self.stall_timeout)

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """One transaction: committed on success, rolled back on any error;
        a server that cannot be reached is :class:`HistoryUnreachable`."""
        with self._translated():
            if self.url.dialect != "postgresql":
                with self.engine.begin() as conn:
                    yield conn
                return
            self._send_riding()
            conn = self._pinned()
            conn.exec_driver_sql("BEGIN")
            try:
                yield conn
            except BaseException:
                _abandon(conn)
                raise
            conn.exec_driver_sql("COMMIT")

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """Reads that need no transaction of their own: each statement of
        immutable rows (objects, published layers) or of the head alone."""
        if self.url.dialect != "postgresql":
            with self.tx() as conn:
                yield conn
            return
        with self._translated():
            self._send_riding()
            yield self._pinned()

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except (OperationalError, InterfaceError) as exc:
            raise self.unreachable(exc) from None
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise self.unreachable(exc) from None
            raise

    def unreachable(self, exc: BaseException) -> HistoryUnreachable:
        return stall.unreachable(self.url.display, exc, self._watchdog.stalled, self.hint)

    @contextmanager
    def lock(self, workspace: str | None = None) -> Iterator[None]:
        """Hold the history's lock (PostgreSQL: a session advisory lock on
        the command's connection) for a whole step or sync.  SQLite files
        rely on the compare-and-swap alone.  ``workspace``: the id whose
        published layers (:meth:`origins`) are read with the head, in one
        query, once the lock is held.  The lock ends with the connection's
        session (closed here, so the next command waiting for it need not
        wait for an unlock's round trip; a later read connects anew)."""
        if self.url.dialect != "postgresql":
            yield
            return
        lock = pgread.lock_statement("stepfs:" + self.name, OBJECTS_LOCK)
        with self._translated():
            conn = self._pinned()
            # With it, the objects' lock shared (store/shared/gc.py takes it
            # exclusively): no gc runs between an upload and its layer.  The
            # head and own layers are read right after it, in the same round trip.
            if workspace is None:
                self._pipeline([lock], LOCK_STALL_TIMEOUT)
            else:
                _, rows = self._pipeline([lock, pgread.position_statement(self.name, workspace)],
                                         LOCK_STALL_TIMEOUT)
        self._locked = True
        try:
            if workspace is not None:
                head, origins = pgread.position(rows)
                if head is not None:
                    self._head = head
                    self._origins[workspace] = origins
            yield
        finally:
            self._locked, self._head, self._origins = False, None, {}
            conn.invalidate()  # closes the session: the server drops its locks with it
            if self._conn is conn:
                self._conn = None

    @contextmanager
    def objects_held(self, alone: bool = False) -> Iterator[None]:
        """Hold the objects' advisory lock (PostgreSQL) on this command's
        session: ``alone`` for ``gc-history``, else shared, by a command
        that reads a layer's states, then their objects, in separate
        statements (``cat``, ``diff``, a clone written in place), so gc
        cannot sweep an object between the two when a prune drops the
        layer meanwhile.  Never held with :meth:`lock` (which closes the
        session)."""
        if self.url.dialect != "postgresql":
            yield  # an SQLite history has no gc-history
            return
        mode = "" if alone else "_shared"
        with self.read() as conn:
            conn.execute(text(f"SELECT pg_advisory_lock{mode}(hashtext(:o))"), {"o": OBJECTS_LOCK})
        try:
            yield
        finally:
            try:
                with self.read() as conn:
                    conn.execute(text(f"SELECT pg_advisory_unlock{mode}(hashtext(:o))"), {"o": OBJECTS_LOCK})
            except Exception:
                pass  # a broken connection: its session, and the lock with it, ends when it closes

    def _pipeline(self, statements: list[tuple[str, dict | None]], bound: float) -> list[list[tuple] | None]:
        """PostgreSQL: run ``statements`` in one round trip (a pipeline of
        the extended protocol, one Sync at its end: the server runs them in
        order; those outside an explicit BEGIN ... COMMIT are ONE implicit
        transaction, committed when the Sync arrives; an error skips the
        rest up to the Sync).  Returns each one's rows
        (None for a statement that returns none).  The answer is bounded as
        every statement's is (``_arm``)."""
        import psycopg  # PostgreSQL histories only

        conn = self._pinned()
        raw = conn.connection.driver_connection
        self._watchdog.arm(raw.pgconn.socket, bound)
        try:
            cursors = []
            with raw.pipeline():
                for sql, params in statements:
                    cur = raw.cursor()
                    cur.execute(sql, params)
                    cursors.append(cur)
            return [cur.fetchall() if cur.description is not None else None for cur in cursors]
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            conn.invalidate()
            raise self.unreachable(exc) from None
        except psycopg.Error as exc:  # as SQLAlchemy raises it (IntegrityError, ...)
            raise DBAPIError.instance(statements[-1][0], None, exc, psycopg.Error, dialect=self.engine.dialect) from exc
        finally:
            self._watchdog.disarm()

    def _ensure_schema(self) -> None:
        if self.url.dialect == "postgresql":
            try:  # the usual case, one round trip: the schema is there
                with self.read() as conn:
                    facts = pgread.facts(conn)
                return self._check_format(facts)
            except ProgrammingError:
                pass  # no stepfs_meta yet: made below, under a lock
        with self.tx() as conn:
            if self.url.dialect == "postgresql":
                # Two first clients at once: one creates, the other waits and finds it.
                conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('stepfs:schema'))"))
                conn.dialect.default_schema_name = conn.exec_driver_sql("SELECT current_schema()").scalar()
            names = set(conn.dialect.get_table_names(conn))
            if T.meta.name not in names:
                T.metadata.create_all(conn)
                conn.execute(T.meta.insert(), [{"key": "format_version", "value": str(T.CREATED_FORMAT)},
                                               {"key": "hash_algorithm", "value": T.HASH}])
                return
            facts = dict(conn.execute(select(T.meta.c.key, T.meta.c.value)).all())
        self._check_format(facts)

    def _check_format(self, facts: dict) -> None:
        logread.check_format(facts, self.url.display)

    # -- objects -------------------------------------------------------------------

    def _insert_ignore(self, table):
        from sqlalchemy.dialects.sqlite import insert  # PostgreSQL's writes are pgwrite's

        return insert(table).on_conflict_do_nothing()

    def missing_objects(self, hashes: set[str]) -> set[str]:
        if not hashes:
            return set()
        with self.read() as conn:
            have = set(conn.execute(select(T.objects.c.hash).where(T.objects.c.hash.in_(sorted(hashes)))).scalars())
        return set(hashes) - have

    def put_object(self, digest: str, pieces: list[bytes]) -> None:
        """Store an object (its whole content hashes to ``digest``) as
        ``pieces``; idempotent, one transaction."""
        self.put_objects([(digest, pieces)])

    def put_objects(self, batch: list[tuple[str, list[bytes]]], ride: bool = False) -> None:
        """Store several objects in one transaction (idempotent: a key
        already present is left as it is).  ``ride`` (PostgreSQL, a batch
        of a step's upload): a batch held back while those held come to at
        most :data:`RIDE_BYTES` is sent in the next :meth:`publish`'s round
        trip, still its own transaction ahead of the publish's; any other
        use of the connection sends it first."""
        chunk_rows: dict[str, dict] = {}
        object_rows, link_rows = [], []
        for digest, pieces in batch:
            offset = 0
            for seq, piece in enumerate(pieces):
                h = sha256_hex(piece)
                chunk_rows.setdefault(h, {"hash": h, "size": len(piece), "data": bytes(piece)})
                link_rows.append({"object": digest, "seq": seq, "offset": offset, "chunk": h})
                offset += len(piece)
            object_rows.append({"hash": digest, "size": offset})
        if not object_rows:
            return
        if self.url.dialect == "postgresql":
            size = sum(r["size"] for r in chunk_rows.values())
            if ride and self._riding_bytes + size <= RIDE_BYTES:
                self._riding += pgwrite.put_statements(list(chunk_rows.values()), object_rows, link_rows)
                self._riding_bytes += size
                return
            with self.read() as conn:  # one statement: its own transaction
                pgwrite.put_objects(conn, list(chunk_rows.values()), object_rows, link_rows)
            return
        with self.tx() as conn:
            if chunk_rows:
                conn.execute(self._insert_ignore(T.chunks), list(chunk_rows.values()))
            conn.execute(self._insert_ignore(T.objects), object_rows)
            if link_rows:
                conn.execute(self._insert_ignore(T.object_chunks), link_rows)

    def read_objects(self, digests: list[str]) -> dict[str, bytes]:
        """Several objects' bytes in one transaction, each chunk and each
        whole object checked against its hash."""
        with self.read() as conn:
            sizes = dict(conn.execute(select(T.objects.c.hash, T.objects.c.size)
                                      .where(T.objects.c.hash.in_(digests))).all())
            rows = conn.execute(
                select(T.object_chunks.c.object, T.object_chunks.c.seq, T.object_chunks.c.offset, T.chunks.c.hash,
                       T.chunks.c.data)
                .join(T.chunks, T.chunks.c.hash == T.object_chunks.c.chunk, isouter=True)
                .where(T.object_chunks.c.object.in_(digests))
                .order_by(T.object_chunks.c.object, T.object_chunks.c.seq)).all()
        parts: dict[str, list[bytes]] = {d: [] for d in digests}
        for obj, seq, offset, chash, data in rows:
            got = parts[obj]
            if seq != len(got) or offset != sum(map(len, got)) or data is None or sha256_hex(data) != chash:
                raise CorruptObject(f"object {obj} of the shared history {self.url.display} is damaged at chunk {seq}.")
            got.append(bytes(data))
        out = {}
        for d in digests:
            data = b"".join(parts[d])
            if d not in sizes or len(data) != sizes[d] or sha256_hex(data) != d:
                raise CorruptObject(f"object {d} of the shared history {self.url.display} is missing or damaged.")
            out[d] = data
        return out

    def iter_object(self, digest: str) -> Iterator[bytes]:
        """The object's bytes, chunk by chunk, each checked against its hash."""
        with self.read() as conn:
            size = conn.execute(select(T.objects.c.size).where(T.objects.c.hash == digest)).scalar()
            if size is None:
                raise CorruptObject(f"object {digest} is missing from the shared history {self.url.display}.")
            rows = conn.execute(
                select(T.object_chunks.c.seq, T.object_chunks.c.offset, T.chunks.c.hash, T.chunks.c.data)
                .join(T.chunks, T.chunks.c.hash == T.object_chunks.c.chunk, isouter=True)
                .where(T.object_chunks.c.object == digest).order_by(T.object_chunks.c.seq)).all()
        pos = 0
        for i, (seq, offset, chash, data) in enumerate(rows):
            if seq != i or offset != pos or data is None or sha256_hex(data) != chash:
                raise CorruptObject(f"object {digest} of the shared history {self.url.display} is damaged at chunk {i}.")
            pos += len(data)
            yield bytes(data)
        if pos != size:
            raise CorruptObject(f"object {digest} of the shared history {self.url.display} is short.")

    def read_object(self, digest: str) -> bytes:
        return b"".join(self.iter_object(digest))

    # -- layers --------------------------------------------------------------------

    def head(self) -> int | None:
        """The history's head, or None if it does not exist yet."""
        if self._locked and self._head is not None:
            return self._head
        with self.read() as conn:
            head = conn.execute(select(T.histories.c.head).where(T.histories.c.name == self.name)).scalar()
        self._head = head if self._locked else None
        return head

    def create(self, layer: LayerRecord, entries: list[dict]) -> None:
        """Make the history with ``layer`` (number 0) as its first layer."""
        if self.url.dialect == "postgresql":
            with self.tx() as conn:  # see publish
                made = pgwrite.create(conn, self.name, layer.as_dict(), entries, time.time_ns())
        else:
            try:
                with self.tx() as conn:
                    conn.execute(T.histories.insert().values(name=self.name, head=0, created_ns=time.time_ns()))
                    self._insert_layer(conn, layer, entries)
                made = True
            except IntegrityError:
                made = False
        if not made:
            raise HistoryError(f"the shared history {self.url.display} exists already; make a workspace of it with "
                               f"'stepfs clone URL DIR'.")
        self._head = 0 if self._locked else None

    def publish(self, expect_head: int, layer: LayerRecord, entries: list[dict]) -> int:
        """Publish ``layer`` as ``expect_head + 1`` if the head is still
        ``expect_head``; else raise HeadMoved and write nothing."""
        number = expect_head + 1
        layer.number = number
        if self.url.dialect == "postgresql":
            # The uploads held back (each its own transaction), BEGIN and the
            # publish in one round trip, then COMMIT in a round trip of its
            # own once they all succeeded: a connection cut before COMMIT is
            # sent publishes nothing, even if the server runs the statement
            # after the cut.
            riding, self._riding, self._riding_bytes = self._riding, [], 0
            with self._translated():
                conn = self._pinned()
                try:
                    rows = self._pipeline([*riding, ("BEGIN", None),
                                           pgwrite.publish_statement(self.name, expect_head, layer.as_dict(), entries)],
                                          self.stall_timeout)
                except HistoryUnreachable:
                    raise  # the connection is closed: the server rolls the transaction back
                except BaseException:
                    _abandon(conn)
                    raise
                conn.exec_driver_sql("COMMIT")
            if rows[-1][0][0] != 1:
                self._head_moved(expect_head)
        else:
            with self.tx() as conn:
                moved = conn.execute(update(T.histories).where(T.histories.c.name == self.name,
                                                               T.histories.c.head == expect_head).values(head=number))
                if moved.rowcount != 1:
                    self._head_moved(expect_head, conn)
                self._insert_layer(conn, layer, entries)
        if self._locked:
            self._head = number
            if layer.origin is not None and layer.workspace in self._origins:
                self._origins[layer.workspace][layer.origin] = number
        return number

    def _head_moved(self, expect_head: int, conn: Connection | None = None):
        if conn is None:
            with self.read() as c:
                now = c.execute(select(T.histories.c.head).where(T.histories.c.name == self.name)).scalar()
        else:
            now = conn.execute(select(T.histories.c.head).where(T.histories.c.name == self.name)).scalar()
        self._head = None
        raise HeadMoved(f"the shared history {self.url.display} moved from layer {expect_head} to {now}; "
                        f"nothing was published.", now if now is not None else -1)

    def _insert_layer(self, conn: Connection, layer: LayerRecord, entries: list[dict]) -> None:
        row = layer.as_dict()
        row["meta"] = json.dumps(layer.meta or {}, sort_keys=True)
        conn.execute(T.layers.insert().values(history=self.name, **row))
        if entries:
            conn.execute(T.entries.insert(), [{"history": self.name, "layer": layer.number, **e} for e in entries])

    def layers(self, after: int = -1, upto: int | None = None, limit: int | None = None,
               newest_first: bool = False, kept_only: bool = False) -> list[LayerRecord]:
        """Layer headers; ``kept_only``: not those ``stepfs prune`` dropped (``prune.py``)."""
        q = select(T.layers).where(T.layers.c.history == self.name, T.layers.c.number > after)
        if kept_only:
            q = q.where(T.layers.c.kind != "pruned")
        if upto is not None:
            q = q.where(T.layers.c.number <= upto)
        q = q.order_by(T.layers.c.number.desc() if newest_first else T.layers.c.number)
        if limit is not None:
            q = q.limit(limit)
        with self.read() as conn:
            rows = conn.execute(q).all()
        return [LayerRecord(r.number, r.kind, r.created_ns, r.message, r.agent, r.mount, json.loads(r.meta),
                            r.workspace, r.workspace_path, r.host, r.origin) for r in rows]

    def layer(self, number: int) -> LayerRecord:
        found = self.layers(after=number - 1, upto=number)
        if not found:
            raise NoSuchLayer(f"layer {number} does not exist in the shared history {self.url.display}; "
                              f"'stepfs log --history URL' lists its layers.")
        return found[0]

    def entries(self, number: int) -> list[dict]:
        return self.entries_of([number])[number]

    def entries_of(self, numbers: list[int]) -> dict[int, list[dict]]:
        """The entries of each of the layers ``numbers``, by path, in one query."""
        out: dict[int, list[dict]] = {n: [] for n in numbers}
        if not numbers:
            return out
        with self.read() as conn:
            rows = conn.execute(select(T.entries.c.layer, *[T.entries.c[c] for c in ENTRY_COLUMNS])
                                .where(T.entries.c.history == self.name, T.entries.c.layer.in_(numbers))
                                .order_by(T.entries.c.layer, T.entries.c.path)).all()
        for r in rows:
            out[r.layer].append(_entry_dict(r))
        return out

    def log(self, limit: int | None = None) -> list[tuple[LayerRecord, tuple[int, int, int]]]:
        """``stepfs log``: the layers, newest first, with their (added,
        modified, deleted) path counts, in ONE query (``logread``).  Empty
        if the history does not exist (it always has layer 0 otherwise)."""
        with self.read() as conn:
            rows = conn.exec_driver_sql(*logread.statement(self.name, limit, conn.dialect.paramstyle)).all()
        return logread.records(rows)

    def counts(self, numbers: list[int]) -> dict[int, tuple[int, int, int]]:
        """Per layer: (added, modified, deleted) paths."""
        if not numbers:
            return {}
        with self.read() as conn:
            rows = conn.execute(select(T.entries.c.layer, T.entries.c.before_kind, T.entries.c.after_kind)
                                .where(T.entries.c.history == self.name, T.entries.c.layer.in_(numbers))).all()
        out: dict[int, list[int]] = {n: [0, 0, 0] for n in numbers}
        for layer, before, after in rows:
            out[layer][0 if before is None else 2 if after is None else 1] += 1
        return {n: tuple(v) for n, v in out.items()}

    def origins(self, workspace: str) -> dict[int, int]:
        """{local layer number: shared number} of the layers ``workspace`` published."""
        if self._locked and workspace in self._origins:
            return dict(self._origins[workspace])
        with self.read() as conn:
            rows = conn.execute(select(T.layers.c.origin, T.layers.c.number).where(
                T.layers.c.history == self.name, T.layers.c.workspace == workspace,
                T.layers.c.origin.is_not(None))).all()
        found = {int(o): int(n) for o, n in rows}
        if self._locked:
            self._origins[workspace] = dict(found)
        return found

    def path_at(self, path: bytes, number: int) -> dict | None:
        """The entry that defines ``path``'s state as of layer ``number``
        (the newest at or below it; one indexed query), or None."""
        with self.read() as conn:
            r = conn.execute(select(*[T.entries.c[c] for c in ENTRY_COLUMNS])
                             .where(T.entries.c.history == self.name, T.entries.c.path == path,
                                    T.entries.c.layer <= number)
                             .order_by(T.entries.c.layer.desc()).limit(1)).first()
        return None if r is None else _entry_dict(r)

    def state_at(self, number: int) -> dict[bytes, dict]:
        """Every path's entry that defines its state as of layer ``number``
        (the newest entry at or below it), by path."""
        with self.read() as conn:
            rows = conn.execute(select(T.entries.c.layer, *[T.entries.c[c] for c in ENTRY_COLUMNS])
                                .where(T.entries.c.history == self.name, T.entries.c.layer <= number)
                                .order_by(T.entries.c.path, T.entries.c.layer)).all()
        out: dict[bytes, dict] = {}
        for r in rows:
            out[bytes(r.path)] = _entry_dict(r)
        return out


def _abandon(conn: Connection) -> None:
    """End a failed transaction: ROLLBACK, or, when even that cannot be
    sent, close the connection (the server rolls back a closed session's)."""
    try:
        conn.exec_driver_sql("ROLLBACK")
    except Exception:
        conn.invalidate()


def _entry_dict(r) -> dict:
    out = {}
    for c in ENTRY_COLUMNS:
        v = getattr(r, c)
        out[c] = bytes(v) if isinstance(v, (bytes, memoryview)) else v
    return out
