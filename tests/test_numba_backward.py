"""The Numba backward (FlashAttention-2's structure) against the float64 oracle, on the simulator
or a GPU: float64 exact, low precision by the 3x gradient rule, GQA, masks, determinism."""
import numpy as np
import pytest

from iokernels.core import gpu, reference, testing

pytest.importorskip("numba")
nb = pytest.importorskip("iokernels.numba_cuda.backward")

import iokernels as ik  # noqa: E402

SIM = gpu.simulator_enabled()
needs_numba_device = pytest.mark.skipif(not (SIM or gpu.has_gpu()), reason="no GPU and no Numba simulator")


def _problem(rng, dtype, B=1, Hq=2, Hkv=1, Nq=7, Nk=11, d=8, causal=False, window=None):
    q, k, v = testing.make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk,
                                  head_dim=d, dtype=dtype)
    do = testing.make_inputs(rng, batch=B, heads_q=Hq, seqlen_q=Nq, head_dim=d, dtype=dtype)[0]
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="tiled", return_lse=True)
    return do, q, k, v, o, lse


def _run(args, causal=False, window=None, config=None):
    do, q, k, v, o, lse = args
    scale = q.shape[-1] ** -0.5
    return nb.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                 window=(-1, -1) if window is None else window, config=config)


@needs_numba_device
@pytest.mark.parametrize("causal,window,shape", [
    (False, None, dict(Nq=7, Nk=11)), (True, None, dict(Nq=11, Nk=7)), (True, None, dict(Nq=5, Nk=13)),
    (False, (3, 1), dict(Nq=9, Nk=9))])
def test_float64_matches_the_oracle(rng, causal, window, shape):
    args = _problem(rng, "float64", causal=causal, window=window, **shape)
    got = _run(args, causal=causal, window=window, config=nb.BackwardConfig(block_q=4, block_k=4))
    want = reference.attention_backward(*args[:4], causal=causal, window=window)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.max(np.abs(a - b)) < 1e-12, name


@needs_numba_device
def test_float64_finite_differences(rng):
    do, q, k, v, o, lse = _problem(rng, "float64", Nq=4, Nk=5, d=4, causal=True)
    dq, dk, dv = _run((do, q, k, v, o, lse), causal=True, config=nb.BackwardConfig(block_q=2, block_k=2))
    eps = 1e-6
    for name, x, g in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        idx = tuple(int(rng.integers(s)) for s in x.shape)
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        args = {"q": q, "k": k, "v": v}
        fp = np.sum(do * reference.attention(**{**args, name: xp}, causal=True)[0])
        fm = np.sum(do * reference.attention(**{**args, name: xm}, causal=True)[0])
        assert abs((fp - fm) / (2 * eps) - g[idx]) < 1e-7, name


@needs_numba_device
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_low_precision_by_the_gradient_rule_with_gqa(rng, dtype):
    args = _problem(rng, dtype, B=2, Hq=4, Hkv=2, Nq=9, Nk=6, d=12, causal=True)
    got = _run(args, causal=True)
    want = reference.attention_backward(*args[:4], causal=True)
    base = ik.attention_backward(*args, causal=True, backend="naive")
    for name, a, w, b in zip(("dq", "dk", "dv"), got, want, base):
        testing.assert_close(a, w, b, dtype=dtype, factor=testing.GRADIENT_FACTOR, name=name)


@needs_numba_device
def test_deterministic_mode_repeats_bit_for_bit_and_agrees_with_atomics(rng):
    args = _problem(rng, "float32", Nq=8, Nk=10, d=8)
    cfg = nb.BackwardConfig(block_q=4, block_k=2, deterministic=True)
    a, b = _run(args, config=cfg), _run(args, config=cfg)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    atomic = _run(args, config=cfg.replace(deterministic=False))
    assert all(np.max(np.abs(x - y)) < 1e-5 for x, y in zip(a, atomic))


@needs_numba_device
def test_fully_masked_rows_and_the_public_dispatch(rng):
    # window (0, 0) with Nq > Nk: the first rows see no key; their dQ is 0, never NaN
    args = _problem(rng, "float64", Nq=9, Nk=4, causal=True)
    dq, dk, dv = ik.attention_backward(*args, causal=True, backend="numba")
    want = reference.attention_backward(*args[:4], causal=True)
    assert np.all(np.isfinite(dq)) and np.all(dq[:, :, :5] == 0)
    assert all(np.max(np.abs(x - w)) < 1e-12 for x, w in zip((dq, dk, dv), want))


def test_config_checks_and_defaults_that_fit():
    for dtype in ("float16", "float32", "float64"):
        for d in (8, 59, 64, 128, 256):
            cfg = nb.BackwardConfig().resolved(d, dtype)
            assert cfg.smem_bytes(d, dtype) <= nb.SHARED_LIMIT_BYTES and cfg.version == "v1"
    with pytest.raises(ValueError, match="config"):
        nb.BackwardConfig(block_q=64, block_k=64).resolved(128, "float32")
    with pytest.raises(ValueError, match="config.version"):
        nb.BackwardConfig(version="v9")
    with pytest.raises(ValueError, match="config.deterministic"):
        nb.BackwardConfig(deterministic=1)


# --------------------------------------------------------------------------- on a GPU, at full size
#: FlashAttention's rule for gradients: at most twice the naive backward's error in the same dtype
GRAD_FACTOR = 2.0


@pytest.mark.gpu
@pytest.mark.skipif(SIM or not gpu.torch_gpu(), reason="needs a CUDA GPU with torch, simulator off")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("N,causal", [(1, False), (127, True), (1024, False), (1024, True), (4096, False),
                                      (4096, True)])
def test_float32_on_a_gpu_by_the_gradient_rule(rng, d, N, causal):
    """float32, both dQ modes, GQA, N_q != N_k, against the float64 gradients by the 2x rule (the
    naive backward in float32 on the GPU, from the same O and LSE, as the baseline).  The kernels run on CUDA cores, so
    N = 4096 uses one query head.  A failure lists every (mode, tensor) with its errors."""
    import torch
    from iokernels.torch_sdpa import naive_backward
    B, Hq, Hkv, Nq, Nk = (1, 1, 1, N, N + 37) if N >= 4096 else (1, 4, 2, N, N + 37)
    q, k, v, do = testing.make_grid_inputs(rng, B, Hq, Hkv, Nq, Nk, d)
    o64, lse64, *refs = testing.oracle_by_head(do, q, k, v, causal=causal)
    q32, k32, v32, do32, o32 = (x.astype(np.float32) for x in (q, k, v, do, o64))
    lse32 = lse64.astype(np.float32)
    bases = naive_backward(*(torch.from_numpy(x).cuda() for x in (do32, q32, k32, v32, o32, lse32)), causal=causal)
    checks = []
    for det in (False, True):
        got = ik.attention_backward(do32, q32, k32, v32, o32, lse32, causal=causal,
                                    backend="numba", config=nb.BackwardConfig(deterministic=det))
        checks += testing.check_gradients(got, refs, bases, dtype="float32", factor=GRAD_FACTOR,
                                          label=f"numba v1 {'deterministic' if det else 'atomic'}")
    assert all(checks), testing.report(checks)
