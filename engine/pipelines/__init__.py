"""The one place that chooses a pipeline: ``make_trainer`` makes the ``Trainer`` that the
``PipelineOptions`` and the ranks at hand ask for, after ``check`` (both in
engine/pipelines/options.py, which the pipelines import, and exported here).

A run may hand over from one pipeline to another, through the snapshot that the first one's stop
writes, as ``--resume`` would (``handed_over``): ``--exchange auto`` chooses the exchange that moves
fewer bytes (``choose_exchange``) at the start and again where densification changed the model
(``train_choosing_exchange``), and ``--polish-steps`` trains the last steps with the Gaussian-level
exchange (``polish_in_render_order``).  ``train_handing_over`` runs both, as ``run.py train`` does.

The command line (cli/train.py), ``run.py scaling`` (engine/tools/scaling.py) and ``run.py evaluate``
make their trainers here; the pipeline modules are imported when one is made, so that a run in
one process loads no MPI.
"""
from dataclasses import replace

from engine.tools.outputs import SNAPSHOT
from .options import PipelineOptions, check

__all__ = ["PipelineOptions", "check", "make_trainer", "choose_exchange", "exchange_decision_steps",
           "train_choosing_exchange", "polish_in_render_order", "train_handing_over"]


def make_trainer(data, out, cfg, options, comm=None, backend=None, log=print):
    """The pipeline that ``options`` ask for on the ranks of ``comm``, training on ``data`` into the
    folder ``out``: one process (None; the model in device memory, on an aggregate device of several GPUs
    or virtual devices (``--devices``, ``--virtual-devices``), or ``--offload`` host or disk),
    or over MPI ranks (``COMM_SELF`` too: the batched pipeline), trading Gaussians or pixels
    (``--exchange``; auto: ``choose_exchange`` measures).  Offloading turns ``cfg.visible_adam`` on
    (``cfg`` is changed, so that a pipeline handed over to later says it once)."""
    out_of_core = options.offload != "none"
    check(replace(cfg, visible_adam=True) if out_of_core else cfg, options, comm)
    exchange = choose_exchange(data, cfg, comm) if options.exchange == "auto" else options.exchange
    if out_of_core and not cfg.visible_adam:
        if comm is None or comm.Get_rank() == 0:
            print(f"--offload {options.offload}: Adam updates each step's working set only (--visible-adam)")
        cfg.visible_adam = True
    made = dict(backend=backend, log=log)
    if out_of_core:
        made.update(mode=options.offload, offload_dir=options.offload_dir, host_memory=options.host_memory or 0,
                    gpu_memory=options.gpu_memory or 0, offload_adam=options.offload_adam)
    if comm is None:
        from .aggregate import aggregate_trainer, is_aggregate
        if is_aggregate(options):
            return aggregate_trainer(data, out, cfg, options, **made)
        if out_of_core:
            from .single_gpu import OffloadTrainer
            return OffloadTrainer(data, out, cfg, **made)
        from .single_gpu import SingleGPUTrainer
        return SingleGPUTrainer(data, out, cfg, **made)
    from .distributed import select_device, share_host_threads
    select_device(comm)
    share_host_threads(comm)
    made.update(batch_size=options.batch_size, transport=options.transport)
    if exchange == "pixel":
        from .pixel_exchange import OffloadedPixelExchangeTrainer, PixelExchangeTrainer
        if not out_of_core:  # (out of core, each step loads its own working set: none is rendered ahead)
            made.update(render_ahead=options.render_ahead)
        pipeline = OffloadedPixelExchangeTrainer if out_of_core else PixelExchangeTrainer
        return pipeline(data, out, cfg, comm, saturation=options.saturation == "on",
                        consolidation=options.consolidation == "on", **made)
    from .gaussian_exchange import GaussianExchangeTrainer, OffloadedGaussianExchangeTrainer
    pipeline = OffloadedGaussianExchangeTrainer if out_of_core else GaussianExchangeTrainer
    return pipeline(data, out, cfg, comm, grad_comm=options.grad_comm, shard=options.shard, **made)


def choose_exchange(data, cfg, comm, trainer=None):
    """``--exchange auto``: the exchange that moves fewer bytes per image at this many ranks, measured on
    the root (engine/pipelines/traffic.py's ``exchange_bytes``) from the starting model, or from ``trainer``'s
    model as it is (collective), and said in one line; one process: none to choose."""
    if comm is None:
        return "gaussian"
    model = trainer.whole_model() if trainer is not None else None  # (the root's; every rank gathers)
    choice = None
    if comm.Get_rank() == 0:
        from .traffic import exchange_bytes
        sizes = exchange_bytes(data, cfg, comm.Get_size(), gaussians=None if model is None else model.gaussians)
        choice = min(sizes, key=sizes.get)
        when = f" at step {trainer.step}" if trainer is not None else ""
        what = f"the model of step {trainer.step}" if trainer is not None else "the starting model"
        print(f"--exchange auto{when}: {choice} (MB an image crossing {comm.Get_size()} ranks, measured on {what}: "
              f"pixel {sizes['pixel'] / 1e6:.3f}, gaussian {sizes['gaussian'] / 1e6:.3f})")
    return comm.bcast(choice, root=0)


def exchange_decision_steps(cfg, start):
    """The steps after ``start`` (and before the last) where ``--exchange auto`` decides again, on the
    model as densification left it: the end of each period of the opacity resets while densification runs
    (the step before each multiple of ``opacity_reset_every``, where the late regularisers have ended the
    resets too: the model still grows) and the end of densification."""
    steps = {cfg.densify_until}
    if cfg.opacity_reset and cfg.opacity_reset_every > 0:
        steps.update(range(cfg.opacity_reset_every - 1, cfg.densify_until, cfg.opacity_reset_every))
    return sorted(s for s in steps if start < s < cfg.iterations)


def exchange_options(options, exchange):
    """``options`` for a pipeline trading ``exchange`` that takes over from another: the pixel
    exchange's own options (``--render-ahead``, ``--polish-steps``) left out for the Gaussian-level
    one, which refuses them."""
    if exchange == "gaussian":
        return replace(options, exchange=exchange, render_ahead=0, polish_steps=0)
    return replace(options, exchange=exchange)


def handed_over(t, cfg, options, comm):
    """The pipeline of ``options`` going on from ``t``, which has stopped: made anew, it loads the
    snapshot the stop wrote, as ``--resume`` would, and takes over ``t``'s step hooks."""
    hooks = t.step_hooks
    t = make_trainer(t.data, t.out, cfg, options, comm)
    t.load_snapshot(t.out / SNAPSHOT)
    t.step_hooks = hooks
    return t


def train_choosing_exchange(t, cfg, options, comm, progress, choose=choose_exchange):
    """``--exchange auto`` under MPI: train to each of ``exchange_decision_steps`` and choose again
    there (``choose``: rank 0 counts both exchanges' bytes on the model as it is); where the choice
    changes, the other pipeline goes on from the snapshot the stop wrote (``handed_over``).
    -> the trainer that trained last (densification over: the exchange stays)."""
    for at in exchange_decision_steps(cfg, t.step):
        t.train(progress=progress, until=at)
        choice = choose(t.data, cfg, comm, t)
        if choice != t.options.exchange:
            t = handed_over(t, cfg, exchange_options(options, choice), comm)
    return t


def polish_in_render_order(t, cfg, options, comm, progress):
    """``--polish-steps N`` under MPI with the pixel exchange: train to N steps before the end, then
    the last N steps with the Gaussian-level exchange at one view a step, whose blend order is the
    single render's, the order the model is judged and viewed in (the boxes' order costs lego about
    0.3 dB at P = 4: BENCHMARKS.md, issue 25).  The pipelines hand over through the snapshot the
    stop writes, as ``--exchange auto``'s do.  -> the trainer of the last steps."""
    steps = options.polish_steps
    if not steps or comm is None or t.options.exchange != "pixel":
        return t
    at = max(cfg.iterations - steps, t.step)
    t.train(progress=progress, until=at)  # (writes the snapshot, also where it has nothing to train)
    t = handed_over(t, cfg, replace(exchange_options(options, "gaussian"), batch_size=1), comm)
    if comm.Get_rank() == 0:
        print(f"--polish-steps {steps}: steps {at + 1} to {cfg.iterations} with the Gaussian-level exchange, "
              "one view a step")
    return t


def train_handing_over(t, cfg, options, comm, progress, choose_again=True):
    """Train ``t`` through the handovers that ``options`` ask for under MPI: ``--exchange auto`` chooses
    again at each of ``exchange_decision_steps`` (unless not ``choose_again``: a live viewer holds
    ``t``), ``--polish-steps`` ends with the Gaussian-level exchange.  -> the trainer of the last
    steps, to train on to the end."""
    if options.exchange == "auto" and comm is not None and choose_again:
        t = train_choosing_exchange(t, cfg, options, comm, progress)
    return polish_in_render_order(t, cfg, options, comm, progress)
