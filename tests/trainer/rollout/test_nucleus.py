"""`Nucleus` (temperature and top-p without sorting the vocabulary) keeps exactly the tokens
transformers' own `TopPLogitsWarper` keeps, passes on the same scores, and `generate` samples the
same tokens through it as through transformers' warpers."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from eopd_trainer.rollout.samplers.nucleus import FIRST_K, Nucleus, nucleus_mask
from tests.trainer.rollout.test_shared_prefill import PROMPTS
from tests.trainer.rollout.test_step_logprobs import Tok
from tests.trainer.test_pipeline_units import tiny_causal_lm


def transformers_scores(z: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
    return LogitsProcessorList(warpers)(None, z.clone())


def exact_mass_before(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """`[B, V]` float64: the mass of the tokens more probable than each, summed exactly enough."""
    probs = (z.double() / temperature).softmax(-1)
    top, idx = probs.sort(-1, descending=True)
    return torch.empty_like(probs).scatter_(1, idx, top.cumsum(-1) - top)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.8, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat rows (a nucleus beyond FIRST_K tokens) to peaked
def test_nucleus_keeps_what_transformers_keeps(top_p, temperature, spread):
    """The same tokens kept and the same scores, but where transformers' cumulative sum (fp32, over the
    whole sorted vocabulary) and this one round to different sides of top_p: there the token's exact
    mass before it is within 1e-5 of top_p (a handful of the 128k tokens of the flattest rows)."""
    g = torch.Generator().manual_seed(int(top_p * 1000) + int(spread * 10))
    z = torch.randn(64, 2000, generator=g) * spread
    want = transformers_scores(z, temperature, top_p)
    got = Nucleus(temperature, top_p)(None, z.clone())
    differ = torch.isinf(got) != torch.isinf(want)
    assert int(differ.sum()) <= 8
    assert bool(((exact_mass_before(z, temperature) - top_p).abs()[differ] < 1e-5).all())
    both = ~torch.isinf(got) & ~torch.isinf(want)
    torch.testing.assert_close(got[both], want[both], rtol=0, atol=0)


def test_the_nucleus_grows_past_the_first_candidates_and_keeps_the_top_token():
    z = torch.zeros(2, 5000)  # uniform: the nucleus at 0.9 is 4500 tokens, far beyond FIRST_K
    z[1, 7] = 50.0  # one certain token: only it survives any top-p
    mask = nucleus_mask(z, 0.9)
    assert int(mask[0].sum()) == pytest.approx(4500, abs=1) and int(mask[0].sum()) > FIRST_K
    assert mask[1].nonzero().flatten().tolist() == [7]
    assert nucleus_mask(z, 1e-9).sum(-1).tolist() == [1, 1]


def test_generate_samples_what_transformers_warpers_sample():
    model = tiny_causal_lm("llama")
    ids = torch.tensor([p[-4:] for p in PROMPTS])
    for temperature, top_p in ((1.0, 0.8), (0.7, 0.9), (1.3, 1.0)):
        torch.manual_seed(11)
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                              temperature=temperature, top_p=top_p, max_new_tokens=12, pad_token_id=0,
                              eos_token_id=[Tok.eos_token_id])
        torch.manual_seed(11)
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             temperature=1.0, top_p=1.0, max_new_tokens=12, pad_token_id=0,
                             eos_token_id=[Tok.eos_token_id],
                             logits_processor=LogitsProcessorList([Nucleus(temperature, top_p)]))
        assert torch.equal(got, want)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 0.5), (1.0, 0.0), (1.0, 1.5)])
def test_bad_settings_are_refused(temperature, top_p):
    with pytest.raises(ValueError, match="temperature|top_p"):
        Nucleus(temperature, top_p)
