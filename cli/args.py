"""What several commands share: the parser, which takes other trainers' spellings of the options
(``ALIASES``), argument types that name a bad value, the capture options, the output folder (made,
and claimed by a run: ``claimed_output``), the MPI communicator a command runs on, and the metrics file."""
import argparse
import contextlib
import difflib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

TRANSPORTS = ["auto", "nccl", "cuda", "host", "ipc"]  # comm.TRANSPORTS and "auto" (comm is imported late: mpi4py)

# Inria's 3DGS and gsplat's spellings of our options (users bring their habits and scripts): theirs ->
# ours, or ours in the order tried where commands differ (Inria's -m is the model eval reads, and the
# folder train writes).  Any long option is taken with underscores for dashes too (--lr_means), so
# only dashes are listed; a config file's keys are looked up the same way (cli/config.py).
ALIASES = {
    "-s": "--data", "--source-path": "--data", "--data-dir": "--data",
    "-m": ("--model", "--out"), "--model-path": ("--model", "--out"), "--result-dir": "--out",
    "-r": "--resolution", "--data-factor": "--resolution",
    "-i": "--images",
    "-w": "--white-background",
    "--max-steps": "--iters",
    "--densify-grad-threshold": "--grad-threshold", "--grow-grad2d": "--grad-threshold",
    "--densify-from-iter": "--densify-from", "--refine-start-iter": "--densify-from",
    "--densify-until-iter": "--densify-until", "--refine-stop-iter": "--densify-until",
    "--densification-interval": "--densify-every", "--refine-every": "--densify-every",
    "--opacity-reset-interval": "--opacity-reset-every", "--reset-every": "--opacity-reset-every",
    "--position-lr-init": "--lr-means", "--position-lr-final": "--lr-means-final",
    "--position-lr-max-steps": "--lr-means-steps", "--scaling-lr": "--lr-scales", "--rotation-lr": "--lr-quats",
    "--opacity-lr": "--lr-opacities", "--feature-lr": "--lr-sh", "--ssim-lambda": "--lambda-dssim",
    "--prune-opa": "--prune-opacity", "--random-bkgd": "--random-background", "--antialiased": "--antialias",
    "--antialiasing": "--antialias", "--ip": "--host",
    "--save-iterations": "--save-at", "--save-steps": "--save-at",
    "--test-iterations": "--eval-at", "--eval-steps": "--eval-at",
    "--init-num-pts": "--init-points", "--init-opa": "--init-opacity", "--sh-degree-interval": "--sh-increase-every",
    "--app-opt": "--appearance",
}
# Their options that mean something else here, with what to give instead (said where one is unknown).
UNLIKE = {
    "--checkpoint-iterations": "this trainer writes OUT/snapshot.h5 every --snapshot-every N steps and at the end",
    "--start-checkpoint": "continue a run from OUT/snapshot.h5 with --out OUT --resume",
    "--disable-viewer": "the viewer is off unless --viewer is given",
    "--ckpt": "continue a run from OUT/snapshot.h5 with --out OUT --resume",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser that also takes the options in other trainers' spellings (``ALIASES``) and
    with underscores for dashes (each is rewritten to this parser's name before parsing), and says
    what is wrong with the arguments in one line.  A command's parser is one too (``add_subparsers``
    makes its parsers of the parent's class)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.our_spellings(args), namespace)

    def our_spellings(self, args):
        """``args`` with every option (up to a ``--``) as this parser spells it; values as they are."""
        args = list(args)
        for i, token in enumerate(args):
            if token == "--":
                break
            if token.startswith("-"):
                flag, equals, value = token.partition("=")
                args[i] = self.our_flag(flag) + equals + value
        return args

    def our_flag(self, flag):
        """This parser's option ``flag`` stands for (``--x_y`` is ``--x-y``; ``ALIASES``, ``--no-``
        before a switch's alias too); ``flag`` with dashes where it names none of them."""
        if flag.startswith("--"):
            flag = "--" + flag[2:].replace("_", "-")
        if flag in self._option_string_actions:
            return flag
        negated = flag.startswith("--no-") and "--" + flag[5:] in ALIASES
        targets = ALIASES.get("--" + flag[5:] if negated else flag, ())
        for target in (targets,) if isinstance(targets, str) else targets:
            target = "--no-" + target[2:] if negated else target
            if target in self._option_string_actions:
                return target
        return flag

    def parse_args(self, args=None, namespace=None):
        """argparse's, but arguments no option takes end the command with one line naming the first
        unknown option and the closest known one (exit 2)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.command_parser(ns).unknown_options(extras))
        return ns

    def error(self, message):
        """A bad argument ends the command with one line naming it (exit 2), not the usage first
        (train's is 44 lines, which hide the one that matters)."""
        self.exit(2, f"error: {message}\n")

    def command_parser(self, ns):
        """The parser of the command ``ns`` was parsed for (this one where it has no commands)."""
        for action in self._actions:
            chosen = action.choices.get(getattr(ns, action.dest, None)) if isinstance(action.choices, dict) else None
            if isinstance(chosen, Parser):
                return chosen.command_parser(ns)
        return self

    def unknown_options(self, extras):
        """What to say of ``extras``, the arguments no option of this parser took: the first unknown
        option with this parser's closest one (difflib), or the stray arguments."""
        unknown = next((t.partition("=")[0] for t in extras if t.startswith("-") and not is_number(t)), None)
        if unknown is None:
            return f"unrecognized arguments: {' '.join(extras)}"
        if (instead := self.instead_of(unknown)) is not None:
            return f"unknown option {unknown}: {instead}"
        close = difflib.get_close_matches(unknown, [o for o in self._option_string_actions if o.startswith("--")], n=1)
        hint = f"did you mean {close[0]}?" if close else f"{self.prog} --help lists them"
        return f"unknown option {unknown}; {hint}"

    def instead_of(self, flag):
        """What to give instead of another trainer's option ``flag`` (any spelling) that means something else
        here (``UNLIKE``); None where it is not one."""
        return UNLIKE.get(self.our_flag(flag if str(flag).startswith("-") else "--" + str(flag)))

    def dest_of(self, name):
        """The option a config file's key ``name`` names, by its flag in any spelling; None if none."""
        action = self._option_string_actions.get(self.our_flag("--" + str(name)))
        return action.dest if action is not None else None


def is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parsed(text, kind, what):
    """``kind(text)``, or argparse's error naming ``what`` was expected."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def integer(text):
    return _parsed(text, int, "an integer")


def count(low):
    """argparse type: an integer of at least ``low`` (so a bad value is named, not silently used)."""
    def parse(text):
        value = integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def number(text):
    return _parsed(text, float, "a number")


def _unit_interval(text, ends):
    """A number in [0, 1], or strictly inside it where ``ends`` is False; one message either way."""
    value = number(text)
    if not (0.0 <= value <= 1.0 if ends else 0.0 < value < 1.0):
        raise argparse.ArgumentTypeError(f"must be between 0 and 1{'' if ends else ' (both excluded)'}, got {value}")
    return value


def fraction(text):
    """argparse type: a number in [0, 1]."""
    return _unit_interval(text, ends=True)


def open_fraction(text):
    """argparse type: a number strictly between 0 and 1 (an opacity, whose logit is finite)."""
    return _unit_interval(text, ends=False)


def positive(text):
    """argparse type: a finite number above 0."""
    value = number(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def percent(text):
    """argparse type: a percentage above 0, at most 100."""
    value = number(text)
    if not 0.0 < value <= 100.0:
        raise argparse.ArgumentTypeError(f"must be a percentage above 0 and at most 100, got {value:g}")
    return value


def nonnegative(text):
    """argparse type: a finite number of at least 0."""
    value = number(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {value}")
    return value


def hold_out(text):
    """argparse type of ``--test-every``: 0 (no test views) or at least 2 (1 would hold out every view)."""
    value = count(0)(text)
    if value == 1:
        raise argparse.ArgumentTypeError("must be 0 (no test views) or at least 2 (1 would hold out every view)")
    return value


BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text):
    """argparse type: a size in bytes, a number with an optional unit (``24GiB``, ``512MiB``, ``1.5GB``,
    ``1000000``; KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024)."""
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in ("", *BYTE_UNITS):
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 24GiB, 512MiB or 1000000, got {text!r}")
    return int(float(m.group(1)) * BYTE_UNITS.get(unit, 1))


def switch(p, *flags, help):
    """A ``--x/--no-x`` option, off by default (``--no-x`` turns off what a config file turned on)."""
    action = p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=False)
    action.help = help  # set after: argparse appends "(default: %(default)s)", which reads None in train's help
    return action


def resolution(text):
    """argparse type of ``--resolution``: an integer of at least 1, or -1 (Inria's "auto": None, the default)."""
    value = integer(text)
    if value == 0 or value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the default) or at least 1, got {value}")
    return None if value == -1 else value


def width_cap(a):
    """The largest image width: ``--max-width``, else, as Inria's, ``DEFAULT_MAX_WIDTH`` unless a
    ``--resolution`` is given (which says the size wanted)."""
    from data.images import DEFAULT_MAX_WIDTH
    if a.max_width is not None:
        return a.max_width
    return 0 if a.resolution else DEFAULT_MAX_WIDTH


def add_data_options(p, need_data=True, need_out=True):
    """The options that name a capture, how its images are scaled and split, and where a command
    writes (``need_data``/``need_out`` False: a config file may give ``--data`` and ``--out``, or the
    command can do without them)."""
    from data.images import DEFAULT_MAX_WIDTH, DISTORTION, MAX_FACTOR
    p.add_argument("--data", required=need_data, help="capture folder (COLMAP, Blender or instant-ngp)")
    p.add_argument("--format", default="auto", choices=["auto", "colmap", "blender", "ngp"])
    p.add_argument("--images", default=None, help="image folder of a COLMAP capture, e.g. images_4")
    switch(p, "--white-background", help="composite RGBA on white and train on a white background (Blender "
                                         "scenes): the same as --background 1 1 1")
    p.add_argument("--resolution", type=resolution, default=None, metavar="N",
                   help=f"as Inria's -r: N up to {MAX_FACTOR} divides the images' width and height on loading, a "
                        f"larger N is their width in pixels (-1: the default, full size up to {DEFAULT_MAX_WIDTH} px "
                        "wide)")
    p.add_argument("--max-width", type=count(0), default=None, metavar="PX",
                   help=f"narrow images still wider than PX pixels to PX, as Inria does (default {DEFAULT_MAX_WIDTH} "
                        "without --resolution, else none; 0: no limit)")
    p.add_argument("--distortion", choices=DISTORTION, default="undistort",
                   help="cameras with lens distortion: undistort their images (cropped to the pixels with a "
                        "source), or ignore it and train on them as pinhole views, as trainers that do not "
                        "undistort do (default undistort)")
    p.add_argument("--test-every", type=hold_out, default=None, metavar="N",
                   help="hold out every Nth image (sorted by name) as a test view (0: none; "
                        "default: 8 with --eval and for eval/render, else none)")
    p.add_argument("--out", required=need_out, help="output folder")


def port_number(text):
    """argparse type: a TCP port, 1 to 65535."""
    value = count(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value}")
    return value


def add_viewer_options(p):
    """``--port`` and ``--host`` of the browser viewer (``view``, ``train --viewer``)."""
    p.add_argument("--port", type=port_number, default=None,
                   help="the viewer's port (default 8080; one in use is named with a free one to take)")
    p.add_argument("--host", default=None,
                   help="the address the viewer listens on (default 127.0.0.1: this machine only, which ssh -L "
                        "reaches; 0.0.0.0: every network of this machine)")


def load_data(a, background, test_every=None):
    """The capture ``--data`` names, scaled as ``--resolution`` and ``width_cap`` say, with every
    ``--test-every``-th image held out (``test_every`` where the option is not given); a bad one
    ends the command with the loader's message."""
    from data import DataError, load_dataset
    if a.test_every is not None:
        test_every = a.test_every
    try:
        return load_dataset(a.data, fmt=a.format, images=a.images, background=background, test_every=test_every,
                            resolution=a.resolution, max_width=width_cap(a), distortion=a.distortion)
    except DataError as e:
        raise SystemExit(f"error: {e}")


def output_folder(path):
    """Make the output folder ``path`` (and its parents); one error naming ``--out`` where it cannot
    be a folder (a file there or above it) rather than the system's "[Errno 17] File exists"."""
    out = Path(path)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "it" if p == out else str(p)
                raise ValueError(f"--out {path}: {what} is a file, not a folder; give an output folder")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot make the output folder ({e.strerror or e})") from None
    return out


LOCK = ".lock"  # OUT/.lock: "PID HOST" of the run writing in OUT


@contextlib.contextmanager
def claimed_output(out, resume=False, overwrite=False):
    """The output folder ``out`` (made already) for this run alone while the context lasts.  A lock
    file, ``OUT/.lock``, refuses a second run into it at the same time (their files would mix); a
    killed run's lock is taken over.  A folder that holds an earlier run is refused unless ``resume``
    (continue it) or ``overwrite`` (remove its outputs first): the old PLYs, metrics and renders
    would lie beside the new model, and viewers open the stale ones.  Under MPI rank 0 alone claims."""
    from engine.tools.outputs import run_outputs
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: give one")
    lock = take_lock(Path(out))
    try:
        earlier = run_outputs(out)
        if earlier and not resume:
            names = ", ".join([p.relative_to(out).as_posix() for p in earlier[:3]] + ["..."] * (len(earlier) > 3))
            if not overwrite:
                raise ValueError(f"--out {out} holds an earlier run ({names}): give --resume to continue it, "
                                 "--overwrite to replace it, or another --out")
            for p in earlier:
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            print(f"--overwrite: removed the earlier run's outputs from {out} ({names})")
        yield
    finally:
        release_lock(*lock)


def take_lock(out):
    """Create ``OUT/.lock`` holding this process's PID and host; a lock of a process that has ended on
    this host (a killed run) is taken over, another is a ValueError naming its holder.
    -> (the lock's path, what it holds)."""
    path, me = out / LOCK, f"{os.getpid()} {socket.gethostname()}"
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock_holder(path)
            if holder is not None:
                raise ValueError(f"--out {out}: another run is writing there ({holder}, its lock {path}): wait "
                                 f"for it, or give another --out (remove {path} if no run is)") from None
            continue  # (stale, removed, or released meanwhile)
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        return path, me


def lock_holder(path):
    """Who holds the lock file ``path``, in words; None where it is gone or stale (its process has
    ended on this host, or is this one: a PID reused in a new container), which is then removed."""
    try:
        pid, host = path.read_text().split()
        pid = int(pid)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "a lock that names no process"
    if host != socket.gethostname():
        return f"PID {pid} on {host}"
    if pid != os.getpid() and process_alive(pid):
        return f"PID {pid} on this host"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return None


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def release_lock(path, me):
    """Remove the lock ``path`` where it still holds ``me`` (not taken over since)."""
    with contextlib.suppress(OSError):
        if path.read_text().strip() == me:
            path.unlink()


def write_metrics(summary, out_dir):
    """``OUT/metrics.json`` (atomically) and the line a user reads."""
    from data.atomic import atomic_path
    path = Path(out_dir) / "metrics.json"
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(summary, indent=1))
    if summary["psnr"] is not None:
        lpips = f", LPIPS {summary['lpips']:.4f}" if summary.get("lpips") is not None else ""
        print(f"test PSNR {summary['psnr']:.2f} dB, SSIM {summary['ssim']:.4f}{lpips} over {len(summary['views'])} "
              f"views; {summary['gaussians']} Gaussians; {summary['train_seconds']:.1f} s training; metrics in {path}")


def mpi_comm(batched=False):
    """COMM_WORLD when started by mpiexec/srun with several ranks; else COMM_SELF for
    ``batched`` training (--batch-size on one process: the batched pipeline, one rank), else None."""
    launched = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    if not any(k in os.environ for k in launched) and not batched:
        return None
    from comm.libraries import MPIUnavailable, load_mpi
    try:
        MPI = load_mpi()
    except MPIUnavailable as e:
        raise SystemExit(f"error: {e}") from None
    if MPI.COMM_WORLD.Get_size() > 1:
        return MPI.COMM_WORLD
    return MPI.COMM_SELF if batched else None


def steps(text):
    """argparse type: training steps, integers of at least 1 separated by commas ("7000,30000"), or 0
    for none.  -> a sorted tuple."""
    items = [t for t in str(text).replace(" ", "").split(",") if t]
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps separated by commas (7000,30000), got {text!r}") from None
    if values == [0]:
        return ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"steps must be at least 1 (or 0 for none), got {text!r}")
    return tuple(sorted(set(values)))


class MergeSteps(argparse.Action):
    """``--save-at 7000,30000`` and ``--save-at 7000 30000`` (a config file's list) alike: the steps
    of every value, merged and sorted."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, tuple(sorted({s for v in values for s in v})))
