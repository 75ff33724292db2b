"""Refinement block by block against the whole model's, out of core on a GPU (issue 60).

Not collected by pytest (a GPU check, as tests/check_*.py); tests/test_offload.py checks on the CPU
that the two refinements are equal row for row.  This trains one capture twice with ``--offload
host`` under a ``--gpu-memory`` cap that leaves blocks on the host (so the block-by-block path runs),
densifying: once refining the whole model (``OutOfCoreStore.refine_in_blocks`` off, the old
default) and once block by block.  Prints each run's test PSNR, Gaussians, training seconds and
peak host memory (RSS), and exits 1 where the block-by-block run's PSNR is more than
``--tolerance`` dB below (GPU atomics make the two runs differ beyond rounding), 2 where the cap
held every block at the end (the block-by-block path then never ran: give a smaller cap or a
capture that grows more).

    python tests/check_offload_refine.py --data ../shared/data/fern --gpu-memory 250MiB \
        --train-option=--images --train-option=images_8
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUN = """import resource, runpy, sys
from engine.stores.offload.store import OutOfCoreStore
OutOfCoreStore.refine_in_blocks = {blocks}
sys.argv = ["run.py", "train"] + {argv!r}
try:
    runpy.run_path("run.py", run_name="__main__")
finally:
    print("peak host RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
"""


def train(blocks, out, args):
    """One run; -> (its metrics.json, the seconds it trained, its peak host RSS in bytes)."""
    argv = ["--data", args.data, "--out", str(out), "--iters", str(args.iters), "--eval", "--quiet",
            "--offload", "host", "--gpu-memory", args.gpu_memory, "--seed", str(args.seed),
            "--densify-until", str(args.iters // 2), "--overwrite", *args.train_option]
    done = subprocess.run([sys.executable, "-c", RUN.format(blocks=blocks, argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=args.run_timeout)
    if done.returncode != 0:
        raise SystemExit(f"refine_in_blocks={blocks}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rss = [int(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("peak host RSS")]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((out / "metrics.json").read_text()), log[-1], rss[-1] if rss else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="/tmp/check_offload_refine")
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--gpu-memory", default="160MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.3, help="dB the block-by-block run may lose")
    ap.add_argument("--train-option", action="append", default=[], metavar="OPT", help="more train options")
    ap.add_argument("--run-timeout", type=float, default=300)
    args = ap.parse_args()
    psnr, resident = {}, True
    for blocks in (False, True):
        metrics, last, rss = train(blocks, Path(args.out) / ("blocks" if blocks else "whole"), args)
        psnr[blocks] = metrics["psnr"]
        resident = resident and last.get("resident_gaussians", 0) >= last["gaussians"]
        print(f"refine {'block by block' if blocks else 'the whole model'}: test PSNR {metrics['psnr']:.2f} dB, "
              f"{last['gaussians']:,} Gaussians, {last['time']:.1f} s training, hit rate "
              f"{last.get('cache_hit_rate', float('nan')):.2f}, peak host RSS {rss / 2**30:.2f} GiB", flush=True)
    lost = psnr[False] - psnr[True]
    print(f"block by block {-lost:+.2f} dB against the whole model's refinement (tolerance {args.tolerance} dB)")
    if resident:
        print(f"--gpu-memory {args.gpu_memory} held every block at the end: the block-by-block path did not run")
        return 2
    return 1 if lost > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
