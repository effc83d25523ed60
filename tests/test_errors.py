"""Bad input through the public API raises ValueError whose message names the argument.

Each case is one kind of mistake a learner makes; the test asserts the exception type
and that the message starts with (or names) the offending argument, so a message that
blames the wrong argument fails.  The inputs themselves are left untouched.
"""
import numpy as np
import pytest

import iokernels as ik
from iokernels import testing
from iokernels.core.config import TileConfig


@pytest.fixture
def qkv(rng):
    return testing.make_inputs(rng, batch=2, heads_q=4, heads_kv=2, seqlen_q=9, seqlen_k=11, head_dim=8)


@pytest.fixture
def packed(rng):
    return testing.make_varlen_inputs(rng, [3, 0, 4], [5, 2, 0], heads_q=2, head_dim=8)


def raises_naming(arg, fn, *a, **kw):
    with pytest.raises(ValueError) as info:
        fn(*a, **kw)
    msg = str(info.value)
    assert msg.split(":")[0].find(arg) >= 0, f"message does not name {arg!r}: {msg}"
    return msg


ATTENTION_CASES = {
    # name: (argument the message must name, function of (q, k, v) making the bad call)
    "rank": ("q", lambda q, k, v: ik.attention(q[0], k, v)),
    "int dtype": ("q", lambda q, k, v: ik.attention(q.astype(np.int32), k, v)),
    "complex dtype": ("k", lambda q, k, v: ik.attention(q, k.astype(np.complex128), v)),
    "q/k dtype mismatch": ("k", lambda q, k, v: ik.attention(q, k.astype(np.float32), v.astype(np.float32))),
    "head_dim mismatch": ("k", lambda q, k, v: ik.attention(q, k[..., :7], v[..., :7])),
    "heads not divisible": ("k", lambda q, k, v: ik.attention(q[:, :3], k, v)),
    "k/v shape mismatch": ("v", lambda q, k, v: ik.attention(q, k, v[:, :, :10])),
    "batch mismatch": ("k", lambda q, k, v: ik.attention(q, k[:1], v[:1])),
    "window negative": ("window", lambda q, k, v: ik.attention(q, k, v, window=(-2, 3))),
    "window scalar": ("window", lambda q, k, v: ik.attention(q, k, v, window=5)),
    "window float": ("window", lambda q, k, v: ik.attention(q, k, v, window=(2.5, 0))),
    "scale nan": ("scale", lambda q, k, v: ik.attention(q, k, v, scale=float("nan"))),
    "scale string": ("scale", lambda q, k, v: ik.attention(q, k, v, scale="0.1")),
    "scale bool": ("scale", lambda q, k, v: ik.attention(q, k, v, scale=True)),
    "causal int": ("causal", lambda q, k, v: ik.attention(q, k, v, causal=1)),
    "causal string": ("causal", lambda q, k, v: ik.attention(q, k, v, causal="yes")),
    "return_lse": ("return_lse", lambda q, k, v: ik.attention(q, k, v, return_lse=None)),
    "unknown backend": ("backend", lambda q, k, v: ik.attention(q, k, v, backend="cuda")),
    "oversized tiles": ("config", lambda q, k, v: ik.attention(q, k, v, config=TileConfig(1024, 1024))),
    "oversized tiles fa1": ("config", lambda q, k, v: ik.attention(
        q, k, v, config=TileConfig(64, 64, "fa1", sram_bytes=4096))),
    "config not a TileConfig": ("config", lambda q, k, v: ik.attention(q, k, v, config={"block_q": 64})),
    "not an array": ("q", lambda q, k, v: ik.attention(q.tolist(), k, v)),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_bad_input(qkv, case):
    arg, call = ATTENTION_CASES[case]
    q, k, v = qkv
    before = [x.copy() for x in qkv]
    raises_naming(arg, call, q, k, v)
    for x, b in zip(qkv, before):
        np.testing.assert_array_equal(x, b)          # a failing call changes nothing


@pytest.mark.parametrize("field,value", [("block_q", 0), ("block_k", -4), ("block_q", 16.0),
                                         ("sram_bytes", True), ("loop_order", "fa3")])
def test_tile_config_bad_fields(field, value):
    kw = {field: value}
    msg = raises_naming("config", TileConfig, **kw)
    assert field in msg


VARLEN_CASES = {
    "cu decreasing": ("cu_seqlens_q", lambda q, k, v, cq, ck: ik.attention_varlen(
        q, k, v, np.array([0, 4, 3, 7], np.int32), ck)),
    "cu wrong end": ("cu_seqlens_k", lambda q, k, v, cq, ck: ik.attention_varlen(
        q, k, v, cq, np.array([0, 5, 7, 8], np.int32))),
    "cu not from 0": ("cu_seqlens_q", lambda q, k, v, cq, ck: ik.attention_varlen(
        q, k, v, np.array([1, 3, 3, 7], np.int32), ck)),
    "cu wrong length": ("cu_seqlens_k", lambda q, k, v, cq, ck: ik.attention_varlen(
        q, k, v, cq, np.array([0, 7], np.int32))),
    "cu float": ("cu_seqlens_q", lambda q, k, v, cq, ck: ik.attention_varlen(
        q, k, v, cq.astype(np.float64), ck)),
    "cu 2-D": ("cu_seqlens_q", lambda q, k, v, cq, ck: ik.attention_varlen(q, k, v, cq[None], ck)),
    "batched layout to varlen": ("q", lambda q, k, v, cq, ck: ik.attention_varlen(
        q[None], k[None], v[None], cq, ck)),
    "varlen window": ("window", lambda q, k, v, cq, ck: ik.attention_varlen(q, k, v, cq, ck, window=(1,))),
    "varlen oversized tiles": ("config", lambda q, k, v, cq, ck: ik.attention_varlen(
        q, k, v, cq, ck, config=TileConfig(2048, 2048))),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_bad_input(packed, case):
    arg, call = VARLEN_CASES[case]
    raises_naming(arg, call, *packed)


def test_backward_argument_checks(rng):
    q, k, v, do = testing.make_inputs(rng, seqlen_q=8, seqlen_k=6, head_dim=4, with_grad=True)
    o, lse = ik.reference.attention(q, k, v)
    raises_naming("do", ik.attention_backward, do[:, :, :4], q, k, v, o, lse)
    raises_naming("lse", ik.attention_backward, do, q, k, v, o, lse[..., :3])
    raises_naming("do", ik.attention_backward, do.astype(np.float32), q, k, v, o, lse)
    raises_naming("lse", ik.attention_backward, do, q, k, v, o, lse.astype(np.float16))
    raises_naming("k", ik.attention_backward, do, q, k[..., :3], v[..., :3], o, lse)
    raises_naming("backend", ik.attention_backward, do, q, k, v, o, lse, backend="numpy")


def test_decode_argument_checks(rng):
    q = rng.standard_normal((2, 4, 8))
    k = rng.standard_normal((2, 2, 10, 8))
    v = rng.standard_normal((2, 2, 10, 8))
    raises_naming("q", ik.decode, q[0], k, v)
    raises_naming("k", ik.decode, q[..., :7], k, v)
    raises_naming("seq_lens", ik.decode, q, k, v, seq_lens=np.array([3, 11]))
    raises_naming("seq_lens", ik.decode, q, k, v, seq_lens=np.array([3]))
    raises_naming("seq_lens", ik.decode, q, k, v, seq_lens=np.array([3.0, 4.0]))
    raises_naming("num_splits", ik.decode, q, k, v, num_splits=0)
    raises_naming("scale", ik.decode, q, k, v, scale=float("inf"))
    raises_naming("backend", ik.decode, q, k, v, backend="naivex")


def test_traffic_model_bad_kind():
    raises_naming("kind", ik.traffic.model, "fa3", batch=1)
