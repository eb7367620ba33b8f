"""The sampler interface of the rollout worker: `Sample`, the `Sampler` protocol,
`SamplerUnavailable`, and the stop-token helpers both samplers share (`stop_ids`, `cut_response`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from eopd_common.models import eos_token_ids

if TYPE_CHECKING:
    from ...queue.messages import PolicyVersion


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    truncated: bool
    # The sampler's own log-prob of each response token (vLLM, and transformers with
    # rollout.old_logprobs generate); None otherwise.
    logprobs: np.ndarray | None = None
    # The policy's top-k ids [n, k] at each response token, recorded while sampling (transformers with
    # rollout.old_logprobs generate and a loss with per-position candidates); None otherwise.
    top_ids: np.ndarray | None = None
    # The model's raw next-token logits at each response position [n, V] float32, recorded while
    # sampling for the rows `generate` was asked to keep (`keep_logits`, eopd eval); None otherwise.
    logits: torch.Tensor | None = None


def stop_ids(model, tokenizer) -> set[int]:
    """The student's stop tokens: the EOS ids of its generation config and of its tokenizer."""
    return set(eos_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id))


def cut_response(generated: Sequence[int], stop: set[int], max_new: int) -> tuple[list[int], bool]:
    """The response up to and including the first stop token; truncated if none within max_new."""
    out: list[int] = []
    for tok in list(generated)[:max_new]:
        out.append(int(tok))
        if int(tok) in stop:
            return out, False
    return out, True


class SamplerUnavailable(RuntimeError):
    """The configured rollout engine cannot run in this environment (e.g. vLLM not installed)."""


class Sampler(Protocol):
    """What the rollout worker needs from a sampling engine. Calls come from one thread at a time."""

    engine: str  # "transformers" or "vllm"
    tokenizer: Any

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, temperature: float, top_p: float,
               max_new_tokens: int) -> list[Sample]:
        """One response per prompt (repeat a prompt for several samples); `seeds[i]` seeds prompt i
        (the transformers sampler seeds the whole batch with `seeds[0]`)."""
        ...

    def old_logprobs(self, samples: Sequence[Sample], *, temperature: float) -> list[np.ndarray]:
        """log pi_old(token | prefix) at every response token, at `temperature`, as the learner computes it."""
        ...

    def old_logprobs_topk(self, samples: Sequence[Sample], *, temperature: float, k: int
                          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`old_logprobs` and the policy's top-`k` ids `[n, k]` at each response token, from the same
        pass (the per-position candidates of the eopd_topk_rkl loss)."""
        ...

    def load_weights(self, pv: PolicyVersion) -> None:
        """Loads an announced policy version in place (sha256 verified); no restart."""
        ...

    def load_state(self, pv: PolicyVersion, tensors: dict[str, torch.Tensor]) -> None:
        """Loads `pv`'s tensors, received by this worker (weight_sync: broadcast), in place; ValueError,
        the model untouched, when they are not the student's."""
        ...

    def close(self) -> None: ...
