"""How often a training run's steps outgrow their binning room, with and without the learned drift.

On the CPU backend, which bins exactly unless asked, a run binning into room as a GPU run does
(``engine.single_gpu.BinningRoom``): the steps it would skip (their intersections outgrew the
room given them) and the slots given over the intersections found, which the sorts pay for.  A
count, so the CPU gives what a GPU would for the same run; ``--no-drift`` keeps each room at its
view's last total scaled by the model's growth alone (the rule before the drift was learned).

    python scripts/binning_room_count.py --data CITY --iters 3000 [--no-drift] [--slack N]
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.dataset import load_dataset  # noqa: E402
from engine.single_gpu import BinningRoom, SingleGPUTrainer  # noqa: E402
from engine.trainer import TrainConfig  # noqa: E402


class CountingRoom(BinningRoom):
    """BinningRoom that adds up the slots it gives and the intersections that then came."""

    def __init__(self, drift=True, slack=None):
        super().__init__()
        if not drift:
            self.DRIFT_WEIGHT = 0.0
        if slack is not None:
            self.SLACK = slack
        self.slots = self.found = 0

    def settle(self):
        if self.pending is not None:
            _, _, room, copy, _, _ = self.pending
            self.slots += room
            self.found += int(copy.get()[0])
        super().settle()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a dataset folder (e.g. run.py synth's city)")
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--no-drift", action="store_true", help="rooms without the learned drift")
    p.add_argument("--slack", type=int, default=None,
                   help="slots added to every room (default BinningRoom.SLACK, sized for 1600x900 views: at a "
                        "small test resolution it dwarfs the totals, so scale it by the pixels)")
    a = p.parse_args(argv)
    data = load_dataset(a.data, test_every=8)
    room = CountingRoom(drift=not a.no_drift, slack=a.slack)
    with tempfile.TemporaryDirectory() as out:
        t = SingleGPUTrainer(data, out, TrainConfig(iterations=a.iters, snapshot_every=0), backend="cpu", log=lambda *_: None)
        t.binning_room, t._room = True, room
        t.train(progress=False)
    room.settle()
    print(f"{'no drift' if a.no_drift else 'drift'}: {len(data.train)} training views, {a.iters} steps: "
          f"{room.overflows} skipped for room ({100 * room.overflows / a.iters:.2f}%), slots given "
          f"{room.slots / max(room.found, 1):.3f}x the intersections found, learned rate {room.rate:.2e} a binning, "
          f"{len(t.model)} Gaussians at the end")


if __name__ == "__main__":
    main()
