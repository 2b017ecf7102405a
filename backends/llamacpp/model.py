"""One loaded GGUF model and its context, with the small llama.cpp helpers the engine needs:
tokenize (prompt or chat messages), token -> bytes, end-of-generation test."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import llama_cpp as ll

from backends.base import JobRejected
from backends.chat.placeholders import SPACE, StandIns
from backends.contract.schema import GenerateRequest, Message
from backends.llamacpp.jinja_chat import JinjaChat
from backends.llamacpp.speculation import DRAFT_CALL_ROWS
from backends.model import default_model_path

# ggml reads its kernel switches once per process, at the first matmul; the first model decides
_kernels_invariant: bool | None = None
KERNEL_SWITCH = "GGML_CPU_TILED_MM_FORCE"

# tokens that text becomes only with special parsing (user-defined ones are split out either way)
_SPLIT_ONLY_WITH_SPECIAL = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN


def _choose_kernels(invariant: bool) -> bool:
    """Batch-invariant kernels: ggml's tiled K-quant matmul for every batch size (by default it
    is taken only from 8 rows, below that a vec_dot kernel that rounds differently), so a row's
    result never depends on how many rows share its batch. True: this call put ggml's switch in
    the environment, and the caller takes it out after the first decode (see _warm_up)."""
    global _kernels_invariant
    if _kernels_invariant is None:
        set_here = invariant and KERNEL_SWITCH not in os.environ
        if set_here:
            os.environ[KERNEL_SWITCH] = "1"
        _kernels_invariant = invariant or os.environ.get(KERNEL_SWITCH) == "1"
        return set_here
    if invariant and not _kernels_invariant:
        raise RuntimeError("batch_invariant needs the first llama.cpp model of this process to be "
                           "loaded with batch_invariant=true (ggml fixes its kernels at first use)")
    return False


@ll.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every load detail to stderr; keep errors only (level 4 = GGML_LOG_LEVEL_ERROR)
    if level == 4 and os.environ.get("FLEET_LLAMA_LOG") != "0":
        os.write(2, text)


class LoadedModel:
    def __init__(
        self, path: Path | None, *, n_ctx: int, n_batch: int, n_seq_max: int, threads: int | None,
        batch_invariant: bool = False, kv_unified: bool = False, swa_full: bool = True,
        chat_template: str | None = None, chat_template_file: Path | None = None, jinja: bool = True,
    ) -> None:
        path = Path(path) if path else default_model_path()
        if not path.exists():
            raise FileNotFoundError(f"model file not found: {path}")
        ll.llama_log_set(_quiet_log, ctypes.c_void_p())
        if chat_template is not None:
            check_builtin_template(chat_template)  # before anything is loaded
        switched = _choose_kernels(batch_invariant)
        model = load_weights(path)
        self.model = model
        self.path = path
        self.threads = threads or len(os.sched_getaffinity(0))
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        # logits rows: one per sequence (or a drafted call's rows), not n_batch x 262k vocab
        cparams.n_outputs_max = max(n_seq_max, DRAFT_CALL_ROWS)
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
        self.preserved: set[int] = set()  # control tokens whose text `piece` renders
        self.chat_template = choose_chat_template(self, chat_template)
        self.jinja = self._jinja(chat_template_file) if jinja else None
        eos = ll.llama_vocab_eos(self.vocab)
        self.eog_token = eos if eos >= 0 else ll.llama_vocab_eot(self.vocab)
        if switched:
            self._warm_up()
            # ggml has read the switch: a process this one starts (a worker, a llama-server)
            # chooses its own kernels from its own settings, not this process's
            del os.environ[KERNEL_SWITCH]

    def _warm_up(self) -> None:
        """One token decoded and forgotten: ggml's first matmul, where it reads its switches."""
        token = (ctypes.c_int32 * 1)(max(0, ll.llama_vocab_bos(self.vocab)))
        if ll.llama_decode(self.ctx, ll.llama_batch_get_one(token, 1)) != 0:
            raise RuntimeError("llama.cpp could not decode a warm-up token")
        ll.llama_memory_clear(self.memory, True)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None when the model has no such key)."""
        n = ll.llama_model_meta_val_str(self.model, key.encode(), self._piece_buf, len(self._piece_buf))
        return self._piece_buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def metadata(self) -> dict[str, str]:
        """Every scalar GGUF metadata key and its value as llama.cpp renders it (arrays, such as
        the vocabulary, are not kept by llama.cpp)."""
        out: dict[str, str] = {}
        for i in range(ll.llama_model_meta_count(self.model)):
            key = _read_string(functools.partial(ll.llama_model_meta_key_by_index, self.model, i))
            value = _read_string(functools.partial(ll.llama_model_meta_val_str_by_index, self.model, i))
            if key is not None and value is not None:
                out[key] = value
        return out

    def _jinja(self, template_file: Path | None) -> JinjaChat | None:
        """The model's own template (or the file's) rendered by Jinja, as llama-server `--jinja`;
        None: a built-in template renders chats (a setting names one, or the model has none)."""
        if template_file is not None:
            source = template_file.read_text(encoding="utf-8")
        elif self.chat_template is not None and len(self.chat_template) > 64:  # not a built-in name
            source = self.chat_template.decode("utf-8", errors="replace")
        else:
            return None
        return JinjaChat(source, bos_token=self._token_text(ll.llama_vocab_bos(self.vocab)),
                         eos_token=self._token_text(ll.llama_vocab_eos(self.vocab)),
                         add_bos=bool(ll.llama_vocab_get_add_bos(self.vocab)),
                         add_eos=bool(ll.llama_vocab_get_add_eos(self.vocab)),
                         reads_as_text=self._reads_as_text)

    def _token_text(self, token: int) -> str:
        return (ll.llama_vocab_get_text(self.vocab, token) or b"").decode("utf-8", errors="replace") \
            if token >= 0 else ""

    def _reads_as_text(self, text: str) -> bool:
        """No control token's text inside: special parsing leaves it as it is."""
        return self.tokenize(text, special=True, add_special=False) == \
            self.tokenize(text, special=False, add_special=False)

    def template_text(self) -> str | None:
        """The chat template as text: the model's own, or the built-in one rendered around Ollama's
        placeholders (what a prompt looks like)."""
        if self.jinja is not None:
            return self.jinja.source
        if self.chat_template is None:
            return None
        if len(self.chat_template) > 64:  # the model's own template, not a built-in one's name
            return self.chat_template.decode("utf-8", errors="replace")
        request = GenerateRequest(messages=[Message(role="system", content="{{ .System }}"),
                                            Message(role="user", content="{{ .Prompt }}")])
        return self._render(request, ["{{ .System }}", "{{ .Prompt }}"])

    @functools.cached_property
    def eog_ids(self) -> tuple[int, ...]:
        """Every end-of-generation token (gemma-3: <eos>, <end_of_turn>, </s>), found once: a
        scan of the vocabulary (~70 ms for 262k tokens)."""
        return tuple(t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self.vocab, t))

    # -- text <-> tokens --------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool, add_special: bool = True) -> list[int]:
        """`special`: text of control tokens becomes those tokens; `add_special`: BOS (and EOS
        where the model wants one). The length is passed, so a NUL byte is text like any other."""
        return tokenize(self.vocab, text, special=special, add_special=add_special)

    def prompt_tokens(self, request: GenerateRequest) -> list[int]:
        if request.prompt is not None:
            tokens = self.tokenize(request.prompt, special=False)
        else:
            tokens = self.chat_tokens(request)
        if not tokens:
            raise JobRejected("prompt has no tokens")
        return tokens

    def chat_tokens(self, request: GenerateRequest) -> list[int]:
        """The templated chat's tokens, where only the template's own text may hold control tokens:
        the client's text is always text (message content; with the model's own template also
        names, ids, arguments, thoughts, tools and template settings: jinja_chat.py), so
        "<end_of_turn>" typed by a user cannot close their turn and forge another. The template is
        rendered with a placeholder per such text, its own text tokenized with special tokens,
        each client text spliced in as text (as the template would have placed it, trimmed or not:
        backends/chat/placeholders.py), and each text run between two control tokens tokenized
        whole (so a chat without such text gets exactly the tokens the rendered string would)."""
        stand_ins = StandIns()
        if self.jinja is not None:
            rendered = self.jinja.render(request, stand_ins)
        else:
            rendered = self._render(request, [stand_ins.message(m.content) for m in request.messages or []])
        segments, placed = stand_ins.place(rendered)
        items: list[int | str] = []  # control token ids and text, in order
        for i, segment in enumerate(segments):
            items += self._split_control(segment)
            if i < len(placed):
                items.append(placed[i])
        return self._tokens_of(items)

    def _split_control(self, text: str) -> list[int | str]:
        """Template text as control token ids and the text between them (llama.cpp's own split)."""
        out: list[int | str] = []
        pos = 0
        for tok in self.tokenize(text, special=True, add_special=False):
            if not ll.llama_vocab_get_attr(self.vocab, tok) & _SPLIT_ONLY_WITH_SPECIAL:
                continue
            marker = (ll.llama_vocab_get_text(self.vocab, tok) or b"").decode("utf-8", errors="replace")
            at = text.find(marker, pos)
            if not marker or at < 0:  # never expected: keep the rest as template text
                break
            out += [text[pos:at], tok]
            pos = at + len(marker)
        out.append(text[pos:])
        return out

    def _tokens_of(self, items: list[int | str]) -> list[int]:
        """Token ids for control tokens and text (each run of text tokenized whole), with BOS/EOS
        once, as `tokenize(add_special=True)` adds them; whitespace next to a control token that
        strips it (LSTRIP/RSTRIP) is dropped as llama.cpp's own split drops it."""
        tokens = [ll.llama_vocab_bos(self.vocab)] if ll.llama_vocab_get_add_bos(self.vocab) else []
        run: list[str] = []
        strip_front = False
        for item in [*items, -1]:
            if isinstance(item, str):
                run.append(item)
                continue
            attr = ll.llama_vocab_get_attr(self.vocab, item) if item >= 0 else 0
            text = "".join(run)
            if attr & ll.LLAMA_TOKEN_ATTR_LSTRIP:
                text = text.rstrip(SPACE)
            if strip_front:
                text = text.lstrip(SPACE)
            if text:
                tokens += self.tokenize(text, special=False, add_special=False)
            if item >= 0:
                tokens.append(item)
            run, strip_front = [], bool(attr & ll.LLAMA_TOKEN_ATTR_RSTRIP)
        if ll.llama_vocab_get_add_eos(self.vocab):
            tokens.append(ll.llama_vocab_eos(self.vocab))
        return tokens

    def apply_chat_template(self, request: GenerateRequest) -> str:
        """The chat as the template renders it (text; tokenize with `chat_tokens`, never this:
        it would read control-token text inside the messages as control tokens, and llama.cpp
        reads each content as a C string, so a NUL byte would cut it)."""
        if self.jinja is not None:
            return self.jinja.render(request, None)
        return self._render(request, [m.content for m in request.messages or []])

    def _render(self, request: GenerateRequest, contents: list[str]) -> str:
        """llama.cpp's rendering of the request's roles with these contents."""
        if self.chat_template is None:
            raise JobRejected("this model has no chat template; set backend.chat_template to one of "
                              "llama.cpp's built-in templates, or send 'prompt' instead of 'messages'")
        roles = [m.role.encode() for m in request.messages or []]
        keep = [(r, c.encode("utf-8", errors="replace")) for r, c in zip(roles, contents, strict=True)]
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

    def piece(self, token: int, *, control: bool = False) -> bytes:
        """A token's text; control tokens are empty unless preserved (`preserve`) or `control`
        (their text as llama.cpp's grammar reads it: its vocabulary's pieces render them all)."""
        special = control or token in self.preserved
        n = ll.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def preserve(self, texts: tuple[str, ...]) -> None:
        """Render these control tokens as their text (a tool syntax's markers, which the answer's
        reader looks for: llama-server's preserved tokens)."""
        for text in texts:
            tokens = self.tokenize(text, special=True, add_special=False)
            if len(tokens) == 1 and not self.is_eog(tokens[0]):
                self.preserved.add(tokens[0])

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None


def load_weights(path: Path) -> ll.llama_model_p | None:
    """A GGUF model's weights (mmap'd: a second load of the same file shares the page cache)."""
    ll.llama_log_set(_quiet_log, ctypes.c_void_p())
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    # repacked weights (CPU_REPACK) use a 4-row kernel and a 1-row kernel that round differently:
    # a draft's verification rows would not give what decoding one row at a time gives
    # (speculation.py). Not slower without them here: docs/bench.md, "Kernels".
    mparams.use_extra_bufts = False
    model = ll.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def tokenize(vocab: ll.llama_vocab_p, text: str, *, special: bool, add_special: bool) -> list[int]:
    """`text`'s tokens (LoadedModel.tokenize says what the flags do)."""
    data = text.encode("utf-8", errors="replace")
    n_max = len(data) + 16
    buf = (ll.llama_token * n_max)()
    n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, special)
    if n < 0:  # buffer too small: -n is the size needed
        n_max = -n
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, special)
    return list(buf[:n])


def builtin_chat_templates() -> list[str]:
    """The template names llama.cpp formats chats with itself (`llama_chat_builtin_templates`)."""
    n = ll.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    ll.llama_chat_builtin_templates(names, n)
    return [name.decode() for name in names if name]


def _read_string(call: Callable[[ctypes.Array[ctypes.c_char], int], int]) -> str | None:
    """A string llama.cpp writes snprintf-style (the length it needed is returned): read again
    with room when the first buffer was short; None when it failed."""
    size = 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = call(buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1
    return None


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
