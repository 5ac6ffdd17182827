"""stepfs: an agent's writes staged copy-on-write and committed to the
workspace as numbered, undoable layers.

The distribution installs one import package, ``stepfs``: the repository's
folders ``store/``, ``overlayfs/`` and ``cli/`` are ``stepfs.store``,
``stepfs.overlayfs`` and ``stepfs.cli`` (``package-dir`` in
pyproject.toml).  The Python API for agent harnesses is :mod:`stepfs.api`.
"""


def __getattr__(name: str) -> str:
    # ``__version__`` is looked up on first use: importlib.metadata costs
    # more than the rest of a ``stepfs step`` start-up, which never asks.
    if name != "__version__":
        raise AttributeError(f"module 'stepfs' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        value = version("stepfs")
    except PackageNotFoundError:  # imported from a checkout that was never installed
        value = "0+unknown"
    globals()["__version__"] = value
    return value
