"""DeepSpeed set-up: the generated DeepSpeed config (pure), the learning-rate schedule (pure
function + the scheduler object handed to DeepSpeed), process-group start, broadcasting rollout
bytes from rank 0, and gathering ZeRO-3 parameters for exports."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from typing import Any

import torch

from ..batching import gradient_accumulation_steps
from ..config import RunConfig
from ..config.load import deep_merge

log = logging.getLogger(__name__)


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `total_steps` steps.

    Linear warm-up over the first `warmup_steps` steps, starting above 0: step s < W uses
    peak * (s + 1) / W (the last warm-up step is at the peak). Then a cosine from the peak to
    peak * min_ratio over the remaining D = total - W steps: step W + j uses
    peak * (min_ratio + (1 - min_ratio) * (1 + cos(pi * j / D)) / 2), so the first decay step is
    at the peak and the last one (j = D - 1) still above the floor: the floor is where the
    schedule would be one step after the end. Steps past the end stay at the floor."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay = total_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / decay) if decay > 0 else 1.0
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class WarmupCosineSchedule:
    """`lr_at` as the learning-rate scheduler DeepSpeed drives (passed to `deepspeed.initialize`).

    DeepSpeed calls `step()` after every optimizer step it applies; `next_step` is the index of
    the optimizer step about to run, whose lr is already in the optimizer's param groups (set at
    construction for step 0, then after each step). `get_last_lr()` is therefore the lr the next
    optimizer step uses. The state saved in DeepSpeed's checkpoint is `next_step`; loading it
    re-applies that step's lr, so a resumed run continues the schedule where it stopped (the lr
    comes from the run's config: a resume with another `train.lr` uses the new peak).

    Not DeepSpeed's WarmupCosineLR: in 0.19 it starts at iteration -1, so the first optimizer
    step runs at lr 0, and it forces at least 2 warm-up steps."""

    def __init__(self, optimizer, *, peak: float, warmup_steps: int, total_steps: int, min_ratio: float):
        self.optimizer = optimizer
        self.peak, self.warmup_steps, self.total_steps, self.min_ratio = peak, warmup_steps, total_steps, min_ratio
        self.next_step = 0
        self._apply()

    def lr(self, step: int) -> float:
        return lr_at(step, peak=self.peak, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                     min_ratio=self.min_ratio)

    def _apply(self) -> None:
        value = self.lr(self.next_step)
        for group in self.optimizer.param_groups:
            group["lr"] = value
        self._last_lr = [value] * len(self.optimizer.param_groups)

    def step(self, *_ignored) -> None:  # DeepSpeed may pass a batch size on its fallback path
        self.next_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "next_step" in state:
            self.next_step = int(state["next_step"])
        elif "last_batch_iteration" in state:  # a checkpoint written with DeepSpeed's WarmupCosineLR
            self.next_step = int(state["last_batch_iteration"]) + 1
        else:
            raise ValueError(f"not a learning-rate scheduler state this learner knows (keys {sorted(state)})")
        self._apply()


def lr_scheduler_factory(cfg: RunConfig, total_steps: int):
    """The `lr_scheduler` argument of `deepspeed.initialize`: DeepSpeed calls it with its basic
    optimizer (the same param groups ZeRO and bf16 wrap)."""
    t = cfg.train
    return lambda optimizer: WarmupCosineSchedule(optimizer, peak=t.lr, warmup_steps=t.warmup_steps,
                                                  total_steps=total_steps, min_ratio=t.min_lr_ratio)


def build_ds_config(cfg: RunConfig, world_size: int, total_steps: int) -> dict[str, Any]:
    """The DeepSpeed config of a run: B_mini rollouts per optimizer step, made of micro-batches
    of `micro_batch_size` per process and gradient accumulation; AdamW. No `scheduler` section:
    the schedule is `lr_scheduler_factory`'s (warm-up + cosine, `lr_at`), and one given in
    `train.deepspeed` is refused (it would be silently ignored)."""
    t = cfg.train
    if "scheduler" in t.deepspeed:
        raise ValueError("train.deepspeed.scheduler is not supported: the learning-rate schedule is set by "
                         "train.lr, train.warmup_steps and train.min_lr_ratio (linear warm-up + cosine)")
    gas = gradient_accumulation_steps(t.mini_batch_size, t.micro_batch_size, world_size)
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    # torch's AdamW on every device. DeepSpeed's FusedAdam is a CUDA op it compiles with nvcc at the first
    # step (a compiler on every learner host, minutes of start-up), and its builder cannot parse an arch
    # list such as TORCH_CUDA_ARCH_LIST="9.0a" (int('0a')). The learner's first GPU run died on that error
    # with torch's AdamW too: another library parses the list (not yet found; docs/benchmarks.md).
    # train.deepspeed.optimizer.params.torch_adam=false asks for FusedAdam.
    # `fused`: torch's own one-kernel AdamW (CPU and CUDA), not its loop of per-parameter ops, whose
    # temporaries (sqrt(v), then its quotient) are a parameter's size each: on the main job's learner
    # (SmolLM2, 131M parameters, CPU) the peak RSS 0.09 GiB lower and an iteration 8% faster (issue 50
    # ask 5; docs/benchmarks.md "Main job"). train.deepspeed.optimizer.params.fused=false turns it off.
    optim_params: dict[str, Any] = {"lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay,
                                    "torch_adam": True, "fused": True}
    base = {
        "train_batch_size": t.mini_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": optim_params},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    return deep_merge(base, t.deepspeed)


def loopback_interface() -> str:
    """The loopback interface's name (lo on Linux, lo0 on macOS)."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def deepspeed_arch_list(value: str) -> str | None:
    """`TORCH_CUDA_ARCH_LIST` as DeepSpeed 0.19 can parse it, or None when it already can.

    CUDA images list architecture variants (`9.0a`, `10.0f`, with or without `+PTX`); DeepSpeed's op
    builder takes each entry's minor version with `int()` and fails on them ("invalid literal for
    int() with base 10: '0a'": the learner died at start on a lent H200, docs/benchmarks.md;
    deepspeedai/DeepSpeed#8619 is the open fix). eopd builds no DeepSpeed ops, so the base
    architecture is enough: `9.0a` -> `9.0`, `10.0f+PTX` -> `10.0+PTX`, separators `;`, duplicates once."""
    out: list[str] = []
    changed = False
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        arch, plus, rest = entry.partition("+")
        major, dot, minor = arch.partition(".")
        digits = minor.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
        if dot and major.isdigit() and digits.isdigit() and digits != minor:
            entry, changed = f"{major}.{digits}{plus}{rest}", True
        if entry not in out:
            out.append(entry)
    return ";".join(out) if changed else None


def init_process_group(backend: str = "") -> tuple[int, int]:
    """Starts torch.distributed through DeepSpeed (env:// rendezvous from torchrun / the deepspeed
    launcher). Returns (rank, world_size).

    A single process (`eopd run`'s learner, one started by hand) is a world of one that listens on
    nothing reachable (issue 49): its store is in memory (a HashStore, not env://'s TCPStore, which
    binds every interface), and gloo's and NCCL's sockets are on the loopback unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise. Several ranks rendezvous as their launcher
    says (torchrun's store listens where torchrun puts it); those variables name the interface their
    collectives use."""
    parsable = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    if parsable is not None:
        log.info("TORCH_CUDA_ARCH_LIST %r -> %r in the learner: DeepSpeed 0.19 cannot parse architecture variants "
                 "(deepspeedai/DeepSpeed#8619); eopd builds no DeepSpeed ops", os.environ["TORCH_CUDA_ARCH_LIST"], parsable)
        os.environ["TORCH_CUDA_ARCH_LIST"] = parsable
    import deepspeed

    skip_shm_comm_build(deepspeed)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ:  # started by hand: a world of one
        lo = loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend)  # adopts the group started above, if any
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


#: DeepSpeed's CPU shared-memory all-reduce op (`deepspeed.ops.op_builder.cpu.ShareMemCommBuilder`).
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_build(deepspeed) -> None:
    """Marks DeepSpeed's CPU shared-memory comm op as not to be built, before `init_distributed`.

    DeepSpeed's torch backend JIT-compiles that op whenever its accelerator is the CPU and the op
    is not installed (40-60 s of C++ on a 2-core machine, the first learner start after every fresh
    install; a second venv sharing TORCH_EXTENSIONS_DIR rebuilds it over the first's), for one
    method only, `inference_all_reduce`, which training never calls: DeepSpeed's training
    collectives are torch.distributed's own. Its backend asks `deepspeed.ops.__compatible_ops__`
    whether to build (a dict DeepSpeed computes once per process and keeps, edits included); an op
    marked incompatible there is not built and the backend runs without it, as on a machine
    without a compiler. Other accelerators (CUDA) have no such op: nothing is probed or changed there."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().get_op_builder("ShareMemCommBuilder") is not None:
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def destroy_process_group() -> None:
    """Ends the process group, if one was started: a gloo group left to interpreter exit aborted
    torchrun's rank 1 after training ('terminate called without an active exception')."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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


# Step metrics over every rank --------------------------------------------------------------

def step_metrics_tensor(rows: list[tuple[dict[str, float], int]], loss_sum: dict[str, float],
                        keys: tuple[str, ...], loss_keys: tuple[str, ...]) -> torch.Tensor:
    """This rank's share of a step's metrics as one float64 tensor [3, K] to all-reduce (sum):
    row 0 the token-weighted sums of `keys` (non-finite values skipped), row 1 their token
    counts, row 2 the loss terms (padded with zeros)."""
    t = torch.zeros(3, max(len(keys), len(loss_keys)), dtype=torch.float64)
    for metrics, n in rows:
        for i, k in enumerate(keys):
            v = metrics.get(k)
            if v is not None and math.isfinite(float(v)):
                t[0, i] += float(v) * n
                t[1, i] += n
    for i, k in enumerate(loss_keys):
        t[2, i] = float(loss_sum.get(k, 0.0))
    return t


def step_metrics_from_tensor(t: torch.Tensor, keys: tuple[str, ...], loss_keys: tuple[str, ...],
                             world: int) -> dict[str, float]:
    """The step's metrics from the all-reduced tensor: token-weighted means over every rank's
    tokens, and the loss terms averaged over ranks (each rank's `loss_sum` is its share of the
    mini-batch loss times the world size, see the learner's denominator)."""
    out = {k: float(t[0, i] / t[1, i]) for i, k in enumerate(keys) if t[1, i] > 0}
    out.update({k: float(t[2, i]) / world for i, k in enumerate(loss_keys)})
    return out


def all_reduce_step_metrics(rows: list[tuple[dict[str, float], int]], loss_sum: dict[str, float],
                            keys: tuple[str, ...], loss_keys: tuple[str, ...]) -> dict[str, float]:
    """Every rank calls this after a step; every rank gets the metrics of the whole mini-batch."""
    t = step_metrics_tensor(rows, loss_sum, keys, loss_keys)
    world = 1
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        world = torch.distributed.get_world_size()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return step_metrics_from_tensor(t, keys, loss_keys, world)
