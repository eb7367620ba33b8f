"""Sampling responses from the student with transformers, and the behaviour log-probs.

Old log-probs come from a separate forward pass of the sampling policy over the full sequence
(prompt + response), at the sampling temperature, never from generation scores: generation may
use kernels, caches or processors (top-p) that make its scores differ from the distribution the
learner's ratio is taken against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .batching import pack_sequences


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    truncated: bool


def stop_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if src is None:
            continue
        ids.update([src] if isinstance(src, int) else list(src))
    return ids


def cut_response(generated: Sequence[int], stop: set[int], max_new: int) -> tuple[list[int], bool]:
    """The response up to and including the first stop token; truncated if none within max_new."""
    out: list[int] = []
    for tok in list(generated)[:max_new]:
        out.append(int(tok))
        if int(tok) in stop:
            return out, False
    return out, True


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Sequence[int]], *, temperature: float, top_p: float,
             max_new_tokens: int, seed: int) -> list[Sample]:
    """One sampled response per prompt (repeat a prompt for several samples)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding for generation
        ids[i, L - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, L - len(p):] = 1
    stop = stop_ids(model, tokenizer)
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=temperature,
        top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, pad_token_id=pad,
        eos_token_id=sorted(stop) if stop else None,
    )
    samples = []
    for i, p in enumerate(prompts):
        response, truncated = cut_response(out[i, L:].tolist(), stop, max_new_tokens)
        if not response:  # cannot happen with max_new_tokens >= 1, kept for safety
            response, truncated = [pad], True
        samples.append(Sample(list(map(int, p)), response, truncated))
    return samples


@torch.no_grad()
def sequence_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                      temperature: float, pad_id: int) -> list[np.ndarray]:
    """log pi(x_t | x_<t) at every response token, from one forward pass over the full sequences."""
    device = next(model.parameters()).device
    packed = pack_sequences(prompts, responses, pad_id)
    logits = model(input_ids=packed.input_ids.to(device), attention_mask=packed.attention_mask.to(device)).logits
    flat = logits.reshape(-1, logits.shape[-1])[packed.positions.to(device)].float() / temperature
    lp = torch.log_softmax(flat, dim=-1).gather(1, packed.sampled_ids.to(device)[:, None])[:, 0].cpu().numpy()
    out, start = [], 0
    for r in responses:
        out.append(lp[start : start + len(r)].astype(np.float32))
        start += len(r)
    return out
