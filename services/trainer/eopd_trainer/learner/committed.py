"""The committed checkpoint, read and pointed to without torch (`checkpoint.py` writes and loads the
DeepSpeed state): `COMMITTED` names the newest complete tag, whose `trainer_state.json` is the
learner's `LearnerState`. `eopd run`'s supervisor reads it to resume (job/resume.py) and never
imports torch for it."""

from __future__ import annotations

import json
from pathlib import Path

from .state import LearnerState

STATE_FILE = "trainer_state.json"
POINTER = "COMMITTED"


def tag_for(iteration: int) -> str:
    return f"iter{iteration:06d}"


def committed_tag(ckpt_dir: Path) -> str | None:
    p = Path(ckpt_dir) / POINTER
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    return tag or None


def read_state(ckpt_dir: Path, tag: str | None = None) -> LearnerState | None:
    """The trainer state of the committed (or given) checkpoint, or None if there is none."""
    tag = tag or committed_tag(ckpt_dir)
    if tag is None:
        return None
    return LearnerState.from_json(json.loads((Path(ckpt_dir) / tag / STATE_FILE).read_text()))
