#!/usr/bin/env bash
# The ONE GPU script: everything the project measures on a GPU, in one call of < 10 minutes.
#
#   scripts/gpu_all.sh OUTDIR            (from anywhere; it cds to the repository root)
#
# Stages, each time-boxed with `timeout`; a failing stage is logged, never fatal:
#   1. env        nvidia-smi, driver, CUDA, python / torch / numba / cupy / numpy versions, date
#   2. bench      python -m iokernels bench  (alone on the GPU: it times things)   -> bench.json
#                 (saved whenever a case starts: a bench its time box stops keeps what finished)
#   2b. ring      python -m iokernels ring --world-size 1 --device cuda --bench (NCCL, one rank)
#   2c. serve     python -m iokernels serve-bench on the GPU, paged against contiguous     -> serve.json
#   3. traffic    ncu DRAM bytes vs the traffic model                              -> traffic.json
#                 then (LIMITS=0 leaves it out) what bounds each kernel that misses a bar: ncu's
#                 throughput, issue, occupancy, pipe and stall figures, in traffic.json's "limits"
#   4. checks     GPU pytest and compute-sanitizer memcheck / racecheck / synccheck / initcheck
#                 over scripts/sanitize.py, one process per (tool, kernel family)
#                 3 and 4 run in parallel, after the bench (correctness only, no timing)
# Time: DEADLINE (default 580 s) bounds the whole script; every stage gets what is left.
# With a short device lease: DEADLINE=300 scripts/gpu_all.sh OUTDIR (the bench then runs
# first and whole, the sanitizers get what remains); BENCH_SECTIONS=decode,gather times only
# those sections (CLIFF_BUDGET_S=90 shortens the cliff sweep's time box, CLIFF_START=K starts it at its
# K-th case: the next slice of a sweep an earlier run's box cut; BENCH_BACKENDS=triton times only those
# backends' rows beside SDPA's); GPU_TESTS="tests/test_cupy.py ..."
# runs only those files' GPU tests; GPU_TEST_IDS=FILE runs the test ids FILE lists, one a line, whatever
# their marker (the tests a time box left unrun, say).
# SWEEP="decode --shapes short --splits 1,2,4" adds a tuning sweep of iokernels.bench.sweeps_cupy after
# the bench (its rows in logs.tar.gz: sweep.json, sweep.log; T_SWEEP its box, default 90 s);
# SWEEP="triton --shapes b8n32768" the Triton decode sweep (iokernels.bench.sweeps_triton) instead.
# SWEEP=numba_fwd (or numba_decode) the Numba sweep of iokernels.bench.sweeps_numba (into sweep_numba_fwd.jsonl).
# SWEEP2 (box T_SWEEP2) a second sweep of any kind after the first, into sweep2.json; SWEEP3 (box
# T_SWEEP3) a third, into sweep3.json.
# Stages can be left out when a lease is short and an earlier run of the same tree has
# their result: RING=0, TRAFFIC=0, LIMITS=0, SERVE=0 (TRAFFIC_ONLY=g16: only the profiler's cases whose
# name holds it); SAN_FAMILIES="numba cupy" sanitizes only those
# families (default: numba cupy triton); SAN_KERNELS="attention_backward:v3 fp8_attention:v1"
# sanitizes only those CuPy kernels (op:version); SAN=0 runs no sanitizer at all;
# SERVE_ARGS replaces the serve-bench arguments; SERVE_FIRST=1 serves before the bench;
# SERVE_AGAIN="--rows-granule 64" serves a second time with those arguments added (its JSON in
# logs.tar.gz, serve_again.json; T_SERVE its box too);
# HOST_PROFILE=1 adds the host's time of a matrix product and of a serving step
# (scripts/host_profile.py) after the serving stage.
#   5. summary
# Writes exactly these 8 files to OUTDIR (the device tool returns at most 8):
#   summary.txt  bench.json  bench.txt  traffic.json  serve.json  sanitizer.txt  pytest.txt
#   logs.tar.gz  (every full log, the ncu plan and its raw CSV, ncu_raw.csv)
# Turn them into the committed records and the README table with
#   python scripts/readme_table.py --from OUTDIR
set -u
OUT=${1:?usage: scripts/gpu_all.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
unset NUMBA_ENABLE_CUDASIM          # real GPU: never the simulator
PY=${PYTHON:-python3}
LOGS=$(mktemp -d)
T0=$(date +%s)

# per-stage limits in seconds (total well under 600)
T_ENV=30 T_BENCH=${T_BENCH:-300} T_TRAFFIC=${T_TRAFFIC:-50} T_CHECKS=${T_CHECKS:-270} T_SERVE=${T_SERVE:-130}
T_LIMITS=$([ "${LIMITS:-1}" != 0 ] && echo ${T_LIMITS:-120} || echo 0)
SAN_FAMILIES=${SAN_FAMILIES:-numba cupy triton}
# the serving benchmark on the CuPy kernels: the Llama-3-8B-shaped model with all its 32 layers (16 GB of
# bf16 weights) and 20 GB of KV cache; 8192 requests arriving over about four
# seconds, more than either side serves in its 12 s (on this budget paged holds several times as many
# sequences at once as contiguous: serve_bench_*.json), so both serve a full batch until their time
# limit and tokens/s is the throughput at capacity (with fewer requests than paged can finish in its
# 12 s, paged admits all of them and spends the rest of its run on the tail of the longest outputs,
# at a shrinking batch: its "finished" near --requests says so); each side stops after 12 s of
# serving (the JSON then says complete: false and how many requests finished).  Three pairs in
# turn: a step's host work is Python, whose speed drifts between runs on a shared machine, so one
# pair's ratio may mislead; the JSON gives each pair's ratio.  All 32 layers, not serve-bench's
# default 2: the engine's books are paid once a step and the model's work once a layer, so fewer
# layers weigh the per-sequence books more than the real model does (SERVE_AGAIN="--layers 2
# --kv-budget-gb 1.25" serves the two-layer model at the same KV slots a layer, for comparison).
SERVE_ARGS=${SERVE_ARGS:---model llama3-8b-shape --layers 32 --kv-budget-gb 20 --requests 8192 --rate 2000 --device cuda --backend cupy --max-seconds 12 --repeats 3}

# the whole script must end before DEADLINE seconds (the device tool allows 600 per call)
DEADLINE=${DEADLINE:-580}
left() { local l=$(( DEADLINE - 25 - ($(date +%s) - T0) )); [ $l -lt 5 ] && l=5; [ $l -gt $1 ] && l=$1; echo $l; }
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOGS/stages.txt"; }

# stage 2c, serving, paged against contiguous (SERVE_FIRST=1 runs it before the bench: a
# short lease then gets the serving record whole)
serve_stage() {
  if [ "${SERVE:-1}" != 0 ]; then
    T_SV=$(left $T_SERVE)
    note "serve-bench (limit ${T_SV}s): $SERVE_ARGS"
    timeout --kill-after=5 $T_SV $PY -m iokernels serve-bench $SERVE_ARGS --json "$OUT/serve.json" \
      > "$LOGS/serve.log" 2>&1
    note "serve-bench exit $?"
    [ -s "$OUT/serve.json" ] || echo '{"error": "serve-bench did not finish; see logs.tar.gz serve.log"}' > "$OUT/serve.json"
    if [ -n "${SERVE_AGAIN:-}" ]; then                  # the same trace again, with these arguments added
      T_SV=$(left $T_SERVE)
      note "serve-bench again (limit ${T_SV}s): $SERVE_AGAIN"
      timeout --kill-after=5 $T_SV $PY -m iokernels serve-bench $SERVE_ARGS $SERVE_AGAIN \
        --json "$LOGS/serve_again.json" > "$LOGS/serve_again.log" 2>&1
      note "serve-bench again exit $?"
    fi
  else
    echo '{"error": "not run (SERVE=0)"}' > "$OUT/serve.json"
  fi
}

# ---------------------------------------------------------------- 1. env
note "env"
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  timeout $T_ENV nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1
  timeout $T_ENV nvidia-smi 2>&1 | head -20
  echo "nvcc: $(nvcc --version 2>&1 | tail -2 | tr '\n' ' ')"
  echo "ncu: $(ncu --version 2>&1 | tail -1)"
  echo "compute-sanitizer: $(compute-sanitizer --version 2>&1 | tail -1)"
  timeout $T_ENV $PY - <<'EOF'
import json, sys
sys.path.insert(0, ".")
from iokernels.bench import environment, label
env = environment()
print(json.dumps(env, indent=1))
print(label(env))
EOF
} > "$LOGS/env.txt" 2>&1
ENV_LINE=$(tail -1 "$LOGS/env.txt")

[ "${SERVE_FIRST:-0}" = 1 ] && serve_stage

# ---------------------------------------------------------------- 2. bench
T_BENCH=$(left $T_BENCH)
note "bench (limit ${T_BENCH}s)"
timeout --kill-after=10 $T_BENCH $PY -m iokernels bench --no-progress --out "$OUT/bench.json" \
  ${BENCH_SECTIONS:+--sections $BENCH_SECTIONS} ${CLIFF_BUDGET_S:+--cliff-budget-s $CLIFF_BUDGET_S} \
  ${CLIFF_START:+--cliff-start $CLIFF_START} ${BENCH_BACKENDS:+--backends $BENCH_BACKENDS} \
  --target-ms ${BENCH_TARGET_MS:-200} \
  > "$LOGS/bench.log" 2>&1
note "bench exit $?"
grep -v '^USDT' "$LOGS/bench.log" | sed -n '/^recorded on/,$p' > "$OUT/bench.txt"
[ -s "$OUT/bench.txt" ] || tail -60 "$LOGS/bench.log" > "$OUT/bench.txt"

# ---------------------------------------------------------------- 2b. ring attention on this one GPU
# A world of one rank over NCCL (a ring of two needs two GPUs): the time of a ring step at long
# sequences with the fused local kernel, the single-GPU side of a multi-GPU comparison.
if [ "${RING:-1}" != 0 ]; then
note "ring, one GPU (limit $(left ${T_RING:-30})s)"
timeout --kill-after=5 $(left ${T_RING:-30}) bash -c '
  for n in 32768 131072; do
    '"$PY"' -m iokernels ring --world-size 1 --device cuda --bench --reps 3 --causal --seqlen $n \
      --heads 16 --heads-kv 8 --head-dim 128 --timeout 50 2>&1
  done' > "$LOGS/ring_single_gpu.txt" 2>&1
note "ring exit $?"
fi

# ---------------------------------------------------------------- 2c. serving, paged against contiguous
[ "${SERVE_FIRST:-0}" = 1 ] || serve_stage

# ---------------------------------------------------------------- 2c'. the host's time (optional)
# HOST_PROFILE=1 runs scripts/host_profile.py after the serving stage (alone on the GPU): the host's
# cost of a matrix product at one row count against a new row count every call (--op gemm), then a
# serving step's host and device time, paged and contiguous, with the serving record's 32 layers and
# with 2 (--op serve); its text goes into logs.tar.gz (host_profile.txt), its summary lines into
# summary.txt.  T_HOST_PROFILE its box, default 150 s.
if [ "${HOST_PROFILE:-0}" != 0 ]; then
  T_HP=$(left ${T_HOST_PROFILE:-150})
  note "host profile (limit ${T_HP}s)"
  timeout --kill-after=5 $T_HP bash -c '
    '"$PY"' scripts/host_profile.py --op gemm
    for n in 32 2; do '"$PY"' scripts/host_profile.py --op serve --layers $n --top 12; done' \
    > "$LOGS/host_profile.txt" 2>&1
  note "host profile exit $?"
fi

# ---------------------------------------------------------------- 2d. a tuning sweep (optional)
# SWEEP="decode --shapes short --only v4,v6 --splits 1,2,4" runs iokernels.bench.sweeps_cupy with
# those arguments after the bench (alone on the GPU: it times things), in a box of T_SWEEP
# seconds (default 90); its JSON goes into logs.tar.gz as sweep.json, its rows to sweep.log
# SWEEP2 (box T_SWEEP2) a second sweep after it, into sweep2.json / sweep2.log
run_sweep() {                                   # run_sweep SPEC BOX STEM
  local spec=$1 box=$2 stem=$3 name
  note "sweep (limit ${box}s): $spec"
  set -- $spec
  name=$1; shift
  if [ "$name" = triton ]; then                 # SWEEP="triton --shapes b8n32768": iokernels.bench.sweeps_triton
    timeout --kill-after=5 $box $PY -m iokernels.bench.sweeps_triton "$LOGS/$stem.json" "$@" > "$LOGS/$stem.log" 2>&1
  elif [ "$name" = numba_fwd ] || [ "$name" = numba_decode ]; then   # SWEEP=numba_fwd: scripts/gpu_sweep.py's
    timeout --kill-after=5 $box $PY scripts/gpu_sweep.py "$LOGS" $name > "$LOGS/$stem.log" 2>&1   # sweep_<name>.jsonl
  else
    timeout --kill-after=5 $box $PY -m iokernels.bench.sweeps_cupy "$name" "$LOGS/$stem.json" "$@" \
      > "$LOGS/$stem.log" 2>&1
  fi
  note "$stem exit $?"
}
[ -n "${SWEEP:-}" ] && run_sweep "$SWEEP" "$(left ${T_SWEEP:-90})" sweep
[ -n "${SWEEP2:-}" ] && run_sweep "$SWEEP2" "$(left ${T_SWEEP2:-90})" sweep2
[ -n "${SWEEP3:-}" ] && run_sweep "$SWEEP3" "$(left ${T_SWEEP3:-90})" sweep3

# ---------------------------------------------------------------- 3 + 4. traffic and checks, in parallel
# The device lease is short, so the profiler shares the GPU with the sanitized runs, whose
# kernels are KB-sized (ragged test shapes) next to the MB-GB each profiled case moves; the
# GPU tests, which launch larger kernels, start only when the profiler is done.  The traffic
# record carries a note saying so.
T_TRAFFIC=$(left $T_TRAFFIC)
note "$([ "${TRAFFIC:-1}" != 0 ] && echo "traffic (ncu, limit ${T_TRAFFIC}s; limits profile ${T_LIMITS}s), then ")pytest; sanitizers alongside"
(
  if [ "${TRAFFIC:-1}" != 0 ]; then
    IK_TRAFFIC_NOTE="measured while compute-sanitizer runs (KB-sized kernels) shared the GPU" \
    timeout --kill-after=10 $(( T_TRAFFIC + T_LIMITS + 10 )) $PY scripts/profile_traffic.py all --out "$LOGS/traffic" \
      --timeout $T_TRAFFIC --limits-timeout $T_LIMITS ${TRAFFIC_ONLY:+--only "$TRAFFIC_ONLY"} > "$LOGS/traffic.log" 2>&1
    echo "[$(( $(date +%s) - T0 ))s] traffic exit $?" >> "$LOGS/stages.txt"
  fi
  files=""
  # (the files whose unmarked tests launch kernels on a real GPU when the simulator and Triton's
  # interpreter are off: lab 13's Triton kernels are graded live there;
  # the compile, launch-argument and schedule tests need no GPU and run in CI)
  for f in tests/test_conformance.py tests/test_numba*.py tests/test_gpu_*.py \
           tests/test_autograd.py tests/test_torch_sdpa.py tests/test_labs_triton.py; do
    [ -f "$f" ] && files="$files $f"; done
  # whole output (failures with short tracebacks, skip reasons, no warning summary): a failure on the
  # GPU must be readable from the record without another device call.  Three pytest
  # processes side by side (the GPU has room; NVRTC and Numba compiles are CPU-bound):
  # test_cupy.py's GPU tests, every other GPU test, the simulator-capable files; each in
  # PT_WORKERS pytest-xdist workers where xdist is installed (the compiles run in parallel).
  # -v: each test's verdict on its own line as it ends (xdist prints a -q run's failures only at
  # its end, which a time box can cut off)
  PT="$PY -m pytest -v -rfEs --durations=25 --tb=short -p no:warnings -p no:cacheprovider -p no:benchmark"
  if [ "${PT_WORKERS:-4}" -gt 1 ] && $PY -c "import xdist" 2>/dev/null; then
    PT="$PT -n ${PT_WORKERS:-4}"
  fi
  T_PT=$(left $T_CHECKS)
  rm -f "$LOGS"/pytest_*.log
  if [ -n "${GPU_TEST_IDS:-}" ]; then            # a file of test ids, one a line, no marker filter
    mapfile -t ids < "$GPU_TEST_IDS"
    { echo "== python3 -m pytest (the ${#ids[@]} test ids of $GPU_TEST_IDS)"
      timeout --kill-after=5 $T_PT $PT "${ids[@]}" 2>&1; } > "$LOGS/pytest_1.log" 2>&1
  elif [ -n "${GPU_TESTS:-}" ]; then
    { echo "== python3 -m pytest -m gpu $GPU_TESTS"; timeout --kill-after=5 $T_PT $PT -m gpu $GPU_TESTS 2>&1; } \
      > "$LOGS/pytest_1.log" 2>&1
  else
    { echo "== python3 -m pytest -m gpu tests/test_cupy.py"
      timeout --kill-after=5 $T_PT $PT -m gpu tests/test_cupy.py 2>&1; } > "$LOGS/pytest_1.log" 2>&1 &
    { echo "== python3 -m pytest -m gpu tests --ignore=tests/test_cupy.py (the other tests marked gpu)"
      timeout --kill-after=5 $T_PT $PT -m gpu tests --ignore=tests/test_cupy.py 2>&1; } > "$LOGS/pytest_2.log" 2>&1 &
    if [ -n "$files" ]; then
      { echo "== python3 -m pytest -m 'not gpu'$files (the simulator-capable tests, on the GPU)"
        timeout --kill-after=5 $T_PT $PT -m "not gpu" $files 2>&1; } > "$LOGS/pytest_3.log" 2>&1 &
    fi
    wait
  fi
  cat "$LOGS"/pytest_*.log > "$LOGS/pytest.log"
  echo "[$(( $(date +%s) - T0 ))s] pytest done" >> "$LOGS/stages.txt"
) &
PIDS="$!"
# warm CuPy's kernel cache (~/.cupy/kernel_cache) without the sanitizer first: NVRTC compiles
# under four sanitizers at once were too slow to finish in a debug run
KERNEL_ARGS=""
if [ -n "${SAN_KERNELS:-}" ]; then
  SAN_FAMILIES=cupy; for k in $SAN_KERNELS; do KERNEL_ARGS="$KERNEL_ARGS --kernel $k"; done
fi
[ "${SAN:-1}" = 0 ] && SAN_FAMILIES=""          # SAN=0: the GPU tests alone
if [ -n "$SAN_FAMILIES" ]; then
timeout --kill-after=5 $(left 60) $PY scripts/sanitize.py ${SAN_KERNELS:+--only cupy} $KERNEL_ARGS \
  > "$LOGS/sanitize_prewarm.log" 2>&1
note "sanitize.py without a sanitizer: exit $?"
fi
T_SAN=$(left $T_CHECKS)
[ -n "$SAN_FAMILIES" ] && note "4 sanitizers x families $SAN_FAMILIES (limit ${T_SAN}s)"
for tool in memcheck racecheck synccheck initcheck; do
  for fam in $SAN_FAMILIES; do       # one process per (tool, family): 12 in parallel by default
    (
      # --report-api-errors no: CUDA Python (numba-cuda's driver bindings) probes the driver
      # with cuGetProcAddress for symbols it may lack; those failed *host API* calls are not
      # kernel errors, and without this flag each one counts in the ERROR SUMMARY
      timeout --kill-after=5 $T_SAN compute-sanitizer --tool $tool --report-api-errors no \
        --error-exitcode 99 --print-limit 50 \
        $PY scripts/sanitize.py --only $fam $KERNEL_ARGS > "$LOGS/sanitize_${tool}_$fam.log" 2>&1
      echo $? > "$LOGS/sanitize_${tool}_$fam.rc"
    ) &
    PIDS="$PIDS $!"
  done
done
for p in $PIDS; do wait $p; done
note "traffic and checks done"
cp "$LOGS/traffic/traffic.json" "$OUT/traffic.json" 2>/dev/null || echo '{"error": "no traffic.json"}' > "$OUT/traffic.json"
cp "$LOGS/traffic/ncu_raw.csv" "$LOGS/ncu_raw.csv" 2>/dev/null || echo "no ncu output" > "$LOGS/ncu_raw.csv"
cp "$LOGS/traffic/limits_raw.csv" "$LOGS/limits_raw.csv" 2>/dev/null
cp "$LOGS/pytest.log" "$OUT/pytest.txt"
if [ -n "$SAN_FAMILIES" ]; then
  $PY scripts/sanitize.py --summarize "$LOGS" "$ENV_LINE" > "$OUT/sanitizer.txt" 2>&1
else
  echo "compute-sanitizer: not run (SAN=0)" > "$OUT/sanitizer.txt"
fi

# ---------------------------------------------------------------- 5. summary
note "summary"
{
  echo "scripts/gpu_all.sh: $ENV_LINE"
  cat "$LOGS/stages.txt"
  echo
  echo "== sanitizer"; sed -n '1,/^$/p' "$OUT/sanitizer.txt"
  echo
  echo "== pytest (summaries and failures)"
  grep -E "^== python3|^=* ?[0-9]+ (passed|failed)|no tests ran|FAILED|^ERROR " "$OUT/pytest.txt" | head -40
  echo
  echo "== traffic (measured DRAM bytes vs model; first, what bounds each kernel that misses a bar)"
  sed -n '/^case /,$p' "$LOGS/traffic.log" 2>/dev/null | head -130
  echo
  echo "== ring attention, one GPU (NCCL world of one)"; grep -E "ring bench|rank 0|ring:" "$LOGS/ring_single_gpu.txt" 2>/dev/null | head -6
  echo
  for f in "$OUT/serve.json" "$LOGS/serve_again.json"; do
    [ -e "$f" ] || continue
    echo "== serve-bench (paged against contiguous)$([ "$f" = "$OUT/serve.json" ] || echo " again: $SERVE_AGAIN")"
    $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(r.get('error') or '\n'.join(f'{k}: ' + json.dumps({f: r[k].get(f) for f in ('max_concurrent', 'tokens_per_s', 'waste_fraction', 'p50_ms', 'p99_ms', 'finished', 'complete', 'phase_ms')}) for k in ('paged', 'contiguous')) + '\nwall_s: ' + json.dumps(r.get('wall_s')) + ('\ntokens/s ratio over the pairs: ' + json.dumps(r['tokens_per_s_ratio']) if r.get('tokens_per_s_ratio') else ''))" "$f" 2>&1
    echo
  done
  if [ -s "$LOGS/host_profile.txt" ]; then
    echo "== host profile (scripts/host_profile.py: gemm, then serve at 32 layers and at 2)"
    grep -E "^==|pads" "$LOGS/host_profile.txt" | head -20
    echo
  fi
  echo "== bench: silent fall-backs and suspect rows"
  grep -E "silent fall-back|SUSPECT" "$OUT/bench.txt" | head -20
  echo "total wall time: $(( $(date +%s) - T0 )) s"
} > "$OUT/summary.txt" 2>&1
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
cat "$OUT/summary.txt"
