"""learner/swiglu.py: the gated MLP with two activations recomputed in backward equals the module's
own forward (values and gradients of input and weights, fp64 and fp32), keeps fewer bytes for
backward, and is applied only where it is the same computation."""

from __future__ import annotations

import pytest
import torch
import transformers
from eopd_trainer.learner.swiglu import is_recomputable, recompute_gated_mlps, swiglu


def _config(kind: str, **kw):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **kw)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=8, **common)
    return transformers.LlamaConfig(**common)


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    h = model(input_ids=ids).logits
    loss = (h.double() ** 2).mean() + h.double()[..., 3].sum()
    loss.backward()
    return h.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_model_with_recomputed_mlps_equals_its_own_forward(kind, dtype, tol):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).to(dtype)
    ids = torch.randint(0, 64, (3, 11))
    want_out, want = _grads(model, ids)
    assert recompute_gated_mlps(model) == 2
    got_out, got = _grads(model, ids)
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=name)
    with torch.no_grad():  # without gradients: the module's own forward
        torch.testing.assert_close(model(input_ids=ids).logits, want_out, rtol=tol, atol=tol)


def test_gradcheck_of_the_function():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    wg, wu = (torch.randn(7, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    wd = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x, wg, wu, wd))
    frozen = (x, wg.detach(), wu.detach(), wd.detach())  # weights without gradients
    assert torch.autograd.gradcheck(swiglu, frozen)


def _saved_bytes(model, ids) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(storages.values())


def test_keeps_two_fewer_intermediate_tensors_per_layer():
    torch.manual_seed(0)
    cfg = _config("llama")
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (4, 16))
    before = _saved_bytes(model, ids)
    recompute_gated_mlps(model)
    after = _saved_bytes(model, ids)
    per_layer = 2 * ids.numel() * cfg.intermediate_size * 4  # silu(gate) and the product, float32
    assert before - after == cfg.num_hidden_layers * per_layer


def test_only_the_same_computation_is_replaced():
    assert is_recomputable(transformers.models.llama.modeling_llama.LlamaMLP(_config("llama")))
    assert not is_recomputable(transformers.models.llama.modeling_llama.LlamaMLP(_config("llama", mlp_bias=True)))
    assert not is_recomputable(transformers.models.llama.modeling_llama.LlamaMLP(_config("llama", hidden_act="gelu")))
    wrapped = transformers.models.llama.modeling_llama.LlamaMLP(_config("llama"))
    wrapped.up_proj = torch.nn.Sequential(wrapped.up_proj)  # e.g. an adapter around the projection
    assert not is_recomputable(wrapped)
    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                                                 vocab_size=32))
    assert recompute_gated_mlps(gpt2) == 0
