"""The unversioned-path rules without a kernel: gitignore syntax
(``overlayfs/core/ignorefile.py``) and the decision per view path
(``overlayfs/core/unversioned.py``)."""

from __future__ import annotations

import pytest

from stepfs.store.ignorefile import BadPattern, Matcher, parse, parse_line, parse_lenient
from stepfs.overlayfs.core.unversioned import DEFAULT_PATTERNS, RELOAD_INTERVAL, Rules


def matches(patterns: list[str], rel: str, is_dir: bool = False) -> bool:
    return Matcher(parse(patterns)).match(rel, is_dir)


@pytest.mark.parametrize("patterns,rel,is_dir,expected", [
    # a name without a slash matches at any depth
    (["foo"], "foo", False, True),
    (["foo"], "a/b/foo", False, True),
    (["foo"], "a/foo/b", False, False),  # the leaf only (ancestors are Rules' business)
    (["foo"], "xfoo", False, False),
    # trailing slash: directories only
    (["build/"], "build", True, True),
    (["build/"], "build", False, False),
    (["build/"], "src/build", True, True),
    # a slash at the start or in the middle anchors at the root
    (["/build"], "build", False, True),
    (["/build"], "src/build", False, False),
    (["doc/frotz"], "doc/frotz", False, True),
    (["doc/frotz"], "a/doc/frotz", False, False),
    (["doc/frotz/"], "doc/frotz", True, True),
    # globs stay within one component
    (["*.pyc"], "a/b/c.pyc", False, True),
    (["*.pyc"], "c.pyc.txt", False, False),
    (["a/*.js"], "a/x.js", False, True),
    (["a/*.js"], "a/b/x.js", False, False),
    (["?.txt"], "a.txt", False, True),
    (["?.txt"], "ab.txt", False, False),
    (["[abc].txt"], "b.txt", False, True),
    (["[abc].txt"], "d.txt", False, False),
    (["[!abc].txt"], "d.txt", False, True),
    (["[!abc].txt"], "a.txt", False, False),
    (["[a-c]x"], "bx", False, True),
    (["a[/]b"], "a/b", False, False),  # a class never matches '/'
    # ** forms
    (["**/foo"], "foo", False, True),
    (["**/foo"], "x/y/foo", False, True),
    (["**/foo/bar"], "x/foo/bar", False, True),
    (["abc/**"], "abc/x/y", False, True),
    (["abc/**"], "abc", True, False),
    (["a/**/b"], "a/b", False, True),
    (["a/**/b"], "a/x/y/b", False, True),
    (["a/**/b"], "ab", False, False),
    # escapes and comments
    (["\\#hash"], "#hash", False, True),
    (["#comment"], "#comment", False, False),
    (["\\!bang"], "!bang", False, True),
    (["trail\\ "], "trail ", False, True),
    (["trail   "], "trail", False, True),
    # last match wins; ! re-includes
    (["*.log", "!keep.log"], "keep.log", False, False),
    (["*.log", "!keep.log"], "other.log", False, True),
    (["!keep.log", "*.log"], "keep.log", False, True),
    # regex metacharacters are literal
    (["a+b(c).txt"], "a+b(c).txt", False, True),
    (["a.b"], "axb", False, False),
])
def test_gitignore_syntax(patterns, rel, is_dir, expected):
    assert matches(patterns, rel, is_dir) is expected


def test_blank_and_comment_lines_are_nothing():
    assert parse(["", "   ", "# c", "/"]) == []
    assert parse_line("!") is None


@pytest.mark.parametrize("bad", ["../x", "a/../b", "/..", "..", "x/.."])
def test_dotdot_patterns_are_refused_with_a_sentence(bad):
    with pytest.raises(BadPattern, match="'..' component"):
        parse([bad])
    pats, problems = parse_lenient(["ok/", bad])
    assert [p.text for p in pats] == ["ok/"] and len(problems) == 1


def test_defaults_cover_the_generated_trees():
    r = Rules()
    for d in ("/node_modules", "/.venv", "/src/__pycache__", "/.pytest_cache", "/.mypy_cache",
              "/.ruff_cache", "/.tox", "/a/b/node_modules"):
        assert r.covers(d, True), d
        assert r.covers(d + "/x/y.js", False), d
    assert not r.covers("/src/app.py", False)
    assert not r.covers("/node_modules", False)  # a file of that name stays versioned
    assert r.describe()["trees"] == ["/.mypy_cache", "/.pytest_cache", "/.ruff_cache", "/.tox", "/.venv",
                                     "/a/b/node_modules", "/node_modules", "/src/__pycache__"]
    assert set(r.describe()["defaults"]) == set(DEFAULT_PATTERNS)


def test_no_default_excludes():
    r = Rules(defaults=False)
    assert not r.covers("/node_modules/x", False)
    r = Rules(["build/"], defaults=False)
    assert r.covers("/build/x.o", False) and not r.covers("/node_modules/x", False)


def test_never_unversioned_whatever_the_patterns():
    r = Rules(["*", ".*", "**", ".stepfs/", ".stepfsignore"], defaults=False)
    assert not r.covers("/", True)
    assert not r.covers("/.stepfs", True)
    assert not r.covers("/.stepfs/layers/1/x", False)
    assert not r.covers("/.stepfsignore", False)
    assert r.covers("/other", False)


def test_a_path_under_an_excluded_directory_cannot_be_reincluded():
    r = Rules(["node_modules/", "!node_modules/keep.js"], defaults=False)
    assert r.covers("/node_modules/keep.js", False)


def test_kind_is_asked_only_when_it_decides():
    asked = []

    def is_dir():
        asked.append(1)
        return True

    r = Rules(["build/", "*.o"], defaults=False)
    assert r.covers("/x.o", is_dir) and not asked      # a file pattern decides
    assert not r.covers("/src", is_dir) and not asked  # nothing matches either way
    assert r.covers("/build", is_dir) and asked         # only the dir pattern matches


class FakeFile:
    """``/.stepfsignore`` as a view would report it: a token and a text."""

    def __init__(self):
        self.token, self.text, self.reads = "absent", None, 0

    def __call__(self, last):
        if last == self.token:
            return self.token, None, False
        self.reads += 1
        return self.token, self.text, True


def test_stepfsignore_is_reread_when_its_token_changes():
    now = [0.0]
    f = FakeFile()
    r = Rules(read_ignore=f, clock=lambda: now[0])
    assert not r.covers("/out/a.o", False)
    f.token, f.text = "t1", "# build output\nout/\n"
    assert not r.covers("/out/a.o", False)  # not looked at again before the interval
    now[0] += RELOAD_INTERVAL
    assert r.covers("/out/a.o", False)
    reads = f.reads
    now[0] += RELOAD_INTERVAL
    assert r.covers("/out/a.o", False) and f.reads == reads  # same token: not read again
    f.token, f.text = "t2", "!node_modules/\n"  # the file comes after the defaults: its ! re-includes
    now[0] += RELOAD_INTERVAL
    assert not r.covers("/out/a.o", False)
    assert not r.covers("/node_modules", True)
    f.token, f.text = "t3", "../escape\nok/\n"
    now[0] += RELOAD_INTERVAL
    assert r.covers("/ok/x", False)
    assert r.describe()["ignored_lines"] and r.describe()["stepfsignore"] == ["ok/"]


def test_excludes_come_last():
    r = Rules(["!node_modules/"], defaults=True)
    assert not r.covers("/node_modules/x", False)
