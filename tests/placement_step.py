"""One view's forward, loss and backward through a ``numbasplat.placement.Placement``: what the
aggregate device's tests (tests/test_aggregate.py) and its GPU check (tests/check_aggregate.py)
compare between a split and one part."""
import numbasplat as ns
from numbasplat import backend as _backend
from numbasplat.placement import Placement


def split_step(parts, g, cam, target, backend="cpu", deterministic=False, separate_gradients=False,
               background=(0.2, 0.3, 0.1), lam=0.2, sh_degree=None, antialias=False, into_room=False,
               shared_binning=None, part_streams=None, room=None):
    """Projection, binning, raster, loss, raster backward and projection backward of ``g`` seen by
    ``cam`` against ``target``, each split ``parts`` ways; ``into_room``: binned again into room of a few
    slots more than each part's exact binning (``bin_tiles(room=)``); ``shared_binning``,
    ``part_streams``: ``Placement``'s.  ``room``: binned into it at once (``Placement.slots``' form), the
    loss left unread (a ``SplitLoss``): nothing waits for the device, so a CUDA graph may capture the
    step.  -> ({name: result}, the binning)."""
    placement = Placement(parts, backend, separate_gradients=separate_gradients, shared_binning=shared_binning,
                          part_streams=part_streams)
    unread = room is not None  # (the loss)
    p = placement.project(g, cam, sh_degree=sh_degree, antialias=antialias, check=False)
    b = placement.bin_tiles(p, room=room, deterministic=deterministic)
    if into_room:
        room = [n + 5 for n in b.part_slots] if placement.binnings > 1 else b.n_isect + 5
        b = placement.bin_tiles(p, room=room, deterministic=deterministic)
        assert int(_backend.to_host(b.overflow)[0]) == 0
    r = placement.rasterize(p, b, background)
    loss, d_image = placement.image_loss(r.image, target, lam)
    grad = placement.rasterize_backward(p, b, r, d_image, deterministic=deterministic)
    xp = _backend.array_module(backend)
    out = ns.Gaussians(**{k: xp.zeros_like(a) for k, a in g.arrays().items()})
    placement.project_backward(g, p, grad, out, accumulate=False)
    return dict(proj=p.proj, counts=p.counts, image=r.image, trans=r.trans, depth=r.depth,
                loss=loss if unread else float(loss), grad=grad,
                **{f"d_{k}": a for k, a in out.arrays().items()}), b
