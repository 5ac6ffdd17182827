#!/usr/bin/env bash
# Install stepfs from this checkout into a virtualenv and link the `stepfs`
# command onto PATH. The Docker image runs it (docker/Dockerfile) and the
# tests run it into a temporary prefix (tests/test_docker_setup.py), so the
# image's install is tested without a Docker engine.
#
# usage: docker/setup.sh [--prefix DIR] [--bin-dir DIR]
#   --prefix DIR    the virtualenv to create or update   (default: /opt/stepfs)
#   --bin-dir DIR   where to link the stepfs command     (default: /usr/local/bin)
#   PYTHON=...      the interpreter for the virtualenv   (default: python3, 3.11 or newer)
#
# The package is installed as a copy, not editable: the installed command
# must not depend on the checkout (the image deletes it). The system
# packages (fuse3, ...) come from docker/install-system-deps.sh.
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix=/opt/stepfs
bin_dir=/usr/local/bin
python="${PYTHON:-python3}"

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --bin-dir) bin_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "stepfs setup: unknown argument $1 (see --help)." >&2; exit 2 ;;
  esac
done

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "stepfs setup: $python is missing or older than Python 3.11; set PYTHON=/path/to/python3.11." >&2
  exit 1
fi

# Build from a clean copy of just the package sources: pip would otherwise
# write build/ and *.egg-info into the checkout (and scan .venv, .git).
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
cp "$src/pyproject.toml" "$src/README.md" "$build/"
for pkg in stepfs store overlayfs cli; do
  cp -r "$src/$pkg" "$build/$pkg"
done
find "$build" -name __pycache__ -prune -exec rm -rf {} +

[ -x "$prefix/bin/python" ] || "$python" -m venv "$prefix"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$prefix/bin/python" -m pip install --quiet --no-cache-dir "$build"

mkdir -p "$bin_dir"
ln -sf "$prefix/bin/stepfs" "$bin_dir/stepfs"
"$bin_dir/stepfs" --help >/dev/null

command -v fusermount3 >/dev/null ||
  echo "stepfs setup: fusermount3 is missing; mounting needs the fuse3 package (docker/install-system-deps.sh)." >&2
echo "stepfs installed in $prefix; command: $bin_dir/stepfs"
