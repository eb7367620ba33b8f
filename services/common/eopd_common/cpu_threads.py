"""What a process's CPU threading is, in one line for its start-up log (the teacher's and the
trainer processes'): torch's intra-op thread count, OpenMP's wait policy and, where set, libgomp's
spin count, all fixed when the process started (`threads:` of the run config sets them for the
processes `eopd run` starts)."""

from __future__ import annotations

import os


def cpu_threads_note() -> str:
    import torch

    note = f"{torch.get_num_threads()} torch threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    spin = os.environ.get("GOMP_SPINCOUNT")
    return note + (f", GOMP_SPINCOUNT={spin}" if spin is not None else "")
