"""A GGUF file's header read without llama.cpp: its metadata, its parameter count and the KV bytes
a token takes. The gateway and the CLI describe the catalogue's models with it before any worker
loads them (a producer-only host has no llama-cpp-python), and a worker sizes a model's RAM with
it before it decides to load. Only the header is read (metadata and tensor infos: a few MB for a
large vocabulary), never the weights.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3, little endian).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from backends.contract.schema import SamplingDefaults
from backends.model_card import capabilities, gguf_card

MAGIC = b"GGUF"
MAX_STRING = 1 << 24  # longer strings (or counts) mean a corrupt or hostile file
MAX_ITEMS = 1 << 24
DEFAULT_ALIGNMENT = 32  # GGUF's, when general.alignment does not say
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
           12: "<d"}
STRING, ARRAY = 8, 9
# llama.cpp's metadata values as text: the card's reader (model_card.typed) takes them so
SKIPPED_ARRAY = object()  # arrays (a vocabulary, merges) are skipped, as llama.cpp's text view omits them


class GgufError(ValueError):
    """Not a GGUF file this reader understands (the message says why)."""


@dataclass
class GgufHeader:
    metadata: dict[str, Any]  # scalars and strings, typed; arrays left out
    n_params: int
    path: Path
    last_tensor_at: int = 0  # where the last tensor's data starts: a complete file is longer

    def cut_short(self) -> str | None:
        """Why the file is cut short (its tensors start past its end), None if it seems whole."""
        size = self.path.stat().st_size
        if size > self.last_tensor_at:
            return None
        return f"{self.path}: cut short: {size} bytes, its tensors' data start at byte {self.last_tensor_at}"

    def text_metadata(self) -> dict[str, str]:
        """The metadata as llama.cpp renders it (every value text), for model_card.gguf_card."""
        out = {}
        for key, value in self.metadata.items():
            if isinstance(value, bool):
                out[key] = "true" if value else "false"
            elif isinstance(value, float):
                out[key] = f"{value:.6f}"
            else:
                out[key] = str(value)
        return out

    def kv_bytes_per_token(self, type_bytes: float = 2.0) -> int:
        """KV cache bytes one token of context takes (f16 K and V in every layer), 0 when the
        metadata does not say."""
        arch = self.metadata.get("general.architecture")
        get = self.metadata.get
        layers, embd = get(f"{arch}.block_count"), get(f"{arch}.embedding_length")
        heads = get(f"{arch}.attention.head_count") or 1
        heads_kv = get(f"{arch}.attention.head_count_kv") or heads
        if not (isinstance(layers, int) and isinstance(embd, int) and isinstance(heads, int)
                and isinstance(heads_kv, int)):
            return 0
        head = embd // heads
        k_len = get(f"{arch}.attention.key_length") or head
        v_len = get(f"{arch}.attention.value_length") or head
        return int(layers * heads_kv * (int(k_len) + int(v_len)) * type_bytes)


def read_header(path: Path) -> GgufHeader:
    """Raises GgufError for a file that is not GGUF (or is cut short), OSError if unreadable."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GgufError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = _unpack(f, "<IQQ")
        if version not in (2, 3) or n_tensors > MAX_ITEMS or n_kv > MAX_ITEMS:
            raise GgufError(f"{path}: GGUF version {version} with {n_tensors} tensors is not supported")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(f)
            value = _value(f, _unpack(f, "<I")[0])
            if value is not SKIPPED_ARRAY:
                metadata[key] = value
        n_params = last = 0
        for _ in range(n_tensors):
            _string(f)
            (n_dims,) = _unpack(f, "<I")
            if n_dims > 8:
                raise GgufError(f"{path}: a tensor of {n_dims} dimensions")
            count = 1
            for dim in _unpack(f, f"<{n_dims}Q"):
                count *= dim
            last = max(last, _unpack(f, "<IQ")[1])  # type, offset in the data section
            n_params += count
        align = metadata.get("general.alignment")
        align = align if isinstance(align, int) and align > 0 else DEFAULT_ALIGNMENT
        data_at = -(-f.tell() // align) * align
    return GgufHeader(metadata, n_params, path, data_at + last)


def file_card(path: Path, defaults: SamplingDefaults | None = None) -> dict[str, Any]:
    """The model card (backends/model_card.py) of a GGUF file from its header alone: what a worker
    that loads it publishes, but for the template's thinking, which needs its rendering."""
    header = read_header(path)
    template = header.metadata.get("tokenizer.chat_template")
    return gguf_card(header.text_metadata(), path=path, n_params=header.n_params,
                     template=template if isinstance(template, str) else None,
                     defaults=defaults or SamplingDefaults(), capabilities=capabilities())


def _unpack(f: BinaryIO, fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise GgufError(f"{getattr(f, 'name', 'file')}: cut short in its header")
    return struct.unpack(fmt, raw)


def _string(f: BinaryIO) -> str:
    (n,) = _unpack(f, "<Q")
    if n > MAX_STRING:
        raise GgufError(f"{getattr(f, 'name', 'file')}: a string of {n} bytes")
    raw = f.read(n)
    if len(raw) != n:
        raise GgufError(f"{getattr(f, 'name', 'file')}: cut short in its header")
    return raw.decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in SCALARS:
        return _unpack(f, SCALARS[kind])[0]
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        item, n = _unpack(f, "<IQ")
        if n > MAX_ITEMS:
            raise GgufError(f"{getattr(f, 'name', 'file')}: an array of {n} items")
        if item in SCALARS:
            size = struct.calcsize(SCALARS[item])
            f.seek(size * n, 1)
        else:
            for _ in range(n):
                _value(f, item)
        return SKIPPED_ARRAY
    raise GgufError(f"{getattr(f, 'name', 'file')}: unknown value type {kind}")
