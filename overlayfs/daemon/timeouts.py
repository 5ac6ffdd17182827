"""How long the kernel may cache what a stepfs mount tells it (the mount
options ``fuse_ops.run`` passes to libfuse)."""

#: How long the kernel trusts a looked-up name and its attributes in a
#: stepfs mount (``fuse_ops.run``) while the mount watches the workspace
#: for outside edits (``daemon/watch.py``).  Long enough to span the pause between an agent's commands;
#: short enough to bound what a lost inotify event could hide.
ENTRY_TIMEOUT = 60.0
ATTR_TIMEOUT = 60.0
#: How long the kernel may trust that a name does not exist, for the
#: names whose appearance the mount can announce (``StepFS._negative``:
#: set per reply; 0 for the others and once the mount cannot watch).
NEGATIVE_TIMEOUT = 60.0
#: The timeouts of a mount that cannot watch (inotify unavailable, out of
#: watches, events lost): outside edits show after at most this long.
SHORT_TIMEOUT = 1.0

