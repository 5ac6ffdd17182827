"""``stepfs --version``: the package version and, with ``--json``, the store
format version and the libfuse version the daemon would load.

Kept to the standard library and ``store/version.py``: the version must
answer without importing SQLAlchemy or mfusepy (loading mfusepy loads
libfuse and more; here the library is only asked its version).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os


def libfuse_path() -> str | None:
    """The library mfusepy loads on Linux, found the way it finds it:
    FUSE_LIBRARY_PATH, FUSE_LIBRARY_NAME, then libfuse, then libfuse3."""
    path = os.environ.get("FUSE_LIBRARY_PATH")
    if path:
        return path
    name = os.environ.get("FUSE_LIBRARY_NAME")
    if name:
        return ctypes.util.find_library(name)
    return ctypes.util.find_library("fuse") or ctypes.util.find_library("fuse3")


def libfuse_version() -> str | None:
    """``3.14.0`` (``fuse_pkgversion``), or ``major.minor`` from
    ``fuse_version()`` on a libfuse without it; None if none is installed."""
    path = libfuse_path()
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if hasattr(lib, "fuse_pkgversion"):
        lib.fuse_pkgversion.restype = ctypes.c_char_p
        return lib.fuse_pkgversion().decode()
    number = lib.fuse_version()  # major * 100 + minor for libfuse 3, major * 10 + minor for 2
    return f"{number // 100}.{number % 100}" if number >= 100 else f"{number // 10}.{number % 10}"


def print_version(as_json: bool) -> int:
    from stepfs import __version__

    if not as_json:
        print(f"stepfs {__version__}")
        return 0
    from stepfs.store.version import FORMAT_VERSION

    lib = libfuse_path()
    print(json.dumps({"message_type": "version", "version": __version__, "store_format": FORMAT_VERSION,
                      "libfuse": libfuse_version(), "libfuse_library": lib}, sort_keys=True))
    return 0
