"""Embeddings on the in-process engine: a llama.cpp context of its own (on the generation model's
weights, or on a dedicated embedding model), so the generation context's KV, slots and batches
are never touched. Up to `n_seq` inputs are decoded together, one sequence id each.

Two ways to pool, by the model's metadata (`<arch>.pooling_type`):
- the model declares a pooling (embedding models: mean, CLS, last): llama.cpp pools
  (`llama_get_embeddings_seq`); every input fits one ubatch (non-causal models need that);
- it declares none (generative models, like the embedded gemma-3-270m): mean pooling of the
  final hidden states, done here. The context runs with pooling NONE, which outputs every token's
  hidden state (the output norm), and an eval callback stops the graph once that tensor is
  computed (ggml's scheduler: a callback returning false cancels the rest of the graph
  compute). What it skips is the vocabulary projection of every token, which llama.cpp's own
  pooled path computes and discards: for a 262k vocabulary that is most of a small model's work
  (measured 2.7x faster on gemma-3-270m, same vectors within float rounding). A long input may
  span several decodes (causal attention: its KV carries over), so inputs may be longer than a
  ubatch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import llama_cpp as ll
import numpy as np

from backends.base import Embedding, InputRejected
from backends.llamacpp.model import tokenize
from backends.llamacpp.side_context import SideContext

# llama.cpp's name for the tensor an embedding context outputs; with pooling NONE it is each
# token's final hidden state, computed before the vocabulary projection
HIDDEN_TENSOR = b"result_embd_pooled"
POOLING_NAMES = {ll.LLAMA_POOLING_TYPE_MEAN: "mean", ll.LLAMA_POOLING_TYPE_CLS: "cls",
                 ll.LLAMA_POOLING_TYPE_LAST: "last"}


def _tensor_name() -> Callable[[int], bytes] | None:
    """ggml_get_name from the ggml llama-cpp-python loaded (None: no graph cut, full graph)."""
    try:
        from llama_cpp import _ggml
        fn = _ggml.libggml.ggml_get_name
    except (ImportError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_char_p
    return fn


def declared_pooling(model: ll.llama_model_p | None) -> int | None:
    """The pooling type the GGUF declares (None: none, as generative models)."""
    buf = ctypes.create_string_buffer(64)
    arch = buf.value if ll.llama_model_meta_val_str(model, b"general.architecture", buf, 64) >= 0 else b""
    if ll.llama_model_meta_val_str(model, arch + b".pooling_type", buf, 64) < 0:
        return None
    try:
        pooling = int(buf.value)
    except ValueError:
        return None
    return pooling if pooling in POOLING_NAMES else None


@dataclass
class _Segment:
    """Rows [start, start + n) of a decode belong to input `seq`; `last`: its final tokens."""

    seq: int
    start: int
    n: int
    last: bool


class EmbeddingContext(SideContext):
    kind = "embedding"

    def __init__(self, model: ll.llama_model_p | None, *, n_ctx: int, n_batch: int, n_seq: int, threads: int,
                 owns_model: bool = False) -> None:
        self.model = model
        self.owns_model = owns_model
        self.vocab = ll.llama_model_get_vocab(model)
        self.n_embd = ll.llama_model_n_embd_out(model)
        self.n_seq = n_seq
        self.limit = n_ctx  # tokens of one input
        self.pooling = declared_pooling(model)
        self.own_pooling = self.pooling is None
        # llama.cpp's pooling needs an input within one ubatch; ours lets it span decodes
        self.n_batch = n_batch if self.own_pooling else max(n_batch, n_ctx)
        self.graph_cuts = 0  # decodes stopped after the hidden states (tests read it)
        cparams = ll.llama_context_default_params()
        # one input may span decodes while the next ones start beside it
        cparams.n_ctx = n_ctx + self.n_batch if self.own_pooling else self.n_batch
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True  # inputs of any lengths share one pool of cells
        cparams.embeddings = True
        cparams.pooling_type = ll.LLAMA_POOLING_TYPE_NONE if self.own_pooling else self.pooling
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        name_of = _tensor_name() if self.own_pooling else None
        if name_of is not None:
            self._stop = self._graph_cut(name_of)  # kept alive as long as the context
            cparams.cb_eval = self._stop
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create an embedding context (n_ctx={cparams.n_ctx})")
        self.ctx = ctx
        self.memory = ll.llama_get_memory(ctx)  # NULL for encoder-only models
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    def _graph_cut(self, name_of: Callable[[int], bytes]) -> object:
        @ll.ggml_backend_sched_eval_callback
        def stop_after_hidden(tensor: int, ask: bool, _user: int) -> bool:
            if ask:  # the scheduler computes every node up to the one asked for in one call
                return name_of(tensor) == HIDDEN_TENSOR
            self.graph_cuts += 1
            return False  # the hidden states are there: cancel the rest (the vocabulary projection)

        return stop_after_hidden

    @property
    def pooling_name(self) -> str:
        return "mean (hidden states)" if self.pooling is None else POOLING_NAMES[self.pooling]

    # -- embedding ------------------------------------------------------------------------------

    def embed(self, texts: Sequence[str], truncate: Sequence[bool]) -> list[Embedding]:
        if len(texts) > self.n_seq:
            raise ValueError(f"{len(texts)} inputs in one call; the embedding context takes {self.n_seq}")
        pairs = enumerate(zip(texts, truncate, strict=True))
        inputs = [self._tokens(i, text, cut) for i, (text, cut) in pairs]
        try:
            vectors = self._mean_pooled(inputs) if self.own_pooling else self._model_pooled(inputs)
        finally:
            self.batch.n_tokens = 0
            if self.memory:
                ll.llama_memory_clear(self.memory, True)
        return [Embedding(v.tolist(), len(tokens)) for v, tokens in zip(vectors, inputs, strict=True)]

    def tokens_of(self, text: str) -> list[int]:
        """An input's tokens: text only (no control tokens), with the model's BOS/EOS."""
        return tokenize(self.vocab, text, special=False, add_special=True)

    def _tokens(self, index: int, text: str, cut: bool) -> list[int]:
        tokens = self.tokens_of(text)
        if not tokens:
            raise InputRejected(index, "has no tokens")
        if len(tokens) > self.limit:
            if not cut:
                raise InputRejected(index, f"has {len(tokens):,} tokens; this worker embeds at most "
                                           f"{self.limit:,} tokens per input (backend.embed_n_ctx)")
            tokens = tokens[:self.limit]
        return tokens

    def _mean_pooled(self, inputs: list[list[int]]) -> list[np.ndarray]:
        """Every input's tokens, packed in order into decodes of n_batch tokens (an input may
        continue in the next one), each decode's hidden-state rows summed per input."""
        sums = np.zeros((len(inputs), self.n_embd), dtype=np.float64)
        segments: list[_Segment] = []
        for seq, tokens in enumerate(inputs):
            done = 0
            while done < len(tokens):
                if self.batch.n_tokens == self.n_batch:
                    self._decode_and_sum(segments, sums)
                    segments = []
                take = tokens[done:done + self.n_batch - self.batch.n_tokens]
                last = done + len(take) == len(tokens)
                segments.append(_Segment(seq, self.batch.n_tokens, len(take), last))
                self._add(take, done, seq)
                done += len(take)
        if segments:
            self._decode_and_sum(segments, sums)
        return [sums[i] / len(tokens) for i, tokens in enumerate(inputs)]

    def _decode_and_sum(self, segments: list[_Segment], sums: np.ndarray) -> None:
        rows = self.decode_batch()
        hidden = np.ctypeslib.as_array(ll.llama_get_embeddings(self.ctx), shape=(rows, self.n_embd))
        for s in segments:
            sums[s.seq] += hidden[s.start:s.start + s.n].sum(axis=0, dtype=np.float64)
            if s.last and self.memory:  # its cells are free for the inputs after it
                ll.llama_memory_seq_rm(self.memory, s.seq, -1, -1)

    def _model_pooled(self, inputs: list[list[int]]) -> list[np.ndarray]:
        """Whole inputs packed into decodes of n_batch tokens; llama.cpp pools each."""
        out: list[np.ndarray] = []
        pending: list[int] = []
        for seq, tokens in enumerate(inputs):
            if self.batch.n_tokens + len(tokens) > self.n_batch:
                out += self._decode_pooled(pending)
                pending = []
            self._add(tokens, 0, seq)
            pending.append(seq)
        return out + self._decode_pooled(pending)

    def _decode_pooled(self, seqs: list[int]) -> list[np.ndarray]:
        if not seqs:
            return []
        self.decode_batch()
        shape = (self.n_embd,)
        vectors = [np.ctypeslib.as_array(ll.llama_get_embeddings_seq(self.ctx, s), shape=shape).copy()
                   for s in seqs]
        if self.memory:
            ll.llama_memory_clear(self.memory, True)
        return vectors

    def _add(self, tokens: list[int], first_pos: int, seq: int) -> None:
        b, n = self.batch, self.batch.n_tokens
        for i, token in enumerate(tokens):
            b.token[n + i] = token
            b.pos[n + i] = first_pos + i
            b.n_seq_id[n + i] = 1
            b.seq_id[n + i][0] = seq
            b.logits[n + i] = 1  # an embedding context outputs every token
        b.n_tokens = n + len(tokens)

    def close(self) -> None:
        self.free()
        if self.owns_model and self.model:
            ll.llama_model_free(self.model)
            self.model = None
