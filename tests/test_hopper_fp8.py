"""The FP8 forward on Hopper (cupy_raw/hopper/fp8_forward.py, kernels/fa_fp8_v1.cu, fa_fp8_v2.cu).

Without a GPU: fa_fp8_v1.cu (the forward and its two quantization kernels) and fa_fp8_v2.cu (the
forward with ping-pong and the softmax overlapped with P V, with ping-pong on and off) compile
with nvcc for sm_90a from exactly the source NVRTC is handed, at each output dtype and ring
depth, with no local memory (no spills, no stack frame), registers within the launch bound's
share (what a thread has before setmaxnreg), no wgmma serialisation (ptxas C7515) and no
ignored setmaxnreg (C7508); the sources refuse what they cannot run with #error; the config and
the input checks are ValueErrors naming the argument; the V^T key order is the one the e4m3
A fragment reads; neither kernel is a registered attention version (FP8 is opt-in); and the
launches of both versions, recorded by the stand-in CuPy with the tensor maps faked, pass
exactly what the kernels declare.

With compute capability 9.0:

* the quantization kernels against iokernels.fp8's model: the same scales bit for bit and the
  same e4m3 codes (V^T transposed and in the fragment's key order, zero past Nk);
* FlashAttention-3's accuracy experiment (iokernels.fp8.outlier_inputs, the seed and shape of
  iokernels.fp8.accuracy_experiment, inputs rounded to bfloat16 first so that every side sees
  the same numbers): the kernel's RMSE against the float64 oracle is within a factor
  :data:`EMULATION_FACTOR` of the CPU emulation's (iokernels.fp8.fp8_attention with the kernel's
  blocks, 128 rows), with and without the Hadamard transform; and the transform lowers the
  kernel's error at least 2x (the CPU experiment shows about 2.2x at this shape and seed: asserted
  too, as the premise);
* the kernel against its tile-by-tile NumPy model (_kernel_model: the same codes and scales, the
  running maximum over 128-key tiles, P * P_SCALE cast to e4m3, V's scale carried in O): O within
  MODEL_SHARE of the model's own FP8 error, LSE to float32 rounding; on the CPU the model errs like
  the CPU experiment (test_the_kernel_model_is_the_cpu_experiment, no GPU needed);
* LSE against the LSE of the quantized scores (float64 on the host): the S scaling is exact up
  to float32 rounding;
* causal (bottom-right), GQA, Nq != Nk, rows that see no key (O = 0, LSE = -inf), NumPy in and out;
* each of the above for both versions (v1 and v2 share the model: the same arithmetic), and v2
  against v1 directly (ring depths, ping-pong on and off): the same output up to float32
  reordering, far below the FP8 error.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from iokernels import fp8
from iokernels.core.registry import Need
from iokernels.cupy_raw import hopper as hp
from iokernels.cupy_raw import launch
from iokernels.cupy_raw.hopper import fp8_forward as F

from nvcc_support import NVCC, PTXAS_V, compile_all, compile_source, registers_only
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")
#: the kernel's RMSE may differ from the CPU emulation's by at most this factor either way.  The
#: two share every quantization (scales and codes bit for bit: test_quantize_matches_the_cpu_model)
#: and P's scaling; they differ in the softmax's maximum (running in the kernel, exact in the
#: model: P is cast relative to a smaller maximum, which e4m3's relative spacing does not care
#: about inside its normal range), in summation order, in the tensor cores' accumulation of FP8
#: products (not exactly IEEE float32) and in ex2.approx -- each far below e4m3's 2^-4 spacing,
#: so the two errors should agree to a few percent; 1.5 leaves room without hiding a real bug
#: (a wrong scale, a lost tile or a P cast without its scaling each move the RMSE by far more),
#: and the lower bound catches a kernel that is not really computing in FP8.
EMULATION_FACTOR = 1.5
#: the kernel may differ from its tile-by-tile NumPy model (_kernel_model) by at most this share of
#: the model's own FP8 error (RMSE against float64).  The two cast the same P up to the rounding of
#: S (the tensor cores' accumulation of FP8 products, not exactly IEEE float32) and of exp2
#: (ex2.approx), which tips a P * P_SCALE to the neighbouring e4m3 code (12.5% apart at most) only
#: when it lies that close to a rounding midpoint: a small share of the casts.  A real bug (a wrong
#: scale, key order or tile) moves O by about its own size, several times the FP8 error.
MODEL_SHARE = 0.2
#: the acceptance: incoherent processing lowers the error at least this much at the experiment's shape
HADAMARD_GAIN = 2.0
#: v2 may differ from v1 by at most this share of v1's FP8 error (RMSE against float64).  v2 changes
#: only the issue order: every element sees v1's operations in v1's order, so the two should agree
#: bit for bit, and float32 reordering by the compiler would move O by float32 rounding.  A
#: pipeline bug (O left in the wrong V tile's units, a product from the wrong stage, a lost tile)
#: moves O by about its own size.
V2_SHARE = 0.01
#: registers a thread has before setmaxnreg: the launch bound (one block of FP8_THREADS a
#: multiprocessor) shares the 64K register file, in steps of 8; ptxas reports this figure for a
#: warp-specialized kernel (the producer then gives registers back, the consumers take them)
LAUNCH_REGS = 65536 // 384 // 8 * 8


# --------------------------------------------------------------------------- compile (no GPU)
def _compile(tmp_path, defines, extra=PTXAS_V, name=F.FP8_FILE):
    return compile_source(tmp_path, name, hp.source(name), defines, extra=extra)


def _v2_configs():
    """Every v2 config the launcher can build: each ring depth it takes, ping-pong on and off."""
    return [F.Fp8Config(stages=s, version="v2", pingpong=pp) for s in range(2, F.FP8_MAX_STAGES + 1)
            for pp in (True, False)]


def _within_launch_regs(label, err):
    used = [int(n) for n in re.findall(r"Used (\d+) registers", err)]
    assert used and max(used) <= LAUNCH_REGS, (label, used)


@needs_nvcc
def test_fp8_kernels_compile_for_sm90a_in_registers(tmp_path):
    jobs = [F.Fp8Config(stages=s).defines(dt) for dt in F.FP8_DTYPES for s in range(1, F.FP8_MAX_STAGES + 1)]
    for defines in jobs:
        rc, err = _compile(tmp_path, defines)
        registers_only(str(defines), rc, err)
        _within_launch_regs(str(defines), err)
        entries = re.findall(r"Compiling entry function '(\w+)'", err)
        assert sorted(entries) == ["fa_fp8_v1", "fp8_quantize_rows", "fp8_quantize_vt"], err[:400]


@needs_nvcc
def test_fp8_v2_compiles_for_sm90a_in_registers(tmp_path):
    """v2 (the forward alone: the quantization kernels stay v1's) at both output dtypes, every ring
    depth, ping-pong on and off: no spills, no serialised wgmma, no ignored setmaxnreg."""
    jobs = [(cfg, dt) for cfg in _v2_configs() for dt in F.FP8_DTYPES]
    results = compile_all(lambda j: _compile(tmp_path, j[0].defines(j[1]), name=j[0].file), jobs)
    for (cfg, dt), (rc, err) in zip(jobs, results):
        label = f"{cfg} {dt}"
        registers_only(label, rc, err)
        _within_launch_regs(label, err)
        assert re.findall(r"Compiling entry function '(\w+)'", err) == ["fa_fp8_v2"], err[:400]


@needs_nvcc
def test_fp8_source_refuses_what_it_cannot_run(tmp_path):
    base = F.Fp8Config().defines("bfloat16")
    for bad, message in ((dict(HEAD_DIM=64), "HEAD_DIM 128"), (dict(BLOCK_N=64), "BLOCK_N 128"),
                         (dict(STAGES=5), "STAGES 1 .. 4"), (dict(IK_DTYPE=0), "IK_DTYPE 1 (float16) or 2"),
                         (dict(P_SCALE=None), "-DP_SCALE is missing"), (dict(STAGES=None), "-DSTAGES is missing")):
        defines = {k: v for k, v in dict(base, **bad).items() if v is not None}
        rc, err = _compile(tmp_path, defines, extra=())
        assert rc != 0 and message in err, f"{bad}: rc={rc} {err[:300]}"
    v2 = F.Fp8Config(version="v2").defines("bfloat16")
    for bad, message in ((dict(STAGES=1), "STAGES 2 .. 4"), (dict(PINGPONG=None), "-DPINGPONG is missing"),
                         (dict(HEAD_DIM=64), "HEAD_DIM 128"), (dict(BLOCK_M=64), "BLOCK_M 128")):
        defines = {k: v for k, v in dict(v2, **bad).items() if v is not None}
        rc, err = _compile(tmp_path, defines, extra=(), name="fa_fp8_v2")
        assert rc != 0 and message in err, f"v2 {bad}: rc={rc} {err[:300]}"


def test_fp8_file_is_a_hopper_source_without_a_record():
    from iokernels.cupy_raw import REGISTRY
    assert F.FP8_FILE == F.FP8_FILES["v1"] and set(F.FP8_FILES.values()) <= set(launch.HOPPER_UNRECORDED)
    for name in F.FP8_FILES.values():
        assert name in hp.SOURCES
        assert "#include" not in hp.source(name)
        assert not [r for r in REGISTRY if r.file.removesuffix(".cu") == name]     # opt-in: no record
        # no default path reaches it: on Hopper or not, the default is a 16-bit version
        assert REGISTRY.default("attention", Need(dtype="bfloat16", head_dim=128, cc=90)).file != name + ".cu"
    assert all(r.config_class is not F.Fp8Config for r in REGISTRY)


# --------------------------------------------------------------------------- config, checks (no GPU)
def test_config_names_the_field_and_counts_its_sram():
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match="config.stages"):
            F.Fp8Config(stages=bad)
    for kw, field in ((dict(version="v3"), "config.version"), (dict(version=2), "config.version"),
                      (dict(version="v2", pingpong=1), "config.pingpong"),
                      (dict(version="v2", stages=1), "config.stages: v2 uses K_j and V_{j-1} together"),
                      (dict(pingpong=False), "config.pingpong: v1 has no ping-pong"),
                      (dict(version="v1", pingpong=False), "config.pingpong")):
        with pytest.raises(ValueError, match=re.escape(field)):
            F.Fp8Config(**kw)
    c = F.Fp8Config()
    assert c.resolve() == F.Fp8Config(F.FP8_STAGES, "v1", True)      # v1 stays the default
    assert c.resolve().stages == F.FP8_STAGES and c.file == "fa_fp8_v1"
    v2 = F.Fp8Config(version="v2")
    assert v2.file == "fa_fp8_v2" and v2.smem_bytes() == c.smem_bytes()     # the same SRAM layout
    assert v2.defines("bfloat16") == dict(c.defines("bfloat16"), PINGPONG=1)
    assert F.Fp8Config(version="v2", pingpong=False, stages=3).defines("float16")["PINGPONG"] == 0
    # Q codes + 2 x (K codes + V^T codes), 128 x 128 bytes each; 7 mbarriers; the alignment slack
    assert c.smem_bytes() == 128 * 128 * 5 + 8 * 7 + 1024
    for s in range(1, F.FP8_MAX_STAGES + 1):
        assert F.Fp8Config(stages=s).smem_bytes() <= hp.FALLBACK_SMEM_OPTIN
    d = c.defines("float16")
    assert d == dict(IK_DTYPE=1, HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, STAGES=2, P_SCALE="256.0f",
                     QUANT_THREADS=F.QUANT_THREADS)                     # v1's defines: no PINGPONG
    assert F.P_SCALE == fp8.P_SCALE and F.E4M3_MAX == 448.0


def test_vt_key_order_is_the_fragment_order():
    """Thread t of a quad holds, of each 32-key group, keys {2t, 2t+1, 8+2t, 9+2t} and the same
    plus 16 (the float32 accumulator layout); the e4m3 A fragment reads positions 4t..4t+3 and
    16+4t..16+4t+3.  V^T's order puts exactly those keys there, each once."""
    order = F.vt_key_order()
    assert sorted(order) == list(range(32))
    for t in range(4):
        held = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t}
        assert set(order[4 * t:4 * t + 4]) == held
        assert set(order[16 + 4 * t:20 + 4 * t]) == {16 + k for k in held}
    # the permuted product is the product: sum over keys in any order
    rng = np.random.default_rng(0)
    p, v = rng.standard_normal((4, 32)), rng.standard_normal((32, 8))
    np.testing.assert_allclose(p[:, order] @ v[order], p @ v, atol=1e-12)


def test_bad_inputs_raise_naming_the_argument(rng):
    q = rng.standard_normal((1, 2, 16, 128)).astype(np.float16)
    with pytest.raises(ValueError, match="q: dtype"):
        hp.fp8_attention(q.astype(np.float32), q, q)
    with pytest.raises(ValueError, match="q: the FP8 kernel takes head_dim"):
        hp.fp8_attention(q[..., :64], q[..., :64], q[..., :64])
    with pytest.raises(ValueError, match="causal"):
        hp.fp8_attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match="hadamard"):
        hp.fp8_attention(q, q, q, hadamard="yes")
    with pytest.raises(ValueError, match="config"):
        hp.fp8_attention(q, q, q, config="v1")
    with pytest.raises(ValueError, match="config: expected an Fp8Config"):
        hp.fp8_attention(q, q, q, config=hp.HopperConfig(version="v5"))
    with pytest.raises(ValueError, match="config.version"):
        hp.fp8_attention(q, q, q, config=F.Fp8Config(version="v9"))
    with pytest.raises(ValueError, match="signs"):
        hp.fp8_attention(q, q, q, hadamard=True, signs=np.ones(64))
    with pytest.raises(ValueError, match="seed"):
        hp.fp8_attention(q, q, q, hadamard=True, seed="zero")
    with pytest.raises(ValueError, match="k"):
        hp.fp8_attention(q, q[:, :, :, :64], q)
    with pytest.raises(ValueError, match="x: expected Fp8Inputs"):
        hp.fp8_attention_codes(q)
    if hp.available() is not None:                       # no Hopper here: refused by name, with the reason
        with pytest.raises(ValueError, match="q: the FP8 Hopper kernel cannot run here"):
            hp.fp8_attention(q, q, q)
        with pytest.raises(ValueError, match="q: the FP8 Hopper kernel cannot run here"):
            hp.quantize_qkv(q, q, q, hadamard=True)


# --------------------------------------------------------------------------- the launches (stand-in CuPy)
DRIVER = r'''
import json, sys
import numpy as np
import cupy
from iokernels.cupy_raw import hopper as hp
from iokernels.cupy_raw import launch
from iokernels.cupy_raw.hopper import fp8_forward as F
from iokernels.core.testing import make_inputs
MAPS = []
def fake_map(ptr, dims, strides, box):
    MAPS.append(dict(dims=[int(x) for x in dims], strides=[int(x) for x in strides], box=[int(x) for x in box]))
    return np.zeros(1, dtype=np.dtype((np.void, 128)))
F.available, F.tensor_map_u8 = (lambda: None), fake_map
rng = np.random.default_rng(0)
out = {}
def kind(a):
    return "tmap" if isinstance(a, np.ndarray) and a.dtype.kind == "V" and a.dtype.itemsize == 128 else \
        "bits" if isinstance(a, np.ndarray) and a.dtype.kind == "V" else type(a).__name__
CASES = (("bfloat16", False, True, (2, 4, 2, 300, 333), "v1"), ("float16", True, False, (1, 2, 2, 37, 77), "v1"),
         ("bfloat16", True, False, (1, 4, 2, 300, 333), "v2"), ("float16", False, True, (2, 2, 2, 37, 77), "v2"))
for dt, causal, had, shape, ver in CASES:
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=128, dtype=dt)
    o, lse = hp.fp8_attention(q, k, v, causal=causal, hadamard=had, seed=3, config=F.Fp8Config(version=ver))
    out[f"{dt} {causal} {had} {ver}"] = dict(
        launches=[dict(name=L["name"], options=list(L["options"]), grid=list(L["grid"]), block=list(L["block"]),
                       smem=int(L["smem"]), args=[kind(a) for a in L["args"]],
                       ints=[int(a) for a in L["args"] if isinstance(a, np.int32)]) for L in cupy.LAUNCHES],
        maps=MAPS[:], o=[list(o.shape), str(o.dtype)], lse=[list(lse.shape), str(lse.dtype)])
    cupy.LAUNCHES.clear()
    MAPS.clear()
json.dump(out, sys.stdout)
'''


def _params(name, options):
    src = (launch.source("fwht") if name == "fwht" else hp.source(name) if name in F.FP8_FILES.values()
           else hp.source(F.FP8_FILE))
    r = subprocess.run([NVCC, "-E", "-arch=sm_90", "-x", "cu", *[o for o in options if o.startswith("-D")], "-"],
                       input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-400:]
    text = "\n".join(x for x in r.stdout.splitlines() if not x.lstrip().startswith("#"))
    for m in re.finditer(r"\b" + name + r"\s*\(", text):    # the definition: the parameter list, then "{"
        end, depth = m.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        if text[end:end + 40].lstrip().startswith("{"):
            params = text[m.end():end - 1].split(",")
            break
    return ["tmap" if "TmaMap" in p else "bits" if "SignBits" in p else "uint64" if "*" in p
            else "int32" if re.match(r"\s*(const )?int\b", p) else "float32" for p in params]


@needs_nvcc
def test_launches_match_the_kernel_signatures():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{here / 'stand_ins'}{os.pathsep}{here.parent}")
    r = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, cwd=here.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    sigs = {}
    for label, run in got.items():
        dt, causal, had, ver = label.split()
        names = [L["name"] for L in run["launches"]]
        pre = ["fwht", "fp8_quantize_rows"] * 2 if had == "True" else ["fp8_quantize_rows"] * 2
        assert names == pre + ["fp8_quantize_vt", F.FP8_FILES[ver]], (label, names)
        for L in run["launches"]:
            key = (L["name"], tuple(L["options"]))
            if key not in sigs:
                sigs[key] = _params(*key)
            assert L["args"] == sigs[key], (label, L["name"], L["args"], sigs[key])
        fa = run["launches"][-1]
        assert fa["block"] == [F.FP8_THREADS] and fa["smem"] == F.Fp8Config().smem_bytes()
        nq, nk, hq, hkv, left, right, heavy = fa["ints"]
        assert (left, right) == ((-1, 0) if causal == "True" else (-1, -1))
        assert fa["grid"] == [-(-nq // 128), hq, run["o"][0][0]]
        tk = -(-nk // 128)
        assert run["launches"][-2]["grid"] == [tk, run["o"][0][0] * hkv]             # V^T: a block a key tile
        d = 128
        B = run["o"][0][0]
        assert run["maps"] == [dict(dims=[d, nq, B * hq], strides=[d, d * nq], box=[d, 128, 1]),
                               dict(dims=[d, nk, B * hkv], strides=[d, d * nk], box=[d, 128, 1]),
                               dict(dims=[tk * 128, d, B * hkv], strides=[tk * 128, tk * 128 * d], box=[128, d, 1])]
        assert run["o"] == [[B, hq, nq, d], dt]
        assert run["lse"] == [[B, hq, nq], "float32"]


# --------------------------------------------------------------------------- on a Hopper GPU
gpu = pytest.mark.skipif(hp.available() is not None, reason=f"Hopper kernels: {hp.available()}")


def _bf16(x):
    from iokernels.core.testing import numpy_dtype
    return np.asarray(x).astype(numpy_dtype("bfloat16"))


def _to_numpy(x):
    """A device array's bytes on the host, dtype kept (codes stay uint8)."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _e4m3(codes):
    import ml_dtypes
    return _to_numpy(codes).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _model_codes(x, block):
    """iokernels.fp8.quantize's scales and codes (its arithmetic, kept apart): per block of rows."""
    import ml_dtypes
    x = np.asarray(x, np.float32)
    n = x.shape[-2]
    tiles = -(-n // block)
    scales = np.empty(x.shape[:-2] + (tiles,), np.float32)
    codes = np.empty(x.shape, np.float64)
    for t in range(tiles):
        blk = x[..., t * block:(t + 1) * block, :]
        amax = np.max(np.abs(blk), axis=(-1, -2))
        s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
        scales[..., t] = s
        codes[..., t * block:(t + 1) * block, :] = (blk / s[..., None, None]).astype(ml_dtypes.float8_e4m3fn)
    return scales, codes


@gpu
@pytest.mark.gpu
def test_quantize_matches_the_cpu_model_bit_for_bit(rng):
    B, Hq, Hkv, Nq, Nk, d = 2, 4, 2, 300, 333, 128
    q, k, v = (np.asarray(_bf16(x)) for x in fp8.outlier_inputs(rng, B, Hq, Nq, Nk, d))
    k, v = k[:, :Hkv], v[:, :Hkv]
    x = hp.quantize_qkv(q, k, v)
    for name, src, codes, scales, block in (("q", q, x.q, x.q_scale, 128), ("k", k, x.k, x.k_scale, 128),
                                            ("v", v, None, x.v_scale, 128)):
        s_model, c_model = _model_codes(src.astype(np.float32), block)
        np.testing.assert_array_equal(_to_numpy(scales), s_model, err_msg=f"{name} scales")
        if codes is not None:
            np.testing.assert_array_equal(_e4m3(codes), c_model, err_msg=f"{name} codes")
    _, cv_ = _model_codes(v.astype(np.float32), 128)
    vt = _e4m3(x.vt)                                           # (B, Hkv, d, Nk_pad)
    tk = -(-Nk // 128)
    assert vt.shape == (B, Hkv, d, tk * 128)
    order = F.vt_key_order()
    keys = (np.arange(tk * 128) // 32) * 32 + order[np.arange(tk * 128) % 32]
    want = np.zeros_like(vt)
    inside = keys < Nk
    want[..., inside] = np.swapaxes(cv_, -1, -2)[..., keys[inside]]
    np.testing.assert_array_equal(vt, want)
    # after the Hadamard transform (float32 on the GPU, float64 in the model): codes agree but for
    # the rare value that lies within float32 rounding of a tie
    xh = hp.quantize_qkv(q, k, v, hadamard=True, seed=11)
    signs = F.resolve_signs(d, None, 11)
    _, cq = _model_codes(fp8.randomized_hadamard(q.astype(np.float64), signs).astype(np.float32), 128)
    assert np.mean(_e4m3(xh.q) == cq) > 0.999


def _experiment_inputs():
    """iokernels.fp8.accuracy_experiment's draw (seed, shape, then the signs), rounded to bfloat16."""
    rng = np.random.default_rng(fp8.EXPERIMENT_SEED)
    q, k, v = fp8.outlier_inputs(rng, 1, 1, 1024, 8192, 128)
    signs = fp8.random_signs(128, rng)
    return (*(np.asarray(_bf16(x)) for x in (q, k, v)), signs)


def _oracle(q, k, v, causal=False):
    """The float64 oracle in passes of query rows (memory only).  A causal pass keeps the whole
    problem's bottom-right alignment: row i sees keys up to i + Nk - Nq, so the pass of rows
    [r, r + n) is given the first r + n + Nk - Nq keys (its own bottom-right corner)."""
    from iokernels.core import reference
    rows, (nq, nk) = fp8.ROWS_PER_PASS, (q.shape[-2], k.shape[-2])
    outs, lses = [], []
    for r in range(0, nq, rows):
        qr = q[..., r:r + rows, :]
        keys = nk if not causal else r + qr.shape[-2] + nk - nq
        if keys <= 0:                                    # every row of the pass sees no key
            outs.append(np.zeros(qr.shape))
            lses.append(np.full(qr.shape[:-1], -np.inf))
            continue
        o, lse = reference.attention(qr, k[..., :keys, :], v[..., :keys, :], causal=causal)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs, axis=-2), np.concatenate(lses, axis=-1)


def test_the_oracle_in_passes_keeps_the_causal_alignment(rng):
    """More query rows than a pass, fewer keys (bottom-right: the first 1100 - 300 rows see no
    key): the oracle in passes is the one-shot oracle, row for row."""
    from iokernels.core import reference
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 1100, 16), (1, 1, 300, 16), (1, 1, 300, 16)))
    for causal in (True, False):
        o, lse = _oracle(q, k, v, causal=causal)
        want_o, want_lse = reference.attention(q, k, v, causal=causal)
        assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
        assert np.max(np.abs(o - want_o)) <= 1e-12 and np.max(np.abs(lse - want_lse)[np.isfinite(want_lse)]) <= 1e-12


def _kernel_model(q, k, v, *, causal=False, signs=None):
    """fa_fp8_v1 tile by tile in NumPy (and so fa_fp8_v2: the same arithmetic, issued in another
    order; float64 arithmetic, e4m3 casts by ml_dtypes): the same per-tile codes and scales, the
    running maximum over key tiles of 128, P * P_SCALE cast to e4m3, O kept in units of the
    current V tile's scale.  Returns (O, LSE), float64."""
    import ml_dtypes
    from iokernels.core import conventions as cv
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    if signs is not None:
        q, k = fp8.randomized_hadamard(q, signs), fp8.randomized_hadamard(k, signs)
    (qs, qc), (ks, kc), (vs, vc) = (_model_codes(x.astype(np.float32), 128) for x in (q, k, v))
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    factor = d ** -0.5 * np.log2(np.e)
    vis = cv.mask(Nq, Nk, causal, None)
    o, lse = np.zeros(q.shape), np.full(q.shape[:3], -np.inf)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i0 in range(0, Nq, 128):
                rows = slice(i0, min(i0 + 128, Nq))
                m = np.full(rows.stop - i0, -np.inf)
                l, acc, vs_prev = np.zeros_like(m), np.zeros((rows.stop - i0, d)), 1.0
                for j0 in range(0, Nk, 128):
                    cols = slice(j0, min(j0 + 128, Nk))
                    if not vis[rows, cols].any():
                        continue
                    s = qc[b, h, rows] @ kc[b, hk, cols].T * (factor * qs[b, h, i0 // 128] * ks[b, hk, j0 // 128])
                    s = np.where(vis[rows, cols], s, -np.inf)
                    m_new = np.maximum(m, s.max(axis=1))
                    base = np.where(np.isneginf(m_new), 0.0, m_new)
                    alpha = np.exp2(m - base)
                    p = np.exp2(s - base[:, None])
                    l = l * alpha + p.sum(axis=1)
                    vs_j = float(vs[b, hk, j0 // 128])
                    acc *= (alpha * (vs_prev / vs_j))[:, None]
                    p8 = (p * F.P_SCALE).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
                    acc += p8 @ vc[b, hk, cols]
                    m, vs_prev = m_new, vs_j
                live = l > 0
                o[b, h, rows] = np.where(live[:, None], acc * (vs_prev / F.P_SCALE) / np.where(live, l, 1)[:, None], 0)
                lse[b, h, rows] = np.where(live, (m + np.log2(np.where(live, l, 1))) * np.log(2), -np.inf)
    return o, lse


def test_the_kernel_model_is_the_cpu_experiment(rng):
    """The tile-by-tile model of the kernel (its running maximum, V's scale carried in O) errs
    like iokernels.fp8.fp8_attention with the same blocks, within EMULATION_FACTOR: the premise
    of the GPU comparison, checked on the CPU."""
    q, k, v = (np.asarray(_bf16(x)) for x in fp8.outlier_inputs(rng, 1, 2, 256, 1024, 128))
    signs = fp8.random_signs(128, rng)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, _ = _oracle(q64, k64, v64)
    for sg in (None, signs):
        model = fp8.rmse(_kernel_model(q, k, v, signs=sg)[0], ref)
        cpu = fp8.rmse(fp8.fp8_attention(q64, k64, v64, block_q=128, block_k=128, signs=sg), ref)
        assert 1 / EMULATION_FACTOR <= model / cpu <= EMULATION_FACTOR, (sg is not None, model, cpu)
    # causal, GQA, Nq > Nk: rows that see nothing are 0 / -inf; the rest is still attention
    q, k, v = (np.asarray(_bf16(x)) for x in fp8.outlier_inputs(rng, 1, 2, 300, 200, 128))
    o, lse = _kernel_model(q, k[:, :1], v[:, :1], causal=True)
    ref, ref_lse = _oracle(*(x.astype(np.float64) for x in (q, k[:, :1], v[:, :1])), causal=True)
    dead = np.isneginf(ref_lse)
    assert dead[:, :, :100].all() and np.all(o[dead] == 0) and np.all(np.isneginf(lse[dead]))
    assert fp8.rmse(o[~dead], ref[~dead]) < 0.05


def _quantized_lse(q, k, scale, signs=None, causal=False):
    """LSE of the scores of the quantized Q and K (float64 on the host)."""
    from iokernels.core import conventions as cv
    q, k = q.astype(np.float64), k.astype(np.float64)
    if signs is not None:
        q, k = fp8.randomized_hadamard(q, signs), fp8.randomized_hadamard(k, signs)
    qq, kq = fp8.quantize(q, "e4m3", 128).astype(np.float64), fp8.quantize(k, "e4m3", 128).astype(np.float64)
    g = qq.shape[1] // kq.shape[1]
    s = scale * qq @ np.repeat(kq, g, axis=1).swapaxes(-1, -2)
    s = np.where(cv.mask(q.shape[2], k.shape[2], causal, None), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    with np.errstate(all="ignore"):
        return (np.log(np.sum(np.exp(s - np.where(np.isfinite(m), m, 0)), axis=-1)) + np.where(
            np.isfinite(m), m, -np.inf)[..., 0])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version", F.FP8_VERSIONS)
def test_error_matches_the_cpu_experiment_and_hadamard_halves_it(version):
    q, k, v, signs = _experiment_inputs()
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, ref_lse = _oracle(q64, k64, v64)
    errs = {}
    cfg = F.Fp8Config(version=version)
    for had in (False, True):
        o, lse = hp.fp8_attention(q, k, v, hadamard=had, signs=signs if had else None, config=cfg)
        gpu_err = fp8.rmse(o.astype(np.float64), ref)
        cpu_err = fp8.rmse(fp8.fp8_attention(q64, k64, v64, block_q=128, block_k=128,
                                             signs=signs if had else None), ref)
        errs[had] = gpu_err, cpu_err
        assert 1 / EMULATION_FACTOR <= gpu_err / cpu_err <= EMULATION_FACTOR, (had, gpu_err, cpu_err)
        want_lse = _quantized_lse(q, k, 128 ** -0.5, signs if had else None)
        assert np.max(np.abs(lse - want_lse)) <= 1e-3 * max(1.0, np.max(np.abs(want_lse))), had
        o_model, lse_model = _kernel_model(q, k, v, signs=signs if had else None)
        # the kernel is its tile-by-tile model up to float32 rounding and the rare P cast that the
        # rounding tips to the neighbouring code: far below the FP8 error itself
        assert fp8.rmse(o.astype(np.float64), o_model) <= MODEL_SHARE * fp8.rmse(o_model, ref), had
        assert np.max(np.abs(lse - lse_model)) <= 1e-3 * max(1.0, np.max(np.abs(lse_model))), had
    (g_plain, c_plain), (g_had, c_had) = errs[False], errs[True]
    assert c_plain / c_had >= HADAMARD_GAIN, ("the CPU experiment's premise", c_plain, c_had)
    assert g_plain / g_had >= HADAMARD_GAIN, (g_plain, g_had)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 2, 300, 1000, True), (1, 2, 2, 1000, 300, True), (2, 6, 3, 333, 100, False),
                                   (1, 2, 1, 1, 513, False), (1, 2, 2, 130, 70, True)])
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("version", F.FP8_VERSIONS)
def test_causal_gqa_and_unequal_lengths(rng, shape, dtype, version):
    from iokernels.core.testing import make_inputs
    B, Hq, Hkv, Nq, Nk, causal = shape
    q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=128, dtype=dtype)
    o, lse = hp.fp8_attention(q, k, v, causal=causal, config=F.Fp8Config(version=version))
    assert o.dtype == q.dtype and lse.dtype == np.float32 and o.shape == q.shape
    ref, ref_lse = _oracle(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    masked = ~np.isfinite(ref_lse)
    assert np.all(o.astype(np.float64)[masked] == 0) and np.all(np.isneginf(lse[masked]))
    live = ~masked
    err = np.sqrt(np.mean((o.astype(np.float64) - ref)[live] ** 2))
    assert err < 0.05, err                                       # unit-variance inputs: FP8 is still attention
    o_model, _ = _kernel_model(q, k, v, causal=causal)
    assert np.sqrt(np.mean((o.astype(np.float64) - o_model)[live] ** 2)) <= MODEL_SHARE * max(err, 1e-3)
    want_lse = _quantized_lse(q, k, 128 ** -0.5, causal=causal)
    assert np.max(np.abs(lse[live] - want_lse[live])) <= 1e-3 * max(1.0, np.max(np.abs(want_lse[live])))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("version", F.FP8_VERSIONS)
def test_torch_in_torch_out_and_the_codes_path(rng, version):
    torch = pytest.importorskip("torch")
    from iokernels.core.testing import make_inputs
    q, k, v = (torch.from_numpy(x).cuda().to(torch.bfloat16)
               for x in make_inputs(rng, batch=1, heads_q=2, seqlen_q=200, seqlen_k=300, head_dim=128, dtype="float32"))
    o, lse = hp.fp8_attention(q, k, v, hadamard=True, seed=1, config=hp.Fp8Config(version=version))
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    x = hp.quantize_qkv(q, k, v, hadamard=True, seed=1)
    o2, lse2 = hp.fp8_attention_codes(x, config=hp.Fp8Config(stages=3, version=version))
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)        # the codes path is the same computation


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 2, 1000, 1000, False), (2, 4, 2, 1000, 1000, True),
                                   (1, 2, 2, 1000, 300, True), (1, 2, 1, 1, 513, False), (1, 2, 2, 130, 70, True)])
def test_v2_is_v1_up_to_float32_reordering(rng, shape):
    """Same codes into both forwards: v2 (every ring depth, ping-pong on and off) gives v1's O
    within V2_SHARE of v1's FP8 error and v1's LSE to float32 rounding.  The shapes cover many key
    tiles (the pipeline's steady state), one tile (prologue and epilogue only), causal blocks that
    see no key (no turns taken: ping-pong must not wait for them) and GQA."""
    from iokernels.core.testing import make_inputs
    B, Hq, Hkv, Nq, Nk, causal = shape
    q, k, v = make_inputs(rng, batch=B, heads_q=Hq, heads_kv=Hkv, seqlen_q=Nq, seqlen_k=Nk, head_dim=128,
                          dtype="bfloat16")
    x = hp.quantize_qkv(q, k, v)
    o1, lse1 = (_to_numpy(a).astype(np.float64) for a in hp.fp8_attention_codes(x, causal=causal))
    ref, ref_lse = _oracle(*(a.astype(np.float64) for a in (q, k, v)), causal=causal)
    live = np.isfinite(ref_lse)
    fp8_err = np.sqrt(np.mean((o1 - ref)[live] ** 2))
    for cfg in _v2_configs():
        o2, lse2 = (_to_numpy(a).astype(np.float64) for a in hp.fp8_attention_codes(x, causal=causal, config=cfg))
        assert np.array_equal(np.isneginf(lse2), np.isneginf(lse1)) and np.all(o2[~live] == 0), cfg
        diff = np.sqrt(np.mean((o2 - o1)[live] ** 2))
        assert diff <= V2_SHARE * fp8_err, (cfg, diff, fp8_err)
        assert np.max(np.abs(lse2 - lse1)[live]) <= 1e-5 * max(1.0, np.max(np.abs(lse1[live]))), cfg
