"""The hidden-state path of the transformers engine: the final hidden states a Score answer carries,
projected by the engine's own output head with the shared maths (`eopd_common.output_head`), give
the statistics the engine sends (token log-prob, exact entropy, top-k), on random Qwen3- and
Llama-shaped models (bench.random_models) and the tiny-random preset; on SmolLM2-135M in the slow tier.

Tolerances (measured, with margin): float32 hidden states 1e-4 (the same float32 maths in another
order; largest seen 4e-5); bfloat16 hidden states, whose 8-bit mantissa moves each logit by
about |z| * 2^-9: 0.1 nats on entropies and log-probs (largest seen over these positions: 0.020 on
tiny-random, 0.053 on SmolLM2-135M).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from bench.random_models import TINY, write_random_model
from eopd_common.output_head import head_statistics, unpack_hidden
from eopd_teacher.engines.transformers_engine import TransformersEngine
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.types import GenerateItem, ScoreItem

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


def _engine(model: str, **kw) -> TransformersEngine:
    eng = TransformersEngine(TeacherSettings(model=model, chunk_size=16, compile_statistics=False, dtype="float32",
                                            **kw).engine_settings())
    eng.load()
    return eng


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hidden-models")
    return {
        "tiny-random": "tiny-random",
        "qwen3": str(write_random_model(root / "qwen3", TINY, role="teacher")),
        "llama": str(write_random_model(root / "llama", replace(TINY, family="llama", vocab_size=128256), role="teacher")),
    }


@pytest.fixture(scope="module")
def engines(models) -> dict[str, TransformersEngine]:
    """One loaded engine per model, shared by the module's tests."""
    return {kind: _engine(spec) for kind, spec in models.items()}


def _items(vocab: int, hidden: str, temperature: float = 1.0, seed: int = 0) -> list[ScoreItem]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, start) in enumerate(((19, 5), (7, 1), (33, 20))):
        out.append(ScoreItem(f"s{i}", rng.integers(0, vocab, n).astype(np.int64), start, 8, temperature,
                             hidden_dtype=hidden if i != 1 else ""))  # the middle one asks for none
    return out


def check_parity(engine, items, scores) -> float:
    """Asserts the hidden-state statistics equal the sent ones (the item's dtype's tolerance); the
    largest difference seen."""
    head = engine.output_head()
    worst = 0.0
    for it, s in zip(items, scores, strict=True):
        if not it.hidden_dtype:
            assert s.hidden_states is None
            continue
        assert s.hidden_dtype == it.hidden_dtype and s.output_head_fingerprint == head.fingerprint
        h = unpack_hidden(s.hidden_states, s.hidden_size, s.hidden_dtype, rows=it.num_scored)
        targets = torch.from_numpy(it.token_ids[it.score_from :])
        st = head_statistics(head, h, targets, torch.full((it.num_scored,), 1.0 / it.temperature), it.top_k, chunk_size=8)
        tol = TOLERANCE[it.hidden_dtype]
        for got, sent in ((st.entropies, s.entropies), (st.token_logprobs, s.token_logprobs),
                          (st.topk_logprobs, s.topk_logprobs)):
            np.testing.assert_allclose(got.numpy(), sent, atol=tol, rtol=0)
            worst = max(worst, float(np.abs(got.numpy() - sent).max()))
        if it.hidden_dtype == "float32":  # the same ids, except where two log-probs tie within the tolerance
            same = st.topk_ids.numpy() == s.topk_ids
            assert same.all() or np.abs(np.diff(s.topk_logprobs, axis=1)).min() < tol
    return worst


@pytest.mark.parametrize("kind", ["tiny-random", "qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hidden_states_reproduce_the_teachers_statistics(engines, kind, dtype):
    engine = engines[kind]
    info = engine.info
    assert info.hidden_size == engine.output_head().info.hidden_size and info.output_head_fingerprint
    items = _items(info.vocab_size, dtype, temperature=0.7)
    check_parity(engine, items, engine.score(items))


def test_chunked_prefill_returns_the_same_hidden_states(models):
    engine = _engine(models["tiny-random"], prefill_chunk_tokens=8)
    items = _items(engine.info.vocab_size, "float32")
    stepped = None
    for stepped in engine.score_steps(items):
        pass
    whole = engine.score(items)
    for a, b in zip(stepped, whole, strict=True):
        if b.hidden_states is None:
            assert a.hidden_states is None
            continue
        ha = unpack_hidden(a.hidden_states, a.hidden_size, "float32")
        hb = unpack_hidden(b.hidden_states, b.hidden_size, "float32")
        torch.testing.assert_close(ha, hb, atol=1e-5, rtol=1e-5)
    check_parity(engine, items, stepped)


def test_generate_returns_the_generated_positions_hidden_states(engines):
    engine = engines["tiny-random"]
    prompt = np.arange(5, 12, dtype=np.int64)
    item = GenerateItem("p", prompt, num_samples=2, max_new_tokens=6, temperature=1.0, top_p=1.0, stop_token_ids=(),
                        seed=3, top_k=8, score_temperature=0.9, hidden_dtype="float32")
    gens = engine.generate([item])
    assert len(gens) == 2
    for g in gens:  # the same check as Score's: the generated positions, scored at score_temperature
        it = ScoreItem(g.prompt_id, np.concatenate([prompt, g.token_ids]), len(prompt), 8, 0.9, hidden_dtype="float32")
        check_parity(engine, [it], [g.scores])


@pytest.mark.slow
def test_smollm2_hidden_states_reproduce_its_statistics():
    engine = _engine("smollm2-135m")
    info = engine.info
    assert (info.hidden_size, info.vocab_size) == (576, 49152)
    for dtype in ("float32", "bfloat16"):
        items = _items(info.vocab_size, dtype, seed=1)
        check_parity(engine, items, engine.score(items))
