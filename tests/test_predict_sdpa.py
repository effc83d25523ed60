"""Notebook 10's predict-then-check questions: hidden until a prediction, answered from the recorded run."""
import pytest

from iokernels import recorded
from iokernels.labs import predict
from iokernels.labs.predict_sdpa import SDPA_QUESTIONS, reveal


@pytest.mark.parametrize("key", sorted(SDPA_QUESTIONS))
def test_hidden_until_predicted_then_judged(key):
    q = SDPA_QUESTIONS[key]
    assert predict.QUESTIONS[key] is q
    answer = q.answer()
    hidden = reveal(key, None)
    assert hidden.correct is None and "Predict first" in hidden.text and q.explain(answer) not in hidden.text
    assert all(f"{v:.3g}" not in hidden.text for v in answer.values() if isinstance(v, float))
    right = reveal(key, dict(answer))
    assert right.correct is True and q.explain(answer) in right.text
    assert reveal(key, {n: 3 * v + 1 for n, v in answer.items()}).correct is False


def test_answers_are_the_recorded_run():
    rec = recorded.load("h200")
    fp32 = next(c for c in rec["bench"]["cases"] if c["section"] == "compare" and c["dtype"] == "float32")
    refused = [r["runner"] for r in fp32["results"] if r["group"] == "sdpa" and r["status"] != "ok"]
    assert SDPA_QUESTIONS["sdpa_fp32_refusals"].answer() == {"refused": len(refused)}
    assert sorted(refused) == ["sdpa:cudnn", "sdpa:flash"]            # on CUDA both take fp16 / bf16 only
    assert not reveal("sdpa_fp32_refusals", 3).correct
    rows = {r["runner"]: r["ms"] for r in recorded.bench_rows(rec, section="compare", dtype="bfloat16", causal=False)}
    slowdown = rows["sdpa:math"] / rows["sdpa:cudnn"]
    assert SDPA_QUESTIONS["sdpa_math_slowdown"].answer()["slowdown"] == pytest.approx(slowdown)
    assert reveal("sdpa_math_slowdown", 1.25 * slowdown).correct and not reveal("sdpa_math_slowdown", 2.0).correct
    flash = next(r for r in recorded.traffic_rows(rec) if r["case"] == "sdpa flash" and r["size"] == "large")
    assert reveal("sdpa_flash_dram", flash["measured_over_mandatory"]).correct
    # the model's answer (K and V once per query tile) is far off: the L2 serves the re-reads
    assert not reveal("sdpa_flash_dram", flash["measured_over_mandatory"] / flash["measured_over_model"]).correct


@pytest.mark.parametrize("stem", ["09a_hopper_asynchrony", "09b_low_precision", "10_pytorch_sdpa",
                                  "11_what_goes_wrong", "12_context_parallel", "13_decode_for_real_models",
                                  "15_triton"])
def test_every_later_notebook_has_two_predictions_that_exist(stem):
    """Notebooks 09a-13 and 15 each ask at least two predict-then-check questions, each one registered,
    and each cell starts with the learner's prediction still None (the answer hidden)."""
    import json
    import re
    from pathlib import Path

    from iokernels.labs import predict_chapters, predict_hopper, predict_sdpa, predict_triton  # noqa: F401
    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / f"{stem}.ipynb").read_text())
    asked = []
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code":
            for key, var in re.findall(r'reveal\("([a-z0-9_]+)",\s*([A-Za-z_]\w*)\)', src):
                assert re.search(rf"^{var}\s*=\s*None", src, re.M), f"{stem}: {var} is not None before the reveal"
                asked.append(key)
    assert len(asked) >= 2, f"{stem} asks {len(asked)} predict-then-check questions"
    assert all(k in predict.QUESTIONS for k in asked), asked
