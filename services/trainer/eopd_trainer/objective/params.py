"""`LossParams`: what the variants and the loss terms read of the loss configuration, as a
Protocol. `LossConfig` (config.py) is the one object that satisfies it; typing against this view
lets variants.py and loss_terms.py annotate with it without importing config.py, which imports the
variants' registry (no import cycle, type-checking imports included)."""

from __future__ import annotations

from typing import Protocol


class LossParams(Protocol):
    """The loss's hyper-parameters (documented on `LossConfig`'s fields)."""

    variant: str
    tau: float
    alpha: float
    clip_low: float
    clip_high: float
    temperature: float
    random_fraction: float
    random_seed: int
    entropy_coef: float
    shaping_alpha: float
    shaping_kappa: float
    ce_weight: float
    kl_weight: float
    gkd_lambda: float
    gkd_beta: float
    support: str
    gate: str
    aggregation: str
    grpo_eps: float
    candidate_k: int
    chunk_size: int
    vocab_metrics: bool
