"""ik.autograd.attention inside torch: gradients equal torch's own autograd, a model trains the same."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from iokernels import autograd  # noqa: E402
from iokernels.core import conventions as cv  # noqa: E402


def _torch_reference(q, k, v, causal, window, scale):
    """The definition, in torch ops, with the package's bottom-right mask (autograd differentiates it)."""
    nq, nk = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    vis = torch.from_numpy(cv.mask(nq, nk, causal, window))
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)                  # fully masked rows: 0
    return torch.einsum("bhqk,bhkd->bhqd", p, v)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 3))])
def test_gradients_match_torch_autograd_in_float64(rng, causal, window):
    B, Hq, Hkv, Nq, Nk, d = 2, 4, 2, 19, 27, 11
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
               for s in ((B, Hq, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d)))
    do = torch.randn((B, Hq, Nq, d), generator=gen, dtype=torch.float64)
    scale = d ** -0.5
    o = autograd.attention(q, k, v, causal=causal, window=window, backend="tiled")
    o.backward(do)
    got = [o.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    o_ref = _torch_reference(q, k, v, causal, window, scale)
    o_ref.backward(do)
    want = [o_ref.detach()] + [t.grad for t in (q, k, v)]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert torch.max(torch.abs(a - b)).item() < 1e-12, name


def test_a_model_trains_the_same_as_with_the_definition(rng):
    """One attention layer learning a toy retrieval task: identical loss curves in float64."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    d, n, steps = 8, 12, 15
    x = torch.randn((4, 1, n, d), dtype=torch.float64)
    target = x.flip(2)                                   # learn to read the sequence backwards

    def train(attn):
        torch.manual_seed(0)
        wq, wk, wv = (torch.nn.Parameter(torch.randn(d, d, dtype=torch.float64) * 0.3) for _ in range(3))
        opt = torch.optim.SGD([wq, wk, wv], lr=0.5)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            out = attn(x @ wq, x @ wk, x @ wv)
            loss = torch.mean((out - target) ** 2)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses)

    ours = train(lambda q, k, v: autograd.attention(q, k, v, backend="tiled"))
    ref = train(lambda q, k, v: _torch_reference(q, k, v, False, None, d ** -0.5))
    assert ours[-1] < ours[0]                           # it learns
    assert np.max(np.abs(ours - ref)) < 1e-10


def test_a_backend_without_a_backward_is_refused_before_any_work():
    q = torch.randn((1, 1, 4, 8), requires_grad=True)
    with pytest.raises(ValueError, match="backward_backend"):
        autograd.attention(q, q, q, backend="tiled", backward_backend="numpy")
    with pytest.raises(ValueError, match="^q: expected a torch tensor"):
        autograd.attention(np.zeros((1, 1, 4, 8)), q, q)
