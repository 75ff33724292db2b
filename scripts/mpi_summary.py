"""Summarise a distributed run: per-rank phase times and bytes from log.jsonl, and the top of each rank's profile.

Usage: python scripts/mpi_summary.py RUN_DIR [PROFILE ...]
(PROFILE: files written by ``python -m cProfile -o FILE run.py train ...``, one per rank)
"""
import json
import pstats
import statistics
import sys
from pathlib import Path


def phases(run_dir):
    """Images/s over the second half, and each rank's phase times: the median over the second half's timed (log)
    steps, where there are several (one timed step is one sample: a stall or a compile shows as the phase's
    time), each with the host's part of it in brackets (until the host had queued the phase: ``PhaseClock``),
    and their bytes from the last."""
    recs = [json.loads(ln) for ln in (Path(run_dir) / "log.jsonl").read_text().splitlines() if ln.strip()]
    last = ([r for r in recs if "rank_stats" in r] or recs)[-1]
    half = [r for r in recs if r["step"] >= last["step"] // 2][0]  # past compilation and warm-up
    rate = (last["step"] - half["step"]) / max(last["time"] - half["time"], 1e-9)
    timed = [r for r in recs if "rank_stats" in r and r["step"] >= half["step"]] or [last]
    print(f"{run_dir}: step {last['step']}, {last.get('gaussians_total')} Gaussians, {last['time']:.1f} s, "
          f"{rate:.0f} images/s from step {half['step']}; phases: medians of {len(timed)} timed steps")
    median = lambda values: 1e3 * statistics.median(values)  # noqa: E731 (ms)
    for rank, s in enumerate(last["rank_stats"]):
        mine = [r["rank_stats"][rank] for r in timed]
        t = " ".join(f"{k} {median([m['times'][k] for m in mine if k in m.get('times', {})]):.2f}"
                     + (f" ({median([m['host'][k] for m in mine if k in m.get('host', {})]):.2f})"
                        if k in s.get("host", {}) else "") for k in s.get("times", {}))
        extra = " ".join(f"{k} {median([m[k] for m in mine if k in m]):.2f}" for k in ("t_encode", "t_exchange",
                                                                                       "t_decode") if k in s)
        extra += f" collectives {statistics.median([m['collective_ms'] for m in mine if 'collective_ms' in m]):.2f}" \
            if "collective_ms" in s else ""
        print(f"  rank {rank}: ms {t} | {extra} | fwd {s.get('forward_bytes', 0) / 1e6:.2f} MB, "
              f"bwd dense {s.get('dense_bytes', 0) / 1e6:.2f} sparse {s.get('sparse_bytes', 0) / 1e6:.2f} MB, "
              f"zero {s.get('zero_fraction')}")


if __name__ == "__main__":
    phases(sys.argv[1])
    for f in sys.argv[2:]:
        print(f"--- {f}")
        st = pstats.Stats(f)
        st.sort_stats("tottime").print_stats(22)
