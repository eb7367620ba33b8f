"""Shared prefill (`eopd_common.shared_prefill`): tokens the prompts of a batch share (a common prefix,
a prompt repeated for several samples) are run once, and generate samples the same tokens with the
same recorded log-probs (fp32, ~1e-5) as with the plain left-padded prefill, on tiny random models (a
Llama, a Gemma 2 with sliding-window layers and soft-capping); `response_hidden` gives a full forward
pass's final hidden states. Checked against the naive reference (each sequence alone, full logits),
and that the shared tokens really run once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eopd_trainer.rollout.samplers import transformers_sampler as ts
from eopd_common.shared_prefill import (
    common_prefix_length, layout, positions, prefill, response_hidden, work_tokens)
from tests.trainer.rollout.test_step_logprobs import Tok
from tests.trainer.test_pipeline_units import naive_sequence_logprobs, tiny_causal_lm

TEMPLATE = [1, 40, 41, 42, 43, 44, 45, 46]  # a chat template every prompt starts with
QUESTIONS = [[50, 51], [60, 61, 62, 63, 64], [70], [80, 81, 82]]
# repeated per sample (in a row, as eval and the rollout worker lay them out), ragged, one prompt no
# longer than the template plus one token
PROMPTS = [TEMPLATE + q for q in QUESTIONS for _ in range(3)] + [TEMPLATE[:5]]


def test_common_prefix_length_leaves_every_row_a_token():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # the last token is generate's
    assert common_prefix_length([[1, 2], [1, 2, 3, 4]]) == 1
    assert common_prefix_length([[5, 2], [1, 2]]) == 0
    assert common_prefix_length(PROMPTS) == 4


def test_layout_puts_the_padding_after_the_prefix_and_counts_positions_over_the_mask():
    ids, mask = layout([[7, 8, 9], [7, 8, 1, 2, 3]], 2, pad_id=0)
    assert ids.tolist() == [[7, 8, 0, 0, 9], [7, 8, 1, 2, 3]]
    assert mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]]
    assert positions(mask).tolist() == [[0, 1, 1, 1, 2], [0, 1, 2, 3, 4]]
    ids, mask = layout([[9], [1, 2, 3]], 0, pad_id=0)  # no prefix: plain left padding
    assert ids.tolist() == [[0, 0, 9], [1, 2, 3]] and mask.tolist() == [[0, 0, 1], [1, 1, 1]]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_shared_prefill_samples_what_the_plain_prefill_samples(kind, temperature, top_p):
    model = tiny_causal_lm(kind)
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=10, seed=5, record_logprobs=True)
    shared = ts.generate(model, Tok(), PROMPTS, share_prefill=True, **kw)
    plain = ts.generate(model, Tok(), PROMPTS, share_prefill=False, **kw)
    assert [s.response_ids for s in shared] == [s.response_ids for s in plain]
    assert [s.truncated for s in shared] == [s.truncated for s in plain]
    assert [s.prompt_ids for s in shared] == [list(p) for p in PROMPTS]
    for a, b in zip(shared, plain, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    want = naive_sequence_logprobs(model, PROMPTS, [s.response_ids for s in shared], temperature)
    for s, w in zip(shared, want, strict=True):
        np.testing.assert_allclose(s.logprobs, w, atol=1e-4)


def test_the_shared_tokens_run_once():
    """The prefix runs as one row, the rest of each distinct prompt once: 4 + 5 distinct rows' tails,
    not 13 rows of the full width."""
    model = tiny_causal_lm("llama")
    rows_tokens: list[tuple[int, int]] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kwargs: rows_tokens.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        done = prefill(model, PROMPTS, pad_id=0, device=torch.device("cpu"))
    finally:
        hook.remove()
    width = max(map(len, PROMPTS))
    assert done.prefix_tokens == 4 and done.distinct_prompts == 5
    assert rows_tokens == [(1, 4), (5, width - 4 - 1)]
    assert done.input_ids.shape == (len(PROMPTS), width)
    assert done.cache.get_seq_length() == width - 1


def test_nothing_shared_takes_the_plain_path():
    model = tiny_causal_lm("llama")
    assert prefill(model, [[5, 6], [7, 8, 9]], pad_id=0, device=torch.device("cpu")) is None
    assert prefill(model, [[5], [5]], pad_id=0, device=torch.device("cpu")) is None  # one token each: generate's
    assert prefill(model, [[5, 6, 7]], pad_id=0, device=torch.device("cpu")) is None  # one prompt shares nothing


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
@pytest.mark.parametrize("prompts", [PROMPTS[:6] + [PROMPTS[-1]], [[5, 9, 14], [3, 1, 4, 1, 5]]],
                         ids=["shared", "nothing-shared"])
@pytest.mark.parametrize("share", [True, False])
def test_response_hidden_is_the_full_forward_pass(kind, prompts, share):
    """At every position predicting a response token (ragged responses, in response order): each
    sequence's own full forward pass's final hidden states, 1e-4 in fp32."""
    model = tiny_causal_lm(kind)
    responses = [[11, 12, 2], [99], [8, 17, 250, 3, 41], [6, 7], [3], [9, 9, 9, 9], [4, 4]][: len(prompts)]
    got = response_hidden(model, prompts, responses, pad_id=0, device=torch.device("cpu"), share=share)
    want = []
    for p, r in zip(prompts, responses, strict=True):
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.tensor([list(p) + list(r)])).last_hidden_state[0]
        want.append(hidden[len(p) - 1 : len(p) - 1 + len(r)])
    torch.testing.assert_close(got, torch.cat(want), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="one response token"):
        response_hidden(model, prompts, [[]] * len(prompts), pad_id=0, device=torch.device("cpu"))


def test_work_tokens_counts_the_shared_tokens_once():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 7]]
    responses = [[5, 6], [5], [8, 9, 9]]
    # plain: 3 rows x 6 columns; shared: prefix [1, 2] once, 2 distinct rests of width 4 - 2 - 1 = 1,
    # 3 rows x (the last prompt token + 2 response columns) = 3 x 3
    assert work_tokens(prompts, responses) == (18, 2 + 2 * 1 + 3 * 3)
    assert work_tokens([[1, 2], [3, 4, 5]], [[6], [7]]) == (8, 8)  # nothing shared: the plain pass


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_response_hidden_gradients_are_the_plain_passes(kind):
    """The learner's use (train.share_prefill): with autograd on, a loss over the response positions'
    hidden states has the same value and the same gradient for every parameter with the shared
    tokens run once (the prefix's keys and values receive every row's gradient) as with one plain pass."""
    responses = [[11, 12, 2], [99, 98], [8, 17, 250, 3, 41], [6, 7], [3], [9, 9, 9, 9], [4, 4]]
    prompts = PROMPTS[:6] + [PROMPTS[-1]]
    results = []
    for share in (True, False):
        model = tiny_causal_lm(kind).train()
        h = response_hidden(model, prompts, responses, pad_id=0, device=torch.device("cpu"), share=share)
        weights = torch.linspace(-1.0, 1.0, h.numel()).reshape(h.shape)
        loss = (h * weights).sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_shared, grads_shared), (loss_plain, grads_plain) = results
    torch.testing.assert_close(loss_shared, loss_plain, atol=1e-4, rtol=1e-5)
    assert grads_shared.keys() == grads_plain.keys() and len(grads_plain) > 5
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_shared[name], g, atol=1e-4, rtol=1e-4, msg=name)
