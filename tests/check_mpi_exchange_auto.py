"""Run by tests/test_pixel_exchange.py under mpiexec: ``--exchange auto``'s hand-overs.  A run whose
chooser flips the exchange at every decision step (train_choosing_exchange) against the same run
made by hand: each leg trained to its step, the other pipeline resumed from its snapshot.  Rank 0
prints the exchanges chosen and whether the two final models and steps are equal.  Then
``--polish-steps 4`` (polish_in_render_order) against the same by hand: the pixel exchange to step
10, the Gaussian-level one at batch 1 resumed from its snapshot to 14."""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.pipelines import (PipelineOptions, exchange_decision_steps, make_trainer,  # noqa: E402
                              polish_in_render_order, train_choosing_exchange)
from comm import abort_on_error  # noqa: E402
from engine.tools.demo import make_dataset  # noqa: E402
from engine.recipe.trainer import SNAPSHOT, TrainConfig  # noqa: E402

out = Path(sys.argv[1])
comm = MPI.COMM_WORLD


def same_state(a, b):
    """Whether two ``gather_state`` results hold the same parameters and moments, bit for bit."""
    (a, _), (b, _) = a, b
    return all(np.array_equal(a[w][g], b[w][g]) for w in ("params", "m", "v") for g in a["params"])


with abort_on_error(comm):
    data = make_dataset(size=32, n_views=10, backend="cpu")

    def config():
        return TrainConfig(iterations=14, sh_degree=0, snapshot_every=0, log_every=0, background=(1.0, 1.0, 1.0),
                           n_random_init=300, densify_from=2, densify_every=2, densify_until=10,
                           opacity_reset_every=4)

    def trainer(folder, exchange, cfg, **options):
        return make_trainer(data, out / folder, cfg, PipelineOptions(exchange=exchange, **options), comm)

    chosen = []

    def flip(dataset, cfg, comm, t):
        choice = "pixel" if t.options.exchange == "gaussian" else "gaussian"
        chosen.append((t.step, choice))
        return choice

    cfg = config()
    t = train_choosing_exchange(trainer("auto", "gaussian", cfg), cfg, PipelineOptions(exchange="auto"), comm, False,
                                choose=flip)
    t.train(progress=False)
    auto = t.gather_state()

    cfg = config()
    steps = exchange_decision_steps(cfg, 0)
    t, exchange = trainer("hand", "gaussian", cfg), "gaussian"
    for at in steps:
        t.train(progress=False, until=at)
        exchange = "pixel" if exchange == "gaussian" else "gaussian"
        t = trainer("hand", exchange, cfg)
        t.load_snapshot(out / "hand" / SNAPSHOT)
    t.train(progress=False)
    hand = t.gather_state()
    if comm.Get_rank() == 0:
        print("decisions", steps, "chosen", chosen, "last", t.options.exchange, "same", same_state(auto, hand),
              "gaussians", len(auto[0]["params"]["means"]), len(hand[0]["params"]["means"]))

    def plain():
        cfg = config()
        cfg.densify_until = 0
        return cfg

    cfg = plain()
    polishing = PipelineOptions(exchange="pixel", polish_steps=4)
    t = polish_in_render_order(trainer("polish", "pixel", cfg), cfg, polishing, comm, False)
    polished_by = (t.options.exchange, t.batch, t.step)
    t.train(progress=False)
    polished = t.gather_state()
    cfg = plain()
    t = trainer("polish_hand", "pixel", cfg)
    t.train(progress=False, until=10)
    t = trainer("polish_hand", "gaussian", cfg, batch_size=1)
    t.load_snapshot(out / "polish_hand" / SNAPSHOT)
    t.train(progress=False)
    by_hand = t.gather_state()
    if comm.Get_rank() == 0:
        print("polish", polished_by, "same", same_state(polished, by_hand))
