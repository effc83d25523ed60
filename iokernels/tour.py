"""The tour: the whole progression on one small problem, in under a minute.

``python -m iokernels tour`` (or ``bash dev.sh tour``) runs every step of the
progression on an embedded problem and prints one line per step and backend:

=================  ==========================================================
max err vs f64     max |out - oracle| against the float64 reference (outputs,
                   LSE and gradients; the largest of them)
check              FlashAttention's rule: float64 within ~1e-12; lower precision
                   within 2x (3x for gradients) of the naive algorithm's error in
                   the same precision (:mod:`iokernels.core.testing`)
counted B          HBM bytes counted while the NumPy kernel ran (:func:`traffic.count`)
modelled B         the closed-form prediction for the same run (:func:`traffic.model`);
                   ``=`` between them when they agree exactly
time               wall-clock seconds of that one call on this machine (NumPy, with
                   the counting on; GPU backends: the first call, so compilation and
                   copies back to NumPy included): to compare steps, not to benchmark
                   (``python -m iokernels bench`` times kernels properly)
=================  ==========================================================

Each step is labelled with the number of the notebook that teaches it (01-10, 09a).

Steps: naive forward; tiled forward in FlashAttention-1 and -2 loop orders, and with
FlashAttention-4's conditional rescaling (notebook 09a; the note counts the skipped rescales); backward
(naive and tiled); paged gather; split-KV decode and paged decode; then the GPU
backends: Numba CUDA (on the simulator at a tiny size when there is no GPU), CuPy
(GPU only), torch SDPA.  A backend that cannot run on this machine prints
``skipped: <reason>``; a step that raises prints ``FAILED: <error>`` and the tour
exits non-zero at the end.

The GPU backends do not count traffic (there are no HBM wrappers on a device); their
modelled bytes are left out.  Under each step, a line starting ``->`` says what to read
off it (:func:`conclusion`), e.g. how many of naive attention's bytes the tiled kernel
moves, and why.  Figures go to ``out/figures/`` (``--out`` to change it, ``--no-figures``
for none), a folder git ignores: the tour never changes a tracked file.  ``python -m
iokernels figures`` (``bash dev.sh figures``) is the one command that rewrites the
committed ``figures/``.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["Problem", "DEFAULT", "SMALL", "SIMULATOR", "Row", "run", "nvidia_device_present"]


@dataclass(frozen=True)
class Problem:
    """One attention problem: GQA, Nq != Nk, lengths not multiples of the tile, causal."""

    batch: int = 1
    heads_q: int = 4
    heads_kv: int = 2
    seqlen_q: int = 200
    seqlen_k: int = 264
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    decode_lens: tuple = (264, 173)       # one ragged decode batch (one query per sequence)
    block_size: int = 16                  # paged KV block size (vLLM's default)

    def describe(self) -> str:
        heads = f"Hq={self.heads_q}, Hkv={self.heads_kv}"
        mask = "causal (bottom-right)" if self.causal else "no mask"
        return (f"B={self.batch}, {heads}, Nq={self.seqlen_q}, Nk={self.seqlen_k}, d={self.head_dim}, "
                f"{self.dtype}, {mask}; decode lengths {list(self.decode_lens)}")

    def shape_kw(self) -> dict:
        return dict(batch=self.batch, heads_q=self.heads_q, heads_kv=self.heads_kv,
                    seqlen_q=self.seqlen_q, seqlen_k=self.seqlen_k, head_dim=self.head_dim)


#: the tour's problem: big enough that tiles, masks and GQA all matter, small enough for NumPy.
DEFAULT = Problem()
#: a quicker one (``--small``), used by the tests.
SMALL = Problem(heads_q=2, heads_kv=1, seqlen_q=72, seqlen_k=100, head_dim=32, decode_lens=(100, 41))
#: the Numba simulator runs every GPU thread in Python: keep it tiny.
SIMULATOR = Problem(heads_q=2, heads_kv=1, seqlen_q=12, seqlen_k=20, head_dim=8, decode_lens=(20, 9))
#: the Numba kernel version the tour runs on the simulator (on a GPU: the backend's default)
SIMULATOR_NUMBA_VERSION = "v2"


@dataclass
class Row:
    """One line of the tour's table."""

    step: str
    backend: str
    error: float | None = None
    verdict: str = ""
    counted: int | None = None
    modelled: int | None = None
    seconds: float | None = None
    status: str = "ok"                    # "ok" | "skipped" | "failed"
    note: str = ""
    traffic: object = None                # the counted Traffic of a NumPy step, for its conclusion


def nvidia_device_present() -> bool:
    """Is there an NVIDIA device node or driver tool?  (Asked without importing any CUDA library.)"""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


# --------------------------------------------------------------------------- inputs
@dataclass
class _Case:
    """Inputs of one problem and their float64 oracle, plus naive baselines in the same dtype."""

    p: Problem
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    ref: tuple                            # (O, LSE) float64
    qd: np.ndarray                        # decode queries (B, Hq, d)
    kd: np.ndarray
    vd: np.ndarray
    lens: np.ndarray
    ref_decode: tuple
    base: dict = field(default_factory=dict)   # naive results in the same precision


def _case(p: Problem, seed: int) -> _Case:
    from .core import reference, testing
    rng = np.random.default_rng(seed)
    q, k, v, do = testing.make_inputs(rng, dtype=p.dtype, with_grad=True, **p.shape_kw())
    B, n = len(p.decode_lens), max(p.decode_lens)
    qd, kd, vd = testing.make_inputs(rng, batch=B, heads_q=p.heads_q, heads_kv=p.heads_kv, seqlen_q=1,
                                     seqlen_k=n, head_dim=p.head_dim, dtype=p.dtype)
    qd = np.ascontiguousarray(qd[:, :, 0])
    lens = np.asarray(p.decode_lens, dtype=np.int64)
    return _Case(p, q, k, v, do, reference.attention(q, k, v, causal=p.causal), qd, kd, vd, lens,
                 reference.decode(qd, kd, vd, seq_lens=lens))


def _checked(pairs, factor=None):
    """Max error and verdict over several (out, ref64, baseline) triples."""
    from .core import testing
    kw = {} if factor is None else {"factor": factor}
    checks = [testing.check(o, r, b, **kw) for o, r, b in pairs]
    return max(c.error for c in checks), ("ok" if all(checks) else "FAIL")


# --------------------------------------------------------------------------- steps
def _forward(c: _Case, backend: str, loop_order: str | None = None, model: str | None = None, config=None,
             convert=None):
    """One forward run, checked against the oracle.  ``convert`` maps the NumPy inputs to the
    backend's own arrays first (e.g. torch CUDA tensors), outside the timed region."""
    import iokernels as ik
    from .core import traffic
    if loop_order is not None:
        config = ik.TileConfig(loop_order=loop_order)
    q, k, v = (c.q, c.k, c.v) if convert is None else (convert(c.q), convert(c.k), convert(c.v))
    t0 = time.perf_counter()
    with traffic.count() as t:
        o, lse = ik.attention(q, k, v, causal=c.p.causal, backend=backend, config=config, return_lse=True)
        o, lse = _to_numpy(o), _to_numpy(lse)      # waits for device work: the time includes it
    dt = time.perf_counter() - t0
    if backend == "naive":
        c.base["forward"] = (o, lse)
    bo, bl = c.base.get("forward", (None, None))
    err, verdict = _checked([(o, c.ref[0], bo), (lse, c.ref[1], bl)])
    counted = modelled = None
    if model is not None:
        counted = t.total
        modelled = traffic.model(model, dtype=c.p.dtype, causal=c.p.causal, config=config,
                                 **c.p.shape_kw()).total
    return Row("", backend, err, verdict, counted, modelled, dt, traffic=t if model is not None else None)


#: FlashAttention-4's conditional-rescaling threshold for 16-bit inputs (log2 units)
FA4_RESCALE_THRESHOLD = 8.0


def _conditional_rescale(c: _Case):
    """The FA2 forward with FlashAttention-4's conditional rescaling: checked and counted like
    the others, then run once more to count the rescales it skipped."""
    import iokernels as ik
    from . import tiled
    config = ik.TileConfig(rescale_threshold=FA4_RESCALE_THRESHOLD)
    row = _forward(c, "tiled", model="fa2", config=config)
    count = tiled.RescaleCount()
    tiled.forward_fa2(c.q, c.k, c.v, causal=c.p.causal, scale=c.p.head_dim ** -0.5, window=None, config=config,
                      rescale_stats=count)
    row.note = f"{count.skipped:,} of {count.needed:,} rescales skipped"
    return row


def _backward(c: _Case, backend: str, model: str):
    import iokernels as ik
    from .core import reference, traffic
    if "ref_grad" not in c.base:
        c.base["ref_grad"] = reference.attention_backward(c.do, c.q, c.k, c.v, causal=c.p.causal)
        c.base["fwd_tiled"] = ik.attention(c.q, c.k, c.v, causal=c.p.causal, backend="tiled",
                                           return_lse=True)
    o, lse = c.base["fwd_tiled"]
    t0 = time.perf_counter()
    with traffic.count() as t:
        grads = ik.attention_backward(c.do, c.q, c.k, c.v, o, lse, causal=c.p.causal, backend=backend)
    dt = time.perf_counter() - t0
    if backend == "naive":
        c.base["grad"] = grads
    base = c.base.get("grad", (None, None, None))
    from .core.testing import GRADIENT_FACTOR
    err, verdict = _checked(zip(grads, c.base["ref_grad"], base), factor=GRADIENT_FACTOR)
    modelled = traffic.model(model, dtype=c.p.dtype, causal=c.p.causal, **c.p.shape_kw()).total
    return Row("", backend, err, verdict, t.total, modelled, dt, traffic=t)


def _paged_cache(c: _Case):
    import iokernels as ik
    p = c.p
    blocks = sum(-(-n // p.block_size) for n in p.decode_lens)
    cache = ik.PagedKVCache(blocks, block_size=p.block_size, num_kv_heads=p.heads_kv, head_dim=p.head_dim,
                            dtype=np.dtype(p.dtype))
    sids = []
    for b, n in enumerate(p.decode_lens):
        sid = cache.new_sequence()
        cache.append(sid, c.kd[b, :, :n].transpose(1, 0, 2), c.vd[b, :, :n].transpose(1, 0, 2))
        sids.append(sid)
    return cache, sids


def _paged_gather(c: _Case):
    from .core import traffic
    cache, sids = _paged_cache(c)
    t0 = time.perf_counter()
    with traffic.count() as t:
        kv = [cache.gather(s) for s in sids]
    dt = time.perf_counter() - t0
    err = max(float(np.max(np.abs(np.asarray(x, np.float64) - ref[b, :, :n])))
              for b, (n, (kk, vv)) in enumerate(zip(c.p.decode_lens, kv))
              for x, ref in ((kk, c.kd), (vv, c.vd)))
    modelled = traffic.model("paged_gather", seq_len=list(c.p.decode_lens), heads_kv=c.p.heads_kv,
                             head_dim=c.p.head_dim, block_size=c.p.block_size, dtype=c.p.dtype).total
    return Row("", "numpy", err, "ok" if err == 0 else "FAIL", t.total, modelled, dt,
               note="a copy: must be exact")


def _decode(c: _Case, paged: bool):
    import iokernels as ik
    from .core import traffic
    if "decode" not in c.base:
        c.base["decode"] = ik.decode(c.qd, c.kd, c.vd, seq_lens=c.lens, backend="naive", return_lse=True)
    kw = dict(batch=len(c.p.decode_lens), heads_q=c.p.heads_q, heads_kv=c.p.heads_kv, head_dim=c.p.head_dim,
              seq_lens=list(c.p.decode_lens), dtype=c.p.dtype)
    if paged:
        cache, sids = _paged_cache(c)
        t0 = time.perf_counter()
        with traffic.count() as t:
            o, lse = ik.paged_decode(c.qd, cache, sids, return_lse=True)
        kind, kw = "paged_decode", dict(kw, block_size=c.p.block_size)
    else:
        t0 = time.perf_counter()
        with traffic.count() as t:
            o, lse = ik.decode(c.qd, c.kd, c.vd, seq_lens=c.lens, return_lse=True)
        kind = "decode"
    dt = time.perf_counter() - t0
    bo, bl = c.base["decode"]
    err, verdict = _checked([(o, c.ref_decode[0], bo), (lse, c.ref_decode[1], bl)])
    return Row("", "tiled", err, verdict, t.total, traffic.model(kind, **kw).total, dt, traffic=t)


def _to_numpy(x):
    from .core.testing import as_numpy
    a = np.asarray(x) if isinstance(x, np.ndarray) else as_numpy(x)
    return a


# --------------------------------------------------------------------------- GPU backends
def _numba_status() -> tuple[bool, str]:
    from .core import gpu
    if not (gpu.simulator_enabled() or nvidia_device_present()):
        return False, "no GPU and NUMBA_ENABLE_CUDASIM is not set (run through `python -m iokernels`)"
    try:
        import iokernels.numba_cuda  # noqa: F401
    except Exception as e:  # ImportError, or numba-cuda failing to find a driver
        return False, f"iokernels.numba_cuda cannot load here ({type(e).__name__}: {e})"
    return True, f"simulator, {SIMULATOR_NUMBA_VERSION}, tiny size" if gpu.simulator_enabled() else "GPU"


def _cupy_status() -> tuple[bool, str]:
    from .core import gpu
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return False, f"CuPy is not installed ({type(e).__name__})"
    if not gpu.cupy_gpu():
        return False, "CuPy needs a CUDA GPU and this machine has none"
    try:
        import iokernels.cupy_raw  # noqa: F401
    except Exception as e:
        return False, f"iokernels.cupy_raw cannot load here ({type(e).__name__}: {e})"
    return True, "GPU"


def _torch_cuda(x):
    """A NumPy array as a torch tensor on the GPU (so SDPA runs there, not on the CPU)."""
    import torch
    return torch.from_numpy(x).to("cuda")


def _torch_status() -> tuple[bool, str]:
    from .core import gpu
    try:
        import torch  # noqa: F401
        import iokernels.torch_sdpa  # noqa: F401
    except Exception as e:
        return False, f"torch backend unavailable ({type(e).__name__}: {e})"
    return True, "CUDA" if gpu.torch_gpu() else "CPU"


# --------------------------------------------------------------------------- conclusions
def _parts(row: Row, p: Problem) -> dict:
    from .core import conventions as cv
    from .core import traffic
    return traffic.decompose(row.traffic, heads=p.batch * p.heads_q, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k,
                             head_dim=p.head_dim, itemsize=cv.itemsize_of(p.dtype))


def _ratio(rows: dict, a: str, b: str):
    ra, rb = rows.get(a), rows.get(b)
    return ra.counted / rb.counted if ra and rb and ra.counted and rb.counted else None


def conclusion(name: str, row: Row, rows: dict, p: Problem) -> str:
    """The one line a learner should read off step ``name`` (rows: the steps so far, by name)."""
    if row.status != "ok" or row.verdict == "FAIL":
        return ""
    if name == "01 naive forward":
        sp = _parts(row, p)["S and P"]
        return f"S and P are {sp / row.counted:.0%} of naive's bytes: N x N intermediates written and read back"
    if name == "03 tiled forward FA1":
        x, parts = _ratio(rows, name, "01 naive forward"), _parts(row, p)
        return (f"FA1 moves {x:.2f}x naive's bytes: no S and P, but Q, O, m, l are re-read once per K/V tile "
                f"({parts['tile re-reads'] / row.counted:.0%} of its bytes)")
    if name == "03 tiled forward FA2":
        x, parts = _ratio(rows, name, "01 naive forward"), _parts(row, p)
        return (f"tiled moves {x:.2f}x naive's bytes: S and P never reach HBM; what is left above the "
                f"mandatory bytes is K/V re-read once per query tile ({parts['tile re-reads'] / row.counted:.0%}), "
                "which a GPU's L2 mostly serves")
    if name == "04 backward naive":
        return "the naive backward moves P, dP and dS through HBM: N x N matrices again"
    if name == "04 backward tiled (FA2)":
        x = _ratio(rows, name, "04 backward naive")
        return f"the tiled backward moves {x:.2f}x the naive backward's bytes: it rebuilds P from O and the LSE"
    if name == "07 paged gather":
        return "a gather reads the cache through the block table and writes it contiguously: exact, 2x the cache"
    if name == "08 decode (split-KV)":
        kv = sum(row.traffic.by_tensor[t][0] for t in ("K", "V"))
        return f"decode reads K and V once: {kv / row.counted:.0%} of its bytes; it is bandwidth-bound"
    if name == "08 paged decode":
        contiguous = rows.get("08 decode (split-KV)")
        if contiguous is None or contiguous.counted is None:
            return ""
        return (f"paged decode moves {row.counted - contiguous.counted:,} B more than contiguous decode: "
                "the block-table entries, nothing else")
    if row.counted is None and row.error is not None:
        return "the same answer as the NumPy kernels, within FlashAttention's accuracy rule"
    return ""


# --------------------------------------------------------------------------- the table
_HEADER = (f"{'step':<26}{'backend':<8}{'max err vs f64':>15}{'check':>7}{'counted B':>14}"
           f"{'':>2}{'modelled B':>13}{'time':>10}")


def _fmt(row: Row, times: bool = True) -> str:
    head = f"{row.step:<26}{row.backend:<8}"
    if row.status != "ok":
        label = "skipped" if row.status == "skipped" else "FAILED"
        return f"{head}{label}: {row.note}"
    err = "-" if row.error is None else f"{row.error:.2e}"
    counted = "-" if row.counted is None else f"{row.counted:,}"
    modelled = "-" if row.modelled is None else f"{row.modelled:,}"
    same = "=" if row.counted is not None and row.counted == row.modelled else (
        "!=" if row.counted is not None and row.modelled is not None else "")
    secs = "-" if row.seconds is None or not times else (f"{row.seconds * 1e3:.1f} ms" if row.seconds < 1 else
                                            f"{row.seconds:.2f} s")
    note = f"  ({row.note})" if row.note else ""
    return f"{head}{err:>15}{row.verdict:>7}{counted:>14}{same:>2}{modelled:>13}{secs:>10}{note}"


def _steps(case: _Case, small_case):
    """(step name, backend, thunk or None, skip reason) in the order of the progression."""
    numba_ok, numba_note = _numba_status()
    cupy_ok, cupy_note = _cupy_status()
    torch_ok, torch_note = _torch_status()

    def gpu_forward(backend, note):
        def run():
            simulated = note.startswith("simulator")
            c = small_case() if simulated else case
            config = None
            if backend == "numba" and simulated:
                # v2 (K/V tiles in shared memory, one thread per row): the simulator runs it in
                # well under a second; v3's warp shuffles take tens of seconds there.
                from .numba_cuda import ForwardConfig
                config = ForwardConfig(version=SIMULATOR_NUMBA_VERSION)
            convert = _torch_cuda if backend == "torch" and note == "CUDA" else None
            row = _forward(c, backend, config=config, convert=convert)
            row.note = note if c is case else f"{note}: {c.p.describe().split(';')[0]}"
            return row
        return run

    return [
        ("01 naive forward", "naive", lambda: _forward(case, "naive", model="naive"), None),
        ("03 tiled forward FA1", "tiled", lambda: _forward(case, "tiled", "fa1", model="fa1"), None),
        ("03 tiled forward FA2", "tiled", lambda: _forward(case, "tiled", "fa2", model="fa2"), None),
        ("09a FA2, FA4 rescaling", "tiled", lambda: _conditional_rescale(case), None),
        ("04 backward naive", "naive", lambda: _backward(case, "naive", "naive_backward"), None),
        ("04 backward tiled (FA2)", "tiled", lambda: _backward(case, "tiled", "fa2_backward"), None),
        ("07 paged gather", "tiled", lambda: _paged_gather(case), None),
        ("08 decode (split-KV)", "tiled", lambda: _decode(case, paged=False), None),
        ("08 paged decode", "tiled", lambda: _decode(case, paged=True), None),
        ("05 Numba CUDA forward", "numba", gpu_forward("numba", numba_note) if numba_ok else None, numba_note),
        ("06 CuPy forward", "cupy", gpu_forward("cupy", cupy_note) if cupy_ok else None, cupy_note),
        ("10 torch SDPA forward", "torch", gpu_forward("torch", torch_note) if torch_ok else None, torch_note),
    ]


def run(problem: Problem = DEFAULT, *, seed: int = 0, figures_dir=None, file=None,
        simulator_problem: Problem = SIMULATOR, times: bool = True) -> list[Row]:
    """Run the tour, printing each row as it finishes; returns the rows.

    ``figures_dir``: where to write the figures afterwards (None: no figures).  ``times``
    False prints "-" for the time of each step (an output that repeats, for documentation).
    """
    out = sys.stdout if file is None else file
    print(f"iokernels tour: {problem.describe()}; seed {seed}", file=out)
    print("(each step is labelled with the notebook that teaches it, notebooks/<label>_*.ipynb)", file=out)
    print("(counted = HBM bytes counted while running; modelled = closed-form formula; "
          "'=' when they agree exactly)", file=out)
    print(_HEADER, file=out, flush=True)
    case = _case(problem, seed)
    small = {}

    def small_case():
        if "c" not in small:
            sim = replace(simulator_problem, dtype=problem.dtype, causal=problem.causal)
            small["c"] = _case(sim, seed)
            _forward(small["c"], "naive")          # the same-precision baseline at that size
        return small["c"]

    rows = []
    for name, backend, thunk, reason in _steps(case, small_case):
        if thunk is None:
            row = Row(name, backend, status="skipped", note=reason)
        else:
            try:
                row = thunk()
                row.step = name
                if row.verdict == "FAIL":
                    row.note = (row.note + "; " if row.note else "") + "error above the bound"
            except Exception as e:  # report and go on: one broken step should not hide the rest
                row = Row(name, backend, status="failed", note=f"{type(e).__name__}: {e}")
        rows.append(row)
        print(_fmt(row, times), file=out, flush=True)
        line = conclusion(name, row, {r.step: r for r in rows}, problem)
        if line:
            print(f"    -> {line}", file=out, flush=True)

    if figures_dir is not None:
        from .viz import figures
        paths = figures.write_all(figures_dir)
        print(f"figures: {len(paths)} written to {figures_dir}: " + ", ".join(p.name for p in paths),
              file=out, flush=True)
    bad = [r for r in rows if r.status == "failed" or r.verdict == "FAIL"]
    skipped = [r for r in rows if r.status == "skipped"]
    print(f"tour done: {len(rows) - len(bad) - len(skipped)} ok, {len(skipped)} skipped, "
          f"{len(bad)} failed", file=out, flush=True)
    return rows
