#!/usr/bin/env bash
# The main job, end to end: mount a sample workspace for an "agent", let it
# work through the mount, commit two steps, show the history, unmount.
# Leaves no mount and no daemon behind, even when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
# STEPFS_BIN and STEPFS_DEMO_DIR let the test suite run this very script
# (tests/test_demo.py) with its own interpreter and under a temp directory.
STEPFS="${STEPFS_BIN:-$PWD/.venv/bin/stepfs}"
WORK="${STEPFS_DEMO_DIR:-$PWD/demo-work}"
WS="$WORK/project"
MNT="$WORK/agent"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cleanup() {
  if grep -q " $MNT fuse.stepfs " /proc/mounts 2>/dev/null; then
    "$STEPFS" unmount "$MNT" 2>/dev/null || "$STEPFS" unmount --force "$MNT" || true
  fi
}
trap cleanup EXIT

cleanup
rm -rf "$WORK"
mkdir -p "$WS/src" "$WS/docs" "$MNT"
cat > "$WS/src/app.py" <<'PY'
def greet(name):
    return "hello " + name
PY
printf '# Sample project\n\nA workspace an agent will edit.\n' > "$WS/README.md"
printf 'old notes\n' > "$WS/docs/notes.txt"
printf 'scratch\n' > "$WS/TODO"

say "mount the workspace for the agent"
"$STEPFS" mount "$WS" "$MNT"
grep " $MNT " /proc/mounts

say "step 1: the agent edits, creates, deletes, renames"
cd "$MNT"
sed -i 's/hello /hello, /' src/app.py
printf 'def test_greet():\n    from app import greet\n    assert greet("x") == "hello, x"\n' > src/test_app.py
echo "more notes" >> docs/notes.txt
rm TODO
mv docs documentation
mkdir -p build && sh -c 'for i in 1 2 3; do echo "artifact $i" > build/out$i.txt; done'
# head reads from a here-string, not a pipe: with pipefail, a writer whose
# reader stopped early would fail the demo.
head -20 <<<"$(ls -R "$MNT")"
echo "workspace on disk is untouched until the step is committed:"
ls "$WS"
cd - >/dev/null
"$STEPFS" status "$MNT"
"$STEPFS" step "$MNT" -m "edit app, add test, reorganise docs" --meta tool=demo --meta call=1

say "step 2: the agent runs git inside the mount"
cd "$MNT"
git init -q
git add -A
git -c user.name=agent -c user.email=agent@example.invalid commit -q -m "initial import"
git log --oneline
cd - >/dev/null
"$STEPFS" step "$MNT" -m "git init and first commit" --meta tool=demo --meta call=2

say "history"
"$STEPFS" log "$WS"
say "change card of the last layer"
last=$("$STEPFS" log "$WS" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["layers"][0]["number"])')
head -25 <<<"$("$STEPFS" show "$WS" "$last")"
say "layer 1 as a file: src/app.py"
"$STEPFS" cat "$WS" 1 src/app.py

say "unmount"
"$STEPFS" unmount "$MNT"
echo "the workspace on disk now holds both steps:"
ls -a "$WS"
test -d "$WS/.git" && test -f "$WS/documentation/notes.txt" && test ! -e "$WS/TODO"
# Count the demo's own mounts only (under $WORK): another stepfs mount on
# this machine is none of the demo's business.
own=$(awk -v w="$WORK/" '$3 == "fuse.stepfs" && index($2 "/", w) == 1' /proc/mounts | wc -l)
if [ "$own" -ne 0 ]; then
  echo "demo: $own of the demo's mounts are still mounted" >&2
  exit 1
fi
echo "demo finished: no mount left (0 stepfs mounts of the demo's)"
