"""The Numba paged prefill on a GPU (skipped without one): a packed batch of long and short
chunks through the block table, torch tensors in and out, held to the float64 oracle on a
gathered contiguous copy with the same-precision naive baseline (the 2x rule)."""
import numpy as np
import pytest

import iokernels as ik
from iokernels import gpu, testing
from iokernels.core import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu.simulator_enabled() or not gpu.torch_gpu(),
                                 reason="needs a CUDA GPU with torch (and the simulator off)")]


@pytest.mark.parametrize("hq,hkv,d,dtype", [(32, 8, 128, "float16"), (4, 4, 64, "float32"), (8, 1, 64, "float64")])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_real_sizes(hq, hkv, d, dtype, causal):
    import torch
    rng = np.random.default_rng(d + hq)
    lens, chunks = (1000, 300, 77, 16), (1000, 64, 1, 16)
    cache = ik.PagedKVCache(sum(-(-n // 16) for n in lens) + 3, 16, num_kv_heads=hkv, head_dim=d, dtype=dtype)
    sids = []
    for n in lens:
        sids.append(cache.new_sequence())
        cache.append(sids[-1], *(rng.standard_normal((n, hkv, d)).astype(dtype) for _ in range(2)))
    cq = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    qn = rng.standard_normal((int(cq[-1]), hq, d)).astype(dtype)
    o, lse = ik.paged_prefill(torch.as_tensor(qn, device="cuda"), cache, sids, cq, causal=causal, backend="numba",
                              return_lse=True)
    assert isinstance(o, torch.Tensor) and o.is_cuda
    base, base_lse = ik.paged_prefill(qn, cache, sids, cq, causal=causal, backend="naive", return_lse=True)
    ref = np.zeros(qn.shape)
    ref_lse = np.full((hq, qn.shape[0]), -np.inf)
    for b, sid in enumerate(sids):
        rows = slice(int(cq[b]), int(cq[b + 1]))
        k, v = (x.astype(np.float64)[None] for x in cache.gather(sid))
        ob, lb = reference.attention(qn[rows].astype(np.float64).transpose(1, 0, 2)[None], k, v, causal=causal)
        ref[rows], ref_lse[:, rows] = ob[0].transpose(1, 0, 2), lb[0]
    testing.assert_close(o, ref, base, dtype=dtype, name=f"paged prefill O {dtype}")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=1e-4, name=f"paged prefill LSE {dtype}")
