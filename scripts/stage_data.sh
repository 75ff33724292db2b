#!/usr/bin/env bash
# Copy the test captures into .data/ (git-ignored) so a device run can carry them
# (lego, fern images_8 and images_4: about 49 MB; with the numpy wheel 66 MB of the 64 MiB a run may carry).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
src=${1:-../shared/data}
mkdir -p .data/fern
cp -r "$src/lego" .data/
cp -r "$src/fern/images_8" "$src/fern/images_4" "$src/fern/sparse" .data/fern/
cp "$src/../bench/scene_gen.py" .data/ 2>/dev/null || true
# the reference, run beside ours (never imported)
if cp "$src/../peer/ref_trainer.py" "$src/../peer/colmap_read.py" .data/ 2>/dev/null; then
    patch -s .data/ref_trainer.py scripts/ref_trainer_log.patch  # its log every 100 steps (scripts/side_by_side.py)
fi
du -sh .data
