"""`weight_sync: auto` made concrete by `eopd run`, which starts the learner and the workers on this
machine: shared memory (/dev/shm) when it has room, as one mapped buffer where the workers sample
with transformers (`mapped`, queue/weights_buffer.py) or as versioned files where they sample with
vLLM, which loads files (`shm`); else disk. The shared-memory directory is released when the
training attempt ends (it holds RAM).

The learner republishes its weights when a restarted run finds the announced file gone
(`RolloutFeed.announced_version`), so releasing the directory loses nothing a resume needs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from eopd_common.models import resolve_spec

from ..config import RunConfig
from ..config.sections import SHM_ROOT, shm_weights_dir
from ..rollout.samplers import resolve_engine, vllm_installed

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


def shm_bytes_needed(cfg: RunConfig) -> int:
    """Room for the versions the learner keeps, one being written and one being read: twice the
    student's files per version (a bf16 file may be published as float32)."""
    return 2 * model_file_bytes(cfg.student.model) * (cfg.checkpoint.keep_weights + 2)


def mapped_bytes_needed(cfg: RunConfig) -> int:
    """Room for the mapped buffer: the student's files, twice (a bf16 file may be published as float32)."""
    return 2 * model_file_bytes(cfg.student.model)


def choose_weight_sync(cfg: RunConfig, *, shm_root: Path = SHM_ROOT, vllm: bool | None = None) -> tuple[str, str]:
    """(disk, shm or mapped; why) for this machine: an explicit setting as it is; auto on Linux, when
    `shm_root` is a directory with room, is mapped where the workers sample with transformers
    (`rollout.engine` resolved as the worker will, `vllm`: whether vLLM is installed, looked up when
    None) and shm where they sample with vLLM; else disk."""
    if cfg.weight_sync != "auto":
        return cfg.weight_sync, f"weight_sync: {cfg.weight_sync} (configured)"
    if not sys.platform.startswith("linux") or not shm_root.is_dir():
        return "disk", f"weight_sync auto: disk ({shm_root} is not available here)"
    engine = resolve_engine(cfg.rollout.engine, cfg.student.device, vllm_installed() if vllm is None else vllm)
    mapped = engine == "transformers"
    need, free = (mapped_bytes_needed if mapped else shm_bytes_needed)(cfg), shutil.disk_usage(shm_root).free
    if free < need:
        return "disk", f"weight_sync auto: disk ({shm_root} has {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB needed)"
    where = shm_weights_dir(cfg.run_dir).parent
    if mapped:
        return "mapped", f"weight_sync auto: one mapped buffer in shared memory ({where})"
    return "shm", f"weight_sync auto: shared memory ({where}; files: the workers sample with vLLM)"


def release_shm(run_dir: Path) -> None:
    """Removes the run's shared-memory weights directory, if any (this user's own only: the learner
    never publishes into one it does not own)."""
    shutil.rmtree(shm_weights_dir(run_dir).parent, ignore_errors=True)
