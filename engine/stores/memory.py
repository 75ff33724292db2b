"""Where a pipeline's Gaussians live between steps: its store.

Every pipeline owns one store of its Gaussians (the whole model, or this rank's shard) and their
strategy state, and asks it explicitly for what a step trains and gives it back:

* ``checkout(views, upcoming)`` -> (model, state): the Gaussians that the step's training ``views``
  train, on the device (``upcoming``: the next step's views, a hint to move their Gaussians ahead);
* ``checkin(model, state, lr)``: that model trained (``lr``: the step's learning rates, by group);
  None where this rank trained nothing in the step;
* ``whole()`` -> (model, state): every Gaussian, for refinement, snapshots, the viewer and
  evaluation; ``hold(model, state)`` takes a whole model (a start, a refinement's result) instead;
* ``saved_state()``, ``saved_gaussians()``: what a snapshot and the PLY write, host arrays or arrays that
  they read a slice of rows at a time (out of core: never the whole model gathered a second time);
* ``binned(gaussians, intersections)``: a step's exact binning, which an out-of-core store's budget follows;
* ``steady``: whether the model that ``checkout`` gave stays the same from step to step, its buffers where they
  are, until the store holds another (a step graph may then replay the steps on it).

``MemoryStore`` holds the model in this process's memory: what it checks out is the model itself.
``engine.stores.offload.OutOfCoreStore`` holds it in host memory or on disk, the device a view's working
set.  Between steps ``model`` is the store's stand-in for the whole (its size, SH bases), which the
recipe reads; a pipeline never replaces it, only the store's calls change what it holds.
"""
from numbasplat import backend as _backend


class MemoryStore:
    """The Gaussians in this process's memory, on the trainer's device (or host arrays for the CPU
    backend): every view trains the model itself, and ``checkin`` has nothing to move."""

    out_of_core = False
    steady = True  # what ``checkout`` gives stays the same model, its buffers where they are, until ``hold``

    def __init__(self):
        self.model = None  # the ``GaussianModel`` (None until the pipeline's start)
        self.state = {}  # the strategy's state of its rows
        self.home = None  # the backend that a model to hold is made on (``open``)

    def open(self, backend, **_):
        """Ready the store for a trainer training on ``backend`` (an out-of-core store takes more)."""
        self.home = backend

    def hold(self, model, state):
        """Hold ``model`` and the strategy ``state`` of its rows instead of what was held."""
        self.model, self.state = model, state

    def checkout(self, views, upcoming=()):
        """-> (model, state) that the training ``views`` train: all of it."""
        return self.model, self.state

    def checkin(self, model, state, lr):
        """The model that ``checkout`` gave, trained: it is the held one already."""

    def binned(self, gaussians, intersections):
        """A step's exact binning of ``gaussians`` rows into ``intersections`` tile intersections: nothing
        to size here (an out-of-core store sizes the device's budget by them)."""

    def whole(self, device=False):
        """-> (the whole model, its strategy state): the held ones."""
        return self.model, self.state

    def saved_state(self):
        """-> (model state, strategy state) for a snapshot: host copies."""
        return self.model.state(), {k: _backend.to_host(a) for k, a in self.state.items()}

    def saved_gaussians(self):
        """-> the model's ``Gaussians`` for the PLY (on its device: the PLY reads a slice of rows at a time)."""
        return self.model.gaussians

    def group(self, name):
        """Parameter group ``name`` (e.g. "means") of the whole model, on its device."""
        return getattr(self.model.gaussians, name)

    def rendered(self):
        """The whole model to render evaluation views from (read only): the held one."""
        return self.model

    def recent(self):
        """The Gaussians the last step trained (the divergence check reads them): the model."""
        return self.model

    def part_in_view(self, model, camera):
        """The Gaussians of ``model`` (``rendered``'s) to render ``camera``'s evaluation view from: all."""
        return model.gaussians

    def step_stats(self):
        """The last step's residency fields for the trainer's ``stats``: none here."""
        return {}

    def log_fields(self, step, peak_device_bytes):
        """More fields for the log line at ``step`` (``peak_device_bytes()``: the device's peak): none here."""
        return {}

    def progress_text(self, record):
        """More for the progress line from the log ``record``: nothing here."""
        return ""

    def close(self):
        """Release what the store holds outside the model (files, page-locked memory): nothing here."""
