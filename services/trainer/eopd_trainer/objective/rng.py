"""`step_generator`: a CPU torch.Generator derived deterministically from a seed and integer keys.

`random_fkl` draws its FKL positions from a `torch.Generator`. Without one, `compute_loss` seeds a
fresh generator with `LossConfig.random_seed` on every call, so the draw is a deterministic function
of (random_seed, number of valid tokens): two calls with the same token count pick the same
positions. A training loop should instead pass a generator keyed by where it is, e.g.

    gen = step_generator(cfg.random_seed, iteration, optimizer_step, rank, micro_batch)
    loss, metrics = compute_loss(..., config=cfg, generator=gen)

so successive steps, ranks and micro-batches draw differently while a resumed run (same keys)
draws exactly the same positions again.
"""

from __future__ import annotations

import hashlib
import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_PERSON = b"eopd-step-gen-v1"  # domain separation of the hash (16 bytes, blake2b's maximum)


def step_seed(seed: int, *keys: int) -> int:
    """The 63-bit seed that `step_generator(seed, *keys)` uses.

    A BLAKE2b hash of the decimal integers joined by commas, so it is stable across processes,
    Python versions and platforms (unlike `hash()`), and distinct key tuples give unrelated seeds
    (`(1, 23)` and `(12, 3)` hash different strings). Keys may be negative; bools and non-integers
    are rejected.
    """
    values = []
    for i, v in enumerate((seed, *keys)):
        if isinstance(v, bool):
            raise TypeError(f"step_generator: {'seed' if i == 0 else f'key {i - 1}'} must be an int, got a bool")
        try:
            values.append(operator.index(v))
        except TypeError:
            name = "seed" if i == 0 else f"key {i - 1}"
            raise TypeError(f"step_generator: {name} must be an int, got {type(v).__name__}") from None
    text = ",".join(str(v) for v in values).encode("ascii")
    digest = hashlib.blake2b(text, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a valid seed for any torch generator


def step_generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU `torch.Generator` seeded by `step_seed(seed, *keys)`: same arguments, same draws.
    (torch is imported here: `step_seed` serves the data path's config, which loads without torch.)"""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(step_seed(seed, *keys))
    return gen
