#!/usr/bin/env bash
# Nsight Compute summary of every kernel in one training step of the benchmark.
# Usage: scripts/profile.sh SCENE.npz   (writes $OUT/ncu.csv; prints a table)
set -uo pipefail
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NUMBASPLAT_BACKEND=cuda
OUT=${OUT:-out}
mkdir -p "$OUT"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$ncu" --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size \
    --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-40}" \
    python3 run.py bench --scene "$1" --iters 2 --warmup 2 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(head)}
def get(r, k):
    return r[col[k]] if k in col else "?"
for r in data:
    name = get(r, "Kernel Name")[:60]
    print(f"{name:60s} t={get(r,'gpu__time_duration.sum'):>10s} regs={get(r,'launch__registers_per_thread'):>4s} "
          f"occ={get(r,'sm__warps_active.avg.pct_of_peak_sustained_active'):>6s} "
          f"rd={get(r,'dram__bytes_read.sum'):>12s} wr={get(r,'dram__bytes_write.sum'):>12s} grid={get(r,'launch__grid_size')}")
print("units:", {k: units[i] for k, i in col.items() if k.startswith(('gpu__', 'dram'))})
PY
