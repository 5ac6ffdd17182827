"""store/FORMAT.md documents every table and column of store/schema.py and
has a change-log line for the current format version."""

from __future__ import annotations

import re
from pathlib import Path

from stepfs.store import schema

FORMAT_MD = Path(schema.__file__).with_name("FORMAT.md").read_text()


def documented_columns() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for section in re.split(r"(?m)^### ", FORMAT_MD)[1:]:
        title, _, body = section.partition("\n")
        # the section's column table: the first block headed "| column |"
        table = next((b for b in body.split("\n\n") if b.lstrip().startswith("| column |")), "")
        out[title.strip()] = set(re.findall(r"(?m)^\| `([a-z_]+)` \|", table))
    return out


def test_every_table_and_column_is_documented():
    docs = documented_columns()
    for table in schema.metadata.sorted_tables:
        assert table.name in docs, f"FORMAT.md has no section for table {table.name}"
        assert docs[table.name] == {c.name for c in table.columns}, table.name


def test_change_log_has_the_current_version():
    log = FORMAT_MD.split("## Change log", 1)[1]
    assert re.search(rf"(?m)^\| {schema.FORMAT_VERSION} \|", log)
    assert f"format\n**version {schema.FORMAT_VERSION}**" in FORMAT_MD
