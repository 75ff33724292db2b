"""The benchmark scenes of ``run.py bench`` and ``run.py scaling --scene``: ``make_scene`` draws the
arrays of a standard scene (``run.py bench --make 1M --out b1m.npz`` writes them to an .npz file),
and ``load_scene`` reads such a file back as Gaussians and a camera, or raises ``DataError`` with
one line that names the file and what is wrong with it."""
import zipfile
import zlib

import numpy as np

from numbasplat import Camera, Gaussians

from .scene import DataError

SCENE_KEYS = (*Gaussians.FIELDS, "viewmat", "K", "W", "H")
# The standard benchmark scenes (BENCHMARKS.md): Gaussians -> the camera's width and height.  Any other
# count gets the 1M scene's camera unless told otherwise.
STANDARD_SIZES = {1_000_000: (1297, 840), 6_000_000: (1920, 1080)}
DEFAULT_SIZE = STANDARD_SIZES[1_000_000]
MAKE_HINT = "make one with run.py bench --make 1M --out FILE.npz"


def make_scene(n, width, height, seed=0, sh_degree=3):
    """A synthetic benchmark scene: ``n`` random Gaussians in front of one pinhole camera, as the dict
    of arrays that ``load_scene`` reads from an .npz (``run.py bench --make`` writes one).

    The camera sits at the origin looking down +z (OpenCV axes), focal length 0.9 x ``width``.  Depths
    run from 2 to 20, uniform in their square root so that the near field is denser; x and y spread
    uniformly over 1.2 times the field of view at each depth.  Scales are log-normal in screen pixels
    (median 2.5 px, log-sigma 0.8) turned into world units at each Gaussian's depth, so that each
    covers a few to tens of pixels wherever it is, as in trained scenes.  Rotations are uniform (a
    normalised 4D normal, wxyz), opacity logits N(0, 1.5), SH coefficients N(0, 0.3) with the DC term
    N(0.3, 0.6).  Drawn in this order from ``default_rng(seed)``: seed 0 gives the scenes that
    BENCHMARKS.md's numbers were measured on.
    """
    rng = np.random.default_rng(seed)
    focal = 0.9 * width
    depth = 2.0 + 18.0 * rng.random(n) ** 2
    x = (rng.random(n) - 0.5) * 1.2 * width / focal * depth
    y = (rng.random(n) - 0.5) * 1.2 * height / focal * depth
    footprint_px = np.exp(rng.normal(np.log(2.5), 0.8, (n, 3)))
    quats = rng.normal(size=(n, 4))
    quats /= np.linalg.norm(quats, axis=1, keepdims=True)
    opacities = rng.normal(0.0, 1.5, n)
    sh = rng.normal(0.0, 0.3, (n, (sh_degree + 1) ** 2, 3)).astype(np.float32)
    sh[:, 0, :] = rng.normal(0.3, 0.6, (n, 3))
    return {
        "means": np.stack([x, y, depth], 1).astype(np.float32),
        "quats": quats.astype(np.float32),
        "scales": np.log(footprint_px * depth[:, None] / focal).astype(np.float32),
        "opacities": opacities.astype(np.float32),
        "sh": sh,
        "viewmat": np.eye(4, dtype=np.float32),
        "K": np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]], np.float32),
        "W": width,
        "H": height,
    }


def load_scene(path):
    """Gaussians and camera from a benchmark scene file (``make_scene``'s arrays: ``run.py bench --make``).

    A file that is not such a scene raises ``DataError`` with one line naming it and what is wrong
    (unreadable, not a NumPy archive, missing arrays, damaged, or arrays that do not fit together),
    never NumPy's advice about pickles: scenes hold plain arrays, so nothing is unpickled.
    """
    def fail(what):
        return DataError(f"{path} is not a benchmark scene: {what} ({MAKE_HINT})")

    try:
        z = np.load(path, allow_pickle=False)
    except EOFError:
        raise fail("an empty file") from None
    except zipfile.BadZipFile:
        raise fail("a damaged or truncated .npz archive") from None
    except ValueError:  # neither a zip (.npz) nor an .npy header: NumPy would only try it as a pickle
        raise fail("not a NumPy .npz archive") from None
    except OSError as e:
        raise DataError(f"cannot read benchmark scene {path}: {e.strerror or e}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise fail("a single .npy array, not an .npz archive of arrays")
    with z:
        missing = [k for k in SCENE_KEYS if k not in z.files]
        if missing:
            raise fail(f"it lacks the arrays {', '.join(missing)} (it holds: {', '.join(z.files) or 'none'})")
        arrays = {}
        for k in SCENE_KEYS:
            try:
                arrays[k] = z[k]
            except ValueError:  # allow_pickle=False refused an object array
                raise fail(f"{k} holds Python objects, not numbers") from None
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
                raise fail(f"{k} is damaged ({e})") from None
    try:
        g = Gaussians(*(arrays[k] for k in Gaussians.FIELDS))
        g.validate(np, check=False)
        g.sh_degree()
        cam = Camera.from_K(arrays["viewmat"], arrays["K"], int(arrays["W"]), int(arrays["H"]))
    except (ValueError, TypeError, IndexError) as e:
        raise fail(f"arrays that do not fit together ({e})") from None
    return g, cam
