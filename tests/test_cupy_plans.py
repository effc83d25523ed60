"""The plan/run path launches what the eager path launches, checks once, and costs few calls.

Run without a GPU against the stand-in CuPy (tests/stand_ins/cupy: NumPy memory, kernels that
record their launches), in a subprocess as tests/test_cupy_launch_args.py does.  For each
call the launches of the eager path (:func:`iokernels.cupy_raw.decode.decode`, ...) and of
the cached plan (:func:`iokernels.cupy_raw.decode` a second time, a cache hit) are compared
argument by argument: kernel, grid, block, shared memory, every size, stride and scale, and
every pointer that names an input (outputs and workspaces are fresh allocations, so their
pointers only have to differ from the inputs').  Then the cost of a hit: the Python
function calls made inside the package (``sys.setprofile``), held to a small bound, so a
per-call repeat that creeps back is caught here.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

STAND_INS = pathlib.Path(__file__).resolve().parent / "stand_ins"
REPO = pathlib.Path(__file__).resolve().parents[1]

#: Python calls inside iokernels/ a cached call may make (a hit: key, plan.run, pack, launch; decode v8
#: at a group of 32 launches two kernels: the split and the combine)
HIT_CALL_BOUND = {"ik.decode": 40, "ik.attention": 35, "plan.run": 36, "pools": 48, "pools quant": 56,
                  "hopper": 35, "gather": 40, "backward": 50, "backward plan.run": 42, "mla": 40, "mla paged": 45,
                  "prefill": 38, "prefill plan.run": 32, "prefill v3": 38, "prefill v3 plan.run": 32,
                  "decode v8": 46, "decode v8 plan.run": 42}

#: the paged prefill versions PagedPrefillPlan takes (v1, v2; the Hopper v3 when a HopperPagedPrefillConfig names it)
PLANNED_PREFILL = ("v1", "v2", "v3")

DRIVER = r'''
import importlib, json, os, sys
import numpy as np
import cupy
import iokernels as ik
from iokernels import cupy_raw as cr
cr.hopper.available = cr.hopper.checks.available = lambda: "the stand-in CuPy has no TMA"
D = importlib.import_module("iokernels.cupy_raw.decode")
F = importlib.import_module("iokernels.cupy_raw.forward")
PKG = os.path.dirname(ik.__file__)
rng = np.random.default_rng(0)
out = {"cases": {}, "calls": {}, "names": {}, "errors": {}}


def arr(*shape, dtype=np.float16):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def launches(fn, inputs):
    """fn's launches, pointers named by the input they are (or 'new', or 0)."""
    cupy.LAUNCHES.clear()
    fn()
    ptrs = {int(x.data.ptr): n for n, x in inputs.items()}
    got = []
    for L in cupy.LAUNCHES:
        args = []
        for a in L["args"]:
            if type(a) is np.uint64:
                p = int(a)
                args.append("0" if p == 0 else ptrs.get(p, "new"))
            else:
                args.append(f"{type(a).__name__}:{a!r}")
        got.append(dict(name=L["name"], grid=list(L["grid"]), block=list(L["block"]), smem=int(L["smem"]),
                        options=sorted(L["options"]), args=args))
    cupy.LAUNCHES.clear()
    return got


def case(label, eager, cached, inputs):
    e = launches(eager, inputs)
    first = launches(cached, inputs)
    hits = cr.PLANS.hits
    second = launches(cached, inputs)
    out["cases"][label] = dict(eager=e, first=first, second=second, hit=cr.PLANS.hits == hits + 1)


def count(label, fn):
    fn()
    names = []
    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            names.append(frame.f_code.co_name)
    sys.setprofile(prof)
    fn()
    sys.setprofile(None)
    out["calls"][label] = len(names)
    out["names"][label] = sorted(set(names))


q, k, v = arr(3, 8, 128), arr(3, 2, 301, 128), arr(3, 2, 301, 128)
lens = np.array([301, 0, 7])
io = dict(q=q, k=k, v=v)
for cfg in (None, cr.DecodeConfig("v1"), cr.DecodeConfig("v2"), cr.DecodeConfig("v3"),
            cr.DecodeConfig("v3", fused=False), cr.DecodeConfig("v4"),
            cr.DecodeConfig("v4", fused=False, combine="parallel")):
    for splits in (None, 1, 5):
        for lens_ in (None, lens):
            kw = dict(seq_lens=lens_, num_splits=splits, config=cfg)
            case(f"decode {cfg} {splits} {lens_ is not None}", lambda: D.decode(q, k, v, **kw),
                 lambda: cr.decode(q, k, v, **kw), io)
    kw = dict(seq_lens=lens, config=cfg, window=(100, 0), scale=0.3)
    case(f"decode window {cfg}", lambda: D.decode(q, k, v, **kw), lambda: cr.decode(q, k, v, **kw), io)
# decode v9: at few (b, kv head) pairs its deal is declined and the launch is v4's own; at a wave of
# blocks (132 SMs x 2 an SM, the stand-in's) + 8 pairs, 520 keys each, it deals runs across pairs
for B, Hkv, N in ((3, 2, 301), (68, 4, 520)):
    q9, k9, v9 = arr(B, 4 * Hkv, 64), arr(B, Hkv, N, 64), arr(B, Hkv, N, 64)
    for cfg in (cr.DecodeConfig("v9"), cr.DecodeConfig("v9", fused=False)):
        case(f"decode v9 B={B} {cfg}", lambda: D.decode(q9, k9, v9, config=cfg),
             lambda: cr.decode(q9, k9, v9, config=cfg), dict(q=q9, k=k9, v=v9))
dl = cupy.asarray(lens.astype(np.int32))
io_l = dict(io, lens=dl)
case("decode device lens", lambda: D.decode(q, k, v, seq_lens=dl, num_splits=3),
     lambda: cr.decode(q, k, v, seq_lens=dl, num_splits=3), io_l)

pools = [arr(20, 16, 2, 128), arr(20, 16, 2, 128)]
tables = np.array([[3, 1, 4, 9, 0], [2, 6, 5, 0, 0], [7, 8, 10, 11, 12]], np.int32)
plens = np.array([70, 20, 80], np.int32)
io_p = dict(q=q, k=pools[0], v=pools[1])
for cfg in (None, cr.DecodeConfig("v1"), cr.DecodeConfig("v3"), cr.DecodeConfig("v4"),
            cr.DecodeConfig("v1", combine="parallel"), cr.DecodeConfig("v9")):
    kw = dict(num_splits=2, config=cfg)
    case(f"pools {cfg}", lambda: D.paged_decode_pools(q, *pools, tables, plens, **kw),
         lambda: cr.paged_decode_pools(q, *pools, tables, plens, **kw), io_p)
dt, dln = cupy.asarray(tables), cupy.asarray(plens)
case("pools device tables", lambda: D.paged_decode_pools(q, *pools, dt, dln, num_splits=2),
     lambda: cr.paged_decode_pools(q, *pools, dt, dln, num_splits=2), dict(io_p, tables=dt, lens=dln))

# a quantized cache: 1-byte codes, float32 scales per block and KV head or per block; device scales
# are planned (and read in place), NumPy ones take the eager path on every call
codes = [cupy.asarray(rng.integers(0, 255, (20, 16, 2, 128)).astype(np.uint8)) for _ in range(2)]
for heads in (2, 1):
    scl = [cupy.asarray(rng.uniform(0.01, 0.1, (20, heads)).astype(np.float32)) for _ in range(2)]
    quant = dict(kv="float8_e4m3fn", k_scale=scl[0], v_scale=scl[1])
    io_quant = dict(q=q, k=codes[0], v=codes[1], ks=scl[0], vs=scl[1])
    for cfg in (None, cr.DecodeConfig("v1"), cr.DecodeConfig("v3"), cr.DecodeConfig("v5")):
        for tabs in ((tables, plens), (dt, dln)):
            kw = dict(num_splits=2, config=cfg, quant=quant)
            io_t = dict(io_quant, tables=dt, lens=dln) if tabs[0] is dt else io_quant
            case(f"pools quant {heads} {cfg} {'device' if tabs[0] is dt else 'host'}",
                 lambda: D.paged_decode_pools(q, *codes, *tabs, **kw),
                 lambda: cr.paged_decode_pools(q, *codes, *tabs, **kw), io_t)
count("pools quant", lambda: cr.paged_decode_pools(q, *codes, dt, dln, num_splits=2, quant=quant))
n_plans = len(cr.PLANS)
host_quant = dict(kv="float8_e4m3fn", k_scale=scl[0].get(), v_scale=scl[1].get())
e = launches(lambda: D.paged_decode_pools(q, *codes, dt, dln, num_splits=2, quant=host_quant), io_quant)
c = launches(lambda: cr.paged_decode_pools(q, *codes, dt, dln, num_splits=2, quant=host_quant), io_quant)
out["quant host scales"] = [len(cr.PLANS) == n_plans, [x["name"] for x in e] == [x["name"] for x in c]]

gt = cupy.asarray(np.array([3, 1, 4, 9, 0], np.int32))
out["gather"] = launches(lambda: cr.gather_pools(*pools, gt, 70), dict(k=pools[0], v=pools[1], table=gt))
out["gather host"] = launches(lambda: cr.gather_pools(*pools, np.array([3, 1, 4, 9, 0]), 70),
                              dict(k=pools[0], v=pools[1], table=gt))

# the paged gather: device and host tables, the config's launch shape, odd row sizes, a strided pool;
# the length is not part of a plan (one plan serves a growing sequence)
G = importlib.import_module("iokernels.cupy_raw.gather")
io_g = dict(k=pools[0], v=pools[1], table=gt)
ht = np.array([3, 1, 4, 9, 0])
for cfg in (None, cr.GatherConfig(threads=128, blocks_per_sm=2)):
    for n_ in (70, 1, 80):
        for tab in (gt, ht):
            kw = dict(config=cfg)
            case(f"gather {cfg} {n_} {type(tab).__module__}", lambda: G.gather_pools(*pools, tab, n_, **kw),
                 lambda: cr.gather_pools(*pools, tab, n_, **kw), io_g)
odd = [arr(9, 4, 3, 7, dtype=np.float32), arr(9, 4, 3, 7, dtype=np.float32)]   # 28-byte rows: 4-byte chunks
ot = cupy.asarray(np.array([8, 0, 5], np.int32))
case("gather odd rows", lambda: G.gather_pools(*odd, ot, 10), lambda: cr.gather_pools(*odd, ot, 10),
     dict(k=odd[0], v=odd[1], table=ot))
wide = arr(20, 16, 2, 256)
strided = [wide[..., ::2], pools[1]]                                            # a pool a plan copies
case("gather strided pool", lambda: G.gather_pools(*strided, gt, 70), lambda: cr.gather_pools(*strided, gt, 70),
     dict(k=strided[0], v=pools[1], table=gt))
n_plans = len(cr.PLANS)
for n_ in (5, 33, 64, 0):
    cr.gather_pools(*pools, gt, n_)
out["gather lengths share a plan"] = len(cr.PLANS) == n_plans
out["gather empty"] = [launches(lambda: cr.gather_pools(*pools, gt, 0), {}) == [],
                       cr.gather_pools(*pools, gt, 0)[0].shape == G.gather_pools(*pools, gt, 0)[0].shape == (2, 0, 128)]

# the backward: both versions, atomic and deterministic dQ, causal and not, GQA and MHA, windows
Bk = importlib.import_module("iokernels.cupy_raw.backward")
for dtype, d, hkv in ((np.float16, 64, 2), (np.float16, 128, 4), (np.float32, 64, 2), (np.float64, 59, 1)):
    bq, bk, bv = arr(2, 4, 37, d, dtype=dtype), arr(2, hkv, 77, d, dtype=dtype), arr(2, hkv, 77, d, dtype=dtype)
    bdo, bo = arr(2, 4, 37, d, dtype=dtype), arr(2, 4, 37, d, dtype=dtype)
    blse = arr(2, 4, 37, dtype=np.float64 if dtype == np.float64 else np.float32)
    io_b = dict(do=bdo, q=bq, k=bk, v=bv, o=bo, lse=blse)
    cfgs = [None, cr.BackwardConfig(deterministic=True), cr.BackwardConfig("v1"),
            cr.BackwardConfig("v1", deterministic=True, block_q=16)]
    if dtype == np.float16:
        cfgs += [cr.BackwardConfig("v2", deterministic=True), cr.BackwardConfig("v2", num_warps=4, block_q=16)]
    for cfg in cfgs:
        for kw in (dict(), dict(causal=True), dict(window=(9, 4), scale=0.3)):
            kw = dict(kw, config=cfg)
            case(f"backward {np.dtype(dtype).name} {d} {hkv} {cfg} {kw}",
                 lambda: Bk.attention_backward(bdo, bq, bk, bv, bo, blse, **kw),
                 lambda: cr.attention_backward(bdo, bq, bk, bv, bo, blse, **kw), io_b)
zq, zdo, zo, zlse = arr(2, 4, 0, 59, dtype=np.float64), arr(2, 4, 0, 59, dtype=np.float64), \
    arr(2, 4, 0, 59, dtype=np.float64), arr(2, 4, 0, dtype=np.float64)
out["backward no queries"] = [launches(lambda: cr.attention_backward(zdo, zq, bk, bv, zo, zlse), {}) == [],
                              launches(lambda: Bk.attention_backward(zdo, zq, bk, bv, zo, zlse), {}) == []]
fq, fk, fv = arr(2, 4, 37, 64), arr(2, 2, 77, 64), arr(2, 2, 77, 64)           # for ik.attention_backward
fdo, fo, flse = arr(2, 4, 37, 64), arr(2, 4, 37, 64), arr(2, 4, 37, dtype=np.float32)
case("ik backward", lambda: Bk.attention_backward(fdo, fq, fk, fv, fo, flse, causal=True, scale=0.125),
     lambda: ik.attention_backward(fdo, fq, fk, fv, fo, flse, causal=True, backend="cupy"),
     dict(do=fdo, q=fq, k=fk, v=fv, o=fo, lse=flse))
wq = arr(2, 4, 37, 128)[..., ::2]                                                # rows a plan copies
case("backward strided q", lambda: Bk.attention_backward(fdo, wq, fk, fv, fo, flse, causal=True),
     lambda: cr.attention_backward(fdo, wq, fk, fv, fo, flse, causal=True),
     dict(do=fdo, q=wq, k=fk, v=fv, o=fo, lse=flse))

for dtype, d in ((np.float16, 64), (np.float32, 128), (np.float64, 59)):
    aq, ak, av = arr(2, 4, 37, d, dtype=dtype), arr(2, 2, 77, d, dtype=dtype), arr(2, 2, 77, d, dtype=dtype)
    for kw in (dict(), dict(causal=True), dict(window=(5, 3), scale=0.2)):
        case(f"attention {np.dtype(dtype).name} {d} {kw}", lambda: F.attention(aq, ak, av, **kw),
             lambda: cr.attention(aq, ak, av, **kw), dict(q=aq, k=ak, v=av))

# the Hopper forward: the stand-in cannot encode TMA descriptors, so a tensor map here is a
# hash of what it was asked for (equal maps, equal bytes); the Hopper check is let through
HA = importlib.import_module("iokernels.cupy_raw.hopper.attention")
HA.tensor_map = lambda *a: np.array([hash(a)], np.int64).view("V8")
cr.hopper.available = cr.hopper.checks.available = lambda: None
for kw in (dict(), dict(causal=True), dict(window=(100, 7)), dict(config=cr.hopper.HopperConfig(version="v8"))):
    hq, hk, hv = arr(2, 4, 300, 128), arr(2, 2, 300, 128), arr(2, 2, 300, 128)
    case(f"hopper attention {kw}", lambda: F.attention(hq, hk, hv, **kw), lambda: cr.attention(hq, hk, hv, **kw),
         dict(q=hq, k=hk, v=hv))
# the persistent v9: its grid and its tile counter (a fresh one eagerly, the plan's own one a stream)
for kw in (dict(config=cr.hopper.HopperConfig(version="v9")),
           dict(causal=True, config=cr.hopper.HopperConfig(version="v9", blocks=5))):
    case(f"persistent attention {kw}", lambda: F.attention(hq, hk, hv, **kw), lambda: cr.attention(hq, hk, hv, **kw),
         dict(q=hq, k=hk, v=hv))
count("hopper", lambda: ik.attention(hq, hk, hv, backend="cupy"))

# MLA decode (Hopper only: the same stand-in tensor maps): no lengths, host and device lengths, splits
M = importlib.import_module("iokernels.cupy_raw.mla")
cr.hopper.tensor_map = HA.tensor_map
mq, mkv = arr(3, 80, 576), arr(3, 333, 576)
mlens = np.array([1, 333, 0])
mdl = cupy.asarray(mlens.astype(np.int32))
io_m = dict(q=mq, kv=mkv, lens=mdl)
for lens_ in (None, mlens, mdl):
    for splits in (None, 1, 3):
        kw = dict(seq_lens=lens_, num_splits=splits)
        case(f"mla {type(lens_).__module__} {splits}", lambda: M.mla_decode(mq, mkv, **kw),
             lambda: cr.mla_decode(mq, mkv, **kw), io_m)
kw = dict(seq_lens=mlens, scale=0.05, config=cr.MLADecodeConfig(min_keys_per_split=64))
case("mla scale config", lambda: M.mla_decode(mq, mkv, **kw), lambda: cr.mla_decode(mq, mkv, **kw), io_m)
count("mla", lambda: cr.mla_decode(mq, mkv, seq_lens=mdl))
# paged MLA: host tables and lengths, and device ones used in place (planned for the tables' capacity,
# so the eager comparison uses a full first sequence)
mpool = arr(20, 64, 576)
mtab = np.array([[3, 1, 4, 9, 0, 2], [5, 6, 7, 8, 10, 11], [12, 13, 14, 15, 16, 17]], np.int32)
mplens = np.array([384, 70, 0], np.int32)
io_mp = dict(q=mq, kv=mpool)
for splits in (None, 1, 4):
    kw = dict(num_splits=splits)
    case(f"mla paged host {splits}", lambda: M.paged_mla_decode(mq, mpool, mtab, mplens, **kw),
         lambda: cr.paged_mla_decode(mq, mpool, mtab, mplens, **kw), io_mp)
mdt, mdpl = cupy.asarray(mtab), cupy.asarray(mplens)
case("mla paged device tables", lambda: M.paged_mla_decode(mq, mpool, mdt, mdpl),
     lambda: cr.paged_mla_decode(mq, mpool, mdt, mdpl), dict(io_mp, tables=mdt, lens=mdpl))
count("mla paged", lambda: cr.paged_mla_decode(mq, mpool, mdt, mdpl))
# NumPy gives an empty array zero strides; a device library gives (0, 1152, 1) elements' worth
nkv = cupy.ndarray(np.lib.stride_tricks.as_strided(np.zeros(8, np.float16), (3, 0, 576), (0, 1152, 2)))
out["mla no rows"] = [launches(lambda: cr.mla_decode(mq, nkv), {}) == [] == launches(lambda: M.mla_decode(mq, nkv), {}),
                      float(cr.mla_decode(mq, nkv)[1].get().max()) == -np.inf]

# the paged prefill: device, host and mixed tables / lengths / offsets, the grid's bound, settings,
# every registered version; a layer loop over other pools of the same shape reuses one plan
PP = importlib.import_module("iokernels.cupy_raw.paged_prefill")
ppool = [arr(20, 16, 2, 64), arr(20, 16, 2, 64)]
pq = arr(50, 8, 64)
ptab, plen, pcu = (np.array([[3, 1, 4, 9], [2, 6, 5, 0]], np.int32), np.array([60, 20], np.int32),
                   np.array([0, 40, 50], np.int32))
dptab, dplen, dpcu = (cupy.asarray(x) for x in (ptab, plen, pcu))
io_pp = dict(q=pq, k=ppool[0], v=ppool[1], tables=dptab, lens=dplen, cu=dpcu)
pp_versions = [cr.PagedPrefillConfig(v) for v in cr.REGISTRY.versions("paged_prefill")
               if cr.REGISTRY.get("paged_prefill", v).config_class is cr.PagedPrefillConfig]   # the planned ones
for cfg in [None, cr.PagedPrefillConfig("v1", num_warps=2, block_k=16)] + pp_versions:
    for kw in (dict(), dict(causal=False, scale=0.2)):
        for vals in ((dptab, dplen, dpcu), (ptab, plen, pcu), (dptab, plen, pcu), (ptab, plen, dpcu)):
            for m in (None, 40):
                kw_ = dict(kw, config=cfg, max_seqlen_q=m)
                case(f"prefill {cfg} {kw} {[type(x).__module__ for x in vals]} {m}",
                     lambda: PP.paged_prefill_pools(pq, *ppool, *vals, **kw_),
                     lambda: cr.paged_prefill_pools(pq, *ppool, *vals, **kw_), io_pp)
layers = [[arr(20, 16, 2, 64), arr(20, 16, 2, 64)] for _ in range(3)]
pplan = cr.PagedPrefillPlan(pq, *layers[0], dptab, dplen, dpcu, max_seqlen_q=40,
                            config=cr.PagedPrefillConfig("v2"))           # (v3's layer loop: below)
out["prefill layers"] = [launches(lambda: pplan.run(pq, *lay, dptab, dplen, dpcu, max_seqlen_q=40),
                                  dict(q=pq, k=lay[0], v=lay[1], tables=dptab, lens=dplen, cu=dpcu))[0]["args"][:6]
                         for lay in layers]
wpool = arr(20, 16, 2, 128)[..., ::2]                                           # rows the eager call copies
n_plans = len(cr.PLANS)
for args_ in ((pq, wpool, wpool, dptab, dplen, dpcu), (pq, ppool[0].get(), ppool[1].get(), dptab, dplen, dpcu)):
    cr.paged_prefill_pools(*args_)
out["prefill eager"] = len(cr.PLANS) == n_plans
out["prefill empty"] = launches(lambda: cr.paged_prefill_pools(pq[:0], *ppool, dptab, dplen,
                                                               cupy.asarray(np.zeros(3, np.int32))), {}) == []

# the Hopper v3 (a config of its own class naming it): the same calls through the same plan class; its
# tensor maps encode q's and the pools' addresses, so they are counted: encoded once per address set
PP3 = importlib.import_module("iokernels.cupy_raw.hopper.paged_prefill")
V3 = PP3.HopperPagedPrefillConfig("v3")
ENCODED = [0]


def counted_map(*a):
    ENCODED[0] += 1
    return HA.tensor_map(*a)


cr.hopper.tensor_map = counted_map
for cfg in (V3, PP3.HopperPagedPrefillConfig("v3", block_n=64, stages=2, pingpong=False)):
    for kw in (dict(), dict(causal=False, scale=0.2)):
        for vals in ((dptab, dplen, dpcu), (ptab, plen, pcu), (dptab, plen, pcu), (ptab, plen, dpcu)):
            for m in (None, 40):
                kw_ = dict(kw, config=cfg, max_seqlen_q=m)
                case(f"prefill {cfg} {kw} {[type(x).__module__ for x in vals]} {m}",
                     lambda: PP3.paged_prefill_pools(pq, *ppool, *vals, **kw_),
                     lambda: cr.paged_prefill_pools(pq, *ppool, *vals, **kw_), io_pp)
v3plan = cr.PagedPrefillPlan(pq, *layers[0], dptab, dplen, dpcu, config=V3, max_seqlen_q=40)
encoded = []
for lay in (layers[0], layers[0], layers[1], layers[0]):
    ENCODED[0] = 0
    v3plan.run(pq, *lay, dptab, dplen, dpcu, max_seqlen_q=40)
    encoded.append(ENCODED[0])
out["prefill v3 maps"] = encoded
out["prefill v3 layers"] = [launches(lambda: v3plan.run(pq, *lay, dptab, dplen, dpcu, max_seqlen_q=40),
                                     dict(q=pq, k=lay[0], v=lay[1], tables=dptab, lens=dplen, cu=dpcu))[0]["args"][3:6]
                            for lay in layers]
n_plans = len(cr.PLANS)
cr.paged_prefill_pools(pq, wpool, wpool, dptab, dplen, dpcu, config=V3)       # rows TMA cannot read: eager
numpy_call = launches(lambda: cr.paged_prefill_pools(pq.get(), ppool[0].get(), ppool[1].get(), ptab, plen, pcu,
                                                     config=V3), {})            # NumPy arrays: v3's eager call
out["prefill v3 eager"] = len(cr.PLANS) == n_plans and [x["name"] for x in numpy_call] == ["paged_prefill_v3"]
# v3 is the default (out of policy.HELD_BACK): a call naming no version plans and launches it
# (a change of the gate is a change of the code, so no plan made before it survives: the cache starts empty)
kept = dict(cr.PLANS._plans)
cr.PLANS.clear()
released = launches(lambda: cr.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=40), {})
planned_v3 = [p.record.version for p in cr.PLANS._plans.values()]
eager_default = launches(lambda: PP.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=40), {})
out["prefill v3 released"] = [[x["name"] for x in released], planned_v3, [x["name"] for x in eager_default]]
cr.PLANS.clear()
cr.PLANS._plans.update(kept)
out["prefill v3 default"] = [cr.PagedPrefillPlan(pq, *ppool, dptab, dplen, dpcu, config=c).record.version
                             for c in (None, PP3.HopperPagedPrefillConfig())]
# ... and held back again, the default is v2
cr.policy.HELD_BACK[("paged_prefill", "v3")] = "the test holds it back"
out["prefill v3 held back"] = [cr.PagedPrefillPlan(pq, *ppool, dptab, dplen, dpcu, config=c).record.version
                               for c in (None, PP3.HopperPagedPrefillConfig())]
del cr.policy.HELD_BACK[("paged_prefill", "v3")]
cr.PLANS.clear()
cr.PLANS._plans.update(kept)
count("prefill v3", lambda: cr.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=40, config=V3))
count("prefill v3 plan.run", lambda: v3plan.run(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=40))

# a bad call of the new plans: the same ValueError on a hit (a plan of its key, or of the shapes,
# is cached), on a miss (an empty cache) and from the eager path; the cache is unchanged either way
out["bad"] = {}


def bad(label, fn, eager, hit=True):
    got = {}
    before = set(cr.PLANS._plans)
    for where in ("hit", "miss") if hit else ("miss",):
        if where == "miss":
            cr.PLANS.clear()
        try:
            fn()
            got[where] = None
        except ValueError as e:
            got[where] = str(e)
        got[where + " unchanged"] = set(cr.PLANS._plans) == (before if where == "hit" else set())
        if where == "miss":
            for key in before:                                  # put the cached plans back
                cr.PLANS._plans[key] = saved[key]
    if eager is not None:
        try:
            eager()
            got["eager"] = None
        except ValueError as e:
            got["eager"] = str(e)
    out["bad"][label] = got


saved = dict(cr.PLANS._plans)
bad("mla seq_lens", lambda: cr.mla_decode(mq, mkv, seq_lens=np.array([400, 1, 0])),
    lambda: M.mla_decode(mq, mkv, seq_lens=np.array([400, 1, 0])))
bad("mla q", lambda: cr.mla_decode(arr(3, 80, 512), mkv), lambda: M.mla_decode(arr(3, 80, 512), mkv))
bad("mla kv", lambda: cr.mla_decode(mq, mkv.get()), lambda: M.mla_decode(mq, mkv.get()))
bad("mla block_tables", lambda: cr.paged_mla_decode(mq, mpool, mtab + 19, mplens),
    lambda: M.paged_mla_decode(mq, mpool, mtab + 19, mplens))
bad("mla pool", lambda: cr.paged_mla_decode(mq, arr(20, 48, 576), mdt, mdpl),
    lambda: M.paged_mla_decode(mq, arr(20, 48, 576), mdt, mdpl))
cr.hopper.available = cr.hopper.checks.available = lambda: "the stand-in CuPy has no TMA"
bad("mla config", lambda: cr.mla_decode(mq, mkv), lambda: M.mla_decode(mq, mkv), hit=False)   # no Hopper
bad("gather block_table short", lambda: cr.gather_pools(*pools, gt, 81), lambda: G.gather_pools(*pools, gt, 81))
bad("gather block_table ids", lambda: cr.gather_pools(*pools, ht + 16, 70),
    lambda: G.gather_pools(*pools, ht + 16, 70))
bad("gather seq_len", lambda: cr.gather_pools(*pools, gt, -1), lambda: G.gather_pools(*pools, gt, -1))
bad("gather v_pool", lambda: cr.gather_pools(pools[0], arr(20, 16, 2, 64), gt, 70),
    lambda: G.gather_pools(pools[0], arr(20, 16, 2, 64), gt, 70))
bad("backward do", lambda: cr.attention_backward(fdo[:1], fq, fk, fv, fo, flse),
    lambda: ik.attention_backward(fdo[:1].get(), fq.get(), fk.get(), fv.get(), fo.get(), flse.get(), backend="tiled"))
bad("backward causal", lambda: ik.attention_backward(fdo, fq, fk, fv, fo, flse, causal=1, backend="cupy"), None)
bad("backward config", lambda: cr.attention_backward(fdo, fq, fk, fv, fo, flse, config=cr.DecodeConfig()),
    lambda: Bk.attention_backward(fdo, fq, fk, fv, fo, flse, config=cr.DecodeConfig()))
bad("backward lse", lambda: cr.attention_backward(fdo, fq, fk, fv, fo, flse.view(np.int32)), None)

bad("prefill block_tables", lambda: cr.paged_prefill_pools(pq, *ppool, ptab + 17, plen, pcu),
    lambda: PP.paged_prefill_pools(pq, *ppool, ptab + 17, plen, pcu))
bad("prefill seq_lens", lambda: cr.paged_prefill_pools(pq, *ppool, ptab, plen * 2, pcu),
    lambda: PP.paged_prefill_pools(pq, *ppool, ptab, plen * 2, pcu))
bad("prefill cu_seqlens_q", lambda: cr.paged_prefill_pools(pq, *ppool, ptab, np.array([30, 20], np.int32), pcu),
    lambda: PP.paged_prefill_pools(pq, *ppool, ptab, np.array([30, 20], np.int32), pcu))
bad("prefill max_seqlen_q", lambda: cr.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=51),
    lambda: PP.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=51))
bad("prefill max_seqlen_q short", lambda: cr.paged_prefill_pools(pq, *ppool, ptab, plen, pcu, max_seqlen_q=39),
    lambda: PP.paged_prefill_pools(pq, *ppool, ptab, plen, pcu, max_seqlen_q=39))
bad("prefill causal", lambda: cr.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, causal="yes"),
    lambda: PP.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, causal="yes"), hit=False)
bad("prefill cu_seqlens_q device", lambda: cr.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu[:2]),
    lambda: PP.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu[:2]), hit=False)
bad("prefill q", lambda: cr.paged_prefill_pools(arr(50, 3, 64), *ppool, dptab, dplen, dpcu),
    lambda: PP.paged_prefill_pools(arr(50, 3, 64), *ppool, dptab, dplen, dpcu), hit=False)
cr.hopper.available = cr.hopper.checks.available = lambda: None                  # v3 runs here
for name, args_, kw_, hit_ in (("block_tables", (ptab + 17, plen, pcu), {}, True),
                               ("seq_lens", (ptab, plen * 2, pcu), {}, True),
                               ("cu_seqlens_q", (ptab, np.array([30, 20], np.int32), pcu), {}, True),
                               ("max_seqlen_q", (dptab, dplen, dpcu), dict(max_seqlen_q=51), True),
                               ("causal", (dptab, dplen, dpcu), dict(causal="yes"), False)):
    bad(f"prefill {name} v3", lambda: cr.paged_prefill_pools(pq, *ppool, *args_, config=V3, **kw_),
        lambda: PP3.paged_prefill_pools(pq, *ppool, *args_, config=V3, **kw_), hit=hit_)
bad("prefill q v3", lambda: cr.paged_prefill_pools(arr(50, 6, 64), *ppool, dptab, dplen, dpcu, config=V3),
    lambda: PP3.paged_prefill_pools(arr(50, 6, 64), *ppool, dptab, dplen, dpcu, config=V3), hit=False)
bad("prefill block_size v3", lambda: cr.paged_prefill_pools(pq, arr(20, 12, 2, 64), arr(20, 12, 2, 64), dptab, dplen,
                                                            dpcu, config=V3),
    lambda: PP3.paged_prefill_pools(pq, arr(20, 12, 2, 64), arr(20, 12, 2, 64), dptab, dplen, dpcu, config=V3),
    hit=False)
cr.hopper.available = cr.hopper.checks.available = lambda: "the stand-in CuPy has no TMA"

# a bad call raises naming the argument, and leaves the cache as it was
n = len(cr.PLANS)
for label, fn in (("k", lambda: cr.decode(q[:, :3], k, v)), ("seq_lens", lambda: cr.decode(q, k, v, seq_lens=[1, 2])),
                  ("num_splits", lambda: cr.decode(q, k, v, num_splits=0)),
                  ("hit num_splits", lambda: cr.decode(q, k, v, num_splits=True)),      # True == 1: a plan's key
                  ("hit causal", lambda: cr.attention(aq, ak, av, causal=1)),
                  ("hit scale", lambda: cr.decode(q, k, v, scale=True)),
                  ("hit float seq_lens", lambda: cr.decode(q, k, v, seq_lens=lens.astype(float))),
                  ("config", lambda: cr.decode(q, k, v, config=cr.ForwardConfig())),
                  ("hit seq_lens", lambda: cr.decode(q, k, v, seq_lens=np.array([302, 0, 7]))),
                  ("block_tables", lambda: cr.paged_decode_pools(q, *pools, tables + 30, plens, num_splits=2))):
    try:
        fn()
        out["errors"][label] = None
    except ValueError as e:
        out["errors"][label] = str(e)
out["unchanged"] = len(cr.PLANS) == n

# under capture: host lengths are refused (a graph would bake them in), device ones pin the plan
P = importlib.import_module("iokernels.cupy_raw.plans")
host_plan, dev_plan = cr.DecodePlan(q, k, v, seq_lens=lens), cr.DecodePlan(q, k, v, seq_lens=dl)
import torch
out["cpu torch lens"] = cr.DecodePlan(q, k, v, seq_lens=torch.from_numpy(np.asarray(lens))).lens_mode
real = P._capturing
P._capturing = lambda *a: True
try:
    host_plan.run(q, k, v, seq_lens=lens)
    out["capture host"] = None
except ValueError as e:
    out["capture host"] = str(e)
dev_plan.run(q, k, v, seq_lens=dl)
cr.hopper.available = cr.hopper.checks.available = lambda: None
plans = dict(gather=cr.GatherPlan(*pools, gt, 70), gather_host=cr.GatherPlan(*pools, ht, 70),
             backward=cr.BackwardPlan(fdo, fq, fk, fv, fo, flse), mla=cr.MLADecodePlan(mq, mkv, seq_lens=mdl),
             mla_host=cr.MLADecodePlan(mq, mkv, seq_lens=mlens), gather_strided=cr.GatherPlan(*strided, gt, 70),
             backward_strided=cr.BackwardPlan(fdo, wq, fk, fv, fo, flse),
             mla_paged=cr.PagedMLADecodePlan(mq, mpool, mdt, mdpl),
             mla_paged_host=cr.PagedMLADecodePlan(mq, mpool, mtab, mplens),
             prefill=cr.PagedPrefillPlan(pq, *ppool, dptab, dplen, dpcu),
             prefill_host=cr.PagedPrefillPlan(pq, *ppool, ptab, plen, pcu),
             prefill_mixed=cr.PagedPrefillPlan(pq, *ppool, dptab, plen, dpcu),
             prefill_v3=cr.PagedPrefillPlan(pq, *ppool, dptab, dplen, dpcu, config=V3),
             prefill_v3_host=cr.PagedPrefillPlan(pq, *ppool, ptab, dplen, dpcu, config=V3))
calls = dict(gather=lambda p: p.run(*pools, gt, 70), gather_host=lambda p: p.run(*pools, ht, 70),
             gather_strided=lambda p: p.run(*strided, gt, 70),
             backward_strided=lambda p: p.run(fdo, wq, fk, fv, fo, flse),
             mla_paged=lambda p: p.run(mq, mpool, mdt, mdpl), mla_paged_host=lambda p: p.run(mq, mpool, mtab, mplens),
             backward=lambda p: p.run(fdo, fq, fk, fv, fo, flse), mla=lambda p: p.run(mq, mkv, mdl),
             mla_host=lambda p: p.run(mq, mkv, mlens), prefill=lambda p: p.run(pq, *ppool, dptab, dplen, dpcu),
             prefill_host=lambda p: p.run(pq, *ppool, ptab, plen, pcu),
             prefill_mixed=lambda p: p.run(pq, *ppool, dptab, plen, dpcu),
             prefill_v3=lambda p: p.run(pq, *ppool, dptab, dplen, dpcu),
             prefill_v3_host=lambda p: p.run(pq, *ppool, ptab, dplen, dpcu))
out["capture"] = {}
for name, plan_ in plans.items():
    try:
        calls[name](plan_)
        out["capture"][name] = plan_.pinned
    except ValueError as e:
        out["capture"][name] = str(e)
cr.hopper.available = cr.hopper.checks.available = lambda: "the stand-in CuPy has no TMA"
P._capturing = real
out["pinned"] = [host_plan.pinned, dev_plan.pinned]

count("ik.decode", lambda: ik.decode(q, k, v, backend="cupy"))
count("ik.attention", lambda: ik.attention(aq, ak, av, backend="cupy"))
plan = cr.DecodePlan(q, k, v, seq_lens=dl)
count("plan.run", lambda: plan.run(q, k, v, seq_lens=dl))
count("pools", lambda: cr.paged_decode_pools(q, *pools, dt, dln))
count("gather", lambda: cr.gather_pools(*pools, gt, 70))
count("backward", lambda: ik.attention_backward(fdo, fq, fk, fv, fo, flse, causal=True, backend="cupy"))
bplan = cr.BackwardPlan(fdo, fq, fk, fv, fo, flse, config=cr.BackwardConfig(deterministic=True))
count("backward plan.run", lambda: bplan.run(fdo, fq, fk, fv, fo, flse))
count("prefill", lambda: cr.paged_prefill_pools(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=40))
count("prefill plan.run", lambda: pplan.run(pq, *ppool, dptab, dplen, dpcu, max_seqlen_q=40))


def via(fn):
    """How fn's launches went: through the packed arguments and the driver, or CuPy's launch."""
    cupy.LAUNCHES.clear()
    fn()
    return [L["via"] for L in cupy.LAUNCHES]


hits = [lambda: cr.decode(q, k, v, seq_lens=lens, num_splits=5),
        lambda: cr.paged_decode_pools(q, *pools, tables, plens, num_splits=2),
        lambda: cr.attention(aq, ak, av)]
out["via packed"] = [via(fn) for fn in hits]

# decode v8 (Hopper: Q, K, V through tensor maps, which encode the arrays' addresses; the stand-in
# maps of the Hopper forward): the plan packs its arguments once per address triple, so a layer loop
# over three caches launches what three eager calls launch, through the driver, and a hit neither
# encodes nor looks up a map; a group of 32 over a contiguous cache takes v8 by default
V8D = importlib.import_module("iokernels.cupy_raw.decode_v8_config")
cr.hopper.available = cr.hopper.checks.available = lambda: None
cr.hopper.tensor_map = HA.tensor_map
V8 = cr.DecodeConfig("v8")
gq = arr(3, 64, 128)
gcaches = [[arr(3, 2, 301, 128), arr(3, 2, 301, 128)] for _ in range(3)]
gv = arr(3, 2, 600, 128)[:, :, :301]                                      # a view of a longer cache
for cfg in (None, V8, cr.DecodeConfig("v8", fused=False, stages=2)):
    for splits in (None, 1, 3):
        for lens_ in (None, lens, dl):
            kw = dict(seq_lens=lens_, num_splits=splits, config=cfg)
            where = {None: "none", "numpy": "host"}.get(type(lens_).__module__ if lens_ is not None else None, "device")
            case(f"decode v8 {cfg} {splits} {where} lengths",
                 lambda: D.decode(gq, *gcaches[0], **kw), lambda: cr.decode(gq, *gcaches[0], **kw),
                 dict(q=gq, k=gcaches[0][0], v=gcaches[0][1], lens=dl))
case("decode v8 view", lambda: D.decode(gq, gv, gv, config=V8), lambda: cr.decode(gq, gv, gv, config=V8),
     dict(q=gq, k=gv, v=gv))
gplan = cr.DecodePlan(gq, *gcaches[0], seq_lens=dl, num_splits=3)
V8D._MAPS.clear()
eager_layers = [launches(lambda: D.decode(gq, *c, seq_lens=dl, num_splits=3), {}) for c in gcaches]
planned = [[launches(lambda: gplan.run(gq, *c, seq_lens=dl), {}) for c in gcaches] for _ in range(2)]
ENCODES = [0]
keep_map = cr.hopper.tensor_map
cr.hopper.tensor_map = lambda *a: ENCODES.__setitem__(0, ENCODES[0] + 1) or keep_map(*a)
V8D._MAPS.clear()                    # a map looked up again would now be encoded again, and counted
third = [launches(lambda: gplan.run(gq, *c, seq_lens=dl), {}) for c in gcaches]
out["decode v8 layers"] = dict(eager=eager_layers, planned=planned, third=third, encodes=ENCODES[0],
                               version=gplan.record.version,
                               distinct=len({json.dumps(x[0]["args"][:3]) for x in eager_layers}))
cr.hopper.tensor_map = keep_map
out["via packed v8"] = [via(lambda: gplan.run(gq, *c, seq_lens=dl)) for c in gcaches]
count("decode v8", lambda: cr.decode(gq, *gcaches[0], seq_lens=dl, config=V8))
count("decode v8 plan.run", lambda: gplan.run(gq, *gcaches[1], seq_lens=dl))
cr.hopper.available = cr.hopper.checks.available = lambda: "the stand-in CuPy has no TMA"
# where a plan's arguments do not pack (ArgBuffer.of says None), its runs take CuPy's launch, the same
from iokernels.cupy_raw.packed import ArgBuffer
ArgBuffer.of = classmethod(lambda cls, args, slots=(): None)
cr.PLANS.clear()
case("unpacked decode", lambda: D.decode(q, k, v, seq_lens=lens, num_splits=5),
     lambda: cr.decode(q, k, v, seq_lens=lens, num_splits=5), io)
case("unpacked pools", lambda: D.paged_decode_pools(q, *pools, tables, plens, num_splits=2),
     lambda: cr.paged_decode_pools(q, *pools, tables, plens, num_splits=2), io_p)
case("unpacked attention", lambda: F.attention(aq, ak, av), lambda: cr.attention(aq, ak, av),
     dict(q=aq, k=ak, v=av))
out["via unpacked"] = [via(fn) for fn in hits]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONPATH=f"{STAND_INS}{os.pathsep}{REPO}")
    r = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_cached_call_launches_what_the_eager_call_launches(result):
    assert len(result["cases"]) > 40
    for label, c in result["cases"].items():
        assert c["eager"], label
        if "device" in label:                  # the eager path uploads a host copy of the lengths
            for e, s in zip(c["eager"], c["second"]):
                assert (e["name"], e["grid"], e["smem"]) == (s["name"], s["grid"], s["smem"]), label
            assert "lens" in c["second"][0]["args"], label
        else:
            assert c["first"] == c["eager"] == c["second"], label
        assert c["hit"], label
    # decode_combine.cu's combine planned and packed like decode.cu's, after the split kernel
    parallel = [c for label, c in result["cases"].items() if "combine='parallel'" in label]
    assert len(parallel) >= 7 and any(len(c["second"]) == 2 for c in parallel)
    for c in parallel:
        assert [x["name"] for x in c["second"][1:]] in ([], ["decode_combine_parallel"])


def test_decode_v9_launches_v4_where_its_deal_is_declined(result):
    """decode v9 without a split count: at three sequences (fewer pairs than a wave's blocks) the
    launch, eager and planned, is v4's own kernel on v4's (S, Hkv, B) grid; at a wave of blocks + 8
    pairs it is v9's kernel on a (G, 1, 1) grid of at most one wave; a named split count (the pools
    case's 2) runs v4's splits as runs of v9's kernel, one block a split."""
    v9 = {label: c for label, c in result["cases"].items()
          if label.startswith(("decode v9", "pools DecodeConfig(version='v9'"))}
    assert len(v9) == 5, sorted(v9)
    for label, c in v9.items():
        first = c["second"][0]
        if "B=68" in label:
            assert first["name"] == "decode_split_v9" and first["grid"][1:] == [1, 1] and first["grid"][0] <= 264
        elif label.startswith("pools"):                # num_splits=2 named: v4's splits as runs of v9's kernel
            assert first["name"] == "decode_split_v9" and first["grid"] == [3 * 2 * 2, 1, 1], label
        else:
            assert first["name"] == "decode_split_v4" and first["grid"][1:] == [2, 3], label


def test_a_hit_launches_through_the_packed_arguments_and_else_through_cupy(result):
    """A cached call's kernels go through their packed arguments and the driver (the decode's
    combine too, where a launch does not fuse it); where the arguments do not pack, every
    launch is CuPy's, and launches what the eager call launches (the cases "unpacked ...")."""
    assert [set(v) for v in result["via packed"]] == [{"driver"}] * 3
    assert all(set(v) == {"cupy"} for v in result["via unpacked"])
    assert {"unpacked decode", "unpacked pools", "unpacked attention"} <= set(result["cases"])


def test_the_backward_gather_and_mla_plans_launch_what_the_eager_calls_launch(result):
    cases = result["cases"]
    back = [c for label, c in cases.items() if "backward" in label]
    names = {c["second"][1]["name"] for c in back if len(c["second"]) == 3}
    assert len(back) >= 60 and names == {"bwd_main", "bwd_v2_main"}
    for c in back:                                     # rowsum, main loop, finish: all three planned
        assert [x["name"] for x in c["second"]] == ["bwd_rowsum", c["second"][1]["name"], "bwd_finish"]
        assert c["second"][1]["args"][:5] == ["q", "k", "v", "do", "lse"] or c["second"][1]["args"][0] == "new"
    det = [c for label, c in cases.items() if "backward" in label and "deterministic=True" in label]
    atomic = [c for label, c in cases.items() if "backward" in label and "deterministic=False" in label]
    assert det and atomic and all("DETERMINISTIC=1" in " ".join(c["second"][1]["options"]) for c in det)
    gather = [c for label, c in cases.items() if label.startswith("gather")]
    assert len(gather) >= 14 and result["gather empty"] == [True, True]
    assert all(c["second"][0]["name"] == "paged_gather" for c in gather)
    mla = [c for label, c in cases.items() if label.startswith("mla")]
    assert len(mla) == 14 and all(c["second"][0]["name"] == "mla_decode" for c in mla)
    paged = cases["mla paged device tables"]["second"][0]["args"]
    assert "tables" in paged and "lens" in paged                 # used in place: no host copy
    assert any(len(c["second"]) == 2 and c["second"][1]["name"] == "decode_combine" for c in mla)
    assert result["gather lengths share a plan"]           # the length is a run argument, not a key
    assert result["backward no queries"] == [True, True]
    assert result["mla no rows"] == [True, True]                 # O = 0, LSE = -inf, nothing launched


def test_a_bad_backward_gather_or_mla_call_raises_the_same_on_a_hit_and_a_miss(result):
    for label, got in result["bad"].items():
        name = label.split()[1]
        msgs = {got[w] for w in ("hit", "miss", "eager") if w in got}
        assert len(msgs) == 1 and None not in msgs, (label, got)
        assert got["miss"].startswith(name) or name == "config" and got["miss"].startswith("q:"), (label, got)
        assert all(v for w, v in got.items() if w.endswith("unchanged")), (label, got)


def test_under_capture_the_new_plans_pin_or_refuse_host_values(result):
    cap = result["capture"]
    assert cap["gather"] is True and cap["backward"] is True and cap["mla"] is True
    assert cap["gather_host"].startswith("block_table: a CUDA graph reads the table")
    assert cap["mla_host"].startswith("seq_lens: a CUDA graph reads the lengths")
    assert cap["mla_paged"] is True and cap["mla_paged_host"].startswith("block_tables: a CUDA graph reads")
    # a CuPy copy made during a capture goes back to CuPy's pool while the graph keeps writing it
    assert cap["gather_strided"].startswith("k_pool: a CUDA graph would replay its contiguous copy")
    assert cap["backward_strided"].startswith("q: a CUDA graph would replay its unit-stride copy")


def test_the_hopper_forward_is_planned_too(result):
    """The default at 300 rows over 300 keys is v9 (few key tiles: policy.hopper_forward_for_length),
    a config naming v8 runs v8; each through a plan whose launch is the eager one's."""
    from iokernels.cupy_raw import policy
    hop = {label: c for label, c in result["cases"].items() if label.startswith("hopper")}
    assert len(hop) == 4 and all(c["hit"] and c["eager"] == c["first"] == c["second"] for c in hop.values())
    assert {policy.hopper_forward_for_length(128, 300, 300, w) for w in ((-1, -1), (-1, 0), (100, 7))} == {"v9"}
    names = sorted(c["second"][0]["name"] for c in hop.values())
    assert names == ["fa_v8", "fa_v9", "fa_v9", "fa_v9"]


def test_the_persistent_forward_is_planned_with_its_own_counter(result):
    """v9 through a plan: the launch eager attention makes (grid min(tiles, SMs or blocks) in a
    row, the batch and a counter after v8's arguments), the plan's counter made once for the stream
    and reused by the next call (both are no input: 'new')."""
    v9 = {label: c for label, c in result["cases"].items() if label.startswith("persistent")}
    assert len(v9) == 2
    for label, c in v9.items():
        assert c["hit"] and c["eager"] == c["first"] == c["second"], label
        (launch,) = c["second"]
        assert launch["name"] == "fa_v9" and launch["grid"][1:] == [1, 1] and launch["args"][-1] == "new"
        assert launch["args"][-2] == "int32:np.int32(2)"
    blocks = [c["second"][0]["grid"][0] for label, c in sorted(v9.items())]
    assert 5 in blocks and max(blocks) == 2 * 4 * 3                      # 24 query tiles, fewer than the SMs


def test_a_quantized_cache_is_planned_with_its_device_scales_read_in_place(result):
    cases = {k: c for k, c in result["cases"].items() if k.startswith("pools quant")}
    assert len(cases) == 16
    for label, c in cases.items():
        (split, *_) = c["second"]
        assert "ks" in split["args"] and "vs" in split["args"], label      # the scales, not a copy of them
    assert result["quant host scales"] == [True, True]     # NumPy scales: no plan, the eager launches


def test_device_lengths_and_tables_are_used_in_place(result):
    s = result["cases"]["pools device tables"]["second"][0]["args"]
    assert "tables" in s and "lens" in s                   # used in place: no host copy
    (g,), (h,) = result["gather"], result["gather host"]
    assert g["args"][:3] == ["k", "v", "table"] and h["args"][:3] == ["k", "v", "new"]
    assert g["args"][3:] == h["args"][3:] and g["grid"] == h["grid"]


def test_a_bad_call_raises_naming_the_argument_and_caches_nothing(result):
    errs = result["errors"]
    for name, msg in errs.items():
        assert msg is not None and msg.startswith(name.split()[-1]), (name, msg)
    assert result["unchanged"]


def test_under_capture_host_lengths_are_refused_and_device_ones_pin_the_plan(result):
    assert result["capture host"].startswith("seq_lens: a CUDA graph reads the lengths")
    assert result["pinned"] == [False, True]


def test_lengths_in_a_cpu_torch_tensor_are_host_values(result):
    assert result["cpu torch lens"] == "host"


def test_the_plan_cache_is_bounded_and_keeps_pinned_plans():
    from iokernels.cupy_raw.plans import PlanCache

    class Plan:
        def __init__(self, pinned=False):
            self.pinned = pinned
    c = PlanCache(maxsize=3)
    c.put("a", Plan(pinned=True))
    for key in "bcde":
        c.put(key, Plan())
    assert len(c) == 3 and c.get("a") is not None and c.get("b") is None and c.get("c") is None   # a is pinned
    c.get("d")                                             # used: now the most recent
    c.put("f", Plan())
    assert c.get("e") is None and c.get("d") is not None and (c.hits, c.misses) == (3, 6)


def test_torch_streams_come_from_the_raw_pointer_where_torch_has_it(monkeypatch):
    """A torch tensor's stream: torch's private raw-pointer function by device index where it
    exists (one C call), else torch.cuda.current_stream(device).cuda_stream."""
    from types import SimpleNamespace

    from iokernels.cupy_raw import plans

    class Tensor:
        device = "cuda:2"

        def get_device(self):
            return 2
    asked = []
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(
        current_stream=lambda device: asked.append(device) or SimpleNamespace(cuda_stream=777)))
    monkeypatch.setattr(plans, "_RAW_STREAM", [lambda index: 1000 + index, fake_torch])
    assert plans._torch_stream_ptr(Tensor()) == 1002 and asked == []
    monkeypatch.setattr(plans, "_RAW_STREAM", [None, fake_torch])
    assert plans._torch_stream_ptr(Tensor()) == 777 and asked == ["cuda:2"]


#: what a hit must not repeat: the checks, the device facts, the registry, the array views
NOT_ON_A_HIT = {"check_qkv", "check_decode", "dtype_name", "device_array", "device_info", "need", "resolve",
                "defines", "function", "split_static", "split_dynamic", "decode_wave_splits", "kind_of"}


def test_decode_v8_is_planned_and_packed_once_per_address_triple(result):
    """Decode v8 (its Q, K, V are tensor maps, which hold the arrays' addresses) through a plan:
    every call launches what the eager call launches, the default at a group of 32 is v8, a layer
    loop over three caches launches three different map triples through the driver, and a run of
    a triple seen before encodes no map (its packed arguments are kept per address triple)."""
    v8 = {label: c for label, c in result["cases"].items() if label.startswith("decode v8")}
    assert len(v8) == 28
    for label, c in v8.items():
        assert c["hit"] and c["first"] == c["second"], label
        assert c["second"][0]["name"] == "decode_split_v8", label
        if "device" in label:               # the eager call uploads a host copy of the lengths
            assert [x["args"][:3] for x in c["eager"]] == [x["args"][:3] for x in c["second"]], label
            assert c["second"][0]["args"][3] == "lens", label
        else:
            assert c["eager"] == c["second"], label
    layers = result["decode v8 layers"]
    assert layers["version"] == "v8" and layers["distinct"] == 3
    assert layers["planned"][0] == layers["planned"][1] == layers["third"] == layers["eager"]
    assert layers["encodes"] == 0
    # 32 heads x 128 leave the merge to decode.cu's combine (policy.decode_fuse_combine): both through the driver
    assert result["via packed v8"] == [["driver", "driver"]] * 3
    assert not {"v8_maps", "args_v8", "tensor_map"} & set(result["names"]["decode v8 plan.run"])


def test_a_hit_costs_few_python_calls(result):
    for label, bound in HIT_CALL_BOUND.items():
        assert 0 < result["calls"][label] <= bound, (label, result["calls"][label])
        assert not NOT_ON_A_HIT & set(result["names"][label]), (label, NOT_ON_A_HIT & set(result["names"][label]))


def test_the_paged_prefill_plan_launches_what_the_eager_call_launches(result):
    """Every registered version, device / host / mixed tables, lengths and offsets, the grid's
    bound: the cached launch equals the eager one argument by argument (checked above with the
    others); a layer loop passes each layer's pools and the same device values; calls the plan
    cannot take (NumPy pools, pools whose rows the eager call copies) run eagerly, uncached."""
    pre = {label: c for label, c in result["cases"].items() if label.startswith("prefill")}
    assert len(pre) >= 64 and all(c["hit"] for c in pre.values())
    names = {c["second"][0]["name"] for c in pre.values()}
    assert names == {f"paged_prefill_{v}" for v in PLANNED_PREFILL}
    dev = [c for label, c in pre.items() if "['cupy', 'cupy', 'cupy']" in label]
    assert dev and all(c["second"][0]["args"][3:6] == ["tables", "lens", "cu"] for c in dev)   # used in place
    assert result["prefill layers"] == [["q", "k", "v", "tables", "lens", "cu"]] * 3
    # v2 packs the 4 query heads of a KV head into a tile's rows: 40 rows x 4 heads over 64-row
    # tiles, a block a KV head; v1 a block a query head
    grids = {v: pre[f"prefill PagedPrefillConfig(version='{v}', num_warps=None, block_k=None) {{}} "
                    "['cupy', 'cupy', 'cupy'] 40"]["second"][0]["grid"] for v in ("v1", "v2")}
    assert grids == {"v1": [1, 8, 2], "v2": [3, 2, 2]}
    assert result["prefill eager"] and result["prefill empty"]
    # v3 packs the 4 query heads of a KV head into 128-row tiles: 40 rows x 4 heads, a block a KV head
    v3 = pre["prefill HopperPagedPrefillConfig(version='v3', block_n=None, stages=None, pingpong=True) {} "
             "['cupy', 'cupy', 'cupy'] 40"]["second"][0]
    assert v3["grid"] == [2, 2, 2] and v3["block"] == [384] and "-arch=sm_90a" in v3["options"]
    assert all(a.startswith("ndarray:") for a in v3["args"][:3])       # the tensor maps of q and the pools
    assert result["prefill v3 layers"] == [["tables", "lens", "cu"]] * 3
    assert result["prefill v3 eager"]          # rows TMA cannot read in place, NumPy arrays: v3's eager call, uncached
    assert result["prefill v3 default"] == ["v3", "v3"]    # a config naming no version: the default (v3)
    assert result["prefill v3 held back"] == ["v2", "v2"]  # ... v2 while v3 is in policy.HELD_BACK
    # a call naming no version plans and launches v3, eager calls too
    assert result["prefill v3 released"] == [["paged_prefill_v3"], ["v3"], ["paged_prefill_v3"]]


def test_the_paged_prefill_v3_plan_encodes_its_tensor_maps_once_per_address_set(result):
    """Run with one layer's pools (3 maps: q, K pool, V pool), the same again (none), another
    layer's (3), the first again (none: the plan keeps the maps of its last few address sets)."""
    assert result["prefill v3 maps"] == [3, 0, 3, 0]


def test_under_capture_the_paged_prefill_plan_pins_or_refuses_host_values(result):
    cap = result["capture"]
    assert cap["prefill"] is True
    assert cap["prefill_host"].startswith("block_tables: a CUDA graph reads the tables, lengths and offsets")
    assert cap["prefill_mixed"].startswith("seq_lens: a CUDA graph reads the tables, lengths and offsets")
    assert cap["prefill_v3"] is True and cap["prefill_v3_host"] == cap["prefill_host"]
