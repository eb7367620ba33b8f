"""A sampler's weights handed back while its worker waits (`rollout.release_idle_weights`, issue 50
ask 5).

In sync mode a worker that has sampled its iteration's tasks waits while the learner trains on
them, and the next tasks ask for the version the learner publishes after that step, which the
worker then loads in full. Meanwhile its copy of the policy is dead memory, and it is held at the
moment the whole job's memory peaks (the learner's backward pass and optimizer step: on the main
job, 0.5 GiB of the worker's 0.95). `park` frees every parameter's storage (the module keeps its
parameter objects, each holding an empty tensor; a tied parameter is one object, freed once);
`unpark` gives each its shape back, uninitialised, for the next load to fill.

    parked = park(model)      # [(parameter, shape, dtype, device)], the storage freed
    unpark(parked)            # allocated again (uninitialised): load the weights next
"""

from __future__ import annotations

import torch

Parked = list[tuple[torch.nn.Parameter, torch.Size, torch.dtype, torch.device]]


def park(model: torch.nn.Module) -> Parked:
    """Frees the storage of every parameter of `model` (buffers are kept: rotary tables and the
    like are small and not loaded from the policy); returns what `unpark` needs."""
    parked: Parked = []
    for p in model.parameters():  # each shared (tied) parameter once
        parked.append((p, p.shape, p.dtype, p.device))
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return parked


def unpark(parked: Parked) -> None:
    """Each parked parameter allocated again at its shape, dtype and device, uninitialised."""
    for p, shape, dtype, device in parked:
        p.data = torch.empty(shape, dtype=dtype, device=device)
