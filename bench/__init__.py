"""The stepfs benchmark suite (``make bench``; see bench/README.md)."""
