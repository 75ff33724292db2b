#!/usr/bin/env bash
# Everything the open issues measure on one GPU, in one call (about 8-10 minutes):
# checks, rasterizer benchmarks (global and tile loss, fused and not), 7k-iteration
# lego and fern runs, and 1/2/4-rank MPI runs sharing the GPU.
# Needs scripts/stage_data.sh run beforehand (carry .data and .whl).  Logs go to $OUT.
set -uo pipefail
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1 NUMBASPLAT_BACKEND=cuda
OUT=${OUT:-out}
ITERS=${ITERS:-7000}
mkdir -p "$OUT"
step() { echo "== $*"; }
step checks
python3 tests/check_cuda.py > "$OUT/check_cuda.txt" 2>&1; tail -1 "$OUT/check_cuda.txt"
python3 tests/check_fused.py > "$OUT/check_fused.txt" 2>&1; tail -1 "$OUT/check_fused.txt"
mpiexec --allow-run-as-root -n 2 python3 tests/mpi_comm_check.py --device > "$OUT/check_comm.txt" 2>&1; tail -1 "$OUT/check_comm.txt"
step benchmarks
[ -f .data/b1m.npz ] || python3 .data/scene_gen.py .data/b1m.npz --n 1000000 --res 1297x840 > /dev/null
for args in "" "--loss tile" "--loss tile --no-fuse"; do
    python3 run.py bench --scene .data/b1m.npz $args 2>&1 | tail -14 | tee -a "$OUT/bench.txt"
done
step training
python3 run.py train --data .data/lego --white-background --out "$OUT/lego" --iters "$ITERS" --eval --quiet 2>&1 | tail -1
python3 run.py train --data .data/fern --images images_8 --out "$OUT/fern" --iters "$ITERS" --eval --quiet 2>&1 | grep -v Warn | tail -1
for n in 2 4; do
    mpiexec --allow-run-as-root -n $n python3 run.py train --data .data/fern --images images_8 --out "$OUT/fern_p$n" \
        --iters "$ITERS" --eval --quiet 2>&1 | grep -v Warn | tail -1
done
