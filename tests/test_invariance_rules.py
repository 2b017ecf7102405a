"""The prefix-reuse rules that keep the batch-invariant engine's promise (pure, no model)."""

from __future__ import annotations

import pytest

from backends.llamacpp.invariance import FA_TILE_ROWS, reusable_prefix, tiled


def test_kernel_of_a_position() -> None:
    assert tiled(0, 300, 512) and tiled(299, 300, 512)
    assert not tiled(0, FA_TILE_ROWS - 1, 512)  # a short prompt: row by row
    assert tiled(511, 560, 512) and not tiled(512, 560, 512)  # 48-row last chunk
    assert not tiled(300, 300, 512)  # past the prompt: decoded one row at a time


@pytest.mark.parametrize(("reuse", "n_source", "n_prompt", "expected", "why"), [
    (100, 200, 300, 100, "both tiled in chunk 0; 200 rows still to prefill"),
    (280, 400, 300, 236, "the rest of a tiled chunk keeps >= 64 rows"),
    (30, 40, 300, 0, "the source prefilled row by row, this prompt alone tiles"),
    (45, 300, 50, 0, "the source tiled, this short prompt alone goes row by row"),
    (45, 40, 50, 45, "both row by row (positions 40.. were decoded)"),
    (49, 40, 50, 48, "at least 2 rows left, or a lone row could take the split KV scan"),
    (150, 100, 300, 100, "positions 100.. were decoded row by row, this prompt tiles them"),
    (530, 600, 560, 512, "chunk 1: the source tiled 88 rows, alone it is 48 rows"),
    (520, 1100, 1000, 520, "chunk 1 tiled on both sides, 480 rows left"),
])
def test_reusable_prefix(reuse: int, n_source: int, n_prompt: int, expected: int, why: str) -> None:
    assert reusable_prefix(reuse, n_source, n_prompt, 512) == expected, why
