#!/usr/bin/env bash
# Nsight Compute summary of every kernel in one training step of the benchmark.
# Usage: scripts/profile.sh SCENE.npz [bench options, e.g. --loss tile]   (writes $OUT/ncu.csv; prints a table)
set -uo pipefail
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NUMBASPLAT_BACKEND=cuda
OUT=${OUT:-out}
mkdir -p "$OUT"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$ncu" --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size \
    --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-40}" \
    python3 run.py bench --scene "$@" --iters 2 --warmup 2 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
python3 scripts/ncu_table.py "$OUT/ncu.csv"
