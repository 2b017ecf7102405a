"""Cached prompt tokens, end to end: a real `fleet worker` on the real model behind a real `fleet
serve`. A repeated prompt finds its KV where the last job left it; what the engine did not prefill
(its prompt tokens minus the prompt tokens it prefilled, read from the worker's own counters) is
what the gateway reports: OpenAI's `usage.prompt_tokens_details.cached_tokens` (chat and
completions, whole and streamed, summed over n choices) and the Responses API's
`usage.input_tokens_details.cached_tokens`; the fleet counts the same into tenant usage, the
pool's counters (`fleet status`, Prometheus) and `fleet usage`. The llama-server backend reports
llama-server's own figure."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from backends.contract.keys import worker_key
from dispatcher.observe.snapshot import snapshot
from dispatcher.plans import run
from dispatcher.tenants import usage_plan
from tests.gateway_harness import wait_until_healthy
from tests.harness import ROOT, wait_for
from tests.observe_helpers import cli_env
from tests.real_servers import LlamaServer, llama_server

pytestmark = [pytest.mark.timeout(300), pytest.mark.model]
# about 110 tokens: long enough that reuse shows, short enough to prefill quickly on a busy box
STORY = ("Write the next chapter of the story. The lighthouse keeper kept a log of every ship that "
         "passed the northern rocks: the date, the flag, the weather and what the crew shouted up "
         "to him. In the winter of the great storm the log stops for eleven days, and when it "
         "starts again the handwriting is not his. The village says he walked into the sea; the "
         "harbour master says he took the mail boat south. The new hand writes only the names of "
         "ships that never reached the harbour.")
CHAT: list[Any] = [{"role": "user", "content": STORY}]
TEXT = "Once upon a time, " + STORY


class Prefills:
    """The worker's prompt tokens prefilled so far (its engine's counter, in its status hash as of
    the beat after its last job ended)."""

    def __init__(self, redis: Redis, worker: str) -> None:
        self.redis, self.worker, self.jobs, self.seen = redis, worker, 0, 0

    def since_last(self, jobs: int = 1) -> int:
        """Tokens prefilled by the next `jobs` jobs (read once the worker says they ended)."""
        self.jobs += jobs

        def read() -> int | None:
            status = self.redis.hgetall(worker_key(self.worker))
            if int(json.loads(status.get(b"jobs_done", b"0"))) < self.jobs:
                return None
            return int(json.loads(status[b"backend_stats"])["prompt_tokens_prefilled"])

        now = wait_for(read, 30, "the worker's status after its job")
        before, self.seen = self.seen, now
        return now - before


def cached_of(usage: Any) -> int:
    return int(usage.prompt_tokens_details.cached_tokens)


def sse_json(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture
def served(redis: Redis, workers: Any, gateways: Any) -> Any:
    workers.start("w1", backend__slots=1, backend__n_ctx_per_seq=1024)
    gw = gateways.start()
    wait_until_healthy(gw)
    return gw


def test_a_repeated_prompt_reports_the_tokens_it_did_not_prefill(served: Any, redis: Redis,
                                                                  redis_url: str) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    prefills = Prefills(redis, "w1")
    small: dict[str, Any] = {"model": "llm", "max_tokens": 4, "temperature": 0}
    seen: list[tuple[str, int, int]] = []  # (what, prompt tokens, cached tokens): every job

    def check(what: str, prompt: int, cached: int, jobs: int = 1) -> int:
        prefilled = prefills.since_last(jobs)
        assert cached == prompt - prefilled, (what, prompt, cached, prefilled)
        seen.append((what, prompt, cached))
        return cached

    # chat: the first finds nothing (a fresh worker), the next its whole prompt but the last token
    first = client.chat.completions.create(messages=CHAT, **small).usage
    assert first is not None and check("chat, first", first.prompt_tokens, cached_of(first)) == 0
    again = client.chat.completions.create(messages=CHAT, **small).usage
    assert again is not None and first.prompt_tokens > 100
    assert check("chat, again", again.prompt_tokens, cached_of(again)) == again.prompt_tokens - 1
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True}, **small))
    usage = chunks[-1].usage
    assert usage is not None and check("chat, streamed", usage.prompt_tokens, cached_of(usage)) > 0
    # n choices: their prompt tokens and cached tokens summed alike
    two = client.chat.completions.create(messages=CHAT, n=2, **small).usage
    assert two is not None and two.prompt_tokens == 2 * first.prompt_tokens
    assert check("chat, n=2", two.prompt_tokens, cached_of(two), jobs=2) == 2 * (first.prompt_tokens - 1)

    # the Responses API: the same chat; whole, then streamed (its last event's usage)
    body = {"model": "llm", "input": STORY, "max_output_tokens": 4, "temperature": 0}
    whole = httpx.post(f"{served.url}/v1/responses", json=body, timeout=120).json()["usage"]
    assert check("responses", whole["input_tokens"], whole["input_tokens_details"]["cached_tokens"]) > 0
    events = sse_json(httpx.post(f"{served.url}/v1/responses", json={**body, "stream": True}, timeout=120))
    last = events[-1]["response"]["usage"]
    assert check("responses, streamed", last["input_tokens"],
                 last["input_tokens_details"]["cached_tokens"]) > 0

    # completions: another prompt (at most the first token is shared), then the same again
    text = client.completions.create(prompt=TEXT, **small).usage
    assert text is not None and check("completion, first", text.prompt_tokens, cached_of(text)) <= 1
    text = client.completions.create(prompt=TEXT, **small).usage
    assert text is not None and check("completion, again", text.prompt_tokens, cached_of(text)) == (
        text.prompt_tokens - 1)
    raw = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
        "prompt": TEXT, "stream": True, "stream_options": {"include_usage": True}, **small})
    streamed = sse_json(raw)[-1]["usage"]
    assert check("completion, streamed", streamed["prompt_tokens"],
                 streamed["prompt_tokens_details"]["cached_tokens"]) > 0
    print("prompt and cached tokens:", seen)

    # the fleet's accounting counts the same: tenant usage, the pool's counters, Prometheus, the CLI
    total = sum(cached for _, _, cached in seen)
    prompts = sum(prompt for _, prompt, _ in seen)
    tenants = run(redis, usage_plan(None, 1))
    assert sum(c["cached_tokens"] for c in tenants.values()) == total
    assert sum(c["prompt_tokens"] for c in tenants.values()) == prompts
    totals = snapshot(redis, "llm")["totals"]
    assert (totals["cached_tokens"], totals["prompt_tokens"]) == (total, prompts)
    metrics = httpx.get(f"{served.url}/metrics", timeout=30).text
    samples = {(s.name, s.labels.get("pool") or s.labels.get("tenant")): s.value
               for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert samples[("llama_fleet_cached_prompt_tokens_total", "llm")] == total
    tenant_metric = "llama_fleet_tenant_cached_prompt_tokens_total"
    by_tenant = [v for (name, _), v in samples.items() if name == tenant_metric]
    assert sum(by_tenant) == total
    table = subprocess.run([sys.executable, "-m", "ecosystem.cli", "usage", "--since", "1h"],
                           env=cli_env(redis_url), cwd=ROOT, check=True, capture_output=True, text=True,
                           timeout=60).stdout
    assert "cached" in table and f"{total:,}" in table, table


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    with llama_server(tmp_path_factory.mktemp("llama-server"), parallel=1, ctx=1024) as s:
        yield s


def test_the_llama_server_backend_reports_the_servers_cache_hits(server: LlamaServer, workers: Any,
                                                                 gateways: Any) -> None:
    """llama-server's own figure (its `timings.cache_n`), on its chat endpoint and on /completion:
    nothing the first time, most of the prompt the second (llama-server prefills a few tokens
    again at the end of a reused prompt)."""
    workers.start("w1", backend__type="llama-server", backend__endpoint=server.url,
                  backend__connect_timeout=30)
    gw = gateways.start()
    wait_until_healthy(gw)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    small: dict[str, Any] = {"model": "llm", "max_tokens": 4, "temperature": 0}
    seen = []
    for ask in (lambda: client.chat.completions.create(messages=CHAT, **small),
                lambda: client.completions.create(prompt=TEXT, **small)):
        usages = [ask().usage for _ in range(2)]
        assert usages[0] is not None and usages[1] is not None
        seen += [(u.prompt_tokens, cached_of(u)) for u in usages]
    print("llama-server, prompt and cached tokens:", seen)
    (chat_prompt, chat_first), (_, chat_again), (text_prompt, text_first), (_, text_again) = seen
    assert chat_first == 0 and chat_prompt - 16 < chat_again < chat_prompt
    assert text_first <= 1 and text_prompt - 16 < text_again < text_prompt
