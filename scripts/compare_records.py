#!/usr/bin/env python3
"""Same-run ratios of two benchmark records, side by side: did a change move a kernel?

    python scripts/compare_records.py OLD.json NEW.json [--threshold 0.05]

Prints one line per (case, runner) present in both records, the ratio to the best SDPA
kernel (or to the device copy, for gathers) in each, and new / old; rows outside
1 +- threshold are marked.  Records are the files under benchmarks/results (or a
gpu_all.sh OUTDIR's bench.json).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from iokernels.core import recorded  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--threshold", type=float, default=0.05)
    a = p.parse_args(argv)
    old, new = (json.load(open(f)) for f in (a.old, a.new))
    rows = recorded.compare(old, new)
    moved = 0
    for r in rows:
        flag = "" if abs(r["change"] - 1) <= a.threshold else "  <-- moved"
        moved += bool(flag)
        print(f"{r['section']:<8}{str(r['dtype']):<10}{str(r['causal']):<6}{str(r['shape']):<40}"
              f"{r['runner']:<24}{r['old']:8.3f}{r['new']:8.3f}{r['change']:8.3f}{flag}")
    print(f"{len(rows)} (case, runner) pairs in both records; {moved} moved by more than {a.threshold:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
