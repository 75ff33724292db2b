"""Adam on the host for a working set whose moments live in the host's tier alone (``--offload-adam host``,
issue 60's CLM option): the device's pool holds the rows' parameters and statistics
(``RowLayout.without_moments``), so a working-set Gaussian takes no device bytes for its moments.

A step's update (``HostAdam.update``): the working set's gradients and visible mask come to the host; the CPU
backend's host-only Adam kernel (``numbasplat.cpu.adam_table_rows``: the ``numbasplat.math.adam`` update that the
device's kernels inline too, Gaussian by Gaussian, reading the parameters from the host's rows) steps the host's
rows of those Gaussians, their parameters and moments there; the new parameters go back to the device, into the
working set's model and its pool rows.  On the CPU backend it is the device's ``RowsAdam`` to the bit: the same
update on the same values.

Since the host holds the parameters that the update reads, the device's copy of them in the working set's
model is not read after the backward: where each checked-out model takes one projection backward
(``OutOfCoreStore.grads_over_params``, the single-process pipeline's), the backward writes the gradients over
it (``GaussianModel.grads_over_params``) and the device keeps no gradients' buffer."""
from dataclasses import dataclass

import numpy as np

from numbasplat import backend as _backend
from numbasplat import device
from numbasplat.optim import MomentsElsewhereAdam

from engine.pipelines.options import OFFLOAD_ADAM as ADAM_PLACES  # where a working set's Adam runs


@dataclass
class HostAdam(MomentsElsewhereAdam):
    """``Adam`` of a working set on the device (``params``: its model's parameters) whose moments are in the
    host's tier of ``store`` (an ``OutOfCoreStore``): ``rows`` (host int64) its Gaussians' model rows and
    ``pool_rows`` (on the device) their rows in ``pool``, both in the model's order.  ``set_step`` keeps the
    step's rates on the host, where ``update`` runs (``m``, ``v``: empty, as ``RowsAdam``'s)."""
    store: object = None
    rows: object = None
    pool: object = None
    pool_rows: object = None

    def __post_init__(self):
        super().__post_init__()  # (the moments are the host's)
        self._host_values = None
        self._host_no_skip, self._host_no_mask = np.zeros(1, np.int32), np.ones(1, np.bool_)
        self._staging = {}  # name: a page-locked host buffer, reused from step to step (``_staged``)

    def _staged(self, name, n, dtype):
        """``n`` values of ``dtype`` in this Adam's page-locked host buffer ``name`` (grown by doubling), which the
        GPU copies into and out of without a staging copy of its own (a plain array where no GPU runs).  A step's
        copies out of it are queued on the step's stream before the next step's download is waited for, so
        reusing it is safe."""
        buffer = self._staging.get(name)
        if buffer is None or buffer.size < n:
            buffer = device.pinned_empty(max(n, 2 * (0 if buffer is None else buffer.size)), dtype)
            self._staging[name] = buffer
        return buffer[:n]

    def _download(self, a, name):
        """The copy of the device array ``a`` into this Adam's page-locked buffer ``name``, queued (``HostCopy``:
        numpy arrays pass through)."""
        return device.HostCopy(a, self._staged(name, a.size, a.dtype).reshape(a.shape))

    def set_step(self, lr_columns):
        """Count a step and keep its per-column rates and bias corrections on the host, in float32 as
        ``Adam.set_step`` writes them to the device."""
        self.step_count += 1
        t = self.step_count
        values = np.concatenate([np.asarray(lr_columns, np.float32), [1 - self.b1 ** t, 1 - self.b2 ** t]])
        self._host_values = values.astype(np.float32)
        if self._host_layout is None:
            self._host_layout = self.params.layout(lr_columns)

    def update(self, grads, visible=None, skip=None, rows=None):
        """The step ``set_step`` prepared, on the host: ``grads`` (device, flat like ``params``), ``visible``
        ((N,) bool, None: every Gaussian), ``skip`` (a (1,) int32 device flag: set, nothing changes) come to
        the host; the host's rows take the new parameters and moments, the device's model and pool rows the
        new parameters.  ``grads`` may be the model's parameters themselves, the backward's gradients written
        over them (``GaussianModel.grads_over_params``): the update reads the parameters from the host's rows
        alone, and a skipped step takes them back from the pool's rows.  (No split by ``rows``: the aggregate
        device does not run out of core.)"""
        if rows is not None:
            raise ValueError("HostAdam.update: no split by rows (the aggregate device does not run out of core)")
        if not self.params.size:
            return
        if skip is not None and _backend.to_host(skip)[0] != 0:
            if device.address(grads) == device.address(self.params.data):
                self.store.pool_layout.read_params(self.pool, self.pool_rows, self.params.data, self.backend)
            return
        use_visible = visible is not None
        downloads = [self._download(grads, "gradients")]
        if use_visible:  # (both copies queued before the host waits for either)
            downloads.append(self._download(visible, "visible"))
        grads = downloads[0].get()
        visible = downloads[1].get() if use_visible else self._host_no_mask
        store = self.store
        table, at, gathered = store.host_rows_for_update(self.rows)
        params = self._staged("parameters", self.params.size, np.float32)  # (uploaded from page-locked memory)
        lrs, corrections = self._host_values[:-2], self._host_values[-2:]
        _backend.kernels("cpu").adam_table_rows(table, at, np.array(store.layout.part_columns, np.int32), params,
                                                grads, *self._host_layout, lrs, visible, use_visible,
                                                self._host_no_skip, np.float32(self.b1), np.float32(self.b2),
                                                np.float32(self.eps), corrections)
        if gathered:
            store.put_host_rows(self.rows, table)
        data = self.params.data
        device.copy_rows(data, 0, params, 0, len(params))  # (queued, the host going on: the next step's download is
        # queued after it, ``_staged``)
        store.pool_layout.write_params(data, self.pool, self.pool_rows, self.backend)
