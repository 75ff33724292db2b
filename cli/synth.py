"""``synth``: the procedural city to train and measure on (``data/synthetic_city.py``)."""
from .args import count


def cmd_synth(a):
    """Write the procedural city dataset (data/synthetic_city.py) and say what it holds."""
    from data.synthetic_city import generate
    s = generate(a.out, preset=a.preset, gaussians=a.gaussians, views=a.views, resolution=a.res, seed=a.seed,
                 force=a.force, progress=not a.quiet, exposure=a.exposure, blocks=a.blocks, sh_degree=a.sh_degree,
                 **({} if a.street_share is None else {"street_share": a.street_share}))
    print(f"wrote {a.out}: {s['gaussians']} ground-truth Gaussians, {s['views']} views at {s['width']}x{s['height']} "
          f"({s['street_views']} street, {s['aerial_views']} aerial, {s['test_views']} held out), "
          f"{s['initial_points']} initial points; {sum(s['seconds'].values()):.1f} s")


def add_commands(sub):
    y = sub.add_parser("synth", help="write a procedural city (COLMAP text, ground-truth PLY) to train on")
    y.add_argument("--out", required=True, help="output folder (new or empty)")
    y.add_argument("--preset", default="small",
                   help="small or large: the city size, Gaussians, views and image size of PRESETS in "
                        "data/synthetic_city.py")
    y.add_argument("--gaussians", type=count(1), default=None, help="ground-truth Gaussians (default: the preset's)")
    y.add_argument("--views", type=count(1), default=None, help="views, every 8th held out (default: the preset's)")
    y.add_argument("--res", default=None, help="image size WxH (default: the preset's)")
    y.add_argument("--blocks", type=count(1), default=None,
                   help="the city's size: blocks x blocks of buildings and streets (default: the preset's)")
    y.add_argument("--street-share", type=float, default=None, metavar="X",
                   help="the share of street-level views, the rest aerial orbits (default 0.7; 0: an aerial "
                        "capture, whose views each see a neighbourhood)")
    y.add_argument("--seed", type=count(0), default=0)
    y.add_argument("--sh-degree", type=int, default=1, choices=(1, 2, 3),
                   help="the ground truth's SH degree (its colours are of degree 1; the higher bands zero, so that "
                        "training from it runs at this degree)")
    y.add_argument("--exposure", type=float, default=0.0, metavar="SIGMA",
                   help="vary the training images' exposure and white balance: per-channel gains exp(SIGMA z), "
                        "z standard normal (0: none; 0.2 is a real capture's spread); held-out views keep theirs")
    y.add_argument("--force", action="store_true", help="overwrite an earlier generation in --out")
    y.add_argument("--quiet", action="store_true", help="no progress bar")
    y.set_defaults(fn=cmd_synth)
