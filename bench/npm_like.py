"""Create an npm-like ``node_modules`` tree: many tiny files in nested directories.

``python bench/npm_like.py DEST [--files N]`` writes N files (default
20,000, rounded down to a multiple of 20) as N/20 packages of 20 files each
(``package.json``, ``README.md``, ``LICENSE``, ``index.js``, ``lib/*.js``,
``lib/util/*.js``, ``test/*.js``), every fifth package under a ``@scope/``,
the way a package manager extracts them: mkdir, then create-write-close
each file.  Content is deterministic and tiny (tens to hundreds of bytes).
"""

from __future__ import annotations

import argparse
import os
import sys

FILES_PER_PACKAGE = 20
LIB = [f"lib/{c}.js" for c in "abcdefghij"]
UTIL = [f"lib/util/{c}.js" for c in "abcd"]
TESTS = ["test/index.test.js", "test/helpers.js"]


def package_files(name: str, seq: int) -> dict[str, bytes]:
    files = {
        "package.json": (
            f'{{\n  "name": "{name}",\n  "version": "1.{seq % 10}.{seq % 7}",\n'
            f'  "main": "index.js",\n  "license": "MIT"\n}}\n'
        ).encode(),
        "README.md": f"# {name}\n\nA package of the benchmark, number {seq}.\n".encode(),
        "LICENSE": b"MIT License\n\nPermission is hereby granted, free of charge.\n",
        "index.js": f"module.exports = require('./lib/a.js'); // {seq}\n".encode(),
    }
    for i, rel in enumerate(LIB + UTIL + TESTS):
        files[rel] = f"'use strict';\nmodule.exports = function f{i}(x) {{ return x + {seq * 31 + i}; }};\n".encode()
    assert len(files) == FILES_PER_PACKAGE
    return files


def create(dest: str, files: int) -> int:
    written = 0
    for seq in range(files // FILES_PER_PACKAGE):
        name = f"@scope{seq % 7}/pkg-{seq}" if seq % 5 == 0 else f"pkg-{seq}"
        base = os.path.join(dest, name)
        for rel, data in package_files(name, seq).items():
            path = os.path.join(base, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="npm_like")
    parser.add_argument("dest")
    parser.add_argument("--files", type=int, default=20_000)
    args = parser.parse_args(argv)
    create(args.dest, args.files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
