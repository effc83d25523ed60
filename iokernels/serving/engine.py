"""The engine: a request queue and one scheduling decision per step (continuous batching).

Every step the engine decides again which sequences run: **iteration-level scheduling**
(Orca, Yu et al., OSDI 2022, paper; vLLM, Kwon et al., SOSP 2023, paper).  A sequence that
finishes leaves the batch at once and a waiting request joins at the next step, instead
of the whole batch waiting for its longest member.  One step, top to bottom:

1. **arrivals**: requests whose arrival time has come move from ``pending`` to ``waiting``;
2. **running first**, oldest first: each running sequence gets the tokens it has left to
   compute, up to what remains of the step's ``token_budget``.  A decoding sequence asks
   for one token; one still prefilling asks for a **chunk** of its prompt (chunked
   prefill, so prefill and decode share the step, as Sarathi-Serve, Agrawal et al., OSDI
   2024, paper, schedules them).  A chunk that stops short ends at a block boundary, so
   the prefix cache can find its full blocks later;
3. **preemption**: when the blocks a sequence's append may take are not free, the newest
   running request is **preempted by recomputation**: its blocks are freed, it goes back
   to the front of the queue with every token it has generated, and when it is admitted
   again its tokens are computed again as a prompt (vLLM's default for a request with one
   sequence; here a request's parallel samples are recomputed too, each as a sequence of
   its own, and the prefix cache finds their common prompt blocks while they are cached).
   The victim and the reason are logged (``engine.preemptions``, and the
   ``iokernels.serving`` logger);
4. **admission**: waiting requests join in arrival order while the budget, ``max_seqs``
   and memory allow (head of line first: a request that does not fit stops the line);
   while others run, a paged memory keeps its watermark of blocks free for their growth
   (``PagedMemory.WATERMARK``, vLLM's 1%); none joins in a step that had to preempt, so a
   victim is not readmitted at once;
5. **the model runs once** on the batch of chunks; each sequence whose chunk reached its
   last token samples one new token (all of the step's draws at once, where the logits
   are: :func:`~.requests.sample_tokens`).  A request with ``n`` samples forks after its prompt
   (the samples share the prompt's blocks; copy-on-write splits the last one), and a
   sample that has generated its tokens frees its memory at once.

The memory decides what "fits" means (:mod:`iokernels.serving.memory`): a paged memory
takes blocks as sequences grow and may preempt; a contiguous one reserves every sample's
maximum length at admission and never runs out afterwards.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .requests import Group, Request, Sequence, sample_tokens

__all__ = ["Engine", "StepRecord", "Results"]

log = logging.getLogger("iokernels.serving")


@dataclass
class StepRecord:
    """What one step did: its batch as (request id, sample, tokens), the running count, memory.

    phases: the step's wall time in seconds, split where it is spent: ``schedule`` (the
    scheduler's decisions, on the host), ``model`` (the model's forward pass as the host
    sees it: the memory's books for the step, and every operation issued; on a GPU the
    call returns once the work is queued), ``sample`` (counting the chunks, forking parallel
    samples, and drawing the tokens: the step's one trip to the host, so on a GPU it waits
    for the queued work to finish), ``books`` (each sequence takes its token, finished ones
    leave and free their blocks, the memory's usage is counted).  A step that is host-bound
    spends its time in ``schedule``, ``model`` and ``books``; one that is bound by the
    device, in ``sample``.  The four add up to the step's wall time (the engine's
    ``busy_s`` and the clock, unless a fixed ``step_time`` drives it).
    """

    step: int
    time: float
    batch: list
    running: int
    used_slots: int
    allocated_slots: int
    free_blocks: int
    preempted: list
    phases: dict = field(default_factory=dict)


@dataclass
class Results:
    """A finished run: every request's tokens, the steps, and the numbers the benchmark reports."""

    outputs: dict
    steps: list = field(default_factory=list)
    preemptions: list = field(default_factory=list)
    busy_s: float = 0.0
    #: tokens drawn by every sample, finished or not: a run stopped at its time limit still
    #: counts the work it did for the requests it had not finished
    generated_tokens: int = 0
    token_times: list = field(default_factory=list)
    #: False when the run stopped at its time limit with requests still unserved
    complete: bool = True

    @property
    def max_concurrent(self) -> int:
        return max((s.running for s in self.steps), default=0)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for outs in self.outputs.values() for t in outs)

    @property
    def waste_fraction(self) -> float:
        """Allocated slots not holding a token, over allocated slots, summed over the steps."""
        alloc = sum(s.allocated_slots for s in self.steps)
        return 1.0 - sum(s.used_slots for s in self.steps) / alloc if alloc else 0.0

    def time_per_output_token(self) -> np.ndarray:
        """Per sample with two or more tokens: (last token's time - first's) / (tokens - 1), seconds."""
        return np.array([(t[-1] - t[0]) / (len(t) - 1) for t in self.token_times if len(t) > 1])

    def phase_ms(self) -> dict:
        """Per phase of a step (:class:`StepRecord`'s ``phases``): the median and the total, milliseconds."""
        names = sorted({k for s in self.steps for k in s.phases})
        out = {}
        for name in names:
            t = np.array([s.phases.get(name, 0.0) for s in self.steps]) * 1e3
            out[name] = dict(median=float(np.median(t)), total=float(t.sum()))
        return out

    def summary(self) -> dict:
        tpot = self.time_per_output_token() * 1e3
        pct = (lambda p: float(np.percentile(tpot, p))) if tpot.size else (lambda p: 0.0)
        return dict(max_concurrent=self.max_concurrent, output_tokens=self.output_tokens, steps=len(self.steps),
                    generated_tokens=self.generated_tokens,
                    tokens_per_s=self.generated_tokens / self.busy_s if self.busy_s else 0.0,
                    waste_fraction=self.waste_fraction, p50_ms=pct(50), p99_ms=pct(99),
                    preemptions=len(self.preemptions), finished=len(self.outputs), complete=self.complete,
                    phase_ms=self.phase_ms())


def check_max_seconds(max_seconds) -> None:
    """A run's time limit: None, or a number of seconds > 0 (a ValueError naming it otherwise)."""
    if max_seconds is not None and (isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float))
                                    or not max_seconds > 0):
        raise ValueError(f"max_seconds: expected None or a number of seconds > 0, got {max_seconds!r}")


class Engine:
    """Continuous batching of :class:`Request`\\ s through ``model`` over ``memory``.

    model: ``forward(memory, seqs, chunk_lens)`` computes each sequence's next
    ``chunk_lens[i]`` tokens (writing their K and V through ``memory``) and returns the
    logits of each chunk's last token, (len(seqs), vocab), a NumPy array or a torch tensor
    on the model's device; it has ``vocab``.
    token_budget: tokens computed per step at most; max_seqs: running sequences at most.
    step_time: None measures each step's wall time as the clock's advance; a number
    advances the clock by that many seconds a step (a deterministic schedule, for tests).
    check: a function of the engine run after every step (an invariant check).
    """

    def __init__(self, model, memory, *, token_budget=256, max_seqs=256, step_time=None, check=None):
        for name, value in (("token_budget", token_budget), ("max_seqs", max_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if step_time is not None and not (isinstance(step_time, (int, float)) and step_time > 0):
            raise ValueError(f"step_time: expected None or a number of seconds > 0, got {step_time!r}")
        self.model, self.memory = model, memory
        self.token_budget, self.max_seqs, self.step_time, self.check = token_budget, max_seqs, step_time, check
        self.align = getattr(memory, "block_size", 1)
        self.pending: list = []            # (arrival, order, group), not arrived yet, sorted
        self.waiting: list = []            # arrived, sorted by order
        self.running: list = []            # sorted by order: the oldest first
        self.clock, self.busy_s, self._order = 0.0, 0.0, 0
        self._ids: set = set()
        self.results = Results(outputs={})

    # ------------------------------------------------------------------ the queue
    def submit(self, request: Request) -> None:
        """Queue a request; a ValueError (queue unchanged) when it can never be served."""
        if not isinstance(request, Request):
            raise ValueError(f"request: expected a Request, got {type(request).__name__}")
        if request.rid in self._ids:
            raise ValueError(f"request: id {request.rid!r} is already queued or served; ids must be unique")
        bad = [t for t in request.prompt if t >= self.model.vocab]
        if bad:
            raise ValueError(f"prompt: request {request.rid!r} holds token {bad[0]}, outside the model's "
                             f"vocabulary of {self.model.vocab}")
        if request.n > self.max_seqs:
            raise ValueError(f"request: {request.rid!r} asks for {request.n} samples; the engine runs at most "
                             f"max_seqs={self.max_seqs} sequences, so it can never be served")
        why = self.memory.fits(request)
        if why is not None:
            raise ValueError(f"request: {why}, so it can never be served")
        self._ids.add(request.rid)
        group = Group(request, self._order)
        self._order += 1
        bisect.insort(self.pending, (request.arrival, group.order, group), key=lambda x: x[:2])

    @property
    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def run(self, progress=None, *, max_seconds=None) -> Results:
        """Step until every request is served; ``progress(finished, total)`` after each step.

        max_seconds: stop after the step that crosses this much wall time (None: no limit);
        the results then hold the requests finished so far and say ``complete=False``.
        """
        check_max_seconds(max_seconds)
        total, start = len(self._ids), time.perf_counter()
        while not self.done:
            self.step()
            if progress is not None:
                progress(len(self.results.outputs), total)
            if max_seconds is not None and time.perf_counter() - start > max_seconds and not self.done:
                self.results.complete = False
                log.info("stopped after %.1f s with %d of %d requests served", time.perf_counter() - start,
                         len(self.results.outputs), total)
                break
        return self.results

    # ------------------------------------------------------------------ one step
    def step(self) -> StepRecord:
        if not (self.waiting or self.running) and self.pending:
            self.clock = max(self.clock, self.pending[0][0])       # idle: jump to the next arrival
        while self.pending and self.pending[0][0] <= self.clock:
            bisect.insort(self.waiting, self.pending.pop(0)[2], key=lambda g: g.order)
        t0 = time.perf_counter()
        preempted: list = []
        plan = self._schedule(preempted)
        seqs, chunks = list(plan), [c for c, _ in plan.values()]
        running = sum(len(g.live) for g in self.running)
        t1 = t2 = time.perf_counter()
        if seqs:
            logits = self.model.forward(self.memory, seqs, chunks)
            t2 = time.perf_counter()
            drawn = self._advance(seqs, chunks)
            draws = [(row, s.group.request, s.sample, len(s.tokens)) for row, s in drawn]
            tokens = sample_tokens(logits, draws)         # the step's one trip to the host
        t3 = time.perf_counter()
        if seqs:
            self._take([s for _, s in drawn], tokens)
        used, alloc = self.memory.usage()
        t4 = time.perf_counter()
        dt = t4 - t0
        phases = dict(schedule=t1 - t0, model=t2 - t1, sample=t3 - t2, books=t4 - t3)
        self.clock += dt if self.step_time is None else self.step_time
        self.busy_s += dt
        batch = [(s.group.request.rid, s.sample, c) for s, c in zip(seqs, chunks)]
        rec = StepRecord(len(self.results.steps), self.clock, batch, running, used, alloc,
                         self.memory.free_blocks(), preempted, phases)
        self.results.steps.append(rec)
        self.results.busy_s = self.busy_s
        if self.check is not None:
            self.check(self)
        return rec

    def _chunk(self, seq: Sequence, budget: int) -> int:
        c = min(seq.to_compute, budget)
        if c < seq.to_compute:                                      # a partial chunk: end on a block
            aligned = (seq.computed + c) // self.align * self.align - seq.computed
            c = aligned if aligned > 0 else c
        return c

    def _schedule(self, preempted: list) -> dict:
        """{sequence: (tokens to compute, blocks reserved)} for this step, in priority order."""
        seqs = [s for g in self.running for s in g.live]
        todo = [len(s.tokens) - s.computed for s in seqs]                  # each one's to_compute
        needs = self.memory.growths(seqs, todo)                            # the blocks each whole chunk takes
        whole = dict(zip(seqs, zip(todo, needs)))
        if self._everyone_fits(todo, needs):                                # the common step: one pass
            plan, computing, reserved = whole, sum(todo), sum(needs)
        else:
            plan = self._schedule_running(preempted, whole)
            computing, reserved = sum(c for c, _ in plan.values()), sum(need for _, need in plan.values())
        return self._admit(plan, self.token_budget - computing, reserved, preempted)

    def _everyone_fits(self, todo: list, needs: list) -> bool:
        """Whether every running sequence's whole remaining chunk (``todo``, taking ``needs``
        blocks) fits the token budget and the free blocks together.  Then
        :meth:`_schedule_running` would take each whole chunk in order and preempt none, so the
        plan is all of them, made in one pass."""
        return sum(todo) <= self.token_budget and 0 not in todo and sum(needs) <= self.memory.free_blocks()

    def _schedule_running(self, preempted: list, whole: dict) -> dict:
        """Steps 2 and 3, a sequence at a time: each running sequence's chunk, preempting the newest
        requests while the blocks it may take are not free.

        whole: per running sequence, (its whole remaining chunk, the blocks that chunk takes),
        asked of the memory for the whole batch before the loop.  A preemption does not change
        what another request's sequences take: it frees the victim's blocks, and a partial
        last block (the only block whose sharing counts, for copy-on-write) is shared only by
        the samples of one request.  So the loop reads the blocks from ``whole`` unless a
        sequence's chunk is cut short by the budget.
        """
        budget, reserved, plan = self.token_budget, 0, {}
        free = self.memory.free_blocks()                            # changes only when a request is preempted
        dropped = set()                                             # preempted in this step (a set: O(1) to ask)
        for group in list(self.running):                            # 2. running first, oldest first
            if group in dropped:                                    # preempted by an older one
                continue
            for seq in group.live:
                c, need = whole[seq]
                if c > budget:                                      # cut short: a partial chunk
                    c = self._chunk(seq, budget)
                    if c == 0:
                        continue
                    need = self.memory.growth(seq, c)
                elif c == 0:
                    continue
                while need > free - reserved:                       # 3. preempt the newest
                    victim = self.running[-1]
                    for s in [s for s in victim.seqs if s in plan]:   # its own earlier sequences
                        c_s, need_s = plan.pop(s)
                        budget, reserved = budget + c_s, reserved - need_s
                    self._preempt(victim, f"request {group.request.rid!r} sample {seq.sample} needs {need} "
                                          f"block(s) for {c} token(s); {self.memory.free_blocks() - reserved} "
                                          f"free and not promised this step", preempted)
                    free = self.memory.free_blocks()
                    dropped.add(victim)
                    if victim is group:
                        break
                if group in dropped:
                    break
                plan[seq] = (c, need)
                reserved += need
                budget -= c
        return plan

    def _admit(self, plan: dict, budget: int, reserved: int, preempted: list) -> dict:
        """Step 4: waiting requests join ``plan`` in arrival order while they fit."""
        live = sum(len(g.live) for g in self.running)              # counted once, then kept up to date
        while self.waiting and budget > 0 and not preempted:        # 4. admission, in arrival order
            group = self.waiting[0]
            if live + len(group.live) > self.max_seqs or not self.memory.admit(group):
                break
            for seq in group.live:
                self.memory.start(seq)
            first = group.live[0]
            c = self._chunk(first, budget)
            need = self.memory.growth(first, c)
            keep = self.memory.watermark_blocks if self.running else 0   # room for the running ones to grow
            if need > self.memory.free_blocks() - reserved - keep:  # its first chunk does not fit
                self.memory.release_group(group)
                break
            self.waiting.pop(0)
            self.running.append(group)
            live += len(group.live)
            for seq in group.live:
                c = self._chunk(seq, budget)
                need = self.memory.growth(seq, c) if c else 0
                if c == 0 or need > self.memory.free_blocks() - reserved:
                    break
                plan[seq] = (c, need)
                reserved += need
                budget -= c
        return plan

    def _preempt(self, group: Group, reason: str, preempted: list) -> None:
        """Free the request's memory; it waits again with its tokens, to be recomputed."""
        self.memory.release_group(group)
        for s in group.seqs:
            s.computed = 0
        group.preemptions += 1
        self.running.remove(group)
        bisect.insort(self.waiting, group, key=lambda g: g.order)
        entry = dict(step=len(self.results.steps), victim=group.request.rid, reason=reason)
        preempted.append(entry)
        self.results.preemptions.append(entry)
        log.info("step %d: preempted request %r (recompute): %s", entry["step"], group.request.rid, reason)

    def _advance(self, seqs: list, chunks: list) -> list:
        """After the model ran: count each chunk; (logits row, sequence) of each sequence that draws
        a token now (none mid-prefill; a request's samples, forked after its prompt, share a row)."""
        drawn = []
        for row, (seq, c) in enumerate(zip(seqs, chunks)):
            seq.computed += c
            if seq.computed < len(seq.tokens):                      # mid-prefill: nothing to sample
                continue
            drawn.append((row, seq))
            group = seq.group
            if not group.forked:
                for i in range(1, group.request.n):                 # parallel samples share the prompt
                    child = Sequence(group, i, list(seq.tokens), computed=seq.computed)
                    self.memory.fork(seq, child)
                    group.add(child)
                    drawn.append((row, child))
                group.forked = True
        return drawn

    def _take(self, drawn: list, tokens: list) -> None:
        """Append each drawn token; a sample with all its tokens frees its memory, a finished request leaves."""
        self.results.generated_tokens += len(drawn)
        for s, token in zip(drawn, tokens):
            s.tokens.append(token)
            s.token_times.append(self.clock)
            if len(s.tokens) == s.group.final_len:
                self._finish(s)

    def _finish(self, seq: Sequence) -> None:
        """``seq`` has drawn its last token: its memory is freed, and its request leaves once every
        sample of it is done."""
        group = seq.group
        group.finish(seq)
        self.memory.release(seq)
        if group.finished:
            self.memory.release_group(group)
            self.running.remove(group)
            self.results.outputs[group.request.rid] = [list(s.generated) for s in group.seqs]
            self.results.token_times.extend(list(s.token_times) for s in group.seqs)
