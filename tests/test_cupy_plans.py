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

#: Python calls inside iokernels/ a cached call may make (a hit: key, plan.run, pack, launch)
HIT_CALL_BOUND = {"ik.decode": 40, "ik.attention": 35, "plan.run": 36, "pools": 48, "hopper": 35}

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
            cr.DecodeConfig("v3", fused=False), cr.DecodeConfig("v4")):
    for splits in (None, 1, 5):
        for lens_ in (None, lens):
            kw = dict(seq_lens=lens_, num_splits=splits, config=cfg)
            case(f"decode {cfg} {splits} {lens_ is not None}", lambda: D.decode(q, k, v, **kw),
                 lambda: cr.decode(q, k, v, **kw), io)
    kw = dict(seq_lens=lens, config=cfg, window=(100, 0), scale=0.3)
    case(f"decode window {cfg}", lambda: D.decode(q, k, v, **kw), lambda: cr.decode(q, k, v, **kw), io)
dl = cupy.asarray(lens.astype(np.int32))
io_l = dict(io, lens=dl)
case("decode device lens", lambda: D.decode(q, k, v, seq_lens=dl, num_splits=3),
     lambda: cr.decode(q, k, v, seq_lens=dl, num_splits=3), io_l)

pools = [arr(20, 16, 2, 128), arr(20, 16, 2, 128)]
tables = np.array([[3, 1, 4, 9, 0], [2, 6, 5, 0, 0], [7, 8, 10, 11, 12]], np.int32)
plens = np.array([70, 20, 80], np.int32)
io_p = dict(q=q, k=pools[0], v=pools[1])
for cfg in (None, cr.DecodeConfig("v1"), cr.DecodeConfig("v3"), cr.DecodeConfig("v4")):
    kw = dict(num_splits=2, config=cfg)
    case(f"pools {cfg}", lambda: D.paged_decode_pools(q, *pools, tables, plens, **kw),
         lambda: cr.paged_decode_pools(q, *pools, tables, plens, **kw), io_p)
dt, dln = cupy.asarray(tables), cupy.asarray(plens)
case("pools device tables", lambda: D.paged_decode_pools(q, *pools, dt, dln, num_splits=2),
     lambda: cr.paged_decode_pools(q, *pools, dt, dln, num_splits=2), dict(io_p, tables=dt, lens=dln))

gt = cupy.asarray(np.array([3, 1, 4, 9, 0], np.int32))
out["gather"] = launches(lambda: cr.gather_pools(*pools, gt, 70), dict(k=pools[0], v=pools[1], table=gt))
out["gather host"] = launches(lambda: cr.gather_pools(*pools, np.array([3, 1, 4, 9, 0]), 70),
                              dict(k=pools[0], v=pools[1], table=gt))

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
for kw in (dict(), dict(causal=True), dict(window=(100, 7))):
    hq, hk, hv = arr(2, 4, 300, 128), arr(2, 2, 300, 128), arr(2, 2, 300, 128)
    case(f"hopper attention {kw}", lambda: F.attention(hq, hk, hv, **kw), lambda: cr.attention(hq, hk, hv, **kw),
         dict(q=hq, k=hk, v=hv))
count("hopper", lambda: ik.attention(hq, hk, hv, backend="cupy"))
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
real = P._capturing
P._capturing = lambda *a: True
try:
    host_plan.run(q, k, v, seq_lens=lens)
    out["capture host"] = None
except ValueError as e:
    out["capture host"] = str(e)
dev_plan.run(q, k, v, seq_lens=dl)
P._capturing = real
out["pinned"] = [host_plan.pinned, dev_plan.pinned]

count("ik.decode", lambda: ik.decode(q, k, v, backend="cupy"))
count("ik.attention", lambda: ik.attention(aq, ak, av, backend="cupy"))
plan = cr.DecodePlan(q, k, v, seq_lens=dl)
count("plan.run", lambda: plan.run(q, k, v, seq_lens=dl))
count("pools", lambda: cr.paged_decode_pools(q, *pools, dt, dln))
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


def test_the_hopper_forward_is_planned_too(result):
    hop = [c for label, c in result["cases"].items() if label.startswith("hopper")]
    assert len(hop) == 3 and all(c["second"][0]["name"] == "fa_v5" for c in hop)


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


#: what a hit must not repeat: the checks, the device facts, the registry, the array views
NOT_ON_A_HIT = {"check_qkv", "check_decode", "dtype_name", "device_array", "device_info", "need", "resolve",
                "defines", "function", "split_static", "split_dynamic", "decode_wave_splits", "kind_of"}


def test_a_hit_costs_few_python_calls(result):
    for label, bound in HIT_CALL_BOUND.items():
        assert 0 < result["calls"][label] <= bound, (label, result["calls"][label])
        assert not NOT_ON_A_HIT & set(result["names"][label]), (label, NOT_ON_A_HIT & set(result["names"][label]))
