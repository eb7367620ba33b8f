"""Chunked reductions over the vocabulary, with an analytic, recomputing backward.

Every loss variant depends on the student's logits only through a few per-token statistics of
`y = z / T` (z the raw logits of a row, T the temperature, `lse = logsumexp(y)`):

    logp_sampled[m]   = y[x_m] - lse                        [M]     (x_m the sampled token)
    entropy[m]        = lse - sum_v softmax(y)_v * y_v      [M]     (the student's entropy)
    logp_gathered[g]  = y[ids_g] - lse                      [G, k]  (teacher's top-k ids, gated rows)

`vocab_stats` computes them chunk by chunk over the rows, relative to each row's maximum (so a
large common offset of the logits costs no precision), with one `[chunk, V]` work buffer alive at a
time (two in backward when the entropy is differentiated), and never keeps anything of size
`[rows, V]` for the backward pass. Its backward
recomputes each chunk's logits and writes the exact gradient

    dL/dy_v = g_s [v = x] + sum_j g_j [v = ids_j] - p_v * (a + g_H * (log p_v + H)),
    a = g_s + sum_j g_j,       dL/dz = dL/dy / T,

where `g_s`, `g_j`, `g_H` are the upstream gradients of the three statistics. The logits come from
one of two sources:

* `LogitsSource`: a `[N, V]` logits tensor (the gradient is a `[N, V]` tensor, written in place
  chunk by chunk; masked rows get zeros),
* `HiddenSource`: final hidden states `[N, D]` and the output projection `[V, D]` (+ bias `[V]`);
  chunk logits are `h @ W.T + b`, recomputed in backward, so full `[N, V]` logits never exist.

Rows not selected (masked positions) are never read, so they may hold anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class VocabPlan:
    """What to reduce: M selected rows, their sampled ids, and G gathered rows with k ids each.

    rows        [M] long: indices of the selected rows in the source's N rows, strictly increasing.
    sampled     [M] long: the sampled token id of each selected row, in [0, V).
    gather_pos  [G] long: positions in [0, M), strictly increasing, of rows whose top-k is gathered.
    gather_ids  [G, k] long: vocabulary ids gathered at those rows, in [0, V).
    temperature: T > 0.
    chunk_size: selected rows per chunk.
    entropy: compute the student entropy (else the entropy output is zeros and gets no gradient).
    student_topk: if > 0, also return the student's top-`student_topk` ids per row (no gradient).
    """

    rows: Tensor
    sampled: Tensor
    gather_pos: Tensor
    gather_ids: Tensor
    temperature: float
    chunk_size: int
    entropy: bool
    student_topk: int = 0

    def chunks(self):
        """Yields (m0, m1, row_selector, g0, g1) per chunk; row_selector is a slice when the chunk's
        rows are contiguous (a view, no copy) and an index tensor otherwise."""
        m_total = self.rows.numel()
        if m_total == 0:
            return
        rows = self.rows.tolist()
        gpos = self.gather_pos.tolist()
        g0 = 0
        for m0 in range(0, m_total, self.chunk_size):
            m1 = min(m0 + self.chunk_size, m_total)
            r0, r1 = rows[m0], rows[m1 - 1]
            sel = slice(r0, r1 + 1) if r1 - r0 + 1 == m1 - m0 else self.rows[m0:m1]
            g1 = g0
            while g1 < len(gpos) and gpos[g1] < m1:
                g1 += 1
            yield m0, m1, sel, g0, g1
            g0 = g1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Workspace:
    """One reusable `[chunk_size, V]` buffer: chunks reuse its pages instead of faulting in fresh
    ones (on CPU a fresh large allocation costs as much as a pass over it)."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device):
        self.shape, self.dtype, self.device = (rows, vocab), dtype, device
        self.buf: Tensor | None = None

    def take(self, c: int) -> Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buf[:c]


class LogitsSource:
    """Chunks of a `[N, V]` logits tensor (views when rows are contiguous)."""

    def __init__(self, logits: Tensor):
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
        self.logits = logits
        self.vocab = logits.shape[1]
        self.dtype = _compute_dtype(logits.dtype)

    def chunk(self, sel, ws: Workspace) -> tuple[Tensor, bool]:
        """Returns `(z [c, V], private)`; `private` is False when z is a view of the logits, True
        when it is a copy in the workspace (which the caller may then overwrite)."""
        if isinstance(sel, slice):
            if self.logits.dtype == self.dtype:
                return self.logits[sel], False
            out = ws.take(sel.stop - sel.start)
            out.copy_(self.logits[sel])  # converts from a view: no intermediate copy
            return out, True
        out = ws.take(sel.numel())
        if self.logits.dtype == self.dtype:
            torch.index_select(self.logits, 0, sel, out=out)
        else:  # scattered low-precision rows: one [c, V] copy in their own dtype, then converted
            out.copy_(self.logits.index_select(0, sel))
        return out, True


class HiddenSource:
    """Chunks of `hidden @ weight.T + bias` from `[N, D]` hidden states and a `[V, D]` weight."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None):
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"hidden must be [N, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
            )
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.vocab = weight.shape[0]
        self.dtype = _compute_dtype(torch.promote_types(hidden.dtype, weight.dtype))

    def chunk(self, sel, ws: Workspace) -> tuple[Tensor, bool]:
        h = self.hidden[sel]
        out = ws.take(h.shape[0])
        if h.dtype == self.weight.dtype == self.dtype:
            if self.bias is None:
                torch.mm(h, self.weight.t(), out=out)
            else:
                torch.addmm(self.bias.to(self.dtype), h, self.weight.t(), out=out)
        else:  # low-precision weights: matmul in their dtype, reductions in fp32
            z = h @ self.weight.t() if self.bias is None else torch.addmm(self.bias, h, self.weight.t())
            out.copy_(z)
        return out, True


def _forward(source, plan: VocabPlan):
    """Per chunk: `zmax = max_v z`, `s = (z - zmax) / T`, `log_total = log sum_v exp(s)`, so that
    `log p = s - log_total` and `H = log_total - sum_v exp(s) s / sum_v exp(s)`. Everything is taken
    relative to the row maximum, so a large common offset of the logits costs no precision.

    One `[c, V]` buffer: the exponentials are written over the chunk's private copy of the logits
    (hidden path, converted or scattered rows) after its gathers, or into the workspace when the
    chunk is a view of the caller's logits. Returns per-row `zmax`, `log_total` (saved for backward)
    and the statistics."""
    m_total, k = plan.rows.numel(), plan.gather_ids.shape[1]
    dev, dt = plan.rows.device, source.dtype
    inv_t = 1.0 / plan.temperature
    shift = torch.empty(m_total, device=dev, dtype=dt)
    log_total = torch.empty(m_total, device=dev, dtype=dt)
    logp_s = torch.empty(m_total, device=dev, dtype=dt)
    entropy = torch.zeros(m_total, device=dev, dtype=dt)
    logp_g = torch.empty(plan.gather_pos.numel(), k, device=dev, dtype=dt)
    topk = torch.empty(m_total, plan.student_topk, device=dev, dtype=torch.long)
    ws = Workspace(min(plan.chunk_size, m_total), source.vocab, dt, dev)
    for m0, m1, sel, g0, g1 in plan.chunks():
        z, private = source.chunk(sel, ws)  # [c, V]
        zmax = z.amax(dim=1)  # [c]
        # reads of z first: a private z is overwritten by the exponentials below
        z_s = z.gather(1, plan.sampled[m0:m1, None]).squeeze(1)
        if g1 > g0:
            local = plan.gather_pos[g0:g1] - m0
            z_g = z[local[:, None], plan.gather_ids[g0:g1]]  # [g, k]
        if plan.student_topk:
            topk[m0:m1] = z.topk(plan.student_topk, dim=1, sorted=False).indices
        e = z if private else ws.take(m1 - m0)
        torch.sub(z, zmax[:, None], out=e)
        if inv_t != 1.0:
            e.mul_(inv_t)
        e.exp_()
        total = e.sum(dim=1)
        c_lt = total.log()
        shift[m0:m1] = zmax
        log_total[m0:m1] = c_lt
        logp_s[m0:m1] = (z_s - zmax) * inv_t - c_lt
        if g1 > g0:
            logp_g[g0:g1] = (z_g - zmax[local, None]) * inv_t - c_lt[local, None]
        if plan.entropy:  # sum_v e_v s_v = -sum_v entr(e_v), in place (entr(0) = 0)
            torch.special.entr(e, out=e)
            entropy[m0:m1] = c_lt + e.sum(dim=1) / total
        del z, e
    return shift, log_total, logp_s, entropy, logp_g, topk


def _chunk_grad(z: Tensor, out: Tensor, plan: VocabPlan, m0, m1, g0, g1, shift, log_total, ent, a, g_s, g_h,
                g_g, ws_p: Workspace):
    """Writes dL/dz of one chunk into `out` [c, V]; `out` may be `z` itself (then z is consumed).
    Uses `ws_p` (a second [c, V] buffer) only when the entropy is differentiated (g_h given)."""
    inv_t = 1.0 / plan.temperature
    torch.sub(z, shift[m0:m1, None], out=out)  # z - zmax: exact for nearby values, whatever the offset
    if inv_t != 1.0:
        out.mul_(inv_t)
    if g_h is not None:
        out.sub_(log_total[m0:m1, None])  # log p
        p = torch.exp(out, out=ws_p.take(m1 - m0))
        out.add_(ent[m0:m1, None]).mul_(g_h[m0:m1, None]).add_(a[m0:m1, None]).mul_(p).mul_(-inv_t)
        del p
    else:  # -a p / T, with p = exp(s) / total
        out.exp_().mul_((a[m0:m1] * torch.exp(-log_total[m0:m1]) * -inv_t)[:, None])
    c = m1 - m0
    ar = torch.arange(c, device=out.device)
    out.index_put_((ar, plan.sampled[m0:m1]), g_s[m0:m1] * inv_t, accumulate=True)
    if g_g is not None and g1 > g0:
        local = (plan.gather_pos[g0:g1] - m0)[:, None].expand_as(g_g[g0:g1])
        out.index_put_((local, plan.gather_ids[g0:g1]), g_g[g0:g1] * inv_t, accumulate=True)
    return out


class _VocabStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: VocabPlan, logits, hidden, weight, bias):
        source = LogitsSource(logits) if logits is not None else HiddenSource(hidden, weight, bias)
        shift, log_total, logp_s, entropy, logp_g, topk = _forward(source, plan)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # unused outputs (e.g. a metrics-only entropy) cost nothing
        ctx.mark_non_differentiable(topk)
        if not plan.entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, hidden, weight, bias, shift, log_total, entropy)
        return logp_s, entropy, logp_g, topk

    @staticmethod
    def backward(ctx, g_s, g_h, g_g, _g_topk):
        plan: VocabPlan = ctx.plan
        logits, hidden, weight, bias, shift, log_total, ent = ctx.saved_tensors
        lse = log_total  # device and dtype of the per-row statistics
        need_logits, need_h, need_w, need_b = ctx.needs_input_grad[1:5]
        m_total = plan.rows.numel()
        dt = lse.dtype
        g_s = torch.zeros(m_total, device=lse.device, dtype=dt) if g_s is None else g_s.to(dt)
        g_h = None if (g_h is None or not plan.entropy) else g_h.to(dt)
        g_g = None if g_g is None else g_g.to(dt)
        a = g_s.clone()
        if g_g is not None and g_g.numel():
            a.index_add_(0, plan.gather_pos, g_g.sum(dim=1))

        grad_logits = grad_h = grad_w = grad_b = None
        chunk_rows = min(plan.chunk_size, m_total)
        if logits is not None:
            if not need_logits:
                return None, None, None, None, None
            source = LogitsSource(logits)
            ws = Workspace(chunk_rows, source.vocab, dt, lse.device)
            ws_p = Workspace(chunk_rows, source.vocab, dt, lse.device)  # allocated only if g_h
            full = m_total == logits.shape[0]
            grad_logits = (torch.empty_like if full else torch.zeros_like)(logits)
            for m0, m1, sel, g0, g1 in plan.chunks():
                z, private = source.chunk(sel, ws)
                # A contiguous chunk of same-dtype logits is a view: write its gradient straight
                # into grad_logits. Otherwise z is already a private copy: overwrite it in place.
                out = z if private else grad_logits[sel]
                _chunk_grad(z, out, plan, m0, m1, g0, g1, shift, log_total, ent, a, g_s, g_h, g_g, ws_p)
                if private and isinstance(sel, slice):
                    grad_logits[sel].copy_(out)  # converts into the view: no intermediate copy
                elif private:
                    grad_logits.index_copy_(0, sel, out.to(grad_logits.dtype))
                del z, out
            return None, grad_logits, None, None, None

        if not (need_h or need_w or (need_b and bias is not None)):
            return None, None, None, None, None
        source = HiddenSource(hidden, weight, bias)
        ws = Workspace(chunk_rows, source.vocab, dt, lse.device)
        ws_p = Workspace(chunk_rows, source.vocab, dt, lse.device)  # allocated only if g_h
        if need_h:
            grad_h = torch.zeros_like(hidden)
        if need_w:
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=dt)
        if need_b and bias is not None:
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=dt)
        for m0, m1, sel, g0, g1 in plan.chunks():
            out, _ = source.chunk(sel, ws)  # freshly recomputed logits: turned into dL/dz in place
            _chunk_grad(out, out, plan, m0, m1, g0, g1, shift, log_total, ent, a, g_s, g_h, g_g, ws_p)
            dz = out if out.dtype == weight.dtype else out.to(weight.dtype)
            if grad_h is not None:
                grad_h[sel] = (dz @ weight).to(grad_h.dtype)
            if grad_w is not None:
                h = hidden[sel]
                grad_w.addmm_(out.t(), h if h.dtype == dt else h.to(dt))
            if grad_b is not None:
                grad_b += out.sum(dim=0)
            del out, dz
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return None, None, grad_h, grad_w, grad_b


def vocab_stats(
    plan: VocabPlan,
    *,
    logits: Tensor | None = None,
    hidden: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row statistics of the temperature-scaled student distribution, chunked.

    Give either `logits [N, V]` or `hidden [N, D]` + `weight [V, D]` (+ `bias [V]`).

    Returns `(logp_sampled [M], entropy [M], logp_gathered [G, k], student_topk_ids [M, s])`, in
    fp32 (fp64 if the source is fp64). The first three are differentiable with respect to the
    source; `entropy` is zeros unless `plan.entropy`; the top-k ids are empty unless
    `plan.student_topk`.
    """
    if (logits is None) == (hidden is None and weight is None):
        raise ValueError("give either logits, or hidden and weight")
    if logits is None and (hidden is None or weight is None):
        raise ValueError("the hidden-state source needs both hidden and weight")
    return _VocabStats.apply(plan, logits, hidden, weight, bias)
