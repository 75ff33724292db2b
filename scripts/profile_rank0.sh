#!/usr/bin/env bash
# Under mpiexec: rank 0 runs `python3 run.py ARGS` under cProfile (stats to $PROF, default /tmp/prof0), the other
# ranks plainly; then `python3 -c "import pstats; pstats.Stats('/tmp/prof0').sort_stats('tottime').print_stats(25)"`.
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
if [ "$rank" = 0 ]; then exec python3 -m cProfile -o "${PROF:-/tmp/prof0}" run.py "$@"; fi
exec python3 run.py "$@"
