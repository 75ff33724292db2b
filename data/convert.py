"""From one's own photos to a COLMAP capture the loader reads: ``run.py convert`` (cli/convert.py).

This is what Inria's ``convert.py`` does with the COLMAP binary and ImageMagick, done through
pycolmap (a wheel with COLMAP inside: nothing to build or install besides ``pip install pycolmap``,
the ``convert`` extra).  The stages, with Inria's settings where it has them:

1. feature extraction: SIFT on the CPU into ``OUT/distorted/database.db``, one camera shared by all
   the photos (Inria's ``--ImageReader.single_camera 1``: one device) of the OPENCV model
   (Inria's default ``--camera``), whose focal length and distortion mapping estimates.  Photos of
   several sizes cannot share a camera: they get one each, and the summary says so;
2. matching: every pair (Inria's ``exhaustive_matcher``), or each photo with its neighbours in name
   order (``sequential``, for video frames: linear rather than quadratic in the photos; COLMAP sorts
   the names as text, so frame_0002 comes before frame_0010 but 2.jpg after 10.jpg), each pair
   verified geometrically;
3. incremental mapping: poses, intrinsics and 3D points by bundle adjustment (Inria's global
   tolerance, 1e-6).  COLMAP may split photos that do not overlap into several models: the largest
   is kept, in ``OUT/distorted/sparse/0``, and one that registers too few of the photos is an error
   (``mapping failed: only K of N images ...``) rather than a capture with holes;
4. undistortion: the photos resampled to pinhole cameras (PINHOLE), cropped to the pixels that have
   a source, into ``OUT/images`` and ``OUT/sparse/0/{cameras,images,points3D}.bin``: the COLMAP
   capture ``data/colmap.py`` loads, with no distortion left to handle at training time;
5. ``OUT/images_2``, ``images_4``, ``images_8``: the undistorted images at 1/2, 1/4 and 1/8 of their
   size (Inria's ``--resize``, Mip-NeRF 360's layout), for ``train --images images_4`` and the like.

``OUT/distorted`` (the database and the model before undistortion) stays, as Inria's does: COLMAP's
GUI opens it, and it shows what mapping found.  The photos are read where they are, never moved.
"""
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from PIL import Image

from .images import IMAGE_EXTENSIONS, list_image_files, parallel_map
from .scene import DataError

MIN_IMAGES = 3                       # fewer cannot make a model (two views give no scale check)
CAMERA_MODELS = ("OPENCV", "SIMPLE_RADIAL", "RADIAL", "SIMPLE_PINHOLE", "PINHOLE")  # the first: Inria's default
MATCHERS = ("exhaustive", "sequential")
DOWNSCALES = (2, 4, 8)               # OUT/images_N
OUTPUTS = ("images", "sparse", "distorted") + tuple(f"images_{f}" for f in DOWNSCALES)  # what convert writes
STAGES = ("features", "matching", "mapping", "undistortion", "images_2/4/8")
PYCOLMAP_HINT = "convert needs pycolmap: pip install pycolmap (the convert extra: pip install -e '.[convert]')"


class PycolmapMissing(ImportError):
    """pycolmap is not installed (cli/convert.py makes it a one-line error naming the extra)."""


def import_pycolmap():
    """The pycolmap module, else ``PycolmapMissing`` with the install hint."""
    try:
        import pycolmap
    except ImportError:
        raise PycolmapMissing(PYCOLMAP_HINT) from None
    return pycolmap


def photos_of(images):
    """The sorted image file names directly in the folder ``images``; DataError, naming the folder,
    when it does not exist or holds fewer than ``MIN_IMAGES``."""
    images = Path(images)
    if not images.exists():
        raise DataError(f"image folder {images} does not exist")
    if not images.is_dir():
        raise DataError(f"{images} is not a folder: --images takes the folder of the photos")
    names = list_image_files(images)
    if len(names) < MIN_IMAGES:
        found = f"only {len(names)} image{'' if len(names) == 1 else 's'}" if names else "no images"
        raise DataError(f"image folder {images} holds {found} ({', '.join(IMAGE_EXTENSIONS)}); convert needs "
                        f"at least {MIN_IMAGES} overlapping photos of the scene")
    return names


def check_out(images, out, overwrite=False):
    """Refuse an ``out`` that holds an earlier conversion (without ``overwrite``, which removes it)
    and photos where convert writes (``OUT/images`` would be overwritten by the undistorted ones)."""
    images, out = Path(images).resolve(), Path(out).resolve()
    for name in OUTPUTS:
        if images == out / name or out / name in images.parents:
            raise DataError(f"the photos in {images} are where convert writes ({out / name}): move them to "
                            f"another folder, e.g. {out / 'input'} (as Inria's convert.py has them)")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder")
    earlier = [name for name in OUTPUTS if (out / name).exists()]
    if earlier and not overwrite:
        raise DataError(f"{out} already holds {', '.join(earlier)} (an earlier conversion?): pass --overwrite to "
                        f"replace them, or choose another --out")
    for name in earlier:
        p = out / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def downscaled_size(size, factor):
    """(w, h) / factor, rounded half up and at least 1 (ImageMagick's ``-resize 50%``)."""
    return tuple(max(1, int(v / factor + 0.5)) for v in size)


def write_downscales(folder, names, factors=DOWNSCALES, threads=None):
    """``folder/../images_F/NAME`` for each image NAME of ``folder`` and factor F: Lanczos-filtered, the
    same file name and format (JPEG at quality 95)."""
    folder = Path(folder)
    for f in factors:
        (folder.parent / f"images_{f}").mkdir(exist_ok=True)

    def work(name):
        with Image.open(folder / name) as im:
            im.load()
            for f in factors:
                small = im.resize(downscaled_size(im.size, f), Image.LANCZOS)
                extra = {"quality": 95} if Path(name).suffix.lower() in (".jpg", ".jpeg") else {}
                small.save(folder.parent / f"images_{f}" / name, **extra)

    parallel_map(work, names, workers=threads if threads and threads > 0 else None)


@contextmanager
def _colmap_log(pycolmap, verbose):
    """COLMAP's log lines (several per image and stage, and its own view of a failure, which the
    errors here say in one line) off unless ``verbose``."""
    before = pycolmap.logging.minloglevel
    if not verbose:
        pycolmap.logging.minloglevel = 3  # (glog's FATAL: only what ends the process)
    try:
        yield
    finally:
        pycolmap.logging.minloglevel = before


def _progress(total, quiet):
    from tqdm import tqdm
    return tqdm(total=total, desc="convert", unit="stage", disable=quiet, leave=False,
                bar_format="{desc} {n_fmt}/{total_fmt} stages |{bar}| {elapsed}")


def convert(images, out, camera="OPENCV", matcher="exhaustive", min_registered=50.0, threads=-1, seed=0,
            overwrite=False, quiet=False, verbose=False):
    """Photos in the folder ``images`` -> the COLMAP capture ``out`` (the module's docstring says how).

    ``camera``: the camera model mapping estimates (one of ``CAMERA_MODELS``); ``matcher``:
    ``exhaustive`` (every pair) or ``sequential`` (name-order neighbours: video frames);
    ``min_registered``: the percent of the photos the model must register, else DataError
    ``mapping failed``; ``threads``: for COLMAP's stages (-1: all cores); ``seed``: COLMAP's random
    seed (RANSAC, mapping); ``overwrite``: replace an earlier conversion in ``out``; ``quiet``: no
    progress bar; ``verbose``: COLMAP's own log lines.

    Returns a summary dict: images, registered, points, reprojection_error (px, mean), camera,
    size (the undistorted images'), seconds (per stage and total), notes, out.
    """
    if camera not in CAMERA_MODELS:
        raise ValueError(f"camera must be one of {', '.join(CAMERA_MODELS)}, got {camera!r}")
    if matcher not in MATCHERS:
        raise ValueError(f"matcher must be one of {', '.join(MATCHERS)}, got {matcher!r}")
    images, out = Path(images), Path(out)
    names = photos_of(images)
    check_out(images, out, overwrite)
    pycolmap = import_pycolmap()
    notes = []
    sizes = {}
    for name in names:
        with Image.open(images / name) as im:
            sizes.setdefault(im.size, []).append(name)
    if len(sizes) > 1:
        listed = ", ".join(f"{w}x{h} ({len(n)})" for (w, h), n in sorted(sizes.items(), key=lambda kv: -len(kv[1])))
        notes.append(f"the photos have {len(sizes)} sizes ({listed}): one camera each, not one shared")

    made_out = not out.exists()
    distorted = out / "distorted"
    (distorted / "sparse").mkdir(parents=True, exist_ok=True)
    database = distorted / "database.db"
    if database.exists():
        database.unlink()
    seconds = {}
    bar = _progress(len(STAGES), quiet)
    current = [None, time.perf_counter()]  # the stage running, since when

    def stage(name):
        """End the stage running (its seconds, the bar a step on) and start ``name`` (None: the end)."""
        now = time.perf_counter()
        if current[0] is not None:
            seconds[current[0]] = now - current[1]
            bar.update(1)
        current[:] = [name, now]
        if name:
            bar.set_description_str(f"convert: {name}")

    try:
        with _colmap_log(pycolmap, verbose):
            pycolmap.set_random_seed(seed)
            stage("features")
            reader = pycolmap.ImageReaderOptions()
            reader.camera_model = camera
            extraction = pycolmap.FeatureExtractionOptions()
            extraction.num_threads = threads
            pycolmap.extract_features(database, images, image_names=names,
                                      camera_mode=pycolmap.CameraMode.SINGLE if len(sizes) == 1
                                      else pycolmap.CameraMode.PER_IMAGE,
                                      reader_options=reader, extraction_options=extraction)

            stage("matching")
            matching = pycolmap.FeatureMatchingOptions()
            matching.num_threads = threads
            if matcher == "exhaustive":
                pycolmap.match_exhaustive(database, matching_options=matching)
            else:
                pycolmap.match_sequential(database, matching_options=matching)

            stage("mapping")
            registered = 0

            def registering(start):
                def callback():  # after a model's initial pair (2 registered), after each image then (+1)
                    nonlocal registered
                    registered = 2 if start else registered + 1
                    bar.set_description_str(f"convert: mapping ({registered} registered)")
                return callback

            options = pycolmap.IncrementalPipelineOptions()
            options.num_threads = threads
            options.random_seed = seed
            options.ba_global_function_tolerance = 1e-6  # Inria's --Mapper.ba_global_function_tolerance
            models_dir = distorted / "models"
            shutil.rmtree(models_dir, ignore_errors=True)
            models_dir.mkdir()
            models = pycolmap.incremental_mapping(database, images, models_dir, options,
                                                  initial_image_pair_callback=registering(True),
                                                  next_image_callback=registering(False))
            shutil.rmtree(models_dir)
            best = max(models.values(), key=lambda m: m.num_reg_images(), default=None)
            k = best.num_reg_images() if best is not None else 0
            if k < max(MIN_IMAGES, min_registered / 100.0 * len(names)):
                raise DataError(f"mapping failed: only {k} of {len(names)} images of {images} registered; try more "
                                f"overlap between the photos (--verbose shows COLMAP's log)")
            model = distorted / "sparse" / "0"
            shutil.rmtree(model, ignore_errors=True)
            model.mkdir(parents=True)
            best.write_binary(str(model))
            if k < len(names):
                found = {best.image(i).name for i in best.reg_image_ids()}
                left = [n for n in names if n not in found]
                shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
                split = f" (mapping made {len(models)} separate models; the largest is kept)" if len(models) > 1 else ""
                notes.append(f"{len(left)} of the {len(names)} photos did not register and are left out{split}: "
                             f"{shown}")
            points = best.num_points3D()
            error = best.compute_mean_reprojection_error()

            stage("undistortion")
            undistorted = distorted / "undistorted"
            shutil.rmtree(undistorted, ignore_errors=True)
            pycolmap.undistort_images(undistorted, model, images, output_type="COLMAP", num_threads=threads)
            (undistorted / "images").rename(out / "images")
            (out / "sparse" / "0").mkdir(parents=True)
            for f in (undistorted / "sparse").iterdir():
                f.rename(out / "sparse" / "0" / f.name)
            shutil.rmtree(undistorted)  # (stereo/ and the MVS scripts: not used here)

            stage("images_2/4/8")
            written = list_image_files(out / "images")
            write_downscales(out / "images", written, threads=threads if threads > 0 else None)
            stage(None)
    except BaseException:  # (a failure or Ctrl-C: no half capture left to refuse the next run)
        bar.close()
        for name in OUTPUTS:
            shutil.rmtree(out / name, ignore_errors=True)
        if made_out and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    bar.close()

    from .colmap import read_cameras_binary
    cams = read_cameras_binary(out / "sparse" / "0" / "cameras.bin")
    cam = next(iter(cams.values()))
    camera_line = (f"{len(cams)} {cam.model} camera{'' if len(cams) == 1 else 's'}"
                   + (f" at {cam.width}x{cam.height}" if len(cams) == 1 else ""))
    seconds["total"] = sum(seconds.values())
    return {"out": str(out), "images": len(names), "registered": k, "points": points,
            "reprojection_error": float(error), "camera": camera_line, "size": (cam.width, cam.height),
            "seconds": seconds, "notes": notes}


def summary_line(s):
    """The one line ``run.py convert`` ends with."""
    return (f"wrote {s['out']}: {s['registered']} of {s['images']} images registered, {s['points']} points, mean "
            f"reprojection error {s['reprojection_error']:.2f} px, {s['camera']}; images, images_2/4/8 and sparse/0; "
            f"{s['seconds']['total']:.1f} s ("
            + ", ".join(f"{k} {v:.1f}" for k, v in s["seconds"].items() if k != "total") + ")")


__all__ = ["convert", "summary_line", "photos_of", "check_out", "write_downscales", "downscaled_size",
           "import_pycolmap", "PycolmapMissing", "CAMERA_MODELS", "MATCHERS", "MIN_IMAGES", "DOWNSCALES"]
