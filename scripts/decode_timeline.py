"""When each block of CuPy decode v4 starts, gets its first tile, ends its key loop and ends.

    python scripts/decode_timeline.py [--shapes BxN ...] [--dtype float16] [--reps R] [--no-flush] [--save DIR]

A timing says how long a launch took; it cannot say where inside the launch the time went.
This script compiles a copy of decode_v4.cu with clock reads added (the package's kernel is
not changed): thread 0 of every block stores the GPU's global timer (%globaltimer, in ns,
the same clock on every SM) when the block starts, when warp 0's first K/V tile has landed,
before the partial's write and the fused combine (decode_common.cuh's decode_finish), and
at the block's end; lane 0 of every warp stores it when the warp's key loop is done.  Each
repetition flushes L2 (as iokernels.bench.time_cuda does; ``--no-flush``: it does not, and
the previous launch's K and V partly sit in L2) and launches once at the default settings
(GQA 32/8, head_dim 128); printed per shape, medians over the repetitions, in us
from the first block's start:

    span          the last block's end
    first tile    a block's wait for its first tile (the ring's ramp up)
    loop end      when the blocks' last warps leave the key loop: min, median, max (equal
                  work a block, so the spread is how unevenly HBM served the SMs)
    tail          loop end -> block end: the warps' merge, the partial, the combine
    end deciles   the blocks' end times (the last repetition)

``--save DIR`` writes every repetition's raw stamps (blocks x 16 int64: start, first tile,
the warps' loop ends in 2..9, finish start, end, SM id in 12) as timeline_B{B}_N{N}.npy.
The clock reads cost a few stores a block; compare the span with a plain timing of the
same call (printed beside it) before trusting small differences.
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
#: stamps a block: [0] start, [1] first tile, [2 .. 2 + warps) loop ends, [10] finish start,
#: [11] end, [12] SM id
SLOTS, MAX_BLOCKS = 16, 16384
CLOCK = ('static __device__ __forceinline__ unsigned long long ik_clock() {\n'
         '    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }\n')
#: where the stamps go in decode_v4.cu, the registered v4 with its one load path (each anchor
#: must occur once in the inlined source; tests/test_cupy_compile.py checks that they do and
#: that the stamped copy compiles): (anchor, its replacement).  The sweeps' load experiments
#: (iokernels/bench/kernels/decode_v4_loads.cu) are not stamped: they are timed by the sweeps.
ENTRY = 'extern "C" __global__ void __launch_bounds__(NTHREADS, DECODE_MIN_BLOCKS)\ndecode_split_v4('
BLOCK_IDS = ("    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;\n"
             "    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;\n")
FIRST_TILE = "        __syncwarp();\n        const u16* Kt = ring + (j % STAGES) * STAGE_ELEMS;\n"
LOOP_END = "    cp_async_wait<0>();\n\n    // merge the warps (through SRAM)"
FINISH = ("    decode_finish(red_m, red_l, red_o, red_o, split, b, hk, heads_q, heads_kv, num_splits,\n"
          "                  O_part, LSE_part, counters, O, LSE);\n}")
EDITS = (
    (ENTRY, f"__device__ unsigned long long ik_stamps[{MAX_BLOCKS * SLOTS}];\n" + CLOCK + ENTRY),
    (BLOCK_IDS, BLOCK_IDS
     + f"    unsigned long long* ik_my = ik_stamps + {SLOTS}ull"
     " * ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);\n"
     "    if (threadIdx.x == 0) {\n"
     "        unsigned smid; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "        ik_my[0] = ik_clock(); ik_my[12] = smid;\n"
     "    }\n"),
    (FIRST_TILE, FIRST_TILE.replace("        const u16* Kt",
                                    "        if (j == 0 && threadIdx.x == 0) ik_my[1] = ik_clock();\n"
                                    "        const u16* Kt")),
    (LOOP_END, LOOP_END.replace("\n\n", "\n    if (lane == 0) ik_my[2 + warp % 8] = ik_clock();\n\n")),
    (FINISH, "    if (threadIdx.x == 0) ik_my[10] = ik_clock();\n" + FINISH[:-1]
     + "    __syncthreads();\n    if (threadIdx.x == 0) ik_my[11] = ik_clock();\n}"),
)


def stamped_source(launch) -> str:
    """decode_v4.cu (includes inlined) with the clock reads added."""
    s = launch.source("decode_v4")
    for anchor, text in EDITS:
        if s.count(anchor) != 1:
            raise RuntimeError(f"decode_timeline: decode_v4.cu changed; anchor not found once: {anchor[:60]!r}")
        s = s.replace(anchor, text)
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x32768", "8x4096", "8x32768", "64x32768"],
                   help="BxN: batch x cache length")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--reps", type=int, default=9, help="launches a shape (medians over them)")
    p.add_argument("--no-flush", action="store_true", help="leave L2 as the previous launch left it")
    p.add_argument("--save", type=pathlib.Path, help="directory for the raw stamps (.npy)")
    a = p.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in a.shapes]
        assert all(len(s) == 2 and min(s) >= 1 for s in shapes)
    except (ValueError, AssertionError):
        p.error(f"--shapes: expected BxN with B, N >= 1, got {a.shapes}")
    if a.reps < 1:
        p.error(f"--reps: need at least 1, got {a.reps}")
    import cupy as cp
    import torch

    from iokernels import bench
    from iokernels import cupy_raw as cr
    from iokernels.cupy_raw import launch
    dec = importlib.import_module("iokernels.cupy_raw.decode_launch")     # where the split kernel is compiled
    source = stamped_source(launch)
    modules = {}

    compile_function = launch.function

    def function(name, kernel, defines, smem=0, *, options=(), sources=None):
        if name != "decode_v4":
            return compile_function(name, kernel, defines, smem, options=options, sources=sources)
        key = tuple(sorted(defines.items()))
        if key not in modules:
            opts = ("-std=c++17",) + tuple(f"-D{k}={v}" for k, v in key)
            mod = cp.RawModule(code=source, options=opts)
            fn = mod.get_function(kernel)
            if smem > launch.OPT_IN_ABOVE_BYTES:
                fn.max_dynamic_shared_size_bytes = int(smem)
            modules[key] = (mod, fn, dict(defines))
        function.last = modules[key]
        return modules[key][1]
    # decode v4's launches compile the stamped copy, whether the launcher calls launch.function
    # or the name it imported from there
    launch.function = function
    if hasattr(dec, "function"):
        dec.function = function
    flush = torch.empty(bench.timer.L2_FLUSH_FACTOR * bench.timer.l2_cache_bytes(), dtype=torch.uint8, device="cuda")
    tdt = getattr(torch, a.dtype)
    print(f"# decode v4 timeline, {a.dtype}, GQA {HEADS_Q}/{HEADS_KV}, d={HEAD_DIM}; us from the first block's start, "
          f"medians of {a.reps} launches "
          f"({'L2 as the previous launch left it' if a.no_flush else 'L2 flushed before each'})")
    for B, N in shapes:
        gen = torch.Generator(device="cuda").manual_seed(B * 7 + N)
        q = torch.randn((B, HEADS_Q, HEAD_DIM), device="cuda", dtype=tdt, generator=gen)
        k, v = (torch.randn((B, HEADS_KV, N, HEAD_DIM), device="cuda", dtype=tdt, generator=gen) for _ in range(2))

        def call():
            return cr.decode(q, k, v)
        call()
        torch.cuda.synchronize()
        mod, _, defines = function.last
        stamps = cp.ndarray((MAX_BLOCKS * SLOTS,), dtype=cp.uint64, memptr=mod.get_global("ik_stamps"))
        stamps.fill(0)
        call()
        torch.cuda.synchronize()
        blocks = int((stamps.reshape(MAX_BLOCKS, SLOTS)[:, 0] != 0).sum().get())
        if blocks >= MAX_BLOCKS:
            print(f"B={B} N={N}: more than {MAX_BLOCKS} blocks; skipped")
            continue
        warps = defines["NUM_WARPS"]
        plain = bench.time_cuda(call, reps=20, flush_l2=not a.no_flush).median_ms * 1e3
        runs, rows = [], []
        for _ in range(a.reps):
            if not a.no_flush:
                flush.zero_()
            call()
            torch.cuda.synchronize()
            t = stamps.get().reshape(MAX_BLOCKS, SLOTS)[:blocks].astype(np.int64)
            runs.append(t)
            t0 = t[:, 0].min()
            loop = t[:, 2:2 + min(warps, 8)].max(1) - t0
            end = t[:, 11] - t0
            rows.append((end.max(), np.median(t[:, 1] - t[:, 0]), loop.min(), np.median(loop), loop.max(),
                         np.median(end - loop), (end - loop).max()))
        m = np.median(np.array(rows, dtype=np.float64), 0) / 1e3
        ends = np.sort(runs[-1][:, 11] - runs[-1][:, 0].min()) / 1e3
        print(f"B={B:3d} N={N:6d}: {blocks} blocks of {warps} warps on {len(set(runs[-1][:, 12].tolist()))} SMs; "
              f"span {m[0]:.1f} (a plain timing of the call: {plain:.1f}); first tile {m[1]:.2f}; "
              f"loop end {m[2]:.1f} / {m[3]:.1f} / {m[4]:.1f}; tail {m[5]:.2f} (max {m[6]:.2f})")
        print("    end deciles " + " ".join(f"{x:.1f}" for x in np.quantile(ends, np.linspace(0, 1, 11))), flush=True)
        if a.save is not None:
            a.save.mkdir(parents=True, exist_ok=True)
            np.save(a.save / f"timeline_B{B}_N{N}.npy", np.stack(runs))
        q = k = v = None                  # drop the tensors (call() closes over them)
        bench.release_device_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
