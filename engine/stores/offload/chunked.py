"""A view whose working set is larger than the device's pool, checked out a depth-ordered chunk of
rows at a time (issue 60: any view under any cap).

``OutOfCoreStore.checkout`` gives a ``ChunkedView`` instead of a model where the blocks that the
view sees outnumber the pool's slots (and the pipeline trains chunked views: ``OffloadTrainer``).
The view's rows are split by ``numbasplat.chunks``'s depth key (ties by model row, as
``bin_tiles`` breaks them in one working set) into chunks of at most the pool's rows, each chunk's
rows in model order; the pool is their staging area (its blocks written back and let go first), so
a chunk takes the device memory the cap gave the blocks.  The trainer renders the chunks front to
back, carrying each pixel's state, and back-propagates them back to front, each chunk checked out
again, stepped by Adam on its drawn rows (visible-only Adam) and checked in: the same model as the
unchunked step, since every Gaussian is in one chunk and its gradient is whole once its chunk's
backward ran."""
import numpy as np

from numbasplat import backend as _backend
from numbasplat.chunks import depth_keys


def depth_chunk_places(keys, size):
    """-> for each chunk front to back, the places (ascending) of its keys among ``keys`` (float32, one a row): the
    chunks of ``size`` places that a stable argsort of the keys below +inf cuts, found without a sort (a large
    street view has tens of millions of keys): the keys at the chunks' first ranks by a partition, each place's
    chunk by a search among them, and the places whose key equals one of those split in place order (ties by
    place, as the stable sort breaks them)."""
    drawn = np.flatnonzero(keys < np.float32(np.inf))
    ranks = np.arange(size, len(drawn), size)
    if not len(ranks):
        return [drawn] if len(drawn) else []
    drawn_keys = keys[drawn]
    firsts = np.partition(drawn_keys, ranks)[ranks]  # (the key at each chunk's first rank, but the first chunk's)
    chunk = np.zeros(len(drawn), np.int32)
    for first in firsts:  # (a key equal to a first key: the chunk before it)
        chunk += drawn_keys > first
    for value in np.unique(firsts):  # (those places split at the rank: the first ones before it)
        tied = np.flatnonzero(drawn_keys == value)
        chunk[tied] = (np.count_nonzero(drawn_keys < value) + np.arange(len(tied))) // size
    return [drawn[chunk == c] for c in range(len(ranks) + 1)]


class ChunkedView:
    """View ``view``'s working set (the rows of ``blocks``, in model order) out of core, in chunks of
    at most ``size`` rows (``store``: the ``OutOfCoreStore``).  ``adam.set_step(cols)`` takes the
    step's learning rates, which every chunk's Adam then uses at the same step count."""

    chunked = True

    def __init__(self, store, view, blocks, size):
        self.store, self.view, self.blocks, self.size = store, view, blocks, int(size)
        self.rows = store.index.rows(blocks)
        self.chunks = None
        self.adam = _StepRates(store._adam_steps)

    def __len__(self):
        return len(self.rows)

    @property
    def count(self):
        """The rows a chunk holds at most (the step's resident Gaussians)."""
        return min(self.size, len(self.rows))

    def depth_chunks(self, camera, antialias=False):
        """Split the view's rows into chunks front to back (``numbasplat.chunks.depth_chunks``'s order:
        its depth key, ties by model row; only the Gaussians drawn), each chunk's rows in model order;
        the keys computed a chunk's rows at a time.  -> the chunks (host int64 arrays of model rows;
        one empty chunk where nothing is drawn)."""
        keys = np.empty(len(self.rows), np.float32)
        for a in range(0, len(self.rows), self.size):
            rows = self.rows[a:a + self.size]
            keys[a:a + len(rows)] = self._depth_keys(rows, camera, antialias)
        self.chunks = [self.rows[part] for part in depth_chunk_places(keys, self.size)] or [self.rows[:0]]
        return self.chunks

    def _depth_keys(self, rows, camera, antialias):
        """The depth keys of the model rows ``rows`` (host), from what they read alone (``depth_rows``: a
        quarter of the pool's row at SH degree 3), let go before the next rows' are moved."""
        return _backend.to_host(depth_keys(self.store.depth_rows(rows), camera, antialias,
                                           backend=self.store.backend, check=False))

    def checkout(self, k):
        """-> (chunk ``k``'s rows as a model on the device, with the step's learning rates; their
        statistics)."""
        model, statistics = self.store.rows_in(self.chunks[k])
        model.adam.set_step(self.adam.cols)
        return model, statistics

    def checkin(self, k, model, statistics):
        """Chunk ``k``'s rows, trained, back to the host (``checkout``'s ``model``, ``statistics``)."""
        self.store.rows_out(self.chunks[k], model, statistics)


class _StepRates:
    """What ``ChunkedView.adam`` keeps of ``Adam.set_step``: the step's learning rates."""

    def __init__(self, step_count):
        self.step_count, self.cols = step_count, None

    def set_step(self, lr_columns):
        self.cols = lr_columns
        self.step_count += 1
