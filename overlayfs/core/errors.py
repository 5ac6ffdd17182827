"""Errors of the overlay view (FUSE-free side).

The view raises these, or lets ``OSError`` from the workspace's own
filesystem pass through with its errno.  The FUSE adapter turns each class
into an errno in one table (``fuse_ops.ERRNO``); nothing in the view picks
errno values for its own decisions.
"""

from __future__ import annotations


class ViewError(Exception):
    """Base class of the view's refusals."""


class NotFound(ViewError):
    pass


class Exists(ViewError):
    pass


class NotEmpty(ViewError):
    pass


class NotADirectory(ViewError):
    pass


class IsADirectory(ViewError):
    pass


class ReadOnly(ViewError):
    """A write into the read-only ``.stepfs`` tree, or a mount gone read-only."""


class Invalid(ViewError):
    """An operation that makes no sense here (a directory into itself, …)."""


class Unsupported(ViewError):
    """An operation or flag this filesystem does not implement."""


class BadHandle(ViewError):
    pass


class Reserved(ViewError):
    """A name reserved for stepfs (``.stepfs`` at the mount root)."""


class NameTooLong(Invalid):
    """A name component longer than 255 bytes."""


class Stale(ViewError):
    """The path changed since this agent observed it or opened it (ESTALE)."""


class NotObserved(ViewError):
    """``--require-read``: writing an existing file this agent never read."""


class NoAttribute(ViewError):
    """getxattr/removexattr of an attribute the path does not have."""


class NotSupported(ViewError):
    """An extended attribute outside the ``user.`` namespace."""
