"""eopd's full-vocabulary divergence is TRL's GKD loss (issue 48): `objective.dense.full_vocab_divergence`
and `compute_loss(variant="gkd", support="full", gkd_beta=beta)` against TRL 1.16's own
`GKDTrainer.generalized_jsd_loss`, unmodified, in fp64: values and gradients w.r.t. the student's
logits, several beta (0 forward KL, 1 reverse KL, the mixture between), masked labels and a
temperature. Pure tensors: no model, no server."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="the TRL tier runs in .venv-vllm (bash scripts/vllm_env.sh)")

try:  # TRL 1.16: GKD lives in trl.experimental
    from trl.experimental.gkd import GKDTrainer
except ImportError:  # pragma: no cover - older TRL exported it at the top level
    from trl import GKDTrainer

from eopd_trainer.objective import LossConfig, LossInputs, compute_loss
from eopd_trainer.objective.dense import full_vocab_divergence

B, T, V = 3, 7, 53
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def batch(seed: int, masked: bool = True):
    g = torch.Generator().manual_seed(seed)
    student = (2.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 2.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    if masked:
        labels[0, :2] = -100  # the prompt
        labels[2, 5:] = -100  # padding
    return student, teacher, labels


def gkd_inputs(teacher, labels) -> LossInputs:
    """The loss core's inputs for `labels` (-100: not scored) with the teacher's full logits: its
    per-token scores and top-4 derived from them."""
    t_logp = torch.log_softmax(teacher, -1)
    sampled = labels.clamp(min=0)
    top = t_logp.topk(4, -1)
    return LossInputs(sampled, teacher_logprobs=t_logp.gather(-1, sampled[..., None]).squeeze(-1),
                      teacher_entropies=-(t_logp.exp() * t_logp).sum(-1), teacher_topk_ids=top.indices,
                      teacher_topk_logprobs=top.values, mask=labels != -100, teacher_logits=teacher)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_full_vocab_divergence_equals_trls_generalized_jsd_loss(beta, temperature):
    student, teacher, labels = batch(seed=int(beta * 10) + 1)
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature,
                                          reduction="batchmean")
    mask = (labels != -100).reshape(-1)
    ours = full_vocab_divergence(student.reshape(-1, V), (teacher / temperature).reshape(-1, V), beta,
                                 chunk_size=5, temperature=temperature)[mask].mean()
    torch.testing.assert_close(ours, trl, atol=1e-12, rtol=0)
    (g_trl,) = torch.autograd.grad(trl, student)
    (g_ours,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(g_ours, g_trl, atol=1e-12, rtol=0)


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "every-token"])
@pytest.mark.parametrize("beta", BETAS)
def test_gkd_variant_at_full_support_is_trls_loss(beta, masked):
    """`loss.variant=gkd loss.gkd_lambda=1 loss.gkd_beta=beta loss.support=full`: the loss core on the
    batched [B, T, V] form, the teacher's logits as LossInputs.teacher_logits. With every token valid
    beta 0 and 1 take the student's gradient written out by hand (objective.dense._DenseKL)."""
    student, teacher, labels = batch(seed=100 + int(beta * 10), masked=masked)
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, reduction="batchmean")
    inputs = gkd_inputs(teacher, labels)
    cfg = LossConfig(variant="gkd", gkd_lambda=1.0, gkd_beta=beta, support="full", chunk_size=4)
    loss, metrics = compute_loss(student, inputs, cfg)
    torch.testing.assert_close(loss, trl, atol=1e-12, rtol=0)
    (g_trl,) = torch.autograd.grad(trl, student)
    (g_ours,) = torch.autograd.grad(loss, student)
    torch.testing.assert_close(g_ours, g_trl, atol=1e-12, rtol=0)
    assert metrics["divergence_loss"] == pytest.approx(float(trl), abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_token_sum_aggregation_is_trls_num_items_in_batch_scale(beta):
    """`loss.aggregation=token-sum loss.sum_divisor=N` is GKDTrainer's loss when its Trainer passes
    `num_items_in_batch=N` (what `compute_loss` receives: transformers counts it from the dataset's
    labels before the completions are generated, so it is a constant of the data, not the scored
    tokens): the summed per-token divergence over N, value and gradient."""
    student, teacher, labels = batch(seed=200 + int(beta * 10))
    num_items = 16
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, num_items_in_batch=num_items)
    inputs = gkd_inputs(teacher, labels)
    cfg = LossConfig(variant="gkd", gkd_lambda=1.0, gkd_beta=beta, support="full", chunk_size=4,
                     aggregation="token-sum", sum_divisor=num_items)
    loss, _ = compute_loss(student, inputs, cfg)
    torch.testing.assert_close(loss, trl, atol=1e-12, rtol=0)
    (g_trl,) = torch.autograd.grad(trl, student)
    (g_ours,) = torch.autograd.grad(loss, student)
    torch.testing.assert_close(g_ours, g_trl, atol=1e-12, rtol=0)
