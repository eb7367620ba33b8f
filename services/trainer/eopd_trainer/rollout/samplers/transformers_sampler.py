"""The transformers sampler: the student as a transformers module samples (`generate`), with the
behaviour ("old") log-probs of each sampled token.

Old log-probs come, by `rollout.old_logprobs`, from `generate` itself (`generate`: `StepLogprobs`
records each step's raw logits before the sampling warpers, no second pass) or from a separate
forward pass of the sampling policy over the full sequence (`transformers`: `sequence_logprobs`,
exactly as the learner computes them). `auto` records them while sampling where the student is
fp32 and a probe shows the two agree (`check_step_logprobs`: decode steps with a KV cache match
a full forward pass to ~1e-5 in fp32, not in bf16), and takes the forward pass otherwise.
`sequence_logprobs` runs the decoder body once, then the output projection in chunks of
`rollout.logprob_chunk_size` response positions: no `[batch, seq, vocab]` logits. Published
weights are reloaded into the module in place."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from transformers import LogitsProcessorList

from eopd_common.logits import LOGIT_TRANSFORMS, final_logits
from eopd_common.models import load_causal_lm, pad_token_id
from eopd_common.shared_prefill import layout, prefill

from ...batching import pack_sequences
from ...queue.policy_load import load_policy
from ...queue.weights import load_tensors
from .base import Sample, SamplerUnavailable, cut_response, stop_ids
from .nucleus import Nucleus
from .parked import Parked, park, unpark
from .step_logits import StepLogits
from .step_logprobs import StepLogprobs

log = logging.getLogger(__name__)


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Sequence[int]], *, temperature: float, top_p: float,
             max_new_tokens: int, seed: int, kv_cache: str = "dynamic", record_logprobs: bool = False,
             top_k_ids: int = 0, share_prefill: bool = True, keep_logits: Sequence[int] = ()) -> list[Sample]:
    """One sampled response per prompt (repeat a prompt for several samples). `kv_cache` "static":
    a KV cache preallocated to prompt + `max_new_tokens` (transformers then compiles the decode
    step on CUDA: one graph per step instead of Python per layer), "dynamic": grown per token.
    `share_prefill` (dynamic cache only): tokens the prompts share (a common prefix such as the chat
    template, a prompt repeated for several samples) are prefilled once (`eopd_common.shared_prefill`; the same
    logits up to float rounding). Temperature and top-p filter as transformers' warpers do, without
    sorting the vocabulary (`nucleus.Nucleus`). `record_logprobs`: each Sample carries the log-prob at
    `temperature` of each response token under the step's raw logits (`StepLogprobs`), and with
    `top_k_ids` > 0 the step's top-k ids. `keep_logits`: the samples of these prompt indices carry
    the raw logits of every response position (`Sample.logits`, `StepLogits`; decode-step values,
    ~1e-5 from a full forward pass in fp32)."""
    device = next(model.parameters()).device
    pad = pad_token_id(tokenizer)
    shared = prefill(model, prompts, pad, device) if kv_cache == "dynamic" and share_prefill else None
    if shared is not None:
        ids, mask, given = shared.input_ids, shared.attention_mask, {shared.cache_kwarg: shared.cache}
    else:
        ids, mask = layout(prompts, 0, pad)  # left padding for generation
        ids, mask, given = ids.to(device), mask.to(device), {}
    L = ids.shape[1]
    stop = stop_ids(model, tokenizer)
    rec = StepLogprobs(temperature, top_k_ids) if record_logprobs else None
    torch.manual_seed(seed)
    kept = StepLogits(keep_logits) if keep_logits else None
    processors = LogitsProcessorList([p for p in (rec, kept) if p is not None] + [Nucleus(temperature, top_p)])
    out = model.generate(  # temperature and top-p are the Nucleus processor's: transformers adds no warper
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=sorted(stop) if stop else None, **given,
        **({"cache_implementation": "static"} if kv_cache == "static" else {}), logits_processor=processors,
    )
    if rec is not None:
        rec.finish(out)
    samples = []
    for i, p in enumerate(prompts):
        response, truncated = cut_response(out[i, L:].tolist(), stop, max_new_tokens)
        if not response:  # cannot happen with max_new_tokens >= 1, kept for safety
            response, truncated = [pad], True
        lp = top = None
        if rec is not None:
            lp = rec.logprobs[i, : len(response)].copy()
            top = rec.top_ids[i, : len(response)].copy() if top_k_ids else None
        logits = kept.of(i, len(response)) if kept is not None else None
        samples.append(Sample(list(map(int, p)), response, truncated, lp, top, logits))
    return samples


@torch.no_grad()
def check_head_reproduces_logits(model, probe_length: int = 8) -> None:
    """Checks once, on a short probe sequence, that `final_logits(lm_head(decoder(x)))` is
    `model(x).logits` (`eopd_common.logits`): a causal LM with a logit transform not in that table
    is refused at start instead of silently getting wrong old log-probs."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, probe_length + 1, dtype=torch.long) * 7919 % vocab)[None].to(device)
    mask = torch.ones_like(ids)
    want = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[0].float(), dim=-1)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[0]
    head = model.get_output_embeddings()
    raw = torch.nn.functional.linear(hidden, head.weight, head.bias)
    got = torch.log_softmax(final_logits(model.config, raw), dim=-1)
    err = float((got - want).abs().max())
    tol = 1e-3 if head.weight.dtype in (torch.float32, torch.float64) else 0.1
    if not err <= tol:
        raise SamplerUnavailable(
            f"{type(model).__name__}: the output projection of the final hidden states does not reproduce the "
            f"model's logits (max log-prob difference {err:.3g} > {tol}); its logit transform is not one the "
            f"old-log-prob pass knows ({', '.join(LOGIT_TRANSFORMS)})")


@torch.no_grad()
def sequence_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                      temperature: float, pad_id: int, chunk_size: int = 1024, top_k: int = 0,
                      topk_out: list | None = None) -> list[np.ndarray]:
    """log pi(x_t | x_<t) at every response token, from one forward pass over the full sequences.

    The decoder body runs once over the right-padded batch; only the final hidden states at the
    positions that predict response tokens are kept, and the output projection (with the model's
    logit transform, `eopd_common.logits.final_logits`), the temperature and the log-softmax are
    applied to `chunk_size` of them at a time: at most one `[chunk_size, V]` float32 block of logits is alive,
    never `[batch, seq, V]` (64 sequences x 5k tokens x 152k vocabulary would be ~100 GB).

    With `top_k > 0` the same pass also appends to `topk_out`, per response, the policy's top-`top_k`
    ids at each response position (`[n, top_k]` int32, by descending probability): the per-position
    candidates of the eopd_topk_rkl loss, at no second forward pass."""
    if top_k and topk_out is None:
        raise ValueError("top_k > 0 needs a topk_out list")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    device = next(model.parameters()).device
    packed = pack_sequences(prompts, responses, pad_id)
    hidden = model.get_decoder()(input_ids=packed.input_ids.to(device),
                                 attention_mask=packed.attention_mask.to(device)).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1])[packed.positions.to(device)]  # [N, D]
    del hidden
    head = model.get_output_embeddings()
    targets = packed.sampled_ids.to(device)
    lp = torch.empty(h.shape[0], dtype=torch.float32)
    top = torch.empty(h.shape[0], top_k, dtype=torch.int32)
    for start in range(0, h.shape[0], chunk_size):
        stop = min(start + chunk_size, h.shape[0])
        z = final_logits(model.config, torch.nn.functional.linear(h[start:stop], head.weight, head.bias)) / temperature
        lp[start:stop] = (z.gather(1, targets[start:stop, None])[:, 0] - torch.logsumexp(z, dim=-1)).cpu()
        if top_k:
            top[start:stop] = torch.topk(z, min(top_k, z.shape[-1]), dim=-1, sorted=True).indices.to(torch.int32).cpu()
        del z
    lp, top = lp.numpy(), top.numpy()
    out, start = [], 0
    for r in responses:
        out.append(lp[start : start + len(r)].astype(np.float32))
        if top_k:
            topk_out.append(top[start : start + len(r)].copy())
        start += len(r)
    return out


@torch.no_grad()
def check_step_logprobs(model, tokenizer, *, probe_tokens: int = 6) -> float:
    """The largest difference between the log-probs `generate` records (`StepLogprobs`) and the
    forward pass's (`sequence_logprobs`) on a probe: two prompts of different lengths (left
    padding), `probe_tokens` sampled tokens each, temperature 1."""
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = [[int(t) for t in (torch.arange(1, n + 1) * 7919 % vocab)] for n in (5, 9)]
    samples = generate(model, tokenizer, prompts, temperature=1.0, top_p=1.0, max_new_tokens=probe_tokens, seed=0,
                       record_logprobs=True)
    want = sequence_logprobs(model, prompts, [s.response_ids for s in samples], temperature=1.0,
                             pad_id=pad_token_id(tokenizer))
    return max(float(np.abs(s.logprobs - w).max()) for s, w in zip(samples, want, strict=True))


#: the largest probe difference (`check_step_logprobs`) at which generate's log-probs are taken
STEP_LOGPROBS_TOLERANCE = 1e-3


class TransformersSampler:
    """The student as a transformers module: `generate` to sample, old log-probs recorded while
    sampling or from `sequence_logprobs` (`old_logprobs`: generate, transformers, or auto),
    published weights loaded into the module in place. `candidates` > 0: the policy's top-k ids
    per response position are wanted too (eopd_topk_rkl), recorded with the log-probs."""

    engine = "transformers"

    def __init__(self, spec: str, *, dtype: str = "float32", device: str = "cpu", model=None, tokenizer=None,
                 logprob_chunk_size: int = 1024, kv_cache: str = "dynamic", old_logprobs: str = "transformers",
                 candidates: int = 0):
        if kv_cache not in ("dynamic", "static"):
            raise ValueError(f"kv_cache must be dynamic or static, got {kv_cache!r}")
        if old_logprobs not in ("auto", "generate", "transformers"):
            raise ValueError(f"the transformers sampler's old_logprobs is auto, generate or transformers, got {old_logprobs!r}")
        self.kv_cache = kv_cache
        if model is None:
            loaded = load_causal_lm(spec, dtype=dtype, device=device)
            model, tokenizer = loaded.model, loaded.tokenizer
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.stop = stop_ids(self.model, tokenizer)  # the student's EOS ids (the teacher's Generate stops on them too)
        self.logprob_chunk_size = logprob_chunk_size
        self.candidates = candidates
        self._sampled_at: float | None = None
        self._parked: Parked | None = None  # the weights released while the worker waits (release_weights)
        check_head_reproduces_logits(self.model)  # the old-log-prob pass projects hidden states itself
        self.old_logprobs_from = self._resolve_old_logprobs(old_logprobs)

    def _resolve_old_logprobs(self, wanted: str) -> str:
        """"generate" or "transformers": `wanted` made concrete, checked on a probe."""
        fp32 = next(self.model.parameters()).dtype == torch.float32
        if wanted == "transformers" or (wanted == "auto" and not fp32):
            return "transformers"
        err = check_step_logprobs(self.model, self.tokenizer)
        if err <= STEP_LOGPROBS_TOLERANCE:
            log.info("old log-probs recorded while sampling (rollout.old_logprobs=%s; probe difference to the "
                     "forward pass %.2g)", wanted, err)
            return "generate"
        why = (f"generate's log-probs differ from the forward pass's by {err:.3g} on a probe "
               f"(> {STEP_LOGPROBS_TOLERANCE})")
        if wanted == "generate":
            raise SamplerUnavailable(f"rollout.old_logprobs=generate: {why}; use rollout.old_logprobs=transformers")
        log.warning("rollout.old_logprobs=auto: %s; old log-probs come from a forward pass", why)
        return "transformers"

    def sample(self, prompts, seeds, *, temperature, top_p, max_new_tokens) -> list[Sample]:
        self._check_loaded()
        self._sampled_at = temperature  # the temperature of the log-probs recorded with these samples
        return generate(self.model, self.tokenizer, prompts, temperature=temperature, top_p=top_p,
                        max_new_tokens=max_new_tokens, seed=int(seeds[0]), kv_cache=self.kv_cache,
                        record_logprobs=self.old_logprobs_from == "generate", top_k_ids=self.candidates)

    def _recorded(self, samples, temperature: float, k: int = 0) -> bool:
        """Whether every sample carries the log-probs at `temperature` (and top-`k` ids) recorded
        while sampling."""
        return self.old_logprobs_from == "generate" and self._sampled_at == temperature and all(
            s.logprobs is not None and len(s.logprobs) == len(s.response_ids)
            and (not k or (s.top_ids is not None and s.top_ids.shape[-1] == k)) for s in samples)

    def old_logprobs(self, samples, *, temperature) -> list[np.ndarray]:
        if self._recorded(samples, temperature):
            return [s.logprobs for s in samples]
        self._check_loaded()
        return sequence_logprobs(self.model, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                 temperature=temperature, pad_id=self.pad_id, chunk_size=self.logprob_chunk_size)

    def old_logprobs_topk(self, samples, *, temperature, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`old_logprobs` plus the policy's top-`k` ids at each response position (`[n, k]`), from
        the same pass (recorded while sampling, or the forward pass)."""
        if self._recorded(samples, temperature, k):
            return [s.logprobs for s in samples], [s.top_ids for s in samples]
        self._check_loaded()
        top: list[np.ndarray] = []
        lps = sequence_logprobs(self.model, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                temperature=temperature, pad_id=self.pad_id, chunk_size=self.logprob_chunk_size,
                                top_k=k, topk_out=top)
        return lps, top

    def load_weights(self, pv, *, verify: bool = True) -> None:
        self._unpark()
        load_policy(self.model, pv, verify=verify)

    def load_state(self, pv, tensors: dict[str, torch.Tensor]) -> None:
        self._unpark()
        load_tensors(self.model, tensors, pv.uri)

    def release_weights(self) -> bool:
        """Frees the policy's parameters until the next load (`parked.py`; the worker does this
        while it waits in sync mode); sampling before a load is refused. True: released; False on
        a GPU, where the weights stay (host memory is what the release saves; a compiled decode
        step's reuse of new parameter storage is not measured there)."""
        if next(self.model.parameters()).device.type != "cpu":
            return False
        if self._parked is None:
            self._parked = park(self.model)
        return True

    @property
    def holds_weights(self) -> bool:
        return self._parked is None

    def _unpark(self) -> None:
        """The parameters allocated again for a load to fill (a failed load leaves them unusable:
        the worker's VersionTracker samples nothing until a load succeeds)."""
        if self._parked is not None:
            unpark(self._parked)
            self._parked = None

    def _check_loaded(self) -> None:
        if self._parked is not None:
            raise RuntimeError("the sampler's weights are released (release_weights): load a policy version first")

    def close(self) -> None:
        pass
