"""The Hopper kernels held to FlashAttention's 2x rule against the float64 oracle (on a GPU)."""
from __future__ import annotations

import math

import numpy as np

from ...core import conventions as cv
from ...core.arrays import Call
from ..launch import on_stream
from .attention import _check_attention_inputs, launch_attention
from .gemm import gemm


#: the oracle (float64 NumPy, on the host) sees at most this many query rows at each end of a
#: long sequence: the last rows (every key, the diagonal's end) and the first (the mask's start)
ORACLE_ROWS = 128


def _baseline(q, k, v, causal, window):
    """Naive attention in q's precision on the GPU (O), and its LSE from the same rounded S."""
    import torch
    from ...torch_sdpa import naive_attention
    o = naive_attention(q, k, v, causal=causal, window=window if window is not None else (-1, -1))
    Hq, Hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else k
    s = torch.matmul(q * cv.default_scale(q.shape[-1]), kk.transpose(-1, -2))
    vis = torch.from_numpy(cv.mask(q.shape[2], k.shape[2], causal, window)).to(q.device)
    return o, torch.logsumexp(s.float().masked_fill(~vis, -math.inf), dim=-1)


def oracle_check(q, k, v, *, causal, window=None, config=None):
    """Run one version on torch CUDA tensors into NaN-poisoned outputs and hold it to
    FlashAttention's 2x rule against the float64 oracle: a list of Checks (O, LSE per slice)."""
    import torch
    from ...core import reference
    from ...core.testing import as_numpy, check
    info, scale, win, cfg = _check_attention_inputs(q, k, v, causal, None, window, config)
    B, Hq, Nq, d = q.shape
    Nk = k.shape[2]
    o = torch.full((B, Hq, Nq, d), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32, device=q.device)
    with on_stream(Call(q).stream_ptr()):
        launch_attention(q, k, v, o, lse, dtype=info["dtype"], scale=scale, window=win, config=cfg)
    torch.cuda.synchronize()
    checks = []
    for name, x in (("O", o), ("LSE", lse)):
        if torch.isnan(x).any():
            from ...core.testing import Check
            checks.append(Check(f"{name} all rows", float("inf"), 0.0, None, False, "; unwritten or NaN"))
    R = ORACLE_ROWS
    slices = [(0, Nq, 0, Nk)] if Nq <= 2 * R else [(Nq - R, Nq, 0, Nk)]
    if Nq > 2 * R and window is None:
        # the first R rows: with a bottom-right causal mask they see keys [0, R + Nk - Nq)
        hi = R + Nk - Nq if causal else Nk
        if hi > 0:
            slices.append((0, R, 0, hi))
    for r0, r1, c0, c1 in slices:
        qs, ks, vs = q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1]
        ref_o, ref_l = reference.attention(as_numpy(qs), as_numpy(ks), as_numpy(vs), causal=causal, window=window)
        bo, bl = _baseline(qs, ks, vs, causal, window)
        masked = ~np.isfinite(ref_l)[..., None]
        checks.append(check(o[:, :, r0:r1], ref_o, bo, dtype=info["dtype"], name=f"O rows {r0}:{r1}",
                            masked_rows=masked))
        checks.append(check(lse[:, :, r0:r1], ref_l, bl, dtype=info["dtype"], name=f"LSE rows {r0}:{r1}"))
    return checks


def gemm_check(a, b):
    """gemm(a, b) against the float64 product, by the 2x rule against torch.matmul in a's dtype."""
    import torch
    from ...core.testing import check
    ref = torch.matmul(a.double(), b.double())
    c = gemm(a, b)
    torch.cuda.synchronize()
    name = cv.dtype_name(a)
    return check(c.float().cpu().numpy(), ref.cpu().numpy(), torch.matmul(a, b).float().cpu().numpy(),
                 dtype=name, name=f"C {tuple(a.shape)}x{tuple(b.shape)}")
