#!/usr/bin/env bash
# Install what `make bench` needs on top of `make deps` (Debian/Ubuntu, as root):
# fuse-overlayfs (a reference of the benchmark) and py-spy (the daemon
# profiler, from PyPI into the project's virtualenv). Idempotent and quiet
# when all is present, so nothing installed by hand has to survive to the
# next machine.
#   bench/install-deps.sh [VENV_PYTHON]     (default: .venv/bin/python)
set -euo pipefail

PACKAGES=(fuse-overlayfs)
VENV_PYTHON="${1:-.venv/bin/python}"

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "bench: missing system packages: ${missing[*]}; run 'sudo $0' or install them with apt." >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A fresh machine may have no package lists yet: on failure update once and retry.
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
  echo "installed: ${missing[*]}"
fi

if ! "$VENV_PYTHON" -c 'import shutil, sys, os; sys.exit(0 if os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")) else 1)'; then
  "$VENV_PYTHON" -m pip install -q 'py-spy>=0.3.14'
  echo "installed: py-spy"
fi
