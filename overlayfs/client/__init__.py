"""The client side of stepfs: what runs in the caller's process (mounting,
stepping, rollback from another process, confining a command to a mount)."""
