"""Each model family's own tool-call syntax, as llama.cpp's common/chat.cpp chooses and reads it,
and `NativeAnswerParser`, which reads a model's text in it as the text streams: its thoughts
(backends/chat/reasoning.py), its words and its calls, as `Piece`s the worker re-writes as the
answer JSON (backends/chat/answer_json.py).

    hermes        Qwen 2.5, Qwen3, Hermes 2 Pro/3  <tool_call>\\n{"name": N, "arguments": {..}}\\n</tool_call>
    llama3        Llama 3.1-3.3                    {"name": N, "parameters": {..}} starting the answer,
                                                   or after <|python_tag|>
    mistral       Mistral Nemo                     [TOOL_CALLS][{"name": N, "arguments": {..}, "id": ".."}]
    mistral-args  Mistral Small 3.2, Devstral      [TOOL_CALLS]N[ARGS]{..} ([CALL_ID]x before [ARGS] read)
    deepseek-r1   DeepSeek R1 and its distills     <|tool calls begin|><|tool call begin|>function
                                                   <|tool sep|>N\\n```json\\n{..}\\n```<|tool call end|>
                                                   <|tool calls end|> (bars fullwidth, spaces U+2581)
    gpt-oss       gpt-oss (harmony)                <|channel|>commentary to=functions.N <|constrain|>json
                                                   <|message|>{..}<|call|>

Both Mistral forms read with one parser; the grammar writes the form the template uses. Text
around calls stays words; a call is given once its arguments' JSON is whole; text after an opener
that turns out not to be a call (no grammar held it, or max_tokens cut it) is words again, never
an error. Each delta is read once (linear in the text). A call repeated word for word is dropped
(`repeated`), as the generic reader drops it, so ids agree. Importable without llama_cpp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from backends.chat.answer_json import CallLedger, JsonScan, Piece
from backends.chat.reasoning import THINK, HarmonySplitter, Segment, ThoughtSplitter, partial_suffix
from backends.contract.tool_specs import TOOL_NAME


def regex_escape(text: str) -> str:
    """`text` as a literal in an ECMAScript regex (llama.cpp's std::regex): special characters
    only; Python's re.escape also escapes spaces, an escape std::regex need not accept."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


@dataclass(frozen=True)
class ToolSyntax:
    """A family's calls: what the parser looks for and what the grammar writes
    (backends/llamacpp/tool_grammar.py): [block_open] call_prefix NAME name_end ARGS call_suffix
    [separator call ...] [block_close]; where `name_end` is empty the name is inside the JSON
    object, {"name": N, <args_key>: ARGS}."""

    name: str
    # lazy-grammar patterns, as llama_sampler_init_grammar_lazy_patterns reads them: searched in
    # the generated text; the grammar is fed from the first capture group, or from the match
    triggers: tuple[str, ...]
    openers: tuple[str, ...]  # literals after which the parser reads calls
    block_open: str = ""
    call_prefix: str = ""
    name_end: str = ""
    call_suffix: str = ""
    separator: str = ""
    block_close: str = ""
    args_key: str = "arguments"
    thought: tuple[str, str] | None = THINK  # a thought's markers (gpt-oss: none, it has channels)
    # where a thought held to a reasoning budget starts and ends, where the reader finds it by
    # other means than `thought` (gpt-oss: the analysis message, read as a channel)
    analysis: tuple[str, str] | None = None
    preserved: tuple[str, ...] = ()  # control tokens the engine must render as text for the parser
    one_call: bool = False  # the format holds one call per answer
    id_pattern: str | None = None  # the call's own id, written in its JSON (Mistral Nemo)


def _ds(words: str, sep: str = "\u2581") -> str:
    """A DeepSeek marker: fullwidth bars, its words joined by U+2581 (or `sep`)."""
    return "<\uff5c" + words.replace(" ", sep) + "\uff5c>"


def spellings(marker: str) -> tuple[str, ...]:
    """A marker as written, and as a SentencePiece vocabulary renders it (U+2581 as a space):
    both are read, and the grammar allows both (llama.cpp allows its opener's spaced form)."""
    spaced = marker.replace("\u2581", " ")
    return (marker, spaced) if spaced != marker else (marker,)


DS_BEGIN, DS_CALL, DS_SEP = _ds("tool calls begin"), _ds("tool call begin"), _ds("tool sep")
DS_CALL_END, DS_END = _ds("tool call end"), _ds("tool calls end")
# the distills' variants of the opener, as llama.cpp reads them
DS_BEGINS = (DS_BEGIN, _ds("tool calls begin", "_"), _ds("tool calls begin", " "),
              _ds("tool calls begin", "\\_"), _ds("tool calls"))
_MISTRAL = ("[TOOL_CALLS]",)
_MISTRAL_THINKS = ("[THINK]", "[/THINK]")
_HARMONY = ("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>")

HERMES = ToolSyntax("hermes", (regex_escape("<tool_call>"),), ("<tool_call>",), call_prefix="<tool_call>\n",
                    call_suffix="\n</tool_call>", separator="\n",
                    preserved=(*THINK, "<tool_call>", "</tool_call>"))
LLAMA3 = ToolSyntax("llama3", (r'^\s*(\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*")',
                               regex_escape("<|python_tag|>")),
                    ("<|python_tag|>",), args_key="parameters", one_call=True, preserved=("<|python_tag|>",))
MISTRAL = ToolSyntax("mistral", (regex_escape(_MISTRAL[0]),), _MISTRAL, block_open="[TOOL_CALLS][",
                     separator=", ", block_close="]", thought=_MISTRAL_THINKS, id_pattern="^[a-zA-Z0-9]{9}$",
                     preserved=(*_MISTRAL, *_MISTRAL_THINKS))
MISTRAL_ARGS = ToolSyntax("mistral-args", (regex_escape(_MISTRAL[0]),), _MISTRAL, call_prefix="[TOOL_CALLS]",
                          name_end="[ARGS]", thought=_MISTRAL_THINKS,
                          preserved=(*_MISTRAL, "[ARGS]", "[CALL_ID]", *_MISTRAL_THINKS))
DEEPSEEK_R1 = ToolSyntax("deepseek-r1", tuple(regex_escape(b) for b in DS_BEGINS), DS_BEGINS,
                         block_open=DS_BEGIN, call_prefix=DS_CALL + "function" + DS_SEP,
                         name_end="\n```json\n", call_suffix="\n```" + DS_CALL_END, separator="\n",
                         block_close=DS_END,
                         preserved=(*THINK, DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END))
GPT_OSS = ToolSyntax("gpt-oss", (r"(<\|channel\|>(?:commentary|analysis) to=)",
                                 r"<\|start\|>assistant( to=)"), (),
                     call_prefix="<|channel|>commentary to=functions.",
                     name_end=" <|constrain|>json<|message|>", call_suffix="<|call|>", thought=None,
                     analysis=("<|channel|>analysis<|message|>", "<|end|>"), one_call=True,
                     preserved=_HARMONY)
SYNTAXES = {s.name: s for s in (HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, DEEPSEEK_R1, GPT_OSS)}


def detect(template_source: str) -> ToolSyntax | None:
    """The family of a Jinja chat template, by the markers llama.cpp chooses by; None: no
    native syntax this module reads (the caller keeps the generic format)."""
    src = template_source
    if "<|channel|>" in src:
        return GPT_OSS
    if DS_BEGIN in src:
        return DEEPSEEK_R1
    if "[TOOL_CALLS]" in src:
        return MISTRAL_ARGS if "[ARGS]" in src else MISTRAL
    if "<tool_call>" in src:
        # Qwen3-Coder's XML calls (<function=..><parameter=..>) are another syntax
        return None if "<function=" in src and "<parameter=" in src else HERMES
    if "<|start_header_id|>" in src and "<function=" not in src and (
            "<|start_header_id|>ipython<|end_header_id|>" in src or '"parameters"' in src):
        return LLAMA3  # (Functionary v3.1 writes <function=..> in Llama 3's turns: not this)
    return None


class NativeAnswerParser:
    """A job's raw text in its model's syntax, in: its thoughts, words and calls, out. `syntax`
    None (or `read_calls` False): thoughts apart, no calls read. Each call is {"id", "name",
    "arguments" (JSON text, as tools.AnswerReader gives it)}."""

    def __init__(self, syntax: ToolSyntax | None, reasoning_format: str, job_id: str,
                 starts_inside_thought: bool = False, *, read_calls: bool = True) -> None:
        self.ledger = CallLedger(job_id)
        self._read_calls = read_calls and syntax is not None
        self._split: ThoughtSplitter | HarmonySplitter
        self._reader: _CallReader | None = None
        if syntax is GPT_OSS:
            self._split = HarmonySplitter(reasoning_format)
            return
        markers = syntax.thought if syntax is not None and syntax.thought else THINK
        self._split = ThoughtSplitter(reasoning_format, markers=markers, starts_inside=starts_inside_thought)
        if syntax is not None and self._read_calls:
            self._reader = _CallReader(syntax, self.ledger.add)

    @property
    def calls(self) -> list[dict[str, str]]:
        return self.ledger.calls

    @property
    def repeated(self) -> bool:
        """A call repeated an earlier one word for word, and was dropped."""
        return self.ledger.repeated

    def feed(self, delta: str) -> Piece:
        out = Piece()
        self._route(self._split.feed(delta), out)
        return out

    def finish(self) -> Piece:
        out = Piece()
        self._route(self._split.finish(), out)
        if self._reader is not None:
            self._reader.finish(out)
        return out

    def _route(self, segments: list[Segment], out: Piece) -> None:
        for seg in segments:
            if seg.kind == "text" and self._reader is not None:
                self._reader.feed(seg.text, out)
            elif seg.kind == "call":
                if not self._read_calls:
                    continue  # a call nobody offered: dropped, as llama.cpp drops one
                try:
                    self.ledger.add(out, _valid_name(seg.name), json.loads(seg.text, strict=False))
                except (ValueError, _Malformed):
                    out.add("content", seg.text)
            else:
                out.add("content" if seg.kind == "text" else seg.kind, seg.text)


# -- reading calls -------------------------------------------------------------------------------


class _Malformed(Exception):
    """The text after an opener is not a call: it is words."""


Step = Generator[None, None, Any]  # a reading step: yields while it needs more text


def _valid_name(name: str) -> str:
    if not re.match(TOOL_NAME, name):
        raise _Malformed
    return name


def _named(item: Any, keys: tuple[str, ...]) -> tuple[str, Any]:
    """A call written as one JSON object: its name and arguments."""
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        for key in keys:
            if key in item:
                return _valid_name(item["name"]), item[key]
    raise _Malformed


_LLAMA3_HEADS = ('{"name":"', '{"type":"function","name":"')


def _llama3_head(text: str) -> bool | None:
    """Whether bare JSON at the answer's start is a call (True), is not (False), or cannot
    tell yet (None). Spaces are ignored: the whole object's parse decides in the end."""
    bare = re.sub(r"\s+", "", text)
    if any(bare.startswith(h) for h in _LLAMA3_HEADS):
        return True
    return None if any(h.startswith(bare) for h in _LLAMA3_HEADS) else False


class _CallReader:
    """Calls out of the answer's text (after any thought); everything else is words. Text mode
    looks for an opener, holding back a partial one; after an opener a region's steps read the
    calls (a generator that yields while it needs more text); text it read that is no call, or
    a call cut short, is words."""

    def __init__(self, syntax: ToolSyntax, call: Callable[[Piece, str, Any], None]) -> None:
        self._syntax, self._call = syntax, call
        self._text = ""  # not read yet
        self._taken: list[str] = []  # read by the region since its last call
        self._region: Step | None = None
        self._in_call = False  # the region is inside a call (else between calls, in markup)
        self._after_call = False  # the spaces after a call are dropped, as llama.cpp consumes them
        self._bare = syntax is LLAMA3  # a call may begin the answer as bare JSON
        self._out = Piece()

    def feed(self, text: str, out: Piece) -> None:
        self._text += text
        self._out = out
        while self._region is not None or self._scan():
            assert self._region is not None
            try:
                self._region.send(None)
                return  # it needs more text
            except StopIteration:
                pass
            except _Malformed:
                if self._in_call:
                    out.add("content", "".join(self._taken))
            self._region, self._taken, self._in_call = None, [], False

    def finish(self, out: Piece) -> None:
        if self._region is None:
            out.add("content", self._text.lstrip() if self._after_call else self._text)
        elif self._in_call:  # a call cut short: its text is words
            out.add("content", "".join(self._taken) + self._text)
        self._region, self._taken, self._text = None, [], ""

    def _scan(self) -> bool:
        """Words up to the next opener (True: a region starts there), holding back a partial
        opener at the end and the spaces before it: spaces before a call are not words."""
        t = self._text
        if self._after_call:
            t = t.lstrip()
            if not t:
                self._text = ""
                return False
            self._after_call = False
        if self._bare:
            lead = t.lstrip()
            if not lead:
                self._text = t
                return False
            self._bare = False
            if lead[0] == "{":
                self._text, self._taken = lead, [t[:len(t) - len(lead)]]
                self._start(self._bare_json())
                return True
        openers = self._syntax.openers
        hits = [(i, o) for o in openers if (i := t.find(o)) >= 0]
        if hits:
            at, opener = min(hits)
            words = t[:at].rstrip()
            self._out.add("content", words)
            self._text, self._taken = t[at + len(opener):], [t[len(words):at + len(opener)]]
            self._start(self._region_of())
            return True
        partial = partial_suffix(t, openers)
        words = t[:len(t) - partial].rstrip()
        self._out.add("content", words)
        self._text = t[len(words):]
        return False

    def _start(self, region: Step) -> None:
        self._region, self._in_call = region, True

    def _emit(self, name: str, arguments: Any) -> None:
        self._call(self._out, name, arguments)
        self._taken, self._in_call, self._after_call = [], False, True
        self._bare = self._syntax is LLAMA3  # another call may follow right after

    # steps --------------------------------------------------------------------------------------

    def _take(self, n: int) -> str:
        got, self._text = self._text[:n], self._text[n:]
        self._taken.append(got)
        return got

    def _peek(self) -> Step:
        while not self._text:
            yield
        return self._text[0]

    def _spaces(self) -> Step:
        while True:
            self._take(len(self._text) - len(self._text.lstrip()))
            if self._text:
                return
            yield

    def _one_of(self, options: Sequence[str]) -> Step:
        while True:
            t = self._text
            for o in options:
                if t.startswith(o):
                    self._take(len(o))
                    return o
            if not any(o.startswith(t) for o in options):
                raise _Malformed
            yield

    def _until(self, stops: Sequence[str], limit: int = 256) -> Step:
        """The text up to the first of `stops` (that stop consumed too): a name, an id."""
        parts: list[str] = []
        while True:
            t = self._text
            hits = [(i, s) for s in stops if (i := t.find(s)) >= 0]
            if hits:
                at, stop = min(hits)
                parts.append(t[:at])
                self._take(at + len(stop))
                return "".join(parts), stop
            parts.append(self._take(len(t) - partial_suffix(t, stops)))
            if sum(map(len, parts)) > limit:
                raise _Malformed
            yield

    def _json(self, head: Callable[[str], bool | None] | None = None) -> Step:
        scan, parts = JsonScan(), []
        while True:
            try:
                parts.append(self._take(scan.scan(self._text)))
            except ValueError:
                raise _Malformed from None
            if head is not None:
                verdict = head("".join(parts))
                if verdict is False:
                    raise _Malformed
                head = None if verdict else head
            if scan.done:
                try:
                    return json.loads("".join(parts), strict=False)  # raw control characters pass
                except ValueError:
                    raise _Malformed from None
            yield

    # regions, one per family --------------------------------------------------------------------

    def _region_of(self) -> Step:
        regions = {"hermes": self._hermes, "llama3": self._bare_json, "deepseek-r1": self._deepseek}
        return regions.get(self._syntax.name, self._mistral)()

    def _hermes(self) -> Step:
        self._emit(*_named((yield from self._json()), ("arguments",)))
        yield from self._spaces()
        yield from self._one_of(("</tool_call>",))

    def _bare_json(self) -> Step:
        self._emit(*_named((yield from self._json(_llama3_head)), ("parameters", "arguments")))

    def _mistral(self) -> Step:
        if (yield from self._peek()) == "[":  # Nemo: one JSON array of calls
            yield from self._one_of(("[",))
            while True:
                self._emit(*_named((yield from self._json()), ("arguments",)))
                yield from self._spaces()
                if (yield from self._one_of((",", "]"))) == "]":
                    return
                self._in_call = True
        name, stop = yield from self._until(("[ARGS]", "[CALL_ID]"))
        if stop == "[CALL_ID]":
            yield from self._until(("[ARGS]",))
        self._emit(_valid_name(name), (yield from self._json()))

    def _deepseek(self) -> Step:
        while True:
            yield from self._spaces()
            got = yield from self._one_of((*spellings(DS_CALL), "function", *spellings(DS_END)))
            if got in spellings(DS_END):
                return
            self._in_call = True
            if got != "function":
                yield from self._one_of(("function",))
            yield from self._one_of(spellings(DS_SEP))
            name, _ = yield from self._until(("\n",))
            yield from self._one_of(("```json\n",))
            self._emit(_valid_name(name.strip()), (yield from self._json()))
            yield from self._spaces()
            yield from self._one_of(("```",))
            yield from self._spaces()
            yield from self._one_of(spellings(DS_CALL_END))
