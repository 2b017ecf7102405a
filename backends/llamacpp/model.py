"""One loaded GGUF model and its context, with the small llama.cpp helpers the engine needs:
tokenize (prompt or chat messages), token -> bytes, end-of-generation test."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp as ll

from backends.base import JobRejected
from backends.contract.schema import GenerateRequest
from backends.llamacpp.invariance import TILED_MM_ROWS
from backends.model import default_model_path

# ggml reads its kernel switches once per process, at the first matmul; the first model decides
_kernels_invariant: bool | None = None


def _choose_kernels(invariant: bool) -> None:
    """Batch-invariant kernels: ggml's tiled K-quant matmul for every batch size (by default it
    is taken only from 8 rows, below that a vec_dot kernel that rounds differently), so a row's
    result never depends on how many rows share its batch."""
    global _kernels_invariant
    if _kernels_invariant is None:
        if invariant:
            os.environ["GGML_CPU_TILED_MM_FORCE"] = "1"
        _kernels_invariant = invariant or os.environ.get("GGML_CPU_TILED_MM_FORCE") == "1"
    elif invariant and not _kernels_invariant:
        raise RuntimeError("batch_invariant needs the first llama.cpp model of this process to be "
                           "loaded with batch_invariant=true (ggml fixes its kernels at first use)")


@ll.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every load detail to stderr; keep errors only (level 4 = GGML_LOG_LEVEL_ERROR)
    if level == 4 and os.environ.get("FLEET_LLAMA_LOG") != "0":
        os.write(2, text)


class LoadedModel:
    def __init__(
        self, path: Path | None, *, n_ctx: int, n_batch: int, n_seq_max: int, threads: int | None,
        batch_invariant: bool = False, kv_unified: bool = False, swa_full: bool = True,
        chat_template: str | None = None,
    ) -> None:
        path = Path(path) if path else default_model_path()
        if not path.exists():
            raise FileNotFoundError(f"model file not found: {path}")
        ll.llama_log_set(_quiet_log, ctypes.c_void_p())
        if chat_template is not None:
            check_builtin_template(chat_template)  # before anything is loaded
        _choose_kernels(batch_invariant)
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        # repacked weights (CPU_REPACK) use a 4-row kernel and a 1-row kernel that round differently:
        # a draft's verification rows would not give what decoding one row at a time gives
        # (speculation.py). Not slower without them here: docs/bench.md, "Kernels".
        mparams.use_extra_bufts = False
        model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.model = model
        self.path = path
        self.threads = threads or len(os.sched_getaffinity(0))
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        # logits rows: one per sequence (or a few drafts' rows), not n_batch x 262k vocab
        cparams.n_outputs_max = max(n_seq_max, TILED_MM_ROWS)
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        # unified: one cell pool for all slots (flexible lengths, seq_cp of a prefix is free); else
        # one KV stream per sequence, so a job's cells and attention sums are laid out as if alone
        cparams.kv_unified = kv_unified
        # swa_full: sliding-window layers keep every position, not just their window (see
        # LlamaCppBackend: what each KV layout needs)
        cparams.swa_full = swa_full
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            ll.llama_model_free(model)
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})")
        self.ctx = ctx
        self.vocab = ll.llama_model_get_vocab(model)
        self.memory = ll.llama_get_memory(ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        # sliding-window layers attend to the last n_swa positions; 0: no such layers, or kept whole
        self.n_swa = 0 if swa_full else max(0, ll.llama_model_n_swa(model))
        self._piece_buf = ctypes.create_string_buffer(256)
        self.chat_template = choose_chat_template(self, chat_template)
        eos = ll.llama_vocab_eos(self.vocab)
        self.eog_token = eos if eos >= 0 else ll.llama_vocab_eot(self.vocab)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None when the model has no such key)."""
        n = ll.llama_model_meta_val_str(self.model, key.encode(), self._piece_buf, len(self._piece_buf))
        return self._piece_buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    # -- text <-> tokens --------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        n_max = len(data) + 16
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, True, special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (ll.llama_token * n_max)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, True, special)
        return list(buf[:n])

    def prompt_tokens(self, request: GenerateRequest) -> list[int]:
        if request.prompt is not None:
            tokens = self.tokenize(request.prompt, special=False)
        else:
            tokens = self.tokenize(self.apply_chat_template(request), special=True)
        if not tokens:
            raise JobRejected("prompt has no tokens")
        return tokens

    def apply_chat_template(self, request: GenerateRequest) -> str:
        msgs = request.messages or []
        if self.chat_template is None:
            raise JobRejected("this model has no chat template; set backend.chat_template to one of "
                              "llama.cpp's built-in templates, or send 'prompt' instead of 'messages'")
        keep = [(m.role.encode(), m.content.encode("utf-8", errors="replace")) for m in msgs]
        chat = (ll.llama_chat_message * len(keep))()
        for i, (role, content) in enumerate(keep):
            chat[i].role = role
            chat[i].content = content
        size = sum(len(c) for _, c in keep) * 2 + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = ll.llama_chat_apply_template(self.chat_template, chat, len(keep), True, buf, size)
            if n < 0:
                raise JobRejected("the model's chat template is not supported by llama.cpp")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise JobRejected("chat template output did not fit")

    def piece(self, token: int) -> bytes:
        n = ll.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, big, -n, 0, False)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None



def builtin_chat_templates() -> list[str]:
    """The template names llama.cpp formats chats with itself (`llama_chat_builtin_templates`)."""
    n = ll.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    ll.llama_chat_builtin_templates(names, n)
    return [name.decode() for name in names if name]


def check_builtin_template(name: str) -> None:
    builtin = builtin_chat_templates()
    if name not in builtin:
        raise ValueError(f"chat_template {name!r} is not a llama.cpp built-in template; "
                         f"choose one of: {', '.join(sorted(builtin))}")


def choose_chat_template(model: LoadedModel, setting: str | None) -> bytes | None:
    """The chat template: the `chat_template` setting (a llama.cpp built-in name) if given, else
    the model's own, else by family: gemma models get `gemma` (the embedded gemma-3-270m GGUF
    ships without a template); None: chat requests are refused with a clear error."""
    if setting is not None:
        return setting.encode()
    own = ll.llama_model_chat_template(model.model, None)
    if own:
        return bytes(own)
    family = f"{model.meta('general.architecture') or ''} {model.meta('general.name') or ''}".lower()
    return b"gemma" if "gemma" in family else None
