"""A llama.cpp context beside the engine's (embeddings, rerank scoring) on the same weights, with
the one batch it fills and decodes: the decode and the teardown both kinds share."""

from __future__ import annotations

from typing import Any

import llama_cpp as ll


class SideContext:
    kind = "side"  # named in its errors
    ctx: Any
    batch: Any

    def decode_batch(self) -> int:
        """Decode the batch; its number of rows (and an empty batch for the next one)."""
        rows = int(self.batch.n_tokens)
        rc = ll.llama_decode(self.ctx, self.batch)
        self.batch.n_tokens = 0
        if rc != 0:
            raise RuntimeError(f"llama_decode failed in the {self.kind} context ({rc})")
        return rows

    def free(self) -> None:
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
