"""The GPU exercises of the labs (8-10): Numba CUDA on the simulator, and a CuPy RawKernel.

=================  ==============================================================
exercise           what the learner writes (lab 07, lab 08)
=================  ==============================================================
numba_forward      a @cuda.jit FlashAttention-2 forward: K_j, V_j staged in shared
                   memory by the whole block, one thread per query row
barrier_hunt       the same idea with one cuda.syncthreads() missing: find it
cupy_online        (GPU only) the online-softmax update inside a CUDA C++ tile loop
=================  ==============================================================

The Numba kernels run without a GPU: :mod:`iokernels.labs.simt` runs the kernel's Python
function with one Python thread per GPU thread, counts every global-memory element it
reads and writes (the arrays are :class:`iokernels.numba_cuda.counting.CountingArray`
objects, as the package's own counted runs use) and checks every shared-memory access
for races, deterministically.  The counted bytes are held against FlashAttention-2's
traffic model per tile: each visited (query tile, K/V tile) pair loads Bc x d of K and of
V, once.  The kernel is also launched once through ``numba.cuda`` itself (the simulator
without a GPU) and checked against the oracle.

Lab constants (the kernels' compile-time tile sizes): Br = :data:`BR` threads per block,
one per query row; Bc = :data:`BC` keys per tile; :data:`D_MAX` the largest head dim the
per-thread arrays hold.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from .. import naive, tiled
from ..core import conventions as cv
from ..core import gpu, reference, testing
from ..core.config import TileConfig
from ..core.traffic import Traffic
from . import references as refs
from . import simt
from .engine import Case, CaseReport, Exercise, LabSkip, Mistake, budget_report, fail, oracle_problem

#: query rows per block (one thread each) and keys per shared-memory tile: small, so the
#: simulator runs a lab in seconds, and unequal tile counts show up in awkward shapes
BR, BC = 8, 8
#: the per-thread arrays (q_i, o_i) hold up to this many dims; the lab's head dims are below it
D_MAX = 64


def _label(p) -> str:
    s = f"B={p['B']} Hq={p['Hq']} Hkv={p['Hkv']} Nq={p['Nq']} Nk={p['Nk']} d={p['d']} float32"
    return s + (" causal" if p["causal"] else "")


def grid_for(Nq, B, Hq):
    """The launch grid of the lab kernels: (query tiles, batch x heads)."""
    return (math.ceil(Nq / BR), B * Hq)


def _counted(arrays, names, traffic_):
    from ..numba_cuda.counting import CountingArray
    lock = threading.Lock()
    return [CountingArray(a, n, traffic_, lock) for a, n in zip(arrays, names)]


def _run_numba(kernel, grid, *args):
    """Launch through numba.cuda (the simulator without a GPU); returns the host copies of args."""
    from numba import cuda
    dev = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args]
    kernel[grid, BR](*dev)
    cuda.synchronize()
    return [d.copy_to_host() if hasattr(d, "copy_to_host") else d for d in dev]


# =========================================================================== 8 numba forward
TILE_PER_THREAD = Mistake("every thread loads the whole K/V tile",
                          "the block shares the tile: thread t loads rows t, t + Br, t + 2 Br, ... "
                          "(or elements t, t + Br, ... of the Bc x d tile), then cuda.syncthreads().")
Q_REREAD_GPU = Mistake("q_i re-read from global memory inside the tile loop",
                       "load the thread's query row into a local array once, before the loop over tiles.")
MASKED_TILES_GPU = Mistake("fully masked K/V tiles loaded",
                           "loop only over the tiles [kmin, kmax) some row of the block can see (causal: "
                           "kmax = min(Nk, r0 + Br - 1 + Nk - Nq + 1)); with none, do not read q.")
MISSING_BARRIER = Mistake("a missing cuda.syncthreads()",
                          "a barrier after the tile load (everyone's share is in shared memory before anyone "
                          "reads it) and one at the end of the tile loop (everyone is done reading before the "
                          "next tile overwrites it).")


def _gpu_detectors(row, counted, budget):
    if row.tensor in ("K", "V") and row.read >= BR * row.allowed_read * 0.9 and BR > 1:
        return TILE_PER_THREAD
    if row.tensor in ("K", "V") and row.read > row.allowed_read:
        return MASKED_TILES_GPU
    if row.tensor == "Q" and row.read > row.allowed_read:
        return Q_REREAD_GPU if row.read >= 2 * row.allowed_read else MASKED_TILES_GPU
    return None


def _forward_case(kernel, case, rng, first: bool):
    p = case.params
    q, k, v = testing.make_inputs(rng, p["B"], p["Hq"], p["Hkv"], p["Nq"], p["Nk"], p["d"], "float32")
    scale, causal = np.float32(cv.default_scale(p["d"])), p["causal"]
    o = np.full(q.shape, np.nan, np.float32)
    lse = np.full(q.shape[:3], np.nan, np.float32)
    counted = Traffic()
    args = _counted([q, k, v, o, lse], ["Q", "K", "V", "O", "LSE"], counted)
    grid = grid_for(p["Nq"], p["B"], p["Hq"])
    try:
        simt.launch(kernel, grid, BR, *args, scale, causal)
    except simt.RaceError as exc:    # two threads writing one element: both load the same tile
        fail(str(exc), mistake=TILE_PER_THREAD if exc.race.kind == "WAW" else MISSING_BARRIER)
    except simt.BarrierError as exc:
        fail(str(exc))
    ref_o, ref_lse = reference.attention(q, k, v, causal)
    base_o, base_lse = naive.attention(q, k, v, causal=causal, scale=float(scale), window=None)
    report = CaseReport()
    lo, hi = cv.key_range(np.arange(p["Nq"]), p["Nq"], p["Nk"], causal)
    oracle_problem(o, ref_o, base_o, name="O", dtype="float32", report=report, masked_rows=(hi <= lo)[:, None])
    oracle_problem(lse, ref_lse, base_lse, name="LSE", dtype="float32", report=report)
    budget = tiled.traffic_model_fa2(batch=p["B"], heads_q=p["Hq"], heads_kv=p["Hkv"], seqlen_q=p["Nq"],
                                     seqlen_k=p["Nk"], head_dim=p["d"], dtype="float32", causal=causal,
                                     config=TileConfig(block_q=BR, block_k=BC))
    budget_report(counted, budget, (_gpu_detectors,), report=report)
    tiles = sum(1 for _ in _visited_tiles(p, causal)) * p["B"] * p["Hq"]
    k_read = counted.by_tensor.get("K", [0, 0])[0]
    report.notes.append(f"K: {k_read:,} B read over {tiles} visited tiles = {k_read // max(1, tiles):,} B per tile "
                        f"(at most Bc x d x 4 = {BC * p['d'] * 4:,} B)")
    if first:                                       # once through numba.cuda itself
        out = _run_numba(kernel, grid, q, k, v, np.zeros_like(o), np.zeros_like(lse), scale, causal)
        oracle_problem(out[3], ref_o, base_o, name="O (numba.cuda launch)", dtype="float32", report=report)
    return report


def _visited_tiles(p, causal):
    for r0 in range(0, p["Nq"], BR):
        for c0 in range(0, p["Nk"], BC):
            if cv.tile_state(r0, min(r0 + BR, p["Nq"]), c0, min(c0 + BC, p["Nk"]), p["Nq"], p["Nk"],
                             causal) != "skip":
                yield r0, c0


def _grade_numba_forward(kernel, case, rng):
    return _forward_case(kernel, case, rng, first=case.params.get("launch", False))


def _require_numba():
    try:
        import numba.cuda  # noqa: F401
    except Exception as exc:   # pragma: no cover - numba is a core dependency
        raise LabSkip(f"numba.cuda is not importable here: {exc}") from None


_FORWARD_CASES = [dict(B=1, Hq=2, Hkv=1, Nq=13, Nk=21, d=59, causal=False, launch=True),
                  dict(B=1, Hq=1, Hkv=1, Nq=19, Nk=11, d=16, causal=True),
                  dict(B=2, Hq=2, Hkv=2, Nq=9, Nk=17, d=5, causal=True)]

NUMBA_FORWARD = Exercise(
    name="numba_forward", title="A Numba CUDA FlashAttention forward with shared-memory tiles",
    entry="flash_fwd_kernel",
    spec=("flash_fwd_kernel(q, k, v, o, lse, scale, causal): a @cuda.jit kernel on grid (ceil(Nq / BR), B * Hq) "
          "with BR threads per block, one query row each; K_j, V_j (BC x d) staged in cuda.shared.array by the "
          "whole block; q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d), o like q, lse (B, Hq, Nq), all float32."),
    cases=lambda: [Case(_label(p), p) for p in _FORWARD_CASES],
    grade_case=lambda kernel, case, rng: (_require_numba(), _grade_numba_forward(kernel, case, rng))[1],
    seed=808,
    hint="each thread: its row's m, l, O in registers (local arrays); the block: the K/V tile in shared memory.",
    mistakes=(TILE_PER_THREAD, Q_REREAD_GPU, MASKED_TILES_GPU, MISSING_BARRIER), references=refs.FORWARD)


# =========================================================================== 9 barrier hunt
def _grade_barrier(kernel, case, rng):
    """The kernel computes LSE only: row i's log-sum-exp of scale q_i K^T over K tiles in shared memory."""
    _require_numba()
    p = case.params
    q, k, _ = testing.make_inputs(rng, p["B"], p["Hq"], p["Hkv"], p["Nq"], p["Nk"], p["d"], "float32")
    scale, causal = np.float32(cv.default_scale(p["d"])), p["causal"]
    lse = np.full(q.shape[:3], np.nan, np.float32)
    grid = grid_for(p["Nq"], p["B"], p["Hq"])
    try:
        simt.launch(kernel, grid, BR, q, k, lse, scale, causal)
    except simt.RaceError as exc:
        fail(str(exc), mistake=MISSING_BARRIER)
    except simt.BarrierError as exc:
        fail(str(exc))
    _, ref_lse = reference.attention(q, k, k, causal)
    _, base_lse = naive.attention(q, k, k, causal=causal, scale=float(scale), window=None)
    report = CaseReport()
    oracle_problem(lse, ref_lse, base_lse, name="LSE", dtype="float32", report=report)
    if p.get("launch"):
        out = _run_numba(kernel, grid, q, k, np.zeros_like(lse), scale, causal)
        oracle_problem(out[2], ref_lse, base_lse, name="LSE (numba.cuda launch)", dtype="float32", report=report)
    report.notes.append("no shared-memory hazard: every store and load of the tile is separated by a barrier")
    return report


BARRIER_HUNT = Exercise(
    name="barrier_hunt", title="Bug hunt: the missing barrier", entry="row_lse_kernel",
    spec=("row_lse_kernel(q, k, lse, scale, causal): each thread computes its query row's log-sum-exp over K "
          "tiles staged in shared memory.  As given it races; fix it."),
    cases=lambda: [Case(_label(p), p) for p in (dict(B=1, Hq=2, Hkv=1, Nq=11, Nk=29, d=7, causal=False,
                                                     launch=True),
                                                dict(B=1, Hq=1, Hkv=1, Nq=16, Nk=24, d=59, causal=True))],
    grade_case=_grade_barrier, seed=909,
    hint="ask of every shared-memory store: who reads it, and is there a barrier in between? And of every load?",
    mistakes=(MISSING_BARRIER,), references=refs.FORWARD)


# =========================================================================== 10 cupy online update
#: The CUDA C++ tile loop of exercise 10: one thread per query row, K_j and V_j in shared
#: memory, float32.  ``{ONLINE_UPDATE}`` is the learner's code: it folds the tile's scores
#: s[0..n) into m_i, l_i and o_i[0..d).
CUDA_TEMPLATE = r"""
#define BR 32
#define BC 32
#define D_MAX 128
extern "C" __global__ void lab_flash_fwd(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ o,
                                         float* __restrict__ lse, int Hq, int Hkv, int Nq, int Nk, int d,
                                         float scale) {
    __shared__ float K_j[BC][D_MAX];
    __shared__ float V_j[BC][D_MAX];
    const int bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / (Hq / Hkv);
    const int i = blockIdx.x * BR + threadIdx.x;                 // this thread's query row
    const float* qb = q + ((long long)bh * Nq) * d;
    const float* kb = k + ((long long)(b * Hkv + hk) * Nk) * d;
    const float* vb = v + ((long long)(b * Hkv + hk) * Nk) * d;
    float q_i[D_MAX], o_i[D_MAX], s[BC];
    float m_i = __int_as_float(0xff800000), l_i = 0.0f;     // m = -inf
    for (int dd = 0; dd < d; ++dd) { q_i[dd] = i < Nq ? qb[(long long)i * d + dd] : 0.0f; o_i[dd] = 0.0f; }
    for (int c0 = 0; c0 < Nk; c0 += BC) {                         // for each K/V tile j
        const int n = min(BC, Nk - c0);
        for (int e = threadIdx.x; e < n * d; e += BR) {           // load K_j, V_j -> shared memory
            K_j[e / d][e % d] = kb[(long long)(c0 + e / d) * d + e % d];
            V_j[e / d][e % d] = vb[(long long)(c0 + e / d) * d + e % d];
        }
        __syncthreads();
        if (i < Nq) {
            for (int j = 0; j < n; ++j) {                         // S_ij = scale q_i K_j^T
                float dot = 0.0f;
                for (int dd = 0; dd < d; ++dd) dot += q_i[dd] * K_j[j][dd];
                s[j] = dot * scale;
            }
            // ---- the online-softmax update: fold s[0..n) into m_i, l_i, o_i[0..d) ----
{ONLINE_UPDATE}
        }
        __syncthreads();
    }
    if (i < Nq) {                                                 // write O_i, LSE_i -> HBM
        for (int dd = 0; dd < d; ++dd) o[((long long)bh * Nq + i) * d + dd] = o_i[dd] / l_i;
        lse[(long long)bh * Nq + i] = m_i + logf(l_i);
    }
}
"""
CUDA_BR = 32


def cuda_source(update: str) -> str:
    """The whole kernel with the learner's online-softmax update in place."""
    return CUDA_TEMPLATE.replace("{ONLINE_UPDATE}", update)


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME")
    cand = os.path.join(home, "bin", "nvcc") if home else ""
    return cand if cand and os.path.exists(cand) else None


#: the architecture compiled for without a GPU: compute capability 7.5 (a T4), the oldest supported
COMPILE_ARCH = "sm_75"


def compile_check(source: str) -> str | None:
    """Compile ``source`` with nvcc to a cubin (no GPU needed); the error text, or None if it compiles.

    Raises LabSkip when there is no nvcc.
    """
    nvcc = _nvcc()
    if nvcc is None:
        raise LabSkip("no GPU and no nvcc here: the CUDA C++ could not be compiled or run (skipped); "
                      "run this lab on a machine with a CUDA GPU and CuPy")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lab.cu")
        with open(path, "w") as f:
            f.write(source)
        proc = subprocess.run([nvcc, f"-arch={COMPILE_ARCH}", "-cubin", "-o", os.path.join(tmp, "lab.cubin"), path],
                              capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if "error" in ln]
        return "\n".join(ln.replace(path, "kernel") for ln in lines[:5]) or proc.stderr[-800:]
    return None


def _gpu_ready() -> str | None:
    """None when CuPy and a CUDA device are usable, else the reason."""
    if gpu.simulator_enabled():
        return "NUMBA_ENABLE_CUDASIM is set (no GPU in use)"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:       # no cupy, no driver
        return f"CuPy is not usable here ({type(exc).__name__})"
    return None


def _grade_cupy(update_fn, case, rng):
    update = update_fn()
    if not isinstance(update, str) or not update.strip():
        fail("online_update_cuda() must return the CUDA C++ lines of the update as a string")
    source = cuda_source(update)
    reason = _gpu_ready()
    if reason is not None:
        error = compile_check(source)
        if error is not None:
            fail(f"the kernel does not compile with your update:\n{error}")
        raise LabSkip(f"compiled with nvcc for {COMPILE_ARCH}: OK; running it needs a CUDA GPU with CuPy "
                      f"({reason}), so the check is skipped here")
    import cupy
    p = case.params
    q, k, v = testing.make_inputs(rng, p["B"], p["Hq"], p["Hkv"], p["Nq"], p["Nk"], p["d"], "float32")
    kern = cupy.RawKernel(source, "lab_flash_fwd")
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    do = cupy.zeros_like(dq)
    dl = cupy.zeros(q.shape[:3], cupy.float32)
    grid = (math.ceil(p["Nq"] / CUDA_BR), p["B"] * p["Hq"])
    kern(grid, (CUDA_BR,), (dq, dk, dv, do, dl, np.int32(p["Hq"]), np.int32(p["Hkv"]), np.int32(p["Nq"]),
                            np.int32(p["Nk"]), np.int32(p["d"]), np.float32(cv.default_scale(p["d"]))))
    ref_o, ref_lse = reference.attention(q, k, v)
    base_o, base_lse = naive.attention(q, k, v, causal=False, scale=cv.default_scale(p["d"]), window=None)
    report = CaseReport()
    oracle_problem(cupy.asnumpy(do), ref_o, base_o, name="O", dtype="float32", report=report)
    oracle_problem(cupy.asnumpy(dl), ref_lse, base_lse, name="LSE", dtype="float32", report=report)
    return report


CUPY_ONLINE = Exercise(
    name="cupy_online", title="(GPU) The online-softmax update in CUDA C++", entry="online_update_cuda",
    spec=("online_update_cuda() -> str: CUDA C++ statements that fold the tile's scores s[0..n) into m_i, l_i "
          "and o_i[0..d) (V_j[j][dd] holds the tile's values); they are pasted into CUDA_TEMPLATE."),
    cases=lambda: [Case(f"B=1 Hq=2 Hkv=1 Nq={nq} Nk={nk} d={d} float32", dict(B=1, Hq=2, Hkv=1, Nq=nq, Nk=nk, d=d))
                   for nq, nk, d in ((77, 130, 59), (64, 33, 128))],
    grade_case=_grade_cupy, seed=1010,
    hint="m_new = max(m_i, max_j s[j]); alpha = expf(m_i - m_new); l_i = alpha l_i + sum_j expf(s[j] - m_new); "
         "o_i = alpha o_i + sum_j p_j V_j[j]; m_i = m_new.",
    references=refs.CUDA_SOURCE + refs.FORWARD)

GPU_EXERCISES = (NUMBA_FORWARD, BARRIER_HUNT, CUPY_ONLINE)
