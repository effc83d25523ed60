"""What notebook 15 ("the same kernel in Triton") computes: small pure functions, no kernels.

* :data:`WHO_DECIDES` is the notebook's table: for each decision a FlashAttention forward
  makes, who makes it in the CUDA C++ kernel (``cupy_raw/kernels/fa_v1.cu``) and in the
  Triton one (:mod:`.forward_v1`), with the source that says so.
* :func:`programs` and :func:`tiles_visited` count forward v1's grid and the key tiles its loop
  loads (the loop runs over :func:`.tiles.tile_span` only), from the same key bands as the
  kernel (:func:`iokernels.core.conventions.key_range`), without running it.
* :func:`interpreter_check` runs forward v1 (on Triton's interpreter when there is no GPU)
  and holds it to the float64 oracle with FlashAttention's 2x rule.
* :func:`decode_depth_table` sets decode v1's split counts beside v2's at the serving shapes
  (what :data:`.config.DECODE_DEPTH` asks of the occupancy rule), and beside them the
  recorded tuning sweep's speeds (benchmarks/results/sweeps/*_triton_decode_*.json), if any.

Nothing here imports triton at module import; :func:`interpreter_check` says why it cannot
run where triton is missing (:func:`.launch.unavailable`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..core import conventions as cv
from ..core import reference, testing
from . import launch

#: (decision, CUDA C++ v1, Triton v1, source)
WHO_DECIDES = (
    ("which query rows a block / program owns", "you: blockIdx.x -> Q tile", "you: tl.program_id(0) -> Q tile",
     "both kernels' first lines (code)"),
    ("which thread holds which element of S_ij", "you: 4 rows x 4 keys per thread, warp shuffles",
     "Triton: the compiler's layouts for each tile", "OpenAI's post introducing Triton (2021): memory "
                                                     "coalescing is automatic in Triton, manual in CUDA (blog post)"),
    ("staging K_j, V_j through shared memory", "you: __shared__ arrays, __syncthreads()",
     "Triton: the compiler allocates it for tl.dot's operands",
     "OpenAI's post introducing Triton (2021): shared memory "
     "management is automatic in Triton, manual in CUDA (blog post)"),
    ("overlapping the next tile's loads with this tile's math", "you: cp.async double buffering (v1b)",
     "Triton: the loop is pipelined, num_stages deep", "triton.Config, num_stages: the stages the compiler uses "
     "when software-pipelining loops (docs)"),
    ("the tile sizes Br, Bc and the loop over K/V tiles", "you", "you (BLOCK_Q, BLOCK_K; the for loop)",
     "forward_v1.py (code)"),
    ("the online softmax: m, l, the rescale of O", "you", "you", "forward_v1.py; FlashAttention-2, Alg. 1 (paper)"),
    ("masking: the end of the sequence, causal, the window", "you", "you (tl.load's mask=, tl.where)",
     "forward_v1.py (code)"),
)


def programs(batch: int, heads_q: int, seqlen_q: int, block_q: int) -> int:
    """Forward v1's grid: ceil(Nq / Br) Q tiles times B * Hq heads."""
    for name, val in (("batch", batch), ("heads_q", heads_q), ("seqlen_q", seqlen_q), ("block_q", block_q)):
        if not isinstance(val, (int, np.integer)) or val < (1 if name == "block_q" else 0):
            raise ValueError(f"{name}: expected a non-negative int (block_q >= 1); got {val!r}")
    return -(-seqlen_q // block_q) * batch * heads_q


def tiles_visited(seqlen_q: int, seqlen_k: int, block_q: int, block_k: int, causal: bool = False,
                  window=None) -> tuple[int, int]:
    """(key tiles forward v1 loads for one head, Q tiles x K tiles of the whole matrix).

    A Q tile loops over the key tiles from its span's first key (rounded down to a tile) to
    its last: the tiles no row of it sees are never loaded.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q, block_k: expected >= 1; got {block_q}, {block_k}")
    tq, tk = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    visited = 0
    for i in range(tq):
        r0, r1 = i * block_q, min((i + 1) * block_q, seqlen_q)
        lo, hi = cv.key_range(np.arange(r0, r1), seqlen_q, seqlen_k, causal, window)
        span_lo, span_hi = int(lo.min()), int(hi.max())
        if span_hi > span_lo:
            visited += -(-span_hi // block_k) - span_lo // block_k
    return visited, tq * tk


def interpreter_check(dtype: str = "float16", causal: bool = True, *, seqlen_q: int = 37, seqlen_k: int = 45,
                      head_dim: int = 32, heads_q: int = 2, heads_kv: int = 1, seed: int = 0):
    """Run forward v1 on ragged lengths and hold O to the float64 oracle (2x rule).

    Returns (where it ran, the :class:`iokernels.core.testing.Check`); raises ValueError
    naming what to install where the Triton kernels cannot run.
    """
    why = launch.unavailable()
    if why is not None:
        raise ValueError(f"dtype: the Triton kernels cannot run here: {why}")
    from . import ForwardConfig
    from .registry import attention
    rng = np.random.default_rng(seed)
    q, k, v = testing.make_inputs(rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                                  heads_q=heads_q, heads_kv=heads_kv, dtype=dtype)
    o, _ = attention(q, k, v, causal=causal, config=ForwardConfig(version="v1"))
    ref, ref_lse = reference.attention(q, k, v, causal=causal)
    from ..naive import attention as naive
    base, _ = naive(q, k, v, causal=causal, scale=cv.default_scale(head_dim), window=None)
    where = "Triton's interpreter (CPU)" if launch.interpreting() else "the GPU"
    return where, testing.check(o, ref, base, dtype=dtype, masked_rows=np.isneginf(ref_lse)[..., None])


#: the forward v1 kernel's file (shown by path: reading it needs no triton)
FORWARD_V1 = Path(__file__).with_name("forward_v1.py")


def who_decides_table() -> str:
    """:data:`WHO_DECIDES` as plain text, one decision per block of lines."""
    out = []
    for what, cuda, tri, src in WHO_DECIDES:
        out.append(f"{what}\n    CUDA C++ v1: {cuda}\n    Triton v1:   {tri}\n    source:      {src}")
    return "\n".join(out)


#: the decode tuning sweeps (:mod:`iokernels.bench.sweeps_triton`) recorded in the repository
SWEEPS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "sweeps"
#: the sweep rows that run each decode version's setting, by any of their labels (v2 is v1's kernel
#: four programs deep, two stages: :data:`.config.DECODE_DEPTH`; v3 its own kernel at its own depth)
SWEEP_ROWS = {"v1": ("triton v1",), "v2": ("triton v2", "triton v1 2 stages x4 deep"), "v3": ("triton v3",)}


def decode_depth_table(sms: int | None = None, sweep: Path | None = None) -> str:
    """Each decode version's split count and programs (splits x B x Hkv) at the serving shapes
    (GQA 32/8, d = 128) on ``sms`` multiprocessors (None: 132, an H100's), and, from the
    latest recorded sweep (or ``sweep``), each version's time as a fraction of the best SDPA
    kernel's, contiguous and paged, on the GPU that recorded it ("-" where the sweep has no row)."""
    from ..decode import DEFAULT_NUM_SMS
    from .config import DECODE_BLOCK_N, DECODE_DEPTH
    from .decode import split_count
    sms = DEFAULT_NUM_SMS if sms is None else sms
    versions = tuple(SWEEP_ROWS)
    if sweep is None:
        found = sorted(SWEEPS.glob("*_triton_decode_*.json"))
        sweep = found[-1] if found else None
    speed: dict = {}
    gpu = None
    if sweep is not None:
        rec = json.loads(Path(sweep).read_text())
        gpu = rec.get("env", {}).get("gpu")
        for row in rec["rows"]:
            if row.get("ratio_to_best_sdpa") is not None:
                speed[row["group"], row["runner"]] = row["ratio_to_best_sdpa"]
    head = f"{'B':>3} {'N':>6}" + "".join(f" | {v + ' splits':>9} {'programs':>8}" for v in versions)
    if speed:
        head += " | speed vs best SDPA: " + ", ".join(versions) + " (paged: the same)"
    lines = [head]
    for batch in (1, 8, 64):
        for n in (4096, 32768):
            line = f"{batch:>3} {n:>6}"
            for v in versions:
                s = split_count(batch, 8, n, DECODE_BLOCK_N, DECODE_DEPTH[v][0], sms)
                line += f" | {s:>9} {s * batch * 8:>8}"
            group = f"decode float16 B={batch} Hq=32 Hkv=8 N={n} d=128"
            got = [[next((speed[group, r + paged] for r in SWEEP_ROWS[v] if (group, r + paged) in speed), None)
                    for v in versions] for paged in ("", " paged")]
            if speed and any(x is not None for part in got for x in part):
                contiguous, paged = (", ".join("-" if x is None else f"{x:.2f}" for x in part) for part in got)
                line += f" | {contiguous} ({paged})"
            lines.append(line)
    if gpu:
        lines.append(f"(speeds: {Path(sweep).name}, recorded on {gpu})")
    return "\n".join(lines)
