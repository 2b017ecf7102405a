"""Rerank scores on the in-process engine: Qwen3-Reranker's judgement asked of any chat model.

The prompt is one user turn in the model's own chat template: a fixed judge instruction, the
task's instruction, the query, then the document, closed by the template's turn end and the
generation prompt. The score is P("yes") / (P("yes") + P("no")) over the logits at the next
token (Qwen3-Reranker's `log_softmax` over the two, i.e. a sigmoid of their difference).

Everything up to the document is the same for every document of a request, so it is decoded once
into sequence 0 and each document's sequence starts as a copy of it (`llama_memory_seq_cp`: in
a unified KV pool a copy only tags the prefix's cells). Documents are packed into decodes of
`n_batch` tokens, a logits row only at each document's last token. A call scores the first
documents that fill one decode of `n_batch` tokens (at least one; a document that does not fit
in the cells after the prefix is refused), so its work is about a generation step's prefill
chunk however many the documents are; after it the documents' sequences are removed and the
prefix stays, so the next call of the same request (a job's documents span worker turns)
decodes none of it again.

A context of its own on the generation model's weights (like embeddings: the generation slots'
KV is never touched). Client text is always text: only the template's own text may hold control
tokens, so "<end_of_turn>" inside a document cannot close the turn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import llama_cpp as ll
import numpy as np

from backends.base import InputRejected, JobRejected, Scores
from backends.contract.schema import GenerateRequest
from backends.llamacpp.model import LoadedModel
from backends.llamacpp.side_context import SideContext

JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct '
         'provided. Note that the answer can only be "yes" or "no".')
# stands for the turn's content when the template is rendered once; split off, never tokenized
MARK = "[[llama-fleet document]]"


class ScoringContext(SideContext):
    kind = "scoring"

    def __init__(self, model: LoadedModel, *, n_ctx: int, n_batch: int, n_seq: int) -> None:
        self.model = model
        self.n_seq = n_seq  # documents of one call (each a sequence; the prefix is sequence 0)
        self.head, self.tail = self._turn()
        self.yes, self.no = self._answer_token("yes"), self._answer_token("no")
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq + 1
        cparams.n_outputs_max = n_seq + 1  # a row per document ending in a decode
        cparams.kv_unified = True  # the copies of the prefix share its cells
        # copies share cells, which llama.cpp never recycles: windowed layers keep every position
        cparams.swa_full = True
        cparams.n_threads = cparams.n_threads_batch = model.threads
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(model.model, cparams)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a scoring context (n_ctx={n_ctx})")
        self.ctx = ctx
        self.n_ctx = ll.llama_n_ctx(ctx)
        self.n_batch = n_batch
        self.memory = ll.llama_get_memory(ctx)
        self.n_vocab = model.n_vocab
        self.batch = ll.llama_batch_init(n_batch, 0, 1)
        self.held: list[int] = []  # the prefix sequence 0 holds

    def _turn(self) -> tuple[list[int], list[int]]:
        """The template's tokens before and after a user turn's content (generation prompt
        included), BOS once at the front."""
        chat = GenerateRequest.model_validate({"messages": [{"role": "user", "content": MARK}]})
        rendered = self.model.apply_chat_template(chat)
        if rendered.count(MARK) != 1:
            raise JobRejected("this model's chat template does not place a user turn's text as "
                              "given, so it cannot judge documents")
        before, after = rendered.split(MARK)
        head = self.model.tokenize(before, special=True, add_special=False)
        bos = ll.llama_vocab_bos(self.model.vocab)
        if ll.llama_vocab_get_add_bos(self.model.vocab) and head[:1] != [bos]:
            head.insert(0, bos)
        return head, self.model.tokenize(after, special=True, add_special=False)

    def _answer_token(self, word: str) -> int:
        tokens = self.model.tokenize(word, special=False, add_special=False)
        if len(tokens) != 1:
            raise JobRejected(f"this model has no single token for {word!r}, so it cannot judge documents")
        return tokens[0]

    def prefix_of(self, query: str, instruction: str) -> list[int]:
        body = f"{JUDGE}\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>:"
        return self.head + self.model.tokenize(body, special=False, add_special=False)

    def document_of(self, text: str) -> list[int]:
        return self.model.tokenize(" " + text, special=False, add_special=False) + self.tail

    # -- scoring --------------------------------------------------------------------------------

    def score(self, query: str, instruction: str, documents: Sequence[str]) -> Scores:
        if len(documents) > self.n_seq:
            raise ValueError(f"{len(documents)} documents in one call; the scoring context takes "
                             f"{self.n_seq}")
        prefix = self.prefix_of(query, instruction)
        room = self.n_ctx - len(prefix)
        if room < 1 + len(self.tail):
            raise InputRejected(-1, f"and instruction take {len(prefix):,} tokens of the prompt; this "
                                    f"worker scores at most {self.n_ctx:,} tokens of prompt, query and "
                                    "document together (backend.rerank_n_ctx)")
        # the first documents that fill one decode (n_batch tokens; a longer document alone) and
        # the cells after the prefix, so a call costs about a generation step's prefill chunk
        # whatever the documents; the rest are tokenized when their call comes
        docs: list[list[int]] = []
        used, fill = 0, min(self.n_batch, room)
        for i, text in enumerate(documents):
            tokens = self.document_of(text)
            if len(tokens) > room:
                raise InputRejected(i, f"has {len(tokens):,} tokens; with the query's prompt of "
                                       f"{len(prefix):,} this worker scores at most {self.n_ctx:,} "
                                       "(backend.rerank_n_ctx)")
            if docs and used + len(tokens) > fill:
                break
            docs.append(tokens)
            used += len(tokens)
        prefilled = 0
        try:
            if self.held != prefix:
                ll.llama_memory_clear(self.memory, True)
                self.held = []
                self._decode_prefix(prefix)
                self.held = prefix
                prefilled += len(prefix)
            relevance = self._score_group(len(prefix), docs)
            prefilled += used
        except BaseException:
            self.held = []  # what the cells hold is unknown now: the next call starts clean
            raise
        finally:
            self.batch.n_tokens = 0
        return Scores(relevance, [len(d) for d in docs], len(prefix), prefilled)

    def _decode_prefix(self, prefix: list[int]) -> None:
        for start in range(0, len(prefix), self.n_batch):
            chunk = prefix[start:start + self.n_batch]
            for i, token in enumerate(chunk):
                self._add(token, start + i, 0, logits=False)
            self._decode()

    def _score_group(self, at: int, docs: list[list[int]]) -> list[float]:
        """Each document as a copy of the prefix plus its own tokens; its sequence removed after."""
        scores = [0.0] * len(docs)
        ending: list[tuple[int, int]] = []  # (row in the batch, document) of rows with logits
        for d, tokens in enumerate(docs):
            ll.llama_memory_seq_cp(self.memory, 0, d + 1, -1, -1)
            for i, token in enumerate(tokens):
                if self.batch.n_tokens == self.n_batch:
                    self._read(ending, scores)
                    ending = []
                last = i == len(tokens) - 1
                if last:
                    ending.append((self.batch.n_tokens, d))
                self._add(token, at + i, d + 1, logits=last)
        self._read(ending, scores)
        for d in range(len(docs)):
            ll.llama_memory_seq_rm(self.memory, d + 1, -1, -1)
        return scores

    def _read(self, ending: list[tuple[int, int]], scores: list[float]) -> None:
        """Decode the batch; the score of each document whose last token was in it."""
        self._decode()
        for row, d in ending:
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
            # P(yes) / (P(yes) + P(no)) = sigmoid(logit_yes - logit_no)
            margin = float(logits[self.no]) - float(logits[self.yes])
            scores[d] = 1.0 / (1.0 + math.exp(margin)) if margin < 700 else 0.0

    def _add(self, token: int, pos: int, seq: int, *, logits: bool) -> None:
        b, n = self.batch, self.batch.n_tokens
        b.token[n] = token
        b.pos[n] = pos
        b.n_seq_id[n] = 1
        b.seq_id[n][0] = seq
        b.logits[n] = logits
        b.n_tokens = n + 1

    def _decode(self) -> None:
        if self.batch.n_tokens:
            self.decode_batch()

    def close(self) -> None:
        self.free()
