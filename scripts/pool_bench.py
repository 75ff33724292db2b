"""Time the device pool's bookkeeping on the host (``DeviceCache.fetch``, ``prefetch``, ``changed``: which blocks
are resident, which leave, which changed) at the block counts of a 100M-Gaussian model, with the moves themselves
as cheap as they can be (a pool of a few columns in host memory): the host's part of an out-of-core step that grows
with the working set's blocks, not with its bytes.

    python scripts/pool_bench.py --blocks 24000 --slots 20000 --working-set 14000 --reps 20

Each step fetches a working set of ``--working-set`` random blocks (one of five, so that some are missing), marks
it changed and prefetches the next one; also a step whose working set is all resident (the pool holding every block
it needs).  Prints the mean of ``--reps`` steps of each, in ms, and the pool's traffic.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.stores.offload.cache import DeviceCache  # noqa: E402
from engine.stores.offload.layout import BlockIndex, RowLayout  # noqa: E402
from engine.stores.offload.tiers import HostBlocks  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=24000)
    ap.add_argument("--slots", type=int, default=20000)
    ap.add_argument("--working-set", type=int, default=14000)
    ap.add_argument("--block-rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rows = a.block_rows
    rng = np.random.default_rng(0)
    index = BlockIndex(rng.uniform(-1, 1, (a.blocks * rows, 3)), np.full((a.blocks * rows, 3), -3.0), rows)
    layout = RowLayout(0, {})
    host = HostBlocks()
    host.reset({b: np.zeros((int(index.sizes[b]), layout.columns_total), np.float32) for b in range(index.blocks)})
    cache = DeviceCache(np, layout, rows, a.slots, index)
    sets = [np.sort(rng.choice(index.blocks, a.working_set, replace=False)) for _ in range(5)]
    cache.fetch(sets[0], index, host)

    def timed(step):
        start = time.perf_counter()
        for k in range(a.reps):
            step(k)
        return (time.perf_counter() - start) / a.reps * 1e3

    resident = timed(lambda k: cache.fetch(sets[0], index, host))
    moving = timed(lambda k: (cache.fetch(sets[k % 5], index, host), cache.changed(sets[k % 5]),
                              cache.prefetch(sets[(k + 1) % 5], sets[k % 5], index, host)))
    print(f"{index.blocks} blocks, {cache.slots} slots, working sets of {a.working_set} blocks")
    print(f"  every block resident: {resident:.2f} ms a step (fetch)")
    print(f"  blocks moving:        {moving:.2f} ms a step (fetch, changed, prefetch)")
    print(f"  traffic: {cache.hits} hits, {cache.misses} misses, {cache.moved_bytes / 2**20:.1f} MiB moved")


if __name__ == "__main__":
    main()
