"""``convert``: one's own photos -> a COLMAP capture to train on (``data/convert.py``, through pycolmap).

As Inria's convert.py: features, matching, incremental mapping, undistortion, then images_2/4/8.
A folder that does not exist or holds fewer than 3 photos, a mapping that registers too few of them
and a missing pycolmap are each one ``error:`` line.
"""
from .args import count, percent


def cmd_convert(a):
    """Run the pipeline with a progress bar over its stages, then say what it made."""
    from data.convert import PycolmapMissing, convert, summary_line
    from engine.tools.outputs import MissingExtra
    try:
        s = convert(a.images, a.out, camera=a.camera, matcher=a.matcher, min_registered=a.min_registered,
                    threads=a.threads, seed=a.seed, overwrite=a.overwrite, quiet=a.quiet, verbose=a.verbose)
    except PycolmapMissing as e:
        raise MissingExtra(str(e)) from None
    for note in s["notes"]:
        print(f"note: {note}")
    print(summary_line(s))
    print(f"train on it: python run.py train --data {s['out']} --out OUT (--images images_4 for a quarter size)")


def add_commands(sub):
    from data.convert import CAMERA_MODELS, MATCHERS
    c = sub.add_parser("convert", help="photos -> a COLMAP capture (pycolmap: features, matching, mapping, "
                                       "undistortion, images_2/4/8), as Inria's convert.py")
    c.add_argument("--images", required=True, metavar="DIR", help="the folder of the photos (read, never changed)")
    c.add_argument("--out", required=True, metavar="DATA",
                   help="the capture to write: DATA/images (undistorted), DATA/sparse/0, DATA/images_2/4/8, "
                        "DATA/distorted (COLMAP's database and model before undistortion)")
    c.add_argument("--camera", choices=CAMERA_MODELS, default="OPENCV",
                   help="the camera model mapping estimates, one shared by all the photos (default OPENCV, as "
                        "Inria's; the undistorted capture is PINHOLE whatever it is)")
    c.add_argument("--matcher", choices=MATCHERS, default="exhaustive",
                   help="exhaustive: every pair (default, as Inria's); sequential: each photo with its "
                        "neighbours in name order (COLMAP's: number frames with zeros, frame_0001.jpg), for video frames "
                        "(linear in the photos, not quadratic)")
    c.add_argument("--min-registered", type=percent, default=50.0, metavar="PCT",
                   help="the percent of the photos mapping must register, else an error (default 50)")
    c.add_argument("--threads", type=int, default=-1, help="threads for COLMAP's stages (default -1: all cores)")
    c.add_argument("--seed", type=count(0), default=0, help="COLMAP's random seed (RANSAC, mapping)")
    c.add_argument("--overwrite", action="store_true", help="replace an earlier conversion in --out")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--verbose", action="store_true", help="COLMAP's own log lines (stderr)")
    c.set_defaults(fn=cmd_convert)
