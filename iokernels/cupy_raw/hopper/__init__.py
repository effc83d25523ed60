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
v6       fa_v6.cu           head_dim 64 only: three consumer warpgroups (Br = 192, 512 threads,
                            160 registers a consumer thread) take turns on the tensor cores in a
                            round of three named barriers, so each K/V tile in SRAM serves 1.5x
                            the rows; one softmax with a run-time mask keeps a consumer in its
                            registers.  Held back from the default until a GPU has measured it
v7       fa_v7.cu           v5 with two empty barriers a stage: a consumer releases K_j once S_j
                            is in its registers and V_{j-1} once P_{j-1} V_{j-1} is, and the
                            producer refills each as soon as it is free.  Two stages (all that
                            fits at head_dim 256) then keep the next tiles landing while a tile
                            is computed, where v5 exposes every load there (its default gate:
                            head_dim 256, policy.hopper_v7_default_at)
v8       fa_v8.cu           the masked copy of the softmax reads two key bounds a row, computed
                            once (fa_v6's), instead of testing Nk, the window and the diagonal
                            key by key; and at head_dim 256 FlashAttention-3's 80-key tile, whose
                            two stages v7's release keeps landing.  Its gate opens at every head
                            dim (policy.hopper_v8_default_at); the default where v9, v10 and v11
                            are not (policy.hopper_forward_for_length)
v9       fa_v9.cu           v8 as a persistent kernel: min(query tiles, SMs) blocks, each claiming
                            tiles from a counter; Q has an empty barrier, so the producer loads
                            the next tile's Q and K/V tiles while the consumers finish the last
                            P V and write O, and the ring runs on from tile to tile.  The same
                            bits as v8.  The default where a query tile reads few key tiles
                            (short sequences), where it measured faster than v8; slower on long
                            ones (policy.hopper_forward_for_length)
v10      fa_v10.cu          head_dim 64 only: v8 with v6's three consumer warpgroups (Br = 192)
                            and their round of three, so a softmax hides behind two other
                            warpgroups' products where at d = 64 one's are shorter than it.  The
                            same bits as v8.  The default at head_dim 64 where a query tile reads
                            many key tiles, where it measured faster than v8; slower on short
                            causal ones (policy.hopper_forward_for_length)
v11      fa_v11.cu          v8 with its blocks longest first: under the causal mask the heads are
                            taken in groups whose K and V fit the L2 cache, and within a group
                            every head's heaviest query tile starts first, so the grid ends on
                            short tiles (policy.forward_lpt_pairs; bwd_v5's order).  The same
                            bits as v8.  The default at head_dim 128 and 256 under the causal
                            mask where a query tile reads many key tiles (measured faster than
                            v8 there, slower on short ones: policy.hopper_forward_for_length)
=======  =================  ===================================================================

The default chooses by the call's lengths and band
(:func:`~iokernels.cupy_raw.policy.hopper_forward_for_length`, thresholds measured in
benchmarks/results/sweeps): v9 where a query tile reads few key tiles, then v10 at head_dim 64,
v11 under the causal mask at 128 and 256, and v8 otherwise; ``HopperConfig().resolve(d)`` alone,
which knows no lengths, takes v8 (:func:`~iokernels.cupy_raw.hopper.config.default_version`).  The
registry ranks v11 > v10 > v9 > v8 > ... > v3, all above the portable versions (at the head dims its
default picks them: 64, 128 and 256); v6 is held back from the default until it is measured
(:data:`~iokernels.cupy_raw.policy.HELD_BACK`), v7 and v8 have head-dim gates
(:func:`~iokernels.cupy_raw.policy.hopper_v7_default_at`: 256; ``hopper_v8_default_at``: all three),
v9, v10 and v11 length gates.

Notation (the papers' names):

=======  ===========================================================================
Br, Bc   query rows a block owns (BLOCK_M = 128: two consumer warpgroups of 64 rows; v6, v10: 192),
         keys a K/V tile holds (``HopperConfig.block_n``)
Tr, Tc   ceil(Nq / Br) query tiles (the grid's x; v9's blocks claim them), the K/V tiles a
         block visits
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

Scope: float16 and bfloat16; head_dim 64, 128 and 256; causal (bottom-right) and windows, tiles
no row can see skipped; GQA/MQA; Nq != Nk; any lengths; LSE returned (float32).  At head_dim 256
a consumer's O is 64 x 256 (128 float32 registers a thread, one m64n256k16 wgmma a k-step of
P V), so the tiles are Bc = 64 with two stages (:func:`~iokernels.cupy_raw.policy.hopper_tiles`).
The registry's default picks these kernels at the head dims
:func:`~iokernels.cupy_raw.policy.hopper_default_at` allows (each measured on a GPU first); a
config naming the version runs it anywhere it fits,
``ik.attention(q, k, v, backend="cupy", config=HopperConfig(version="v5"))``.  Nothing here
touches a GPU at import; compiled kernels (in :mod:`.launch`'s cache, keyed by kernel, defines and device) and
the device facts (:func:`~iokernels.cupy_raw.launch.device_info`) are the only state.

==============  ============================================================
module          what it holds
==============  ============================================================
config          the constants and :class:`HopperConfig`
checks          :func:`available`, the registry check
tensor_maps     :func:`tensor_map` (cuTensorMapEncodeTiled)
attention       the attention launch and its argument builder
gemm            :func:`gemm` (hopper_gemm.cu)
records         the records of v3 .. v11
oracle          :func:`oracle_check`, :func:`gemm_check` (on a GPU)
fp8_forward     :func:`fp8_attention` (fa_fp8_v1.cu, fa_fp8_v2.cu): FP8 products, opt-in
==============  ============================================================
"""
from ..launch import HOPPER_OPTIONS as NVRTC_OPTIONS  # noqa: F401
from ..launch import HOPPER_SOURCES as SOURCES  # noqa: F401
from ..launch import KERNEL_DIR, hopper_source as source  # noqa: F401
from .config import (BLOCK_M, BLOCK_MS, BLOCK_N_CHOICES, DEFAULT_VERSION, DTYPES, default_version,  # noqa: F401
                     FALLBACK_SMEM_OPTIN, GEMM_BK, GEMM_BM, GEMM_BN, GEMM_GROUP_M, GEMM_STAGES, GEMM_THREADS,
                     HEAD_DIMS, HOPPER_CC, LONGEST_FIRST, MAX_STAGES, MBARRIER_BYTES, PANEL, PERSISTENT, SMEM_ALIGN,
                     THREADS, VERSION_HEAD_DIMS, VERSIONS, HopperConfig, block_n_choices, grid, head_dims)
from .checks import available, check, default_check, require_available  # noqa: F401
from .tensor_maps import tensor_map  # noqa: F401
from .attention import (attention, attention_args, launch_attention, longest_first_pairs,  # noqa: F401
                        lpt_attention_args, persistent_attention_args)
from .gemm import gemm, gemm_defines, gemm_smem_bytes  # noqa: F401
from .records import RECORDS  # noqa: F401
from .oracle import gemm_check, oracle_check  # noqa: F401
from .fp8_forward import Fp8Config, Fp8Inputs, fp8_attention, fp8_attention_codes, quantize_qkv  # noqa: F401

