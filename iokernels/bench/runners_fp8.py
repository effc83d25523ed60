"""The benchmark's FP8 rows: the opt-in FP8 Hopper forward next to the 16-bit one and SDPA.

Each case is bfloat16 inputs (B, H, N, d = 128), causal or not.  Rows, in the case format of
the other sections (ms, host_ms, TFLOP/s at 4 B H N^2 d FLOPs, halved for causal):

* ``cupy:v5`` -- the 16-bit Hopper forward, the row the FP8 rows are rated against
  (``speed_vs_bf16``: its time / the row's);
* ``cupy:fp8`` -- :func:`iokernels.cupy_raw.hopper.fp8_attention`, what a caller waits for: the
  quantization kernels (Q and K rows, V to its transposed codes) and the FP8 forward;
* ``cupy:fp8+hadamard`` -- the same after the randomized Hadamard transform of Q and K;
* ``cupy:fp8 quantize`` and ``cupy:fp8 forward`` -- the two halves of ``cupy:fp8`` (the forward
  on codes made once: :func:`~iokernels.cupy_raw.hopper.fp8_attention_codes`), where the time goes;
* ``cupy:fp8 v2`` and ``cupy:fp8 v2 forward`` -- the same two with the forward's version 2
  (fa_fp8_v2: ping-pong and the softmax overlapped with P V), and ``cupy:fp8 v2 forward
  no-pingpong`` (only the overlap inside a warpgroup): in the same case as the v1 rows (the rows
  above, whose forward is the default, v1), so one run compares them;
* the SDPA kernels (FLASH, cuDNN, ...), as in every prefill case; ``speed_vs_best_sdpa``.

Only the 16-bit rows are checked against SDPA here (FP8 rounds far more than the check's
tolerance); the FP8 error against the float64 oracle is the tests' (tests/test_hopper_fp8.py).
"""
from __future__ import annotations

from .runners import _finish_case, _first_line, _measure, _sdpa_rows, speed_vs_first
from .timer import release_device_cache

#: the FP8 section's cases: the head-to-head shape of the other sections, bf16 in and out
FP8 = dict(batch=8, heads=16, head_dim=128, seqlens=(4096,), causal=(False, True), dtype="bfloat16")


def fp8_cases(spec, seed, progress, section="fp8", target_ms=None, into=None):
    """The cases of ``spec`` (seqlens x causal); see the module."""
    import torch
    from ..cupy_raw import hopper as hp
    cases = [] if into is None else into
    B, H, d, dtype = spec["batch"], spec["heads"], spec["head_dim"], spec["dtype"]
    for N in spec["seqlens"]:
        for causal in spec["causal"]:
            flops = 4.0 * B * H * N * N * d / (2 if causal else 1)
            case = dict(section=section, kind="prefill", dtype=dtype, causal=causal,
                        shape=dict(batch=B, heads=H, seqlen=N, head_dim=d), work=dict(flops=flops),
                        unit="TFLOP/s", results=[])
            progress.set_description(f"{section} B={B} H={H} N={N} causal={causal}")
            gen = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = (torch.randn((B, H, N, d), device="cuda", dtype=getattr(torch, dtype), generator=gen)
                       for _ in range(3))
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            v5 = hp.HopperConfig(version="v5")
            rows = [_measure("cupy:v5", "cupy", lambda: hp.attention(q, k, v, causal=causal, config=v5),
                             work=flops, unit="TFLOP/s", ref=ref, dtype=dtype, target_ms=target_ms)]
            v2, v2_alone = hp.Fp8Config(version="v2"), hp.Fp8Config(version="v2", pingpong=False)
            try:
                codes = hp.quantize_qkv(q, k, v)
                fp8_rows = (("cupy:fp8", lambda: hp.fp8_attention(q, k, v, causal=causal)),
                            ("cupy:fp8+hadamard", lambda: hp.fp8_attention(q, k, v, causal=causal, hadamard=True)),
                            ("cupy:fp8 quantize", lambda: hp.quantize_qkv(q, k, v)),
                            ("cupy:fp8 forward", lambda: hp.fp8_attention_codes(codes, causal=causal)),
                            ("cupy:fp8 v2", lambda: hp.fp8_attention(q, k, v, causal=causal, config=v2)),
                            ("cupy:fp8 v2 forward", lambda: hp.fp8_attention_codes(codes, causal=causal, config=v2)),
                            ("cupy:fp8 v2 forward no-pingpong",
                             lambda: hp.fp8_attention_codes(codes, causal=causal, config=v2_alone)))
                for name, fn in fp8_rows:
                    rows.append(_measure(name, "cupy", fn, work=flops, unit="TFLOP/s", dtype=dtype, check=False,
                                         target_ms=target_ms))
            except Exception as e:  # no Hopper, no cuda-python: the rows say why, the sweep goes on
                rows.append({"runner": "cupy:fp8", "group": "cupy",
                             "status": f"unavailable: {type(e).__name__}: {_first_line(e)}"})
            speed_vs_first(rows, "speed_vs_bf16")
            rows += _sdpa_rows(case, q, k, v, causal, ref, dtype, False, flops, "TFLOP/s", False, target_ms)
            progress.update(1)
            case["results"] = rows
            cases.append(_finish_case(case))
            q = k = v = ref = codes = None
            release_device_cache()
    return cases
