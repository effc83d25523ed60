"""Why Hopper needed a new kernel: a discrete-event model of one SM running attention's tile loop.

An SM has separate units that can work at the same time: a copy engine (Hopper's Tensor
Memory Accelerator, TMA) moving tiles from HBM into shared memory, the tensor cores
(matmuls), the special-function units (SFU: the exponentials of the softmax), and the
CUDA cores (everything else: row maxima, sums, conversions, the rescale of O).  A kernel
is fast when the tensor cores never wait.  FlashAttention-2 runs each step in turn, so
the tensor cores idle while the softmax runs; FlashAttention-3 (Shah, Bikshandi, Zhang,
Thakkar, Ramani, Dao, 2024) overlaps them.  This module schedules the ops of one thread
block's tile loop on the four units and reports how busy the tensor cores are.

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

The schedules (:data:`SCHEDULES`), each one idea more than the last:

- ``fa2``: FlashAttention-2's lockstep: load K_j, V_j, GEMM0, softmax, GEMM1, in turn, one
  warpgroup doing all of it, with Ampere's mma.sync instructions, which reach only about
  two thirds of Hopper's tensor-core peak (FlashAttention-3 paper).
- ``lockstep``: the same order with wgmma (full rate): the instruction, no overlap yet.
- ``warp_specialized``: a producer warp issues the loads into a ring of ``stages`` shared-
  memory buffers while the consumer computes; loads leave the critical path, the softmax
  does not.
- ``intra_wg_no_ws``: one warpgroup, no producer; it issues the next tile's loads itself
  (asynchronously) and overlaps its softmax of tile j with GEMM1 of tile j - 1 (the
  paper's "GEMM-softmax pipelining" without warp specialization).
- ``pingpong``: a producer and two consumer warpgroups of Br / 2 rows each; while one
  runs its softmax the other's GEMMs keep the tensor cores busy.
- ``intra_wg``: a producer and one consumer with the intra-warpgroup overlap above.
- ``fa3``: a producer and two consumers, each with the intra-warpgroup overlap: the
  full FlashAttention-3 schedule.

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
paper measures, and the ordering of the schedules, not their values, is what to compare.
On an A100 (no wgmma, no TMA) and a B200 (tcgen05 instead of wgmma) the schedules after
``fa2`` stand for "the same overlap with that GPU's full-rate matmul and copy engine".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .core import roofline as rl

__all__ = ["SMRates", "Problem", "Op", "Schedule", "SCHEDULES", "simulate", "run_all",
           "exp_budget", "sfu_share_table", "PAPER_ABLATION", "ablation_comparison",
           "lockstep_bound"]

#: dense FP16/BF16 tensor-core FLOP per clock per SM, by architecture: Ampere 1024 FMA
#: (NVIDIA A100 Tensor Core GPU Architecture whitepaper), Hopper twice that clock for clock
#: (NVIDIA H100 Tensor Core GPU Architecture whitepaper), Blackwell twice Hopper
#: (FlashAttention-4 paper, Zadouri et al., 2026).  Only used to infer the clock.
TENSOR_FLOP_PER_CLOCK_PER_SM = {"Ampere": 2048, "Hopper": 4096, "Blackwell": 8192}
#: exponentials (ex2) per clock per SM: 16 (CUDA C++ Programming Guide, arithmetic
#: instruction throughput, compute capability 8.0 to 10.0)
SFU_PER_CLOCK_PER_SM = 16
#: mma.sync reaches about two thirds of Hopper's tensor-core peak (FlashAttention-3 paper)
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
#: schedule name -> (description, consumers, producer, intra-warpgroup overlap, mma.sync)
SCHEDULES = {
    "fa2": ("FlashAttention-2 lockstep (mma.sync)", 1, False, False, True),
    "lockstep": ("lockstep with wgmma", 1, False, False, False),
    "warp_specialized": ("warp specialization (producer + 1 consumer)", 1, True, False, False),
    "intra_wg_no_ws": ("intra-warpgroup overlap, no producer", 1, False, True, False),
    "pingpong": ("ping-pong (producer + 2 consumers)", 2, True, False, False),
    "intra_wg": ("intra-warpgroup overlap (producer + 1 consumer)", 1, True, True, False),
    "fa3": ("FlashAttention-3: ping-pong + intra-warpgroup", 2, True, True, False),
}


def _build(kind: str, p: Problem, r: SMRates) -> list:
    """The ops of one schedule, each agent's in program order."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {kind!r}")
    _, consumers, producer, intra, mma_sync = SCHEDULES[kind]
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


def lockstep_bound(problem: Problem, rates: SMRates, mma_sync: bool = False) -> float:
    """The lockstep schedules' utilisation in closed form: nothing overlaps (but the SFU's and
    the software share of the exps), so each tile costs the sum of its ops, and utilisation =
    ideal GEMM time / that sum."""
    p, r = problem, rates
    f = r.mma_sync_fraction if mma_sync else 1.0
    scores = p.block_q * p.block_k
    gemm = 4 * scores * p.head_dim / r.tensor_flops
    exps = max((1 - p.sw_exp_fraction) * scores / r.sfu_ops,
               p.sw_exp_fraction * scores * SOFTWARE_EXP2_OPS / r.cuda_ops)
    tile = (2 * p.block_k * p.head_dim * p.itemsize / r.copy_bytes + gemm / f + exps
            + ((OPS_BEFORE_EXP + OPS_AFTER_EXP) * scores + p.block_q * p.head_dim) / r.cuda_ops)
    return gemm / tile


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


# --------------------------------------------------------------------------- the paper's ablation
#: FlashAttention-3 paper, ablation on an H100 SXM (FP16, d = 128): TFLOP/s per configuration,
#: beside the schedule of this model that has the same ingredients
PAPER_ABLATION = [
    ("FlashAttention-2", 350.0, "fa2"),
    ("GEMM-softmax pipelining, no warp specialization", 570.0, "intra_wg_no_ws"),
    ("warp specialization, no GEMM-softmax pipelining", 582.0, "warp_specialized"),
    ("FlashAttention-3 (both)", 661.0, "fa3"),
]


def ablation_comparison(problem: Problem | None = None, gpu="H100 SXM") -> list[dict]:
    """The paper's ablation beside the model: measured fraction of peak vs predicted utilisation."""
    r = SMRates.from_gpu(gpu)
    peak = rl.get_gpu(gpu)["fp16_tflops"]
    out = []
    for label, tflops, kind in PAPER_ABLATION:
        s = simulate(kind, problem, r)
        out.append(dict(paper=label, paper_tflops=tflops, paper_fraction=tflops / peak, schedule=kind,
                        model_utilisation=s.utilisation))
    return out
