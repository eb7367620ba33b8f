"""Weight sync: versioned safetensors files in a shared directory, announced on a Redis key.

The learner writes `<run_dir>/weights/v000012.safetensors` (to a temporary name, fsynced, then
renamed, so a reader never sees a partial file), then SETs `<ns>:policy` to a `PolicyVersion`
(version, uri, sha256, size). Workers poll the key (one GET) and, when (version, sha256) changes
(a learner restarted from its last checkpoint re-announces an older version), verify the sha256
and load the file into their model in place. Old files are pruned, keeping the last
few versions so a worker still loading one is not pulled from under.

Multi-node: `weights_dir` must be a shared file system (NFS, Lustre, a mounted bucket) or the
uri an object-store URL fetched by a small loader; only the announcement goes through Redis, so
Redis carries bytes per version, not gigabytes. For large fleets the same file can be fanned out
(workers copy to local NVMe once per version); see docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import torch

from .messages import PolicyVersion, decode_policy, encode_policy, now_ns

log = logging.getLogger(__name__)


def weights_path(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version:06d}.safetensors"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as standalone contiguous CPU tensors, tied aliases dropped (the
    first name of a shared parameter is kept). DeepSpeed ZeRO 1-2 turn parameters into views
    of flat buffers, which safetensors refuses to save as they are."""
    keep = set(export_state_dict_names(model))
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items() if k in keep}


def save_weights(model: torch.nn.Module, weights_dir: Path, version: int, iteration: int) -> PolicyVersion:
    """Writes the model's weights atomically; returns the announcement to publish."""
    from safetensors.torch import save_file

    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = weights_path(weights_dir, version)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    save_file(export_state_dict(model), str(tmp), metadata={"version": str(version), "iteration": str(iteration)})
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(weights_dir)
    return PolicyVersion(version=version, uri=str(final.resolve()), sha256=file_sha256(final),
                         num_bytes=final.stat().st_size, iteration=iteration, created_unix_ns=now_ns())


def announce(client, key: str, pv: PolicyVersion) -> None:
    client.set(key, encode_policy(pv))


def current_announcement(client, key: str) -> PolicyVersion | None:
    raw = client.get(key)
    return decode_policy(raw) if raw else None


def prune_weights(weights_dir: Path, keep: int, protect: int) -> None:
    """Deletes all but the newest `keep` versions (never `protect`, the announced one)."""
    files = sorted(Path(weights_dir).glob("v*.safetensors"))
    for f in files[:-keep]:
        if f != weights_path(weights_dir, protect):
            with contextlib.suppress(OSError):
                f.unlink()


def load_weights(model: torch.nn.Module, pv: PolicyVersion, *, verify: bool = True) -> None:
    """Loads announced weights into `model` in place (dtype converted to the model's)."""
    from safetensors.torch import load_file

    path = Path(pv.uri)
    if verify:
        digest = file_sha256(path)
        if digest != pv.sha256:
            raise ValueError(f"weights {path}: sha256 {digest[:12]}... does not match the announcement {pv.sha256[:12]}...")
    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    if unexpected:
        raise ValueError(f"weights {path}: unexpected tensors {sorted(unexpected)[:5]}")
    kept = set(export_state_dict_names(model))
    real_missing = [m for m in missing if m in kept]
    if real_missing:
        raise ValueError(f"weights {path}: missing tensors {sorted(real_missing)[:5]}")


def export_state_dict_names(model: torch.nn.Module) -> list[str]:
    """The names `export_state_dict` keeps (without copying anything)."""
    aliases, seen = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return [k for k in model.state_dict() if k not in aliases]
