"""Our training log beside the reference trainer's, every N steps (issue 24): the Gaussian count,
the loss and the PSNR of the step's training image, and the seconds so far.

    python scripts/side_by_side.py OURS_OUT_DIR REFERENCE_OUTPUT.txt [--every 500]

OURS_OUT_DIR is a `run.py train --out` folder (its log.jsonl); the reference's output is what
`.data/ref_trainer.py` printed (patched by scripts/stage_data.sh to log every 100 steps: one JSON
line each, then its summary line).  Either log's steps must be multiples of 100.
"""
import argparse
import json
import sys
from pathlib import Path


def read_log(path):
    """{step: record} of the JSON lines with a step in ``path`` (other lines are skipped)."""
    out = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and '"step"' in line:
            r = json.loads(line)
            out[int(r["step"])] = r
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ours", help="a run.py train --out folder")
    ap.add_argument("reference", help="the reference trainer's output")
    ap.add_argument("--every", type=int, default=500, help="print every this many steps (default 500)")
    a = ap.parse_args(argv)
    log = Path(a.ours) / "log.jsonl"
    if not log.is_file():
        sys.exit(f"side_by_side: {log} not found (not a run.py train --out folder?)")
    if not Path(a.reference).is_file():
        sys.exit(f"side_by_side: {a.reference} not found")
    ours, ref = read_log(log), read_log(a.reference)
    if not ref:
        sys.exit(f"side_by_side: no step lines in {a.reference} (was ref_trainer.py patched by stage_data.sh?)")
    print(f"{'step':>6} | {'ours: Gaussians':>15} {'loss':>7} {'PSNR':>6} {'s':>6} | "
          f"{'reference':>15} {'loss':>7} {'PSNR':>6} {'s':>6}")
    for step in sorted(set(ours) | set(ref)):
        if step % a.every:
            continue
        cells = []
        for r in (ours.get(step), ref.get(step)):
            cells.append(f"{r['gaussians']:>15,} {r['loss']:>7.4f} {r['psnr']:>6.2f} {r['time']:>6.1f}" if r
                         else f"{'-':>15} {'':>7} {'':>6} {'':>6}")
        print(f"{step:>6} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
