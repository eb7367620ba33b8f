"""The scoring engine interface: load, score a batch, health, shutdown.

An engine is synchronous and single-threaded from the caller's point of view: the server's
batcher calls `score` from one worker thread, one batch at a time. Batching across requests is
the batcher's job; an engine scores whatever list it is given, and must return the same numbers
for a sequence whether it is scored alone or with others.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from eopd_common.output_head import OutputHead, pack_hidden

from ..settings import EngineSettings
from ..host_copy import HostStatistics, to_host
from ..stats import ChunkStats, StatsFn, TokenStatistics, device_statistics
from ..types import EngineInfo, GenerateItem, Generation, ScoreItem, SequenceScores


class ScoringEngine(abc.ABC):
    # Optional capabilities, declared here (None: the engine has none), set or overridden by engines:
    # the served model's Hugging Face tokenizer (the HTTP API's text prompts and decoded tokens);
    tokenizer: Any = None
    # `score_steps(items)`: `score` in steps of at most `max_batch_tokens` padded tokens, yielding
    # None between steps and the scores last (chunked prefill; the batcher's `steps_fn`);
    score_steps: Callable[[list[ScoreItem]], Iterator[list[SequenceScores] | None]] | None = None
    # `generate_steps(items, cancelled=...)`: `generate` in bounded steps, yielding None between steps
    # and the generations last (the batcher serves scoring batches between the steps);
    generate_steps: Callable[..., Iterator[list[Generation] | None]] | None = None
    # the per-chunk statistics function (its `path`: "compiled" or "eager").
    _stats_fn: ChunkStats | None = None

    @abc.abstractmethod
    def load(self) -> EngineInfo:
        """Loads the model (slow); returns what it serves (the server adds its limits:
        `state.served_info`)."""

    @abc.abstractmethod
    def score(self, items: list[ScoreItem]) -> list[SequenceScores]:
        """Scores validated items (in order). Items may mix lengths, top_k and temperatures."""

    def score_async(self, items: list[ScoreItem]) -> PendingScores:
        """`score`, returning once the work is queued on the device: `result()` of the answer
        waits for the statistics' copy to the host and splits them per sequence. The batcher calls
        this on the engine's thread and `result()` elsewhere, so the device runs the next batch
        while this one's answers are delivered. Default: `score` itself, already done."""
        return PendingScores.done(self.score(items))

    def generate(self, items: list[GenerateItem], *, cancelled: Callable[[], bool] | None = None) -> list[Generation]:
        """Generates `item.num_samples` responses per validated item and returns them with their
        statistics, grouped by item in order, samples in order. `cancelled` (optional), polled
        between decoding steps: once it returns True the caller is gone (cancelled, deadline
        passed) and the engine may stop early by raising GenerationCancelled. Engines that cannot
        generate raise NotImplementedError (the server then does not serve Generate)."""
        raise NotImplementedError(f"{type(self).__name__} does not generate")

    @property
    def can_generate(self) -> bool:
        """True when this engine implements `generate` (the server then serves Generate)."""
        return type(self).generate is not ScoringEngine.generate

    def output_head(self) -> OutputHead:
        """The served model's output projection and logit transforms (GetOutputHead), for clients
        that ask for hidden states. Engines that cannot return hidden states raise
        NotImplementedError (their EngineInfo then names no output head)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve its output head")

    @abc.abstractmethod
    def health(self) -> bool:
        """True while the engine can score."""

    def shutdown(self) -> None:
        """Releases the model. Idempotent."""

    @property
    def statistics_path(self) -> str:
        """"compiled" or "eager": how the per-chunk statistics run (a failed torch.compile falls
        back to "eager" at load or later; see stats.ChunkStats)."""
        return "eager" if self._stats_fn is None else self._stats_fn.path


class PendingScores:
    """The scores of a batch on their way from the device: `result()` (once) waits for the host
    copy (`host_copy.HostStatistics`) and splits it per sequence. `copy_wait_s` and `split_s`:
    the seconds `result()` spent blocked on the device and splitting (the server's breakdown)."""

    def __init__(self, items: list[ScoreItem], host: HostStatistics | None, scores: list[SequenceScores] | None = None,
                 hidden: ItemHidden | None = None):
        self._items = items
        self._host = host
        self._scores = scores
        self._hidden = hidden
        self.copy_wait_s = 0.0
        self.split_s = 0.0

    @classmethod
    def done(cls, scores: list[SequenceScores]) -> PendingScores:
        return cls([], None, scores)

    @property
    def ready(self) -> bool:
        """True when `result()` would not wait for the device."""
        return self._host is None or self._host.ready

    def result(self) -> list[SequenceScores]:
        if self._scores is None:
            stats = self._host.wait()
            self.copy_wait_s = self._host.copy_wait_s
            started = time.perf_counter()
            self._scores = split_scores(self._items, stats, self._hidden)
            self.split_s = time.perf_counter() - started
            self._host = None
        return self._scores


def scores_from_hidden(
    items: list[ScoreItem],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    settings: EngineSettings,
    stats_fn: StatsFn,
    logit_factor: float = 1.0,
) -> list[SequenceScores]:
    """The engines' shared tail: exact statistics from the final hidden states at the scored
    positions of `items` (`hidden [sum(num_scored), d]`, in item order; the row for position t is
    the hidden state at t - 1) and the output projection, split back per sequence.

    `logit_factor` is the model's logit scaling (`eopd_common.logits.scoring_logit_factor`: the
    model's logits are `logit_factor * (hidden @ weight.T + bias)`); it is folded into each
    position's inverse temperature, so the statistics are those of `model(...).logits` at the
    item's temperature."""
    return pending_from_hidden(items, hidden, weight, bias, settings, stats_fn, logit_factor).result()


def pending_from_hidden(
    items: list[ScoreItem],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    settings: EngineSettings,
    stats_fn: StatsFn,
    logit_factor: float = 1.0,
    head_fingerprint: str = "",
) -> PendingScores:
    """`scores_from_hidden` left on the device (`stats.device_statistics`) with its copy to the
    host started (`host_copy.to_host`): returns once the work is queued (at once on the CPU). Items
    that ask for hidden states get their rows of `hidden` packed (`ItemHidden.of`: a copy to the
    host that waits for the decoder on a GPU), named by `head_fingerprint`."""
    targets, inv_t, candidates = flat_targets(items, logit_factor)
    stats = device_statistics(
        hidden,
        weight,
        targets,
        inv_t,
        max(it.top_k for it in items),
        bias=bias,
        chunk_size=settings.chunk_size,
        projection_dtype=torch.float32 if settings.fp32_projection else None,
        stats_fn=stats_fn,
        candidates=candidates,
    )
    return PendingScores(items, to_host(stats), hidden=ItemHidden.of(items, hidden, head_fingerprint))


@dataclasses.dataclass(frozen=True)
class ItemHidden:
    """The packed hidden states of the items that asked for them (`packed[i]`, None for the
    others) and the fingerprint of the head that projects them."""

    packed: list[bytes | None]
    hidden_size: int
    head_fingerprint: str

    @classmethod
    def of(cls, items: list[ScoreItem], hidden: torch.Tensor, head_fingerprint: str) -> ItemHidden | None:
        """From the flat hidden states `[sum(num_scored), d]` of `items` (item order); None when
        no item asks for them."""
        if not any(it.hidden_dtype for it in items):
            return None
        packed: list[bytes | None] = []
        offset = 0
        for it in items:
            rows = hidden[offset : offset + it.num_scored]
            packed.append(pack_hidden(rows, it.hidden_dtype) if it.hidden_dtype else None)
            offset += it.num_scored
        return cls(packed, int(hidden.shape[1]), head_fingerprint)

    def attach(self, i: int, scores: SequenceScores, item: ScoreItem) -> SequenceScores:
        if self.packed[i] is None:
            return scores
        return dataclasses.replace(scores, hidden_states=self.packed[i], hidden_dtype=item.hidden_dtype,
                                   hidden_size=self.hidden_size, output_head_fingerprint=self.head_fingerprint)


def flat_targets(items: list[ScoreItem], logit_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The scored positions of `items`, in item order (N = sum of num_scored): targets `[N]` int64,
    inverse temperatures `[N]` (the logit factor folded in) and candidate ids `[N, m]` (each item's
    rows padded with -1 filler to the widest m; None when no item asks for candidates)."""
    targets = torch.cat([torch.from_numpy(it.token_ids[it.score_from :]) for it in items]).long()
    inv_t = torch.cat([torch.full((it.num_scored,), logit_factor / it.temperature) for it in items])
    m = max(it.num_candidates for it in items)
    candidates = None
    if m:
        candidates = torch.full((targets.shape[0], m), -1, dtype=torch.int64)
        offset = 0
        for it in items:
            if it.num_candidates:
                candidates[offset : offset + it.num_scored, : it.num_candidates] = torch.from_numpy(it.candidate_ids)
            offset += it.num_scored
    return targets, inv_t, candidates


def split_scores(items: list[ScoreItem], stats: TokenStatistics, hidden: ItemHidden | None = None) -> list[SequenceScores]:
    """Flat statistics of the scored positions of `items` (in item order), per sequence (each with
    its own top_k and candidates, and its packed hidden states when it asked for them)."""
    lp, ent = stats.token_logprobs.numpy(), stats.entropies.numpy()
    clp = stats.candidate_logprobs.numpy()
    tids, tlp = stats.topk_ids.numpy().astype(np.int32, copy=False), stats.topk_logprobs.numpy()
    out: list[SequenceScores] = []
    offset = 0
    for i, it in enumerate(items):
        sl = slice(offset, offset + it.num_scored)
        out.append(
            SequenceScores(
                seq_id=it.seq_id,
                token_logprobs=lp[sl],
                entropies=ent[sl],
                topk_ids=np.ascontiguousarray(tids[sl, : it.top_k]),
                topk_logprobs=np.ascontiguousarray(tlp[sl, : it.top_k]),
                candidate_logprobs=np.ascontiguousarray(clp[sl, : it.num_candidates]) if it.num_candidates else None,
            )
        )
        if hidden is not None:
            out[-1] = hidden.attach(i, out[-1], it)
        offset += it.num_scored
    return out
