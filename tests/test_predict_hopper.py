"""Notebooks 09a and 09b's predict-then-check questions: hidden until a prediction, answered by the package."""
import pytest

from iokernels import fp8
from iokernels import hopper_schedule as hs
from iokernels.labs import predict
from iokernels.labs.predict_hopper import HOPPER_QUESTIONS, reveal


def test_every_question_is_registered_and_hides_its_answer():
    for key, q in HOPPER_QUESTIONS.items():
        assert predict.QUESTIONS[key] is q
        r = reveal(key, None)
        assert r.correct is None and "Predict first" in r.text
        answer = q.answer()
        # a float answer never shows before the prediction (an integer may be among the listed choices)
        assert all(f"{v:.3g}" not in r.text for v in answer.values() if isinstance(v, float)), key


def test_answers_are_the_package_values():
    assert reveal("pingpong_utilisation", hs.simulate("pingpong").utilisation).correct
    assert reveal("fa2_prefetch_utilisation", hs.simulate("fa2").utilisation).correct
    assert not reveal("fa2_prefetch_utilisation", 0.35 * 0.85).correct       # the serialized model's guess, off
    flip = next(r["l2_reuse"] for r in hs.sensitivity() if not r["table2_order_holds"])
    assert reveal("table2_order_flip", flip).correct and not reveal("table2_order_flip", flip + 1).correct
    assert reveal("e4m3_mean_error", fp8.rounding_error("e4m3")["mean"]).correct
    assert not reveal("e4m3_mean_error", 0.0625).correct                      # the worst case is not typical
    assert reveal("fp8_max_threshold", 0.807).correct and not reveal("fp8_max_threshold", 8).correct


@pytest.mark.slow
def test_hadamard_ratio_question():
    ratio = fp8.error_ratio(fp8.accuracy_experiment(variants=fp8.RATIO_VARIANTS))
    assert reveal("hadamard_rmse_ratio", ratio).correct and not reveal("hadamard_rmse_ratio", 1.0).correct
