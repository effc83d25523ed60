"""Start W ranks on this machine with torch.multiprocessing and collect what each returns.

One function, :func:`launch`, for every multi-process run of the package (ring attention's
launcher and its tests).  It is careful about the three ways such runs go wrong:

* ports: the rendezvous store is hosted by the launching process on a port the
  operating system picks (port 0), and the ranks connect to it, so two runs on one
  machine never collide and nothing guesses a "free" port that another run then takes;
* a failing rank: its traceback comes back through a queue, the other ranks (which
  would otherwise wait for it forever) are terminated, and :class:`RankFailed` names
  the rank and the error;
* a hang: a wall-clock ``timeout`` for the whole run, after which every rank is
  terminated (then killed); no process is left behind in any case.

Process-group backends: "gloo" (CPU processes) and "nccl" (one GPU per rank: rank r uses
device r mod the device count).  NCCL_NVLS_ENABLE=0 is set in every rank's environment
(NVLink multicast stays off).
"""
from __future__ import annotations

import datetime
import os
import queue as _queue
import time
import traceback
from typing import Any

#: seconds a terminated rank is given to exit before it is killed
TERMINATE_GRACE_S = 5.0
#: how often the launcher looks at the queue and at the ranks' exit codes (seconds)
POLL_S = 0.1
#: after a first failure, how long to gather the other ranks' reports: the rank that failed
#: first is the cause, the others usually fail because it went away (seconds)
GATHER_S = 2.0
#: the environment every rank gets, whatever the caller's
RANK_ENV = {"NCCL_NVLS_ENABLE": "0"}
HOST = "127.0.0.1"


class RankFailed(RuntimeError):
    """A rank raised, died or the run timed out; the message says which and why."""


def _rank_main(rank, world_size, port, backend, fn, payload, results, timeout):
    """A rank's entry point: join the process group, run ``fn``, report to the launcher."""
    os.environ.update(RANK_ENV)
    try:
        import torch
        import torch.distributed as dist
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        store = dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=timeout))
        kw: dict[str, Any] = dict(device_id=device) if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout), **kw)
        # every rank has joined before any runs: a rank whose fn returns at once would otherwise
        # tear its connections down while a slower peer is still connecting to it (gloo's
        # connectFullMesh then fails in the peer, "Connection closed by peer")
        dist.barrier()
        out = fn(rank, world_size, device, payload)
        dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException as e:  # noqa: BLE001 -- everything goes back to the launcher
        # reported at once, before this process's connections close and its peers fail too
        results.put(("error", rank, (time.time(), f"{type(e).__name__}: {e}", traceback.format_exc())))
        raise SystemExit(1)


def _stop(procs):
    """Terminate every rank still running, then kill what does not exit; join them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn, world_size: int, payload=None, *, backend: str = "gloo", timeout: float = 120.0):
    """Run ``fn(rank, world_size, device, payload)`` on ``world_size`` processes; return its results.

    ``fn`` must be a module-level function (the ranks are started with "spawn") and
    return something picklable.  Results come back as a list indexed by rank.  Raises
    :class:`RankFailed` (after stopping every rank) if a rank raises or dies, or if the
    run takes longer than ``timeout`` seconds; ValueError for bad arguments.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
    if backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("backend: 'nccl' needs a CUDA GPU per rank; none is visible (use 'gloo')")
    store = dist.TCPStore(HOST, 0, None, True, datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)      # port 0: the OS picks a free one
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, store.port, backend, fn, payload, results,
                                                  timeout), daemon=True)
             for r in range(world_size)]
    out: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    failure = None
    deadline = time.monotonic() + timeout
    gather_until = float("inf")       # set when the first error arrives: then wait GATHER_S for the rest
    try:
        for p in procs:
            p.start()
        while len(out) + len(errors) < world_size and failure is None:
            try:
                status, rank, value = results.get(timeout=POLL_S)
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in out and r not in errors]
                if errors and time.monotonic() > gather_until:
                    break
                if dead and not errors:
                    failure = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                elif time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in out]
                    failure = f"timed out after {timeout:g} s waiting for rank(s) {waiting}"
                continue
            if status == "ok":
                out[rank] = value
            else:
                if not errors:
                    gather_until = time.monotonic() + GATHER_S
                errors[rank] = value
    finally:
        _stop(procs)
        results.close()
        del store
    if errors:
        first, *later = sorted(errors, key=lambda r: errors[r][0])
        also = "".join(f"\n  then rank {r} failed: {errors[r][1].splitlines()[0]}" for r in later)
        failure = f"rank {first} failed: {errors[first][1]}{also}\n{errors[first][2]}"
    if failure is not None:
        raise RankFailed(failure)
    return [out[r] for r in range(world_size)]
