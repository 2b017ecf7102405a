"""Text jobs in the worker without servers: the text thread answers them while the loop goes on
(a text_op that blocks never blocks `step`), a cancel ends one at once while its slot stays held
until the thread lets it go, a catalogue model is not unloaded under a running one, and the
characters a request carries count every text field (the pre-check's one count). The real
processes: tests/test_text_work_bounds.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from backends.base import Backend, Done, Failed
from backends.contract.catalogue import ModelEntry
from backends.contract.schema import GenerateRequest
from backends.contract.settings import EngineSettings
from backends.contract.text_ops import ENCODE_CHUNK, TextRequest, encode_answer
from backends.fake import FakeBackend, FakeSettings
from backends.shelf import ModelShelf, ModelView
from worker.serving import limits
from worker.serving.text_jobs import TextJobs

pytestmark = pytest.mark.timeout(60)
TOKENIZE = TextRequest(kind="text", op="tokenize", content="a b c")


class SlowTokenizer(FakeBackend):
    """Tokenizes one token per word, once `go` is set (`entered`: a text_op is under way)."""

    def __init__(self, settings: FakeSettings | None = None) -> None:
        super().__init__(settings)
        self.go, self.entered = threading.Event(), threading.Event()

    def text_op(self, request: TextRequest) -> dict[str, object]:
        self.entered.set()
        assert self.go.wait(30)
        return {"tokens": list(range(len((request.content or "").split())))}


def make_slow(settings: EngineSettings) -> Backend:
    assert isinstance(settings, FakeSettings)
    return SlowTokenizer(settings)


def wait_for_event(texts: TextJobs) -> list[Any]:
    deadline = time.monotonic() + 10
    while not (events := texts.step(0.05)):
        assert time.monotonic() < deadline
    return events


def test_a_running_text_job_never_blocks_the_loop_and_counts_its_tokens() -> None:
    engine, texts = SlowTokenizer(), TextJobs()
    try:
        texts.add("j1", TOKENIZE, engine)
        started = time.monotonic()
        assert texts.step() == [] and texts.step(0.05) == []  # the text_op is blocked meanwhile
        assert time.monotonic() - started < 5  # generous: the loop returned, it did not wait
        assert texts.held() == 1  # its slot
        engine.go.set()
        [done] = wait_for_event(texts)
        assert isinstance(done, Done) and done.job_id == "j1" and done.prompt_tokens == 3
        assert json.loads(str(done.extra["answer"])) == {"tokens": [0, 1, 2]}  # encoded on the thread
        assert texts.held() == 0
    finally:
        engine.go.set()
        texts.close()


def test_a_cancelled_text_job_ends_at_once_and_holds_its_slot_until_the_thread_lets_go() -> None:
    engine, texts = SlowTokenizer(), TextJobs()
    try:
        texts.add("running", TOKENIZE, engine)
        texts.add("waiting", TOKENIZE, engine)  # behind it on the one thread
        assert engine.entered.wait(10)  # the running one is on its thread
        assert texts.cancel("running") and texts.cancel("waiting") and not texts.cancel("other")
        ended = texts.step()
        assert all(isinstance(e, Done) and e.finish_reason == "cancelled" for e in ended)
        assert {e.job_id for e in ended} == {"running", "waiting"}
        assert texts.held() == 1  # the running one's thread is still busy
        engine.go.set()
        deadline = time.monotonic() + 10
        while texts.held():
            assert texts.step(0.05) == [] and time.monotonic() < deadline  # its answer is dropped
    finally:
        engine.go.set()
        texts.close()


def test_an_engine_without_a_tokenizer_fails_the_job_as_a_rejection() -> None:
    texts = TextJobs()
    try:
        texts.add("j", TOKENIZE, FakeBackend())
        [failed] = wait_for_event(texts)
        assert isinstance(failed, Failed) and "does not tokenize" in failed.error and not failed.retryable
    finally:
        texts.close()


def test_a_catalogue_model_stays_loaded_while_a_text_job_reads_it(tmp_path: Path) -> None:
    entry = ModelEntry(path=tmp_path / "m.gguf", memory_mb=10, keep_alive=0)
    shelf = ModelShelf({"m": entry}, {"m": "m"}, FakeSettings(), make_slow, budget_mb=100)
    view, texts = shelf.engine_for("m:default"), TextJobs()
    assert isinstance(view, ModelView) and isinstance(view.engine, SlowTokenizer)
    try:
        texts.add("j", TOKENIZE, view)
        assert shelf.unload_idle(time.monotonic() + 3600) == []  # idle past keep_alive, but in use
        view.engine.go.set()
        [done] = wait_for_event(texts)
        assert isinstance(done, Done)
        assert shelf.unload_idle(time.monotonic() + 3600) == ["m"]
    finally:
        view.engine.go.set()
        texts.close()


def test_the_characters_a_request_carries_count_every_text_field() -> None:
    """Each field holds 1,000 characters of its own (or as many as it may); the count sees every
    one (the pre-check counted message content only)."""
    n = 1000
    tool = {"name": "f", "description": "d" * n, "parameters": {"type": "object", "properties": {}}}
    call = {"id": "i" * 256, "name": "c" * 256, "arguments": json.dumps({"a": "x" * n})}
    fields: dict[str, dict[str, Any]] = {
        "content": {"messages": [{"role": "user", "content": "u" * n}]},
        "system": {"messages": [{"role": "system", "content": "s" * n}, {"role": "user", "content": "hi"}]},
        "reasoning_content": {"messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": "", "reasoning_content": "r" * n}]},
        "tool call id, name, arguments": {"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "tool_calls": [call]}]},
        "tool result's id and name": {"messages": [{"role": "user", "content": "hi"}, {
            "role": "tool", "tool_call_id": "t" * 256, "name": "n" * 256}]},
        "tools": {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]},
    }
    for what, body in fields.items():
        request = GenerateRequest.model_validate(body)
        assert request.chars() >= 512, (what, request.chars())
        assert limits.request_chars(request) == request.chars(), what
    # the template's settings take at most 256 characters of text (schema.TEMPLATE_SETTINGS):
    # counted too, key and value
    settings = {"model_identity": "v" * 256, "reasoning_effort": "high"}
    with_settings = GenerateRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                    "chat_template_kwargs": settings})
    assert with_settings.chars() == len("hi") + sum(len(k) + len(v) for k, v in settings.items())
    assert limits.request_chars(with_settings) == with_settings.chars()
    assert GenerateRequest(prompt="p" * n).chars() == n
    call_chars = 2 * 256 + len(call["arguments"])
    with_call = GenerateRequest.model_validate(fields["tool call id, name, arguments"])
    assert with_call.chars() == len("hi") + call_chars
    # text jobs: the text to tokenize, the chat to render, nothing for ids
    assert limits.request_chars(TextRequest(kind="text", op="tokenize", content="t" * n)) == n
    chat = GenerateRequest.model_validate(fields["reasoning_content"])
    assert limits.request_chars(TextRequest(kind="text", op="apply_template", chat=chat)) == chat.chars()
    assert limits.request_chars(TextRequest(kind="text", op="detokenize", tokens=[1, 2, 3])) == 0


@pytest.mark.parametrize("answer", [
    {"tokens": list(range(20_000))},
    {"tokens": [{"id": i, "piece": "ü\n\"" if i % 3 else [240, 159]} for i in range(ENCODE_CHUNK * 2 + 1)]},
    {"tokens": list(range(ENCODE_CHUNK))}, {"tokens": []}, {"content": "日本語 \"quoted\"\n"},
    {"prompt": "<start_of_turn>user\nhi"},
])
def test_an_answer_encoded_in_chunks_is_what_json_writes(answer: dict[str, Any]) -> None:
    assert encode_answer(answer) == json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
