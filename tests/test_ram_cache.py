"""The host-RAM cache of finished conversations on the real model: a conversation whose slot went
to another job finds its history again (its whole state stashed before the slot was emptied,
restored when it returns), as when edited history needs the stashed checkpoint of the windowed
layers; the answer is the one a cold prefill gives."""

from __future__ import annotations

import pytest

from backends.contract.schema import GenerateRequest
from backends.llamacpp import LlamaCppBackend
from backends.llamacpp_settings import LlamaCppSettings
from tests.test_chat_checkpoints import N_BATCH, run

pytestmark = pytest.mark.model


def conversation(engine: LlamaCppBackend, edited: bool, other_jobs: tuple[bool, ...]
                 ) -> list[tuple[str, dict[str, object], int]]:
    """Turn 1, then turn 2 once per entry of `other_jobs`, after another conversation in the only
    slot where it is True: per turn 2, (its text, the engine's stats, tokens of its prompt
    reused)."""
    facts = " ".join(f"Fact {i}: river {i} flows north past the town of Alder{i}." for i in range(34))
    history = [{"role": "user", "content": facts + "\nNow count from 1 to 200, numbers only."}]
    while len(engine.model.prompt_tokens(GenerateRequest(messages=history))) % N_BATCH:
        history[0]["content"] += " More."  # whole chunks: both ways compute the same chunks
    first = GenerateRequest(messages=history, max_tokens=300, ignore_eos=True, temperature=0.0)
    answer, _ = run(engine, "turn-1", first)
    said = ("Sure! " + answer) if edited else answer
    second = [*history, {"role": "assistant", "content": said},
              {"role": "user", "content": "Thank you. Is the sky blue? Answer yes or no."}]
    turns = []
    for i, other_job in enumerate(other_jobs):
        if other_job:  # shares only the template's first tokens: the slot's KV is cut to those
            other = [{"role": "user", "content": "Name three colours of the rainbow. " * 20}]
            run(engine, f"other-{i}", GenerateRequest(messages=other, max_tokens=8, temperature=0.0))
        before = int(engine.stats()["prompt_tokens_reused"])  # type: ignore[call-overload]
        text, _ = run(engine, f"turn-2-{i}", GenerateRequest(messages=second, max_tokens=24, temperature=0.0))
        stats = engine.stats()
        turns.append((text, stats, int(stats["prompt_tokens_reused"]) - before))  # type: ignore[call-overload]
    return turns


def engine(cache_ram_mib: int) -> LlamaCppBackend:
    return LlamaCppBackend(LlamaCppSettings(slots=1, n_batch=N_BATCH, prefix_cache=0, draft_max=0,
                                            cache_ram_mib=cache_ram_mib))


@pytest.mark.parametrize("edited", [False, True], ids=["real history", "edited answer"])
def test_a_conversation_whose_slot_went_to_another_finds_its_history_in_ram(edited: bool) -> None:
    cached, cold = engine(64), engine(0)
    try:
        [(text, stats, reused)] = conversation(cached, edited, other_jobs=(True,))
        # the reference first: the history never left its slot; then, without the RAM cache,
        # another job in the slot loses it (turn 1 is the same computation for both: done once)
        (kept_text, _, kept_reused), (_, cold_stats, cold_reused) = conversation(
            cold, edited, other_jobs=(False, True))
    finally:
        cached.close()
        cold.close()
    assert stats["ram_reuses"] == 1 and int(stats["ram_entries"]) >= 1  # type: ignore[call-overload]
    assert 0 < int(stats["ram_bytes"]) <= 64 << 20  # type: ignore[call-overload]
    assert stats["checkpoint_reuses"] == (1 if edited else 0)  # the stashed checkpoint, when edited
    assert reused == kept_reused > 600 and cold_reused < 16  # the history, not the template's start
    assert cold_stats["ram_reuses"] == 0 and cold_stats["ram_entries"] == 0
    # the same state as if the slot had kept it: the same answer (a cold prefill chunks the
    # history differently, so it may round a near tie the other way)
    assert text and text == kept_text
