"""What the engine serves: requests, their sequences, and how a next token is drawn.

A :class:`Request` is a prompt (token ids) and how much to generate.  ``n > 1`` asks for
``n`` samples of the same prompt (parallel sampling): they share the prompt's KV blocks
and diverge from their first sampled token on.  The engine keeps one :class:`Sequence`
per sample, grouped in a :class:`Group` per request.

``stop_after`` stands in for the end-of-sequence token a real model would emit: a trace
knows how long each answer was, the scheduler does not (it only knows the cap,
``max_new_tokens``, which is what a system that reserves memory up front must reserve).
"""
from __future__ import annotations

import numbers
import zlib
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Request", "Sequence", "Group", "sample_token", "sample_tokens"]


def _int(value, name, lo):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Request:
    """One request: ``prompt`` (token ids), at most ``max_new_tokens`` new tokens per sample.

    ``n`` samples (parallel sampling); ``temperature`` 0 is greedy, above 0 samples with a
    seed fixed by (``seed``, request id, sample, position), so every run draws the same
    tokens from the same logits; ``stop_after`` (<= max_new_tokens, None: the cap) is where
    the answer ends; ``arrival`` (seconds on the engine's clock) is when it joins the queue.
    """

    rid: object
    prompt: tuple
    max_new_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    stop_after: int | None = None
    arrival: float = 0.0

    def __post_init__(self):
        prompt = tuple(self.prompt)
        if not prompt:
            raise ValueError(f"prompt: request {self.rid!r} has an empty prompt; a request needs at least one "
                             f"token to start from")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in prompt):
            raise ValueError(f"prompt: request {self.rid!r}: expected non-negative integer token ids")
        object.__setattr__(self, "prompt", tuple(int(t) for t in prompt))
        _int(self.max_new_tokens, "max_new_tokens", 1)
        _int(self.n, "n", 1)
        _int(self.seed, "seed", 0)
        if self.stop_after is not None and not 1 <= _int(self.stop_after, "stop_after", 1) <= self.max_new_tokens:
            raise ValueError(f"stop_after: expected 1..max_new_tokens ({self.max_new_tokens}), got {self.stop_after}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) \
                or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if isinstance(self.arrival, bool) or not isinstance(self.arrival, numbers.Real) or not self.arrival >= 0:
            raise ValueError(f"arrival: expected a time >= 0, got {self.arrival!r}")

    @property
    def output_len(self) -> int:
        """Tokens each sample generates."""
        return self.max_new_tokens if self.stop_after is None else self.stop_after

    @property
    def max_len(self) -> int:
        """The longest a sample can grow: prompt + max_new_tokens."""
        return len(self.prompt) + self.max_new_tokens


@dataclass(eq=False, slots=True)
class Sequence:
    """One sample of a request: its tokens, how many of them are in the KV cache, its memory.

    ``computed`` tokens have their K and V in the cache; the step after the last one is
    computed samples a new token.  ``handle`` is the memory's name for it (a
    :class:`~iokernels.paged.PagedKVCache` sequence id, or a contiguous region), None
    while it holds no memory.
    """

    group: "Group"
    sample: int
    tokens: list
    computed: int = 0
    handle: object = None
    done: bool = False
    token_times: list = field(default_factory=list)

    @property
    def generated(self) -> list:
        return self.tokens[len(self.group.request.prompt):]

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.computed


@dataclass(eq=False, slots=True)
class Group:
    """A request in the engine: its samples (one until the prompt is done), its place in line.

    ``live`` lists the samples not done yet, in sample order.  The scheduler walks it for
    every running request every step, so it is kept up to date as samples join
    (:meth:`add`) and finish (:meth:`finish`) instead of being filtered out of ``seqs``
    each time; read it, do not change it.
    """

    request: Request
    order: int                     # arrival order: lower runs first and is preempted last
    seqs: list = field(default_factory=list)
    forked: bool = False           # the samples exist (after the first token)
    preemptions: int = 0
    reservation: object = None     # what a contiguous memory reserved for it
    live: list = field(init=False, repr=False)
    #: the tokens each sample holds once its output is drawn: prompt + output_len
    final_len: int = field(init=False, repr=False)

    def __post_init__(self):
        if not self.seqs:
            self.seqs = [Sequence(self, 0, list(self.request.prompt))]
        self.live = [s for s in self.seqs if not s.done]
        self.final_len = len(self.request.prompt) + self.request.output_len

    def add(self, seq: Sequence) -> None:
        """A new sample of this request (a fork's child), after the ones there are."""
        self.seqs.append(seq)
        if not seq.done:
            self.live.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Sample ``seq`` has drawn its last token: it is done and leaves ``live``."""
        seq.done = True
        self.live.remove(seq)

    @property
    def finished(self) -> bool:
        return (self.forked or self.request.n == 1) and not self.live


def sample_token(logits, request: Request, sample: int, position: int) -> int:
    """The next token: argmax (temperature 0), else the Gumbel-max draw seeded by
    (request seed, request id, sample, position), the same draw in every run."""
    logits = np.asarray(logits, dtype=np.float64)
    if request.temperature == 0:
        return int(np.argmax(logits))
    key = zlib.crc32(repr((request.rid, sample, position)).encode())
    rng = np.random.default_rng([request.seed, key])
    return int(np.argmax(logits / request.temperature + rng.gumbel(size=logits.shape)))


def sample_tokens(logits, draws) -> list[int]:
    """:func:`sample_token` for each draw (row, request, sample, position), all at once.

    ``logits`` (rows, vocab) is a NumPy array or a torch tensor on any device.  The greedy
    draws are one argmax over the rows, taken where the logits are; only the rows drawn at
    a temperature come to the host whole.  So a step on a GPU whose draws are all greedy
    copies one token id per row to the host, not rows x vocab logits.
    """
    if not draws:
        return []
    greedy = logits.argmax(-1).tolist()              # NumPy and torch alike: the first maximum
    hot = sorted({row for row, req, _, _ in draws if req.temperature > 0})
    if not hot:
        return [greedy[row] for row, _, _, _ in draws]
    host = {}
    if hot:
        rows = logits[hot]
        rows = rows.double().cpu().numpy() if hasattr(rows, "cpu") else np.asarray(rows, np.float64)
        host = dict(zip(hot, rows))
    return [sample_token(host[row], req, sample, position) if req.temperature > 0 else int(greedy[row])
            for row, req, sample, position in draws]
