"""Which reused KV keeps a job batch-invariant: the rules behind `batch_invariant` prefix reuse.

ggml's CPU flash attention takes a tiled kernel for a chunk with FA_TILE_ROWS or more rows of one
stream and a row-by-row kernel below that (and splits a lone row's KV scan across threads from
SPLIT_KV_CELLS cells); the two round differently. Alone, a prompt is prefilled in chunks cut at
multiples of n_batch, so each of its positions has a known kernel. KV reused from another job
(a prefix entry, a running job, a finished job's slot) keeps the batch-invariance promise only
where that job computed each position with the kernel this prompt would use alone.
"""

from __future__ import annotations

TILED_MM_ROWS = 8  # ggml CPU K-quant matmul: a tiled kernel from this many rows, vec_dot below
FA_TILE_ROWS = 64  # ggml CPU flash attention: a tiled kernel from this many rows of one stream
SPLIT_KV_CELLS = 512  # ... and a KV scan split across threads for a lone row from this many cells


def tiled(position: int, n_prompt: int, n_batch: int) -> bool:
    """Did (would) the prompt of n_prompt tokens prefill `position` with the tiled kernel?
    Positions past the prompt were decoded one row at a time."""
    if position >= n_prompt:
        return False
    start = position - position % n_batch
    return min(n_batch, n_prompt - start) >= FA_TILE_ROWS


def reusable_prefix(reuse: int, n_source_prompt: int, n_prompt: int, n_batch: int) -> int:
    """The longest prefix, at most `reuse` tokens, that a prompt of n_prompt tokens can take from
    KV computed by a job whose prompt had n_source_prompt tokens, and still prefill the rest as
    it would alone."""
    # 1. positions the source computed with another kernel than this prompt alone would
    for pos in _kernel_boundaries(reuse, n_source_prompt, n_batch):
        if tiled(pos, n_source_prompt, n_batch) != tiled(pos, n_prompt, n_batch):
            reuse = pos
            break
    # 2. the rest of the chunk the reuse ends in must keep its kernel: alone that chunk has
    #    rows_alone rows, so the part still to prefill needs as many to stay tiled, and at least
    #    2 (a single row of one stream may take the split KV scan)
    start = reuse - reuse % n_batch
    if reuse == start:
        return reuse
    end = min(start + n_batch, n_prompt)
    rows_alone = end - start
    need = FA_TILE_ROWS if rows_alone >= FA_TILE_ROWS else min(rows_alone, 2)
    return max(start, min(reuse, end - need))


def _kernel_boundaries(reuse: int, n_source_prompt: int, n_batch: int) -> list[int]:
    """Positions below `reuse` where either side's kernel can change: chunk starts, the source's
    first generated token."""
    points = list(range(0, reuse, n_batch))
    if n_source_prompt < reuse:
        points.append(n_source_prompt)
    return sorted(points)
