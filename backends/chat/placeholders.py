"""Stand-ins for a chat's client-written text while a template renders it, so that text stays text.

A template's own text may hold control tokens ("<end_of_turn>", "<|im_start|>"); a message must
not: typed by a user, it could close their turn and forge another. So the chat is rendered with a
stand-in per message content, the template's text is tokenized with special tokens, and each
content goes in as text where its stand-in was (`place`).

A message stand-in has no whitespace inside (templates trim content) and is wrapped in \\v, which
every trim removes like any space (llama.cpp's C isspace, Python's str.strip): a stand-in found
without them was trimmed, so its text is trimmed the same way. Its marks are private-use
characters, which neither trim touches, no JSON encoder escapes and no template writes.

A literal stand-in takes the place of a string inside JSON a template writes (`tojson` of a tool's
description or a call's arguments) whose text holds a control token's; its text, already
JSON-escaped, goes in untrimmed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SPACE = " \t\n\v\f\r"  # C's isspace(), what llama.cpp trims
_MESSAGE = "\v\ue000fleet-message-{}\ue001\v"
_LITERAL = "\ue000fleet-literal-{}\ue001"
_PLACED = re.compile("(\v?)\ue000fleet-(message|literal)-(\\d+)\ue001(\v?)")


def message_stand_in(i: int) -> str:
    """The stand-in of texts[i], a message's content."""
    return _MESSAGE.format(i)


def literal_stand_in(i: int) -> str:
    """The stand-in of texts[i], text placed untrimmed (a JSON string's escaped inside)."""
    return _LITERAL.format(i)


def place(rendered: str, texts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(segments, placed): the template's own text between the stand-ins (one piece more than
    placed) and each stand-in's text, trimmed where the template trimmed its stand-in."""
    segments: list[str] = []
    placed: list[str] = []
    pos = 0
    for m in _PLACED.finditer(rendered):
        segments.append(rendered[pos:m.start()])
        text = texts[int(m.group(3))]
        if m.group(2) == "message":
            if not m.group(1):  # the template trimmed the stand-in's front: trim the text's
                text = text.lstrip(SPACE)
            if not m.group(4):
                text = text.rstrip(SPACE)
        placed.append(text)
        pos = m.end()
    segments.append(rendered[pos:])
    return segments, placed
