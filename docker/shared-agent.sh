#!/usr/bin/env bash
# One agent container of a shared history (docker/compose.yaml, profile
# "shared"): join the history named by STEPFS_HISTORY (clone it into the
# empty /workspace volume; or, if it does not exist yet, make it from
# /workspace; or, after a restart, take what others published), then run
# the agent in a mount of /workspace. Each `stepfs step /mnt/agent` the
# agent runs publishes to the shared history; the commit at the end of the
# run is published by the final sync.
set -uo pipefail
: "${STEPFS_HISTORY:?set STEPFS_HISTORY to postgresql://USER:PASSWORD@HOST/DATABASE?name=NAME}"
if [ -z "$(ls -A /workspace)" ] && stepfs clone "$STEPFS_HISTORY" /workspace; then
  :
else
  stepfs sync /workspace || exit $?
fi
stepfs run /workspace --mountpoint /mnt/agent -- "$@"
status=$?
stepfs sync /workspace
exit $status
