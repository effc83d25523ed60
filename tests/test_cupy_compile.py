"""Every CUDA C++ kernel compiles with nvcc for sm_75, sm_80 and sm_90 (no GPU needed).

The source compiled is exactly what the launcher hands NVRTC (``cupy_raw.source``:
common.cuh inlined) with the defines the launcher derives from its config, for at least
one config per dtype.  bfloat16 needs sm_80: on sm_75 the source must refuse with a
clear #error (the launcher never asks for it there).  Compiles run two at a time.
"""
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from iokernels import cupy_raw as cr

NVCC = shutil.which("nvcc") or "/usr/local/bin/nvcc"
ARCHS = (75, 80, 90)
pytestmark = pytest.mark.skipif(not shutil.which(NVCC), reason="nvcc not found")


def _jobs():
    """(label, kernel file, defines, arch) for every compile we want."""
    jobs = []
    for arch in ARCHS:
        sixteen = ["float16"] + (["bfloat16"] if arch >= 80 else [])
        for dtype, d in [("float32", 128), ("float64", 64)] + [(dt, 128) for dt in sixteen]:
            cfg = cr.CupyConfig(version="v1").resolve(d, dtype)
            jobs.append((f"fa_v1 {dtype} d={d}", "fa_v1", cfg.defines(d, dtype), arch))
        for dtype in sixteen:
            for d, nw, bk in ((128, 4, 64), (72, 2, 32)):
                cfg = cr.CupyConfig(version="v2", num_warps=nw, block_k=bk).resolve(d, dtype)
                jobs.append((f"fa_v2 {dtype} d={d}", "fa_v2", cfg.defines(d, dtype), arch))
        jobs.append(("fa_v2 float16 d=59 (scalar rows)", "fa_v2",
                     cr.CupyConfig(version="v2").resolve(59, "float16").defines(59, "float16"), arch))
        for dtype, d, paged in [("float32", 128, False), ("float64", 128, True)] + \
                [(dt, 128, p) for dt in sixteen for p in (False, True)]:
            jobs.append((f"decode {dtype} paged={paged}", "decode",
                         cr._decode_defines(d, dtype, 4, paged, 16, True), arch))
        jobs.append(("paged_gather 16 B", "paged_gather", dict(BLOCK_SIZE=16, CHUNK_BYTES=16, CHUNKS_PER_ROW=16), arch))
        jobs.append(("paged_gather 2 B", "paged_gather", dict(BLOCK_SIZE=7, CHUNK_BYTES=2, CHUNKS_PER_ROW=59), arch))
    return jobs


def _compile(tmp_path, name, defines, arch):
    src = tmp_path / f"{name}_{arch}_{abs(hash(tuple(sorted(defines.items()))))}.cu"
    src.write_text(cr.source(name))
    cmd = [NVCC, "-cubin", f"-arch=sm_{arch}", "-std=c++17", *(f"-D{k}={v}" for k, v in sorted(defines.items())),
           str(src), "-o", str(src.with_suffix(".cubin"))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr


def test_every_kernel_compiles_for_every_arch(tmp_path):
    jobs = _jobs()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda j: _compile(tmp_path, j[1], j[2], j[3]), jobs))
    failed = [f"sm_{j[3]} {j[0]}: {err.strip()[:400]}" for j, (rc, err) in zip(jobs, results) if rc != 0]
    assert not failed, "\n".join(failed)
    assert len(jobs) >= 30


def test_bfloat16_refuses_sm75_with_a_clear_error(tmp_path):
    defines = cr.CupyConfig(version="v2").resolve(128, "bfloat16").defines(128, "bfloat16")
    rc, err = _compile(tmp_path, "fa_v2", defines, 75)
    assert rc != 0 and "compute capability 8.0" in err


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
