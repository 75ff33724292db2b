"""``prune``: ByteSplat's hardware-aware pruning (``engine/recipe/pruning.py``) applied to a trained model.

As the paper applies it after convergence: the model of ``--model`` (its snapshot) is pruned by
contribution, fine-tuned, then pruned in rounds to the fused kernel's shared-memory budget, each
round fine-tuned with the settings the model trained with (its cfg.json); the result goes to
``--out`` as a training folder (cfg.json, snapshot, PLY, cameras.json, log.jsonl) with the test
views' renders and metrics.json, which holds the pruning's report (the budget and how it was
derived, the Gaussians and the tiles within the budget at each stage, and PSNR/SSIM before and
after).  One process: the pruned model then trains under mpiexec as any.
"""
from dataclasses import asdict, fields
from pathlib import Path

from .args import add_data_options, count, percent, write_metrics


def cmd_prune(a):
    from engine.tools.outputs import split_dir
    from engine.recipe.pruning import PruneConfig, prune_model
    from .args import mpi_comm
    from .config import write_settings
    from .evaluate import data_defaults, recorded_settings, trained_model
    if mpi_comm() is not None:
        raise SystemExit("error: prune runs in one process, not under mpiexec (train --prune prunes under mpiexec)")
    recorded = recorded_settings(a)  # (before trained_model, which may make --out the model's folder)
    t = trained_model(a)
    fine_tuning = {f.name for f in fields(t.cfg)} - {"sh_degree", "iterations", "background"}
    for name in fine_tuning & recorded.keys():  # fine-tune as the model trained (its loss, rates, ...)
        setattr(t.cfg, name, tuple(recorded[name]) if isinstance(recorded[name], list) else recorded[name])
    capture = {name: vars(a)[name] for name in data_defaults()}
    capture["data"] = str(Path(a.data).resolve())
    write_settings(t.out / "cfg.json", {**recorded, **capture, **asdict(t.cfg)})  # eval, render, scaling read it
    cfg = PruneConfig.of(t.cfg, stage=a.stage, fine_tune=a.fine_tune, round_fine_tune=a.round_fine_tune, beta=a.beta,
                         max_rounds=a.rounds, smem_budget=a.smem_budget)
    report = prune_model(t, cfg)
    write_metrics({**t.evaluate(save_dir=split_dir(t.out, "test", t.step)), "pruning": report}, t.out)


def add_commands(sub):
    from .evaluate import data_defaults
    p = sub.add_parser("prune", help="prune a trained model to the fused kernel's budget (ByteSplat) and fine-tune")
    add_data_options(p, need_data=False, need_out=True)
    p.add_argument("--model", required=True, help="training output folder or snapshot .h5 (its capture: its "
                                                  "cfg.json, or --data)")
    p.add_argument("--stage", choices=["contribution", "hardware"], default="hardware",
                   help="contribution: keep each pixel's dominant Gaussians only; hardware: then prune to the "
                        "fused kernel's budget in rounds (default)")
    p.add_argument("--smem-budget", type=count(1), default=None, metavar="BYTES",
                   help="shared memory per block to fit (default: the GPU's; without a GPU, an H200's)")
    p.add_argument("--rounds", type=count(0), default=None, help="hardware rounds at most (default: train's "
                                                                "--prune-rounds)")
    p.add_argument("--beta", type=percent, default=None, metavar="PCT",
                   help="percent of the candidates a hardware round removes (default: train's --prune-beta)")
    p.add_argument("--fine-tune", type=count(0), default=None, metavar="N",
                   help="images of fine-tuning after contribution pruning (default: train's --prune-fine-tune)")
    p.add_argument("--round-fine-tune", type=count(0), default=None, metavar="N",
                   help="images of fine-tuning after each hardware round (default: train's "
                        "--prune-round-fine-tune)")
    p.set_defaults(**dict.fromkeys(data_defaults(), None))  # the capture may come from the model's cfg.json
    p.set_defaults(fn=cmd_prune)
