"""iokernels attention inside a transformers LlamaForCausalLM (random init, no download):
a counter proves our kernel ran; logits match SDPA's (float64: to 1e-12; float32: the 2x rule)."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from iokernels import hf_attention  # noqa: E402
from iokernels.core.testing import check  # noqa: E402

NAME = hf_attention.register("iokernels-test", backend="tiled")


def _models(dtype):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = NAME
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(cfg).eval()
    sdpa = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).eval()
    sdpa.set_attn_implementation("sdpa")
    sdpa.load_state_dict(ours.state_dict())
    return ours.to(dtype), sdpa.to(dtype)


def test_our_kernel_runs_and_matches_sdpa():
    ours, sdpa = _models(torch.float32)
    ours64, sdpa64 = _models(torch.float64)
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    before = hf_attention.CALLS[NAME]
    with torch.no_grad():
        a, b = ours(ids).logits, sdpa(ids).logits
        a64, b64 = ours64(ids).logits, sdpa64(ids).logits
    assert hf_attention.CALLS[NAME] - before == 2 * 2            # two forwards of two layers each
    assert (a64 - b64).abs().max() <= 1e-12 * max(1.0, b64.abs().max())
    assert check(a.numpy(), b64.numpy(), b.numpy(), dtype="float32").ok


def test_generate_with_the_kv_cache_runs_through_our_kernel():
    ours, sdpa = _models(torch.float64)
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    before = hf_attention.CALLS[NAME]
    with torch.no_grad():
        got = ours.generate(ids, max_new_tokens=6, do_sample=False)
        want = sdpa.generate(ids, max_new_tokens=6, do_sample=False)
    assert got.tolist() == want.tolist()
    assert hf_attention.CALLS[NAME] - before == 2 * 6            # a prefill and five one-token decodes


def test_a_padding_mask_is_refused():
    ours, _ = _models(torch.float64)
    ids = torch.tensor([[5, 17, 99, 3], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask: only the bottom-right causal"):
        ours(ids, attention_mask=mask)
