"""How often a training run's steps outgrow their binning room, and when.

On the CPU backend, which bins exactly unless asked, a run binning into room as a GPU run does
(``engine.pipelines.single_gpu.BinningRoom``): the steps it would skip (their intersections outgrew the
room given them), the steps where that happened, and the slots given over the intersections
found, which the sorts pay for.  A count, so the CPU gives what a GPU would for the same run
(the GPU's atomics change the run itself a little).  ``--slack``: BinningRoom.SLACK is sized for
1600x900 views; at a small test resolution it dwarfs the totals, so scale it by the pixels.

    python scripts/binning_room_count.py --data CITY --iters 7000 [--slack N]
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.dataset import load_dataset  # noqa: E402
from engine.pipelines.single_gpu import BinningRoom, SingleGPUTrainer  # noqa: E402
from engine.recipe.trainer import TrainConfig  # noqa: E402


class CountingRoom(BinningRoom):
    """BinningRoom that adds up the slots it gives and the intersections that then came, and notes
    the binning (the step) of each overflow."""

    def __init__(self, slack=None):
        super().__init__()
        if slack is not None:
            self.SLACK = slack
        self.slots = self.found = self.binnings = 0
        self.overflow_steps = []

    def plan(self, view, gaussians):
        room = super().plan(view, gaussians)
        self.binnings += 1
        return room

    def settle(self):
        pending, before = self.pending, self.overflows
        super().settle()
        if pending is not None:
            view, room = pending[0], pending[2]
            self.slots += room
            self.found += self.last[view][0]  # the total just read
            if self.overflows > before:
                self.overflow_steps.append(self.binnings)  # (the binnings so far: the skipped one is the last)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a dataset folder (e.g. run.py synth's city)")
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--slack", type=int, default=None, help="slots added to every room (default BinningRoom.SLACK)")
    a = p.parse_args(argv)
    data = load_dataset(a.data, test_every=8)
    room = CountingRoom(slack=a.slack)
    with tempfile.TemporaryDirectory() as out:
        t = SingleGPUTrainer(data, out, TrainConfig(iterations=a.iters, snapshot_every=0), backend="cpu",
                             log=lambda *_: None)
        t.binning_room, t._room = True, room
        t.train(progress=False)
    room.settle()
    print(f"{len(data.train)} training views, {a.iters} steps: {room.overflows} skipped for room "
          f"({100 * room.overflows / a.iters:.2f}%), slots given {room.slots / max(room.found, 1):.3f}x the "
          f"intersections found, {len(t.model)} Gaussians at the end; the skipped steps: {room.overflow_steps}")


if __name__ == "__main__":
    main()
