"""Old log-probs recorded while sampling (`rollout.old_logprobs: generate`, the CPU default through
`auto`): `StepLogprobs` reads generate's raw logits of each step, so the transformers sampler needs
no second forward pass. Checked against the naive reference (each sequence's full logits, fp64
log-softmax) on tiny random fp32 models, with and without a logit transform after the output
projection, with left padding, temperature and top-p; the recording does not change what is
sampled; the sampler's choice between the recorded and the forward-pass log-probs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from eopd_trainer.config import ConfigError, load_config
from eopd_trainer.rollout.samplers import make_sampler
from eopd_trainer.rollout.samplers import transformers_sampler as ts
from eopd_trainer.rollout.samplers.base import SamplerUnavailable
from eopd_trainer.rollout.samplers.step_logprobs import StepLogprobs
from tests.procs import ROOT
from tests.trainer.test_pipeline_units import naive_sequence_logprobs, tiny_causal_lm

TINY = ROOT / "configs" / "tiny.yaml"
PROMPTS = [[5, 9, 14], [3, 1, 4, 1, 5, 9, 2, 8], [7], [20, 30, 40, 50, 60]]  # different lengths: left padding


class Tok:
    """What `generate` reads of a tokenizer: the pad and EOS ids."""

    pad_token_id = 0
    eos_token_id = 2


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_recorded_logprobs_equal_the_full_logits(kind, temperature, top_p):
    """Each response token's recorded log-prob is log_softmax(logits / T) of the model's own logits
    over the whole vocabulary (not the top-p nucleus), as the learner takes it: 1e-4 in fp32."""
    model = tiny_causal_lm(kind)
    samples = ts.generate(model, Tok(), PROMPTS, temperature=temperature, top_p=top_p, max_new_tokens=12, seed=4,
                          record_logprobs=True)
    want = naive_sequence_logprobs(model, PROMPTS, [s.response_ids for s in samples], temperature)
    for s, w in zip(samples, want, strict=True):
        assert s.logprobs.dtype == np.float32 and s.logprobs.shape == (len(s.response_ids),)
        np.testing.assert_allclose(s.logprobs, w, rtol=0, atol=1e-4)
        assert s.top_ids is None


def test_recorded_top_ids_are_the_forward_pass_top_k():
    """With top_k_ids the step's top-k ids come along: at every response position they are the k
    most likely ids of the forward pass (their forward log-probs are its k largest, by rank)."""
    model, k = tiny_causal_lm("llama"), 5
    samples = ts.generate(model, Tok(), PROMPTS, temperature=0.9, top_p=1.0, max_new_tokens=10, seed=1,
                          record_logprobs=True, top_k_ids=k)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].double() / 0.9, dim=-1)
        rows = lp[len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
        assert s.top_ids.shape == (len(s.response_ids), k) and s.top_ids.dtype == np.int32
        got = rows.gather(1, torch.as_tensor(s.top_ids, dtype=torch.long))
        np.testing.assert_allclose(got.numpy(), rows.topk(k, dim=-1).values.numpy(), rtol=0, atol=1e-4)


def test_recording_does_not_change_what_is_sampled():
    model = tiny_causal_lm("llama")
    plain = ts.generate(model, Tok(), PROMPTS, temperature=1.0, top_p=0.9, max_new_tokens=16, seed=7)
    rec = ts.generate(model, Tok(), PROMPTS, temperature=1.0, top_p=0.9, max_new_tokens=16, seed=7,
                      record_logprobs=True, top_k_ids=3)
    assert [s.response_ids for s in rec] == [s.response_ids for s in plain]
    assert [s.truncated for s in rec] == [s.truncated for s in plain]
    assert all(s.logprobs is None for s in plain)


def test_step_logprobs_settles_each_step_with_the_next_token():
    """Pure logic: the scores of step t are settled by the token appended before step t + 1 (the
    last column of input_ids), the last step's by `finish`; one [B, V] block is kept at a time."""
    scores = [torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0], [0.0, 5.0, 0.0]])]
    tokens = [torch.tensor([2, 0]), torch.tensor([0, 1])]
    rec = StepLogprobs(temperature=2.0, top_k=1)
    prompt = torch.tensor([[9], [9]])
    assert rec(prompt, scores[0]) is scores[0]  # the scores pass through untouched
    rec(torch.cat([prompt, tokens[0][:, None]], 1), scores[1])
    rec.finish(torch.cat([prompt, tokens[0][:, None], tokens[1][:, None]], 1))
    want = np.stack([torch.log_softmax(s / 2.0, -1).gather(1, t[:, None])[:, 0].numpy()
                     for s, t in zip(scores, tokens, strict=True)], axis=1)
    np.testing.assert_allclose(rec.logprobs, want, rtol=0, atol=1e-6)
    assert rec.top_ids.tolist() == [[[2], [0]], [[0], [1]]]
    with pytest.raises(ValueError, match="temperature must be > 0"):
        StepLogprobs(0.0)


def test_the_sampler_serves_recorded_logprobs_and_falls_back_to_the_forward_pass():
    model = tiny_causal_lm("llama")
    sampler = ts.TransformersSampler("tiny", model=model, tokenizer=Tok(), old_logprobs="auto", candidates=4)
    assert sampler.old_logprobs_from == "generate"
    samples = sampler.sample(PROMPTS, [3], temperature=0.8, top_p=1.0, max_new_tokens=8)
    forward = ts.sequence_logprobs(model, PROMPTS, [s.response_ids for s in samples], temperature=0.8, pad_id=0)
    got = sampler.old_logprobs(samples, temperature=0.8)
    assert all(g is s.logprobs for g, s in zip(got, samples, strict=True))  # recorded, no second pass
    for g, f in zip(got, forward, strict=True):
        np.testing.assert_allclose(g, f, rtol=0, atol=1e-4)
    lps, tops = sampler.old_logprobs_topk(samples, temperature=0.8, k=4)
    assert all(t is s.top_ids for t, s in zip(tops, samples, strict=True))
    # asked at another temperature, or for another k, than recorded: the forward pass answers
    other = sampler.old_logprobs(samples, temperature=1.0)
    want = ts.sequence_logprobs(model, PROMPTS, [s.response_ids for s in samples], temperature=1.0, pad_id=0)
    for g, f in zip(other, want, strict=True):
        np.testing.assert_array_equal(g, f)
    _, tops6 = sampler.old_logprobs_topk(samples, temperature=0.8, k=6)
    assert [t.shape[-1] for t in tops6] == [6] * len(samples)


def test_which_old_logprobs_the_sampler_takes(monkeypatch, caplog):
    model = tiny_causal_lm("llama")
    assert ts.TransformersSampler("t", model=model, tokenizer=Tok(), old_logprobs="transformers").old_logprobs_from == "transformers"
    assert ts.TransformersSampler("t", model=model, tokenizer=Tok(), old_logprobs="generate").old_logprobs_from == "generate"
    half = tiny_causal_lm("llama").to(torch.bfloat16)
    assert ts.TransformersSampler("t", model=half, tokenizer=Tok(), old_logprobs="auto").old_logprobs_from == "transformers"
    with pytest.raises(ValueError, match="old_logprobs is auto, generate or transformers"):
        ts.TransformersSampler("t", model=model, tokenizer=Tok(), old_logprobs="vllm")
    monkeypatch.setattr(ts, "check_step_logprobs", lambda *a, **k: 0.5)  # a probe that disagrees
    with pytest.raises(SamplerUnavailable, match="differ from the forward pass's by 0.5 .* use rollout.old_logprobs=transformers"):
        ts.TransformersSampler("t", model=model, tokenizer=Tok(), old_logprobs="generate")
    with caplog.at_level(logging.WARNING):
        assert ts.TransformersSampler("t", model=model, tokenizer=Tok(), old_logprobs="auto").old_logprobs_from == "transformers"
    assert "old log-probs come from a forward pass" in caplog.text


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite"])
def test_the_start_up_probe_agrees_in_fp32(kind):
    """The probe's difference is float rounding in fp32, logit transforms included."""
    assert ts.check_step_logprobs(tiny_causal_lm(kind), Tok()) <= 1e-4


def test_config_old_logprobs():
    assert load_config(TINY).rollout.old_logprobs == "auto"
    assert make_sampler(load_config(TINY)).old_logprobs_from == "generate"  # CPU, fp32: recorded while sampling
    assert make_sampler(load_config(TINY, ["rollout.old_logprobs=transformers"])).old_logprobs_from == "transformers"
    assert make_sampler(load_config(TINY, ["mode=async"])).old_logprobs_from == "generate"  # either mode
    with pytest.raises(ConfigError, match="rollout.old_logprobs=generate needs the transformers sampler"):
        load_config(TINY, ["rollout.engine=vllm", "rollout.old_logprobs=generate"])
