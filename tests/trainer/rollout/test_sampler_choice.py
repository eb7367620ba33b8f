"""Which sampler a rollout worker runs and how (issue 31): `rollout.engine: auto` is vLLM on a CUDA
student with vLLM installed, else transformers; `rollout.kv_cache: auto` is a static KV cache on CUDA
(transformers compiles its decode step there), dynamic on CPU; both caches sample the same tokens
from the same seed (the tiny random student, fp32)."""

from __future__ import annotations

import pytest

from eopd_trainer.config import ConfigError, load_config
from eopd_trainer.rollout.samplers import make_sampler, resolve_engine, resolve_kv_cache
from eopd_trainer.rollout.samplers.base import SamplerUnavailable
from eopd_trainer.rollout.samplers.transformers_sampler import TransformersSampler
from tests.procs import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def test_auto_engine_is_vllm_only_on_cuda_with_vllm_installed():
    assert resolve_engine("auto", "cuda", True) == "vllm"
    assert resolve_engine("auto", "cuda:1", True) == "vllm"
    assert resolve_engine("auto", "cuda", False) == "transformers"
    assert resolve_engine("auto", "cpu", True) == "transformers"
    assert resolve_engine("transformers", "cuda", True) == "transformers"
    assert resolve_engine("vllm", "cpu", False) == "vllm"  # asked for: the sampler says if it cannot run


def test_auto_kv_cache_is_static_only_on_cuda():
    assert resolve_kv_cache("auto", "cuda") == "static" and resolve_kv_cache("auto", "cpu") == "dynamic"
    assert resolve_kv_cache("static", "cpu") == "static" and resolve_kv_cache("dynamic", "cuda:0") == "dynamic"


def test_cpu_defaults_give_the_transformers_sampler_with_a_dynamic_cache():
    sampler = make_sampler(load_config(TINY))
    assert isinstance(sampler, TransformersSampler) and sampler.kv_cache == "dynamic"
    with pytest.raises(ValueError, match="kv_cache must be dynamic or static"):
        TransformersSampler("tiny-random@1", kv_cache="paged")


def test_old_logprobs_from_vllm_need_an_engine_that_is_vllm():
    with pytest.raises(ConfigError, match="rollout.old_logprobs=vllm needs rollout.engine=vllm or auto"):
        load_config(TINY, ["rollout.engine=transformers", "rollout.old_logprobs=vllm"])
    cfg = load_config(TINY, ["rollout.old_logprobs=vllm"])  # auto on this CPU: transformers, refused at start
    with pytest.raises(SamplerUnavailable, match="resolved to transformers"):
        make_sampler(cfg)


def test_static_and_dynamic_caches_sample_the_same_tokens():
    sampler = TransformersSampler("tiny-random@1")
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]  # different lengths: left padding
    runs = {}
    for kv in ("dynamic", "static"):
        sampler.kv_cache = kv
        runs[kv] = sampler.sample(prompts, [3], temperature=1.0, top_p=0.9, max_new_tokens=24)
    assert [s.response_ids for s in runs["static"]] == [s.response_ids for s in runs["dynamic"]]
    assert [s.truncated for s in runs["static"]] == [s.truncated for s in runs["dynamic"]]
