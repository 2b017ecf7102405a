"""`min_tokens` and `ignore_eos` on the in-process engine with the real model: the end-of-generation
tokens are masked in the job's own logits row, on every sampling path (greedy argmax, drafts,
a sampler chain, logprobs), and nowhere else."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backends.base import Done, GenerateRequest
from backends.llamacpp import LlamaCppBackend
from tests.engine_state import deterministic
from tests.test_batched_engine import run_all

pytestmark = pytest.mark.model

# The base model ends this one at once, greedily: its first token is <eos>
STOPS_AT_ONCE = "#include <stdio.h>\nint main() { return 0; }\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppBackend]:
    # drafts sized by a stand-in clock, not this CPU's timings (tests/engine_state.py): whether any
    # draft is kept below is then the same on every machine
    b = deterministic(threads=None, slots=4, n_ctx_per_seq=512, n_batch=512, prefix_cache=0, draft_max=4)
    yield b
    b.close()


def run(engine: LlamaCppBackend, jobs: dict[str, GenerateRequest]) -> dict[str, tuple[str, Done]]:
    for job_id, request in jobs.items():
        engine.admit(job_id, request)
    texts, ends = run_all(engine)
    out = {}
    for job_id in jobs:
        done = ends[job_id]
        assert isinstance(done, Done), done
        out[job_id] = (texts.get(job_id, ""), done)
    return out


def ask(**fields: object) -> GenerateRequest:
    return GenerateRequest(**{"prompt": STOPS_AT_ONCE, "max_tokens": 64, "temperature": 0.0, **fields})  # type: ignore[arg-type]


def test_min_tokens_and_ignore_eos_beside_a_job_that_asks_for_neither(engine: LlamaCppBackend) -> None:
    got = run(engine, {"plain": ask(), "min": ask(min_tokens=12), "all": ask(ignore_eos=True)})
    plain_text, plain = got["plain"]
    assert plain.completion_tokens == 0 and plain_text == "" and plain.finish_reason == "stop"
    min_text, at_least = got["min"]
    # at least 12; it may stop after them (or run on: a near tie after the forced tokens)
    assert 12 <= at_least.completion_tokens <= 64 and at_least.finish_reason in ("stop", "length")
    all_text, to_the_end = got["all"]
    assert to_the_end.completion_tokens == 64 and to_the_end.finish_reason == "length"
    # the same greedy text until min_tokens' job stops (drafts were verified as usual)
    assert all_text.startswith(min_text) and min_text
    assert engine.stats()["draft_accepted"] > 0  # the greedy fast path and speculation stayed on


def test_other_sampling_paths_honour_the_mask(engine: LlamaCppBackend) -> None:
    got = run(engine, {
        "chain": ask(ignore_eos=True, temperature=0.8, seed=5, max_tokens=24),
        "penalties": ask(min_tokens=6, presence_penalty=0.5),
        "logprobs": ask(ignore_eos=True, logprobs=True, top_logprobs=2, max_tokens=16),
    })
    assert got["chain"][1].completion_tokens == 24
    assert got["penalties"][1].completion_tokens >= 6
    text, done = got["logprobs"]
    assert done.completion_tokens == 16
    entries = done.extra["logprobs"]
    assert len(entries) == 16 and "".join(e["token"] for e in entries) == text
    assert all(a["token"] not in ("<eos>", "<end_of_turn>") for e in entries for a in e["top_logprobs"])


def test_stop_strings_still_stop_and_bounds_are_checked(engine: LlamaCppBackend) -> None:
    text, _ = run(engine, {"x": ask(ignore_eos=True)})["x"]
    stop = text.strip().split()[1]
    cut, stopped = run(engine, {"y": ask(ignore_eos=True, stop=[stop])})["y"]
    assert stopped.finish_reason == "stop" and stop not in cut and text.startswith(cut)
    assert stopped.extra["stop_word"] == stop  # which stop string ended it (Anthropic's stop_sequence)
    with pytest.raises(ValueError, match="min_tokens"):
        GenerateRequest(prompt="x", max_tokens=4, min_tokens=5)
    # without max_tokens, the worker's default caps min_tokens (it never asks for more than it allows)
    capped = GenerateRequest(prompt="x", min_tokens=500).sampling(engine.settings.sampling)
    assert capped.min_tokens == capped.max_tokens == engine.settings.sampling.max_tokens
