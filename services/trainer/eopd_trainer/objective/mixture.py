"""A mixture of teachers' losses (`route.mixture`, issue 32): the loss of a response scored by
several teachers is the weighted sum of each teacher's loss (its own advantage, entropy gate and
top-k: the variant's terms, computed once per teacher on the same student outputs),

    L = sum_j w_j * L(student, teacher_j),    sum_j w_j = 1.

The metrics are the same weighted sums (the loss terms exactly, the diagnostics as the mixture's
average), plus each teacher's own `by_teacher/<name>/<key>` for `PER_TEACHER`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from .inputs import LossInputs

PER_TEACHER = ("fkl_gated_mean",)  # what only the student's distribution can give, per teacher


def per_teacher_keys(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"by_teacher/{name}/{key}" for name in names for key in PER_TEACHER)


def mixture_loss(loss_of: Callable[[LossInputs], tuple[Tensor, dict[str, float]]], inputs: LossInputs,
                 parts: Sequence[tuple[str, dict]], weights: Mapping[str, float]) -> tuple[Tensor, dict[str, float]]:
    """`loss_of(inputs)` for the mixture's first teacher (`inputs` holds its scores) and
    `loss_of(inputs.replace(**fields))` for each of `parts` ((name, teacher_* tensors), in the
    mixture's order), summed with `weights` (name -> w_j)."""
    names = list(weights)
    if [name for name, _ in parts] != names[1:]:
        raise ValueError(f"mixture parts {[name for name, _ in parts]} differ from route.mixture's teachers {names[1:]}")
    results = [(names[0], loss_of(inputs))]
    results += [(name, loss_of(inputs.replace(**fields))) for name, fields in parts]
    loss = sum(weights[name] * value for name, (value, _) in results)
    keys = {k for _, (_, m) in results for k in m}
    metrics = {k: sum(weights[name] * m[k] for name, (_, m) in results if k in m) for k in keys}
    for name, (_, m) in results:
        metrics.update({f"by_teacher/{name}/{k}": m[k] for k in PER_TEACHER if k in m})
    return loss, metrics
