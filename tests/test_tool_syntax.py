"""The models' own tool-call syntaxes (backends/chat/tool_syntax.py), their thoughts
(backends/chat/reasoning.py) and the answer JSON the worker re-writes them as
(backends/chat/answer_json.py, read back by backends/contract/tools.AnswerReader): which template
speaks which syntax; each family's calls, words and thoughts read the same whatever the split of
the stream; text that is no call, or a call cut short, is words; and any answer survives the
trip writer -> wire -> reader, split anywhere. Pure Python: no model."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.chat.answer_json import AnswerJsonWriter, Piece
from backends.chat.reasoning import HarmonySplitter, Segment, ThoughtSplitter
from backends.chat.tool_syntax import (
    DEEPSEEK_R1,
    DS_BEGIN,
    DS_CALL,
    DS_CALL_END,
    DS_END,
    DS_SEP,
    GPT_OSS,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS,
    SYNTAXES,
    NativeAnswerParser,
    ToolSyntax,
    detect,
)
from backends.contract import tools
from backends.contract.tools import AnswerReader, arguments_text, call_id

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
WEATHER: tuple[str, dict[str, Any]] = ("get_weather", {"city": "Paris", "days": 3,
                                                       "units": {"t": "°C", "q": "a \"b\" }{ ] \\ c"}})
TIME: tuple[str, dict[str, Any]] = ("get.time", {})


# -- which syntax ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("fixture", "family"), [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral-args"),
    ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral-args"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1"),
    ("openai-gpt-oss-120b.jinja", "gpt-oss"),
    ("google-gemma-2-2b-it.jinja", None),
])
def test_each_public_template_speaks_its_family(fixture: str, family: str | None) -> None:
    found = detect((TEMPLATES / fixture).read_text())
    assert (found.name if found else None) == family


def test_templates_without_a_syntax_read_here_keep_the_generic_format() -> None:
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    qwen3_coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>"
    functionary = "<|start_header_id|>assistant<|end_header_id|>\n<function={{ name }}>{{ args }}</function>"
    assert detect(chatml) is None and detect(qwen3_coder) is None and detect(functionary) is None
    assert detect("{{ '<tool_call>' }}") is HERMES and detect("[TOOL_CALLS][") is MISTRAL
    assert detect("'<|start_header_id|>ipython<|end_header_id|>'") is LLAMA3


# -- each family's text ---------------------------------------------------------------------------

def hermes(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def deepseek(calls: list[tuple[str, Any]]) -> str:
    body = "\n".join(f"{DS_CALL}function{DS_SEP}{n}\n```json\n{json.dumps(a)}\n```{DS_CALL_END}"
                     for n, a in calls)
    return f"{DS_BEGIN}{body}{DS_END}"


CASES: list[tuple[ToolSyntax, str, str, str, list[tuple[str, Any]]]] = [
    # syntax, text, reasoning, content, calls
    (HERMES, f"Let me look.\n{hermes(*WEATHER)}\n{hermes(*TIME)}", "", "Let me look.", [WEATHER, TIME]),
    (HERMES, f"<think>\nParis, so weather.\n</think>\n\n{hermes(*WEATHER)}", "\nParis, so weather.\n", "",
     [WEATHER]),
    (HERMES, f"{hermes(*WEATHER)}\nI asked for the weather.", "", "I asked for the weather.", [WEATHER]),
    (LLAMA3, json.dumps({"name": WEATHER[0], "parameters": WEATHER[1]}), "", "", [WEATHER]),
    (LLAMA3, ' {"type": "function", "name": "get.time", "parameters": {}}', "", "", [TIME]),
    (LLAMA3, 'On it.<|python_tag|>{"name": "get.time", "arguments": {}}', "", "On it.", [TIME]),
    (MISTRAL, "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a, "id": "abcDEF123"})
                                          for n, a in (WEATHER, TIME)) + "]", "", "", [WEATHER, TIME]),
    (MISTRAL_ARGS, f"Sure.[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER[1])}[TOOL_CALLS]get.time[CALL_ID]"
                   "a1b2c3d4e[ARGS]{}", "", "Sure.", [WEATHER, TIME]),
    (MISTRAL_ARGS, "[THINK]hm[/THINK]Done, no call.", "hm", "Done, no call.", []),
    (DEEPSEEK_R1, "<think>\nweather\n</think>\n\n" + deepseek([WEATHER, TIME]), "\nweather\n", "",
     [WEATHER, TIME]),
    (DEEPSEEK_R1, "Looking. " + deepseek([TIME]) + "\nDone.", "", "Looking.Done.", [TIME]),
    (GPT_OSS, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              f"to=functions.get_weather <|constrain|>json<|message|>{json.dumps(WEATHER[1])}<|call|>",
     "Need the weather.", "", [WEATHER]),
    (GPT_OSS, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>commentary<|message|>"
              "Checking.<|end|><|start|>assistant to=functions.get.time<|channel|>commentary json"
              "<|message|>{}",
     "Easy.", "Checking.", [TIME]),
    (GPT_OSS, "<|channel|>analysis<|message|>Plain.<|end|><|start|>assistant<|channel|>final"
              "<|message|>Hello!",
     "Plain.", "Hello!", []),
    (GPT_OSS, ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}',
     "", "", [("get_weather", {"city": "Paris"})]),
]


def parse(syntax: ToolSyntax | None, deltas: list[str], fmt: str = "deepseek", inside: bool = False,
          job: str = "job") -> tuple[Piece, NativeAnswerParser]:
    parser = NativeAnswerParser(syntax, fmt, job, inside)
    total = Piece()
    for d in deltas:
        total.extend(parser.feed(d))
    total.extend(parser.finish())
    return total, parser


def expected_calls(calls: list[tuple[str, Any]], job: str = "job") -> list[dict[str, str]]:
    return [{"id": call_id(job, i), "name": n, "arguments": arguments_text(a)}
            for i, (n, a) in enumerate(calls)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].name)
def test_each_family_reads_the_same_whatever_the_split(case: tuple[Any, ...]) -> None:
    syntax, text, reasoning, content, calls = case
    whole, _ = parse(syntax, [text])
    assert (whole.reasoning, whole.content, whole.calls) == (reasoning, content, expected_calls(calls))
    assert [c["name"] for c in whole.calls] == [n for n, _ in calls]
    assert [json.loads(c["arguments"]) for c in whole.calls] == [a for _, a in calls]
    assert parse(syntax, list(text))[0].parts == whole.parts  # one character at a time
    for at in range(1, len(text)):  # and split in two at every character
        assert parse(syntax, [text[:at], text[at:]])[0].parts == whole.parts, at
    chunks, rng = [], random.Random(len(text))
    i = 0
    while i < len(text):
        n = rng.randint(1, 9)
        chunks.append(text[i:i + n])
        i += n
    assert parse(syntax, chunks)[0].parts == whole.parts


@pytest.mark.parametrize("case", [c for c in CASES if not c[2]], ids=lambda c: c[0].name)
def test_a_call_cut_short_is_words(case: tuple[Any, ...]) -> None:
    """max_tokens cuts anywhere: never an error; a call whose arguments closed is given, one
    cut before is words (text after a call may be dropped markup), nothing is invented."""
    syntax, text, _, _, calls = case
    for at in range(len(text) + 1):
        piece, _ = parse(syntax, [text[:at]])
        got = [(c["name"], json.loads(c["arguments"])) for c in piece.calls]
        assert got == calls[:len(got)], at
        if not got:
            said = piece.content.replace(" ", "").replace("\n", "")
            assert said == text[:at].replace(" ", "").replace("\n", "") or syntax is GPT_OSS, at


def test_text_that_is_no_call_stays_words() -> None:
    for syntax, text in [
        (HERMES, "Use <tool_call>like this</tool_call> tags."),
        (HERMES, 'Broken <tool_call>\n{"name": "x", "arguments": {"a": 1}\n</tool_call> end'),
        (HERMES, '<tool_call>\n{"nom": "x", "arguments": {}}\n</tool_call>'),
        (HERMES, '<tool_call>\n{"name": "two words", "arguments": {}}\n</tool_call>'),
        (LLAMA3, '{"answer": 42} is plain JSON'),
        (LLAMA3, 'Text first {"name": "get.time", "parameters": {}}'),
        (MISTRAL_ARGS, "[TOOL_CALLS]no args here"),
        (DEEPSEEK_R1, f"{DS_BEGIN}nonsense"),
        (GPT_OSS, "just words, no channel"),
    ]:
        piece, parser = parse(syntax, list(text))
        assert piece.calls == [] and parser.calls == [], text
        assert piece.content == text, text
    # the markup of a broken call is words; the call before it stands
    piece, _ = parse(HERMES, [hermes(*TIME) + "\n<tool_call>\n{oops}\n</tool_call>"])
    assert [c["name"] for c in piece.calls] == ["get.time"]
    assert piece.content == "<tool_call>\n{oops}\n</tool_call>"


def test_a_repeated_call_is_read_once_and_ids_count_the_calls_kept() -> None:
    text = hermes(*TIME) + hermes("get_weather", {"city": "Oslo"}) + hermes(*TIME) + hermes(*WEATHER)
    piece, parser = parse(HERMES, list(text), job="j7")
    assert [c["name"] for c in piece.calls] == ["get.time", "get_weather", "get_weather"] and parser.repeated
    ids = [call_id("j7", i) for i in range(3)]
    assert [c["id"] for c in piece.calls] == ids == [c["id"] for c in parser.calls]
    # arguments sent as JSON text (a model taught so) are its JSON
    nemo = '[TOOL_CALLS][{"name": "get.time", "arguments": "{\\"zone\\": \\"UTC\\"}", "id": "123456789"}]'
    assert json.loads(parse(MISTRAL, [nemo])[0].calls[0]["arguments"]) == {"zone": "UTC"}


def test_without_a_syntax_only_thoughts_are_read() -> None:
    text = "<think>a</think>" + hermes(*TIME)
    piece, _ = parse(None, list(text))
    assert piece.reasoning == "a" and piece.content == hermes(*TIME) and piece.calls == []
    harmony = NativeAnswerParser(GPT_OSS, "auto", "j", read_calls=False)
    got = harmony.feed(next(c[1] for c in CASES if c[0] is GPT_OSS and c[4]))
    got.extend(harmony.finish())
    assert got.reasoning == "Need the weather." and got.calls == [] and got.content == ""


def test_the_parser_keeps_no_growing_buffer() -> None:
    """Each delta is read once: what waits between deltas is a partial marker, never the text
    so far (a rescan per token would be quadratic in the answer)."""
    for syntax in SYNTAXES.values():
        text = "<think>" + "reason " * 3000 + "</think>" + "word " * 3000 + hermes(*WEATHER)
        parser = NativeAnswerParser(syntax, "deepseek", "j")
        longest = 0
        for ch in text:
            parser.feed(ch)
            split = parser._split
            held = split._held + getattr(split, "_head", "")
            reader = parser._reader
            longest = max(longest, len(held), len(reader._text) if reader else 0)
        assert longest <= 16, (syntax.name, longest)


# -- thoughts -------------------------------------------------------------------------------------

def split_thoughts(splitter: ThoughtSplitter | HarmonySplitter, text: str) -> tuple[str, str, str]:
    segments: list[Segment] = []
    for ch in text:
        segments += splitter.feed(ch)
    segments += splitter.finish()
    joined = {k: "".join(s.text for s in segments if s.kind == k) for k in ("reasoning", "content", "text")}
    return joined["reasoning"], joined["content"], joined["text"]


@pytest.mark.parametrize(("fmt", "inside", "text", "want"), [
    ("deepseek", False, "  <think>plan</think>\n\nAnswer.", ("plan", "", "Answer.")),
    ("auto", False, "<think>plan</think>Answer.", ("plan", "", "Answer.")),
    ("none", False, "  <think>plan</think>\n\nAnswer.", ("", "  <think>plan</think>", "\n\nAnswer.")),
    ("deepseek-legacy", False, "<think>plan</think>\nAnswer.", ("plan", "<think>plan</think>", "Answer.")),
    ("deepseek", True, "plan</think> Answer.", ("plan", "", "Answer.")),
    ("none", True, "plan</think> Answer.", ("", "plan</think>", " Answer.")),
    ("deepseek-legacy", True, "plan</think>Answer.", ("plan", "<think>plan</think>", "Answer.")),
    ("deepseek", True, "cut short inside the </thi", ("cut short inside the </thi", "", "")),
    ("deepseek", False, "Words. <think>later</think>", ("", "", "Words. <think>later</think>")),
    ("deepseek", False, "<thinking aloud", ("", "", "<thinking aloud")),
    ("deepseek", False, "   ", ("", "", "   ")),
])
def test_thoughts_split_as_llama_server_reasoning_formats_say(fmt: str, inside: bool, text: str,
                                                              want: tuple[str, str, str]) -> None:
    assert split_thoughts(ThoughtSplitter(fmt, starts_inside=inside), text) == want


def test_harmony_channels_are_thoughts_words_and_calls() -> None:
    text = ("<|channel|>analysis<|message|>think<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hi<|return|>")
    assert split_thoughts(HarmonySplitter("deepseek"), text) == ("think", "Hi", "")
    assert split_thoughts(HarmonySplitter("none"), text) == (
        "", "<|channel|>analysis<|message|>think<|end|>Hi", "")
    assert split_thoughts(HarmonySplitter("deepseek-legacy"), text)[:2] == (
        "think", "<|channel|>analysis<|message|>think<|end|>Hi")
    splitter, segments = HarmonySplitter("auto"), []
    for ch in "<|start|>assistant to=browser.search<|channel|>commentary<|message|>{}<|call|>":
        segments += splitter.feed(ch)
    assert segments + splitter.finish() == []  # a built-in tool's call: nobody offered it
    with pytest.raises(ValueError, match="reasoning_format"):
        ThoughtSplitter("sometimes")


# -- the wire -------------------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=10)
NAMES = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)
LEAF = st.none() | st.booleans() | st.integers(-10**12, 10**12) | TEXT
JSON = st.recursive(LEAF, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3),
                    max_leaves=6)
ARGS = st.dictionaries(TEXT, JSON, max_size=4)
PART = st.one_of(st.tuples(st.just("reasoning"), TEXT), st.tuples(st.just("content"), TEXT),
                 st.tuples(st.just("call"), st.tuples(NAMES, ARGS)))


def pieces_of(drawn: list[list[tuple[str, Any]]]) -> tuple[list[Piece], list[dict[str, str]]]:
    """Pieces as the parser gives them: each call with its index and id (distinct calls: the
    reader drops a repeat)."""
    pieces: list[Piece] = []
    calls: list[dict[str, str]] = []
    for parts in drawn:
        piece = Piece()
        for kind, value in parts:
            if kind == "call":
                name, args = value
                args = {**args, "#": len(calls)}
                value = {"id": call_id("job", len(calls)), "name": name, "arguments": arguments_text(args)}
                calls.append(value)
            piece.add(kind, value)
        pieces.append(piece)
    return pieces, calls


def read(wire: list[str]) -> tuple[str, str, list[dict[str, str]]]:
    reader, words, thoughts = AnswerReader("job"), "", ""
    calls: list[dict[str, str]] = []
    for delta in wire:
        w, c = reader.feed(delta)
        words, calls, thoughts = words + w, calls + c, thoughts + reader.take_reasoning()
    assert thoughts == reader.reasoning and words == reader.content
    return thoughts, words, calls


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(PART, max_size=4), max_size=4))
def test_any_answer_survives_writer_wire_reader_split_anywhere(drawn: list[list[tuple[str, Any]]]) -> None:
    pieces, calls = pieces_of(drawn)
    writer = AnswerJsonWriter()
    deltas = [writer.feed(p) for p in pieces] + [writer.close()]
    wire = "".join(deltas)
    want = ("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces), calls)
    assert read(deltas) == want
    assert read(list(wire)) == want
    for at in range(len(wire) + 1):
        assert read([wire[:at], wire[at:]]) == want, at
    answer = tools.read_answer(wire, "job")
    assert (answer.reasoning, answer.content, answer.tool_calls) == (
        want[0], want[1] if not calls or want[1] else None, calls)


def test_a_native_answer_reaches_the_gateway_as_it_was_read() -> None:
    for syntax, text, reasoning, content, calls in CASES:
        parser, writer, wire = NativeAnswerParser(syntax, "auto", "job"), AnswerJsonWriter(), []
        for ch in text:
            wire.append(writer.feed(parser.feed(ch)))
        wire += [writer.feed(parser.finish()), writer.close()]
        assert read(wire) == (reasoning, content, expected_calls(calls)), syntax.name
    assert AnswerJsonWriter().close() == '{"response": ""}'
    writer = AnswerJsonWriter()
    text = writer.feed(Piece([("content", "a"), ("call", {"name": "f", "arguments": "{}"}),
                              ("content", "b")]))
    text += writer.close()
    assert text == '{"response": "a", "tool_calls": [{"name": "f", "arguments": {}}], "response": "b"}'


def test_the_reader_still_reads_generic_answers_and_stops_at_a_stray_key() -> None:
    answer = tools.read_answer('{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}', "j")
    assert answer.content is None and answer.reasoning == ""
    assert answer.tool_calls[0]["arguments"] == '{"a": 1}'
    assert tools.read_answer('{"response": "hi"}', "j") == tools.Answer("hi", [], "")
    reader = AnswerReader("j")
    assert reader.feed('{"reasoning": ["no"], "response": "x"}') == ("", []) and reader.take_reasoning() == ""
