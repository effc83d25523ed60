"""The Hopper kernels (iokernels.cupy_raw.hopper): compiled everywhere, run where there is one.

Without a GPU (CI): every .cu file compiles with nvcc for sm_90a
(``-gencode=arch=compute_90a,code=sm_90a -cubin``) from exactly the source and defines the
launcher hands NVRTC, for each dtype, head dim and tile setting; ``-Xptxas -v`` must show no
local memory (no spills, no stack frame), no wgmma serialisation (ptxas C7515) and no ignored
setmaxnreg (C7508); fa_v6 (head_dim 64, three consumer warpgroups of 160 registers) in every
define set its config makes; the sources refuse what they cannot run with #error; the config,
the input checks and the registry hook are pure Python, v6 held back from the default until
measured (policy.HELD_BACK), v7's and v8's head-dim gates (policy.hopper_v7_default_at,
hopper_v8_default_at: 256).

With compute capability 9.0: FlashAttention's 2x rule against the float64 oracle
(``hopper.oracle_check``: outputs poisoned with NaN, the oracle on the first and last rows) at
d in {64, 128, 256} (v6 at 64 only), N in {1, 127, 1024, 4096}, causal and not, GQA and
Nq != Nk; v6's fully masked rows, windows, other tile settings and its agreement with v5; v7
equal to v5 bit for bit (its tiles, a two-stage ring, no ping-pong, windows) and its one-tile
blocks and empty rows; v8's masks, windows and other tiles, and v5's bits at its 128-key tiles;
the public function at d = 256 with a config naming the version and with the default; the GEMM by
the same rule against torch.matmul.  Skipped elsewhere with the reason.
"""

import pathlib

import numpy as np
import pytest

from iokernels.core.registry import Need
from iokernels.cupy_raw import hopper as hp
from iokernels.cupy_raw import policy as P

from nvcc_support import NVCC, PTXAS_V, compile_all, compile_source, registers_only


# --------------------------------------------------------------------------- compile (no GPU)
def _compile(tmp_path, name, defines, extra=PTXAS_V):
    return compile_source(tmp_path, name, hp.source(name), defines, extra=extra)


def _jobs():
    """(label, kernel, defines): each attention version at each dtype and head dim, the tile
    settings the config allows, and the GEMM in both dtypes."""
    jobs = []
    for version in hp.VERSIONS:
        for dtype, d in (("bfloat16", 128), ("float16", 64), ("bfloat16", 256), ("float16", 256)):
            if d not in hp.head_dims(version):
                continue                                          # v6, v10: head_dim 64 only (_jobs_round)
            cfg = hp.HopperConfig(version=version)
            jobs.append((f"fa_{version} {dtype} d={d}", f"fa_{version}", cfg.defines(d, dtype)))
    for kw, d in ((dict(version="v3", block_n=64, stages=3), 128), (dict(version="v4", stages=3, block_n=64), 128),
                  (dict(version="v5", stages=2), 128), (dict(version="v5", pingpong=False), 128),
                  (dict(version="v5", pingpong=False), 256), (dict(version="v3", stages=1), 256),
                  (dict(version="v7", stages=2), 128), (dict(version="v7", stages=4, block_n=64), 128),
                  (dict(version="v7", pingpong=False), 256), (dict(version="v7", stages=4), 64),
                  (dict(version="v8", block_n=64), 128), (dict(version="v8", block_n=64), 256),
                  (dict(version="v8", stages=2), 64), (dict(version="v8", pingpong=False), 128),
                  (dict(version="v8", pingpong=False), 256), (dict(version="v9", block_n=64), 256),
                  (dict(version="v9", stages=2), 128), (dict(version="v9", pingpong=False), 64),
                  (dict(version="v11", block_n=64), 256), (dict(version="v11", pingpong=False), 128)):
        cfg = hp.HopperConfig(**kw)
        jobs.append((f"fa_{cfg.version} {kw} bfloat16 d={d}", f"fa_{cfg.version}", cfg.defines(d, "bfloat16")))
    for dtype in hp.DTYPES:
        jobs.append((f"gemm {dtype}", "hopper_gemm", hp.gemm_defines(dtype)))
    from iokernels.cupy_raw.config import BackwardConfig       # the Hopper backward (every case:
    for dtype, d in (("bfloat16", 128), ("float16", 64)):      # tests/test_hopper_backward.py)
        for version in ("v3", "v4", "v5", "v6"):
            jobs.append((f"bwd_{version} {dtype} d={d}", f"bwd_{version}", BackwardConfig(version).defines(d, dtype)))
    from iokernels.cupy_raw.config import MLADecodeConfig
    for dtype, paged, page in (("bfloat16", False, 64), ("float16", False, 64), ("bfloat16", True, 64),
                               ("float16", True, 256)):
        jobs.append((f"mla_decode {dtype} paged={paged} page={page}", "mla_decode",
                     MLADecodeConfig(version="v1").defines(dtype, paged, page)))
    from iokernels.cupy_raw.hopper.paged_prefill import HopperPagedPrefillConfig   # every combo: its own test
    jobs.append(("paged_prefill_v3 bfloat16 d=128 page=16", "paged_prefill_v3",
                 HopperPagedPrefillConfig("v3").resolve(128).defines(128, "bfloat16", 16)))
    from iokernels.cupy_raw.decode_config import DecodeConfig                  # decode v8 (the Hopper decode)
    smem = 227 * 1024
    for dtype, d, group, kw in (("bfloat16", 128, 32, {}), ("float16", 64, 64, {}), ("bfloat16", 256, 1, {}),
                                ("float16", 256, 64, dict(fused=False)), ("bfloat16", 128, 8, dict(tile_rows=128)),
                                ("bfloat16", 64, 16, dict(tile_rows=64, stages=2))):
        jobs.append((f"decode_v8 {dtype} d={d} g={group} {kw}", "decode_v8",
                     DecodeConfig("v8", **kw).defines(d, dtype, group, False, 0, smem_limit=smem, cc=90)))
    return jobs


def _jobs_round(version="v6"):
    """(label, kernel, defines) of a three-consumer version (fa_v6, fa_v10) for every define set its
    config can make: both dtypes, Bc 64 and 128, 2 to MAX_STAGES stages, with and without the round
    (head_dim 64 only)."""
    jobs = []
    for dtype in hp.DTYPES:
        for block_n in hp.BLOCK_N_CHOICES:
            for stages in range(2, hp.MAX_STAGES + 1):
                for pingpong in (True, False):
                    cfg = hp.HopperConfig(version=version, block_n=block_n, stages=stages, pingpong=pingpong)
                    jobs.append((f"fa_{version} {dtype} d=64 Bc={block_n} stages={stages} pingpong={pingpong}",
                                 f"fa_{version}", cfg.defines(64, dtype)))
    return jobs


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_hopper_kernel_compiles_for_sm90a_in_registers(tmp_path):
    jobs = _jobs()
    results = compile_all(lambda j: _compile(tmp_path, j[1], j[2]), jobs)
    for (label, name, defines), (rc, err) in zip(jobs, results):
        registers_only(label, rc, err)
    names = {name for _, name, _ in jobs + _jobs_round()}
    assert names == set(hp.SOURCES) - {"fa_fp8_v1", "fa_fp8_v2"}   # FP8: test_hopper_fp8.py


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("version", ("v6", "v10"))
def test_three_consumer_versions_compile_in_registers_for_every_config(tmp_path, version):
    """fa_v6's and fa_v10's consumers have 160 registers a thread (setmaxnreg, four warpgroups in
    64K): every define set the config can make compiles with no spill, no stack frame, setmaxnreg
    kept (fa_v10 carries v8's two softmax copies beside them)."""
    jobs = _jobs_round(version)
    assert {j[2]["BLOCK_M"] for j in jobs} == {192} and {j[2]["HEAD_DIM"] for j in jobs} == {64}
    results = compile_all(lambda j: _compile(tmp_path, j[1], j[2]), jobs)
    for (label, name, defines), (rc, err) in zip(jobs, results):
        registers_only(label, rc, err)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_sources_refuse_what_they_cannot_run(tmp_path):
    base = hp.HopperConfig(version="v5").defines(128, "bfloat16")
    v6 = hp.HopperConfig(version="v6").defines(64, "bfloat16")
    for name, defines, message in (("fa_v5", dict(base, STAGES=1), "at least two stages"),
                                   ("fa_v3", dict(base, HEAD_DIM=96), "HEAD_DIM 64, 128 or 256"),
                                   ("fa_v5", dict(base, HEAD_DIM=256), "at HEAD_DIM 256 the Hopper attention"),
                                   ("fa_v4", dict(base, IK_DTYPE=0), "IK_DTYPE 1 (float16) or 2"),
                                   ("fa_v6", dict(v6, HEAD_DIM=128), "HEAD_DIM 64 only"),
                                   ("fa_v6", dict(v6, BLOCK_M=128), "exactly three consumer warpgroups"),
                                   ("fa_v6", dict(v6, STAGES=1), "at least two stages"),
                                   ("fa_v5", dict(base, HEAD_DIM=256, BLOCK_N=80), "at HEAD_DIM 256"),
                                   ("fa_v8", dict(base, BLOCK_N=80), "BLOCK_N 80 is the wide key tile"),
                                   ("fa_v8", dict(base, BLOCK_N=96), "BLOCK_N 64 or 128"),
                                   ("fa_v9", dict(base, BLOCK_N=80), "BLOCK_N 80 is the wide key tile"),
                                   ("fa_v9", dict(base, STAGES=1), "at least two stages"),
                                   ("fa_v10", dict(v6, HEAD_DIM=128), "HEAD_DIM 64 only"),
                                   ("fa_v10", dict(v6, BLOCK_M=128), "exactly three consumer warpgroups"),
                                   ("fa_v10", dict(v6, STAGES=1), "at least two stages"),
                                   ("hopper_gemm", dict(hp.gemm_defines("bfloat16"), BK=32), "BK is one"),
                                   ("mla_decode", dict(LATENT=256, ROPE=64, IK_DTYPE=2), "LATENT 512 and ROPE 64"),
                                   ("mla_decode", dict(PAGED=1, PAGE_SIZE=16, IK_DTYPE=2), "multiple of 64")):
        rc, err = _compile(tmp_path, name, defines, extra=())
        assert rc != 0 and message in err, f"{name} {defines}: rc={rc} {err[:300]}"


def test_every_kernel_file_is_a_source():
    from iokernels.cupy_raw import launch
    on_disk = {p.stem for p in hp.KERNEL_DIR.glob("*.cu")}
    assert on_disk - set(launch.SOURCES) == set(hp.SOURCES)   # the portable kernels are launch's
    assert "#include" not in hp.source("fa_v5")          # headers inlined, each once
    assert hp.source("fa_v5").count("struct __align__(64) TmaMap") == 1


# --------------------------------------------------------------------------- config, checks (no GPU)
def test_config_validation_names_the_field():
    for kw, field in ((dict(version="v12"), "config.version"), (dict(block_n=96), "config.block_n"),
                      (dict(stages=0), "config.stages"), (dict(stages=True), "config.stages"),
                      (dict(pingpong=1), "config.pingpong"), (dict(version="v9", blocks=0), "config.blocks"),
                      (dict(version="v9", blocks=True), "config.blocks"),
                      (dict(version="v8", blocks=4), "config.blocks"), (dict(blocks=4), "config.blocks")):
        with pytest.raises(ValueError, match=field):
            hp.HopperConfig(**kw)
    with pytest.raises(ValueError, match="config.stages"):
        hp.HopperConfig(version="v5", stages=1).check_fits(128, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.stages"):
        hp.HopperConfig(version="v4", stages=4).check_fits(128, hp.FALLBACK_SMEM_OPTIN)
    # head_dim 256: Bc = 64 only (O is 128 registers a thread), and Q + 3 stages is 256 KB
    with pytest.raises(ValueError, match="config.block_n: at head_dim 256"):
        hp.HopperConfig(version="v5", block_n=128).check_fits(256, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.stages: 3 stages of Bc = 64 at head_dim 256"):
        hp.HopperConfig(version="v5", stages=3).check_fits(256, hp.FALLBACK_SMEM_OPTIN)
    hp.HopperConfig(version="v5", block_n=128).check_fits(128, hp.FALLBACK_SMEM_OPTIN)


def test_defaults_fit_every_dtype_and_head_dim():
    for version in (None, *hp.VERSIONS):
        cfg = hp.HopperConfig(version=version)
        for d in (hp.head_dims(version) if version else hp.HEAD_DIMS):
            cfg.check_fits(d, hp.FALLBACK_SMEM_OPTIN)
            assert cfg.resolve(d).version in hp.VERSIONS
    # Q + 2 (K + V) tiles of 128 x 128 bf16, 7 mbarriers, the alignment slack
    assert hp.HopperConfig(version="v4").smem_bytes(128) == 2 * 128 * (128 + 4 * 128) + 8 * 7 + 1024
    assert hp.gemm_smem_bytes() <= hp.FALLBACK_SMEM_OPTIN


def test_bad_inputs_raise_naming_the_argument(rng):
    q = rng.standard_normal((1, 2, 16, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="q: dtype"):
        hp.attention(q, q, q)
    h = q.astype(np.float16)
    with pytest.raises(ValueError, match="q: the Hopper kernels take head_dim"):
        hp.attention(h[..., :48], h[..., :48], h[..., :48])
    with pytest.raises(ValueError, match="config"):
        hp.attention(h, h, h, config="v3")
    with pytest.raises(ValueError, match="window"):
        hp.attention(h, h, h, window=(3,))
    with pytest.raises(ValueError, match="b: rows"):
        hp.gemm(h[0, 0], h[0, 0])
    with pytest.raises(ValueError, match="multiples of 8"):
        hp.gemm(h[0, 0, :, :12], h[0, 0, :12, :60])


def test_registry_check_says_why_not():
    ok = Need(dtype="bfloat16", head_dim=128, cc=90)
    assert hp.check(Need(dtype="bfloat16", head_dim=128, cc=80)).startswith("needs compute capability 9.0")
    assert "float16 / bfloat16" in hp.check(Need(dtype="float32", head_dim=128, cc=90))
    assert "head_dim" in hp.check(Need(dtype="float16", head_dim=96, cc=90))
    assert "simulator" in hp.check(Need(dtype="float16", head_dim=64, simulator=True))
    assert hp.check(ok) == hp.available()                # the rest is what this machine has
    assert hp.check(Need(dtype="bfloat16", head_dim=256, cc=90)) == hp.available()   # d = 256 runs
    assert hp.default_check(ok) is None
    assert hp.default_check(Need(dtype="bfloat16", head_dim=256, cc=90)) is None


def test_the_head_dim_gate_keeps_the_portable_kernel_where_it_is_closed(monkeypatch):
    """As if on a Hopper GPU: the default picks a Hopper version at every head dim
    policy.hopper_default_at allows (v8 at each); with 256 taken out of the gate
    it keeps the portable v2 there and says why; a config naming a Hopper version runs it at 256
    either way."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    at = {d: Need(dtype="bfloat16", head_dim=d, cc=90) for d in hp.HEAD_DIMS}
    for d in hp.HEAD_DIMS:
        assert REGISTRY.default("attention", at[d]).version == hp.default_version(d) == "v8"
        k, _ = REGISTRY.resolve("attention", hp.HopperConfig(), at[d])      # version None: the default
        assert k.config_class is hp.HopperConfig and k.version == hp.default_version(d)
    monkeypatch.setattr(P, "HOPPER_DEFAULT_HEAD_DIMS", (64, 128))
    assert hp.default_check(at[256]).startswith("not the default at head_dim 256")
    portable = REGISTRY.default("attention", at[256])
    assert portable.config_class is not hp.HopperConfig and portable.version == "v2"
    k, cfg = REGISTRY.resolve("attention", None, at[256])
    assert k is portable
    k, cfg = REGISTRY.resolve("attention", hp.HopperConfig(), at[256])
    assert k is portable
    for version in (v for v in hp.VERSIONS if 256 in hp.head_dims(v)):
        k, cfg = REGISTRY.resolve("attention", hp.HopperConfig(version=version), at[256])
        assert k.version == version and k.config_class is hp.HopperConfig
        c = cfg.resolve(256)
        assert (c.block_n, c.stages) == ((80, 2) if version in ("v8", "v9", "v11") else (64, 2))
        c.check_fits(256, hp.FALLBACK_SMEM_OPTIN)


def test_records_rank_above_the_portable_versions():
    from iokernels.cupy_raw import REGISTRY
    ranks = {k.version: k.rank for k in REGISTRY.kernels("attention")}
    portable = [k.version for k in REGISTRY.kernels("attention") if k.config_class is not hp.HopperConfig]
    assert [r.version for r in hp.RECORDS] == list(hp.VERSIONS) and portable
    assert min(ranks[v] for v in hp.VERSIONS) > max(ranks[v] for v in portable)
    from iokernels.cupy_raw.hopper.checks import DEFAULT_GATES
    # the default where no head-dim gate opens: the highest-ranked version neither held back nor gated
    measured = {v: r for v, r in ranks.items() if ("attention", v) not in P.HELD_BACK and v not in DEFAULT_GATES}
    assert max(measured, key=measured.get) == hp.DEFAULT_VERSION
    # on a GPU that is not Hopper the default stays the portable version, with the reasons
    k = REGISTRY.default("attention", Need(dtype="bfloat16", head_dim=128, cc=80))
    assert k.version == "v2"


# --------------------------------------------------------------------------- v6: head_dim 64, held back
def test_v6_config_takes_head_dim_64_only_with_the_reason():
    cfg = hp.HopperConfig(version="v6")
    c = cfg.resolve(64)
    assert (c.version, c.block_n, c.stages, c.block_m()) == ("v6", 128, 4, 192) and hp.THREADS["v6"] == 512
    assert cfg.defines(64, "float16") == dict(IK_DTYPE=1, HEAD_DIM=64, BLOCK_M=192, BLOCK_N=128, STAGES=4,
                                              PINGPONG=1)
    # Q 192 x 64 + 4 (K + V) tiles of 128 x 64, 16-bit; 13 mbarriers; the alignment slack
    assert cfg.smem_bytes(64) == 2 * 64 * (192 + 8 * 128) + 8 * 13 + 1024
    for block_n in hp.BLOCK_N_CHOICES:
        for stages in range(2, hp.MAX_STAGES + 1):
            hp.HopperConfig(version="v6", block_n=block_n, stages=stages).check_fits(64, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.stages: v6 uses K_j and V_{j-1} together"):
        hp.HopperConfig(version="v6", stages=1).check_fits(64, hp.FALLBACK_SMEM_OPTIN)
    for d in (128, 256):
        with pytest.raises(ValueError, match="config.version: v6 takes head_dim 64 only .*160 registers"):
            cfg.resolve(d)
    # the public function refuses before it looks for a GPU
    h = np.zeros((1, 2, 16, 128), np.float16) + 0.5
    with pytest.raises(ValueError, match="config.version: v6 takes head_dim 64 only"):
        hp.attention(h, h, h, config=cfg)
    # the other versions keep their 128-row tile
    assert {hp.HopperConfig(version=v).block_m() for v in ("v3", "v4", "v5", None)} == {hp.BLOCK_M}


def test_v6_is_held_back_runs_when_named_and_says_why_not(monkeypatch):
    """As if on a Hopper GPU: v6 ranks above v5 but the default stays v5 at head_dim 64 (HELD_BACK
    says what must be recorded first); a config naming v6 runs it there; elsewhere it says why not."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    at = {d: Need(dtype="bfloat16", head_dim=d, cc=90) for d in hp.HEAD_DIMS}
    rec = REGISTRY.get("attention", "v6")
    assert rec.rank > REGISTRY.get("attention", "v5").rank and rec.file == "fa_v6.cu"
    assert P.HELD_BACK[("attention", "v6")] == ("its GPU tests and a benchmark record faster than v5 at head_dim 64 "
                                                "on Hopper")
    assert rec.unavailable(at[64]) is None
    assert rec.not_default(at[64]) == P.held_back("attention", "v6")
    assert "held back from the default" in rec.summary
    for d in hp.HEAD_DIMS:
        assert REGISTRY.default("attention", at[d]).version == hp.default_version(d)
    k, cfg = REGISTRY.resolve("attention", hp.HopperConfig(version="v6"), at[64])
    assert k is rec and cfg.resolve(64).block_m() == 192
    for n, why in ((at[128], "takes head_dim 64 only"), (at[256], "takes head_dim 64 only"),
                   (Need(dtype="bfloat16", head_dim=64, cc=80), "needs compute capability 9.0"),
                   (Need(dtype="float32", head_dim=64, cc=90), "float16 / bfloat16"),
                   (Need(dtype="float16", head_dim=64, simulator=True), "simulator")):
        assert why in rec.unavailable(n)
        with pytest.raises(ValueError, match=f"config.version: cupy attention v6 cannot run here: .*{why}"):
            REGISTRY.resolve("attention", hp.HopperConfig(version="v6"), n)


def test_v6_gate_opens_in_one_place(monkeypatch):
    """Once its entry leaves policy.HELD_BACK, v6 is the default at head_dim 64 on Hopper where the
    versions ranked above it are gated out there (v7 by its gate, v8 as if its gate left 64 out),
    and only there: v5 stays the default at 128 (v8's gate closed there too), v8 at 256, the
    portable kernel off Hopper."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    assert REGISTRY.default("attention", Need(dtype="bfloat16", head_dim=64, cc=90)).version == "v8"
    monkeypatch.delitem(P.HELD_BACK, ("attention", "v6"))
    assert REGISTRY.default("attention", Need(dtype="bfloat16", head_dim=64, cc=90)).version == "v8"
    monkeypatch.setattr(P, "HOPPER_V8_DEFAULT_HEAD_DIMS", (256,))
    at = {d: Need(dtype="bfloat16", head_dim=d, cc=90) for d in hp.HEAD_DIMS}
    k, cfg = REGISTRY.resolve("attention", None, at[64])
    assert k.version == "v6" and cfg.version == "v6" and cfg.resolve(64).block_m() == 192
    assert REGISTRY.default("attention", at[128]).version == "v5"
    assert REGISTRY.default("attention", at[256]).version == "v8"
    assert REGISTRY.default("attention", Need(dtype="bfloat16", head_dim=64, cc=80)).version == "v2"


def test_v6_sanitizer_cases_run_at_head_dim_64():
    """The sanitizer runs v6 where it runs (d = 64: causal, unmasked, windowed), with the tightest
    ring and without the round beside its default."""
    from iokernels.cupy_raw import sanitize as S
    shapes = S.FORWARD_CASES + S.FORWARD_EXTRA[("attention", "v6")]
    assert {(causal, window) for d, causal, window in shapes if d == 64} >= {(True, None), (False, None),
                                                                            (False, (5, 3))}
    for kw in S.VARIANTS[("attention", "v6")]:
        hp.HopperConfig(version="v6", **kw).check_fits(64, hp.FALLBACK_SMEM_OPTIN)


# --------------------------------------------------------------------------- v7: K and V released apart
def test_v7_config_counts_its_barriers_and_fits_every_head_dim():
    """v7 is v5's block (Br 128, 384 threads, ping-pong) with an empty barrier for K and one for V
    a stage: 1 + 4 x stages mbarriers; three stages at head_dim 64 and 128, two at 256."""
    for d, stages, block_n in ((64, 3, 128), (128, 3, 128), (256, 2, 64)):
        c = hp.HopperConfig(version="v7").resolve(d)
        assert (c.block_n, c.stages, c.block_m(), hp.THREADS["v7"]) == (block_n, stages, 128, 384)
        assert c.smem_bytes(d) == 2 * d * (128 + 2 * stages * block_n) + 8 * (1 + 4 * stages) + 1024
        assert c.smem_bytes(d) == hp.HopperConfig(version="v5").smem_bytes(d) + 8 * stages
        assert c.defines(d, "bfloat16") == dict(IK_DTYPE=2, HEAD_DIM=d, BLOCK_M=128, BLOCK_N=block_n,
                                                STAGES=stages, PINGPONG=1)
        c.check_fits(d, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.stages: v7 uses K_j and V_{j-1} together"):
        hp.HopperConfig(version="v7", stages=1).check_fits(128, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.stages: 3 stages of Bc = 64 at head_dim 256"):
        hp.HopperConfig(version="v7", stages=3).check_fits(256, hp.FALLBACK_SMEM_OPTIN)


def test_v7_gate_is_head_dim_256_and_it_runs_when_named(monkeypatch):
    """As if on a Hopper GPU: v7 ranks above v6 and v5 and below v8 (the default); its own
    gate (policy.hopper_v7_default_at) lets the default take it at head_dim 256 only, as it would
    with v8 held back, and says why not at 64 and 128; a config naming v7 runs it everywhere."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    at = {d: Need(dtype="bfloat16", head_dim=d, cc=90) for d in hp.HEAD_DIMS}
    rec = REGISTRY.get("attention", "v7")
    assert REGISTRY.get("attention", "v6").rank < rec.rank < REGISTRY.get("attention", "v8").rank
    assert rec.file == "fa_v7.cu" and P.HOPPER_V7_DEFAULT_HEAD_DIMS == (256,)
    for d in hp.HEAD_DIMS:
        assert rec.unavailable(at[d]) is None
        assert REGISTRY.resolve("attention", hp.HopperConfig(version="v7"), at[d])[0] is rec
        assert REGISTRY.default("attention", at[d]).version == hp.HopperConfig().resolve(d).version == "v8"
    assert rec.not_default(at[256]) is None
    assert rec.not_default(at[128]).startswith("not the default at head_dim 128: v5's third stage")
    assert "needs compute capability 9.0" in rec.unavailable(Need(dtype="bfloat16", head_dim=128, cc=80))
    monkeypatch.setitem(P.HELD_BACK, ("attention", "v8"), "a test holds it back")
    assert [REGISTRY.default("attention", at[d]).version for d in hp.HEAD_DIMS] == ["v5", "v5", "v7"]


def test_v7_sanitizer_cases_cover_head_dim_256_and_the_two_stage_ring():
    from iokernels.cupy_raw import sanitize as S
    assert (256, True, None) in S.FORWARD_EXTRA[("attention", "v7")]
    assert {"stages": 2} in S.VARIANTS[("attention", "v7")]
    for kw in S.VARIANTS[("attention", "v7")]:
        for d in hp.HEAD_DIMS:
            hp.HopperConfig(version="v7", **kw).check_fits(d, hp.FALLBACK_SMEM_OPTIN)


# --------------------------------------------------------------------------- v8: wide key tiles
def test_v8_tiles_80_keys_at_256_and_v5s_elsewhere():
    """v8's tiles: v5's 128 keys in three stages at head_dim 64 and 128, FlashAttention-3's 80 keys
    in two stages at 256 (policy.HOPPER_V8_WIDE_TILES); v7's barriers; 80 is v8's tile, at 256 only."""
    for d, block_n, stages in ((64, 128, 3), (128, 128, 3), (256, 80, 2)):
        c = hp.HopperConfig(version="v8").resolve(d)
        assert (c.block_n, c.stages, c.block_m(), hp.THREADS["v8"]) == (block_n, stages, 128, 384)
        assert c.smem_bytes(d) == 2 * d * (128 + 2 * stages * block_n) + 8 * (1 + 4 * stages) + 1024
        c.check_fits(d, hp.FALLBACK_SMEM_OPTIN)
        assert hp.HopperConfig().resolve(d) == c                      # the default everywhere
    assert hp.block_n_choices("v8", 256) == (64, 80) and hp.block_n_choices("v8", 128) == (64, 128)
    assert hp.block_n_choices("v7", 256) == (64,)
    with pytest.raises(ValueError, match="config.stages: 3 stages of Bc = 80 at head_dim 256"):
        hp.HopperConfig(version="v8", stages=3).check_fits(256, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.block_n: at head_dim 128 v8 takes Bc in .*80 is a key tile of "
                                         "v8, v9, v11 at head_dim 256 only"):
        hp.HopperConfig(version="v8", block_n=80).check_fits(128, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.block_n: at head_dim 256 v8 takes Bc in \\(64, 80\\)"):
        hp.HopperConfig(version="v8", block_n=128).check_fits(256, hp.FALLBACK_SMEM_OPTIN)
    for version in (None, "v5", "v7"):
        with pytest.raises(ValueError, match="config.block_n: 80 keys is a tile of v8, v9, v11 only"):
            hp.HopperConfig(version=version, block_n=80)
    with pytest.raises(ValueError, match="config.block_n: expected one of \\(64, 80, 128\\)"):
        hp.HopperConfig(version="v8", block_n=96)


def test_v8_is_the_default_at_every_head_dim_and_its_gate_closes_in_one_place(monkeypatch):
    """As if on a Hopper GPU: v8 ranks above every Hopper version but v9, v10 and v11 (gated by the call's
    lengths); for a need without lengths the default picks v8 at every head dim
    (policy.hopper_v8_default_at); a config naming it runs it; with 64 and 128 taken out of its gate
    the default there is v5 again, with the reason."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    rec = REGISTRY.get("attention", "v8")
    assert rec.rank == max(k.rank for k in REGISTRY.kernels("attention") if k.version not in ("v9", "v10", "v11"))
    assert rec.file == "fa_v8.cu"
    assert ("attention", "v8") not in P.HELD_BACK and P.HOPPER_V8_DEFAULT_HEAD_DIMS == (64, 128, 256)
    at = {d: Need(dtype="float16", head_dim=d, cc=90) for d in hp.HEAD_DIMS}
    for d in hp.HEAD_DIMS:
        assert rec.unavailable(at[d]) is None and rec.not_default(at[d]) is None
        assert REGISTRY.resolve("attention", hp.HopperConfig(version="v8"), at[d])[0] is rec
        assert REGISTRY.default("attention", at[d]) is rec and hp.default_version(d) == "v8"
    monkeypatch.setattr(P, "HOPPER_V8_DEFAULT_HEAD_DIMS", (256,))
    assert rec.not_default(at[128]).startswith("not the default at head_dim 128 (policy.hopper_v8_default_at)")
    assert [REGISTRY.default("attention", at[d]).version for d in hp.HEAD_DIMS] == ["v5", "v5", "v8"]
    assert [hp.default_version(d) for d in hp.HEAD_DIMS] == ["v5", "v5", "v8"]


def test_v8_sanitizer_cases_fit_every_head_dim():
    from iokernels.cupy_raw import sanitize as S
    assert (256, True, None) in S.FORWARD_EXTRA[("attention", "v8")]
    for kw in S.VARIANTS[("attention", "v8")]:
        for d in hp.HEAD_DIMS:
            hp.HopperConfig(version="v8", **kw).check_fits(d, hp.FALLBACK_SMEM_OPTIN)


# --------------------------------------------------------------------------- v9: persistent
def test_v9_takes_v8s_tiles_a_block_an_sm_and_16_bytes_more():
    """v9 is v8's block with its tiles at every head dim; its SRAM is v8's and Q's empty barrier and
    the tile index (16 bytes); its grid is min(query tiles, SMs or config.blocks) blocks in a row,
    where the other versions launch a block a query tile."""
    for d in hp.HEAD_DIMS:
        c8, c9 = hp.HopperConfig(version="v8").resolve(d), hp.HopperConfig(version="v9").resolve(d)
        assert (c9.block_n, c9.stages, c9.block_m(), hp.THREADS["v9"]) == (c8.block_n, c8.stages, 128, 384)
        assert c9.smem_bytes(d) == c8.smem_bytes(d) + 16
        assert c9.defines(d, "bfloat16") == c8.defines(d, "bfloat16")
        c9.check_fits(d, hp.FALLBACK_SMEM_OPTIN)
    v9, v8 = hp.HopperConfig(version="v9").resolve(128), hp.HopperConfig(version="v8").resolve(128)
    assert hp.grid(v8, 16, 16, 1000, 132) == (8, 16, 16)
    assert hp.grid(v9, 16, 16, 1000, 132) == (132, 1, 1)          # 2048 tiles, one block an SM
    assert hp.grid(v9, 1, 2, 300, 132) == (6, 1, 1)               # fewer tiles than SMs: a block each
    assert hp.grid(v9.replace(blocks=3), 16, 16, 1000, 132) == (3, 1, 1)
    assert hp.HopperConfig(version="v9", blocks=3).resolve(256).blocks == 3
    assert hp.block_n_choices("v9", 256) == (64, 80) and hp.PERSISTENT == ("v9",)


def _lengths(d, n, window, nq=None):
    """The need of a forward call of ``nq`` (default ``n``) query rows over ``n`` keys in ``window``."""
    return Need(dtype="bfloat16", head_dim=d, cc=90, extra=dict(seq_q=nq or n, seq_k=n, window=window))


def test_v9_is_the_default_on_short_key_ranges(monkeypatch):
    """As if on a Hopper GPU: v9 ranks above v8, and the default picks it where a query tile reads few
    key tiles (policy.hopper_forward_for_length), never for a need that carries no lengths; a config
    naming it runs it at every head dim."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    rec = REGISTRY.get("attention", "v9")
    assert rec.rank == max(k.rank for k in REGISTRY.kernels("attention") if k.version not in ("v10", "v11"))
    assert rec.file == "fa_v9.cu" and ("attention", "v9") not in P.HELD_BACK
    assert rec.args is hp.persistent_attention_args and "held back" not in rec.summary
    for d in hp.HEAD_DIMS:
        bare = Need(dtype="bfloat16", head_dim=d, cc=90)
        assert rec.unavailable(bare) is None and "carries none" in rec.not_default(bare)
        assert REGISTRY.default("attention", bare).version == "v8"
        assert REGISTRY.resolve("attention", hp.HopperConfig(version="v9"), bare)[0] is rec
        assert REGISTRY.default("attention", _lengths(d, 1000, (-1, 0))).version == "v9"
        assert REGISTRY.default("attention", _lengths(d, 100, (-1, -1))).version == "v9"
        assert REGISTRY.default("attention", _lengths(d, 8192, (-1, -1))).version != "v9"
        why = rec.not_default(_lengths(d, 8192, (-1, -1)))
        assert why.startswith("not the default for 8192 query rows over 8192 keys")
        assert "hopper_forward_for_length" in why


def test_the_default_takes_the_version_the_length_policy_names(monkeypatch):
    """As if on a Hopper GPU: over head dims, lengths (a tile and a half of keys to 64), Nq != Nk and
    bands, the registry's default is policy.hopper_forward_for_length's choice, and that choice is v9,
    v10 (head_dim 64 only), v11 (with an upper band edge, not at 64) or v8; with a version held back
    the default falls to v8."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    seen = set()
    for d in hp.HEAD_DIMS:
        for n in (1, 200, 1000, 2000, 3000, 5000, 8192, 30000):
            for window in ((-1, -1), (-1, 0), (512, 0), (100, 100)):
                for nq in (n, 1, 4 * n):
                    want = P.hopper_forward_for_length(d, nq, n, window)
                    assert REGISTRY.default("attention", _lengths(d, n, window, nq)).version == want
                    assert want in ("v8", "v9", "v10", "v11") and (want != "v10" or d == 64)
                    assert want != "v11" or (d != 64 and window[1] >= 0)
                    seen.add((d, want))
    assert seen == {(64, "v9"), (64, "v10"), (128, "v9"), (128, "v11"), (128, "v8"), (256, "v9"), (256, "v11"),
                    (256, "v8")}
    for version in ("v9", "v10", "v11"):
        with monkeypatch.context() as m:
            m.setitem(P.HELD_BACK, ("attention", version), "a record")
            for d, n, window in ((64, 1000, (-1, 0)), (64, 8192, (-1, -1)), (128, 8192, (-1, 0))):
                want = P.hopper_forward_for_length(d, n, n, window)
                got = REGISTRY.default("attention", _lengths(d, n, window)).version
                assert got == ("v8" if want == version else want), (version, d, n, window)


def test_v9_arguments_end_with_the_batch_and_the_counter():
    """fa_v9's arguments are fa_v8's, then the batch and the two-int tile counter's pointer."""
    from iokernels.core.arrays import DeviceArray
    shape = (3, 4, 300, 128)
    q = DeviceArray(1 << 20, shape, (153600, 38400, 128, 1), "bfloat16", 2, None)
    o = DeviceArray(2 << 20, shape, (153600, 38400, 128, 1), "bfloat16", 2, None)
    lse = DeviceArray(3 << 20, shape[:3], (1200, 300, 1), "float32", 4, None)
    claimed = DeviceArray(4 << 20, (2,), (1,), "int32", 4, None)
    kw = dict(dtype="bfloat16", block_n=128, scale=0.1, window=(-1, 0), heavy_first=True)
    try:
        v8 = hp.attention_args(q, q, q, o, lse, **kw)
    except Exception as e:                                          # no CUDA driver: no tensor maps here
        pytest.skip(f"tensor maps need the CUDA driver: {e}")
    v9 = hp.persistent_attention_args(q, q, q, o, lse, claimed=claimed, **kw)
    assert len(v9) == len(v8) + 2 and v9[-2] == 3 and v9[-1] == claimed.ptr
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(v9[3:-2], v8[3:]))


def _cuobjdump():
    """cuobjdump from the CUDA toolkit, or the copy Triton's wheel carries; None without either."""
    import shutil
    found = shutil.which("cuobjdump")
    if found is None:
        try:
            import triton
        except ImportError:
            return None
        bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(bundled) if bundled.exists() else None
    return found


def _key_loop(tmp_path, name: str, defines: dict, dump: str) -> list[str]:
    """The opcodes of ``name``'s key loop in SASS: the loop (a backward branch) that holds the two
    products of one turn, Q K^T and P V, as one run of HGMMA instructions each."""
    import re
    import subprocess
    rc, err = compile_source(tmp_path, name, hp.source(name), defines, extra=())
    assert rc == 0, err[:400]
    cubin = max(tmp_path.glob(f"{name}_*.cubin"), key=lambda f: f.stat().st_mtime)
    sass = subprocess.run([dump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    steps = 2 * defines["HEAD_DIM"] // 16                          # QK_STEPS + PV_STEPS (Bc = HEAD_DIM here)
    loops = []
    for i, (addr, op) in enumerate(ops):
        jump = re.search(r"\bBRA\b.*0x([0-9a-f]+)", op)
        if jump and int(jump.group(1), 16) < addr:
            j = next(k for k, (a, _) in enumerate(ops) if a == int(jump.group(1), 16))
            body = [o for _, o in ops[j:i + 1]]
            if sum("HGMMA" in o for o in body) == steps:
                loops.append([re.sub(r"^@!?U?P\w+\s+", "", o).split()[0] for o in body])
    assert loops, f"{name}: no loop with {steps} HGMMA instructions"
    return min(loops, key=len)


@pytest.mark.skipif(NVCC is None or _cuobjdump() is None, reason="nvcc or cuobjdump not found")
def test_v9_key_loop_compiles_like_v8s(tmp_path):
    """v9's key loop is v8's: its stage indices, wgmma descriptors and loop bounds come from the tile
    index, which the consumers read from SRAM; broadcast from one lane, the compiler keeps them in
    uniform registers as in v8 (read by every lane, the first v9 copied each descriptor into uniform
    registers before every wgmma and wrapped the loop in divergence handling, and ran slower than v8
    the more key tiles a query tile had).  Same opcodes but for a few, no divergence handling."""
    from collections import Counter
    defines = hp.HopperConfig(version="v9").defines(128, "bfloat16")
    v8 = Counter(_key_loop(tmp_path, "fa_v8", defines, _cuobjdump()))
    v9 = Counter(_key_loop(tmp_path, "fa_v9", defines, _cuobjdump()))
    assert v9["BSSY"] == v8["BSSY"] == 0 and v9["R2UR"] <= v8["R2UR"] + 2, (v8, v9)
    assert abs(sum(v9.values()) - sum(v8.values())) <= 0.03 * sum(v8.values()), (sum(v8.values()), sum(v9.values()))


def test_v9_sanitizer_cases_claim_many_tiles_and_fit_every_head_dim():
    from iokernels.cupy_raw import sanitize as S
    assert (256, True, None) in S.FORWARD_EXTRA[("attention", "v9")]
    assert {kw.get("blocks") for kw in S.VARIANTS[("attention", "v9")]} == {None, 1, 2}
    for kw in S.VARIANTS[("attention", "v9")]:
        for d in hp.HEAD_DIMS:
            hp.HopperConfig(version="v9", **kw).check_fits(d, hp.FALLBACK_SMEM_OPTIN)


# --------------------------------------------------------------------------- v10: three consumers on v8
def test_v10_is_v8s_block_with_three_consumers_at_head_dim_64_only():
    """v10 takes v6's block (192 rows, 512 threads, head_dim 64 only) with v8's barriers (K and V
    released apart: 1 + 4 x stages) and v8's key tile; three stages by default."""
    cfg = hp.HopperConfig(version="v10")
    c = cfg.resolve(64)
    assert (c.version, c.block_n, c.stages, c.block_m(), hp.THREADS["v10"]) == ("v10", 128, 3, 192, 512)
    assert cfg.defines(64, "bfloat16") == dict(IK_DTYPE=2, HEAD_DIM=64, BLOCK_M=192, BLOCK_N=128, STAGES=3,
                                               PINGPONG=1)
    assert cfg.smem_bytes(64) == 2 * 64 * (192 + 6 * 128) + 8 * 13 + 1024
    for block_n in hp.BLOCK_N_CHOICES:
        for stages in range(2, hp.MAX_STAGES + 1):
            hp.HopperConfig(version="v10", block_n=block_n, stages=stages).check_fits(64, hp.FALLBACK_SMEM_OPTIN)
    with pytest.raises(ValueError, match="config.stages: v10 uses K_j and V_{j-1} together"):
        hp.HopperConfig(version="v10", stages=1).check_fits(64, hp.FALLBACK_SMEM_OPTIN)
    for d in (128, 256):
        with pytest.raises(ValueError, match="config.version: v10 takes head_dim 64 only .*160 registers"):
            cfg.resolve(d)
    with pytest.raises(ValueError, match="config.block_n: 80 keys is a tile of v8, v9, v11 only"):
        hp.HopperConfig(version="v10", block_n=80)


def test_v10_is_the_default_at_head_dim_64_on_long_key_ranges(monkeypatch):
    """As if on a Hopper GPU: v10 ranks above every version but v11; the default picks it at head_dim 64
    where a query tile reads many key tiles, causal or not, never for a need that carries no lengths; a
    config naming it runs it at head_dim 64, and elsewhere it says why not."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    rec = REGISTRY.get("attention", "v10")
    assert rec.rank == max(k.rank for k in REGISTRY.kernels("attention") if k.version != "v11")
    assert rec.file == "fa_v10.cu" and ("attention", "v10") not in P.HELD_BACK
    assert rec.args is hp.attention_args and "held back" not in rec.summary
    bare = {d: Need(dtype="bfloat16", head_dim=d, cc=90) for d in hp.HEAD_DIMS}
    assert rec.unavailable(bare[64]) is None and "carries none" in rec.not_default(bare[64])
    assert REGISTRY.resolve("attention", hp.HopperConfig(version="v10"), bare[64])[0] is rec
    for d in (128, 256):
        assert "takes head_dim 64 only" in rec.unavailable(bare[d])
    assert REGISTRY.default("attention", _lengths(64, 8192, (-1, -1))).version == "v10"
    assert REGISTRY.default("attention", _lengths(64, 8192, (-1, 0))).version == "v10"
    assert REGISTRY.default("attention", _lengths(64, 1000, (-1, 0))).version == "v9"


def test_v10_sanitizer_cases_run_at_head_dim_64():
    from iokernels.cupy_raw import sanitize as S
    shapes = S.FORWARD_CASES + S.FORWARD_EXTRA[("attention", "v10")]
    assert {(causal, window) for d, causal, window in shapes if d == 64} >= {(True, None), (False, None),
                                                                            (False, (5, 3))}
    assert {} in S.VARIANTS[("attention", "v10")] and {"pingpong": False} in S.VARIANTS[("attention", "v10")]
    for kw in S.VARIANTS[("attention", "v10")]:
        hp.HopperConfig(version="v10", **kw).check_fits(64, hp.FALLBACK_SMEM_OPTIN)


# --------------------------------------------------------------------------- v11: v8's blocks longest first
def test_v11_is_v8s_block_with_one_more_argument():
    """v11 takes v8's tiles, SRAM, threads and defines at every head dim (80-key tiles at 256); its
    arguments are v8's and then the size of a longest-first group."""
    from iokernels.core.arrays import DeviceArray
    for d in hp.HEAD_DIMS:
        c8, c11 = hp.HopperConfig(version="v8").resolve(d), hp.HopperConfig(version="v11").resolve(d)
        assert (c11.block_n, c11.stages, c11.block_m(), hp.THREADS["v11"]) == (c8.block_n, c8.stages, 128, 384)
        assert c11.smem_bytes(d) == c8.smem_bytes(d) and c11.defines(d, "bfloat16") == c8.defines(d, "bfloat16")
        c11.check_fits(d, hp.FALLBACK_SMEM_OPTIN)
    assert hp.block_n_choices("v11", 256) == (64, 80) and hp.LONGEST_FIRST == ("v11",)
    assert hp.grid(hp.HopperConfig(version="v11").resolve(128), 16, 16, 1000, 132) == (8, 16, 16)
    shape = (3, 4, 300, 128)
    q = DeviceArray(1 << 20, shape, (153600, 38400, 128, 1), "bfloat16", 2, None)
    o = DeviceArray(2 << 20, shape, (153600, 38400, 128, 1), "bfloat16", 2, None)
    lse = DeviceArray(3 << 20, shape[:3], (1200, 300, 1), "float32", 4, None)
    kw = dict(dtype="bfloat16", block_n=128, scale=0.1, window=(-1, 0), heavy_first=True)
    try:
        v8 = hp.attention_args(q, q, q, o, lse, **kw)
    except Exception as e:                                          # no CUDA driver: no tensor maps here
        pytest.skip(f"tensor maps need the CUDA driver: {e}")
    v11 = hp.lpt_attention_args(q, q, q, o, lse, lpt_pairs=5, **kw)
    assert len(v11) == len(v8) + 1 and v11[-1] == 5
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(v11[3:-1], v8[3:]))


def test_v11_is_the_default_under_the_causal_mask_on_long_key_ranges(monkeypatch):
    """As if on a Hopper GPU: v11 ranks above every version; the default picks it at head_dim 128 and 256
    under a band with an upper edge where a query tile reads many key tiles (not without such a band,
    where its order is v8's, not at 64, where v10 is faster, not on short ranges); a config naming it
    runs it at every head dim."""
    from iokernels.cupy_raw import REGISTRY
    from iokernels.cupy_raw.hopper import checks
    monkeypatch.setattr(checks, "available", lambda: None)
    rec = REGISTRY.get("attention", "v11")
    assert rec.rank == max(k.rank for k in REGISTRY.kernels("attention")) and rec.file == "fa_v11.cu"
    assert rec.args is hp.lpt_attention_args and ("attention", "v11") not in P.HELD_BACK
    for d in hp.HEAD_DIMS:
        at = _lengths(d, 8192, (-1, 0))
        assert rec.unavailable(at) is None
        assert REGISTRY.resolve("attention", hp.HopperConfig(version="v11"), at)[0] is rec
        assert (REGISTRY.default("attention", at).version == "v11") == (d != 64)
        assert REGISTRY.default("attention", _lengths(d, 8192, (-1, -1))).version != "v11"
        assert REGISTRY.default("attention", _lengths(d, 1000, (-1, 0))).version == "v9"
    assert REGISTRY.default("attention", _lengths(128, 8192, (4096, 0))).version == "v11"    # a causal window
    assert REGISTRY.default("attention", _lengths(128, 8192, (500, 0))).version == "v9"      # a short one


@pytest.mark.skipif(NVCC is None or _cuobjdump() is None, reason="nvcc or cuobjdump not found")
def test_v11_key_loop_compiles_like_v8s(tmp_path):
    """v11 changes which tile a block takes, computed once before the key loop: the loop's SASS is
    v8's but for a few instructions (the tile's bounds come from other registers)."""
    from collections import Counter
    defines = hp.HopperConfig(version="v11").defines(128, "bfloat16")
    v8 = Counter(_key_loop(tmp_path, "fa_v8", defines, _cuobjdump()))
    v11 = Counter(_key_loop(tmp_path, "fa_v11", defines, _cuobjdump()))
    assert v11["BSSY"] == v8["BSSY"] and v11["HGMMA"] == v8["HGMMA"], (v8, v11)
    assert abs(sum(v11.values()) - sum(v8.values())) <= 0.03 * sum(v8.values()), (sum(v8.values()), sum(v11.values()))


def test_v11_sanitizer_cases_reorder_blocks_at_every_head_dim():
    """The sanitizer runs v11 where its groups reorder blocks: more than one query tile a pair (the
    causal cases) and several pairs; at every head dim, with v8's variants."""
    from iokernels.cupy_raw import sanitize as S
    sizes = S.FORWARD_SIZES_OF[("attention", "v11")]
    assert sizes["seqlen_q"] > hp.BLOCK_M and sizes["batch"] * sizes["heads_q"] > 2
    shapes = S.FORWARD_CASES + S.FORWARD_EXTRA[("attention", "v11")]
    assert {d for d, causal, _ in shapes if causal} >= {64, 256}
    assert S.VARIANTS[("attention", "v11")] == S.VARIANTS[("attention", "v8")]


def test_available_gives_a_reason_or_none():
    why = hp.available()
    assert why is None or (isinstance(why, str) and why)


# --------------------------------------------------------------------------- on a Hopper GPU
gpu = pytest.mark.skipif(hp.available() is not None, reason=f"Hopper kernels: {hp.available()}")


def _torch_inputs(rng, B, Hq, Hkv, Nq, Nk, d, dtype):
    import torch
    from iokernels.core.testing import make_inputs
    q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=d,
                          dtype="float32")
    return tuple(torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q, k, v))


def _assert_checks(checks, label):
    bad = [str(c) for c in checks if not c.ok]
    assert checks and not bad, f"{label}: " + "; ".join(bad)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version,d", [(v, d) for v in hp.VERSIONS for d in hp.HEAD_DIMS if d in hp.head_dims(v)])
@pytest.mark.parametrize("n", (1, 127, 1024, 4096))
@pytest.mark.parametrize("causal", (False, True))
def test_two_x_rule_square(rng, version, d, n, causal):
    dtype = "bfloat16" if (n + d) % 2 else "float16"
    q, k, v = _torch_inputs(rng, 1, 2, 2, n, n, d, dtype)
    _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=hp.HopperConfig(version=version)),
                   f"{version} {dtype} d={d} N={n} causal={causal}")


GQA_SHAPES = [(4, 1, 300, 1000, 128, True), (4, 2, 1000, 300, 64, True), (6, 3, 333, 100, 128, False),
              (2, 1, 77, 513, 64, False), (4, 1, 300, 1000, 256, True), (6, 3, 333, 100, 256, False)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version,shape", [(v, s) for v in hp.VERSIONS for s in GQA_SHAPES if s[4] in hp.head_dims(v)])
def test_two_x_rule_gqa_and_unequal_lengths(rng, version, shape):
    Hq, Hkv, Nq, Nk, d, causal = shape
    q, k, v = _torch_inputs(rng, 2, Hq, Hkv, Nq, Nk, d, "bfloat16")
    _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=hp.HopperConfig(version=version)),
                   f"{version} {shape}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", (False, True))
def test_public_attention_at_256_runs_hopper_by_default_and_by_name(rng, causal):
    """d = 256 through ik.attention (the plan path): the default at 1000 keys runs fa_v9 (few key tiles:
    policy.hopper_forward_for_length; v8's 80-key tiles and v8's bits), a config naming v8 the same
    bits, those of hopper.attention, which the 2x rule holds; a config naming v5 runs fa_v5, which
    does too."""
    import torch

    import iokernels as ik
    from iokernels.cupy_raw import REGISTRY, need
    q, k, v = _torch_inputs(rng, 2, 4, 2, 1000, 1000, 256, "bfloat16")
    assert REGISTRY.default("attention", need("attention", q=q, k=k, v=v, causal=causal)).version == "v9"
    for cfg in (hp.HopperConfig(version="v8"), hp.HopperConfig(version="v5")):
        o = ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg)
        o_direct, _ = hp.attention(q, k, v, causal=causal, config=cfg)
        torch.cuda.synchronize()
        assert torch.equal(o, o_direct)
        if cfg.version == "v8":
            assert torch.equal(ik.attention(q, k, v, causal=causal, backend="cupy"), o_direct)
        _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=cfg), f"{cfg.version} d=256 causal={causal}")


@gpu
@pytest.mark.gpu
def test_window_and_numpy_round_trip(rng):
    from iokernels import naive
    from iokernels.core import reference
    from iokernels.core.testing import check, make_inputs
    q, k, v = _torch_inputs(rng, 1, 2, 2, 400, 400, 64, "bfloat16")
    _assert_checks(hp.oracle_check(q, k, v, causal=False, window=(50, 10)), "window (50, 10)")
    # NumPy in, NumPy out; rows 0..59 see no key (bottom-right causal, Nq - Nk = 60)
    qn, kn, vn = make_inputs(rng, heads_q=2, seqlen_q=130, seqlen_k=70, head_dim=128, dtype="float16")
    o, lse = hp.attention(qn, kn, vn, causal=True)
    assert isinstance(o, np.ndarray) and o.dtype == np.float16 and lse.dtype == np.float32
    ref_o, ref_l = reference.attention(qn, kn, vn, causal=True)
    base_o, base_l = naive.attention(qn, kn, vn, causal=True, scale=1 / np.sqrt(128), window=None)
    masked = ~np.isfinite(ref_l)[..., None]
    assert masked[:, :, :60].all() and not masked[:, :, 60:].any()
    assert check(o, ref_o, base_o, dtype="float16", name="O", masked_rows=masked)
    assert check(lse, ref_l, base_l, dtype="float16", name="LSE")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", hp.DTYPES)
@pytest.mark.parametrize("mkn", [(128, 64, 256), (300, 200, 264), (1000, 1032, 776), (2048, 4096, 1024)])
def test_gemm_two_x_rule_against_torch(rng, dtype, mkn):
    import torch
    M, K, N = mkn
    a = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32)).cuda().to(getattr(torch, dtype))
    b = torch.from_numpy(rng.standard_normal((K, N), dtype=np.float32)).cuda().to(getattr(torch, dtype))
    c = hp.gemm_check(a, b)
    assert c, str(c)


# --------------------------------------------------------------------------- v6 on a Hopper GPU (d = 64)
# v6 joins test_two_x_rule_square and test_two_x_rule_gqa_and_unequal_lengths at d = 64 (hp.head_dims);
# these add what its 192-row block and its row-bound mask change: blocks of rows that see nothing,
# windows, a block the mask cuts in three, and agreement with v5.
V6 = hp.HopperConfig(version="v6")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 500, 200, True, None), (2, 1, 700, 700, False, (50, 10)),
                                   (4, 2, 384, 1000, False, (200, -1)), (8, 2, 193, 193, True, None),
                                   (3, 3, 1000, 65, True, (30, 0))])
def test_v6_masked_rows_windows_and_gqa(rng, shape):
    """Nq = 500 over Nk = 200, causal: rows 0..299 see no key (the first 192-row block has no
    tile at all, the second is cut by the diagonal); windows, GQA 4/1 and 8/2, a block of one row."""
    Hq, Hkv, Nq, Nk, causal, window = shape
    q, k, v = _torch_inputs(rng, 2, Hq, Hkv, Nq, Nk, 64, "bfloat16" if Nq % 2 else "float16")
    _assert_checks(hp.oracle_check(q, k, v, causal=causal, window=window, config=V6), f"v6 {shape}")


@gpu
@pytest.mark.gpu
def test_v6_fully_masked_rows_are_zero_and_minus_inf(rng):
    import torch
    q, k, v = _torch_inputs(rng, 1, 2, 2, 500, 200, 64, "bfloat16")
    o, lse = hp.attention(q, k, v, causal=True, config=V6)
    torch.cuda.synchronize()
    assert torch.equal(o[:, :, :300], torch.zeros_like(o[:, :, :300]))
    assert torch.isneginf(lse[:, :, :300]).all() and torch.isfinite(lse[:, :, 300:]).all()
    assert not torch.isnan(o).any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", hp.DTYPES)
def test_v6_agrees_with_v5(rng, causal, dtype):
    """The same arithmetic a row (v6 changes the block, the issue order and how the mask is found):
    v6's O and LSE within a unit in the last place of v5's, the same rows -inf; and through
    ik.attention (the plan path) v6 gives what hp.attention gives."""
    import torch

    import iokernels as ik
    q, k, v = _torch_inputs(rng, 2, 8, 2, 1000, 1100, 64, dtype)
    o5, l5 = hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v5"))
    o6, l6 = hp.attention(q, k, v, causal=causal, config=V6)
    torch.cuda.synchronize()
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert (o6.float() - o5.float()).abs().max().item() <= 2 * eps
    assert torch.equal(torch.isneginf(l6), torch.isneginf(l5))
    fin = torch.isfinite(l5)
    assert (l6[fin] - l5[fin]).abs().max().item() <= 1e-4
    o_public = ik.attention(q, k, v, causal=causal, backend="cupy", config=V6)
    torch.cuda.synchronize()
    assert torch.equal(o_public, o6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(pingpong=False), dict(stages=2), dict(block_n=64, stages=3)])
def test_v6_other_tile_settings(rng, kw):
    q, k, v = _torch_inputs(rng, 2, 4, 2, 777, 1029, 64, "bfloat16")
    for causal in (False, True):
        _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=hp.HopperConfig(version="v6", **kw)),
                       f"v6 {kw} causal={causal}")


# --------------------------------------------------------------------------- v7 on a Hopper GPU
# v7 joins test_two_x_rule_square and test_two_x_rule_gqa_and_unequal_lengths at every head dim;
# it changes when a stage is released and refilled, not the arithmetic: v5's bits, exactly.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", hp.HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True))
def test_v7_gives_v5s_bits(rng, d, causal):
    """O and LSE equal to v5's bit for bit at the default tiles, with a two-stage ring, without
    ping-pong, with a window and GQA; and ik.attention (the plan path) gives hp.attention's."""
    import torch

    import iokernels as ik
    dtype = "bfloat16" if causal else "float16"
    q, k, v = _torch_inputs(rng, 2, 8, 2, 1000, 1100, d, dtype)
    for window in (None, (300, 0) if causal else (200, 50)):
        o5, l5 = hp.attention(q, k, v, causal=causal, window=window, config=hp.HopperConfig(version="v5"))
        for kw in ({}, dict(stages=2), dict(pingpong=False)):
            o7, l7 = hp.attention(q, k, v, causal=causal, window=window, config=hp.HopperConfig(version="v7", **kw))
            torch.cuda.synchronize()
            assert torch.equal(o7, o5) and torch.equal(l7, l5), (d, causal, window, kw)
    o_public = ik.attention(q, k, v, causal=causal, backend="cupy", config=hp.HopperConfig(version="v7"))
    torch.cuda.synchronize()
    assert torch.equal(o_public, hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v7"))[0])


@gpu
@pytest.mark.gpu
def test_v7_one_tile_and_empty_rows(rng):
    """A block of one key tile (K_0 never refilled), rows that see no key (zero and -inf), Nk = 1."""
    import torch
    for Nq, Nk, causal in ((500, 200, True), (64, 1, False), (130, 64, False)):
        q, k, v = _torch_inputs(rng, 1, 2, 1, Nq, Nk, 256 if Nk == 64 else 128, "bfloat16")
        _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=hp.HopperConfig(version="v7")),
                       f"v7 Nq={Nq} Nk={Nk} causal={causal}")
        if causal:
            o, lse = hp.attention(q, k, v, causal=True, config=hp.HopperConfig(version="v7"))
            torch.cuda.synchronize()
            assert torch.equal(o[:, :, :300], torch.zeros_like(o[:, :, :300]))
            assert torch.isneginf(lse[:, :, :300]).all() and not torch.isnan(o).any()


# --------------------------------------------------------------------------- v8 on a Hopper GPU
# v8 joins test_two_x_rule_square and test_two_x_rule_gqa_and_unequal_lengths at its default tiles;
# these add its other tiles and what its row-bound mask must get right.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", hp.HEAD_DIMS)
def test_v8_masks_windows_and_other_tiles(rng, d):
    """At each head dim: causal Nq > Nk (rows that see nothing: zero and -inf), windows cutting a
    176-key tile, GQA; v8's default tiles, 64-key tiles, no ping-pong; by the 2x rule."""
    import torch
    for Hq, Hkv, Nq, Nk, causal, window in ((2, 1, 500, 200, True, None), (4, 2, 700, 1029, False, (100, 37)),
                                            (6, 3, 333, 1000, True, (250, 0)), (2, 2, 1, 177, False, None)):
        q, k, v = _torch_inputs(rng, 2, Hq, Hkv, Nq, Nk, d, "bfloat16" if Nq % 2 else "float16")
        for kw in ({}, dict(block_n=64), dict(pingpong=False)):
            cfg = hp.HopperConfig(version="v8", **kw)
            _assert_checks(hp.oracle_check(q, k, v, causal=causal, window=window, config=cfg),
                           f"v8 {kw} d={d} {(Hq, Hkv, Nq, Nk, causal, window)}")
        if Nq > Nk and causal:
            o, lse = hp.attention(q, k, v, causal=True, config=hp.HopperConfig(version="v8"))
            torch.cuda.synchronize()
            assert torch.equal(o[:, :, :300], torch.zeros_like(o[:, :, :300]))
            assert torch.isneginf(lse[:, :, :300]).all() and not torch.isnan(o).any()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_v8_gives_v5s_bits_at_its_128_key_tiles(rng, d, causal):
    """At head_dim 64 and 128 v8's tile is v5's (128 keys) and only its masked copy reads the mask
    another way: the same keys are set to -inf, so O and LSE are v5's bit for bit (windows, GQA)."""
    import torch
    q, k, v = _torch_inputs(rng, 2, 8, 2, 1000, 1100, d, "bfloat16" if causal else "float16")
    for window in (None, (300, 0) if causal else (200, 50)):
        o5, l5 = hp.attention(q, k, v, causal=causal, window=window, config=hp.HopperConfig(version="v5"))
        o8, l8 = hp.attention(q, k, v, causal=causal, window=window, config=hp.HopperConfig(version="v8"))
        torch.cuda.synchronize()
        assert torch.equal(o8, o5) and torch.equal(l8, l5), (d, causal, window)


# --------------------------------------------------------------------------- v9 on a Hopper GPU
# v9 joins test_two_x_rule_square and test_two_x_rule_gqa_and_unequal_lengths at its default grid;
# it changes which block computes a tile and when its loads are issued, not the arithmetic.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", hp.HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True))
def test_v9_gives_v8s_bits(rng, d, causal):
    """O and LSE equal to v8's bit for bit: one block an SM, three blocks (each claims dozens of
    tiles), one block without ping-pong; windows, GQA, Nq != Nk; the same launch twice (the counter
    is back at zero after each); and through ik.attention (the plan path), also captured in a CUDA
    graph and replayed."""
    import torch

    import iokernels as ik
    q, k, v = _torch_inputs(rng, 3, 8, 2, 1000, 1100, d, "bfloat16" if causal else "float16")
    for window in (None, (300, 0) if causal else (200, 50)):
        o8, l8 = hp.attention(q, k, v, causal=causal, window=window, config=hp.HopperConfig(version="v8"))
        for kw in ({}, dict(blocks=3), dict(blocks=1, pingpong=False)):
            for _ in range(2):
                o9, l9 = hp.attention(q, k, v, causal=causal, window=window,
                                      config=hp.HopperConfig(version="v9", **kw))
                torch.cuda.synchronize()
                assert torch.equal(o9, o8) and torch.equal(l9, l8), (d, causal, window, kw)
    cfg = hp.HopperConfig(version="v9", blocks=5)
    o8 = hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v8"))[0]
    assert torch.equal(ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg), o8)
    ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg)        # warm: the plan exists
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg)    # this stream's counter
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, o8)


@gpu
@pytest.mark.gpu
def test_v9_tiles_without_keys_one_tile_and_fewer_tiles_than_blocks(rng):
    """Query tiles whose rows see no key (bottom-right causal, Nq > Nk: zero and -inf, no Q loaded),
    blocks of one key tile, Nk = 1, and a grid of more blocks asked for than there are tiles; by
    the 2x rule and against v8's bits."""
    import torch
    for Nq, Nk, causal, d in ((700, 200, True, 128), (64, 1, False, 256), (130, 64, False, 64), (900, 100, True, 64)):
        q, k, v = _torch_inputs(rng, 2, 2, 1, Nq, Nk, d, "bfloat16")
        for kw in ({}, dict(blocks=1), dict(blocks=1000)):
            cfg = hp.HopperConfig(version="v9", **kw)
            _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=cfg), f"v9 {kw} Nq={Nq} Nk={Nk}")
            o9, l9 = hp.attention(q, k, v, causal=causal, config=cfg)
            o8, l8 = hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v8"))
            torch.cuda.synchronize()
            assert torch.equal(o9, o8) and torch.equal(l9, l8), (Nq, Nk, causal, kw)
        if causal:
            assert torch.equal(o9[:, :, :Nq - Nk], torch.zeros_like(o9[:, :, :Nq - Nk]))
            assert torch.isneginf(l9[:, :, :Nq - Nk]).all() and not torch.isnan(o9).any()


# --------------------------------------------------------------------------- v11 on a Hopper GPU
# v11 joins test_two_x_rule_square and test_two_x_rule_gqa_and_unequal_lengths at its default
# groups; it changes which block computes a tile, not the arithmetic.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", hp.HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True))
def test_v11_gives_v8s_bits(rng, monkeypatch, d, causal):
    """O and LSE equal to v8's bit for bit, with the longest-first groups the policy gives and with
    groups of 1 (v8's order), 3 (a short last group: 24 pairs), 5 and every pair; windows, GQA,
    Nq != Nk, no ping-pong; and through ik.attention (the plan path), also captured in a CUDA graph
    and replayed."""
    import torch

    import iokernels as ik
    import importlib
    ha = importlib.import_module("iokernels.cupy_raw.hopper.attention")   # the module, not the function
    q, k, v = _torch_inputs(rng, 3, 8, 2, 1000, 1100, d, "bfloat16" if causal else "float16")
    for window in (None, (300, 0) if causal else (200, 50)):
        o8, l8 = hp.attention(q, k, v, causal=causal, window=window, config=hp.HopperConfig(version="v8"))
        for pairs in (None, 1, 3, 5, 24):
            for kw in ({},) if pairs not in (None, 5) else ({}, dict(pingpong=False)):
                with monkeypatch.context() as m:
                    if pairs is not None:
                        m.setattr(ha, "longest_first_pairs", lambda *a, pairs=pairs: pairs)
                    o11, l11 = hp.attention(q, k, v, causal=causal, window=window,
                                            config=hp.HopperConfig(version="v11", **kw))
                torch.cuda.synchronize()
                assert torch.equal(o11, o8) and torch.equal(l11, l8), (d, causal, window, pairs, kw)
    cfg = hp.HopperConfig(version="v11")
    o8 = hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v8"))[0]
    assert torch.equal(ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg), o8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg)
    for _ in range(2):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, o8)


# --------------------------------------------------------------------------- v10 on a Hopper GPU (d = 64)
# v10 joins test_two_x_rule_square and test_two_x_rule_gqa_and_unequal_lengths at d = 64; a row's
# arithmetic is v8's, so these hold it to v8's bits where the 192-row block and the round change
# which rows share a block and in what order the products are issued.
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("causal", (False, True))
def test_v10_gives_v8s_bits(rng, causal):
    """O and LSE equal to v8's bit for bit: the default, a two-stage ring, no round, 64-key tiles;
    windows, GQA, Nq != Nk; and ik.attention (the plan path) gives hp.attention's."""
    import torch

    import iokernels as ik
    q, k, v = _torch_inputs(rng, 2, 8, 2, 1000, 1100, 64, "bfloat16" if causal else "float16")
    for window in (None, (300, 0) if causal else (200, 50)):
        for kw in ({}, dict(stages=2), dict(pingpong=False), dict(block_n=64)):
            o8, l8 = hp.attention(q, k, v, causal=causal, window=window,
                                  config=hp.HopperConfig(version="v8", block_n=kw.get("block_n")))
            o10, l10 = hp.attention(q, k, v, causal=causal, window=window,
                                    config=hp.HopperConfig(version="v10", **kw))
            torch.cuda.synchronize()
            assert torch.equal(o10, o8) and torch.equal(l10, l8), (causal, window, kw)
    cfg = hp.HopperConfig(version="v10")
    o_public = ik.attention(q, k, v, causal=causal, backend="cupy", config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(o_public, hp.attention(q, k, v, causal=causal, config=cfg)[0])


@gpu
@pytest.mark.gpu
def test_v10_rows_without_keys_one_tile_and_small_blocks(rng):
    """Blocks whose rows see no key (bottom-right causal, Nq > Nk: zero and -inf), blocks of one key
    tile, Nk = 1, a block of one row; by the 2x rule and against v8's bits."""
    import torch
    for Nq, Nk, causal in ((700, 200, True), (64, 1, False), (193, 130, False), (1, 177, False), (900, 100, True)):
        q, k, v = _torch_inputs(rng, 2, 2, 1, Nq, Nk, 64, "bfloat16")
        cfg = hp.HopperConfig(version="v10")
        _assert_checks(hp.oracle_check(q, k, v, causal=causal, config=cfg), f"v10 Nq={Nq} Nk={Nk}")
        o10, l10 = hp.attention(q, k, v, causal=causal, config=cfg)
        o8, l8 = hp.attention(q, k, v, causal=causal, config=hp.HopperConfig(version="v8"))
        torch.cuda.synchronize()
        assert torch.equal(o10, o8) and torch.equal(l10, l8), (Nq, Nk, causal)
        if causal:
            assert torch.equal(o10[:, :, :Nq - Nk], torch.zeros_like(o10[:, :, :Nq - Nk]))
            assert torch.isneginf(l10[:, :, :Nq - Nk]).all() and not torch.isnan(o10).any()
