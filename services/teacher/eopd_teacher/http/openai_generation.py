"""`/v1/completions` with `max_tokens` > 1: the teacher generates (the Generate path, vLLM's sampler
where vLLM is the engine) and the answer is vLLM's CompletionResponse, as pure functions: the
sampling fields validated in vLLM's terms (`sampling`), and the choices built from eopd's
`Generation`s (`generation_response`). No I/O here: the route is `openai_compat.py`.

As vLLM: one choice per prompt and sample (`index` = prompt * n + sample), `text` the completion
decoded with the served tokenizer without the stop/EOS token that ended it (`echo`: the prompt's
text first), `token_ids` (with `return_token_ids`) the generated ids including that token,
`finish_reason` "stop"/"length", `stop_reason` the stop id when one of `stop_token_ids` ended it
(else null), `logprobs` per generated token (its log-prob and the top `logprobs`, keyed by decoded
token, the token itself first; `echo`: the prompt's entries first), `prompt_logprobs` per choice
when asked, `usage.completion_tokens` all generated tokens. The log-probs are eopd's exact
statistics at the request's temperature (vLLM's `processed_logprobs`; top-p does not renormalise
them). Extension, as `prompt_entropies`: `choices[i].completion_entropies`, the exact entropy at
each generated position, when `logprobs` is asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..types import Generation, SequenceScores
from .openai_format import CompatError, CompletionRequest, Plan, in_vocab, response_envelope
from .openai_logprobs import Decoder, logprob_entries, logprobs_object, prompt_logprobs

MAX_SEED = (1 << 64) - 1  # GenerateRequest.seed is a uint64


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of a `max_tokens` > 1 request, as Generate takes them."""

    temperature: float  # 0: greedy
    top_p: float  # in (0, 1]; 1.0: off
    seed: int | None
    stop_token_ids: tuple[int, ...]


def sampling(req: CompletionRequest, vocab_size: int | None = None) -> Sampling:
    """Validates the sampling fields Generate honours (400 naming the field) and refuses those it
    cannot (a non-neutral sampling `top_k` or `min_p`, stop strings): vLLM would honour them, so
    eopd does not ignore them. `stop_token_ids` are checked against `vocab_size` (ids beyond int64
    included) before they reach the Generate path."""
    temperature = 1.0 if req.temperature is None else float(req.temperature)  # vLLM's default
    top_p = 1.0 if req.top_p is None else float(req.top_p)
    if not 0.0 < top_p <= 1.0:
        raise CompatError(400, f"top_p: {req.top_p} must be in (0, 1]", "top_p")
    if req.top_k not in (None, 0, -1):
        raise CompatError(400, f"top_k: {req.top_k}; eopd-teacher samples from the whole vocabulary (top_k 0 or -1) "
                               "or its top_p nucleus", "top_k")
    if req.min_p not in (None, 0.0):
        raise CompatError(400, f"min_p: {req.min_p}; only 0 is supported when generating", "min_p")
    if req.stop:
        raise CompatError(400, "stop: stop strings are not supported when generating; send stop_token_ids", "stop")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise CompatError(400, f"seed: {req.seed} must be in [0, 2**64)", "seed")
    if vocab_size is not None:
        in_vocab(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    return Sampling(temperature, top_p, req.seed, tuple(req.stop_token_ids or ()))


def _choice(req: CompletionRequest, p: Plan, index: int, ids: list[int], prompt_scores: SequenceScores | None,
            g: Generation, decode: Decoder, text_of, eos_id: int | None) -> dict:
    """One choice: prompt `ids` (scored by `prompt_scores` when its log-probs were asked) and `g`."""
    out = g.token_ids.tolist()
    stopped = g.finish_reason == "stop" and bool(out)
    text = text_of(out[:-1] if stopped else out)  # vLLM leaves the stop/EOS token out of the text
    if req.echo:
        text = "".join(decode(t) or "" for t in ids) + text
    stop_reason = out[-1] if stopped and out[-1] in (req.stop_token_ids or ()) and out[-1] != eos_id else None
    logprobs = None
    if p.logprobs_k is not None:
        tokens, token_lps, tops = logprob_entries(ids, prompt_scores, p.prompt_k or 0, decode, first=True) if req.echo else ([], [], [])
        more = logprob_entries(out, g.scores, p.logprobs_k, decode, first=False)
        logprobs = logprobs_object(tokens + more[0], token_lps + more[1], tops + more[2])
    choice: dict = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": g.finish_reason,
                    "stop_reason": stop_reason}
    choice["prompt_logprobs"] = None  # as vLLM: null when not asked
    if p.prompt_k is not None:
        choice["prompt_logprobs"], choice["prompt_entropies"] = prompt_logprobs(ids, prompt_scores, p.prompt_k, decode)
    if p.logprobs_k is not None:
        choice["completion_entropies"] = g.scores.entropies.tolist()
    choice["prompt_token_ids"] = ids if req.return_token_ids else None
    choice["token_ids"] = out if req.return_token_ids else None
    return choice


def generation_response(req: CompletionRequest, p: Plan, prompt_scores: list[SequenceScores | None],
                        generations: list[list[Generation]], served_model: str, decode: Decoder, text_of,
                        eos_id: int | None, fingerprint: str = "eopd") -> dict:
    """vLLM's CompletionResponse for `p`'s prompts: `generations[i]` the n samples of prompt i (in
    sample order), `prompt_scores[i]` its prompt's scores (None: not asked); `text_of(ids)` decodes
    a completion as vLLM's detokenizer does (the served tokenizer, `skip_special_tokens`)."""
    choices = []
    for ids, ps, gens in zip(p.prompts, prompt_scores, generations, strict=True):
        for g in gens:
            choices.append(_choice(req, p, len(choices), ids, ps, g, decode, text_of, eos_id))
    prompt_tokens = sum(len(ids) for ids in p.prompts)
    completion_tokens = sum(len(g.token_ids) for gens in generations for g in gens)
    return response_envelope(choices, prompt_tokens, completion_tokens, served_model, fingerprint)
