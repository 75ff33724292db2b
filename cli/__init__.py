"""The command line: one module per group of commands, each adding its subcommands to the parser.

``python run.py --help`` lists them.  A command that fails on bad input, or for want of an optional
extra it needs, prints one line naming it and exits 1 (``NUMBASPLAT_DEBUG=1`` shows the traceback instead).
"""
import os
import sys

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")  # (before Numba is imported)

from . import bench, convert, evaluate, plot, prune, synth, train, view  # noqa: E402
from .args import Parser  # noqa: E402

COMMANDS = (train, evaluate, view, prune, plot, bench, synth, convert)


def parser(prog="run.py"):
    ap = Parser(prog=prog, description="NumbaSplat: 3D Gaussian Splatting in Numba. The options are also "
                "taken in Inria's and gsplat's spellings (-s, -m, -r, -i, -w, --source_path, --data_dir, "
                "--data_factor, underscores for dashes, ...: cli/args.py ALIASES)")
    sub = ap.add_subparsers(dest="cmd")
    for module in COMMANDS:
        module.add_commands(sub)
    return ap


def main(argv=None, prog="run.py"):
    ap = parser(prog)
    a = ap.parse_args(argv)
    if a.cmd is None:
        a = ap.parse_args(["demo"])
    try:
        a.fn(a)
    except (ValueError, OSError, ImportError) as e:  # bad input or a missing extra: a message naming it
        from engine.tools.outputs import MissingExtra
        if os.environ.get("NUMBASPLAT_DEBUG") or (isinstance(e, ImportError) and not isinstance(e, MissingExtra)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def console_main(argv=None):
    """The ``numbasplat`` command that ``pip install`` puts on the PATH (pyproject's [project.scripts]):
    ``python run.py`` under the name it was called by, in its usage lines."""
    return main(argv, prog="numbasplat")
