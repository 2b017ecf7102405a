"""The in-process engine's sampling on the real model: OpenAI's penalties, per-token logprobs,
structured output (JSON schema -> grammar, checked per pick like llama-server) and chat on a model
without its own chat template."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest

from backends.base import Done, GenerateRequest, JobRejected
from backends.llamacpp import LlamaCppBackend, sampling
from backends.llamacpp.model import check_builtin_template
from backends.llamacpp.schema_grammar import integer_range
from backends.llamacpp_settings import LlamaCppSettings
from tests.engine_state import deterministic
from tests.test_batched_engine import TOPICS, run_all

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
EXAMPLES = '{"name":"Alice","age":31}\n{"name":"Bob","age":42}\n'


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppBackend]:
    b = LlamaCppBackend(LlamaCppSettings(slots=16, n_ctx_per_seq=512, n_batch=512, prefix_cache=2), threads=2)
    yield b
    b.close()


def generate(engine: LlamaCppBackend, **fields: Any) -> tuple[str, Done]:
    engine.admit("one", GenerateRequest(**fields))
    texts, ends = run_all(engine)
    done = ends["one"]
    assert isinstance(done, Done), done
    return texts.get("one", ""), done


def rejections(engine: LlamaCppBackend) -> int:
    return int(engine.stats()["grammar_rejections"])  # type: ignore[call-overload]


@pytest.mark.model
def test_presence_and_frequency_penalties_change_greedy_output(engine: LlamaCppBackend) -> None:
    prompt = " ".join(["the"] * 12)
    plain, _ = generate(engine, prompt=prompt, max_tokens=12, temperature=0.0)
    assert plain.split().count("the") >= 10  # the model just repeats
    penalized, _ = generate(engine, prompt=prompt, max_tokens=12, temperature=0.0,
                            presence_penalty=1.0, frequency_penalty=1.5)
    assert penalized != plain
    assert penalized.split().count("the") < plain.split().count("the") // 2


@pytest.mark.model
def test_logprobs_chosen_token_is_top_one_when_greedy(engine: LlamaCppBackend) -> None:
    text, done = generate(engine, prompt="The capital of France is", max_tokens=8, temperature=0.0,
                          logprobs=True, top_logprobs=3)
    entries: Any = done.extra["logprobs"]
    assert len(entries) == done.completion_tokens == 8
    assert "".join(e["token"] for e in entries) == text
    for e in entries:
        tops = e["top_logprobs"]
        assert len(tops) == 3
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert (tops[0]["token"], tops[0]["logprob"]) == (e["token"], e["logprob"])  # greedy: the best
        assert e["logprob"] <= 0.0 and bytes(e["bytes"]).decode() == e["token"]
    # logprobs without alternatives, and none at all when not asked
    _, bare = generate(engine, prompt="The capital of France is", max_tokens=3, temperature=0.0,
                       logprobs=True)
    bare_entries: Any = bare.extra["logprobs"]
    assert [e["top_logprobs"] for e in bare_entries] == [[], [], []]
    _, none = generate(engine, prompt="The capital of France is", max_tokens=3, temperature=0.0)
    assert "logprobs" not in none.extra


@pytest.mark.model
def test_json_schema_output_validates_for_sixteen_jobs_in_a_batch(engine: LlamaCppBackend) -> None:
    rejections0 = rejections(engine)
    for i in range(16):
        engine.admit(f"s{i}", GenerateRequest(prompt=f"Person number {i} as JSON:\n" + EXAMPLES,
                                              max_tokens=48, temperature=0.9, seed=i, format=PERSON))
    assert engine.stats()["active"] == 16
    texts, ends = run_all(engine)
    for i in range(16):
        done = ends[f"s{i}"]
        assert isinstance(done, Done) and done.finish_reason == "stop", (done, texts.get(f"s{i}"))
        jsonschema.validate(json.loads(texts[f"s{i}"]), PERSON)
    # "json": any JSON object, on a prompt that does not invite one
    text, done = generate(engine, prompt="Write a poem about rain.", max_tokens=64, temperature=0.0,
                          format="json")
    assert done.finish_reason == "stop" and isinstance(json.loads(text), dict)
    assert rejections(engine) > rejections0  # that prompt needed the full filter


@pytest.mark.model
def test_grammar_leaves_greedy_text_it_accepts_unchanged(engine: LlamaCppBackend) -> None:
    """The pick is only checked against the grammar: when the model already writes valid JSON,
    the constrained text is the unconstrained one, cut where the JSON value ends."""
    free, _ = generate(engine, prompt=EXAMPLES, max_tokens=24, temperature=0.0)
    rejections0 = rejections(engine)
    constrained, done = generate(engine, prompt=EXAMPLES, max_tokens=24, temperature=0.0, format=PERSON)
    assert done.finish_reason == "stop" and constrained.endswith("}")
    assert free.startswith(constrained)
    assert rejections(engine) == rejections0


@pytest.mark.model
def test_schema_that_cannot_compile_fails_at_admission(engine: LlamaCppBackend) -> None:
    unusable: list[tuple[dict[str, Any], str]] = [({"$ref": "#/$defs/missing"}, "$defs"),
                                                  ({"not": {"type": "string"}}, "Unrecognized")]
    for schema, problem in unusable:
        with pytest.raises(JobRejected, match="cannot be turned into a grammar") as rejected:
            engine.admit("bad", GenerateRequest(prompt="x", max_tokens=4, format=schema))
        assert problem in str(rejected.value)
        assert engine.stats()["active"] == 0 and engine.stats()["waiting"] == 0  # nothing started
    text, done = generate(engine, prompt="Hello", max_tokens=3, temperature=0.0)  # still serving
    assert done.completion_tokens == 3 and text


@pytest.mark.model
def test_chat_on_the_default_model_uses_the_gemma_template(engine: LlamaCppBackend) -> None:
    assert engine.model.chat_template == b"gemma"  # the embedded GGUF has none of its own
    request = GenerateRequest.model_validate({"messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}]})
    formatted = engine.model.apply_chat_template(request)
    assert formatted.startswith("<start_of_turn>user\nAnswer briefly.")
    assert formatted.endswith("<end_of_turn>\n<start_of_turn>model\n")
    text, done = generate(engine, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
                          temperature=0.0)
    assert text.strip() and done.prompt_tokens == len(engine.model.tokenize(
        "<start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n", special=True))
    with pytest.raises(ValueError, match=r"not a llama.cpp built-in template.*chatml"):
        check_builtin_template("gemma-4-imaginary")


@pytest.mark.model
def test_shortlist_resampling_picks_what_the_full_filter_picks(engine: LlamaCppBackend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused pick is re-sampled from the best SHORTLIST candidates when enough of them pass the
    grammar; the text must be the one filtering the whole vocabulary gives (greedy and seeded)."""
    def both() -> list[str]:
        out = []
        for fields in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 5}):
            text, _ = generate(engine, prompt="Write a poem about rain.", max_tokens=24, format=PERSON,
                               **fields)
            out.append(text)
        return out

    rejections0 = rejections(engine)
    shortlisted = both()
    assert rejections(engine) > rejections0
    monkeypatch.setattr(sampling, "chain_keeps", lambda s: None)  # always filter the whole vocabulary
    assert both() == shortlisted


@pytest.mark.model
def test_top_k_candidates_pick_what_the_whole_vocabulary_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains that start with top-k (the default sampling, and greedy with penalties) sample from the
    tokens near the best logit (sampling.TopCandidates); the text must be the one
    llama_sampler_sample gives from the whole vocabulary: seeded, batched, with penalties, top_k 1000.
    Each run on a fresh engine that makes the same calls on any CPU (tests/engine_state.py): a
    shared one would find the second run's prompts in its KV, and drafts and prefill chunks would
    follow this machine's timings, so the two samplers would see other logits rows."""
    def texts() -> dict[str, str]:
        engine = deterministic(slots=16, n_ctx_per_seq=512, n_batch=512, prefix_cache=2)
        try:
            for i in range(16):
                fields: dict[str, Any] = {"temperature": 0.9, "seed": 40 + i}
                if i % 4 == 1:
                    fields["top_k"] = 1000
                elif i % 4 == 2:
                    fields.update(presence_penalty=0.8, frequency_penalty=0.5)
                elif i % 4 == 3:
                    fields = {"temperature": 0.0, "repeat_penalty": 1.3}
                # 24 tokens a job: 384 picks, past the > 16 * 16 / 0.9 the assertion below needs
                request = GenerateRequest(prompt=f"Tell me about {TOPICS[i]}.", max_tokens=24, **fields)
                engine.admit(f"t{i}", request)
            got, _ = run_all(engine)
        finally:
            engine.close()
        return got

    fill = sampling.TopCandidates.fill
    used = []

    def counted(self: sampling.TopCandidates, logits: Any, k: int) -> Any:
        cur = fill(self, logits, k)
        used.append(cur is not None)
        return cur

    monkeypatch.setattr(sampling.TopCandidates, "fill", counted)
    near_best = texts()
    assert sum(used) > 0.9 * len(used) > 16 * 16, (sum(used), len(used))  # the fast path, nearly always
    monkeypatch.setattr(sampling.TopCandidates, "fill", lambda self, logits, k: None)  # all in C
    assert texts() == near_best


def test_top_k_candidates_hold_the_k_best_or_step_aside() -> None:
    top = sampling.TopCandidates(capacity=64)
    rng = np.random.default_rng(0)
    row = rng.normal(0, 4, 262_144).astype(np.float32)
    cur = top.fill(row, 40)
    assert cur is not None and 40 <= cur.size <= 64
    ids = {int(top._view["id"][i]) for i in range(cur.size)}
    assert set(np.argsort(-row)[:40].tolist()) <= ids
    assert top.fill(np.zeros(1000, dtype=np.float32), 40) is None  # flat: more than capacity tie
    assert top.fill(np.full(1000, -np.inf, dtype=np.float32), 40) is None
    assert top.fill(np.arange(10, dtype=np.float32), 40) is None  # fewer tokens than k


@pytest.mark.parametrize(("lo", "hi"),
                         [(0, 120), (5, 5), (-7, 3), (-120, -3), (17, 98765), (-999, 999), (10, 19)])
def test_integer_bounds_grammar_matches_exactly_the_range(lo: int, hi: int) -> None:
    """llama-cpp-python's converter ignores minimum/maximum; ours turns them into digit ranges.
    Each GBNF alternative here is a sequence of literals and digit classes, so it reads as a regex."""
    alts = integer_range(lo, hi)
    as_regex = ["".join(part.strip('"') for part in alt.split(" ")) for alt in alts]
    regex = re.compile("^(" + "|".join(as_regex) + ")$")
    for n in range(lo - 1200, hi + 1200):
        assert bool(regex.match(str(n))) == (lo <= n <= hi), n
    assert not any(regex.match(s) for s in ("00", "01", "-0", "007"))  # no leading zeros


@pytest.mark.model
def test_bounded_integers_hold_in_generated_json(engine: LlamaCppBackend) -> None:
    tight = {"type": "object", "required": ["age"], "additionalProperties": False,
             "properties": {"age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 21}}}
    for seed in range(4):
        text, done = generate(engine, prompt='{"age":1255}\n{"age":4}\n', max_tokens=12, temperature=1.0,
                              seed=seed, format=tight)
        assert done.finish_reason == "stop" and json.loads(text)["age"] in (18, 19, 20), text
    with pytest.raises(JobRejected, match="no integer lies within"):
        engine.admit("empty", GenerateRequest(prompt="x", format={"type": "integer", "minimum": 3,
                                                                  "maximum": 2}))
