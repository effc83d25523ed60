"""MLA decode on Hopper (iokernels.cupy_raw.mla, kernels/mla_decode.cu).

Without a GPU: the config, the split plan, the registry check's reasons, the argument checks,
and the float64 oracle of the absorbed form (:func:`iokernels.mla.reference_latent`) against
the definition (:func:`iokernels.mla.reference_mla`) and the torch baseline.  The kernel's
sm_90a compile is in tests/test_hopper.py.

With compute capability 9.0: FlashAttention's 2x rule against the float64 oracle, the
baseline being the absorbed form in torch matmuls in the same precision
(:func:`iokernels.torch_sdpa.mla_decode_matmul`), outputs poisoned with NaN by the caller's
allocator (any element left unwritten fails).  Ragged N (not a multiple of the 64-row tile),
seq_lens with a zero length (O = 0, LSE = -inf), Hq of 16, 64, 80 and 128, B > 1, several
split counts, and the paged pool (shuffled pages whose rows past N are NaN).  Each failure
message lists every check of the case.
"""
import math

import numpy as np
import pytest

from iokernels import mla
from iokernels.core.registry import Need
from iokernels.cupy_raw import config as C
from iokernels.cupy_raw import hopper as hp
from iokernels.cupy_raw import mla as cm

ROW = cm.ROW


# --------------------------------------------------------------------------- no GPU
def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="config.version"):
        C.MLADecodeConfig(version="v2")
    with pytest.raises(ValueError, match="config.min_keys_per_split"):
        C.MLADecodeConfig(min_keys_per_split=0)
    assert C.MLADecodeConfig(min_keys_per_split=100).keys_per_split() == 128
    assert C.MLADecodeConfig.smem_bytes() <= hp.FALLBACK_SMEM_OPTIN
    with pytest.raises(ValueError, match="q: MLA decode takes float16 or bfloat16"):
        C.MLADecodeConfig().defines("float32")


@pytest.mark.parametrize("longest", [1, 63, 64, 65, 777, 8192, 32768])
@pytest.mark.parametrize("splits", [1, 3, 7, 64, 200])
def test_split_plan_covers_every_row_in_whole_tiles(longest, splits):
    launched, per = cm.split_plan(longest, splits)
    assert per % C.MLA_BLOCK_N == 0 and 1 <= launched <= splits
    assert launched * per >= longest > (launched - 1) * per       # every row once, no empty split


def test_registry_check_says_why_not():
    ok = dict(dtype="bfloat16", head_dim=ROW, cc=90)
    assert "float16 / bfloat16" in cm.check_v1(Need(**dict(ok, dtype="float32")))
    assert "512 + rope 64" in cm.check_v1(Need(**dict(ok, head_dim=ROW - 64)))
    assert "compute capability 9.0" in cm.check_v1(Need(**dict(ok, cc=80)))
    assert "simulator" in cm.check_v1(Need(**dict(ok, simulator=True)))
    assert "shared memory" in cm.check_v1(Need(**ok, extra=dict(smem=100 * 1024)))
    assert cm.check_v1(Need(**ok)) == hp.available()
    from iokernels.cupy_raw import REGISTRY
    k = REGISTRY.get("mla_decode", "v1")
    assert k.config_class is C.MLADecodeConfig and k.summary


def test_bad_inputs_raise_naming_the_argument(rng):
    from iokernels.core.testing import numpy_dtype
    bf = numpy_dtype("bfloat16")
    q = rng.standard_normal((2, 16, ROW)).astype(bf)
    kv = rng.standard_normal((2, 70, ROW)).astype(bf)
    with pytest.raises(ValueError, match="kv: expected latent rows"):
        cm.mla_decode(q, kv[..., :512])
    with pytest.raises(ValueError, match="q: expected absorbed queries"):
        cm.mla_decode(q[..., :512], kv)
    with pytest.raises(ValueError, match="kv: dtype"):
        cm.mla_decode(q, kv.astype(np.float32))
    with pytest.raises(ValueError, match="q: dtype must equal"):
        cm.mla_decode(q.astype(np.float16), kv)
    with pytest.raises(ValueError, match="q: batch"):
        cm.mla_decode(q[:1], kv)
    with pytest.raises(ValueError, match="config"):
        cm.mla_decode(q, kv, config="v1")
    pool = rng.standard_normal((4, 16, ROW)).astype(bf)
    with pytest.raises(ValueError, match="pool: page_size"):
        cm.paged_mla_decode(q, pool, np.zeros((2, 1), np.int32), np.array([3, 4]))
    pool = rng.standard_normal((4, 64, ROW)).astype(bf)
    with pytest.raises(ValueError, match="block_tables: sequence 1"):
        cm.paged_mla_decode(q, pool, np.array([[0, 1], [2, 9]], np.int32), np.array([70, 70]))
    with pytest.raises(ValueError, match="seq_lens"):
        cm.paged_mla_decode(q, pool, np.array([[0, 1], [2, 3]], np.int32), np.array([70, 129]))


def test_latent_oracle_is_the_definition(rng):
    """reference_latent over the absorbed queries, up-projected, is MLA by its definition."""
    x = mla.make_mla_inputs(rng, batch=3, heads=5, seqlen=41, latent_dim=32, rope_dim=8, head_dim=16)
    lens = np.array([41, 0, 17])
    scale = mla.default_scale(16, 8)
    q_abs = np.concatenate([mla.absorb_query(x["q_nope"], x["w_uk"]), x["q_rope"]], -1)
    o_lat, lse = mla.reference_latent(q_abs, x["kv_latent"], 32, seq_lens=lens, scale=scale)
    ref_o, ref_l = mla.reference_mla(**x, seq_lens=lens)
    np.testing.assert_allclose(np.einsum("bhc,hcd->bhd", o_lat, x["w_uv"]), ref_o, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_l))
    fin = np.isfinite(ref_l)
    np.testing.assert_allclose(lse[fin], ref_l[fin], rtol=0, atol=1e-12)
    assert np.all(o_lat[1] == 0)


def test_torch_baseline_matches_the_oracle_in_float64(rng):
    torch = pytest.importorskip("torch")
    from iokernels.torch_sdpa import mla_decode_matmul, mla_decode_sdpa
    q, kv = rng.standard_normal((3, 7, 40)), rng.standard_normal((3, 29, 40))
    lens = np.array([29, 0, 5])
    o, lse = mla_decode_matmul(torch.from_numpy(q), torch.from_numpy(kv), latent_dim=32, seq_lens=lens, scale=0.2)
    ref_o, ref_l = mla.reference_latent(q, kv, 32, seq_lens=lens, scale=0.2)
    np.testing.assert_allclose(o.numpy(), ref_o, rtol=0, atol=1e-12)
    assert np.all(np.isneginf(lse.numpy()[1])) and np.all(o.numpy()[1] == 0)
    np.testing.assert_allclose(lse.numpy()[[0, 2]], ref_l[[0, 2]], rtol=0, atol=1e-12)
    o2 = mla_decode_sdpa(torch.from_numpy(q), torch.from_numpy(kv), latent_dim=32, scale=0.2)
    full, _ = mla.reference_latent(q, kv, 32, scale=0.2)
    np.testing.assert_allclose(o2.numpy(), full, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- on Hopper
def _hopper():
    why = hp.available()
    if why is not None:
        pytest.skip(why)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,B,Hq,N,lens,splits,page", cm.CHECK_CASES)
def test_mla_decode_matches_the_oracle(rng, dtype, B, Hq, N, lens, splits, page):
    torch = _hopper()
    tdt = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((B, Hq, ROW)).astype(np.float32)).cuda().to(tdt)
    kv = torch.from_numpy(rng.standard_normal((B, N, ROW)).astype(np.float32)).cuda().to(tdt)
    checks = cm.oracle_check(q, kv, seq_lens=lens, num_splits=splits, paged_page=page, seed=B * N)
    assert all(checks), f"{dtype} B={B} Hq={Hq} N={N} lens={lens} splits={splits} page={page}: " + \
        "; ".join(str(c) for c in checks)


@pytest.mark.gpu
def test_mla_decode_empty_and_torch_in_torch_out(rng):
    torch = _hopper()
    q = torch.randn((2, 64, ROW), device="cuda", dtype=torch.bfloat16)
    kv = torch.randn((2, 100, ROW), device="cuda", dtype=torch.bfloat16)
    o, lse = cm.mla_decode(q, kv, seq_lens=np.array([0, 0], np.int32))
    assert isinstance(o, torch.Tensor) and o.shape == (2, 64, 512) and o.dtype == torch.bfloat16
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    o, lse = cm.mla_decode(q, kv[:, :0])
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    a, la = cm.mla_decode(q, kv)
    b, lb = cm.mla_decode(q, kv)
    assert torch.equal(a, b) and torch.equal(la, lb)                 # no atomics: bit-for-bit repeatable
    assert math.isfinite(float(la.float().abs().max()))
