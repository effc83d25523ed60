"""FP8 attention forward on Hopper (fa_fp8_v1.cu, fa_fp8_v2.cu): opt-in, never a default.

FlashAttention-3's FP8 ideas (Shah, Bikshandi, Zhang, Thakkar, Ramani and Dao, 2024) on the v4
kernel's structure (a TMA producer warpgroup, two consumer warpgroups): both products in e4m3
with float32 accumulators, one scale per tile (block quantization), optionally the randomized
Hadamard transform of Q and K first (incoherent processing, :mod:`..hadamard`), and P scaled
into e4m3's range before its cast.  :func:`iokernels.fp8.fp8_attention` is the same arithmetic
on the CPU; the GPU tests hold each version's error to that model's.

Two versions of the forward (``Fp8Config.version``), the same arithmetic:

=======  ==========================================================================
v1       fa_fp8_v1.cu: each consumer warpgroup issues S = Q K_j^T, waits, computes the
         softmax, issues P V_j, waits.  FP8 halves the products' time, not the softmax's
         exp2, so the tensor cores idle during every softmax, now the larger share of a tile.
v2       fa_fp8_v2.cu: v1 with fa_v5's two overlaps.  The two consumer warpgroups take
         turns issuing their products (ping-pong, ``pingpong``), and inside a warpgroup
         S_j and P_{j-1} V_{j-1} are issued together, softmax(S_j) computed while
         P_{j-1} V_{j-1} runs.  O, kept in units of the current V tile's scale, is moved
         from s_V(j-1) to s_V(j) together with the softmax's rescale, once P_{j-1} V_{j-1}
         has landed.  Needs two stages (K_j and V_{j-1} are held together).
=======  ==========================================================================

v1 is the default: measured on a GPU, v2 ran slower than v1 with ping-pong and without (the
benchmark's ``cupy:fp8 v2`` rows run next to v1's; benchmarks/results).

A call runs up to five kernels, all counted in its time:

==========================  ================================================================
fwht (twice, optional)      Q, K -> Q D H / sqrt(d), K D H / sqrt(d) in float32 (same signs)
fp8_quantize_rows (twice)   Q per (query tile of Br rows, head), K per (key tile of Bc keys,
                            KV head): scale = amax / 448, codes = round(x / scale) in e4m3
fp8_quantize_vt             V -> V^T codes (B, Hkv, d, Nk_pad), a scale a key tile: fp8 wgmma
                            takes K-major operands only, so P V needs V with keys contiguous
                            (both quantization kernels: fa_fp8_v1.cu's, for both versions)
fa_fp8_v1 or fa_fp8_v2      the forward: S = codes x codes times s_Q s_K, online softmax,
                            P * P_SCALE -> e4m3, O += P V^T, O / (P_SCALE l) times s_V
==========================  ================================================================

Notation: Br = Bc = 128 (:data:`FP8_BLOCK_M`, :data:`FP8_BLOCK_N`); s_Q, s_K, s_V the per-tile
scales (float32, "x ~ s * code"); P_SCALE = :data:`iokernels.fp8.P_SCALE` (2^8); Nk_pad = Nk
rounded up to Bc.

Why it is opt-in: FP8 changes the answer (e4m3 keeps 3 mantissa bits, bfloat16 7: the error
grows by one to two orders of magnitude, notebook 09b), so it is not registered as an
``attention`` version (the registry's forward versions all pass FlashAttention's 2x rule; this
one cannot) and no default path reaches it.  Call :func:`fp8_attention` by name.

Limits: head_dim 128; float16 / bfloat16 inputs (quantized here) or codes made by
:func:`quantize_qkv`; non-causal or causal (bottom-right); GQA; no window; no backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import fp8 as fp8_lesson
from ...core import conventions as cv
from ...core.arrays import Call, device_array
from ..hadamard import launch_fwht, resolve_signs
from ..config_checks import check_version
from ..launch import DTYPE_IDS, HOPPER_OPTIONS, HOPPER_SOURCES, contiguous, device_info, fill, function, on_stream
from .checks import available
from .config import BLOCK_M, MBARRIER_BYTES, SMEM_ALIGN
from .tensor_maps import tensor_map

#: the kernel file of the quantization kernels and of the v1 forward (a Hopper source:
#: launch.HOPPER_UNRECORDED names it, since it has no record)
FP8_FILE = "fa_fp8_v1"
#: the forward's versions and their files (each in launch.HOPPER_UNRECORDED)
FP8_FILES = {"v1": "fa_fp8_v1", "v2": "fa_fp8_v2"}
FP8_VERSIONS = tuple(FP8_FILES)
#: what Fp8Config() runs: v1 (v2 measured slower; see the module docstring)
FP8_DEFAULT_VERSION = "v1"
#: versions that issue S_j with P_{j-1} V_{j-1} (K_j and V_{j-1} in SRAM together: two stages)
FP8_PIPELINED = ("v2",)
FP8_DTYPES = ("float16", "bfloat16")
#: a row of codes (d = 128 bytes) is one 128-byte swizzle row; d = 64 would need another swizzle
FP8_HEAD_DIMS = (128,)
#: query rows a block owns (two consumer warpgroups of 64), and the tile Q's scales cover
FP8_BLOCK_M = BLOCK_M
#: keys a K / V tile holds, and the tile K's and V's scales cover: a V^T row of Bc codes is
#: one 128-byte swizzle row
FP8_BLOCK_N = 128
#: K / V^T tiles the SRAM ring holds by default (two tiles of 16 KB each a stage)
FP8_STAGES = 2
FP8_MAX_STAGES = 4
#: a producer warpgroup and two consumer warpgroups (fa_v4's block)
FP8_THREADS = 384
#: threads of a quantization block (8 warps: one tile's amax, then its codes)
QUANT_THREADS = 256
#: e4m3's largest finite value: a block's max|x| is mapped onto it
E4M3_MAX = fp8_lesson.FORMATS["e4m3"][1]
#: P is multiplied by this before its e4m3 cast (P in [0, 1] -> [0, 256], out of the subnormals)
P_SCALE = fp8_lesson.P_SCALE


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 forward's settings.

    stages: the K / V^T tiles in flight (1 .. 4, v2 at least 2; None: :data:`FP8_STAGES`).
    version: "v1", "v2" or None (:data:`FP8_DEFAULT_VERSION`); see the module's table.
    pingpong: v2 only; False keeps v2's overlap inside a warpgroup but lets the two consumer
    warpgroups issue their products whenever they are ready (to measure what ping-pong adds).
    """

    stages: int | None = None
    version: str | None = None
    pingpong: bool = True

    def __post_init__(self):
        check_version(self, FP8_VERSIONS)
        if self.stages is not None and (isinstance(self.stages, bool) or not isinstance(self.stages, int)
                                        or not 1 <= self.stages <= FP8_MAX_STAGES):
            raise ValueError(f"config.stages: expected an integer in 1..{FP8_MAX_STAGES} or None, "
                             f"got {self.stages!r}")
        cv.check_bool(self.pingpong, "config.pingpong")
        version = self.version or FP8_DEFAULT_VERSION
        if version in FP8_PIPELINED and self.stages is not None and self.stages < 2:
            raise ValueError(f"config.stages: {version} uses K_j and V_{{j-1}} together, so it needs at least "
                             f"2 stages, got {self.stages}")
        if version not in FP8_PIPELINED and not self.pingpong:
            raise ValueError(f"config.pingpong: {version} has no ping-pong to turn off (v2 only)")

    def resolve(self) -> "Fp8Config":
        return Fp8Config(self.stages or FP8_STAGES, self.version or FP8_DEFAULT_VERSION, self.pingpong)

    @property
    def file(self) -> str:
        """The forward's kernel file (and kernel name) for this version."""
        return FP8_FILES[self.resolve().version]

    def smem_bytes(self) -> int:
        """Q_i codes, stages x (K_j codes + V_j^T codes), the mbarriers, the alignment slack."""
        s = self.resolve().stages
        return 128 * (FP8_BLOCK_M + 2 * s * FP8_BLOCK_N) + MBARRIER_BYTES * (1 + 3 * s) + SMEM_ALIGN

    def defines(self, out_dtype: str) -> dict:
        c = self.resolve()
        out = dict(IK_DTYPE=DTYPE_IDS[out_dtype], HEAD_DIM=128, BLOCK_M=FP8_BLOCK_M, BLOCK_N=FP8_BLOCK_N,
                   STAGES=c.stages, P_SCALE=f"{float(P_SCALE)!r}f", QUANT_THREADS=QUANT_THREADS)
        if c.version in FP8_PIPELINED:
            out["PINGPONG"] = int(c.pingpong)
        return out


def vt_key_order() -> np.ndarray:
    """Position p of a 32-key group of V^T holds key ``vt_key_order()[p]``: the order in which
    the e4m3 A fragment of P reads the keys its thread already holds (fa_fp8_v1.cu, fa_fp8_v2.cu)."""
    p = np.arange(32)
    h, t, i = p // 16, (p % 16) // 4, p % 4
    return 16 * h + 8 * (i // 2) + 2 * t + (i % 2)


@dataclass
class Fp8Inputs:
    """Q, K, V as the FP8 kernel reads them (device arrays of the caller's library).

    q (B, Hq, Nq, d) and k (B, Hkv, Nk, d) e4m3 codes (uint8); vt (B, Hkv, d, Nk_pad) the codes
    of V^T, keys in :func:`vt_key_order` within each 32-key group, zero past Nk; q_scale (B, Hq,
    ceil(Nq / Br)), k_scale and v_scale (B, Hkv, ceil(Nk / Bc)) float32; ``signs``: the
    Hadamard signs applied to Q and K (None: none); ``dtype``: the 16-bit dtype O will have.
    """

    q: object
    k: object
    vt: object
    q_scale: object
    k_scale: object
    v_scale: object
    nk: int
    dtype: str
    signs: np.ndarray | None = None


def _check_inputs(q, k, v, causal, hadamard):
    info = cv.check_qkv(q, k, v, allowed=FP8_DTYPES)
    if info["head_dim"] not in FP8_HEAD_DIMS:
        raise ValueError(f"q: the FP8 kernel takes head_dim in {FP8_HEAD_DIMS}, got {info['head_dim']}")
    cv.check_bool(causal, "causal")
    cv.check_bool(hadamard, "hadamard")
    return info


def require_hopper():
    why = available()
    if why is not None:
        raise ValueError(f"q: the FP8 Hopper kernel cannot run here: {why}")


def quantize_qkv(q, k, v, *, hadamard=False, seed=0, signs=None) -> Fp8Inputs:
    """Q, K, V (float16 / bfloat16, (B, H, N, 128)) -> :class:`Fp8Inputs` on the GPU.

    ``hadamard``: multiply Q and K by the same D H / sqrt(d) first (:func:`..hadamard.fwht`, in
    float32), with ``signs`` or, if None, the signs :func:`iokernels.fp8.random_signs` draws
    from ``numpy.random.default_rng(seed)``.
    """
    info = _check_inputs(q, k, v, False, hadamard)
    s = resolve_signs(info["head_dim"], signs, None if signs is not None else seed) if hadamard else None
    require_hopper()
    call = Call(q, name="q")
    with on_stream(call.stream_ptr()):
        return _quantize(call, q, k, v, info, s)


def _quantize(call, q, k, v, info, signs) -> Fp8Inputs:
    dtype, d = info["dtype"], info["head_dim"]
    B, Hq, Nq, Hkv, Nk = info["batch"], info["heads_q"], info["seqlen_q"], info["heads_kv"], info["seqlen_k"]
    qd, kd, vd = (call.to_device(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    tq, tk = -(-Nq // FP8_BLOCK_M), -(-Nk // FP8_BLOCK_N)
    nk_pad = tk * FP8_BLOCK_N
    out = Fp8Inputs(call.empty((B, Hq, Nq, d), "uint8"), call.empty((B, Hkv, Nk, d), "uint8"),
                    call.empty((B, Hkv, d, nk_pad), "uint8"), call.empty((B, Hq, tq), "float32"),
                    call.empty((B, Hkv, tk), "float32"), call.empty((B, Hkv, tk), "float32"), Nk, dtype, signs)
    if B * Hq * Nq == 0 or Nk == 0:
        return out
    defines = Fp8Config().defines(dtype)
    rows = function(FP8_FILE, "fp8_quantize_rows", defines, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES)
    for x, codes, scales, heads, n, tile in ((qd, out.q, out.q_scale, Hq, Nq, FP8_BLOCK_M),
                                             (kd, out.k, out.k_scale, Hkv, Nk, FP8_BLOCK_N)):
        src = device_array(contiguous(x, 16), dtype)
        in_f32 = 0
        if signs is not None:                       # incoherent processing: x D H / sqrt(d), float32
            h = call.empty(tuple(src.shape), "float32")
            launch_fwht(src, h, dtype=dtype, signs=signs, out_f32=True)
            src, in_f32 = device_array(h), 1
        rows((-(-n // tile), B * heads), (QUANT_THREADS,),
             (src.arg, np.int32(in_f32), device_array(codes).arg, device_array(scales).arg, np.int32(n),
              np.int32(tile)))
    vt = function(FP8_FILE, "fp8_quantize_vt", defines, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES)
    vsrc = device_array(contiguous(vd, 16), dtype)
    vt((tk, B * Hkv), (QUANT_THREADS,), (vsrc.arg, device_array(out.vt).arg, device_array(out.v_scale).arg,
                                         np.int32(Nk), np.int32(nk_pad)))
    return out


def tensor_map_u8(ptr: int, dims, strides_bytes, box) -> np.ndarray:
    """A TMA tensor map (CUtensorMap) of a one-byte (e4m3 codes as uint8) tensor, 128-byte swizzle
    (:func:`.tensor_maps.tensor_map`'s arguments; box[0] = 128 bytes, the swizzle width)."""
    return tensor_map(ptr, "uint8", dims, strides_bytes, box)


def fp8_attention_codes(x: Fp8Inputs, *, causal=False, scale=None, config=None):
    """The FP8 forward on codes made by :func:`quantize_qkv`: (O in ``x.dtype``, LSE float32).
    ``config``: an :class:`Fp8Config` (the version, the stages, v2's ping-pong) or None."""
    if not isinstance(x, Fp8Inputs):
        raise ValueError(f"x: expected Fp8Inputs (quantize_qkv), got {type(x).__name__}")
    cv.check_bool(causal, "causal")
    cfg = (config or Fp8Config())
    if not isinstance(cfg, Fp8Config):
        raise ValueError(f"config: expected an Fp8Config or None, got {type(cfg).__name__}")
    require_hopper()
    call = Call(x.q, name="q")
    with on_stream(call.stream_ptr()):
        return _forward(call, x, causal, cfg, scale)


def _forward(call, x: Fp8Inputs, causal, cfg, scale):
    qd, kd, vtd = device_array(x.q, "uint8"), device_array(x.k, "uint8"), device_array(x.vt, "uint8")
    B, Hq, Nq, d = qd.shape
    Hkv, Nk = kd.shape[1], x.nk
    scale = cv.resolve_scale(scale, d)
    o = call.empty((B, Hq, Nq, d), x.dtype)
    lse = call.empty((B, Hq, Nq), "float32")
    if B * Hq * Nq == 0:
        return o, lse
    if Nk == 0:
        fill(o, 0)
        fill(lse, -math.inf)
        return o, lse
    smem = cfg.smem_bytes()
    optin = device_info()["smem_optin"]
    if smem > optin:
        raise ValueError(f"config.stages: {cfg.resolve().stages} stages need {smem} bytes of SRAM; "
                         f"this GPU allows {optin}")
    nk_pad = vtd.shape[3]
    maps = (tensor_map_u8(qd.ptr, (d, Nq, B * Hq), (d, d * Nq), (d, FP8_BLOCK_M, 1)),
            tensor_map_u8(kd.ptr, (d, Nk, B * Hkv), (d, d * Nk), (d, FP8_BLOCK_N, 1)),
            tensor_map_u8(vtd.ptr, (nk_pad, d, B * Hkv), (nk_pad, nk_pad * d), (FP8_BLOCK_N, d, 1)))
    left, right = cv.effective_window(bool(causal), None)
    heavy_first = right >= 0 and Nq > FP8_BLOCK_M
    fn = function(cfg.file, cfg.file, cfg.defines(x.dtype), smem, options=HOPPER_OPTIONS, sources=HOPPER_SOURCES)
    i32 = np.int32
    args = (*maps, *(device_array(a, "float32").arg for a in (x.q_scale, x.k_scale, x.v_scale)),
            device_array(o, x.dtype).arg, device_array(lse, "float32").arg, i32(Nq), i32(Nk), i32(Hq), i32(Hkv),
            np.float32(scale * math.log2(math.e)), i32(left), i32(right), i32(heavy_first))
    fn((-(-Nq // FP8_BLOCK_M), Hq, B), (FP8_THREADS,), args, shared_mem=smem)
    return o, lse


def fp8_attention(q, k, v, *, causal=False, scale=None, hadamard=False, seed=0, signs=None, config=None):
    """FP8 (e4m3) attention forward on Hopper: (O, LSE).  Opt-in: FP8 changes accuracy.

    q (B, Hq, Nq, 128), k and v (B, Hkv, Nk, 128), float16 or bfloat16: torch CUDA tensors or
    CuPy arrays (used in place when contiguous) or NumPy arrays (copied).  Quantized per tile
    (:func:`quantize_qkv`), then :func:`fp8_attention_codes`.  ``hadamard``: incoherent
    processing of Q and K with the signs of ``seed`` (or ``signs``).  ``causal``: bottom-right.
    ``config``: an :class:`Fp8Config` (the forward's version, stages, v2's ping-pong) or None.
    O has q's dtype; LSE is float32 (B, Hq, Nq), natural log; rows that see no key give O = 0,
    LSE = -inf.  A wrong dtype, head_dim, shape or config, or a GPU that is not Hopper, is a
    ValueError naming the argument.
    """
    info = _check_inputs(q, k, v, causal, hadamard)
    s = resolve_signs(info["head_dim"], signs, None if signs is not None else seed) if hadamard else None
    cfg = config or Fp8Config()
    if not isinstance(cfg, Fp8Config):
        raise ValueError(f"config: expected an Fp8Config or None, got {type(cfg).__name__}")
    require_hopper()
    call = Call(q, name="q")
    dtype = info["dtype"]
    with on_stream(call.stream_ptr()):
        x = _quantize(call, q, k, v, info, s)
        o, lse = _forward(call, x, causal, cfg, scale)
    return call.finish(o, dtype), call.finish(lse, "float32")
