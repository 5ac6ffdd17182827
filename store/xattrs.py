"""Extended attributes in the ``user.`` namespace, as stored values.

Only ``user.*`` attributes are staged and committed: ``security.*`` and
``trusted.*`` belong to the host, and ``system.*`` (ACLs) would need their
own semantics.  A set of attributes is stored as one ``bytes`` value (sorted
``name, value`` pairs, length-prefixed) or ``None`` when there are none, so
two equal sets always encode equally.
"""

from __future__ import annotations

import errno
import os

PREFIX = b"user."


def encode(attrs: dict[bytes, bytes]) -> bytes | None:
    if not attrs:
        return None
    out = bytearray()
    for name in sorted(attrs):
        value = attrs[name]
        out += len(name).to_bytes(2, "big") + name + len(value).to_bytes(4, "big") + value
    return bytes(out)


def decode(data: bytes | None) -> dict[bytes, bytes]:
    attrs: dict[bytes, bytes] = {}
    pos = 0
    while data and pos < len(data):
        n = int.from_bytes(data[pos:pos + 2], "big")
        name = data[pos + 2:pos + 2 + n]
        pos += 2 + n
        m = int.from_bytes(data[pos:pos + 4], "big")
        attrs[name] = data[pos + 4:pos + 4 + m]
        pos += 4 + m
    return attrs


def read_fd(fd: int) -> dict[bytes, bytes]:
    """The ``user.*`` attributes of an open file or directory."""
    try:
        names = os.listxattr(fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EBADF):
            return {}
        raise
    out = {}
    for name in names:
        raw = os.fsencode(name)
        if raw.startswith(PREFIX):
            try:
                out[raw] = os.getxattr(fd, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:  # removed meanwhile
                    raise
    return out


def apply_fd(fd: int, attrs: dict[bytes, bytes]) -> None:
    """Make the ``user.*`` attributes of ``fd`` exactly ``attrs``."""
    current = read_fd(fd)
    for name in current:
        if name not in attrs:
            os.removexattr(fd, name)
    for name, value in attrs.items():
        if current.get(name) != value:
            os.setxattr(fd, name, value)
