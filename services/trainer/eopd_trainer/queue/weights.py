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
import stat
from pathlib import Path

import torch
from eopd_common.atomic_files import fsync_dir
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .messages import PolicyVersion, now_ns

log = logging.getLogger(__name__)


def weights_path(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version:06d}.safetensors"


def file_sha256(path: Path, limit: int | None = None) -> str:
    """The file's sha256; with `limit`, at most `limit` bytes are read (a file that grew past the
    size checked before is never hashed for ever)."""
    h = hashlib.sha256()
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            chunk = fh.read(1 << 20 if left is None else min(1 << 20, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as standalone contiguous CPU tensors, tied aliases dropped (the
    first name of a shared parameter is kept). DeepSpeed ZeRO 1-2 turn parameters into views
    of flat buffers, which safetensors refuses to save as they are."""
    keep = set(export_state_dict_names(model))
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items() if k in keep}


class WeightsDirUnsafe(RuntimeError):
    """A shared-memory weights directory another user could enter or own: nothing is published there."""


def ensure_private_dir(path: Path) -> Path:
    """Creates `path` owner-only (0700), or checks that an existing one is a directory (not a link)
    of this user that nobody else can enter; WeightsDirUnsafe naming the problem otherwise. For the
    shared-memory weights directory, whose name in /dev/shm (world-writable) another local user
    could take first."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise WeightsDirUnsafe(f"{path}: not a directory (a link or a file is in its place): refusing to publish weights there")
    if st.st_uid != os.getuid():
        raise WeightsDirUnsafe(f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()}): refusing to publish "
                               "weights there (remove it, or set weight_sync: disk)")
    if st.st_mode & 0o077:
        raise WeightsDirUnsafe(f"{path}: mode {stat.S_IMODE(st.st_mode):o}, others can enter it: refusing to publish "
                               "weights there (chmod 700 it, or remove it)")
    return path


def save_weights(model: torch.nn.Module, weights_dir: Path, version: int, iteration: int) -> PolicyVersion:
    """Writes the model's weights atomically; returns the announcement to publish."""
    weights_dir = Path(weights_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    final = weights_path(weights_dir, version)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    save_file(export_state_dict(model), str(tmp), metadata={"version": str(version), "iteration": str(iteration)})
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(weights_dir)
    return PolicyVersion(version=version, uri=str(final.resolve()), sha256=file_sha256(final),
                         num_bytes=final.stat().st_size, iteration=iteration, created_unix_ns=now_ns())


def prune_weights(weights_dir: Path, keep: int, protect: int) -> None:
    """Deletes all but the newest `keep` versions (never `protect`, the announced one)."""
    files = sorted(Path(weights_dir).glob("v*.safetensors"))
    for f in files[:-keep]:
        if f != weights_path(weights_dir, protect):
            with contextlib.suppress(OSError):
                f.unlink()


class WeightsUnavailable(ValueError):
    """An announced version cannot be read right now: its file is missing (pruned, not yet visible
    on a shared file system), does not match the announced sha256 (rewritten by a learner that
    rolled back and re-announced, or damaged), changed while it was read, or is not a readable
    safetensors file. Transient from a worker's point of view: re-read the announcement, retry."""


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_weights_location(pv: PolicyVersion, weights_dir: Path) -> Path:
    """The announced file's real path, after checking that it lies inside the run's `weights_dir`
    (symbolic links and `..` resolved): an announcement naming any other file (`/dev/zero`, a file
    of the attacker's, `<run_dir>/weights/../x`) is WeightsUnavailable, never opened."""
    real = Path(os.path.realpath(pv.uri))
    root = Path(os.path.realpath(weights_dir))
    if root not in real.parents:
        raise WeightsUnavailable(f"weights {pv.uri} (version {pv.version}): not inside the run's weights directory "
                                 f"{root} (resolves to {real})")
    return real


def verify_weights(pv: PolicyVersion, weights_dir: Path | None = None) -> tuple[Path, tuple[int, int, int, int]]:
    """The announced file's path and identity (device, inode, size, mtime) after checking, in this
    order, that it lies inside `weights_dir` (when given), is a regular file, has the announced
    size, and has the announced sha256 (reading at most that size); WeightsUnavailable when it is
    missing or differs. The size is checked before any byte is hashed: `uri=/dev/zero` or a
    huge file is refused at once."""
    path = check_weights_location(pv, weights_dir) if weights_dir is not None else Path(pv.uri)
    try:
        ident = _identity(path)
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise WeightsUnavailable(f"weights {path} (version {pv.version}): not a regular file")
        if ident[2] != pv.num_bytes:
            raise WeightsUnavailable(f"weights {path} (version {pv.version}): {ident[2]} bytes, the announcement says "
                                     f"{pv.num_bytes}")
        digest = file_sha256(path, limit=pv.num_bytes)
    except FileNotFoundError:
        raise WeightsUnavailable(f"weights {path} (version {pv.version}): file not found (pruned or not yet visible)") from None
    except OSError as exc:
        raise WeightsUnavailable(f"weights {path} (version {pv.version}): cannot read: {exc.strerror or exc}") from None
    if digest != pv.sha256:
        raise WeightsUnavailable(f"weights {path} (version {pv.version}): sha256 {digest[:12]}... does not match the "
                                 f"announcement {pv.sha256[:12]}...")
    return path, ident


def read_weights(pv: PolicyVersion, *, verify: bool = True, weights_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The announced tensors, read once: sha256 verified first (unless `verify=False`, when the
    caller verified it), and the file's identity checked again after reading, so a file replaced
    between the check and the read (a re-announced version number) is never loaded unverified."""
    path = Path(pv.uri)
    if verify:
        path, ident = verify_weights(pv, weights_dir)
    else:
        try:
            ident = _identity(path)
        except OSError as exc:
            raise WeightsUnavailable(f"weights {path} (version {pv.version}): {exc.strerror or exc}") from None
    try:
        tensors = load_file(str(path))
        changed = _identity(path) != ident
    except FileNotFoundError:
        changed = True
    except (SafetensorError, OSError) as exc:
        raise WeightsUnavailable(f"weights {path} (version {pv.version}): not a readable safetensors file: {exc}") from None
    if changed:
        raise WeightsUnavailable(f"weights {path} (version {pv.version}): the file changed while it was read")
    return tensors


def load_weights(model: torch.nn.Module, pv: PolicyVersion, *, verify: bool = True,
                 weights_dir: Path | None = None) -> None:
    """Loads an announced weights file into `model` in place (dtype converted to the model's). The
    model is left untouched when anything is wrong: WeightsUnavailable for a file that cannot be
    read right now (retry), ValueError for tensors that are not the model's. (Any announced format:
    `queue/policy_load.load_policy`.)"""
    load_tensors(model, read_weights(pv, verify=verify, weights_dir=weights_dir), pv.uri)


def load_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Loads `tensors` (what export_state_dict exported) into `model` in place, dtypes converted;
    ValueError, the model untouched, when names or shapes are not the model's."""
    check_tensors(model, tensors, where)
    model.load_state_dict(tensors, strict=False)


def check_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """ValueError unless `tensors` are exactly what export_state_dict exports of `model` (names and
    shapes; dtypes may differ)."""
    own = set(model.state_dict())
    unexpected = sorted(set(tensors) - own)
    if unexpected:
        raise ValueError(f"weights {where}: unexpected tensors {unexpected[:5]}")
    missing = sorted(set(export_state_dict_names(model)) - set(tensors))
    if missing:
        raise ValueError(f"weights {where}: missing tensors {missing[:5]}")
    state = model.state_dict()
    wrong = [f"{k} {tuple(t.shape)} (the model's {tuple(state[k].shape)})" for k, t in tensors.items() if t.shape != state[k].shape]
    if wrong:
        raise ValueError(f"weights {where}: size mismatch: {', '.join(wrong[:3])}")


def export_state_dict_names(model: torch.nn.Module) -> list[str]:
    """The names `export_state_dict` keeps (without copying anything)."""
    aliases, seen = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return [k for k in model.state_dict() if k not in aliases]
