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
joined=
if [ -z "$(ls -A /workspace)" ]; then
  # The first agent finds no history to clone and the sync below makes it:
  # clone's "does not exist" is shown only if that sync fails too.
  { clone_err=$(stepfs clone "$STEPFS_HISTORY" /workspace 2>&1 1>&3); } 3>&1 && joined=1
fi
if [ -z "$joined" ]; then
  { sync_err=$(stepfs sync /workspace 2>&1 1>&3); } 3>&1
  status=$?
  if [ $status -ne 0 ] && [ -n "${clone_err:-}" ] && [ "$clone_err" != "$sync_err" ]; then
    echo "$clone_err" >&2
  fi
  [ -z "$sync_err" ] || echo "$sync_err" >&2
  [ $status -eq 0 ] || exit $status
fi
stepfs run /workspace --mountpoint /mnt/agent -- "$@"
status=$?
stepfs sync /workspace
exit $status
