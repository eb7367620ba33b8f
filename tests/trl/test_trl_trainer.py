"""A few steps of TRL 1.16's own server-teacher distillation trainer
(`trl.experimental.server_distillation.ServerDistillationTrainer`, unmodified) on CPU: a tiny local
student (the tiny-random preset, which shares SmolLM2's tokenizer) generates on-policy completions
and is trained against `eopd-teacher serve --model smollm2-135m`, which TRL reaches through its
own `VLLMClient` (`/v1/completions` with `prompt_logprobs`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import requests
import torch

pytest.importorskip("trl", reason="the TRL tier runs in .venv-vllm (bash scripts/vllm_env.sh)")

pytestmark = pytest.mark.integration


def _completions_ok(url: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('eopd_teacher_requests_total{code="OK",method="/v1/completions"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize(("beta", "loss_top_k"), [(0.0, 8), (1.0, 1)])
def test_server_distillation_trainer_steps(smollm2_teacher, tmp_path, beta, loss_top_k):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    from eopd_common.model_dirs import materialise_model_dir
    from eopd_common.models import default_cache_dir

    student_dir, _, _ = materialise_model_dir("tiny-random", Path(default_cache_dir()))
    model = AutoModelForCausalLM.from_pretrained(student_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = ServerDistillationConfig(
        output_dir=str(tmp_path), teacher_model_server_url=smollm2_teacher.http, max_steps=2, per_device_train_batch_size=2,
        max_completion_length=8, logging_steps=1, report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        loss_top_k=loss_top_k, beta=beta, save_strategy="no", learning_rate=1e-4)
    calls = _completions_ok(smollm2_teacher.http)
    trainer = ServerDistillationTrainer(
        model=model, args=args, processing_class=AutoTokenizer.from_pretrained(student_dir),
        train_dataset=Dataset.from_dict({"prompt": ["The capital of France is", "2 + 2 =", "Name a colour:", "def f(x):"]}))
    out = trainer.train()
    assert out.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    assert _completions_ok(smollm2_teacher.http) >= calls + 2  # the teacher was asked at each step
    assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())  # the student learned
