"""ByteSplat's fused rasterization: forward, tile-local loss and backward in one CUDA kernel.

One 16x16 thread block per tile loads the tile's depth-sorted Gaussians into
shared memory once, composites front to back, computes the tile-local loss
(L1 + S3IM, ``tile_loss``) and each pixel's dL/dcolour on chip, then runs the
backward pass back to front from the same cached records.  Only the
per-Gaussian gradients (and, when asked, the image) go to device memory.

A record costs shared memory, and shared memory sets how many tiles an SM
runs at once, so the cache holds only what the passes read: the first
``CACHED`` fields (no depth: the tile loss has no depth term).  The Gaussian's
id is read again from ``ids`` in the backward pass (one broadcast load a warp,
an L1 hit).  And it holds at most ``CACHE_RECORDS`` records a tile: the
pixels of a dense tile are done long before its list ends, and a cache sized
for whole lists would hold a dense scene to fewer tiles an SM.  Past the cache,
the forward pass's batches take turns in its last ``BLOCK`` slots, and the
backward pass reloads them there.

A tile fits when its Gaussians fit the shared-memory budget
``B = (M_budget - M_fixed) // M_g`` (M_budget: the device's shared memory per
block; M_fixed: the kernel's static layout; M_g: one cached record).  The
other tiles take the unfused path (raster forward, the same tile-local loss,
raster backward) in the same step, so results do not depend on the path.
The kernel runs over every tile and those over the budget leave at once: the
launch needs no per-tile counts on the host, so it waits for no device sync.
"""
import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from ..math import gaussian_ops as go
from ..math.jit import SIM
from ..math.tiles import TILE, fused_smem_layout
from .launch import F1, F2, F3, I1, I2, kernel
from .tile import (BLOCK, NG, ONE, RED_ROWS, ZERO, backward_hit, chunk_hits, composite_chunks, field,
                   flat_records, next_hit, pixel_of_tile, record_reaches)
from .tile_loss import TILE_LOSS_SMEM, store_tile_sums, tile_loss_grad

CACHED = go.DEPTH               # record fields cached per Gaussian: all before depth
RECORD_BYTES = 4 * CACHED       # one cached record (float32 fields)
CACHE_RECORDS = 3 * BLOCK       # records a tile caches at most (see above; at least BLOCK)


@cuda.jit(device=True, inline=True)
def _cache(proj, ids, start, first, n, slot, rec, tid):
    """Records first..first+n-1 of the tile into shared slots slot..slot+n-1, a record a thread
    (a field-interleaved copy cost ~100 instructions a word)."""
    if tid < n:
        g = uint32(ids[start + first + tid])
        for f in range(CACHED):
            rec[field(slot + tid, f, CACHED)] = proj[g, f]


# 48 registers: five tiles share an SM's 64K (ptxas would take 56, four tiles, though 48 spill nothing)
@kernel(F2, I1, I2, "int64", "int64", "int64", F1, F3, "int32[:, ::1]", "int64", "float32", "float32", "float32",
        "int64", "int64", "boolean", F3, F1, F2, fastmath=True, max_registers=48)
def _fused_kernel(proj, ids, ranges, W, H, tiles_x, bg, target, perms, repeats, lam, inv_l1, inv_ssim, max_count,
                  cap, write_image, image, grad, partials):
    tile = cuda.blockIdx.x
    tid, lane, px, py, inside, start, end, x0, x1, y0, y1, fx, fy = pixel_of_tile(tile, ranges, tiles_x, W, H)
    if end - start > max_count:  # over the budget: the unfused path's tile (the whole block leaves)
        return
    count = int32(end - start)  # int32 loop counters: Numba's int64 ones cost ~15 instructions an iteration
    window = int32(cap - BLOCK)  # past the cache, batches take turns in its last BLOCK slots
    rec = cuda.shared.array(0, float32)      # cap * CACHED record fields
    sm = cuda.shared.array(TILE_LOSS_SMEM, float32)  # the loss's scratch, then its block sums
    red = cuda.shared.array((NG, RED_ROWS), float32)
    block_last = cuda.shared.array(1, int32)
    if tid == 0:
        block_last[0] = 0
    # forward, front to back, caching records batch by batch until every pixel is done
    T = ONE
    r = ZERO
    gr = ZERO
    b = ZERO
    stop = int32(0)
    done = not inside
    spilled = False  # a batch went past the cache (the same for the whole block)
    for base in range(int32(0), count, int32(BLOCK)):
        if cuda.syncthreads_count(int32(done)) == BLOCK:
            break
        n = int32(min(BLOCK, count - base))
        slot = base
        if base + n > cap:
            slot = window
            spilled = True
        _cache(proj, ids, start, base, n, slot, rec, tid)
        cuda.syncthreads()
        T, r, gr, b, _, stop, done = composite_chunks(rec, CACHED, slot, int32(slot + n), int32(base - slot), lane,
                                                      x0, x1, y0, y1, fx, fy, T, r, gr, b, ZERO, stop, done, False)
    if inside:
        cuda.atomic.max(block_last, 0, stop)
    c0 = r + T * bg[0]
    c1 = gr + T * bg[1]
    c2 = b + T * bg[2]
    t0 = ZERO
    t1 = ZERO
    t2 = ZERO
    if inside:
        t0 = target[py, px, 0]
        t1 = target[py, px, 1]
        t2 = target[py, px, 2]
        if write_image:
            image[py, px, 0] = c0
            image[py, px, 1] = c1
            image[py, px, 2] = c2
    # the tile-local loss and dL/dcolour, on chip
    dc0, dc1, dc2, l1, ss = tile_loss_grad(tid, (py % TILE) * TILE + px % TILE, inside, c0, c1, c2, t0, t1, t2,
                                           perms, repeats, lam, inv_l1, inv_ssim, sm)
    store_tile_sums(tid, tile, l1, ss, sm, partials)
    # backward, back to front: from the cache, after reloading what spilled past it a batch at a time
    s0 = T * bg[0]
    s1 = T * bg[1]
    s2 = T * bg[2]
    sd = ZERO
    hi = block_last[0]
    while hi > 0:
        lo = int32(0)
        shift = int32(0)  # record j sits in slot j - shift
        if spilled and hi > window:
            lo = int32(max(window, hi - BLOCK))
            shift = int32(lo - window)
            cuda.syncthreads()  # the previous window's records are done with
            _cache(proj, ids, start, lo, int32(hi - lo), window, rec, tid)
            cuda.syncthreads()
        for top in range(hi, lo, int32(-32)):  # chunks back to front; lane l: Gaussian top-1-l
            k = int32(top - 1 - lane)
            hits = chunk_hits(k >= lo and record_reaches(rec, CACHED, k - shift, x0, x1, y0, y1), int32(top - lo))
            while hits != 0:
                h, hits = next_hit(hits)
                j = int32(top - 1 - h)
                T, s0, s1, s2, sd = backward_hit(rec, CACHED, j - shift, fx, fy, j < stop, T, s0, s1, s2, sd,
                                                 dc0, dc1, dc2, ZERO, ZERO, False, grad, ids, start + j, tid, red,
                                                 False, grad, 0)
        hi = lo


@functools.cache
def _shared_memory():
    """(shared memory per block, the kernel's static layout) in bytes, read from the process's
    device once (getDeviceProperties takes milliseconds: not a per-step call)."""
    if SIM:
        return 48 * 1024, 0
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]), _fused_kernel.static_shared_bytes()


def fused_budget():
    """B: Gaussians per tile that fit in shared memory beside the kernel's fixed layout."""
    per_block, m_fixed = _shared_memory()
    return max(0, (per_block - m_fixed) // RECORD_BYTES)


def fused_layout():
    """(M_budget, M_fixed, M_g, where M_budget comes from) of ``fused_budget``, in bytes; in the
    simulator, which has no compiled kernel, M_fixed from the constants (``fused_smem_layout``)."""
    per_block, m_fixed = _shared_memory()
    return per_block, m_fixed or fused_smem_layout()[0], RECORD_BYTES, "the simulator" if SIM else "this GPU"


def fused_raster_loss_backward(proj, ids, ranges, W, H, tiles_x, bg, target, perms, lam, max_count, write_image,
                               image, grad, partials):
    """Launch the fused kernel over every tile; the tiles with more than ``max_count`` Gaussians leave
    at once, for the unfused path.  The tiles are picked on the device, so the launch waits for
    no per-tile counts on the host (that wait left the GPU idle while the host caught up)."""
    n_tiles = ranges.shape[0]
    if not n_tiles:
        return
    repeats = perms.shape[0]
    _fused_kernel[n_tiles, (TILE, TILE), CACHE_RECORDS * RECORD_BYTES](
        proj, ids, ranges, W, H, tiles_x, bg, target, perms, repeats, np.float32(lam),
        np.float32(1.0 / (3 * W * H)), np.float32(1.0 / (repeats * 3 * W * H)), max_count, CACHE_RECORDS,
        bool(write_image), image, flat_records(grad), partials)
