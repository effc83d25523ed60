"""Every CUDA C++ kernel compiles with nvcc for sm_75, sm_80 and sm_90 (no GPU needed).

The source compiled is exactly what the launcher hands NVRTC (``cupy_raw.source``:
common.cuh inlined) with the defines the launcher derives from its config, for at least
one config per dtype.  bfloat16 needs sm_80: on sm_75 the source must refuse with a
clear #error (the launcher never asks for it there).  Compiles run two at a time.

The candidate versions not yet measured on a GPU (fa_v1b, decode_v2, decode_v3) are compiled for
every arch too, and their main shapes (sm_90, fp32 d=128 forward, bf16 d=128 decode) are held to
no local memory (no spills, no stack frame): the point of them is to stay within registers.
The decode split heuristic is pure Python and is tested here too (no GPU needed).
"""
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from iokernels import cupy_raw as cr

NVCC = shutil.which("nvcc") or "/usr/local/bin/nvcc"
ARCHS = (75, 80, 90)
pytestmark = pytest.mark.skipif(not shutil.which(NVCC), reason="nvcc not found")


def _jobs():
    """(label, kernel file, defines, arch): every file for every arch, each dtype at least once.

    About 45 compiles (two at a time): about 20 s on two cores.
    """
    jobs = []

    def fa(version, dtype, d, arch, **kw):
        cfg = cr.CupyConfig(version=version, **kw).resolve(d, dtype)
        jobs.append((f"fa_{version} {dtype} d={d} {kw}", f"fa_{version}", cfg.defines(d, dtype), arch))

    def dec(dtype, d, paged, arch):
        jobs.append((f"decode {dtype} d={d} paged={paged}", "decode",
                     cr._decode_defines(d, dtype, 4, paged, 16, True), arch))

    def dec2(dtype, d, paged, arch, group=4, block_size=16, **kw):
        defines, _ = cr._decode_v2_defines(d, dtype, group, paged, block_size, cr.DecodeConfig("v2", **kw))
        jobs.append((f"decode_v2 {dtype} d={d} paged={paged} g={group} {kw}", "decode_v2", defines, arch))

    def dec3(dtype, d, paged, arch, group=4, block_size=16, **kw):
        defines = cr._decode_v3_defines(d, dtype, group, paged, block_size, cr.DecodeConfig("v3", **kw))
        jobs.append((f"decode_v3 {dtype} d={d} paged={paged} g={group} {kw}", "decode_v3", defines, arch))

    for arch in ARCHS:
        fa("v1", "float32", 128, arch)
        fa("v2", "float16", 128, arch)
        dec("float32", 128, False, arch)
        dec("float16", 128, True, arch)
        jobs.append(("paged_gather 16 B", "paged_gather", dict(BLOCK_SIZE=16, CHUNK_BYTES=16, CHUNKS_PER_ROW=16), arch))
        fa("v1b", "float32", 128, arch)
        dec2("float16", 128, arch != 80, arch)
        dec3("float16", 128, arch != 80, arch)
        if arch >= 80:                                  # bfloat16 exists from sm_80
            fa("v2", "bfloat16", 128, arch)
            dec("bfloat16", 128, arch == 90, arch)
            dec2("bfloat16", 128, arch == 80, arch)
            dec3("bfloat16", 128, arch == 80, arch, fused=arch == 90)
            dec3("bfloat16", 128, arch == 90, arch, num_warps=8)
    fa("v1", "float16", 64, 75)
    fa("v1", "float64", 64, 80)
    fa("v1", "bfloat16", 72, 90)
    fa("v2", "float16", 72, 75, num_warps=2, block_k=32)
    fa("v2", "bfloat16", 64, 80, num_warps=4, block_k=128)
    fa("v2", "float16", 59, 90)                        # rows not whole 16-byte chunks: scalar loads
    dec("float64", 128, True, 90)                      # scalar rows (1 KB does not fit 32 lanes x 16 B)
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
    return jobs


def _compile(tmp_path, name, defines, arch, extra=()):
    src = tmp_path / f"{name}_{arch}_{abs(hash(tuple(sorted(defines.items()))))}.cu"
    src.write_text(cr.source(name))
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
    defines = cr.CupyConfig(version="v2").resolve(128, "bfloat16").defines(128, "bfloat16")
    rc, err = _compile(tmp_path, "fa_v2", defines, 75)
    assert rc != 0 and "compute capability 8.0" in err


def test_candidates_refuse_what_they_cannot_run(tmp_path):
    """fa_v1b is float32 only; decode_v2 needs whole 16-byte chunks: each says so with #error."""
    d16 = dict(cr.CupyConfig(version="v1b").resolve(128, "float32").defines(128, "float32"), IK_DTYPE=1)
    rc, err = _compile(tmp_path, "fa_v1b", d16, 90)
    assert rc != 0 and "float32 kernel" in err
    d59, _ = cr._decode_v2_defines(64, "float16", 4, False, 16, cr.DecodeConfig("v2"))
    rc, err = _compile(tmp_path, "decode_v2", dict(d59, HEAD_DIM=59), 90)
    assert rc != 0 and "16-byte chunks" in err
    d3 = cr._decode_v3_defines(64, "float16", 4, False, 16, cr.DecodeConfig("v3"))
    rc, err = _compile(tmp_path, "decode_v3", dict(d3, HEAD_DIM=59), 90)
    assert rc != 0 and "16-byte chunks" in err


def test_candidates_stay_in_registers(tmp_path):
    """ptxas -v: the candidates' main shapes on sm_90 use no local memory (no spills, no stack)."""
    v1b = cr.CupyConfig(version="v1b").resolve(128, "float32").defines(128, "float32")
    dec, _ = cr._decode_v2_defines(128, "bfloat16", 4, False, 16, cr.DecodeConfig("v2"))
    decp, _ = cr._decode_v2_defines(128, "bfloat16", 4, True, 16, cr.DecodeConfig("v2"))
    jobs = [("fa_v1b", v1b, 90), ("decode_v2", dec, 90), ("decode_v2", decp, 90)]
    for paged, nw, fused in ((False, 4, True), (True, 4, True), (False, 8, True), (True, 8, True),
                             (False, 4, False)):
        jobs.append(("decode_v3", cr._decode_v3_defines(128, "bfloat16", 4, paged, 16,
                                                        cr.DecodeConfig("v3", num_warps=nw, fused=fused)), 90))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, *j, extra=("-Xptxas", "-v")), jobs))
    for (name, defines, arch), (rc, err) in zip(jobs, results):
        assert rc == 0, err[:400]
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", err)
        regs = re.search(r"Used (\d+) registers", err)
        assert frame and regs, err[:400]
        assert frame.groups() == ("0", "0", "0"), f"{name} {defines}: {frame.group(0)}"
        assert int(regs.group(1)) <= 128, f"{name}: {regs.group(0)} (the launch bounds cap 128)"


def test_every_source_file_is_covered():
    """A new .cu file must be added to SOURCES (and so to the compile list above)."""
    on_disk = {p.stem for p in cr.KERNEL_DIR.glob("*.cu")}
    assert on_disk == set(cr.SOURCES) == {j[1] for j in _jobs()}


def test_config_checks_need_no_gpu():
    """Config errors are ValueErrors naming config, raised before any GPU is touched."""
    import numpy as np
    q = np.ones((1, 1, 8, 64), np.float32)
    with pytest.raises(ValueError, match="config"):
        cr.attention(q, q, q, config=cr.CupyConfig(version="v2"))
    with pytest.raises(ValueError, match="config"):
        cr.attention(q, q, q, config="v1")
    cfg = cr.CupyConfig(version="v1").resolve(128, "float32")
    assert cfg.smem_bytes(128, "float32") == 4 * (128 * 64 * 3 + 64 * 64)
    with pytest.raises(ValueError, match="config"):
        cfg.check_fits(128, "float32", 64 * 1024)       # a T4's 64 KB: the default does not fit
    v2 = cr.CupyConfig(version="v2").resolve(128, "bfloat16")
    assert (v2.block_q, v2.block_k, v2.num_warps) == (128, 64, 8)


def test_auto_picks_the_fastest_measured_forward_for_the_dtype_and_gpu():
    """version="auto": the tensor-core v2 for 16-bit inputs, v1b (cp.async tiles) for float32
    where cp.async exists (compute capability 8.0+), v1 for float64 and float32 on sm_75."""
    auto = cr.CupyConfig()
    assert auto.resolve(128, "bfloat16", 90).version == "v2"
    assert auto.resolve(64, "float16", 75).version == "v2"
    assert auto.resolve(128, "float32", 90).version == "v1b"
    assert auto.resolve(59, "float32", 80).version == "v1b"
    assert auto.resolve(128, "float32", 75).version == "v1"
    assert auto.resolve(128, "float64", 90).version == "v1"
    assert auto.resolve(300, "float16", 90).version == "v1"          # past v2's head-dim limit


# --------------------------------------------------------------------------- decode split heuristic
def test_num_splits_heuristic_properties():
    """num_splits_heuristic is pure Python: its promises, over a grid of shapes (no GPU).

    One wave: batch * heads_kv * splits <= num_sms * blocks_per_sm unless splits == 1; at
    least DECODE_MIN_KEYS_PER_SPLIT keys a split (unless splits == 1); at most
    DECODE_MAX_SPLITS; never fewer splits for a longer sequence; 1 for an empty one.
    """
    lo, cap = cr.DECODE_MIN_KEYS_PER_SPLIT, cr.DECODE_MAX_SPLITS
    for sms in (40, 108, 132):
        for bps in (1, 2, 3, 4, 8):
            slots = cr.DECODE_WAVES * sms * bps
            for batch in (1, 2, 8, 64, 1000):
                for hkv in (1, 2, 8, 32):
                    prev = 0
                    for n in (0, 1, 100, 255, 256, 257, 1000, 4096, 32768, 131072, 10 ** 6):
                        s = cr.num_splits_heuristic(batch, hkv, n, sms, bps)
                        assert isinstance(s, int) and 1 <= s <= cap, (batch, hkv, n, sms, bps, s)
                        if n == 0:
                            assert s == 1
                        if s > 1:
                            assert batch * hkv * s <= slots, (batch, hkv, n, sms, bps, s)
                            assert n // s >= lo, (batch, hkv, n, sms, bps, s)
                        assert s >= prev, f"not monotone in seq_len at {(batch, hkv, n, sms, bps)}: {prev} -> {s}"
                        prev = s
                    # a long sequence with room on the GPU uses the room (more than one split)
                    if batch * hkv * 2 <= slots:
                        assert cr.num_splits_heuristic(batch, hkv, 10 ** 6, sms, bps) > 1
    # a grid that already fills the GPU gets no splits; one that does not is filled, up to the caps
    assert cr.num_splits_heuristic(64, 8, 32768, 132, 4) == 1          # 512 blocks of 528 slots
    for hkv in (1, 8):
        want = min(cr.DECODE_WAVES * 132 * 4 // hkv, 32768 // lo, cap)
        assert cr.num_splits_heuristic(1, hkv, 32768, 132, 4) == want


def test_default_decode_is_v3_and_falls_back_to_v1_where_it_cannot_run():
    """DecodeConfig() runs decode_v3.cu (8 warps x 4 stages) on rows of whole 16-byte chunks,
    16-byte aligned; other rows (d = 59 in float16, unaligned views) run decode.cu."""
    cfg = cr.DecodeConfig()
    assert (cfg.version, cfg.num_warps, cfg.stages) == ("v3", None, None)
    assert cr.decode_version_used(128, "bfloat16", True) == "v3"
    assert cr.decode_version_used(128, "bfloat16", False) == "v1"
    assert cr.decode_version_used(59, "float16", True) == "v1"
    defines = cr._decode_v3_defines(128, "bfloat16", 4, False, 0, cfg)
    assert (defines["NUM_WARPS"], defines["STAGES"]) == (cr.DECODE_V3_WARPS, cr.DECODE_V3_STAGES)
    with pytest.raises(ValueError, match="num_warps"):
        cr.DecodeConfig(version="v2", num_warps=8)
