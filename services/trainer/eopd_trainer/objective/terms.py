"""Per-token loss terms and the aggregation weights: pure functions on small tensors.

All tensors here are per valid token (M of them) or per gathered token (G of them, with k teacher
candidates each); nothing here is of vocabulary size. Inputs at masked positions never reach these
functions (the caller selects the valid tokens first), so they need no masking of their own.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_pg_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate of on-policy distillation (paper eq. 7).

    `r = exp(logp - old_logp)`, `loss_t = max(-r * A, -clip(r, 1 - clip_low, 1 + clip_high) * A)`.

    Args:
        logp: [M] student log-prob of the sampled token under the current parameters (grad flows).
        old_logp: [M] behaviour-policy log-prob of the same token (no grad).
        advantages: [M] advantages (detached by the caller).
    Returns:
        `(loss_t [M], ratio [M], clipped [M] bool)`; `clipped` is where the clipped branch is the
        strictly larger one, i.e. where the token's gradient is cut off.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return torch.maximum(unclipped, clipped), ratio, clipped > unclipped


def teacher_topk_distribution(teacher_topk_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher's top-k renormalised: `p~ = softmax(teacher_topk_logprobs)` over the k entries.

    Entries at -inf get probability 0; a row whose k entries are all -inf gets all zeros (and so
    an FKL of 0) instead of NaN.

    Args:
        teacher_topk_logprobs: [G, k].
    Returns:
        `(p [G, k], log_p [G, k])`, with `log_p = -inf` where `p = 0`.
    """
    lse = torch.logsumexp(teacher_topk_logprobs, dim=-1, keepdim=True)
    finite_row = torch.isfinite(lse)
    log_p = torch.where(finite_row, teacher_topk_logprobs - torch.where(finite_row, lse, 0.0), -torch.inf)
    return log_p.exp(), log_p


def topk_forward_kl(student_logp_topk: Tensor, teacher_topk_logprobs: Tensor) -> Tensor:
    """Forward KL over the teacher's top-k, renormalised (paper eq. 11).

    `FKL = sum_{x in S_k} p~(x) * (log p~(x) - log pi_theta(x))`, where `log pi_theta` is the
    student's full-vocabulary log-softmax gathered at the teacher's ids (not renormalised over S_k).

    Args:
        student_logp_topk: [G, k] student log-probs at the teacher's top-k ids (grad flows).
        teacher_topk_logprobs: [G, k] teacher log-probs of its top-k (may contain -inf).
    Returns:
        [G] per-token forward KL (>= 0 up to the student mass outside S_k; 0 for empty rows).
    """
    p, log_p = teacher_topk_distribution(teacher_topk_logprobs)
    terms = torch.where(p > 0, p * (log_p - student_logp_topk), 0.0)
    return terms.sum(dim=-1)


def shaped_advantages(advantages: Tensor, entropy: Tensor, alpha: float, kappa: float) -> Tensor:
    """Entropy advantage shaping (Cheng et al.; paper app. A): `A + min(alpha * H, |A| / kappa)`.

    Args:
        advantages: [M] advantages (detached).
        entropy: [M] the student's entropy at each token (detached here).
    Returns:
        [M] shaped advantages, detached.
    """
    bonus = torch.minimum(alpha * entropy.detach(), advantages.abs() / kappa)
    return (advantages + bonus).detach()


def aggregation_weights(
    mode: str, num_tokens: int, seq_index: Tensor | None, denominator: float | None, *, device, dtype,
    sum_divisor: float = 1.0,
) -> Tensor:
    """Weights `w [M]` such that the aggregated loss is `sum_t w_t * loss_t` over valid tokens.

    * "token-mean": `w_t = 1 / n`, n = `denominator` if given (e.g. the valid tokens of a whole
      mini-batch split into micro-batches), else the M valid tokens here (Algorithm 1).
    * "seq-mean-token-mean": `w_t = 1 / (n_tokens(seq(t)) * S)`: mean over each sequence's valid
      tokens, then mean over the S sequences that have at least one valid token (S = `denominator`
      if given, for micro-batching). Needs `seq_index [M]`, the sequence of each valid token.
    * "token-sum": `w_t = 1 / sum_divisor`, a constant whatever the token count (`denominator`, if
      given, replaces it: the divisor scaled for micro-batching).

    With no valid token the weights are empty (the loss is then an exact, gradient-carrying 0).
    """
    if num_tokens == 0:
        return torch.zeros(0, device=device, dtype=dtype)
    if mode == "token-mean":
        n = float(denominator) if denominator is not None else float(num_tokens)
        return torch.full((num_tokens,), 1.0 / n, device=device, dtype=dtype)
    if mode == "token-sum":
        n = float(denominator) if denominator is not None else float(sum_divisor)
        return torch.full((num_tokens,), 1.0 / n, device=device, dtype=dtype)
    if mode == "seq-mean-token-mean":
        if seq_index is None:
            raise ValueError("seq-mean-token-mean needs seq_index (or batched [B, T] inputs)")
        _, inverse, counts = torch.unique(seq_index, return_inverse=True, return_counts=True)
        n_seq = float(denominator) if denominator is not None else float(counts.numel())
        return 1.0 / (counts[inverse].to(dtype) * n_seq)
    raise ValueError(f"unknown aggregation mode {mode!r}")


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float) -> Tensor:
    """GRPO's group-normalised advantages (Shao et al.; TRL GRPOTrainer, scale_rewards="group").

    `A_i = (r_i - mean_g) / (std_g + eps)` over the responses i of group g = group_ids[i] (the
    samples of one prompt), with `std_g` the sample standard deviation (Bessel-corrected, n - 1),
    as TRL computes it with `torch.Tensor.std`. A group of one response (where that std is
    undefined) and a group whose rewards are all equal get exactly 0.

    Args:
        rewards: [B] float, one scalar reward per response (finite).
        group_ids: [B] integer, any ids (need not be contiguous or sorted).
        eps: > 0, added to the std (TRL: 1e-4; `LossConfig.grpo_eps`).
    Returns:
        [B] advantages, in the rewards' dtype (float32 for integer rewards), computed in fp64, no grad.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [B], got {tuple(rewards.shape)}")
    if tuple(group_ids.shape) != tuple(rewards.shape):
        raise ValueError(f"group_ids must have shape {tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    r = rewards.detach().to(torch.float64)
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    bad = int((~torch.isfinite(r)).sum())
    if bad:
        raise ValueError(f"rewards has {bad} non-finite value(s)")
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(torch.float64)
    mean = torch.zeros_like(n).index_add_(0, inv, r) / n
    dev = r - mean[inv]
    var = torch.zeros_like(n).index_add_(0, inv, dev * dev) / (n - 1.0).clamp(min=1.0)
    adv = dev / (var.sqrt()[inv] + eps)
    hi = torch.full_like(n, -torch.inf).scatter_reduce(0, inv, r, "amax")
    lo = torch.full_like(n, torch.inf).scatter_reduce(0, inv, r, "amin")
    degenerate = (counts < 2) | (hi == lo)  # [G]: std undefined, or every reward equal
    return torch.where(degenerate[inv], 0.0, adv).to(out_dtype)
