"""An announced policy version loaded into a model, whatever its format: a safetensors file (`disk`,
`shm`: queue/weights.py) or the mapped buffer (`mapped`: queue/weights_buffer.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from .messages import PolicyVersion
from .weights import check_weights_location, load_weights
from .weights_buffer import FORMAT as BUFFER_FORMAT
from .weights_buffer import load_buffer_into


def load_policy(model: torch.nn.Module, pv: PolicyVersion, *, verify: bool = True,
                weights_dir: Path | None = None) -> None:
    """Loads the announced weights into `model` in place (dtypes converted to the model's); the model
    untouched when anything is wrong: WeightsUnavailable (retry), ValueError (not the model's
    tensors), except WeightsTorn: the mapped buffer, copied straight into the model
    (`load_buffer_into`), was rewritten during the copy, and the model holds no whole version until
    the next load. `weights_dir`: the announced path must lie inside it."""
    if pv.format == BUFFER_FORMAT:
        if weights_dir is not None:
            check_weights_location(pv, weights_dir)
        load_buffer_into(model, pv)
    else:
        load_weights(model, pv, verify=verify, weights_dir=weights_dir)
