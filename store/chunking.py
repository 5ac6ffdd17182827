"""Where an object's bytes are cut into chunks.

New objects are cut by content (FastCDC 2020, gear hash with normalised
chunking, as in pyfastcdc): a cut point depends only on the bytes since the
previous cut, so inserting a few bytes into a file changes the one or two
chunks around the insertion and every later chunk is cut exactly as before,
and deduplicates.  Fixed-size cuts (the only kind version-1 writers made,
and what tests use to force many tiny chunks) shift every later chunk on an
insertion.

A chunker sees the content one *window* at a time (a bounded buffer, so a
512 MiB file is not read into memory whole).  Every chunk of a window but
the last is final; the last one is cut again at the start of the next
window, unless the window reached the end of the content.  Because a cut
point depends only on the bytes from the chunk's start, and a window is
larger than the biggest chunk, windowed cuts equal the cuts of the whole
content at once (tests pin this), so the boundaries of given bytes are the
same whatever the reader's window.

Readers never depend on how an object was cut: ``object_chunks`` records
each chunk's offset, and the object id is the hash of the whole content.
"""

from __future__ import annotations

import functools
import logging
import warnings

log = logging.getLogger("stepfs.store")

#: FastCDC parameters of new objects: cuts are never closer than MIN_SIZE
#: bytes nor further apart than MAX_SIZE; AVG_SIZE is pyfastcdc's target,
#: whose mean chunk is about AVG_SIZE + MIN_SIZE (80 KiB).  Measured on a
#: 10 MB text file: a one-line insertion stores ~0.15 MB new; smaller
#: chunks save little more there but add rows (and per-row cost) to every
#: big write.
MIN_SIZE = 16 * 1024
AVG_SIZE = 64 * 1024
MAX_SIZE = 256 * 1024
#: Bytes read and cut at once: bounds memory per put; must exceed MAX_SIZE.
WINDOW = 8 << 20


@functools.cache
def _load_fastcdc():
    """pyfastcdc's compiled chunker, or its pure-Python twin (same cuts,
    about a thousand times slower: logged once) where no wheel exists.
    Loaded on first use: importing it costs ~10 ms of CLI start-up."""
    with warnings.catch_warnings():
        # pyfastcdc warns on its own when its extension is missing; we log instead.
        warnings.simplefilter("ignore")
        try:
            from pyfastcdc.cy import FastCDC as fast

            return fast
        except ImportError:
            from pyfastcdc.py import FastCDC as slow

    log.warning("pyfastcdc's compiled chunker is not available on this machine; using its pure-Python "
                "version (same chunks, much slower writes of big files)")
    return slow


class ContentChunker:
    """FastCDC cuts (see the module doc).  ``cut`` returns chunk lengths."""

    def __init__(self, min_size: int = MIN_SIZE, avg_size: int = AVG_SIZE, max_size: int = MAX_SIZE,
                 window: int = WINDOW):
        if window <= max_size:
            raise ValueError(f"a chunking window ({window}) must exceed the largest chunk ({max_size})")
        self._params = (avg_size, min_size, max_size)
        self._cdc = None
        self.max_size = max_size
        self.window = window
        # A cut is never closer than min_size to the start: content of at
        # most that many bytes is one chunk, without asking FastCDC.
        self.whole_max = min_size

    def cut(self, buf) -> list[int]:
        """Lengths of the chunks of ``buf`` (bytes-like), in order; they sum to ``len(buf)``."""
        if self._cdc is None:
            avg_size, min_size, max_size = self._params
            self._cdc = _load_fastcdc()(avg_size, min_size=min_size, max_size=max_size)
        return [c.length for c in self._cdc.cut_buf(buf)]

    def __repr__(self) -> str:
        return f"ContentChunker(max_size={self.max_size}, window={self.window})"


class FixedChunker:
    """Fixed-size cuts of ``size`` bytes (the last one shorter): what version-1
    writers made.  Its window is one chunk, so a put reads the content one
    chunk at a time, as those writers did."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError("a chunk size must be positive")
        self.max_size = size
        self.window = size
        self.whole_max = size

    def cut(self, buf) -> list[int]:
        n = len(buf)
        return [min(self.max_size, n - i) for i in range(0, n, self.max_size)]

    def __repr__(self) -> str:
        return f"FixedChunker({self.max_size})"


def windows(read, chunker):
    """Yield the chunks of the content that ``read(offset, n)`` returns, as
    lists of memoryviews (one list per window read), in order, cut by
    ``chunker``.

    The content ends at the first read shorter than asked (a regular file's
    end; a file cut short meanwhile just ends earlier): the chunks are
    always of the bytes that were read.  The last chunk of a full window is
    held back and read again at the start of the next one, where its true
    end is known.
    """
    offset = 0
    while True:
        buf = read(offset, chunker.window)
        if not buf:
            return
        view = memoryview(buf)
        final = len(buf) < chunker.window
        if final and offset == 0 and len(buf) <= chunker.whole_max:
            # One chunk (most files of a source tree): FastCDC's call and
            # its chunk objects cost more than the rest of the cut.
            yield [view]
            return
        lengths = chunker.cut(view)
        if not final and len(lengths) > 1:
            lengths = lengths[:-1]
        pieces, pos = [], 0
        for n in lengths:
            pieces.append(view[pos:pos + n])
            pos += n
        yield pieces
        offset += pos
        if final:
            return
