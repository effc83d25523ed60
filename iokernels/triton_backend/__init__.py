"""The kernels in Triton: tiles and programs instead of threads, on a GPU or on Triton's interpreter.

Triton (Tillet et al., 2019; paper) is a Python language for GPU kernels in which a program
works on whole tiles (``tl.load`` of a block of rows, ``tl.dot`` of two tiles) and the
compiler decides how the tiles are laid out over threads and registers, staged through
shared memory and pipelined.  The kernels here are the FlashAttention forward, Flash-Decoding
and the backward of the NumPy progression, written that way.  Without a CUDA GPU they run on
Triton's interpreter (``TRITON_INTERPRET=1``, set by :func:`.launch.prepare`), which runs
each program in NumPy on the CPU: small problems only.

Triton is an optional extra (``pip install 'iokernels[triton]'``); without it the records
are still listed and every call says what to install.

=============  ==================================================================
module         what it holds
=============  ==================================================================
config         ForwardConfig, DecodeConfig, BackwardConfig; the tile lists (data)
registry       REGISTRY (every (op, version)), ``need``, the dispatching functions
forward        the forward launchers (host side)
forward_v1     forward v1 (a Triton kernel)
forward_v2     forward v2: off-band and on-band loops, autotuned tiles
decode         the decode launchers (contiguous and paged)
decode_v1      split-KV decode v1 and the merge (Triton kernels; v2 launches them deeper)
decode_v3      split-KV decode v3: a paged tile's block ids loaded a step ahead
pipeline       what Triton's pipeliner made of the decode loops, read from PTX (no GPU)
backward       the backward launcher (host side)
backward_v1    backward v1: D = rowsum(dO * O), dK/dV by K/V tile, dQ (Triton kernels)
tiles          the device functions the kernels share (the product, the key band)
launch         GPU or interpreter, the caller's arrays in and out
sanitize       every registered kernel at ragged shapes (for compute-sanitizer)
=============  ==================================================================

The versions (generated from the records in :mod:`.registry`; ``REGISTRY.version_table()``):

.. versions:triton:begin
====================  =======  =============================  ====  ==========================================
op                    version  file                           rank  what it adds
====================  =======  =============================  ====  ==========================================
attention             v2       triton_backend/forward_v2.py   2     off-band key tiles in a loop with no mask
                                                                    or bounds check, on-band tiles masked;
                                                                    tiles autotuned from a list on a GPU
attention             v1       triton_backend/forward_v1.py   1     one program per Q tile, the online softmax
                                                                    over K/V tiles in a loop, every tile
                                                                    masked
attention_backward    v1       triton_backend/backward_v1.py  1     FlashAttention-2's backward: P recomputed
                                                                    from the LSE, dK/dV by K/V tile over the
                                                                    GQA group, dQ by atomic adds or by a
                                                                    deterministic Q-tile pass
decode, paged_decode  v3       triton_backend/decode_v3.py    3     v2 with a paged tile's block ids loaded a
                                                                    step ahead, so the pipeliner runs the
                                                                    paged K/V copies ahead; three programs an
                                                                    SM, three stages (held back from the
                                                                    default until measured)
decode, paged_decode  v2       triton_backend/decode_v1.py    2     v1's kernel four programs deep: the split
                                                                    count fills four programs a
                                                                    multiprocessor, each with a two-stage
                                                                    pipeline, so enough loads are in flight to
                                                                    stream at memory speed
decode, paged_decode  v1       triton_backend/decode_v1.py    1     split-KV with the exact LSE merge; the
                                                                    query heads of one KV head share each K/V
                                                                    tile (GQA packed); paged: keys gathered
                                                                    through the block table
====================  =======  =============================  ====  ==========================================
.. versions:triton:end

Public functions (``ik.attention(..., backend="triton")`` etc. dispatch here): :func:`attention`,
:func:`decode`, :func:`paged_decode`, and on device pools :func:`paged_decode_pools`;
``ik.attention_backward(..., backend="triton")`` runs :func:`.backward.attention_backward`.
They take NumPy arrays (copied in and out) or torch tensors (CUDA tensors on a GPU, CPU
tensors under the interpreter) and return the kind given.  float16, bfloat16 and float32
inputs, float32 accumulation; float64 is refused with a ValueError that names the backends
that run it.
"""
from __future__ import annotations

from .config import BackwardConfig, DecodeConfig, ForwardConfig
from .registry import PLANNED, REGISTRY, attention, decode, need, paged_decode, paged_decode_pools
from .sanitize import sanitize_cases

__all__ = ["PLANNED", "REGISTRY", "need", "attention", "decode", "paged_decode", "paged_decode_pools", "ForwardConfig",
           "DecodeConfig", "BackwardConfig", "sanitize_cases"]
