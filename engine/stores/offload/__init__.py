"""Out-of-core training (``--offload host|disk``): the model out of the device, which holds a view's working set.

All parameters, Adam moments and densification statistics live out of the device, a Gaussian's
values one row of a table (``RowLayout``).  The Gaussians are grouped into spatially coherent
blocks (``BlockIndex``: the Morton order of their centres, cut into blocks of about
``BLOCK_ROWS``), each with a box that holds its centres grown by its Gaussians' reach.  Three
levels hold the blocks' tables:

* the disk (``--offload disk``): a file per block in ``--offload-dir`` (``DiskBlocks``), with host
  memory a cache of them capped by ``--host-memory`` (least recently used out first, written back
  if changed; a thread reads the next view's blocks ahead);
* host memory (``--offload host``: every block, ``HostBlocks``);
* the device: a pool of block slots (``DeviceCache``), capped by ``--gpu-memory``, holding the
  blocks the recent views saw (least recently used out first, written back to the host).

One step, one view:

1. the view's blocks: those whose grown box the view can see, culled on the host from the boxes
   alone (``partition.visible_regions``); those the device lacks come in (the only transfers);
2. the working set, those blocks' rows in model order, trains in place on the pool: its parameters and
   statistics are gathered into a model of its own (its moments stay in the pool's rows), which renders,
   computes the loss and back-propagates as the single-GPU pipeline does, and steps Adam
   (``numbasplat.optim.RowsAdam``: the moments read and written in the pool, the new parameters written
   there and into the model) on the Gaussians the view saw (visible-only Adam: ``cfg.visible_adam`` must
   be on) with the whole model's step count; its statistics go back to the pool, and its blocks' boxes are
   recomputed there (one kernel) for the host's culling, which reads them a step late
   (``BoxesInFlight``: the host queues the next step without waiting for this one);
   A view whose blocks outnumber the pool's slots is trained in depth-ordered chunks of the pool's rows
   instead (``chunked``: ``ChunkedView``; ``OffloadTrainer`` only, other pipelines refuse it);
3. where the strategy densifies or resets (``DefaultStrategy.acts_at``), the model is refined block by
   block (``OutOfCoreStore.refine``: host mode in its one table, disk mode into the next generation of
   block files), never gathered a second time in host memory; snapshots and the PLY read it a slice of
   rows at a time (disk mode from a file of its columns in model order).  Where the device's pool holds
   every block, the refinement runs there on the gathered pool.

All of this is one store (``OutOfCoreStore``, ``engine.stores.memory``'s interface), which any pipeline may
own instead of its ``MemoryStore``: the single-process pipeline (``engine.pipelines.single_gpu.OffloadTrainer`` is
``engine.pipelines.single_gpu.SingleGPUTrainer`` with this store), and under MPI each rank's shard, of the
Gaussian exchange (``engine.pipelines.gaussian_exchange.OffloadedGaussianExchangeTrainer``: a step's working set is
what any view of its batch sees) or of the pixel exchange
(``engine.pipelines.pixel_exchange.OffloadedPixelExchangeTrainer``: the Gaussians of the rank's box that its view of
the step sees).

With ``--offload-adam host`` (issue 60's CLM option) Adam's moments never reach the device: the pool's rows
hold the parameters and statistics alone, and a working set's update runs on the host, on its rows in the
host's tier (``host_adam.HostAdam``: its gradients to the host, the new parameters back to the pool), the same
update as the device's to the bit on the CPU backend (tested).  The host's rows hold the parameters that update
reads, so in the single-process pipeline the backward writes the gradients over the working set's parameters on
the device, which keeps no gradients' buffer.

The device's budget (``--gpu-memory``) is spent on block slots, each holding a block's rows and room for
them in a step's working set: ``store.working_set_bytes`` itemises a working-set Gaussian's device bytes
from the sizes the code allocates, ``store.tier_bytes`` each tier's bytes per Gaussian (``run.py scaling
--offload`` prints both, and the largest model each tier holds).

The package: ``layout`` (the blocks' index, a row's layout, a working set's rows), ``tiers`` (host
memory, disk), ``cache`` (the device's pool of blocks, the boxes in flight), ``chunked`` (a view in
chunks), ``host_adam`` (Adam on the host), ``store`` (the store).

Rows keep the in-memory model's order, so the working set binned and sorted on the device ties as
the whole model would, and the strategy's random draws fall on the same Gaussians: offloaded
training equals in-memory training with visible-only Adam and the same view order (tested).  While the
device holds under half the blocks, the views follow a tour along the cameras by default (``--view-order
auto``: trajectory), so that consecutive working sets overlap and few blocks move; else they come in
random order, as in memory: a tour's neighbouring views in a row cost quality.

The moves overlap the kernels: where blocks move in host mode the host's table is page-locked, a
block moves by one copy between its rows there and its slot, and the next step's blocks (a guess from
the next view) move in on a stream of their own while this step trains (``DeviceCache.prefetch``);
what the guess missed moves at the step, queued before its kernels.  In disk mode the blocks move
through page-locked staging buffers on a GPU (``numbasplat.device.StagingRing``), a copy a block.
"""
from dataclasses import replace

from .cache import BoxesInFlight, DeviceCache
from .host_adam import ADAM_PLACES, HostAdam
from .layout import BLOCK_ROWS, BlockIndex, RowLayout, WorkingRows, format_bytes, frustum_part
from .store import GPU_SHARE, OutOfCoreModel, OutOfCoreStore
from .tiers import DiskBlocks, HostBlocks, own_memory

__all__ = ["ADAM_PLACES", "BLOCK_ROWS", "GPU_SHARE", "BlockIndex", "BoxesInFlight", "DeviceCache", "DiskBlocks",
           "HostAdam", "HostBlocks", "OutOfCoreModel", "OutOfCoreStore", "RowLayout", "WorkingRows",
           "format_bytes", "frustum_part", "out_of_core", "own_memory"]



def out_of_core(options, mode="host", offload_dir=None, host_memory=0, gpu_memory=0, prefetch=True,
                block_rows=BLOCK_ROWS, shard=False, adam="device"):
    """-> (``options`` (``PipelineOptions``) with the out-of-core ones, the ``OutOfCoreStore`` they ask
    for): what a pipeline's constructor gives ``Trainer.__init__``, which checks the options and opens
    the store.  ``shard``: the store holds a rank's shard; ``adam``: where Adam runs (``--offload-adam``)."""
    options = replace(options, offload=mode, offload_dir=offload_dir, host_memory=host_memory,
                      gpu_memory=gpu_memory, offload_adam=adam)
    return options, OutOfCoreStore(mode, offload_dir, host_memory, gpu_memory, prefetch, block_rows, shard, adam)
