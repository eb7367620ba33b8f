"""Divergences between two distributions over a named support: pure tensor functions.

Three supports (`LossConfig.support`): the teacher's top-k ids, the student's top-k ids (the
per-position candidates), or the full vocabulary. Over a partial support S the mass outside it is
one more outcome on both sides, the tail bucket,

    log q_tail = log(1 - sum_{v in S} q(v)),   log p_tail = log(1 - sum_{v in S} p(v)),

so the divergence compares two proper distributions over |S| + 1 outcomes: it is >= 0 and 0 only
where the two agree on S (and hence on the tail). Without the tail, `sum_S q (log q - log p)` is not
a divergence: a student lowers it by moving its mass off S (issue 48; verl issue 7856).

The divergence is TRL's generalized Jensen-Shannon divergence (`GKDTrainer.generalized_jsd_loss`,
Agarwal et al. eq. 1), with `p` the teacher and `q` the student:

    beta = 0:      KL(p || q) = sum p (log p - log q)                 (forward KL)
    beta = 1:      KL(q || p) = sum q (log q - log p)                 (reverse KL)
    0 < beta < 1:  beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q

(as TRL defines it, the mixture's value tends to 0, not to the forward KL, as beta -> 0; beta = 0
is the forward KL by definition). Outcomes with zero probability on the left of a KL add nothing;
log-probs may be -inf (an id the teacher masks, a padded vocabulary entry).

`full_vocab_divergence` is the full-vocabulary form: student and teacher logits in chunks of rows,
each chunk recomputed in backward (activation checkpointing), so no `[N, V]` log-prob tensor of
either side is kept for the backward pass; the teacher's side may be a function that builds a chunk
of rows on demand (e.g. from its final hidden states and output projection), so `[N, V]` teacher
logits need never exist.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

#: A `[N, V]` logits tensor, or a function `(start, end) -> [end - start, V]` logits of rows start..end.
RowSource = Tensor | Callable[[int, int], Tensor]


def check_beta(beta: float) -> float:
    """`beta` as a float in [0, 1]; ValueError naming it otherwise."""
    beta = float(beta)
    if not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    return beta


def _kl_sum(log_left: Tensor, log_right: Tensor, keep: Tensor) -> Tensor:
    """`sum_{keep, left > 0} left (log left - log right)` over the last dim; NaN-free gradients
    where `left` is 0 (its entries are replaced by 0 before any arithmetic)."""
    ok = keep & (log_left > -torch.inf)
    a = torch.where(ok, log_left, 0.0)
    b = torch.where(ok, log_right, 0.0)
    return torch.where(ok, a.exp() * (a - b), 0.0).sum(dim=-1)


def generalized_jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float,
                    keep: Tensor | None = None) -> Tensor:
    """TRL's generalized JSD between two distributions over the same K outcomes.

    Args:
        student_logp: [..., K] log q (grad flows), a distribution over the K outcomes (may hold -inf).
        teacher_logp: [..., K] log p, the same outcomes (may hold -inf).
        beta: in [0, 1]: 0 forward KL(p || q), 1 reverse KL(q || p), between the mixture (see module).
        keep: [..., K] bool, the outcomes that exist (others are left out: both sides must have zero
            mass there); None: all.
    Returns:
        [...] the divergence per row, >= 0 (up to rounding), 0 where q = p.
    """
    beta = check_beta(beta)
    if keep is None:
        keep = torch.ones_like(student_logp, dtype=torch.bool)
    keep = keep & ((student_logp > -torch.inf) | (teacher_logp > -torch.inf))
    if beta == 0.0:
        return _kl_sum(teacher_logp, student_logp, keep)
    if beta == 1.0:
        return _kl_sum(student_logp, teacher_logp, keep)
    ls = torch.where(keep, student_logp, 0.0)
    lt = torch.where(keep, teacher_logp, 0.0)
    log_mix = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * _kl_sum(lt, log_mix, keep) + (1.0 - beta) * _kl_sum(ls, log_mix, keep)


def log1mexp(x: Tensor) -> Tensor:
    """`log(1 - exp(x))` for x <= 0, stably (Maechler 2012: expm1 near 0, log1p far from it)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def log_tail(logp: Tensor, valid: Tensor) -> Tensor:
    """The log of the mass outside a support: `log(1 - sum_{valid} exp(logp))`, stably.

    Args:
        logp: [..., k] full-distribution log-probs at the support's ids (grad flows).
        valid: [..., k] bool, which entries belong to the support (distinct ids).
    Returns:
        [...] log tail mass: 0 for an empty support; about `log(eps)` of the dtype (never -inf or
        NaN) when the support holds all the mass up to rounding.
    """
    has = valid.any(dim=-1, keepdim=True)
    inside = torch.where(valid, logp, -torch.inf)
    lse = torch.logsumexp(torch.where(has, inside, 0.0), dim=-1)
    tiny = torch.finfo(logp.dtype).eps
    lse = lse.clamp(max=math.log1p(-tiny))  # rounding may put the support's mass at or above 1
    return torch.where(has.squeeze(-1), log1mexp(lse), 0.0)


def support_divergence(student_logp: Tensor, teacher_logp: Tensor, valid: Tensor, beta: float) -> Tensor:
    """The generalized JSD over a partial support plus its tail bucket.

    Args:
        student_logp: [M, k] the student's full-vocabulary log-probs at the support's ids (grad flows).
        teacher_logp: [M, k] the teacher's full-vocabulary log-probs at the same ids (no grad needed;
            anything where not `valid`).
        valid: [M, k] bool, the support's real entries (distinct ids, finite teacher log-prob).
        beta: 0 forward KL, 1 reverse KL, between TRL's mixture.
    Returns:
        [M] `generalized_jsd` over the k + 1 outcomes (support, tail); >= 0, 0 where the student's
        and teacher's log-probs agree on the support; 0 for a row without a valid entry.
    """
    s = torch.where(valid, student_logp, -torch.inf)
    t = torch.where(valid, teacher_logp, -torch.inf)
    s_all = torch.cat([s, log_tail(student_logp, valid).unsqueeze(-1)], dim=-1)
    t_all = torch.cat([t, log_tail(torch.where(valid, teacher_logp, 0.0), valid).unsqueeze(-1)], dim=-1)
    keep = torch.cat([valid, valid.any(dim=-1, keepdim=True)], dim=-1)
    return generalized_jsd(s_all, t_all, beta, keep)


def _rows(source: RowSource, start: int, end: int) -> Tensor:
    return source(start, end) if callable(source) else source[start:end]


def _work_dtype(student: Tensor) -> torch.dtype:
    """The divergences' arithmetic: float64 for float64 students, else float32."""
    return torch.float64 if student.dtype == torch.float64 else torch.float32


def _log_probs(student: Tensor, teacher: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    return torch.log_softmax(student.to(_work_dtype(student)) / temperature, dim=-1), _teacher_logp(teacher, student)


def _teacher_logp(teacher: Tensor, student: Tensor) -> Tensor:
    return torch.log_softmax(teacher.to(_work_dtype(student)), dim=-1)


def _constant_rows(source: RowSource, start: int, end: int, vocab: int) -> Callable[[], Tensor]:
    """The teacher's rows start..end as a constant, built on each call (forward, then backward)."""
    def rows() -> Tensor:
        t = _rows(source, start, end).detach()
        if t.shape != (end - start, vocab):
            raise ValueError(f"student and teacher logits rows {start}..{end} differ in shape: "
                             f"{(end - start, vocab)} vs {tuple(t.shape)}")
        return t
    return rows


class _DenseKL(torch.autograd.Function):
    """KL(p || q) (beta 0) or KL(q || p) (beta 1) per row, `q = softmax(student / T)`, `p =
    softmax(teacher)`, the teacher's rows given by a function and taken as constants, with the
    student's gradient written out (`generalized_jsd`'s values at beta 0 / 1):

        beta 1: dD/ds = q ((log q - log p) - D) / T        beta 0: dD/ds = (q - p) / T

    Kept for backward: the student's rows (a view of its logits: nothing new); the teacher's rows are
    built again in backward, and the gradient is formed there only. The elementwise form under autograd and checkpointing ran its
    forward twice and kept a dozen `[rows, V]` temporaries. Zero-mass outcomes (log-prob -inf) add
    nothing: where a row's plain sum is not finite it is redone with `_kl_sum`'s masking."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher_rows: Callable[[], Tensor], beta: float, temperature: float) -> Tensor:
        with torch.no_grad():
            d, _ = _kl_and_student_grad(student, _teacher_logp(teacher_rows(), student), beta, temperature, grad=False)
        ctx.save_for_backward(student)
        ctx.teacher_rows, ctx.beta, ctx.temperature = teacher_rows, beta, temperature
        return d

    @staticmethod
    def backward(ctx, grad: Tensor):
        (student,) = ctx.saved_tensors
        with torch.no_grad():
            _, gs = _kl_and_student_grad(student, _teacher_logp(ctx.teacher_rows(), student), ctx.beta, ctx.temperature)
        return (gs * grad.unsqueeze(-1)).to(student.dtype), None, None, None


def _kl_and_student_grad(z: Tensor, lt: Tensor, beta: float, temperature: float, *,
                         grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """(D [rows], dD/dz [rows, V] or None without `grad`) of `_DenseKL`'s divergence from the
    student's logits `z` and the teacher's log-probs `lt` (no autograd)."""
    ls = torch.log_softmax(z.to(_work_dtype(z)) / temperature, dim=-1)
    q = ls.exp()
    d = (q * (ls - lt)).sum(-1) if beta == 1.0 else (lt.exp() * (lt - ls)).sum(-1)
    plain = bool(torch.isfinite(d).all())
    if not plain:  # zero-mass outcomes add nothing (see `_kl_sum`)
        d = _kl_sum(ls, lt, ls > -torch.inf) if beta == 1.0 else _kl_sum(lt, ls, lt > -torch.inf)
    if not grad:
        return d, None
    if beta == 0.0:
        return d, (q - lt.exp()) / temperature
    gz = q * (ls - lt - d.unsqueeze(-1))
    return d, (gz if plain else torch.where(ls > -torch.inf, gz, 0.0)) / temperature


class _DenseKLFromHidden(torch.autograd.Function):
    """`_DenseKL` with the student's rows `hidden @ weight.T + bias` formed inside (the learner's fused
    path): D and its gradients to hidden, weight and bias, keeping for backward only the chunk's
    hidden rows `[rows, d]` and D; the logits and the teacher's rows are rebuilt in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, teacher_rows: Callable[[], Tensor],
                beta: float, temperature: float) -> Tensor:
        with torch.no_grad():
            z = torch.nn.functional.linear(hidden, weight, bias)
            lt = _teacher_logp(teacher_rows(), z)
            d, _ = _kl_and_student_grad(z, lt, beta, temperature, grad=False)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.teacher_rows, ctx.beta, ctx.temperature = teacher_rows, beta, temperature
        return d

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, bias = ctx.saved_tensors
        with torch.no_grad():
            z = torch.nn.functional.linear(hidden, weight, bias)
            lt = _teacher_logp(ctx.teacher_rows(), z)
            _, gz = _kl_and_student_grad(z, lt, ctx.beta, ctx.temperature)
            gz = (gz * grad.unsqueeze(-1)).to(weight.dtype)
            gh = gz @ weight if ctx.needs_input_grad[0] else None
            gw = gz.T @ hidden if ctx.needs_input_grad[1] else None
            gb = gz.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return gh, gw, gb, None, None, None


def full_vocab_divergence_from_hidden(hidden: Tensor, weight: Tensor, bias: Tensor | None, teacher_logits: RowSource,
                                      beta: float, *, chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """`full_vocab_divergence` of the student's logits `hidden @ weight.T + bias` against a constant
    teacher, for beta 0 or 1, chunked over rows (`_DenseKLFromHidden`: neither side's `[N, V]` is
    ever kept).

    Args:
        hidden: [N, d] the student's final hidden states (grad flows).
        weight: [V, d] its output projection (grad flows); bias: [V] or None.
        teacher_logits: [N, V] or `(start, end) -> [end - start, V]` (taken as constants).
        beta: 0 (forward KL) or 1 (reverse KL).
    Returns:
        [N] fp32 divergence per row.
    """
    if beta not in (0.0, 1.0):
        raise ValueError(f"full_vocab_divergence_from_hidden: beta must be 0 or 1, got {beta} (use "
                         "full_vocab_divergence with a row function for the mixture)")
    if not chunk_size > 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    n, v = hidden.shape[0], weight.shape[0]
    out = []
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        out.append(_DenseKLFromHidden.apply(hidden[start:end], weight, bias, _constant_rows(teacher_logits, start, end, v),
                                            beta, temperature))
    return torch.cat(out) if out else torch.zeros(0, device=hidden.device)


def _chunk_divergence(student: Tensor, teacher: Tensor, beta: float, temperature: float) -> Tensor:
    ls, lt = _log_probs(student, teacher, temperature)
    return generalized_jsd(ls, lt, beta)


def full_vocab_divergence(student_logits: RowSource, teacher_logits: RowSource, beta: float, *,
                          num_rows: int | None = None, chunk_size: int = 1024,
                          temperature: float = 1.0, teacher_requires_grad: bool = True) -> Tensor:
    """The generalized JSD over the full vocabulary, per row, chunked over rows.

    `q = softmax(student_logits / temperature)`, `p = softmax(teacher_logits)`: the teacher's logits
    are taken as they come (its own temperature, soft-capping, masking already applied; -inf allowed
    for masked ids). For each chunk of `chunk_size` rows both log-softmaxes are formed in fp32 (fp64
    kept) and the divergence reduced; with grad enabled each chunk is recomputed in backward
    (`torch.utils.checkpoint`), so only the sources are kept and at most one chunk's `[chunk, V]`
    work is alive at a time.

    Args:
        student_logits: [N, V] logits (grad flows), or `(start, end) -> [end - start, V]`
            (e.g. `lambda a, b: hidden[a:b] @ weight.T`, grad flowing to hidden and weight).
        teacher_logits: [N, V] logits, or `(start, end) -> [end - start, V]` (called again in
            backward for chunks that need grad: it must be deterministic). Detach it unless a
            gradient to the teacher is wanted.
        beta: 0 forward KL(p || q), 1 reverse KL(q || p), between TRL's mixture (`generalized_jsd`).
        num_rows: N; required when neither source is a tensor.
        chunk_size: rows per chunk (> 0).
        temperature: the student's (> 0); TRL's `generalized_jsd_loss(..., temperature=T)` equals
            this with `teacher_logits / T`.
        teacher_requires_grad: False: the teacher's logits are constants (no gradient to them), which
            lets beta 0 and 1 over a student tensor take the cheaper `_DenseKL` path.
    Returns:
        [N] the divergence per row, fp32 (fp64 for fp64 student logits); TRL's "batchmean" over
        valid rows is its masked mean.
    """
    beta = check_beta(beta)
    if not chunk_size > 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if num_rows is None:
        tensors = [s for s in (student_logits, teacher_logits) if isinstance(s, Tensor)]
        if not tensors:
            raise ValueError("num_rows is required when both student_logits and teacher_logits are functions")
        num_rows = tensors[0].shape[0]
    for name, s in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if isinstance(s, Tensor) and (s.dim() != 2 or s.shape[0] != num_rows):
            raise ValueError(f"{name} must have shape [{num_rows}, V], got {tuple(s.shape)}")
    # Beta 0 and 1 with the student's logits as a tensor and a constant teacher: `_DenseKL` (its rows
    # are views; nothing is recomputed but the teacher's rows). Otherwise each chunk is checkpointed.
    plain = beta in (0.0, 1.0) and isinstance(student_logits, Tensor) and not teacher_requires_grad
    out = []
    for start in range(0, num_rows, chunk_size):
        end = min(start + chunk_size, num_rows)
        if plain:
            teacher_rows = _constant_rows(teacher_logits, start, end, student_logits.shape[1])
            out.append(_DenseKL.apply(student_logits[start:end], teacher_rows, beta, temperature))
            continue

        def chunk(start=start, end=end):
            s, t = _rows(student_logits, start, end), _rows(teacher_logits, start, end)
            if s.shape != t.shape:
                raise ValueError(f"student and teacher logits rows {start}..{end} differ in shape: "
                                 f"{tuple(s.shape)} vs {tuple(t.shape)}")
            return _chunk_divergence(s, t, beta, temperature)

        out.append(checkpoint(chunk, use_reentrant=False) if torch.is_grad_enabled() else chunk())
    if not out:
        src = student_logits if isinstance(student_logits, Tensor) else None
        dtype = torch.float64 if src is not None and src.dtype == torch.float64 else torch.float32
        return torch.zeros(0, dtype=dtype, device=None if src is None else src.device)
    return torch.cat(out)
