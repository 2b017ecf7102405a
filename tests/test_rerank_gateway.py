"""The rerank routes' own refusals (docs/gateway.md#rerank), each a 400 naming the problem before
any job exists, and an engine that cannot rerank (the fake one, as the HTTP backends): the job's
422 names it and the worker serves on. The gateway in process, a fake-engine worker beside it;
the real model's scores and limits: tests/test_rerank.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway_harness import wait_until_healthy
from tests.gateway_inprocess import InProcessFleet

FAKE = {"backend__type": "fake", "backend__slots": 4}
MAX_DOCUMENTS = 150  # gateway.rerank_max_documents
DOC = "Paris is the capital of France."
BASE = {"model": "llm", "query": "What is the capital of France?"}

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/rerank", {"query": BASE["query"], "documents": [DOC]}, "'model' is required"),
    ("/v1/rerank", {"model": "llm", "documents": [DOC]}, "'query' is required"),
    ("/rerank", {**BASE, "query": ""}, "'query' is required"),
    ("/v2/rerank", {**BASE, "documents": []}, "'documents' is required"),
    ("/v1/rerank", {**BASE, "documents": "one text"}, "'documents' is required"),
    ("/v1/rerank", {**BASE, "documents": [DOC, 7]}, "document 1 is neither"),
    ("/v1/rerank", {**BASE, "documents": [{"title": "x"}]}, "document 0 is neither"),
    ("/v1/rerank", {**BASE, "documents": [DOC, ""]}, "document 1 is an empty string"),
    ("/v1/rerank", {**BASE, "documents": [DOC] * (MAX_DOCUMENTS + 1)},
     f"at most {MAX_DOCUMENTS} in one request (gateway.rerank_max_documents)"),
    ("/v2/rerank", {**BASE, "documents": [DOC], "top_n": 0}, "'top_n' must be a positive integer"),
    ("/v2/rerank", {**BASE, "documents": [DOC], "top_n": "2"}, "'top_n' must be a positive integer"),
    ("/v2/rerank", {**BASE, "documents": [DOC], "top_n": True}, "'top_n' must be a positive integer"),
    ("/v1/rerank", {**BASE, "documents": [DOC], "return_documents": "yes"}, "'return_documents' must be"),
    ("/v1/rerank", {**BASE, "documents": [DOC], "rank_fields": ["a"]}, "'rank_fields' is not supported"),
    ("/v1/rerank", {**BASE, "documents": [DOC], "instruction": ""}, "instruction"),
    ("/v1/rerank", {**BASE, "documents": ["x" * 1_000_001]}, "document 0 has 1,000,001 characters"),
]


def test_refusals_name_the_problem_and_a_non_scorer_says_so(inprocess_gateway: InProcessFleet) -> None:
    inprocess_gateway.worker("w1", **FAKE)
    gw = inprocess_gateway.start(gateway__rerank_max_documents=MAX_DOCUMENTS, gateway__max_body_bytes=4 << 20)
    wait_until_healthy(gw)
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for route, body, says in REFUSED:
            r = http.post(route, json=body)
            assert r.status_code == 400, (route, says, r.status_code, r.text[:300])
            assert says in r.json()["error"]["message"], (says, r.text[:300])
        # well formed, on an engine that cannot score: the job fails naming why, and the worker
        # takes the next job
        r = http.post("/v2/rerank", json={**BASE, "documents": [DOC]})
        assert r.status_code == 422 and "does not rerank" in r.json()["error"]["message"], r.text
        done = http.post("/v1/completions", json={"model": "llm", "prompt": "Hello", "max_tokens": 2})
        assert done.status_code == 200, done.text


@pytest.mark.parametrize("route", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_routes_take_only_post(inprocess_gateway: InProcessFleet, route: str) -> None:
    gw = inprocess_gateway.start()
    assert httpx.get(f"{gw.url}{route}", timeout=30).status_code == 405
