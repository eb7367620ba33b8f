"""Distance of a student to its teacher on held-out prompts (full vocabulary, both models local).

At every response position of a set of contexts (prompt + sampled response), the exact reverse
KL(student || teacher) and forward KL(teacher || student) of the next-token distributions,
averaged over positions:

- `kl_to_teacher`: on the student's own samples (on-policy, as in the paper's analyses);
- `sample_contexts` + `kl_on_samples`: on fixed contexts, e.g. sampled once from the initial
  student, so that two checkpoints are compared on the very same positions (a paired measure,
  much less noisy on small evaluation sets).

`position_log_probs` gives both models' log-distributions at those positions; `paired_log_probs`
(for `eopd eval`) runs a model that is its own teacher once; `recorded_log_probs` takes the model's
from the logits `generate` recorded while sampling (fp32 models: no second pass over its samples).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from eopd_common.logits import final_logits
from eopd_common.models import pad_token_id
from eopd_common.shared_prefill import response_hidden

from ..rollout.samplers.base import Sample
from ..rollout.samplers.transformers_sampler import generate


@torch.no_grad()
def sample_contexts(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int = 1234,
                    temperature: float = 1.0, batch_size: int = 8) -> list[Sample]:
    out: list[Sample] = []
    for start in range(0, len(prompts), batch_size):
        out.extend(generate(model, tokenizer, list(prompts[start : start + batch_size]), temperature=temperature,
                            top_p=1.0, max_new_tokens=max_new_tokens, seed=seed + start))
    return out


@torch.no_grad()
def position_log_probs(student, teacher, samples: Sequence[Sample], pad_id: int, *, temperature: float = 1.0,
                       batch_size: int = 8) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk of samples: the student's and the teacher's full next-token log-distributions at
    every response position, `(ls, lt)`, each [positions, V] float64 (response order kept)."""
    for chunk in _chunks(samples, batch_size):
        yield (_response_log_probs(student, chunk, pad_id, temperature),
               _response_log_probs(teacher, chunk, pad_id, temperature))


@torch.no_grad()
def paired_log_probs(model, teacher, samples: Sequence[Sample], pad_id: int,
                     batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`position_log_probs(model, teacher, ...)` at temperature 1.0; when the model IS the teacher,
    one forward pass per chunk whose log-probs serve as both."""
    if model is not teacher:
        yield from position_log_probs(model, teacher, samples, pad_id, temperature=1.0, batch_size=batch_size)
        return
    for chunk in _chunks(samples, batch_size):
        ls = _response_log_probs(model, chunk, pad_id, 1.0)
        yield ls, ls


@torch.no_grad()
def recorded_log_probs(teacher, samples: Sequence[Sample], pad_id: int,
                       batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`paired_log_probs` for samples that carry their model's logits recorded while sampling
    (`Sample.logits`, `generate(keep_logits=...)`): the model's log-distributions at temperature 1.0
    from those, the teacher's from its forward pass; `teacher` None: the model is its own teacher
    (no forward pass at all). Each `(ls, lt)` is [positions, V] float64, response order kept."""
    for chunk in _chunks(samples, batch_size):
        if any(s.logits is None or s.logits.shape[0] != len(s.response_ids) for s in chunk):
            raise ValueError("recorded_log_probs: every sample must carry the logits of each response position")
        ls = torch.log_softmax(torch.cat([s.logits for s in chunk]).double(), dim=-1)
        yield ls, (ls if teacher is None else _response_log_probs(teacher, chunk, pad_id, 1.0))


def _chunks(samples: Sequence[Sample], batch_size: int):
    for start in range(0, len(samples), batch_size):
        yield samples[start : start + batch_size]


def _response_log_probs(model, chunk: Sequence[Sample], pad_id: int, temperature: float) -> torch.Tensor:
    """The model's full next-token log-distribution at every response position of a chunk of
    samples, [positions, V] float64: its logits (`final_logits` of the output projection) from the
    final hidden states at those positions only, the prompts' shared tokens run once (`response_hidden`)."""
    device = next(model.parameters()).device
    h = response_hidden(model, [s.prompt_ids for s in chunk], [s.response_ids for s in chunk], pad_id, device)
    head = model.get_output_embeddings()
    logits = final_logits(model.config, torch.nn.functional.linear(h, head.weight, head.bias))
    return torch.log_softmax(logits.double() / temperature, dim=-1)


@torch.no_grad()
def kl_on_samples(student, teacher, samples: Sequence[Sample], pad_id: int, *, temperature: float = 1.0,
                  batch_size: int = 8) -> dict[str, float]:
    rkl_sum = fkl_sum = 0.0
    n = 0
    for ls, lt in position_log_probs(student, teacher, samples, pad_id, temperature=temperature, batch_size=batch_size):
        rkl_sum += float((ls.exp() * (ls - lt)).sum())
        fkl_sum += float((lt.exp() * (lt - ls)).sum())
        n += ls.shape[0]
    return {"reverse_kl": rkl_sum / max(n, 1), "forward_kl": fkl_sum / max(n, 1), "tokens": float(n)}


@torch.no_grad()
def kl_to_teacher(student, teacher, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
                  seed: int = 1234, temperature: float = 1.0, batch_size: int = 8) -> dict[str, float]:
    samples = sample_contexts(student, tokenizer, prompts, max_new_tokens=max_new_tokens, seed=seed,
                              temperature=temperature, batch_size=batch_size)
    return kl_on_samples(student, teacher, samples, pad_token_id(tokenizer), temperature=temperature, batch_size=batch_size)
