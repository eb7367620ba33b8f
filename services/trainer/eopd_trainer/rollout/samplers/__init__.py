"""The samplers of the rollout worker (`make_sampler(cfg)` picks one by `rollout.engine`).

Old log-probs come from a separate forward pass of the sampling policy over the full sequence
(prompt + response), at the sampling temperature, never from generation scores: generation may
use kernels, caches or processors (top-p) that make its scores differ from the distribution the
learner's ratio is taken against.

The rollout worker talks to a `Sampler` (`base.py`):

- `TransformersSampler` (`transformers`, the default; `transformers_sampler.py`): `generate` with
  transformers, old log-probs from `sequence_logprobs` (decoder body once, then the output
  projection in chunks of `rollout.logprob_chunk_size` response positions: no
  `[batch, seq, vocab]` logits), weights reloaded into the module in place;
- `VllmSampler` (`vllm`, in `vllm_sampler.py`, which imports vLLM only when the engine starts):
  vLLM samples, old log-probs by default from the same transformers forward pass (see that module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Sampler
from .transformers_sampler import TransformersSampler
from .vllm_sampler import VllmSampler  # imports vLLM itself only when the engine starts

if TYPE_CHECKING:
    from ...config import RunConfig


def make_sampler(cfg: RunConfig) -> Sampler:
    """The sampler of `rollout.engine` for the run's student."""
    if cfg.rollout.engine == "vllm":
        return VllmSampler.from_config(cfg)
    return TransformersSampler(cfg.student.model, dtype=cfg.student.dtype, device=cfg.student.device,
                               logprob_chunk_size=cfg.rollout.logprob_chunk_size)
