"""Batched generation in bounded steps, for the transformers engine's `generate_steps`.

The prompts of a job (one `GenerateItem` each) are decoded together: one row per (prompt, sample),
in item order, samples in order. The prompts are left-padded to one width (attention mask, and
position ids counted from each prompt's first real token, so a row's positions are those it has
alone) and prefilled once per prompt, in column chunks of at most `prefill_chunk_tokens` padded
tokens (the KV cache carried between chunks, as in `chunked_prefill`); the cache is then repeated
to the prompt's `num_samples` rows. Each decode step feeds every live row its last token; a row
stops on its own (a stop or EOS id, or its own `max_new_tokens`) and leaves the batch (its cache
rows are dropped), so the step costs what the live rows cost. Each row draws with its own
temperature, top-p and generator (`sampling.sample_rows`), so a sample's tokens do not depend on the
rows beside it (up to float rounding of the batched forward).

`generate_in_steps` is a generator: every `next()` runs one bounded step (one prefill chunk, or
decode steps for at most `step_seconds`, or one scoring step) and yields None, the last yields the
generations. The engine's batcher runs other clients' scoring batches between the steps; the KV
cache lives in the generator between them, and `close()` frees it. `cancelled()` is polled before
every decode step (GenerationCancelled once it is True).

The statistics are Score's: the rows' prompt + generated ids are scored at `score_temperature` by
the engine's own scoring steps (`score_steps`), after the last decode step.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from transformers import DynamicCache

from ..types import GenerateItem, Generation, GenerationCancelled, ScoreItem, SequenceScores
from .sampling import sample_rows, sample_seed

ScoreSteps = Callable[[list[ScoreItem]], Iterator["list[SequenceScores] | None"]]


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: transformers >= 5.2x names it `cache`,
    earlier releases (the vLLM venv's 5.19) `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate_in_steps(
    model: torch.nn.Module,
    items: list[GenerateItem],
    *,
    eos_ids: frozenset[int],
    device: str,
    prefill_chunk_tokens: int,
    step_seconds: float,
    cancelled: Callable[[], bool],
    score_steps: ScoreSteps,
) -> Iterator[list[Generation] | None]:
    """A generator of bounded steps (see the module's docstring); call `next()` under
    `torch.inference_mode()`. `prefill_chunk_tokens` 0: each prompt batch prefilled in one step;
    `step_seconds` <= 0: all decode steps in one engine turn."""
    responses, reasons = yield from _decode(model, items, eos_ids=eos_ids, device=device,
                                            prefill_chunk_tokens=prefill_chunk_tokens, step_seconds=step_seconds,
                                            cancelled=cancelled)
    rows = [(item, j) for item in items for j in range(item.num_samples)]
    score_items = [ScoreItem(item.prompt_id, np.concatenate([item.token_ids, r]), len(item.token_ids), item.top_k,
                             item.score_temperature, hidden_dtype=item.hidden_dtype) for (item, _), r in zip(rows, responses)]
    scores = None
    for scores in score_steps(score_items):
        if scores is None:
            yield None
    assert scores is not None, "score_steps ends with the scores"
    yield [Generation(item.prompt_id, j, r, reason, s)
           for (item, j), r, reason, s in zip(rows, responses, reasons, scores, strict=True)]


def _decode(
    model: torch.nn.Module,
    items: list[GenerateItem],
    *,
    eos_ids: frozenset[int],
    device: str,
    prefill_chunk_tokens: int,
    step_seconds: float,
    cancelled: Callable[[], bool],
) -> Iterator[None]:
    """Prefill and decode steps (yielding None between engine turns); returns (the responses, `[n]`
    int64 each, ending with the stop/EOS id that ended them, and their finish reasons), one per row."""
    key = cache_keyword(model)
    n_items = len(items)
    width = max(len(it.token_ids) for it in items)
    max_new = max(it.max_new_tokens for it in items)
    # Left-padded prompts; a row's positions count from its first real token.
    ids = torch.zeros((n_items, width), dtype=torch.long)
    mask = torch.zeros((n_items, width + max_new), dtype=torch.long)
    for i, it in enumerate(items):
        p = len(it.token_ids)
        ids[i, width - p:] = torch.from_numpy(it.token_ids)
        mask[i, width - p: width] = 1
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    cache = DynamicCache()
    chunk = width if prefill_chunk_tokens <= 0 else max(1, prefill_chunk_tokens // n_items)
    for start in range(0, width, chunk):
        stop = min(start + chunk, width)
        out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], position_ids=positions[:, start:stop],
                    use_cache=True, logits_to_keep=1, **{key: cache})
        if stop < width:
            del out
            yield None
    # One row per (item, sample): the prompt's cache and last logits repeated to its samples.
    per_item = torch.tensor([it.num_samples for it in items])
    expand = torch.repeat_interleave(torch.arange(n_items), per_item)
    rows = int(per_item.sum())
    if rows != n_items:
        cache.batch_select_indices(expand.to(device))
    logits = out.logits[:, -1][expand.to(device)]
    del out
    mask = mask[expand.to(device)]
    next_pos = torch.tensor([len(it.token_ids) for it in items])[expand].to(device)
    row_items = [items[i] for i in expand.tolist()]
    samples = [j for it in items for j in range(it.num_samples)]
    temperatures = [it.temperature for it in row_items]
    top_ps = [it.top_p for it in row_items]
    generators = [torch.Generator().manual_seed(sample_seed(it.seed, it.index, j)) if it.temperature > 0 else None
                  for it, j in zip(row_items, samples)]
    stops = [frozenset(eos_ids | set(it.stop_token_ids)) for it in row_items]
    limits = [it.max_new_tokens for it in row_items]
    tokens = torch.zeros((rows, max_new), dtype=torch.long)
    lengths = [0] * rows
    stopped = [False] * rows
    live = list(range(rows))  # the rows still decoding, in batch order
    turn_started = time.perf_counter()
    for t in range(max_new):
        if cancelled():
            raise GenerationCancelled(f"generation of prompt {items[0].prompt_id!r} stopped after {t} tokens: its caller went away")
        nxt = sample_rows(logits, [temperatures[r] for r in live], [top_ps[r] for r in live],
                          [generators[r] for r in live]).tolist()
        keep = []
        for b, r in enumerate(live):
            tokens[r, t] = nxt[b]
            lengths[r] += 1
            if nxt[b] in stops[r]:
                stopped[r] = True
            elif lengths[r] < limits[r]:
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(live):  # rows that stopped leave the batch
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            mask, next_pos = mask[sel], next_pos[sel]
            nxt = [nxt[b] for b in keep]
            live = [live[b] for b in keep]
        if step_seconds > 0 and time.perf_counter() - turn_started >= step_seconds:
            yield None
            turn_started = time.perf_counter()
        mask[:, width + t] = 1
        out = model(input_ids=torch.tensor(nxt, device=device).view(-1, 1), attention_mask=mask[:, : width + t + 1],
                    position_ids=next_pos.view(-1, 1), use_cache=True, logits_to_keep=1, **{key: cache})
        logits = out.logits[:, -1]
        del out
        next_pos = next_pos + 1
    responses = [tokens[r, : lengths[r]].numpy().copy() for r in range(rows)]
    return responses, ["stop" if s else "length" for s in stopped]
