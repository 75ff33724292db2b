"""Print a per-kernel table from an ``ncu --csv --page raw`` file (scripts/profile.sh)."""
import csv
import sys

KEYS = ("gpu__time_duration.sum", "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "dram__bytes_read.sum", "dram__bytes_write.sum", "Grid Size", "Block Size")
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 20]
head, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(head)}
print(f"{'kernel':50s} {'ns':>10s} {'regs':>5s} {'occ%':>6s} {'read B':>13s} {'write B':>13s}")
total = 0
for r in data:
    total += float(r[col[KEYS[0]]].replace(",", ""))
    print(f"{r[col['Kernel Name']][:50]:50s}", *(f"{r[col[k]]:>12s}" for k in KEYS if k in col))
print(f"sum of kernel times: {total / 1e6:.3f} ms over {len(data)} launches")
