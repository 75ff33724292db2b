"""What pipelines over several MPI ranks share: one GPU per rank, the checks that ranks agree,
cuts of rows or tiles into contiguous ranges, one per rank, and ``RankedTrainer``, the part of a
multi-rank ``Trainer`` that does not depend on how its step exchanges data."""
import json
from dataclasses import asdict, replace

import numpy as np

from numbasplat import backend as _backend
from numbasplat.loss import psnr_of_mse
from numbasplat.rendering import tiles_squared_error

from engine.recipe.model import GaussianModel
from engine.recipe.trainer import Trainer


def select_device(comm):
    """One GPU per rank: the rank's index among the ranks of its node picks the device."""
    if not _backend.on_gpu():
        return
    from mpi4py import MPI
    import cupy
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()


def share_host_threads(comm):
    """The node's cores shared among its ranks: each rank's compiled host passes (Numba's parallel loops)
    use at most its share of them, not every core each (ranks busy in their collectives starved the
    others' threads: BENCHMARKS.md, the partition proxy).  -> the threads this rank now uses."""
    import os
    import numba
    from mpi4py import MPI
    here = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    numba.set_num_threads(max(1, min(numba.get_num_threads(), (os.cpu_count() or 1) // here)))
    return numba.get_num_threads()


def disagreement(comm, fields):
    """Where the ranks' ``fields`` ({name: JSON value}, the same names on every rank) differ: one
    message, the same on every rank, naming each differing field, the ranks that differ from rank 0
    and two of the values; None where all agree.  Collective (one gather of the fields)."""
    mine = {k: json.dumps(v, sort_keys=True, default=str) for k, v in fields.items()}
    every = comm.allgather(mine)
    problems = []
    for name in fields:
        values = [r[name] for r in every]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            ranks = ("rank " if len(differ) == 1 else "ranks ") + ", ".join(map(str, differ))
            problems.append(f"{name} differs on {ranks} (rank 0: {values[0]}, rank {differ[0]}: {values[differ[0]]})")
    return "; ".join(problems) or None


def max_over_ranks(comm, value):
    """The largest of the ranks' integers ``value``: one small host allreduce.  Collective."""
    from mpi4py import MPI
    buf = np.array([value], np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return int(buf[0])


def even_bounds(n, parts):
    """Cut ``n`` rows into ``parts`` contiguous ranges of near-equal size: their ``parts + 1`` bounds."""
    return np.array([n * r // parts for r in range(parts + 1)], np.int64)


def balanced_bounds(cost, parts):
    """Cut a cost array into ``parts`` contiguous ranges of near-equal total cost."""
    c = np.cumsum(np.asarray(cost, np.float64) + 1e-3)  # +eps: empty tiles still split evenly
    targets = c[-1] * np.arange(1, parts) / parts
    inner = np.searchsorted(c, targets) + 1
    return np.concatenate([[0], np.minimum(inner, len(c)), [len(c)]]).astype(np.int64)


class RankedTrainer(Trainer):
    """A ``Trainer`` over the ranks of ``comm``, each holding a shard of the Gaussians (``model``)
    and of the strategy's state: the snapshot, the whole model, the stop signal and the check
    that the ranks were given the same run, for any way of exchanging data in the step."""

    def __init__(self, dataset, out_dir, cfg, comm, backend=None, log=print, transport="auto", store=None):
        """``transport``: how device buffers cross ranks (``comm.alltoallv``): "auto" (a CUDA-aware MPI,
        else NCCL when every rank has its own GPU, else staged through host memory), "cuda", "nccl", "host".
        ``store``: where this rank's shard lives (default: in memory; ``engine.stores.memory``)."""
        from comm import Exchange
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.is_root = self.rank == 0
        self.options = replace(self.options, transport=transport)
        super().__init__(dataset, out_dir, cfg, backend, log if self.rank == 0 else (lambda *a, **k: None), store)
        self.exchange = Exchange(comm, transport if _backend.on_gpu(self.backend) else "host")
        self.total = 0  # the whole model's Gaussians (start_from sets it)
        self._view0 = None  # (image, target, first tile, end tile) of this rank's share of the step's first view
        self._collectives_logged = (0, 0.0)  # (step, Exchange.collective_seconds) at the last log

    def gaussian_total(self):
        return self.total

    def log_extra(self):
        """The whole model's count, and every rank's statistics gathered, per phase and per rank: its
        last step's ``stats`` (phase and host times, a pipeline's bytes) and ``collective_ms``, its host's
        time inside the exchange's collectives a step since the last log (where ranks wait for the
        slowest; the first log of a resumed run counts from step 0).  Collective."""
        step, seconds = self._collectives_logged
        now = self.exchange.collective_seconds
        mine = {**self.stats, "collective_ms": 1e3 * (now - seconds) / max(self.step - step, 1)}
        self._collectives_logged = (self.step, now)
        return {**super().log_extra(), "rank_stats": self.comm.allgather(mine), "gaussians_total": self.total}

    def progress_psnr(self):
        """The step's first view's PSNR from the ranks' summed squared errors on their tiles (no image
        is gathered, ``_view0``).  Collective, like ``log_extra``: every rank logs the same steps."""
        sse = 0.0
        if self._view0 is not None:
            image, target, first, last = self._view0
            sse = float(tiles_squared_error(image, target, first, last))
        sse = float(self.exchange.allreduce_sum(np.array([sse]))[0])
        cam = self.data.train[0].camera
        mse = sse / (3 * cam.width * cam.height)
        return psnr_of_mse(mse)

    def pipeline_fields(self):
        """{name: value} of the pipeline's own options that every rank must share (``check_ranks_agree``)."""
        return {}

    def gather_state(self):
        model, state = self.store.whole()
        model_state = {w: self.gathered(w, root_only=True) for w in ("params", "m", "v")}
        strategy = {k: self.comm.gather(_backend.to_host(a), root=0) for k, a in state.items()}
        if self.rank != 0:
            return None
        model_state["step"] = model.adam.step_count
        return model_state, {k: self.whole_rows(parts) for k, parts in strategy.items()}

    def whole_model(self):
        """Rank 0 gathers the parameters (the moments are not needed to render), on the store's home (the
        device, or host memory out of core: the whole model need not fit on the device)."""
        params = self.gathered("params", root_only=True)
        return GaussianModel(params, self.store.home) if self.rank == 0 else None

    def barrier(self):
        self.comm.Barrier()

    def from_root(self, value):
        return self.comm.bcast(value, root=0)

    def check_ranks_agree(self):
        """Different options on one rank (say ``--iters``) or other files would hang a collective
        or train silently wrong: every rank compares its configuration, its pipeline's options, the
        step it starts from and its dataset's fingerprint with every other rank's, and raises the
        same ``ValueError`` where they differ."""
        fields = {**asdict(self.cfg), **self.pipeline_fields(), "backend": self.backend, "start step": self.step,
                  "Gaussian count": self.total, "training image count": len(self.data.train),
                  "data": str(self.data.source), "dataset fingerprint": self.data_fingerprint[:16]}
        problem = disagreement(self.comm, fields)
        if problem:
            raise ValueError(f"the {self.size} ranks were not given the same run (the same options and files "
                             f"on every rank): {problem}")

    def stop_signal(self):
        """The largest stop signal that any rank received (0: none): every rank stops for it."""
        return max_over_ranks(self.comm, self.signals.received)

    def gathered(self, which="params", root_only=False):
        """The whole model's host arrays on every rank (on rank 0 only, None elsewhere, with ``root_only``),
        the shards in rank order."""
        local = self.store.whole()[0].host_arrays(which)
        if not root_only:
            return {g: self.whole_rows(self.comm.allgather(a)) for g, a in local.items()}
        parts = {g: self.comm.gather(a, root=0) for g, a in local.items()}
        return {g: self.whole_rows(p) for g, p in parts.items()} if self.rank == 0 else None

    def view_model(self, most):
        """Every k-th Gaussian of each rank's shard on rank 0, k the least that brings at most ``most``
        (the viewer's copy: the parameters alone, in rank order).  Collective."""
        import numbasplat as ns
        k = max(1, -(-self.total // max(1, most)))
        local = {g: a[::k] for g, a in self.store.whole()[0].host_arrays("params").items()}
        parts = {g: self.comm.gather(a, root=0) for g, a in local.items()}
        if self.rank != 0:
            return None
        return ns.Gaussians(**{g: self.xp.asarray(np.concatenate(p)) for g, p in parts.items()})

    def whole_rows(self, parts):
        """The whole model's array of the ranks' ``parts`` (in rank order): here one after another."""
        return np.concatenate(parts)
