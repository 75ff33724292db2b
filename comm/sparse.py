"""ByteSplat's zero-eliding gradient encoding, and the gradient exchanges built on it.

Most gradient records sent back to a Gaussian's owner are all zero (the
Gaussian was projected but touched no pixel), so instead of the dense rows we
send one bit per row plus the non-zero rows ("packed"), and the receiver adds
each packed row straight into its gradient rows, never rebuilding the dense
block.  The message format and its layout are ``numbasplat.math.sparse``'s
(``message_parts`` splits messages into their parts); the encoder and decoder
kernels are the backend's (``numbasplat.cpu.sparse``, ``numbasplat.cuda.sparse``:
the kernels of CuPy arrays, or of numpy arrays under the simulator with the
CUDA backend, unless ``backend`` says), and both give identical messages.  GPU
encode: a count kernel, one device-to-host copy (message sizes must reach the
host anyway), a pack kernel that writes the messages in place; the receiver
decodes a message with one kernel straight from the receive buffer.
"""
import time

import numpy as np

from numbasplat import backend as _backend
from numbasplat.math.sparse import layout, message_sizes, row_words


def _kernels(a, backend):
    """The kernels of ``backend``, else of the backend that takes ``a``."""
    return _backend.kernels(backend or _backend.backend_of(a))


def encode(G, counts, backend=None):
    """Zero-eliding encoding of rows ``G`` (M x F) grouped by destination (``counts``).

    Returns ``(message, sizes, kept)``: the uint32 words of every chunk's
    message (format above) back to back, of ``G``'s kind (CuPy or numpy); the
    words and the kept rows per destination (int64 numpy).
    """
    counts = np.asarray(counts, np.int64).reshape(-1)
    if G.ndim != 2 or G.shape[0] != counts.sum():
        raise ValueError(f"encode: G of shape {G.shape} does not hold the {counts.sum()} rows of counts")
    return _kernels(G, backend).encode(G, counts)


def decode_add(message, counts, kept, route, out, backend=None):
    """``out[route[i]] += row i`` for every kept row i of the messages, chunk by chunk.

    ``counts`` and ``kept`` are the dense and kept row counts per source (what
    ``encode`` was given and returned on the senders); ``route`` (one integer
    per dense row; int32 avoids a conversion on the GPU) names each row's
    target row of ``out``.  No dense block is built.
    """
    counts = np.asarray(counts, np.int64).reshape(-1)
    lay = layout(counts, kept, row_words(out) if out.ndim == 2 else 0)
    if message.ndim != 1 or message.shape[0] != lay[2, -1] or route.shape[0] != lay[1, -1]:
        raise ValueError(f"decode_add: {message.shape} message words / {route.shape[0]} routes for counts "
                         f"{counts.tolist()}, kept {np.asarray(kept).tolist()} and rows of {out.shape[-1]} "
                         f"(want {lay[2, -1]} / {lay[1, -1]})")
    _kernels(out, backend).decode_add(message, counts, kept, lay, route, out)


def scatter_add(rows, route, out, backend=None):
    """``out[route[i]] += rows[i]`` (duplicates in ``route`` add up)."""
    if rows.shape[0] != route.shape[0]:
        raise ValueError(f"scatter_add: {rows.shape[0]} rows, {route.shape[0]} routes")
    _kernels(out, backend).scatter_add(rows, route, out)


def _sync(a, timed=True):
    """Wait for the device work on ``a``, when the phases are timed (else the host runs ahead)."""
    if timed and _backend.is_device(a):
        _backend.synchronize()


def exchange_sparse(exchange, G, counts, route_recv, out, backend=None, timed=True):
    """Send gradient rows ``G`` (grouped by destination) as zero-eliding messages; add them into ``out``.

    One Alltoall of (dense, kept) counts, then one alltoallv of the messages
    (``encode``), decoded straight from the receive buffer (``decode_add``).
    Returns stats: bytes sent dense/sparse, zero-row fraction, seconds per phase (the device's
    with ``timed``, which syncs at each phase's end; else the host's).
    """
    if exchange.size == 1:
        return _add_own(G, route_recv, out, backend, timed)
    _sync(G, timed)  # the phases' times exclude the still-running work that produced G
    t0 = time.perf_counter()
    message, sizes, kept = encode(G, counts, backend)
    t1 = time.perf_counter()
    counts = np.asarray(counts, np.int64)
    got = exchange.alltoall_ints(np.stack([counts, kept], axis=1))
    recv_counts, recv_kept = got[:, 0].copy(), got[:, 1].copy()
    if route_recv.shape[0] != recv_counts.sum():
        raise ValueError(f"exchange_sparse: route_recv has {route_recv.shape[0]} rows, "
                         f"{recv_counts.sum()} arrive")
    received, _ = exchange.alltoallv(message, sizes, message_sizes(recv_counts, recv_kept, row_words(G)))
    _sync(received, timed)  # an NCCL transfer runs on the stream: time it here, not in the decoder
    t2 = time.perf_counter()
    decode_add(received, recv_counts, recv_kept, route_recv, out, backend)
    _sync(out, timed)
    t3 = time.perf_counter()
    rows = int(counts.sum())
    return {
        "dense_bytes": int(G.nbytes),
        "sparse_bytes": int(message.nbytes),
        "zero_fraction": 1.0 - int(kept.sum()) / rows if rows else 0.0,
        "t_encode": t1 - t0, "t_exchange": t2 - t1, "t_decode": t3 - t2,
    }


def exchange_dense(exchange, G, counts, route_recv, out, backend=None, timed=True, recv_counts=None):
    """Same result as ``exchange_sparse`` by sending every row: alltoallv of ``G``, scatter-add by route.
    ``recv_counts``, when the caller knows them, saves the exchange of the counts.

    Same stats keys; ``zero_fraction`` is None (not measured: it would cost a pass over ``G``).
    """
    if exchange.size == 1:
        return _add_own(G, route_recv, out, backend, timed)
    _sync(G, timed)
    t0 = time.perf_counter()
    recv, recv_counts = exchange.alltoallv(G, counts, recv_counts)
    if route_recv.shape[0] != recv.shape[0]:
        raise ValueError(f"exchange_dense: route_recv has {route_recv.shape[0]} rows, {recv.shape[0]} arrive")
    _sync(recv, timed)
    t1 = time.perf_counter()
    return {
        "dense_bytes": int(G.nbytes), "sparse_bytes": int(G.nbytes), "zero_fraction": None,  # not measured
        "t_encode": 0.0, "t_exchange": t1 - t0, "t_decode": _timed_add(recv, route_recv, out, backend, timed),
    }


def _add_own(G, route, out, backend, timed):
    """The exchanges on one rank (batched training in one process): every row is this rank's own, added
    in place with no message (nothing crosses; encoding it would cost a sync)."""
    _sync(G, timed)
    return {"dense_bytes": int(G.nbytes), "sparse_bytes": 0, "zero_fraction": None,
            "t_encode": 0.0, "t_exchange": 0.0, "t_decode": _timed_add(G, route, out, backend, timed)}


def _timed_add(rows, route, out, backend, timed):
    """``scatter_add(rows, route, out)`` -> its seconds (the device's with ``timed``)."""
    t0 = time.perf_counter()
    scatter_add(rows, route, out, backend)
    _sync(out, timed)
    return time.perf_counter() - t0
