"""Prefill of prompts that share tokens: each shared token runs through the model once instead of
once per row (the student's `generate` and evaluation, the teacher's scoring).

A batch of prompts to sample from usually shares a lot: every prompt starts with the same chat
template (the default preset's first 35 tokens, of 54-68), and each prompt is repeated once per
sample (an evaluation's 4 answers per problem, a rollout's 2). `prefill` runs

1. the tokens every prompt starts with (`common_prefix_length`) once, as a batch of one row;
2. the rest of each *distinct* prompt once, on top of that KV cache copied to each distinct prompt;

and returns the KV cache copied to every row, over all but each row's last prompt token, for
`model.generate` to continue from (it runs the last token and samples), or for `response_hidden`
to run the responses on (the final hidden states that predict each response token: the teacher's
statistics, the evaluation's entropies and KL). Only the decoder runs (no output projection over
prompt positions). Rows are laid out `[prefix | left padding | rest of the prompt]`, the attention
mask zero on the padding, and the positions counted over the mask (0, 1, ... over each row's own
tokens), as generate counts them: each token attends to exactly the tokens it attends to in the
left-padded layout, at the same positions.
So the logits are those of the plain prefill up to float rounding (~1e-6 in fp32: other matrix
shapes), and generate draws the same random numbers.

Both functions run under the caller's grad mode: under `torch.no_grad` to sample and score, with
autograd in the learner (the prefix's keys and values, computed once, get the gradient of every
row that attends to them, as in the plain pass).

Shapes: prompts B rows, L columns after the layout, p the common prefix, U distinct prompts; the
cache returned holds [B, heads, L - 1, head_dim] keys and values per layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Prefilled:
    """What `generate` continues from: the laid-out batch and its KV cache over `L - 1` columns."""

    input_ids: torch.Tensor  # [B, L]: prefix | left padding | rest of each prompt
    attention_mask: torch.Tensor  # [B, L]: 0 on the padding
    cache: Any  # the model's KV cache over the first L - 1 columns, B rows
    cache_kwarg: str  # the name the model's forward and generate take it by ("cache", "past_key_values")
    prefix_tokens: int  # p: the tokens run once for the whole batch
    distinct_prompts: int  # U: the rows the rest of the prompts ran on


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """The number of leading tokens every prompt has in common, at most the shortest prompt's
    length minus one (each row keeps one token of its own for generate to run)."""
    shortest = min(len(p) for p in prompts)
    first = prompts[0]
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def layout(prompts: Sequence[Sequence[int]], prefix: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, L]` ids and attention mask: the first `prefix` tokens (shared), then each prompt's
    remaining tokens left-padded to the longest, L = prefix + the longest remainder."""
    rest = max(len(p) for p in prompts) - prefix
    ids = torch.full((len(prompts), prefix + rest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, :prefix] = torch.tensor(list(p[:prefix]), dtype=torch.long)
        mask[i, :prefix] = 1
        tail = list(p[prefix:])
        ids[i, prefix + rest - len(tail):] = torch.tensor(tail, dtype=torch.long)
        mask[i, prefix + rest - len(tail):] = 1
    return ids, mask


def cache_kwarg(decoder) -> str | None:
    """The keyword the decoder's forward takes its KV cache by, or None when it cannot be given one
    with explicit positions (then nothing is shared)."""
    params = inspect.signature(decoder.forward).parameters
    if "position_ids" not in params:
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position among its row's unmasked tokens, as generate computes them (padding: 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def shares(prompts: Sequence[Sequence[int]]) -> bool:
    """Whether any token is shared: two or more prompts with a common prefix or a repeated prompt, at
    least one of two or more tokens (each row's last token is not prefilled)."""
    if len(prompts) < 2 or max(len(p) for p in prompts) < 2:
        return False
    return common_prefix_length(prompts) > 0 or len({tuple(p) for p in prompts}) < len(prompts)


def prefill(model, prompts: Sequence[Sequence[int]], pad_id: int, device) -> Prefilled | None:
    """The KV cache of `prompts` laid out as above (see the module docstring), or None when no token
    is shared (no common prefix and every prompt distinct) or the model takes no cache by keyword."""
    decoder = model.get_decoder()
    kw = cache_kwarg(decoder)
    if kw is None:
        return None
    if not shares(prompts):
        return None
    prefix = common_prefix_length(prompts)
    keys = [tuple(p) for p in prompts]
    distinct = list(dict.fromkeys(keys))
    ids, mask = layout(prompts, prefix, pad_id)
    end = ids.shape[1] - 1  # generate runs the last column
    row_of = {k: i for i, k in enumerate(distinct)}
    first_row = [keys.index(k) for k in distinct]
    u_ids, u_mask = ids[first_row].to(device), mask[first_row].to(device)
    u_pos = positions(u_mask)
    cache = None
    if prefix:
        out = decoder(input_ids=u_ids[:1, :prefix], attention_mask=u_mask[:1, :prefix],
                      position_ids=u_pos[:1, :prefix], use_cache=True)
        cache = getattr(out, kw)
        cache.batch_repeat_interleave(len(distinct))
    if end > prefix:
        out = decoder(input_ids=u_ids[:, prefix:end], attention_mask=u_mask[:, :end],
                      position_ids=u_pos[:, prefix:end], use_cache=True, **({kw: cache} if cache is not None else {}))
        cache = getattr(out, kw)
    cache.batch_select_indices(torch.tensor([row_of[k] for k in keys], device=device))
    return Prefilled(ids.to(device), mask.to(device), cache, kw, prefix, len(distinct))


def work_tokens(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The padded tokens one pass over prompt + response runs (`[B, W]`), and those `response_hidden`
    runs: where any token is shared (`shares`), the prefix once, each distinct prompt's rest once,
    each response with the last prompt token; else the same plain pass. Pure; what a scheduler
    compares with its step size."""
    plain = len(prompts) * max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    if not shares(prompts):
        return plain, plain
    prefix = common_prefix_length(prompts)
    distinct = {tuple(p) for p in prompts}
    rest = max(len(p) for p in prompts) - prefix - 1
    return plain, prefix + len(distinct) * rest + len(prompts) * max(len(r) for r in responses)


def response_hidden(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                    device, *, share: bool = True) -> torch.Tensor:
    """The decoder's final hidden states `[N, D]` at the positions predicting each response token
    (N = all response tokens, in response order: for each sequence, its last prompt token and every
    response token but the last), as one forward pass over the right-padded prompt + response gives
    them, with the prompts' shared tokens run once (`prefill`; `share` False, or nothing shared: that
    one plain pass). Every prompt and response needs at least one token."""
    if any(len(p) < 1 for p in prompts) or any(len(r) < 1 for r in responses):
        raise ValueError("response_hidden needs at least one prompt token and one response token per sequence")
    decoder = model.get_decoder()
    done = prefill(model, prompts, pad_id, device) if share else None
    if done is None:
        width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            ids[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
            mask[i, : len(p) + len(r)] = 1
        hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        rows = torch.cat([torch.full((len(r),), i, dtype=torch.long) for i, r in enumerate(responses)])
        cols = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(prompts, responses, strict=True)])
        return hidden[rows.to(device), cols.to(device)]
    width = max(len(r) for r in responses)
    cont = torch.full((len(responses), width), pad_id, dtype=torch.long)  # last prompt token + response[:-1]
    cont_mask = torch.zeros_like(cont)
    cont[:, 0], cont_mask[:, 0] = done.input_ids[:, -1].cpu(), 1
    for i, r in enumerate(responses):
        cont[i, 1 : len(r)] = torch.tensor(list(r[:-1]), dtype=torch.long)
        cont_mask[i, : len(r)] = 1
    mask = torch.cat([done.attention_mask[:, :-1], cont_mask.to(device)], dim=1)
    out = decoder(input_ids=cont.to(device), attention_mask=mask, position_ids=positions(mask)[:, -width:],
                  use_cache=True, **{done.cache_kwarg: done.cache})
    return out.last_hidden_state[cont_mask.to(device).bool()]
