"""`weight_sync: auto` (and `broadcast`'s address) made concrete by `eopd run`, which starts the learner and the workers on this
machine: shared memory (/dev/shm) when it has room, as one mapped buffer (`mapped`,
queue/weights_buffer.py) that the workers copy out (with vLLM, each vLLM worker copies it out
itself: rollout/samplers/vllm_mapped.py); else disk. `shm` (versioned files in shared memory) is
kept for those who set it. The shared-memory directory is released when the
training attempt ends (it holds RAM).

The learner republishes its weights when a restarted run finds the announced file gone
(`RolloutFeed.announced_version`), so releasing the directory loses nothing a resume needs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from eopd_common.models import resolve_spec

from ..config import RunConfig, WeightBroadcastConfig
from ..config.sections import SHM_ROOT, shm_weights_dir
from .supervisor import free_port

UNKNOWN_MODEL_BYTES = 1 << 30  # a preset's weights (tiny-random, SmolLM2-135M: well under this)


def model_file_bytes(spec: str) -> int:
    """The bytes of a model spec's weight files (a directory's *.safetensors / *.bin, a .gguf file);
    UNKNOWN_MODEL_BYTES for presets and anything not found."""
    try:
        resolved = resolve_spec(spec)
    except ValueError:
        return UNKNOWN_MODEL_BYTES
    if resolved.kind == "gguf" and resolved.path is not None:
        return resolved.path.stat().st_size
    if resolved.kind == "hf-dir" and resolved.path is not None:
        files = [*resolved.path.glob("*.safetensors"), *resolved.path.glob("*.bin")]
        return sum(f.stat().st_size for f in files) or UNKNOWN_MODEL_BYTES
    return UNKNOWN_MODEL_BYTES


def mapped_bytes_needed(cfg: RunConfig) -> int:
    """Room for the mapped buffer: the student's files, twice (a bf16 file may be published as float32)."""
    return 2 * model_file_bytes(cfg.student.model)


def choose_weight_sync(cfg: RunConfig, *, shm_root: Path = SHM_ROOT) -> tuple[str, str]:
    """(disk or mapped; why) for this machine: an explicit setting as it is; auto on Linux, when
    `shm_root` is a directory with room for the buffer, is mapped (transformers and vLLM workers
    alike); else disk."""
    if cfg.weight_sync != "auto":
        return cfg.weight_sync, f"weight_sync: {cfg.weight_sync} (configured)"
    if not sys.platform.startswith("linux") or not shm_root.is_dir():
        return "disk", f"weight_sync auto: disk ({shm_root} is not available here)"
    need, free = mapped_bytes_needed(cfg), shutil.disk_usage(shm_root).free
    if free < need:
        return "disk", f"weight_sync auto: disk ({shm_root} has {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB needed)"
    return "mapped", f"weight_sync auto: one mapped buffer in shared memory ({shm_weights_dir(cfg.run_dir).parent})"


def broadcast_here(section: WeightBroadcastConfig) -> WeightBroadcastConfig:
    """`weight_sync: broadcast` under `eopd run`: its one worker, and a free port on 127.0.0.1 for the
    learner's store unless an address is configured."""
    address = section.address or f"127.0.0.1:{free_port()}"
    return section.model_copy(update={"address": address, "workers": 1})


def release_shm(run_dir: Path) -> None:
    """Removes the run's shared-memory weights directory, if any (this user's own only: the learner
    never publishes into one it does not own)."""
    shutil.rmtree(shm_weights_dir(run_dir).parent, ignore_errors=True)
