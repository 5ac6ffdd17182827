"""stepfs: an agent's writes staged copy-on-write and committed to the
workspace as numbered, undoable layers.

The distribution installs one import package, ``stepfs``: the repository's
folders ``store/``, ``overlayfs/`` and ``cli/`` are ``stepfs.store``,
``stepfs.overlayfs`` and ``stepfs.cli`` (``package-dir`` in
pyproject.toml).  The Python API for agent harnesses is :mod:`stepfs.api`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stepfs")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
