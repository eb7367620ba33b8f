"""The hidden-state loss with its gradients computed in the forward chunk loop (no recomputation).

`vocab.vocab_stats` returns per-token statistics and recomputes every chunk's logits in backward
(4 matmuls of [c, D] x [D, V] per chunk, plus two passes of exponentials). Here, as in Liger
Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy, each chunk is visited once:

    z = h @ W.T (+ b)                         [c, V], one matmul
    s = (z - max z) / T,  e = exp(s)          the statistics of `vocab` (log p of the sampled token,
                                              entropy, log p at the gathered ids)
    (value, g_s, g_H, g_g) = chunk_loss(...)  the loss of the chunk's tokens and its gradient with
                                              respect to those statistics (autograd on [c] / [g, k]
                                              tensors: the loss is a sum of per-token terms with
                                              weights fixed before the pass, so the chunk's rows
                                              decide their own gradient)
    dz = (g_s 1[v = x] + sum_j g_j 1[v = ids_j] - p (a + g_H (log p + H))) / T,  a = g_s + sum_j g_j
    grad_h[chunk] = dz @ W,   grad_W += dz.T @ h,   grad_b += sum dz

three matmuls per chunk, as many as the naive path's forward + backward, and two [c, V] work
buffers (s and e). The gradients for an upstream gradient of 1 are kept and rescaled in place to the actual one in
backward (the output is a scalar loss; nothing is copied, except by a second backward).
Double backward (a gradient of the gradient) is not supported; a second backward through the same
graph (`retain_graph`) is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .vocab import HiddenSource, VocabPlan, Workspace

#: chunk_loss(m0, m1, g0, g1, logp_sampled [c], entropy [c], logp_gathered [g, k]) -> scalar: the
#: weighted loss of valid tokens m0..m1 (gathered rows g0..g1), differentiable in the three inputs.
ChunkLoss = Callable[[int, int, int, int, Tensor, Tensor, Tensor], Tensor]


def _chunk_grads(chunk_loss: ChunkLoss, m0: int, m1: int, g0: int, g1: int, ls: Tensor, ent: Tensor,
                 lg: Tensor, entropy_on: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The chunk's loss value and its gradients w.r.t. (logp_sampled, entropy, logp_gathered);
    None for the entropy / gathered gradient when the loss does not depend on them."""
    with torch.enable_grad():
        ls_ = ls.detach().requires_grad_(True)
        lg_ = lg.detach().requires_grad_(True)
        ent_ = ent.detach().requires_grad_(entropy_on)
        value = chunk_loss(m0, m1, g0, g1, ls_, ent_, lg_)
        leaves = [ls_, lg_] + ([ent_] if entropy_on else [])
        if not value.requires_grad:
            return value.detach(), torch.zeros_like(ls), None, None
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
    g_s = torch.zeros_like(ls) if grads[0] is None else grads[0]
    g_h = grads[2] if entropy_on else None
    return value.detach(), g_s, g_h, grads[1]


def _fused_pass(plan: VocabPlan, source: HiddenSource, chunk_loss: ChunkLoss, need_h: bool, need_w: bool,
                need_b: bool):
    m_total, k = plan.rows.numel(), plan.gather_ids.shape[1]
    hidden, weight, bias = source.hidden, source.weight, source.bias
    dev, dt = plan.rows.device, source.dtype
    inv_t = 1.0 / plan.temperature
    logp_s = torch.empty(m_total, device=dev, dtype=dt)
    entropy = torch.zeros(m_total, device=dev, dtype=dt)
    logp_g = torch.empty(plan.gather_pos.numel(), k, device=dev, dtype=dt)
    topk = torch.empty(m_total, plan.student_topk, device=dev, dtype=torch.long)
    loss = torch.zeros((), device=dev, dtype=dt)
    rows = min(plan.chunk_size, m_total)
    ws_z = Workspace(rows, source.vocab, dt, dev)
    ws_e = Workspace(rows, source.vocab, dt, dev)
    grad_h = torch.zeros_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, device=weight.device, dtype=dt) if need_w else None
    grad_b = torch.zeros(bias.shape, device=bias.device, dtype=dt) if need_b else None
    for m0, m1, sel, g0, g1 in plan.chunks():
        c = m1 - m0
        z, _ = source.chunk(sel, ws_z)  # [c, V], a private buffer: overwritten in place below
        zmax = z.amax(dim=1)
        sampled = plan.sampled[m0:m1]
        z_s = z.gather(1, sampled[:, None]).squeeze(1)
        local = plan.gather_pos[g0:g1] - m0
        ids = plan.gather_ids[g0:g1]
        z_g = z[local[:, None], ids]  # [g, k]
        if plan.student_topk:
            topk[m0:m1] = z.topk(plan.student_topk, dim=1, sorted=False).indices
        s = z.sub_(zmax[:, None])
        if inv_t != 1.0:
            s.mul_(inv_t)
        e = torch.exp(s, out=ws_e.take(c))
        total = e.sum(dim=1)
        lt = total.log()
        ls_c = (z_s - zmax) * inv_t - lt
        lg_c = (z_g - zmax[local, None]) * inv_t - lt[local, None]
        if plan.entropy:  # H = lt - sum_v e_v s_v / total; a batched dot, no [c, V] temporary
            ent_c = lt - torch.bmm(e[:, None, :], s[:, :, None]).view(c) / total
        else:
            ent_c = torch.zeros(c, device=dev, dtype=dt)
        logp_s[m0:m1], entropy[m0:m1], logp_g[g0:g1] = ls_c, ent_c, lg_c
        value, g_s, g_h, g_g = _chunk_grads(chunk_loss, m0, m1, g0, g1, ls_c, ent_c, lg_c, plan.entropy)
        loss += value
        if not (need_h or need_w or need_b):
            continue
        g_s, g_h, g_g = g_s.to(dt), None if g_h is None else g_h.to(dt), None if g_g is None else g_g.to(dt)
        a = g_s.clone()
        if g_g is not None and g1 > g0:
            a.index_add_(0, local, g_g.sum(dim=1))
        if g_h is not None:  # -p (a + g_H (log p + H)) / T, log p = s - lt, p = e / total
            p = e.mul_((total.reciprocal() * -inv_t)[:, None])  # -p / T
            dz = s.sub_((lt - ent_c)[:, None]).mul_(g_h[:, None]).add_(a[:, None]).mul_(p)
        else:  # -a p / T in one pass over the exponentials
            dz = e.mul_((a * -inv_t / total)[:, None])
        ar = torch.arange(c, device=dev)
        dz.index_put_((ar, sampled), g_s * inv_t, accumulate=True)
        if g_g is not None and g1 > g0:
            dz.index_put_((local[:, None].expand_as(g_g), ids), g_g * inv_t, accumulate=True)
        h = hidden[sel]
        if grad_h is not None:
            dz_w = dz if dz.dtype == weight.dtype else dz.to(weight.dtype)
            grad_h[sel] = (dz_w @ weight).to(grad_h.dtype)
        if grad_w is not None:
            grad_w.addmm_(dz.t(), h if h.dtype == dt else h.to(dt))
        if grad_b is not None:
            grad_b += dz.sum(dim=0)
        del z, e, s, dz
    if grad_w is not None:
        grad_w = grad_w.to(weight.dtype)
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return loss, (logp_s, entropy, logp_g, topk), (grad_h, grad_w, grad_b)


class _FusedHiddenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: VocabPlan, chunk_loss: ChunkLoss, needs: tuple[bool, bool, bool], hidden, weight, bias):
        source = HiddenSource(hidden, weight, bias)
        loss, stats, grads = _fused_pass(plan, source, chunk_loss, *needs)
        ctx.grads, ctx.scale, ctx.handed_out = grads, 1.0, False
        ctx.mark_non_differentiable(*stats)
        return (loss, *stats)

    @staticmethod
    def backward(ctx, g_loss, *_unused):
        # The kept gradients are for an upstream gradient of 1. The first backward rescales them in
        # place (DeepSpeed's 1 / gradient_accumulation_steps, a loss scale) and hands them over, no
        # copy; a second backward through the graph (retain_graph) must not touch what the first
        # handed out, so it returns scaled copies. One scalar sync.
        g = 0.0 if g_loss is None else float(g_loss)
        if g == 0.0:  # a zero gradient (e.g. a term switched off by a 0 weight): zeros, the kept ones untouched
            return None, None, None, *(None if t is None else torch.zeros_like(t) for t in ctx.grads)
        if ctx.handed_out:
            return None, None, None, *(None if t is None else t * (g / ctx.scale) for t in ctx.grads)
        if g != 1.0:
            for t in ctx.grads:
                if t is not None:
                    t.mul_(g)
        ctx.scale, ctx.handed_out = g, True
        return None, None, None, *ctx.grads

def fused_hidden_loss(plan: VocabPlan, chunk_loss: ChunkLoss, hidden: Tensor, weight: Tensor,
                      bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The loss `sum_chunks chunk_loss(...)` from hidden states, its gradients w.r.t. `hidden`,
    `weight`, `bias` computed in the forward pass (only for those that require a gradient, under
    grad mode). Returns `(loss, logp_sampled [M], entropy [M], logp_gathered [G, k], topk [M, s])`,
    the statistics detached (for metrics), as `vocab.vocab_stats` returns them."""
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    return _FusedHiddenLoss.apply(plan, chunk_loss, needs, hidden, weight, bias)
