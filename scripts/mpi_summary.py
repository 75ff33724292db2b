"""Summarise a distributed run: per-rank phase times and bytes from log.jsonl, and the top of each rank's profile.

Usage: python scripts/mpi_summary.py RUN_DIR [PROFILE ...]
(PROFILE: files written by ``python -m cProfile -o FILE run.py train ...``, one per rank)
"""
import json
import pstats
import sys
from pathlib import Path


def phases(run_dir):
    recs = [json.loads(ln) for ln in (Path(run_dir) / "log.jsonl").read_text().splitlines() if ln.strip()]
    last = ([r for r in recs if "rank_stats" in r] or recs)[-1]
    half = [r for r in recs if r["step"] >= last["step"] // 2][0]  # past compilation and warm-up
    rate = (last["step"] - half["step"]) / max(last["time"] - half["time"], 1e-9)
    print(f"{run_dir}: step {last['step']}, {last.get('gaussians_total')} Gaussians, {last['time']:.1f} s, "
          f"{rate:.0f} images/s from step {half['step']}")
    for rank, s in enumerate(last["rank_stats"]):
        t = " ".join(f"{k} {1e3 * v:.2f}" for k, v in s.get("times", {}).items())
        extra = " ".join(f"{k} {s[k] * 1e3:.2f}" for k in ("t_encode", "t_exchange", "t_decode") if k in s)
        extra += f" collectives {s['collective_ms']:.2f}" if "collective_ms" in s else ""
        print(f"  rank {rank}: ms {t} | {extra} | fwd {s.get('forward_bytes', 0) / 1e6:.2f} MB, "
              f"bwd dense {s.get('dense_bytes', 0) / 1e6:.2f} sparse {s.get('sparse_bytes', 0) / 1e6:.2f} MB, "
              f"zero {s.get('zero_fraction')}")


if __name__ == "__main__":
    phases(sys.argv[1])
    for f in sys.argv[2:]:
        print(f"--- {f}")
        st = pstats.Stats(f)
        st.sort_stats("tottime").print_stats(22)
