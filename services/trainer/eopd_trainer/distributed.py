"""DeepSpeed set-up: the generated DeepSpeed config (pure), process-group start, broadcasting
rollout bytes from rank 0, and gathering ZeRO-3 parameters for exports."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import torch

from .batching import gradient_accumulation_steps
from .config import RunConfig


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(cfg: RunConfig, world_size: int, total_steps: int, *, on_cpu: bool) -> dict[str, Any]:
    """The DeepSpeed config of a run: B_mini rollouts per optimizer step, made of micro-batches
    of `micro_batch_size` per process and gradient accumulation; AdamW; warm-up + cosine."""
    t = cfg.train
    gas = gradient_accumulation_steps(t.mini_batch_size, t.micro_batch_size, world_size)
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    optim_params: dict[str, Any] = {"lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay}
    if on_cpu:
        optim_params["torch_adam"] = True  # DeepSpeed's fused Adam needs CUDA
    base = {
        "train_batch_size": t.mini_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": optim_params},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(total_steps, t.warmup_steps + 1),
                # DeepSpeed needs >= 1 warm-up step; "no warm-up" is one step that starts at the peak.
                "warmup_num_steps": max(1, t.warmup_steps),
                "warmup_min_ratio": 0.0 if t.warmup_steps else 1.0,
                "cos_min_ratio": t.min_lr_ratio,
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    return deep_merge(base, t.deepspeed)


def init_process_group(backend: str = "") -> tuple[int, int]:
    """Starts torch.distributed through DeepSpeed (env:// rendezvous from torchrun / the deepspeed
    launcher; a single process gets a private one). Returns (rank, world_size)."""
    import deepspeed

    if "RANK" not in os.environ:  # started by hand: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    deepspeed.init_distributed(dist_backend=backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def broadcast_int(value: int, src: int = 0) -> int:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.broadcast(t, src)
    return int(t.item())


def broadcast_blobs(blobs: list[bytes] | None, src: int = 0) -> list[bytes]:
    """Rank `src`'s list of byte strings on every rank (raw bytes in a uint8 tensor; no pickle)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return list(blobs or [])
    rank = torch.distributed.get_rank()
    n = broadcast_int(len(blobs) if rank == src else 0, src)
    lengths = torch.tensor([len(b) for b in blobs], dtype=torch.int64) if rank == src else torch.empty(n, dtype=torch.int64)
    torch.distributed.broadcast(lengths, src)
    total = int(lengths.sum().item())
    if rank == src:
        payload = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    else:
        payload = torch.empty(total, dtype=torch.uint8)
    torch.distributed.broadcast(payload, src)
    if rank == src:
        return list(blobs)
    raw = payload.numpy().tobytes()
    out, pos = [], 0
    for ln in lengths.tolist():
        out.append(raw[pos : pos + ln])
        pos += ln
    return out


@contextlib.contextmanager
def full_parameters(engine, zero_stage: int):
    """Inside, every rank sees the full parameters (ZeRO-3 gathers them; a no-op otherwise)."""
    if zero_stage < 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield
