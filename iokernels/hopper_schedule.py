"""Why Hopper needed a new kernel: a discrete-event model of one SM running attention's tile loop.

An SM has separate units that can work at the same time: a copy engine (Hopper's Tensor
Memory Accelerator, TMA) moving tiles from HBM into shared memory, the tensor cores
(matmuls), the special-function units (SFU: the exponentials of the softmax), and the
CUDA cores (everything else: row maxima, sums, conversions, the rescale of O).  A kernel
is fast when the tensor cores never wait.  FlashAttention-2 prefetches its loads but runs
the softmax between its two matmuls, so the tensor cores idle while the softmax runs;
FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, 2024) overlaps them.  This
module schedules the ops of one thread block's tile loop on the four units and reports how
busy the tensor cores are.

Notation (the papers' names):

=========  ==================================================================
Br, Bc     query rows of the thread block, key/value rows per tile
d          head dim
Tc         K/V tiles the loop visits (``n_tiles``)
S_j        Q_i K_j^T on the tensor cores ("GEMM0"), 2 Br Bc d FLOP
P_j        exp(S_j - m): Br Bc exponentials on the SFU, plus CUDA-core work
O          O += P_j V_j on the tensor cores ("GEMM1"), 2 Br Bc d FLOP
warpgroup  4 warps (128 threads) issuing one wgmma; "consumers" compute, a
           "producer" only issues TMA loads (warp specialization)
=========  ==================================================================

The schedules (:data:`SCHEDULES`), each one idea more than the last, with a readable name
(``SCHEDULES[kind].label``) for plots and tables:

- ``fa2_serial`` "FA2 without prefetch: load, then compute": loads K_j, V_j, GEMM0, softmax,
  GEMM1, strictly in turn, with Ampere's mma.sync.  Not what FlashAttention-2 does: a
  counterfactual, kept to show what the prefetch is worth.
- ``fa2`` "FA2: cp.async prefetch, mma.sync": FlashAttention-2's kernel as its code runs it
  (flash_fwd_kernel.h in the FlashAttention repository): one warpgroup, one shared-memory
  buffer each for K and V; it waits for K_j, issues the copy of V_j, runs GEMM0 while V_j
  arrives, waits for V_j, issues the copy of K_{j+1} (its buffer is free once GEMM0 has read
  it), then runs the softmax and GEMM1 while K_{j+1} arrives.  The loads overlap compute;
  the softmax does not overlap the matmuls.  mma.sync reaches only about two thirds of
  Hopper's tensor-core peak (a footnote of the FlashAttention-3 blog post, citing Luo et al.
  2024, arXiv 2402.13499).
- ``lockstep`` "wgmma in FA2's order": the same order with wgmma (full rate): the new
  instruction, no new overlap.
- ``warp_specialized`` "FA3: warp-specialized": a producer warp issues the loads into a ring
  of ``stages`` shared-memory buffers while the consumer computes; the softmax still sits
  between the GEMMs.
- ``intra_wg_no_ws`` "FA3: intra-warpgroup overlap, no producer": one warpgroup, no producer;
  it issues the next tile's loads itself (asynchronously) and overlaps its softmax of tile j
  with GEMM1 of tile j - 1 (the paper's "GEMM-softmax pipelining" without warp specialization).
- ``pingpong`` "FA3: ping-pong": a producer and two consumer warpgroups of Br / 2 rows each;
  while one runs its softmax the other's GEMMs keep the tensor cores busy.
- ``intra_wg`` "FA3: intra-warpgroup overlap": a producer and one consumer with the
  intra-warpgroup overlap above.
- ``fa3`` "FA3: ping-pong + intra-warpgroup overlap": the full FlashAttention-3 schedule.

:func:`sensitivity` reruns the schedules over a range of ``l2_reuse`` factors: the model's
one free constant, and the check of how far its conclusions can be trusted.

``Problem(sw_exp_fraction=f)`` adds FlashAttention-4's answer to a slow SFU: a share f of
the exponentials is computed by the polynomial on the CUDA cores, at the same time as the
SFU computes the rest (the warp interleaves both kinds of instruction).

Rates per SM come from the roofline GPU table (:data:`iokernels.core.roofline.GPUS`,
datasheet figures): tensor cores = dense FP16 peak / SMs; CUDA cores = FP32 peak / 2 / SMs
instructions per second (an FMA counts 2 FLOP on the datasheet, one instruction here);
copy engine = HBM bandwidth / SMs times ``l2_reuse`` (below); SFU = 16 exponentials per
clock per SM (the CUDA C++ Programming Guide's throughput table, compute capability
8.0 to 10.0) at the clock the FP16 peak implies, peak / (SMs x dense FP16 FLOP per clock
per SM: 2048 on Ampere, A100 whitepaper; 4096 on Hopper, H100 whitepaper; 8192 on
Blackwell, twice Hopper's, FlashAttention-4 paper).  For an H100 SXM that gives 132 x 16
x 1.83 GHz = 3.9 T exponentials/s, the FlashAttention-3 paper's figure.

Frank notes: this is a model of the ordering, not a simulator of the SM.  It has no
register pressure (which caps tile sizes), no issue-slot or warp-scheduler limits, no
latency (every op starts the moment its inputs and its unit are free), no L2 (loads run
at ``l2_reuse`` times the SM's share of HBM bandwidth: the other query tiles of the same
head read the same K/V tiles about the same time, so L2 serves most of them; the factor
is an assumption, not a measurement), and the softmax is three ops instead of
instructions interleaved by the compiler.  So it predicts higher utilisations than the
paper measures, and it does not even get every ordering right: at the default
``L2_REUSE`` warp specialization alone comes out a hair below the intra-warpgroup overlap
without a producer, the reverse of the paper's Table 2 (:data:`PAPER_TABLE2`); ping-pong
alone takes the model nearly all the way from ``fa2`` to the full schedule and the
intra-warpgroup overlap adds nothing on top, where the blog post reports a gain for each
step (:data:`BLOG_STEPS`; :func:`sensitivity` shows how the model's numbers move with
``L2_REUSE`` and FA2's prefetch).  What it shows is the mechanism: which unit
waits for which.
On an A100 (no wgmma, no TMA) and a B200 (tcgen05 instead of wgmma) the schedules after
``fa2`` stand for "the same overlap with that GPU's full-rate matmul and copy engine".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .core import roofline as rl

__all__ = ["SMRates", "Problem", "Op", "Schedule", "ScheduleSpec", "SCHEDULES", "simulate", "run_all",
           "label", "exp_budget", "sfu_share_table", "PAPER_TABLE2", "PAPER_TABLE2_SETTING", "BLOG_STEPS",
           "ablation_comparison", "blog_comparison", "lockstep_bound", "sensitivity", "SENSITIVITY_REUSE"]

#: dense FP16/BF16 tensor-core FLOP per clock per SM, by architecture: Ampere 1024 FMA
#: (NVIDIA A100 Tensor Core GPU Architecture whitepaper), Hopper twice that clock for clock
#: (NVIDIA H100 Tensor Core GPU Architecture whitepaper), Blackwell twice Hopper
#: (FlashAttention-4 paper, Zadouri et al., 2026).  Only used to infer the clock.
TENSOR_FLOP_PER_CLOCK_PER_SM = {"Ampere": 2048, "Hopper": 4096, "Blackwell": 8192}
#: exponentials (ex2) per clock per SM: 16 (CUDA C++ Programming Guide, arithmetic
#: instruction throughput, compute capability 8.0 to 10.0)
SFU_PER_CLOCK_PER_SM = 16
#: mma.sync reaches about two thirds of Hopper's tensor-core peak (a footnote of the
#: FlashAttention-3 blog post, PyTorch blog 2024-07-11, citing Luo et al. 2024, arXiv 2402.13499)
MMA_SYNC_FRACTION = 2 / 3
#: the share of the peak mma.sync reaches, by architecture: Ampere's native instruction (full
#: rate); Hopper's two thirds; Blackwell has no figure here, so the model assumes Hopper's
MMA_SYNC_FRACTION_BY_ARCH = {"Ampere": 1.0, "Hopper": MMA_SYNC_FRACTION, "Blackwell": MMA_SYNC_FRACTION}
#: assumed readers per K/V tile served by L2 for each read from HBM (see the module notes)
L2_REUSE = 4
#: CUDA-core instructions per score: row max + scale-and-subtract (before the exp), then row
#: sum + conversion of P to 16 bits (after it): 2 + 2
OPS_BEFORE_EXP, OPS_AFTER_EXP = 2, 2
#: CUDA-core instructions per software exp2 (FlashAttention-4's, :func:`iokernels.fa4.software_exp2`):
#: clamp (2), floor (1), fraction (1), degree-3 polynomial by Horner (3 FMAs), exponent add (1)
SOFTWARE_EXP2_OPS = 8


@dataclass(frozen=True)
class SMRates:
    """Throughputs of one SM's units, per second: tensor FLOP, exponentials, CUDA-core
    instructions, bytes the copy engine lands in shared memory."""
    name: str
    tensor_flops: float
    sfu_ops: float
    cuda_ops: float
    copy_bytes: float
    mma_sync_fraction: float = MMA_SYNC_FRACTION

    @classmethod
    def from_gpu(cls, gpu="H100 SXM", l2_reuse: float = L2_REUSE) -> "SMRates":
        """The per-SM rates of a GPU of the roofline table (see the module docstring)."""
        g = rl.get_gpu(gpu)
        arch = g.get("arch")
        if arch not in TENSOR_FLOP_PER_CLOCK_PER_SM or not g.get("sms"):
            raise ValueError(f"gpu: the model needs an Ampere, Hopper or Blackwell GPU with an SM count; "
                             f"{g.get('name', gpu)!r} is {arch!r}")
        if not l2_reuse > 0:
            raise ValueError(f"l2_reuse: must be positive, got {l2_reuse!r}")
        sms = g["sms"]
        tensor = g["fp16_tflops"] * rl.TFLOPS / sms
        clock = tensor / TENSOR_FLOP_PER_CLOCK_PER_SM[arch]
        return cls(name=g.get("name", "custom"), tensor_flops=tensor, sfu_ops=SFU_PER_CLOCK_PER_SM * clock,
                   cuda_ops=g["fp32_tflops"] * rl.TFLOPS / 2 / sms,
                   copy_bytes=g["hbm_tbps"] * rl.TB / sms * l2_reuse,
                   mma_sync_fraction=MMA_SYNC_FRACTION_BY_ARCH[arch])


@dataclass(frozen=True)
class Problem:
    """One thread block's tile loop: Br query rows against ``n_tiles`` K/V tiles of Bc rows."""
    head_dim: int = 128
    block_q: int = 128
    block_k: int = 128
    n_tiles: int = 12
    itemsize: int = 2
    stages: int = 2
    sw_exp_fraction: float = 0.0

    def __post_init__(self):
        for name in ("head_dim", "block_q", "block_k", "n_tiles", "itemsize", "stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"problem: {name} must be a positive integer, got {v!r}")
        f = self.sw_exp_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"problem: sw_exp_fraction must be a number in [0, 1], got {f!r}")

    def smem_bytes(self) -> int:
        """Shared memory: Q_i once, and ``stages`` buffers of K_j and V_j."""
        return (self.block_q + 2 * self.stages * self.block_k) * self.head_dim * self.itemsize

    def matmul_flops(self) -> int:
        return 4 * self.block_q * self.block_k * self.head_dim * self.n_tiles


@dataclass
class Op:
    """One op on one unit: issued by ``agent``, in program order; starts when ``deps`` are done."""
    name: str
    agent: str
    unit: str
    seconds: float
    tile: int
    deps: list = field(default_factory=list)
    sync: bool = True            # the agent waits for it before issuing its next op
    start: float | None = None
    end: float | None = None


@dataclass
class Schedule:
    """A simulated schedule: its ops (with start and end), makespan and tensor utilisation."""
    name: str
    ops: list
    makespan: float
    utilisation: float            # matmul FLOPs / (makespan x peak tensor rate)
    busy: dict                    # unit -> fraction of the makespan it was busy

    def __repr__(self):
        return f"Schedule({self.name!r}, makespan={self.makespan:.3e} s, utilisation={self.utilisation:.3f})"


UNITS = ("copy", "tensor", "sfu", "cuda")


class ScheduleSpec(NamedTuple):
    """One schedule's ingredients: its readable name and what it adds, then the switches."""
    label: str           # the readable name plots and tables use
    adds: str            # the one idea it adds
    consumers: int       # consumer warpgroups (2: ping-pong)
    producer: bool       # a producer warp issues the loads (warp specialization)
    intra: bool          # softmax of tile j overlaps GEMM1 of tile j - 1
    mma_sync: bool       # Ampere's mma.sync (about 2/3 of Hopper's peak) instead of wgmma
    prefetch: bool       # FA2's order: each load issued asynchronously a step ahead


#: schedule name -> :class:`ScheduleSpec`, in the order of the ideas
SCHEDULES = {
    "fa2_serial": ScheduleSpec("FA2 without prefetch: load, then compute",
                               "a counterfactual: every load waited for before any compute",
                               1, False, False, True, False),
    "fa2": ScheduleSpec("FA2: cp.async prefetch, mma.sync",
                        "FlashAttention-2's kernel: the next K/V copies overlap compute", 1, False, False, True, True),
    "lockstep": ScheduleSpec("wgmma in FA2's order", "Hopper's full-rate matmul instruction",
                             1, False, False, False, True),
    "warp_specialized": ScheduleSpec("FA3: warp-specialized", "a producer warp issues TMA loads into a ring of buffers",
                                     1, True, False, False, False),
    "intra_wg_no_ws": ScheduleSpec("FA3: intra-warpgroup overlap, no producer",
                                   "softmax of tile j under GEMM1 of tile j-1, loads issued by the consumer",
                                   1, False, True, False, False),
    "pingpong": ScheduleSpec("FA3: ping-pong", "two consumer warpgroups take turns at the tensor cores",
                             2, True, False, False, False),
    "intra_wg": ScheduleSpec("FA3: intra-warpgroup overlap", "a producer, and one consumer with the overlap",
                             1, True, True, False, False),
    "fa3": ScheduleSpec("FA3: ping-pong + intra-warpgroup overlap", "both overlaps: the full FlashAttention-3",
                        2, True, True, False, False),
}


def label(kind: str) -> str:
    """The readable name of schedule ``kind`` ("fa3" -> "FA3: ping-pong + intra-warpgroup overlap")."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {kind!r}")
    return SCHEDULES[kind].label


def _build(kind: str, p: Problem, r: SMRates) -> list:
    """The ops of one schedule, each agent's in program order."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {kind!r}")
    spec = SCHEDULES[kind]
    consumers, producer, intra, mma_sync = spec.consumers, spec.producer, spec.intra, spec.mma_sync
    rows = p.block_q / consumers                                   # each consumer's share of Br
    d, Bc, n = p.head_dim, p.block_k, p.n_tiles
    rate = r.tensor_flops * (r.mma_sync_fraction if mma_sync else 1.0)
    t_load = Bc * d * p.itemsize / r.copy_bytes                   # one of K_j, V_j -> SRAM
    t_gemm = 2 * rows * Bc * d / rate                             # GEMM0 or GEMM1 of one consumer
    t_pre = OPS_BEFORE_EXP * rows * Bc / r.cuda_ops               # row max, scale and subtract
    t_exp = (1 - p.sw_exp_fraction) * rows * Bc / r.sfu_ops       # exp on the SFU
    t_sw = p.sw_exp_fraction * rows * Bc * SOFTWARE_EXP2_OPS / r.cuda_ops   # the rest in software
    t_post = (OPS_AFTER_EXP * rows * Bc + rows * d) / r.cuda_ops  # row sum, convert P, rescale O
    ops = []
    loads = {}
    cnames = [f"consumer {c + 1}" for c in range(consumers)]

    def add(op):
        ops.append(op)
        return op

    def emit_loads(agent, j, sync, deps_k=(), deps_v=()):
        loads[j] = (add(Op(f"load K{j}", agent, "copy", t_load, j, list(deps_k), sync)),
                    add(Op(f"load V{j}", agent, "copy", t_load, j, list(deps_v), sync)))

    gemm0, gemm1 = {}, {}                                         # (consumer, j) -> op
    if spec.prefetch:
        return _build_prefetch(cnames[0], p, t_load, t_gemm, t_pre, t_exp, t_sw, t_post)
    if producer:                                                  # the producer runs ahead, ring-limited
        for j in range(n):
            emit_loads("producer", j, False)
    for c, ag in enumerate(cnames):
        last = None                                               # the agent's previous sync op
        post = {}
        for j in range(n):
            if not producer and (j == 0 or not intra):
                emit_loads(ag, j, True, deps_k=[last] if last else [])
                last = loads[j][1]
            k_j, v_j = loads[j]
            deps0 = [k_j] + ([last] if last else [])
            g0 = gemm0[(c, j)] = add(Op(f"S{j} = Q K{j}^T", ag, "tensor", t_gemm, j, deps0, sync=not intra))
            if intra and j > 0:                                   # GEMM1 of the previous tile, async
                gemm1[(c, j - 1)] = add(Op(f"O += P{j - 1} V{j - 1}", ag, "tensor", t_gemm, j - 1,
                                           [post[j - 1], loads[j - 1][1]], sync=False))
            if not producer and intra and j + 1 < n:              # prefetch tile j + 1, asynchronously
                emit_loads(ag, j + 1, False)
            pre = add(Op(f"max, scale {j}", ag, "cuda", t_pre, j, [g0]))
            ex = [add(Op(f"exp {j}", ag, "sfu", t_exp, j, [pre], sync=not t_sw))]
            if t_sw:                                              # the software share, beside the SFU's
                ex.append(add(Op(f"software exp2 {j}", ag, "cuda", t_sw, j, [pre])))
            deps_post = ex + ([gemm1[(c, j - 1)]] if intra and j > 0 else [])     # rescale O after PV
            post[j] = add(Op(f"sum, convert, rescale {j}", ag, "cuda", t_post, j, deps_post))
            last = post[j]
            if not intra:
                last = gemm1[(c, j)] = add(Op(f"O += P{j} V{j}", ag, "tensor", t_gemm, j, [post[j], v_j]))
        if intra:
            last = gemm1[(c, n - 1)] = add(Op(f"O += P{n - 1} V{n - 1}", ag, "tensor", t_gemm, n - 1,
                                              [post[n - 1], loads[n - 1][1]]))
    if consumers == 2:            # ping-pong's barrier: the consumers take turns at the tensor cores,
        def turn(c, j):           # one turn = the GEMMs issued together in iteration j
            return gemm1[(c, j - 1)] if intra and j > 0 else gemm0[(c, j)]
        for j in range(n):
            gemm0[(1, j)].deps.append(turn(0, j))
            if j > 0:
                gemm0[(0, j)].deps.append(turn(1, j - 1))
    for j in range(p.stages, n):                                  # a buffer is refilled once consumed
        loads[j][0].deps += [gemm0[(c, j - p.stages)] for c in range(consumers)]
        loads[j][1].deps += [gemm1[(c, j - p.stages)] for c in range(consumers)]
    return ops


def _build_prefetch(ag, p, t_load, t_gemm, t_pre, t_exp, t_sw, t_post) -> list:
    """FlashAttention-2's tile loop as flash_fwd_kernel.h orders it: one buffer each for K and V,
    each copy issued asynchronously (cp.async) one step ahead and waited for before its use."""
    ops = []

    def op(*a, **kw):
        ops.append(Op(*a, **kw))
        return ops[-1]

    k_j = op("load K0", ag, "copy", t_load, 0, [], sync=False)          # the prologue's copy
    last = None                                                          # GEMM1 of the tile before
    for j in range(p.n_tiles):
        after = [last] if last else []
        v_j = op(f"load V{j}", ag, "copy", t_load, j, [k_j] + after, sync=False)   # once K_j is in
        g0 = op(f"S{j} = Q K{j}^T", ag, "tensor", t_gemm, j, [k_j] + after)
        if j + 1 < p.n_tiles:                            # wait for V_j, then K_{j+1} into K_j's buffer
            k_j = op(f"load K{j + 1}", ag, "copy", t_load, j + 1, [g0, v_j], sync=False)
        pre = op(f"max, scale {j}", ag, "cuda", t_pre, j, [g0, v_j])
        ex = [op(f"exp {j}", ag, "sfu", t_exp, j, [pre], sync=not t_sw)]
        if t_sw:
            ex.append(op(f"software exp2 {j}", ag, "cuda", t_sw, j, [pre]))
        post = op(f"sum, convert, rescale {j}", ag, "cuda", t_post, j, ex)
        last = op(f"O += P{j} V{j}", ag, "tensor", t_gemm, j, [post, v_j])
    return ops


def simulate(kind: str = "fa3", problem: Problem | None = None, rates: SMRates | None = None) -> Schedule:
    """Schedule one thread block's tile loop: list scheduling, in program order per agent.

    Repeatedly start the op that can start earliest: each agent's next op, once its deps
    have ended, its unit is free, its agent's previous op has started (in-order issue) and,
    if that previous op is synchronous, ended.  Units run one op at a time.
    """
    p = Problem() if problem is None else problem
    r = SMRates.from_gpu() if rates is None else rates
    ops = _build(kind, p, r)
    agents = list(dict.fromkeys(op.agent for op in ops))
    queue = {a: [op for op in ops if op.agent == a] for a in agents}
    prev = {a: None for a in agents}
    unit_free = dict.fromkeys(UNITS, 0.0)
    while any(queue.values()):
        best = None
        for a in agents:
            if not queue[a]:
                continue
            op = queue[a][0]
            if any(dep.end is None for dep in op.deps):
                continue
            t = max([unit_free[op.unit]] + [dep.end for dep in op.deps])
            pa = prev[a]
            if pa is not None:
                t = max(t, pa.end if pa.sync else pa.start)
            if best is None or t < best[0]:
                best = (t, a, op)
        if best is None:                                          # pragma: no cover - a bug in _build
            raise RuntimeError(f"schedule {kind!r}: no op can start (a dependency cycle)")
        t, a, op = best
        op.start, op.end = t, t + op.seconds
        unit_free[op.unit] = op.end
        prev[a] = queue[a].pop(0)
    makespan = max(op.end for op in ops)
    busy = {u: sum(op.seconds for op in ops if op.unit == u) / makespan for u in UNITS}
    util = p.matmul_flops() / r.tensor_flops / makespan
    return Schedule(kind, ops, makespan, util, busy)


def run_all(problem: Problem | None = None, rates: SMRates | None = None) -> dict:
    """{schedule name: :class:`Schedule`} for every schedule, in :data:`SCHEDULES` order."""
    return {k: simulate(k, problem, rates) for k in SCHEDULES}


def lockstep_bound(problem: Problem, rates: SMRates, mma_sync: bool = False, prefetch: bool = False) -> float:
    """The lockstep schedules' utilisation in closed form (nothing overlaps but the SFU's and the
    software share of the exps): utilisation = ideal GEMM time / the time the loop takes.

    ``prefetch`` False (``fa2_serial``): each tile costs the sum of its ops, loads included.
    ``prefetch`` True (``fa2``, ``lockstep``): each tile costs its compute alone, plus the one
    exposed copy of K_0 before the loop; exact while every copy is shorter than the compute it
    hides under (V_j under GEMM0, K_{j+1} under the softmax and GEMM1), an upper bound otherwise.
    """
    p, r = problem, rates
    f = r.mma_sync_fraction if mma_sync else 1.0
    scores = p.block_q * p.block_k
    gemm = 4 * scores * p.head_dim / r.tensor_flops
    exps = max((1 - p.sw_exp_fraction) * scores / r.sfu_ops,
               p.sw_exp_fraction * scores * SOFTWARE_EXP2_OPS / r.cuda_ops)
    load = p.block_k * p.head_dim * p.itemsize / r.copy_bytes
    compute = (gemm / f + exps
               + ((OPS_BEFORE_EXP + OPS_AFTER_EXP) * scores + p.block_q * p.head_dim) / r.cuda_ops)
    if prefetch:
        return gemm * p.n_tiles / (load + p.n_tiles * compute)
    return gemm / (2 * load + compute)


# --------------------------------------------------------------------------- the exp budget
def exp_budget(head_dim: int) -> int:
    """Matmul FLOPs per exponential: each (query, key) pair costs 2d (in Q K^T) + 2d (in P V)
    FLOP and one exp, so 4d: 256 at d = 64, 512 at d = 128, 1024 at d = 256."""
    return 4 * head_dim


def sfu_share_table(gpus=("H100 SXM", "H200", "B200"), head_dims=(64, 128, 256)) -> list[dict]:
    """Per GPU and d: exponentials per second, and exp time as a fraction of matmul time.

    fraction = (1 / exp rate) / (4 d / tensor rate) = tensor rate / (4 d x exp rate): the
    SFU alone needs that share of the time the tensor cores need, so unless the two overlap
    it adds to it (FlashAttention-3's argument), and where it nears 1 the exponentials
    themselves become the bottleneck (FlashAttention-4's, on Blackwell).
    """
    rows = []
    for g in gpus:
        r = SMRates.from_gpu(g)
        sms = rl.get_gpu(g)["sms"]
        for d in head_dims:
            rows.append(dict(gpu=g, head_dim=d, flop_per_exp=exp_budget(d),
                             tensor_tflops=r.tensor_flops * sms / rl.TFLOPS, exp_tops=r.sfu_ops * sms / 1e12,
                             exp_fraction_of_matmul=r.tensor_flops / (exp_budget(d) * r.sfu_ops)))
    return rows


# --------------------------------------------------------------------------- the paper and the blog post
#: the setting of the FlashAttention-3 paper's ablation (its Table 2)
PAPER_TABLE2_SETTING = "H100 SXM5, FP16, batch 4, sequence length 8448, 16 heads, head dim 128, non-causal"
#: the FlashAttention-3 paper's Table 2, its three rows: (configuration, TFLOP/s, the model
#: schedule with the same ingredients)
PAPER_TABLE2 = [
    ("FlashAttention-3", 661.0, "fa3"),
    ("no GEMM-softmax pipelining (warp specialization kept)", 582.0, "warp_specialized"),
    ("no warp specialization (GEMM-softmax pipelining kept)", 570.0, "intra_wg_no_ws"),
]
#: the FlashAttention-3 blog post (PyTorch blog, 2024-07-11), step by step on an H100, FP16:
#: (step, TFLOP/s low, high, the model schedule with the same ingredients).  The blog post,
#: not the paper, is the source of "FlashAttention-2 about 350"; the paper's text says FA2
#: reaches about 35% of the H100's peak.
BLOG_STEPS = [
    ("FlashAttention-2", 350.0, 350.0, "fa2"),
    ("wgmma + TMA rewrite", 540.0, 570.0, "warp_specialized"),
    ("+ ping-pong scheduling", 620.0, 640.0, "pingpong"),
    ("+ intra-warpgroup overlap", 640.0, 660.0, "fa3"),
]


def ablation_comparison(problem: Problem | None = None, gpu="H100 SXM", l2_reuse: float = L2_REUSE) -> list[dict]:
    """The paper's Table 2 beside the model: measured fraction of peak vs predicted utilisation."""
    r = SMRates.from_gpu(gpu, l2_reuse)
    peak = rl.get_gpu(gpu)["fp16_tflops"]
    out = []
    for config, tflops, kind in PAPER_TABLE2:
        s = simulate(kind, problem, r)
        out.append(dict(paper=config, paper_tflops=tflops, paper_fraction=tflops / peak, schedule=kind,
                        label=label(kind), model_utilisation=s.utilisation))
    return out


def blog_comparison(problem: Problem | None = None, gpu="H100 SXM", l2_reuse: float = L2_REUSE) -> list[dict]:
    """The blog post's steps beside the model: each step's reported range as a fraction of peak,
    the model's utilisation, and each one's gain over the step before (the blog's as a range:
    lowest over highest, highest over lowest)."""
    r = SMRates.from_gpu(gpu, l2_reuse)
    peak = rl.get_gpu(gpu)["fp16_tflops"]
    out = []
    for step, lo, hi, kind in BLOG_STEPS:
        u = simulate(kind, problem, r).utilisation
        prev = out[-1] if out else None
        out.append(dict(step=step, blog_low=lo, blog_high=hi, blog_fraction=(lo / peak, hi / peak), schedule=kind,
                        label=label(kind), model_utilisation=u,
                        blog_gain=None if prev is None else (lo / prev["blog_high"], hi / prev["blog_low"]),
                        model_gain=None if prev is None else u / prev["model_utilisation"]))
    return out


# --------------------------------------------------------------------------- trusting the model
#: the L2 reuse factors :func:`sensitivity` tries by default: from no reuse at all (1) to four
#: times the default
SENSITIVITY_REUSE = (1, 2, 3, 4, 6, 8, 16)
#: the schedules :func:`sensitivity` reports by default: both FA2 models and Table 2's rows
SENSITIVITY_KINDS = ("fa2_serial", "fa2", "warp_specialized", "intra_wg_no_ws", "pingpong", "fa3")


def sensitivity(l2_reuses=SENSITIVITY_REUSE, kinds=SENSITIVITY_KINDS, problem: Problem | None = None,
                gpu="H100 SXM") -> list[dict]:
    """The model's utilisation per schedule for each L2 reuse factor: one dict per factor,
    {"l2_reuse": x, kind: utilisation, ..., "table2_order_holds": bool}, the last saying
    whether Table 2's ordering (warp specialization alone above the pipelining alone) holds.

    The factor is the model's one unmeasured constant: a conclusion that flips inside a
    plausible range of it is not a conclusion of the model.
    """
    l2_reuses = tuple(l2_reuses)
    if not l2_reuses or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0
                            for x in l2_reuses):
        raise ValueError(f"l2_reuses: expected positive numbers, got {l2_reuses!r}")
    kinds = tuple(kinds)
    for k in kinds:
        label(k)                                          # raises on an unknown schedule
    rows = []
    for x in l2_reuses:
        r = SMRates.from_gpu(gpu, x)
        row = {"l2_reuse": x}
        row.update({k: simulate(k, problem, r).utilisation for k in kinds})
        ws = simulate("warp_specialized", problem, r).utilisation
        pipe = simulate("intra_wg_no_ws", problem, r).utilisation
        row["table2_order_holds"] = ws > pipe
        rows.append(row)
    return rows
