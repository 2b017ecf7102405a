"""The grammars of the models' own tool calls (backends/llamacpp/tool_grammar.py) in real
llama.cpp, on the embedded model's vocabulary (loaded vocab-only: no weights): each family's
grammar compiles, as a lazy grammar with its trigger patterns for tool_choice auto; it takes a
valid call's text token by token and lets generation end after it; it refuses a call of a tool
that is not offered, or one missing a required argument; before its trigger a lazy grammar lets
any text through, and a required one lets nothing but a call (or a thought) start; and the
Python watch of a lazy grammar's trigger (backends/llamacpp/lazy_trigger.py) says it fired at the
token where llama.cpp's grammar fires."""

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Iterator
from typing import Any

import llama_cpp as ll
import pytest

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
)
from backends.contract.tool_specs import NamedTool, Tool, ToolChoice
from backends.llamacpp.lazy_trigger import TriggerWatch, mirrors
from backends.llamacpp.model import tokenize
from backends.llamacpp.tool_grammar import NativeGrammar, native_call_grammar, not_containing, prefixed
from backends.model import default_model_path

pytestmark = pytest.mark.timeout(300)

WEATHER = Tool(name="get_weather", description="The weather in a city.", parameters={
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city"]})
TIME = Tool(name="get.time", parameters={"type": "object", "properties": {}})
BOOK = Tool(name="book", parameters={  # pydantic's shape: $defs, a $ref, an enum, bounds
    "$defs": {"Guest": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}},
    "type": "object", "properties": {"guests": {"type": "array", "items": {"$ref": "#/$defs/Guest"},
                                                "minItems": 1},
                                     "room": {"enum": ["single", "double"]}},
    "required": ["guests", "room"]})
TOOLS = [WEATHER, TIME, BOOK]
PARIS = {"city": "Paris", "days": 3}
GUESTS = {"guests": [{"name": "Åsa \"A\"", "age": 30}], "room": "double"}


def call_text(syntax: ToolSyntax, name: str, args: dict[str, Any]) -> str:
    """One call as each family writes it (a model's output, as its template shows calls)."""
    a = json.dumps(args, ensure_ascii=False)
    if syntax is HERMES:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>'
    if syntax is LLAMA3:
        return f'{{"name": "{name}", "parameters": {a}}}'
    if syntax is MISTRAL:
        return f'[TOOL_CALLS][{{"name": "{name}", "arguments": {a}, "id": "abc123XYZ"}}]'
    if syntax is MISTRAL_ARGS:
        return f"[TOOL_CALLS]{name}[ARGS]{a}"
    if syntax is DEEPSEEK_R1:  # spelled as this SentencePiece vocabulary renders U+2581: a space
        text = f"{DS_BEGIN}{DS_CALL}function{DS_SEP}{name}\n```json\n{a}\n```{DS_CALL_END}{DS_END}"
        return text.replace("\u2581", " ")
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{a}"


# free text before a call, where the family allows it (Llama 3's JSON call starts the answer)
BEFORE = {HERMES: "Let me check {this}: ", MISTRAL: 'Free "text" [x] ', MISTRAL_ARGS: "Sure. ",
          DEEPSEEK_R1: "Looking it up. ", LLAMA3: "",
          GPT_OSS: "<|channel|>analysis<|message|>Need {weather}.<|end|><|start|>assistant"}


@pytest.fixture(scope="module")
def vocab() -> Iterator[ll.llama_vocab_p]:
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(default_model_path()).encode(), params)
    assert model
    yield ll.llama_model_get_vocab(model)
    ll.llama_model_free(model)


def compiled(vocab: ll.llama_vocab_p, grammar: NativeGrammar) -> ll.llama_sampler_p:
    if not grammar.lazy:
        sampler = ll.llama_sampler_init_grammar(vocab, grammar.gbnf.encode(), b"root")
    else:
        n = len(grammar.triggers)
        patterns = (ctypes.c_char_p * max(n, 1))(*(p.encode() for p in grammar.triggers))
        sampler = ll.llama_sampler_init_grammar_lazy_patterns(vocab, grammar.gbnf.encode(), b"root",
                                                              patterns, n, None, 0)
    assert sampler, grammar.gbnf
    return sampler


def allowed(sampler: ll.llama_sampler_p, token: int) -> bool:
    one = ll.llama_token_data(token, 1.0, 0.0)
    candidates = ll.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
    ll.llama_sampler_apply(sampler, ctypes.byref(candidates))
    return not math.isinf(one.logit)


def walk(vocab: ll.llama_vocab_p, grammar: NativeGrammar, text: str) -> tuple[str, bool]:
    """Feed `text` token by token as sampling would: each token checked before it is taken.
    The text the grammar took before it refused a token, and whether it lets generation end
    there (the end-of-generation token allowed)."""
    sampler = compiled(vocab, grammar)
    try:
        taken = b""
        for token in tokenize(vocab, text, special=False, add_special=False):
            if not allowed(sampler, token):
                return taken.decode(errors="replace"), False
            ll.llama_sampler_accept(sampler, token)
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(vocab, token, buf, 64, 0, True)
            taken += buf.raw[:n]
        return taken.decode(errors="replace"), allowed(sampler, ll.llama_vocab_eos(vocab))
    finally:
        ll.llama_sampler_free(sampler)


CHOICES: list[ToolChoice] = ["auto", "required", NamedTool(name="get_weather")]


@pytest.mark.parametrize("syntax", list(SYNTAXES.values()), ids=lambda s: s.name)
@pytest.mark.parametrize("choice", CHOICES, ids=str)
def test_a_valid_call_passes_token_by_token(vocab: ll.llama_vocab_p, syntax: ToolSyntax,
                                            choice: ToolChoice) -> None:
    grammar = native_call_grammar(syntax, TOOLS, choice, None)
    assert grammar.lazy == (choice == "auto") and bool(grammar.triggers) == grammar.lazy
    before = BEFORE[syntax] if grammar.lazy or syntax is GPT_OSS else ""
    text = before + call_text(syntax, "get_weather", PARIS)
    assert walk(vocab, grammar, text) == (text, True)
    # what passed is what the parser reads as the call
    parser = NativeAnswerParser(syntax, "deepseek", "j")
    piece = parser.feed(text)
    piece.extend(parser.finish())
    assert [(c["name"], json.loads(c["arguments"])) for c in piece.calls] == [("get_weather", PARIS)]
    if not isinstance(choice, NamedTool):  # another tool, its schema from $defs and a $ref
        text = before + call_text(syntax, "book", GUESTS)
        assert walk(vocab, grammar, text) == (text, True)


@pytest.mark.parametrize("syntax", list(SYNTAXES.values()), ids=lambda s: s.name)
@pytest.mark.parametrize("choice", CHOICES, ids=str)
def test_a_call_the_tools_do_not_allow_is_refused(vocab: ll.llama_vocab_p, syntax: ToolSyntax,
                                                  choice: ToolChoice) -> None:
    """Refused where it goes wrong: the token holding the first character no valid call has
    (`wrong`: the text from there on; a token is at most a few characters here)."""
    grammar = native_call_grammar(syntax, TOOLS, choice, None)
    before = BEFORE[syntax] if grammar.lazy or syntax is GPT_OSS else ""
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("get_wether", PARIS, "ether"),  # no such tool
        ("get_weather_by_city", PARIS, "_by"),  # an offered tool's name is not a prefix of another's
        ("get_weather", {"days": 3}, 'days"'),  # its required argument missing
        ("get_weather", {"city": "Paris", "days": 15}, "5}"),  # out of its bounds
        ("book", {"guests": [{"name": "Bo", "age": 130}], "room": "double"}, "0}"),
    ]
    for name, args, wrong in cases:
        text = before + call_text(syntax, name, args)
        if isinstance(choice, NamedTool) and name == "book":
            wrong = "book"  # only the named tool may be called
        at = text.index(wrong)
        taken, _ = walk(vocab, grammar, text)
        assert text.startswith(taken) and at - 12 < len(taken) <= at, (name, args, taken)


@pytest.mark.parametrize("syntax", list(SYNTAXES.values()), ids=lambda s: s.name)
def test_before_its_trigger_a_lazy_grammar_lets_any_text_through(vocab: ll.llama_vocab_p,
                                                                  syntax: ToolSyntax) -> None:
    grammar = native_call_grammar(syntax, TOOLS, "auto", True)
    prose = ('Any words: {"json": [1, 2]} <b>tags</b> <tool [TOOL calls "quotes" café 😀 '
             "\\ backslash ``` fences\n\nnew lines, and an end")
    if syntax is LLAMA3:
        prose = "Not JSON first. " + prose  # its bare call only starts an answer
    assert walk(vocab, grammar, prose) == (prose, True)
    # after all that, a call still starts the grammar, and it is held to the tools
    later = prose + " " + (BEFORE[syntax] or "<|python_tag|>") + call_text(syntax, "get_weather", PARIS)
    assert walk(vocab, grammar, later) == (later, True)
    bad = prose + " " + (BEFORE[syntax] or "<|python_tag|>") + call_text(syntax, "get_weather", {"days": 3})
    assert walk(vocab, grammar, bad)[0] != bad


@pytest.mark.parametrize("syntax", [s for s in SYNTAXES.values() if s is not GPT_OSS], ids=lambda s: s.name)
def test_a_required_call_starts_the_answer_after_an_optional_thought(vocab: ll.llama_vocab_p,
                                                                      syntax: ToolSyntax) -> None:
    grammar = native_call_grammar(syntax, TOOLS, "required", None)
    call = call_text(syntax, "get.time", {})
    assert walk(vocab, grammar, "Hello " + call)[0] == ""
    assert walk(vocab, grammar, call[: len(call) // 2]) == (call[: len(call) // 2], False)  # not yet whole
    assert syntax.thought is not None
    opening, close = syntax.thought
    thought = f"{opening}The user wants the time; < and </ and [/ are fine.{close}\n"
    assert walk(vocab, grammar, thought + call) == (thought + call, True)
    # the prompt opened the thought: free until it ends, then the call at once
    grammar = native_call_grammar(syntax, TOOLS, "required", None, thought_open=True)
    assert grammar.lazy and walk(vocab, grammar, "Still thinking {a} b" + close + "\n" + call) == (
        "Still thinking {a} b" + close + "\n" + call, True)
    assert walk(vocab, grammar, "Done." + close + "\nHello")[0] == "Done." + close + "\n"


def test_gpt_oss_required_lets_analysis_come_first(vocab: ll.llama_vocab_p) -> None:
    grammar = native_call_grammar(GPT_OSS, TOOLS, "required", None)
    first = "<|channel|>analysis<|message|>Think <|en and more.<|end|><|start|>assistant"
    call = call_text(GPT_OSS, "get_weather", PARIS)
    role = ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Oslo"}'
    assert walk(vocab, grammar, first + call) == (first + call, True)
    assert walk(vocab, grammar, first + role) == (first + role, True)
    assert walk(vocab, grammar, "<|channel|>final<|message|>Hi")[0] == "<|channel|>"


def test_gpt_oss_arguments_hold_no_harmony_marker(vocab: ll.llama_vocab_p) -> None:
    """The reader ends a message at a marker: an argument holding `<|end|>` would cut the call
    short, so its strings refuse `<|` (the small model wrote one); `<` before anything else passes."""
    grammar = native_call_grammar(GPT_OSS, TOOLS, "required", None)
    fine = call_text(GPT_OSS, "get_weather", {"city": "a < b <<c <"})
    assert walk(vocab, grammar, fine) == (fine, True)
    marked = call_text(GPT_OSS, "get_weather", {"city": "Oslo<|end|><|start|>x"})
    taken, _ = walk(vocab, grammar, marked)
    assert taken.endswith('"Oslo') or taken.endswith('"Oslo<'), taken


def test_parallel_false_and_one_call_formats_allow_one_call(vocab: ll.llama_vocab_p) -> None:
    two = call_text(HERMES, "get.time", {}) + "\n" + call_text(HERMES, "get_weather", PARIS)
    assert walk(vocab, native_call_grammar(HERMES, TOOLS, "required", True), two) == (two, True)
    one, _ = walk(vocab, native_call_grammar(HERMES, TOOLS, "required", False), two)
    assert one.rstrip() == call_text(HERMES, "get.time", {})
    args = call_text(MISTRAL_ARGS, "get.time", {}) + call_text(MISTRAL_ARGS, "get_weather", PARIS)
    assert walk(vocab, native_call_grammar(MISTRAL_ARGS, TOOLS, "required", None), args) == (args, True)
    named = native_call_grammar(MISTRAL_ARGS, TOOLS, NamedTool(name="get.time"), None)
    first = call_text(MISTRAL_ARGS, "get.time", {})
    assert walk(vocab, named, first) == (first, True)
    taken, _ = walk(vocab, named, args)  # refused at the token that starts a second call
    assert args.startswith(taken) and len(first) - 4 < len(taken) <= len(first)


def test_the_grammar_helpers() -> None:
    gbnf = ('root ::= "{" space a-b "}" # a comment, a-b\nspace ::= [ \\t\\]]{0,20}\n'
            'a-b ::= "x\\"y" | "[" [^"\\\\]')
    assert prefixed(gbnf, "t3-") == (
        't3-root ::= "{" t3-space t3-a-b "}" # a comment, a-b\nt3-space ::= [ \\t\\]]{0,20}\n'
        't3-a-b ::= "x\\"y" | "[" [^"\\\\]')
    assert not_containing("<|end|>").startswith('( [^<] | "<" [^|]')
    with pytest.raises(ValueError):
        native_call_grammar(HERMES, TOOLS, "none", None)
    with pytest.raises(ValueError):
        native_call_grammar(HERMES, TOOLS, NamedTool(name="absent"), None)


def fire_points(vocab: ll.llama_vocab_p, grammar: NativeGrammar, text: str) -> tuple[int | None, int | None]:
    """Feed `text` token by token; the index of the token at which llama.cpp's lazy grammar fires
    (from then on it refuses an end of generation: a call has begun) and the one at which the
    Python watch says it does (backends/llamacpp/lazy_trigger.py)."""
    buf = ctypes.create_string_buffer(256)

    def piece(token: int) -> bytes:
        n = ll.llama_token_to_piece(vocab, token, buf, 256, 0, True)
        return buf.raw[:n]

    sampler = compiled(vocab, grammar)
    watch = TriggerWatch(grammar.triggers, piece)
    fired: int | None = None
    seen: int | None = None
    try:
        for i, token in enumerate(tokenize(vocab, text, special=True, add_special=False)):
            assert allowed(sampler, token), (text, i)
            ll.llama_sampler_accept(sampler, token)
            if watch.accept(token):
                seen = i
            if fired is None and not allowed(sampler, ll.llama_vocab_eos(vocab)):
                fired = i
        return fired, seen
    finally:
        ll.llama_sampler_free(sampler)


@pytest.mark.parametrize("syntax", list(SYNTAXES.values()), ids=lambda s: s.name)
def test_the_trigger_watch_fires_at_the_token_llama_cpp_fires_at(vocab: ll.llama_vocab_p,
                                                                 syntax: ToolSyntax) -> None:
    """A job under a lazy grammar drafts until its trigger, seen from Python: the watch must say
    the grammar fired at exactly the token where llama.cpp's does, whatever words came before
    and however the trigger's text splits into tokens."""
    assert mirrors(syntax.triggers)
    grammar = native_call_grammar(syntax, TOOLS, "auto", None)
    call = call_text(syntax, "get_weather", PARIS)
    starts = ["", "Sure ", "Let me check {this}: ", "<tool <tool_ca [TOOL x ", "spaces  \n\n "]
    for start in starts if syntax is not LLAMA3 else [""]:  # Llama 3's bare call starts the answer
        text = start + (BEFORE[syntax] or "") + call
        fired, seen = fire_points(vocab, grammar, text)
        assert fired is not None and fired == seen, (text, fired, seen)
    if syntax is LLAMA3:
        for text in [" \n" + call, "Words first. <|python_tag|>" + call]:
            fired, seen = fire_points(vocab, grammar, text)
            assert fired is not None and fired == seen, (text, fired, seen)
    if syntax.thought is not None:  # the prompt opened a thought: a required call after its end
        grammar = native_call_grammar(syntax, TOOLS, "required", None, thought_open=True)
        close = syntax.thought[1]
        text = "Still thinking <tool_call> {a} " + close + "\n" + call_text(syntax, "get.time", {})
        fired, seen = fire_points(vocab, grammar, text)
        assert fired is not None and fired == seen, (text, fired, seen)


def test_trigger_patterns_read_apart_are_not_mirrored() -> None:
    assert mirrors([r"<tool_call>", r'^\s*(\{\s*"name")', r"(<\|channel\|>(?:a|b) to=)", "\uff5ctool\\\\_x"])
    for pattern in ["a.b", r"^\{$", r"\u1234", r"(?<=x)y", r"\bword", "(unclosed"]:
        assert not mirrors([pattern]), pattern
    with pytest.raises(ValueError):
        TriggerWatch(["a.b"], lambda t: b"")
