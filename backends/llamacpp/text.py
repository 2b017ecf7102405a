"""Token bytes -> text for the llama.cpp engine: incremental UTF-8 decoding and stop-string holding.

Tokens arrive as byte pieces; a multi-byte character can be split across two tokens, and a stop
string can be split across many. `TextAssembler` turns pieces into deltas that are always valid
text and never contain (a prefix of) a stop string that might still complete. A tool answer that
ends at a repeated call (`Sampling.end_at_repeated_call`) stops once the repeat is whole. A job
whose model speaks its own dialect (`Sampling.dialect`) streams its text read into answer JSON.
"""

from __future__ import annotations

import codecs

from backends.chat.answer_json import AnswerJsonWriter
from backends.chat.reasoning import first_stop, partial_suffix
from backends.chat.tool_syntax import SYNTAXES, NativeAnswerParser
from backends.contract.schema import AnswerDialect
from backends.contract.tools import AnswerReader


class TextAssembler:
    def __init__(self, stop: list[str], end_at_repeated_call: bool = False,
                 dialect: AnswerDialect | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._held = ""  # decoded text not yet emitted: it may be the start of a stop string
        self.stopped = False
        self.stop_word: str | None = None  # the stop string that ended the text
        self._answer = AnswerReader("") if end_at_repeated_call else None
        self._dialect = DialectReader(dialect) if dialect is not None else None

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit."""
        text = self._push(self._decoder.decode(piece))
        if self._dialect is None:
            return text
        out = self._dialect.feed(text)
        self.stopped = self.stopped or self._dialect.repeated  # as end_at_repeated_call: drop it, end
        return out

    def finish(self) -> str:
        """End of generation: flush everything held (nothing after a stop string)."""
        text = "" if self.stopped else self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._dialect.finish(text) if self._dialect is not None else text

    def _push(self, text: str) -> str:
        out = self._emitted(text)
        if self._answer is not None and out:
            self._answer.feed(out)
            self.stopped = self._answer.repeated  # the repeat is emitted: readers drop it
        return out

    def _emitted(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        if not self._stop:
            self._held = ""
            return buf
        hit = first_stop(buf, self._stop)
        if hit is not None:
            self.stopped, self.stop_word, self._held = True, hit[1], ""
            return buf[:hit[0]]
        hold = partial_suffix(buf, self._stop)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]


class DialectReader:
    """A model's raw text in its own dialect (its tool-call syntax, its thoughts) read as it grows
    into the answer JSON the job's stream carries (backends/chat)."""

    def __init__(self, dialect: AnswerDialect) -> None:
        syntax = SYNTAXES[dialect.syntax] if dialect.syntax else None
        self._parser = NativeAnswerParser(syntax, dialect.reasoning, "",
                                          starts_inside_thought=dialect.thought_open,
                                          read_calls=dialect.read_calls)
        self._writer = AnswerJsonWriter()

    @property
    def repeated(self) -> bool:
        """A call repeated an earlier one word for word (small models loop): it was dropped."""
        return self._parser.repeated

    def feed(self, text: str) -> str:
        return self._writer.feed(self._parser.feed(text)) if text else ""

    def finish(self, text: str) -> str:
        if self.repeated:  # what follows the dropped repeat (a separator, the next opener) goes too
            return self._writer.close()
        out = self.feed(text)
        return out + self._writer.feed(self._parser.finish()) + self._writer.close()
