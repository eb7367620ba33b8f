"""The sampled model's whole next-token logits at every response position of chosen sequences,
recorded while `generate` samples them (for `eopd eval`'s entropy and KL statistics: no second
forward pass of the model over its own samples).

`StepLogits` is a transformers `LogitsProcessor` that leaves the scores untouched and, like
`StepLogprobs`, runs before the sampling warpers: the scores it sees are the model's raw logits
`[B, V]` of the step. It keeps the rows asked for (`[len(rows), V]` float32 per step), so a batch of
`B` sequences of which `r` are kept holds `r x steps x V` floats (8 x 16 x 49152: 25 MB).

The values are the decode steps' (a KV cache, left padding, the prompts' shared tokens prefilled
once), which agree with a full forward pass over the sequence to ~1e-5 in fp32, not in bf16
(`StepLogprobs`' note): callers use them for fp32 models only."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor


class StepLogits(LogitsProcessor):
    """Records the raw logits of rows `rows` of every decode step.

    Use: pass it in `generate(logits_processor=LogitsProcessorList([rec, ...]))`; after generation
    `rec.of(row, n)` is batch row `row`'s logits at its first `n` steps, `[n, V]` float32 (None for a
    row not kept)."""

    def __init__(self, rows: Sequence[int]):
        self.rows = [int(r) for r in rows]
        if len(set(self.rows)) != len(self.rows) or any(r < 0 for r in self.rows):
            raise ValueError(f"rows must be distinct indices >= 0, got {list(rows)}")
        self._index = torch.tensor(self.rows, dtype=torch.long)
        self._slot = {row: j for j, row in enumerate(self.rows)}  # batch row -> its place in a step's block
        self._steps: list[torch.Tensor] = []  # [len(rows), V] per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.rows:
            self._steps.append(scores.detach().index_select(0, self._index.to(scores.device)).float().cpu())
        return scores

    def of(self, row: int, n: int) -> torch.Tensor | None:
        """The logits of batch row `row` at its first `n` steps, `[n, V]` float32; None when the row
        was not kept."""
        if row not in self._slot:
            return None
        if not 0 <= n <= len(self._steps):
            raise ValueError(f"asked for {n} steps of {len(self._steps)} recorded")
        j = self._slot[row]
        if n == 0:  # [0, V]: concatenates with other samples' rows
            return torch.zeros((0, self._steps[0].shape[-1] if self._steps else 0), dtype=torch.float32)
        return torch.stack([s[j] for s in self._steps[:n]])
