"""What every recorded number is labelled with: GPU, driver, CUDA, library versions, date."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess

from .timer import _torch_cuda


def environment() -> dict:
    """GPU, driver, CUDA and library versions, and the date: the label of every recorded number."""
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version()}
    for mod in ("numpy", "torch", "numba", "numba_cuda", "cupy"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # not installed here
            env[mod] = f"missing ({type(e).__name__})"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            name, driver, mem, clk = [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]
            env.update(gpu=name, driver=driver, gpu_memory=mem, max_sm_clock=clk)
    except Exception:
        pass
    torch = _torch_cuda()
    if torch is not None:
        p = torch.cuda.get_device_properties(0)
        env.setdefault("gpu", p.name)
        env.update(cuda_torch=torch.version.cuda, sms=p.multi_processor_count,
                   l2_bytes=int(getattr(p, "L2_cache_size", 0) or 0),
                   compute_capability=f"{p.major}.{p.minor}")
    env["simulator"] = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
    return env


def label(env: dict) -> str:
    """'recorded on NVIDIA H200, <date>, driver ..., torch ..., numba ..., cupy ...'."""
    return (f"recorded on {env.get('gpu', 'no GPU')}, {env.get('date_utc', '?')}, "
            f"driver {env.get('driver', '?')}, CUDA {env.get('cuda_torch', '?')}, "
            f"torch {env.get('torch', '?')}, numba {env.get('numba', '?')} "
            f"(numba-cuda {env.get('numba_cuda', '?')}), cupy {env.get('cupy', '?')}")
