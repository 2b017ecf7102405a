"""Text jobs on the in-process engine (backends/contract/text_ops.py): llama-server's /tokenize,
/detokenize and /apply-template, answered from the loaded model's vocabulary and chat template as
llama-server answers them (the same llama.cpp calls, the same flags).

Only the vocabulary is read, never the context, so no decode is involved. Pieces are read into a
buffer of this module's own: LoadedModel.piece's buffer is the sampler's, which may be in use on
the overlapped step's thread.
"""

from __future__ import annotations

import ctypes

import llama_cpp as ll

from backends.base import JobRejected
from backends.contract.text_ops import TextRequest, out_of_vocabulary, too_many, valid_utf8
from backends.llamacpp.model import LoadedModel


def answer(model: LoadedModel, request: TextRequest) -> dict[str, object]:
    """The body llama-server sends for `request`; JobRejected naming the field it cannot take."""
    if request.op == "tokenize":
        assert request.content is not None
        tokens = model.tokenize(request.content, special=request.parse_special,
                                add_special=request.add_special)
        if reason := too_many(tokens):
            raise JobRejected(reason)
        if not request.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": valid_utf8(p)} for t, p in zip(tokens, pieces(model, tokens),
                                                                               strict=True)]}
    if request.op == "detokenize":
        assert request.tokens is not None
        if reason := out_of_vocabulary(request.tokens, model.n_vocab):
            raise JobRejected(reason)
        text = b"".join(pieces(model, request.tokens))
        return {"content": text.decode("utf-8", errors="replace")}  # a split character: U+FFFD
    assert request.chat is not None
    return {"prompt": model.apply_chat_template(request.chat)}


def pieces(model: LoadedModel, tokens: list[int]) -> list[bytes]:
    """Each token's bytes with control tokens written out ("<bos>"), as llama-server's
    common_token_to_piece(special=true)."""
    buf = ctypes.create_string_buffer(256)
    out = []
    for tok in tokens:
        n = ll.llama_token_to_piece(model.vocab, tok, buf, len(buf), 0, True)
        if n < 0:  # longer than the buffer: -n is the size it needs
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(model.vocab, tok, buf, len(buf), 0, True)
        out.append(buf.raw[:n])
    return out
