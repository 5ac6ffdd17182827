"""The store's format version, alone so that reading it (``stepfs
--version --json``) imports nothing else: ``store.schema`` re-exports it."""

#: Bump on any incompatible change of the store (see store/FORMAT.md's change log).
FORMAT_VERSION = 11
