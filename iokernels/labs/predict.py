"""Predict, then check: the answer is shown only after the learner has committed to one.

A notebook cell sets a variable to the learner's prediction and ends with :func:`reveal`
(the cell shows what it returns).  While the prediction is still None, it says how to make
one and shows nothing of the answer; once there is one, it says whether it was right
(within the question's tolerance) and only then gives the answer and why.

Each question is a :class:`Question`: the prompt, how the answer is computed by the
package (never a hard-coded number), the tolerance, and the explanation.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable

__all__ = ["Question", "QUESTIONS", "reveal", "Revealed"]

#: printed lines are wrapped to this many characters (a notebook's output wraps mid-word past it)
WIDTH = 96


@dataclass(frozen=True)
class Question:
    key: str
    prompt: str
    answer: Callable[[], dict]          # name -> value, computed by the package
    explain: Callable[[dict], str]      # the explanation, given the answer
    rel_tol: float = 0.0                # relative tolerance for non-integer parts (counts are exact)


@dataclass
class Revealed:
    """What :func:`reveal` decided: None until there is a prediction."""

    key: str
    correct: bool | None
    verdicts: dict
    text: str

    def __str__(self) -> str:
        # printed in a notebook: long lines wrapped between words, the text's own breaks kept
        return "\n".join(textwrap.fill(line, WIDTH, break_long_words=False, break_on_hyphens=False,
                                        subsequent_indent=line[:len(line) - len(line.lstrip())])
                          if len(line) > WIDTH else line for line in self.text.splitlines())

    __repr__ = __str__


# --------------------------------------------------------------------------- the questions
def _backward_bc():
    from ..backward import default_backward_config
    cfg = default_backward_config(128, "float16")
    return {"block_k": cfg.block_k}


def _backward_ratio():
    """The backward's traffic ratio naive / tiled at N = 4096, d = 128, fp16, default tiles."""
    from ..backward import traffic_model_naive, traffic_model_tiled
    prob = dict(batch=1, heads_q=1, heads_kv=1, seqlen_q=4096, seqlen_k=4096, head_dim=128, dtype="float16")
    return {"ratio": traffic_model_naive(**prob).total / traffic_model_tiled(**prob).total}


def _paging():
    from .. import paged
    w = paged.paging_waste(1000, 16)
    mib = w.blocks * 16 * paged.kv_bytes_per_token(**paged.LLAMA3_8B) / 2 ** 20
    return {"blocks": w.blocks, "wasted_slots": w.wasted_slots, "mib": mib}


QUESTIONS = {
    "backward_block_k": Question(
        "backward_block_k",
        "the largest Bc the default backward tiles take at d = 128 in fp16 with 228 KiB of SRAM",
        _backward_bc,
        lambda a: (f"default_backward_config(128, 'float16') picks Bc = {a['block_k']}: the backward's traffic "
                   "falls as Bc grows (Q, dO, LSE, D and dQaccum stream past every K/V tile), so SRAM is "
                   "spent on Bc first and Br is halved when the tiles do not fit.")),
    "backward_ratio": Question(
        "backward_ratio",
        "naive backward bytes / tiled backward bytes at N = 4096, d = 128, fp16, default tiles",
        _backward_ratio,
        lambda a: (f"the counted ratio is {a['ratio']:.2f}; the estimate 4 Bc / (3 d) comes from 16 bytes per "
                   "visible entry for the naive backward against (12 d + 8) / Bc for the tiled one."),
        rel_tol=0.15),
    "paging_waste_1000": Question(
        "paging_waste_1000",
        "a 1,000-token request with Llama-3-8B shapes in blocks of 16: blocks, wasted slots, MiB of KV cache",
        _paging,
        lambda a: (f"ceil(1000 / 16) = {a['blocks']} blocks hold {a['blocks'] * 16} slots, "
                   f"{a['wasted_slots']} of them unwritten; each slot holds K and V for 32 layers x 8 KV heads x "
                   f"128 dims x 2 bytes, so the blocks occupy {a['mib']:.1f} MiB."),
        rel_tol=0.02),
}


def _close(guess, truth, rel_tol) -> bool:
    """Counts (integers) must be exact; other numbers within rel_tol; anything else equal as text."""
    if isinstance(truth, int):
        rel_tol = 0.0
    try:
        g, t = float(guess), float(truth)
    except (TypeError, ValueError):
        return str(guess).strip().lower() == str(truth).strip().lower()
    return abs(g - t) <= rel_tol * abs(t) if rel_tol else g == t


def reveal(key: str, prediction) -> Revealed:
    """Check ``prediction`` for question ``key``; reveal the answer only when there is one.

    ``prediction``: a number, or a dict of numbers when the question has several parts
    (the parts are the question's names, e.g. blocks, wasted_slots, mib).
    """
    if key not in QUESTIONS:
        raise ValueError(f"key: expected one of {', '.join(sorted(QUESTIONS))}; got {key!r}")
    q = QUESTIONS[key]
    if prediction is None or (isinstance(prediction, dict) and any(v is None for v in prediction.values())):
        text = (f"Predict first: {q.prompt}.  Write your prediction into the variable above (replace None) "
                "and run this cell again; the answer appears once you have committed to one.")
        return Revealed(key, None, {}, text)
    answer = q.answer()
    if not isinstance(prediction, dict):
        if len(answer) != 1:
            raise ValueError(f"prediction: this question has parts {', '.join(answer)}; give a dict of them")
        prediction = {next(iter(answer)): prediction}
    missing = [n for n in answer if n not in prediction]
    if missing:
        raise ValueError(f"prediction: missing the part(s) {', '.join(missing)}")
    verdicts = {n: _close(prediction[n], answer[n], q.rel_tol) for n in answer}
    lines = [f"{n}: you said {prediction[n]!r}, the package computes "
             f"{answer[n]:.4g} -> {'right' if ok else 'not quite'}" for n, ok in verdicts.items()]
    lines.append(q.explain(answer))
    return Revealed(key, all(verdicts.values()), verdicts, "\n".join(lines))
