"""Checkpoints of the windowed layers on the real model: gemma 3's sliding-window layers keep
only the last positions of a sequence, so once a turn has generated past the point where the next
turn's history diverges (the client edited the answer), the history can only be reused from a
checkpoint taken where the prompt ended. With one, the next turn prefills only what follows the
old prompt, and answers exactly what a cold prefill answers."""

from __future__ import annotations

from backends.base import Done, Token
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp_settings import LlamaCppSettings

N_BATCH = 64  # the windowed layers keep n_swa + n_batch cells: a short answer moves them on


def run(engine: LlamaCppBackend, job_id: str, request: GenerateRequest) -> str:
    engine.admit(job_id, request)
    text = ""
    while True:
        for event in engine.step(0.01):
            if isinstance(event, Token) and event.job_id == job_id:
                text += event.text
            if isinstance(event, Done) and event.job_id == job_id:
                assert event.finish_reason in ("stop", "length")
                return text


def two_turns(checkpoints: int) -> tuple[str, dict[str, object], int]:
    engine = LlamaCppBackend(LlamaCppSettings(slots=2, n_batch=N_BATCH, prefix_cache=0, draft_max=0,
                                              checkpoints=checkpoints), threads=2)
    try:
        facts = " ".join(f"Fact {i}: river {i} flows north past the town of Alder{i}." for i in range(24))
        history = [{"role": "user", "content": facts + "\nList more facts like these."}]
        first = GenerateRequest(messages=history, max_tokens=160, temperature=0.0)
        n_prompt = len(engine.model.prompt_tokens(first))
        answer = run(engine, "turn-1", first)
        assert engine.executor.oldest_held()[0] > n_prompt - engine.model.n_swa  # the window moved on
        edited = [*history, {"role": "assistant", "content": "Sure! " + answer},
                  {"role": "user", "content": "Which town is on river 3?"}]
        before = engine.stats()
        text = run(engine, "turn-2", GenerateRequest(messages=edited, max_tokens=24, temperature=0.0))
        after = engine.stats()
        reused = int(after["prompt_tokens_reused"]) - int(before["prompt_tokens_reused"])  # type: ignore[call-overload]
        return text, after, reused - n_prompt
    finally:
        engine.close()


def test_an_edited_answer_reuses_the_history_through_a_checkpoint() -> None:
    text, stats, beyond_prompt = two_turns(checkpoints=1)
    cold_text, cold_stats, cold_beyond = two_turns(checkpoints=0)
    assert stats["checkpoint_reuses"] == 1 and beyond_prompt == 0  # the whole first prompt reused
    assert int(stats["checkpoint_bytes"]) > 0  # type: ignore[call-overload]
    assert cold_stats["checkpoint_reuses"] == 0 and cold_beyond < 0  # without: prefilled again
    assert text == cold_text and text
