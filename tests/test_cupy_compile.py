"""Every CUDA C++ kernel compiles with nvcc for sm_75, sm_80 and sm_90 (no GPU needed).

The source compiled is exactly what the launcher hands NVRTC (``cupy_raw.source``:
kernels/common.cuh inlined) with the defines the launcher derives from its config, for at least
one config per dtype.  bfloat16 needs sm_80: on sm_75 the source must refuse with a
clear #error (the launcher never asks for it there).  Compiles run two at a time.

The cp.async versions (fa_v1b, decode_v2, decode_v3) have their main shapes (sm_90, fp32 d=128
forward, bf16 d=128 decode) held to no local memory (no spills, no stack frame): the point of
them is to stay within registers.  The host-side arithmetic needs no GPU and is tested here
too: the decode split heuristic, the registry's defaults and checks, and the shared-memory
fit of every default config for every dtype and head dim on every GPU size.
"""
import pathlib
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from iokernels import cupy_raw as cr
from iokernels.core.registry import Need
from iokernels.bench import decode_loads
from iokernels.cupy_raw import decode_config as C
from iokernels.cupy_raw import decode_v6_config as V6
from iokernels.cupy_raw import policy
from iokernels.cupy_raw.decode_launch import parallel_combine_defines

NVCC = shutil.which("nvcc") or "/usr/local/bin/nvcc"
ARCHS = (75, 80, 90)
pytestmark = pytest.mark.skipif(not shutil.which(NVCC), reason="nvcc not found")


def _jobs():
    """(label, kernel file, defines, arch): every file for every arch, each dtype at least once.

    About 45 compiles (two at a time): about 20 s on two cores.
    """
    jobs = []

    def fa(version, dtype, d, arch, **kw):
        cfg = cr.ForwardConfig(version=version, **kw).resolve(d, dtype)
        jobs.append((f"fa_{version} {dtype} d={d} {kw}", f"fa_{version}", cfg.defines(d, dtype), arch))

    def dec(dtype, d, paged, arch, kv=None, group=4):
        jobs.append((f"decode {dtype} d={d} paged={paged} kv={kv} g={group}", "decode",
                     cr.DecodeConfig("v1").defines(d, dtype, group, paged, 16, kv=kv), arch))

    def dec2(dtype, d, paged, arch, group=4, block_size=16, **kw):
        defines = cr.DecodeConfig("v2", **kw).defines(d, dtype, group, paged, block_size)
        jobs.append((f"decode_v2 {dtype} d={d} paged={paged} g={group} {kw}", "decode_v2", defines, arch))

    def dec3(dtype, d, paged, arch, group=4, block_size=16, kv=None, **kw):
        defines = cr.DecodeConfig("v3", **kw).defines(d, dtype, group, paged, block_size, kv=kv)
        jobs.append((f"decode_v3 {dtype} d={d} paged={paged} g={group} kv={kv} {kw}", "decode_v3", defines, arch))

    def dec4(dtype, d, paged, arch, group=4, block_size=16, **kw):
        defines = cr.DecodeConfig("v4", **kw).defines(d, dtype, group, paged, block_size, cc=arch)
        jobs.append((f"decode_v4 {dtype} d={d} paged={paged} g={group} {kw}", "decode_v4", defines, arch))

    def dec9(dtype, d, paged, arch, group=4, block_size=16, **kw):
        defines = cr.DecodeConfig("v9", **kw).defines(d, dtype, group, paged, block_size, cc=arch)
        jobs.append((f"decode_v9 {dtype} d={d} paged={paged} g={group} {kw}", "decode_v9", defines, arch))

    def dec5(dtype, d, arch, kv, group=4, block_size=16, **kw):
        defines = cr.DecodeConfig("v5", **kw).defines(d, dtype, group, True, block_size, kv=kv, cc=arch)
        jobs.append((f"decode_v5 {dtype} d={d} g={group} kv={kv} {kw}", "decode_v5", defines, arch))

    def dec6(dtype, d, paged, arch, group=32, block_size=16, **kw):
        defines = cr.DecodeConfig("v6", **kw).defines(d, dtype, group, paged, block_size, cc=arch)
        jobs.append((f"decode_v6 {dtype} d={d} paged={paged} g={group} {kw}", "decode_v6", defines, arch))

    def dec7(dtype, d, paged, arch, group=32, block_size=16, kv=None, **kw):
        defines = cr.DecodeConfig("v7", **kw).defines(d, dtype, group, paged, block_size, kv=kv)
        jobs.append((f"decode_v7 {dtype} d={d} paged={paged} g={group} kv={kv} {kw}", "decode_v7", defines, arch))

    def comb(dtype, d, arch):
        jobs.append((f"decode_combine {dtype} d={d}", "decode_combine", parallel_combine_defines(d, dtype), arch))

    def loads(load, dtype, d, paged, arch, group=4, block_size=16, **kw):
        defines = cr.DecodeConfig("v4", **kw).defines(d, dtype, group, paged, block_size, cc=arch)
        defines.update(decode_loads.loads_kernel(load, d).extra["defines"])
        jobs.append((f"decode_v4_loads {load} {dtype} d={d} paged={paged} g={group} {kw}", "decode_v4_loads",
                     defines, arch))

    def bwd(dtype, d, arch, **kw):
        jobs.append((f"bwd_v1 {dtype} d={d} {kw}", "bwd_v1", cr.BackwardConfig(**kw).defines(d, dtype), arch))

    def bwd2(dtype, d, arch, smem=None, **kw):
        jobs.append((f"bwd_v2 {dtype} d={d} {kw}", "bwd_v2",
                     cr.BackwardConfig("v2", **kw).defines(d, dtype, smem), arch))

    def pp(dtype, d, arch, page_size=16, vec_io=True, smem=None, version="v1", **kw):
        cfg = cr.PagedPrefillConfig(version, **kw).resolve(d, smem)
        jobs.append((f"paged_prefill_{version} {dtype} d={d} page={page_size} vec={vec_io} {kw}",
                     f"paged_prefill_{version}", cfg.defines(d, dtype, page_size, vec_io), arch))

    for arch in ARCHS:
        pp("float16", 128, arch, smem=64 * 1024 if arch == 75 else None)   # sm_75: Bc shrunk to fit 64 KB
        pp("float16", 64, arch, page_size=4 if arch == 75 else 16)
        if arch >= 80:
            pp("bfloat16", 128, arch, num_warps=8)                       # long chunks: Br = 128
            pp("bfloat16", 64, arch, page_size=7, vec_io=False)          # odd page size, element copies
            # v2 (GQA packed into the tile's rows) from sm_80, where it is offered
            pp("float16", 128, arch, version="v2")
            pp("bfloat16", 64, arch, version="v2", num_warps=8)
            pp("float16", 64, arch, page_size=7, vec_io=False, version="v2", num_warps=2, block_k=16)
        bwd("float32", 128, arch)
        bwd2("float16", 128, arch)
        bwd2("float16", 64, arch, deterministic=True)
        bwd("float16", 64, arch, deterministic=True)
        fa("v1", "float32", 128, arch)
        fa("v2", "float16", 128, arch)
        dec("float32", 128, False, arch)
        dec("float16", 128, True, arch)
        jobs.append(("paged_gather 16 B", "paged_gather", dict(BLOCK_SIZE=16, CHUNK_BYTES=16, CHUNKS_PER_ROW=16), arch))
        fa("v1b", "float32", 128, arch)
        dec2("float16", 128, arch != 80, arch)
        dec3("float16", 128, arch != 80, arch)
        dec4("float16", 128, arch == 80, arch)             # sm_75: compiles (k8 mma pairs); never offered
        dec9("float16", 128, arch != 80, arch, fused=arch != 75)   # both merges, both cache kinds
        dec7("float32", 128, arch != 80, arch, group=64)    # MQA: 4 blocks a KV head
        comb("float16", 128, arch)                      # the parallel combine: a column a thread
        if arch >= 80:                                  # bfloat16 exists from sm_80
            fa("v2", "bfloat16", 128, arch)
            dec("bfloat16", 128, arch == 90, arch)
            dec2("bfloat16", 128, arch == 80, arch)
            dec3("bfloat16", 128, arch == 80, arch, fused=arch == 90)
            dec3("bfloat16", 128, arch == 90, arch, num_warps=8)
            dec4("bfloat16", 128, arch != 80, arch, fused=arch == 80)
    fa("v1", "float16", 64, 75)
    fa("v1", "float64", 64, 80)
    fa("v1", "bfloat16", 72, 90)
    fa("v2", "float16", 72, 75, num_warps=2, block_k=32)
    fa("v2", "bfloat16", 64, 80, num_warps=4, block_k=128)
    fa("v2", "float16", 59, 90)                        # rows not whole 16-byte chunks: scalar loads
    dec("float64", 128, True, 90)                      # scalar rows (1 KB does not fit 32 lanes x 16 B)
    comb("bfloat16", 512, 80)                           # two columns a thread (256 threads)
    comb("float64", 64, 90)
    comb("float32", 59, 75)                             # a row's columns past the last thread's
    dec("bfloat16", 59, False, 80)
    jobs.append(("paged_gather 2 B", "paged_gather", dict(BLOCK_SIZE=7, CHUNK_BYTES=2, CHUNKS_PER_ROW=59), 90))
    fa("v1b", "float32", 72, 80, block_q=64, block_k=32)
    fa("v1b", "float32", 59, 90)                        # rows not whole 16-byte chunks: element copies
    fa("v1b", "float32", 111, 75, block_q=16, block_k=16)
    dec2("float32", 128, True, 90)                      # 32 lanes a row
    dec2("float16", 72, True, 90, block_size=7)         # 9 chunks a row on 16 lanes; odd block size
    dec2("float64", 64, False, 80, group=1)             # MHA, float64 accumulators
    dec2("bfloat16", 64, True, 90, group=8, stages=4)
    dec2("float16", 128, False, 75, stages=2, tile_rows=4)
    dec3("float32", 128, True, 90, block_size=5)         # 32 lanes a row, odd page size
    dec3("float64", 64, False, 80, group=1, fused=False)  # MHA, float64 (ld.global.cg.f64 unused)
    dec3("float64", 64, True, 90, group=2)                # float64 fused combine
    dec3("float16", 72, True, 90, group=8, block_size=7, stages=4, tile_rows=8)
    dec3("bfloat16", 128, False, 90, stages=6, tile_rows=16, num_warps=8)
    loads("bulk", "float16", 64, True, 90, group=8, block_size=7, num_warps=8, stages=2, tile_rows=32)
    dec4("bfloat16", 256, False, 80, group=16)           # rows 8..15 of the A operand used
    dec7("float64", 64, True, 90, group=8, fused=False)  # float64, two blocks a KV head, the separate combine
    dec7("bfloat16", 96, True, 90, group=16, kv="int8")  # codes at a head dim v5 does not take
    dec4("float16", 16, True, 90, group=1, block_size=5)  # MHA, two chunks a row
    loads("bulk", "bfloat16", 112, False, 90, group=12, tile_rows=48)   # bulk copies, 3 rows a lane
    loads("padded", "bfloat16", 128, False, 90)         # padded rows where v4 swizzles; fixed offsets, .ca
    loads("padded", "float16", 128, True, 80)
    loads("same", "bfloat16", 128, False, 90)
    dec4("float16", 48, False, 75, load_l1=True)         # .ca on the per-copy path; sm_75's plain copies
    dec9("bfloat16", 256, True, 90, group=16, block_size=7)   # rows 8..15 of the A operand; odd pages
    dec9("bfloat16", 64, False, 80, group=1, fused=False)      # MHA, the separate combine's empty slots
    dec9("float16", 48, False, 90, group=8, load_l1=True)      # padded rows: the per-copy path
    dec4("bfloat16", 128, True, 80, load_l1=True)        # pages through L1
    dec4("float16", 128, False, 80, load_l1=False)       # the fixed-offset issue with .cg
    bwd("bfloat16", 128, 90)
    bwd("float64", 128, 80)                             # float64 atomics, Bc shrunk to fit
    bwd("float32", 59, 90, lanes_per_key=4, deterministic=True)
    bwd("float32", 256, 80)                             # Br shrunk to 8 for 48 KB
    bwd2("bfloat16", 128, 90, deterministic=True)
    bwd2("bfloat16", 128, 80, smem=99 * 1024)           # sm_86's SRAM: 4 warps (Bc 64), Br 32
    bwd2("bfloat16", 59, 90)                            # rows not whole 16-byte chunks; D_PAD 64
    bwd2("float16", 72, 80, block_q=16, num_warps=4)    # 16-byte chunks past HEAD_DIM zero-filled
    bwd2("bfloat16", 96, 90, block_q=128, deterministic=True)
    # decode v6 (groups past 16 query heads, teams of warps): every arch (sm_75: float16 only,
    # never offered), teams of 2, 4 and 1 warps, both copy paths, a partial last slice (g = 40)
    dec6("float16", 128, False, 75)
    dec6("float16", 128, True, 80, group=64)
    dec6("bfloat16", 128, False, 90, group=32)
    dec6("bfloat16", 64, True, 90, group=64, block_size=7)
    dec6("bfloat16", 256, False, 90, group=40, fused=False)
    dec6("float16", 48, False, 80, group=24, load_l1=True)     # padded rows, the per-copy path
    dec6("bfloat16", 128, True, 90, group=8, num_warps=4)       # one-warp teams (v4's shape)
    dec6("bfloat16", 128, False, 90, group=128)                  # one team of 8 warps fills the block
    dec6("float16", 64, True, 80, group=71, block_size=5)        # MQA of 71 heads: the last warp holds 7
    # quantized paged caches (1-byte codes): every code format on every arch, both versions
    for arch, kv in zip(ARCHS, ("int8", "float8_e4m3fn", "float8_e4m3fn")):
        dec3("float16", 128, True, arch, kv=kv)
        dec("float16", 128, True, arch, kv=kv)
    dec3("bfloat16", 128, True, 90, kv="int8", group=8)
    dec3("float32", 64, True, 80, kv="float8_e4m3fn", block_size=5, fused=False)
    dec3("float64", 256, True, 90, kv="int8", group=1)    # 32 lanes of 8 codes a row
    dec("bfloat16", 59, True, 80, kv="float8_e4m3fn")     # rows not whole 8-byte words: scalar codes
    dec("float64", 128, True, 90, kv="int8", group=2)
    # decode v5 (v4 on quantized caches, paged only): both code formats on every arch (sm_75:
    # float16 only, as v4 already is; the registry offers v5 from sm_80), head dims 64 / 128 /
    # 256, groups 1 to 16, odd page sizes, both tile heights
    for arch, kv in zip(ARCHS, ("float8_e4m3fn", "int8", "float8_e4m3fn")):
        dec5("float16", 128, arch, kv)
    dec5("bfloat16", 128, 80, "float8_e4m3fn", group=8)
    dec5("bfloat16", 128, 90, "int8", fused=False)
    dec5("float16", 64, 90, "int8", group=1, block_size=7)       # rows of 4 chunks share a swizzle group
    dec5("bfloat16", 256, 90, "float8_e4m3fn", group=16, block_size=5)
    dec5("float16", 128, 80, "int8", group=16, tile_rows=16, num_warps=4)
    # the randomized Hadamard transform (cupy_raw/hadamard.py): every arch, each row length, both outputs
    from iokernels.cupy_raw import hadamard
    for arch in ARCHS:
        for dtype, d, out_f32 in (("float16", 128, False), ("float32", 64, False), ("float16", 256, True)):
            jobs.append((f"fwht {dtype} d={d} out_f32={out_f32}", "fwht", hadamard.fwht_defines(d, dtype, out_f32),
                         arch))
        if arch >= 80:
            jobs.append(("fwht bfloat16 d=128 out_f32=True", "fwht", hadamard.fwht_defines(128, "bfloat16", True),
                         arch))
    return jobs


def _compile(tmp_path, name, defines, arch, extra=()):
    src = tmp_path / f"{name}_{arch}_{abs(hash(tuple(sorted(defines.items()))))}.cu"
    src.write_text(cr.source(name, decode_loads.SOURCES if name in decode_loads.SOURCES else None))
    cmd = [NVCC, "-cubin", f"-arch=sm_{arch}", "-std=c++17", *extra,
           *(f"-D{k}={v}" for k, v in sorted(defines.items())),
           str(src), "-o", str(src.with_suffix(".cubin"))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr


def test_every_kernel_compiles_for_every_arch(tmp_path):
    jobs = _jobs()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, j[1], j[2], j[3]), jobs))
    failed = [f"sm_{j[3]} {j[0]}: {err.strip()[:400]}" for j, (rc, err) in zip(jobs, results) if rc != 0]
    assert not failed, "\n".join(failed)
    assert len(jobs) >= 25


def test_bfloat16_refuses_sm75_with_a_clear_error(tmp_path):
    defines = cr.ForwardConfig(version="v2").resolve(128, "bfloat16").defines(128, "bfloat16")
    rc, err = _compile(tmp_path, "fa_v2", defines, 75)
    assert rc != 0 and "compute capability 8.0" in err


def test_candidates_refuse_what_they_cannot_run(tmp_path):
    """fa_v1b is float32 only; decode_v2 needs whole 16-byte chunks: each says so with #error."""
    d16 = dict(cr.ForwardConfig(version="v1b").resolve(128, "float32").defines(128, "float32"), IK_DTYPE=1)
    rc, err = _compile(tmp_path, "fa_v1b", d16, 90)
    assert rc != 0 and "float32 kernel" in err
    d59 = cr.DecodeConfig("v2").defines(64, "float16", 4, False, 16)
    rc, err = _compile(tmp_path, "decode_v2", dict(d59, HEAD_DIM=59), 90)
    assert rc != 0 and "16-byte chunks" in err
    d3 = cr.DecodeConfig("v3").defines(64, "float16", 4, False, 16)
    rc, err = _compile(tmp_path, "decode_v3", dict(d3, HEAD_DIM=59), 90)
    assert rc != 0 and "16-byte chunks" in err
    d4 = cr.DecodeConfig("v4").defines(64, "float16", 4, False, 16)
    for bad, words in ((dict(HEAD_DIM=72), "multiple of 16"), (dict(GROUP=17), "group 1..16"),
                       (dict(IK_DTYPE=0), "16-bit tensor-core decode"), (dict(TILE_ROWS=8), "TILE_ROWS")):
        rc, err = _compile(tmp_path, "decode_v4", dict(d4, **bad), 90)
        assert rc != 0 and words in err, (bad, err[:300])
        if "HEAD_DIM" in bad or "GROUP" in bad:          # the policy's one home, named
            assert "decode_config.v4_limits" in err, (bad, err[:300])
    d5 = cr.DecodeConfig("v5").defines(128, "float16", 4, True, 16, kv="int8")
    for bad, words in ((dict(HEAD_DIM=192), "head_dim 64, 128 or 256"), (dict(PAGED=0), "is paged"),
                       (dict(KV_QUANT=0), "code format")):
        rc, err = _compile(tmp_path, "decode_v5", dict(d5, **bad), 90)
        assert rc != 0 and words in err, (bad, err[:300])
    dp = cr.PagedPrefillConfig("v1").resolve(64).defines(64, "float16", 16)
    for bad, words in ((dict(IK_DTYPE=0), "16-bit tensor-core kernel"), (dict(BLOCK_K=24), "multiple of 16")):
        for name in ("paged_prefill_v1", "paged_prefill_v2"):
            rc, err = _compile(tmp_path, name, dict(dp, **bad), 90)
            assert rc != 0 and words in err, (name, bad, err[:300])


#: every decode kernel file and the config that passes its defines (none has a default in the .cu)
_DECODE_DEFINES = {
    "decode": lambda: cr.DecodeConfig("v1").defines(128, "float16", 4, True, 16),
    "decode_v2": lambda: cr.DecodeConfig("v2").defines(128, "float16", 4, True, 16),
    "decode_v3": lambda: cr.DecodeConfig("v3").defines(128, "float16", 4, True, 16),
    "decode_v4": lambda: cr.DecodeConfig("v4").defines(128, "float16", 4, True, 16),
    "decode_v5": lambda: cr.DecodeConfig("v5").defines(128, "float16", 4, True, 16, kv="int8"),
    "decode_v6": lambda: cr.DecodeConfig("v6").defines(128, "float16", 32, True, 16),
    "decode_v7": lambda: cr.DecodeConfig("v7").defines(128, "float32", 32, True, 16),
    "decode_v9": lambda: cr.DecodeConfig("v9").defines(128, "float16", 4, True, 16),
    "paged_prefill_v1": lambda: cr.PagedPrefillConfig("v1").resolve(128).defines(128, "float16", 16),
    "paged_prefill_v2": lambda: cr.PagedPrefillConfig("v2").resolve(128).defines(128, "float16", 16),
}


@pytest.mark.parametrize("name", ["decode_v4", "decode_v5", "decode_v6", "decode_v7", "decode_v9",
                                  "paged_prefill_v1", "paged_prefill_v2"])
def test_a_missing_define_is_a_compile_error_naming_it(tmp_path, name):
    """decode v4 to v7, v9 and the paged prefill hold no tuning defaults: every define the config
    passes is needed, and leaving one out is an #error that names it."""
    full = _DECODE_DEFINES[name]()
    for key in sorted(full):
        if key in ("IK_DTYPE", "KV_QUANT"):          # common.cuh's (their dtype / format tables)
            continue
        rc, err = _compile(tmp_path, name, {k: v for k, v in full.items() if k != key}, 90)
        assert rc != 0 and f"-D{key} is missing" in err, (name, key, err[:300])


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_paged_prefill_defaults_stay_in_registers(tmp_path, version):
    """ptxas -v: paged_prefill_v1 and v2 at their default tiles (d = 64, 128; both dtypes; 4 and 8
    warps) on sm_80 and sm_90 use no local memory."""
    jobs = [(cr.PagedPrefillConfig(version).resolve(d, None, rows).defines(d, dt, 16), arch)
            for d in (64, 128) for dt in ("float16", "bfloat16") for arch in (80, 90) for rows in (1, 4096)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, f"paged_prefill_{version}", j[0], j[1],
                                                   ("-Xptxas", "-v")), jobs))
    for (defines, arch), (rc, err) in zip(jobs, results):
        assert rc == 0, err[:400]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        assert frame and frame.groups() == ("0", "0", "0"), f"sm_{arch} {defines}: {err[:400]}"


def test_candidates_stay_in_registers(tmp_path):
    """ptxas -v: the candidates' main shapes on sm_90 use no local memory (no spills, no stack)."""
    v1b = cr.ForwardConfig(version="v1b").resolve(128, "float32").defines(128, "float32")
    dec = cr.DecodeConfig("v2").defines(128, "bfloat16", 4, False, 16)
    decp = cr.DecodeConfig("v2").defines(128, "bfloat16", 4, True, 16)
    jobs = [("fa_v1b", v1b, 90), ("decode_v2", dec, 90), ("decode_v2", decp, 90)]
    for paged, nw, fused in ((False, 4, True), (True, 4, True), (False, 8, True), (True, 8, True),
                             (False, 4, False)):
        jobs.append(("decode_v3", cr.DecodeConfig("v3", num_warps=nw, fused=fused).defines(128, "bfloat16", 4,
                                                                                           paged, 16), 90))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, *j, extra=("-Xptxas", "-v")), jobs))
    for (name, defines, arch), (rc, err) in zip(jobs, results):
        assert rc == 0, err[:400]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        regs = re.search(r"Used (\d+) registers", err)
        assert frame and regs, err[:400]
        assert frame.groups() == ("0", "0", "0"), f"{name} {defines}: {frame.group(0)}"
        assert int(regs.group(1)) <= 128, f"{name}: {regs.group(0)} (the launch bounds cap 128)"


def test_decode_v4_stays_in_registers(tmp_path):
    """ptxas -v: decode v4's default at bf16 d=128 (O is 64 float32 a lane, Q_g's A fragments
    32 registers), at d=256, g=16, and at 8 warps, and its quantized default (int8, fp8) at
    d=128, use no local memory within their launch bounds' cap."""
    jobs = [(cr.DecodeConfig("v4").defines(d, "bfloat16", g, paged, 16), d, g)
            for d, g, paged in ((128, 4, False), (128, 4, True), (256, 16, False))]
    jobs.append((cr.DecodeConfig("v4", num_warps=8).defines(128, "bfloat16", 8, True, 16), 128, 8))
    jobs.append((cr.DecodeConfig("v4").defines(128, "bfloat16", 4, False, 16, cc=90, pairs=512, sms=132), 128, 4))
    for kv in ("int8", "float8_e4m3fn"):                  # v5's default: 32-key tiles at d=128
        jobs.append((cr.DecodeConfig("v5").defines(128, "bfloat16", 4, True, 16, kv=kv), 128, 4))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, "decode_v5" if "KV_QUANT" in j[0] else "decode_v4",
                                                   j[0], 90, extra=("-Xptxas", "-v")), jobs))
    for (defines, d, g), (rc, err) in zip(jobs, results):
        assert rc == 0, err[:400]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        regs = re.search(r"Used (\d+) registers", err)
        assert frame and regs, err[:400]
        assert frame.groups() == ("0", "0", "0"), f"d={d} g={g} paged={defines['PAGED']}: {frame.group(0)}"
        cap = 65536 // (32 * defines["NUM_WARPS"] * defines["DECODE_MIN_BLOCKS"])
        assert int(regs.group(1)) <= min(255, cap), f"d={d} g={g}: {regs.group(0)}"


def test_decode_v6_refuses_what_it_cannot_run_and_stays_in_registers(tmp_path):
    """decode v6's #errors name its limits (a group past 16 x TEAM_WARPS, partial teams), and its
    defaults at g = 32, 64 and 128 (teams of 2, 4 and 8 warps), d = 64 / 128 / 256, contiguous
    and paged, use no local memory within their launch bounds' cap (sm_90): each warp holds what
    a v4 warp holds."""
    d6 = cr.DecodeConfig("v6").defines(128, "bfloat16", 32, False, 16, cc=90)
    assert (d6["TEAM_WARPS"], d6["NUM_WARPS"]) == (2, 8)
    for bad, words in ((dict(GROUP=33), "16 x TEAM_WARPS"), (dict(NUM_WARPS=3), "whole teams"),
                       (dict(TEAM_WARPS=3), "TEAM_WARPS must be"), (dict(IK_DTYPE=0), "16-bit")):
        rc, err = _compile(tmp_path, "decode_v6", dict(d6, **bad), 90)
        assert rc != 0 and words in err, (bad, err[:300])
    jobs = [cr.DecodeConfig("v6").defines(d, "bfloat16", g, paged, 16, smem_limit=227 * 1024, cc=90)
            for d, g, paged in ((128, 32, False), (128, 64, True), (64, 64, False), (256, 32, False),
                                (128, 128, True))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, "decode_v6", j, 90, extra=("-Xptxas", "-v")), jobs))
    for defines, (rc, err) in zip(jobs, results):
        assert rc == 0, err[:400]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        regs = re.search(r"Used (\d+) registers", err)
        assert frame and regs, err[:400]
        assert frame.groups() == ("0", "0", "0"), f"{defines}: {frame.group(0)}"
        cap = 65536 // (32 * defines["NUM_WARPS"] * defines["DECODE_MIN_BLOCKS"])
        assert int(regs.group(1)) <= min(255, cap), f"{defines}: {regs.group(0)}"


#: bytes of spill stores decode v7's defaults may have: a few scalars the compiler parks (the
#: per-head arrays of q, O and the scores need kilobytes where they do not fit)
V7_SPILL_SLACK = 64


def test_decode_v7_defaults_stay_in_registers(tmp_path):
    """ptxas -v (sm_90): decode v7's default slice of the group fits a lane's registers at one
    8-warp block an SM, at float32 (d = 64, 128; groups 16 to 128, contiguous and paged), float64,
    16-bit rows at head dims the tensor-core versions do not take, and 1-byte codes; and a
    prime group (71) takes one head a block."""
    cases = [("float32", 128, 16, False, None), ("float32", 128, 64, True, None), ("float32", 64, 128, False, None),
             ("float64", 64, 16, False, None), ("bfloat16", 40, 8, True, None), ("float16", 56, 32, False, None),
             ("bfloat16", 128, 16, True, "int8"), ("bfloat16", 64, 32, True, "float8_e4m3fn"),
             ("float32", 128, 71, False, None)]
    jobs = [cr.DecodeConfig("v7").defines(d, dtype, g, paged, 16, smem_limit=227 * 1024, kv=kv)
            for dtype, d, g, paged, kv in cases]
    assert jobs[-1]["GROUP"] == 1 and jobs[-1]["GROUP_SPLIT"] == 71
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, "decode_v7", j, 90, extra=("-Xptxas", "-v")), jobs))
    for case, defines, (rc, err) in zip(cases, jobs, results):
        assert rc == 0, err[:400]
        assert defines["GROUP"] * defines["GROUP_SPLIT"] == case[2] and defines["DECODE_MIN_BLOCKS"] == 1, case
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        assert frame, err[:400]
        assert int(frame.group(2)) <= V7_SPILL_SLACK, f"{case} {defines['GROUP']} heads a block: {frame.group(0)}"


def test_decode_v6_config_is_v4s_shape_split_into_teams(monkeypatch):
    """The team is the smallest power of two of 16-row slices covering the group; the default
    block is 8 warps (4 where 8 do not fit), whole teams, the ring deep enough to hold v4's
    default key rows, shrunk to the SRAM; the SRAM arithmetic counts one ring and one merge row
    block a team; bad settings are ValueErrors naming config."""
    assert [policy.decode_v6_team_warps(g) for g in (1, 16, 17, 32, 33, 48, 64, 65)] == [1, 1, 2, 2, 4, 4, 4, 8]
    with pytest.raises(ValueError, match="group"):
        policy.decode_v6_team_warps(0)
    assert policy.decode_v6_stages(384, 4, 32, 8) == 3 and policy.decode_v6_stages(384, 2, 32, 8) == 6
    assert policy.decode_v6_stages(384, 8, 64, 8) == 2 and policy.decode_v6_stages(384, 1, 16, 8) == 8
    big = 227 * 1024
    for d in (64, 128, 256):
        for g in (17, 32, 64, 71, 128):
            for paged in (False, True):
                df = cr.DecodeConfig("v6").defines(d, "bfloat16", g, paged, 16, smem_limit=big, cc=90)
                team = df["TEAM_WARPS"]
                assert 16 * team >= g > 8 * team and df["NUM_WARPS"] % team == 0
                rows = df["NUM_WARPS"] // team * df["STAGES"] * df["TILE_ROWS"]
                assert rows <= V6.DECODE_V6_RING_ROWS or df["STAGES"] == C.MIN_STAGES
                total = V6.decode_v6_smem(d, "bfloat16", g, df["STAGES"], df["TILE_ROWS"], df["NUM_WARPS"],
                                          C.DECODE_MAX_SPLITS, True, C.DECODE_V3_TABLE_CAP)[0]
                assert total <= big, (d, g, total)
    # SRAM: teams x stages x 2 x rows x d x 2 bytes (swizzled rows), the merge one g x d block a team
    ring = 2 * 3 * 2 * 32 * 256
    assert V6.decode_v6_smem(128, "float16", 64, 3, 32, 8, swizzled=True) == (ring, ring)
    assert V6.decode_v6_smem(128, "float16", 64, 2, 16, 4, swizzled=True)[0] == 64 * 128 * 4   # the merge
    small = cr.DecodeConfig("v6").defines(128, "bfloat16", 32, False, 0, smem_limit=99 * 1024)   # sm_86
    assert small["NUM_WARPS"] == 4 and small["TEAM_WARPS"] == 2
    wide = cr.DecodeConfig("v6").defines(128, "bfloat16", 128, False, 0, smem_limit=99 * 1024)
    assert wide["NUM_WARPS"] == wide["TEAM_WARPS"] == 8                 # past 64: one team fills the block
    assert V6.v6_smem_bound(128, "bfloat16", 128) == V6.decode_v6_smem(
        128, "bfloat16", 128, C.MIN_STAGES, 32, 8, C.DECODE_MAX_SPLITS, True, C.DECODE_V3_TABLE_CAP)[0]
    with pytest.raises(ValueError, match="config.version"):
        cr.DecodeConfig("v6").defines(128, "bfloat16", 129, False, 0)
    with pytest.raises(ValueError, match="config.version"):
        cr.DecodeConfig("v6").defines(128, "float32", 32, False, 0)
    with pytest.raises(ValueError, match="config.tile_rows"):
        cr.DecodeConfig("v6", tile_rows=24).defines(128, "float16", 32, False, 0)
    assert cr.DecodeConfig("v6", load_l1=False).defines(128, "float16", 32, False, 0, cc=90)["LOAD_L1"] == 0
    assert cr.DecodeConfig("v6").defines(128, "float16", 32, True, 16, cc=90)["LOAD_L1"] == 0   # pages: .cg
    # the registry: v4 where it runs, v6 past 16 query heads a KV head up to 128; past 128 v7
    # (the CUDA-core decode with the group split over blocks); v6 never past 128 or for a quantized cache
    for g, want in ((16, "v4"), (17, "v6"), (32, "v6"), (64, "v6"), (65, "v6"), (128, "v6"), (129, "v7")):
        n = _need("float16", 128, 90, big, group=g, aligned16=True)
        assert cr.REGISTRY.resolve("decode", None, n)[0].version == want, g
        v6_rec = cr.REGISTRY.get("decode", "v6")
        assert (v6_rec.unavailable(n) is None) == (g <= 128), g
    # the group gate (policy.decode_v6_default_at) at a lower bound: past it v6 runs by name only
    monkeypatch.setattr(cr.policy, "DECODE_V6_DEFAULT_MAX_GROUP", 64)
    for g, want in ((64, "v6"), (65, "v7"), (128, "v7")):
        n = _need("float16", 128, 90, big, group=g, aligned16=True)
        assert cr.REGISTRY.resolve("decode", None, n)[0].version == want, g
        if g > 64:
            assert cr.REGISTRY.get("decode", "v6").not_default(n).startswith(f"not the default at group {g}")
            assert cr.REGISTRY.resolve("decode", cr.DecodeConfig("v6"), n)[0].version == "v6"
    v6 = cr.REGISTRY.get("paged_decode", "v6")
    assert "kv_dtype" in v6.unavailable(_need("float16", 128, 90, big, group=32, kv_dtype="int8"))
    assert "compute capability 8.0" in v6.unavailable(_need("float16", 128, 75, big, group=32))
    assert "group" in v6.unavailable(_need("float16", 128, 90, big, group=129))
    assert "shared memory" in v6.unavailable(_need("float16", 256, 90, 48 * 1024, group=64))


def test_backward_v2_defaults_stay_in_registers(tmp_path):
    """ptxas -v: bwd_v2 keeps dK_j, dV_j, S^T and dP^T in registers (sm_90, bfloat16): no local
    memory at d=64 (its default Br=64) and at d=128 with Br=32; the d=128 default (Br=64) may
    spill a few words, never the accumulators (BWD_V2_SPILL_BYTES at most)."""
    BWD_V2_SPILL_BYTES = 64                      # 16 words: not room for a dK/dV row's floats
    jobs = [(cr.BackwardConfig("v2", deterministic=True).defines(64, "bfloat16"), 0),
            (cr.BackwardConfig("v2", block_q=32).defines(128, "bfloat16"), 0),
            (cr.BackwardConfig("v2").defines(128, "bfloat16"), BWD_V2_SPILL_BYTES)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, "bwd_v2", j[0], 90, extra=("-Xptxas", "-v")), jobs))
    for (defines, allowed), (rc, err) in zip(jobs, results):
        assert rc == 0, err[:400]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        assert frame, err[:400]
        assert max(map(int, frame.groups())) <= allowed, f"{defines}: {frame.group(0)}"


def test_every_source_file_is_covered():
    """A new .cu file must be added to SOURCES (and so to the compile list above), or to the
    Hopper kernels' own table (compiled for sm_90a by tests/test_hopper.py)."""
    on_disk = {p.stem for p in cr.KERNEL_DIR.glob("*.cu")}
    assert cr.KERNEL_DIR.name == "kernels" and (cr.KERNEL_DIR / "common.cuh").exists()
    assert not set(cr.SOURCES) & set(cr.hopper.SOURCES)
    assert on_disk == set(cr.SOURCES) | set(cr.hopper.SOURCES)
    assert set(cr.SOURCES) | set(decode_loads.SOURCES) == {j[1] for j in _jobs()}
    bench_dir = pathlib.Path(decode_loads.__file__).parent / "kernels"
    assert {p.stem for p in bench_dir.glob("*.cu")} == set(decode_loads.SOURCES)


def test_config_checks_need_no_gpu():
    """Config errors are ValueErrors naming config, raised before any GPU is touched."""
    import numpy as np
    q = np.ones((1, 1, 8, 64), np.float32)
    with pytest.raises(ValueError, match="config"):
        cr.attention(q, q, q, config=cr.ForwardConfig(version="v2"))
    with pytest.raises(ValueError, match="config"):
        cr.attention(q, q, q, config="v1")
    cfg = cr.ForwardConfig(version="v1").resolve(128, "float32")
    assert cfg.smem_bytes(128, "float32") == 4 * (128 * 64 * 3 + 64 * 64)
    with pytest.raises(ValueError, match="config"):
        cfg.check_fits(128, "float32", 64 * 1024)       # a T4's 64 KB: the default does not fit
    v2 = cr.ForwardConfig(version="v2").resolve(128, "bfloat16")
    assert (v2.block_q, v2.block_k, v2.num_warps) == (128, 64, 8)


def _need(dtype, d, cc, smem=None, **extra):
    return Need(dtype=dtype, head_dim=d, cc=cc, extra=dict(smem=smem, **extra))


def test_default_forward_through_the_registry():
    """The default (config None, or version None): the tensor-core v2 for 16-bit inputs, v1b
    (cp.async tiles) for float32 where cp.async exists (compute capability 8.0+), v1 for
    float64 and float32 on sm_75; bfloat16 on sm_75 runs nothing (a ValueError naming q)."""
    def default(dtype, d, cc):
        return cr.REGISTRY.resolve("attention", None, _need(dtype, d, cc))[0].version
    assert default("bfloat16", 128, 90) == "v2"
    assert default("float16", 64, 75) == "v2"
    assert default("float32", 128, 90) == "v1b"
    assert default("float32", 59, 80) == "v1b"
    assert default("float32", 128, 75) == "v1"
    assert default("float32", 128, None) == "v1b"               # no GPU here: cc unknown
    assert default("float64", 128, 90) == "v1"
    assert default("float16", 300, 90) == "v1"                  # past v2's head-dim limit
    with pytest.raises(ValueError, match="q: no cupy attention kernel"):
        default("bfloat16", 128, 75)
    k, cfg = cr.REGISTRY.resolve("attention", cr.ForwardConfig(block_k=32), _need("float16", 64, 90))
    assert (k.version, cfg.version, cfg.block_k) == ("v2", "v2", 32)


def test_registry_checks_refuse_with_a_reason():
    """An explicit version that cannot run is a ValueError naming config.version, with why."""
    cases = [("attention", cr.ForwardConfig("v1b"), _need("float16", 64, 90), "float32"),
             ("attention", cr.ForwardConfig("v1b"), _need("float32", 64, 75), "8.0"),
             ("attention", cr.ForwardConfig("v2"), _need("float32", 64, 90), "float16/bfloat16"),
             ("attention", cr.ForwardConfig("v1"), _need("bfloat16", 64, 75), "bfloat16"),
             ("decode", cr.DecodeConfig("v3"), _need("float16", 59, 90, aligned16=True), "16-byte"),
             ("decode", cr.DecodeConfig("v2"), _need("float16", 64, 90, aligned16=False), "16-byte"),
             ("decode", cr.DecodeConfig("v3"), _need("float64", 128, 90), "16-byte chunks")]
    for op, cfg, n, why in cases:
        with pytest.raises(ValueError, match="config.version") as e:
            cr.REGISTRY.resolve(op, cfg, n)
        assert why in str(e.value), (op, cfg, str(e.value))
    with pytest.raises(ValueError, match="config"):
        cr.REGISTRY.resolve("attention", cr.DecodeConfig(), _need("float32", 64, 90))
    with pytest.raises(ValueError, match="config"):
        cr.REGISTRY.resolve("attention", "v1", _need("float32", 64, 90))


#: opt-in shared memory a block: a 48 KB floor, sm_75 (T4), sm_86/89, sm_90 (H100/H200)
SMEM_LIMITS = (48 * 1024, 64 * 1024, 99 * 1024, 227 * 1024)
HEAD_DIMS = (8, 59, 64, 128, 256)
DTYPES = ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("smem", SMEM_LIMITS)
@pytest.mark.parametrize("cc", [75, 80, 90])
def test_default_forward_fits_every_dtype_and_head_dim(smem, cc):
    """The default config resolves to tiles that fit ``smem`` for every dtype and head dim, or,
    where no tile set of any version fits (float32 at d=256 and float64 at d >= 128 below
    64 KB, float64 at d=256 below 99 KB), the registry refuses with a ValueError naming q
    and the bytes -- never a launch that fails.  An explicit size that does not fit raises
    naming config."""
    impossible = []
    for dtype in DTYPES:
        if dtype == "bfloat16" and cc < 80:
            continue
        for d in HEAD_DIMS:
            n = _need(dtype, d, cc, smem)
            fits = [v for v in cr.REGISTRY.versions("attention")
                    if cr.REGISTRY.get("attention", v).unavailable(_need(dtype, d, cc)) is None
                    and cr.config.min_forward_smem(v, d, dtype) <= smem]
            if not fits:
                with pytest.raises(ValueError, match="q: no cupy attention kernel.*shared memory"):
                    cr.REGISTRY.resolve("attention", None, n)
                impossible.append((dtype, d))
                continue
            kernel, cfg = cr.REGISTRY.resolve("attention", None, n)
            got = cr.fit_config(cfg, d, dtype, dict(smem_optin=smem, cc=cc))
            assert got.smem_bytes(d, dtype) <= smem, (dtype, d, got)
            assert got.version == kernel.version and got.block_q and got.block_k
            # the explicit default-size config of that version: fits, or raises naming config
            explicit = cfg.resolve(d, dtype)
            if explicit.smem_bytes(d, dtype) > smem:
                with pytest.raises(ValueError, match="config"):
                    cr.fit_config(explicit, d, dtype, dict(smem_optin=smem, cc=cc))
    want = {48 * 1024: {("float32", 256), ("float64", 128), ("float64", 256)},
            64 * 1024: {("float64", 256)}}.get(smem, set())
    assert set(impossible) == want


@pytest.mark.parametrize("v6_gate", ["held back", "open"])
@pytest.mark.parametrize("smem", SMEM_LIMITS)
def test_default_decode_fits_every_dtype_and_head_dim(smem, v6_gate, monkeypatch):
    """The decode default is v4 for 16-bit rows of whole mma k-steps (d % 16 == 0, d <= 256,
    g <= 16) where its shallowest ring fits; v6 for those rows at 16 < g <= 128 where its
    smallest block fits, once policy.HELD_BACK lets it (never while it is held back); else v7
    for the groups v3's registers do not hold (policy.DECODE_V3_LANE_WORDS) where its slice's
    ring fits, else v3 where its rows and shallowest ring fit, else v1 (which needs only a little
    static SRAM); a ring's depth shrinks until it fits."""
    if v6_gate == "held back":                  # as before its GPU record: the gate's other side
        for op in ("decode", "paged_decode"):
            monkeypatch.setitem(cr.policy.HELD_BACK, (op, "v6"), "a test holds it back")
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for group in (1, 4, 8, 16, 32, 64, 71, 128):
                n = _need(dtype, d, 90, smem, group=group, aligned16=True)
                kernel, cfg = cr.REGISTRY.resolve("decode", None, n)
                if C.decode_v2_geometry(d, dtype) is None:
                    assert kernel.version == "v1", (dtype, d)
                tc_shape = dtype in ("float16", "bfloat16") and d % 16 == 0 and d <= 256
                v4_shape = tc_shape and group <= 16
                v6_shape = v6_gate == "open" and tc_shape and 16 < group <= V6.DECODE_V6_MAX_GROUP
                if kernel.version == "v4":
                    assert v4_shape, (dtype, d, group)
                elif v4_shape:                          # only SRAM may send a v4 shape elsewhere
                    assert C.ring_smem_bound("v4", d, dtype, group) > smem, (dtype, d, group, kernel.version)
                if kernel.version == "v6":
                    assert v6_shape, (dtype, d, group, v6_gate)
                elif v6_shape:                          # ... or a v6 shape
                    assert V6.v6_smem_bound(d, dtype, group) > smem, (dtype, d, group, kernel.version)
                words = C.lane_words_a_head(d, dtype)
                v7_shape = words is not None and words * group > policy.DECODE_V3_LANE_WORDS
                if kernel.version == "v7":                  # (a v4 / v6 shape only where they do not fit: above)
                    assert v7_shape, (dtype, d, group)
                elif kernel.version == "v3":
                    assert not v7_shape, (dtype, d, group)  # v7 refuses only what v3 holds, and fits where v3 does
                if kernel.version in ("v3", "v4", "v6", "v7"):
                    defines = cfg.defines(d, dtype, group, True, 16, smem_limit=smem)
                    heads = defines["GROUP"]                    # v7: the slice a block holds
                    assert heads * defines.get("GROUP_SPLIT", 1) == group
                    st = cfg.ring_stages(d, dtype, heads, smem)
                    rows = (cfg.v4_tile_rows() if kernel.version == "v4" else V6.v6_tile_rows(cfg, d)
                            if kernel.version == "v6" else C.decode_v2_geometry(d, dtype)["tile_rows"])
                    ring_smem = kernel.extra["smem"]            # the record's: what the launch sizes
                    assert ring_smem(d, dtype, heads, defines, None, C.DECODE_MAX_SPLITS, True,
                                     C.DECODE_V3_TABLE_CAP)[0] <= smem
                    assert defines["STAGES"] == st and defines["TILE_ROWS"] == rows
                else:
                    assert kernel.version == "v1"
                    cfg.defines(d, dtype, group, False, 16)
    big = 227 * 1024
    assert cr.REGISTRY.resolve("decode", None, _need("bfloat16", 128, 90, big, group=4))[0].version == "v4"
    # v6 runs groups past 16 when named; while policy.HELD_BACK holds v6 the default is v7 (the
    # CUDA-core decode with the group split over blocks)
    assert cr.REGISTRY.resolve("decode", None, _need("float16", 128, 90, big, group=32))[0].version \
        == ("v6" if v6_gate == "open" else "v7")
    assert cr.REGISTRY.resolve("decode", cr.DecodeConfig("v6"), _need("float16", 128, 90, big, group=32))[0].version \
        == "v6"
    assert (cr.REGISTRY.resolve("decode", None, _need("float16", 128, 90, big, group=65))[0].version == "v6") \
        == (v6_gate == "open")
    assert cr.REGISTRY.resolve("decode", None, _need("float32", 128, 90, big, group=4))[0].version == "v3"
    assert cr.REGISTRY.resolve("decode", None, _need("bfloat16", 72, 90, big, group=4))[0].version == "v3"
    why = cr.REGISTRY.get("decode", "v4").unavailable(_need("float16", 128, 75, big, group=4))
    assert why and "compute capability 8.0" in why


def test_forward_fit_shrinks_only_the_sizes_left_open():
    """fit_config keeps the sizes a config gives and shrinks the rest."""
    dev = dict(smem_optin=64 * 1024, cc=75)
    got = cr.fit_config(cr.ForwardConfig("v1", block_k=16), 128, "float32", dev)
    assert got.block_k == 16 and got.smem_bytes(128, "float32") <= 64 * 1024
    with pytest.raises(ValueError, match="config"):
        cr.fit_config(cr.ForwardConfig("v1", block_q=64, block_k=64), 128, "float32", dev)
    with pytest.raises(ValueError, match="config.version"):
        cr.ForwardConfig().resolve(64, "float32")


# --------------------------------------------------------------------------- decode split heuristic
def test_decode_wave_splits_properties():
    """policy.decode_wave_splits is pure Python: its promises, over a grid of shapes (no GPU).

    At least DECODE_MIN_KEYS_PER_SPLIT keys a split (unless splits == 1); at most
    DECODE_MAX_SPLITS; never fewer splits for a longer sequence; 1 for an empty one.  Where
    the pairs fit one wave of slots = num_sms * blocks_per_sm, never fewer splits than the
    one-wave fill slots // pairs (within the caps), and exactly that fill where it keeps
    DECODE_SATURATING_FRACTION of the slots busy.
    """
    lo, cap = C.DECODE_MIN_KEYS_PER_SPLIT, C.DECODE_MAX_SPLITS
    for sms in (40, 108, 132):
        for bps in (1, 2, 3, 4, 8):
            slots = sms * bps
            for batch in (1, 2, 3, 8, 17, 64, 1000):
                for hkv in (1, 2, 8, 32):
                    prev, pairs = 0, batch * hkv
                    for n in (0, 1, 100, 255, 256, 257, 1000, 4096, 32768, 131072, 10 ** 6):
                        at = (batch, hkv, n, sms, bps)
                        s = policy.decode_wave_splits(batch, hkv, n, sms, bps)
                        assert isinstance(s, int) and 1 <= s <= cap, (at, s)
                        if n == 0:
                            assert s == 1
                        if s > 1:
                            assert n // s >= lo, (at, s)
                        assert s >= prev, f"not monotone in seq_len at {at}: {prev} -> {s}"
                        prev = s
                        fill = max(1, min(slots // pairs, n // lo, cap)) if pairs <= slots else None
                        if fill is not None:
                            assert s >= fill, (at, s, fill)
                            if pairs * fill >= C.DECODE_SATURATING_FRACTION * slots:
                                assert s == fill, (at, s, fill)
                    # a long sequence with room on the GPU uses the room (more than one split)
                    if pairs * 2 <= slots:
                        assert policy.decode_wave_splits(batch, hkv, 10 ** 6, sms, bps) > 1
    # the serving shapes on 132 SMs (8 KV heads): one wave filled ...
    assert policy.decode_wave_splits(1, 8, 32768, 132, 1) == 16            # 128 blocks
    assert policy.decode_wave_splits(8, 8, 32768, 132, 1) == 2             # 128 blocks
    assert policy.decode_wave_splits(64, 8, 32768, 132, 2) == 1            # 512 blocks, 264 slots
    # ... and past one wave: 136 pairs do not run as 132 blocks and then 4 (a second wave that
    # leaves the GPU nearly idle), 192 take two splits (3 waves nearly full), 256 none (2 waves
    # of 132 and 124); a shorter sequence takes fewer splits, where each wave's fixed cost counts
    assert 8 <= policy.decode_wave_splits(17, 8, 32768, 132, 1) <= 16
    assert policy.decode_wave_splits(24, 8, 32768, 132, 1) == 2
    assert policy.decode_wave_splits(32, 8, 32768, 132, 1) == 1
    assert 2 <= policy.decode_wave_splits(17, 8, 4096, 132, 1) < policy.decode_wave_splits(17, 8, 32768, 132, 1)
    # split_cost is the model the heuristic minimises, as its docstring writes it: 136 pairs
    # unsplit on 132 slots are a full wave and one of 4 blocks, costed as rho of them
    slots, rho = 132, C.DECODE_SATURATING_FRACTION * 132
    want = 32768 * (slots + rho) + 2 * rho * C.DECODE_WAVE_COST_BYTES / 512
    assert policy.split_cost(136, 32768, 1, 132, 1, 512) == pytest.approx(want, rel=1e-12)
    for batch, n in ((1, 32768), (8, 4096), (17, 32768), (24, 32768), (64, 4096)):
        s = policy.decode_wave_splits(batch, 8, n, 132, 1)
        costs = [policy.split_cost(batch * 8, n, t, 132, 1) for t in range(1, min(n // lo, cap) + 1)]
        assert policy.split_cost(batch * 8, n, s, 132, 1) <= min(costs) * (1 + 1e-9), (batch, n, s)
    # a key's K and V rows set the wave's cost in keys: 1-byte codes make it twice as many
    narrow = policy.decode_wave_splits(17, 8, 4096, 132, 1, row_bytes=256)
    assert narrow < policy.decode_wave_splits(17, 8, 4096, 132, 1)


def test_default_decode_is_v4_then_v3_and_falls_back_to_v1_where_they_cannot_run():
    """DecodeConfig() resolves to decode_v4.cu (8 warps x 3 stages x 16 key rows, copied through
    L1 over a contiguous cache on sm_90) for 16-bit rows of whole mma k-steps, to decode_v3.cu
    (8 warps x 4 stages) on other rows of whole 16-byte chunks, 16-byte aligned; other rows
    (d = 59 in float16, unaligned views) run decode.cu.
    Settings a version does not have are refused naming the field."""
    cfg = cr.DecodeConfig()
    assert (cfg.version, cfg.num_warps, cfg.stages) == (None, None, None)

    def default(dtype, d, aligned, smem=None):
        return cr.REGISTRY.resolve("decode", None, _need(dtype, d, 90, smem, aligned16=aligned))[0].version
    assert default("bfloat16", 128, True) == "v4"
    assert default("float32", 128, True) == "v3"
    assert default("bfloat16", 128, False) == "v1"
    assert default("float16", 59, True) == "v1"
    defines = cr.DecodeConfig("v3").defines(128, "bfloat16", 4, False, 0)
    assert (defines["NUM_WARPS"], defines["STAGES"]) == (C.DECODE_V3_WARPS, C.DECODE_V3_STAGES)
    defines = cr.DecodeConfig("v4").defines(128, "bfloat16", 4, True, 16, smem_limit=227 * 1024)
    assert (defines["NUM_WARPS"], defines["STAGES"], defines["TILE_ROWS"]) == (
        C.DECODE_V4_WARPS, C.DECODE_V4_STAGES, C.DECODE_V4_TILE_ROWS)
    defines = cr.DecodeConfig("v4").defines(128, "bfloat16", 4, False, 0, smem_limit=227 * 1024, cc=90)
    assert (defines["NUM_WARPS"], defines["STAGES"], defines["TILE_ROWS"], defines["LOAD_L1"]) == (
        C.DECODE_V4_WARPS, C.DECODE_V4_STAGES, C.DECODE_V4_TILE_ROWS, 1)
    small = cr.DecodeConfig("v4").defines(128, "bfloat16", 4, True, 16, smem_limit=99 * 1024)   # sm_86
    assert small["NUM_WARPS"] == C.DECODE_V4_SMALL_WARPS and small["DECODE_MIN_BLOCKS"] == 2
    assert C.decode_v4_smem(128, "bfloat16", 4, small["STAGES"], 16, small["NUM_WARPS"], C.DECODE_MAX_SPLITS,
                            True, C.DECODE_V3_TABLE_CAP)[0] <= 99 * 1024
    assert default("bfloat16", 128, True, smem=99 * 1024) == "v4"
    with pytest.raises(ValueError, match="num_warps"):
        cr.DecodeConfig(version="v2", num_warps=8)
    with pytest.raises(ValueError, match="config.tile_rows"):
        cr.DecodeConfig(version="v4", tile_rows=8).defines(128, "float16", 4, False, 0)
    for dtype, d, group in (("float32", 128, 4), ("float16", 72, 4), ("float16", 128, 32)):
        with pytest.raises(ValueError, match="config.version"):
            cr.DecodeConfig(version="v4").defines(d, dtype, group, False, 0)


def test_decode_v4_has_one_load_path():
    """decode v4's config has no bulk-copy setting any more (the sweeps' decode_v4_loads.cu
    has it) and passes no LOAD_BULK or SWIZZLE define; the sweeps' experiments add theirs."""
    with pytest.raises(TypeError):
        cr.DecodeConfig("v4", load_bulk=True)
    for paged in (False, True):
        got = cr.DecodeConfig("v4").defines(128, "bfloat16", 4, paged, 16, cc=90)
        assert "LOAD_BULK" not in got and "SWIZZLE" not in got
    assert decode_loads.loads_kernel("bulk", 128).extra["defines"] == dict(LOAD_BULK=1, SWIZZLE=0, LOAD_L1=0)
    assert decode_loads.loads_kernel("same", 128).extra["defines"]["SWIZZLE"] == 1
    assert decode_loads.loads_kernel("same", 96).extra["defines"]["SWIZZLE"] == 0
    with pytest.raises(ValueError, match="load"):
        decode_loads.loads_kernel("tma", 128)


def test_decode_v4_copies_through_l1_over_a_contiguous_cache():
    """load_l1 None: on compute capability CC_L1+, a contiguous 16-bit cache of 2^k-chunk rows
    copies through L1 (LOAD_L1=1) with the default ring, which fits DECODE_V4_L1_MAX_RING;
    older or unknown GPUs, pages, quantized codes (v5), rows of other chunk counts (d = 48, 96)
    and rings over the cap keep .cg; an explicit load_l1 is kept; a non-bool or load_l1 on
    another version is refused naming config.load_l1."""
    big = 227 * 1024

    def dfn(d=128, paged=False, kv=None, cc=90, **kw):
        version = "v4" if kv is None else "v5"
        return cr.DecodeConfig(version, **kw).defines(d, "bfloat16", 4, paged, 16, smem_limit=big, kv=kv, cc=cc)
    for d in (16, 32, 64, 128, 256):
        got = dfn(d)
        assert got["LOAD_L1"] == 1, d
        assert got["STAGES"] == cr.DecodeConfig("v4").ring_stages(d, "bfloat16", 4, big), d
        ring = got["NUM_WARPS"] * got["STAGES"] * 2 * got["TILE_ROWS"] * d * 2
        assert ring <= C.DECODE_V4_L1_MAX_RING, d
    assert dfn()["STAGES"] == C.DECODE_V4_STAGES
    for got in (dfn(cc=80), dfn(cc=None), dfn(paged=True), dfn(paged=True, kv="int8"), dfn(48), dfn(96),
                dfn(stages=4)):
        assert got["LOAD_L1"] == 0
    assert dfn(load_l1=False)["LOAD_L1"] == 0 and dfn(load_l1=False)["STAGES"] == C.DECODE_V4_STAGES
    assert dfn(paged=True, load_l1=True)["LOAD_L1"] == 1 and dfn(96, load_l1=True, cc=80)["LOAD_L1"] == 1
    with pytest.raises(ValueError, match="config.load_l1"):
        cr.DecodeConfig("v4", load_l1=1)
    with pytest.raises(ValueError, match="config.load_l1"):
        cr.DecodeConfig("v3", load_l1=True)
    assert "LOAD_L1" not in cr.DecodeConfig("v3").defines(128, "bfloat16", 4, False, 16, cc=90)


def test_decode_v4_sram_is_exact_for_swizzled_rows():
    """decode_v4_smem counts swizzled rows (d a multiple of 64, cp.async chunks) exactly --
    warps x stages x 2 x rows x d x 2 bytes, what decode_v4.cu's unpadded rows take -- and
    padded rows by V4_ROW_PAD_BYTES, an upper bound; other head dims pad."""
    for d in (64, 128, 192, 256):
        assert C.decode_v4_swizzled(d)
        for stages, rows, warps in ((3, 16, 8), (2, 32, 4)):
            exact = C.decode_v4_smem(d, "float16", 4, stages, rows, warps, swizzled=True)[0]
            padded = C.decode_v4_smem(d, "float16", 4, stages, rows, warps)[0]
            assert exact == warps * stages * 2 * rows * d * 2
            assert padded == warps * stages * 2 * rows * (d * 2 + C.V4_ROW_PAD_BYTES) > exact
    for d in (16, 48, 96, 112):
        assert not C.decode_v4_swizzled(d)
    # the merge buffer still bounds a tiny ring from below
    assert C.decode_v4_smem(128, "float16", 16, 2, 16, 8, swizzled=True)[0] >= 8 * 16 * 128 * 4


def test_decode_v4_blocks_halve_when_the_batch_fills_the_sms():
    """(b, kv head) pairs of at least DECODE_V4_PAIRS_SPLIT_BLOCK x SMs (one an SM: batch 17 x 8
    KV heads on 132 SMs) give 4-warp blocks with a ring of DECODE_V4_SMALL_STAGES, capped for two
    an SM, over a contiguous cache and a paged one; fewer pairs, an unknown batch, a given
    num_warps or a quantized cache (v5) keep the 8-warp block; a given ring depth stays."""
    def shape(pairs, paged=False, version="v4", kv=None, d=128, **kw):
        got = cr.DecodeConfig(version, **kw).defines(d, "bfloat16", 4, paged, 16, smem_limit=227 * 1024, cc=90,
                                                     pairs=pairs, sms=132, kv=kv)
        return got["NUM_WARPS"], got["STAGES"], got["DECODE_MIN_BLOCKS"]
    one = C.DECODE_V4_PAIRS_SPLIT_BLOCK * 132
    small = (C.DECODE_V4_SMALL_WARPS, C.DECODE_V4_SMALL_STAGES, 2)
    large = (C.DECODE_V4_WARPS, C.DECODE_V4_STAGES, 1)
    for paged in (False, True):
        assert shape(one, paged) == shape(4 * one, paged) == shape(17 * 8, paged) == small, paged
        assert shape(one - 1, paged) == shape(3 * 8, paged) == shape(None, paged) == large, paged
        assert shape(one, paged, num_warps=8) == (8, C.DECODE_V4_STAGES, 1)
        assert shape(one, paged, stages=3) == (C.DECODE_V4_SMALL_WARPS, 3, 2)      # a given depth stays
        assert shape(one, paged, version="v9") == small                            # v9's undealt launch is v4's
    assert C.DECODE_V4_SMALL_WARPS * 2 == C.DECODE_V4_WARPS and C.DECODE_V4_SMALL_STAGES < C.DECODE_V4_STAGES
    # v5's quantized rows keep their block; head_dim 256's SRAM already takes the 4-warp block
    quant = cr.DecodeConfig("v5").defines(128, "bfloat16", 4, True, 16, smem_limit=227 * 1024, cc=90,
                                          pairs=one, sms=132, kv="int8")
    assert quant["NUM_WARPS"] == C.DECODE_V4_WARPS
    assert shape(one, d=256)[0] == shape(None, d=256)[0] == C.DECODE_V4_SMALL_WARPS
    # the policy alone: only a larger block is made smaller, and never a deeper ring
    assert C.decode_v4_block(8, 3, 4, one, 132) == (4, C.DECODE_V4_SMALL_STAGES)
    assert C.decode_v4_block(8, 2, 4, one, 132) == (4, 2) and C.decode_v4_block(4, 3, 4, one, 132) == (4, 3)
    assert C.decode_v4_block(8, 3, 4, one - 1, 132) == C.decode_v4_block(8, 3, 4, None, None) == (8, 3)
    # compute-sanitizer runs that block by name (its cases are batches too small to pick it)
    from iokernels.cupy_raw import sanitize as S
    picked = {"num_warps": C.DECODE_V4_SMALL_WARPS, "stages": C.DECODE_V4_SMALL_STAGES, "min_blocks": 2}
    for op in ("decode", "paged_decode"):
        assert picked in S.VARIANTS[(op, "v4")], op


def test_quantized_paged_caches_default_to_v5_where_it_reads_them():
    """A quantized paged cache (int8 / fp8 codes, float16 or bfloat16 compute dtype) resolves to
    decode v5 (where v4's quantized path was: the same checks) on compute capability 8.0+ at
    head dims 64, 128, 256, to v3 at other head dims and on sm_75; v5 refuses other head dims,
    contiguous caches, 16-bit caches and float32 by name, v4 refuses codes; v5's SRAM counts
    1-byte rows and their scales (and fits sm_86's 99 KB with 4 warps)."""
    def default(dtype, d, cc, kv="int8", gran="block_head", smem=227 * 1024):
        n = _need(dtype, d, cc, smem, aligned16=True, group=4, kv_dtype=kv, scale_granularity=gran)
        return cr.REGISTRY.resolve("paged_decode", None, n)[0].version
    for dtype in ("float16", "bfloat16"):
        for kv in ("int8", "float8_e4m3fn"):
            for gran in ("block_head", "block"):
                for d in C.DECODE_V5_HEAD_DIMS:
                    assert default(dtype, d, 90, kv, gran) == "v5", (dtype, kv, gran, d)
    assert default("bfloat16", 128, 86, smem=99 * 1024) == "v5"
    assert default("float16", 96, 90) == "v3"
    assert default("float16", 128, 75, smem=64 * 1024) == "v3"
    assert default("float32", 128, 90) == "v3"
    for d in (96, 128):
        why = cr.registry.check_decode_v5(_need("float16", d, 90, 227 * 1024, group=4, kv_dtype=None
                                                if d == 128 else "int8", scale_granularity="block"))
        assert why and why.startswith("kv_dtype"), (d, why)
    why = cr.registry.check_decode_v4(_need("float16", 128, 90, 227 * 1024, group=4, kv_dtype="int8",
                                            scale_granularity="block"))
    assert why and why.startswith("kv_dtype") and "v5" in why
    with pytest.raises(ValueError, match="kv_dtype"):
        cr.DecodeConfig("v5").defines(128, "float16", 4, False, 0, kv="int8")          # contiguous
    for version, d, kv in (("v5", 96, "int8"), ("v4", 128, "int8"), ("v5", 128, None)):
        with pytest.raises(ValueError, match="config.version"):
            cr.DecodeConfig(version).defines(d, "float16", 4, True, 16, kv=kv)
    de = cr.DecodeConfig("v5").defines(128, "bfloat16", 4, True, 16, smem_limit=227 * 1024, kv="float8_e4m3fn")
    assert (de["KV_QUANT"], de["NUM_WARPS"], de["STAGES"], de["TILE_ROWS"]) == (
        2, C.DECODE_V4_WARPS, C.DECODE_V4_STAGES, C.DECODE_V5_TILE_ROWS)
    assert cr.DecodeConfig("v5").defines(256, "float16", 4, True, 16, kv="int8")["TILE_ROWS"] == 16
    # a stage: K and V codes (Bc x d bytes each) and a float32 s_K, s_V a row
    total, offset = C.decode_v5_smem(128, "bfloat16", 4, 3, 32, 8, 1, True, 0, "int8")
    assert total == offset == 8 * 3 * (2 * 32 * 128 + 2 * 32 * 4)
    small = cr.DecodeConfig("v5").defines(128, "bfloat16", 4, True, 16, smem_limit=99 * 1024, kv="int8")
    assert C.decode_v5_smem(128, "bfloat16", 4, small["STAGES"], small["TILE_ROWS"], small["NUM_WARPS"],
                            C.DECODE_MAX_SPLITS, True, C.DECODE_V3_TABLE_CAP, "int8")[0] <= 99 * 1024


def test_tuning_sweep_rows_are_registered_versions():
    """The sweeps' rows (iokernels.bench.sweeps_cupy) build their configs without a GPU, and
    each names a registered version of its op."""
    from iokernels.bench import sweeps_cupy
    for dtype in sweeps_cupy.PREFILL_ROWS:
        for label, cfg in sweeps_cupy.prefill_cases(dtype):
            assert cfg.version in cr.REGISTRY.versions("attention"), label
            cfg.resolve(sweeps_cupy.PREFILL_SHAPE["head_dim"], dtype)
    labels = [label for label, _, _ in sweeps_cupy.decode_cases()]
    assert len(labels) == len(set(labels))
    for label, cfg, splits in sweeps_cupy.decode_cases():
        assert cfg.version in cr.REGISTRY.versions("decode"), label
        assert splits is None or 1 <= splits <= C.DECODE_MAX_SPLITS
    assert {cfg.version for _, cfg, _ in sweeps_cupy.decode_cases(only=("v4",))} == {"v4"}
    assert len(sweeps_cupy.SERVING_SHAPES) == 6
    name, out, kw = sweeps_cupy.parse_args(["decode", "o.json", "--shapes", "serving", "--only", "v3,v4"])
    assert (name, out, kw) == ("decode", "o.json", dict(shapes=sweeps_cupy.SERVING_SHAPES, only=("v3", "v4")))
    assert sweeps_cupy.parse_args(["decode", "--shapes", "huge"]) is None
    name, out, kw = sweeps_cupy.parse_args(["decode", "--shapes", "short", "--only", "v4,v6", "--splits", "1,3"])
    assert (out, kw) == (None, dict(shapes=sweeps_cupy.SHORT_CACHE_SHAPES, only=("v4", "v6"), splits=(1, 3)))
    assert [(label, cfg.version, s) for label, cfg, s in sweeps_cupy.decode_cases(("v4", "v6"), (1, 3))] == [
        ("v4", "v4", None), ("v4 S=1", "v4", 1), ("v4 S=3", "v4", 3),
        ("v6", "v6", None), ("v6 S=1", "v6", 1), ("v6 S=3", "v6", 3)]
    name, out, kw = sweeps_cupy.parse_args(["decode", "--shapes", "small_batch", "--only", "v8", "--splits", "8"])
    assert kw["shapes"] == sweeps_cupy.SMALL_BATCH_SHAPES and all(s["batch"] <= 3 for s in kw["shapes"])
    assert sweeps_cupy.parse_args(["decode", "--splits", "0"]) is None
    name, out, kw = sweeps_cupy.parse_args(["decode", "--shapes", "short_lines", "--only", "v4,v8", "--splits", "1"])
    lines = {(s["heads_q"], s["batch"]): sorted(x["seqlen"] for x in kw["shapes"] if x["heads_q"] == s["heads_q"])
             for s in kw["shapes"]}
    assert all(len(set(ns)) >= 3 for ns in lines.values())          # a line's fit needs three points or more
    name, out, kw = sweeps_cupy.parse_args(["decode", "--shapes", "g16", "--only", "v4,v8,v9"])
    assert {s["heads_q"] // s["heads_kv"] for s in kw["shapes"]} == {16} and kw["only"] == ("v4", "v8", "v9")
    assert {s["batch"] for s in kw["shapes"]} == {1, 3, 17, 64, 128}                # the cliff grid's batches
    assert max(2 * s["batch"] * s["heads_kv"] * s["seqlen"] * s["head_dim"] * 2 for s in kw["shapes"]) < 8e9
    name, out, kw = sweeps_cupy.parse_args(["decode", "--only", "v8", "--splits", "8", "--combine", "serial,parallel"])
    assert kw == dict(only=("v8",), splits=(8,), combines=("serial", "parallel"))
    assert [(label, cfg.combine, s) for label, cfg, s in sweeps_cupy.decode_cases(**kw)] == [
        ("v8 serial", "serial", None), ("v8 serial S=8", "serial", 8),
        ("v8 parallel", "parallel", None), ("v8 parallel S=8", "parallel", 8)]
    assert sweeps_cupy.parse_args(["decode", "--splits", "8", "--combine", "fast"]) is None
    assert sweeps_cupy.parse_args(["decode", "--combine", "parallel"]) is None      # rows at split counts only
    assert sweeps_cupy.parse_args(["prefill", "--only", "v4"]) is None


def test_every_module_imports_alone_without_a_gpu():
    """Each module of the backend imports by itself in a fresh interpreter (no import cycles,
    nothing touches a GPU at import)."""
    import pathlib
    import sys
    pkg = pathlib.Path(cr.__file__).parent
    mods = ["iokernels.cupy_raw"] + [f"iokernels.cupy_raw.{p.stem}" for p in sorted(pkg.glob("*.py"))
                                     if p.stem != "__init__"] + ["iokernels.bench.sweeps_cupy"]
    for m in mods:
        r = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True)
        assert r.returncode == 0, f"{m}: {r.stderr[-400:]}"


def test_backward_defaults_and_refusals():
    """The backward default: v2 (tensor cores) for 16-bit inputs at d <= 128 on compute
    capability 8.0+, v1 otherwise; an explicit v2 that cannot run names config.version and why.
    v2's default tiles fit every GPU size it accepts, and shrink (Bc, then Br) to fit."""
    def default(dtype, d, cc, smem=None):
        return cr.REGISTRY.resolve("attention_backward", None, _need(dtype, d, cc, smem))[0].version
    assert default("bfloat16", 128, 90, 227 * 1024) == "v2"
    assert default("float16", 59, 80, 163 * 1024) == "v2"
    assert default("float16", 128, 75, 64 * 1024) == "v1"           # no cp.async / m16n8k16
    assert default("float16", 256, 90) == "v1"                       # dK, dV past the registers
    assert default("float32", 64, 90) == "v1"
    assert default("float64", 64, 90) == "v1"
    for dtype, d, cc, why in (("float32", 64, 90, "float16/bfloat16"), ("bfloat16", 192, 90, "head_dim 128"),
                              ("float16", 64, 75, "8.0")):
        with pytest.raises(ValueError, match="config.version") as e:
            cr.REGISTRY.resolve("attention_backward", cr.BackwardConfig("v2"), _need(dtype, d, cc))
        assert why in str(e.value)
    for smem in SMEM_LIMITS[1:]:
        for d in (8, 59, 64, 96, 128):
            if cr.REGISTRY.get("attention_backward", "v2").unavailable(_need("bfloat16", d, 90, smem)) is None:
                cfg = cr.BackwardConfig("v2").resolve(d, "bfloat16", smem)
                assert cfg.smem_bytes(cfg.block_q, cfg.block_k, d, "bfloat16", "v2") <= smem, (smem, d, cfg)
    big = cr.BackwardConfig("v2").resolve(128, "bfloat16", 227 * 1024)
    assert (big.block_q, big.block_k, big.num_warps) == (64, 128, 8)
    assert cr.BackwardConfig("v2").resolve(128, "bfloat16", 99 * 1024).block_k == 64     # sm_86: 4 warps
    assert cr.BackwardConfig("v2").resolve(64, "float16", 227 * 1024).block_q == 64
    with pytest.raises(ValueError, match="config"):
        cr.BackwardConfig("v2", block_q=128).resolve(128, "bfloat16", 64 * 1024)      # explicit, too big
    with pytest.raises(ValueError, match="config.block_k"):
        cr.BackwardConfig("v2", block_k=32).resolve(64, "float16")
    with pytest.raises(ValueError, match="config.lanes_per_key"):
        cr.BackwardConfig("v2", lanes_per_key=4)


def _script(name):
    import importlib.util
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_timeline_stamps_the_current_decode_v4(tmp_path):
    """scripts/decode_timeline.py's anchors each occur once in decode_v4.cu as the launcher
    inlines it, and the stamped copy compiles (contiguous and paged, sm_80 and sm_90) with a
    stamp at every place it names: block start, first tile, loop end, finish, block end."""
    tl = _script("decode_timeline")
    src = cr.source("decode_v4")
    for anchor, _ in tl.EDITS:
        assert src.count(anchor) == 1, anchor[:80]
    stamped = tl.stamped_source(cr.launch)
    for slot in ("ik_my[0]", "ik_my[1]", "ik_my[2 + warp % 8]", "ik_my[10]", "ik_my[11]", "ik_my[12]"):
        assert stamped.count(slot) == 1, slot
    path = tmp_path / "decode_v4_stamped.cu"
    path.write_text(stamped)
    for paged, arch in ((False, 90), (True, 80)):
        defines = cr.DecodeConfig("v4").defines(tl.HEAD_DIM, "float16", tl.HEADS_Q // tl.HEADS_KV, paged, 16, cc=arch)
        r = subprocess.run([NVCC, "-cubin", f"-arch=sm_{arch}", "-std=c++17",
                            *(f"-D{k}={v}" for k, v in sorted(defines.items())), str(path),
                            "-o", str(tmp_path / f"stamped_{arch}.cubin")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[:600]


_DEVICE_FN = re.compile(r"^(?:template\s*<[^>]*>\s*)?__(?:host__\s+__)?device__\s+(?:__forceinline__\s+)?"
                        r"[\w:<>]+[\s*&]+(\w+)\s*\(", re.M)


def test_every_device_helper_has_one_home():
    """A device function that a header defines is defined in no other header (overloads in one
    file are one helper), and the retired names of the shared-memory address conversion, the
    async-proxy fence, the float32 mask value and the 16-bit packing do not come back: one name
    each (base.cuh's smem_addr, fast_exp2, fence_proxy_async, neg_inf_f; mma.cuh's
    pack2_cvt_each and hopper_common.cuh's pack2_cvt_x2, which are different instructions)."""
    bench_dir = pathlib.Path(decode_loads.__file__).parent / "kernels"
    files = sorted(cr.KERNEL_DIR.glob("*.cu*")) + sorted(bench_dir.glob("*.cu"))
    homes = {}
    for f in files:
        if f.suffix == ".cuh":
            for name in set(_DEVICE_FN.findall(f.read_text())):
                homes.setdefault(name, []).append(f.name)
    forked = {n: fs for n, fs in homes.items() if len(fs) > 1}
    assert not forked, forked
    for name, home in (("smem_addr", "base.cuh"), ("fast_exp2", "base.cuh"), ("fence_proxy_async", "base.cuh"),
                       ("neg_inf_f", "base.cuh"),
                       ("pack2_cvt_each", "mma.cuh"), ("pack2_cvt_x2", "hopper_common.cuh")):
        assert homes.get(name) == [home], (name, homes.get(name))
    text = "\n".join(f.read_text() for f in files)
    for retired in ("smem_u32", "mbar_addr", "fence_proxy_async_smem", "pack2(", "NEG_INF"):
        assert not re.search(rf"\b{re.escape(retired)}", text), retired
    def included(text, seen):
        for h in re.findall(r'#include "(\w+\.cuh)"', text):
            if h not in seen:
                seen.add(h)
                included((cr.KERNEL_DIR / h).read_text(), seen)
        return seen
    for kernel in files:               # and no kernel file defines again a helper of a header it includes
        if kernel.suffix == ".cu":
            text = kernel.read_text()
            theirs = {n for h in included(text, set()) for n in _DEVICE_FN.findall((cr.KERNEL_DIR / h).read_text())}
            again = set(_DEVICE_FN.findall(text)) & theirs
            assert not again, (kernel.name, again)


def test_every_decode_v6_sanitizer_case_is_one_the_launcher_takes():
    """The compute-sanitizer's decode v6 cases (scripts/sanitize.py: each variant at each group
    of DECODE_HEADS) are configs the launcher accepts on an H100-sized SRAM, the variants whose
    warps are not whole teams at a group are left out there, and the default runs every group."""
    from iokernels.cupy_raw import sanitize as S
    (v6,) = [k for k in cr.REGISTRY.kernels("decode") if k.version == "v6"]
    groups = [hq // hkv for hq, hkv in S.DECODE_HEADS["v6"]]
    left_out = []
    for kw in S.VARIANTS[("decode", "v6")]:
        cfg = v6.config_class(version="v6", **kw)
        for g in groups:
            if not S.runs_at_group(v6, cfg, g):
                left_out.append((tuple(kw), g))
                with pytest.raises(ValueError, match="config.num_warps"):
                    cfg.defines(64, "bfloat16", g, False, 16, smem_limit=227 * 1024, cc=90)
                continue
            for dtype in ("float16", "bfloat16"):
                cfg.defines(64, dtype, g, False, 16, smem_limit=227 * 1024, cc=90)
    assert all(kw for kw, _ in left_out), left_out                # the default is never left out
    assert (("fused", "num_warps", "tile_rows"), 128) in left_out  # 4 warps, and g = 128's team is 8


def test_the_combine_module_is_built_once_whatever_the_group():
    """decode.cu's combine reads only the head dim and the dtype: every version but v1 builds
    its module at group 1 over a contiguous cache (decode.cu's split kernel, in the same module,
    spills at large groups), so a decode at 128 query heads a KV head shares the module of one
    at 4; v1 builds the module its own split kernel needs."""
    for version in ("v2", "v3", "v4", "v5", "v6"):
        cfg = cr.DecodeConfig(version)
        one = cfg.combine_defines(128, "bfloat16", 4, False, 0)
        for group, paged, bs in ((128, False, 0), (64, True, 16), (1, True, 7)):
            assert cfg.combine_defines(128, "bfloat16", group, paged, bs) == one, (version, group)
        assert one["GROUP"] == 1 and one["PAGED"] == 0 and one["HEAD_DIM"] == 128
        assert cfg.combine_defines(59, "float16", 8, False, 0, aligned=False)["VEC_IO"] == 0
    v1 = cr.DecodeConfig("v1")
    assert v1.combine_defines(128, "float16", 8, True, 16) == v1.defines(128, "float16", 8, True, 16)
