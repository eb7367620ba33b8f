"""Teachers whose logits are not `lm_head(hidden)`: both engines take the transform from the one
table (`eopd_common.logits`).

A Granite teacher with `logits_scaling` 4 (and a Cohere one with `logit_scale` 0.25) is scored on
its real logits by the transformers engine: log-probs, entropies and top-k equal those of
`model(...).logits` in fp32 at every temperature; the vLLM engine derives the same factor from the
directory's config.json. A Gemma 2 teacher (soft-capping) is refused at load, with the same
message from both engines. vLLM's own parity on the Granite teacher is in test_vllm_engine.py
(it runs where vLLM is installed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from eopd_common.logits import UnsupportedLogitTransform, scoring_logit_factor
from eopd_common.models import load_tokenizer
from eopd_teacher.engines.transformers_engine import TransformersEngine
from eopd_teacher.engines.vllm_engine import model_dir_logit_factor
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.types import ScoreItem

from ..reference import assert_topk_match, reference_scores

# What the table makes of each tiny model's config: the factor on lm_head(hidden), or None (refused).
FACTORS = {"granite": 0.25, "cohere": 0.25, "gemma2": None}


def save_tiny_model(kind: str, path: Path) -> Path:
    """A tiny random fp32 teacher with a logit transform, saved as a Hugging Face directory (weights
    + the tiny-random preset's tokenizer): Granite with `logits_scaling` 4, Cohere with
    `logit_scale` 0.25 or Gemma 2 with `final_logit_softcapping` 30. head_dim 32, as vLLM's CPU
    backend needs; output projection at std 1, so that logits are large enough for the transform to
    change every statistic."""
    import transformers

    tokenizer = load_tokenizer("tiny-random")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = {
        "granite": lambda: transformers.GraniteConfig(**common, logits_scaling=4.0),
        "cohere": lambda: transformers.CohereConfig(**common, logit_scale=0.25),
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=32, final_logit_softcapping=30.0,
                                                    sliding_window=64),
    }[kind]()
    cpu_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(5)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, 1.0)
    finally:
        torch.random.set_rng_state(cpu_state)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("logit-transforms")
    return {kind: save_tiny_model(kind, root / kind) for kind in FACTORS}


def _items(vocab: int) -> list[ScoreItem]:
    rng = np.random.default_rng(0)
    lengths, top_ks, temps = (5, 23, 11, 40, 2), (16, 3, 16, 1, 8), (1.0, 0.7, 1.0, 1.3, 1.0)
    return [ScoreItem(f"s{i}", rng.integers(0, vocab, size=n).astype(np.int64), int(rng.integers(1, n)), k, t)
            for i, (n, k, t) in enumerate(zip(lengths, top_ks, temps, strict=True))]


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_transformers_engine_scores_the_models_logits(model_dirs, kind):
    """Mixed batch (lengths, top-k, temperatures 0.7-1.3), chunk size 7: every statistic equals the
    plain reference on `model(...).logits` (1e-4), and differs from what the unscaled projection
    would give, so the scaling is really applied."""
    eng = TransformersEngine(TeacherSettings(model=str(model_dirs[kind]), chunk_size=7, compile_statistics=False).engine_settings())
    eng.load()
    try:
        model = eng._lm.model
        items = _items(eng.info.vocab_size)
        unscaled_gap = 0.0
        for it, res in zip(items, eng.score(items), strict=True):
            ids = it.token_ids.tolist()
            lp, ent, ti, tv = reference_scores(model, ids, it.score_from, it.top_k, it.temperature)
            np.testing.assert_allclose(res.token_logprobs, lp, atol=1e-4, rtol=0)
            np.testing.assert_allclose(res.entropies, ent, atol=1e-4, rtol=0)
            assert_topk_match(res.topk_ids, res.topk_logprobs, ti, tv, 1e-4)
            # lm_head(hidden) = logits / factor: scoring it at T is scoring the logits at T * factor.
            _, raw_ent, _, _ = reference_scores(model, ids, it.score_from, it.top_k, it.temperature * FACTORS[kind])
            unscaled_gap = max(unscaled_gap, float(np.abs(res.entropies - raw_ent).max()))
        assert unscaled_gap > 0.1
    finally:
        eng.shutdown()


def test_soft_capping_is_refused_at_load_identically_by_both_engines(model_dirs):
    """Soft-capping is not a scaling of lm_head(hidden): the transformers engine refuses the model
    at load, naming it and the attribute, and holds no model afterwards; the vLLM engine's check
    (from config.json, before vLLM starts) raises the same error with the same message."""
    path = model_dirs["gemma2"]
    eng = TransformersEngine(TeacherSettings(model=str(path), compile_statistics=False).engine_settings())
    with pytest.raises(UnsupportedLogitTransform) as tf_error:
        eng.load()
    message = str(tf_error.value)
    assert message.startswith(f"model {path}: final_logit_softcapping=30 is not supported")
    assert not eng.health() and eng._lm is None
    with pytest.raises(UnsupportedLogitTransform) as vllm_error:
        model_dir_logit_factor(path, str(path))
    assert str(vllm_error.value) == message


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_both_engines_take_the_same_factor(model_dirs, kind):
    """The vLLM engine reads config.json, the transformers engine the loaded config object: the
    same table gives both the same factor."""
    import transformers

    path = model_dirs[kind]
    config = transformers.AutoConfig.from_pretrained(path)
    assert model_dir_logit_factor(path, kind) == scoring_logit_factor(config, kind) == FACTORS[kind]
