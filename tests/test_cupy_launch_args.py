"""Every CuPy launch passes exactly what its kernel declares, checked without a GPU.

The launchers run in a subprocess against a stand-in for CuPy (tests/stand_ins/cupy: NumPy
memory, a device with an H200's attributes, kernels that record their launches instead of
running).  Each distinct compiled kernel's signature is read from the source the launcher
hands NVRTC, preprocessed by ``nvcc -E`` with the launch's own ``-D`` options, and every
argument of every launch is held against it: the count, and pointer / int / long long /
float / double as the parameter says (a CuPy array is a pointer argument).  A wrong argument in
a code path only a GPU reaches fails here.  The defaults of the shapes the kernels were tuned at are pinned too (v2 at 8
warps x Bc 64 for bfloat16 d=128, v1b at 64 x 64 for float32, decode v3 at 8 warps x 4
stages, backward v2 at 8 warps (Bc 128) x Br 32 for bfloat16 d=128), so a reshuffle of the
configs cannot move them silently.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

NVCC = shutil.which("nvcc") or "/usr/local/bin/nvcc"
pytestmark = pytest.mark.skipif(not shutil.which(NVCC), reason="nvcc not found")
STAND_INS = pathlib.Path(__file__).resolve().parent / "stand_ins"
REPO = pathlib.Path(__file__).resolve().parents[1]

#: the calls, run in the subprocess; each label maps to the launches it made
DRIVER = r'''
import json, sys
import numpy as np
import cupy
from iokernels import cupy_raw as cr
from iokernels.core.testing import make_inputs
# the stand-in device calls itself an H200, but it cannot encode TMA descriptors: the Hopper
# versions (tests/test_hopper.py) are out of this test's scope
cr.hopper.available = cr.hopper.checks.available = lambda: "the stand-in CuPy has no TMA"
from iokernels.cupy_raw import sanitize as S

rng = np.random.default_rng(0)
out = {}


def _kind(a):
    """An argument's type name; a TMA tensor map (128 opaque bytes, passed by value) is "tmap"."""
    return "tmap" if isinstance(a, np.ndarray) and a.dtype.kind == "V" else type(a).__name__


def rec(label, fn, ints=False):
    """The launches ``fn`` made, under ``label``; ``ints``: with their integer arguments' values too."""
    fn()
    out[label] = [dict(name=L["name"], options=list(L["options"]), grid=list(L["grid"]), block=list(L["block"]),
                       smem=int(L["smem"]), args=[_kind(a) for a in L["args"]],
                       **(dict(ints=[int(a) for a in L["args"] if isinstance(a, np.integer)]) if ints else {}))
                  for L in cupy.LAUNCHES]
    cupy.LAUNCHES.clear()


for dt in ("float32", "float16", "bfloat16", "float64"):
    for d in (128, 59):
        q, k, v = make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=77, head_dim=d, dtype=dt)
        rec(f"attention None {dt} {d}", lambda: cr.attention(q, k, v, causal=True, window=(5, 3)))
        for kern in cr.REGISTRY.kernels("attention"):
            if kern.unavailable(cr.need("attention", q=q, k=k, v=v)) is None:
                rec(f"attention {kern.version} {dt} {d}",
                    lambda: cr.attention(q, k, v, config=kern.config_class(version=kern.version)))
        lse = np.zeros(q.shape[:3], np.float64 if dt == "float64" else np.float32)
        for kern in cr.REGISTRY.kernels("attention_backward"):
            if kern.unavailable(cr.need("attention_backward", q=q, k=k, v=v)) is not None:
                continue
            for det in (False, True):
                rec(f"attention_backward {kern.version} {dt} {d} deterministic={det}",
                    lambda: kern.launcher(q, q, k, v, q, lse, causal=True, scale=None, window=None,
                                          config=cr.BackwardConfig(kern.version, deterministic=det)))
    for d in (128, 59):
        q, k, v = make_inputs(rng, batch=3, heads_q=8, heads_kv=2, seqlen_q=1, seqlen_k=301, head_dim=d, dtype=dt)
        q = q[:, :, 0]
        for kern in [None] + cr.REGISTRY.kernels("decode"):
            if kern is not None and kern.unavailable(cr.need("decode", q=q, k=k, v=v)) is not None:
                continue
            fusable = kern is not None and kern.version in ("v3", "v4", "v5", "v6")
            extras = ({}, {"fused": False}, {"fused": False, "combine": "serial"}) if fusable else ({},)
            if kern is not None and kern.version == "v1":
                extras = ({}, {"combine": "serial"})
            for extra in extras:
                cfg = None if kern is None else cr.DecodeConfig(kern.version, **extra)
                for splits in (1, 5):
                    rec(f"decode {cfg and cfg.version} {extra} {dt} {d} {splits}",
                        lambda: cr.decode(q, k, v, seq_lens=np.array([301, 0, 7]), num_splits=splits, config=cfg))
                rec(f"decode window {cfg and cfg.version} {extra} {dt} {d}",
                    lambda: cr.decode(q, k, v, seq_lens=np.array([301, 0, 7]), config=cfg, window=(100, 0)))
        if dt in ("float16", "bfloat16") and d == 128:      # MQA, 32 query heads: v6 by default and by name
            qm, km, vm = make_inputs(rng, batch=2, heads_q=32, heads_kv=1, seqlen_q=1, seqlen_k=301, head_dim=d,
                                     dtype=dt)
            rec(f"decode mqa {dt} {d}", lambda: cr.decode(qm[:, :, 0], km, vm, num_splits=5))
            rec(f"decode mqa v6 {dt} {d}",
                lambda: cr.decode(qm[:, :, 0], km, vm, num_splits=5, config=cr.DecodeConfig("v6")))
        if dt == "float32" and d == 128:                    # MQA, 32 float32 heads: v7 splits them over 2 blocks
            qm, km, vm = make_inputs(rng, batch=2, heads_q=32, heads_kv=1, seqlen_q=1, seqlen_k=301, head_dim=d,
                                     dtype=dt)
            rec(f"decode mqa {dt} {d}", lambda: cr.decode(qm[:, :, 0], km, vm, num_splits=5))
            rec(f"decode mqa v7 {dt} {d}", lambda: cr.decode(qm[:, :, 0], km, vm, num_splits=5,
                                                           config=cr.DecodeConfig("v7")), ints=True)
            rec(f"decode mqa v7 unfused {dt} {d}", lambda: cr.decode(qm[:, :, 0], km, vm, num_splits=5,
                                                                   config=cr.DecodeConfig("v7", fused=False)))
        if dt in ("float16", "bfloat16") and d == 128:      # the sweeps' v4 load experiments
            from iokernels.bench import decode_loads as DL
            for load in DL.LOADS:
                rec(f"loads {load} {dt} {d}", lambda: DL.decode(q, k, v, load, seq_lens=np.array([301, 0, 7]),
                                                                num_splits=5))
        if dt in S.PAGED_DTYPES:
            cache, sids = S._paged_cache(rng, d, dt)
            q2 = q[:2]
            for kern in [None] + cr.REGISTRY.kernels("paged_decode"):
                if kern is not None and kern.unavailable(cr.need("paged_decode", q=q2, cache=cache)) is not None:
                    continue
                cfg = None if kern is None else cr.DecodeConfig(kern.version)
                rec(f"paged_decode {cfg and cfg.version} {dt} {d}",
                    lambda: cr.paged_decode(q2, cache, sids, num_splits=3, config=cfg))
                t, ln = cache.block_tables_array(sids)
                rec(f"pools {cfg and cfg.version} {dt} {d}",
                    lambda: cr.paged_decode_pools(cupy.asarray(q2), cupy.asarray(cache.k_pool),
                                                  cupy.asarray(cache.v_pool), t, ln, config=cfg))
            rec(f"gather {dt} {d}", lambda: cache.gather(sids[0], backend="cupy"))
        for kv, gran in S.QUANT_CASES:
            if dt not in S.PAGED_DTYPES:
                continue
            qc, qsids = S._paged_cache(rng, d, dt, kv_dtype=kv, scale_granularity=gran)
            q2 = q[:2]
            for kern in [None] + cr.REGISTRY.kernels("paged_decode"):
                if kern is not None and kern.unavailable(cr.need("paged_decode", q=q2, cache=qc)) is not None:
                    continue
                cfg = None if kern is None else cr.DecodeConfig(kern.version)
                for splits in (1, 3):
                    rec(f"quant paged_decode {cfg and cfg.version} {kv} {gran} {dt} {d} {splits}",
                        lambda: cr.paged_decode(q2, qc, qsids, num_splits=splits, config=cfg, window=(40, 0)))

# paged prefill: chunks of 37 (partial), 1 (a decode row) and 45 (a whole prompt), GQA 8/2, over
# caches of 301 and 45 tokens (blocks of 16, the last partial)
for dt in ("float16", "bfloat16", "float32"):
    for d in (128, 64, 59):
        cache, sids = S._paged_cache(rng, d, dt)
        qp = rng.standard_normal((37 + 1 + 45, 8, d)).astype(cache.dtype)
        cq = np.array([0, 37, 38, 83], np.int32)
        for kern in [None] + cr.REGISTRY.kernels("paged_prefill"):
            if kern is not None and kern.unavailable(cr.need("paged_prefill", q=qp, cache=cache)) is not None:
                continue
            if kern is not None and kern.config_class is not cr.PagedPrefillConfig:
                continue                            # the Hopper v3: below, with the TMA stand-in
            cfg = None if kern is None else cr.PagedPrefillConfig(kern.version)
            try:
                rec(f"paged_prefill {cfg and cfg.version} {dt} {d}",
                    lambda: cr.paged_prefill(qp, cache, [sids[0], sids[1], sids[1]], cq, config=cfg))
            except ValueError:                      # no version runs it (the default's call): nothing launched
                assert kern is None
                continue
            t, ln = cache.block_tables_array(sids)
            rec(f"prefill pools {cfg and cfg.version} {dt} {d}",
                lambda: cr.paged_prefill_pools(cupy.asarray(qp[:38]), cupy.asarray(cache.k_pool),
                                               cupy.asarray(cache.v_pool), cupy.asarray(t.astype(np.int32)),
                                               cupy.asarray(ln.astype(np.int32)), cupy.asarray(cq[:3]),
                                               causal=False, config=cfg))
            rec(f"prefill pools bound {cfg and cfg.version} {dt} {d}",
                lambda: cr.paged_prefill_pools(cupy.asarray(qp), cupy.asarray(cache.k_pool),
                                               cupy.asarray(cache.v_pool), cupy.asarray(t[[0, 1, 1]].astype(np.int32)),
                                               cupy.asarray(ln[[0, 1, 1]].astype(np.int32)), cupy.asarray(cq),
                                               config=cfg, max_seqlen_q=45))

# MLA decode: the stand-in cannot encode TMA descriptors, so tensor_map records what it was
# asked for and hands back 128 zero bytes; the Hopper check is let through for these calls
from iokernels.cupy_raw import mla as M
from iokernels.core.testing import numpy_dtype
MAPS = []
def fake_map(ptr, dtype, dims, strides, box):
    MAPS.append(dict(dims=[int(x) for x in dims], strides=[int(x) for x in strides], box=[int(x) for x in box]))
    return np.zeros(1, dtype=np.dtype((np.void, 128)))
cr.hopper.available, cr.hopper.tensor_map = (lambda: None), fake_map
for dt in ("bfloat16", "float16"):
    q = rng.standard_normal((3, 80, M.ROW)).astype(numpy_dtype(dt))
    kv = rng.standard_normal((3, 301, M.ROW)).astype(numpy_dtype(dt))
    for splits in (None, 1, 3):
        rec(f"mla {dt} {splits}", lambda: cr.mla_decode(q, kv, seq_lens=np.array([301, 0, 77]), num_splits=splits))
        out[f"maps mla {dt} {splits}"] = MAPS[:]
        MAPS.clear()
    pool = rng.standard_normal((20, 128, M.ROW)).astype(numpy_dtype(dt))
    tables = rng.permutation(20)[:9].reshape(3, 3).astype(np.int32)
    rec(f"mla paged {dt}", lambda: cr.paged_mla_decode(q, pool, tables, np.array([301, 0, 77]), num_splits=2))
    out[f"maps mla paged {dt}"] = MAPS[:]
    MAPS.clear()

# backward v3 (Hopper): its check let through, the maps recorded as MLA's are
cr.hopper.checks.available = lambda: None
for dt in ("bfloat16", "float16"):
    for d in (64, 128):
        q, k, v = make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=77, head_dim=d, dtype=dt)
        lse = np.zeros(q.shape[:3], np.float32)
        for det in (False, True):
            MAPS.clear()
            rec(f"attention_backward v3 {dt} {d} deterministic={det}",
                lambda: cr.attention_backward(q, q, k, v, q, lse, causal=True,
                                              config=cr.BackwardConfig("v3", deterministic=det)))
            out[f"maps bwd v3 {dt} {d} {det}"] = MAPS[:]
            MAPS.clear()
            for ver in ("v4", "v5", "v6"):
                MAPS.clear()
                rec(f"attention_backward {ver} {dt} {d} deterministic={det}",
                    lambda: cr.attention_backward(q, q, k, v, q, lse, causal=True,
                                                  config=cr.BackwardConfig(ver, deterministic=det)), ints=True)
                out[f"maps bwd {ver} {dt} {d} {det}"] = MAPS[:]
            for ver in ("v5", "v6"):
                for window in (None, (8, -1)):           # no upper edge to the band: v4's order
                    rec(f"attention_backward {ver} {dt} {d} deterministic={det} window={window}",
                        lambda: cr.attention_backward(q, q, k, v, q, lse, window=window,
                                                      config=cr.BackwardConfig(ver, deterministic=det)), ints=True)

# paged prefill v3 (Hopper): packed GQA 8/2 and MHA, blocks of 16, the tensor maps recorded
from iokernels.cupy_raw.hopper import paged_prefill as PP3
for dt in ("bfloat16", "float16"):
    for d in (128, 64):
        cache, sids = S._paged_cache(rng, d, dt)
        cq = np.array([0, 37, 38, 83], np.int32)
        for hq in (8, 2):
            qp = rng.standard_normal((83, hq, d)).astype(cache.dtype)
            MAPS.clear()
            rec(f"paged_prefill v3 {dt} {d} {hq}", lambda: PP3.paged_prefill(qp, cache, [sids[0], sids[1], sids[1]], cq,
                                                                         config=PP3.HopperPagedPrefillConfig("v3")))
            out[f"maps paged_prefill v3 {dt} {d} {hq}"] = MAPS[:]
            MAPS.clear()
            # the same batch through cr.paged_prefill_pools: device arrays, so the plan launches it
            t, ln = cache.block_tables_array([sids[0], sids[1], sids[1]])
            dev = [cupy.asarray(x) for x in (qp, cache.k_pool, cache.v_pool)]
            ints = [cupy.asarray(x.astype(np.int32)) for x in (t, ln, cq)]
            rec(f"prefill pools v3 {dt} {d} {hq}",
                lambda: cr.paged_prefill_pools(*dev, *ints, config=PP3.HopperPagedPrefillConfig("v3"), max_seqlen_q=45))
            out[f"maps prefill pools v3 {dt} {d} {hq}"] = MAPS[:]
            MAPS.clear()

# decode v8 (Hopper): GQA 32/2 over a view of a longer cache (its strides), the tensor maps recorded;
# the eager call (a plan's run packs the same arguments: tests/test_cupy_plans.py)
from iokernels.cupy_raw import decode_v8_config as V8D
from iokernels.cupy_raw.decode import decode as eager_decode
for dt in ("bfloat16", "float16"):
    for d in (64, 128, 256):
        q, k, v = make_inputs(rng, batch=3, heads_q=64, heads_kv=2, seqlen_q=1, seqlen_k=400, head_dim=d, dtype=dt)
        kv = [cupy.asarray(x)[:, :, :301] for x in (k, v)]
        for splits, cfg in ((None, cr.DecodeConfig("v8", fused=True)),
                            (3, cr.DecodeConfig("v8", fused=False, stages=2)), (1, cr.DecodeConfig("v8", stages=2))):
            MAPS.clear()
            V8D._MAPS.clear()
            qd = cupy.asarray(q[:, :, 0])
            rec(f"decode v8 {dt} {d} {splits} {cfg and cfg.fused}",
                lambda: eager_decode(qd, *kv, seq_lens=np.array([301, 0, 77]), num_splits=splits, config=cfg),
                ints=True)
            out[f"maps decode v8 {dt} {d} {splits} {cfg and cfg.fused}"] = MAPS[:]
            MAPS.clear()
            eager_decode(qd, *kv, seq_lens=np.array([301, 0, 77]), num_splits=splits, config=cfg)   # the same arrays
            cupy.LAUNCHES.clear()
            out[f"maps again decode v8 {dt} {d} {splits} {cfg and cfg.fused}"] = MAPS[:]
            MAPS.clear()
json.dump(out, sys.stdout)
'''

#: the kernel file each kernel function lives in
FILES = {"fa_v1": "fa_v1", "fa_v1b": "fa_v1b", "fa_v2": "fa_v2", "decode_split": "decode",
         "decode_combine": "decode", "decode_combine_parallel": "decode_combine", "decode_split_v2": "decode_v2",
         "decode_split_v3": "decode_v3",
         "decode_split_v4": "decode_v4", "decode_split_v5": "decode_v5", "decode_split_v6": "decode_v6",
         "decode_split_v7": "decode_v7", "decode_split_v8": "decode_v8", "decode_split_v9": "decode_v9",
         "decode_split_v4_loads": "decode_v4_loads",
         "paged_gather": "paged_gather", "bwd_rowsum": "bwd_v1", "bwd_main": "bwd_v1", "bwd_finish": "bwd_v1",
         "bwd_v2_main": "bwd_v2", "bwd_v3_main": "bwd_v3", "bwd_v4_main": "bwd_v4", "bwd_v5_main": "bwd_v5",
         "bwd_v6_main": "bwd_v6", "bwd_v6_finish": "bwd_v6", "mla_decode": "mla_decode",
         "paged_prefill_v1": "paged_prefill_v1", "paged_prefill_v2": "paged_prefill_v2",
         "paged_prefill_v3": "paged_prefill_v3"}


@pytest.fixture(scope="module")
def launches():
    env = dict(os.environ, PYTHONPATH=f"{STAND_INS}{os.pathsep}{REPO}")
    r = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _signature(name, options):
    """The parameter list of kernel ``name`` after the preprocessor, at these -D options."""
    from iokernels.bench import decode_loads
    from iokernels.cupy_raw import hopper, launch
    tables = (hopper.SOURCES, decode_loads.SOURCES)
    src = launch.source(FILES[name], next((t for t in tables if FILES[name] in t), None))
    r = subprocess.run([NVCC, "-E", "-arch=sm_90", "-x", "cu", *[o for o in options if o.startswith("-D")], "-"],
                       input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-400:]
    # without the preprocessor's line markers ("# 369 ..."), which may sit inside a parameter list
    text = "\n".join(line for line in r.stdout.splitlines() if not line.lstrip().startswith("#"))
    pos = text.index('extern "C"')
    while True:
        m = re.compile(r"\b" + name + r"\s*\(").search(text, pos)
        start = end = m.end()
        depth = 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        if text[end:end + 40].lstrip().startswith("{"):
            return [p.strip() for p in text[start:end - 1].split(",")]
        pos = end


def _expected(param, options):
    if "TmaMap" in param:
        return "tmap"
    if "*" in param:
        return "uint64"
    if re.match(r"(const )?int\b", param):
        return "int32"
    if param.startswith("long long"):
        return "int64"
    double = param.startswith("double") or (param.startswith("acc_t") and "-DIK_DTYPE=3" in options)
    return "float64" if double else "float32"


def test_every_launch_matches_its_kernel_signature(launches):
    distinct = {}
    for label, ls in launches.items():
        if label.startswith("maps "):             # the tensor maps MLA asked for, not launches
            continue
        for L in ls:
            distinct.setdefault((L["name"], tuple(L["options"])), []).append((label, L["args"]))
    assert {n for n, _ in distinct} == set(FILES), "every kernel function was launched"
    with ThreadPoolExecutor(max_workers=2) as pool:
        sigs = dict(zip(distinct, pool.map(lambda key: _signature(*key), distinct)))
    bad = []
    for (name, options), uses in distinct.items():
        want = [_expected(p, options) for p in sigs[name, options]]
        for label, args in uses:
            # a pointer travels as a 64-bit integer or as a CuPy array (CuPy passes its pointer)
            got = ["uint64" if a == "ndarray" else a for a in args]
            if got != want:
                bad.append(f"{label}: {name} takes {want}, got {args}")
    assert not bad, "\n".join(bad[:10])


def _one(launches, label, name):
    got = [L for L in launches[label] if L["name"] == name]
    assert got, f"{label}: no {name} launch"
    return got[0]


def _defines(L):
    return dict(o[2:].split("=", 1) for o in L["options"] if o.startswith("-D"))


def test_defaults_stay_at_the_tuned_shapes(launches):
    v2 = _defines(_one(launches, "attention None bfloat16 128", "fa_v2"))
    assert (v2["NUM_WARPS"], v2["BLOCK_K"]) == ("8", "64")
    v1b = _defines(_one(launches, "attention None float32 128", "fa_v1b"))
    assert (v1b["RM"], v1b["RN"]) == ("4", "4")                        # Br = Bc = 64
    assert _one(launches, "attention None float64 128", "fa_v1")
    dec = _one(launches, "decode v3 {} bfloat16 128 5", "decode_split_v3")
    assert (_defines(dec)["NUM_WARPS"], _defines(dec)["STAGES"], _defines(dec)["FUSED"]) == ("8", "4", "1")
    # 16-bit rows of whole mma k-steps: v4, 8 warps x 3 stages x 16 key rows, fused (one launch)
    dec = _one(launches, "decode None {} bfloat16 128 5", "decode_split_v4")
    assert tuple(_defines(dec)[k] for k in ("NUM_WARPS", "STAGES", "TILE_ROWS", "FUSED")) == ("8", "3", "16", "1")
    assert [L["name"] for L in launches["decode None {} bfloat16 128 5"]] == ["decode_split_v4"]
    assert [L["name"] for L in launches["decode v4 {'fused': False} float16 128 5"]] == ["decode_split_v4",
                                                                                         "decode_combine_parallel"]
    assert _one(launches, "decode None {} float32 128 5", "decode_split_v3")     # v4 is 16-bit only
    assert _one(launches, "decode None {} float16 59 5", "decode_split")      # rows not 16-byte chunks: v1
    assert [L["name"] for L in launches["decode v1 {} float16 59 5"]] == ["decode_split", "decode_combine_parallel"]
    # the default separate combine is decode_combine.cu's (a thread a column); combine="serial" runs
    # decode.cu's in its place, with the same arguments
    for label in ("decode v1 {} float16 59 5", "decode v4 {'fused': False} bfloat16 128 5"):
        split, comb = launches[label]
        serial = launches[label.replace("{}", "{'combine': 'serial'}").replace("{'fused': False}",
                                                                             "{'fused': False, 'combine': 'serial'}")]
        assert comb["name"] == "decode_combine_parallel" and split["name"] != comb["name"], label
        assert [L["name"] for L in serial] == [split["name"], "decode_combine"], label
        assert serial[1]["args"] == comb["args"] and serial[1]["grid"] == comb["grid"], label
        d = int(_defines(comb)["HEAD_DIM"])
        assert int(_defines(comb)["COMBINE_THREADS"]) == comb["block"][0] == -(-d // 32) * 32, label
        assert comb["grid"] == [3 * 8], label                            # a block a query row
    assert _one(launches, "paged_decode None float16 128", "decode_split_v4")
    # v4 refuses 32 heads a KV head; v6 takes them, by default and by name, with the same defines
    mqa = _one(launches, "decode mqa bfloat16 128", "decode_split_v6")
    assert _defines(mqa) == _defines(_one(launches, "decode mqa v6 bfloat16 128", "decode_split_v6"))
    # 32 float32 query heads a KV head: v7 by default (v3 while it is held back); v7 launches
    # 2 blocks a KV head of 16 heads each (grid y and the kernel's heads_kv: 1 x 2), one 8-warp
    # block an SM, and its fused combine's counters cover both slices
    from iokernels.cupy_raw import policy
    mqa_default = launches["decode mqa float32 128"]
    held = policy.held_back("decode", "v7") is not None
    assert [L["name"] for L in mqa_default] == ["decode_split_v3" if held else "decode_split_v7"]
    v7 = _one(launches, "decode mqa v7 float32 128", "decode_split_v7")
    assert tuple(_defines(v7)[k] for k in ("GROUP", "GROUP_SPLIT", "NUM_WARPS", "DECODE_MIN_BLOCKS")) == \
        ("16", "2", "8", "1")
    assert v7["grid"] == [5, 2, 2] and v7["block"] == [256]
    nk_at = v7["ints"].index(301)                        # nk, heads_q, heads_kv (the slices), ...
    assert v7["ints"][nk_at:nk_at + 3] == [301, 32, 2], v7["ints"]
    assert [L["name"] for L in launches["decode mqa v7 unfused float32 128"]] == ["decode_split_v7",
                                                                                 "decode_combine_parallel"]
    # a quantized cache: v5 by default (codes as float16 mma operands), 8 warps x 3 stages x 32 keys
    quant = _defines(_one(launches, "quant paged_decode None float8_e4m3fn block float16 128 3", "decode_split_v5"))
    assert tuple(quant[k] for k in ("KV_QUANT", "NUM_WARPS", "STAGES", "TILE_ROWS")) == ("2", "8", "3", "32")
    quant = _one(launches, "quant paged_decode v5 int8 block_head float16 128 1", "decode_split_v5")
    assert _defines(quant)["KV_QUANT"] == "1" and quant["smem"] >= 8 * 3 * (2 * 32 * 128 + 2 * 32 * 4)   # codes, scales
    assert "quant paged_decode v5 int8 block_head float16 59 1" not in launches     # d=59: no v5
    assert "quant paged_decode v4 int8 block_head float16 128 1" not in launches    # v4 reads 16-bit caches
    assert "paged_decode v5 float16 128" not in launches                            # v5 reads codes only
    # the load experiments: v4's defines plus their own, one launch each (fused)
    for load, extra in (("bulk", dict(LOAD_BULK="1", SWIZZLE="0", LOAD_L1="0")), ("padded", dict(SWIZZLE="0")),
                        ("same", dict(SWIZZLE="1"))):
        got = _defines(_one(launches, f"loads {load} bfloat16 128", "decode_split_v4_loads"))
        v4 = _defines(_one(launches, "decode v4 {} bfloat16 128 5", "decode_split_v4"))
        assert got == dict(v4, **dict(dict(LOAD_BULK="0"), **extra)), load
    quant = _defines(_one(launches, "quant paged_decode v3 float8_e4m3fn block float16 128 3", "decode_split_v3"))
    assert (quant["KV_QUANT"], quant["STAGES"], quant["TILE_ROWS"]) == ("2", "8", "8")   # 1-byte rows: 8 x 1 KB
    assert _one(launches, "quant paged_decode v1 int8 block_head float32 59 3", "decode_split")
    bwd = _one(launches, "attention_backward v2 bfloat16 128 deterministic=False", "bwd_v2_main")
    assert (_defines(bwd)["NUM_WARPS"], _defines(bwd)["BLOCK_Q"]) == ("8", "64")     # Bc = 128, Br = 64
    assert bwd["block"] == [256] and bwd["grid"] == [1, 2, 2]                  # Tc = ceil(77 / 128)
    # K, V; Q_i, dO_i double-buffered; dS^T (Bc x (Br + 8)); LSE_i, D_i double-buffered (float32)
    assert bwd["smem"] == 2 * (2 * 128 * 136 + 4 * 64 * 136 + 128 * 72) + 16 * 64
    assert _defines(_one(launches, "attention_backward v2 float16 59 deterministic=True",
                         "bwd_v2_main"))["BLOCK_Q"] == "64"                           # D_PAD 64: Br 64
    assert "attention_backward v2 float32 128 deterministic=False" not in launches   # 16-bit only


def test_paged_prefill_launch_geometry(launches):
    """paged_prefill_v1: 4 warps (Br = 64) x Bc = 64 (4 cache blocks of 16) at d = 128 and 64, one
    launch per call; grid (Q tiles of the longest chunk, query heads, sequences) with host offsets,
    (Q tiles of total_q, ...) with device ones (their values are not read on the host).  A call
    naming no version launches v2 (the default without a Hopper GPU)."""
    from iokernels.cupy_raw.paged_prefill_config import paged_prefill_smem
    for dt in ("float16", "bfloat16"):
        for d in (128, 64):
            assert [L["name"] for L in launches[f"paged_prefill None {dt} {d}"]] == ["paged_prefill_v2"]
            ls = launches[f"paged_prefill v1 {dt} {d}"]
            assert [L["name"] for L in ls] == ["paged_prefill_v1"]
            df = _defines(ls[0])
            assert (df["NUM_WARPS"], df["BLOCK_K"], df["PAGE_SIZE"], df["VEC_IO"]) == ("4", "64", "16", "1")
            assert ls[0]["grid"] == [1, 8, 3] and ls[0]["block"] == [128]      # longest chunk 45 rows: 1 tile
            assert ls[0]["smem"] == paged_prefill_smem(d, 4, 64)
            pools = launches[f"prefill pools v1 {dt} {d}"]
            assert pools[0]["grid"] == [1, 8, 2]                               # 38 rows: 1 tile of 64
            # device offsets: the grid from max_seqlen_q (45 rows: one tile), not total_q (83: two)
            assert launches[f"prefill pools bound v1 {dt} {d}"][0]["grid"] == [1, 8, 3]
    assert "paged_prefill None float32 128" not in launches and "prefill pools v1 float32 128" not in launches
    assert "paged_prefill v1 float16 59" not in launches                       # head dims 64 and 128 only


def test_paged_prefill_v2_launch_geometry(launches):
    """paged_prefill_v2: the 4 query heads of a KV head packed into a tile's rows, so the grid is
    (tiles of the longest chunk's rows x 4, KV heads, sequences), the kernel's arguments v1's."""
    for dt in ("float16", "bfloat16"):
        for d in (128, 64):
            ls = launches[f"paged_prefill v2 {dt} {d}"]
            assert [L["name"] for L in ls] == ["paged_prefill_v2"]
            assert ls[0]["grid"] == [3, 2, 3] and ls[0]["block"] == [128]      # 45 x 4 = 180 rows: 3 tiles of 64
            assert launches[f"prefill pools v2 {dt} {d}"][0]["grid"] == [3, 2, 2]          # 38 x 4 rows
            assert launches[f"prefill pools bound v2 {dt} {d}"][0]["grid"] == [3, 2, 3]
            assert ls[0]["args"][8:] == launches[f"paged_prefill v1 {dt} {d}"][0]["args"][8:]


def test_mla_launch_geometry(launches):
    """mla_decode: one block per (64 heads, split, sequence), 256 threads, Q + two tiles of SRAM;
    the tensor maps see q as (576, Hq, B) and the cache as (576, N, B) (or the pool as (576, page,
    blocks)) in 64 x 64 boxes; splits merged by decode.cu's combine over 512-wide rows."""
    from iokernels.cupy_raw import config as C
    for dt in ("bfloat16", "float16"):
        one = launches[f"mla {dt} 1"]
        assert [L["name"] for L in one] == ["mla_decode"]
        assert one[0]["grid"] == [2, 1, 3] and one[0]["block"] == [256]
        assert one[0]["smem"] == C.MLADecodeConfig.smem_bytes()
        three = launches[f"mla {dt} 3"]
        assert [L["name"] for L in three] == ["mla_decode", "decode_combine"]
        assert three[0]["grid"] == [2, 3, 3] and three[1]["grid"] == [3 * 80]
        assert _defines(three[1])["HEAD_DIM"] == "512"
        assert launches[f"mla {dt} None"][0]["grid"] == [2, 3, 3]      # 301 rows: 3 splits of 128 at most
        assert launches[f"maps mla {dt} 3"] == [
            dict(dims=[576, 301, 3], strides=[1152, 1152 * 301], box=[64, 64, 1]),
            dict(dims=[576, 80, 3], strides=[1152, 1152 * 80], box=[64, 64, 1])]
        paged = launches[f"mla paged {dt}"]
        assert _defines(paged[0])["PAGED"] == "1" and _defines(paged[0])["PAGE_SIZE"] == "128"
        assert launches[f"maps mla paged {dt}"][0] == dict(dims=[576, 128, 20], strides=[1152, 1152 * 128],
                                                           box=[64, 64, 1])


def test_backward_v3_launch_geometry(launches):
    """backward v3 (Hopper): rowsum, the main loop, finish; the main loop one block per (K/V tile
    of 64 keys, KV head, sequence), 256 threads (producer + consumer warpgroup), compiled for
    sm_90a; its four tensor maps see Q, K, V, dO as (d, N, B * H) in 64 x 64 boxes."""
    from iokernels.cupy_raw import config as C
    for dt in ("bfloat16", "float16"):
        for d in (64, 128):
            for det in (False, True):
                ls = launches[f"attention_backward v3 {dt} {d} deterministic={det}"]
                assert [L["name"] for L in ls] == ["bwd_rowsum", "bwd_v3_main", "bwd_finish"]
                main = ls[1]
                assert main["grid"] == [2, 2, 2] and main["block"] == [256]          # Tc = ceil(77 / 64)
                assert "-arch=sm_90a" in main["options"]
                assert main["smem"] == C.BackwardConfig.smem_bytes(64, 64, d, dt, "v3")
                got = _defines(main)
                assert (got["BLOCK_M"], got["BLOCK_N"], got["DETERMINISTIC"]) == ("64", "64", str(int(det)))
                assert _defines(ls[2])["DETERMINISTIC"] == str(int(det))
                q_map = dict(dims=[d, 37, 8], strides=[2 * d, 2 * d * 37], box=[64, 64, 1])
                kv_map = dict(dims=[d, 77, 4], strides=[2 * d, 2 * d * 77], box=[64, 64, 1])
                assert launches[f"maps bwd v3 {dt} {d} {det}"] == [q_map, kv_map, kv_map, q_map]


@pytest.mark.parametrize("ver", ("v4", "v5", "v6"))
def test_backward_v4_launch_geometry(launches, ver):
    """backward v4 (Hopper, two consumer warpgroups), v5 (its kernel, longest first) and v6 (v5's,
    dQ added from SRAM): the main loop one block per (K/V tile of 128 keys, KV head, sequence),
    384 threads (producer + two consumer warpgroups), compiled for sm_90a; Q and dO in 64-row
    boxes, K and V in 128-row boxes; dQ's partials one slot per 128-key tile (the finish sums
    Tc = ceil(77 / 128) = 1): bwd_v1.cu's bwd_finish a thread an element, v6's own bwd_v6_finish
    (the same defines as its main loop) a thread a pair of columns, told B x Hq = 8 rows of
    heads, Nq = 37 and the tile count.  v5's and v6's last main-loop argument is the policy's
    group of pairs: all four under the causal mask, one (v4's order) without an upper edge to the
    band."""
    from iokernels.cupy_raw import config as C
    from iokernels.cupy_raw import policy
    for dt in ("bfloat16", "float16"):
        for d in (64, 128):
            for det in (False, True):
                ls = launches[f"attention_backward {ver} {dt} {d} deterministic={det}"]
                finish = "bwd_v6_finish" if ver == "v6" else "bwd_finish"
                assert [L["name"] for L in ls] == ["bwd_rowsum", f"bwd_{ver}_main", finish]
                main = ls[1]
                assert main["grid"] == [1, 2, 2] and main["block"] == [384]
                assert "-arch=sm_90a" in main["options"]
                assert main["smem"] == C.BackwardConfig.smem_bytes(64, 128, d, dt, ver)
                got = _defines(main)
                assert (got["BLOCK_M"], got["BLOCK_N"], got["DETERMINISTIC"]) == ("64", "128", str(int(det)))
                assert _defines(ls[2])["DETERMINISTIC"] == str(int(det))
                if ver == "v6":
                    assert _defines(ls[2]) == got and "-arch=sm_90a" in ls[2]["options"]
                    assert ls[2]["ints"][-3:] == [8, 37, 1] and ls[2]["grid"] == [-(-8 * 37 * d // 2 // 128)]
                else:
                    assert ls[2]["ints"][-2:] == [8 * 37 * d, 1] and ls[2]["grid"] == [-(-8 * 37 * d // 128)]
                q_map = dict(dims=[d, 37, 8], strides=[2 * d, 2 * d * 37], box=[64, 64, 1])
                kv_map = dict(dims=[d, 77, 4], strides=[2 * d, 2 * d * 77], box=[64, 128, 1])
                assert launches[f"maps bwd {ver} {dt} {d} {det}"] == [q_map, kv_map, kv_map, q_map]
                if ver in ("v5", "v6"):      # lpt_pairs, the last argument: the stand-in's 132 SMs and 50 MB of L2
                    pairs = policy.backward_lpt_pairs(4, 2, 37, d, 2, 50 << 20, banded=True, tiles=1, sms=132)
                    assert main["ints"][-1] == pairs == 4                  # causal: every pair one group
                    for window in (None, (8, -1)):
                        ls = launches[f"attention_backward {ver} {dt} {d} deterministic={det} window={window}"]
                        assert ls[1]["name"] == f"bwd_{ver}_main" and ls[1]["ints"][-1] == 1, window


def test_the_paged_prefill_v3_plan_launches_like_its_eager_call(launches):
    """cr.paged_prefill_pools with device arrays and a config naming v3 goes through the plan: the
    same kernel, options, grid (longest chunk 45 rows x g over 128-row tiles, a block a KV head),
    block, shared memory and argument kinds as the eager launcher, and the same tensor maps."""
    for dt in ("bfloat16", "float16"):
        for d in (128, 64):
            for hq in (8, 2):
                case = f"v3 {dt} {d} {hq}"
                planned, eager = launches[f"prefill pools {case}"], launches[f"paged_prefill {case}"]
                assert planned == eager and [L["name"] for L in planned] == ["paged_prefill_v3"], case
                assert planned[0]["grid"] == [-(-45 * (hq // 2) // 128), 2, 3] and planned[0]["block"] == [384]
                maps = launches[f"maps prefill pools {case}"]
                assert maps == launches[f"maps paged_prefill {case}"] and len(maps) == 3, case


def test_decode_v8_launch_geometry(launches):
    """decode v8: a block of the producer's and the consumers' warpgroups (two at head_dim 64 and
    128, one at 256) for each (split, kv head, batch), grid (S, Hkv, B); its Q map is the groups'
    rows (d, g, B * Hkv) in boxes of 64 rows (the rows past g arrive as zeros), K's and V's span
    (d, N, Hkv, B) with the view's strides (a 400-row cache seen as 301 rows) in boxes of Bc keys;
    the two-launch path adds decode.cu's combine; a second call on the same arrays reuses the maps."""
    for dt in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            bn, threads = {64: (128, 384), 128: (64, 384), 256: (64, 256)}[d]
            for splits, fused in ((None, True), (3, False), (1, None)):
                label = f"decode v8 {dt} {d} {splits} {fused}"
                L = _one(launches, label, "decode_split_v8")
                df = _defines(L)
                assert (int(df["BLOCK_N"]), L["block"][0]) == (bn, threads), label
                assert L["grid"][1:] == [2, 3] and (splits is None or L["grid"][0] == splits), label
                assert any(x["name"].startswith("decode_combine") for x in launches[label]) == (fused is False), label
                # fused left unset: 32 heads x d take the separate combine (policy.decode_fuse_combine)
                assert df["FUSED"] == {True: "1", False: "0", None: "0"}[fused], label
                maps = launches[f"maps {label}"]
                assert maps[0] == dict(dims=[d, 32, 6], strides=[2 * d, 2 * d * 32], box=[64, 64, 1]), label
                for m in maps[1:]:
                    assert m == dict(dims=[d, 301, 2, 3], strides=[2 * d, 2 * d * 400, 2 * d * 400 * 2],
                                     box=[64, bn, 1, 1]), label
                assert len(maps) == 3 and launches[f"maps again {label}"] == [], label   # kept, not re-encoded
