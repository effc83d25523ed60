"""The Hopper backward (bwd_v3.cu, and bwd_v4.cu: two consumer warpgroups): compiled
everywhere, run where there is a Hopper GPU.

Without a GPU (CI): bwd_v3.cu compiles with nvcc for sm_90a from exactly the source and
defines the launcher hands NVRTC, for each dtype x head dim x dQ mode and each ring depth;
``-Xptxas -v`` must show no local memory (no spills, no stack frame), no wgmma serialisation
(ptxas C7515, C7512) and no ignored setmaxnreg (C7508); the source refuses what it cannot run with
#error; BackwardConfig's v3 fields are validated naming the field; the registry keeps v2 the
default (the gate in cupy_raw/policy.py), runs v3 when a config names it and refuses it by
name where it cannot run.  The launch arguments, grid and tensor maps are checked against the
kernel's signature in tests/test_cupy_launch_args.py (a CuPy stand-in).

With compute capability 9.0: dQ, dK, dV held to the float64 gradients by FlashAttention's 2x
rule (the naive backward in the same dtype, on the GPU, from the same O and LSE, is the
baseline) at d in {64, 128}, N in {1, 127, 1024, 4096}, causal and not, GQA, N_q != N_k, both
dQ modes; windows and rows that see no key; the deterministic mode bit for bit across runs;
the cached plan the same bits as the eager launch.  Skipped elsewhere with the reason.

bwd_v4.cu gets the same checks (its own compile list, config fields, refusals), is held back
from the default by policy.HELD_BACK (v3 stays the default on Hopper; a config naming v4 runs
it; the gate opens in that one table), and on a Hopper GPU is held to the same 2x rule, the
awkward shapes, the deterministic mode bit for bit, and agreement with v3.
"""

import numpy as np
import pytest

import iokernels as ik
from iokernels.core.registry import Need
from iokernels.cupy_raw import REGISTRY, hopper as hp, policy
from iokernels.cupy_raw.config import (BWD_V3_HEAD_DIMS, BWD_V3_MAX_STAGES, BWD_V4_HEAD_DIMS, BWD_V4_MAX_STAGES,
                                        BackwardConfig)

from nvcc_support import NVCC, PTXAS_V, compile_all, compile_source, registers_only
DTYPES = ("float16", "bfloat16")


# --------------------------------------------------------------------------- compile (no GPU)
def _compile(tmp_path, defines, extra=PTXAS_V, name="bwd_v3"):
    return compile_source(tmp_path, name, hp.source(name), defines, extra=extra)


def _jobs():
    """(label, defines): every dtype x head dim x dQ mode at the default ring, and every other
    ring depth at bfloat16 d=128 (the most registers)."""
    jobs = []
    for dtype in DTYPES:
        for d in BWD_V3_HEAD_DIMS:
            for det in (False, True):
                cfg = BackwardConfig("v3", deterministic=det)
                jobs.append((f"{dtype} d={d} deterministic={det}", cfg.defines(d, dtype)))
    for stages in range(1, BWD_V3_MAX_STAGES + 1):
        cfg = BackwardConfig("v3", stages=stages)
        jobs.append((f"stages={stages} bfloat16 d=128", cfg.defines(128, "bfloat16")))
    return jobs


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_bwd_v3_compiles_for_sm90a_in_registers(tmp_path):
    jobs = _jobs()
    results = compile_all(lambda j: _compile(tmp_path, j[1]), jobs)
    for (label, defines), (rc, err) in zip(jobs, results):
        registers_only(label, rc, err)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_bwd_v3_source_refuses_what_it_cannot_run(tmp_path):
    base = BackwardConfig("v3").defines(128, "bfloat16")
    for defines, message in ((dict(base, BLOCK_M=128), "BLOCK_M = BLOCK_N = 64"),
                             (dict(base, BLOCK_N=128), "BLOCK_M = BLOCK_N = 64"),
                             (dict(base, HEAD_DIM=256), "HEAD_DIM 64 or 128"),
                             (dict(base, IK_DTYPE=0), "IK_DTYPE 1 (float16) or 2"),
                             (dict(base, STAGES=5), "STAGES 1 to 4"),
                             ({k: v for k, v in base.items() if k != "DETERMINISTIC"}, "-DDETERMINISTIC")):
        rc, err = _compile(tmp_path, defines, extra=())
        assert rc != 0 and message in err, f"{defines}: rc={rc} {err[:300]}"


def test_bwd_v3_is_a_hopper_source():
    assert "bwd_v3" in hp.SOURCES
    from iokernels.cupy_raw import launch
    assert "bwd_v3" not in launch.SOURCES            # never compiled for the portable archs
    assert "#include" not in hp.source("bwd_v3")     # headers inlined, each once
    assert hp.source("bwd_v3").count("struct __align__(64) TmaMap") == 1


# --------------------------------------------------------------------------- config (no GPU)
def test_config_v3_fields_are_validated_naming_the_field():
    for kw, field in ((dict(block_q=32), "config.block_q"), (dict(block_k=128), "config.block_k"),
                      (dict(stages=0), "config.stages"), (dict(stages=BWD_V3_MAX_STAGES + 1), "config.stages"),
                      (dict(stages=True), "config.stages"), (dict(num_warps=4), "config.num_warps"),
                      (dict(lanes_per_key=4), "config.lanes_per_key")):
        with pytest.raises(ValueError, match=field):
            BackwardConfig("v3", **kw)
    for version in (None, "v1", "v2"):               # the ring is v3's alone
        with pytest.raises(ValueError, match="config.stages"):
            BackwardConfig(version, stages=2)
    with pytest.raises(ValueError, match="config.version") as e:
        BackwardConfig("v3").resolve(128, "float32")
    assert "float16/bfloat16" in str(e.value)
    with pytest.raises(ValueError, match="config.version") as e:
        BackwardConfig("v3").resolve(96, "bfloat16")
    assert "head_dim 64 or 128" in str(e.value)
    with pytest.raises(ValueError, match="config.stages"):
        BackwardConfig("v3", stages=4).resolve(128, "bfloat16", 100 * 1024)


def test_config_v3_resolves_to_its_fixed_tiles():
    cfg = BackwardConfig("v3", deterministic=True).resolve(128, "bfloat16", hp.FALLBACK_SMEM_OPTIN)
    assert (cfg.block_q, cfg.block_k, cfg.stages, cfg.deterministic) == (64, 64, policy.BWD_V3_STAGES, True)
    assert cfg.defines(128, "bfloat16") == dict(IK_DTYPE=2, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64,
                                                 STAGES=policy.BWD_V3_STAGES, DETERMINISTIC=1)
    # K_j, V_j + 2 x (Q_i, dO_i) + 2 x dS^T (16-bit), 2 x (LSE_i, D_i), 5 mbarriers, the alignment slack
    assert BackwardConfig.smem_bytes(64, 64, 128, "bfloat16", "v3", 2) == \
        2 * 64 * 128 * 2 + 2 * 2 * 64 * 128 * 2 + 2 * 64 * 64 * 2 + 2 * 2 * 64 * 4 + 8 * 5 + 1024
    for d in BWD_V3_HEAD_DIMS:                        # every ring depth fits an H100's SRAM
        for stages in range(1, BWD_V3_MAX_STAGES + 1):
            assert BackwardConfig.smem_bytes(64, 64, d, "float16", "v3", stages) <= hp.FALLBACK_SMEM_OPTIN


# --------------------------------------------------------------------------- registry (no GPU)
def _need(dtype="bfloat16", d=128, cc=90):
    return Need(dtype=dtype, head_dim=d, cc=cc, extra=dict(smem=hp.FALLBACK_SMEM_OPTIN, group=2, aligned16=True))


@pytest.fixture
def hopper_here(monkeypatch):
    """This machine as a Hopper one with cuda-python (what hopper.checks.available reports)."""
    monkeypatch.setattr(hp.checks, "available", lambda: None)


def test_v3_is_the_default_on_hopper(hopper_here):
    """Measured (its GPU tests passed, and the benchmark recorded it faster than v2 on Hopper),
    v3 is out of policy.HELD_BACK: the default on Hopper for every dtype and head dim it runs,
    v2 elsewhere; ``deterministic`` travels with the choice."""
    assert ("attention_backward", "v3") not in policy.HELD_BACK
    v3 = REGISTRY.get("attention_backward", "v3")
    assert v3.rank > REGISTRY.get("attention_backward", "v2").rank
    for dtype in DTYPES:
        for d in BWD_V3_HEAD_DIMS:
            assert v3.unavailable(_need(dtype, d)) is None and v3.not_default(_need(dtype, d)) is None
            kernel, cfg = REGISTRY.resolve("attention_backward", None, _need(dtype, d))
            assert kernel.version == cfg.version == "v3"
            kernel, cfg = REGISTRY.resolve("attention_backward", BackwardConfig(deterministic=True), _need(dtype, d))
            assert kernel.version == "v3" and cfg.deterministic
    assert REGISTRY.resolve("attention_backward", None, _need(cc=80))[0].version == "v2"
    assert REGISTRY.resolve("attention_backward", None, _need(d=96))[0].version == "v2"


def test_held_back_again_the_default_is_v2(hopper_here, monkeypatch):
    """The gate is one table: put v3 back in policy.HELD_BACK and the default is v2 again."""
    monkeypatch.setitem(policy.HELD_BACK, ("attention_backward", "v3"), "a test holds it back")
    v3 = REGISTRY.get("attention_backward", "v3")
    assert v3.not_default(_need()).startswith("not the default until measured")
    assert REGISTRY.resolve("attention_backward", None, _need())[0].version == "v2"


def test_v3_runs_when_named(hopper_here):
    kernel, cfg = REGISTRY.resolve("attention_backward", BackwardConfig("v3", deterministic=True), _need())
    assert kernel.version == "v3" and kernel.file == "bwd_v3.cu" and cfg.deterministic


@pytest.mark.parametrize("need, why", [(_need(cc=80), "compute capability 9.0"),
                                       (_need(cc=89), "compute capability 9.0"),
                                       (_need("float32"), "float16/bfloat16"),
                                       (_need(d=96), "head_dim 64 or 128"),
                                       (_need(d=256), "head_dim 64 or 128")])
def test_v3_is_refused_by_name(hopper_here, need, why):
    with pytest.raises(ValueError, match="config.version") as e:
        REGISTRY.resolve("attention_backward", BackwardConfig("v3"), need)
    assert "v3" in str(e.value) and why in str(e.value)


def test_v3_is_refused_without_what_hopper_needs(monkeypatch):
    monkeypatch.setattr(hp.checks, "available", lambda: "no CUDA device visible to CuPy")
    with pytest.raises(ValueError, match="config.version.*no CUDA device"):
        REGISTRY.resolve("attention_backward", BackwardConfig("v3"), _need())
    assert "simulator" in REGISTRY.get("attention_backward", "v3").unavailable(
        Need(dtype="float16", head_dim=64, simulator=True))


def test_sanitizer_runs_v3():
    from iokernels.cupy_raw import sanitize as S
    assert ("attention_backward", "v3") in S.VARIANTS
    assert any(d in BWD_V3_HEAD_DIMS for d in S.BACKWARD_HEAD_DIMS)


# --------------------------------------------------------------------------- on a Hopper GPU
gpu = pytest.mark.skipif(hp.available() is not None, reason=f"Hopper kernels: {hp.available()}")
#: FlashAttention's rule for gradients: at most twice the naive backward's error in the same dtype
GRAD_FACTOR = 2.0
#: the awkward shapes (windows cut through tiles, rows that see no key): the sanitizer's 3x
AWKWARD_FACTOR = 3.0


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _to_torch(x, dtype):
    torch = _torch()
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).cuda().to(getattr(torch, dtype))


def _naive_grads(do, q, k, v, o, lse, causal, dtype):
    """The naive backward in ``dtype`` on the GPU, from the same O and LSE as the kernel's."""
    from iokernels.core.testing import as_numpy
    from iokernels.torch_sdpa import naive_backward
    torch = _torch()
    args = [_to_torch(x, dtype) for x in (do, q, k, v, o)] + [torch.from_numpy(lse).cuda()]
    return [as_numpy(g) for g in naive_backward(*args, causal=causal)]


def _grad_shape(N):
    """(batch, heads_q, heads_kv, N_q, N_k): GQA and N_k = N_q + 37 (not a multiple of 64); at
    N = 4096 two query heads, so the float64 oracle takes seconds."""
    return (1, 2, 1, N, N + 37) if N >= 4096 else (1, 4, 2, N, N + 37)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", BWD_V3_HEAD_DIMS)
@pytest.mark.parametrize("N", (1, 127, 1024, 4096))
@pytest.mark.parametrize("causal", (False, True))
def test_two_x_rule(rng, d, N, causal):
    """dQ, dK, dV of v3 in float16 and bfloat16, both dQ modes, GQA, N_q != N_k, against the
    float64 gradients by the 2x rule (inputs on a grid both dtypes hold exactly; O and LSE the
    oracle's, rounded as a forward in that dtype stores them).  A failure lists every check."""
    from iokernels.core.testing import check_gradients, make_grid_inputs, numpy_dtype, oracle_by_head, report
    B, Hq, Hkv, Nq, Nk = _grad_shape(N)
    q, k, v, do = make_grid_inputs(rng, B, Hq, Hkv, Nq, Nk, d)
    o64, lse64, *refs = oracle_by_head(do, q, k, v, causal=causal)
    checks = []
    for dtype in DTYPES:
        nd = numpy_dtype(dtype)
        qd, kd, vd, dod, od = (x.astype(nd) for x in (q, k, v, do, o64))
        lse = lse64.astype(np.float32)
        bases = _naive_grads(dod, qd, kd, vd, od, lse, causal, dtype)
        for det in (False, True):
            cfg = BackwardConfig("v3", deterministic=det)
            got = ik.attention_backward(dod, qd, kd, vd, od, lse, causal=causal, backend="cupy", config=cfg)
            checks += check_gradients(got, refs, bases, dtype=dtype, factor=GRAD_FACTOR,
                                      label=f"{dtype} v3 {'deterministic' if det else 'atomic'}")
    assert all(checks), report(checks)


#: (label, dtype, d, heads_q, heads_kv, Nq, Nk, causal, window, config keywords)
AWKWARD = [
    ("causal GQA4 N=127", "bfloat16", 128, 8, 2, 127, 127, True, None, {}),
    ("window (64, 16) Nq<Nk", "bfloat16", 64, 4, 1, 300, 1000, False, (64, 16), {}),
    ("causal Nq>Nk: masked rows", "float16", 128, 4, 4, 1000, 300, True, None, dict(deterministic=True)),
    ("window (-1, 5) one stage", "float16", 64, 4, 2, 200, 333, False, (-1, 5), dict(stages=1)),
    ("window (7, 0) four stages", "bfloat16", 128, 4, 1, 100, 190, False, (7, 0), dict(stages=4)),
    ("MQA 16/1 N=65", "float16", 64, 16, 1, 65, 65, False, None, {}),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", AWKWARD, ids=[c[0] for c in AWKWARD])
def test_awkward_shapes(rng, case):
    """Lengths not a multiple of 64, windows cut through tiles, rows that see no key (their dQ
    must be exactly 0, never NaN), the ring at one and four stages; the 3x rule of the sanitizer
    against the float64 gradients with the NumPy naive backward as the baseline."""
    from iokernels import conventions as cv, reference
    from iokernels.core.testing import check, make_inputs
    label, dtype, d, hq, hkv, nq, nk, causal, window, kw = case
    q, k, v = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype)
    do = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hq, seqlen_q=nq, seqlen_k=1, head_dim=d, dtype=dtype)[0]
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    refs = reference.attention_backward(do, q, k, v, causal=causal, window=window)
    bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="naive")
    cfg = BackwardConfig("v3", **kw)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="cupy", config=cfg)
    blind = ~cv.mask(nq, nk, causal, window).any(axis=-1)[None, None, :, None]     # rows that see no key
    checks = [check(g, r, b, dtype=dtype, name=n, factor=AWKWARD_FACTOR, masked_rows=blind if n == "dq" else None)
              for n, g, r, b in zip(("dq", "dk", "dv"), got, refs, bases)]
    assert all(checks), f"v3 {label} {cfg}: " + "; ".join(str(c) for c in checks)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", BWD_V3_HEAD_DIMS)
def test_deterministic_mode_repeats_bit_for_bit(d):
    torch = _torch()
    q, k, v, do = (torch.randn((2, 4, 1000, d), device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True)
    cfg = BackwardConfig("v3", deterministic=True)
    a = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg)
    b = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy",
                              config=BackwardConfig("v3", deterministic=False))
    for x, y in zip(a, c):                            # atomic adds: the same sums, any order
        assert torch.allclose(x.float(), y.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.gpu
def test_plan_matches_the_eager_launch():
    """The cached plan (torch tensors, TMA maps per address set) gives the eager launch's bits
    (deterministic dQ), run twice (the second run reuses the maps)."""
    torch = _torch()
    from iokernels.cupy_raw.backward import run_attention_backward
    from iokernels.cupy_raw.backward_plan import BackwardPlan
    q = torch.randn((2, 4, 333, 128), device="cuda", dtype=torch.float16)
    k, v = (torch.randn((2, 2, 300, 128), device="cuda", dtype=torch.float16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True)
    cfg = BackwardConfig("v3", deterministic=True)
    eager = run_attention_backward(do, q, k, v, o, lse, causal=True, scale=None, window=None, config=cfg)
    plan = BackwardPlan(do, q, k, v, o, lse, causal=True, config=cfg)
    assert plan.record.version == "v3"
    for _ in range(2):
        got = plan.run(do, q, k, v, o, lse)
        torch.cuda.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(eager, got))


# =========================================================================== bwd_v4.cu
# --------------------------------------------------------------------------- compile (no GPU)
def _v4_fits(d, stages):
    """Whether the launcher can pick ``stages`` at head dim ``d`` (four do not fit at d = 128)."""
    return BackwardConfig.smem_bytes(64, 128, d, "bfloat16", "v4", stages) <= hp.FALLBACK_SMEM_OPTIN


def _jobs_v4():
    """(label, defines): every dtype x head dim x dQ mode at the default ring, and every other
    ring depth that fits, at bfloat16 (the define sets the launcher can hand NVRTC)."""
    jobs = []
    for dtype in DTYPES:
        for d in BWD_V4_HEAD_DIMS:
            for det in (False, True):
                cfg = BackwardConfig("v4", deterministic=det)
                jobs.append((f"{dtype} d={d} deterministic={det}", cfg.defines(d, dtype)))
    for d in BWD_V4_HEAD_DIMS:
        for stages in range(1, BWD_V4_MAX_STAGES + 1):
            if stages != policy.BWD_V4_STAGES and _v4_fits(d, stages):
                cfg = BackwardConfig("v4", stages=stages)
                jobs.append((f"stages={stages} bfloat16 d={d}", cfg.defines(d, "bfloat16")))
    return jobs


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_bwd_v4_compiles_for_sm90a_in_registers(tmp_path):
    """No spills, no stack frame, no serialised wgmma, no ignored setmaxnreg (the producer's 32
    and the consumers' 232 registers hold), for every define set the launcher uses."""
    jobs = _jobs_v4()
    assert {j[1]["STAGES"] for j in jobs} == {1, 2, 3, 4}
    results = compile_all(lambda j: _compile(tmp_path, j[1], name="bwd_v4"), jobs)
    for (label, defines), (rc, err) in zip(jobs, results):
        registers_only(f"bwd_v4 {label}", rc, err)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_bwd_v4_source_refuses_what_it_cannot_run(tmp_path):
    base = BackwardConfig("v4").defines(128, "bfloat16")
    for defines, message in ((dict(base, BLOCK_N=64), "BLOCK_M = 64 and BLOCK_N = 128"),
                             (dict(base, BLOCK_M=128), "BLOCK_M = 64 and BLOCK_N = 128"),
                             (dict(base, HEAD_DIM=256), "HEAD_DIM 64 or 128"),
                             (dict(base, IK_DTYPE=0), "IK_DTYPE 1 (float16) or 2"),
                             (dict(base, STAGES=5), "STAGES 1 to 4"),
                             ({k: v for k, v in base.items() if k != "DETERMINISTIC"}, "-DDETERMINISTIC")):
        rc, err = _compile(tmp_path, defines, extra=(), name="bwd_v4")
        assert rc != 0 and message in err, f"{defines}: rc={rc} {err[:300]}"


def test_bwd_v4_is_a_hopper_source():
    assert "bwd_v4" in hp.SOURCES
    from iokernels.cupy_raw import launch
    assert "bwd_v4" not in launch.SOURCES
    assert "#include" not in hp.source("bwd_v4")
    assert hp.source("bwd_v4").count("struct __align__(64) TmaMap") == 1


# --------------------------------------------------------------------------- config (no GPU)
def test_config_v4_fields_are_validated_naming_the_field():
    for kw, field in ((dict(block_q=128), "config.block_q"), (dict(block_k=64), "config.block_k"),
                      (dict(stages=0), "config.stages"), (dict(stages=BWD_V4_MAX_STAGES + 1), "config.stages"),
                      (dict(stages=True), "config.stages"), (dict(num_warps=8), "config.num_warps"),
                      (dict(lanes_per_key=4), "config.lanes_per_key")):
        with pytest.raises(ValueError, match=field) as e:
            BackwardConfig("v4", **kw)
        assert "v4" in str(e.value) or "positive integer" in str(e.value)
    for dtype, d, why in (("float32", 128, "float16/bfloat16"), ("bfloat16", 96, "head_dim 64 or 128"),
                          ("float16", 256, "head_dim 64 or 128")):
        with pytest.raises(ValueError, match="config.version") as e:
            BackwardConfig("v4").resolve(d, dtype)
        assert "'v4'" in str(e.value) and why in str(e.value)
    with pytest.raises(ValueError, match="config.stages") as e:     # 4 x 32 KB of Q_i, dO_i at d = 128
        BackwardConfig("v4", stages=4).resolve(128, "bfloat16", hp.FALLBACK_SMEM_OPTIN)
    assert "v4 with 4 stages" in str(e.value)


def test_config_v4_resolves_to_its_fixed_tiles():
    cfg = BackwardConfig("v4", deterministic=True).resolve(128, "bfloat16", hp.FALLBACK_SMEM_OPTIN)
    assert (cfg.block_q, cfg.block_k, cfg.stages, cfg.deterministic) == (64, 128, policy.BWD_V4_STAGES, True)
    assert cfg.defines(128, "bfloat16") == dict(IK_DTYPE=2, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=128,
                                                 STAGES=policy.BWD_V4_STAGES, DETERMINISTIC=1)
    # K_j, V_j (128 keys) + 2 x (Q_i, dO_i) + 2 x dS^T [128][64] (16-bit), 2 x (LSE_i, D_i), 5 mbarriers, slack
    assert BackwardConfig.smem_bytes(64, 128, 128, "bfloat16", "v4", 2) == \
        2 * 128 * 128 * 2 + 2 * 2 * 64 * 128 * 2 + 2 * 128 * 64 * 2 + 2 * 2 * 64 * 4 + 8 * 5 + 1024
    assert [_v4_fits(128, s) for s in range(1, 5)] == [True, True, True, False]
    assert all(_v4_fits(64, s) for s in range(1, 5))
    assert BackwardConfig("v4", stages=4).resolve(64, "float16", hp.FALLBACK_SMEM_OPTIN).stages == 4


# --------------------------------------------------------------------------- registry (no GPU)
def test_v4_is_held_back_v3_stays_the_default(hopper_here):
    """bwd_v4 is registered above v3 (rank 40) but held back in policy.HELD_BACK until a GPU has
    measured it: on Hopper the default stays v3, and the version tables say it is held back."""
    assert policy.HELD_BACK[("attention_backward", "v4")] == \
        "its GPU tests and a benchmark record faster than bwd_v3 on Hopper"
    v4 = REGISTRY.get("attention_backward", "v4")
    assert v4.rank == 40 > REGISTRY.get("attention_backward", "v3").rank
    assert v4.file == "bwd_v4.cu" and v4.kernel == "bwd_v4_main"
    assert v4.summary.endswith("(held back from the default until measured)")
    for dtype in DTYPES:
        for d in BWD_V4_HEAD_DIMS:
            assert v4.unavailable(_need(dtype, d)) is None
            assert v4.not_default(_need(dtype, d)).startswith("not the default until measured (its GPU tests")
            kernel, cfg = REGISTRY.resolve("attention_backward", None, _need(dtype, d))
            assert kernel.version == cfg.version == "v3"
            kernel, cfg = REGISTRY.resolve("attention_backward", BackwardConfig(deterministic=True), _need(dtype, d))
            assert kernel.version == "v3" and cfg.deterministic


def test_v4_runs_when_named(hopper_here):
    for det in (False, True):
        kernel, cfg = REGISTRY.resolve("attention_backward", BackwardConfig("v4", deterministic=det), _need())
        assert kernel.version == "v4" and kernel.file == "bwd_v4.cu" and cfg.deterministic == det


def test_the_gate_opens_in_one_place(hopper_here, monkeypatch):
    """Take v4 out of policy.HELD_BACK and it is the default on Hopper at once (its rank is the
    highest), v2 still elsewhere; its summary drops the held-back note."""
    monkeypatch.delitem(policy.HELD_BACK, ("attention_backward", "v4"))
    for dtype in DTYPES:
        for d in BWD_V4_HEAD_DIMS:
            kernel, cfg = REGISTRY.resolve("attention_backward", None, _need(dtype, d))
            assert kernel.version == cfg.version == "v4"
    assert REGISTRY.resolve("attention_backward", BackwardConfig(deterministic=True), _need())[1].deterministic
    assert REGISTRY.resolve("attention_backward", None, _need(cc=80))[0].version == "v2"
    assert REGISTRY.resolve("attention_backward", None, _need(d=96))[0].version == "v2"
    assert policy.held_back_note("attention_backward", "v4") == ""


@pytest.mark.parametrize("need, why", [(_need(cc=80), "compute capability 9.0"),
                                       (_need(cc=89), "compute capability 9.0"),
                                       (_need("float32"), "float16/bfloat16"),
                                       (_need(d=96), "head_dim 64 or 128"),
                                       (_need(d=256), "head_dim 64 or 128")])
def test_v4_is_refused_by_name(hopper_here, need, why):
    with pytest.raises(ValueError, match="config.version") as e:
        REGISTRY.resolve("attention_backward", BackwardConfig("v4"), need)
    assert "v4" in str(e.value) and why in str(e.value)


def test_v4_is_refused_without_what_hopper_needs(monkeypatch):
    monkeypatch.setattr(hp.checks, "available", lambda: "no CUDA device visible to CuPy")
    with pytest.raises(ValueError, match="config.version.*no CUDA device"):
        REGISTRY.resolve("attention_backward", BackwardConfig("v4"), _need())
    assert "simulator" in REGISTRY.get("attention_backward", "v4").unavailable(
        Need(dtype="float16", head_dim=64, simulator=True))


def test_sanitizer_runs_v4():
    from iokernels.cupy_raw import sanitize as S
    assert ("attention_backward", "v4") in S.VARIANTS
    assert {kw.get("stages") for kw in S.VARIANTS[("attention_backward", "v4")]} == {None, 1, 3}


def test_the_backward_benchmark_has_a_v4_row(hopper_here):
    """The benchmark's backward section times one row per registered version: v4 is one, v3 the
    default (marked), on a Hopper GPU."""
    from iokernels.bench.runners import registry_versions
    from iokernels.core.testing import make_inputs
    q, k, v = make_inputs(np.random.default_rng(0), heads_q=4, heads_kv=2, seqlen_q=8, seqlen_k=8, head_dim=128,
                          dtype="bfloat16")
    rows = registry_versions("cupy", "attention_backward", q=q, k=k, v=v)
    if isinstance(rows[0][1], Exception):
        pytest.skip(f"the CuPy backend is not importable here: {rows[0][1]}")
    assert [(name, cfg.version, default) for name, cfg, default in rows][-2:] == [
        ("cupy:v3", "v3", True), ("cupy:v4", "v4", False)]


# --------------------------------------------------------------------------- on a Hopper GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", BWD_V4_HEAD_DIMS)
@pytest.mark.parametrize("N", (1, 127, 1024, 4096))
@pytest.mark.parametrize("causal", (False, True))
def test_v4_two_x_rule(rng, d, N, causal):
    """v4's dQ, dK, dV as v3's test_two_x_rule: float16 and bfloat16, both dQ modes, GQA,
    N_k = N_q + 37 (a 128-key tile whose second warpgroup's keys run past N_k)."""
    from iokernels.core.testing import check_gradients, make_grid_inputs, numpy_dtype, oracle_by_head, report
    B, Hq, Hkv, Nq, Nk = _grad_shape(N)
    q, k, v, do = make_grid_inputs(rng, B, Hq, Hkv, Nq, Nk, d)
    o64, lse64, *refs = oracle_by_head(do, q, k, v, causal=causal)
    checks = []
    for dtype in DTYPES:
        nd = numpy_dtype(dtype)
        qd, kd, vd, dod, od = (x.astype(nd) for x in (q, k, v, do, o64))
        lse = lse64.astype(np.float32)
        bases = _naive_grads(dod, qd, kd, vd, od, lse, causal, dtype)
        for det in (False, True):
            cfg = BackwardConfig("v4", deterministic=det)
            got = ik.attention_backward(dod, qd, kd, vd, od, lse, causal=causal, backend="cupy", config=cfg)
            checks += check_gradients(got, refs, bases, dtype=dtype, factor=GRAD_FACTOR,
                                      label=f"{dtype} v4 {'deterministic' if det else 'atomic'}")
    assert all(checks), report(checks)


#: v3's awkward shapes for v4 (four stages only at d = 64: at 128 they do not fit the SRAM), and a
#: causal case whose N_k leaves the second warpgroup of its one tile a single key
AWKWARD_V4 = [
    ("causal GQA4 N=127", "bfloat16", 128, 8, 2, 127, 127, True, None, {}),
    ("window (64, 16) Nq<Nk four stages", "bfloat16", 64, 4, 1, 300, 1000, False, (64, 16), dict(stages=4)),
    ("causal Nq>Nk: masked rows", "float16", 128, 4, 4, 1000, 300, True, None, dict(deterministic=True)),
    ("window (-1, 5) one stage", "float16", 64, 4, 2, 200, 333, False, (-1, 5), dict(stages=1)),
    ("window (7, 0) three stages", "bfloat16", 128, 4, 1, 100, 190, False, (7, 0), dict(stages=3)),
    ("MQA 16/1 N=65", "float16", 64, 16, 1, 65, 65, False, None, {}),
    ("causal Nk=65: a half with one key", "bfloat16", 128, 4, 2, 70, 65, True, None, dict(deterministic=True)),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", AWKWARD_V4, ids=[c[0] for c in AWKWARD_V4])
def test_v4_awkward_shapes(rng, case):
    """v3's awkward shapes run by v4: lengths off the 128-key tile, windows cut through either
    warpgroup's half, rows that see no key (dQ exactly 0), the ring at one to four stages."""
    from iokernels import conventions as cv, reference
    from iokernels.core.testing import check, make_inputs
    label, dtype, d, hq, hkv, nq, nk, causal, window, kw = case
    q, k, v = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype)
    do = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hq, seqlen_q=nq, seqlen_k=1, head_dim=d, dtype=dtype)[0]
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    refs = reference.attention_backward(do, q, k, v, causal=causal, window=window)
    bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="naive")
    cfg = BackwardConfig("v4", **kw)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="cupy", config=cfg)
    blind = ~cv.mask(nq, nk, causal, window).any(axis=-1)[None, None, :, None]
    checks = [check(g, r, b, dtype=dtype, name=n, factor=AWKWARD_FACTOR, masked_rows=blind if n == "dq" else None)
              for n, g, r, b in zip(("dq", "dk", "dv"), got, refs, bases)]
    assert all(checks), f"v4 {label} {cfg}: " + "; ".join(str(c) for c in checks)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", BWD_V4_HEAD_DIMS)
def test_v4_deterministic_mode_repeats_bit_for_bit(d):
    torch = _torch()
    q, k, v, do = (torch.randn((2, 4, 1000, d), device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True)
    cfg = BackwardConfig("v4", deterministic=True)
    a = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg)
    b = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", BWD_V4_HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True))
def test_v4_agrees_with_v3(d, causal):
    """v4 and v3 compute the same gradients (dQ's sums over the keys grouped otherwise: 128-key
    partials instead of 64-key ones), so they agree to the rounding of 16-bit outputs; GQA 8/2,
    N_q != N_k, both in their deterministic mode."""
    torch = _torch()
    q, do = (torch.randn((2, 8, 700, d), device="cuda", dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn((2, 2, 900, d), device="cuda", dtype=torch.float16) for _ in range(2))
    o, lse = ik.attention(q, k, v, causal=causal, backend="cupy", return_lse=True)
    g3 = ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend="cupy",
                               config=BackwardConfig("v3", deterministic=True))
    g4 = ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend="cupy",
                               config=BackwardConfig("v4", deterministic=True))
    for name, a, b in zip(("dq", "dk", "dv"), g3, g4):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 1e-2 * max(1.0, a.float().abs().max().item()), f"{name}: v3 and v4 differ by {err}"
