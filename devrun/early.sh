#!/usr/bin/env bash
# early device call: Hopper ablation, paged serving probe, ncu on decode
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
mkdir -p $OUT/h
( timeout 200 python3 scripts/hopper_bench.py --parts gemm,time,ablation --out $OUT/h > $OUT/hopper_log.txt 2>&1; echo "hopper exit $?" >> $OUT/hopper_log.txt ) 
mkdir -p /tmp/sw
timeout 120 python3 scripts/gpu_sweep.py /tmp/sw cupy_paged_serving > $OUT/serving_log.txt 2>&1
cp /tmp/sw/*.json $OUT/ 2>/dev/null
mkdir -p /tmp/ncu
timeout 100 bash scripts/ncu_paged_decode.sh /tmp/ncu 8 32768
timeout 80 bash scripts/ncu_paged_decode.sh /tmp/ncu 64 4096
cat /tmp/ncu/*.txt > $OUT/ncu_decode.txt
ls -la $OUT $OUT/h
