"""The Numba kernels at real sizes on a GPU (skipped without one): N up to 8192, d 64 and
128, B*H filling the GPU.  The float64 oracle and the same-precision naive baseline (the
2x rule) are computed with torch on the device, on a few (b, h) slices, because the N x N
float64 matrices of every head would not fit.  Speed is not tested here: see the benchmark.
"""

import numpy as np
import pytest

from iokernels import conventions as cv
from iokernels import gpu, testing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu.simulator_enabled() or not gpu.torch_gpu(),
                                 reason="needs a CUDA GPU with torch (and the simulator off)")]


def _torch():
    import torch
    return torch


def _ref_slice(q, k, v, b, h, causal, window, scale, dtype):
    """(o, lse) of one (b, h) in ``dtype`` (float64: the oracle; low precision: naive)."""
    torch = _torch()
    Hq, Hkv = q.shape[1], k.shape[1]
    hk = h // (Hq // Hkv)
    qs, ks, vs = (x.to(dtype) for x in (q[b, h], k[b, hk], v[b, hk]))
    Nq, Nk = qs.shape[0], ks.shape[0]
    lo, hi = cv.key_range(np.arange(Nq), Nq, Nk, causal, window)
    j = torch.arange(Nk, device=q.device)[None, :]
    vis = (j >= torch.as_tensor(lo, device=q.device)[:, None]) & (j < torch.as_tensor(hi, device=q.device)[:, None])
    s = (qs @ ks.T) * scale
    s = s.masked_fill(~vis, float("-inf"))
    m = s.amax(dim=1, keepdim=True)
    empty = torch.isinf(m)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    l = p.sum(dim=1, keepdim=True)
    o = (p @ vs) / torch.where(empty, torch.ones_like(l), l)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(l))[:, 0]
    return o, lse


def _check_slices(q, k, v, o, lse, causal, window, slices):
    torch = _torch()
    d = q.shape[-1]
    scale = d ** -0.5
    dt = q.dtype
    for b, h in slices:
        ro, rl = _ref_slice(q, k, v, b, h, causal, window, scale, torch.float64)
        bo, bl = _ref_slice(q, k, v, b, h, causal, window, scale, dt)
        name = str(dt).replace("torch.", "")
        testing.assert_close(o[b, h], ro.cpu().numpy(), bo.to(dt), dtype=name)
        acc = "float64" if name == "float64" else "float32"          # the LSE's accumulator dtype
        testing.assert_close(lse[b, h], rl.cpu().numpy(), bl.to(getattr(torch, acc)), dtype=acc, name="lse")


@pytest.mark.parametrize("version,B,H,Hkv,N,d,dtype,causal,window", [
    ("v3", 8, 16, 16, 8192, 128, "float32", True, None),
    ("v4", 8, 16, 16, 8192, 128, "float32", True, None),
    ("v4", 2, 16, 4, 4097, 128, "float16", True, (500, 0)),
    ("v5", 8, 16, 16, 8192, 128, "float32", True, None),
    ("v5", 2, 16, 4, 4097, 128, "float16", True, (500, 0)),
    ("v5", 2, 8, 2, 2049, 256, "float32", False, None),
    ("v5", 1, 4, 4, 1031, 59, "float32", True, None),
    ("v6", 8, 16, 16, 8192, 128, "float32", True, None),
    ("v6", 2, 16, 4, 4097, 128, "float16", True, (500, 0)),
    ("v6", 2, 8, 2, 2049, 256, "float32", False, None),
    ("v6", 1, 4, 4, 1031, 59, "float32", True, None),
    ("v6", 1, 4, 2, 1031, 64, "float64", False, None),
    ("v7", 8, 16, 16, 8192, 128, "float32", True, None),
    ("v7", 2, 16, 4, 4097, 128, "float16", True, (500, 0)),
    ("v7", 2, 8, 2, 2049, 256, "float32", False, None),
    ("v7", 1, 4, 4, 1031, 59, "float32", True, None),
    ("v7", 1, 4, 2, 1031, 64, "float64", False, None),
    ("v3", 4, 32, 8, 8192, 64, "float16", False, None),
    ("v3", 2, 16, 4, 4097, 128, "float16", True, (500, 0)),
    ("v2", 2, 8, 8, 4096, 128, "float32", False, (1000, 1000)),
    ("v2", 2, 8, 2, 2049, 64, "float16", True, None),
    ("v1", 1, 4, 4, 1031, 59, "float32", True, None),
])
def test_forward_real_sizes(version, B, H, Hkv, N, d, dtype, causal, window):
    torch = _torch()
    import iokernels as ik
    from iokernels.numba_cuda import ForwardConfig
    g = torch.Generator(device="cuda").manual_seed(N + d + int(version[1:]))
    tdt = getattr(torch, dtype)
    q = torch.randn((B, H, N, d), device="cuda", generator=g).to(tdt)
    k = torch.randn((B, Hkv, N, d), device="cuda", generator=g).to(tdt)
    v = torch.randn((B, Hkv, N, d), device="cuda", generator=g).to(tdt)
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="numba",
                          config=ForwardConfig(version=version), return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == tdt
    assert lse.dtype == (torch.float64 if dtype == "float64" else torch.float32)
    _check_slices(q, k, v, o, lse, causal, window, [(0, 0), (B - 1, H - 1)])


def test_forward_v7_chunk_copy_matches_its_element_copy():
    """v7 reads a C-contiguous, 16-byte aligned K/V in 16-byte chunks and a K/V that starts 2
    bytes past a boundary (a torch slice) or has strided rows element by element: the same bits."""
    torch = _torch()
    import iokernels as ik
    from iokernels.numba_cuda import ForwardConfig, forward_v7
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn((2, 8, 700, 128), device="cuda", generator=g).half()
    k = torch.randn((2, 2, 900, 128), device="cuda", generator=g).half()
    v = torch.randn((2, 2, 900, 128), device="cuda", generator=g).half()
    flat = torch.empty(k.numel() + 1, device="cuda", dtype=k.dtype)
    k_off = flat[1:].view(k.shape)                                     # 2 bytes past a 16-byte boundary
    k_off.copy_(k)
    v_str = torch.empty(v.shape[:-1] + (2 * v.shape[-1],), device="cuda", dtype=v.dtype)[..., ::2]
    v_str.copy_(v)                                                     # rows strided: every other value
    assert forward_v7.chunk_reason(k, 128, "k") is None
    assert "16-byte boundary" in forward_v7.chunk_reason(k_off, 128, "k")
    assert "not C-contiguous" in forward_v7.chunk_reason(v_str, 128, "v")
    cfg = ForwardConfig(version="v7")
    o, lse = ik.attention(q, k, v, causal=True, backend="numba", config=cfg, return_lse=True)
    o2, lse2 = ik.attention(q, k_off, v_str, causal=True, backend="numba", config=cfg, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    _check_slices(q, k, v, o, lse, True, None, [(0, 0), (1, 7)])


def test_forward_nq_ne_nk_fully_masked_rows():
    torch = _torch()
    import iokernels as ik
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn((2, 8, 700, 128), device="cuda", generator=g)
    k = torch.randn((2, 4, 333, 128), device="cuda", generator=g)
    v = torch.randn((2, 4, 333, 128), device="cuda", generator=g)
    o, lse = ik.attention(q, k, v, causal=True, backend="numba", return_lse=True)
    assert torch.isneginf(lse[:, :, :367]).all() and (o[:, :, :367] == 0).all()
    _check_slices(q, k, v, o, lse, True, None, [(0, 0), (1, 7)])


def _versions(op):
    """A config per registered version of ``op`` (and, for decode, v2's 32-lane tiling, a
    tuning point of the sweep that takes v2's other code path)."""
    import iokernels.numba_cuda as nc
    out = [k.config_class(version=k.version) for k in nc.REGISTRY.kernels(op)]
    if op == "decode":
        out.append(nc.DecodeConfig(version="v2", lanes_per_key=32, keys_per_iter=8))
    return out


ON_GPU = gpu.torch_gpu() and not gpu.simulator_enabled()
DECODE_VERSIONS = _versions("decode") if ON_GPU else []
GATHER_VERSIONS = _versions("paged_gather") if ON_GPU else []


@pytest.mark.parametrize("B,Hq,Hkv,N,d,dtype", [(1, 32, 8, 32768, 128, "float16"),
                                                 (4, 16, 16, 8191, 64, "float32")])
def test_decode_real_sizes(B, Hq, Hkv, N, d, dtype):
    torch = _torch()
    import iokernels as ik
    from iokernels import reference
    from iokernels.bench import device_pages
    g = torch.Generator(device="cuda").manual_seed(N)
    tdt = getattr(torch, dtype)
    q = torch.randn((B, Hq, d), device="cuda", generator=g).to(tdt)
    k = torch.randn((B, Hkv, N, d), device="cuda", generator=g).to(tdt)
    v = torch.randn((B, Hkv, N, d), device="cuda", generator=g).to(tdt)
    from iokernels.numba_cuda import decode
    lens = np.array([N - 17 * b for b in range(B)], np.int32)
    ro, rl = reference.decode(q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), seq_lens=lens)
    qn, kn, vn = (x.cpu().numpy() for x in (q, k, v))
    bo, bl = ik.decode(qn, kn, vn, seq_lens=lens, backend="naive", return_lse=True)
    o, lse = ik.decode(q, k, v, seq_lens=lens, backend="numba", return_lse=True)   # the default version
    testing.assert_close(o, ro, bo)
    testing.assert_close(lse, rl, bl, name="lse")
    for cfg in DECODE_VERSIONS:                      # every registered version
        o, lse = decode(q, k, v, seq_lens=lens, config=cfg)
        testing.assert_close(o, ro, bo)
        testing.assert_close(lse, rl, bl, name="lse")
    if N % 16 == 0:
        from iokernels.numba_cuda import paged_decode_pools, gather_pools
        kp, vp, tables, plens = device_pages(k, v, seed=1)
        ro, rl = reference.decode(qn, kn, vn)
        bo, bl = ik.decode(qn, kn, vn, backend="naive", return_lse=True)
        for cfg in DECODE_VERSIONS:
            po, pl = paged_decode_pools(q, kp, vp, tables, plens, config=cfg)
            testing.assert_close(po, ro, bo)
            testing.assert_close(pl, rl, bl, name="lse")
        for cfg in GATHER_VERSIONS:
            kg, vg = gather_pools(kp, vp, tables[B - 1], N, config=cfg)
            assert torch.equal(kg, k[B - 1]) and torch.equal(vg, v[B - 1])


def test_cupy_arrays_in_cupy_out():
    cp = pytest.importorskip("cupy")
    import iokernels as ik
    rng = np.random.default_rng(0)
    q, k, v = testing.make_inputs(rng, batch=1, heads_q=2, seqlen_q=300, seqlen_k=301, head_dim=64,
                                  dtype="float32")
    o = ik.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=True, backend="numba")
    assert isinstance(o, cp.ndarray)
    ref, _ = __import__("iokernels.core.reference", fromlist=["x"]).attention(q, k, v, causal=True)
    testing.assert_close(o.get(), ref, ik.attention(q, k, v, causal=True, backend="naive"))


def test_decode_v2_and_gathers_misaligned_and_ragged_rows():
    """v2 (and the gathers) view K/V as 8-byte words only when they may: a tensor starting 2
    bytes past an 8-byte boundary, and rows of 59 halves, take the one-element-a-word path."""
    torch = _torch()
    from iokernels import reference
    from iokernels.numba_cuda import DecodeConfig, decode, gather_pools
    g = torch.Generator(device="cuda").manual_seed(5)
    B, Hq, Hkv, N = 2, 8, 2, 1000
    for d in (64, 59):
        shape = (B, Hkv, N, d)
        n = int(np.prod(shape))
        k = torch.randn(n + 1, device="cuda", generator=g).half()[1:].view(shape)   # misaligned by 2 B
        v = torch.randn(shape, device="cuda", generator=g).half()
        q = torch.randn((B, Hq, d), device="cuda", generator=g).half()
        lens = np.array([N, 333], np.int32)
        qn, kn, vn = (x.cpu().numpy() for x in (q, k, v))
        ro, rl = reference.decode(qn, kn, vn, seq_lens=lens)
        bo, bl = __import__("iokernels").decode(qn, kn, vn, seq_lens=lens, backend="naive", return_lse=True)
        o, lse = decode(q, k, v, seq_lens=lens, config=DecodeConfig(version="v2"))
        testing.assert_close(o, ro, bo)
        testing.assert_close(lse, rl, bl, name="lse")
        pool = torch.randn((40, 16, Hkv, d), device="cuda", generator=g).half()
        table = np.random.default_rng(d).permutation(40)[:37].astype(np.int32)
        want = pool[torch.as_tensor(table, device="cuda").long()].reshape(37 * 16, Hkv, d)[:587].permute(1, 0, 2)
        for cfg in GATHER_VERSIONS:
            kg, vg = gather_pools(pool, pool, table, 587, config=cfg)
            assert torch.equal(kg, want) and torch.equal(vg, want)


def test_sanitize_cases_pass():
    """Every registered (op, version) runs its ragged cases and matches the oracle (each case
    asserts its own error)."""
    from iokernels.numba_cuda import REGISTRY, sanitize_cases
    names = [name for name, _ in sanitize_cases(verbose=False)]
    assert len(names) == len(set(names))
    for kern in REGISTRY:
        assert any(n.startswith(f"{kern.op} {kern.version}") for n in names), kern.name


def test_kernels_run_on_the_callers_stream_without_host_sync():
    """Inputs made on a side stream and read right away: the kernels must launch on that
    stream (the wrapper no longer makes the host wait for it), so the result is right and
    the outputs are ready once that stream is synchronized."""
    torch = _torch()
    import iokernels as ik
    from iokernels.numba_cuda import launch as ln
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g = torch.Generator(device="cuda").manual_seed(11)
        q = torch.randn((2, 8, 1000, 64), device="cuda", generator=g)
        k = torch.randn((2, 4, 1100, 64), device="cuda", generator=g)
        v = torch.randn((2, 4, 1100, 64), device="cuda", generator=g)
        handle = ln.stream(ln.call_for(q)).handle          # a ctypes or a cuda-python handle
        assert (handle.value if hasattr(handle, "value") else int(handle)) == side.cuda_stream
        o, lse = ik.attention(q, k, v, causal=True, backend="numba", return_lse=True)
        qd = torch.randn((3, 8, 64), device="cuda", generator=g, dtype=torch.float16)
        kd = torch.randn((3, 2, 3000, 64), device="cuda", generator=g, dtype=torch.float16)
        vd = torch.randn((3, 2, 3000, 64), device="cuda", generator=g, dtype=torch.float16)
        od, lsed = ik.decode(qd, kd, vd, backend="numba", return_lse=True)
    side.synchronize()
    _check_slices(q, k, v, o, lse, True, None, [(0, 0), (1, 7)])
    ref = torch.softmax((qd.double().view(3, 2, 4, 64) @ kd.double().transpose(-1, -2)) * 64 ** -0.5, -1) \
        @ vd.double()
    naive = torch.softmax((qd.view(3, 2, 4, 64) @ kd.transpose(-1, -2)) * 64 ** -0.5, -1) @ vd
    testing.assert_close(od, ref.reshape(3, 8, 64).cpu().numpy(), naive.reshape(3, 8, 64), dtype="float16")
    assert lsed.dtype == torch.float32 and torch.isfinite(lsed).all()
