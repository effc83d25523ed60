"""What goes wrong with IO-aware attention in practice, each failure demonstrated and measured.

Notebook 11 calls these functions; each one runs a small experiment and returns its
numbers (plots come from :mod:`iokernels.viz.failure_modes`).

=====================================  =================================================
:func:`attention_accumulating_in`      FA2's loop with the running l and O rounded to a
                                       low-precision accumulator after every K/V tile
:func:`accumulation_drift`             its error against N, per accumulator dtype
:func:`bitwise_differences`            the same inputs through several tile sizes and
                                       backends: equal to rounding, not bit for bit
:func:`dq_contributions`, :func:`accumulate_dq`
                                       dQ = sum over K/V tiles, added in a shuffled order
                                       (as atomics do) or a fixed one
:func:`deterministic_dq_cost`          the memory and HBM bytes of FA2's deterministic dQ
:func:`bias_vs_score_mod`              a dense bias in HBM against a score_mod computed
                                       in the tile loop, and a document mask's skipped tiles
:func:`textbook_softmax`               the softmax of a fully masked row: NaN
:func:`varlen_savings`                 packing with cu_seqlens against padding: bytes, FLOPs
:func:`check_varlen_per_sequence`      each packed sequence against its own dense oracle
:func:`accuracy_report`                which backend ran, and its accuracy, on this install
=====================================  =================================================

Notation as in :mod:`iokernels.tiled`: Br, Bc tile rows; m, l, O the running statistics;
LSE the row log-sum-exp; dQ, dS, K as in :mod:`iokernels.backward`.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .core import conventions as cv
from .core import reference, testing
from .core import roofline as rl
from .core.config import TileConfig
from .core.traffic import count

__all__ = ["attention_accumulating_in", "accumulation_drift", "bitwise_differences", "dq_contributions",
           "accumulate_dq", "deterministic_dq_cost", "bias_vs_score_mod", "textbook_softmax",
           "varlen_savings", "check_varlen_per_sequence", "accuracy_report"]

#: key rows per tile in the accumulation experiment: the accumulator is rounded once per tile
DRIFT_BLOCK_K = 64
#: query rows of the drift experiment: the drift is per row, so a few rows suffice
DRIFT_QUERIES = 16
#: added to the drift experiment's values: real values share a common component, and with
#: zero-mean values the output shrinks as 1/sqrt(N), which would hide the drift
DRIFT_VALUE_OFFSET = 1.0
#: float32 bytes of one dQ accumulator element
_F32 = 4
#: streaming multiprocessors of an H100 SXM (datasheet): FlashAttention-2's deterministic
#: backward sizes its dQ accumulators from the SM count
H100_SMS = 132


# --------------------------------------------------------------------------- accumulation drift
def attention_accumulating_in(q, k, v, accumulator: str, block_k: int = DRIFT_BLOCK_K, scale=None):
    """FA2's online softmax for (B, H, Nq, d) inputs, with l and O *stored* in ``accumulator``.

    Every tile's arithmetic runs in float32 (as a tensor core's products do), but after each
    K/V tile the running sum l and output O are rounded to ``accumulator`` ("float32",
    "bfloat16" or "float16"), as if the kernel kept them in registers of that type.  With
    Tc = N / Bc tiles that is Tc roundings, so the error grows with N.  Returns O (float32).
    """
    from .tiled import _finalize, _online_step, _Tile
    acc_store = testing.numpy_dtype(accumulator)
    f32 = np.dtype(np.float32)
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    scale = cv.resolve_scale(scale, d)
    out = np.empty((B, H, Nq, d), np.float32)
    for b in range(B):
        for h in range(H):
            hk = cv.kv_head(h, H, k.shape[1])
            q_i = q[b, h].astype(f32)                             # load Q_i -> SRAM (all rows: one tile)
            m, l, o = np.full(Nq, -np.inf, f32), np.zeros(Nq, f32), np.zeros((Nq, d), f32)
            for c0 in range(0, Nk, block_k):                      # for each K/V tile j
                c1 = min(c0 + block_k, Nk)
                tile = _Tile(c0 // block_k, c0, c1, None)
                m, l, o = _online_step(q_i, k[b, hk, c0:c1].astype(f32), v[b, hk, c0:c1].astype(f32),
                                       tile, m, l, o, scale, f32)
                l = l.astype(acc_store).astype(f32)               # the accumulators, rounded
                o = o.astype(acc_store).astype(f32)
            out[b, h] = _finalize(m, l, o)[0]                     # write O_i -> HBM
    return out


def accumulation_drift(rng, seqlens=(256, 1024, 4096, 16384), head_dim: int = 64,
                       accumulators=("float32", "bfloat16", "float16"), queries: int = DRIFT_QUERIES,
                       value_offset: float = DRIFT_VALUE_OFFSET) -> dict:
    """Relative error max|O - O_ref64| / max|O_ref64| against N_k, per accumulator dtype.

    float32 inputs, one head; V is standard normal plus ``value_offset``.  Returns
    {"N": [...], accumulator: [relative error per N], ...}.  Fresh inputs per N from ``rng``.
    """
    out = {"N": list(seqlens), **{a: [] for a in accumulators}}
    for n in seqlens:
        q, k, v = testing.make_inputs(rng, heads_q=1, seqlen_q=queries, seqlen_k=n, head_dim=head_dim,
                                      dtype="float32")
        v = v + np.float32(value_offset)
        ref, _ = reference.attention(q, k, v)
        for a in accumulators:
            err = np.max(np.abs(attention_accumulating_in(q, k, v, a) - ref)) / np.max(np.abs(ref))
            out[a].append(float(err))
    return out


# --------------------------------------------------------------------------- not bitwise
def bitwise_differences(q, k, v, tiles=((16, 16), (64, 64), (64, 128)), backends=("naive",)) -> dict:
    """Run the same inputs through tiled attention at several tile sizes and other backends.

    Returns {"runs": {name: O}, "pairs": [(a, b, max |a - b|, share of elements not bitwise
    equal)], "checks": {name: Check against the oracle}} -- every run passes the accuracy
    check, yet almost no two agree bit for bit: the sums are grouped differently.
    """
    import iokernels as ik
    runs = {}
    for br, bc in tiles:
        runs[f"tiled {br}x{bc}"] = ik.attention(q, k, v, backend="tiled",
                                                config=TileConfig(block_q=br, block_k=bc, sram_bytes=1 << 22))
    for name in backends:
        runs[name] = ik.attention(q, k, v, backend=name)
    ref, _ = reference.attention(q, k, v)
    base = runs.get("naive", ik.attention(q, k, v, backend="naive"))
    checks = {n: testing.check(o, ref, base, name=n) for n, o in runs.items()}
    names = list(runs)
    pairs = [(a, b, float(np.max(np.abs(runs[a].astype(np.float64) - runs[b]))),
              float(np.mean(runs[a] != runs[b]))) for i, a in enumerate(names) for b in names[i + 1:]]
    return {"runs": runs, "pairs": pairs, "checks": checks}


# --------------------------------------------------------------------------- non-deterministic dQ
def dq_contributions(q, k, v, do, block_k: int, scale=None) -> list:
    """The terms dQ = sum_j scale * dS_:j K_j, one (Nq, d) float32 array per K/V tile j.

    One head, (Nq, d) / (Nk, d) arrays.  In the FA2 backward each term comes from a different
    thread block, which adds it into dQaccum in HBM with atomics, in whatever order the
    blocks finish.
    """
    f32 = np.float32
    scale = cv.resolve_scale(scale, q.shape[-1])
    o, lse = reference.attention(q[None, None], k[None, None], v[None, None], scale=scale)
    s = (q.astype(f32) @ k.astype(f32).T) * f32(scale)
    p = np.exp(s - lse[0, 0][:, None].astype(f32))
    dp = do.astype(f32) @ v.astype(f32).T
    D = np.sum(do.astype(f32) * o[0, 0].astype(f32), axis=1, keepdims=True)
    ds = p * (dp - D)
    return [f32(scale) * (ds[:, c0:c0 + block_k] @ k[c0:c0 + block_k].astype(f32))
            for c0 in range(0, k.shape[0], block_k)]


def accumulate_dq(parts, order=None) -> np.ndarray:
    """dQaccum: the float32 sum of ``parts`` added one by one in ``order`` (default: j = 0, 1, ...)."""
    order = range(len(parts)) if order is None else order
    acc = np.zeros_like(parts[0], dtype=np.float32)
    for j in order:                                           # dQaccum += term j (an atomic add)
        acc += parts[j]
    return acc


def deterministic_dq_cost(*, seqlen_q: int, seqlen_k: int, head_dim: int, block_k: int,
                          batch: int = 1, heads: int = 1, num_sms: int = H100_SMS) -> dict:
    """Memory and HBM bytes of dQ with atomics against FlashAttention-2's deterministic mode.

    Atomics: one float32 dQaccum (B x H x Nq x d), read-modified-written once per K/V tile,
    the Tc tiles of a head adding in whatever order their thread blocks finish.

    Deterministic (FlashAttention-2's ``deterministic=True``; code: ``mha_bwd`` in
    csrc/flash_attn/flash_api.cpp): the backward launches only ``splits`` =
    ceil(#SMs / (B x H)) thread blocks per head, each owning one dQaccum of its own and
    walking its share of the K/V tiles one after another (a fixed order); a last pass
    reads the ``splits`` accumulators back and adds them in a fixed order.  So the memory
    is ``splits`` accumulators (not one per K/V tile), the read-modify-write bytes are those
    of the atomic version, and the price is the extra pass and the lost parallelism: Tc
    thread blocks per head become ``splits`` (returned as ``blocks_per_head``).
    FlashAttention-3 keeps one accumulator and orders its atomic adds with semaphores
    instead (code: hopper/ in the same repository); that variant is not modelled here.
    """
    for name, val in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("head_dim", head_dim),
                      ("block_k", block_k), ("batch", batch), ("heads", heads), ("num_sms", num_sms)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {val!r}")
    tc = -(-seqlen_k // block_k)
    splits = -(-num_sms // (batch * heads))
    one = batch * heads * seqlen_q * head_dim * _F32
    rmw = 2 * tc * one                                                  # read + write per K/V tile
    return {"Tc": tc, "splits": splits,
            "atomic_memory": one, "atomic_bytes": rmw,
            "deterministic_memory": splits * one,                          # one dQaccum per split
            "deterministic_bytes": rmw + splits * one,                     # + the fixed-order sum reads them
            "blocks_per_head": {"atomic": tc, "deterministic": min(tc, splits)}}


# --------------------------------------------------------------------------- masks and biases
def bias_vs_score_mod(rng, seqlen: int = 256, head_dim: int = 32, heads: int = 2, docs: int = 4,
                      block: int = 32) -> dict:
    """ALiBi as a dense (B, H, N, N) bias in HBM and as a score_mod; a document mask's skipped tiles.

    Returns counted Traffic per variant ("score_mod", "dense bias", "document mask"), the
    extra bytes of the bias (exactly N*N*itemsize per head), the max difference between the
    two ALiBi outputs, and the block mask of the document mask (skipped tiles counted).
    """
    from . import tiled
    q, k, v = testing.make_inputs(rng, heads_q=heads, seqlen_q=seqlen, head_dim=head_dim, dtype="float32")
    cfg = TileConfig(block_q=block, block_k=block)
    mod = tiled.alibi(tiled.alibi_slopes(heads), seqlen, seqlen)
    idx = (np.arange(1)[:, None, None, None], np.arange(heads)[None, :, None, None],
           np.arange(seqlen)[:, None], np.arange(seqlen)[None, :])
    dense = mod(np.zeros((1, heads, seqlen, seqlen), np.float32), *idx).astype(np.float32)
    out = {}
    with count() as t_mod:
        o_mod, _ = tiled.forward_flex(q, k, v, score_mod=mod, config=cfg)
    with count() as t_bias:
        o_bias, _ = tiled.forward_flex(q, k, v, bias=dense, config=cfg)
    cuts = np.sort(rng.choice(np.arange(1, seqlen), size=docs - 1, replace=False))
    doc_ids = np.searchsorted(cuts, np.arange(seqlen), side="right")
    mask_mod = tiled.document_mask(doc_ids)
    bm = tiled.block_mask(mask_mod, batch=1, heads=heads, seqlen_q=seqlen, seqlen_k=seqlen, block_q=block,
                          block_k=block)
    with count() as t_doc:
        o_doc, _ = tiled.forward_flex(q, k, v, mask_mod=mask_mod, config=cfg, blocks=bm)
    ref_doc, _ = reference.attention(q, k, v, mask_mod=mask_mod)
    out.update(traffic={"score_mod": t_mod, "dense bias": t_bias, "document mask": t_doc},
               bias_bytes=t_bias.total - t_mod.total, alibi_difference=float(np.max(np.abs(o_mod - o_bias))),
               document_error=float(np.max(np.abs(o_doc - ref_doc))), blocks=bm, doc_ids=doc_ids)
    return out


# --------------------------------------------------------------------------- padding
def textbook_softmax(s) -> np.ndarray:
    """softmax(s) = exp(s - max) / sum, row-wise, as a textbook writes it (no masked-row rule).

    A row whose every entry is -inf gives max = -inf, s - max = NaN, and NaN everywhere:
    the failure that padded or fully masked rows cause in a careless kernel.
    """
    s = np.asarray(s, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


# --------------------------------------------------------------------------- varlen
def varlen_savings(seqlens, *, heads: int = 8, head_dim: int = 64, dtype: str = "float16") -> dict:
    """Packing sequences with cu_seqlens against padding them to the longest (no mask).

    Returns bytes (FA2 traffic model) and FLOPs (4 N_q N_k d per head) of both, and the
    share saved.  Padding attends over pad tokens too (and masks them out afterwards), so
    its cost is that of B sequences of the maximum length.
    """
    from .tiled import traffic_model_fa2, traffic_model_varlen
    lens = [int(n) for n in seqlens]
    longest = max(lens)
    packed = traffic_model_varlen(seqlens_q=lens, seqlens_k=lens, heads_q=heads, heads_kv=heads,
                                  head_dim=head_dim, dtype=dtype).total
    padded = traffic_model_fa2(batch=len(lens), heads_q=heads, heads_kv=heads, seqlen_q=longest,
                               seqlen_k=longest, head_dim=head_dim, dtype=dtype).total
    flops_packed = sum(rl.attention_flops(n, n, head_dim, heads=heads) for n in lens)
    flops_padded = rl.attention_flops(longest, longest, head_dim, batch=len(lens), heads=heads)
    return {"bytes_packed": packed, "bytes_padded": padded, "bytes_saved": 1 - packed / padded,
            "flops_packed": flops_packed, "flops_padded": flops_padded, "flops_saved": 1 - flops_packed / flops_padded}


def check_varlen_per_sequence(o, q, k, v, seqlens, *, causal: bool = False, baseline=None) -> list:
    """Check packed output ``o`` sequence by sequence against each sequence's own dense oracle.

    ``seqlens`` are the lengths the caller *meant* (not the cu_seqlens the kernel was given),
    so an off-by-one in cu_seqlens, which still passes the argument checks when the total is
    right, shows up as the sequences whose rows are wrong.  Returns one Check per sequence.
    """
    checks, start = [], 0
    for b, n in enumerate(int(x) for x in seqlens):
        rows = slice(start, start + n)
        ref, _ = reference.attention(q[rows].transpose(1, 0, 2)[None], k[rows].transpose(1, 0, 2)[None],
                                     v[rows].transpose(1, 0, 2)[None], causal=causal)
        base = None if baseline is None else baseline[rows].transpose(1, 0, 2)[None]
        checks.append(testing.check(o[rows].transpose(1, 0, 2)[None], ref, base, name=f"sequence {b} ({n} tokens)"))
        start += n
    return checks


# --------------------------------------------------------------------------- version churn
def accuracy_report(rng, backends=("naive", "tiled", "torch"), seqlen: int = 96, head_dim: int = 64,
                    quiet=contextlib.nullcontext) -> list:
    """For each backend that can run here: which kernel ran, the versions, and the 2x-rule check.

    float32 inputs, causal.  For "torch" the SDPA kernel that actually ran is read off the
    profiler (:func:`iokernels.torch_sdpa.backend_that_ran`), inside ``quiet()`` (a context
    manager: a notebook passes :func:`iokernels.viz.native_stderr_silenced` to hide the
    profiler's trace markers).  A row per backend: dict with backend, ran, check (or
    "unavailable: <reason>").
    """
    import iokernels as ik
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=seqlen, head_dim=head_dim, dtype="float32")
    ref, _ = reference.attention(q, k, v, causal=True)
    base = ik.attention(q, k, v, causal=True, backend="naive")
    rows = []
    for name in backends:
        try:
            if name == "torch":
                import torch
                from . import torch_sdpa as ts
                tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
                with quiet():
                    o, ran = ts.backend_that_ran(ik.attention, tq, tk, tv, causal=True, backend="torch")
                o, ran = o.numpy(), ", ".join(ran) or "?"
            else:
                o, ran = ik.attention(q, k, v, causal=True, backend=name), name
        except (ImportError, RuntimeError) as e:
            rows.append({"backend": name, "ran": f"unavailable: {e}", "check": None})
            continue
        rows.append({"backend": name, "ran": ran, "check": testing.check(o, ref, base, name=name)})
    return rows


def versions() -> dict:
    """The versions of the libraries whose changes move numbers or dispatch: record them with results."""
    import importlib.metadata as md
    out = {}
    for pkg in ("numpy", "torch", "numba", "numba-cuda", "cupy", "ml_dtypes", "iokernels"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


__all__ += ["versions"]
