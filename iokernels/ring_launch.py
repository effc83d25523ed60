"""``python -m iokernels ring``: ring attention on W local processes, checked and counted.

Starts W ranks with :func:`iokernels.core.launch.launch` (gloo on CPU processes, NCCL when
each rank has a GPU), runs a seeded problem through :func:`~iokernels.context_parallel.ring_attention`
and its backward, gathers the shards and holds them against the float64 oracle, and
prints, per rank, the bytes sent and received (counted, and the closed-form model).

``--bench`` times instead of checking: per rank, a ring step (median of ``--reps``), the
same blocks computed with no communication, the same transfers with no computation, and
the fraction of the communication hidden behind the computation,

    hidden = (t_compute + t_comm - t_ring) / t_comm,   clipped to [0, 1].

Exit status: 0 when every check passes, 1 when one fails (error or byte count), 2 when a
rank fails or the run times out (the message names the rank; no process is left).
``--fail-rank R`` (or IOKERNELS_RING_FAIL_RANK=R in the environment) makes rank R raise
before the ring starts: the launcher's failure path, exercised on purpose.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from . import context_parallel as cp
from .core import conventions as cv
from .core import reference, testing

#: the environment variable that injects a failure on one rank (the tests use it)
FAIL_ENV = "IOKERNELS_RING_FAIL_RANK"
#: a problem small enough for CPU processes, awkward on purpose (N not a multiple of W or 2W, GQA)
DEFAULT_CASE = dict(batch=1, heads_q=4, heads_kv=2, seqlen=203, head_dim=32, dtype="float64")


def _case_inputs(case):
    rng = np.random.default_rng(case["seed"])
    return testing.make_inputs(rng, batch=case["batch"], heads_q=case["heads_q"], heads_kv=case["heads_kv"],
                               seqlen_q=case["seqlen"], seqlen_k=case.get("seqlen_k"),
                               head_dim=case["head_dim"], dtype=case["dtype"], with_grad=True)


def _fail_if_asked(rank, payload):
    if payload.get("fail_rank") is not None and int(payload["fail_rank"]) == rank:
        raise RuntimeError(f"injected failure on rank {rank} ({FAIL_ENV} / --fail-rank)")


# --------------------------------------------------------------------------- the rank's work
def check_worker(rank, world_size, device, payload):
    """One rank: run every case of ``payload["cases"]``; return this rank's shards and counters.

    ``payload["world_sizes"]`` (optional) runs the cases on sub-groups of ranks 0..W-1 for
    each W listed, so one launch covers several ring sizes; the result is then a dict
    {W: [case results]} (empty lists on ranks outside a sub-group).
    """
    import torch.distributed as dist
    _fail_if_asked(rank, payload)
    sizes = payload.get("world_sizes")
    if sizes is None:
        return _run_cases(rank, world_size, device, payload["cases"], None)
    out = {}
    for W in sizes:
        group = dist.new_group(list(range(W))) if W < world_size else None   # every rank joins the call
        out[W] = _run_cases(rank, W, device, payload["cases"], group) if rank < W else []
    return out


def _run_cases(rank, world_size, device, cases, group):
    from .torch_sdpa import _to_torch
    out = []
    for case in cases:
        q, k, v, do = _case_inputs(case)
        q_pos = cp.split_positions(q.shape[2], world_size, case["split"])
        kv_pos = cp.split_positions(k.shape[2], world_size, case["split"])
        tq, tdo = (cp.shard(_to_torch(x), q_pos[rank]).contiguous().to(device) for x in (q, do))
        tk, tv = (cp.shard(_to_torch(x), kv_pos[rank]).contiguous().to(device) for x in (k, v))
        kw = dict(seqlen_q=q.shape[2], seqlen_k=k.shape[2], causal=case["causal"], split=case["split"],
                  backend=case["backend"], group=group)
        fs, bs = cp.RingStats(rank=rank), cp.RingStats(rank=rank)
        o, lse = cp.ring_attention(tq, tk, tv, stats=fs, **kw)
        res = dict(o=cp._np(o), lse=cp._np(lse), fwd=fs.as_dict())
        if case.get("backward", True):
            dq, dk, dv = cp.ring_attention_backward(tdo, tq, tk, tv, o, lse, stats=bs, **kw)
            res.update(dq=cp._np(dq), dk=cp._np(dk), dv=cp._np(dv), bwd=bs.as_dict())
        out.append(res)
    return out


def _sync(device):
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def _median_time(fn, device, reps):
    import torch.distributed as dist
    times = []
    for _ in range(reps + 1):                                   # the first run is a warm-up
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def bench_worker(rank, world_size, device, payload):
    """One rank of ``--bench``: time a ring forward, its computation alone, its transfers alone."""
    import torch
    import torch.distributed as dist
    _fail_if_asked(rank, payload)
    case, reps = payload["case"], payload["reps"]
    W, N, split = world_size, case["seqlen"], case["split"]
    pos = cp.split_positions(N, W, split)
    gen = torch.Generator(device=device).manual_seed(case["seed"] * 1000 + rank)
    dt = getattr(torch, case["dtype"])

    def rand(h, n):
        return torch.randn((case["batch"], h, n, case["head_dim"]), generator=gen, device=device, dtype=dt)

    q, k, v = rand(case["heads_q"], cp._length(pos[rank])), *(rand(case["heads_kv"], cp._length(pos[rank]))
                                                               for _ in range(2))
    kw = dict(seqlen_q=N, causal=case["causal"], split=split, backend=case["backend"])
    kv_of = [torch.stack([rand(case["heads_kv"], cp._length(p)), rand(case["heads_kv"], cp._length(p))])
             for p in pos]                                      # same-shaped stand-ins for the W blocks
    scale = cv.default_scale(case["head_dim"])
    null = cp.RingStats(rank=rank)

    def compute_only():
        for s in range(W):
            c = (rank - s) % W
            cp._block_forward(q, kv_of[c], cp.block_schedule(pos[rank], pos[c], case["causal"]), scale,
                              case["backend"], None, null)

    kv = torch.stack([k, v])

    def comm_only():
        buf = kv
        for s in range(W - 1):
            nxt = torch.empty_like(kv_of[(rank - s - 1) % W])
            ops = [dist.P2POp(dist.isend, buf, (rank + 1) % W), dist.P2POp(dist.irecv, nxt, (rank - 1) % W)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            buf = nxt

    t_ring = _median_time(lambda: cp.ring_attention(q, k, v, **kw), device, reps)
    t_comp = _median_time(compute_only, device, reps)
    t_comm = _median_time(comm_only, device, reps) if W > 1 else 0.0
    hidden = min(1.0, max(0.0, (t_comp + t_comm - t_ring) / t_comm)) if t_comm > 0 else None
    return dict(rank=rank, t_ring=t_ring, t_compute=t_comp, t_comm=t_comm, hidden=hidden)


# --------------------------------------------------------------------------- the launcher side
def check_results(case, world_size, shards):
    """Gather the shards of one case and hold them against the oracle; a dict of findings."""
    q, k, v, do = _case_inputs(case)
    q_pos = cp.split_positions(q.shape[2], world_size, case["split"])
    kv_pos = cp.split_positions(k.shape[2], world_size, case["split"])
    O, LSE = reference.attention(q, k, v, causal=case["causal"])
    got = dict(o=unshard_key(shards, "o", q_pos), lse=unshard_key(shards, "lse", q_pos))
    refs = dict(o=O, lse=LSE)
    base = {}
    low = case["dtype"] != "float64"
    if low:
        from .api import attention, attention_backward
        bo, bl = attention(q, k, v, causal=case["causal"], backend="naive", return_lse=True)
        base.update(o=bo, lse=bl)
    backward = "dq" in shards[0]
    if backward:
        dQ, dK, dV = reference.attention_backward(do, q, k, v, causal=case["causal"])
        refs.update(dq=dQ, dk=dK, dv=dV)
        got.update(dq=unshard_key(shards, "dq", q_pos), dk=unshard_key(shards, "dk", kv_pos),
                   dv=unshard_key(shards, "dv", kv_pos))
        if low:
            g = attention_backward(do, q, k, v, bo, bl, causal=case["causal"], backend="naive")
            base.update(dq=g[0], dk=g[1], dv=g[2])
    checks = [testing.check(got[n], refs[n], base.get(n), dtype=case["dtype"], name=n,
                            factor=testing.GRADIENT_FACTOR if n.startswith("d") else testing.FORWARD_FACTOR)
              for n in refs]
    model = dict(fwd=cp.comm_model(k.shape[2], world_size, case["split"], batch=case["batch"],
                                   heads_kv=case["heads_kv"], head_dim=case["head_dim"], dtype=case["dtype"]),
                 bwd=cp.comm_model(k.shape[2], world_size, case["split"], batch=case["batch"],
                                   heads_kv=case["heads_kv"], head_dim=case["head_dim"], dtype=case["dtype"],
                                   backward=True))
    counted = {p: [dict(sent=s[p]["sent"], received=s[p]["received"]) for s in shards] for p in model
               if p in shards[0]}
    bytes_ok = all(c["sent"] == m["sent"] and c["received"] == m["received"]
                   for p in counted for c, m in zip(counted[p], model[p]))
    return dict(checks=checks, counted=counted, model=model, bytes_ok=bytes_ok,
                ok=bytes_ok and all(checks), pairs=[s["fwd"]["pairs"] for s in shards],
                events=[s["fwd"]["events"] for s in shards])


def unshard_key(shards, key, positions):
    return cp.unshard([s[key] for s in shards], positions)


def run_checks(cases, world_size, *, dist_backend="gloo", timeout=120.0, fail_rank=None, world_sizes=None):
    """Launch one world that runs every case; check each against the oracle.

    Returns a list of result dicts (one per case); with ``world_sizes``, the world has
    max(world_sizes) ranks and the result is {W: [one per case]} for each ring size W.
    """
    from .core.launch import launch
    n = max(world_sizes) if world_sizes else world_size
    per_rank = launch(check_worker, n, dict(cases=cases, fail_rank=fail_rank, world_sizes=world_sizes),
                      backend=dist_backend, timeout=timeout)

    def checked(W, rows):
        return [check_results(case, W, [rows[r][i] for r in range(W)]) for i, case in enumerate(cases)]

    if not world_sizes:
        return checked(world_size, per_rank)
    return {W: checked(W, [per_rank[r][W] for r in range(W)]) for W in world_sizes}


def print_check(case, world_size, res):
    print(f"ring attention: W={world_size}, split={case['split']}, causal={case['causal']}, "
          f"backend={case['backend']}, B={case['batch']} Hq={case['heads_q']} Hkv={case['heads_kv']} "
          f"N={case['seqlen']} d={case['head_dim']} {case['dtype']}")
    for c in res["checks"]:
        print(f"  {c}")
    print("  bytes per rank (counted / model):")
    for p in res["counted"]:
        for r, (c, m) in enumerate(zip(res["counted"][p], res["model"][p])):
            cs, cr = sum(c["sent"].values()), sum(c["received"].values())
            print(f"    {p} rank {r}: sent {cs} / {m['bytes_sent']}, received {cr} / {m['bytes_received']}")
    print(f"  (query, key) pairs computed per rank (forward): {res['pairs']}")
    print(f"  counted bytes equal the model: {'yes' if res['bytes_ok'] else 'NO'}")
    print("  verdict:", "ok" if res["ok"] else "FAIL")


def _parser():
    p = argparse.ArgumentParser(prog="python -m iokernels ring",
                                description="Ring attention on W local processes (torch.distributed).")
    p.add_argument("--world-size", type=int, default=2, help="processes on the ring (default 2)")
    p.add_argument("--backend", default=None, choices=cp.RING_BACKENDS,
                   help="local kernel for the blocks (default: tiled on CPU, torch_fused on GPUs)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cpu: gloo; cuda: NCCL, one GPU per rank; auto: cuda when every rank can have a GPU")
    p.add_argument("--seqlen", type=int, default=DEFAULT_CASE["seqlen"], help="tokens per sequence")
    p.add_argument("--seqlen-k", type=int, default=None, help="key tokens (non-causal only; default seqlen)")
    p.add_argument("--batch", type=int, default=DEFAULT_CASE["batch"])
    p.add_argument("--heads", type=int, default=DEFAULT_CASE["heads_q"], help="query heads")
    p.add_argument("--heads-kv", type=int, default=DEFAULT_CASE["heads_kv"], help="K/V heads (GQA)")
    p.add_argument("--head-dim", type=int, default=DEFAULT_CASE["head_dim"])
    p.add_argument("--dtype", default=None, choices=("float64", "float32", "bfloat16", "float16"),
                   help="default float64 on CPU, bfloat16 on GPUs")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--split", default="zigzag", choices=cp.SPLITS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (default 300)")
    p.add_argument("--fail-rank", type=int, default=None, help=f"make this rank raise (also {FAIL_ENV})")
    p.add_argument("--bench", action="store_true", help="time a ring step instead of checking")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions for --bench (default 5)")
    return p


def _device_kind(choice, world_size):
    if choice != "auto":
        return choice
    try:
        import torch
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("ring: needs PyTorch with torch.distributed (pip install 'iokernels[torch]')", file=sys.stderr)
        return 2
    from .core.launch import RankFailed
    kind = _device_kind(args.device, args.world_size)
    fail = args.fail_rank if args.fail_rank is not None else os.environ.get(FAIL_ENV)
    case = dict(batch=args.batch, heads_q=args.heads, heads_kv=args.heads_kv, seqlen=args.seqlen,
                seqlen_k=args.seqlen_k, head_dim=args.head_dim, causal=args.causal, split=args.split,
                seed=args.seed, backward=not args.no_backward,
                dtype=args.dtype or ("bfloat16" if kind == "cuda" else "float64"),
                backend=args.backend or ("torch_fused" if kind == "cuda" else "tiled"))
    dist_backend = "nccl" if kind == "cuda" else "gloo"
    try:
        cp.split_positions(args.seqlen, args.world_size, args.split)      # bad sizes fail here, not in W ranks
        if args.causal and args.seqlen_k not in (None, args.seqlen):
            raise ValueError(f"--seqlen-k: causal ring attention needs seqlen_k == seqlen ({args.seqlen})")
        if args.bench:
            from .core.launch import launch
            rows = launch(bench_worker, args.world_size, dict(case=case, reps=args.reps, fail_rank=fail),
                          backend=dist_backend, timeout=args.timeout)
            print(f"ring bench: W={args.world_size} ({dist_backend}), split={case['split']}, "
                  f"causal={case['causal']}, backend={case['backend']}, N={case['seqlen']} "
                  f"d={case['head_dim']} {case['dtype']}")
            for r in rows:
                hid = "n/a" if r["hidden"] is None else f"{r['hidden']:.2f}"
                print(f"  rank {r['rank']}: ring step {r['t_ring'] * 1e3:.3f} ms, compute alone "
                      f"{r['t_compute'] * 1e3:.3f} ms, comm alone {r['t_comm'] * 1e3:.3f} ms, "
                      f"comm hidden {hid}")
            return 0
        res = run_checks([case], args.world_size, dist_backend=dist_backend, timeout=args.timeout,
                         fail_rank=fail)[0]
    except RankFailed as e:
        print(f"ring: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"ring: {e}", file=sys.stderr)
        return 2
    print_check(case, args.world_size, res)
    return 0 if res["ok"] else 1
