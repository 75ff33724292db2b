"""One line per training run of the BlitzGS ablation (scripts/gpu_session.sh blitz): test PSNR,
training seconds, ms a step and the mean model size over each half of the run, the importance
passes' seconds and share (their renders' seconds, each pass's with its renders', the warm-up's that
compiled them), with
``--view-masks auto`` or ``--lod-views auto`` the views culled after each pass, the mean
Gaussians drawn per view (the log's ``drawn_per_view``, where a switch was on; else the model's mean
size), the final count, under MPI the mean ``projected_imbalance``, and with the LOD gate what it kept
from training at each pass (``engine.recipe.workload.LodReach``).

    python scripts/workload_summary.py OUT_DIR [OUT_DIR ...]
"""
import json
import sys
from pathlib import Path


def halves(records):
    """(ms a step, mean Gaussians) over the log's first and second halves: a run's step follows its
    model's size, which densification grows in the first half and the passes prune (the first half's
    time includes the first steps' compilations)."""
    if len(records) < 2:
        return [(float("nan"), float("nan"))] * 2
    mid = next(r for r in records if r["step"] >= records[-1]["step"] // 2)

    def over(rows, start, end):
        sizes = [r.get("gaussians_total", r["gaussians"]) for r in rows]
        return 1e3 * (end["time"] - start["time"]) / max(end["step"] - start["step"], 1), sum(sizes) / max(len(sizes), 1)
    return (over([r for r in records if r["step"] <= mid["step"]], {"time": 0.0, "step": 0}, mid),
            over([r for r in records if r["step"] > mid["step"]], mid, records[-1]))


def summary(out):
    out = Path(out)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.endswith("}")]
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    drawn = [r["drawn_per_view"] for r in records if "drawn_per_view" in r]
    sizes = [r.get("gaussians_total", r["gaussians"]) for r in records]
    per_view = (f"drawn per view {sum(drawn) / len(drawn):,.0f}" if drawn
                else f"model {sum(sizes) / max(len(sizes), 1):,.0f} Gaussians")
    imbalance = [r["projected_imbalance"] for r in records if "projected_imbalance" in r]
    train = metrics.get("train_seconds", records[-1]["time"] if records else 0.0)
    passes = metrics.get("importance_seconds", sum(r["importance_pass"]["seconds"] for r in records
                                                   if "importance_pass" in r))
    each = [r["importance_pass"] for r in records if "importance_pass" in r]
    rendering = sum(p.get("render_seconds", 0.0) for p in each)
    each_seconds = " / ".join(f"{p['seconds']:.2f} ({p.get('render_seconds', 0.0):.2f})" for p in each) or "-"
    steps = records[-1]["step"] if records else 0
    share = 100 * passes / max(train, 1e-9)
    (first_ms, first_n), (second_ms, second_n) = halves(records)
    line = (f"{out.name}: PSNR {metrics.get('psnr', float('nan')):.2f} dB, {train:.1f} s training "
            f"({1e3 * train / max(steps, 1):.2f} ms a step; {first_ms:.2f} in the first half at {first_n:,.0f} "
            f"Gaussians, {second_ms:.2f} in the second at {second_n:,.0f}), "
            f"passes {passes:.1f} s ({share:.1f}%; their renders {rendering:.1f} s; each {each_seconds}; warm-up "
            f"{metrics.get('importance_warmup_seconds', 0.0):.2f} s), "
            f"{per_view}, final {metrics.get('gaussians', '?')} Gaussians")
    if imbalance:
        line += f", projected imbalance {sum(imbalance) / len(imbalance):.3f}"
    if any("cut_views" in p for p in each):  # --view-masks auto, --lod-views auto: the views culled after each pass
        line += ", views culled " + " / ".join(f"{p['cut_views']} (median share {p['visible_share']:.2f})"
                                               for p in each)
    lod = [r["importance_pass"] for r in records if "lod_untrained" in r.get("importance_pass", {})]
    if lod:  # what the LOD gate kept from training, at each pass: share of the rendered weight, rows
        line += ", LOD hid " + " / ".join(f"{p['lod_hidden_weight']:.2%} ({p['lod_untrained']:,} untrained)"
                                          for p in lod)
    return line


if __name__ == "__main__":
    for d in sys.argv[1:]:
        try:
            print(summary(d))
        except (OSError, ValueError, KeyError, IndexError) as e:
            print(f"{d}: no summary ({type(e).__name__}: {e})")
