"""``train``'s settings, from three places: the defaults, a ``--config`` file and the command line.

Every field of ``engine.recipe.trainer.TrainConfig`` (the recipe) and of ``engine.pipelines.PipelineOptions``
(the pipeline) is a flag, generated from the dataclass: the field's name with dashes (``lr_means``:
``--lr-means``), a type from its annotation (a whole number >= 0, a number >= 0, ``--x/--no-x`` for
a bool, a string) and the comment beside the field as the help, so that a new field is reachable
without code here.  ``FLAGS`` gives the few fields whose flag has another name as well
(``--iters``, ``--init-points``), a narrower type or choices.

A config file (``--config FILE``: .json, or .yaml/.yml, which needs PyYAML) is one mapping of the
``train`` command's settings by their names with underscores (or any spelling their flags take:
``iters``, Inria's ``source_path``, ``densify_grad_threshold``: cli/args.py ALIASES): TrainConfig's fields and the
command's other options (``data``, ``images``, ``resolution``, ``max_width``, ``test_every``,
``eval``, ``out``, ``batch_size``, ...), all but ``COMMAND_LINE_ONLY``, which say what this
invocation does rather than what the run is.  Its values are checked as the flags' are; null
stands for the default.  A flag given on the command line overrides the file, and the file the
defaults.  ``OUT/cfg.json`` is such a file, written as a run starts with each of its settings
resolved (``out`` aside), so that ``run.py train --config OLD/cfg.json --out NEW`` repeats it.
"""
import argparse
import dataclasses
import difflib
import inspect
import io
import json
import textwrap
import tokenize
import typing
from pathlib import Path

from .args import TRANSPORTS, MergeSteps, byte_size, count, fraction, nonnegative, open_fraction, percent, positive, steps

# what this invocation does, not a setting of the run
COMMAND_LINE_ONLY = ("config", "resume", "overwrite", "quiet", "viewer", "port", "host", "timeline")
NOT_RECORDED = COMMAND_LINE_ONLY + ("out",)         # cfg.json lies in OUT: a copy of the run goes elsewhere

# the fields whose flag has another name too, a narrower type, choices or a longer help than the generated one
FLAGS = {
    "iterations": dict(flags=("--iters",), type=count(1), metavar="N"),
    "n_random_init": dict(flags=("--init-points",), type=count(1), metavar="N"),
    "sh_degree": dict(type=int, choices=range(4)),
    "sh_increase_every": dict(type=count(1)),
    "lambda_dssim": dict(type=fraction),
    "loss": dict(choices=["global", "tile"]),
    "view_order": dict(choices=["auto", "random", "trajectory"]),
    "s3im_repeats": dict(type=count(1),
                         help="with --loss tile: arrangements of each tile's pixels into S3IM windows, the first "
                              "spatial and the others random (as published)"),
    "lambda_s3im": dict(type=fraction,
                        help="with --loss tile: the weight l of (1 - l) L1 + l (1 - S3IM) (default 0.5 where the "
                             "images have alpha, objects on a plain background such as Blender scenes; else 0.2)"),
    "lr_means_steps": dict(type=count(1)),
    "opacity_reg": dict(type=nonnegative),
    "scale_reg": dict(type=nonnegative),
    "strategy": dict(choices=["default", "mcmc"], help="densification: 3DGS's (default) or 3DGS as MCMC"),
    "cap_max": dict(type=count(1)),
    "init_opacity": dict(type=open_fraction),
    "init_scale": dict(type=positive),
    "max_gaussians": dict(help="memory guard: stop growing at N Gaussians (0: the device's capacity)"),
    "grad_threshold": dict(type=positive),
    "densify_every": dict(type=count(1)),
    "opacity_reset_every": dict(type=count(1)),
    "prune_opacity": dict(type=fraction),
    "batch_lr_exponent": dict(type=fraction,
                              help="at batch B the learning rates are scaled by B ** this (0.5 as Grendel does; "
                                   "Adam's betas are raised to the power B)"),
    "background": dict(type=fraction, nargs=3, metavar=("R", "G", "B")),
    "log_every": dict(type=count(1)),
    "prune": dict(choices=["none", "contribution", "hardware"]),
    "prune_beta": dict(type=percent, metavar="PCT"),
    "smem_budget": dict(metavar="BYTES"),
    "importance_prune": dict(type=fraction, metavar="T"),
    "view_masks": dict(choices=["on", "off", "auto"]),
    "lod_views": dict(choices=["all", "auto"]),
    "cull_share_below": dict(type=fraction),
    "view_mask_below": dict(type=positive),
    "lod_min_px": dict(metavar="R"),
    "targets": dict(choices=["auto", "float32", "uint8"]),
    "step_graphs": dict(choices=["on", "off"]),
    "fuse_adam": dict(choices=["on", "off"]),
    "save_at": dict(type=steps, nargs="+", action=MergeSteps, metavar="N[,N...]"),
    "eval_at": dict(type=steps, nargs="+", action=MergeSteps, metavar="N[,N...]"),
    # PipelineOptions
    "batch_size": dict(type=count(1)),
    "offload": dict(choices=["none", "host", "disk"]),
    "offload_dir": dict(metavar="PATH"),
    "host_memory": dict(type=byte_size, metavar="BYTES"),
    "gpu_memory": dict(type=byte_size, metavar="BYTES"),
    "offload_adam": dict(choices=["device", "host"]),
    "exchange": dict(choices=["gaussian", "pixel", "auto"]),
    "saturation": dict(choices=["on", "off"]),
    "render_ahead": dict(metavar="K"),
    "consolidation": dict(choices=["on", "off"]),
    "shard": dict(choices=["contiguous", "parity"]),
    "devices": dict(metavar="N|all"),
    "virtual_devices": dict(type=count(1)),
    "grad_comm": dict(choices=["sparse", "dense"]),
    "transport": dict(choices=TRANSPORTS),
}


class ConfigError(ValueError):
    """A bad ``--config`` file or a missing setting; the message names the file and the key."""


def add_config_options(p):
    """``--config`` and a flag for every field of ``TrainConfig`` and of ``PipelineOptions``, its
    default the field's."""
    from engine.pipelines import PipelineOptions
    from engine.recipe.trainer import TrainConfig
    p.add_argument("--config", metavar="FILE",
                   help="a .json or .yaml file of settings by name: TrainConfig's and PipelineOptions' fields and "
                        "the options of this command, with underscores (cli/config.py); flags given here override it")
    add_field_flags(p.add_argument_group("pipeline settings", "also keys of a --config file, with underscores"),
                    PipelineOptions)
    add_field_flags(p.add_argument_group("training settings", "also keys of a --config file, with underscores"),
                    TrainConfig)


def add_field_flags(group, settings):
    """A flag in ``group`` for every field of the dataclass ``settings``: its name with dashes, a type
    from its annotation (``flag_of_type``) or ``FLAGS``, the field's comment as the help and its
    default as the flag's."""
    comments = field_comments(settings)
    hints = typing.get_type_hints(settings)
    for f in dataclasses.fields(settings):
        spec = {**flag_of_type(hints[f.name]), **FLAGS.get(f.name, {})}
        flags = spec.pop("flags", ()) + ("--" + f.name.replace("_", "-"),)
        text = spec.pop("help", comments.get(f.name, ""))
        action = group.add_argument(*flags, dest=f.name, default=f.default, **spec)
        if f.default is not None:
            text += f" (default {shown(f.default)})"
        action.help = text.strip().replace("%", "%%")   # set here: argparse appends its own to some actions' help


def flag_of_type(annotation):
    """argparse keywords for a field of type ``annotation`` (``X | None`` as ``X``)."""
    kinds = [t for t in typing.get_args(annotation) if t is not type(None)] or [annotation]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind is bool:
        return dict(action=argparse.BooleanOptionalAction)
    if kind is int:
        return dict(type=count(0), metavar="N")
    if kind is float:
        return dict(type=nonnegative, metavar="X")
    if kind in (tuple, list):
        return dict(type=nonnegative, nargs="+", metavar="X")
    return dict(type=str)


def shown(value):
    if isinstance(value, (tuple, list)):
        return " ".join(shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def field_comments(cls):
    """{field name: its comment} from the source of the dataclass ``cls``: the comment on the
    field's line and the comment lines right below it that start in the same column."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen install): flags without help
        return {}
    comments = {t.start[0]: (t.start[1], t.string.lstrip("#").strip())
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(cls)}
    found, current, column = {}, None, None
    for row, line in enumerate(source.splitlines(), 1):
        name = line.split(":", 1)[0].strip()
        if ":" in line and name in names and line[:len(line) - len(line.lstrip())] == "    ":
            current = name
            column, text = comments.get(row, (None, ""))
            found[name] = [text] if text else []
        elif current and line.lstrip().startswith("#") and comments.get(row, (None,))[0] == column:
            found[current].append(comments[row][1])
        else:
            current = None
    return {k: " ".join(v) for k, v in found.items() if v}


def resolve(a, parser):
    """Fill in the options of ``a`` that the command line left None: from the ``--config`` file
    (``a.config``), else the default.  ``parser`` is a parser of the command with its real
    defaults (the command's own parser defaults to None, so that what was given is known).
    -> {name: value} of the run's settings (the options but ``COMMAND_LINE_ONLY``)."""
    defaults = vars(parser.parse_args([]))
    options = vars(a)  # (a's own: filled in here)
    from_file = read_settings(a.config, parser, defaults) if options.get("config") else {}
    for name, default in defaults.items():
        if options.get(name) is None:
            options[name] = from_file.get(name, default)
    return {name: options[name] for name in defaults if name not in COMMAND_LINE_ONLY}


def read_settings(path, parser, defaults):
    """The settings in the config file ``path``, each checked by ``parser`` as its flag would be."""
    data = read_mapping(path)
    settings, keys = {}, {}
    for key, value in data.items():
        name = parser.dest_of(key)  # the keys are the flags' names, in any spelling a flag takes (args.ALIASES)
        if name in COMMAND_LINE_ONLY:
            raise ConfigError(f"config file {path}: {key!r} is not a setting of the run: give --{name} on the "
                              "command line")
        if name not in defaults:
            known = [k for k in defaults if k not in COMMAND_LINE_ONLY]
            close = difflib.get_close_matches(str(key).replace("-", "_"), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; the keys are the flags' names with underscores"
            if (instead := parser.instead_of(key)) is not None:
                hint = f": {instead}"
            raise ConfigError(f"config file {path}: unknown key {key!r}{hint}")
        if name in keys:
            raise ConfigError(f"config file {path}: {keys[name]!r} and {key!r} are the same setting: give one")
        keys[name] = key
        if value is not None:
            settings[name] = parse_setting(parser, key, name, value, defaults[name], path)
    return settings


def read_mapping(path):
    """The mapping in a .json or .yaml/.yml file; ConfigError naming the file otherwise."""
    path = Path(path)
    kind = path.suffix.lower()
    if kind not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: expected a .json, .yaml or .yml file")
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror or e})") from None
    if kind == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"config file {path}: not valid JSON: {e}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"config file {path}: reading YAML needs PyYAML (pip install pyyaml); "
                              "or give the settings as a .json file") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings by name, got {type(data).__name__}")
    return data


def parse_setting(parser, key, name, value, default, path):
    """``value`` of the setting ``name`` (written ``key`` in the file) as its flag would parse it (the
    same types, ranges and choices); ConfigError naming the file and the key otherwise."""
    flag = "--" + name.replace("_", "-")
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"config file {path}: {key}: expected true or false, got {value!r}")
        argv = [flag if value else "--no-" + flag[2:]]
    elif isinstance(value, (bool, dict)):
        raise ConfigError(f"config file {path}: {key}: expected a value as {flag} takes, got {value!r}")
    elif isinstance(value, list):
        argv = [flag, *(str(v) for v in value)]
    else:
        argv = [f"{flag}={value}"]
    try:
        ns, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"config file {path}: {key}: {e.message}") from None
    if rest:
        raise ConfigError(f"config file {path}: {key}: {flag} does not take {value!r}")
    return getattr(ns, name)


def write_settings(path, settings):
    """``settings`` as JSON at ``path`` (atomically), in the form a ``--config`` file takes."""
    from data.atomic import atomic_path
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(settings, indent=1) + "\n")
