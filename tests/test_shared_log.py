"""``stepfs log --history URL`` (cli/shared.py, ``Remote.log``) on a real
server (tests/pgserver.py): the layers and their per-layer counts come
from ONE query whatever the history's length, so a 10,000-layer history
costs one round trip, not one per layer or a second pass over the entries."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from stepfs.cli import main as cli_main
from stepfs.cli.exitcodes import code_for
from stepfs.store.errors import HistoryError
from stepfs.store.shared.remote import LayerRecord, Remote
from stepfs.store.shared.url import parse
from test_shared_history import _entry, _record
from test_shared_pgwrite import _Trips


def _log(url: str, *extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main.main(["log", "--history", url, "--json", *extra]) == 0
    return json.loads(out.getvalue())


def _changes(n: int) -> list[dict]:
    """Layer ``n``: one path added, one modified, one deleted (symlinks: no object to upload)."""
    link = {"after_kind": "symlink", "after_mode": 0o777, "after_target": b"t", "after_mtime_ns": None}
    was = {"before_kind": "symlink", "before_mode": 0o777, "before_target": b"t"}
    gone = {"after_kind": None, "after_mode": None, "after_target": None, "after_mtime_ns": None}
    return [_entry(f"add{n}".encode()) | link, _entry(f"mod{n}".encode()) | link | was,
            _entry(f"del{n}".encode()) | was | gone]


def _history(url: str, layers: int) -> None:
    with Remote.open(parse(url)) as r:
        r.create(_record(0, "baseline"), [_entry(b"base") | {"after_kind": "symlink", "after_target": b"t"}])
        for n in range(layers):
            r.publish(n, _record(), _changes(n + 1))


@pytest.mark.parametrize("layers", [3, 40])
def test_log_is_one_query_whatever_the_history_s_length(pg_url, monkeypatch, layers):
    _history(pg_url, layers)
    trips = _Trips(monkeypatch)
    full = _log(pg_url)
    # the schema check, then the layers with their counts
    assert (len(trips.statements), trips.round_trips) == (2, 2), trips.statements
    assert [r["number"] for r in full["layers"]] == list(range(layers, -1, -1))
    assert [(r["added"], r["modified"], r["deleted"]) for r in full["layers"]] == [(1, 1, 1)] * layers + [(1, 0, 0)]
    assert full["layers"][0]["host"] == "host" and full["layers"][0]["workspace_path"] == "/ws"
    trips.clear()
    page = _log(pg_url, "--limit", "2")
    assert (len(trips.statements), trips.round_trips) == (2, 2), trips.statements
    assert [r["number"] for r in page["layers"]] == [layers, layers - 1]
    assert page["layers"] == full["layers"][:2]


def test_log_of_a_missing_history_is_refused_with_or_without_a_limit(pg_url, capsys):
    for extra in ((), ("--limit", "0"), ("--limit", "5")):
        assert cli_main.main(["log", "--history", pg_url, *extra]) == code_for(HistoryError("x")) == 20
        assert "does not exist" in capsys.readouterr().err
    _history(pg_url, 1)
    assert _log(pg_url, "--limit", "0")["layers"] == []


def test_log_counts_on_both_backends(history_url):
    _history(history_url, 2)
    with Remote.open(parse(history_url)) as r:
        got = [(layer.number, counts) for layer, counts in r.log()]
        assert got == [(2, (1, 1, 1)), (1, (1, 1, 1)), (0, (1, 0, 0))]
        assert [layer.number for layer, _ in r.log(limit=1)] == [2]
        assert isinstance(r.log()[0][0], LayerRecord)


def test_the_log_s_own_sql_names_the_schema_s_columns():
    from stepfs.store.shared import logread, tables as T

    assert list(logread.LAYER_COLUMNS) == [c.name for c in T.layers.columns]
    assert {"stepfs_meta", "stepfs_layers", "stepfs_entries"} <= set(T.metadata.tables)


@pytest.mark.parametrize("text", [
    "postgresql://me:p%40ss@db.example:5433/stepfs?name=proj",
    "postgresql://me@/db?host=/run/postgresql&name=p&connect_timeout=3",
    "postgresql+psycopg://u:x@[::1]:5/d%20b?name=n&x=1&x=2",
    "postgresql://u@h/d?name=a&name=b",
    "sqlite:////tmp/x.db?name=a",
])
def test_urls_are_parsed_as_sqlalchemy_parses_them(text):
    """url.py reads URLs without SQLAlchemy (for a lean log); what it shows
    and what psycopg is given agree with SQLAlchemy's reading."""
    from sqlalchemy.engine import make_url

    from stepfs.store.shared.remote import Remote

    url = parse(text)
    assert url.display == make_url(text).render_as_string(hide_password=True)
    if url.dialect == "postgresql":
        engine = Remote(url).engine
        try:
            _, theirs = engine.dialect.create_connect_args(url.engine_url())
        finally:
            engine.dispose()
        theirs = {k: v[-1] if isinstance(v, tuple) else v for k, v in theirs.items() if k not in ("context",)}
        assert url.connect_kwargs() == theirs


def test_log_through_psycopg_alone_is_bounded_by_the_stall_bound(pg_server, pg_url, monkeypatch):
    """A server that stops answering after the connect: the log's query is
    cut by the client's stall bound, exit 19, as Remote's statements are."""
    import time
    from contextlib import ExitStack

    import psycopg

    from stepfs.store.errors import HistoryUnreachable
    from stepfs.store.shared import logread, stall
    from test_shared_timeouts import SLACK, stopped

    _history(pg_url, 1)
    monkeypatch.setattr(stall, "STALL_TIMEOUT", 2)
    real = psycopg.connect
    with ExitStack() as stack:
        def connect_then_stop(*args, **kwargs):
            conn = real(*args, **kwargs)
            stack.enter_context(stopped(pg_server))
            return conn

        monkeypatch.setattr(psycopg, "connect", connect_then_stop)
        t = time.monotonic()
        with pytest.raises(HistoryUnreachable, match="did not answer for 2 s"):
            logread.read(parse(pg_url))
        assert time.monotonic() - t < 2 + SLACK
    monkeypatch.setattr(psycopg, "connect", real)
    assert [layer.number for layer, _ in logread.read(parse(pg_url))] == [1, 0]
