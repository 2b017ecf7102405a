"""A thinking model's thoughts split from its answer as the text streams, with llama-server's
`reasoning_format` values:

- "none": the text stays as written, thought, markers and all;
- "deepseek" / "auto": the thought (between `<think>` and `</think>`, or the model's own markers)
  is reasoning; the answer is what follows it, its leading whitespace dropped;
- "deepseek-legacy": both: the thought is reasoning, and the content keeps it inside its markers.

A thought opens only at the start of the output (after whitespace), as llama.cpp reads it; or the
prompt already opened it (`starts_inside`: the template ended its generation prompt with
`<think>`), so the output begins inside it and the thought runs to the first `</think>`.

gpt-oss writes harmony messages instead (`HarmonySplitter`): `<|channel|>analysis<|message|>...
<|end|>` is its thought, `final` (and `commentary` without a recipient) its words, and a message
`to=functions.NAME` a call, whose body is the arguments' JSON.

A marker split across deltas is held back at a delta's end as stop strings are
(backends/llamacpp/text.py): the longest suffix that is a proper prefix of a marker waits for the
next delta. Each delta is read once: the work is linear in the text, whatever the split.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
THINK = ("<think>", "</think>")


class Segment(NamedTuple):
    """A run of the output: `kind` is "reasoning"; "content" (words, never read for calls: a
    thought kept in the text, its markers); "text" (the answer after or without a thought, where
    calls may be); or, from harmony, "call" (`text` the whole body, `name` the function)."""

    kind: str
    text: str
    name: str = ""


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest of `stops` begins in `text`, and which (the first listed at a tie)."""
    hits = [(i, n, s) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    return min(hits)[::2] if hits else None


def _add(out: list[Segment], kind: str, text: str) -> None:
    """Append, merging with the run before when it is of the same kind."""
    if not text:
        return
    if out and out[-1].kind == kind and kind != "call":
        out[-1] = Segment(kind, out[-1].text + text)
    else:
        out.append(Segment(kind, text))


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"reasoning_format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return fmt


class ThoughtSplitter:
    """One thought at the start of the output, split off as `fmt` says (module docstring)."""

    def __init__(self, fmt: str, *, markers: tuple[str, str] = THINK, starts_inside: bool = False) -> None:
        self._fmt = check_format(fmt)
        self._open, self._close = markers
        self._state = "inside" if starts_inside else "start"  # start, inside, after, answer
        self._held = ""
        # the legacy format shows the thought in its markers, the opening one included
        self._prefix = self._open if starts_inside and fmt == "deepseek-legacy" else ""

    def feed(self, delta: str) -> list[Segment]:
        out: list[Segment] = []
        if self._prefix:
            _add(out, "content", self._prefix)
            self._prefix = ""
        text, self._held = self._held + delta, ""
        while text:
            if self._state == "start":
                body = text.lstrip()
                if not body or (self._open.startswith(body) and body != self._open):
                    self._held = text  # whitespace, or the opener's start: wait
                    break
                if not body.startswith(self._open):
                    self._state = "answer"
                    continue
                lead = text[: len(text) - len(body)]
                self._markup(out, lead + self._open if self._fmt == "none" else self._open)
                self._state, text = "inside", body[len(self._open):]
            elif self._state == "inside":
                end = text.find(self._close)
                if end < 0:
                    hold = partial_suffix(text, [self._close])
                    self._thought(out, text[: len(text) - hold])
                    self._held = text[len(text) - hold:]
                    break
                self._thought(out, text[:end])
                self._markup(out, self._close)
                self._state, text = "after", text[end + len(self._close):]
            elif self._state == "after":
                if self._fmt != "none":  # llama.cpp consumes the spaces after the thought
                    text = text.lstrip()
                    if not text:
                        break
                self._state = "answer"
            else:
                _add(out, "text", text)
                break
        return out

    def finish(self) -> list[Segment]:
        """The end of the output: what was held is what it is (a thought cut short stays one)."""
        out: list[Segment] = []
        held, self._held = self._held, ""
        if self._state == "inside":
            self._thought(out, held)
        else:
            _add(out, "text", held)
        return out

    def _thought(self, out: list[Segment], text: str) -> None:
        if self._fmt != "none":
            _add(out, "reasoning", text)
        if self._fmt in ("none", "deepseek-legacy"):
            _add(out, "content", text)

    def _markup(self, out: list[Segment], text: str) -> None:
        if self._fmt in ("none", "deepseek-legacy"):
            _add(out, "content", text)


# -- gpt-oss (harmony) ---------------------------------------------------------------------------

H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_BODY_STOPS = (*H_ENDS, H_START)  # a message that starts anew ends the one before
_HEAD_STARTS = ("<|", "to=")  # what a message's header can begin with, after spaces
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
MAX_HEADER_CHARS = 512


class HarmonySplitter:
    """gpt-oss's messages as they stream (module docstring). The prompt ends with
    `<|start|>assistant`, so the output starts with a message's header. Output that does not look
    like a header is words; a message to another recipient (a built-in tool) is dropped, as
    llama.cpp drops it."""

    def __init__(self, fmt: str) -> None:
        self._fmt = check_format(fmt)
        self._state = "head"  # head: reading a header up to <|message|>; body: its message
        self._head = ""
        self._kind = "content"  # the body's: thought, content, call or drop
        self._name = ""
        self._held = ""
        self._call: list[str] = []

    def feed(self, delta: str) -> list[Segment]:
        out: list[Segment] = []
        text, self._held = self._held + delta, ""
        while text:
            text = self._read_head(out, text) if self._state == "head" else self._read_body(out, text)
        return out

    def finish(self) -> list[Segment]:
        """The end of the output: a call's body ends here too (its `<|call|>` is an end-of-
        generation token, not always in the text); a header cut short is dropped."""
        out: list[Segment] = []
        if self._state == "body":
            held, self._held = self._held, ""
            self._body(out, held)
            self._end_body(out, "")
        self._head = ""
        return out

    def _read_head(self, out: list[Segment], text: str) -> str:
        head = self._head + text
        at = head.find(H_MESSAGE)
        if at < 0:
            lead = head.lstrip()
            header_like = any(lead.startswith(s) or s.startswith(lead) for s in _HEAD_STARTS)
            if header_like and len(head) <= MAX_HEADER_CHARS:
                self._head = head
                return ""
            self._head, self._state, self._kind = "", "body", "content"  # words without a header
            return head
        header, rest = head[:at], head[at + len(H_MESSAGE):]
        self._head, self._state = "", "body"
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            to = recipient.group(1)  # a function, or a built-in tool no one offered
            self._kind, self._name = ("call", to[10:]) if to.startswith("functions.") else ("drop", "")
            self._call = []
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "thought"
            self._markup(out, header + H_MESSAGE)
        else:
            self._kind = "content"
        return rest

    def _read_body(self, out: list[Segment], text: str) -> str:
        hits = [(i, m) for m in _BODY_STOPS if (i := text.find(m)) >= 0]
        if not hits:
            hold = partial_suffix(text, _BODY_STOPS)
            self._body(out, text[: len(text) - hold])
            self._held = text[len(text) - hold:]
            return ""
        at, marker = min(hits)
        self._body(out, text[:at])
        self._state = "head"
        if marker == H_START:
            self._end_body(out, "")
            return text[at:]  # the header of the next message
        self._end_body(out, marker)
        return text[at + len(marker):]

    def _body(self, out: list[Segment], text: str) -> None:
        if self._kind == "thought":
            if self._fmt != "none":
                _add(out, "reasoning", text)
            self._markup(out, text)
        elif self._kind == "content":
            _add(out, "content", text)
        elif self._kind == "call":
            self._call.append(text)

    def _end_body(self, out: list[Segment], marker: str) -> None:
        if self._kind == "thought":
            self._markup(out, marker)
        elif self._kind == "call":
            out.append(Segment("call", "".join(self._call), self._name))
            self._call = []
        self._kind = "content"

    def _markup(self, out: list[Segment], text: str) -> None:
        """A thought's markers and text, kept in the words where the format keeps them."""
        if self._fmt in ("none", "deepseek-legacy"):
            _add(out, "content", text)
