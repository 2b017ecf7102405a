"""What users send, one builder per kind of request: each takes the client's seeded random source
and a tenant and returns a `Call`. The same kinds run on the fake engine (which echoes the words
of the prompt, so a prompt's length is its job's length and a tool call's JSON comes back as the
model's answer) and on the real model (short prompts, bounded max_tokens).

Bad input is a table of requests that must be refused with a 4xx naming the problem, never a 5xx.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from ecosystem.soak.client import Call
from ecosystem.soak.plan import BROKEN_MODEL, HOSTILE_MODEL, MODEL, OTHER_MODEL, tenant_key

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform",
         "victor", "whiskey", "xray", "yankee", "zulu")
TOPICS = ("the sea", "a lighthouse", "winter", "a red fox", "trains", "the moon", "coffee", "a library")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                 "required": ["answer"], "additionalProperties": False}
PRIORITIES = ("high", "default", "low")


class Kinds:
    def __init__(self, fake: bool) -> None:
        self.fake = fake

    # -- prompts ------------------------------------------------------------------------------------

    def words(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def prompt(self, rng: random.Random, long: bool = False) -> tuple[str, int]:
        """A prompt and its max_tokens: fake jobs run one step per prompt word."""
        if self.fake:
            n = rng.randint(60, 120) if long else rng.randint(3, 14)
            return self.words(rng, n), n + rng.choice((0, 2))
        topic = rng.choice(TOPICS)
        if long:
            return f"Write a long story about {topic}, with many details.", rng.randint(40, 64)
        return f"Say one short sentence about {topic}.", rng.randint(6, 24)

    def priority(self, rng: random.Random) -> str | None:
        return rng.choices((None, *PRIORITIES), weights=(2, 2, 4, 2))[0]

    def base(self, kind: str, rng: random.Random, tenant: str, path: str, body: Any, **kw: Any) -> Call:
        return Call(kind, tenant, tenant_key(tenant), path, body, priority=self.priority(rng), **kw)

    # -- the kinds ----------------------------------------------------------------------------------

    def chat(self, rng: random.Random, tenant: str, *, stream: bool = False, long: bool = False,
             kind: str = "chat", **kw: Any) -> Call:
        prompt, n = self.prompt(rng, long)
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": n}
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return self.base(kind, rng, tenant, "/v1/chat/completions", body, stream="sse" if stream else None,
                         **kw)

    def completion(self, rng: random.Random, tenant: str, *, stream: bool = False) -> Call:
        prompt, n = self.prompt(rng)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": stream}
        kind = "completion_stream" if stream else "completion"
        return self.base(kind, rng, tenant, "/v1/completions", body, stream="sse" if stream else None)

    def ollama_chat(self, rng: random.Random, tenant: str) -> Call:
        prompt, n = self.prompt(rng)
        stream = rng.random() < 0.6
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": stream,
                "options": {"num_predict": n}}
        return self.base("ollama_chat", rng, tenant, "/api/chat", body, stream="ndjson" if stream else None)

    def responses(self, rng: random.Random, tenant: str) -> Call:
        prompt, n = self.prompt(rng)
        stream = rng.random() < 0.5
        body = {"model": MODEL, "input": prompt, "max_output_tokens": n, "stream": stream}
        return self.base("responses", rng, tenant, "/v1/responses", body,
                         stream="responses" if stream else None)

    def tools(self, rng: random.Random, tenant: str) -> Call:
        city = rng.choice(("Paris", "Oslo", "Lima", "Kyoto"))
        # the fake engine answers with the last message's words: here, a call in the generic format
        content = (json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": city}}]})
                   if self.fake else f"What is the weather in {city}? Use the tool.")
        stream = rng.random() < 0.5
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                "tools": [WEATHER_TOOL], "max_tokens": 64, "stream": stream}
        return self.base("tools", rng, tenant, "/v1/chat/completions", body, stream="sse" if stream else None)

    def structured(self, rng: random.Random, tenant: str) -> Call:
        content = (json.dumps({"answer": rng.choice(WORDS)}) if self.fake
                   else f"Answer in JSON: what colour is {rng.choice(TOPICS)}?")
        stream = rng.random() < 0.3
        schema = {"name": "answer", "schema": ANSWER_SCHEMA}
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 48,
                "stream": stream, "response_format": {"type": "json_schema", "json_schema": schema}}
        return self.base("structured", rng, tenant, "/v1/chat/completions", body,
                         stream="sse" if stream else None)

    def embeddings(self, rng: random.Random, tenant: str) -> Call:
        texts = [self.words(rng, rng.randint(2, 8)) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:
            return self.base("embeddings", rng, tenant, "/v1/embeddings", {"model": MODEL, "input": texts})
        return self.base("embeddings", rng, tenant, "/api/embed", {"model": MODEL, "input": texts})

    def long_stream(self, rng: random.Random, tenant: str, kind: str = "long_stream", **kw: Any) -> Call:
        return self.chat(rng, tenant, stream=True, long=True, kind=kind, **kw)

    def cancel_mid_stream(self, rng: random.Random, tenant: str) -> Call:
        return self.chat(rng, tenant, stream=True, long=True, kind="cancel_mid_stream", leave="mid_stream")

    def cancel_early(self, rng: random.Random, tenant: str) -> Call:
        """Leaves as soon as the response head (with the job id) arrives: mostly while queued."""
        return self.chat(rng, tenant, stream=True, long=True, kind="cancel_early", leave="after_headers")

    def client_timeout(self, rng: random.Random, tenant: str) -> Call:
        return self.chat(rng, tenant, long=True, kind="client_timeout", client_timeout=rng.uniform(0.5, 2.0))

    def gateway_timeout(self, rng: random.Random, tenant: str, seconds: float) -> Call:
        """A job longer than the short-timeout gateway waits: its 504 (or error event) is the answer."""
        if self.fake:
            n = int(seconds / 0.05) + 60
            content = self.words(rng, n)
            body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                    "max_tokens": n}
        else:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a very long story."}],
                    "max_tokens": 500}
        stream = rng.random() < 0.5
        if stream:
            body["stream"] = True
        return self.base("gateway_timeout", rng, tenant, "/v1/chat/completions", body,
                         stream="sse" if stream else None)

    def turn(self, rng: random.Random, tenant: str, history: list[dict[str, str]]) -> Call:
        prompt, n = self.prompt(rng)
        body = {"model": MODEL, "messages": [*history, {"role": "user", "content": prompt}], "max_tokens": n}
        return self.base("multiturn", rng, tenant, "/v1/chat/completions", body)

    def batch_lines(self, rng: random.Random, n: int) -> bytes:
        rows = []
        for i in range(n):
            prompt, tokens = self.prompt(rng)
            rows.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                  "max_tokens": tokens}})
        return "".join(json.dumps(r) + "\n" for r in rows).encode()

    # -- bad input: always a 4xx -----------------------------------------------------------------------

    def bad_input(self, rng: random.Random, tenant: str) -> Call:
        name, build = rng.choice(list(self.bad_cases().items()))
        call = build(rng, tenant)
        call.kind = "bad_input"
        call.expect_refusal = True
        call.headers["X-Soak-Case"] = name
        return call

    def bad_cases(self) -> dict[str, Callable[[random.Random, str], Call]]:
        msgs = [{"role": "user", "content": "hi"}]

        def chat(body: dict[str, Any], **kw: Any) -> Callable[[random.Random, str], Call]:
            return lambda rng, t: Call("bad_input", t, tenant_key(t), "/v1/chat/completions", body, **kw)

        return {
            "no model": chat({"messages": msgs}),
            "max_tokens too large": chat({"model": MODEL, "messages": msgs, "max_tokens": 10**6}),
            "temperature not a number": chat({"model": MODEL, "messages": msgs, "temperature": "hot"}),
            "messages not a list": chat({"model": MODEL, "messages": "hi"}),
            "unknown model": chat({"model": "no-such-model", "messages": msgs}),
            "n too large": chat({"model": MODEL, "messages": msgs, "n": 100}),
            "bad priority": chat({"model": MODEL, "messages": msgs}, headers={"X-Fleet-Priority": "urgent"}),
            "schema too large": chat({"model": MODEL, "messages": msgs, "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": 20000}}}}),
            "model outside the trial allow-list": lambda rng, t: Call(
                "bad_input", "trial", tenant_key("trial"), "/v1/chat/completions",
                {"model": OTHER_MODEL, "messages": msgs}),
            "wrong key": lambda rng, t: Call("bad_input", t, "not-a-key", "/v1/chat/completions",
                                             {"model": MODEL, "messages": msgs}),
            "embeddings of token arrays": lambda rng, t: Call(
                "bad_input", t, tenant_key(t), "/v1/embeddings", {"model": MODEL, "input": [[1, 2, 3]]}),
            "embeddings of numbers": lambda rng, t: Call(
                "bad_input", t, tenant_key(t), "/v1/embeddings", {"model": MODEL, "input": [1, 2]}),
            "embeddings of an object": lambda rng, t: Call(
                "bad_input", t, tenant_key(t), "/api/embed", {"model": MODEL, "input": [{"image": "x"}]}),
            "batch of an unknown file": lambda rng, t: Call(
                "bad_input", t, tenant_key(t), "/v1/batches",
                {"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/chat/completions",
                 "completion_window": "24h"}),
            "ollama chat without messages": lambda rng, t: Call(
                "bad_input", t, tenant_key(t), "/api/chat", {"model": MODEL, "messages": 7}),
        }

    def hostile_input(self, tenant: str, case: int) -> Call:
        """The `case`-th (cyclically) hostile input: work that once held a worker's loop or a
        model's lock for minutes, each now a 4xx at once."""
        name, build = list(self.hostile_cases().items())[case % len(self.hostile_cases())]
        call = build(tenant)
        call.kind = "hostile_input"
        call.expect_refusal = True
        call.headers["X-Soak-Case"] = name
        return call

    def hostile_cases(self) -> dict[str, Callable[[str], Call]]:
        def chat(model: str, messages: list[dict[str, str]]) -> Callable[[str], Call]:
            return lambda t: Call("hostile_input", t, tenant_key(t), "/v1/chat/completions",
                                  {"model": model, "messages": messages, "max_tokens": 8})

        # 900k characters (under the producer's limit, far over a worker's prompt limit): refused
        # like a prompt, never tokenized on a loop (the fake engine refuses text jobs outright)
        cases = {"tokenize past the prompt limit": lambda t: Call(
            "hostile_input", t, tenant_key(t), "/tokenize", {"model": MODEL, "content": "word " * 180_000})}
        if not self.fake:  # chat templates and model files are the real engine's
            turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "and now?"}]
            cases["a chat template that runs away"] = chat(HOSTILE_MODEL, turns)
            cases["a model file cut short"] = chat(BROKEN_MODEL, [{"role": "user", "content": "hi"}])
        return cases
