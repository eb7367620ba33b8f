"""The transformers engine: a Hugging Face causal LM on CPU or GPU.

The decoder runs over right-padded sequences; only the hidden states at scored positions go
through the output projection, in chunks (`stats.token_statistics`), so no `[batch, seq, vocab]`
tensor is ever built. The tokens a batch's sequences share before their scored positions (a chat
template, a prompt sampled twice) run once (`share_prefill`, `eopd_common.shared_prefill`); with a
chunked-prefill step size, a batch then runs as consecutive groups of items whose shared work fits
one step each. A logit scaling after the projection (Granite's `logits_scaling`, Cohere's
`logit_scale`) is folded into the inverse temperature; soft-capping is refused at load
(`eopd_common.logits.scoring_logit_factor`).

`generate_steps` decodes the prompts and samples of a Generate job as one batch, in bounded steps
(`batched_generation`), and then scores prompt + generated ids with the engine's own scoring, so
Generate's statistics are Score's.

Asked for hidden states (`ScoreItem.hidden_dtype`), an answer also carries the final hidden states
at the scored positions, packed; `output_head` is the projection and transforms that turn them
into the same statistics (`eopd_common.output_head`), fingerprinted once at load.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from eopd_common.logits import scoring_logit_factor
from eopd_common.models import LoadedModel, eos_token_ids, load_causal_lm, tokenizer_fingerprint
from eopd_common.output_head import HeadInfo, OutputHead, dtype_name
from eopd_common.shared_prefill import cache_kwarg, response_hidden, work_tokens

from ..settings import EngineSettings
from ..stats import ChunkStats
from ..types import EngineInfo, GenerateItem, Generation, ScoreItem, SequenceScores
from .base import PendingScores, ScoringEngine, pending_from_hidden
from .chunked_prefill import score_in_steps
from .batched_generation import generate_in_steps

log = logging.getLogger(__name__)


class TransformersEngine(ScoringEngine):
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self._lm: LoadedModel | None = None
        self._device = "cpu"
        self._lock = threading.Lock()
        self._stats_fn = ChunkStats(compile=False)
        self._logit_factor = 1.0
        self._healthy = False
        self._eos_ids: frozenset[int] = frozenset()
        self._head: OutputHead | None = None

    def load(self) -> EngineInfo:
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        self._device = s.resolved_device()
        lm = load_causal_lm(s.model, dtype=s.dtype, device=self._device, cache_dir=s.cache_dir)
        self._logit_factor = scoring_logit_factor(lm.model.config, s.model)  # refuses soft-capping
        self._lm = lm
        self._eos_ids = _eos_ids(lm)
        # Compiled statistics, or the eager path if compiling fails (at the warm-up below or later).
        self._stats_fn = ChunkStats(compile=s.compile_statistics)
        head = self._lm.model.get_output_embeddings()
        vocab, hidden_size = head.weight.shape
        bias = getattr(head, "bias", None)
        self._head = OutputHead.of(
            HeadInfo(model=f"{lm.name}@{lm.revision}", vocab_size=int(vocab), hidden_size=int(hidden_size),
                     dtype=dtype_name(head.weight.dtype), has_bias=bias is not None, logit_factor=self._logit_factor),
            head.weight, bias)
        self._healthy = True
        self.info = EngineInfo(
            model_name=self._lm.name,
            model_revision=self._lm.revision,
            vocab_size=int(vocab),
            max_context_length=int(self._lm.max_context_length),
            dtype=s.dtype,
            engine="transformers",
            tokenizer_fingerprint=tokenizer_fingerprint(self._lm.tokenizer),
            hidden_size=int(hidden_size),
            output_head_fingerprint=self._head.fingerprint,
        )
        if s.compile_statistics:  # compile now, not on the first request
            self.score([ScoreItem("warmup", np.arange(8, dtype=np.int64) % vocab, 1, s.warmup_top_k, 1.0)])
        return self.info

    @property
    def tokenizer(self):
        assert self._lm is not None, "engine not loaded"
        return self._lm.tokenizer

    def output_head(self) -> OutputHead:
        assert self._head is not None, "engine not loaded"
        return self._head

    def health(self) -> bool:
        return self._healthy and self._lm is not None

    def shutdown(self) -> None:
        self._healthy = False
        self._lm = None

    def score(self, items: list[ScoreItem]) -> list[SequenceScores]:
        return self.score_async(items).result()

    @torch.inference_mode()
    def score_async(self, items: list[ScoreItem]) -> PendingScores:
        """Queues the batch on the device and returns; `result()` waits for the statistics' copy
        (pinned, non-blocking: `host_copy`) and splits them. On the CPU the work is done on return."""
        if not items:
            return PendingScores.done([])
        assert self._lm is not None, "engine not loaded"
        with self._lock:
            return self._score(items)

    def _score(self, items: list[ScoreItem]) -> PendingScores:
        model = self._lm.model
        dev = self._device
        head = model.get_output_embeddings()
        shared = self._shared(items)
        if shared is not None:
            h = response_hidden(model, *shared, 0, dev)
            return pending_from_hidden(items, h, head.weight, getattr(head, "bias", None), self.settings,
                                       self._stats_fn, self._logit_factor, self._head.fingerprint)
        lengths = [it.num_tokens for it in items]
        width = max(lengths)
        pad_id = 0
        pin = str(dev).startswith("cuda")  # pinned: the copies to the device do not block this thread
        ids = torch.full((len(items), width), pad_id, dtype=torch.long, pin_memory=pin)
        attn = torch.zeros((len(items), width), dtype=torch.long, pin_memory=pin)
        for row, it in enumerate(items):
            ids[row, : it.num_tokens] = torch.from_numpy(it.token_ids)
            attn[row, : it.num_tokens] = 1
        ids, attn = ids.to(dev, non_blocking=pin), attn.to(dev, non_blocking=pin)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
        # The hidden state at t-1 predicts token t: gather positions [score_from - 1, len - 1).
        rows = torch.cat([torch.full((it.num_scored,), r, dtype=torch.long) for r, it in enumerate(items)])
        cols = torch.cat([torch.arange(it.score_from - 1, it.num_tokens - 1) for it in items])
        h = hidden[rows.to(dev), cols.to(dev)]
        del hidden
        return pending_from_hidden(items, h, head.weight, getattr(head, "bias", None), self.settings, self._stats_fn,
                                   self._logit_factor, self._head.fingerprint)

    def _shared(self, items: list[ScoreItem]) -> tuple[list[list[int]], list[list[int]]] | None:
        """The items' prompts (ids before `score_from`) and scored ids, when their shared tokens are
        run once (`share_prefill`, every item scoring at least one position after at least one
        token); None: the plain pass."""
        if (not self.settings.share_prefill or any(it.score_from < 1 or it.num_scored < 1 for it in items)
                or cache_kwarg(self._lm.model.get_decoder()) is None):
            return None
        return ([it.token_ids[: it.score_from].tolist() for it in items],
                [it.token_ids[it.score_from :].tolist() for it in items])

    def _share_groups(self, items: list[ScoreItem]) -> list[list[int]] | None:
        """The batch as consecutive groups of items (indices, in order) whose work with their shared
        tokens run once (`shared_prefill.work_tokens`) fits one chunked-prefill step each; one group
        without a step size. None: nothing shared (`_shared`), or one item alone over a step (the
        chunked steps of the plain pass then bound the step)."""
        shared = self._shared(items)
        if shared is None:
            return None
        chunk = self.settings.prefill_chunk_tokens
        if chunk <= 0:
            return [list(range(len(items)))]
        prompts, responses = shared

        def work(group: list[int]) -> int:
            return work_tokens([prompts[i] for i in group], [responses[i] for i in group])[1]

        groups: list[list[int]] = [[]]
        for i in range(len(items)):
            if work(groups[-1] + [i]) <= chunk:
                groups[-1].append(i)
            elif work([i]) <= chunk and groups[-1]:
                groups.append([i])
            else:
                return None
        return groups

    def _group_steps(self, items: list[ScoreItem], groups: list[list[int]], lock) -> Iterator[list[SequenceScores] | None]:
        """Each group scored as one step under `lock` (`_score`: its shared tokens run once), None
        between the steps, then every item's scores (the groups are consecutive: item order)."""
        out: list[SequenceScores] = []
        for n, group in enumerate(groups):
            with lock:
                out.extend(self._score([items[i] for i in group]).result())
            if n < len(groups) - 1:
                yield None
        yield out

    @torch.inference_mode()
    def score_steps(self, items: list[ScoreItem]) -> Iterator[list[SequenceScores] | None]:
        """`score` in steps of at most `prefill_chunk_tokens` padded tokens (chunked prefill,
        `chunked_prefill.score_in_steps`): each `next()` runs one step and yields None, the last
        yields the scores. The batcher serves other clients' batches between the steps. Where the
        items share tokens, each step is instead a group of items scored with their shared tokens run
        once (`_share_groups`)."""
        assert self._lm is not None, "engine not loaded"
        groups = self._share_groups(items)
        if groups is not None:
            yield from self._group_steps(items, groups, self._lock)
            return
        model = self._lm.model
        steps = score_in_steps(model.get_decoder(), model.get_output_embeddings(), items,
                               chunk_tokens=self.settings.prefill_chunk_tokens, settings=self.settings,
                               stats_fn=self._stats_fn, logit_factor=self._logit_factor, device=self._device,
                               head_fingerprint=self._head.fingerprint)
        while True:
            with self._lock:  # per step: another job's steps run in between
                out = next(steps)
            yield out
            if out is not None:
                return

    @torch.inference_mode()
    def generate_steps(self, items: list[GenerateItem], *, cancelled: Callable[[], bool] | None = None
                       ) -> Iterator[list[Generation] | None]:
        """`generate` in bounded steps (`batched_generation.generate_in_steps`: the items' prompts
        and samples decoded as one batch, at most `generate_step_ms` of decoding, one prefill
        chunk or one scoring step per `next()`), yielding None between steps and the generations
        last. The batcher serves other clients' scoring batches between the steps; `close()`
        frees the KV cache. `cancelled` is polled before every decoding step."""
        assert self._lm is not None, "engine not loaded"
        s = self.settings
        steps = generate_in_steps(self._lm.model, items, eos_ids=self._eos_ids, device=self._device,
                                  prefill_chunk_tokens=s.prefill_chunk_tokens, step_seconds=s.generate_step_ms / 1000.0,
                                  cancelled=cancelled or (lambda: False), score_steps=self._scoring_steps)
        try:
            while True:
                with self._lock:  # per step: another job's steps run in between
                    out = next(steps)
                yield out
                if out is not None:
                    return
        finally:
            steps.close()

    def generate(self, items: list[GenerateItem], *, cancelled: Callable[[], bool] | None = None) -> list[Generation]:
        """All steps of `generate_steps` at once: per item, `num_samples` responses (the items'
        rows decoded together), then their statistics by scoring prompt + response at
        `score_temperature` (score_from = len(prompt)), so Generate's statistics are Score's."""
        out = None
        for out in self.generate_steps(items, cancelled=cancelled):
            pass
        assert out is not None
        return out

    def _scoring_steps(self, items: list[ScoreItem]) -> Iterator[list[SequenceScores] | None]:
        """Scores `items` (under the caller's lock): in groups sharing their tokens (`_share_groups`),
        else in chunked-prefill steps when they exceed `prefill_chunk_tokens` padded tokens, else in
        one step."""
        chunk = self.settings.prefill_chunk_tokens
        groups = self._share_groups(items)
        if groups is not None:
            yield from self._group_steps(items, groups, contextlib.nullcontext())
        elif chunk > 0 and max(it.num_tokens for it in items) * len(items) > chunk:
            model = self._lm.model
            yield from score_in_steps(model.get_decoder(), model.get_output_embeddings(), items, chunk_tokens=chunk,
                                      settings=self.settings, stats_fn=self._stats_fn, logit_factor=self._logit_factor,
                                      device=self._device, head_fingerprint=self._head.fingerprint)
        else:
            yield self._score(items).result()


def _eos_ids(lm: LoadedModel) -> frozenset[int]:
    """The model's end-of-sequence ids (generation config, model config, tokenizer)."""
    sources = (getattr(lm.model, "generation_config", None), lm.model.config, lm.tokenizer)
    return eos_token_ids(*(getattr(src, "eos_token_id", None) for src in sources))
