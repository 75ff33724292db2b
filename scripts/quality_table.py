"""Issue 57's quality table from a folder of runs (``scripts/gpu_session.sh curves`` writes them):
per capture, variant and length, the test PSNR and SSIM as the mean over seeds with min and max,
and each run's test-PSNR curve (``--eval-every``), ours and the reference's.

    python scripts/quality_table.py RUNS_DIR [--every 1000]

RUNS_DIR holds ``run.py train --out`` folders named CAPTURE_VARIANT_ITERSk_sSEED (their
metrics.json and log.jsonl) and the reference's outputs CAPTURE_reference_ITERSk.txt (its JSON
lines, patched by scripts/ref_trainer_log.patch to score the test views every REF_EVAL_EVERY steps).
"""
import argparse
import json
import re
import statistics
from pathlib import Path

RUN = re.compile(r"^(?P<group>.+)_s(?P<seed>\d+)$")


def json_lines(path):
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def curve(records, every):
    """'1k 23.10 2k 28.39 ...': the test PSNR of the records that have one, at multiples of ``every``."""
    return " ".join(f"{r['step'] / 1000:g}k {r['test_psnr']:.2f}" for r in records
                    if "test_psnr" in r and r["step"] % every == 0)


def spread(values, fmt=".2f"):
    return f"{statistics.mean(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}}, n={len(values)})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="the folder of runs")
    ap.add_argument("--every", type=int, default=1000, help="curve points every this many steps")
    a = ap.parse_args(argv)
    root = Path(a.runs)
    groups = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (p / "log.jsonl").is_file()):
        m = RUN.match(d.name)
        if not m:
            continue
        log = json_lines(d / "log.jsonl")
        metrics = json.loads((d / "metrics.json").read_text()) if (d / "metrics.json").is_file() else None
        print(f"{d.name}: {curve(log, a.every)}"
              + (f" | final {metrics['psnr']:.2f} dB, SSIM {metrics['ssim']:.4f}, {metrics['gaussians']} Gaussians, "
                 f"{metrics['train_seconds']:.1f} s" if metrics else " | unfinished"))
        if metrics:
            groups.setdefault(m["group"], []).append(metrics)
    for f in sorted(root.glob("*_reference_*.txt")):
        recs = json_lines(f)
        final = next((r for r in reversed(recs) if "train_s" in r), None)
        print(f"{f.stem}: {curve(recs, a.every)}"
              + (f" | final {final['psnr']:.2f} dB, SSIM {final['ssim']:.4f}, {final['gaussians']} Gaussians, "
                 f"{final['train_s']} s" if final else " | unfinished"))
    print("\nmean over seeds (min-max): test PSNR | SSIM | Gaussians | seconds")
    for name, ms in groups.items():
        print(f"{name}: {spread([m['psnr'] for m in ms])} | {spread([m['ssim'] for m in ms], '.4f')} | "
              f"{statistics.mean(m['gaussians'] for m in ms):,.0f} | {statistics.mean(m['train_seconds'] for m in ms):.1f}")


if __name__ == "__main__":
    main()
