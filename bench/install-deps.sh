#!/usr/bin/env bash
# Install what `make bench` needs on top of `make deps` (Debian/Ubuntu, as root):
# fuse-overlayfs (a reference of the benchmark) and py-spy (the daemon
# profiler, from PyPI into the project's virtualenv). Idempotent and quiet
# when all is present, so nothing installed by hand has to survive to the
# next machine.
#   bench/install-deps.sh [VENV_PYTHON]     (default: .venv/bin/python)
set -euo pipefail

VENV_PYTHON="${1:-.venv/bin/python}"

# The one apt routine (package lists updated on demand), with our package.
bash "$(dirname "$0")/../docker/install-system-deps.sh" fuse-overlayfs

if ! "$VENV_PYTHON" -c 'import shutil, sys, os; sys.exit(0 if os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")) else 1)'; then
  "$VENV_PYTHON" -m pip install -q 'py-spy>=0.3.14'
  echo "installed: py-spy"
fi
