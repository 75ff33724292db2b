"""The training recipe and the interface of its pipelines.

``Trainer.train`` is the 3DGS recipe, top to bottom as the reference
train.py: initialise the model, step until ``cfg.iterations`` (the schedules
of the views, SH degree, background and learning rates are here), log,
snapshot, evaluate.  How a step runs and where the model lives is a
pipeline's: a subclass implementing the hooks of ``Trainer``'s "what a
pipeline implements" section.

    engine/pipelines/single_gpu.py         one process, one view per step
    engine/pipelines/gaussian_exchange.py  P ranks own shards of the Gaussians and render ranges of the
                                 batch's tiles; projected Gaussians and their gradients cross
                                 ranks (Grendel's split, ByteSplat's sparse gradients)

Another pipeline (pixel-level exchange, out-of-core training) is one more
module implementing the same hooks, and a line in engine/pipelines/__init__.py's
``make_trainer`` that picks it.  Where the step's operators run is the
``placement``'s (``numbasplat.placement``): one device, or an aggregate device
whose parts split each operator (engine/pipelines/aggregate.py), with the same
trainer.
"""
import json
import math
import signal
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from numbasplat import backend as _backend
from numbasplat import device
from numbasplat.loss import psnr, ssim
from numbasplat.rendering import rasterize_tile_loss
from numbasplat.tile_loss import s3im_permutations
from numbasplat.optim import column_lrs, exp_decay
from numbasplat.placement import Placement
from data.atomic import atomic_path, remove_stale_temps

from engine.pipelines.options import PipelineOptions, check
from engine.stores.memory import MemoryStore
from engine.tools.outputs import SNAPSHOT, TensorBoardLog, lpips_metric, render_image, save_png, write_model_outputs
from .appearance import ColourCorrection
from .model import init_from_points
from .strategy import Context, DefaultStrategy, MCMCStrategy
from .targets import Targets
from .view_order import VIEW_ORDERS, epoch_order
from .workload import Workload



def initial_arrays(data, cfg, rng):
    """The Gaussians training starts from: the capture's SfM points, else random points in its box (or
    around its cameras), drawn from ``rng``."""
    box = data.init_box
    if box is None and len(data.points) == 0:  # no SfM points and no known bounds: a box around the cameras
        c = np.mean([np.linalg.inv(v.camera.viewmat)[:3, 3] for v in data.train], axis=0)
        box = (c - 1.3 * data.scene_scale, c + 1.3 * data.scene_scale)
    opacity, scale = starting_opacity_and_scale(cfg)
    arrays = init_from_points(data.points, data.colors, cfg.sh_degree, opacity=opacity, rng=rng,
                              n_random=cfg.n_random_init, box=box)
    arrays["scales"] += np.float32(np.log(scale))
    return arrays


REGULARISER_WEIGHT = 0.01  # gsplat's mcmc preset's opacity_reg and scale_reg
LATE_REGULARISERS = 7000   # the default strategy's regularisers start here: a 7k run is 3DGS's, a 30k run overfits less
MCMC_START = (0.5, 0.1)     # gsplat's mcmc preset (init_opa, init_scale): more opaque, smaller starting Gaussians
DEFAULT_START = (0.1, 1.0)  # 3DGS's


def starting_opacity_and_scale(cfg):
    """The starting Gaussians' opacity and their scale as a multiple of the RMS distance to their three
    nearest points: ``cfg.init_opacity``/``init_scale`` where set, else the strategy's (MCMC's regulariser
    kills Gaussians that start at 3DGS's 0.1: a third of mouse's in its first 500 steps)."""
    opacity, scale = MCMC_START if cfg.strategy == "mcmc" else DEFAULT_START
    return (opacity if cfg.init_opacity is None else cfg.init_opacity,
            scale if cfg.init_scale is None else cfg.init_scale)


def regularisers(cfg):
    """The strategy's regularisers (``opacity_reg``, ``scale_reg``, ``regularise_from``): ``cfg``'s where set, else
    0.01 each, from step 0 with mcmc and from ``LATE_REGULARISERS`` with the default strategy, whose opacity resets
    come before them.  Later captures of few views (mouse, office) overfit in a 30k run without them, and from the
    start they cost a 7k run on office (BENCHMARKS.md, issue 57)."""
    opacity = REGULARISER_WEIGHT if cfg.opacity_reg is None else cfg.opacity_reg
    start = (0 if cfg.strategy == "mcmc" else LATE_REGULARISERS) if cfg.regularise_from is None else cfg.regularise_from
    return dict(opacity_reg=opacity, scale_reg=opacity if cfg.scale_reg is None else cfg.scale_reg,
                regularise_from=start)


def crossed(prev, step, every):
    """Whether going from image ``prev`` to ``step`` crosses a multiple of ``every`` (0: none does)."""
    return bool(every) and prev // every != step // every


def reached_any(prev, step, steps):
    """Whether going from image ``prev`` to ``step`` reaches one of ``steps`` (prev < s <= step)."""
    return any(prev < s <= step for s in steps)


SHORTEST_DECAY = 7_000
"""The shortest default decay of the means' learning rate: a run shorter than this decays as the
start of a run this long (BENCHMARKS.md, "The means' learning rate on short runs")."""


def means_decay_steps(iterations):
    """The default length of the means' learning-rate decay (to ``lr_means_final``): the run (gsplat's
    rule), at least ``SHORTEST_DECAY`` and at most Inria's 30k.  On Inria's 30k schedule a 7k run is
    the start of a 30k one and ends with its means still moving at a third of their initial rate, which
    cost the generated cities 1.7-2.0 dB; a decay over a run much shorter than 7k stops the means
    before they reach their places (the demo: 26-29 dB over its 2000 steps against 36-37 over 7000).
    Measured in BENCHMARKS.md."""
    return min(max(iterations, SHORTEST_DECAY), 30_000)


MEANS_LR = 1.6e-4
"""3DGS's learning rate of the means (x scene scale), where training starts from SfM points."""


def means_learning_rate(random_start):
    """The default learning rate of the means: 3DGS's (``MEANS_LR``) from SfM points, twice it from
    random points (``random_start``: the capture has none), which start far from the surfaces and must
    travel to them.  Doubled, random starts gain and captures that start from SfM points lose
    (BENCHMARKS.md, "Quality that holds")."""
    return 2 * MEANS_LR if random_start else MEANS_LR


@dataclass
class TrainConfig:
    """A run's settings; the defaults are the reference 3DGS implementation's but for two, each
    measured on every scene we have (README): no screen-size prune, and the means' learning rate
    decaying over the run (at least 7k and at most 30k steps).  Every field is a flag of ``run.py train`` (its
    name with dashes) and a key of its ``--config`` file, and the comment beside a field (with the
    comment lines below it in the same column) is that flag's help."""
    iterations: int = 30_000          # training steps, in images
    sh_degree: int = 3                # the highest degree of the spherical harmonics of the colours (0-3)
    sh_increase_every: int = 1000     # one SH degree more every this many steps, up to sh_degree
    lambda_dssim: float = 0.2         # global loss: the weight l of (1 - l) L1 + l (1 - SSIM)
    loss: str = "global"              # global: L1 + windowed SSIM; tile: L1 + S3IM per tile (fused on GPUs)
    s3im_repeats: int = 10            # tile loss: arrangements of each tile's pixels into S3IM windows
    lambda_s3im: float | None = None  # tile loss: the weight of S3IM; None: ``s3im_weight`` of the data
    lr_means: float | None = None     # the means' learning rate (x scene scale), decaying to lr_means_final
                                      # (default: 1.6e-4 from SfM points, twice it from random ones)
    lr_means_final: float = 1.6e-6    # the means' learning rate (x scene scale) at step lr_means_steps
    lr_means_steps: int | None = None # the decay's length in steps (default: the run, at least 7k, at most 30k)
    lr_scales: float = 5e-3           # the learning rate of the log-scales
    lr_quats: float = 1e-3            # the learning rate of the rotations (quaternions)
    lr_opacities: float = 5e-2        # the learning rate of the opacity logits
    lr_sh: float = 2.5e-3             # the learning rate of the colours' SH degree 0;
                                      # the higher bands train 20x slower
    strategy: str = "default"         # default | mcmc
    cap_max: int = 1_000_000          # mcmc: the most Gaussians
    opacity_reg: float | None = None  # the weight of the L1 regulariser on opacities (unset: 0.01)
    scale_reg: float | None = None    # the weight of the L1 regulariser on scales (unset: as opacity_reg's)
    regularise_from: int | None = None  # the regularisers act from this step (unset: 7000 with the default
                                      # strategy, whose opacity resets stop there, 0 with mcmc)
    mcmc_noise_lr: float = 5e5        # mcmc: the scale of the noise on the means (x their learning rate)
    init_opacity: float | None = None # the starting Gaussians' opacity (unset: 0.5 with mcmc, 0.1 with the default
                                      # strategy, as gsplat's presets)
    init_scale: float | None = None   # the starting Gaussians' scale, x the RMS distance to their 3 nearest points
                                      # (unset: 0.1 with mcmc, 1 with the default strategy, as gsplat's presets)
    max_gaussians: int = 0            # memory guard for the default strategy (0: device capacity)
    absgrad: bool = False             # default strategy: densify on the absolute screen-space gradients
    grad_threshold: float = 2e-4      # default strategy: densify Gaussians whose mean screen-space gradient
                                      # reaches this
    densify_from: int = 500           # default strategy: the first step that densifies and prunes
    densify_until: int = 15_000       # default strategy: no densification or opacity reset from this step
    densify_every: int = 100          # default strategy: densify and prune every this many steps
    opacity_reset_every: int = 3000   # default strategy: set every opacity to at most 0.01 every this many steps
    opacity_reset: bool = True        # default strategy: reset the opacities at all (gsplat 1.5.3 never does;
                                      # the prunes of large Gaussians still begin after opacity_reset_every)
    prune_opacity: float = 0.005      # default strategy: prune Gaussians less opaque than this
    max_screen_size: float = 0.0      # default strategy: after the first opacity reset, prune Gaussians whose
                                      # radius reached this many pixels (0: never, as gsplat's default and, in
                                      # effect, Inria's; 3DGS's paper says 20: measured in BENCHMARKS.md)
    percent_dense: float = 0.01       # default strategy: Gaussians larger than this (x scene scale) split,
                                      # smaller ones clone
    prune: str = "none"               # ByteSplat's pruning at densify_until (engine/recipe/pruning.py): none, contribution,
                                      # or hardware (then to the fused kernel's budget); its fine-tuning counts
                                      # in the iterations
    prune_fine_tune: int = 10000      # pruning: images of fine-tuning after contribution pruning (I_M)
    prune_round_fine_tune: int = 500  # pruning: images of fine-tuning after each hardware round (I_o)
    prune_beta: float = 10.0          # pruning: percent of the candidates a hardware round removes
    prune_rounds: int = 5             # pruning: hardware rounds at most
    smem_budget: int = 0              # pruning: shared memory per block to fit, bytes (0: the GPU's; an H200's
                                      # without a GPU)
    batch_lr_exponent: float = 0.5    # at batch B the learning rates are scaled by B ** this (Grendel: sqrt)
    random_background: bool = False   # render each step on a random background colour (the targets keep theirs)
    background: tuple = (0.0, 0.0, 0.0)  # the background colour, RGB in [0, 1]
    antialias: bool = False           # Mip-Splatting's 2D filter, compensating the opacity
    visible_adam: bool = False        # Adam updates only the Gaussians the step saw
    importance_every: int = 0         # BlitzGS (engine/recipe/workload.py): score every Gaussian's T * alpha over the
                                      # training views every N steps and at 90% of the run (0: never)
    importance_prune: float = 0.0     # BlitzGS: the importance pass prunes Gaussians whose importance over the
                                      # largest is below this (0: none)
    view_masks: str = "off"           # BlitzGS: on: until the next importance pass each view skips the
                                      # Gaussians that contributed under view_mask_below to it; auto: the views
                                      # whose share of the Gaussians in them was under cull_share_below do
    view_mask_below: float = 1 / 255  # BlitzGS: a view's mask holds the Gaussians whose T * alpha sum in it
                                      # is below this
    lod_min_px: float = 0.0           # BlitzGS: a training view skips Gaussians whose 3-sigma footprint is
                                      # under this many pixels (0: none; evaluation renders all; each
                                      # importance pass spares those it would hide from every view)
    lod_views: str = "all"            # BlitzGS: the views the LOD gate applies to: all, or auto: those whose share
                                      # of the Gaussians in them was under cull_share_below at the last pass
    cull_share_below: float = 0.3     # BlitzGS: with --view-masks auto or --lod-views auto, the share of the
                                      # Gaussians in a view (measured by each importance pass) under which the
                                      # view is culled
    appearance: bool = False          # a per-image affine colour correction that the loss sees, for captures
                                      # whose exposure varies (engine/recipe/appearance.py; not for held-out views)
    lr_appearance: float = 1e-3       # the learning rate of the colour corrections
    step_graphs: str = "on"           # on a GPU, a single process replays each view's step as a CUDA graph
                                      # (engine/pipelines/step_graphs.py): one launch where Python queued ~35
    fuse_adam: str = "off"            # on: a single process applies Adam's update in the projection backward's
                                      # kernels wherever that is exact (engine/pipelines/single_gpu.py): no
                                      # gradient buffer written and read back, no launch of Adam's own (off
                                      # until timed on a GPU: BENCHMARKS.md, the rasterizer)
    targets: str = "auto"             # the training images on the GPU: float32, or uint8 (a quarter of the
                                      # memory, rounded to 8 bits: exact for 8-bit images the loader left as
                                      # they were); auto: uint8 where float32 would take over an
                                      # eighth of the GPU's memory (engine/recipe/targets.py)
    snapshot_every: int = 5000        # write OUT/snapshot.h5 every this many steps (0: at the end only)
    log_every: int = 100              # a line of OUT/log.jsonl every this many steps
    save_at: tuple = (7_000, 30_000)  # also write the model at these steps (OUT/point_cloud/iteration_N, as Inria's
                                      # save_iterations; 0: only at the end)
    eval_at: tuple = (7_000, 30_000)  # also score the views at these steps, as --eval-every (Inria's test_iterations;
                                      # 0: none)
    eval_every: int = 0               # every this many steps, the test views' PSNR and SSIM and that of up to 5
                                      # training views into log.jsonl, as Inria's test_iterations (0: never; not
                                      # at a step that reset the opacities, when every Gaussian is translucent)
    tensorboard: bool = False         # the log's scalars as TensorBoard events in OUT too (tensorboardX)
    view_order: str = "auto"          # each epoch's order of the views: random (3DGS), trajectory (a tour along the
                                      # cameras: consecutive views see much the same), auto: trajectory when
                                      # offloading and the device cannot hold every block, else random
    seed: int = 0                     # the random seed (the views' order, random points, densification)
    deterministic: bool = False       # the same bits at every run of one seed and data: on a GPU the raster backward
                                      # sums each Gaussian's gradient in a fixed order, not by float atomics (384
                                      # bytes of scratch per tile intersection; one process, the global loss)
    n_random_init: int = 100_000      # random points to start from when the capture has no SfM points


PHASES = ("project", "plan", "forward_exchange", "render", "halo_exchange", "loss", "backward",
          "backward_exchange", "owner", "optimizer", "refine", "reduce")
"""The phases of a step, in order, named alike in every pipeline (each runs those it has):
projection of the model's (or shard's) Gaussians for the step's views; the send plan (which
records go to which renderer, and the counts' exchange); the records' exchange; binning and
rasterization (with ``--loss tile`` also the loss and raster backward, one fused kernel); the
rendered tiles that the global loss needs from other renderers; the loss and its image
gradient; the raster backward; the gradients' exchange back to the owners; the owners'
projection backward and the strategy's statistics; Adam; the strategy's refinements and resets
(and the pixel exchange's migrations: steps where none acts take no time there, so that a logged
step, which a refinement's often is, still shows Adam's time alone); the ranks' sum of the loss and
the tile costs."""


class PhaseClock:
    """The times of one step's phases (``PHASES``): ``end(phase)`` closes the phase that began at the
    previous mark (or at the start).

    ``synced``: the device is waited for at the start and at every mark, so that a phase's time
    is the device's work in it and not only the host's queueing of it (a sync costs the overlap
    of host and device work, so not on every step).  ``times``: seconds per phase, from mark to
    mark; ``host``: the host's part of each, from the previous mark until the host had queued
    the phase (its own waits for the device inside the phase included), before the wait at its end."""

    def __init__(self, backend, synced):
        self.backend, self.synced = backend, synced
        self.times, self.host = {}, {}
        if synced:
            _backend.synchronize(backend)
        self._last = time.perf_counter()

    def end(self, phase):
        queued = time.perf_counter()
        if self.synced:
            _backend.synchronize(self.backend)
        done = time.perf_counter()
        self.host[phase] = self.host.get(phase, 0.0) + queued - self._last
        self.times[phase] = self.times.get(phase, 0.0) + done - self._last
        self._last = done

    def stats(self):
        """What a pipeline keeps of the step's timing (its ``stats``)."""
        return {"timed": self.synced, "times": self.times, "host": self.host}


class Interrupted(KeyboardInterrupt):
    """Training stopped by signal ``signum`` during step ``step``; ``saved``: at a step boundary, every
    rank with it, after writing the snapshot (else at once, mid-step, without one).  Processes
    exit with ``exit_code``, the shell's 128 + signal number."""

    def __init__(self, signum, step=None, saved=False):
        super().__init__(signal.Signals(signum).name + ("" if step is None else f" at step {step}"))
        self.signum, self.step, self.saved = signum, step, saved
        self.exit_code = 128 + signum


# Ctrl-C, and what schedulers (Slurm, PBS, a closed terminal) send some time before they kill a job
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """Between ``install`` and ``restore``, the ``STOP_SIGNALS`` ask training to stop at the next step
    boundary.

    A Python signal handler runs between any two bytecodes: mid-step a snapshot would hold a
    half-updated model, and under MPI the ranks would stop in different collectives and the
    snapshot's gathers would hang.  So a signal only sets ``received``; the training loop reads
    it between steps, a pipeline over ranks agreeing on it first, so that all ranks stop after
    the same step.  A second SIGINT (Ctrl-C again) stops at once; a repeated SIGTERM or SIGHUP
    (a scheduler may signal every process and a launcher forward the same signal) changes nothing."""

    def __init__(self):
        self.received = 0   # this process's first stop signal (0: none)
        self._previous = {}

    def install(self):
        """Catch the stop signals, except those that this process was told to ignore (``nohup``
        ignores SIGHUP so that closing the terminal does not end the run: it still does not)."""
        self.received = 0
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS
                              if signal.getsignal(s) is not signal.SIG_IGN}
        except ValueError:  # not the main thread, where Python runs handlers: the signals stay as they were
            self._previous = {}

    def restore(self):
        """Put back the handlers that ``install`` replaced."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        if not self.received:
            self.received = signum
        elif signum == signal.SIGINT:
            raise Interrupted(signum)


def s3im_weight(dataset):
    """The tile loss's S3IM weight where none is given. To match the global loss, objects cut out
    onto a plain background want 0.5 (lego) and real captures 0.2 (fern): BENCHMARKS.md, issue 5."""
    return 0.5 if dataset.masked else 0.2


class Trainer(ABC):
    """The recipe and the state that every pipeline shares: the config, the data, one RNG
    (seeded alike on every rank, so ranks draw the same), the step count (in images), the
    views' order, the strategy, and ``store``: where this process's Gaussians (the whole model
    or its shard) and their strategy state live (``engine.stores.memory``: in memory, or out of core).
    ``model`` and ``strategy_state`` are the store's between steps."""

    is_root = True  # writes the logs and outputs (rank 0 under MPI)
    batch = 1  # views per step (a batched pipeline sets its batch size)
    time_phases = False  # sync at the phase boundaries (PhaseClock): True every step, False never, None at log steps
    culls_views = False  # runs the workload switches (engine/recipe/workload.py): its step hides what ``workload.cull`` skips
    supports_deterministic = False  # trains the same bits at every run of one seed and data (``--deterministic``)
    comm = None  # the MPI ranks it trains over (None: one process)
    # the pipeline options it was made with: each constructor adds its own before ``__init__`` checks them all
    options = PipelineOptions()

    def __init__(self, dataset, out_dir, cfg: TrainConfig, backend=None, log=print, store=None, placement=None,
                 options=None):
        """``store``: where the Gaussians live (default: a ``MemoryStore``); ``placement``: where the step's
        operators run (``numbasplat.placement``; default: each the one call on this process's device,
        else split across the parts of an aggregate device, engine/pipelines/aggregate.py); ``options``:
        the ``PipelineOptions`` it is made with, where the pipeline's class does not set them."""
        if options is not None:
            self.options = options
        if cfg.lambda_s3im is None:
            cfg = replace(cfg, lambda_s3im=s3im_weight(dataset))
        if cfg.lr_means_steps is None:
            cfg = replace(cfg, lr_means_steps=means_decay_steps(cfg.iterations))
        if cfg.lr_means is None:  # a start from a given model (--init-ply) sets it before
            cfg = replace(cfg, lr_means=means_learning_rate(random_start=len(dataset.points) == 0))
        check(cfg, self.options, self.comm, type(self))
        if cfg.view_order not in VIEW_ORDERS:
            raise ValueError(f"--view-order {cfg.view_order}: unknown (one of {', '.join(VIEW_ORDERS)})")
        self.data = dataset
        self.cfg = cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.backend = backend or _backend.BACKEND
        self.xp = _backend.array_module(self.backend)
        self.log = log
        self.placement = placement or Placement(backend=self.backend)
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.train_seconds = 0.0
        self.peak_pool_bytes = 0
        self.strategy = self._make_strategy()
        self.store = store or MemoryStore()
        self.targets = Targets([v.image for v in dataset.train], cfg.targets, self.backend)
        note = self.targets.describe()
        if note:
            self.log(note)
        self.stats = {}  # the last step's phase times (PhaseClock) and a pipeline's exchange statistics
        self.order = []
        self.train_until = None  # the step where the current ``train`` stops (None: cfg.iterations)
        self.signals = StopSignals()
        # called after every step as hook(trainer, the log record or None), each returning the seconds it
        # held the loop that are not training (a viewer's pause): engine/tools/viewer.py's LiveView
        self.step_hooks = []
        self.appearance = None
        if cfg.appearance:
            self.appearance = ColourCorrection(len(dataset.train), cfg.lr_appearance, self.backend)
        self.workload = Workload(cfg, len(dataset.train))
        self.store.open(backend=self.backend, views=dataset.train, images_bytes=self.targets.device_bytes,
                        betas=self.adam_betas(), fresh_statistics=lambda xp, n: self.strategy.fresh_statistics(xp, n))

    @property
    def model(self):
        """This process's Gaussians between steps (``store.model``): a ``GaussianModel``, or an out-of-core
        store's stand-in for it (its size and SH bases); None before the start."""
        return self.store.model

    @property
    def strategy_state(self):
        """The strategy's state of ``model``'s rows (``store.state``)."""
        return self.store.state

    @strategy_state.setter
    def strategy_state(self, state):
        self.store.hold(self.store.model, state)

    def close(self):
        """Release what the store holds outside the model (disk mode's files, page-locked memory)."""
        self.store.close()

    def _make_strategy(self):
        c = self.cfg
        regs = regularisers(c)
        if c.strategy == "default":
            # no refinement or opacity reset at the last step: nothing would train what they change
            return DefaultStrategy(grad_threshold=c.grad_threshold, refine_start=c.densify_from,
                                   refine_stop=min(c.densify_until, c.iterations), refine_every=c.densify_every,
                                   reset_every=c.opacity_reset_every, prune_opacity=c.prune_opacity,
                                   max_screen_size=c.max_screen_size, reset=c.opacity_reset,
                                   percent_dense=c.percent_dense, absgrad=c.absgrad,
                                   reset_at_start=tuple(c.background) == (1.0, 1.0, 1.0), **regs)
        if c.strategy == "mcmc":
            return MCMCStrategy(cap_max=c.cap_max, noise_lr=c.mcmc_noise_lr, **regs)
        raise ValueError(f"unknown strategy {c.strategy!r} (default or mcmc)")

    # ------------------------------------------------------------------ the recipe
    def train(self, progress=True, until=None):
        """Train to ``cfg.iterations`` (or stop early at step ``until``) and write a snapshot.

        SIGINT, SIGTERM and SIGHUP stop training at the next step boundary, where every rank
        writes the snapshot together, then raise ``Interrupted`` (see ``StopSignals``)."""
        c = self.cfg
        until = c.iterations if until is None else min(until, c.iterations)
        self.train_until = until  # (a pipeline with steps in flight empties there)
        if self.model is None:
            self.init_model()
        self.check_ranks_agree()
        run = self._open_run(progress)
        self.signals.install()
        try:
            run.start_clock()
            self.workload.warm(self)  # (the pass's kernels compiled now: each pass's time is its own)
            while self.step < until:
                prev = self.step
                loss, events = self.train_step()
                self._after_train_step(prev, loss, events, run)
            run.bank_time()
            run.bar.close()
            self.save_snapshot()
            write_model_outputs(self)
            signum = self.stop_signal()  # came after the last step's check: stop all the same
            if signum:
                raise self._stopped_by(signum)
        except KeyboardInterrupt as e:
            if not getattr(e, "saved", False):  # a second Ctrl-C: no snapshot of a half-done step
                run.bank_time()
                run.bar.close()
                self.log(f"interrupted at step {self.step}: no snapshot written now (the last one is kept)")
            raise
        finally:
            run.close()  # (an error's line then starts a line of its own)
            self.signals.restore()
        return self

    def _open_run(self, progress):
        """The outputs of one ``train`` call (``TrainingRun``): on the root rank the JSON-lines log (and
        the temporary files an interrupted write left in OUT removed: nothing writes to OUT now) and
        TensorBoard's, on every rank the progress bar."""
        logf = tensorboard = None
        if self.is_root:
            removed = remove_stale_temps(self.out)  # left by a crash mid-write
            if removed:
                self.log(f"removed {len(removed)} temporary file(s) that an interrupted write left in {self.out}: "
                         + ", ".join(removed))
            logf = self._open_log()
            tensorboard = TensorBoardLog(self.out, purge_step=self.step) if self.cfg.tensorboard else None
        return TrainingRun(self, logf, tensorboard, Progress(self.cfg.iterations, self.step, enabled=progress))

    def _after_train_step(self, prev, loss, events, run):
        """What the recipe does after a step from image ``prev`` (``loss``, ``events``: ``train_step``'s):
        an importance pass, the scores, the log record, the step hooks, the model's outputs and the
        snapshot where due, and the stop at a stop signal (``run``: the ``TrainingRun``)."""
        c = self.cfg
        if self.workload.scores_after(prev, self.step, self.strategy):
            events = {**events, **self.workload.score(self)}
        run.bar.update(self.step)
        if events:
            self._device_memory_peak(release_cache=True)
        scores = {}
        if ((crossed(prev, self.step, c.eval_every) or reached_any(prev, self.step, c.eval_at))
                and not events.get("opacity_reset")):
            scores = run.untimed(self.scores_during_training)
        rec = None
        if crossed(prev, self.step, c.log_every) or events or scores or self.step == c.iterations:
            rec = self._log_step(loss, events, scores, run)
        for hook in self.step_hooks:
            run.exclude(hook(self, rec) or 0.0)  # (time paused is not training time)
        if reached_any(prev, self.step, c.save_at) and self.step < c.iterations:  # (the end writes it anyway)
            run.untimed(write_model_outputs, self)
        signum = self.stop_signal()
        if (crossed(prev, self.step, c.snapshot_every) and self.step < c.iterations) or signum:
            run.bank_time()
            self.save_snapshot()
        if signum:
            run.bar.close()
            raise self._stopped_by(signum)

    def _log_step(self, loss, events, scores, run):
        """The log record of this step (``loss``: its loss, read now: a device sync; ``events``,
        ``scores``: the strategy's and the scores' fields), written to ``run``'s logs and shown on
        its progress bar.  -> the record."""
        loss = float(loss)  # a LazyLoss: read at log steps only
        self._check_finite(loss)
        p = self.progress_psnr()
        rec = {"step": self.step, "loss": loss, "psnr": p, "gaussians": len(self.model), "time": run.seconds(),
               **events, **scores, **self.log_extra()}
        run.write(rec)
        if run.tensorboard and scores:
            run.tensorboard.image("test/view_0" if self.data.test else "train/view_0", self.scored_image, self.step)
        run.bar.show(loss, p, rec.get("gaussians_total", len(self.model)), self.progress_extra(rec))
        return rec

    def _stopped_by(self, signum):
        """-> the ``Interrupted`` of a stop at a step boundary, the snapshot written, and say so."""
        self.log(f"{signal.Signals(signum).name}: stopped at step {self.step}, snapshot in {self.out / SNAPSHOT}")
        return Interrupted(signum, self.step, saved=True)

    def _open_log(self):
        """``OUT/log.jsonl``, opened to append from this step: its records of later steps (written
        after the snapshot that this run resumes from, or by an earlier run in OUT) are dropped, so
        that the log reads as one run."""
        path = self.out / "log.jsonl"
        if path.exists():
            lines = path.read_text().splitlines(keepends=True)
            kept = [line for line in lines if _logged_step(line) <= self.step]
            if len(kept) < len(lines):
                with atomic_path(path) as tmp:
                    Path(tmp).write_text("".join(kept))
        return open(path, "a")

    def init_model(self):
        """The model to start from (``initial_arrays``)."""
        self.start_from({"params": initial_arrays(self.data, self.cfg, self.rng)})

    def fine_tune_from_here(self, images):
        """Train ``images`` more steps with densification and opacity resets off from this step on
        (the model's rows may have changed: the strategy starts afresh)."""
        self.cfg.densify_until = self.step
        self.cfg.iterations = self.step + images
        self.strategy = self._make_strategy()
        self.strategy_state = self.strategy.initialize_state()
        if images:
            self.train(progress=False)

    # ------------------------------------------------------------------ what a pipeline implements
    @abstractmethod
    def start_from(self, model_state, strategy_state=None):
        """Start from the whole model's ``GaussianModel.state()`` (host arrays; the parameters alone
        for a new model) and the strategy's state (None: a new one).  A pipeline that shards the
        Gaussians keeps its rows of both."""

    @abstractmethod
    def gather_state(self):
        """-> (the whole model's ``state()``, the strategy's state), host arrays, on the root rank;
        None on the others.  Collective: every rank calls it."""

    def whole_state(self):
        """What ``gather_state`` gives, for a pass that cuts the model's rows and starts again from
        them (``start_from``): a pipeline holding the whole model in this process may give its own
        device arrays instead of host copies (read them before changing the model).  Collective."""
        return self.gather_state()

    def saved_state(self):
        """What ``gather_state`` gives, for a snapshot: a pipeline may give arrays that the snapshot reads a
        slice of rows at a time (``TableRows``: an out-of-core model is not gathered).  Collective."""
        return self.gather_state()

    def saved_gaussians(self):
        """The whole model's ``Gaussians`` for the PLY on the root rank (None on the others), which it may
        read a slice of rows at a time, as ``saved_state``'s.  Collective."""
        model = self.whole_model()
        return None if model is None else model.gaussians

    @abstractmethod
    def whole_model(self):
        """The whole model (a ``GaussianModel``) on the root rank, which evaluates it; None on the
        others.  Collective."""

    def view_model(self, most):
        """The model a viewer shows (``engine/tools/viewer.py``), as ``numbasplat.Gaussians`` on the root
        rank's device, None on the others: here the whole model, which this process holds.  A
        pipeline over ranks gathers at most ``most`` Gaussians.  Collective."""
        return self.model.gaussians

    @abstractmethod
    def train_step(self):
        """One step: render the step's views, loss, backward, Adam, the strategy's hooks; advances
        ``step`` by the views trained.  -> (loss, events): the loss may be a ``LazyLoss`` (``float``
        reads it: a device sync), events the strategy's dict of what it did."""

    @abstractmethod
    def progress_psnr(self):
        """PSNR of the last step's first view, for the progress line and the log (called at log
        steps only: it syncs).  Collective."""

    def log_extra(self):
        """More fields for the JSON-lines log: the fused-tile fractions with ``--loss tile``
        (a multi-rank pipeline adds its exchange statistics).  Collective."""
        return {**getattr(self, "tile_stats", {}), **self.workload.log_fields(),
                **self.store.log_fields(self.step, self._device_memory_peak)}

    def progress_extra(self, record):
        """More for the progress line, from the log step's ``record`` ("": nothing): the store's."""
        return self.store.progress_text(record)

    def pipeline_arrays(self):
        """The pipeline's own state that its next steps depend on, for the snapshot: {name: host array}
        (here none).  Collective callers: the root rank's is written."""
        return {}

    def restore_pipeline_arrays(self, arrays):
        """Take back what ``pipeline_arrays`` gave, from a snapshot ({} from one without it)."""

    def barrier(self):
        """Wait for every rank (a pipeline of one process has none to wait for)."""

    def from_root(self, value):
        """``value`` as the root rank has it, on every rank (a pipeline of one process has it).
        Collective."""
        return value

    def check_ranks_agree(self):
        """Stop with one message if the ranks were given different options or see other data
        (a pipeline of one process has nothing to compare).  Collective."""

    def loop_acts_after(self, prev, step):
        """Whether ``train``'s loop does more after a step from image ``prev`` to ``step`` than log it:
        it stops there (its ``until``), writes a snapshot or the model, scores the views or runs an
        importance pass (where a pipeline with steps in flight empties)."""
        c = self.cfg
        until = min(self.train_until or c.iterations, c.iterations)
        return (step >= until or crossed(prev, step, c.snapshot_every) or crossed(prev, step, c.eval_every)
                or reached_any(prev, step, c.eval_at) or reached_any(prev, step, c.save_at)
                or self.workload.scores_after(prev, step, self.strategy))

    def stop_signal(self):
        """The signal to stop for at this step boundary (0: none; see ``StopSignals``): here this
        process's.  A pipeline over ranks returns the one that every rank stops for.  Collective."""
        return self.signals.received

    def _timing(self):
        """Whether this step syncs the device at its phase boundaries, so that the phase times are
        the device's and not the host's: when ``time_phases`` says so; None: on the steps that
        will be logged (a sync costs the overlap of host and device work)."""
        if self.time_phases is not None:
            return self.time_phases
        every = self.cfg.log_every
        return bool(every) and (self.step + self.batch) // every != self.step // every

    # ------------------------------------------------------------------ the step's schedules
    def adam_betas(self):
        """Adam's betas (3DGS's) raised to the batch size: a step of B views decays the moments as B
        steps would (Grendel's batched Adam)."""
        return 0.9 ** self.batch, 0.999 ** self.batch

    def next_view(self):
        """The next training view: every view once per epoch, in an order drawn from the RNG
        (``cfg.view_order``: a permutation, or a tour along the cameras)."""
        if not self.order:
            kind = self.epoch_view_order()
            order = epoch_order(kind, [v.camera for v in self.data.train], self.rng, self.data.scene_scale)
            self.order = order if kind == "random" else order[::-1]  # popped from its end
        return int(self.order.pop())

    def upcoming_views(self, n):
        """The next step's ``n`` training views, where known (the epoch's order holds them): a hint for a
        store that moves their Gaussians ahead."""
        return self.order[::-1][:n] if len(self.order) >= n else []

    def epoch_view_order(self):
        """This epoch's order of the views: ``cfg.view_order``, auto being random (3DGS)."""
        return "random" if self.cfg.view_order == "auto" else self.cfg.view_order

    def step_background(self):
        """The step's background: drawn with ``random_background`` (the render's only, as in 3DGS)."""
        c = self.cfg
        return self.rng.random(3) if c.random_background else np.asarray(c.background, np.float64)

    def sh_degree_now(self, step=None):
        """The SH degree trained at this step (or at ``step``): one band more every ``sh_increase_every`` steps."""
        return min(self.cfg.sh_degree, (self.step if step is None else step) // self.cfg.sh_increase_every)

    def learning_rates(self, batched=False):
        """-> ({group: learning rate}, per-column rates for Adam): the means' decays over ``lr_means_steps``.
        ``batched``: the rates of a step of ``batch`` views, times B ** ``batch_lr_exponent`` (Grendel's
        scaling: one Adam step on the mean gradient of B views moves as far as about B steps would)."""
        c = self.cfg
        lr_means = exp_decay(c.lr_means * self.data.scene_scale, c.lr_means_final * self.data.scene_scale,
                             self.step, c.lr_means_steps)
        lr = {"means": lr_means, "scales": c.lr_scales, "quats": c.lr_quats, "opacities": c.lr_opacities,
              "sh": c.lr_sh}
        cols = column_lrs(lr, self.model.sh_bases)
        if not batched:
            return lr, cols
        scale = self.batch ** c.batch_lr_exponent
        return {g: rate * scale for g, rate in lr.items()}, cols * scale

    def context(self, **step):
        """The strategy's ``Context``: the scene scale, the RNG, the memory guard's limits, and a
        pipeline's ``step`` fields (the step's learning rate, this rank's rows)."""
        in_device_memory = not self.store.out_of_core and not self.placement.managed  # (managed: pages to the host)
        free = device.free_bytes if _backend.on_gpu(self.backend) and in_device_memory else 0
        return Context(self.data.scene_scale, self.rng, self.cfg.max_gaussians, free, **step)

    def gaussian_total(self):
        """The whole model's Gaussians (``RankedTrainer``: over every rank's shard)."""
        return len(self.model)

    # ------------------------------------------------------------------ the step body: per view, in every pipeline
    def project_view(self, model, state, i, degree):
        """Training view ``i``'s projection of ``model`` (this process's Gaussians, or the step's working set;
        ``state`` its strategy state) at SH degree ``degree``, less what the view's mask and LOD gate skip
        (``workload.cull``); unchecked (a check syncs: it runs at log steps)."""
        g = model.gaussians
        p = self.placement.project(g, self.data.train[i].camera, sh_degree=degree, antialias=self.cfg.antialias,
                                   check=False)
        return self.workload.cull(p, g, state, i, self.backend)

    def view_loss(self, image, target, tiles=None):
        """The global loss (L1 + SSIM) of a training view's ``image`` against its ``target``
        (``targets[view]``), over the tiles ``tiles`` (first, last: a renderer's share; None: the whole
        view), lazy (read at log steps).  -> (loss, its gradient with respect to ``image``)."""
        return self.placement.image_loss(image, target, self.cfg.lambda_dssim, tiles=tiles)

    def s3im_permutations(self):
        """The tile loss's arrangements of a view's pixels into S3IM windows, drawn from the RNG (host)."""
        return s3im_permutations(self.rng, self.cfg.s3im_repeats)

    def tile_loss(self, p, binning, target, perms, bg, **fused):
        """``--loss tile``'s render, loss and raster backward of one view in one pass (ByteSplat's fused
        kernel on GPUs): ``perms`` its S3IM arrangements, ``fused`` ``rasterize_tile_loss``'s options (a
        renderer's ``tiles``, the ``grad`` to add into, ``want_image``).  Keeps its statistics in
        ``tile_stats`` for the log.  -> (loss, screen-space gradients, image)."""
        loss, grad, image, self.tile_stats = rasterize_tile_loss(
            p, binning, target, self.xp.asarray(perms), self.cfg.lambda_s3im, bg, backend=self.backend, lazy=True,
            **fused)
        return loss, grad, image

    def owner_backward(self, model, state, projections, grads, skip=None):
        """The owner's part of the step's backward: each view's projection backward into ``model``'s
        gradients (the first view's writes them, the rest add), each view's screen-space statistics for
        the strategy (a batch's view sees its own gradient, not its 1/B share of the batch loss; ``skip``:
        the device flag of a step the optimizer skips), then the strategy's regularisers' gradients, made
        from the parameters before the backward, which may write the gradients over them
        (``GaussianModel.grads_over_params``).  On the device alone (a step graph may capture it).  -> the
        rows that visible-only Adam updates: those any view drew (None: ``visible_adam`` off)."""
        seen = None
        regularisers = self.strategy.loss_gradients(model, self.strategy_state if state is None else state, self.step,
                                                    self.gaussian_total()) or {}
        for n, (p, grad) in enumerate(zip(projections, grads)):
            self.placement.project_backward(model.gaussians, p, grad, model.grad_gaussians, accumulate=n > 0)
            self.strategy.after_backward(model, state, self.step, p, grad, self.batch, skip=skip)
            if self.cfg.visible_adam:
                seen = p.counts > 0 if seen is None else seen | (p.counts > 0)
        for k, v in regularisers.items():
            getattr(model.grad_gaussians, k)[...] += v
        return seen

    def _check_finite(self, loss=None, model=None):
        """Stop with a clear message if training diverged (rendering skips this per-step sync),
        naming which attributes of how many Gaussians went non-finite and the step's loss
        (``model``: the Gaussians to check, default the store's last trained: none after a view trained in chunks,
        whose rows the store checks as they come back)."""
        model = self.store.recent() if model is None else model
        if model is None:
            return
        xp = model.xp  # (the device's, or the host's where the store holds the model there: after a chunked view)
        if bool(xp.isfinite(model.params.data).all()):
            return
        g = model.gaussians
        bad = []
        for name, a in g.arrays().items():
            n = int((~xp.isfinite(a.reshape(len(a), -1)).all(axis=1)).sum())
            if n:
                bad.append(f"{name} of {n}")
        raise FloatingPointError(f"training diverged before step {self.step}: non-finite {', '.join(bad)} of "
                                 f"{len(g)} Gaussians, step loss {loss} (the last snapshot is kept; try lower "
                                 "learning rates)")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, views=None, save_dir=None, lpips=True, model=None):
        """PSNR, SSIM and LPIPS (with the ``metrics`` extra; ``lpips=False``: not computed) of the
        whole model on ``views`` (the test split).  With ``save_dir``, each render and its ground
        truth side by side as Inria's render.py writes them (``save_dir/renders/00000.png``,
        ``save_dir/gt/00000.png``, in the order of ``views``), so that Inria's metrics.py reads
        them.  Computed on the root rank, None on the others; collective, unless the root's caller
        gives the ``model`` it gathered (``whole_model``) and the others call it not at all."""
        model = self.whole_model() if model is None else model
        if model is None:
            return None
        views = self.data.test if views is None else views
        perceptual = lpips_metric(self.log) if lpips and views else None
        per_view = []
        for i, v in enumerate(views):
            img = self.view_image(model, v.camera)
            gt = self.xp.asarray(v.image)
            rec = {"name": v.name, "psnr": psnr(img, gt), "ssim": ssim(img, gt, backend=self.backend)}
            if perceptual is not None:
                rec["lpips"] = perceptual(img, gt)
            if save_dir is not None:
                rec["file"] = f"{i:05d}.png"
                save_png(Path(save_dir) / "renders" / rec["file"], _backend.to_host(img))
                save_png(Path(save_dir) / "gt" / rec["file"], v.image)
            per_view.append(rec)

        def mean(key):
            return float(np.mean([r[key] for r in per_view])) if per_view and key in per_view[0] else None
        summary = {"psnr": mean("psnr"), "ssim": mean("ssim"), "lpips": mean("lpips"),
                   "views": per_view, "gaussians": len(model), "train_seconds": self.train_seconds,
                   "iterations": self.step, "peak_device_bytes": self._device_memory_peak()}
        if self.workload.passes:
            summary["importance_seconds"] = self.workload.seconds
        if self.workload.warmup_seconds:
            summary["importance_warmup_seconds"] = self.workload.warmup_seconds
        return summary

    def scores_during_training(self):
        """``--eval-every``'s and ``--eval-at``'s log fields: test_psnr and test_ssim over the test views
        (where the capture holds some out), train_psnr over up to 5 training views spread through the
        split (fixed, so that the curve compares like with like); with ``--tensorboard``,
        ``scored_image`` the first scored view's render (host).  Collective; the root rank's fields,
        {} on the others."""
        train = self.data.train[::max(1, -(-len(self.data.train) // 5))]
        model = self.whole_model()  # (collective: gathered once for every score)
        if model is None:
            return {}
        fields = {}
        for name, views in (("test", self.data.test), ("train", train)):
            if views:
                res = self.evaluate(views, lpips=False, model=model)
                fields[f"{name}_psnr"] = res["psnr"]
                if name == "test":
                    fields["test_ssim"] = res["ssim"]
        if self.cfg.tensorboard:  # (the first scored view's render, for its image event)
            first = (self.data.test or train)[0]
            self.scored_image = _backend.to_host(self.view_image(model, first.camera))
        return fields

    def view_image(self, model, camera):
        """``model`` (``whole_model``'s) rendered from ``camera`` for evaluation, clipped to [0, 1]: the part of
        it that the store renders the view from (out of core: what the view can see, on the device)."""
        return render_image(self.store.part_in_view(model, camera), camera, self.cfg.sh_degree, self.cfg.background,
                            self.cfg.antialias, self.backend)

    def _device_memory_peak(self, release_cache=False):
        """The most device memory CuPy's pool has held so far.  After a refinement every buffer
        changes size and the pool would keep the old sizes' blocks cached as well, many times
        the model's size by the end of a run: ``release_cache`` hands those back."""
        if not _backend.on_gpu(self.backend):
            return 0
        import cupy
        pool = cupy.get_default_memory_pool()
        self.peak_pool_bytes = max(self.peak_pool_bytes, int(pool.total_bytes()))
        if release_cache:
            pool.free_all_blocks()
        return self.peak_pool_bytes

    # ------------------------------------------------------------------ snapshots
    def save_snapshot(self, path=None):
        """One snapshot whatever the pipeline: the root rank writes the whole state."""
        from engine.tools.snapshot import VIEWS_ARRAY, records_array, state_arrays, write_snapshot
        state = self.saved_state()
        if self.is_root:
            model_state, strategy_state = state
            attrs = {"step": self.step, "adam_step": model_state["step"], "config": asdict(self.cfg),
                     "rng": self.rng.bit_generator.state, "order": [int(i) for i in self.order],
                     "train_seconds": self.train_seconds, "fingerprint": self.data_fingerprint}
            arrays = state_arrays(model_state, strategy_state)
            arrays[VIEWS_ARRAY] = records_array(self.data_views)
            if self.appearance is not None:
                arrays.update({f"appearance/{k}": a for k, a in self.appearance.state().items()})
            arrays.update({f"pipeline/{k}": a for k, a in self.pipeline_arrays().items()})
            arrays.update({f"workload/{k}": a for k, a in self.workload.snapshot_arrays().items()})
            write_snapshot(str(path or self.out / SNAPSHOT), arrays, attrs)
        self.barrier()

    def load_snapshot(self, path, check_data=True):
        """Continue from a snapshot: the model, the strategy's state, the step, the RNG and the views'
        order, so that the run goes on as if never stopped.  -> its attributes."""
        from engine.tools.snapshot import read_snapshot, states_of
        arrays, attrs = read_snapshot(str(path))
        if check_data:
            self.check_same_data(path, arrays, attrs)
        model_state, strategy_state = states_of(arrays, attrs)
        self.start_from(model_state, strategy_state)
        corrections = {k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith("appearance/")}
        if self.appearance is not None and corrections:  # (none: a run that turns --appearance on starts them)
            self.appearance.load_state(corrections)
        self.restore_pipeline_arrays({k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith("pipeline/")})
        self.workload.restore({k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith("workload/")})
        self.step = int(attrs["step"])
        self.rng.bit_generator.state = attrs["rng"]
        self.order = list(attrs["order"])
        self.train_seconds = float(attrs.get("train_seconds", 0.0))
        return attrs


    def check_same_data(self, path, arrays, attrs):
        """Refuse the snapshot at ``path`` (its ``arrays`` and ``attrs``) if it trained on other data
        than this trainer's, saying which image or camera differs.  The views' contents are compared
        (``view_records``), not their path, so the same capture under another path, or a copy, resumes;
        a snapshot from before knows its data by path, names and sizes alone, which must match."""
        from engine.tools.snapshot import VIEWS_ARRAY, data_difference, records_of
        source = self.data.source
        if VIEWS_ARRAY not in arrays:
            if attrs.get("fingerprint") != path_fingerprint(self.data):
                raise ValueError(f"snapshot {path} was written by an older NumbaSplat, which knows its data by "
                                 f"path, image names and sizes, and those differ from {source}'s: give --data as "
                                 "it was given then (the same path), or train afresh")
            return
        difference = data_difference(records_of(arrays[VIEWS_ARRAY]), self.data_views)
        if difference:
            raise ValueError(f"snapshot {path} was trained on different data than {source}: {difference}")

    @cached_property
    def data_views(self):
        """``view_records`` of the training views: what a snapshot records of its data (computed once:
        it reads every pixel)."""
        from engine.tools.snapshot import view_records
        return view_records(self.data.train)

    @property
    def data_fingerprint(self):
        """One string for the training views' contents (``records_fingerprint``): equal data, equal string."""
        from engine.tools.snapshot import records_fingerprint
        return records_fingerprint(self.data_views)


def path_fingerprint(dataset):
    """What snapshots before ``view_records`` recorded of their data: its path, image names and sizes."""
    from engine.tools.snapshot import dataset_fingerprint
    return dataset_fingerprint([v.name for v in dataset.train], [v.image.shape for v in dataset.train],
                               extra=str(dataset.source))


def _logged_step(line):
    """The step of one line of log.jsonl; a line cut short by a crash (no newline, no JSON) counts as
    past every step, a record without a step as before them."""
    try:
        rec = json.loads(line) if line.endswith("\n") else None
    except json.JSONDecodeError:
        rec = None
    if not isinstance(rec, dict):
        return math.inf
    return rec.get("step", -math.inf)


class TrainingRun:
    """What one ``Trainer.train`` call writes to and how long it trains: the JSON-lines log ``logf`` and
    ``tensorboard`` (the root rank's; None elsewhere or when off), the progress ``bar``, and the clock of
    its training time, which leaves out what is not training (scoring, writing the model, a viewer's
    pause) and is banked into the trainer's ``train_seconds`` (before a snapshot records it)."""

    def __init__(self, trainer, logf, tensorboard, bar):
        self.trainer, self.logf, self.tensorboard, self.bar = trainer, logf, tensorboard, bar
        self.t0 = time.perf_counter()

    def start_clock(self):
        """Training starts now."""
        self.t0 = time.perf_counter()

    def exclude(self, seconds):
        """Leave ``seconds`` that held the loop out of the training time."""
        self.t0 += seconds

    def untimed(self, work, *args):
        """-> ``work(*args)``, its time left out of the training time."""
        start = time.perf_counter()
        result = work(*args)
        self.exclude(time.perf_counter() - start)
        return result

    def seconds(self):
        """The trainer's training time until now."""
        return self.trainer.train_seconds + time.perf_counter() - self.t0

    def bank_time(self):
        """Add the training time since the clock last started to the trainer's, and start it again."""
        self.trainer.train_seconds += time.perf_counter() - self.t0
        self.t0 = time.perf_counter()

    def write(self, record):
        """One log ``record`` to the JSON-lines log and TensorBoard, where written."""
        if self.logf:
            self.logf.write(json.dumps(record) + "\n")
            self.logf.flush()
        if self.tensorboard:
            self.tensorboard.write(record)

    def close(self):
        """The bar's line ended, the logs closed."""
        self.bar.close()
        if self.logf:
            self.logf.close()
        if self.tensorboard:
            self.tensorboard.close()


class Progress:
    """The progress bar of a run: iterations per second, loss, PSNR, Gaussian count and ETA.

    ``update(step)`` after every step (cheap: no device sync; tqdm redraws at most every
    ``min_interval`` seconds), ``show(loss, psnr, gaussians)`` at log steps, where those are read.
    On a terminal the bar is tqdm's; elsewhere (a batch job's log file) it is a plain line per log
    step, at most one every ``line_interval`` seconds, so that the log holds no carriage-return redraws.
    """

    def __init__(self, total, start=0, enabled=True, stream=None, min_interval=0.25, line_interval=10.0):
        self.total, self.step, self.enabled = total, start, enabled
        self.stream = sys.stderr if stream is None else stream
        self.line_interval = line_interval
        self.stats = ""
        self.start, self.t0 = start, time.perf_counter()
        self.last_line = -math.inf
        self.bar = None
        if enabled and _isatty(self.stream):
            self.bar = tqdm(total=total, initial=start, file=self.stream, mininterval=min_interval,
                            dynamic_ncols=True, smoothing=0.1)

    def update(self, step):
        """The run reached ``step``."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.step)
        self.step = step

    def show(self, loss, psnr, gaussians, extra=""):
        """The last log step's loss, PSNR, Gaussian count and a pipeline's ``extra``, shown until the next one."""
        if not self.enabled:
            return
        self.stats = f"loss {loss:.4f} psnr {psnr:5.2f} gaussians {gaussians:,}" + (f" {extra}" if extra else "")
        if self.bar is not None:
            self.bar.set_postfix_str(self.stats, refresh=False)
        elif time.perf_counter() - self.last_line >= self.line_interval or self.step >= self.total:
            self._line()

    def _line(self):
        """One plain line: the bar as text, the step, iterations per second, the stats and the ETA."""
        now = time.perf_counter()
        dt = now - self.t0
        rate = (self.step - self.start) / dt if dt > 0 else 0.0
        eta = (self.total - self.step) / rate if rate > 0 else math.inf
        frac = min(1.0, self.step / self.total) if self.total else 1.0
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        eta_s = f"{eta:6.0f}s" if math.isfinite(eta) else "     ?"
        self.stream.write(f"[{bar}] {self.step}/{self.total} {rate:6.1f} it/s {self.stats} eta {eta_s}\n")
        self.stream.flush()
        self.last_line = now

    def close(self):
        """End the bar's line (once: later calls do nothing)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.enabled = False


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
