"""The one table of logit transforms (`eopd_common.logits`) against a naive reference: each
transform, a config object and its config.json dict alike, the `text_config` lookup, identity
scalings counted as off, the teacher's scoring factor, and the tiny architectures' own logits."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from eopd_common.logits import (
    LOGIT_TRANSFORMS,
    UnsupportedLogitTransform,
    final_logits,
    logit_transforms,
    scoring_logit_factor,
    transform_values,
)


def _raw(dtype=torch.float32) -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(3, 5, 11) * 8.0).to(dtype)  # [..., V]: large enough for soft-capping to bite


def _naive(raw: torch.Tensor, cap=None, scale=None, scaling=None) -> torch.Tensor:
    """The transforms as transformers writes them, element by element in float64."""
    z = raw.double()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    if scale is not None:
        z = z * scale
    if scaling is not None:
        z = z / scaling
    return z


def _configs():
    """(name, config object, naive kwargs): one per transform, plus none and identity scalings."""
    return [
        ("llama", transformers.LlamaConfig(), {}),
        ("gemma2", transformers.Gemma2Config(final_logit_softcapping=5.0), {"cap": 5.0}),
        ("cohere", transformers.CohereConfig(logit_scale=0.25), {"scale": 0.25}),
        ("granite", transformers.GraniteConfig(logits_scaling=4.0), {"scaling": 4.0}),
        ("granite-identity", transformers.GraniteConfig(logits_scaling=1.0), {}),
        ("cohere-identity", transformers.CohereConfig(logit_scale=1.0), {}),
    ]


@pytest.mark.parametrize("name,config,naive", _configs(), ids=[c[0] for c in _configs()])
@pytest.mark.parametrize("as_dict", [False, True], ids=["object", "config.json"])
def test_final_logits_equal_the_naive_transform(name, config, naive, as_dict):
    cfg = config.to_dict() if as_dict else config
    raw = _raw()
    got = final_logits(cfg, raw)
    assert got.dtype == torch.float32 and got.shape == raw.shape
    torch.testing.assert_close(got.double(), _naive(raw, **naive), rtol=1e-6, atol=1e-5)
    expected_on = {"cap": "final_logit_softcapping", "scale": "logit_scale", "scaling": "logits_scaling"}
    assert logit_transforms(cfg) == [expected_on[k] for k in naive]


def test_final_logits_cast_low_precision_to_float32():
    raw = _raw(torch.bfloat16)
    got = final_logits(transformers.GraniteConfig(logits_scaling=4.0), raw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), raw.double() / 4.0, rtol=0, atol=0)  # / 4 is exact
    untouched = final_logits(transformers.LlamaConfig(), raw)
    assert untouched.dtype == torch.float32 and torch.equal(untouched, raw.float())


def test_object_and_config_json_dict_agree():
    """The config object, its dict and the config.json it saves give the same transforms."""
    for _, config, _ in _configs():
        saved = json.loads(config.to_json_string(use_diff=False))
        assert transform_values(config) == transform_values(config.to_dict()) == transform_values(saved)


def test_granite_with_logits_scaling_one_is_off():
    """Granite's default `logits_scaling: 1.0` is the identity: no transform, factor 1, the
    projection's output is the logits."""
    cfg = transformers.GraniteConfig()
    assert cfg.logits_scaling == 1.0
    assert transform_values(cfg) == {} and logit_transforms(cfg.to_dict()) == []
    assert scoring_logit_factor(cfg, "granite") == 1.0


def test_text_config_is_looked_up():
    """Multimodal configs keep the text model's attributes under `text_config`; a value set there
    is found, from the object and from the dict, and the top level is read when it is not set there."""
    gemma3 = transformers.Gemma3Config(text_config={"final_logit_softcapping": 30.0})
    assert transform_values(gemma3) == {"final_logit_softcapping": 30.0}
    assert transform_values(gemma3.to_dict()) == {"final_logit_softcapping": 30.0}
    raw = _raw()
    torch.testing.assert_close(final_logits(gemma3, raw).double(), _naive(raw, cap=30.0), rtol=1e-6, atol=1e-5)
    assert logit_transforms(transformers.Gemma3Config()) == []  # Gemma 3 text default: no soft-capping
    assert transform_values({"text_config": {"logits_scaling": 2.0}}) == {"logits_scaling": 2.0}
    assert transform_values({"text_config": {}, "logits_scaling": 2.0}) == {"logits_scaling": 2.0}
    assert transform_values({"text_config": None, "logit_scale": 0.5}) == {"logit_scale": 0.5}
    assert transform_values({"text_config": {"logits_scaling": 1.0}, "logits_scaling": 8.0}) == {}  # text model's own wins


def test_off_values():
    assert transform_values({}) == {}
    assert transform_values({"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": None}) == {}
    assert transform_values({"final_logit_softcapping": 0.0}) == {}  # transformers uses None; 0 would divide by 0
    assert list(transform_values({"logits_scaling": 2, "logit_scale": 3, "final_logit_softcapping": 5})) == list(
        LOGIT_TRANSFORMS)  # table order


@pytest.mark.parametrize("as_dict", [False, True], ids=["object", "config.json"])
def test_scoring_logit_factor(as_dict):
    """The teacher's check: a positive scaling becomes one factor, with `factor * raw` equal to
    `final_logits(raw)`; soft-capping and non-positive scalings are refused, naming the model and
    the attribute."""
    def conv(c):
        return c.to_dict() if as_dict else c

    raw = _raw()
    for config, factor in [(transformers.LlamaConfig(), 1.0), (transformers.GraniteConfig(logits_scaling=4.0), 0.25),
                           (transformers.GraniteConfig(logits_scaling=3.0), 1 / 3),
                           (transformers.CohereConfig(logit_scale=0.0625), 0.0625)]:
        got = scoring_logit_factor(conv(config), "m")
        assert got == pytest.approx(factor, rel=1e-15)
        torch.testing.assert_close(raw * got, final_logits(conv(config), raw), rtol=1e-6, atol=1e-6)
    with pytest.raises(UnsupportedLogitTransform, match=r"model /models/g2: final_logit_softcapping=5 is not supported"):
        scoring_logit_factor(conv(transformers.Gemma2Config(final_logit_softcapping=5.0)), "/models/g2")
    for bad in (0.0, -2.0, math.inf, math.nan):
        with pytest.raises(UnsupportedLogitTransform, match=r"model m: logits_scaling=\S+ is not supported \(must be > 0\)"):
            scoring_logit_factor({"logits_scaling": bad}, "m")
    assert issubclass(UnsupportedLogitTransform, ValueError)  # the engines' load errors stay ValueErrors


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "cohere"])
def test_table_reproduces_the_models_own_logits(kind):
    """On tiny random models of each architecture, `final_logits(config, lm_head(decoder(x)))` is
    `model(x).logits` (fp32)."""
    from tests.trainer.test_pipeline_units import tiny_causal_lm

    model = tiny_causal_lm(kind)
    ids = torch.tensor([[5, 9, 14, 3, 1, 4, 1, 5, 9, 2]])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
        head = model.get_output_embeddings()
        raw = torch.nn.functional.linear(hidden, head.weight, head.bias)
    torch.testing.assert_close(final_logits(model.config, raw), want, rtol=1e-5, atol=1e-5)
    if kind != "gemma2":
        torch.testing.assert_close(raw * scoring_logit_factor(model.config, kind), want, rtol=1e-5, atol=1e-5)
