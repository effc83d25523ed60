#!/usr/bin/env bash
# Nsight Compute on the default CuPy decode kernel, contiguous and paged, at the benchmark's
# shape (bf16, B=1, N=32768, GQA 32/8, d=128): why is paged slower?  Writes OUTDIR/ncu_paged_decode.txt
#   scripts/ncu_paged_decode.sh OUTDIR
set -u
OUT=${1:?usage: scripts/ncu_paged_decode.sh OUTDIR}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
ncu --kernel-name regex:decode_split_v3 --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section LaunchStats --section Occupancy \
    python3 - > "$OUT/ncu_paged_decode.txt" 2>&1 <<'PY'
import torch
from iokernels import bench
from iokernels import cupy_raw as cr
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn((1, 32, 128), device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn((1, 8, 32768, 128), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
kp, vp, tables, lens = bench.device_pages(k, v, seed=0)
for _ in range(3):
    cr.decode(q, k, v)                      # launches 1-3: contiguous (the 3rd is profiled)
for _ in range(3):
    cr.paged_decode_pools(q, kp, vp, tables, lens)   # launch 4 (profiled), 5, 6: paged
torch.cuda.synchronize()
print("done")
PY
echo "ncu exit $?" >> "$OUT/ncu_paged_decode.txt"
