"""Time the zero-eliding encoder (``comm.sparse.encode``) alone on one GPU: what a rank's encode costs without
the step around it, to set against the encode phase of a distributed run (``scripts/mpi_summary.py``).

    python scripts/encode_bench.py --rows 77000 --fields 59 --zero 0.16 --reps 20

``--rows`` records of ``--fields`` float32 fields, a ``--zero`` share of them all zero, split over two
destinations; each encode synced, the median and the least of ``--reps`` after three warm-ups.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comm.sparse import encode  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=77000)
    ap.add_argument("--fields", type=int, default=12, help="float32 fields a record (the exchange's: 12)")
    ap.add_argument("--zero", type=float, default=0.16, help="share of all-zero records")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    G = rng.standard_normal((a.rows, a.fields)).astype(np.float32)
    G[rng.random(a.rows) < a.zero] = 0
    G, counts = _backend.array_module().asarray(G), np.array([a.rows // 2, a.rows - a.rows // 2])
    times = []
    for it in range(a.reps + 3):
        _backend.synchronize()
        start = time.perf_counter()
        message, _, _ = encode(G, counts)
        _backend.synchronize()
        if it >= 3:
            times.append(time.perf_counter() - start)
    print(f"encode {a.rows} rows of {a.fields} fields, {a.zero:.0%} zero: median {1e3 * np.median(times):.3f} ms, "
          f"least {1e3 * min(times):.3f}, message {message.nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
