"""Tuning sweeps on a GPU: alternative tilings of the Numba and CuPy kernels, each next to its
torch baseline in the same run, before a winner becomes a default.

    python scripts/gpu_sweep.py OUTDIR [numba_fwd] [numba_decode] [cupy_decode] [cupy_prefill]
                                       [cupy_paged_layout] [cupy_paged_serving]

The CuPy sweeps are declared as data in iokernels/bench/sweeps_cupy.py.

Writes OUTDIR/sweep_<name>.json(l) and prints one JSON line a row.  Every
time comes from iokernels.bench.time_cuda (the project's one timer: CUDA events, L2 flushed).
Each part is time-boxed by the caller (gpu_all.sh style ``timeout``); none is needed for
correctness: scripts/gpu_all.sh records the defaults.
"""
from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def numba_fwd(outdir):
    """The Numba forward tilings (iokernels.bench.sweeps_numba.FORWARD) vs SDPA EFFICIENT."""
    from iokernels.bench.sweeps_numba import run_sweep
    run_sweep("forward", out_path=str(outdir / "sweep_numba_fwd.jsonl"), reps=5)


def numba_decode(outdir):
    """The Numba decode and gather tilings (sweeps_numba.DECODE_GATHER) vs cuDNN/FLASH and a copy."""
    from iokernels.bench.sweeps_numba import run_sweep
    run_sweep("decode_gather", out_path=str(outdir / "sweep_numba_decode.jsonl"))


def cupy_decode(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.sweep_decode(out_path=str(outdir / "sweep_cupy_decode.json"))


def cupy_prefill(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.sweep_prefill(out_path=str(outdir / "sweep_cupy_prefill.json"))


def cupy_paged_layout(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.paged_layout_probe(out_path=str(outdir / "sweep_cupy_paged_layout.json"))


def cupy_paged_serving(outdir):
    from iokernels.bench import sweeps_cupy
    sweeps_cupy.paged_serving_probe(out_path=str(outdir / "sweep_cupy_paged_serving.json"))


PARTS = {"numba_fwd": numba_fwd, "numba_decode": numba_decode, "cupy_decode": cupy_decode}
#: run only when named on the command line
OPTIONAL_PARTS = {"cupy_prefill": cupy_prefill, "cupy_paged_layout": cupy_paged_layout,
                  "cupy_paged_serving": cupy_paged_serving}


def main(argv):
    outdir = pathlib.Path(argv[0])
    outdir.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or list(PARTS):
        t0 = time.time()
        try:
            {**PARTS, **OPTIONAL_PARTS}[name](outdir)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {e}", flush=True)
        print(f"== {name} done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
