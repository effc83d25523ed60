"""One spec, every backend: each registered (backend, op, version) held to the float64 oracle.

The GPU backends' registries (:mod:`iokernels.core.registry`) list every kernel version;
this suite runs each one that can run here (on a GPU, on Numba's CUDA simulator, or on
Triton's interpreter) at awkward shapes through the public functions, with the shared checker
(FlashAttention's 2x rule, fully masked rows 0 / LSE -inf), so a new version is tested the
moment it is registered.  Versions that cannot run here are skipped with their reason.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import iokernels as ik
from iokernels import api
from iokernels.core import reference, testing
from iokernels.core.gpu import cupy_gpu, simulator_enabled, torch_gpu

#: what each backend can be run on here; the simulator is tiny, so its shapes are tiny
SIM = simulator_enabled()
#: absolute LSE tolerance (nats) on top of the 2x rule: base-2 exponent and log conversions
LSE_ATOL = 1e-4


def _backend_ready(backend: str) -> str | None:
    if backend == "numba":
        return None if (SIM or torch_gpu() or cupy_gpu()) else "no GPU and no Numba simulator"
    if backend == "cupy":
        return None if (cupy_gpu() and not SIM) else "CuPy needs a CUDA GPU"
    if backend == "triton":
        from iokernels.triton_backend import launch
        return launch.unavailable()
    return None


def _kernels():
    out = []
    for backend, mod in api.GPU_BACKENDS.items():
        try:
            reg = importlib.import_module(mod).REGISTRY
        except Exception as e:  # pragma: no cover - a broken backend import fails loudly below
            out.append(pytest.param(backend, None, None, id=f"{backend}-import",
                                    marks=pytest.mark.xfail(reason=str(e), strict=True)))
            continue
        for k in reg:
            out.append(pytest.param(backend, k.op, k.version, id=f"{backend}-{k.op}-{k.version}"))
    return out


def _run_or_skip(backend, op, version, need):
    why = _backend_ready(backend)
    if why:
        pytest.skip(why)
    mod = importlib.import_module(api.GPU_BACKENDS[backend])
    kernel = mod.REGISTRY.get(op, version)
    reason = kernel.unavailable(mod.need(op, **need))
    if reason:
        pytest.skip(f"{kernel.name}: {reason}")
    return kernel.config_class(version=version)


def _triton_interpreted() -> bool:
    from iokernels.triton_backend import launch
    return launch.interpreting() or not launch.cuda_gpu()


#: (dtype, head_dim) per backend: the simulator runs tiny problems only
def _dtypes(backend):
    if backend == "numba":
        return ("float32", "float16") if SIM else ("float32", "float16", "float64")
    return ("float16", "bfloat16", "float32")       # cupy, triton (float32 accumulation: no float64)


def _sizes(backend):
    if backend == "numba" and SIM:
        return dict(batch=1, heads_q=2, heads_kv=1, seqlen_q=9, seqlen_k=13, head_dim=8)
    if backend == "triton" and _triton_interpreted():   # Triton's interpreter: every program in NumPy
        return dict(batch=1, heads_q=4, heads_kv=2, seqlen_q=21, seqlen_k=35, head_dim=24)
    return dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=131, head_dim=64)


def _check_mla(backend, version, rng):
    from iokernels.cupy_raw.mla import ROW, mla_decode
    from iokernels.mla import reference_latent
    from iokernels.torch_sdpa import mla_decode_matmul
    for dtype in ("bfloat16", "float16"):
        q = rng.standard_normal((3, 48, ROW)).astype(testing.numpy_dtype(dtype))
        kv = rng.standard_normal((3, 131, ROW)).astype(testing.numpy_dtype(dtype))
        cfg = _run_or_skip(backend, "mla_decode", version, dict(q=q, k=kv))
        lens = np.array([131, 1, 0], dtype=np.int32)
        o, lse = mla_decode(q, kv, seq_lens=lens, config=cfg)
        ref, ref_lse = reference_latent(q, kv, 512, seq_lens=lens)
        base, _ = mla_decode_matmul(q, kv, seq_lens=lens)
        testing.assert_close(o, ref, base, dtype=dtype, masked_rows=(lens == 0)[:, None, None],
                             name=f"{backend} {version} mla_decode O {dtype}")
        assert np.all(np.isneginf(np.asarray(lse)[2]))


def _check_paged_prefill(backend, version, dtype, sz, rng):
    """Ragged chunks (a whole prompt, a partial chunk, a decode row, an empty chunk) over a block table."""
    hkv, hq, d, n = sz["heads_kv"], sz["heads_q"], sz["head_dim"], sz["seqlen_k"]
    lens, chunks = (n, 7, 5, 0), (n, 3, 1, 0)
    cache = ik.PagedKVCache(sum(-(-m // 4) for m in lens) + 2, block_size=4, num_kv_heads=hkv, head_dim=d,
                            dtype=testing.numpy_dtype(dtype))
    sids = [cache.new_sequence() for _ in lens]
    for sid, m in zip(sids, lens):
        if m:
            cache.append(sid, *(rng.standard_normal((m, hkv, d)).astype(cache.dtype) for _ in range(2)))
    cq = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), hq, d)).astype(cache.dtype)
    cfg = _run_or_skip(backend, "paged_prefill", version, dict(q=q, cache=cache))
    o, lse = ik.paged_prefill(q, cache, sids, cq, backend=backend, config=cfg, return_lse=True)
    base, base_lse = ik.paged_prefill(q, cache, sids, cq, backend="naive", return_lse=True)
    ref = np.zeros(q.shape)
    ref_lse = np.full((hq, q.shape[0]), -np.inf)
    for b, sid in enumerate(sids):
        rows = slice(int(cq[b]), int(cq[b + 1]))
        if rows.stop > rows.start:
            k, v = (x.astype(np.float64)[None] for x in cache.gather(sid))
            ob, lb = reference.attention(q[rows].astype(np.float64).transpose(1, 0, 2)[None], k, v, causal=True)
            ref[rows], ref_lse[:, rows] = ob[0].transpose(1, 0, 2), lb[0]
    testing.assert_close(o, ref, base, dtype=dtype, name=f"{backend} {version} paged prefill O {dtype}")
    testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=LSE_ATOL,
                         name=f"{backend} {version} paged prefill LSE {dtype}")


@pytest.mark.parametrize("backend,op,version", _kernels())
def test_registered_kernel_matches_the_oracle(backend, op, version, rng):
    assert op in (None,) + ("attention", "attention_backward", "decode", "paged_decode", "paged_gather",
                            "paged_prefill", "mla_decode")
    if op == "mla_decode":                   # its own shapes: absorbed queries against 576-value rows
        _check_mla(backend, version, rng)
        return
    for dtype in _dtypes(backend):
        sz = _sizes(backend)
        q, k, v = testing.make_inputs(rng, dtype=dtype, **sz)
        if op == "attention":
            cfg = _run_or_skip(backend, op, version, dict(q=q, k=k, v=v))
            for causal, window in ((False, None), (True, None), (False, (3, 2))):
                o, lse = ik.attention(q, k, v, causal=causal, window=window, backend=backend, config=cfg,
                                      return_lse=True)
                ref, ref_lse = reference.attention(q, k, v, causal=causal, window=window)
                base, base_lse = ik.attention(q, k, v, causal=causal, window=window, backend="naive",
                                              return_lse=True)
                testing.assert_close(o, ref, base, dtype=dtype, name=f"{backend} {version} O {dtype}")
                # LSE is float32 in every backend whatever the storage dtype; the kernels' exp2/log2
                # forms add rounding the naive float32 baseline does not have: LSE_ATOL covers it
                testing.assert_close(lse, ref_lse, base_lse, dtype=dtype, atol=LSE_ATOL,
                                     name=f"{backend} {version} LSE {dtype}")
        elif op == "decode":
            qd = testing.make_inputs(rng, batch=3, heads_q=sz["heads_q"], heads_kv=sz["heads_kv"], seqlen_q=1,
                                     seqlen_k=1, head_dim=sz["head_dim"], dtype=dtype)[0][:, :, 0]
            kd, vd = (testing.make_inputs(rng, batch=3, heads_q=sz["heads_kv"], seqlen_q=sz["seqlen_k"],
                                          head_dim=sz["head_dim"], dtype=dtype)[0] for _ in range(2))
            cfg = _run_or_skip(backend, op, version, dict(q=qd, k=kd, v=vd))
            lens = np.array([sz["seqlen_k"], 1, 0], dtype=np.int32)
            o, lse = ik.decode(qd, kd, vd, seq_lens=lens, backend=backend, config=cfg, return_lse=True)
            ref, ref_lse = reference.decode(qd, kd, vd, seq_lens=lens)
            base = ik.decode(qd, kd, vd, seq_lens=lens, backend="naive")
            testing.assert_close(o, ref, base, dtype=dtype, masked_rows=(lens == 0)[:, None, None],
                                 name=f"{backend} {version} decode O {dtype}")
            assert np.all(np.isneginf(np.asarray(testing.as_numpy(lse))[2]))
        elif op in ("paged_decode", "paged_gather"):
            if dtype == "bfloat16" and backend == "numba":
                continue                                   # the Numba kernels take no bfloat16
            cache = ik.PagedKVCache(24, block_size=4, num_kv_heads=sz["heads_kv"], head_dim=sz["head_dim"],
                                    dtype=testing.numpy_dtype(dtype))
            sids = [cache.new_sequence() for _ in range(3)]
            for sid, n in zip(sids, (sz["seqlen_k"] % 23 + 2, 5, 0)):
                kk, vv = (testing.make_inputs(rng, batch=1, heads_q=n or 1, seqlen_q=sz["heads_kv"],
                                              head_dim=sz["head_dim"], dtype=dtype)[0][0][:n] for _ in range(2))
                if n:
                    cache.append(sid, kk, vv)
            if op == "paged_gather":
                cfg = _run_or_skip(backend, op, version, dict(cache=cache))
                for sid in sids[:2]:
                    kg, vg = cache.gather(sid, backend=backend, config=cfg)
                    kr, vr = cache.gather(sid)
                    assert np.array_equal(testing.as_numpy(kg), kr) and np.array_equal(testing.as_numpy(vg), vr)
                continue
            qd = testing.make_inputs(rng, batch=3, heads_q=sz["heads_q"], seqlen_q=1, seqlen_k=1,
                                     head_dim=sz["head_dim"], dtype=dtype)[0][:, :, 0]
            cfg = _run_or_skip(backend, op, version, dict(q=qd, cache=cache))
            o, lse = ik.paged_decode(qd, cache, sids, backend=backend, config=cfg, return_lse=True)
            base, _ = ik.paged_decode(qd, cache, sids, backend="tiled", return_lse=True)
            n = max(cache.seq_len(s) for s in sids)
            kk = np.stack([np.pad(cache.gather(s)[0].astype(np.float64), ((0, 0), (0, n - cache.seq_len(s)), (0, 0)))
                           for s in sids])
            vv = np.stack([np.pad(cache.gather(s)[1].astype(np.float64), ((0, 0), (0, n - cache.seq_len(s)), (0, 0)))
                           for s in sids])
            lens = np.array([cache.seq_len(s) for s in sids])
            ref, _ = reference.decode(qd, kk, vv, seq_lens=lens)
            testing.assert_close(o, ref, base, dtype=dtype, masked_rows=(lens == 0)[:, None, None],
                                 name=f"{backend} {version} paged decode {dtype}")
        elif op == "paged_prefill":
            if dtype == "bfloat16" and backend == "numba":
                continue                                   # the Numba kernels take no bfloat16
            _check_paged_prefill(backend, version, dtype, sz, rng)
        elif op == "attention_backward":
            cfg = _run_or_skip(backend, op, version, dict(q=q, k=k, v=v))
            do = testing.make_inputs(rng, dtype=dtype, **sz)[0]
            for causal in (False, True):
                o, lse = ik.attention(q, k, v, causal=causal, backend="tiled", return_lse=True)
                grads = ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend=backend, config=cfg)
                refs = reference.attention_backward(do, q, k, v, causal=causal)
                bases = ik.attention_backward(do, q, k, v, o, lse, causal=causal, backend="naive")
                for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases):
                    testing.assert_close(g, r, b, dtype=dtype, factor=testing.GRADIENT_FACTOR,
                                         name=f"{backend} {version} {name} {dtype}")


def test_every_registered_kernel_has_a_summary_and_a_config_class():
    for backend, mod in api.GPU_BACKENDS.items():
        reg = importlib.import_module(mod).REGISTRY
        assert len(reg) > 0
        for k in reg:
            assert k.summary and len(k.summary) < 200, k.name
            cfg = k.config_class(version=k.version)
            assert cfg.version == k.version and isinstance(k.version, str) and k.version.startswith("v")
