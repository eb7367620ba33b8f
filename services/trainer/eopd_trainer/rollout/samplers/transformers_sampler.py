"""The transformers sampler: the student as a transformers module samples (`generate`), and the
behaviour ("old") log-probs come from `sequence_logprobs`.

Old log-probs come from a separate forward pass of the sampling policy over the full sequence
(prompt + response), at the sampling temperature, never from generation scores: generation may
use kernels, caches or processors (top-p) that make its scores differ from the distribution the
learner's ratio is taken against. `sequence_logprobs` runs the decoder body once, then the output
projection in chunks of `rollout.logprob_chunk_size` response positions: no `[batch, seq, vocab]`
logits. Published weights are reloaded into the module in place."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from eopd_common.logits import LOGIT_TRANSFORMS, final_logits
from eopd_common.models import load_causal_lm, pad_token_id

from ...batching import pack_sequences
from ...queue.policy_load import load_policy
from ...queue.weights import load_tensors
from .base import Sample, SamplerUnavailable, cut_response, stop_ids

log = logging.getLogger(__name__)


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Sequence[int]], *, temperature: float, top_p: float,
             max_new_tokens: int, seed: int, kv_cache: str = "dynamic") -> list[Sample]:
    """One sampled response per prompt (repeat a prompt for several samples). `kv_cache` "static":
    a KV cache preallocated to prompt + `max_new_tokens` (transformers then compiles the decode
    step on CUDA: one graph per step instead of Python per layer), "dynamic": grown per token."""
    device = next(model.parameters()).device
    pad = pad_token_id(tokenizer)
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding for generation
        ids[i, L - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, L - len(p):] = 1
    stop = stop_ids(model, tokenizer)
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=temperature,
        top_p=top_p, top_k=0, max_new_tokens=max_new_tokens, pad_token_id=pad,
        eos_token_id=sorted(stop) if stop else None, **({"cache_implementation": "static"} if kv_cache == "static" else {}),
    )
    samples = []
    for i, p in enumerate(prompts):
        response, truncated = cut_response(out[i, L:].tolist(), stop, max_new_tokens)
        if not response:  # cannot happen with max_new_tokens >= 1, kept for safety
            response, truncated = [pad], True
        samples.append(Sample(list(map(int, p)), response, truncated))
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


class TransformersSampler:
    """The student as a transformers module: `generate` to sample, `sequence_logprobs` for old
    log-probs, published weights loaded into the module in place."""

    engine = "transformers"

    def __init__(self, spec: str, *, dtype: str = "float32", device: str = "cpu", model=None, tokenizer=None,
                 logprob_chunk_size: int = 1024, kv_cache: str = "dynamic"):
        if kv_cache not in ("dynamic", "static"):
            raise ValueError(f"kv_cache must be dynamic or static, got {kv_cache!r}")
        self.kv_cache = kv_cache
        if model is None:
            loaded = load_causal_lm(spec, dtype=dtype, device=device)
            model, tokenizer = loaded.model, loaded.tokenizer
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pad_id = pad_token_id(tokenizer)
        self.stop = stop_ids(self.model, tokenizer)  # the student's EOS ids (the teacher's Generate stops on them too)
        self.logprob_chunk_size = logprob_chunk_size
        check_head_reproduces_logits(self.model)  # the old-log-prob pass projects hidden states itself

    def sample(self, prompts, seeds, *, temperature, top_p, max_new_tokens) -> list[Sample]:
        return generate(self.model, self.tokenizer, prompts, temperature=temperature, top_p=top_p,
                        max_new_tokens=max_new_tokens, seed=int(seeds[0]), kv_cache=self.kv_cache)

    def old_logprobs(self, samples, *, temperature) -> list[np.ndarray]:
        return sequence_logprobs(self.model, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                 temperature=temperature, pad_id=self.pad_id, chunk_size=self.logprob_chunk_size)

    def old_logprobs_topk(self, samples, *, temperature, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """`old_logprobs` plus the policy's top-`k` ids at each response position (`[n, k]`), from
        the same forward pass."""
        top: list[np.ndarray] = []
        lps = sequence_logprobs(self.model, [s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                temperature=temperature, pad_id=self.pad_id, chunk_size=self.logprob_chunk_size,
                                top_k=k, topk_out=top)
        return lps, top

    def load_weights(self, pv, *, verify: bool = True) -> None:
        load_policy(self.model, pv, verify=verify)

    def load_state(self, pv, tensors: dict[str, torch.Tensor]) -> None:
        load_tensors(self.model, tensors, pv.uri)

    def close(self) -> None:
        pass
