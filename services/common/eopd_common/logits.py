"""The logit transforms causal LMs apply after the output projection: the one table both services use.

Some architectures do not take `lm_head(hidden)` as their logits. transformers applies, by config
attribute (on the text model's config for multimodal ones, `text_config`):

| attribute                 | architectures | logits                | off when             |
|---------------------------|---------------|-----------------------|----------------------|
| `final_logit_softcapping` | Gemma 2 / 3   | `cap * tanh(z / cap)` | None or 0            |
| `logit_scale`             | Cohere        | `z * s`               | None or 1 (identity) |
| `logits_scaling`          | Granite       | `z / s`               | None or 1 (identity) |

where `z = lm_head(hidden)`. Code that projects hidden states itself (the trainer's old-log-prob
pass, the teacher's statistics) must apply them to get `model(...).logits`:

- `final_logits(config, raw)` applies every transform (the trainer);
- `scoring_logit_factor(config, model)` is the teacher engines' check: the two scalings are one
  positive factor on the logits, which the statistics fold into the inverse temperature (exact,
  no extra pass over the logits); soft-capping is not linear and is refused.

Every function takes a transformers config object or the parsed `config.json` dict. Pure
functions; torch is not imported here (`final_logits` only calls tensor methods).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SOFTCAPPING = "final_logit_softcapping"
LOGIT_SCALE = "logit_scale"
LOGITS_SCALING = "logits_scaling"
# Every transform this table knows, in the order `final_logits` applies them (no architecture
# turns on more than one).
LOGIT_TRANSFORMS: tuple[str, ...] = (SOFTCAPPING, LOGIT_SCALE, LOGITS_SCALING)


class UnsupportedLogitTransform(ValueError):
    """A model's logits are not something the teacher's statistics can reproduce."""


def _attr(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def transform_values(config: Any) -> dict[str, float]:
    """The transforms this config turns on, with their values, in `LOGIT_TRANSFORMS` order,
    e.g. `{"final_logit_softcapping": 30.0}` for Gemma 2 and `{}` for Llama (or Granite with
    `logits_scaling: 1.0`). A value is read from `text_config` when the config has one and sets
    it there, else from the top level."""
    text = _attr(config, "text_config") or {}
    out: dict[str, float] = {}
    for name in LOGIT_TRANSFORMS:
        value = _attr(text, name)
        if value is None:
            value = _attr(config, name)
        if value is None:
            continue
        value = float(value)
        if name == SOFTCAPPING and value == 0.0:
            continue  # 0 would be undefined (z / 0); transformers configs use None for off
        if name != SOFTCAPPING and value == 1.0:
            continue  # the identity
        out[name] = value
    return out


def logit_transforms(config: Any) -> list[str]:
    """The names of the transforms this config turns on (see `transform_values`); empty when
    `lm_head(hidden)` is the logits."""
    return list(transform_values(config))


def final_logits(config: Any, raw: torch.Tensor) -> torch.Tensor:
    """`model(...).logits` from the output projection `raw = lm_head(hidden)`.

    Args:
        config: the model's config object or `config.json` dict.
        raw: `[..., V]` projection output, any float dtype.

    Returns:
        `[..., V]` float32 (a new tensor when a transform is on; `raw` itself when it is already
        float32 and none is).
    """
    z = raw.float()
    values = transform_values(config)
    if SOFTCAPPING in values:
        cap = values[SOFTCAPPING]
        z = (z / cap).tanh() * cap
    if LOGIT_SCALE in values:
        z = z * values[LOGIT_SCALE]
    if LOGITS_SCALING in values:
        z = z / values[LOGITS_SCALING]
    return z


def scoring_logit_factor(config: Any, model: str) -> float:
    """The factor `c` with `model(...).logits == c * lm_head(hidden)`, for the teacher's statistics
    (which multiply the projection by `c / temperature`): 1.0 without a transform, `s` for
    Cohere's `logit_scale`, `1 / s` for Granite's `logits_scaling`.

    Raises `UnsupportedLogitTransform`, naming `model` and the attribute, for soft-capping (not a
    linear map of the projection) and for a scale that is not a positive finite number (the top-k
    would no longer be those of the projection)."""
    values = transform_values(config)
    if SOFTCAPPING in values:
        raise UnsupportedLogitTransform(
            f"model {model}: {SOFTCAPPING}={values[SOFTCAPPING]:g} is not supported by the teacher "
            f"(its statistics apply only a positive scaling of lm_head(hidden))")
    factor = 1.0
    for name in (LOGIT_SCALE, LOGITS_SCALING):
        if name not in values:
            continue
        value = values[name]
        if not (math.isfinite(value) and value > 0.0):
            raise UnsupportedLogitTransform(f"model {model}: {name}={value:g} is not supported (must be > 0)")
        factor = factor * value if name == LOGIT_SCALE else factor / value
    return factor
