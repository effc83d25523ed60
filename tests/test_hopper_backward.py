"""The Hopper backward (bwd_v3.cu: one consumer warpgroup, 64 keys a tile; bwd_v4.cu: two
consumer warpgroups, 128 keys a tile; bwd_v5.cu: v4's kernel, its blocks longest first;
bwd_v6.cu: v5 with dQ added to HBM from SRAM): compiled everywhere, run where there is a Hopper
GPU.

Every check that the versions share is one test parametrized over the version (ids "v3" ..
"v6"); what differs between them (head dims, tiles, ring depths, the compile list, the
refusals that name a tile, the awkward shapes) is the table VERSIONS below.

Without a GPU (CI): each source compiles with nvcc for sm_90a from exactly the source and
defines the launcher hands NVRTC, for each dtype x head dim x dQ mode and each ring depth its
table lists; ``-Xptxas -v`` must show no local memory (no spills, no stack frame), no wgmma
serialisation (ptxas C7515, C7512) and no ignored setmaxnreg (C7508); the source refuses what it
cannot run with #error; BackwardConfig's fields are validated naming the field; the registry
makes v6 the default on Hopper (the gate in cupy_raw/policy.py: v4 below it), holds v5 back from
the default until measured (a config naming it runs it; the gate opens in that one table), runs
each version when a config names it and refuses it by name where it cannot run.  The launch arguments,
grid and tensor maps are checked against the kernels' signatures in tests/test_cupy_launch_args.py
(a CuPy stand-in).

With compute capability 9.0, for each version: dQ, dK, dV held to the float64 gradients by
FlashAttention's 2x rule (the naive backward in the same dtype, on the GPU, from the same O and
LSE, is the baseline) at d in {64, 128}, N in {1, 127, 1024, 4096}, causal and not, GQA,
N_q != N_k, both dQ modes; windows and rows that see no key; the deterministic mode bit for bit
across runs.  Then v5 and v6 giving v4's bits (deterministic dQ) with their pairs grouped every
way, v4 agreeing with v3, and v3's cached plan giving the eager launch's bits.
Skipped elsewhere with the reason.
"""

import numpy as np
import pytest

import iokernels as ik
from iokernels.core.registry import Need
from iokernels.cupy_raw import REGISTRY, hopper as hp, policy
from iokernels.cupy_raw.config import (BWD_V3_HEAD_DIMS, BWD_V3_MAX_STAGES, BWD_V4_HEAD_DIMS, BWD_V4_MAX_STAGES,
                                        BackwardConfig)

from gpu_support import cuda_torch as _torch
from nvcc_support import NVCC, PTXAS_V, compile_all, compile_source, registers_only

DTYPES = ("float16", "bfloat16")

#: what differs between the two versions; every test below that takes ``version`` reads it here
VERSIONS = {
    "v3": dict(
        head_dims=BWD_V3_HEAD_DIMS, max_stages=BWD_V3_MAX_STAGES, default_stages=policy.BWD_V3_STAGES,
        block_q=64, block_k=64, dq_sram=0,
        # the compile list's extra ring depths: every one, at bfloat16 d = 128 (the most registers),
        # the default depth included (compiled again under its ring label)
        ring_head_dims=(128,), ring_repeats_default=True,
        # tiles the source refuses with #error, and the message
        tile_refusals=((dict(BLOCK_M=128), "BLOCK_M = BLOCK_N = 64"), (dict(BLOCK_N=128), "BLOCK_M = BLOCK_N = 64")),
        # BackwardConfig keywords refused naming the field (the rest are shared)
        bad_fields=((dict(block_q=32), "config.block_q"), (dict(block_k=128), "config.block_k"),
                    (dict(num_warps=4), "config.num_warps")),
        # whether each ring depth 1..max_stages fits an H100's SRAM, by head dim
        fits={64: [True, True, True, True], 128: [True, True, True, True]},
        # the ring depths the sanitizer runs (None: the default)
        sanitized_stages={None, 1},
        # the awkward shapes: (label, dtype, d, heads_q, heads_kv, Nq, Nk, causal, window, config keywords)
        awkward=[
            ("causal GQA4 N=127", "bfloat16", 128, 8, 2, 127, 127, True, None, {}),
            ("window (64, 16) Nq<Nk", "bfloat16", 64, 4, 1, 300, 1000, False, (64, 16), {}),
            ("causal Nq>Nk: masked rows", "float16", 128, 4, 4, 1000, 300, True, None, dict(deterministic=True)),
            ("window (-1, 5) one stage", "float16", 64, 4, 2, 200, 333, False, (-1, 5), dict(stages=1)),
            ("window (7, 0) four stages", "bfloat16", 128, 4, 1, 100, 190, False, (7, 0), dict(stages=4)),
            ("MQA 16/1 N=65", "float16", 64, 16, 1, 65, 65, False, None, {}),
        ],
    ),
    "v4": dict(
        head_dims=BWD_V4_HEAD_DIMS, max_stages=BWD_V4_MAX_STAGES, default_stages=policy.BWD_V4_STAGES,
        block_q=64, block_k=128, dq_sram=0,
        # every other ring depth that fits, at bfloat16 and each head dim
        ring_head_dims=BWD_V4_HEAD_DIMS, ring_repeats_default=False,
        tile_refusals=((dict(BLOCK_N=64), "BLOCK_M = 64 and BLOCK_N = 128"),
                       (dict(BLOCK_M=128), "BLOCK_M = 64 and BLOCK_N = 128")),
        bad_fields=((dict(block_q=128), "config.block_q"), (dict(block_k=64), "config.block_k"),
                    (dict(num_warps=8), "config.num_warps")),
        fits={64: [True, True, True, True], 128: [True, True, True, False]},   # 4 x 32 KB of Q_i, dO_i at 128
        sanitized_stages={None, 1, 3},
        # v3's awkward shapes (four stages only at d = 64: at 128 they do not fit the SRAM, so three),
        # and a causal case whose N_k leaves the second warpgroup of its one tile a single key
        awkward=[
            ("causal GQA4 N=127", "bfloat16", 128, 8, 2, 127, 127, True, None, {}),
            ("window (64, 16) Nq<Nk four stages", "bfloat16", 64, 4, 1, 300, 1000, False, (64, 16), dict(stages=4)),
            ("causal Nq>Nk: masked rows", "float16", 128, 4, 4, 1000, 300, True, None, dict(deterministic=True)),
            ("window (-1, 5) one stage", "float16", 64, 4, 2, 200, 333, False, (-1, 5), dict(stages=1)),
            ("window (7, 0) three stages", "bfloat16", 128, 4, 1, 100, 190, False, (7, 0), dict(stages=3)),
            ("MQA 16/1 N=65", "float16", 64, 16, 1, 65, 65, False, None, {}),
            ("causal Nk=65: a half with one key", "bfloat16", 128, 4, 2, 70, 65, True, None, dict(deterministic=True)),
        ],
    ),
}
#: v5 is v4's kernel with its blocks in another order, v6 v5's with dQ added from SRAM:
#: v4's tiles, rings, refusals and shapes
VERSIONS["v5"] = dict(VERSIONS["v4"])
#: (v6 also holds the two consumer warpgroups' dQ panels in SRAM, 64 x 64 float32 each; v4's ring
#: depths still fit, three at d = 128 with 456 bytes to spare)
VERSIONS["v6"] = dict(VERSIONS["v4"], dq_sram=2 * 64 * 64 * 4)


def _version_cases(key):
    """(version, case) for every case of every version's VERSIONS[version][key] list."""
    return [(version, case) for version, info in VERSIONS.items() for case in info[key]]


# --------------------------------------------------------------------------- compile (no GPU)
def _compile(tmp_path, defines, extra=PTXAS_V, name="bwd_v3"):
    return compile_source(tmp_path, name, hp.source(name), defines, extra=extra)


def _fits(version, d, stages, dtype="bfloat16"):
    """Whether the launcher can pick ``stages`` at head dim ``d`` (v4's four do not fit at d = 128)."""
    info = VERSIONS[version]
    return BackwardConfig.smem_bytes(info["block_q"], info["block_k"], d, dtype, version, stages) \
        <= hp.FALLBACK_SMEM_OPTIN


def _jobs(version="v3"):
    """(label, defines) of bwd_<version>.cu: every dtype x head dim x dQ mode at the default ring,
    and the other ring depths that fit at bfloat16, at the head dims VERSIONS lists for them
    (the define sets the launcher can hand NVRTC).  scripts/ptx_same.py compiles these too."""
    info = VERSIONS[version]
    jobs = []
    for dtype in DTYPES:
        for d in info["head_dims"]:
            for det in (False, True):
                cfg = BackwardConfig(version, deterministic=det)
                jobs.append((f"{dtype} d={d} deterministic={det}", cfg.defines(d, dtype)))
    for d in info["ring_head_dims"]:
        for stages in range(1, info["max_stages"] + 1):
            if (info["ring_repeats_default"] or stages != info["default_stages"]) and _fits(version, d, stages):
                cfg = BackwardConfig(version, stages=stages)
                jobs.append((f"stages={stages} bfloat16 d={d}", cfg.defines(d, "bfloat16")))
    return jobs


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("version", VERSIONS)
def test_bwd_compiles_for_sm90a_in_registers(tmp_path, version):
    """bwd_v3.cu and bwd_v4.cu: no spills, no stack frame, no serialised wgmma, no ignored
    setmaxnreg (v4: the producer's 32 and the consumers' 232 registers hold), for every define
    set the launcher uses; the list reaches every ring depth 1 to 4."""
    jobs = _jobs(version)
    assert {j[1]["STAGES"] for j in jobs} == set(range(1, VERSIONS[version]["max_stages"] + 1)) == {1, 2, 3, 4}
    results = compile_all(lambda j: _compile(tmp_path, j[1], name=f"bwd_{version}"), jobs)
    for (label, defines), (rc, err) in zip(jobs, results):
        registers_only(f"bwd_{version} {label}", rc, err)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("version", VERSIONS)
def test_bwd_source_refuses_what_it_cannot_run(tmp_path, version):
    """bwd_v3.cu and bwd_v4.cu stop with #error on a tile other than their own (v3: 64 x 64;
    v4: 64 x 128), a head dim other than 64 or 128, a dtype other than float16/bfloat16, a ring
    deeper than 4, and a missing -DDETERMINISTIC."""
    base = BackwardConfig(version).defines(128, "bfloat16")
    cases = [(dict(base, **tile), message) for tile, message in VERSIONS[version]["tile_refusals"]]
    cases += [(dict(base, HEAD_DIM=256), "HEAD_DIM 64 or 128"),
              (dict(base, IK_DTYPE=0), "IK_DTYPE 1 (float16) or 2"),
              (dict(base, STAGES=5), "STAGES 1 to 4"),
              ({k: v for k, v in base.items() if k != "DETERMINISTIC"}, "-DDETERMINISTIC")]
    for defines, message in cases:
        rc, err = _compile(tmp_path, defines, extra=(), name=f"bwd_{version}")
        assert rc != 0 and message in err, f"bwd_{version} {defines}: rc={rc} {err[:300]}"


@pytest.mark.parametrize("version", VERSIONS)
def test_bwd_is_a_hopper_source(version):
    """bwd_v3 and bwd_v4 are Hopper sources, never compiled for the portable archs, their
    headers inlined, each once."""
    name = f"bwd_{version}"
    assert name in hp.SOURCES
    from iokernels.cupy_raw import launch
    assert name not in launch.SOURCES                # never compiled for the portable archs
    assert "#include" not in hp.source(name)         # headers inlined, each once
    assert hp.source(name).count("struct __align__(64) TmaMap") == 1


# --------------------------------------------------------------------------- config (no GPU)
@pytest.mark.parametrize("version", VERSIONS)
def test_config_fields_are_validated_naming_the_field(version):
    """BackwardConfig("v3") and BackwardConfig("v4") refuse, naming the field (and the version
    or the rule), a tile other than their own, a ring depth out of 1 to 4 or not an integer,
    v2's num_warps and v1's lanes_per_key; resolving refuses, naming config.version and the
    version, float32 and head dims other than 64 or 128; and a ring too deep for the SRAM
    (every depth that does not fit an H100's, and four at d = 128 in 100 KB) naming
    config.stages."""
    info = VERSIONS[version]
    for kw, field in info["bad_fields"] + (
            (dict(stages=0), "config.stages"), (dict(stages=info["max_stages"] + 1), "config.stages"),
            (dict(stages=True), "config.stages"), (dict(lanes_per_key=4), "config.lanes_per_key")):
        with pytest.raises(ValueError, match=field) as e:
            BackwardConfig(version, **kw)
        assert version in str(e.value) or "positive integer" in str(e.value)
    for dtype, d, why in (("float32", 128, "float16/bfloat16"), ("bfloat16", 96, "head_dim 64 or 128"),
                          ("float16", 256, "head_dim 64 or 128")):
        with pytest.raises(ValueError, match="config.version") as e:
            BackwardConfig(version).resolve(d, dtype)
        assert f"'{version}'" in str(e.value) and why in str(e.value)
    too_deep = [(128, 4, 100 * 1024)] + [(d, s + 1, hp.FALLBACK_SMEM_OPTIN)
                                         for d, fits in info["fits"].items() for s, ok in enumerate(fits) if not ok]
    for d, stages, smem in too_deep:
        with pytest.raises(ValueError, match="config.stages") as e:
            BackwardConfig(version, stages=stages).resolve(d, "bfloat16", smem)
        assert f"{version} with {stages} stages" in str(e.value)


def test_config_stages_is_the_hopper_versions_alone():
    """The ring depth is a v3/v4 setting: the portable versions (and no version) refuse it."""
    for version in (None, "v1", "v2"):
        with pytest.raises(ValueError, match="config.stages"):
            BackwardConfig(version, stages=2)


@pytest.mark.parametrize("version", VERSIONS)
def test_config_resolves_to_its_fixed_tiles(version):
    """v3 resolves to 64 x 64 tiles, v4 to 64 x 128, each at its default ring depth, with the
    defines that say so; the SRAM sum is K_j, V_j + 2 x (Q_i, dO_i) + 2 x dS^T + 2 x (LSE_i, D_i)
    + 5 mbarriers + slack (v6: + its dQ panels); which ring depths fit an H100's SRAM at each head dim (v3: all;
    v4: not four at d = 128), and each that fits resolves as asked."""
    info = VERSIONS[version]
    bq, bk, stages = info["block_q"], info["block_k"], info["default_stages"]
    cfg = BackwardConfig(version, deterministic=True).resolve(128, "bfloat16", hp.FALLBACK_SMEM_OPTIN)
    assert (cfg.block_q, cfg.block_k, cfg.stages, cfg.deterministic) == (bq, bk, stages, True)
    assert cfg.defines(128, "bfloat16") == dict(IK_DTYPE=2, HEAD_DIM=128, BLOCK_M=bq, BLOCK_N=bk,
                                                 STAGES=stages, DETERMINISTIC=1)
    # K_j, V_j + 2 x (Q_i, dO_i) + 2 x dS^T (16-bit), 2 x (LSE_i, D_i), 5 mbarriers, the alignment slack
    assert BackwardConfig.smem_bytes(bq, bk, 128, "bfloat16", version, 2) == \
        2 * bk * 128 * 2 + 2 * 2 * bq * 128 * 2 + 2 * bk * bq * 2 + 2 * 2 * bq * 4 + 8 * 5 + 1024 + info["dq_sram"]
    assert sorted(info["fits"]) == sorted(info["head_dims"])
    for d, fits in info["fits"].items():
        for dtype in DTYPES:
            assert [_fits(version, d, s, dtype) for s in range(1, info["max_stages"] + 1)] == fits
        for s in range(1, info["max_stages"] + 1):
            if fits[s - 1]:
                assert BackwardConfig(version, stages=s).resolve(d, "float16", hp.FALLBACK_SMEM_OPTIN).stages == s


# --------------------------------------------------------------------------- registry (no GPU)
def _need(dtype="bfloat16", d=128, cc=90):
    return Need(dtype=dtype, head_dim=d, cc=cc, extra=dict(smem=hp.FALLBACK_SMEM_OPTIN, group=2, aligned16=True))


@pytest.fixture
def hopper_here(monkeypatch):
    """This machine as a Hopper one with cuda-python (what hopper.checks.available reports)."""
    monkeypatch.setattr(hp.checks, "available", lambda: None)


@pytest.mark.parametrize("version", VERSIONS)
def test_runs_when_named(hopper_here, version):
    """A config naming v3 runs bwd_v3.cu, one naming v4 runs bwd_v4.cu, in either dQ mode."""
    for det in (False, True):
        kernel, cfg = REGISTRY.resolve("attention_backward", BackwardConfig(version, deterministic=det), _need())
        assert kernel.version == version and kernel.file == f"bwd_{version}.cu" and cfg.deterministic == det


@pytest.mark.parametrize("need, why", [(_need(cc=80), "compute capability 9.0"),
                                       (_need(cc=89), "compute capability 9.0"),
                                       (_need("float32"), "float16/bfloat16"),
                                       (_need(d=96), "head_dim 64 or 128"),
                                       (_need(d=256), "head_dim 64 or 128")])
@pytest.mark.parametrize("version", VERSIONS)
def test_is_refused_by_name(hopper_here, version, need, why):
    """A config naming v3 or v4 where it cannot run (not compute capability 9.0, float32, a
    head dim other than 64 or 128) is refused naming config.version, the version and why."""
    with pytest.raises(ValueError, match="config.version") as e:
        REGISTRY.resolve("attention_backward", BackwardConfig(version), need)
    assert version in str(e.value) and why in str(e.value)


@pytest.mark.parametrize("version", VERSIONS)
def test_is_refused_without_what_hopper_needs(monkeypatch, version):
    """v3 and v4 named where hopper.checks finds no CUDA device are refused saying so; the
    simulator cannot run either."""
    monkeypatch.setattr(hp.checks, "available", lambda: "no CUDA device visible to CuPy")
    with pytest.raises(ValueError, match="config.version.*no CUDA device"):
        REGISTRY.resolve("attention_backward", BackwardConfig(version), _need())
    assert "simulator" in REGISTRY.get("attention_backward", version).unavailable(
        Need(dtype="float16", head_dim=64, simulator=True))


@pytest.mark.parametrize("version", VERSIONS)
def test_sanitizer_runs(version):
    """The sanitizer runs v3 and v4, at a head dim each takes, at the ring depths VERSIONS lists
    (v3: the default and one; v4: the default, one and three)."""
    from iokernels.cupy_raw import sanitize as S
    assert ("attention_backward", version) in S.VARIANTS
    assert any(d in VERSIONS[version]["head_dims"] for d in S.BACKWARD_HEAD_DIMS)
    assert {kw.get("stages") for kw in S.VARIANTS[("attention_backward", version)]} == \
        VERSIONS[version]["sanitized_stages"]


def _assert_the_default_on_hopper(version, head_dims):
    """``version`` runs and is the default on Hopper at every dtype and head dim it takes, with
    ``deterministic`` travelling with the choice; v2 on an Ampere GPU and at head_dim 96."""
    rec = REGISTRY.get("attention_backward", version)
    for dtype in DTYPES:
        for d in head_dims:
            assert rec.unavailable(_need(dtype, d)) is None and rec.not_default(_need(dtype, d)) is None
            kernel, cfg = REGISTRY.resolve("attention_backward", None, _need(dtype, d))
            assert kernel.version == cfg.version == version
            kernel, cfg = REGISTRY.resolve("attention_backward", BackwardConfig(deterministic=True), _need(dtype, d))
            assert kernel.version == version and cfg.deterministic
    assert REGISTRY.resolve("attention_backward", None, _need(cc=80))[0].version == "v2"
    assert REGISTRY.resolve("attention_backward", None, _need(d=96))[0].version == "v2"


def _hold_back(monkeypatch, *versions):
    """Put these backward versions in policy.HELD_BACK for one test."""
    for version in versions:
        monkeypatch.setitem(policy.HELD_BACK, ("attention_backward", version), "a test holds it back")


def test_v3_is_the_default_below_v4(hopper_here, monkeypatch):
    """Measured (its GPU tests passed, and the benchmark recorded it faster than v2 on Hopper),
    v3 is out of policy.HELD_BACK: with the versions above it held back it is the default on
    Hopper for every dtype and head dim it runs, v2 elsewhere; ``deterministic`` travels with
    the choice."""
    assert ("attention_backward", "v3") not in policy.HELD_BACK
    _hold_back(monkeypatch, "v4", "v6")
    assert REGISTRY.get("attention_backward", "v3").rank > REGISTRY.get("attention_backward", "v2").rank
    _assert_the_default_on_hopper("v3", BWD_V3_HEAD_DIMS)


def test_held_back_again_the_default_is_v2(hopper_here, monkeypatch):
    """The gate is one table: put v3, v4 and v6 back in policy.HELD_BACK and the default is v2 again."""
    _hold_back(monkeypatch, "v3", "v4", "v6")
    v3 = REGISTRY.get("attention_backward", "v3")
    assert v3.not_default(_need()).startswith("not the default until measured")
    assert REGISTRY.resolve("attention_backward", None, _need())[0].version == "v2"


def test_v4_is_the_default_below_v6(hopper_here, monkeypatch):
    """bwd_v4 is registered above v3 (rank 40) and out of policy.HELD_BACK: with v6 held back it
    is the default on Hopper at every dtype and head dim it takes, deterministic or not; v2
    elsewhere."""
    assert ("attention_backward", "v4") not in policy.HELD_BACK
    v4 = REGISTRY.get("attention_backward", "v4")
    assert v4.rank == 40 > REGISTRY.get("attention_backward", "v3").rank
    assert v4.file == "bwd_v4.cu" and v4.kernel == "bwd_v4_main"
    assert "held back" not in v4.summary
    _hold_back(monkeypatch, "v6")
    _assert_the_default_on_hopper("v4", BWD_V4_HEAD_DIMS)


def test_v6_is_the_default_on_hopper(hopper_here):
    """bwd_v6 is registered at rank 60, above v4 and the held-back v5, and out of policy.HELD_BACK
    (its GPU tests passed and a benchmark recorded it ahead of v4 and v5, causal and not): on
    Hopper it is the default at every dtype and head dim it takes, deterministic or not; v2
    elsewhere."""
    assert ("attention_backward", "v6") not in policy.HELD_BACK
    v6 = REGISTRY.get("attention_backward", "v6")
    assert v6.rank == 60 > REGISTRY.get("attention_backward", "v5").rank
    assert (v6.file, v6.kernel, v6.extra["finish"]) == ("bwd_v6.cu", "bwd_v6_main", "bwd_v6_finish")
    assert "held back" not in v6.summary
    _assert_the_default_on_hopper("v6", BWD_V4_HEAD_DIMS)


def test_the_gate_closes_in_one_place(hopper_here, monkeypatch):
    """Put v6 back in policy.HELD_BACK and v4 is the default on Hopper at once (v5 stays held
    back); v6's summary says it is held back, and a config naming v6 still runs it."""
    _hold_back(monkeypatch, "v6")
    v6 = REGISTRY.get("attention_backward", "v6")
    for dtype in DTYPES:
        for d in BWD_V4_HEAD_DIMS:
            assert v6.not_default(_need(dtype, d)).startswith("not the default until measured (a test")
            kernel, cfg = REGISTRY.resolve("attention_backward", None, _need(dtype, d))
            assert kernel.version == cfg.version == "v4"
    assert REGISTRY.resolve("attention_backward", BackwardConfig(version="v6"), _need())[0].version == "v6"
    assert policy.held_back_note("attention_backward", "v6") == " (held back from the default until measured)"


def test_the_backward_benchmark_has_v4_v5_and_v6_rows(hopper_here):
    """The benchmark's backward section times one row per registered version: v3, v4 and v5 (held
    back), and v6, the default (marked), on a Hopper GPU."""
    from iokernels.bench.runners import registry_versions
    from iokernels.core.testing import make_inputs
    q, k, v = make_inputs(np.random.default_rng(0), heads_q=4, heads_kv=2, seqlen_q=8, seqlen_k=8, head_dim=128,
                          dtype="bfloat16")
    rows = registry_versions("cupy", "attention_backward", q=q, k=k, v=v)
    if isinstance(rows[0][1], Exception):
        pytest.skip(f"the CuPy backend is not importable here: {rows[0][1]}")
    assert [(name, cfg.version, default) for name, cfg, default in rows][-4:] == [
        ("cupy:v3", "v3", False), ("cupy:v4", "v4", False), ("cupy:v5", "v5", False), ("cupy:v6", "v6", True)]


def test_v5_is_held_back_until_measured(hopper_here, monkeypatch):
    """bwd_v5 ranks above v4 (50) but sits in policy.HELD_BACK: with v6 held back too, v4 is the
    default, a config naming v5 runs it, its summary says it is held back; out of the table, it
    is the default at every dtype and head dim v4 takes."""
    v5 = REGISTRY.get("attention_backward", "v5")
    assert v5.rank == 50 > REGISTRY.get("attention_backward", "v4").rank
    assert (v5.file, v5.kernel) == ("bwd_v5.cu", "bwd_v5_main") and "held back" in v5.summary
    assert v5.not_default(_need()).startswith("not the default until measured")
    _hold_back(monkeypatch, "v6")
    assert REGISTRY.resolve("attention_backward", None, _need())[0].version == "v4"
    assert REGISTRY.resolve("attention_backward", BackwardConfig("v5"), _need())[0].version == "v5"
    monkeypatch.delitem(policy.HELD_BACK, ("attention_backward", "v5"))
    _assert_the_default_on_hopper("v5", BWD_V4_HEAD_DIMS)


def test_lpt_pairs_fill_one_wave_within_part_of_the_l2_cache():
    """policy.backward_lpt_pairs: under a band with an upper edge, the pairs whose blocks fill one
    wave (SMs / tiles, rounded up), no more than whose Q and dO rows (2 x group x N_q x d x
    itemsize bytes each) fit BWD_V5_L2_SHARE of the L2 cache; at least one, at most all of them.
    Without an upper edge, one (v4's order)."""
    mb = 1 << 20
    per_pair = 2 * 4 * 4096 * 128 * 2                         # GQA 4, N_q 4096, d 128, 16-bit: 8 MB
    assert per_pair == 8 * mb

    def lpt(pairs, group, n, d, l2, banded=True, tiles=32, sms=132):
        return policy.backward_lpt_pairs(pairs, group, n, d, 2, l2, banded=banded, tiles=tiles, sms=sms)
    assert lpt(64, 4, 4096, 128, 50 * mb) == int(policy.BWD_V5_L2_SHARE * 50 * mb) // per_pair
    assert lpt(64, 4, 4096, 128, 50 * mb) == 3                 # 25 MB of 50 MB: three pairs (a wave is 5)
    assert lpt(64, 1, 4096, 128, 50 * mb) == 5                 # 12 fit; 5 x 32 blocks fill 132 SMs
    assert lpt(64, 1, 4096, 128, 50 * mb, tiles=200) == 1      # one pair more than fills a wave
    assert lpt(2, 1, 128, 64, 50 * mb, tiles=1) == 2           # every pair fits: all of them
    assert lpt(8, 8, 131072, 128, 50 * mb) == 1                # one pair over the share: one
    assert lpt(8, 4, 4096, 128, 0) == 1                        # no L2 size reported: one
    for pairs in (1, 7, 64):                                   # no upper edge: v4's order
        assert lpt(pairs, 1, 128, 64, 50 * mb, banded=False, tiles=1) == 1


# --------------------------------------------------------------------------- on a Hopper GPU
gpu = pytest.mark.skipif(hp.available() is not None, reason=f"Hopper kernels: {hp.available()}")
#: FlashAttention's rule for gradients: at most twice the naive backward's error in the same dtype
GRAD_FACTOR = 2.0
#: the awkward shapes (windows cut through tiles, rows that see no key): the sanitizer's 3x
AWKWARD_FACTOR = 3.0


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
@pytest.mark.parametrize("version, d", _version_cases("head_dims"))
@pytest.mark.parametrize("N", (1, 127, 1024, 4096))
@pytest.mark.parametrize("causal", (False, True))
def test_two_x_rule(rng, version, d, N, causal):
    """dQ, dK, dV of v3 and of v4 in float16 and bfloat16, both dQ modes, GQA, N_k = N_q + 37
    (not a multiple of 64; for v4 a 128-key tile whose second warpgroup's keys run past N_k),
    against the float64 gradients by the 2x rule (inputs on a grid both dtypes hold exactly; O
    and LSE the oracle's, rounded as a forward in that dtype stores them).  A failure lists
    every check."""
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
            cfg = BackwardConfig(version, deterministic=det)
            got = ik.attention_backward(dod, qd, kd, vd, od, lse, causal=causal, backend="cupy", config=cfg)
            checks += check_gradients(got, refs, bases, dtype=dtype, factor=GRAD_FACTOR,
                                      label=f"{dtype} {version} {'deterministic' if det else 'atomic'}")
    assert all(checks), report(checks)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version, case", _version_cases("awkward"),
                         ids=[f"{version}-{case[0]}" for version, case in _version_cases("awkward")])
def test_awkward_shapes(rng, version, case):
    """v3's and v4's awkward shapes (VERSIONS[...]["awkward"]): lengths not a multiple of the key
    tile, windows cut through tiles (for v4 through either warpgroup's half), rows that see no
    key (their dQ must be exactly 0, never NaN), the ring at one to four stages; the 3x rule of
    the sanitizer against the float64 gradients with the NumPy naive backward as the baseline."""
    from iokernels import conventions as cv, reference
    from iokernels.core.testing import check, make_inputs
    label, dtype, d, hq, hkv, nq, nk, causal, window, kw = case
    q, k, v = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_k=nk, head_dim=d, dtype=dtype)
    do = make_inputs(rng, batch=2, heads_q=hq, heads_kv=hq, seqlen_q=nq, seqlen_k=1, head_dim=d, dtype=dtype)[0]
    o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive", return_lse=True)
    refs = reference.attention_backward(do, q, k, v, causal=causal, window=window)
    bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="naive")
    cfg = BackwardConfig(version, **kw)
    got = ik.attention_backward(do, q, k, v, o, lse, causal=causal, window=window, backend="cupy", config=cfg)
    blind = ~cv.mask(nq, nk, causal, window).any(axis=-1)[None, None, :, None]     # rows that see no key
    checks = [check(g, r, b, dtype=dtype, name=n, factor=AWKWARD_FACTOR, masked_rows=blind if n == "dq" else None)
              for n, g, r, b in zip(("dq", "dk", "dv"), got, refs, bases)]
    assert all(checks), f"{version} {label} {cfg}: " + "; ".join(str(c) for c in checks)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version, d", _version_cases("head_dims"))
def test_deterministic_mode_repeats_bit_for_bit(version, d):
    """v3's and v4's deterministic mode give the same bits twice (bfloat16, causal, N = 1000);
    their atomic mode the same sums in any order (close, not equal)."""
    torch = _torch()
    q, k, v, do = (torch.randn((2, 4, 1000, d), device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = ik.attention(q, k, v, causal=True, backend="cupy", return_lse=True)
    cfg = BackwardConfig(version, deterministic=True)
    a = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg)
    b = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy", config=cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = ik.attention_backward(do, q, k, v, o, lse, causal=True, backend="cupy",
                              config=BackwardConfig(version, deterministic=False))
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


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", BWD_V4_HEAD_DIMS)
def test_v5_and_v6_give_v4s_bits(monkeypatch, d):
    """v5 is v4's kernel with its blocks in another order, and v6 is v5's with dQ's partials
    written from SRAM by a bulk copy (and read back by its own finish kernel), so in the
    deterministic mode their gradients are v4's bit for bit: causal, a causal window, no mask,
    GQA, N_q != N_k (700 rows: the last Q tile is partial), with the launcher's policy set so
    that a group holds every pair, three pairs (a last group of fewer: 2 x 4 = 8 pairs), or one
    (v4's own order).  A tile run twice or never, or a dQ panel written to the wrong place,
    would change dK, dV or dQ."""
    torch = _torch()
    from iokernels.cupy_raw import backward as bw
    from iokernels.cupy_raw.backward import run_attention_backward
    q, do = (torch.randn((2, 8, 700, d), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((2, 4, 900, d), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for causal, window in ((True, None), (False, (256, 0)), (False, None)):
        o, lse = ik.attention(q, k, v, causal=causal, window=window, backend="cupy", return_lse=True)
        g4 = run_attention_backward(do, q, k, v, o, lse, causal=causal, scale=None, window=window,
                                    config=BackwardConfig("v4", deterministic=True))
        for pairs in (8, 3, 1):
            monkeypatch.setattr(bw, "backward_lpt_pairs", lambda *args, pairs=pairs, **kw: pairs)
            for version in ("v5", "v6"):
                g = run_attention_backward(do, q, k, v, o, lse, causal=causal, scale=None, window=window,
                                           config=BackwardConfig(version, deterministic=True))
                for name, a, b in zip(("dq", "dk", "dv"), g4, g):
                    assert torch.equal(a, b), f"{name}: {version} (groups of {pairs} pairs) differs from v4, " \
                                              f"causal={causal} window={window}"


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
