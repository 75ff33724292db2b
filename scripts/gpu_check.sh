#!/usr/bin/env bash
# On the GPU machine: the CUDA-vs-CPU checks, then the benchmark, in one go.
# Usage: scripts/gpu_check.sh [SCENE_GEN]   (default ../shared/bench/scene_gen.py, or .data/scene_gen.py)
# Writes logs to $OUT (default ./out).
set -uo pipefail
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1 NUMBASPLAT_BACKEND=cuda
OUT=${OUT:-out}
mkdir -p "$OUT" .data
gen=${1:-../shared/bench/scene_gen.py}
[ -f "$gen" ] || gen=.data/scene_gen.py
rc=0
python3 run.py info | tee "$OUT/info.txt"
python3 tests/check_cuda_raster.py 2>&1 | tee "$OUT/check_cuda_raster.txt" || rc=1
python3 tests/check_cuda_fused.py 2>&1 | tee "$OUT/check_cuda_fused.txt" || rc=1
python3 tests/check_deterministic_raster.py 2>&1 | tee "$OUT/check_deterministic_raster.txt" || rc=1
python3 tests/check_deterministic.py 2>&1 | tee "$OUT/check_deterministic.txt" || rc=1
for bg in "" --random-background; do
    python3 tests/check_cuda_graphs.py $bg 2>&1 | grep -v "^model:" | tee "$OUT/check_cuda_graphs$bg.txt"
    grep -q "step graphs: ok" "$OUT/check_cuda_graphs$bg.txt" || rc=1
done
# the GPU machine's Open MPI is not CUDA-aware: device buffers are staged through pinned host memory
mpiexec --allow-run-as-root -n 2 python3 tests/check_mpi_comm.py --device 2>&1 | tee "$OUT/check_comm.txt" || rc=1
for spec in "1000000 1297x840" "6000000 1920x1080"; do
    set -- $spec
    f=.data/bench_$1_$2.npz
    [ -f "$f" ] || python3 "$gen" "$f" --n "$1" --res "$2"
    python3 run.py bench --scene "$f" --iters "${ITERS:-20}" 2>&1 | tee "$OUT/bench_$1_$2.txt" || rc=1
    python3 run.py bench --scene "$f" --iters "${ITERS:-20}" --deterministic 2>&1 \
        | tee "$OUT/bench_$1_$2_deterministic.txt" || rc=1
done
exit $rc
