"""What the teacher's vLLM engine and the student's vLLM sampler start vLLM with, in one place.

`prepare_vllm_process` sets the environment vLLM reads when it starts, `engine_kwargs` the
`vllm.LLM` arguments both roles pass (each adds its own: the teacher's pooling runner, the
student's sampling settings), `describe_kwargs` the log line. vLLM itself is never imported here
(it is an optional install), and torch only by `prepare_vllm_process`.

Named `vllm_args`, not `vllm`, so it never looks like the vllm package.
"""

from __future__ import annotations

import os
from collections.abc import Container, Mapping
from typing import Any

GiB = 1 << 30
# The KV cache on CPU unless configured (on GPU vLLM sizes it from gpu_memory_utilization).
CPU_DEFAULT_KV_CACHE_GIB = 1.0


def prepare_vllm_process(threads: int = 0) -> None:
    """Sets up this process for an in-process vLLM engine, before it starts: the engine core runs
    in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the environment says otherwise),
    and `OMP_NUM_THREADS` is set, because vLLM's CPU worker pins torch to one thread unless it is,
    and then forbids `torch.set_num_threads`. With `threads` (> 0) both are set to it; else
    `OMP_NUM_THREADS` keeps its value, or gets torch's current thread count."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


def engine_kwargs(*, dtype: str, tensor_parallel_size: int, gpu_memory_utilization: float, enforce_eager: bool,
                  kv_cache_gib: float | None, max_model_len: int | None, on_cpu: bool) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments both roles share. The KV cache gets `kv_cache_gib` GiB,
    else `CPU_DEFAULT_KV_CACHE_GIB` on CPU, else vLLM's own sizing (from gpu_memory_utilization);
    `max_model_len` is passed only when set (vLLM's default: the model's context length)."""
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
    )
    kv_gib = kv_cache_gib if kv_cache_gib is not None else (CPU_DEFAULT_KV_CACHE_GIB if on_cpu else None)
    if kv_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gib * GiB)
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def describe_kwargs(kwargs: Mapping[str, Any], skip: Container[str] = ()) -> str:
    """`k=v, k=v` for a log line, leaving out the keys in `skip` (objects without a useful repr)."""
    return ", ".join(f"{k}={v}" for k, v in kwargs.items() if k not in skip)
