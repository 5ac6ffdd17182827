#!/usr/bin/env bash
# A parallel FUSE workload for running the mount tier under load (issue 18
# item 6): fio random read/write with an fsync after every write, through a
# fuse-overlayfs mount, in a loop until killed.  Usage:
#   scripts/fuse_load.sh DIR &   # DIR: an empty temp dir it may fill
# Stop it with `kill -- -PGID` (it runs fio in its own process group) or by
# killing the script; its trap unmounts the overlay.
set -euo pipefail
top=${1:?usage: fuse_load.sh DIR}
mkdir -p "$top"/{lower,upper,work,merged}
cleanup() { fusermount3 -u "$top/merged" 2>/dev/null || true; }
trap cleanup EXIT
fuse-overlayfs -o "lowerdir=$top/lower,upperdir=$top/upper,workdir=$top/work" "$top/merged"
while true; do
  fio --name=load --directory="$top/merged" --rw=randrw --bs=4k --size=32m --numjobs=2 \
      --fsync=1 --time_based --runtime=30 --group_reporting --output=/dev/null
  rm -f "$top/merged"/load.*
done
