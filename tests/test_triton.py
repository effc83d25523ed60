"""The Triton backend on a CPU: its kernels on Triton's interpreter, its configs, its refusals.

tests/test_conformance.py holds every registered Triton version to the float64 oracle at
one awkward shape; this file adds the cases a Triton kernel gets wrong first: GQA groups
other than 2, head dims that are not a power of two (padded tiles), fully masked rows
(Nq > Nk under the bottom-right causal mask), windows, explicit tile configs, torch tensors
in and out, strided inputs, and the calls it must refuse.  Shapes are small: the interpreter
runs every program of the grid in NumPy.  Without triton every kernel test skips with the
reason; the refusal tests run anyway.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels.core import reference, testing
from iokernels.triton_backend import REGISTRY, BackwardConfig, DecodeConfig, ForwardConfig, launch

WHY = launch.unavailable()
needs_triton = pytest.mark.skipif(WHY is not None, reason=WHY or "")
FORWARD = REGISTRY.versions("attention")


def _check_forward(q, k, v, out, dtype, causal=False, window=None):
    o, lse = out
    ref, ref_lse = reference.attention(q, k, v, causal=causal, window=window)
    base, base_lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    masked = np.isneginf(ref_lse)[..., None]
    testing.assert_close(o, ref, base, dtype=dtype, masked_rows=masked, name=f"O {dtype}")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=1e-4, name=f"LSE {dtype}")
    return masked


# --------------------------------------------------------------------------- configs and refusals
@pytest.mark.parametrize("kw,field", [(dict(block_q=24, block_k=16), "block_q"),
                                      (dict(block_q=8, block_k=8), "block_q"), (dict(block_q=32), "block_q"),
                                      (dict(version="v9"), "version"), (dict(num_warps=3), "num_warps"),
                                      (dict(block_q=32, block_k=True), "block_k")])
def test_forward_config_refuses_bad_fields_by_name(kw, field):
    with pytest.raises(ValueError, match=rf"config\.{field}"):
        ForwardConfig(**kw)


def test_decode_and_backward_configs_refuse_bad_fields_by_name():
    with pytest.raises(ValueError, match=r"config\.block_n"):
        DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match=r"config\.deterministic"):
        BackwardConfig(deterministic=1)
    with pytest.raises(ValueError, match=r"config\.version"):
        BackwardConfig(version="v2")


def test_without_triton_every_call_says_what_to_install(monkeypatch, rng):
    monkeypatch.setattr(launch, "triton_installed", lambda: False)
    q, k, v = testing.make_inputs(rng, seqlen_q=4, head_dim=16, dtype="float16")
    with pytest.raises(ValueError, match=r"iokernels\[triton\]"):
        ik.attention(q, k, v, backend="triton")
    for r in REGISTRY:                                 # each record gives the same reason
        assert "pip install" in r.unavailable(launch_need(r.op, q, k, v))


def launch_need(op, q, k, v):
    from iokernels.triton_backend import need
    return need(op, q=q, k=k, v=v)


@needs_triton
def test_float64_is_refused_with_the_backends_that_run_it(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=4, head_dim=16, dtype="float64")
    with pytest.raises(ValueError, match="float64 runs on the numba and cupy"):
        ik.attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="head_dim 300"):
        q, k, v = testing.make_inputs(rng, seqlen_q=2, head_dim=300, dtype="float16")
        ik.attention(q, k, v, backend="triton")


# --------------------------------------------------------------------------- forward
@needs_triton
@pytest.mark.parametrize("version", FORWARD)
@pytest.mark.parametrize("case", ["gqa3-d40", "masked-rows", "window-left", "window-long-k"])
def test_forward_matches_the_oracle(version, case, rng):
    shape = dict(batch=1, heads_q=3, heads_kv=1, seqlen_q=18, seqlen_k=29, head_dim=40)
    causal, window = False, None
    if case == "masked-rows":                         # Nq > Nk: the first Nq - Nk rows see no key
        shape.update(heads_q=2, seqlen_q=25, seqlen_k=7, head_dim=16)
        causal = True
    elif case == "window-left":
        shape.update(heads_q=2, head_dim=32)
        window = (5, -1)
    elif case == "window-long-k":
        shape.update(heads_q=2, seqlen_q=5, seqlen_k=70, head_dim=16)
        causal, window = True, (9, 0)
    for dtype in ("float16", "float32"):
        q, k, v = testing.make_inputs(rng, dtype=dtype, **shape)
        out = ik.attention(q, k, v, causal=causal, window=window, backend="triton",
                           config=ForwardConfig(version=version), return_lse=True)
        masked = _check_forward(q, k, v, out, dtype, causal, window)
        assert masked.any() == (case == "masked-rows")


@needs_triton
@pytest.mark.parametrize("version", FORWARD)
def test_forward_with_an_explicit_tile(version, rng):
    q, k, v = testing.make_inputs(rng, batch=2, heads_q=2, seqlen_q=40, seqlen_k=33, head_dim=16, dtype="bfloat16")
    cfg = ForwardConfig(version=version, block_q=32, block_k=16)
    out = ik.attention(q, k, v, causal=True, backend="triton", config=cfg, return_lse=True)
    _check_forward(q, k, v, out, "bfloat16", causal=True)


@needs_triton
def test_no_keys_gives_zero_and_minus_infinity(rng):
    q, k, v = testing.make_inputs(rng, seqlen_q=5, seqlen_k=0, head_dim=16, dtype="float16")
    o, lse = ik.attention(q, k, v, backend="triton", return_lse=True)
    assert o.dtype == q.dtype and np.all(o == 0) and np.all(np.isneginf(lse))


@needs_triton
@pytest.mark.skipif(launch.cuda_gpu(), reason="the interpreter's CPU tensors (a GPU takes CUDA tensors)")
def test_torch_tensors_in_torch_tensors_out_strided_too(rng):
    import torch
    q, k, v = testing.make_inputs(rng, heads_q=2, seqlen_q=9, seqlen_k=12, head_dim=16, dtype="float32")
    # (B, N, H, d) storage viewed as (B, H, N, d): strided along every axis but the last
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(1, 2)
                  for x in (q, k, v))
    assert not qt.is_contiguous()
    o, lse = ik.attention(qt, kt, vt, causal=True, backend="triton", return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32 and lse.shape == (1, 2, 9)
    _check_forward(q, k, v, (o.numpy(), lse.numpy()), "float32", causal=True)


# --------------------------------------------------------------------------- decode
def _decode_inputs(rng, dtype, B=3, Hq=8, Hkv=2, N=45, d=24):
    dt = testing.numpy_dtype(dtype)
    q = rng.standard_normal((B, Hq, d)).astype(dt)
    k, v = (rng.standard_normal((B, Hkv, N, d)).astype(dt) for _ in range(2))
    return q, k, v


@needs_triton
@pytest.mark.parametrize("version", REGISTRY.versions("decode"))
@pytest.mark.parametrize("num_splits,window", [(None, None), (2, (6, 0)), (9, None)])   # 9 splits of 3 tiles:
def test_decode_splits_merge_exactly(num_splits, window, version, rng):                 # most of them empty
    for dtype, group, hkv in (("float16", 4, 2), ("float32", 1, 2), ("bfloat16", 32, 1)):
        q, k, v = _decode_inputs(rng, dtype, Hq=hkv * group, Hkv=hkv)
        lens = np.array([45, 17, 0], dtype=np.int32)
        o, lse = ik.decode(q, k, v, seq_lens=lens, num_splits=num_splits, window=window, backend="triton",
                           return_lse=True, config=DecodeConfig(version=version))
        ref, ref_lse = reference.decode(q, k, v, seq_lens=lens, window=window)
        base = ik.decode(q, k, v, seq_lens=lens, window=window, backend="naive")
        testing.assert_close(o, ref, base, dtype=dtype, masked_rows=(lens == 0)[:, None, None],
                             name=f"decode {dtype} g={group} S={num_splits}")
        assert np.all(np.isneginf(lse[2])) and np.allclose(lse[:2], ref_lse[:2], atol=1e-5)


def test_decode_v2_fills_four_programs_a_multiprocessor():
    from iokernels.decode import DEFAULT_NUM_SMS, occupancy_splits
    dec = importlib.import_module("iokernels.triton_backend.decode")
    assert DecodeConfig().depth() == DecodeConfig(version="v2").depth() == (4, 2)
    assert DecodeConfig(version="v1").depth() == (1, None)
    assert DecodeConfig(version="v2", num_stages=3).depth() == (4, 3)
    assert DecodeConfig(version="v3").depth() == (3, 3)          # held back: a config without a version runs v2's
    for op in ("decode", "paged_decode"):
        assert "not the default until measured" in REGISTRY.get(op, "v3").default_check(None)
    with pytest.raises(ValueError, match=r"config\.num_stages"):
        DecodeConfig(num_stages=9)
    for batch, n in ((1, 32768), (8, 4096), (8, 32768)):      # the launcher's rule, asked for 4x the programs
        v1 = dec._splits(None, batch, 8, n, -1, 32, 1)
        v2 = dec._splits(None, batch, 8, n, -1, 32, 4)
        assert v1 == occupancy_splits(batch, 8, n, DEFAULT_NUM_SMS, block_n=32)
        assert v2 == occupancy_splits(batch, 8, n, 4 * DEFAULT_NUM_SMS, block_n=32) and v2 > v1
    assert dec._splits(5, 8, 8, 4096, -1, 32, 4) == 5          # an explicit count is taken as it is
    assert dec._splits(None, 8, 8, 4096, 99, 32, 4) == dec._splits(None, 8, 8, 100, -1, 32, 4)   # a window's keys


@needs_triton
@pytest.mark.skipif(launch.cuda_gpu(), reason="the interpreter's CPU tensors (a GPU takes CUDA tensors)")
def test_decode_takes_lengths_on_the_device_in_place(monkeypatch, rng):
    """Lengths as a tensor on q's device go through ik.decode without a host read (the path a
    CUDA graph captures; here the interpreter's CPU tensors stand in for CUDA ones): the
    upload path is never called, the split count is planned for the cache's N keys, a change
    made in place is what the next call reads, and int64 lengths are converted on the device."""
    import torch
    dec = importlib.import_module("iokernels.triton_backend.decode")

    def no_host(*a, **k):
        raise AssertionError("device lengths were read on the host")
    monkeypatch.setattr(dec, "host_lens", no_host)
    q, k, v = (torch.from_numpy(x) for x in _decode_inputs(rng, "float16", B=3, Hq=8, Hkv=2, N=45))
    lens = torch.tensor([45, 17, 0], dtype=torch.int32)
    for _ in range(2):
        for window in (None, (6, 0)):
            o, lse = ik.decode(q, k, v, seq_lens=lens, window=window, backend="triton", return_lse=True)
            want = lens.numpy().copy()
            ref, ref_lse = reference.decode(q.numpy(), k.numpy(), v.numpy(), seq_lens=want, window=window)
            base = ik.decode(q.numpy(), k.numpy(), v.numpy(), seq_lens=want, window=window, backend="naive")
            testing.assert_close(o.numpy(), ref, base, dtype="float16", masked_rows=(want == 0)[:, None, None])
            assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(ref_lse))
        lens.copy_(torch.tensor([3, 0, 44], dtype=torch.int32))      # in place, as a serving step does
    o64 = ik.decode(q, k, v, seq_lens=lens.to(torch.int64), backend="triton")
    assert torch.equal(o64, ik.decode(q, k, v, seq_lens=lens, backend="triton"))
    with pytest.raises(ValueError, match="seq_lens"):
        ik.decode(q, k, v, seq_lens=torch.tensor([45, 17], dtype=torch.int32), backend="triton")
    with pytest.raises(ValueError, match="seq_lens"):
        ik.decode(q, k, v, seq_lens=torch.tensor([45.0, 17.0, 0.0]), backend="triton")
    with pytest.raises(ValueError, match=r"seq_lens: each length must be in \[0, 45\]"):
        ik.decode(q, k, v, seq_lens=torch.tensor([46, 0, 0], dtype=torch.int32), backend="triton")


if WHY is None:                     # a kernel of this file's own: to_storage as the versions use it
    import triton
    import triton.language as tl

    from iokernels.triton_backend.tiles import to_storage

    @triton.jit
    def _narrow(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, to_storage(tl.load(X + i), Y.dtype.element_ty))


@needs_triton
def test_bfloat16_results_are_rounded_to_nearest_even_under_the_interpreter_too():
    import torch
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * torch.logspace(-20, 20, 1024)
    x[:4] = torch.tensor([1 + 2**-8 + 2**-10, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-10)])   # ties, both ways
    for dtype in (torch.bfloat16, torch.float16):
        y = torch.empty(1024, dtype=dtype)
        _narrow[(1,)](x, y, N=1024)
        assert torch.equal(y.view(torch.int16), x.to(dtype).view(torch.int16)), dtype


def _paged_cache(rng, dtype, lens, hkv=2, d=16, block_size=4):
    cache = ik.PagedKVCache(40, block_size=block_size, num_kv_heads=hkv, head_dim=d, dtype=testing.numpy_dtype(dtype))
    sids = [cache.new_sequence() for _ in lens]
    dt = testing.numpy_dtype(dtype)
    for step in range(max(lens)):                   # appends interleaved: every table is scattered in the pool
        for sid, n in zip(sids, lens):
            if step < n:
                kk, vv = (rng.standard_normal((1, hkv, d)).astype(dt) for _ in range(2))
                cache.append(sid, kk, vv)
    return cache, sids


@needs_triton
@pytest.mark.parametrize("version", REGISTRY.versions("paged_decode"))
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_decode_reads_through_scattered_block_tables(num_splits, version, rng):
    """Every version (v3 loads a tile's block ids a step ahead: splits of several tiles, and a
    last tile that ends inside a block, read the right blocks)."""
    lens = (23, 6, 0, 9)
    cache, sids = _paged_cache(rng, "float16", lens)
    tables, _ = cache.block_tables_array(sids)
    assert not np.all(np.diff(tables[0][tables[0] >= 0]) == 1)    # sequence 0's blocks are not consecutive
    q = rng.standard_normal((len(sids), 6, 16)).astype(np.float16)
    o, lse = ik.paged_decode(q, cache, sids, num_splits=num_splits, backend="triton", return_lse=True,
                             config=DecodeConfig(version=version))
    base, base_lse = ik.paged_decode(q, cache, sids, backend="tiled", return_lse=True)
    n = max(lens)
    kk, vv = (np.stack([np.pad(cache.gather(s)[i].astype(np.float64), ((0, 0), (0, n - cache.seq_len(s)), (0, 0)))
                        for s in sids]) for i in (0, 1))
    ref, ref_lse = reference.decode(q, kk, vv, seq_lens=np.array(lens))
    testing.assert_close(o, ref, base, dtype="float16", masked_rows=(np.array(lens) == 0)[:, None, None])
    testing.assert_close(lse, ref_lse, base_lse, dtype="float16", atol=1e-4)


@needs_triton
@pytest.mark.skipif(launch.cuda_gpu(), reason="the interpreter's CPU tensors (a GPU takes CUDA tensors)")
def test_paged_decode_pools_takes_torch_pools_and_a_window(rng):
    import torch
    from iokernels.triton_backend import paged_decode_pools
    lens = (19, 7)
    cache, sids = _paged_cache(rng, "float32", lens)
    tables, seq_lens = cache.block_tables_array(sids)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    o, lse = paged_decode_pools(torch.from_numpy(q), torch.from_numpy(cache.k_pool), torch.from_numpy(cache.v_pool),
                                torch.from_numpy(tables), torch.from_numpy(seq_lens), window=(4, 0))
    assert isinstance(o, torch.Tensor)
    want, want_lse = ik.paged_decode(q, cache, sids, backend="tiled", window=(4, 0), return_lse=True)
    np.testing.assert_allclose(o.numpy(), want, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-5)


@needs_triton
@pytest.mark.skipif(launch.cuda_gpu(), reason="the interpreter's CPU tensors (a GPU takes CUDA tensors)")
def test_paged_decode_pools_checks_its_lengths_against_the_tables(rng):
    """Host lengths past what a table's blocks hold, and no lengths at all, are ValueErrors
    naming seq_lens (a kernel would read table entries past the row)."""
    import torch
    from iokernels.triton_backend import paged_decode_pools
    cache, sids = _paged_cache(rng, "float32", (19, 7))
    tables, seq_lens = cache.block_tables_array(sids)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    pools = (cache.k_pool, cache.v_pool)
    cap = tables.shape[1] * 4
    for bad in (np.array([cap + 1, 7]), torch.tensor([cap + 1, 7], dtype=torch.int32)):
        with pytest.raises(ValueError, match=rf"seq_lens: each length must be in \[0, {cap}\]"):
            paged_decode_pools(q if isinstance(bad, np.ndarray) else torch.from_numpy(q), *pools, tables, bad)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_pools(q, *pools, tables, None)


@needs_triton
def test_paged_decode_refuses_a_quantized_cache(rng):
    cache = ik.PagedKVCache(8, block_size=4, num_kv_heads=1, head_dim=16, dtype=np.float16, kv_dtype="int8")
    sid = cache.new_sequence()
    cache.append(sid, *(rng.standard_normal((3, 1, 16)).astype(np.float16) for _ in range(2)))
    q = rng.standard_normal((1, 2, 16)).astype(np.float16)
    with pytest.raises(ValueError, match="the 'triton' backend reads unquantized pools"):
        ik.paged_decode(q, cache, [sid], backend="triton")
    from iokernels.triton_backend import need
    assert "kv_dtype" in REGISTRY.get("paged_decode", "v1").unavailable(need("paged_decode", q=q, cache=cache))


# --------------------------------------------------------------------------- backward
@needs_triton
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", ["gqa3-d40", "masked-rows", "window"])
def test_backward_matches_the_oracle(case, deterministic, rng):
    shape = dict(batch=1, heads_q=3, heads_kv=1, seqlen_q=18, seqlen_k=29, head_dim=40)
    causal, window = True, None
    if case == "masked-rows":
        shape.update(heads_q=2, seqlen_q=25, seqlen_k=7, head_dim=16)
    elif case == "window":
        shape.update(heads_q=2, head_dim=16)
        causal, window = False, (4, 3)
    cfg = BackwardConfig(deterministic=deterministic)
    for dtype in ("float16", "float32"):
        q, k, v, do = testing.make_inputs(rng, dtype=dtype, with_grad=True, **shape)
        o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="tiled", return_lse=True)
        grads = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="triton", config=cfg)
        refs = reference.attention_backward(do, q, k, v, causal=causal, window=window)
        bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="naive")
        for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
            assert g.dtype == q.dtype
            testing.assert_close(g, r, b, dtype=dtype, factor=testing.GRADIENT_FACTOR, name=f"{name} {dtype}")
        if case == "masked-rows":                   # rows that see no key have no gradient
            assert np.all(grads[0][:, :, :18] == 0)


@needs_triton
@pytest.mark.skipif(launch.cuda_gpu(), reason="the interpreter's CPU tensors (a GPU takes CUDA tensors)")
def test_autograd_through_the_triton_backend(rng):
    import torch
    from iokernels import autograd
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in
               testing.make_inputs(rng, heads_q=2, seqlen_q=9, seqlen_k=14, head_dim=16, dtype="float32"))
    grads = []
    for backend in ("triton", "tiled"):
        out = autograd.attention(q, k, v, causal=True, backend=backend)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=2e-5)


@needs_triton
def test_sanitize_cases_cover_every_record():
    from iokernels.triton_backend import sanitize_cases
    names = [name for name, _ in sanitize_cases(verbose=False)]
    for r in REGISTRY:
        assert any(n.startswith(f"{r.op} {r.version}") for n in names), r.name


@needs_triton
@pytest.mark.parametrize("dtype, tiles", [("float32", "FORWARD_TILES_F32"), ("bfloat16", "FORWARD_TILES"),
                                          ("float16", "FORWARD_TILES")])
def test_v2_autotunes_float32_over_its_own_tiles(monkeypatch, rng, dtype, tiles):
    """On a GPU, v2's tile is autotuned: float32 inputs (three TF32 products, whose split operands
    need more shared memory) over FORWARD_TILES_F32, 16-bit inputs over FORWARD_TILES.
    Checked here by recording the launch instead of running it, with the interpreter reported off
    and the tensors kept on the CPU."""
    import importlib

    from iokernels.triton_backend import config as tc
    launch.prepare()                     # (the interpreter on before the kernels are defined, without a GPU)
    fv2 = importlib.import_module("iokernels.triton_backend.forward_v2")
    for name, want in (("fwd_v2_tuned", tc.FORWARD_TILES), ("fwd_v2_tuned_f32", tc.FORWARD_TILES_F32)):
        got = [(c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
               for c in getattr(fv2, name).configs]
        assert got == list(want), name
    assert max(bq * bk for bq, bk, _, _ in tc.FORWARD_TILES_F32) < max(bq * bk for bq, bk, _, _ in tc.FORWARD_TILES)
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((self.name, meta))

    for name in ("fwd_v2_tuned", "fwd_v2_tuned_f32"):
        monkeypatch.setattr(fv2, name, Recorder(name))
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "device", lambda: "cpu")          # (the tensors stay here)
    q, k, v = testing.make_inputs(rng, heads_q=2, heads_kv=1, seqlen_q=8, seqlen_k=8, head_dim=64, dtype=dtype)
    ik.attention(q, k, v, backend="triton", config=ForwardConfig(version="v2"))
    want = "fwd_v2_tuned_f32" if tiles == "FORWARD_TILES_F32" else "fwd_v2_tuned"
    assert [(name, meta["F32"]) for name, meta in launched] == [(want, tc.TF32X3 if dtype == "float32" else 0)]


@pytest.mark.parametrize("interpreting", [False, True])
def test_f32_dot_takes_three_tf32_products_for_the_forward_on_a_gpu_only(monkeypatch, interpreting):
    """mm's F32 per dtype: float32 inputs take TF32X3 in the forward on a GPU and IEEE elsewhere
    (decode, the backward, the interpreter); bfloat16 needs IEEE under the interpreter only."""
    from iokernels.triton_backend import config as tc
    from iokernels.triton_backend import forward as fw
    monkeypatch.setattr(launch, "interpreting", lambda: interpreting)
    assert (tc.IEEE, tc.TF32X3) == (1, 2) and tc.IEEE == True  # noqa: E712  (kernels test `if F32:`)
    assert fw.f32_dot("float32", tensor_cores=True) == (tc.IEEE if interpreting else tc.TF32X3)
    assert fw.f32_dot("float32") == tc.IEEE
    assert fw.f32_dot("bfloat16", tensor_cores=True) == fw.f32_dot("bfloat16") == (tc.IEEE if interpreting else 0)
    assert fw.f32_dot("float16", tensor_cores=True) == 0


def test_the_decode_sweep_rows_build_and_its_command_line_parses():
    """The Triton decode sweep is data: each row's config builds, its labels are distinct, its depth
    is a number of programs a multiprocessor; ``--shapes`` picks the serving grid or its B=8 N=32768
    cell, and a wrong command line is refused."""
    from iokernels.bench import sweeps_triton as st
    labels = [label for label, _, _ in st.DECODE_ROWS]
    assert len(labels) == len(set(labels))
    for _, kw, deep in st.DECODE_ROWS:
        DecodeConfig(**kw)
        assert deep is None or (isinstance(deep, int) and deep >= 1)
    assert st.parse_args([]) == (None, st.SERVING_SHAPES, st.DECODE_ROWS)
    out, shapes, rows = st.parse_args(["o.json", "--shapes", "b8n32768", "--rows", "v3,v1_x4_deep"])
    assert out == "o.json" and [(s["batch"], s["seqlen"]) for s in shapes] == [(8, 32768)]
    assert [r[0] for r in rows] == ["v3", "v1 x4 deep"]
    for bad in (["--shapes", "huge"], ["a.json", "b.json"], ["--only", "v1"], ["--rows", "v3,v99"]):
        assert st.parse_args(bad) is None


def test_loop_waits_reads_the_waits_inside_a_backward_branch_only():
    from iokernels.triton_backend.pipeline import loop_waits
    ptx = ("\tcp.async.wait_group 1;\n"
           "$L__BB0_1:\n"
           "\tcp.async.wait_group 2;\n"
           "\tmma.sync.aligned.m16n8k16;\n"
           "\t@%p1 bra $L__BB0_2;\n"
           "\tcp.async.wait_group 4;\n"
           "$L__BB0_2:\n"
           "\t@%p2 bra $L__BB0_1;\n"
           "\tcp.async.wait_group 0;\n")
    assert loop_waits(ptx) == [2, 4]          # the loop $L__BB0_1 .. its back-branch; a forward branch is none
    assert loop_waits("cp.async.wait_group 0;") == []


@needs_triton
def test_decode_v3_pipelines_its_paged_loop_as_the_contiguous_one():
    """Compiled for sm_90 (no GPU): v3's paged key loop keeps copies in flight while it computes
    (a wait that leaves groups pending), with the contiguous loop's waits and shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    from iokernels.triton_backend.decode_v3 import split_kv_v3
    from iokernels.triton_backend.pipeline import compile_decode, pipeline_table
    if type(split_kv_v3).__name__ != "JITFunction":        # the interpreter's wrapper: the table runs a fresh process
        table = pipeline_table((3,))
        rows = {tuple(w[2:4]): w[4:] for w in (line.split() for line in table.splitlines())
                if w and w[0] == "split_kv_v3"}                     # (cache, stages): shared B, groups, waits
        assert rows[("contiguous", "3")] == rows[("paged", "3")] and rows[("paged", "3")][-1] != "0"
        return
    contiguous, paged = (compile_decode(split_kv_v3, p, 3) for p in (False, True))
    assert paged == contiguous and contiguous[2] and min(contiguous[2]) > 0
