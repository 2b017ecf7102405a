"""A model's weights loaded once per test process: every in-process engine of a session maps the
same llama_model (a load costs ~0.7 CPU s; each engine still makes its own context). The cached
weights live as long as the process: llama_model_free passes over them.

Installed under tests/model_guard.py's watch (conftest installs this first), so every load, cached
or not, still goes through the guard."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_loaded: dict[tuple[str, int, int], Any] = {}  # (path, size, mtime): a file rewritten is loaded again


def cached(model: Any) -> bool:
    return model is not None and any(model is kept for kept in _loaded.values())


def install() -> None:
    try:
        import llama_cpp as ll

        from backends.llamacpp import engine, model
    except ImportError:  # no llama-cpp-python here: nothing in this process loads weights
        return
    load: Callable[[Path], Any] = model.load_weights
    free: Callable[[Any], None] = ll.llama_model_free

    def load_weights(path: Path) -> Any:
        try:
            st = os.stat(path)
        except OSError:  # the loader's own error says what is wrong
            return load(path)
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key not in _loaded:
            _loaded[key] = load(path)
        return _loaded[key]

    def llama_model_free(weights: Any) -> None:
        if not cached(weights):
            free(weights)

    model.load_weights = load_weights
    engine.load_weights = load_weights
    ll.llama_model_free = llama_model_free
