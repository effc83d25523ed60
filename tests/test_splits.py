"""The split-range contract (iokernels.core.splits) and every backend that deals keys by it.

split_range is the one statement of which keys a split owns; the NumPy lesson
(decode.split_ranges), the Numba split kernels (device functions compiled from it) and the
CUDA C++ kernels (kernels/splits.cuh, run here on the host by nvcc) must all agree with it.
"""
import ast
import importlib
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from iokernels.core import splits
from iokernels.cupy_raw import KERNEL_DIR
from iokernels.numba_cuda.decode_v3 import split_range_dev, visible_first_dev
from iokernels.numba_cuda.launch import cuda

dec = importlib.import_module("iokernels.decode")
NVCC = shutil.which("nvcc") or "/usr/local/bin/nvcc"
#: (keys, window_left, splits) the backends are held to: empty and one-key sequences, lengths
#: on and off a tile, windows inside and past the sequence, more splits than keys
GRID = [(n, left, s) for n in (0, 1, 2, 15, 16, 17, 100, 255, 256, 1000, 4097)
        for left in (-1, 0, 5, 99, 5000) for s in (1, 2, 3, 7, 16, 37)]


def _check_partition(n, start, S, g, ranges):
    """Contiguous, in order, covering [start, n) exactly; every cut on a granule; no split
    more than ceil(granules / S) granules; only trailing splits empty."""
    assert len(ranges) == S
    assert ranges[0][0] == min(start, n) and ranges[-1][1] == max(min(start, n), n)
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert a <= b == c, ranges
    granules = max(-(-n // g) - start // g, 0)
    per = -(-granules // S) if granules else 0
    for i, (a, b) in enumerate(ranges):
        assert b - a <= per * g, (n, start, S, g, ranges)
        if a < b:
            assert a == start or a % g == 0
            assert b == n or b % g == 0
        else:
            assert all(x == y for x, y in ranges[i:]), f"a non-trailing empty split: {ranges}"


@pytest.mark.parametrize("g", [1, 16, 128])
def test_split_range_partitions_the_visible_keys(g):
    for n, left, S in GRID:
        start = splits.visible_first(n, left)
        assert start == (0 if left < 0 else max(n - 1 - left, 0))
        _check_partition(n, start, S, g, splits.split_ranges(n, S, g, start))


def test_split_ranges_refuses_bad_counts():
    with pytest.raises(ValueError, match="num_splits"):
        splits.split_ranges(10, 0)
    with pytest.raises(ValueError, match="granule"):
        splits.split_ranges(10, 2, granule=0)


def test_the_numpy_lesson_deals_tiles_by_the_contract():
    """decode.split_ranges and visible_start are the contract at granule = Bc."""
    for n, left, S in GRID:
        for bn in (16, 128):
            start = dec.visible_start(n, (left, 0) if left >= 0 else None)
            assert start == splits.visible_first(n, left)
            assert dec.split_ranges(n, S, bn, start) == splits.split_ranges(n, S, bn, start)


def _ranges(out, n, left, S, g):
    """One split a block: each writes its range, through the contract's device functions."""
    sp = cuda.blockIdx.x
    if cuda.threadIdx.x == 0:
        a = visible_first_dev(n, left)
        out[sp, 0], out[sp, 1] = split_range_dev(n, S, sp, g, a)


def test_the_numba_kernels_deal_tiles_by_the_contract():
    """Every Numba split kernel takes its range from the contract's device functions (no
    copy of the arithmetic), and those compile and run as device code on the simulator."""
    nd, nd3 = (importlib.import_module(f"iokernels.numba_cuda.{m}") for m in ("decode", "decode_v3"))
    for mod in (nd, nd3):
        src = pathlib.Path(mod.__file__).read_text()
        calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) == "split_range_dev"]
        assert calls and "per = ((n +" not in src, mod.__name__
    assert len([1 for m in (nd, nd3) for line in pathlib.Path(m.__file__).read_text().splitlines()
                if "split_range_dev(n, nsplit, sp," in line]) == 3          # v1, v2, v3 split kernels
    kernel = cuda.jit(_ranges)
    for n, left, S in GRID[::7]:
        out = np.zeros((S, 2), np.int64)
        kernel[S, 1](out, n, left, S, 16)
        want = splits.split_ranges(n, S, 16, splits.visible_first(n, left))
        assert [tuple(r) for r in out.tolist()] == want, (n, left, S)


@pytest.mark.skipif(not shutil.which(NVCC), reason="nvcc not found")
def test_the_cuda_kernels_deal_keys_by_the_contract(tmp_path):
    """kernels/splits.cuh, compiled by nvcc for the host and run, gives the contract's ranges
    at granule 1; every decode kernel takes its range from it (no copy of the arithmetic)."""
    prog = tmp_path / "splits_host.cu"
    cases = " ".join(f"{n} {left} {S}" for n, left, S in GRID)
    prog.write_text('#include <cstdio>\n#include "splits.cuh"\n'
                    f'static const int CASES[] = {{{", ".join(cases.split())}}};\n'
                    'int main() {\n'
                    '  for (int i = 0; i < (int)(sizeof(CASES) / sizeof(int)); i += 3) {\n'
                    '    const int n = CASES[i], left = CASES[i + 1], S = CASES[i + 2];\n'
                    '    for (int s = 0; s < S; ++s) {\n'
                    '      int3 r = decode_split_keys(n, left, S, s); printf("%d %d %d\\n", r.x, r.y, r.z);\n'
                    '    }\n'
                    '  }\n  return 0;\n}\n')
    exe = tmp_path / "splits_host"
    r = subprocess.run([NVCC, "-std=c++17", f"-I{KERNEL_DIR}", str(prog), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-600:]
    got = [tuple(map(int, line.split())) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                    check=True).stdout.splitlines()]
    want = [(splits.visible_first(n, left), *rng) for n, left, S in GRID
            for rng in splits.split_ranges(n, S, 1, splits.visible_first(n, left))]
    assert got == want
    bench = pathlib.Path(importlib.import_module("iokernels.bench.decode_loads").__file__).parent / "kernels"
    for f in sorted(KERNEL_DIR.glob("decode*.cu")) + sorted(bench.glob("decode*.cu")):
        if f.stem == "decode_combine":              # merges the splits' partials: deals no keys
            continue
        src = f.read_text()
        assert '#include "splits.cuh"' in src, f.name
        # v9 deals runs of the pairs' keys laid end to end; its visible start is the contract's
        call = "decode_split_keys(len, window_left, 1, 0)" if f.stem == "decode_v9" else \
            "decode_split_keys(len, window_left, num_splits, split)"
        assert call in src, f.name
        assert "per_split = (len" not in src, f.name


def test_wave_tail_prices_the_last_wave():
    """core.splits.wave_tail: 136 pairs on 132 SMs at one split leave 4 SMs a second block (twice
    the SM's share of 132 / 136 of a pair: 264 / 136); pairs that fill whole waves have no tail;
    the balanced deal is within one key of even; bad sizes raise naming the argument."""
    from iokernels.core.splits import wave_tail
    assert wave_tail(136, 4096, 132) == pytest.approx(2 * 132 / 136)
    assert wave_tail(136, 4096, 132, splits=2) == pytest.approx(3 * 2048 * 132 / (136 * 4096))
    assert wave_tail(264, 1000, 132) == pytest.approx(1.0) and wave_tail(132, 77, 132, splits=1) == 1.0
    for pairs, keys in ((136, 4096), (8, 1000), (17, 3)):
        tail = wave_tail(pairs, keys, 132, balanced=True)
        assert 1.0 <= tail <= 1.0 + 132 / (pairs * keys)
    for bad in (dict(pairs=0), dict(keys=0), dict(num_sms=0), dict(splits=0)):
        args = dict(pairs=8, keys=100, num_sms=132, splits=1) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            wave_tail(args["pairs"], args["keys"], args["num_sms"], splits=args["splits"])
