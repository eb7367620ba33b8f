"""The sampling policy's log-prob of each token `generate` samples, recorded during generation
(`rollout.old_logprobs: generate`): no second forward pass over the sampled sequences.

`StepLogprobs` is a transformers `LogitsProcessor` that leaves the scores untouched. `generate`
runs the processors it is given before its sampling warpers (temperature, top-p), so the scores it
sees are the model's raw next-token logits `[B, V]`: it keeps them (divided by the temperature, as
the learner's ratio is taken), and at the next step, when the token sampled from them is the last
column of `input_ids`, it gathers that token's log-prob (`z[tok] - logsumexp(z)`) and, when asked,
the step's top-`k` ids (the per-position candidates of the eopd_topk_rkl loss). One `[B, V]` float32
block is alive at a time, never `[steps, B, V]`. `finish` settles the last step with the tokens
`generate` returned.

The values are the decode steps' (a KV cache, left padding), which agree with a full forward pass
over the sequence to ~1e-5 in fp32 (not in bf16): `TransformersSampler` checks that agreement once at
start (`rollout.old_logprobs: auto` falls back to the forward pass where it fails)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessor


class StepLogprobs(LogitsProcessor):
    """Records, per sequence of a `generate` batch, log pi(x_t | x_<t) at `temperature` of every
    sampled token, and (`top_k` > 0) the top-`top_k` ids at every step.

    Use: pass it in `generate(logits_processor=LogitsProcessorList([rec]))`, then `rec.finish(out)`
    with the returned ids `[B, L + steps]`; `rec.logprobs` is then `[B, steps]` float32 and
    `rec.top_ids` `[B, steps, top_k]` int32 (None without top_k)."""

    def __init__(self, temperature: float, top_k: int = 0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self._z: torch.Tensor | None = None  # [B, V] the last step's logits / temperature, not yet settled
        self._lp: list[torch.Tensor] = []  # [B] per settled step
        self._top: list[torch.Tensor] = []  # [B, k] per step
        self.logprobs: np.ndarray | None = None
        self.top_ids: np.ndarray | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._settle(input_ids[:, -1])
        z = scores.detach().float() / self.temperature
        if self.top_k:
            self._top.append(torch.topk(z, min(self.top_k, z.shape[-1]), dim=-1, sorted=True).indices.to(torch.int32).cpu())
        self._z = z
        return scores

    def _settle(self, tokens: torch.Tensor) -> None:
        """The log-prob of `tokens` [B] (sampled from the kept step's scores) under those scores."""
        if self._z is None:
            return
        z = self._z
        self._lp.append((z.gather(1, tokens[:, None].to(z.device))[:, 0] - torch.logsumexp(z, dim=-1)).cpu())
        self._z = None

    def finish(self, sequences: torch.Tensor) -> None:
        """Settles the last step with the ids `generate` returned (`[B, L + steps]`) and sets
        `logprobs` `[B, steps]` (and `top_ids`)."""
        self._settle(sequences[:, -1])
        steps = len(self._lp)
        self.logprobs = (torch.stack(self._lp, dim=1).numpy().astype(np.float32) if steps
                         else np.zeros((sequences.shape[0], 0), np.float32))
        if self.top_k:
            self.top_ids = (torch.stack(self._top, dim=1).numpy() if steps
                            else np.zeros((sequences.shape[0], 0, self.top_k), np.int32))
