"""Time the host's Adam kernel (``numbasplat.cpu.adam_table_rows``, what ``--offload-adam host`` runs on a working
set's rows each step) alone on this machine's cores: what the host's part of a host-Adam step costs, to set
against the step's images/s on a GPU (``tests/check_offload_adam.py``).

    python scripts/host_adam_bench.py --gaussians 100000 --sh-degree 3 --visible 0.7 --reps 10

``--gaussians`` rows of a host table (each the parameters, both moments and 8 statistics' columns, as the host's
tier holds them, a fifth more rows than the working set so that its rows are scattered), a ``--visible`` share of
them stepped (visible-only Adam) and every one's parameters written out; the median and the least of ``--reps``
calls after one warm-up, with the threads Numba used.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numbasplat import backend as _backend  # noqa: E402
from numbasplat.optim import FlatParams, column_lrs  # noqa: E402

RATES = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh": 2.5e-3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaussians", type=int, default=100000)
    ap.add_argument("--sh-degree", type=int, default=3)
    ap.add_argument("--visible", type=float, default=0.7, help="share of the rows stepped")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    n, rng = a.gaussians, np.random.default_rng(0)
    flat = FlatParams(n, (a.sh_degree + 1) ** 2)
    lrs = column_lrs(RATES, flat.sh_bases)
    width = len(lrs)
    table = rng.random((n + n // 5, 3 * width + 8)).astype(np.float32)
    rows = np.sort(rng.permutation(len(table))[:n]).astype(np.int64)
    grads = (1e-3 * rng.standard_normal(flat.size)).astype(np.float32)
    visible = rng.random(n) < a.visible
    args = (table, rows, np.array([0, width, 2 * width], np.int32), flat.data, grads, *flat.layout(lrs), lrs,
            visible, True, np.zeros(1, np.int32), np.float32(0.9), np.float32(0.999), np.float32(1e-15),
            np.array([0.1, 0.001], np.float32))
    kernel = _backend.kernels("cpu").adam_table_rows
    times = []
    for it in range(a.reps + 1):
        start = time.perf_counter()
        kernel(*args)
        if it:
            times.append(time.perf_counter() - start)
    print(f"host Adam, {n} rows at SH degree {a.sh_degree} ({width} columns), {a.visible:.0%} stepped, "
          f"{numba.get_num_threads()} threads: median {1e3 * statistics.median(times):.2f} ms, "
          f"least {1e3 * min(times):.2f} ms")


if __name__ == "__main__":
    main()
