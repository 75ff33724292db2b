"""Time the backward gradient exchange, sparse against dense, on synthetic records (run under mpiexec).

    mpiexec -n 2 python scripts/exchange_bench.py --rows 75000 --zero 0.2 --transport nccl

Each rank sends ``--rows`` gradient records (12 float32 fields) spread evenly over
the ranks, a ``--zero`` fraction of them exactly zero, routed to random owner
rows; both exchanges run ``--reps`` times after a warm-up and each rank prints
the median time of every phase (encode, exchange, decode), so the encoder and
decoder can be set against the dense exchange they replace.
"""
import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comm.alltoallv import Exchange, abort_on_error  # noqa: E402
from comm.sparse import exchange_dense, exchange_sparse  # noqa: E402
from numbasplat import backend as _backend  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=75000, help="records each rank sends")
    ap.add_argument("--zero", type=float, default=0.2, help="fraction of exactly-zero records")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--transport", default="auto")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    with abort_on_error(comm):
        if _backend.on_gpu():
            from engine.pipelines.distributed import select_device
            select_device(comm)
        xp = _backend.array_module()
        rng = np.random.default_rng(rank)
        counts = np.full(P, a.rows // P, np.int64)
        G = rng.normal(size=(counts.sum(), 12)).astype(np.float32)
        G[rng.random(len(G)) < a.zero] = 0
        recv = np.array(comm.alltoall(counts.tolist()), np.int64)
        n_out = max(1, a.rows // 2)
        route = xp.asarray(rng.integers(0, n_out, recv.sum()).astype(np.int32))
        G, out = xp.asarray(G), xp.zeros((n_out, 12), np.float32)
        ex = Exchange(comm, transport=a.transport)
        times = {}
        for name, fn in (("sparse", exchange_sparse), ("dense", exchange_dense)):
            stats = []
            for it in range(a.reps + 5):
                comm.Barrier()
                s = fn(ex, G, counts, route, out)
                if it >= 5:
                    stats.append(s)
            times[name] = {k: 1e3 * statistics.median(s[k] for s in stats) for k in ("t_encode", "t_exchange",
                                                                                       "t_decode")}
            times[name]["bytes"] = stats[-1]["sparse_bytes"]
        sp, de = times["sparse"], times["dense"]
        line = (f"rank {rank}/{P} {ex.transport.name}, {a.rows} rows, {a.zero:.0%} zero: "
                f"sparse encode {sp['t_encode']:.3f} exchange {sp['t_exchange']:.3f} decode {sp['t_decode']:.3f} ms "
                f"({sp['bytes'] / 1e6:.2f} MB) | dense exchange {de['t_exchange']:.3f} scatter {de['t_decode']:.3f} "
                f"ms ({de['bytes'] / 1e6:.2f} MB) | encode+decode = "
                f"{100 * (sp['t_encode'] + sp['t_decode']) / de['t_exchange']:.0f}% of the dense exchange")
        for r in range(P):
            comm.Barrier()
            if r == rank:
                print(line, flush=True)


if __name__ == "__main__":
    main()
