"""The loss's per-token inputs: `LossInputs`, one type from `pack_rollouts` to the loss core.

`LossInputs` holds the flat `[N, ...]` or batched `[B, T, ...]` tensors the loss reads, under one
name each (the same names as `Rollout`'s per-token arrays, `teacher_entropies` included).
`LossInputs.flatten` checks their shapes against the leading shape and
flattens them to `[N]` / `[N, k]`. Which inputs are required depends on the variant: the teacher's
per-token scores only when it reads them (`Variant.needs_teacher_scores`; grpo does not, and they
are then never read), `old_logprobs` only with a policy-gradient term, `advantages` only with
`advantages_from == "given"`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossInputs:
    """Per-token inputs of the loss. Flat form: N tokens (the response tokens of a micro-batch);
    batched form: [B, T] (then `seq_index` is implied and must be None). None where absent.

    sampled_ids            [N] long     token x_t sampled by the behaviour policy (kd/gkd: or the teacher)
    old_logprobs           [N]          log pi_old(x_t); None only for variants without a pg term
    teacher_logprobs       [N]          log pi_te(x_t)
    teacher_entropies      [N]          the teacher's full-vocabulary entropy (nats)
    teacher_topk_ids       [N, k] long  S_t^k, the teacher's top-k ids
    teacher_topk_logprobs  [N, k]       log pi_te(v), v in S_t^k (-inf allowed: zero mass)
        (the four teacher fields may be None for a variant with `needs_teacher_scores` False: grpo)
    mask                   [N]          bool or 0/1 valid tokens; None: every token is valid
    seq_index              [N] long     the sequence of each token (flat form; "seq-mean-token-mean")
    candidate_ids          [N, m] long  the student's top-m ids per token, -1 filler (eopd_topk_rkl)
    candidate_logprobs     [N, m]       the teacher's log-probs at candidate_ids (NaN at filler)
    advantages             [N]          per-token advantages, for advantages_from "given" (grpo)
    teacher_logits         [N, V]       the teacher's full-vocabulary logits (its temperature, soft-capping and
                                        masking applied; -inf allowed) for support "full" (gkd, eopd_rkl), or a
                                        function `(rows [c] long, flat indices into N) -> [c, V]` building the
                                        rows on demand (e.g. from the teacher's hidden states and output head)

    Inputs at masked positions are never read (they may hold padding ids, NaN, -inf...).
    """

    sampled_ids: Tensor
    old_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    teacher_entropies: Tensor | None = None
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logprobs: Tensor | None = None
    mask: Tensor | None = None
    seq_index: Tensor | None = None
    candidate_ids: Tensor | None = None
    candidate_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    teacher_logits: Tensor | Callable[[Tensor], Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """N: the tokens of the flat form (B * T of the batched one)."""
        return int(self.sampled_ids.numel())

    def to(self, device) -> "LossInputs":
        """Every tensor moved to `device` (None stays None)."""
        return dataclasses.replace(self, **{f.name: t.to(device) if isinstance(t := getattr(self, f.name), Tensor)
                                            else t for f in dataclasses.fields(self)})

    def replace(self, **changes) -> "LossInputs":
        return dataclasses.replace(self, **changes)

    def flatten(self, variant, lead: tuple[int, ...], config=None) -> "LossInputs":
        """Checks shapes against the leading shape `lead` ([N] or [B, T]) and flattens to [N]: the
        mask made bool (all True when None), `seq_index` filled in for the batched form.

        Raises ValueError naming the field when one the variant needs is missing or misshapen;
        inputs it does not use are dropped unread (teacher scores for grpo, `advantages` for the
        variants that take A from the teacher, candidates for the variants without a top-k RKL
        are kept but never read; `teacher_logits` is required when `config` makes the variant's support
        "full")."""
        return _flatten(variant, lead, self, config)


def _flatten_candidates(lead: tuple[int, ...], cand_ids, cand_logprobs) -> tuple[Tensor | None, Tensor | None]:
    if cand_ids is None and cand_logprobs is None:
        return None, None
    if cand_ids is None or cand_logprobs is None:
        raise ValueError("candidate_ids and candidate_logprobs go together")
    for name, t in (("candidate_ids", cand_ids), ("candidate_logprobs", cand_logprobs)):
        if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead:
            raise ValueError(f"{name} must have shape {lead + ('m',)}, got {tuple(t.shape)}")
    if cand_ids.shape != cand_logprobs.shape:
        raise ValueError("candidate_ids and candidate_logprobs must have the same shape")
    m = cand_ids.shape[-1]
    return cand_ids.reshape(-1, m), cand_logprobs.reshape(-1, m)


def _flatten_teacher_logits(variant, lead: tuple[int, ...], x: LossInputs, config):
    if config is None or not variant.needs_teacher_logits(config):
        return None
    t = x.teacher_logits
    if t is None:
        raise ValueError(f"loss variant {variant.name!r} with loss.support='full' needs teacher_logits (the teacher's "
                         "full-vocabulary logits, from its final hidden states: hidden-state scores)")
    if callable(t) and not isinstance(t, Tensor):
        return t
    if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead:
        raise ValueError(f"teacher_logits must have shape {lead + ('V',)}, got {tuple(t.shape)}")
    return t.reshape(-1, t.shape[-1])


def _flatten(variant, lead: tuple[int, ...], x: LossInputs, config=None) -> LossInputs:
    if len(lead) not in (1, 2):
        raise ValueError(f"expected [N, ...] or [B, T, ...] inputs, got leading shape {lead}")
    name = variant.name
    device = x.sampled_ids.device
    mask = x.mask if x.mask is not None else torch.ones(lead, dtype=torch.bool, device=device)
    old_logprobs, advantages = x.old_logprobs, x.advantages
    teacher_logprobs, teacher_entropies = x.teacher_logprobs, x.teacher_entropies
    topk_ids, topk_logprobs = x.teacher_topk_ids, x.teacher_topk_logprobs
    per_token = [("sampled_ids", x.sampled_ids), ("mask", mask)]
    if variant.pg:
        if old_logprobs is None:
            raise ValueError(f"loss variant {name!r} needs old_logprobs (its clipped ratio is against them)")
    if old_logprobs is not None:
        per_token.append(("old_logprobs", old_logprobs))
    uses_teacher = variant.needs_teacher_scores
    if uses_teacher:
        missing = [n for n, t in (("teacher_logprobs", teacher_logprobs), ("teacher_entropies", teacher_entropies),
                                  ("teacher_topk_ids", topk_ids), ("teacher_topk_logprobs", topk_logprobs))
                   if t is None]
        if missing:
            raise ValueError(f"loss variant {name!r} needs the teacher's scores: {', '.join(missing)} missing")
        per_token += [("teacher_logprobs", teacher_logprobs), ("teacher_entropies", teacher_entropies)]
    else:
        teacher_logprobs = teacher_entropies = topk_ids = topk_logprobs = None
    if variant.advantages_from == "given":
        if advantages is None:
            raise ValueError(f"loss variant {name!r} needs advantages (per-token, e.g. group_advantages of the "
                             "rewards broadcast over each response's tokens)")
        per_token.append(("advantages", advantages))
    else:
        advantages = None
    for n, t in per_token:
        if tuple(t.shape) != lead:
            raise ValueError(f"{n} must have shape {lead}, got {tuple(t.shape)}")
    if uses_teacher:
        for n, t in (("teacher_topk_ids", topk_ids), ("teacher_topk_logprobs", topk_logprobs)):
            if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead or t.shape[-1] < 1:
                raise ValueError(f"{n} must have shape {lead + ('k',)} with k >= 1, got {tuple(t.shape)}")
        if topk_ids.shape != topk_logprobs.shape:
            raise ValueError("teacher_topk_ids and teacher_topk_logprobs must have the same shape")
    seq_index = x.seq_index
    if len(lead) == 2:
        if seq_index is not None:
            raise ValueError("seq_index is implied by batched [B, T] inputs; pass it only with flat [N] inputs")
        b, t = lead
        seq_index = torch.arange(b, device=device).repeat_interleave(t)
    elif seq_index is not None and tuple(seq_index.shape) != lead:
        raise ValueError(f"seq_index must have shape {lead}, got {tuple(seq_index.shape)}")
    cand_ids, cand_logprobs = _flatten_candidates(lead, x.candidate_ids, x.candidate_logprobs)

    def flat(t, extra=False):
        if t is None:
            return None
        return t.reshape(-1, t.shape[-1]) if extra else t.reshape(-1)

    return LossInputs(
        sampled_ids=x.sampled_ids.reshape(-1),
        old_logprobs=flat(old_logprobs),
        teacher_logprobs=flat(teacher_logprobs),
        teacher_entropies=flat(teacher_entropies),
        teacher_topk_ids=flat(topk_ids, True),
        teacher_topk_logprobs=flat(topk_logprobs, True),
        mask=mask.reshape(-1) != 0,
        seq_index=flat(seq_index),
        candidate_ids=cand_ids,
        candidate_logprobs=cand_logprobs,
        advantages=flat(advantages),
        teacher_logits=_flatten_teacher_logits(variant, lead, x, config),
    )


def check_valid_inputs(vocab: int, dtype: torch.dtype, *, sampled: Tensor, per_token: dict[str, Tensor | None],
                       topk_ids: Tensor | None, topk_logprobs: Tensor | None, topk_finite: Tensor | None) -> None:
    """Raises ValueError, naming the tensor and its number of bad valid positions, on out-of-range
    ids, non-finite per-token inputs (`per_token`: name -> [M] values at the valid tokens, None
    when absent), or NaN / +inf teacher top-k log-probs (-inf is allowed there: an absent
    candidate). The per-token tensors are checked in the compute dtype, so values that overflow
    it count as non-finite. One device-to-host sync for all checks."""
    names = [n for n, t in per_token.items() if t is not None]
    zero = sampled.new_zeros(())
    has_topk = topk_ids is not None
    counts = torch.stack([
        ((sampled < 0) | (sampled >= vocab)).sum(),
        (topk_finite & ((topk_ids < 0) | (topk_ids >= vocab))).sum() if has_topk else zero,
        *[(~torch.isfinite(per_token[n])).sum() for n in names],
        (torch.isnan(topk_logprobs) | (topk_logprobs == torch.inf)).sum() if has_topk else zero,
    ]).tolist()
    if not any(counts):
        return
    kind = {torch.float32: "float32", torch.float64: "float64"}.get(dtype, str(dtype))
    messages = []
    for name, n in zip(("sampled_ids", "teacher_topk_ids"), counts[:2]):
        if n:
            messages.append(f"{name} has {n} id(s) out of range [0, {vocab}) at valid positions")
    for name, n in zip(names, counts[2:-1]):
        if n:
            messages.append(f"{name} has {n} non-finite value(s) (NaN, +-inf, or beyond the {kind} range) "
                            "at valid positions")
    if counts[-1]:
        messages.append(f"teacher_topk_logprobs has {counts[-1]} NaN or +inf value(s) at valid positions "
                        "(-inf, an absent candidate, is allowed)")
    raise ValueError("; ".join(messages))


def candidates(variant, tokens: LossInputs, valid: Tensor, vocab: int, dtype: torch.dtype,
               config) -> tuple[Tensor, Tensor, Tensor] | None:
    """For a divergence over the student's top-k (`variant.needs_candidates(config)`): the valid
    tokens' candidate ids `[M, m]` (filler made 0), the teacher's log-probs there `[M, m]` and which
    candidates count `[M, m]` (an id, not -1 filler, with a finite teacher log-prob); None otherwise."""
    name = config.variant
    if not variant.needs_candidates(config):
        return None
    if tokens.candidate_ids is None:
        raise ValueError(f"loss variant {name!r} needs candidate_ids and candidate_logprobs (the student's top-k "
                         "ids at each position and the teacher's log-probs there)")
    ids = tokens.candidate_ids[valid].long()
    t_lp = tokens.candidate_logprobs[valid].detach().to(dtype)
    out_of_range = int(((ids < -1) | (ids >= vocab)).sum())
    if out_of_range:
        raise ValueError(f"candidate_ids has {out_of_range} id(s) out of range [0, {vocab}) (-1 is filler) at valid positions")
    ok = (ids >= 0) & torch.isfinite(t_lp)
    return torch.where(ok, ids, 0), t_lp, ok
