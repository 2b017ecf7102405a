"""Text jobs: llama-server's `/tokenize`, `/detokenize` and `/apply-template` as small jobs a
worker answers with its model's tokenizer and chat template (the gateway's host may have no
model). Told apart from generation and embedding jobs on the wire by `"kind": "text"`; `op` says
which of the three.

A finished text job's result holds `answer`: the body llama-server sends for the same request
(`{"tokens": [...]}`, `{"content": ...}`, `{"prompt": ...}`) as JSON text, encoded once where it
was made (an answer of 262,144 tokens with their pieces is ~9 MB: as a structure it would be
encoded again for the job's stream, for RQ's result and by the gateway). A request that is well
formed but cannot be answered by this model (a token id outside its vocabulary, a text of too
many tokens, an engine without a tokenizer) fails with a reason starting `REJECTED`, which the
gateway answers with a 400.

Importable without llama_cpp and without Redis.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.contract.schema import MAX_PROMPT_CHARS, TENANT_PATTERN, GenerateRequest

# Tokens one job may take or give: a large context's worth; bounds the answer's size too (a
# piece is a few bytes, so a detokenized text or a with_pieces answer stays a few MB)
MAX_TEXT_TOKENS = 262_144
MAX_TOKEN_ID = 2**31 - 1  # llama_token is int32; the worker checks its own vocabulary's size
REJECTED = "text request rejected: "

TextOp = Literal["tokenize", "detokenize", "apply_template"]
# the field each op needs; the others' fields must be absent
NEEDS: dict[str, str] = {"tokenize": "content", "detokenize": "tokens", "apply_template": "chat"}
TOKENIZE_FIELDS = ("content", "add_special", "parse_special", "with_pieces")  # llama-server's body


class TextRequest(BaseModel):
    """One text job. Field names and defaults are llama-server's."""

    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["text"]
    op: TextOp
    # tokenize: the text; BOS (and EOS where the model adds one) only when asked; control-token
    # text ("<start_of_turn>") read as that token unless parse_special is false; with_pieces:
    # each token with its text
    content: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    tokens: list[int] | None = Field(None, max_length=MAX_TEXT_TOKENS)  # detokenize
    chat: GenerateRequest | None = None  # apply_template: rendered as a generation would be
    tenant: str | None = Field(None, pattern=TENANT_PATTERN)
    key_name: str | None = Field(None, pattern=TENANT_PATTERN)  # the tenant's named key (its budgets)

    @field_validator("tokens", mode="before")
    @classmethod
    def _token_ids(cls, v: object) -> object:
        """Name the first id that is not one (a boolean, a float, a negative or huge number)."""
        if not isinstance(v, list):
            return v  # pydantic names the type
        for i, tok in enumerate(v):
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise ValueError(f"item {i} ({str(tok)[:40]}) is not a token id: ids are integers")
            if not 0 <= tok <= MAX_TOKEN_ID:
                raise ValueError(f"item {i} ({tok}) is not a token id: ids are 0 or more, below 2^31")
        return v

    @model_validator(mode="after")
    def _fields_of_the_op(self) -> TextRequest:
        needed = NEEDS[self.op]
        if getattr(self, needed) is None:
            raise ValueError(f"{self.op} needs '{needed}'")
        others = [f for f in NEEDS.values() if f != needed and getattr(self, f) is not None]
        if others:
            raise ValueError(f"{self.op} takes no '{others[0]}'")
        return self

    def chars(self) -> int:
        """The characters the job carries (a worker bounds them as a prompt's): the text to
        tokenize, or the chat to render; none for ids to detokenize (MAX_TEXT_TOKENS bounds them)."""
        if self.chat is not None:
            return self.chat.chars()
        return len(self.content or "")

    def tokens_handled(self, answer: dict[str, Any]) -> int:
        """What the job counts as its tenant's tokens (usage, tokens_per_minute): the tokens it
        made or read; a rendered chat is text, no tokens."""
        if self.op == "tokenize":
            tokens = answer.get("tokens")
            return len(tokens) if isinstance(tokens, list) else 0
        return len(self.tokens or [])


ENCODE_CHUNK = 8192  # list items encoded at a time: the GIL changes hands between chunks


def encode_answer(answer: dict[str, Any]) -> str:
    """The result's `answer`: llama-server's body as JSON text (what `json.dumps` writes). A
    long list is encoded a chunk at a time: json's C encoder holds the GIL for a whole call, and
    262,144 tokens in one call froze the worker's decode loop for 30-120 ms."""
    fields = []
    for key, value in answer.items():
        if isinstance(value, list) and len(value) > ENCODE_CHUNK:
            chunks = [_dumps(value[i:i + ENCODE_CHUNK])[1:-1] for i in range(0, len(value), ENCODE_CHUNK)]
            fields.append(f"{_dumps(key)}:[{','.join(chunks)}]")
        else:
            fields.append(f"{_dumps(key)}:{_dumps(value)}")
    return "{" + ",".join(fields) + "}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def text_fields(op: TextOp, **fields: Any) -> dict[str, Any]:
    """The fields of a text job (for `Fleet.submit`)."""
    return {"kind": "text", "op": op, **fields}


def out_of_vocabulary(tokens: list[int], n_vocab: int) -> str | None:
    """Why the ids are not all this model's (None: they are): llama.cpp throws for an id outside
    its vocabulary (llama-server answers a 500; through ctypes it would end the worker)."""
    for i, tok in enumerate(tokens):
        if tok >= n_vocab:
            return (f"tokens: item {i} ({tok}) is not a token of this model (its vocabulary has "
                    f"{n_vocab:,}: ids 0 to {n_vocab - 1:,})")
    return None


def too_many(tokens: list[Any]) -> str | None:
    """Why a tokenized content is too long to answer (None: it is not)."""
    if len(tokens) > MAX_TEXT_TOKENS:
        return f"content: {len(tokens):,} tokens; at most {MAX_TEXT_TOKENS:,} per request"
    return None


def valid_utf8(piece: bytes) -> str | list[int]:
    """A token's piece as llama-server shows it: text when it is valid UTF-8 by itself, else its
    bytes (one token of a character split across several)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


__all__ = ["MAX_TEXT_TOKENS", "REJECTED", "TOKENIZE_FIELDS", "TextOp", "TextRequest", "encode_answer",
           "out_of_vocabulary", "text_fields", "too_many", "valid_utf8"]
