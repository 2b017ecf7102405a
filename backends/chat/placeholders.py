"""Stand-ins for a chat's client-written text while a template renders it, so that text stays text.

A template's own text may hold control tokens ("<end_of_turn>", "<|im_start|>"); a client's text
must not: typed by a user, it could close their turn and forge another. So the chat is rendered
with stand-ins for the client's texts, the template's text is tokenized with special tokens, and
each text goes in as text where its stand-in was (`place`).

A message stand-in has no whitespace inside (templates trim content) and is wrapped in \\v, which
every trim removes like any space (llama.cpp's C isspace, Python's str.strip): a stand-in found
without them was trimmed, so its text is trimmed the same way. Its marks are private-use
characters, which neither trim touches, no JSON encoder escapes and no template writes.

A literal stand-in's text goes in untrimmed: a name or id the template prints as it is, or a
string inside JSON a template writes (`tojson`), its text then already JSON-escaped.

Each render's stand-ins carry a key drawn at random: a stand-in typed by a client (or written by
a template) is not one of them, so it is read as the text it is.
"""

from __future__ import annotations

import re
import secrets

SPACE = " \t\n\v\f\r"  # C's isspace(), what llama.cpp trims


class StandIns:
    """One render's stand-ins and the texts they take the place of."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._mark = f"\ue000fleet-{secrets.token_hex(8)}-"
        mark = re.escape(self._mark)
        self._placed = re.compile(f"(\v?){mark}message-(\\d+)\ue001(\v?)|{mark}literal-(\\d+)\ue001")

    def message(self, text: str) -> str:
        """The stand-in of a message's content (trimmed where the template trims it)."""
        return f"\v{self._add('message', text)}\v"

    def literal(self, text: str) -> str:
        """The stand-in of text placed untrimmed."""
        return self._add("literal", text)

    def _add(self, kind: str, text: str) -> str:
        self.texts.append(text)
        return f"{self._mark}{kind}-{len(self.texts) - 1}\ue001"

    def holds(self, rendered: str) -> bool:
        """Whether any of these stand-ins is in `rendered`."""
        return self._mark in rendered

    def place(self, rendered: str) -> tuple[list[str], list[str]]:
        """(segments, placed): the template's own text between the stand-ins (one piece more than
        placed) and each stand-in's text, trimmed where the template trimmed its stand-in."""
        segments: list[str] = []
        placed: list[str] = []
        pos = 0
        for m in self._placed.finditer(rendered):
            segments.append(rendered[pos:m.start()])
            if m.group(4) is not None:
                placed.append(self.texts[int(m.group(4))])
            else:
                text = self.texts[int(m.group(2))]
                if not m.group(1):  # the template trimmed the stand-in's front: trim the text's
                    text = text.lstrip(SPACE)
                if not m.group(3):
                    text = text.rstrip(SPACE)
                placed.append(text)
            pos = m.end()
        segments.append(rendered[pos:])
        return segments, placed

    def expand(self, rendered: str) -> str:
        """`rendered` with each stand-in's text in its place."""
        segments, placed = self.place(rendered)
        return "".join(s + p for s, p in zip(segments, [*placed, ""], strict=True))
