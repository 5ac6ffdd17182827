"""How a chunk row holds its bytes (format 6): as they are, zstd-compressed,
or as a zstd delta against another chunk.

A chunk's key is always the hash of its *decoded* bytes, and ``size`` their
length, so the encoding is invisible to everything above
:class:`store.objects.ObjectStore` and may change under a key (gc's delta
pass rewrites ``data``, ``codec`` and ``base`` of a row, never its bytes).

* ``RAW`` (0): ``data`` is the bytes.
* ``ZSTD`` (1): ``data`` is one zstd frame of them.
* ``DELTA`` (2): ``data`` is one zstd frame compressed with the decoded
  bytes of chunk ``base`` as a raw-content dictionary (what ``zstd
  --patch-from`` does).  A base is never itself a delta (chains are one
  link long), so reading any chunk costs at most two decompressions.

An encoding is kept only where it pays (:data:`MIN_SAVING`): random or
already compressed bytes stay raw, and cost one failed compression at put.
"""

from __future__ import annotations

import threading

import zstandard

RAW, ZSTD, DELTA = 0, 1, 2
#: zstd level of chunks compressed at put (on the close-write path): level 1
#: keeps most of the ratio of text at several times level 3's speed.
PUT_LEVEL = 1
#: Level of deltas (made by gc).  Measured on a one-line edit of a 52 KB
#: chunk: level 3 stored 175 bytes, level 9 7,897 (its match finder skipped
#: most of the dictionary), level 19 37 bytes at many times the time.
DELTA_LEVEL = 3
#: Level of the deltas a commit makes (it holds the commit lock meanwhile):
#: measured on a one-line edit, level 1 took 0.06 ms for a 20 KB file (29
#: bytes) and 0.4 ms for 100 KB (147 bytes), level 3 0.39 ms and 1.4 ms
#: (30 and 42 bytes).
COMMIT_DELTA_LEVEL = 1
#: An encoding is kept only if it saves at least this fraction of the bytes.
MIN_SAVING = 0.1
#: Chunks smaller than this stay raw (a zstd frame's overhead eats the gain).
MIN_SIZE = 256
#: Deltas against a base up to this size are decoded as a content-dictionary
#: chain (measured: 16 us against 70 for a 70-byte base; compressing the base
#: again makes it dearer than a new dictionary for a 100 KB one).
SMALL_BASE = 4096

_local = threading.local()


def compressor(level: int = PUT_LEVEL) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor at ``level`` (a context is not
    thread-safe, and making one per call costs more than small inputs)."""
    per_level = getattr(_local, "c", None)
    if per_level is None:
        per_level = _local.c = {}
    c = per_level.get(level)
    if c is None:
        c = per_level[level] = zstandard.ZstdCompressor(level=level)
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def pays(encoded_len: int, raw_len: int) -> bool:
    return encoded_len <= raw_len * (1 - MIN_SAVING)


def compress(raw) -> tuple[int, bytes | memoryview]:
    """``(codec, data)`` for new chunk bytes ``raw``: zstd where it pays."""
    if len(raw) < MIN_SIZE:
        return RAW, raw
    packed = compressor().compress(raw)
    if pays(len(packed), len(raw)):
        return ZSTD, packed
    return RAW, raw


def compress_many(raws: list) -> list[tuple[int, bytes | memoryview]]:
    """:func:`compress` of each of ``raws``, those zstd is tried on in one
    call (one release of the GIL for them all instead of one per piece:
    the row timer's thread compresses a batch while the FUSE loop serves
    requests, and every hand-over of the GIL costs the loop).  The frames
    are the ones :func:`compress` makes (the same compressor parameters)."""
    out: list[tuple[int, bytes | memoryview]] = [(RAW, raw) for raw in raws]
    todo = [i for i, raw in enumerate(raws) if len(raw) >= MIN_SIZE]
    c = compressor()
    multi = getattr(c, "multi_compress_to_buffer", None)  # the C backend's
    if len(todo) < 2 or multi is None:
        for i in todo:
            out[i] = compress(raws[i])
        return out
    frames = multi([raws[i] for i in todo], threads=0)
    for j, i in enumerate(todo):
        packed = frames[j].tobytes()
        if pays(len(packed), len(raws[i])):
            out[i] = (ZSTD, packed)
    return out


def stored_frame(raw: bytes) -> bytes:
    """``raw`` (at most 65,791 bytes) as a zstd frame of one uncompressed
    block with its content size: what a content-dictionary chain needs as
    its first frame, without compressing the base again (RFC 8878: magic,
    a single-segment frame header, a raw last block)."""
    n = len(raw)
    head = bytes((0x20, n)) if n < 256 else bytes((0x60,)) + (n - 256).to_bytes(2, "little")
    return b"\x28\xb5\x2f\xfd" + head + (1 | n << 3).to_bytes(3, "little") + bytes(raw)


MAGIC = b"\x28\xb5\x2f\xfd"


def frame_head(n: int) -> bytes | None:
    """The first bytes of a single-segment zstd frame of ``n`` bytes with
    its content size, no dictionary id and no checksum (magic, frame header
    descriptor, content size), or None above 65,791 bytes."""
    if n < 256:
        return MAGIC + bytes((0x20, n))
    if n <= 65791:
        return MAGIC + bytes((0x60,)) + (n - 256).to_bytes(2, "little")
    return None


def delta(raw: bytes, base_raw: bytes, level: int = DELTA_LEVEL) -> bytes:
    """``raw`` compressed with ``base_raw`` as dictionary.  Format 9: a
    frame that starts with :func:`frame_head` of its size is stored without
    those 6-7 bytes (most deltas are 15-30 bytes: the head was a quarter of
    them); :func:`decode` puts them back.  Stored data never starts with the
    magic then (a block header of those bytes would be larger than a block
    may be), so the two forms cannot be confused."""
    d = zstandard.ZstdCompressionDict(base_raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    frame = zstandard.ZstdCompressor(level=level, dict_data=d).compress(raw)
    head = frame_head(len(raw))
    if head is not None and frame.startswith(head):
        return frame[len(head):]
    return frame


def _framed(data: bytes, size: int) -> bytes:
    """A delta's stored bytes as a whole frame (:func:`delta`)."""
    if data.startswith(MAGIC):
        return data
    head = frame_head(size)
    if head is None:
        raise ValueError("a delta without its frame header for a size that needs one")
    return head + data


def decode(codec: int, data, size: int, base_raw: bytes | None = None) -> bytes:
    """The chunk's bytes.  Raises ``ValueError`` for an unknown codec or
    damaged data (the caller reports it as a corrupt chunk)."""
    if codec == RAW:
        return bytes(data)
    try:
        if codec == ZSTD:
            # A damaged header may declare terabytes, which zstd would
            # allocate before finding the damage (max_output_size is then ignored);
            # ``size`` is an upper bound to some callers, the length check is the reader's.
            declared = zstandard.frame_content_size(bytes(data))
            if declared > size:
                raise ValueError(f"a frame of {declared} bytes, {size} recorded")
            return decompressor().decompress(bytes(data), max_output_size=size)
        if codec == DELTA:
            if base_raw is None:
                raise ValueError("a delta chunk without its base")
            data = _framed(bytes(data), size)
            if 0 < len(base_raw) <= SMALL_BASE:
                # A small base (an inline object's): a new decompressor with a
                # dictionary costs 30-70 us, several times the decompression;
                # a content-dictionary chain on the thread's own decompressor
                # decodes the same frame with the base as its dictionary.
                frame = stored_frame(base_raw)
                out = decompressor().decompress_content_dict_chain([frame, bytes(data)])
                if len(out) != size:
                    raise ValueError(f"{len(out)} bytes decoded, {size} recorded")
                return out
            d = zstandard.ZstdCompressionDict(base_raw, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
            return zstandard.ZstdDecompressor(dict_data=d).decompress(bytes(data), max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd: {exc}") from None
    raise ValueError(f"unknown chunk codec {codec}")
