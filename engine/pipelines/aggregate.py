"""The aggregate device: several GPUs (``--devices``), or one split into virtual devices
(``--virtual-devices``), trained as one device by the single-GPU pipeline.

NVIDIA's multi-GPU splatting backend keeps the model in CUDA managed memory and splits every
operator across the GPUs, so the model code has no communication.  Here the model code is the
single-GPU pipeline itself (``SingleGPUTrainer``: the same trainer, strategies, snapshots and
viewer); what changes is its ``placement`` (``numbasplat.placement.Placement``), through which the
step's operators run, each split across the parts, the cross-part reductions (the loss, the
screen-space gradients) in it.  ``--virtual-devices N`` runs the N parts on this process's device
(on a GPU side by side, a stream each; on the CPU one after another), which tests the split without
several GPUs (N = 2 or 3 equals 1: tests/test_aggregate.py); ``--devices N|all`` puts the parts on
GPUs 0..N-1 with the CuPy arrays in managed memory (``numbasplat.device.managed_memory``), and
``--devices 1 --gpu-memory G`` caps one GPU so that a model larger than G pages in from the host
(``reserve_device_memory``).
``check`` (engine/pipelines/options.py) holds the refusals.
"""
from numbasplat import device as _device
from numbasplat.placement import Placement

from .options import aggregate_devices

_RESERVED = []  # ``--gpu-memory`` with ``--devices 1``: the block held so that only G stays free (process-wide)


def is_aggregate(options):
    """Whether ``options`` ask for the aggregate device (``--devices``, or ``--virtual-devices`` over 1)."""
    return options.devices is not None or options.virtual_devices > 1


def aggregate_placement(options, backend=None, log=print):
    """The ``Placement`` of ``options``: ``virtual_devices`` parts on this device, or a part on each of
    the first ``--devices`` GPUs, the CuPy arrays made from here on in managed memory, peer access
    on, and with ``--gpu-memory`` the rest of the one GPU's free memory reserved."""
    n = aggregate_devices(options)
    if n is None:
        placement = Placement(options.virtual_devices, backend)
        log(placement.describe())
        return placement
    devices = list(range(n))
    _device.managed_memory()
    _device.enable_peer_access(devices)
    if options.gpu_memory:
        _RESERVED.append(_device.reserve_device_memory(options.gpu_memory, devices[0]))
    placement = Placement(n, backend, devices=devices)
    log(placement.describe() + (f", {options.gpu_memory / 2**30:.3g} GiB of GPU memory left free (the rest "
                                "reserved: managed memory pages the model past it)" if options.gpu_memory else ""))
    return placement


def aggregate_trainer(data, out, cfg, options, backend=None, log=print):
    """The single-GPU pipeline on the aggregate device of ``options``."""
    from .single_gpu import SingleGPUTrainer
    return SingleGPUTrainer(data, out, cfg, backend, log, placement=aggregate_placement(options, backend, log),
                            options=options)
