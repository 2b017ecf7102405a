"""Checkpoints of the windowed layers on the real model: gemma 3's sliding-window layers keep
only the last positions of a sequence, so once a turn has generated past the point where the next
turn's history diverges (the client edited the answer), the history can only be reused from a
checkpoint taken where the prompt ended. With one, the next turn prefills only what follows the
old prompt, and answers what a cold prefill answers."""

from __future__ import annotations

from typing import Any

import pytest

from backends.base import Done, Token
from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp_settings import LlamaCppSettings

pytestmark = pytest.mark.model

N_BATCH = 64  # the windowed layers keep n_swa + n_batch cells: a short answer moves them on


Entry = dict[str, Any]


def run(engine: LlamaCppBackend, job_id: str, request: GenerateRequest,
        beside: GenerateRequest | None = None) -> tuple[str, list[Entry]]:
    engine.admit(job_id, request)
    if beside is not None:
        engine.admit(job_id + "-beside", beside)
    text = ""
    while True:
        for event in engine.step(0.01):
            if isinstance(event, Token) and event.job_id == job_id:
                text += event.text
            if isinstance(event, Done) and event.job_id == job_id:
                assert event.finish_reason in ("stop", "length")
                return text, list(event.extra.get("logprobs", []))  # type: ignore[call-overload]


def two_turns(checkpoints: int) -> tuple[list[Entry], dict[str, object], int]:
    # two threads, as SAME was measured (with one, a suite run once put a restored window's
    # token 0.118 nats from the cold prefill's; two held in every run)
    # whole n_batch chunks (no pacing): a paced step's rows follow this machine's timed steps, so
    # the chunk that ends the prompt, and the rounding of its last row, would vary run to run
    engine = LlamaCppBackend(LlamaCppSettings(slots=2, n_batch=N_BATCH, prefix_cache=0, draft_max=0,
                                              max_stall_ms=0, checkpoints=checkpoints), threads=2)
    try:
        facts = " ".join(f"Fact {i}: river {i} flows north past the town of Alder{i}." for i in range(34))
        history = [{"role": "user", "content": facts + "\nNow count from 1 to 200, numbers only."}]
        # a prompt of whole n_batch chunks: then both ways compute every position in the same
        # chunks (prefill chunks end at multiples of n_batch), so the texts match bit for bit
        while len(engine.model.prompt_tokens(GenerateRequest(messages=history))) % N_BATCH:
            history[0]["content"] += " More."
        # the windowed layers' cells (n_swa + n_batch, rounded up to 768) recycle once the
        # sequence outgrows them: 300 tokens after a 600-token prompt is past that
        first = GenerateRequest(messages=history, max_tokens=300, ignore_eos=True, temperature=0.0)
        n_prompt = len(engine.model.prompt_tokens(first))
        assert n_prompt > engine.model.n_swa
        answer, _ = run(engine, "turn-1", first)
        # the window before the prompt's end is gone: only a checkpoint brings it back
        assert engine.executor.oldest_held()[0] > n_prompt - engine.model.n_swa
        edited = [*history, {"role": "assistant", "content": "Sure! " + answer},
                  {"role": "user", "content": "Thank you. Repeat Fact 2 exactly."}]
        before = engine.stats()
        # a second job decodes beside the answer, so its rows meet the batched attention kernel:
        # a lone decoder past 256 cells takes ggml's split-KV scan (by default the fleet decodes it
        # alone, as llama-server does), whose sums over a restored window's other cells round
        # differently enough to flip a near-tie; the neighbour row that hid this is batch
        # invariance's promise now
        beside = GenerateRequest(prompt="Say the alphabet.", max_tokens=40, ignore_eos=True, temperature=0.0)
        second = GenerateRequest(messages=edited, max_tokens=24, temperature=0.0,
                                 logprobs=True, top_logprobs=2)
        _, tokens = run(engine, "turn-2", second, beside)
        after = engine.stats()
        reused = int(after["prompt_tokens_reused"]) - int(before["prompt_tokens_reused"])  # type: ignore[call-overload]
        return tokens, after, reused - n_prompt
    finally:
        engine.close()


TIE = 0.25  # nats: two tokens this close are a coin toss that rounding may turn either way
SAME = 0.1  # nats: how far one token's log-probability may move between the two ways


def margin(entry: Entry) -> float:
    best, second = entry["top_logprobs"][:2]
    return float(best["logprob"] - second["logprob"])


def test_an_edited_answer_reuses_the_history_through_a_checkpoint() -> None:
    tokens, stats, beyond_prompt = two_turns(checkpoints=1)
    cold_tokens, cold_stats, cold_beyond = two_turns(checkpoints=0)
    assert stats["checkpoint_reuses"] == 1 and beyond_prompt == 0  # the whole first prompt reused
    assert int(stats["checkpoint_bytes"]) > 0  # type: ignore[call-overload]
    assert cold_stats["checkpoint_reuses"] == 0 and cold_beyond < 0  # without: prefilled again
    # a restored window holds the same values in other cells, so the attention sums round
    # differently: the answer must be the one a cold prefill gives, with each token's probability
    # within SAME of the cold one's, up to the first near-tie (past it the texts may part)
    assert tokens and cold_tokens
    compared = 0
    for warm, cold in zip(tokens, cold_tokens, strict=False):
        assert abs(warm["logprob"] - cold["logprob"]) < SAME, (warm, cold)
        if min(margin(warm), margin(cold)) < TIE:
            break
        assert warm["token"] == cold["token"], (warm, cold)
        compared += 1
    else:
        assert len(tokens) == len(cold_tokens)
    assert compared >= 8, f"a near-tie after {compared} tokens: too short an answer to say anything"
