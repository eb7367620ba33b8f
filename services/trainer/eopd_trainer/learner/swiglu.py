"""The learner's gated MLP with two of its four activations recomputed in backward (`train.recompute_mlp`).

A Llama / Qwen / Mistral decoder layer's MLP is `down(silu(gate(x)) * up(x))`. Autograd keeps four
`[tokens, intermediate]` tensors per layer for backward: `gate(x)` (silu's input), `up(x)` and
`silu(gate(x))` (the product's inputs) and the product (down's input). `swiglu` keeps the first two
and recomputes the other two elementwise in backward: on SmolLM2-135M at the main job's micro-batch
(8 x 86 tokens) that is 234 of the 720 MiB of activations a forward keeps, for two elementwise
passes per layer (the matmuls are not redone). Values and gradients are those of the module's own
forward (the same matmuls and the same silu backward; tested against it in fp64 and fp32).

`recompute_gated_mlps(model)` switches every such MLP of a model to it: modules whose class is one of
`GATED_MLPS`, with bias-free `nn.Linear` projections and a SiLU activation. Anything else (a bias,
another activation, wrapped projections such as LoRA, ZeRO-3's partitioned weights, which only the
projections' own forward gathers) keeps its own forward, and so does a forward under autocast or
without gradients."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation

GATED_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


class _SwiGLU(torch.autograd.Function):
    """y = (silu(x W_g^T) * (x W_u^T)) W_d^T for x [..., H], W_g and W_u [I, H], W_d [H, I]; saves x,
    gate and up, recomputes silu(gate) and the product in backward."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return F.linear(F.silu(gate) * up, w_down)

    @staticmethod
    def backward(ctx, grad_y):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        act = F.silu(gate)
        grad_y2 = grad_y.reshape(-1, grad_y.shape[-1])
        grad_wd = grad_y2.t().mm((act * up).reshape(-1, up.shape[-1])) if ctx.needs_input_grad[3] else None
        grad_p = grad_y.matmul(w_down)
        grad_up = grad_p * act
        grad_gate = torch.ops.aten.silu_backward(grad_p * up, gate)
        del act, grad_p
        x2 = x.reshape(-1, x.shape[-1])
        grad_wg = grad_gate.reshape(-1, gate.shape[-1]).t().mm(x2) if ctx.needs_input_grad[1] else None
        grad_wu = grad_up.reshape(-1, up.shape[-1]).t().mm(x2) if ctx.needs_input_grad[2] else None
        grad_x = grad_gate.matmul(w_gate) + grad_up.matmul(w_up) if ctx.needs_input_grad[0] else None
        return grad_x, grad_wg, grad_wu, grad_wd


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` for bias-free projections, keeping gate(x) and up(x) only."""
    return _SwiGLU.apply(x, w_gate, w_up, w_down)


def _plain_linear(m) -> bool:
    return type(m) is torch.nn.Linear and m.bias is None


def is_recomputable(module: torch.nn.Module) -> bool:
    return (type(module).__name__ in GATED_MLPS and isinstance(getattr(module, "act_fn", None), torch.nn.SiLU | SiLUActivation)
            and all(_plain_linear(getattr(module, n, None)) for n in ("gate_proj", "up_proj", "down_proj")))


def _forward(self, x):
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return type(self).forward(self, x)
    return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def recompute_gated_mlps(model: torch.nn.Module) -> int:
    """Switches every recomputable MLP of `model` to `swiglu` (an instance attribute: the class is
    untouched); returns how many."""
    n = 0
    for module in model.modules():
        if is_recomputable(module):
            module.forward = types.MethodType(_forward, module)
            n += 1
    return n
