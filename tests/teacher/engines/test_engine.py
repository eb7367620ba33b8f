"""The transformers engine against a plain full-vocabulary reference, alone and in mixed batches,
on tiny-random and on the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import numpy as np
import torch
import pytest

from eopd_teacher import __version__
from eopd_teacher.engines.transformers_engine import TransformersEngine
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.serving.state import served_info
from eopd_teacher.types import EngineInfo, ModelInfo, ScoreItem

from ..reference import assert_topk_match, reference_scores


def _engine(model: str, **kw) -> TransformersEngine:
    eng = TransformersEngine(TeacherSettings(model=model, chunk_size=7, **kw).engine_settings())
    eng.load()
    return eng


def _items(vocab: int, seed: int = 0, lengths=(5, 23, 11, 40, 2), top_ks=(16, 3, 16, 1, 8), temps=(1.0, 0.7, 1.0, 1.3, 1.0)):
    rng = np.random.default_rng(seed)
    items = []
    for i, (n, k, t) in enumerate(zip(lengths, top_ks, temps, strict=True)):
        ids = rng.integers(0, vocab, size=n).astype(np.int64)
        items.append(ScoreItem(f"s{i}", ids, int(rng.integers(1, n)), k, t))
    return items


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "compiled"])
def tiny_engine(request):
    eng = _engine("tiny-random", compile_statistics=request.param)
    yield eng
    eng.shutdown()


def _check_against_reference(eng: TransformersEngine, items, atol=1e-4):
    model = eng._lm.model
    results = eng.score(items)
    for it, res in zip(items, results, strict=True):
        lp, ent, ti, tv = reference_scores(model, it.token_ids.tolist(), it.score_from, it.top_k, it.temperature)
        assert res.seq_id == it.seq_id
        assert res.token_logprobs.shape == (it.num_scored,) and res.topk_ids.shape == (it.num_scored, it.top_k)
        np.testing.assert_allclose(res.token_logprobs, lp, atol=atol, rtol=0)
        np.testing.assert_allclose(res.entropies, ent, atol=atol, rtol=0)
        assert_topk_match(res.topk_ids, res.topk_logprobs, ti, tv, atol)
    return results


def test_tiny_matches_reference_in_mixed_batch(tiny_engine):
    _check_against_reference(tiny_engine, _items(tiny_engine.info.vocab_size))


def test_alone_equals_inside_mixed_batch(tiny_engine):
    items = _items(tiny_engine.info.vocab_size, seed=1)
    batched = tiny_engine.score(items)
    for it, b in zip(items, batched, strict=True):
        (alone,) = tiny_engine.score([it])
        np.testing.assert_allclose(alone.token_logprobs, b.token_logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(alone.entropies, b.entropies, atol=1e-5, rtol=0)
        assert_topk_match(alone.topk_ids, alone.topk_logprobs, b.topk_ids, b.topk_logprobs, 1e-5)


def test_model_info(tiny_engine):
    info = tiny_engine.info
    assert isinstance(info, EngineInfo)
    assert info.engine == "transformers" and info.vocab_size == 49152 and info.max_context_length == 2048
    assert len(info.tokenizer_fingerprint) == 64 and info.dtype == "float32"


def test_served_info_adds_limits_and_version(tiny_engine):
    """The engine reports only its model; the server adds its limits (top-k capped at the
    vocabulary) and its version to what GetModelInfo answers."""
    engine_info = EngineInfo(model_name="m", model_revision="r", vocab_size=100, max_context_length=50, dtype="float32",
                             engine="transformers", tokenizer_fingerprint="f" * 64)
    settings = TeacherSettings(default_top_k=16, max_top_k=64, max_sequences_per_request=7, max_tokens_per_request=999)
    assert served_info(engine_info, settings) == ModelInfo(
        model_name="m", model_revision="r", vocab_size=100, max_context_length=50, dtype="float32", engine="transformers",
        default_top_k=16, max_top_k=64, tokenizer_fingerprint="f" * 64, max_sequences_per_request=7,
        max_tokens_per_request=999, server_version=__version__, max_candidates=64,
    )
    assert __version__
    # max_top_k is capped at the vocabulary.
    small = served_info(EngineInfo("m", "r", 40, 50, "float32", "transformers", "f" * 64), settings)
    assert (small.default_top_k, small.max_top_k) == (16, 40)
    assert small.max_candidates == 40  # per-position candidates: capped at the vocabulary too
    # The real engine's info, served with the default settings (as the teacher did before the split).
    info = served_info(tiny_engine.info, TeacherSettings())
    assert info.default_top_k == 16 and info.max_top_k == 64 and info.vocab_size == 49152
    assert (info.max_sequences_per_request, info.max_tokens_per_request) == (4096, 1 << 19)
    assert info.server_version == __version__


def test_bf16_weights_score_close_to_fp32():
    eng = _engine("tiny-random", dtype="bfloat16", compile_statistics=False)
    ref = _engine("tiny-random", compile_statistics=False)
    items = _items(eng.info.vocab_size, seed=2)
    for a, b in zip(eng.score(items), ref.score(items), strict=True):
        assert a.entropies.dtype == np.float32
        # bf16 weights change the model itself; statistics still close to the fp32 model's.
        assert np.abs(a.entropies - b.entropies).max() < 0.15


@pytest.mark.slow
def test_smollm2_matches_reference_fp32():
    eng = _engine("smollm2-135m", compile_statistics=True)
    tok = eng.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], add_generation_prompt=True, tokenize=False)
    a = tok(prompt + "12 * 7 = 84. The answer is 84.", add_special_tokens=False)["input_ids"]
    b = tok(prompt + "Let me think step by step about this multiplication problem.", add_special_tokens=False)["input_ids"]
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    items = [
        ScoreItem("a", np.array(a), n_prompt, 16, 1.0),
        ScoreItem("b", np.array(b), n_prompt, 16, 1.0),
        ScoreItem("c", np.array(a[:9]), 1, 4, 0.6),
    ]
    results = _check_against_reference(eng, items)
    # The real model is confident on "84" after "12 * 7 =": a sanity check of the numbers.
    assert results[0].entropies.min() < 1.0 and results[0].token_logprobs.max() > -1.0
    for it in items:  # alone == in the mixed batch (fp32; tolerances as docs/teacher.md says)
        (alone,) = eng.score([it])
        batched = results[[x.seq_id for x in items].index(it.seq_id)]
        # The 49k-vocabulary model's values differ by up to ~6e-5 between a batch of one and a
        # padded batch (measured over runs: 1.6e-5 to 5.7e-5; fp32 rounding of differently blocked
        # matmuls, ~2e-5 relative), hence 1e-4 here and 1e-5 on the tiny model.
        np.testing.assert_allclose(alone.token_logprobs, batched.token_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(alone.entropies, batched.entropies, atol=1e-4, rtol=0)
        assert_topk_match(alone.topk_ids, alone.topk_logprobs, batched.topk_ids, batched.topk_logprobs, 1e-4)
    eng.shutdown()


@pytest.mark.slow
def test_gguf_file_and_hf_directory_specs(tmp_path):
    """A .gguf file path and a Hugging Face directory load to the same model as the preset."""
    from eopd_common.models import load_causal_lm, smollm2_dir, smollm2_gguf_path

    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253]])
    from_gguf = load_causal_lm(str(smollm2_gguf_path()))
    from_dir = load_causal_lm(str(smollm2_dir()))
    assert from_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and from_dir.revision.startswith("sha256:")
    with torch.no_grad():
        torch.testing.assert_close(from_gguf.model(ids).logits, from_dir.model(ids).logits)
    from eopd_common.models import tokenizer_fingerprint

    assert tokenizer_fingerprint(from_gguf.tokenizer) == tokenizer_fingerprint(from_dir.tokenizer)


def test_unknown_model_spec_is_a_clear_error():
    from eopd_common.models import resolve_spec

    with pytest.raises(ValueError, match="neither a preset"):
        resolve_spec("/nonexistent/model")
    with pytest.raises(ValueError, match="seed"):
        resolve_spec("tiny-random@x")
