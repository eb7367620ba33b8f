"""The vLLM engine: vLLM runs the teacher's forward passes, we compute the exact statistics.

How (checked against vLLM 0.32, the pinned version; see docs/vllm.md):

- The model runs in vLLM's **pooling runner** as an embedding model with **all-token pooling**:
  `LLM(model_dir, runner="pooling", convert="embed",
  pooler_config=PoolerConfig(task="token_embed", pooling_type="ALL", use_activation=False))`,
  and `llm.encode(prompts, pooling_task="token_embed")` returns, per sequence, the final hidden
  states `[L, d]` (after the model's final norm; `use_activation=False` turns off the L2
  normalisation an embedding model would apply). vLLM does the batching, scheduling and paged
  attention; its pooling model never applies the output projection.
- The output projection (`lm_head.weight`, or the input embedding when the model ties them, plus
  `lm_head.bias` if any) is read directly from the model directory's safetensors files, in the
  served dtype, on the statistics device; nothing reaches into vLLM internals.
- The hidden states at the scored positions go through `stats.token_statistics`, the same chunked
  float32 code as the transformers engine (exact entropy over the whole vocabulary, per-sequence
  temperature applied exactly to the logits, top-k under the full distribution). A logit scaling
  after the projection (Granite's `logits_scaling`, Cohere's `logit_scale`, read from config.json)
  is folded into the inverse temperature, as in the transformers engine; soft-capping is refused
  before vLLM starts (`eopd_common.logits.scoring_logit_factor`, the same table).
- Results do not depend on caching or batching: prefix caching is off (a cached prefix would
  not be recomputed, so its hidden states would be missing) and chunked prefill is off (a
  sequence is always computed in one step); vLLM's attention is per sequence, so neighbours in a
  step never mix. A sequence's last token is not sent: its hidden state predicts nothing scored.

Generation (`generate`, the Generate RPC and `/v1/completions` with `max_tokens` > 1) uses vLLM's own
sampler: a second `vllm.LLM` in vLLM's generate runner over the same directory
(`vllm_generator.VllmGenerator`) draws the responses, and their statistics come from this engine's
scoring path on prompt + response (score_from = len(prompt), at the item's score temperature), so
they are exactly Score's. On GPU the two engines share `vllm_gpu_memory_utilization` half and half.

vLLM wants a Hugging Face directory (`eopd_common.model_dirs.materialise_model_dir`): the
`tiny-random` preset is saved once under `cache_dir/tiny-random-<seed>-<config hash>/` (weights +
tokenizer), `smollm2-135m` and GGUF files are materialised as for the transformers engine. The
engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the environment says
otherwise; `eopd_common.vllm_args`, shared with the student's vLLM sampler); with
`vllm_tensor_parallel_size > 1` vLLM still starts its GPU workers as processes.

vLLM is imported inside `load()` only: it is an optional install (its own virtualenv on CPU, see
scripts/vllm_env.sh).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from eopd_common.logits import scoring_logit_factor
from eopd_common.model_dirs import materialise_model_dir, read_model_config, safetensors_index
from eopd_common.models import load_tokenizer, tokenizer_fingerprint
from eopd_common.vllm_args import describe_kwargs, engine_kwargs, prepare_vllm_process

from ..settings import EngineSettings
from ..stats import ChunkStats
from ..types import EngineInfo, GenerateItem, Generation, ScoreItem, SequenceScores
from .base import ScoringEngine, scores_from_hidden
from .vllm_generator import VllmGenerator, eos_ids_of_dir

log = logging.getLogger(__name__)

# Where the output projection lives in a checkpoint, most common first.
_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight", "output.weight")
_EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "transformer.wte.weight",
    "model.embeddings.weight",
    "tok_embeddings.weight",
)


def model_dir_logit_factor(model_dir: Path, model: str) -> float:
    """The factor the statistics multiply the output projection by to get the model's logits, from
    the directory's config.json (`eopd_common.logits.scoring_logit_factor`, `text_config` included):
    1.0 for most models, `1 / logits_scaling` for Granite. Raises `UnsupportedLogitTransform`
    (a ValueError naming `model` and the attribute) for soft-capping."""
    return scoring_logit_factor(read_model_config(model_dir), model)


def load_output_projection(model_dir: Path, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(weight [V, d], bias [V] or None)` of the output projection, from the safetensors files.

    Uses `lm_head.weight` when the checkpoint has one, else the input embedding when the config
    ties them (checkpoints of tied models usually store only the embedding)."""
    config = read_model_config(model_dir)
    text_config = config.get("text_config") or {}
    where = safetensors_index(model_dir)
    if not where:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (the vLLM engine reads the output projection from them)")
    tied = config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False))
    candidates = _HEAD_NAMES + (_EMBED_NAMES if tied or not any(n in where for n in _HEAD_NAMES) else ())
    name = next((n for n in candidates if n in where), None)
    if name is None:
        raise ValueError(f"{model_dir}: no output projection found (looked for {', '.join(candidates)})")
    if name in _EMBED_NAMES and not tied:
        log.warning("%s: no lm_head weight and tie_word_embeddings unset; using %s", model_dir, name)

    def read(key: str) -> torch.Tensor:
        with safe_open(where[key], framework="pt") as st:
            return st.get_tensor(key).to(dtype)

    bias_name = name.rsplit(".", 1)[0] + ".bias"
    bias = read(bias_name) if name in _HEAD_NAMES and bias_name in where else None
    return read(name), bias


class VllmEngine(ScoringEngine):
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self._llm: Any = None
        self._generator: VllmGenerator | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._device = "cpu"
        self._lock = threading.Lock()
        self._stats_fn = ChunkStats(compile=False)
        self._logit_factor = 1.0
        self._healthy = False
        self._dead_error: tuple[type[BaseException], ...] = ()  # (vLLM's EngineDeadError,) once loaded
        self.model_dir: Path | None = None
        self.tokenizer: Any = None

    # -- lifecycle ----------------------------------------------------------------------------
    def load(self) -> EngineInfo:
        s = self.settings
        prepare_vllm_process(s.threads)  # before vLLM starts: in-process engine core, OMP threads

        from vllm import LLM
        from vllm.config import PoolerConfig
        from vllm.platforms import current_platform
        from vllm.v1.engine.exceptions import EngineDeadError

        self._dead_error = (EngineDeadError,)

        cache_dir = Path(s.cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        model_dir, name, revision = materialise_model_dir(s.model, cache_dir)
        self._logit_factor = model_dir_logit_factor(model_dir, s.model)  # refuses soft-capping before vLLM starts
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(s.model, cache_dir)
        on_cpu = current_platform.is_cpu()
        self._device = "cpu" if on_cpu else s.resolved_device()
        # Two engines (scoring, sampling) share the GPU memory vLLM may take.
        shared = engine_kwargs(dtype=s.dtype, tensor_parallel_size=s.vllm_tensor_parallel_size,
                               gpu_memory_utilization=s.vllm_gpu_memory_utilization / 2, enforce_eager=s.vllm_enforce_eager,
                               kv_cache_gib=s.vllm_kv_cache_gib, max_model_len=s.vllm_max_model_len, on_cpu=on_cpu)
        kwargs: dict[str, Any] = dict(
            runner="pooling",
            convert="embed",
            pooler_config=PoolerConfig(task="token_embed", pooling_type="ALL", use_activation=False),
            **shared,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            seed=0,
        )
        if s.vllm_max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = s.vllm_max_num_batched_tokens
        log.info("starting vLLM on %s (%s)", model_dir, describe_kwargs(kwargs, skip=("pooler_config",)))
        self._llm = LLM(str(model_dir), **kwargs)
        max_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._generator = VllmGenerator(model_dir, eos_ids_of_dir(model_dir, self.tokenizer))
        self._generator.start(shared, on_cpu=on_cpu)

        torch_dtype = getattr(torch, s.dtype)
        weight, bias = load_output_projection(model_dir, torch_dtype)
        self._weight = weight.to(self._device)
        self._bias = None if bias is None else bias.to(self._device)
        # Compiled statistics, or the eager path if compiling fails (at the warm-up below or later).
        self._stats_fn = ChunkStats(compile=s.compile_statistics)
        vocab = int(self._weight.shape[0])
        self._healthy = True
        self.info = EngineInfo(
            model_name=name,
            model_revision=revision,
            vocab_size=vocab,
            max_context_length=max_len,
            dtype=s.dtype,
            engine="vllm",
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
        )
        # First request pays no start-up cost (and compiles the statistics now).
        self.score([ScoreItem("warmup", np.arange(8, dtype=np.int64) % vocab, 1, s.warmup_top_k, 1.0)])
        return self.info

    def health(self) -> bool:
        return self._healthy and self._llm is not None and self._generator is not None

    def shutdown(self) -> None:
        self._healthy = False
        generator, self._generator = self._generator, None
        if generator is not None:
            generator.shutdown()
        llm, self._llm = self._llm, None
        self._weight = self._bias = None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort on the way out
                log.debug("vLLM shutdown raised", exc_info=True)

    # -- scoring ------------------------------------------------------------------------------
    def hidden_states(self, items: list[ScoreItem]) -> list[torch.Tensor]:
        """Final hidden states `[len - 1, d]` of each item's tokens but the last (row t predicts
        token t + 1), from one `encode` call: vLLM batches and schedules them."""
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=it.token_ids[:-1].tolist()) for it in items]
        outputs = self._llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        hidden = [o.outputs.data for o in outputs]
        for it, h in zip(items, hidden, strict=True):
            if h.shape[0] != it.num_tokens - 1:
                raise RuntimeError(f"vLLM returned {h.shape[0]} hidden states for {it.num_tokens - 1} tokens of {it.seq_id!r}")
        return hidden

    @torch.inference_mode()
    def score(self, items: list[ScoreItem]) -> list[SequenceScores]:
        if not items:
            return []
        assert self._llm is not None and self._weight is not None, "engine not loaded"
        with self._lock:
            try:
                return self._score(items)
            except self._dead_error:
                self._healthy = False  # /readyz and gRPC health report it; the batch fails INTERNAL
                raise

    def _score(self, items: list[ScoreItem]) -> list[SequenceScores]:
        hidden = self.hidden_states(items)
        # Row t - 1 predicts token t: keep rows [score_from - 1, len - 1).
        h = torch.cat([hs[it.score_from - 1 :] for it, hs in zip(items, hidden)]).to(self._device)
        del hidden
        return scores_from_hidden(items, h, self._weight, self._bias, self.settings, self._stats_fn, self._logit_factor)

    # -- generation ---------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, items: list[GenerateItem], *, cancelled=None) -> list[Generation]:
        """vLLM's sampler draws every item's `num_samples` responses (one `generate` call), then one
        `score` batch of prompt + response (score_from = len(prompt), at `score_temperature`, the
        item's top-k) gives their statistics: exactly what Score answers for those tokens.
        `cancelled` is not polled: vLLM generates the whole job in one call."""
        if not items:
            return []
        assert self._generator is not None and self._weight is not None, "engine not loaded"
        with self._lock:
            try:
                drawn = self._generator.sample(items)
                scored = [
                    ScoreItem(it.prompt_id, np.concatenate([it.token_ids, ids]), len(it.token_ids), it.top_k, it.score_temperature)
                    for it, responses in zip(items, drawn, strict=True) for ids, _ in responses
                ]
                scores = iter(self._score(scored))
            except self._dead_error:
                self._healthy = False
                raise
        return [Generation(it.prompt_id, j, ids, reason, next(scores))
                for it, responses in zip(items, drawn, strict=True) for j, (ids, reason) in enumerate(responses)]
