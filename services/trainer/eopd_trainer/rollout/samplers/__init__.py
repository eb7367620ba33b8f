"""The samplers of the rollout worker (`make_sampler(cfg)` picks one by `rollout.engine`; `auto`:
vLLM where the student's device is CUDA and vLLM is installed, else transformers, `resolve_engine`).

Old log-probs (`rollout.old_logprobs`) are the sampling policy's log-prob of each sampled token at
the sampling temperature over the whole vocabulary, never after top-p: recorded from the raw
logits of generate's steps (`generate`, the CPU default where a start-up probe agrees with the
forward pass), from a separate forward pass over the full sequence (`transformers`: exactly the
learner's computation), or vLLM's own (`vllm`, top-p 1 only).

The rollout worker talks to a `Sampler` (`base.py`):

- `TransformersSampler` (`transformers`, the default on CPU; `transformers_sampler.py`): `generate` with
  transformers, old log-probs recorded while sampling (`step_logprobs.py`) or from
  `sequence_logprobs` (decoder body once, then the output
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
    if cfg.rollout.old_logprobs == "generate" and engine != "transformers":
        raise SamplerUnavailable(f"rollout.old_logprobs=generate needs the transformers sampler, but rollout.engine="
                                 f"{cfg.rollout.engine} resolved to {engine}; use old_logprobs=vllm or transformers")
    if engine == "vllm":
        return VllmSampler.from_config(cfg)
    return TransformersSampler(cfg.student.model, dtype=cfg.student.dtype, device=cfg.student.device,
                               logprob_chunk_size=cfg.rollout.logprob_chunk_size,
                               kv_cache=resolve_kv_cache(cfg.rollout.kv_cache, cfg.student.device),
                               old_logprobs=cfg.rollout.old_logprobs, candidates=cfg.loss.num_candidates)
