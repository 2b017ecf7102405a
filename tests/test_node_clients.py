"""Node clients, unchanged, against the shared real fleet (`fleet serve`, a worker, the real model): the
`openai` npm client (chat, streamed and not) and the Vercel AI SDK (`ai` with
`@ai-sdk/openai-compatible`: generateText, streamText; with `@ai-sdk/anthropic` on the Messages
API: the same, and its tool loop), and tool calls from each.
tests/node/clients.mjs runs one function per case; scripts/setup installs its packages (npm ci
from tests/node/package-lock.json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest

from tests.harness import ROOT
from tests.real_fleet import RealFleet

pytestmark = [pytest.mark.timeout(300), pytest.mark.model]
NODE_DIR = ROOT / "tests" / "node"
CASES = ("openai-chat", "openai-chat-stream", "ai-generate", "ai-stream", "openai-tool", "ai-tool",
         "anthropic-generate", "anthropic-stream", "anthropic-tool")


def run_node(base_url: str, *cases: str) -> dict[str, dict[str, Any]]:
    """Run the cases of tests/node/clients.mjs; what each saw, by case name."""
    node = shutil.which("node")
    assert node, "node is not installed (scripts/setup installs it)"
    assert (NODE_DIR / "node_modules" / "ai").is_dir(), "no Node clients in tests/node: run scripts/setup"
    done = subprocess.run([node, str(NODE_DIR / "clients.mjs"), *cases], cwd=NODE_DIR, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "FLEET_BASE_URL": base_url})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {s.pop("case"): s for s in seen}


@pytest.fixture(scope="module")
def node_seen(shared_real_fleet: RealFleet) -> dict[str, dict[str, Any]]:
    """Every case, run by one Node process on the shared fleet (a Node start per test cost more
    than the cases); each test reads its own."""
    return run_node(shared_real_fleet.url, *CASES)


def test_openai_npm_client_and_vercel_ai_sdk(real_fleet, node_seen) -> None:
    seen = {name: case for name, case in node_seen.items() if name in CASES[:4]}
    assert set(seen) == {"openai-chat", "openai-chat-stream", "ai-generate", "ai-stream"}
    whole = seen["openai-chat"]
    assert whole["text"] and whole["finish"] == "length" and whole["tokens"] == 8
    assert whole["requestId"].startswith("req_")  # the npm client records x-request-id too
    # greedy: every client gets the same text, streamed or not
    for name in ("openai-chat-stream", "ai-generate", "ai-stream"):
        assert seen[name]["text"] == whole["text"], (name, seen[name])
        assert seen[name]["tokens"] == 8, (name, seen[name])
    assert seen["openai-chat-stream"]["finish"] == "length" and seen["openai-chat-stream"]["chunks"] > 2
    assert seen["ai-generate"]["finish"] == "length" and seen["ai-stream"]["finish"] == "length"
    assert seen["ai-stream"]["parts"] > 1  # it streamed


def test_tool_calls_from_node(real_fleet, node_seen) -> None:
    """The openai npm client's tool call (tool_choice required) and the Vercel AI SDK's
    generateText with a tool: the SDK runs the tool and sends its result back for the answer."""
    seen = node_seen
    call = seen["openai-tool"]
    assert call["name"] == "get_weather" and call["finish"] == "tool_calls" and call["id"]
    assert call["args"]["unit"] in ("celsius", "fahrenheit")
    ai = seen["ai-tool"]
    assert ai["calls"] >= 1 and ai["steps"] == 2, ai  # a call, then an answer with its result
    assert isinstance(ai["firstCall"]["city"], str)


def test_vercel_ai_sdk_anthropic_provider_on_the_messages_api(real_fleet, node_seen) -> None:
    """`createAnthropic({baseURL: <gateway>/v1})`: generateText and streamText give the text the
    openai client gets (greedy, the same job), ending at max_tokens; its tool loop (a zod schema,
    toolChoice required) calls the tool, sends the tool_result back and gets an answer."""
    seen = node_seen
    text = seen["openai-chat"]["text"]
    for name in ("anthropic-generate", "anthropic-stream"):
        assert seen[name]["text"] == text and seen[name]["finish"] == "length", (name, seen[name])
        assert seen[name]["tokens"] == 8, (name, seen[name])
    assert seen["anthropic-stream"]["parts"] > 1  # it streamed
    loop = seen["anthropic-tool"]
    assert loop["calls"] >= 1 and loop["steps"] == 2 and loop["firstFinish"] == "tool-calls", loop
    first = loop["firstCall"]
    assert isinstance(first["city"], str) and first["unit"] in ("celsius", "fahrenheit")
    assert all(i.startswith("toolu_") for i in loop["callIds"]) and loop["finish"] in ("stop", "length")
