"""TRL 1.16's own client code, unmodified (`VLLMClient.get_sequence_logprobs`, what its
server-teacher distillation trainers call), against `eopd-teacher serve --model smollm2-135m`'s
`/v1/completions`; the numbers equal eopd's gRPC answer for the same sequences (fp32, 1e-5).

TRL asks `max_tokens: 1`, so eopd scores each sequence with one filler token appended (the last
position gives the completion token, openai_format.scored_tokens): a forward one token longer
than the gRPC request for the sequence alone, whose fp32 rounding differs by up to ~2e-5 at
log-probs near -12 (measured 1.5e-5). The gRPC reference is therefore the same scored tokens
(the sequence plus the filler) in the same requests (the same batches: fp32 sums also differ
with the padding of a batch), compared at 1e-5, and the sequence alone at 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from eopd_common.models import load_tokenizer
from eopd_teacher.client import TeacherClient

pytest.importorskip("trl", reason="the TRL tier runs in .venv-vllm (bash scripts/vllm_env.sh)")

pytestmark = pytest.mark.integration

TEXTS = [
    ("Question: what is 12 + 30?\nAnswer:", " 12 + 30 = 42, so the answer is 42."),
    ("Write one word that rhymes with cat.", " Hat. Other words that rhyme with cat are bat, mat and sat."),
    ("The capital of France is", " Paris, which is also its largest city."),
    ("def add(a, b):\n", "    return a + b\n\nprint(add(2, 3))\n"),
    ("Translate to French: good morning", " Bonjour."),
]


def workload() -> tuple[list[list[int]], list[int]]:
    tok = load_tokenizer("smollm2-135m")
    seqs, prompt_lengths = [], []
    for prompt, completion in TEXTS:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"]
        seqs.append(p + c)
        prompt_lengths.append(len(p))
    return seqs, prompt_lengths


@pytest.mark.parametrize(("top_logprobs", "temperature", "chunk_size"), [(100, 1.0, 0), (20, 0.7, 2)])
def test_get_sequence_logprobs_equals_grpc(trl_client, smollm2_teacher, top_logprobs, temperature, chunk_size):
    seqs, prompt_lengths = workload()
    out = trl_client.get_sequence_logprobs(seqs, prompt_lengths, top_logprobs=top_logprobs, temperature=temperature,
                                           chunk_size=chunk_size, max_concurrent_requests=1)
    pairs = list(zip(seqs, prompt_lengths, strict=True))
    with TeacherClient(smollm2_teacher.target) as c:
        step = chunk_size or len(pairs)
        same = [r for at in range(0, len(pairs), step) for r in c.score(
            [(str(i), s + [0], 1) for i, (s, _) in enumerate(pairs[at:at + step])], top_k=top_logprobs, temperature=temperature)]
        alone = c.score([(str(i), s, pl) for i, (s, pl) in enumerate(pairs)], top_k=top_logprobs, temperature=temperature)
    for i, ((seq, pl), g, a) in enumerate(zip(pairs, same, alone, strict=True)):
        n = len(seq) - pl
        lp = np.asarray(out["logprobs"][i], dtype=np.float64)
        ids = np.asarray(out["logprob_token_ids"][i])
        own = np.asarray(out["actual_logprobs"][i])[:, 0]
        assert lp.shape == ids.shape == (n, top_logprobs)
        assert [t[0] for t in out["actual_token_ids"][i]] == seq[pl:]
        rows = slice(pl - 1, len(seq) - 1)  # the positions TRL keeps, in the answer scored from position 1
        assert (ids == g.topk_ids[rows]).all()
        np.testing.assert_allclose(lp, g.topk_logprobs[rows], atol=1e-5, rtol=0)
        np.testing.assert_allclose(own, g.token_logprobs[rows], atol=1e-5, rtol=0)
        np.testing.assert_allclose(lp, a.topk_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(own, a.token_logprobs, atol=1e-4, rtol=0)
