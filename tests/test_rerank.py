"""Rerank end to end: a real `fleet worker` on the embedded model (gemma-3-270m judging documents
as Qwen3-Reranker does), a real `fleet serve`; llama-server's/Jina's `/v1/rerank` and `/rerank`,
Cohere's `/v2/rerank` (over HTTP, Cohere's SDK and litellm), their fields, `top_n` and
`return_documents`; the worker's limit's 400s (the gateway's: tests/test_rerank_gateway.py); a request
of 100 documents prefilling the query's prefix once. The engine's scoring context is checked in
process at the end: documents scored together on the shared prefix score as each alone does."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.contract.rerank import DEFAULT_INSTRUCTION, rerank_fields
from dispatcher import Fleet
from tests.real_fleet import RealFleet, fleet_processes

pytestmark = [pytest.mark.timeout(600), pytest.mark.model]
QUERY = "What is the capital of France?"
PARIS = "Paris is the capital of France."
RECIPE = "Mix flour, butter and sugar, then bake the cake for 30 minutes."
# a margin the model gives this pair by far (measured 0.86 vs 0.73): sure, not a tie
MARGIN = 0.05
UNRELATED = ("Bake the bread for 40 minutes.", "The stock market fell on Monday.",
             "Cats sleep most of the day.", "Water boils at 100 degrees Celsius.",
             "The train leaves at noon.")
# how far a score moves with how the prompt's decodes are cut and batched alone (one sequence, no
# copies, PARIS 0.838-0.853, RECIPE 0.720-0.767) or shared (up to 0.082 over 100 documents scored
# 32 together against each alone, scripts/bench_rerank.py): the small quantised model's
# rounding; a prefix the documents do not see moves them 0.25
ROUNDING = 0.1
N_CTX = 512  # backend.rerank_n_ctx: the prompt, query and one document together


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    """One worker and one gateway for the module: its tests only ask."""
    worker = {"backend__slots": 4, "backend__rerank_n_ctx": N_CTX}
    with fleet_processes(tmp_path_factory.mktemp("rerank"), "rerank", worker) as started:
        yield started


@pytest.fixture
def url(fleet: RealFleet) -> Iterator[str]:
    fleet.check_serving()
    yield fleet.url
    fleet.check_serving()


def post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=300)


def test_jina_shape_ranks_with_a_margin_top_n_and_documents(url: str) -> None:
    body = {"model": "llm", "query": QUERY, "documents": [RECIPE, PARIS]}
    r = post(url, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and answer["model"] == "llm"
    results = answer["results"]
    assert [x["index"] for x in results] == [1, 0]  # Paris first
    paris, recipe = (x["relevance_score"] for x in results)
    assert 0 < recipe < paris < 1 and paris - recipe > MARGIN
    # Jina's API returns the documents unless told not to
    assert [x["document"] for x in results] == [{"text": PARIS}, {"text": RECIPE}]
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] > 2 * len(QUERY.split())

    # llama-server's /rerank is the same route; objects with a `text` are documents too
    same = post(url, "/rerank", {**body, "documents": [{"text": RECIPE}, {"text": PARIS}]}).json()
    assert [x["index"] for x in same["results"]] == [1, 0]
    assert [x["relevance_score"] for x in same["results"]] == pytest.approx([paris, recipe], abs=1e-3)

    top = post(url, "/v1/rerank", {**body, "top_n": 1, "return_documents": False}).json()["results"]
    assert len(top) == 1 and top[0]["index"] == 1 and "document" not in top[0]
    # top_n past the documents: all of them
    assert len(post(url, "/v1/rerank", {**body, "top_n": 10}).json()["results"]) == 2


def test_cohere_shape(url: str) -> None:
    body = {"model": "llm", "query": QUERY, "documents": [RECIPE, "Berlin is in Germany.", PARIS]}
    r = post(url, "/v2/rerank", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["id"] and answer["meta"]["billed_units"] == {"search_units": 1}
    assert answer["meta"]["tokens"]["input_tokens"] > 0 and answer["meta"]["tokens"]["output_tokens"] == 0
    results = answer["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)  # highest first
    by_index = {x["index"]: x["relevance_score"] for x in results}
    assert by_index[2] - by_index[0] > MARGIN
    assert all("document" not in x for x in results)  # Cohere's default: no documents
    with_docs = post(url, "/v2/rerank", {**body, "top_n": 2, "return_documents": True}).json()["results"]
    assert len(with_docs) == 2
    assert all(x["document"] == {"text": body["documents"][x["index"]]} for x in with_docs)


def test_cohere_sdk_both_clients(url: str) -> None:
    """Cohere's SDK with its base URL set: ClientV2 posts /v2/rerank, the v1 Client /v1/rerank."""
    import cohere

    v2 = cohere.ClientV2(api_key="unused", base_url=url, timeout=300)
    answer = v2.rerank(model="llm", query=QUERY, documents=[RECIPE, PARIS], top_n=2)
    assert [x.index for x in answer.results] == [1, 0]
    assert answer.results[0].relevance_score - answer.results[1].relevance_score > MARGIN
    assert answer.meta and answer.meta.billed_units and answer.meta.billed_units.search_units == 1
    v1 = cohere.Client(api_key="unused", base_url=url, timeout=300)
    old = v1.rerank(model="llm", query=QUERY, documents=[RECIPE, PARIS], top_n=1, return_documents=True)
    assert len(old.results) == 1 and old.results[0].index == 1
    assert old.results[0].document and old.results[0].document.text == PARIS


@pytest.mark.parametrize(("provider", "base"), [("cohere", ""), ("jina_ai", "/v1"), ("hosted_vllm", "")])
def test_litellm_rerank(url: str, provider: str, base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm's rerank() through the providers whose shape the gateway speaks (Cohere's, Jina's,
    vLLM's), the gateway as their api_base."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    answer = litellm.rerank(model=f"{provider}/llm", query=QUERY, documents=[RECIPE, PARIS], top_n=2,
                            return_documents=True, api_base=url + base, api_key="unused")
    results = answer.results or []
    assert [x["index"] for x in results] == [1, 0]
    assert results[0]["relevance_score"] - results[1]["relevance_score"] > MARGIN
    assert results[0]["document"]["text"] == PARIS


@pytest.mark.parametrize(("route", "body", "says"), [
    # the worker's limit: a document whose tokens do not fit beside the query's prompt (the
    # gateway's own refusals: tests/test_rerank_gateway.py)
    ("/v1/rerank", {"model": "llm", "query": QUERY, "documents": [PARIS, "word " * 2000]},
     "document 1 has 2,0"),
    ("/v2/rerank", {"model": "llm", "query": "why " * 1000, "documents": [PARIS]},
     "the query and instruction"),
])
def test_the_workers_limit_is_a_400_naming_it(url: str, route: str, body: dict[str, Any], says: str) -> None:
    r = post(url, route, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert says in message and f"at most {N_CTX}" in message and "backend.rerank_n_ctx" in message, message
    assert post(url, "/v1/rerank", {"model": "llm", "query": QUERY, "documents": [PARIS]}).status_code == 200


def test_a_hundred_documents_prefill_the_prefix_once(fleet: RealFleet, url: str) -> None:
    documents = [f"Note {i}: {UNRELATED[i % len(UNRELATED)]}" for i in range(99)] + [PARIS]
    query = "Which city is the capital of France?"  # a prefix no earlier request left held
    job = Fleet(fleet.redis_url, pool="llm").submit(**rerank_fields(query, documents))
    result = job.result(300)
    scores, stats = result["scores"], result["rerank"]
    assert len(scores) == 100 and all(0 < s < 1 for s in scores)
    prefix, own = stats["prefix_tokens"], stats["document_tokens"]
    assert len(own) == 100 and prefix > 20
    # the prefix once, then only each document's own tokens
    assert stats["prefilled_tokens"] == prefix + sum(own)
    usage = result["usage"]
    assert usage["prompt_tokens"] == 100 * prefix + sum(own)
    assert usage["prompt_tokens"] - usage["cached_tokens"] == stats["prefilled_tokens"]
    # each document's own tokens are its text's and the same closing of the turn for all
    tokenized = [len(post(url, "/tokenize", {"content": " " + d}).json()["tokens"]) for d in documents[:5]]
    closing = {n - t for n, t in zip(own, tokenized, strict=False)}
    assert len(closing) == 1 and 0 < closing.pop() < 10
    # the relevant one stands out from the crowd (not a rank: this small model is sure of a
    # margin over most documents, not over every one)
    median = sorted(scores[:99])[49]
    assert scores[99] - median > MARGIN


def test_shared_prefix_scores_as_each_document_alone() -> None:
    """The scoring context: documents copied from the prefix's KV in one call (packed across
    decodes and cell groups) score as each whole prompt does decoded alone in one sequence (no
    copy), within the model's rounding (a document that does not see the prefix scores PARIS
    0.99); a repeated query prefills none of its prefix again."""
    import llama_cpp as ll
    import numpy as np

    from backends.llamacpp.engine import LlamaCppBackend
    from backends.llamacpp_settings import LlamaCppSettings

    # 256 cells (llama.cpp's least), n_batch 64: the prefix spans two decodes, and the documents
    # do not all fit beside it in one pass
    engine = LlamaCppBackend(LlamaCppSettings(slots=1, n_batch=64, rerank_n_ctx=256, rerank_batch=8),
                             threads=1)
    try:
        documents = [PARIS, RECIPE, "Berlin is the capital of Germany.",
                     "A long one: " + "the weather was mild and the markets were calm; " * 12,
                     "Lyon is a large city in France.", "Cats sleep a lot."]
        calls = [engine.score(QUERY, DEFAULT_INSTRUCTION, documents)]
        while (done := sum(len(c.relevance) for c in calls)) < len(documents):
            calls.append(engine.score(QUERY, DEFAULT_INSTRUCTION, documents[done:]))
        assert len(calls) > 2  # a decode's worth of documents a call (the long one alone), bounded
        first, *more = calls
        assert first.prefilled == first.prefix_tokens + sum(first.tokens)
        assert all(c.prefilled == sum(c.tokens) for c in more)  # the prefix was held
        scored = [score for c in calls for score in c.relevance]
        ctx = engine._scoring
        assert ctx is not None

        def alone(doc: str) -> float:
            """The whole prompt in sequence 0 of a cleared context, P(yes) / (P(yes) + P(no))."""
            ll.llama_memory_clear(ctx.memory, True)
            ctx.held = []
            tokens = ctx.prefix_of(QUERY, DEFAULT_INSTRUCTION) + ctx.document_of(doc)
            for start in range(0, len(tokens), ctx.n_batch):
                chunk = tokens[start:start + ctx.n_batch]
                for i, token in enumerate(chunk):
                    ctx._add(token, start + i, 0, logits=start + i == len(tokens) - 1)
                ctx._decode()
            last = ll.llama_get_logits_ith(ctx.ctx, len(chunk) - 1)
            row = np.ctypeslib.as_array(last, shape=(ctx.n_vocab,))
            return 1 / (1 + math.exp(float(row[ctx.no]) - float(row[ctx.yes])))

        reference = [alone(doc) for doc in documents]
        assert scored == pytest.approx(reference, abs=ROUNDING)
        assert scored[0] - scored[1] > MARGIN
    finally:
        engine.close()
