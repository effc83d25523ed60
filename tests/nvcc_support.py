"""Compiling kernel sources with nvcc, without a GPU: what the compile tests share.

``compile_source`` writes a kernel's source (headers inlined, as the launcher hands it to NVRTC)
and runs ``nvcc -cubin`` on it with ``-Xptxas -v`` by default; ``registers_only`` reads ptxas's
report: no stack frame, no spills, and none of the warnings that mean a Hopper kernel lost what
it was written for (C7515 / C7512: wgmma serialised; C7508: setmaxnreg ignored).
"""
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

NVCC = shutil.which("nvcc")
#: Hopper's architecture-specific target (wgmma, setmaxnreg): sm_90a, not sm_90
SM90A = ("-gencode=arch=compute_90a,code=sm_90a",)
PTXAS_V = ("-Xptxas", "-v")
#: ptxas warnings a Hopper kernel must not get: what each one means
HOPPER_WARNINGS = {"C7515": "wgmma serialised", "C7512": "wgmma serialised for want of registers",
                   "C7508": "setmaxnreg ignored"}
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_source(tmp_path, name: str, source: str, defines: dict, arch=SM90A, extra=PTXAS_V):
    """(return code, stderr) of ``nvcc -cubin`` on ``source`` (kernel ``name``) with ``defines``."""
    src = tmp_path / f"{name}_{abs(hash(tuple(sorted(defines.items()))))}.cu"
    src.write_text(source)
    cmd = [NVCC, "-cubin", *arch, "-std=c++17", *extra, *(f"-D{k}={v}" for k, v in sorted(defines.items())),
           str(src), "-o", str(src.with_suffix(".cubin"))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr


def compile_all(fn, jobs, workers: int = 2) -> list:
    """``fn(job)`` for every job, ``workers`` nvcc processes at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, jobs))


def registers_only(label: str, rc: int, err: str, warnings=HOPPER_WARNINGS) -> None:
    """Assert the compile passed and ptxas reported no stack frame, no spills and none of ``warnings``."""
    assert rc == 0, f"{label}: {err[:600]}"
    frames = _FRAME.findall(err)
    assert frames, f"{label}: no ptxas report\n{err[:400]}"
    assert all(f == ("0", "0", "0") for f in frames), f"{label}: {frames}"
    for code, meaning in warnings.items():
        assert code not in err, f"{label}: {meaning}: {err[:600]}"
