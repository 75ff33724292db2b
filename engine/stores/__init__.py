"""Where a pipeline's Gaussians live: a store hands out the model a step needs (``checkout``), takes
it back with its update (``checkin``) and gives the whole model for refinement, snapshots, the viewer
and evaluation (``whole``).  ``memory``: all on the device; ``offload``: in host memory or on disk,
with the views' working sets moved to the device."""
