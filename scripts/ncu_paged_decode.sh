#!/usr/bin/env bash
# Nsight Compute on the default CuPy decode kernel, contiguous and paged (scattered pages), at
# a decode shape (fp16/bf16, GQA 32/8, d=128): where does each spend its time -- memory
# throughput, the SM's issue slots, or stalls?  Writes OUTDIR/ncu_paged_decode_B<B>_N<N>.txt
#   scripts/ncu_paged_decode.sh OUTDIR [BATCH] [SEQLEN] [KERNEL_REGEX]
set -u
OUT=${1:?usage: scripts/ncu_paged_decode.sh OUTDIR [BATCH] [SEQLEN] [KERNEL_REGEX]}
B=${2:-1}
N=${3:-32768}
KERNEL=${4:-decode_split}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD IK_B=$B IK_N=$N
ncu --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    python3 - > "$OUT/ncu_paged_decode_B${B}_N${N}.txt" 2>&1 <<'PY'
import os
import torch
from iokernels import bench
from iokernels import cupy_raw as cr
B, N = int(os.environ["IK_B"]), int(os.environ["IK_N"])
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn((B, 32, 128), device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn((B, 8, N, 128), device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
kp, vp, tables, lens = bench.device_pages(k, v, seed=0)
for _ in range(3):
    cr.decode(q, k, v)                      # launches 1-3: contiguous (the 3rd is profiled)
for _ in range(3):
    cr.paged_decode_pools(q, kp, vp, tables, lens)   # launch 4 (profiled), 5, 6: paged
torch.cuda.synchronize()
print("done")
PY
echo "ncu exit $?" >> "$OUT/ncu_paged_decode_B${B}_N${N}.txt"
