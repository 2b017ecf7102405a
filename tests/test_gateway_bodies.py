"""The gateway's streamed text events (pure): the fast path writes the very bytes of the dict path."""

from __future__ import annotations

import json

import pytest

from dispatcher.gateway.openai_bodies import Reply, sse_data

TEXTS = ["Hello", " world", "", 'quote " and \\ backslash', "naïve café ✓ 日本語", "\n\ttab", "\u0000 nul"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_text_chunk_is_the_chunk_dict_serialised(chat: bool, include_usage: bool) -> None:
    reply = Reply(chat, "llm", ["job-a", "job-b"], include_usage, created=1700000000)
    for index in (0, 1):
        for text in TEXTS:
            choice = reply._choice(index, text, None, None, chunk=True)
            usage = {"usage": None} if include_usage else {}
            expected = sse_data({**reply._envelope(chunk=True), "choices": [choice], **usage})
            if text or not chat:  # (chat never sends an empty content delta: see Reply.sse)
                assert reply.text_chunk(index, text) == expected
                body = json.loads(expected[len("data: "):])
                got = body["choices"][0]["delta"]["content"] if chat else body["choices"][0]["text"]
                assert got == text and body["choices"][0]["index"] == index
