"""``eval``, ``render`` and ``export``: what a trained model (a snapshot or a PLY) gives."""
from .args import add_data_options, load_data, write_metrics
from .train import HOLD_OUT_EVERY, config_from_args


def trained_model(a):
    """A trainer holding the model of a training output folder (its snapshot) or of a PLY file."""
    from pathlib import Path
    from engine.single_gpu import SingleGPUTrainer
    from engine.trainer import SNAPSHOT
    cfg = config_from_args(a)
    dataset = load_data(a, cfg.background, HOLD_OUT_EVERY)
    t = SingleGPUTrainer(dataset, a.out, cfg)
    src = Path(a.model)
    if src.suffix == ".ply":
        from data.ply import load_ply
        try:
            t.start_from({"params": load_ply(src)})
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        t.cfg.sh_degree = t.model.gaussians.sh_degree()
    else:
        snap = src / SNAPSHOT if src.is_dir() else src
        try:
            t.load_snapshot(snap, check_data=False)
        except (ValueError, OSError) as e:
            raise SystemExit(f"error: {e}")
    return t


def cmd_eval(a):
    t = trained_model(a)
    write_metrics(t.evaluate(save_dir=a.out + "/test_renders"), a.out)


def cmd_render(a):
    t = trained_model(a)
    views = t.data.test if a.split == "test" else t.data.train
    t.evaluate(views, save_dir=a.out + f"/{a.split}_renders")
    print(f"wrote {len(views)} renders to {a.out}/{a.split}_renders")


def cmd_export(a):
    from pathlib import Path
    from data.ply import save_ply
    from engine.trainer import SNAPSHOT
    from engine.snapshot import read_snapshot
    from numbasplat.optim import GROUPS
    src = Path(a.model)
    snap = src / SNAPSHOT if src.is_dir() else src
    try:
        arrays, _ = read_snapshot(str(snap))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    from types import SimpleNamespace
    save_ply(a.ply, SimpleNamespace(**{g: arrays[f"params/{g}"] for g in GROUPS}))
    print(f"wrote {a.ply}")


def add_commands(sub):
    for name, fn, hlp in (("eval", cmd_eval, "evaluate a trained scene on the test split"),
                          ("render", cmd_render, "render views of a trained scene")):
        e = sub.add_parser(name, help=hlp)
        add_data_options(e)
        e.add_argument("--model", required=True, help="training output folder, snapshot .h5 or .ply")
        if name == "render":
            e.add_argument("--split", choices=["test", "train"], default="test")
        e.set_defaults(fn=fn)
    x = sub.add_parser("export", help="write the trained scene as a PLY file")
    x.add_argument("--model", required=True, help="training output folder or snapshot .h5")
    x.add_argument("--ply", required=True, help="output .ply path")
    x.set_defaults(fn=cmd_export)
