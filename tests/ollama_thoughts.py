"""Ollama's split of a thinking model's output (the test server's `thinking`): a thought opened in
the prompt ends at `</think>`; what comes before is `message.thinking`, the rest `content`."""

from __future__ import annotations

from typing import Any


class ThoughtSplit:
    """A thought opened in the prompt, split off the output at `</think>` (a marker cut between
    deltas held back until it is whole)."""

    END = "</think>"

    def __init__(self, opened: bool) -> None:
        self.inside = opened
        self._held = ""
        self._after = False  # the newlines after the marker are not content: strip them

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, content) of the next delta."""
        if not self.inside:
            return "", self._content(text)
        text, self._held = self._held + text, ""
        if (end := text.find(self.END)) >= 0:
            self.inside, self._after = False, True
            return text[:end], self._content(text[end + len(self.END):])
        keep = next((n for n in range(len(self.END) - 1, 0, -1) if text.endswith(self.END[:n])), 0)
        if keep:
            text, self._held = text[:-keep], text[-keep:]
        return text, ""

    def close(self) -> str:
        """The thought's held tail at the end of the output (a marker's start that never closed)."""
        held, self._held = self._held, ""
        return held

    def _content(self, text: str) -> str:
        if self._after:
            text = text.lstrip("\n")
            self._after = not text
        return text


def whole(chat: bool, body: dict[str, Any], thinking: bool, text: str) -> dict[str, Any]:
    """A whole answer's message or response (stream: false)."""
    if not chat:
        return {"response": text}
    split = ThoughtSplit(opened=bool(body.get("think")) and thinking)
    thought, content = split.feed(text)
    thought += split.close()
    message = {"role": "assistant", "content": content, **({"thinking": thought} if thought else {})}
    return {"message": message}
