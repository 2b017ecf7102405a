"""A 3,000-token prompt admitted next to 8 decoding streams, on the real model.

Chunked prefill must keep the decoders moving: every engine step while the long prompt prefills
gives each of the 8 streams its next token and carries at most one chunk (n_batch tokens) of the
prompt, so a decoder waits at most one chunk between two tokens; with per-slot streams (the
default) a chunk is also cut to what the stall target (`max_stall_ms`) allows beside them. Checked
for both KV layouts: per-slot streams and the unified pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from backends.base import Done, Token
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp.pacing import MIN_ROWS
from backends.llamacpp.scheduler import StepPlan
from backends.llamacpp_settings import LlamaCppSettings

pytestmark = pytest.mark.model

N_BATCH = 512
DECODERS = 8
MAX_STEPS = 4000 // MIN_ROWS  # a paced step moves the prompt on by MIN_ROWS rows at least


@pytest.fixture(scope="module", params=[False, True], ids=["per-slot", "unified"])
def engine(request: pytest.FixtureRequest) -> Iterator[LlamaCppBackend]:
    unified: bool = request.param
    b = LlamaCppBackend(LlamaCppSettings(slots=DECODERS + 1, n_ctx_per_seq=4096, n_ctx=8192, n_batch=N_BATCH,
                                        prefix_cache=0, kv_unified=unified, draft_max=0), threads=2)
    yield b
    b.close()


def long_prompt(engine: LlamaCppBackend) -> str:
    text = "Notes from the harbour office. " + " ".join(
        f"Ship {i} left berth {i % 17} carrying {i * 3 % 41} crates of cargo." for i in range(220))
    n = len(engine.model.prompt_tokens(GenerateRequest(prompt=text, max_tokens=1)))
    assert 3000 <= n < 4000, n
    return text + "\nSummary:"


def test_long_prompt_does_not_stall_decoders(engine: LlamaCppBackend) -> None:
    greedy = {"temperature": 0.0}
    for i in range(DECODERS):
        engine.admit(f"d{i}", GenerateRequest(prompt=f"Story {i}: once upon a time",
                                              max_tokens=MAX_STEPS + 20, **greedy))  # type: ignore[arg-type]
    decoders = {f"d{i}" for i in range(DECODERS)}
    started: set[str] = set()
    while started != decoders:  # every stream is decoding before the long prompt comes
        started |= {ev.job_id for ev in engine.step() if isinstance(ev, Token)}

    plans: list[StepPlan] = []
    plan_step = engine.scheduler.plan_step

    def recording() -> StepPlan:  # the real plan, also kept for the assertions below
        plan = plan_step()
        plans.append(plan)
        return plan

    engine.scheduler.plan_step = recording  # type: ignore[method-assign]
    prompt = long_prompt(engine)
    engine.admit("long", GenerateRequest(prompt=prompt, max_tokens=4, **greedy))  # type: ignore[arg-type]
    tokens_per_step: list[Counter[str]] = []
    ended: dict[str, object] = {}
    try:
        while "long" not in {job for c in tokens_per_step for job in c}:
            events = engine.step()
            tokens_per_step.append(Counter(ev.job_id for ev in events if isinstance(ev, Token)))
            ended.update({ev.job_id: ev for ev in events if not isinstance(ev, Token)})
            assert len(tokens_per_step) < MAX_STEPS, "the long prompt never got its first token"
    finally:
        engine.scheduler.plan_step = plan_step  # type: ignore[method-assign]

    assert not ended, f"a decoder ended during the prefill (raise its max_tokens): {ended}"
    n_prompt = len(engine.model.prompt_tokens(GenerateRequest(prompt=prompt, max_tokens=1)))
    # every step of the prefill gave each decoder its next token ...
    for i, got in enumerate(tokens_per_step):
        starved = {d for d in decoders if got[d] < 1}
        assert not starved, f"step {i} of the prefill gave no token to {sorted(starved)}"
    # ... and carried at most one chunk of the long prompt: the prefill took ceil(n / n_batch) steps
    per_step = [sum(count for call in plan.calls for job, count in call.prompts if job.job_id == "long")
                for plan in plans]
    assert max(per_step) <= N_BATCH and sum(per_step) == n_prompt, (per_step, n_prompt)
    assert len(per_step) == len(tokens_per_step) >= -(-n_prompt // N_BATCH)

    while "long" not in ended:  # the long prompt's answer, beside the decoders: nothing fails
        for ev in engine.step():
            if not isinstance(ev, Token):
                assert isinstance(ev, Done), ev
                ended[ev.job_id] = ev
    for d in decoders:  # their tokens past the prefill (a third of the test's CPU) are not its subject
        engine.cancel(d)
    while engine.stats()["active"]:  # finish everything, nothing fails
        for ev in engine.step():
            if not isinstance(ev, Token):
                assert isinstance(ev, Done), ev
