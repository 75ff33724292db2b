"""``plot``: PNG curves of a training run from its OUT/log.jsonl.

    OUT/plots/loss.png         the training loss
    OUT/plots/psnr.png         training PSNR (the step's view), test PSNR (log records that
                               have it, and OUT/metrics.json's at the iteration it scored) and
                               the test PSNR of the runs named by --compare (another run's
                               folder, or the JSON lines of scripts/ref_trainer_log.patch)
    OUT/plots/gaussians.png    the Gaussian count (the whole model's under MPI)
    OUT/plots/step_time.png    milliseconds per step between log records

A resumed run's log may repeat the steps after its snapshot: the later records win, as the
model went on from them.  matplotlib draws (the ``plot`` extra).
"""
import json
from pathlib import Path

CURVES = (("loss", "loss", [("loss", "training loss")]),
          ("psnr", "PSNR (dB)", [("psnr/train", "train (step's view)"), ("psnr/train_views", "train (5 views)"),
                                      ("psnr/test", "test")]),
          ("gaussians", "Gaussians", [("gaussians", "Gaussians")]),
          ("step_time", "ms per step", [("step_seconds", "ms per step")]))


def read_log(path):
    """-> (the records of a log.jsonl, later repeats of a step replacing the earlier run's, in step
    order; the number of unreadable lines (a line cut by a kill))."""
    records, bad = [], 0
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += bool(line.strip())
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)):
            bad += 1
            continue
        while records and records[-1]["step"] >= rec["step"]:  # a resumed run goes on from here
            records.pop()
        records.append(rec)
    return records, bad


def series(records, final=None):
    """-> {curve: ([steps], [values])} of ``engine.tools.outputs.log_scalars``, step times in ms; ``final``
    (metrics.json's summary) adds its test PSNR at its iteration."""
    from engine.tools.outputs import log_scalars
    out = {}
    prev = None
    for rec in records:
        for key, value in log_scalars(rec, prev).items():
            steps, values = out.setdefault(key, ([], []))
            steps.append(rec["step"])
            values.append(1000.0 * value if key == "step_seconds" else value)
        prev = rec
    if final and final.get("psnr") is not None and final.get("iterations") is not None:
        steps, values = out.setdefault("psnr/test", ([], []))
        if final["iterations"] not in steps:
            steps.append(final["iterations"])
            values.append(final["psnr"])
    return out


def compared_curve(path):
    """-> (label, (steps, test PSNRs)) of a run to draw beside this one: a training output folder (its
    log.jsonl) or a file of JSON-lines records (the reference trainer's, patched to score its test
    views: ``test_psnr`` at some steps)."""
    path = Path(path)
    log = path / "log.jsonl" if path.is_dir() else path
    if not log.is_file():
        raise SystemExit(f"error: --compare {path}: no training log there (a training output folder, or a "
                         "file of JSON-lines records)")
    records, _ = read_log(log)
    points = [(r["step"], float(r["test_psnr"])) for r in records if r.get("test_psnr") is not None]
    if not points:
        raise SystemExit(f"error: --compare {path}: its log has no test PSNR (train with --eval-every N)")
    return path.stem if path.is_file() else path.name, tuple(map(list, zip(*points)))


def cmd_plot(a):
    model = Path(a.model)
    log = model / "log.jsonl"
    if not log.is_file():
        raise SystemExit(f"error: no training log at {log} (--model names a training output folder)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: plot needs matplotlib: pip install -e '.[plot]'") from None
    records, bad = read_log(log)
    if not records:
        raise SystemExit(f"error: {log} holds no log records")
    metrics = model / "metrics.json"
    try:
        final = json.loads(metrics.read_text()) if metrics.is_file() else None
    except json.JSONDecodeError:
        final = None
    data = series(records, final)
    others = [compared_curve(path) for path in a.compare or ()]
    out = Path(a.out) if a.out else model / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, ylabel, lines in CURVES:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for key, label in lines:
            if key in data:
                steps, values = data[key]
                ax.plot(steps, values, label=label, marker="o" if len(steps) < 3 else None)
        if name == "psnr":
            for label, (steps, values) in others:
                ax.plot(steps, values, label=f"test: {label}", linestyle="--", marker="o" if len(steps) < 3 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel}: {model.name}")
        ax.grid(alpha=0.3)
        if len(lines) > 1 or (name == "psnr" and others):
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        written.append(f"{name}.png")
    skipped = f" ({bad} unreadable log lines skipped)" if bad else ""
    print(f"wrote {', '.join(written)} to {out} from {len(records)} log records{skipped}")


def add_commands(sub):
    p = sub.add_parser("plot", help="PNG curves of a training run (loss, PSNR, Gaussians, step time)")
    p.add_argument("--model", required=True, help="training output folder (holds log.jsonl)")
    p.add_argument("--out", default=None, help="folder for the PNG files (default MODEL/plots)")
    p.add_argument("--compare", nargs="+", metavar="RUN", default=None,
                   help="draw these runs' test PSNR on psnr.png too: training output folders, or files of "
                        "JSON-lines records with test_psnr (the reference trainer's, scripts/ref_trainer_log.patch)")
    p.set_defaults(fn=cmd_plot)
