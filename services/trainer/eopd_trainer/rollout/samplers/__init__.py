"""The samplers of the rollout worker (`make_sampler(cfg)` picks one by `rollout.engine`; `auto`:
vLLM where the student's device is CUDA and vLLM is installed, else transformers, `resolve_engine`).

Old log-probs come from a separate forward pass of the sampling policy over the full sequence
(prompt + response), at the sampling temperature, never from generation scores: generation may
use kernels, caches or processors (top-p) that make its scores differ from the distribution the
learner's ratio is taken against.

The rollout worker talks to a `Sampler` (`base.py`):

- `TransformersSampler` (`transformers`, the default on CPU; `transformers_sampler.py`): `generate` with
  transformers, old log-probs from `sequence_logprobs` (decoder body once, then the output
  projection in chunks of `rollout.logprob_chunk_size` response positions: no
  `[batch, seq, vocab]` logits), weights reloaded into the module in place;
- `VllmSampler` (`vllm`, in `vllm_sampler.py`, which imports vLLM only when the engine starts):
  vLLM samples, old log-probs by default from the same transformers forward pass (see that module).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from .base import Sampler, SamplerUnavailable
from .transformers_sampler import TransformersSampler
from .vllm_sampler import VllmSampler  # imports vLLM itself only when the engine starts

if TYPE_CHECKING:
    from ...config import RunConfig


def resolve_engine(engine: str, device: str, vllm_installed: bool) -> str:
    """`rollout.engine` made concrete: `auto` is vLLM on a CUDA student with vLLM installed, else
    transformers (pure: the caller says whether vLLM is installed)."""
    if engine != "auto":
        return engine
    return "vllm" if device.startswith("cuda") and vllm_installed else "transformers"


def resolve_kv_cache(kv_cache: str, device: str) -> str:
    """`rollout.kv_cache` made concrete: `auto` is static on CUDA (transformers compiles the decode
    step of a static cache there), dynamic on CPU."""
    if kv_cache != "auto":
        return kv_cache
    return "static" if device.startswith("cuda") else "dynamic"


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_sampler(cfg: RunConfig) -> Sampler:
    """The sampler of `rollout.engine` for the run's student."""
    installed = vllm_installed()
    engine = resolve_engine(cfg.rollout.engine, cfg.student.device, installed)
    if cfg.rollout.old_logprobs == "vllm" and engine != "vllm":
        raise SamplerUnavailable(f"rollout.old_logprobs=vllm needs vLLM, but rollout.engine={cfg.rollout.engine} resolved to "
                                 f"{engine} (student.device={cfg.student.device}, vLLM installed: {installed})")
    if engine == "vllm":
        return VllmSampler.from_config(cfg)
    return TransformersSampler(cfg.student.model, dtype=cfg.student.dtype, device=cfg.student.device,
                               logprob_chunk_size=cfg.rollout.logprob_chunk_size,
                               kv_cache=resolve_kv_cache(cfg.rollout.kv_cache, cfg.student.device))
