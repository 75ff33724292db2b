"""CUDA graphs of the single-GPU training step: the host queues a whole step in one launch.

A step of fern's size is bound by its host: Python queues some 35 launches and array calls in
more time than the device takes to run them (BENCHMARKS.md, BlitzGS).  From one step of a view to
the next while the model keeps its size, the step's device work is the same launches with the
same arguments: what changes each step (the learning rates, Adam's bias corrections) the host
writes to device memory that the step reads (``Adam.set_step``).  So ``StepGraphs`` runs a view's
very first step as usual (it compiles kernels and caches the view's constants on the device),
captures its step into a CUDA graph (``cudaStreamBeginCapture``) and launches it whenever its key
has changed since (a densification changes it every few visits), and replays that graph at every
later step of the view: one launch in place of the step's Python.  A capture queues nothing on the
device until its launch, so a graph never replayed costs the step's host time and device time one
after the other: where the trainer knows the view will not come again before the key changes (a
capture of many views, densifying), the step runs as usual instead (``run``'s ``comes_again``).

A graph keeps the addresses it was captured with.  The step's scratch arrays then come from a
memory pool of the graphs' own, which nothing else allocates from; every view's graph shares it
(one stream runs them one at a time).  What a graph's step returns (the loss) stays allocated
with it, for the host to read after a replay.  The arrays a step reads and writes in
place (the model, its gradients, Adam's moments and values, the strategy's statistics, the
targets, the cameras) stay where they are while the key holds: the key names the Gaussians, the
SH degree and those arrays' addresses, and the trainer drops every graph when the model or the
strategy state changes (``clear``).  Out of core the model is a working set of the store's pool, whose
steps a graph replays only where it stays the same (``steady``: every block); its gradients live from
the backward to the update, made in the step (so a captured step's are its scratch).  A view's room
for its tile intersections (``single_gpu.BinningRoom``) is fixed in its graph: the graph is captured
again when the view's room no longer fits.  A step that cannot be captured (one that would upload from the host, such
as a camera the constants' cache let go) runs as usual until its key changes, and the log says
why (``graph_capture_failures``).  The aggregate device's virtual parts (``numbasplat.placement``)
run each split operator on streams of their own, which wait for an event of the step's stream and
which it waits for after: the capture follows them there, and the graph holds each operator's parts
as parallel branches.

On the CPU backend and in the simulator there are no graphs: ``StepGraphs(simulate=True)``
(tests) replays the captured call itself, so that a test sees the trainer's host work split from
its device work as a real graph would need it.
"""
import time
from dataclasses import dataclass

from numbasplat.device import GraphScratch, address, capture_graph


@dataclass
class _Entry:
    key: tuple
    room: object = None     # the binning room the graph was captured with
    graph: object = None    # a cupy.cuda.graph.Graph, or (simulate) the captured call
    outputs: object = None  # what the captured step returned, kept allocated with the graph
    uncapturable: bool = False  # its capture failed: run as usual until the key changes


class StepGraphs:
    """Per training view, the step's device work as a CUDA graph (see the module's docstring)."""

    def __init__(self, simulate=False):
        self.simulate = simulate
        self._entries = {}
        self._seen = set()  # the views stepped once as usual (their next steps may be captured)
        self._scratch = None  # (a GraphScratch: the graphs' memory pool and stream, made at the first capture)
        self.captures = self.replays = 0
        self.unreplayed = 0  # the steps run as usual, not captured, since their graph would not be replayed
        self.capture_seconds = 0.0  # the host's time capturing (the captured steps' own work included)
        self.failures, self.last_failure = 0, None  # captures that failed (their steps ran as usual), and why

    def clear(self):
        """Drop every graph (the model or the strategy state changed) and the scratch they shared."""
        self._entries.clear()
        if self._scratch is not None:
            self._scratch.free()

    def run(self, view, key, room, fits, step, comes_again=None):
        """``view``'s step: ``step(room, captured)`` -> its outputs (device arrays), called as is the
        view's first time, captured and launched at its first step with ``key``, replayed after while
        ``fits(room)`` holds for the room it was captured with (``room``: the view's room now).
        ``comes_again()``: whether the view comes again while ``key`` holds, asked only where the step would be
        captured (None: it does); where not, the step runs as usual instead (a capture queues nothing on the
        device until its launch, so one never replayed costs the step's host time and its device time one
        after the other).
        -> (outputs, the room the step binned into)."""
        if view not in self._seen:
            self._seen.add(view)
            return step(room, False), room
        e = self._entries.get(view)
        if e is None or e.key != key:
            self._entries[view] = e = _Entry(key)
        if room is None or e.uncapturable:
            return step(room, False), room
        if e.graph is None or not fits(e.room):
            if comes_again is not None and not comes_again():
                self.unreplayed += 1
                return step(room, False), room
            t0 = time.perf_counter()
            try:
                e.room, e.graph, e.outputs = room, *self._capture(lambda: step(room, True))
            except Exception as error:  # noqa: BLE001 (run as usual: a real error raises again there)
                e.graph, e.outputs, e.uncapturable = None, None, True
                self.failures += 1
                self.last_failure = f"{type(error).__name__}: {error}"
            self.capture_seconds += time.perf_counter() - t0
            if e.uncapturable:
                return step(room, False), room
            self.captures += 1
        else:
            self.replays += 1
        if self.simulate:
            e.outputs = e.graph()
        else:
            e.graph.launch(self._scratch.stream)
        return e.outputs, e.room

    def _capture(self, call):
        if self.simulate:
            return call, None  # (the outputs come from each replay)
        if self._scratch is None:
            self._scratch = GraphScratch()
        return capture_graph(call, self._scratch)


def array_key(arrays):
    """The addresses and shapes of ``arrays``: a graph that reads or writes them holds while these do."""
    return tuple((address(a), a.shape) for a in arrays)
