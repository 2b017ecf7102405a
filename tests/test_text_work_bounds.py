"""Text work a client can ask for is bounded and kept off the decode loop, on real processes: a
redis-server, two `fleet worker`s on the embedded gemma-3-270m and `fleet serve`.

- `/tokenize` is answered on the worker's text thread, so a running stream does not pause while
  four 1M-character texts are tokenized beside it (a worker whose context admits 1M characters);
  on a worker with the default context the same texts are refused at once, as a chat of them is,
  naming the limit.
- The character pre-check counts every text field of a chat (reasoning_content, tool calls'
  arguments), so a huge one is refused before it is rendered and tokenized.
- The tokens a tokenize job handled count as its tenant's: usage, and `tokens_per_minute`.

The timing verdict is a same-run ratio: the stream's longest gap during the flood against the
time one tokenize request took (before, the loop tokenized and the stream stood still for at
least that long), so a slow or shared machine moves both. The stream's gaps before the flood and
the worker's own (its stream entries' Redis times) are printed beside it."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from backends.contract.keys import stream_key, usage_key
from tests.gateway_harness import GatewayProcess, start_gateway, wait_until_healthy
from tests.harness import RedisServer, WorkerProcess, start_worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.model]

QWEN3 = Path(__file__).parent / "fixtures" / "templates" / "Qwen-Qwen3-0.6B.jinja"
TENANTS = {
    "open": {"api_keys": ["key-open"]},
    "metered": {"api_keys": ["key-metered"], "models": ["big"], "tokens_per_minute": 2000},
}
POOLS = {"llm": "llm", "big": "big"}
SETTINGS: dict[str, Any] = {"gateway__tenants": TENANTS, "gateway__models": POOLS}
OPEN = {"Authorization": "Bearer key-open"}
METERED = {"Authorization": "Bearer key-metered"}
SMALL_BUDGET = 4096 * 32  # the default context (n_ctx_per_seq 4096) x 32 characters per token
BIG_CTX = 32_768  # 32,768 x 32 = 1,048,576 characters: a 1M-character text is taken
MILLION = 1_000_000
CALM_GAPS = 20  # the stream's gaps measured before the flood


@dataclass
class Fleet:
    url: str
    redis: Redis
    workers: list[WorkerProcess] = field(default_factory=list)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("text-bounds")
    with RedisServer.start(tmp / "redis") as redis_server:
        # llm: the default context, and a template that renders thoughts and native tool calls
        # (Qwen3's), so a chat's every field reaches the prompt; big: a context for 1M characters
        workers = [start_worker(redis_server.url, "tb-llm", tmp / "logs", pool="llm", backend__slots=4,
                                backend__chat_template_file=str(QWEN3), **SETTINGS),
                   start_worker(redis_server.url, "tb-big", tmp / "logs", pool="big", backend__slots=4,
                                backend__n_ctx_per_seq=BIG_CTX, **SETTINGS)]
        gateway: GatewayProcess = start_gateway(redis_server.url, tmp / "logs", name="tb-gateway", **SETTINGS)
        try:
            wait_until_healthy(gateway)
            yield Fleet(gateway.url, redis_server.client(), workers)
        finally:
            gateway.stop()
            for worker in workers:
                worker.kill()


def redis_now(redis: Redis) -> float:
    seconds, micros = redis.time()
    return float(seconds) + micros / 1e6


def million_characters(seed: int) -> str:
    """Text as people write it (words, a little CJK, spaces, punctuation): ~200k tokens, under
    the 262,144 one request may have."""
    rng = random.Random(seed)
    words = ["the", "tokenizer", "reads", "every", "word", "über", "naïve", "日本語", "\n", "Hello,",
             "world.", "straße", "example", "quickly", "résumé", "and", "of", "system", "answer"]
    out: list[str] = []
    size = 0
    while size < MILLION:
        word = rng.choice(words) + " "
        out.append(word)
        size += len(word)
    return "".join(out)[:MILLION]


class Stream:
    """A completion streamed through the gateway on a thread; the arrival time of every chunk
    that carries text."""

    def __init__(self, url: str, model: str) -> None:
        self.arrivals: list[float] = []
        self.job_id = ""
        self.error: BaseException | None = None
        self.done = threading.Event()
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=OPEN, timeout=300) as r:
                assert r.status_code == 200, r.read()
                self.job_id = r.headers["x-fleet-job-id"]
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if json.loads(line[6:])["choices"][0].get("text"):
                        self.arrivals.append(time.monotonic())
        except BaseException as e:  # the test reads it
            self.error = e
        finally:
            self.done.set()

    def wait_for(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < n:
            assert not self.done.is_set(), f"the stream ended early: {self.error!r}"
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def written(self, redis: Redis) -> list[float]:
        """When the worker wrote each of the job's stream entries (Redis time, ms: the entry ids)."""
        entries: list[Any] = redis.xrange(stream_key(self.job_id)) or []
        return [int(entry_id.split(b"-")[0]) / 1000 for entry_id, _ in entries]

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between text chunks, each counted where it ends: those ending within [start, end]."""
        a = self.arrivals
        return [a[i] - a[i - 1] for i in range(1, len(a)) if start <= a[i] <= end]


def flood_beside_a_stream(fleet: Fleet, model: str, bodies: list[dict[str, Any]]) -> tuple[
        list[httpx.Response], dict[str, Any]]:
    """The bodies posted to /tokenize at once while a stream of `model` runs; the responses, and
    the stream's gaps before the flood and during it, with each request's time (printed)."""
    stream = Stream(fleet.url, model)
    took: list[float] = []

    def post(body: dict[str, Any]) -> httpx.Response:
        started = time.monotonic()
        response = httpx.post(f"{fleet.url}/tokenize", json=body, headers=OPEN, timeout=300)
        took.append(time.monotonic() - started)
        return response

    try:
        stream.wait_for(10)  # past its first token and first writes
        calm_from = stream.arrivals[-1]
        stream.wait_for(len(stream.arrivals) + CALM_GAPS)
        flood_from, flood_from_redis = time.monotonic(), redis_now(fleet.redis)
        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(post, bodies))
        flood_to, flood_to_redis = time.monotonic(), redis_now(fleet.redis)
        time.sleep(0.5)  # a pause the flood caused ends after it: it is counted too
        assert not stream.done.is_set(), f"the stream ended during the flood: {stream.error!r}"
        calm, flood = stream.gaps(calm_from, flood_from), stream.gaps(flood_from, flood_to + 0.5)
    finally:
        stream.stop()
    written = stream.written(fleet.redis)
    worker_gaps = [b - a for a, b in itertools.pairwise(written)
                   if flood_from_redis <= b <= flood_to_redis + 0.5]
    assert len(calm) >= CALM_GAPS and flood, (len(calm), len(flood))
    numbers: dict[str, Any] = {
        "median_gap_before": statistics.median(calm), "longest_gap_before": max(calm),
        "median_gap_during": statistics.median(flood), "longest_gap_during": max(flood),
        "worker_longest_gap_during": max(worker_gaps, default=0.0), "flood_seconds": flood_to - flood_from,
        "fastest_request": min(took), "chunks_during": len(flood)}
    print(f"\n{model}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in numbers.items()))
    return responses, numbers


def test_four_million_character_tokenizes_do_not_pause_a_stream(fleet: Fleet) -> None:
    """A worker whose context admits 1M characters tokenizes them, on its text thread: the
    stream beside them keeps its pace (before: each froze it for the whole tokenization)."""
    texts = [million_characters(seed) for seed in range(4)]
    responses, numbers = flood_beside_a_stream(fleet, "big", [{"model": "big", "content": t} for t in texts])
    for response in responses:
        assert response.status_code == 200, response.text[:300]
        assert 100_000 < len(response.json()["tokens"]) <= 262_144
    # before: the loop tokenized, and the stream stood still for at least one whole tokenization
    # (the fastest request's time holds one); a shared machine slows both alike
    assert numbers["longest_gap_during"] <= numbers["fastest_request"] / 2, numbers


def test_million_character_tokenizes_are_refused_like_a_prompt(fleet: Fleet) -> None:
    """On the default context a 1M-character text is over the limit a prompt has: refused before
    tokenizing (before: tokenized on the loop, 200), a 422 naming the limit. The stream's gaps
    beside the four refusals are printed."""
    texts = [million_characters(seed) for seed in range(4)]
    responses, _ = flood_beside_a_stream(fleet, "llm", [{"model": "llm", "content": t} for t in texts])
    for response in responses:
        assert response.status_code == 422, response.text[:300]
        message = response.json()["error"]["message"]
        assert f"refused: request too large: {MILLION:,} characters; this worker takes at most " \
               f"{SMALL_BUDGET:,} characters (a context of 4096 tokens x 32 characters per token)" in message
    # the same limit as a chat of the same text: one rule
    chat = httpx.post(f"{fleet.url}/v1/chat/completions", headers=OPEN, timeout=120, json={
        "model": "llm", "messages": [{"role": "user", "content": texts[0]}], "max_tokens": 1})
    assert chat.status_code == 422 and f"{MILLION:,} characters" in chat.text, chat.text[:300]


def chat_refusal(fleet: Fleet, messages: list[dict[str, Any]], **extra: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{fleet.url}/v1/chat/completions", headers=OPEN, timeout=300,
                          json={"model": "llm", "messages": messages, "max_tokens": 4, **extra})
    return response, time.monotonic() - started


def test_a_huge_reasoning_content_is_refused_before_it_is_tokenized(fleet: Fleet) -> None:
    """990k characters of a past turn's thoughts (Qwen3's template renders them): before, the
    pre-check counted content only and the worker rendered and tokenized them all."""
    messages = [{"role": "user", "content": "Think hard."},
                {"role": "assistant", "content": "Done.", "reasoning_content": "hmm " * 247_500},
                {"role": "user", "content": "And now?"}]
    response, took = chat_refusal(fleet, messages)
    print(f"\nreasoning_content 990,000 characters: {response.status_code} in {took:.2f}s")
    assert response.status_code == 422, response.text[:300]
    assert "refused: request too large: 990,0" in response.text
    assert f"this worker takes at most {SMALL_BUDGET:,} characters" in response.text


def test_huge_tool_call_arguments_are_refused_before_they_are_tokenized(fleet: Fleet) -> None:
    """Nine calls of ~99k characters of arguments each in the history, in the model's own tool
    syntax (the template renders them as sent: nothing lowers them into the content)."""
    tool = {"type": "function", "function": {"name": "store", "parameters": {
        "type": "object", "properties": {"blob": {"type": "string"}}}}}
    arguments = json.dumps({"blob": "z" * 99_000})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "store", "arguments": arguments}}
             for i in range(9)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Store these."},
                                      {"role": "assistant", "content": "", "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": f"call_{i}", "content": "ok"} for i in range(9)]
    response, took = chat_refusal(fleet, messages, tools=[tool])
    print(f"\ntool-call arguments 891,000+ characters: {response.status_code} in {took:.2f}s")
    assert response.status_code == 422, response.text[:300]
    assert "refused: request too large: 891," in response.text
    assert f"this worker takes at most {SMALL_BUDGET:,} characters" in response.text


def test_tokenize_work_counts_against_the_tenants_tokens(fleet: Fleet) -> None:
    """A tenant's tokenize jobs count the tokens they made (usage, tokens_per_minute): one text
    of ~5k tokens passes the tenant's 2,000 a minute, and the next request is refused, 429."""
    if time.time() % 60 > 40:  # both requests within one minute: tokens_per_minute's window
        time.sleep(61 - time.time() % 60)
    text = million_characters(7)[:25_000]
    first = httpx.post(f"{fleet.url}/tokenize", json={"content": text}, headers=METERED, timeout=120)
    assert first.status_code == 200, first.text[:300]
    made = len(first.json()["tokens"])
    assert made > 2000
    usage = fleet.redis.hgetall(usage_key("metered", "total"))
    assert int(usage[b"prompt_tokens"]) == made, usage
    second = httpx.post(f"{fleet.url}/tokenize", json={"content": "one more"}, headers=METERED, timeout=120)
    assert second.status_code == 429, second.text[:300]
    assert second.json()["error"]["param"] == "tokens_per_minute"
