"""Compile the Numba kernels to PTX for compute capability 7.5 and 9.0 with the simulator
off (no GPU needed: NVVM comes with numba-cuda's pip packages), in subprocesses (the
simulator is chosen when numba is first imported): one compiles every report the tests
read, one runs the command line (``python -m iokernels.numba_cuda.ptx``).  A float32 (or
float16) kernel whose PTX computes in float64 fails: a stray Python float (0.0, 1.0 / l)
promotes silently and runs at a fraction of the float32 rate.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


#: every report the tests read, compiled in one process (each device function is compiled
#: once there and shared by the kernels that call it): {report name: [(ccs, dtypes, head dims,
#: only), ...]} for ``ptx.compile_all``; "v3" is ``ptx.ptx_report``'s (ccs, dtypes, head dims)
_REPORTS = r"""
import json
from iokernels.numba_cuda import ptx
plan = {
    # every kernel, float32 at sm_90 (the version-1..3 kernels at sm_75 too), float16 at sm_90
    # (d = 128, and ragged 59 for the forward v3 and decode v2, whose lanes own padded dims);
    # decode v2 and forward v4 skip sm_75 to keep this file quick
    "report": [(((9, 0),), ("float32",), (128,), None),
               (((7, 5),), ("float32",), (128,), "^(fwd_v[1-3]|decode_split|decode_combine|gather$)"),
               (((9, 0),), ("float16",), (128,), None),
               (((9, 0),), ("float32",), (59,), "v3"),
               (((9, 0),), ("float16",), (59,), "decode_v2")],        # v2's one-element-a-word path
    "float64": [(((9, 0),), ("float64",), (59,), "decode_v2"),        # decode v2's element path
                (((9, 0),), ("float64",), (128,), "fwd_v[5-7]")],     # forward v5-v7's 8-byte values
}
out = {name: {} for name in plan}
for name, calls in plan.items():
    for ccs, dtypes, dims, only in calls:
        out[name].update(ptx.compile_all(ccs, dtypes, dims, only))
# the v3 kernels (defaults): float16 d=128 at sm_75 and sm_90, float32 d=128 at sm_90, and the
# one-element-a-word paths (float16 d=59, float64 d=59) at sm_90
out["v3"] = ptx.ptx_report(ccs=((7, 5), (9, 0)), dtypes=("float16",), head_dims=(128,))
out["v3"].update(ptx.ptx_report(ccs=((9, 0),), dtypes=("float32",), head_dims=(128,)))
out["v3"].update(ptx.ptx_report(ccs=((9, 0),), dtypes=("float16", "float64"), head_dims=(59,)))
# decode v4 (16-byte loads): float16 d=128 at sm_75 and sm_90, float32 d=128 at sm_90, and the
# two-word form of arrays that do not start on 16 bytes
out["v4"] = ptx.ptx_report_v4(ccs=((7, 5), (9, 0)), dtypes=("float16",))
out["v4"].update(ptx.ptx_report_v4(ccs=((9, 0),), dtypes=("float32",)))
out["v4"].update(ptx.ptx_report_v4(ccs=((9, 0),), dtypes=("float16",), aligned=False))
# decode v5 (v4 with exp2) and v6 (v5 with an unchecked interior): float16 d=128 at sm_90, beside v4's
out["v5"] = ptx.ptx_report_v4(ccs=((9, 0),), dtypes=("float16",), version="v5")
out["v6"] = ptx.ptx_report_v4(ccs=((9, 0),), dtypes=("float16",), version="v6")
print(json.dumps(out))
"""
#: seconds a compiling process may take before the test fails (the reports' one compiles
#: about sixty kernels)
COMPILE_TIMEOUT_S = 600


def _python(*args):
    """Run ``python *args`` with the simulator off; its last line of output, read as JSON."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=COMPILE_TIMEOUT_S)
    if r.returncode != 0:
        if "NVVM" in r.stderr and "not found" in r.stderr.lower():
            pytest.skip("NVVM (numba-cuda's compiler library) is not installed")
        raise AssertionError(r.stderr[-4000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports():
    """{"report", "float64", "v3" to "v6": {f"{kernel}/{dtype}/sm_{cc}": counts}}, from one process."""
    return _python("-c", _REPORTS)


@pytest.fixture(scope="module")
def report(reports):
    return reports["report"]


@pytest.fixture(scope="module")
def report_v3(reports):
    return reports["v3"]


def test_every_kernel_compiled_for_both_targets(report):
    names = {k.split("/")[0] for k in report}
    assert {"fwd_v1_d128", "fwd_v2_d128", "fwd_v3_d128", "fwd_v4_d128", "decode_split_d128", "decode_split_paged_d128",
            "decode_combine_d128", "gather", "fwd_v3_d59", "decode_v2_split_d128",
            "decode_v2_split_paged_d128"} <= names
    assert sum(k.endswith("sm_75") for k in report) >= 7
    assert sum(k.endswith("sm_90") for k in report) >= 11
    assert all(v["bytes"] > 1000 for v in report.values())


def test_no_float64_arithmetic_in_float32_or_float16_kernels(report):
    bad = {k: v["f64"] for k, v in report.items() if v["f64"]}
    assert not bad, f"float64 instructions in low-precision kernels: {bad}"


def test_shuffles_on_the_gpu_path(report):
    """v3 and the decode split sum a row's lanes with warp shuffles (not the simulator's
    shared-memory stand-in)."""
    assert report["fwd_v3_d128/float32/sm_90"]["shfl"]
    assert report["decode_split_d128/float32/sm_90"]["shfl"]
    assert not report["fwd_v2_d128/float32/sm_90"]["shfl"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_v2_loads_8_byte_words_into_registers(report, dtype):
    """Version 2's point: K/V rows arrive as 8-byte loads (KEYS_PER_ITER_V2 keys x words a
    lane x K and V: 16 for float16 at d = 128 with 16 lanes, 32 for float32), no 2-byte K/V loads (the few left read q),
    and the only local-memory accesses are the per-thread state handed to the final merge
    (v1's split has as many; what matters is that the main loop has none: 16 u64 loads, not
    spilled; see the module docstring)."""
    from iokernels.numba_cuda.decode import KEYS_PER_ITER_V2, LANES_PER_KEY_V2
    words = 128 * (2 if dtype == "float16" else 4) // 8                  # 8-byte words a row
    per_lane = -(-words // LANES_PER_KEY_V2)
    for name in ("decode_v2_split_d128", "decode_v2_split_paged_d128"):
        r = report[f"{name}/{dtype}/sm_90"]
        assert r["ld_u64"] == KEYS_PER_ITER_V2 * per_lane * 2, r
        assert r["ld_u16"] <= 8, r                      # q's values (16 at most per thread)
        assert r["shfl"]
    v1 = report[f"decode_split_d128/{dtype}/sm_90"]
    assert v1["ld_u64"] == 0                            # version 1 loads elements


def test_forward_v4_keeps_its_scores_in_registers(report):
    """v4's 4-key step is unrolled: no local memory at d = 128 (v3's 8-key step is not)."""
    assert report["fwd_v4_d128/float32/sm_90"]["local"] == 0
    assert report["fwd_v4_d128/float16/sm_90"]["local"] == 0
    assert report["fwd_v3_d128/float32/sm_90"]["local"] > 0
    assert report["fwd_v4_d128/float32/sm_90"]["shfl"]


def test_v2_element_path_compiles(report):
    """d = 59 float16 rows (118 bytes) are not whole 8-byte words: version 2 loads elements
    (NVVM once rejected this path's float16 per-thread array; only a compile finds that)."""
    for name in ("decode_v2_split_d59", "decode_v2_split_paged_d59"):
        r = report[f"{name}/float16/sm_90"]
        assert r["ld_u64"] == 0 and r["ld_u16"] > 0 and r["shfl"], r


def test_float64_v2_kernels_compile(reports):
    assert {"decode_v2_split_d59/float64/sm_90", "decode_v2_split_paged_d59/float64/sm_90"} <= set(reports["float64"])


def test_the_float64_detector_finds_float64():
    """The check can fail: the float64 combine kernel's PTX is full of .f64 arithmetic (compiled
    through the command line, ``python -m iokernels.numba_cuda.ptx``)."""
    out = _python("-m", "iokernels.numba_cuda.ptx", "90", "float64", "d=128", "only=combine")
    assert out and all(v["f64"] for v in out.values())


# --------------------------------------------------------------------------- decode / gather v3
def test_v3_kernels_compile_without_float64(report_v3):
    names = {k.split("/")[0] for k in report_v3}
    assert {"decode_v3_split_d128", "decode_v3_split_paged_d128", "gather_v3_d128", "decode_v3_split_d59",
            "gather_v3_d59"} <= names
    assert {"decode_v3_split_d128/float16/sm_75", "decode_v3_split_paged_d128/float16/sm_75",
            "gather_v3_d128/float16/sm_75"} <= set(report_v3)
    bad = {k: v["f64"] for k, v in report_v3.items() if v["f64"] and "float64" not in k}
    assert not bad, f"float64 instructions in low-precision v3 kernels: {bad}"
    assert all(v["f64"] for k, v in report_v3.items() if "float64" in k and "split" in k)   # the check can fail


@pytest.mark.parametrize("cc", ["sm_75", "sm_90"])
def test_decode_v3_pipeline_and_reduce_scatter_in_the_ptx(report_v3, cc):
    """float16 d=128 at the defaults: each lane loads one 8-byte word of K and of V per key;
    the words are loaded in two places (the prologue and the in-loop prefetch), so the PTX has
    2 x KPI x K,V u64 loads and no 2-byte K/V loads; the lane sum is about 2 (RP - 1)
    shuffles (31 at 32 lanes x 4 keys x g = 4; v2's butterflies at this tiling: RP log2 L =
    80); local memory only in the final merge."""
    from iokernels.numba_cuda.decode_v3 import KEYS_PER_ITER_V3, LANES_PER_KEY_V3
    from iokernels.numba_cuda.device import allreduce_shuffles, pow2_at_least
    rp = pow2_at_least(KEYS_PER_ITER_V3 * 4)
    for name in ("decode_v3_split_d128", "decode_v3_split_paged_d128"):
        r = report_v3[f"{name}/float16/{cc}"]
        assert r["ld_u64"] == 2 * KEYS_PER_ITER_V3 * 2, r
        assert r["shfl"] == allreduce_shuffles(LANES_PER_KEY_V3, rp) < rp * 5, r
        # local memory only for the per-thread state handed to the final merge (g heads x
        # (d/L dims + m + l) = 24 values at the default 32 x 4 x 8 tiling, a 96-byte frame);
        # a main loop that spilled its words or scores would add far more
        assert r["local"] <= 4 * (128 // LANES_PER_KEY_V3 + 2), r


@pytest.mark.parametrize("cc", ["sm_75", "sm_90"])
def test_decode_v3_paged_looks_a_page_up_once_per_step(report_v3, cc):
    """Page addressing (the default at block size 16): a key group reads one block-table entry
    from SRAM per step, in the two places that issue loads (the prologue and the in-loop
    prefetch), plus n_b once -- 3 integer SRAM loads, where a lookup per key would be
    1 + 2 x KPI; the contiguous kernel reads only n_b."""
    from iokernels.numba_cuda.decode_v3 import KEYS_PER_ITER_V3
    assert KEYS_PER_ITER_V3 > 1
    paged = report_v3[f"decode_v3_split_paged_d128/float16/{cc}"]
    assert paged["ld_shared_i32"] == 1 + 2, paged
    assert report_v3[f"decode_v3_split_d128/float16/{cc}"]["ld_shared_i32"] == 1


def test_gather_v3_loads_words_before_storing(report_v3):
    """UN u64 loads of K and of V, UN u64 stores of each, no local memory."""
    from iokernels.numba_cuda.gather import GATHER3_UNROLL
    for cc in ("sm_75", "sm_90"):
        g = report_v3[f"gather_v3_d128/float16/{cc}"]
        assert g["ld_u64"] == 2 * GATHER3_UNROLL and g["st_u64"] == 2 * GATHER3_UNROLL, g
        assert g["local"] == 0 and g["shfl"] == 0, g


def test_v3_element_path_loads_elements(report_v3):
    """float16 d=59 rows (118 bytes) are not whole words: v3 loads float16 elements."""
    for name in ("decode_v3_split_d59", "decode_v3_split_paged_d59"):
        r = report_v3[f"{name}/float16/sm_90"]
        assert r["ld_u64"] == 0 and r["shfl"] > 0, r


def test_v3_quantized_kernels_load_words_of_codes(report_v3):
    """A quantized paged cache (int8, float8 e4m3 codes): d=128 rows are 16 words of 8 codes,
    one word a lane of K and of V per key as on the float16 path (2 x KPI x K,V u64 loads),
    decoded in registers without float64 and without a main loop in local memory."""
    from iokernels.numba_cuda.decode_v3 import KEYS_PER_ITER_V3
    for kv in ("int8", "float8_e4m3fn"):
        for cc in ("sm_75", "sm_90"):
            r = report_v3[f"decode_v3_split_paged_{kv}_d128/float16/{cc}"]
            assert r["ld_u64"] == 2 * KEYS_PER_ITER_V3 * 2 and not r["f64"], r
            assert r["local"] <= 4 * (128 // 16 + 2) + 2 * KEYS_PER_ITER_V3, r


# --------------------------------------------------------------------------- decode v4
@pytest.fixture(scope="module")
def report_v4(reports):
    return reports["v4"]


@pytest.mark.parametrize("dtype, cc", [("float16", "sm_75"), ("float16", "sm_90"), ("float32", "sm_90")])
def test_decode_v4_loads_16_bytes_at_once(report_v4, dtype, cc):
    """v4's one idea in its PTX: every K/V load is a 16-byte ``ld.global.v2.u64`` -- KPI keys x
    K,V x pairs a lane, in the two places that issue loads (the prologue and the in-loop
    prefetch) -- and none is an 8- or 2-byte K/V load (the few 2-byte loads read q); the main
    loop keeps its arrays in registers; no float64."""
    from iokernels.numba_cuda.decode_v4 import KEYS_PER_ITER_V4, split_v4_tiling
    L = split_v4_tiling(128, dtype)[0]
    pairs_per_lane = -(-(128 * (2 if dtype == "float16" else 4) // 16) // L)
    for name in ("decode_v4_split_d128", "decode_v4_split_paged_d128"):
        r = report_v4[f"{name}/{dtype}/{cc}"]
        assert r["ld_v2_u64"] == 2 * KEYS_PER_ITER_V4 * 2 * pairs_per_lane, r
        assert r["ld_u64"] == 0 and r["ld_u16"] <= 8 and not r["f64"], r
        assert r["loop_local"] == 0 and r["shfl"], r


def test_decode_v4_unaligned_form_loads_two_words(report_v4):
    """Where K/V do not start on 16 bytes the same kernel reads each pair as two 8-byte loads."""
    from iokernels.numba_cuda.decode_v4 import KEYS_PER_ITER_V4
    for name in ("decode_v4_unaligned_split_d128", "decode_v4_unaligned_split_paged_d128"):
        r = report_v4[f"{name}/float16/sm_90"]
        assert r["ld_v2_u64"] == 0 and r["ld_u64"] == 2 * 2 * KEYS_PER_ITER_V4 * 2, r
        assert r["loop_local"] == 0, r


def test_decode_v4_unpacks_without_shifts(report_v4, report_v3):
    """v4 unpacks a word into its values by a vector bit-cast (``mov.b64 {..}``), v3 by a
    64-bit shift and a truncation a value: v3's load loop has a 64-bit shift for every value
    but the lowest of each word (24 at 4 keys x K,V x one word of 4 values a lane), v4's (8
    values a lane) next to none (what is left is index arithmetic)."""
    v4, v3 = report_v4["decode_v4_split_d128/float16/sm_90"], report_v3["decode_v3_split_d128/float16/sm_90"]
    assert v3["loop_shr_u64"] >= 24 and v4["loop_shr_u64"] * 8 < v3["loop_shr_u64"], (v4, v3)


def test_decode_v5_takes_each_exponential_without_expf_argument_reduction(reports):
    """v5's one idea in its PTX: its load loop has v4's exponentials (``ex2.approx``: KPI keys x g
    heads and g rescales a step), none of expf's argument reduction (an ``fma.rm`` and a
    ``cvt.sat`` each in v4's), and v4's 16-byte loads; so fewer instructions a step."""
    v4, v5 = reports["v4"], reports["v5"]
    for name in ("split_d128", "split_paged_d128"):
        a, b = v4[f"decode_v4_{name}/float16/sm_90"], v5[f"decode_v5_{name}/float16/sm_90"]
        assert b["loop_ex2"] == a["loop_ex2"] == 4 * 4 + 4, (a, b)
        assert a["loop_expf_reduction"] == 2 * a["loop_ex2"] and b["loop_expf_reduction"] == 0, (a, b)
        assert b["ld_v2_u64"] == a["ld_v2_u64"] and b["loop_local"] == 0 and not b["f64"], b
        (na,), (nb,) = a["inner_loop_instructions"], b["inner_loop_instructions"]      # one step loop each
        assert nb < 0.9 * na, (a, b)


def test_decode_v6_interior_steps_have_no_bounds_checks(reports):
    """v6's one idea in its PTX: two step loops, the interior's (no bounds checks) and v5's
    checked one for the last steps, each with the 16-byte loads of a step; the interior has
    fewer instructions than v5's loop, the checked one as many (give or take the loop's
    bookkeeping); no local memory, no float64."""
    v5, v6 = reports["v5"], reports["v6"]
    for name in ("split_d128", "split_paged_d128"):
        a, b = v5[f"decode_v5_{name}/float16/sm_90"], v6[f"decode_v6_{name}/float16/sm_90"]
        (n5,) = a["inner_loop_instructions"]
        interior, checked = b["inner_loop_instructions"]
        assert interior < 0.9 * n5 and abs(checked - n5) <= 0.05 * n5, (a, b)
        assert b["ld_v2_u64"] == a["ld_v2_u64"] * 3 // 2, b     # the prologue's, the checked and unchecked prefetch
        assert b["loop_local"] == 0 and not b["f64"] and b["loop_expf_reduction"] == 0, b


def test_loop_local_accesses_finds_a_spilled_loop():
    """The detector can fail: a loop with a wide global load and a local store in it."""
    from iokernels.numba_cuda.ptx import loop_local_accesses
    clean = ("$L__BB0_1:\n\tld.global.v2.u64 \t{%rd1, %rd2}, [%rd3];\n\t@%p1 bra \t$L__BB0_1;\n"
             "\tst.local.f32 [%rd4], %f1;")
    spilled = clean.replace("[%rd3];", "[%rd3];\n\tst.local.u64 [%rd5], %rd1;")
    assert loop_local_accesses(clean) == 0 and loop_local_accesses(spilled) == 1


def test_forward_v6_reads_shared_memory_16_bytes_a_load(reports):
    """v6's products read Q_i, K_j and V_j by 16-byte vector loads (ld.shared.v4.f32, float64's
    v2.f64), where v5 reads 4 bytes a load; its blocks stay in registers like v5's."""
    for dtype in ("float32", "float16", "float64"):
        report = reports["float64" if dtype == "float64" else "report"]
        r5, r6 = report[f"fwd_v5_d128/{dtype}/sm_90"], report[f"fwd_v6_d128/{dtype}/sm_90"]
        assert r5["ld_shared_16B"] == 0 and r5["ld_shared_f"] > 0, r5
        assert r6["ld_shared_16B"] > 0 and r6["ld_shared_f"] == 0, r6
        assert r6["local"] == 0 and r6["shfl"] > 0 and bool(r6["f64"]) == (dtype == "float64"), r6


def test_forward_v7_copies_its_tiles_16_bytes_a_load(reports):
    """v7 reads K_j and V_j rows by 16-byte global loads (ld.global.v4.f32, float16's two 8-byte
    words v2.u64, float64's v2.f64), where v6 reads them an element at a time; its shared loads
    and registers are v6's."""
    for dtype in ("float32", "float16", "float64"):
        report = reports["float64" if dtype == "float64" else "report"]
        r6, r7 = report[f"fwd_v6_d128/{dtype}/sm_90"], report[f"fwd_v7_d128/{dtype}/sm_90"]
        assert r6["ld_global_16B"] == 0 and r7["ld_global_16B"] > 0, (r6, r7)
        assert r7["ld_shared_16B"] > 0 and r7["ld_shared_f"] == 0 and r7["local"] == 0, r7


def test_forward_v5_keeps_its_blocks_in_registers(report):
    """v5's S and O blocks stay in registers (no local memory: the P V loop is a device
    function per key column, so every index into the S block is a constant), its shuffles are
    the row max, the row sums and the P broadcast, and it computes in float32."""
    for dtype in ("float32", "float16"):
        r = report[f"fwd_v5_d128/{dtype}/sm_90"]
        assert r["local"] == 0 and r["shfl"] > 0 and not r["f64"], r
