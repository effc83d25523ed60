"""The predict-then-check questions of notebooks 11-13: hidden until predicted, answers from the package."""
import math

import pytest

from iokernels import models
from iokernels.labs.predict_chapters import CHAPTER_QUESTIONS, reveal


@pytest.mark.parametrize("key", sorted(CHAPTER_QUESTIONS))
def test_hidden_until_predicted_then_judged(key):
    answer = CHAPTER_QUESTIONS[key].answer()
    hidden = reveal(key, None)
    assert hidden.correct is None and hidden.verdicts == {}
    assert CHAPTER_QUESTIONS[key].explain(answer) not in hidden.text and "package computes" not in hidden.text
    right = reveal(key, dict(answer))
    assert right.correct is True and CHAPTER_QUESTIONS[key].explain(answer) in right.text
    wrong = reveal(key, {n: 3 * v + 1 for n, v in answer.items()})
    assert wrong.correct is False


def test_answers_are_the_closed_forms():
    a = {k: q.answer() for k, q in CHAPTER_QUESTIONS.items()}
    assert a["deterministic_dq_accumulators"] == {"accumulators": math.ceil(132 / (8 * 16))}
    W = 8
    assert a["ring_contiguous_imbalance"]["busiest_over_mean"] == pytest.approx((2 * W - 1) / W, rel=0.01)
    assert 1 / W < a["ring_memory_share"]["share"] < 2 / W
    assert a["llama3_kv_kib"]["kib"] == 2 * 32 * 8 * 128 * 2 / 1024
    assert a["mla_decode_intensity"]["flop_per_byte"] == pytest.approx(2 * 128 * (576 + 512) / (576 * 2))
    lens = [37, 512, 5, 130, 260, 64]
    assert a["varlen_flops_saved"]["flops_saved"] == pytest.approx(1 - sum(n * n for n in lens) / (6 * 512 ** 2))
    assert models.kv_bytes_per_token("Llama-3-8B") == 128 * 1024


def test_a_printed_prompt_wraps_between_words():
    """A question's text prints in lines of at most predict.WIDTH characters, no word cut."""
    from iokernels.labs import predict
    words = ["predict"] * 60
    r = predict.Revealed("k", None, {}, " ".join(words) + "\nshort line")
    lines = str(r).splitlines()
    assert len(lines) > 2 and all(len(line) <= predict.WIDTH for line in lines)
    assert " ".join(str(r).split()) == r.text.replace("\n", " ") and lines[-1] == "short line"
