"""A worker's death costs a streaming client a pause, not its stream: two real workers on the
model, `fleet serve`, 8 clients streaming completions through the official OpenAI client, and
`kill -9` of the worker holding the most streams. The dead worker's jobs resume on the other
from the text they had delivered, so every stream ends complete, its text is the job's result
text, and usage counts the whole answer once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from redis import Redis

from backends.contract import stream
from backends.contract.keys import stream_key
from dispatcher import Fleet
from tests.gateway_harness import Gateways, wait_until_healthy
from tests.harness import wait_for
from tests.reliability_checks import fleet_workers, held, streaming

pytestmark = pytest.mark.timeout(300)
PROMPTS = [f"Write a long story about {t}." for t in (
    "a lighthouse", "bread", "the sea", "a fox", "winter", "a train", "bees", "a clock")]


class Client(threading.Thread):
    """One streaming completion through the OpenAI client; what it saw and when."""

    def __init__(self, url: str, prompt: str, sampling: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=240)
        self.prompt, self.sampling = prompt, sampling
        self.text, self.finish, self.usage, self.job_id = "", None, None, ""
        self.error: BaseException | None = None
        self.arrivals: list[float] = []

    def run(self) -> None:
        try:
            chunks = self.client.completions.create(
                model="llm", prompt=self.prompt, max_tokens=96, stream=True,
                stream_options={"include_usage": True}, **self.sampling)
            for chunk in chunks:
                self.job_id = chunk.id.removeprefix("cmpl-")
                if chunk.usage is not None:
                    self.usage = chunk.usage
                for choice in chunk.choices:
                    if choice.text:
                        self.text += choice.text
                        self.arrivals.append(time.monotonic())
                    if choice.finish_reason:
                        self.finish = choice.finish_reason
        except BaseException as e:  # the assertion below names it
            self.error = e


def shown(redis: Redis, job_id: str, before: int = 2) -> str:
    """The text the attempts before `before` wrote (what a client may have seen)."""
    entries: list[Any] = redis.xrange(stream_key(job_id)) or []
    return stream.delivered_text((fields for _id, fields in entries), before)


def kill_the_busiest_mid_stream(redis_url: str, redis: Redis, tmp_path: Path, gateways: Gateways,
                                sampling: dict[str, Any]) -> tuple[list[Client], list[str], float]:
    with fleet_workers(redis_url, tmp_path / "logs") as workers:
        w = {name: workers.start(name, backend__slots=8, backend__threads=1) for name in ("w1", "w2")}
        gw = gateways.start()
        wait_until_healthy(gw)
        clients = [Client(gw.url, p, sampling) for p in PROMPTS]
        for c in clients:
            c.start()
        wait_for(lambda: sum(len(streaming(redis, n)) for n in w) >= 6, 120, "the streams to flow")
        # far enough in that a greedy run started over drifts from the text already shown: the
        # worker whose streams are along, three of them (or all it still runs: the claim spreads
        # the 8 over both workers, and a structured answer may end once its JSON is whole) at 100
        # characters, at least one; the busier first, looked at again each time (either may end
        # all its streams first)
        chosen: list[str] = []

        def far_enough() -> bool:
            for name in sorted(w, key=lambda n: -len(streaming(redis, n))):
                running = streaming(redis, name)
                along = sum(len(shown(redis, j)) >= 100 for j in running)
                if running and along >= min(3, len(running)):
                    chosen[:] = [name]
                    return True
            return False

        wait_for(far_enough, 120, "a worker's streams to have 100 characters")
        busiest = chosen[0]
        os.kill(w[busiest].process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        w[busiest].process.wait(10)
        victims = held(redis, busiest)
        for c in clients:
            c.join(240)
    return clients, victims, killed_at


STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 150}},
         "required": ["story"]}
STRUCTURED = {"temperature": 0.0, "extra_body": {"response_format": {
    "type": "json_schema", "json_schema": {"name": "story", "schema": STORY}}}}


@pytest.mark.model
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11}, STRUCTURED],
                         ids=["greedy", "seeded", "structured"])
def test_every_stream_survives_the_death_of_its_worker(redis_url: str, redis: Redis, tmp_path: Path,
                                                       gateways: Gateways, sampling: dict[str, Any]) -> None:
    clients, victims, killed_at = kill_the_busiest_mid_stream(redis_url, redis, tmp_path, gateways, sampling)
    assert victims, "the killed worker held no job"
    fleet = Fleet(redis_url)
    resumed = 0
    for c in clients:
        assert c.error is None, f"{c.job_id}: {c.error!r}"
        assert c.finish in ("length", "stop"), c.finish
        result = fleet.job(c.job_id).result(timeout=30)
        assert c.text == result["text"] and c.text
        assert c.usage is not None and c.usage.completion_tokens == result["usage"]["completion_tokens"]
        raw: list[Any] = redis.xrange(stream_key(c.job_id)) or []
        entries = [stream.decode(fields) for _id, fields in raw]
        if c.job_id in victims:
            assert result["attempt"] == 2
            # the dead attempt's text, replayed whole as the new attempt's first entry: resumed
            before = shown(redis, c.job_id)
            first = next(ev for ev in entries if ev.attempt == 2 and ev.kind == "text")
            assert (first.seq, first.text) == (0, before) and c.text.startswith(before)
            resumed += 1
            gap = max((b - a for a, b in zip(c.arrivals, c.arrivals[1:], strict=False)
                       if a <= killed_at + 0.5), default=0.0)
            print(f"\n{c.job_id}: resumed after {len(before)} characters; longest pause {gap:.2f}s")
        if "extra_body" in sampling and c.finish == "stop":  # the whole answer matches the schema
            assert len(json.loads(c.text)["story"]) >= 150
    assert resumed >= 1, "no stream had text when its worker died"


@pytest.mark.model
def test_the_engine_continues_after_the_delivered_text_and_counts_it_once() -> None:
    from backends.base import Done, GenerateRequest, Token
    from backends.llamacpp import LlamaCppBackend
    from backends.llamacpp_settings import LlamaCppSettings

    engine = LlamaCppBackend(LlamaCppSettings(slots=2), threads=1)

    def run(job_id: str, resume: str | None, request: GenerateRequest) -> tuple[str, Done]:
        if resume is None:
            engine.admit(job_id, request)
        else:
            assert engine.resume(job_id, request, resume)
        text, done = "", None
        while done is None:
            for ev in engine.step(0.01):
                if isinstance(ev, Token):
                    text += ev.text
                elif isinstance(ev, Done):
                    done = ev
        return text, done

    try:
        request = GenerateRequest(prompt="Write a story about a fox.", max_tokens=40, temperature=0.0)
        whole, alone = run("a", None, request)
        cut = whole[:len(whole) // 2]
        generated_before = engine.stats()["tokens_generated"]
        rest, resumed = run("b", cut, request)
        delivered = len(engine.model.tokenize(cut, special=False, add_special=False))
        assert resumed.prompt_tokens == alone.prompt_tokens  # the delivered text is output, not prompt
        # max_tokens counts the delivered tokens: 40 in all, the engine made only the rest
        assert (resumed.completion_tokens, resumed.finish_reason) == (40, "length")
        assert engine.stats()["tokens_generated"] == generated_before + 40 - delivered  # type: ignore[operator]
        assert rest  # the engine gives only the text after the delivered part (the worker replays that)
        # structured output: the grammar is fed the delivered text first, so the whole answer
        # still matches the schema; text the grammar refuses is not resumed (the caller starts over)
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        shaped = GenerateRequest(prompt="A person as JSON:", max_tokens=60, temperature=0.0, format=schema)
        whole, _ = run("c", None, shaped)
        cut = whole[:len(whole) // 2]
        rest, done = run("d", cut, shaped)
        person = json.loads(cut + rest)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int), cut + rest
        assert done.finish_reason == "stop"
        assert engine.resume("e", shaped, '{"colour": "red"') is False
        assert engine.resume("f", shaped, "not json at all") is False
    finally:
        engine.close()


@pytest.mark.soak
@pytest.mark.parametrize("round_", range(5))
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_streams_survive_a_kill_five_times_over(redis_url: str, redis: Redis, tmp_path: Path,
                                                gateways: Gateways, sampling: dict[str, Any],
                                                round_: int) -> None:
    """The experiment again, five rounds each (`scripts/test -m soak`)."""
    test_every_stream_survives_the_death_of_its_worker(redis_url, redis, tmp_path / str(round_), gateways,
                                                       sampling)
