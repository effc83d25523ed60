"""FlashAttention for Hopper (compute capability 9.0) in CUDA C++: wgmma, TMA, warp specialization.

The kernels (``kernels/*.cu``, compiled for sm_90a by NVRTC through ``cupy.RawModule``) and
their launchers.  Each version adds one idea to the one before (FlashAttention-3: Shah,
Bikshandi, Zhang, Thakkar, Ramani and Dao, 2024):

=======  =================  ===================================================================
version  file               what it changes, and why
=======  =================  ===================================================================
gemm     hopper_gemm.cu     C = A B with TMA, an mbarrier pipeline, wgmma and a producer
                            warpgroup: the tensor-core ceiling the attention kernels are held to
v3       fa_v3.cu           wgmma instead of mma.sync (Q, K_j, V_j read by the tensor cores from
                            SRAM), TMA tile loads into 128-byte-swizzled SRAM, one mbarrier a
                            stage.  Limits: every warpgroup loads and computes, a __syncthreads
                            a tile gates each refill, and S, softmax, P V run one after another
v4       fa_v4.cu           warp specialization: a producer warpgroup issues every TMA copy,
                            consumers only compute; stages handed back by "empty" mbarriers;
                            setmaxnreg moves the producer's registers to the consumers.  Limit:
                            the tensor cores still idle while a warpgroup computes its softmax
v5       fa_v5.cu           ping-pong: the two consumer warpgroups take turns on the tensor cores
                            (named barriers), and inside each, softmax(S_j) runs while
                            P_{j-1} V_{j-1} is still being multiplied.  A consumer now holds two
                            tiles (K_j, V_{j-1}), so it takes three stages: with two, the tile it
                            frees is refilled only once it is already needed
=======  =================  ===================================================================

The default (``HopperConfig()``) is v5, the fastest on the H200 (benchmarks/results); the
registry ranks v5 > v4 > v3, all above the portable versions.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   query rows a block owns (BLOCK_M = 128: two consumer warpgroups of 64 rows),
         keys a K/V tile holds (``HopperConfig.block_n``)
Tr, Tc   ceil(Nq / Br) query tiles (the grid's x), the K/V tiles a block visits
S, P     S_ij = Q_i K_j^T (float32 wgmma accumulators), P_ij = exp2(S_ij scale log2(e) - m)
m, l     running row max and row sum of the online softmax, in registers
O        output accumulator (float32 registers), written once to HBM; LSE = m + log(l)
SRAM     shared memory; HBM device memory; TMA the copy engine (cp.async.bulk.tensor)
=======  ===========================================================================

Tensor maps: one per operand, encoded on the host by the driver's ``cuTensorMapEncodeTiled``
(cuda-python's ``cuda.bindings.driver``) and passed to the kernel by value as a
``__grid_constant__`` parameter.  Q, K and V are seen as 3-D tensors (head_dim, seq,
batch * heads) so that a tile never runs into the next head: rows past the sequence arrive
as zeros.  Boxes are 64 elements (128 bytes) wide with the 128-byte swizzle, the swizzle the
wgmma descriptors in ``hopper_common.cuh`` name.

Scope: float16 and bfloat16; head_dim 64 and 128; causal (bottom-right) and windows, tiles no
row can see skipped; GQA/MQA; Nq != Nk; any lengths; LSE returned (float32).  Nothing here
touches a GPU at import; compiled kernels (in :mod:`.launch`'s cache, keyed by kernel, defines and device) and
per-device facts (``_DEVICE``: compute capability, SRAM limit) are the only state this module
holds.
"""
from __future__ import annotations

import ctypes
import math
import pathlib
from dataclasses import dataclass, replace as _dc_replace

import numpy as np

from ..core import conventions as cv
from ..core.arrays import Call, device_array
from . import launch

KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "kernels"
#: kernel name -> file (each file holds one extern "C" kernel of that name)
SOURCES = {"hopper_gemm": "hopper_gemm.cu", "fa_v3": "fa_v3.cu", "fa_v4": "fa_v4.cu", "fa_v5": "fa_v5.cu",
           "mla_decode": "mla_decode.cu"}
VERSIONS = ("v3", "v4", "v5")
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
#: -DIK_DTYPE values (hopper_common.cuh)
DTYPE_IDS = {"float16": 1, "bfloat16": 2}
#: the one compute capability these kernels are built for (sm_90a: wgmma, setmaxnreg)
HOPPER_CC = 90
NVRTC_OPTIONS = ("-arch=sm_90a",)
#: one swizzle panel: 128 bytes of 16-bit elements (the TMA box width and the wgmma swizzle)
PANEL = 64
#: every tile starts on a 1024-byte boundary (a 128-byte-swizzle atom); dynamic SRAM is only
#: 16-byte aligned, so the kernels round up and the launcher adds this slack
SMEM_ALIGN = 1024
MBARRIER_BYTES = 8
#: attention: query rows a block owns: two consumer warpgroups of 64 rows (v5's ping-pong pair)
BLOCK_M = 128
#: threads: v3 has only the two computing warpgroups; v4, v5 add a producer warpgroup
THREADS = {"v3": 256, "v4": 384, "v5": 384}
#: default K/V tile (Bc): one m64n128 wgmma for S
DEFAULT_BLOCK_N = 128
#: default pipeline depth: v3, v4 use one tile while the next lands (Q + 2 x (K + V) = 160 KB at
#: d = 128); a v5 consumer holds two tiles at once (K_j and V_{j-1}), so a third stage is the one
#: that lands meanwhile (Q + 3 x (K + V) = 224 KB at d = 128, inside the 227 KB a block may have)
DEFAULT_STAGES = {"v3": 2, "v4": 2, "v5": 3}
BLOCK_N_CHOICES = (64, 128)
MAX_STAGES = 4
#: the GEMM's tile: 128 x 256 (two consumer warpgroups of 64 x 256), 64 deep (one panel),
#: 4 stages (192 KB of SRAM), tile order grouped 8 row-tiles high for L2 reuse
GEMM_BM, GEMM_BN, GEMM_BK, GEMM_STAGES, GEMM_GROUP_M = 128, 256, 64, 4, 8
GEMM_THREADS = 384
#: the H100/H200 per-block SRAM limit after opting in (read off the device when there is one)
FALLBACK_SMEM_OPTIN = 232448

_DEVICE: dict = {}


# --------------------------------------------------------------------------- availability
def _device_facts() -> dict:
    """Compute capability and opt-in SRAM limit of CuPy's current device (queried once)."""
    import cupy
    dev = cupy.cuda.Device().id
    facts = _DEVICE.get(dev)
    if facts is None:
        d = cupy.cuda.Device(dev)
        attrs = d.attributes                      # one query of every attribute: slow, so cached
        facts = dict(cc=int(d.compute_capability),
                     smem_optin=int(attrs.get("MaxSharedMemoryPerBlockOptin", FALLBACK_SMEM_OPTIN)))
        _DEVICE[dev] = facts
    return facts


def available() -> str | None:
    """None when these kernels can run here, else why not (no CuPy / GPU, cc != 9.0, no
    cuda-python)."""
    try:
        import cupy
        if not cupy.is_available():
            return "no CUDA device visible to CuPy"
        cc = _device_facts()["cc"]
    except Exception as e:  # ImportError, or a broken CUDA install
        return f"CuPy with a CUDA device is needed ({type(e).__name__}: {e})"
    if cc != HOPPER_CC:
        return f"needs compute capability 9.0 (Hopper: wgmma, TMA, sm_90a); this GPU is {cc / 10:.1f}"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "needs cuda-python (cuda.bindings.driver) to encode the TMA tensor maps"
    return None


def _require_available():
    why = available()
    if why is not None:
        raise ValueError(f"config.version: the Hopper kernels cannot run here: {why}")


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HopperConfig:
    """Tile settings of the Hopper attention kernels.

    version: "v3", "v4", "v5" or None (the default: :data:`DEFAULT_VERSION`).
    block_n (Bc): keys a K/V tile holds, 64 or 128 (None: :data:`DEFAULT_BLOCK_N`).
    stages: K/V tiles the SRAM ring holds (1 .. MAX_STAGES; v5 at least 2; None: the version's
    default, :data:`DEFAULT_STAGES`).
    pingpong: v5 only; False keeps v5's overlap inside a warpgroup but lets the two consumer
    warpgroups issue their products whenever they are ready (to measure what ping-pong adds).
    The query tile is fixed at BLOCK_M = 128 rows (two consumer warpgroups).
    """

    version: str | None = None
    block_n: int | None = None
    stages: int | None = None
    pingpong: bool = True

    def __post_init__(self):
        if self.version is not None:
            cv.check_choice(self.version, "config.version", VERSIONS)
        if self.block_n is not None and self.block_n not in BLOCK_N_CHOICES:
            raise ValueError(f"config.block_n: expected one of {BLOCK_N_CHOICES} or None, got {self.block_n!r}")
        if self.stages is not None and (isinstance(self.stages, bool) or not isinstance(self.stages, int)
                                        or not 1 <= self.stages <= MAX_STAGES):
            raise ValueError(f"config.stages: expected an integer in 1..{MAX_STAGES} or None, got {self.stages!r}")
        cv.check_bool(self.pingpong, "config.pingpong")

    def replace(self, **kw) -> "HopperConfig":
        return _dc_replace(self, **kw)

    def resolve(self) -> "HopperConfig":
        """Every None filled with its default."""
        version = self.version or DEFAULT_VERSION
        return HopperConfig(version, self.block_n or DEFAULT_BLOCK_N, self.stages or DEFAULT_STAGES[version],
                            self.pingpong)

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic SRAM a block asks for: Q_i, stages x (K_j + V_j), the mbarriers, alignment slack."""
        c = self.resolve()
        tiles = 2 * head_dim * (BLOCK_M + 2 * c.stages * c.block_n)
        return tiles + MBARRIER_BYTES * (1 + 3 * c.stages) + SMEM_ALIGN

    def check_fits(self, head_dim: int, smem_optin: int) -> None:
        c = self.resolve()
        if c.version == "v5" and c.stages < 2:
            raise ValueError("config.stages: v5 uses K_j and V_{j-1} together, so it needs at least 2 stages")
        need = self.smem_bytes(head_dim)
        if need > smem_optin:
            raise ValueError(f"config.stages: {self.resolve().stages} stages of Bc = {self.resolve().block_n} "
                             f"at head_dim {head_dim} need {need} bytes of SRAM; this GPU allows {smem_optin}")

    def defines(self, head_dim: int, dtype: str) -> dict:
        c = self.resolve()
        out = dict(IK_DTYPE=DTYPE_IDS[dtype], HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=c.block_n,
                   STAGES=c.stages)
        if c.version == "v5":
            out["PINGPONG"] = int(c.pingpong)
        return out


#: what HopperConfig() runs: the fastest version measured on the H200 (benchmarks)
DEFAULT_VERSION = "v5"


# --------------------------------------------------------------------------- compile
def source(name: str) -> str:
    """The CUDA source of kernel ``name`` with its #include "...cuh" files inlined (each once)."""
    return launch.source(name, SOURCES)


def _function(name: str, defines: dict, smem: int):
    """Compile (once per defines and device, in :mod:`.launch`'s cache) and return kernel ``name``."""
    return launch.function(name, name, defines, smem, options=NVRTC_OPTIONS, sources=SOURCES)


def _smem_optin() -> int:
    return _device_facts()["smem_optin"]


# --------------------------------------------------------------------------- tensor maps
def tensor_map(ptr: int, dtype: str, dims, strides_bytes, box) -> np.ndarray:
    """A TMA tensor map (CUtensorMap, 128 bytes) for a 16-bit tensor at ``ptr``, as a one-element
    NumPy array that CuPy passes to the kernel by value.

    dims: sizes, innermost first; strides_bytes: the byte stride of each dim but the first
    (multiples of 16); box: the tile the copy engine moves, innermost first (innermost = 64
    elements = 128 bytes, the swizzle width).  128-byte swizzle; out-of-range elements read
    as zeros.
    """
    from cuda.bindings import driver as drv
    types = {"float16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             "bfloat16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}
    rank = len(dims)
    err, tmap = drv.cuTensorMapEncodeTiled(
        types[dtype], rank, int(ptr),
        [drv.cuuint64_t(int(x)) for x in dims], [drv.cuuint64_t(int(s)) for s in strides_bytes],
        [drv.cuuint32_t(int(b)) for b in box], [drv.cuuint32_t(1)] * rank,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"q: cuTensorMapEncodeTiled refused dims={list(dims)} strides={list(strides_bytes)} "
                         f"box={list(box)}: {err}")
    raw = ctypes.string_at(int(tmap.getPtr()), 128)
    return np.frombuffer(raw, dtype=np.dtype((np.void, 128))).copy()


def _qkv_map(x, dtype, rows_box):
    """The 3-D map (head_dim, seq, batch * heads) of a contiguous (B, H, N, d) device array."""
    B, H, N, d = x.shape
    return tensor_map(x.ptr, dtype, (d, N, B * H), (2 * d, 2 * d * N), (PANEL, rows_box, 1))


# --------------------------------------------------------------------------- arrays
def _contiguous(x, dtype):
    """A C-contiguous, 16-byte-aligned DeviceArray over ``x`` (one copy only when it is not)."""
    da = device_array(x, dtype)
    if da.c_contiguous() and da.ptr % 16 == 0:
        return da
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        y = x.contiguous() if not x.is_contiguous() else x.clone()
    else:
        import cupy
        y = cupy.array(x, order="C", copy=True)
    return device_array(y, dtype)


def _fill(x, value):
    """Fill a torch tensor or CuPy array in place (on the current stream)."""
    if type(x).__module__.split(".")[0] == "torch":
        x.fill_(value)
    else:
        x.fill(value)


def _cupy_stream(call: Call):
    import cupy
    return cupy.cuda.ExternalStream(call.stream_ptr())


# --------------------------------------------------------------------------- attention
def _check_attention_inputs(q, k, v, causal, scale, window, config):
    info = cv.check_qkv(q, k, v, allowed=DTYPES)
    if info["head_dim"] not in HEAD_DIMS:
        raise ValueError(f"q: the Hopper kernels take head_dim in {HEAD_DIMS}, got {info['head_dim']}")
    if config is None:
        config = HopperConfig()
    if not isinstance(config, HopperConfig):
        raise ValueError(f"config: expected a HopperConfig or None, got {type(config).__name__}")
    scale = cv.resolve_scale(scale, info["head_dim"])
    left, right = cv.effective_window(bool(causal), window)
    return info, scale, (left, right), config.resolve()


def attention(q, k, v, *, causal=False, scale=None, window=None, config=None):
    """FlashAttention forward on Hopper: (O, LSE).  ``config``: a :class:`HopperConfig`.

    q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d), float16 or bfloat16, d in (64, 128): torch CUDA
    tensors or CuPy arrays (used in place when contiguous) or NumPy arrays (copied).  O has q's
    dtype; LSE is float32 (B, Hq, Nq), natural log; rows that see no key give O = 0, LSE = -inf.
    """
    info, scale, win, cfg = _check_attention_inputs(q, k, v, causal, scale, window, config)
    _require_available()
    cfg.check_fits(info["head_dim"], _smem_optin())
    call = Call(q, name="q")
    dtype = info["dtype"]
    B, Hq, Nq, d = info["batch"], info["heads_q"], info["seqlen_q"], info["head_dim"]
    qd, kd, vd = (call.to_device(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    o = call.empty((B, Hq, Nq, d), dtype)
    lse = call.empty((B, Hq, Nq), "float32")
    launch_attention(call, qd, kd, vd, o, lse, dtype=dtype, scale=scale, window=win, config=cfg)
    return call.finish(o, dtype), call.finish(lse, "float32")


def launch_attention(call: Call, q, k, v, o, lse, *, dtype, scale, window, config):
    """Launch one version on device arrays; ``o`` (B, Hq, Nq, d) and ``lse`` (B, Hq, Nq) are
    preallocated and contiguous (the checks poison them first)."""
    cfg = config.resolve()
    qd, kd, vd = (_contiguous(x, dtype) for x in (q, k, v))
    B, Hq, Nq, d = qd.shape
    Hkv, Nk = kd.shape[1], kd.shape[2]
    if B * Hq * Nq == 0:
        return
    if Nk == 0:                                   # no keys: every row is fully masked
        _fill(o, 0)
        _fill(lse, -math.inf)
        return
    od, ld = device_array(o, dtype), device_array(lse, "float32")
    left, right = window
    # causal / right-bounded: later query tiles see more keys; start those first
    heavy_first = right >= 0 and Nq > BLOCK_M
    name = f"fa_{cfg.version}"
    smem = cfg.smem_bytes(d)
    fn = _function(name, cfg.defines(d, dtype), smem)
    maps = (_qkv_map(qd, dtype, BLOCK_M), _qkv_map(kd, dtype, cfg.block_n), _qkv_map(vd, dtype, cfg.block_n))
    i32 = np.int32
    args = (*maps, od.arg, ld.arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            np.float32(scale * math.log2(math.e)), i32(left), i32(right), i32(heavy_first))
    grid = (-(-Nq // BLOCK_M), Hq, B)
    fn(grid, (THREADS[cfg.version],), args, shared_mem=smem, stream=_cupy_stream(call))


# --------------------------------------------------------------------------- gemm
def gemm_smem_bytes() -> int:
    tiles = GEMM_STAGES * 2 * (GEMM_BM * GEMM_BK + GEMM_BK * GEMM_BN)
    return tiles + MBARRIER_BYTES * 2 * GEMM_STAGES + SMEM_ALIGN


def gemm_defines(dtype: str) -> dict:
    return dict(IK_DTYPE=DTYPE_IDS[dtype], BM=GEMM_BM, BN=GEMM_BN, BK=GEMM_BK, STAGES=GEMM_STAGES,
                GROUP_M=GEMM_GROUP_M)


def gemm(a, b):
    """C = A B on the tensor cores (wgmma + TMA): a (M, K), b (K, N), float16 or bfloat16, row-major
    like torch.matmul; C (M, N) in the same dtype, accumulated in float32.  K and N must be
    multiples of 8 (rows of 16 bytes, what TMA addresses)."""
    for name, x in (("a", a), ("b", b)):
        if len(getattr(x, "shape", ())) != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {getattr(x, 'shape', None)}")
    dtype = cv.check_dtype(a, "a", DTYPES)
    if cv.check_dtype(b, "b", DTYPES) != dtype:
        raise ValueError(f"b: dtype must match a's ({dtype})")
    M, K = (int(s) for s in a.shape)
    K2, N = (int(s) for s in b.shape)
    if K2 != K:
        raise ValueError(f"b: rows (axis 0) must equal a's columns {K}, got {K2}")
    if K % 8 or N % 8:
        raise ValueError(f"a, b: K ({K}) and N ({N}) must be multiples of 8 (16-byte rows for TMA)")
    _require_available()
    call = Call(a, name="a")
    ad, bd = _contiguous(call.to_device(a, "a"), dtype), _contiguous(call.to_device(b, "b"), dtype)
    c = call.empty((M, N), dtype)
    if M * N == 0:
        return call.finish(c, dtype)
    if K == 0:
        _fill(c, 0)
        return call.finish(c, dtype)
    cd = device_array(c, dtype)
    smem = gemm_smem_bytes()
    fn = _function("hopper_gemm", gemm_defines(dtype), smem)
    map_a = tensor_map(ad.ptr, dtype, (K, M), (2 * K,), (GEMM_BK, GEMM_BM))
    map_b = tensor_map(bd.ptr, dtype, (N, K), (2 * N,), (PANEL, GEMM_BK))
    tiles = -(-M // GEMM_BM) * -(-N // GEMM_BN)
    fn((tiles,), (GEMM_THREADS,), (map_a, map_b, cd.arg, np.int32(M), np.int32(N), np.int32(K)),
       shared_mem=smem, stream=_cupy_stream(call))
    return call.finish(c, dtype)


# --------------------------------------------------------------------------- registry
def _check(need) -> str | None:
    """The registry check: why a call cannot run on these kernels, or None."""
    if need.simulator:
        return "runs on a GPU only (not the simulator)"
    if need.cc is not None and need.cc != HOPPER_CC:
        return f"needs compute capability 9.0 (sm_90a), this GPU is {need.cc / 10:.1f}"
    if need.dtype not in DTYPES:
        return f"takes float16 / bfloat16, not {need.dtype}"
    if need.head_dim not in HEAD_DIMS:
        return f"takes head_dim in {HEAD_DIMS}, not {need.head_dim}"
    return available()


SUMMARIES = {
    "v3": "Hopper: wgmma from SRAM, TMA tile loads, an mbarrier a stage",
    "v4": "Hopper: v3 + a producer warpgroup (warp specialization), setmaxnreg",
    "v5": "Hopper: v4 + ping-pong between consumer warpgroups, softmax overlapped with P V",
}
#: the order the registry prefers them in (higher first); all rank above every portable version
RANK_ORDER = {"v3": 1, "v4": 2, "v5": 3}


def register(registry) -> None:
    """Register attention v3, v4, v5 into a backend's Registry, ranked above every attention
    version already there (so on Hopper the default is the best of these)."""
    base = max((k.default_rank for k in registry.kernels("attention")), default=0)
    for version in VERSIONS:
        def launcher(q, k, v, *, causal, scale, window, config, _version=version):
            return attention(q, k, v, causal=causal, scale=scale, window=window,
                             config=(config or HopperConfig()).replace(version=_version))
        registry.register("attention", version, config=HopperConfig, summary=SUMMARIES[version],
                          check=_check, default_rank=base + RANK_ORDER[version])(launcher)


# --------------------------------------------------------------------------- checks
#: the oracle (float64 NumPy, on the host) sees at most this many query rows at each end of a
#: long sequence: the last rows (every key, the diagonal's end) and the first (the mask's start)
ORACLE_ROWS = 128


def _baseline(q, k, v, causal, window):
    """Naive attention in q's precision on the GPU (O), and its LSE from the same rounded S."""
    import torch
    from ..torch_sdpa import naive_attention
    o = naive_attention(q, k, v, causal=causal, window=window if window is not None else (-1, -1))
    Hq, Hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else k
    s = torch.matmul(q * cv.default_scale(q.shape[-1]), kk.transpose(-1, -2))
    vis = torch.from_numpy(cv.mask(q.shape[2], k.shape[2], causal, window)).to(q.device)
    return o, torch.logsumexp(s.float().masked_fill(~vis, -math.inf), dim=-1)


def oracle_check(q, k, v, *, causal, window=None, config=None):
    """Run one version on torch CUDA tensors into NaN-poisoned outputs and hold it to
    FlashAttention's 2x rule against the float64 oracle: a list of Checks (O, LSE per slice)."""
    import torch
    from ..core import reference
    from ..core.testing import as_numpy, check
    info, scale, win, cfg = _check_attention_inputs(q, k, v, causal, None, window, config)
    B, Hq, Nq, d = q.shape
    Nk = k.shape[2]
    o = torch.full((B, Hq, Nq, d), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("nan"), dtype=torch.float32, device=q.device)
    launch_attention(Call(q), q, k, v, o, lse, dtype=info["dtype"], scale=scale, window=win, config=cfg)
    torch.cuda.synchronize()
    checks = []
    for name, x in (("O", o), ("LSE", lse)):
        if torch.isnan(x).any():
            from ..core.testing import Check
            checks.append(Check(f"{name} all rows", float("inf"), 0.0, None, False, "; unwritten or NaN"))
    R = ORACLE_ROWS
    slices = [(0, Nq, 0, Nk)] if Nq <= 2 * R else [(Nq - R, Nq, 0, Nk)]
    if Nq > 2 * R and window is None:
        # the first R rows: with a bottom-right causal mask they see keys [0, R + Nk - Nq)
        hi = R + Nk - Nq if causal else Nk
        if hi > 0:
            slices.append((0, R, 0, hi))
    for r0, r1, c0, c1 in slices:
        qs, ks, vs = q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1]
        ref_o, ref_l = reference.attention(as_numpy(qs), as_numpy(ks), as_numpy(vs), causal=causal, window=window)
        bo, bl = _baseline(qs, ks, vs, causal, window)
        masked = ~np.isfinite(ref_l)[..., None]
        checks.append(check(o[:, :, r0:r1], ref_o, bo, dtype=info["dtype"], name=f"O rows {r0}:{r1}",
                            masked_rows=masked))
        checks.append(check(lse[:, :, r0:r1], ref_l, bl, dtype=info["dtype"], name=f"LSE rows {r0}:{r1}"))
    return checks


def gemm_check(a, b):
    """gemm(a, b) against the float64 product, by the 2x rule against torch.matmul in a's dtype."""
    import torch
    from ..core.testing import check
    ref = torch.matmul(a.double(), b.double())
    c = gemm(a, b)
    torch.cuda.synchronize()
    name = cv.dtype_name(a)
    return check(c.float().cpu().numpy(), ref.cpu().numpy(), torch.matmul(a, b).float().cpu().numpy(),
                 dtype=name, name=f"C {tuple(a.shape)}x{tuple(b.shape)}")
