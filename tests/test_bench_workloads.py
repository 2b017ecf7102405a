"""`fleet bench --workload`: the request lists are repeatable and their lengths hold in the model's
own tokens (checked against llama-server's /tokenize too), and one tiny real run reports both
sides per workload, counting jobs rejected for length instead of dropping them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from ecosystem.local.bench import PROMPTS, bench
from ecosystem.local.bench_report import FLEET, PEER
from ecosystem.local.bench_workloads import (
    GROUNDED_MAX_TOKENS,
    GROUNDED_PASSAGE_TOKENS,
    MIXED_OUTPUT_TOKENS,
    MIXED_PROMPT_TOKENS,
    SHARED_SYSTEM_TOKENS,
    WORKLOADS,
    Tokenizer,
    Workload,
    context_needed,
    ctx_per_slot,
    is_length_rejection,
)
from tests.real_servers import llama_server, model_path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(model_path())


def workload(name: str, tok: Tokenizer, **kw: object) -> Workload:
    return Workload(name, tok, short_prompts=PROMPTS, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests_other_seed_other_requests(tok: Tokenizer, name: str) -> None:
    first = workload(name, tok, seed=7).requests(0, 12)
    assert workload(name, tok, seed=7).requests(0, 12) == first
    # made by index alone: a later round's slice is the same whatever was made before it
    assert workload(name, tok, seed=7).requests(5, 7) == first[5:]
    if name != "short":  # short is the fixed built-in prompt list
        assert workload(name, tok, seed=8).requests(0, 12) != first


def test_mixed_lengths_span_the_ranges_in_real_tokens(tok: Tokenizer) -> None:
    requests = workload("mixed", tok).requests(0, 64)
    prompts = [r.prompt_tokens for r in requests]
    outs = [r.max_tokens for r in requests]
    lo, hi = MIXED_PROMPT_TOKENS
    assert all(lo <= n <= hi for n in prompts), prompts
    assert all(MIXED_OUTPUT_TOKENS[0] <= n <= MIXED_OUTPUT_TOKENS[1] for n in outs), outs
    assert min(prompts) < 100 and max(prompts) > 2000  # both ends of the range occur
    assert min(outs) < 50 and max(outs) > 200
    assert all(r.prompt_tokens == tok.count(r.prompt) for r in requests[:8])
    assert len({r.prompt for r in requests}) == 64
    assert {r.prompt.split("\n", 1)[0][:20] for r in requests} >= {  # all three shapes
        "Answer the question ", "Meeting notes:", "A conversation betwe"}
    assert ctx_per_slot(context_needed(requests), 512) == 4096


def test_shared_prefix_shares_a_300_token_system_prompt(tok: Tokenizer) -> None:
    w = workload("shared-prefix", tok)
    system = w.system_prompt()
    requests = w.requests(0, 32)
    assert abs(tok.count(system) - SHARED_SYSTEM_TOKENS) <= 10
    assert all(r.prompt.startswith(system) for r in requests)
    turns = {r.prompt[len(system):] for r in requests}
    assert len(turns) == 32 and all(t.startswith("\nUser: ") and t.endswith("\nAssistant:") for t in turns)
    # the system prompt's tokens are a prefix of every request's: what a prefix cache can reuse
    system_tokens = tok.tokens(system)
    assert all(tok.tokens(r.prompt)[:len(system_tokens) - 1] == system_tokens[:-1] for r in requests[:8])


def test_grounded_passages_are_400_tokens_and_max_tokens_caps(tok: Tokenizer) -> None:
    requests = workload("grounded", tok).requests(0, 16)
    for r in requests:
        passage = r.prompt.removeprefix("Passage:\n").rsplit("\n\n", 2)[0]
        assert abs(tok.count(passage) - GROUNDED_PASSAGE_TOKENS) <= 10
        assert r.max_tokens == GROUNDED_MAX_TOKENS
    assert len({r.prompt for r in requests}) == 16
    capped = workload("grounded", tok, max_tokens=8).requests(0, 16)
    assert [r.max_tokens for r in capped] == [8] * 16
    assert [r.prompt for r in capped] == [r.prompt for r in requests]
    assert {r.max_tokens for r in workload("mixed", tok, max_tokens=20).requests(0, 32)} <= set(range(16, 21))


@pytest.mark.model
def test_counts_match_llama_servers_tokenizer(tok: Tokenizer, tmp_path: Path) -> None:
    """The peer counts the same tokens: /tokenize with BOS, special tokens not parsed."""
    requests = [workload(name, tok).request(3) for name in WORKLOADS]
    with llama_server(tmp_path, parallel=1, ctx=512) as server:
        for r in requests:
            body = {"content": r.prompt, "add_special": True, "parse_special": False}
            tokens = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]
            assert len(tokens) == r.prompt_tokens


def test_context_sizes_and_length_rejection_texts() -> None:
    assert ctx_per_slot(81, 512) == 512 and ctx_per_slot(674, 512) == 1024
    assert ctx_per_slot(3197, 512) == 4096 and ctx_per_slot(4096, 512) == 4096
    assert is_length_rejection("prompt is 861 tokens; the context holds 512 per job (backend.n_ctx_per_seq)")
    assert is_length_rejection('HTTP 400: {"error":{"code":400,"message":"request (861 tokens) exceeds the '
                               'available context size (512 tokens), try increasing it"')
    assert not is_length_rejection("HTTP 500: boom") and not is_length_rejection(None)


def test_unknown_workload_is_refused() -> None:
    result = CliRunner().invoke(bench, ["--workload", "short,huge"])
    assert result.exit_code == 2 and "unknown workload huge" in result.output


@pytest.mark.model
@pytest.mark.timeout(600)
def test_grounded_and_mixed_end_to_end_count_length_rejections(tmp_path: Path) -> None:
    """Per-job context 512 on both sides: grounded fits; mixed request 0 (861 tokens) is rejected by
    both, counted per side, while requests 1 and 2 (479 and 66 tokens) run."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, [
        "--workload", "grounded,mixed", "--users", "1", "--rounds", "1", "--requests-per-user", "3",
        "--max-tokens", "8", "--no-warmup", "--fleet-set", "n_ctx_per_seq=512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "context 512 tokens per job on both sides" in result.output
    doc = json.loads(out.read_text())
    rows = {(r["workload"], r["role"]): r for r in doc["summary"]}
    assert list(rows) == [("grounded", FLEET), ("grounded", PEER), ("mixed", FLEET), ("mixed", PEER)]
    for role in (FLEET, PEER):
        grounded, mixed = rows["grounded", role], rows["mixed", role]
        assert (grounded["errors"], grounded["length_rejected"], grounded["tokens"]) == (0, 0, 24)
        assert grounded["tok_s"] > 0 and grounded["ttft_p95_ms"] > 0 and grounded["cpu_s_per_1k_total"] > 0
        counts = (mixed["requests"], mixed["errors"], mixed["length_rejected"], mixed["tokens"])
        assert counts == (3, 1, 1, 16), mixed["first_error"]
    ratios = doc["ratios_fleet_over_peer"]
    assert set(ratios) == {"grounded", "mixed"} and ratios["grounded"]["1"]["tok_s"] > 0
    assert ratios["grounded"]["1"]["tok_s_median_of_rounds"] > 0
    meta = doc["meta"]["workloads"]
    assert meta["grounded"]["ctx_per_slot"] == 512 and meta["mixed"]["prompt_tokens"]["max"] == 861
    html = out.with_suffix(".html").read_text()
    assert "workload grounded" in html and "workload mixed" in html
    assert doc["meta"]["cpu"] and f"fleet bench on {doc['meta']['cpu']}" in html  # the CPU model named
