#!/usr/bin/env bash
# Install the system packages stepfs needs (Debian/Ubuntu, as root):
# libfuse3 + fusermount3 (fuse3), and the programs the tests drive (git,
# sqlite3, rsync, gcc/make; fuse-overlayfs and fio, the conformance tests'
# reference target and external exerciser; chromium, the browser the
# `stepfs serve` tests drive through Playwright; postgresql, the server the
# shared-history tests start in a temp dir; e2fsprogs and mount, for the
# loop-mounted ext4 with whole-second timestamps of tests/test_tokens_ctime.py).
# Used by `make deps`, by the Docker image and by
# CI, so there is exactly one list. Idempotent and quiet when all is present.
#   docker/install-system-deps.sh            the packages stepfs and its tests need
#   docker/install-system-deps.sh PKG...     exactly these instead (bench/install-deps.sh)
set -euo pipefail

PACKAGES=(fuse3 libfuse3-3 git sqlite3 rsync make gcc python3-venv fuse-overlayfs fio chromium postgresql e2fsprogs mount)
if [ $# -gt 0 ]; then
  PACKAGES=("$@")
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "stepfs: missing system packages: ${missing[*]}; run 'sudo $0' or install them with apt." >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet: install, and on failure
# update the lists once and try again.
if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "installed: ${missing[*]}"
