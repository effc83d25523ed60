"""The randomized Hadamard transform on the GPU (cupy_raw/hadamard.py, kernels/fwht.cu).

Without a GPU: the sign mask the kernel takes by value is fp8.random_signs' diagonal bit for
bit; fwht.cu compiles for sm_75 / sm_80 / sm_90 in registers (no local memory) and refuses
what it cannot run with #error; bad inputs are ValueErrors naming the argument; and the launch,
recorded by the stand-in CuPy (tests/stand_ins/cupy), passes exactly the parameters the kernel
declares (nvcc -E of the source the launcher compiles).

On a GPU: the transform against iokernels.fp8.randomized_hadamard in float64 on the host, by
FlashAttention's 2x rule for 16-bit inputs (the baseline: the dense product x D H / sqrt(d) in
float32, rounded to the input's dtype), every row length and dtype, with and without signs.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from iokernels import fp8
from iokernels.core import gpu
from iokernels.cupy_raw import hadamard as hd
from iokernels.cupy_raw import launch

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


# --------------------------------------------------------------------------- signs (no GPU)
@pytest.mark.parametrize("d", hd.FWHT_HEAD_DIMS)
def test_sign_bits_are_random_signs_bit_for_bit(d):
    signs = hd.signs_for(d, 123)
    np.testing.assert_array_equal(signs, fp8.random_signs(d, np.random.default_rng(123)))
    words = np.frombuffer(hd.sign_bits(signs).tobytes(), np.uint32)
    bits = np.array([(words[i // 32] >> (i % 32)) & 1 for i in range(d)])
    np.testing.assert_array_equal(bits, (signs < 0).astype(int))
    assert hd.sign_bits(np.ones(d)).tobytes() == bytes(4 * hd.SIGN_WORDS)


def test_bad_inputs_raise_naming_the_argument(rng):
    x = rng.standard_normal((2, 3, 128)).astype(np.float16)
    with pytest.raises(ValueError, match="x: dtype"):
        hd.fwht(x.astype(np.float64))
    with pytest.raises(ValueError, match="x: the last axis"):
        hd.fwht(x[..., :96])
    with pytest.raises(ValueError, match="out_dtype"):
        hd.fwht(x, out_dtype="float64")
    with pytest.raises(ValueError, match="signs"):
        hd.fwht(x, signs=np.ones(64))
    with pytest.raises(ValueError, match="signs"):
        hd.fwht(x, signs=np.ones(128), seed=1)
    with pytest.raises(ValueError, match="seed"):
        hd.fwht(x, seed=1.5)
    with pytest.raises(ValueError, match="signs"):
        hd.sign_bits(np.full(128, 2.0))


# --------------------------------------------------------------------------- compile (no GPU)
def _compile(tmp_path, defines, arch, extra=("-Xptxas", "-v")):
    src = tmp_path / f"fwht_{arch}_{abs(hash(tuple(sorted(defines.items()))))}.cu"
    src.write_text(launch.source("fwht"))
    cmd = [NVCC, "-cubin", f"-arch=sm_{arch}", "-std=c++17", *extra,
           *(f"-D{k}={v}" for k, v in sorted(defines.items())), str(src), "-o", str(src.with_suffix(".cubin"))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr


@needs_nvcc
def test_fwht_compiles_in_registers(tmp_path):
    """Every row length and dtype on sm_80 and sm_90: no stack frame, no spills."""
    jobs = [(hd.fwht_defines(d, dt, out), arch) for d in hd.FWHT_HEAD_DIMS for dt in hd.FWHT_DTYPES
            for out in (False, True) for arch in (80, 90) if not (out and dt == "float32")]
    for defines, arch in jobs:
        rc, err = _compile(tmp_path, defines, arch)
        assert rc == 0, f"sm_{arch} {defines}: {err[:400]}"
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        assert frame and frame.groups() == ("0", "0", "0"), f"sm_{arch} {defines}: {err[:400]}"


@needs_nvcc
def test_fwht_source_refuses_what_it_cannot_run(tmp_path):
    base = hd.fwht_defines(128, "float16", False)
    for bad, words in ((dict(HEAD_DIM=96), "HEAD_DIM must be 64, 128 or 256"), (dict(IK_DTYPE=3), "IK_DTYPE"),
                       (dict(OUT_F32=None), "-DOUT_F32 is missing")):
        defines = {k: v for k, v in dict(base, **bad).items() if v is not None}
        rc, err = _compile(tmp_path, defines, 90, extra=())
        assert rc != 0 and words in err, (bad, err[:300])
    rc, err = _compile(tmp_path, hd.fwht_defines(128, "bfloat16", False), 75, extra=())
    assert rc != 0 and "compute capability 8.0" in err


# --------------------------------------------------------------------------- the launch (stand-in CuPy)
DRIVER = r'''
import json, sys
import numpy as np
import cupy
from iokernels.cupy_raw import hadamard as hd
from iokernels.core.testing import make_inputs
rng = np.random.default_rng(0)
out = {}
for dt, d, odt, seed in (("float16", 128, None, 7), ("bfloat16", 256, "float32", None), ("float32", 64, None, 3)):
    x = make_inputs(rng, batch=2, heads_q=3, seqlen_q=37, seqlen_k=1, head_dim=d, dtype=dt)[0]
    y = hd.fwht(x, seed=seed, out_dtype=odt)
    L = cupy.LAUNCHES.pop()
    assert not cupy.LAUNCHES
    out[f"{dt} {d} {odt} {seed}"] = dict(
        name=L["name"], options=list(L["options"]), grid=list(L["grid"]), block=list(L["block"]),
        args=["bits" if isinstance(a, np.ndarray) and a.dtype.kind == "V" else type(a).__name__ for a in L["args"]],
        bits=L["args"][0].tobytes().hex(), rows=int(L["args"][3]), use_signs=int(L["args"][4]),
        y=[list(y.shape), str(y.dtype)])
json.dump(out, sys.stdout)
'''


@needs_nvcc
def test_launch_matches_the_kernel_signature():
    from pathlib import Path
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{here / 'stand_ins'}{os.pathsep}{here.parent}")
    r = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, cwd=here.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    for label, L in got.items():
        dt, d, odt, seed = label.split()
        d = int(d)
        defines = dict(o[2:].split("=", 1) for o in L["options"] if o.startswith("-D"))
        assert defines == {k: str(v) for k, v in hd.fwht_defines(d, dt, odt == "float32").items()}, label
        assert L["name"] == "fwht" and L["block"] == [32 * hd.FWHT_ROWS_PER_BLOCK]
        assert L["rows"] == 2 * 3 * 37 and L["grid"] == [-(-L["rows"] // hd.FWHT_ROWS_PER_BLOCK)]
        assert L["y"] == [[2, 3, 37, d], odt if odt != "None" else ("uint16" if dt == "bfloat16" else dt)]
        assert L["use_signs"] == (seed != "None")
        if seed != "None":
            assert bytes.fromhex(L["bits"]) == hd.sign_bits(hd.signs_for(d, int(seed))).tobytes()
        # the parameter list after the preprocessor, at this launch's defines
        src = launch.source("fwht")
        pre = subprocess.run([NVCC, "-E", "-arch=sm_90", "-x", "cu", *[o for o in L["options"] if o.startswith("-D")],
                              "-"], input=src, capture_output=True, text=True)
        assert pre.returncode == 0, pre.stderr[-400:]
        text = "\n".join(x for x in pre.stdout.splitlines() if not x.lstrip().startswith("#"))
        params = re.search(r'\bfwht\s*\(([^)]*)\)\s*\{', text).group(1).split(",")
        want = ["bits" if "SignBits" in p else "uint64" if "*" in p else "int32" for p in params]
        assert L["args"] == want, (label, params, L["args"])


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not gpu.cupy_gpu(), reason="CuPy sees no CUDA GPU")
@pytest.mark.parametrize("dtype", hd.FWHT_DTYPES)
@pytest.mark.parametrize("d", hd.FWHT_HEAD_DIMS)
@pytest.mark.parametrize("signed", (False, True))
def test_fwht_against_the_float64_transform(rng, dtype, d, signed):
    from iokernels.core.testing import check, make_inputs, numpy_dtype
    from iokernels.cupy_raw.launch import device_info
    if dtype == "bfloat16" and device_info()["cc"] < 80:
        pytest.skip("bfloat16 needs compute capability 8.0")
    x = make_inputs(rng, batch=2, heads_q=3, seqlen_q=77, seqlen_k=1, head_dim=d, dtype=dtype)[0]
    x[0, 0, 0, 0] = 40.0                                     # an outlier, as the FP8 experiment draws
    signs = fp8.random_signs(d, rng) if signed else None
    x64 = x.astype(np.float64)
    ref = fp8.randomized_hadamard(x64, signs if signed else np.ones(d))
    # the baseline: the dense product in float32, rounded to the input's dtype
    dense = ((x.astype(np.float32) * (signs if signed else 1.0)).astype(np.float32)
             @ fp8.hadamard_matrix(d).astype(np.float32))
    for out_dtype in ((None, "float32") if dtype != "float32" else (None,)):
        y = hd.fwht(x, signs=signs, out_dtype=out_dtype)
        odt = out_dtype or dtype
        base = dense.astype(numpy_dtype(odt))
        c = check(y, ref, base, dtype=odt, name=f"fwht {dtype}->{odt} d={d} signed={signed}")
        assert c, str(c)
    if signed:                                               # the seed path draws the same signs
        s = hd.signs_for(d, 5)
        np.testing.assert_array_equal(hd.fwht(x, seed=5), hd.fwht(x, signs=s))
