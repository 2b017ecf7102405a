"""When a lazy grammar starts applying, known in Python: llama.cpp's trigger detection mirrored,
so a job whose only constraint is a lazy grammar (a model's own tool calls, tool_choice auto)
may draft until its call begins.

llama.cpp's lazy grammar (llama-grammar.cpp, `llama_grammar_accept_impl`) waits for its trigger
(`awaiting_trigger`): every accepted token's piece (the vocabulary's, control tokens rendered)
is appended to `trigger_buffer`, and each trigger pattern is looked for in the whole buffer
(`std::regex_search`; a pattern written `^...$` is tried with `std::regex_match` first, which
finds nothing the search does not). The first pattern that matches ends the wait: the tokens
from the first non-empty capture group's start (else the match's) are replayed into the grammar,
which from then on applies. A trigger token (none are compiled here) would do the same at once.
While it waits, the sampler's apply() returns at once: a pick is the chain's alone, as for a job
without a grammar. So the text up to and including the token that fires is what a plain job
would sample, and a draft of it is verified as a plain job's is. After that token the grammar
constrains: the job's later draft rows are not kept and it decodes one token at a time.

The watch only has to say *when* the grammar fires, not where its text starts (llama.cpp replays
that itself). It reads a pattern as std::regex does over bytes (each byte a character; `\\s` is
ASCII whitespace in the "C" locale, as Python's bytes patterns read it). Where the two dialects
part (`.` excludes `\\r` only in ECMAScript, `$` matches before a final newline only in Python,
escapes of code points) a pattern is not mirrored, and its job does not draft (`mirrors`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

# an escape both engines read the same way over bytes: a class shorthand or a punctuation literal
_SAME_ESCAPE = re.compile(r"\\[sSdDwW\\^$.|?*+()\[\]{}]")
_UNESCAPED_APART = re.compile(r"[.$]")  # what the engines read apart where unescaped


def mirrors(patterns: Sequence[str]) -> bool:
    """Whether every pattern reads the same in std::regex (over bytes) and in Python's `re`."""
    for pattern in patterns:
        rest = _SAME_ESCAPE.sub("", pattern)
        if "\\" in rest or _UNESCAPED_APART.search(rest) or "(?<" in rest:
            return False
        try:
            re.compile(pattern.encode())
        except re.error:
            return False
    return True


class TriggerWatch:
    """A lazy grammar's wait for its trigger, token by token: feed it every token accepted into
    the grammar (never an end of generation: those are not accepted)."""

    __slots__ = ("_buffer", "_patterns", "_piece", "fired")

    def __init__(self, patterns: Sequence[str], piece: Callable[[int], bytes]) -> None:
        if not mirrors(patterns):
            raise ValueError("a trigger pattern that std::regex and Python read apart")
        self._patterns = [re.compile(p.encode()) for p in patterns]
        self._piece = piece  # the vocabulary's piece, control tokens rendered
        self._buffer = bytearray()
        self.fired = False

    def accept(self, token: int) -> bool:
        """Take one accepted token; True when the grammar fires at it (it applies from the next)."""
        if self.fired:
            return False
        self._buffer += self._piece(token)
        buffer = bytes(self._buffer)
        if any(p.search(buffer) for p in self._patterns):
            self.fired = True
            self._buffer.clear()
        return self.fired
