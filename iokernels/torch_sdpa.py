"""The comparison backend: PyTorch's ``scaled_dot_product_attention`` (SDPA), used honestly.

SDPA is one function in front of several kernels.  On a CUDA GPU it dispatches among

=============  ===============================================================
name           what it is
=============  ===============================================================
"flash"        FlashAttention-2 (Dao, 2023), fp16/bf16 only
"efficient"    the memory-efficient kernel of the xFormers lineage (fp32 too)
"cudnn"        NVIDIA cuDNN's fused attention (Hopper: the fastest here)
"math"         the unfused reference: S = QK^T, softmax, PV, with S and P
               in memory -- the naive algorithm of step 1
=============  ===============================================================

and on a CPU between a CPU flash kernel and math.  ``torch.nn.attention.sdpa_kernel``
restricts the choice; when none of the allowed kernels accepts the inputs (fp32 for
"flash" and "cudnn", an explicit mask for "flash", ...), the default dispatcher quietly
takes the next one, down to "math" when no fused kernel accepts them (PyTorch's
sdp_utils.cpp, code, lists each kernel's constraints).  :func:`backend_that_ran` names the kernel that
really ran (from the profiler's operator names), :func:`backend_status` tries each one
forced on its own and reports "ok" or why it is unavailable.

The project's conventions (:mod:`iokernels.core.conventions`) and how this wrapper meets them:

====================  ==============================================================
convention            how
====================  ==============================================================
causal bottom-right   SDPA's ``is_causal`` is TOP-LEFT aligned (query i sees keys
                      j <= i).  Equal lengths: the two agree and ``is_causal`` is
                      used.  Nq != Nk: ``torch.nn.attention.bias.causal_lower_right``
                      (or an explicit mask when some rows see no key at all).
window (left, right)  an explicit boolean mask from :func:`conventions.mask` (flash
                      takes no mask and is skipped; efficient and cudnn take one, cudnn
                      only of the shapes sdp_utils.cpp's check_attn_mask_shape allows)
GQA                   ``enable_gqa=True`` (query head h reads kv head h // g)
fully masked row      output 0 and LSE -inf, whatever torch does (older versions
                      give NaN on the math path): such rows are given a harmless
                      mask, computed, then zeroed
LSE                   SDPA does not return it.  :func:`attention` computes it
                      separately with torch ops, logsumexp of the masked scaled
                      scores, in float32 (float64 for float64 inputs), a few query
                      rows at a time.  This costs an extra Q K^T: it is for
                      checking, never part of a timed call.
====================  ==============================================================

Arrays: NumPy in -> NumPy out (computed by CPU torch, copied in and out; bfloat16 via
ml_dtypes, bit-exact); torch in -> torch out on the same device, no copies.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .core import conventions as cv

#: our names -> torch.nn.attention.SDPBackend member names
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}

#: profiler operator name (prefix) -> which kernel ran.  These are the aten operators
#: SDPA dispatches to; they are stable across torch 2.x.
_OP_TO_BACKEND = (
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "flash"),   # the CPU flash kernel
    ("aten::_scaled_dot_product_flash_attention", "flash"),
    ("aten::_scaled_dot_product_efficient_attention", "efficient"),
    ("aten::_scaled_dot_product_cudnn_attention", "cudnn"),
    ("aten::_scaled_dot_product_attention_math", "math"),
    ("aten::_scaled_dot_product_fused_attention_overrideable", "overrideable"),
)

#: bound on the float32 score block materialized while computing the LSE (bytes)
LSE_BLOCK_BYTES = 256 * 1024 * 1024


def _torch():
    import torch
    return torch


# --------------------------------------------------------------------------- array plumbing
def _to_torch(x):
    """NumPy -> CPU torch tensor (bit-exact for bfloat16); torch tensors pass through."""
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x
    a = np.ascontiguousarray(x)
    if cv.dtype_name(a) == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_like(t, like):
    """Return ``t`` as the same kind of array as ``like`` (NumPy or torch)."""
    torch = _torch()
    if isinstance(like, torch.Tensor):
        return t
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        from .core.testing import numpy_dtype
        return t.contiguous().view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def _backend_enum(name):
    from torch.nn.attention import SDPBackend
    if isinstance(name, SDPBackend):
        return name
    if name not in SDPA_BACKENDS:
        raise ValueError(f"config: expected None or one of {', '.join(map(repr, SDPA_BACKENDS))} "
                         f"(the SDPA backend to force), got {name!r}")
    return getattr(SDPBackend, SDPA_BACKENDS[name])


@contextlib.contextmanager
def force(backend):
    """Allow only ``backend`` ("flash", "efficient", "cudnn", "math"); None allows all.

    Inside, SDPA either runs that kernel or raises RuntimeError ("No available kernel");
    it cannot fall back silently.
    """
    if backend is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([_backend_enum(backend)]):
        yield


# --------------------------------------------------------------------------- masks
def causal_masks(seqlen_q: int, seqlen_k: int):
    """The two causal conventions as boolean masks (True = may attend): (top_left, bottom_right).

    top-left (torch SDPA ``is_causal=True``): query i sees keys j <= i.
    bottom-right (FlashAttention >= 2.1, this project): query i sees j <= i + Nk - Nq, so
    the LAST query sees every key -- what a decoder wants when Nq new tokens follow
    Nk - Nq cached ones.  They agree only when Nq == Nk.
    """
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i, j <= i + (seqlen_k - seqlen_q)


def causal_alignment_demo(seqlen_q: int = 3, seqlen_k: int = 6, head_dim: int = 8, seed: int = 0):
    """Run SDPA's ``is_causal=True`` and this wrapper's causal on the same Nq != Nk inputs.

    Returns a dict with the inputs, both masks, both outputs (NumPy float64 CPU runs) and the largest
    difference, and whether SDPA's result equals attention under the top-left mask.  With
    Nq < Nk the top-left rule hides the cached keys from every new query: a silent bug.
    """
    torch = _torch()
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, seqlen_q, head_dim))
    k = rng.standard_normal((1, 1, seqlen_k, head_dim))
    v = rng.standard_normal((1, 1, seqlen_k, head_dim))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sdpa_top_left = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).numpy()
    ours, _ = attention(q, k, v, causal=True, scale=cv.default_scale(head_dim), window=(-1, -1))
    top_left, bottom_right = causal_masks(seqlen_q, seqlen_k)
    explicit_tl = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(top_left)).numpy()
    return {
        "q": q, "k": k, "v": v,
        "top_left_mask": top_left, "bottom_right_mask": bottom_right,
        "sdpa_is_causal": sdpa_top_left, "bottom_right": ours,
        "max_difference": float(np.max(np.abs(sdpa_top_left - ours))),
        "is_causal_is_top_left": bool(np.allclose(sdpa_top_left, explicit_tl, atol=1e-12)),
    }


def _mask_plan(seqlen_q, seqlen_k, causal, window):
    """How to express the visibility rule to SDPA.

    Returns (kind, mask, empty_rows): kind is "none", "is_causal", "lower_right" or
    "explicit"; mask is a boolean (Nq, Nk) NumPy array for "explicit" (with fully masked
    rows opened up, to be zeroed afterwards) else None; empty_rows a boolean (Nq,) array.
    """
    lo, hi = cv.key_range(np.arange(seqlen_q), seqlen_q, seqlen_k, causal, window)
    empty = hi <= lo
    has_window = tuple(window) != (-1, -1)
    if not causal and not has_window:
        return ("none", None, empty)
    if causal and not has_window and not empty.any():
        return ("is_causal" if seqlen_q == seqlen_k else "lower_right", None, empty)
    m = cv.mask(seqlen_q, seqlen_k, causal, window)
    m[empty] = True       # open fully masked rows (no NaN anywhere); zeroed after
    return ("explicit", m, empty)


def _sdpa_call(tq, tk, tv, plan, scale, enable_gqa):
    torch = _torch()
    F = torch.nn.functional
    kind, m, _ = plan
    kw = dict(scale=scale, enable_gqa=enable_gqa) if enable_gqa else dict(scale=scale)
    if kind == "none":
        return F.scaled_dot_product_attention(tq, tk, tv, **kw)
    if kind == "is_causal":
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, **kw)
    if kind == "lower_right":
        from torch.nn.attention.bias import causal_lower_right
        return F.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=causal_lower_right(tq.shape[-2], tk.shape[-2]), **kw)
    mask = torch.from_numpy(m).to(tq.device)
    return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, **kw)


# --------------------------------------------------------------------------- the LSE
def _lse(tq, tk, scale, causal, window):
    """LSE_i = log sum_j exp(scale * q_i . k_j) over visible keys, in float32 (float64).

    Computed a block of query rows at a time so the score block stays under
    LSE_BLOCK_BYTES.  Fully masked rows give -inf (logsumexp of an empty set).
    """
    torch = _torch()
    acc = torch.float64 if tq.dtype == torch.float64 else torch.float32
    B, Hq, Nq, d = tq.shape
    Hkv, Nk = tk.shape[1], tk.shape[2]
    k = tk.to(acc).repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else tk.to(acc)
    out = torch.empty((B, Hq, Nq), dtype=acc, device=tq.device)
    rows = max(1, LSE_BLOCK_BYTES // max(1, B * Hq * max(Nk, 1) * 4))
    for r0 in range(0, Nq, rows):                       # a block of query rows at a time
        r1 = min(Nq, r0 + rows)
        s = torch.matmul(tq[:, :, r0:r1].to(acc), k.transpose(-1, -2)) * scale
        vis = torch.from_numpy(cv.mask(Nq, Nk, causal, window, rows=(r0, r1))).to(tq.device)
        s = s.masked_fill(~vis, -math.inf)
        out[:, :, r0:r1] = torch.logsumexp(s, dim=-1)
    return out


# --------------------------------------------------------------------------- forward
def sdpa(q, k, v, *, causal=False, scale=None, window=(-1, -1), backend=None):
    """The bare SDPA call on torch tensors (no LSE, no conversions): what the benchmark times.

    ``backend`` forces one kernel (see :func:`force`); None lets SDPA choose.  Fully masked
    rows are zeroed.
    """
    torch = _torch()
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = cv.default_scale(d) if scale is None else float(scale)
    plan = _mask_plan(Nq, Nk, causal, cv.resolve_window(window))
    with force(backend):
        o = _sdpa_call(q, k, v, plan, scale, q.shape[1] != k.shape[1])
    empty = plan[2]
    if empty.any():
        o = o.masked_fill(torch.from_numpy(empty).to(o.device)[:, None], 0.0)
    return o


def attention(q, k, v, *, causal, scale, window, config=None):
    """Backend "torch": SDPA forward, returning (O, LSE) by the project's conventions.

    ``config``: None (SDPA picks) or "flash" | "efficient" | "cudnn" | "math" to force one;
    a forced kernel that cannot run raises RuntimeError rather than falling back.
    O comes from SDPA; the LSE is computed beside it with torch ops (see the module notes).
    """
    if config is not None:
        _backend_enum(config)           # a bad name fails before any work
    tq, tk, tv = _to_torch(q), _to_torch(k), _to_torch(v)
    o = sdpa(tq, tk, tv, causal=causal, scale=scale, window=window, backend=config)
    lse = _lse(tq, tk, scale, causal, window)
    return _to_like(o, q), _to_like(lse.float() if lse.dtype != _torch().float64 else lse, q)


def decode(q, k, v, *, seq_lens, num_splits, scale, config=None):
    """One query token per sequence: SDPA with Nq = 1; ragged lengths via a key mask.

    ``num_splits`` is accepted and ignored: SDPA's kernels choose their own split of the
    keys (FlashAttention's split-KV heuristic) and offer no way to set it.  ``config``: a
    backend name to force (as for :func:`attention`), or None.
    """
    torch = _torch()
    if config is not None:
        _backend_enum(config)           # a bad name fails before any work
    tq, tk, tv = _to_torch(q), _to_torch(k), _to_torch(v)
    B, Hq, d = tq.shape
    Hkv, N = tk.shape[1], tk.shape[2]
    q4 = tq[:, :, None, :]
    sdpa_ctx = force(config) if config is not None else contextlib.nullcontext()
    acc = torch.float64 if tq.dtype == torch.float64 else torch.float32
    kw = dict(scale=scale, enable_gqa=True) if Hq != Hkv else dict(scale=scale)
    if seq_lens is None:
        lens = np.full(B, N)
        with sdpa_ctx:
            o = torch.nn.functional.scaled_dot_product_attention(q4, tk, tv, **kw)
    else:
        lens = np.asarray(seq_lens, dtype=np.int64)
        vis = np.arange(N)[None, :] < lens[:, None]                   # (B, N)
        vis[lens == 0] = True                                         # opened, zeroed below
        mask = torch.from_numpy(vis[:, None, None, :]).to(tq.device)  # (B, 1, 1, N)
        with sdpa_ctx:
            o = torch.nn.functional.scaled_dot_product_attention(q4, tk, tv, attn_mask=mask, **kw)
    o = o[:, :, 0, :]
    kx = tk.to(acc).repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else tk.to(acc)
    s = torch.einsum("bhd,bhnd->bhn", tq.to(acc), kx) * scale
    keymask = torch.from_numpy(np.arange(N)[None, :] < lens[:, None]).to(tq.device)[:, None, :]
    lse = torch.logsumexp(s.masked_fill(~keymask, -math.inf), dim=-1)
    empty = torch.from_numpy(lens == 0).to(tq.device)
    if bool(empty.any()):
        o = o.masked_fill(empty[:, None, None], 0.0)
    return _to_like(o, q), _to_like(lse, q)


def attention_backward(do, q, k, v, o, lse, *, causal, scale, window, config=None):
    """Gradients through autograd of SDPA (the forward is re-run; ``o`` and ``lse`` unused).

    dK and dV come out summed over each GQA group, as the oracle's.  Fully masked rows
    contribute nothing (their dO is zeroed, which is what a zero output implies).
    """
    torch = _torch()
    if config is not None:
        _backend_enum(config)
    tq, tk, tv, tdo = (_to_torch(x).detach().clone().requires_grad_(i < 3)
                       for i, x in enumerate((q, k, v, do)))
    Nq, Nk = tq.shape[-2], tk.shape[-2]
    empty = _mask_plan(Nq, Nk, causal, cv.resolve_window(window))[2]
    with torch.enable_grad():
        out = sdpa(tq, tk, tv, causal=causal, scale=scale, window=window, backend=config)
        g = tdo.detach()
        if empty.any():
            g = g.masked_fill(torch.from_numpy(empty).to(g.device)[:, None], 0.0)
        dq, dk, dv = torch.autograd.grad(out, (tq, tk, tv), grad_outputs=g)
    return _to_like(dq, q), _to_like(dk, q), _to_like(dv, q)


# --------------------------------------------------------------------------- which kernel ran
def backend_that_ran(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` under the profiler; return (result, names of SDPA kernels run).

    The names are from :data:`SDPA_BACKENDS` ("flash", "efficient", "cudnn", "math"),
    read off the aten operators the dispatcher called -- the ground truth for "did the
    kernel I asked for run?".  An empty list means no SDPA call happened.
    """
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn(*args, **kwargs)
    ran = []
    for evt in prof.events():
        for prefix, name in _OP_TO_BACKEND:
            if evt.name == prefix or evt.name.startswith(prefix + "."):
                if name not in ran:
                    ran.append(name)
                break
    return result, ran


def backend_status(q, k, v, *, causal=False, scale=None, window=(-1, -1), backends=None):
    """For each SDPA kernel forced on its own: "ok", or "unavailable: <torch's reason>".

    Also reports which kernel SDPA's default dispatch picks (key "default"), so a silent
    fall-back (default = "math" while a fused kernel was expected) is visible.
    """
    backends = list(SDPA_BACKENDS) if backends is None else list(backends)
    status = {}
    for name in backends:
        try:
            sdpa(q, k, v, causal=causal, scale=scale, window=window, backend=name)
            status[name] = "ok"
        except RuntimeError as e:
            status[name] = "unavailable: " + _first_line(e)
    _, ran = backend_that_ran(sdpa, q, k, v, causal=causal, scale=scale, window=window)
    status["default"] = ran[0] if ran else "unknown"
    return status


def _first_line(err) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


# --------------------------------------------------------------------------- naive, in torch
def naive_attention(q, k, v, *, causal=False, scale=None, window=(-1, -1)):
    """Step 1 in torch: S = scale QK^T and P = softmax(S) materialized, in q's dtype.

    The baseline the fused kernels are measured against: it writes and reads the N x N
    matrices S and P (Nq * Nk elements per head each), so its peak memory grows as N^2.
    GQA is done by copying K and V to every query head (repeat_interleave).  Fully
    masked rows give 0 (not NaN).
    """
    torch = _torch()
    Hq, Hkv = q.shape[1], k.shape[1]
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = cv.default_scale(d) if scale is None else float(scale)
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)                 # read/write Hq/Hkv copies of K
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    # scale folded into Q (an Nq*d pass) so that S is written once and read once
    s = torch.matmul(q * scale, k.transpose(-1, -2))               # read Nq*d + Nk*d; write Nq*Nk
    window = cv.resolve_window(window)
    if causal or window != (-1, -1):
        vis = torch.from_numpy(cv.mask(Nq, Nk, causal, window)).to(q.device)
        s = s.masked_fill(~vis, -math.inf)                          # read Nq*Nk; write Nq*Nk
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)                # read Nq*Nk; write Nq*Nk
    else:
        p = torch.softmax(s, dim=-1)                                # read Nq*Nk; write Nq*Nk
    return torch.matmul(p, v)                                       # read Nq*Nk + Nk*d; write Nq*d




def naive_backward(do, q, k, v, o, lse, *, causal=False, scale=None, window=(-1, -1)):
    """The naive backward (:func:`iokernels.backward.attention_backward_naive`) in torch, on any device.

    The baseline of the gradient rule on a GPU: the same algorithm and the same roundings as
    the NumPy version, from the same saved O and LSE.  P = exp(S - LSE), dP and dS are
    materialized, N_q x N_k each, in q's dtype; products and sums run in float32 (float64
    for float64 inputs) without TF32; dQ, dK, dV come back in q's dtype, dK and dV summed
    over each GQA group one head at a time in q's dtype.  Rows whose LSE is -inf (fully
    masked) get P = 0.
    """
    torch = _torch()
    st = q.dtype
    acc = torch.float64 if st == torch.float64 else torch.float32
    Hq, Hkv = q.shape[1], k.shape[1]
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = cv.default_scale(d) if scale is None else float(scale)
    g = Hq // Hkv
    q, k, v, do, o = (x.to(acc) for x in (q, k, v, do, o))
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    lse = lse.to(acc)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)[..., None]
    vis = torch.from_numpy(cv.mask(Nq, Nk, causal, cv.resolve_window(window))).to(q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        D = (do * o).sum(-1, keepdim=True)                                  # kernel 0
        s = torch.matmul(q, k.transpose(-1, -2)) * scale                   # kernel 1: P, rebuilt
        p = torch.where(vis, torch.exp(s.masked_fill(~vis, -math.inf) - lse), 0.0).to(st).to(acc)
        dv = torch.matmul(p.transpose(-1, -2), do)                          # kernel 2: dV = P^T dO
        dp = torch.matmul(do, v.transpose(-1, -2)).to(st).to(acc)           # kernel 3: dP = dO V^T
        ds = (p * (dp - D)).to(st).to(acc)                                  # kernel 4: dS
        dq = torch.matmul(ds, k) * scale                                    # kernel 5: dQ = scale dS K
        dk = torch.matmul(ds.transpose(-1, -2), q) * scale                  # kernel 6: dK = scale dS^T Q
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    B = q.shape[0]
    sums = []
    for x in (dk, dv):                   # GQA group sums, each head's share added in q's dtype
        x = x.reshape(B, Hkv, g, Nk, d)
        total = x[:, :, 0].to(st)
        for h in range(1, g):
            total = (total.to(acc) + x[:, :, h]).to(st)
        sums.append(total)
    return dq.to(st), sums[0], sums[1]

def plot_causal_alignment(demo: dict, axes=None):
    """The two causal masks of :func:`causal_alignment_demo` side by side (rows: queries)."""
    import matplotlib.pyplot as plt
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(8, 2.6))
    nq, nk = demo["top_left_mask"].shape
    for ax, key, title in ((axes[0], "top_left_mask", "torch is_causal=True: top-left"),
                           (axes[1], "bottom_right_mask", "this project / FlashAttention 2.1+: bottom-right")):
        ax.imshow(demo[key], cmap="Greens", vmin=0, vmax=1.3)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"key j (Nk = {nk})")
        ax.set_ylabel(f"query i (Nq = {nq})")
        ax.set_xticks(range(nk))
        ax.set_yticks(range(nq))
    return axes


# --------------------------------------------------------------------------- MLA decode in torch
def mla_decode_matmul(q, kv, *, latent_dim=512, seq_lens=None, scale=None):
    """MLA decode in its absorbed form with torch matmuls: the baseline of the MLA kernels.

    q (B, Hq, d_c + d_R) absorbed queries, kv (B, N, d_c + d_R) latent rows; returns
    (O (B, Hq, d_c) in q's dtype, LSE (B, Hq) float32).  S = (scale q) kv^T is one batched
    matmul in q's dtype (the tensor cores; S rounded to that dtype, as the naive algorithm of
    step 1 in the same precision), the softmax runs in float32 (float64 for float64 inputs),
    P is rounded back and O = P kv[..., :d_c] is the second matmul: S and P (B * Hq * N values
    each) go through HBM.  Rows at or past seq_lens[b] are masked; a sequence with no rows gives O = 0 and
    LSE = -inf.  ``scale`` None: DeepSeek-V3's 1 / sqrt(d_h + d_R).
    """
    from .mla import DEEPSEEK_V3_MLA, default_scale
    torch = _torch()
    tq, tkv = _to_torch(q), _to_torch(kv)
    if scale is None:
        scale = default_scale(DEEPSEEK_V3_MLA["head_dim"], DEEPSEEK_V3_MLA["rope_dim"])
    s = torch.matmul(tq * scale, tkv.transpose(-1, -2))            # read Hq*row + N*row; write Hq*N
    if seq_lens is not None:
        lens = torch.as_tensor(np.asarray(seq_lens), device=tq.device)
        past = torch.arange(tkv.shape[1], device=tq.device)[None, None, :] >= lens[:, None, None]
        s = s.masked_fill(past, -math.inf)                           # read Hq*N; write Hq*N
    sf = s.to(torch.float64 if tq.dtype == torch.float64 else torch.float32)   # the accumulator dtype
    lse = torch.logsumexp(sf, dim=-1)                                # read Hq*N
    p = torch.softmax(sf, dim=-1).nan_to_num(0.0).to(tq.dtype)       # read Hq*N; write Hq*N
    o = torch.matmul(p, tkv[..., :latent_dim])                       # read Hq*N + N*d_c; write Hq*d_c
    return _to_like(o, q), _to_like(lse, q)


def mla_decode_sdpa(q, kv, *, latent_dim=512, scale=None):
    """MLA decode through SDPA: the Hq heads of one sequence as Hq query rows of ONE head.

    q (B, Hq, d_c + d_R), kv (B, N, d_c + d_R), every sequence N rows long.  With the shared
    row there is one KV head, so the heads can be laid out as the query axis of a prefill
    call: q (B, 1, Hq, row), K = kv (B, 1, N, row), V = its first d_c columns (a view).
    SDPA's dispatcher picks a kernel for key width d_c + d_R and value width d_c (the flash
    and cuDNN kernels take at most 256, so it is one of the others).  Returns O (B, Hq, d_c).
    """
    from .mla import DEEPSEEK_V3_MLA, default_scale
    torch = _torch()
    tq, tkv = _to_torch(q), _to_torch(kv)
    if scale is None:
        scale = default_scale(DEEPSEEK_V3_MLA["head_dim"], DEEPSEEK_V3_MLA["rope_dim"])
    o = torch.nn.functional.scaled_dot_product_attention(tq[:, None], tkv[:, None], tkv[:, None, :, :latent_dim],
                                                         scale=scale)
    return _to_like(o[:, 0], q)
