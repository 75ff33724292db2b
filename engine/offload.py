"""Out-of-core training (``--offload host``): the model in host memory, the GPU holding a view's working set.

All parameters, Adam moments and densification statistics live in host memory (a ``GaussianModel``
on the CPU backend).  The Gaussians are grouped into spatially coherent blocks (``BlockIndex``: the
Morton order of their centres, cut into blocks of about ``BLOCK_ROWS``), each with a box that holds
its centres grown by its Gaussians' reach.  One step, one view:

1. the view's working set: the rows of the blocks whose grown box the view can see, culled on the
   host from the boxes alone (``partition.visible_region``), in model order;
2. those rows' parameters and Adam moments go to the device as a model of their own, which renders,
   computes the loss and back-propagates as the single-GPU pipeline does, and steps Adam on the
   Gaussians the view saw (visible-only Adam: ``cfg.visible_adam`` must be on) with the whole
   model's step count;
3. the rows' parameters, moments and densification statistics come back to the host, where the
   strategy densifies the whole model; the boxes of the blocks that moved are grown anew.

Rows keep the in-memory model's order, so the working set binned and sorted on the device ties as
the whole model would, and the strategy's random draws fall on the same Gaussians: offloaded
training equals in-memory training with visible-only Adam (tested).
"""
import numpy as np

import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.loss import l1_ssim_loss

from .model import GaussianModel
from .partition import GROW_PX, REACH, visible_regions
from .trainer import PhaseClock, Trainer

BLOCK_ROWS = 4096  # Gaussians a block holds, about: spatially close ones, culled together


def morton_codes(points, bits=10):
    """(N,) uint64 Morton codes of ``points`` quantised to ``bits`` per axis within their bounds."""
    points = np.asarray(points, np.float64)
    if not len(points):
        return np.zeros(0, np.uint64)
    lo, hi = points.min(axis=0), points.max(axis=0)
    q = ((points - lo) / np.maximum(hi - lo, 1e-12) * (2 ** bits - 1)).astype(np.uint64)
    code = np.zeros(len(points), np.uint64)
    for b in range(bits):
        for axis in range(3):
            code |= ((q[:, axis] >> np.uint64(b)) & np.uint64(1)) << np.uint64(3 * b + axis)
    return code


class BlockIndex:
    """The model's Gaussians in spatially coherent blocks with growing boxes: ``block`` (N,) each
    Gaussian's block, ``lo``/``hi`` (B, 3) each block's box (centres grown by ``REACH`` of its
    members' largest scale)."""

    def __init__(self, means, log_scales, block_rows=BLOCK_ROWS):
        order = np.argsort(morton_codes(means), kind="stable")
        self.block = np.empty(len(means), np.int64)
        self.block[order] = np.arange(len(means)) // block_rows
        self.blocks = int(self.block.max()) + 1 if len(means) else 0
        self.lo = np.zeros((self.blocks, 3))
        self.hi = np.zeros((self.blocks, 3))
        self.grow(np.arange(len(means)), means, log_scales)

    def grow(self, rows, means, log_scales):
        """Set the boxes of the blocks of ``rows`` (every member of those blocks) from the rows'
        centres and scales (host arrays of the whole model): one pass over the rows."""
        block = self.block[rows]
        reach = REACH * np.exp(np.asarray(log_scales[rows], np.float64).max(axis=1))[:, None]
        centres = np.asarray(means[rows], np.float64)
        self.lo[block] = np.inf
        self.hi[block] = -np.inf
        np.minimum.at(self.lo, block, centres - reach)
        np.maximum.at(self.hi, block, centres + reach)

    def visible(self, camera):
        """The blocks whose box ``camera`` can see."""
        return np.flatnonzero(visible_regions(self.lo, self.hi, camera, grow=GROW_PX)[1])

    def rows(self, blocks):
        """The Gaussians of ``blocks``, in model order."""
        return np.flatnonzero(np.isin(self.block, blocks))


class OffloadTrainer(Trainer):
    """``Trainer`` with the model in host memory and a view's working set on the device (see above)."""

    def __init__(self, dataset, out_dir, cfg, backend=None, log=print, block_rows=BLOCK_ROWS):
        if not cfg.visible_adam:
            raise ValueError("--offload host updates the working set only: it needs --visible-adam")
        if cfg.strategy != "default":  # (MCMC moves every Gaussian every step: every block, every step)
            raise ValueError("--offload host densifies with the default strategy, for now")
        if cfg.loss != "global" or cfg.appearance or cfg.prune != "none":
            raise ValueError("--offload host trains with --loss global, without --appearance or --prune, for now")
        super().__init__(dataset, out_dir, cfg, backend, log)
        self.block_rows = block_rows
        self.blocks = None
        self.moved_bytes = 0

    # ------------------------------------------------------------------ the host model
    def start_from(self, model_state, strategy_state=None):
        self.model = GaussianModel.from_state(model_state, "cpu")  # the whole model, in host memory
        self.strategy_state = dict(strategy_state) if strategy_state else self.strategy.initialize_state()
        self._index()

    def _index(self):
        g = self.model.gaussians
        self.blocks = BlockIndex(g.means, g.scales, self.block_rows)

    def gather_state(self):
        return self.model.state(), {k: np.array(a) for k, a in self.strategy_state.items()}

    def whole_model(self):
        return self.model

    def view_image(self, gaussians, camera):
        """A view rendered from its working set on the device (the whole model need not fit there)."""
        rows = self.blocks.rows(self.blocks.visible(camera))
        return super().view_image(ns.Gaussians(*(self.xp.asarray(a[rows]) for a in gaussians.arrays().values())),
                                  camera)

    # ------------------------------------------------------------------ one step
    def train_step(self):
        c, host = self.cfg, self.model
        clock = PhaseClock(self.backend, self._timing())
        i = self.next_view()
        view = self.data.train[i]
        rows = self.blocks.rows(self.blocks.visible(view.camera))
        state = host.state()
        rows_state = {w: {g: a[rows] for g, a in state[w].items()} for w in ("params", "m", "v")}
        working = GaussianModel.from_state({**rows_state, "step": state["step"]}, self.backend)
        stats = {k: self.xp.asarray(a[rows]) for k, a in self.strategy_state.items() if len(a) == len(host)}
        self.moved_bytes = 2 * working.nbytes()
        clock.end("owner")
        g = working.gaussians
        p = ns.project(g, view.camera, sh_degree=self.sh_degree_now(), antialias=c.antialias, backend=self.backend,
                       check=False)
        clock.end("project")
        b = ns.bin_tiles(p, backend=self.backend)
        r = ns.rasterize(p, b, self.step_background(), self.backend)
        clock.end("render")
        loss, d_img = l1_ssim_loss(r.image, self.targets[i], c.lambda_dssim, backend=self.backend, lazy=True)
        clock.end("loss")
        grad = ns.rasterize_backward(p, b, r, d_img, backend=self.backend)
        clock.end("backward")
        ns.project_backward(g, p, grad, working.grad_gaussians, accumulate=False, backend=self.backend)
        self._progress_view = (r.image, self.targets[i])
        self.add_strategy_gradients(working, stats)  # the strategy's gradients and statistics: of the working set
        self.strategy.after_backward(working, stats, self.step, p, grad)
        lr, cols = self.learning_rates()
        working.adam.step(working.grads.data, cols, p.counts > 0)
        self.step += 1
        # back to the host: the rows' parameters, moments and statistics, and the boxes they grew
        back = working.state()
        for w in ("params", "m", "v"):
            for name, a in back[w].items():
                host.group(name, w)[rows] = a.reshape(host.group(name, w)[rows].shape)
        host.adam.step_count = back["step"]
        for k, a in stats.items():
            if k not in self.strategy_state:  # the statistics' first step: made for the whole model
                self.strategy_state[k] = np.zeros((len(host),) + a.shape[1:], a.dtype)
            self.strategy_state[k][rows] = _backend.to_host(a)
        clock.end("optimizer")
        events = self.strategy.after_optimizer(host, self.strategy_state, self.step, self.context(lr_means=lr["means"]))
        g_host = host.gaussians
        if len(host) != len(self.blocks.block) or "cloned" in events:
            self._index()  # new Gaussians, new rows: blocks anew
        else:
            self.blocks.grow(rows, g_host.means, g_host.scales)  # the working set: whole blocks
        self.stats = {"resident_gaussians": len(rows), "moved_bytes": self.moved_bytes, **clock.stats()}
        return loss, events

    def progress_psnr(self):
        from numbasplat.loss import psnr
        image, target = self._progress_view
        return psnr(image, target)

    def log_extra(self):
        return {**super().log_extra(), "resident_gaussians": self.stats.get("resident_gaussians", 0),
                "moved_bytes": self.stats.get("moved_bytes", 0)}
