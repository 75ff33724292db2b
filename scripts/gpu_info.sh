#!/usr/bin/env bash
# On the GPU machine: `python3 run.py info`, checked. Passes when the CUDA extra named here
# (default gpu-cu13, the one BENCHMARKS.md measures) is the one in use and complete, a GPU is
# seen, NCCL loads, and nothing is printed on stderr (no loader noise).
# Usage: scripts/gpu_info.sh [gpu-cu12|gpu-cu13]; exits 1 with a line naming what is missing.
set -uo pipefail
want=${1:-gpu-cu13}
err=$(mktemp)
out=$(python3 run.py info 2>"$err")
rc=$?
printf '%s\n' "$out"
fail() { cat "$err" >&2; rm -f "$err"; echo "gpu_info: FAIL: $*" >&2; exit 1; }
[ "$rc" -eq 0 ] || fail "run.py info exited $rc"
[ -s "$err" ] && fail "run.py info printed on stderr"
grep -q "^CUDA extra: $want (" <<<"$out" || fail "the $want extra is not the one in use"
grep -q "^CUDA extra: .*incomplete" <<<"$out" && fail "the $want extra is incomplete"
grep -q "^numbasplat backend: cuda" <<<"$out" && ! grep -q "^GPU: none" <<<"$out" || fail "no GPU seen"
grep -q "^NCCL: [0-9]" <<<"$out" || fail "NCCL does not load"
rm -f "$err"
echo "gpu_info: ok: $want in use, GPU and NCCL found"
