"""The layout of ByteSplat's zero-eliding gradient messages (``comm.sparse``), host side.

Message format, per destination chunk of ``n = counts[d]`` rows, all 32-bit words (a chunk is
one message of the alltoallv):

  bitmap  ceil(n/32) words; bit ``i % 32`` of word ``i // 32`` is row i,
          least significant bit first.  A row is kept iff any field is
          ``!= 0`` (NaN is kept, -0.0 is not).
  bases   ceil(n/256) words: kept rows of the chunk before each segment.
  rows    the kept rows in order, as their raw 32-bit words.

Chunks are cut into segments of ``ROWS`` = 256 rows (one CUDA block each, ``WORDS`` bitmap
words).  The bases let every block of the decoder find its segment's rows without a scan.
Both backends' encoders and decoders (``numbasplat.cpu.sparse``, ``numbasplat.cuda.sparse``)
and the exchange API lay messages out with these functions, so they give identical messages.
"""
import numpy as np

ROWS = 256          # rows per segment = threads per block
WORDS = ROWS // 32  # bitmap words per segment


def word_counts(counts):
    """Bitmap words per chunk: ``ceil(counts / 32)``."""
    return (np.asarray(counts, np.int64) + 31) // 32


def layout(counts, kept=None, row_words=0):
    """(3, P+1) int64: segment, row and message-word offsets of each chunk (the last needs ``kept``)."""
    counts = np.asarray(counts, np.int64).reshape(-1)
    if (counts < 0).any():
        raise ValueError(f"negative row count in {counts.tolist()}")
    lay = np.zeros((3, counts.size + 1), np.int64)
    segments = (counts + ROWS - 1) // ROWS
    np.cumsum(segments, out=lay[0, 1:])
    np.cumsum(counts, out=lay[1, 1:])
    if kept is not None:
        np.cumsum(word_counts(counts) + segments + np.asarray(kept, np.int64) * row_words, out=lay[2, 1:])
    return lay


def message_sizes(counts, kept, row_words):
    """Words of each chunk's message."""
    return np.diff(layout(counts, kept, row_words)[2])


def row_words(a):
    """32-bit words of one row of the 2D array ``a``."""
    return a.shape[1] * a.dtype.itemsize // 4


def segment_bases(lay, seg_count):
    """(kept rows per chunk, each segment's kept rows before it in its chunk), from per-segment counts."""
    before = np.zeros(seg_count.size + 1, np.int64)
    np.cumsum(seg_count, out=before[1:])
    kept = before[lay[0, 1:]] - before[lay[0, :-1]]
    chunk_start = np.repeat(before[lay[0, :-1]], np.diff(lay[0]))
    return kept, before[:-1] - chunk_start


def message_parts(message, counts, kept, width, dtype=np.float32):
    """(bitmap, bases, packed rows) of encoded messages (a host array), each part's chunks back
    to back."""
    message = np.asarray(message)
    lay = layout(counts, kept, width * np.dtype(dtype).itemsize // 4)
    nw, ns = word_counts(counts), np.diff(lay[0])
    parts = [[], [], []]
    for d, m0 in enumerate(lay[2, :-1]):
        ends = np.cumsum([m0, nw[d], ns[d]])
        for part, a, b in zip(parts, ends, list(ends[1:]) + [lay[2, d + 1]]):
            part.append(message[a:b])
    bitmap, bases, rows = (np.concatenate(p) if p else np.zeros(0, np.uint32) for p in parts)
    return bitmap, bases, rows.view(dtype).reshape(-1, width)
