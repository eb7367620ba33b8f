"""Learner checkpoints: DeepSpeed state + a Hugging Face export + the trainer state (ledger).

Layout under `<run_dir>/checkpoints/`:

    iter000004/                      one DeepSpeed tag per committed iteration
        mp_rank_00_model_states.pt   (DeepSpeed's own files: module, optimizer, scheduler)
        ...
        hf/                          save_pretrained export of the student (+ tokenizer)
        rng_state_rank<R>.json       each rank's random generators (python, numpy, torch, CUDA)
        trainer_state.json           `LearnerState` (state.py): iteration, policy version, ledger of
                                     trained rollout ids, stream entry ids of the iteration, counters,
                                     tasks published, the iteration's metric records; schema_version
    COMMITTED                        the tag of the newest *complete* checkpoint

Commit protocol: every rank writes its DeepSpeed shard (`save_latest=False`), a barrier, then
rank 0 writes the HF export and `trainer_state.json`, fsyncs them and atomically replaces
`COMMITTED`. A crash at any point before that rename leaves the previous checkpoint committed;
resume always loads the tag named by `COMMITTED` (never DeepSpeed's own `latest`). Only after the
commit does the learner acknowledge the iteration's stream entries.

DeepSpeed's checkpoint holds the module, optimizer and scheduler but not the random generators;
each rank writes its own (JSON, base64) and `load` restores them, so what draws from them after a
resume (dropout, anything seeded once at start) continues as if the run had not stopped.

Our own state is JSON; DeepSpeed's files are torch.save archives written and read only by this
learner on its own disk (they never cross a trust boundary).
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from eopd_common.atomic_files import write_atomic

from ..faults import InjectedFault
from .committed import POINTER, STATE_FILE, committed_tag, read_state, tag_for
from .state import LearnerState

log = logging.getLogger(__name__)

def rng_state() -> dict[str, Any]:
    """This process's random generators as JSON-able data (no pickle)."""
    def b64(t) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    return {"python": [version, list(internal), py_gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "torch": b64(torch.get_rng_state()),
            "cuda": [b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}


def set_rng_state(state: dict[str, Any]) -> None:
    def tensor(s: str):
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(tensor(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


def rng_file(ckpt_dir: Path, tag: str, rank: int) -> Path:
    return Path(ckpt_dir) / tag / f"rng_state_rank{rank}.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. no space left); the previous one is still committed."""


class CheckpointManager:
    def __init__(self, ckpt_dir: Path, *, keep: int, export_hf: bool, rank: int, barrier, faults=None):
        self.faults = faults  # eopd_trainer.faults.Faults: point `checkpoint.write` (see save)
        self.dir = Path(ckpt_dir)
        self.keep = keep
        self.export_hf = export_hf
        self.rank = rank
        self.barrier = barrier
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    def latest(self) -> str | None:
        return committed_tag(self.dir)

    def load(self, engine) -> LearnerState | None:
        """Loads the committed checkpoint into the engine; returns its trainer state (or None)."""
        tag = self.latest()
        if tag is None:
            return None
        path, _ = engine.load_checkpoint(str(self.dir), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.dir / tag}")
        state = read_state(self.dir, tag)
        rng = rng_file(self.dir, tag, self.rank)
        if rng.is_file():  # absent in checkpoints from before they were saved
            set_rng_state(json.loads(rng.read_text()))
        log.info("resumed from %s (iteration %s)", self.dir / tag, state.iteration)
        return state

    def save(self, engine, iteration: int, state: LearnerState, *, export_fn=None) -> Path:
        """Saves and commits a checkpoint (every rank calls this). `export_fn(path)` writes the
        HF export on rank 0 (after parameters are gathered where needed).

        A failed write (a full disk, an I/O error) raises `CheckpointError` naming the cause; the
        partial directory is removed and the previously committed checkpoint stays committed."""
        tag = tag_for(iteration)
        target = self.dir / tag
        if self.rank == 0 and target.exists():  # a crashed, uncommitted attempt at this tag
            shutil.rmtree(target)
        self.barrier()
        try:
            engine.save_checkpoint(str(self.dir), tag=tag, save_latest=False)
            write_atomic(rng_file(self.dir, tag, self.rank), json.dumps(rng_state()))
            if self.faults is not None:  # fault point: the disk fills up with the shards half written
                try:
                    self.faults.hit("checkpoint.write", iteration=iteration)
                except InjectedFault as exc:
                    raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({exc})", str(target)) from exc
            if export_fn is not None and self.export_hf:
                export_fn(target / "hf")
        except (OSError, RuntimeError) as exc:
            self._failed(target, exc)
        self.barrier()
        if self.rank == 0:
            try:
                write_atomic(target / STATE_FILE, json.dumps(state.to_json(), indent=1, sort_keys=True))
                write_atomic(self.dir / POINTER, tag + "\n")
            except OSError as exc:
                self._failed(target, exc)
            self._prune(keep_tag=tag)
        self.barrier()
        return target

    def _failed(self, target: Path, exc: BaseException) -> None:
        previous = self.latest()
        detail = str(exc)
        try:  # torch.save reports a full disk as "unexpected pos ..."; say what it is
            usage = shutil.disk_usage(self.dir)
            full = getattr(exc, "errno", None) == errno.ENOSPC or usage.free < max(64 << 20, usage.total // 100)
            if full:
                detail += f" (No space left on device: {usage.free / 2**20:.1f} MiB free on {self.dir})"
        except OSError:
            pass
        if self.rank == 0:
            shutil.rmtree(target, ignore_errors=True)  # frees the space; never the committed tag
            for tmp in self.dir.glob(POINTER + ".tmp*"):
                tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"writing checkpoint {target} failed: {detail}; the last committed checkpoint "
            f"({self.dir / previous if previous else 'none'}) is intact and is what a restart resumes from"
        ) from exc

    def _prune(self, keep_tag: str) -> None:
        tags = sorted(p.name for p in self.dir.iterdir() if p.is_dir() and p.name.startswith("iter"))
        for tag in tags[: -self.keep]:
            if tag != keep_tag:
                shutil.rmtree(self.dir / tag, ignore_errors=True)
