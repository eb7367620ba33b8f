"""Reading a run directory for the reports (`eopd report`, the experiment table and figures): the
learner's iteration records (`train_metrics.jsonl`), the evaluations (`eval.json`,
`eval-<set>.json`), the loss variant of `run.yaml`, and the order models are shown in. Every
missing file reads as empty, so older runs render."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

#: Column order of the side-by-side sample table; other evaluated models follow.
SAMPLE_MODELS = ("teacher", "initial", "final")


def read_iterations(run_dir: Path) -> list[dict]:
    """The learner's iteration records (`train_metrics.jsonl` rows of kind "iteration"), in order."""
    path = Path(run_dir) / "train_metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "iteration"]


def read_eval(run_dir: Path, set_name: str | None = None) -> dict:
    """`eval.json` (the run's held-out split) or `eval-<set_name>.json` (another set, e.g. the
    variants written differently)."""
    path = Path(run_dir) / ("eval.json" if set_name is None else f"eval-{set_name}.json")
    ev = json.loads(path.read_text()) if path.is_file() else {}
    ev.setdefault("models", {})
    return ev


def extra_sets(run_dir: Path) -> list[str]:
    """Names of the other evaluated sets of a run (`eval-<name>.json`), sorted."""
    return sorted(p.name[len("eval-"):-len(".json")] for p in Path(run_dir).glob("eval-*.json"))


def run_label(run_dir: Path) -> str:
    """How the reports name a run: its directory's name."""
    return Path(run_dir).name


def ordered_models(models: dict) -> list[tuple[str, dict]]:
    """The teacher, initial and final first, then the other models in eval.json order."""
    return sorted(models.items(), key=lambda kv: SAMPLE_MODELS.index(kv[0]) if kv[0] in SAMPLE_MODELS else 3)


def teacher_label(cfg: dict) -> str:
    """The teacher modifier of a run as scripts/experiment.sh names it, from its run.yaml (`cfg`):
    `+routed` (teachers routed on a record field), `+mixture` (a mixture of teachers), `+self` (the
    teacher is the student's own initial weights), `+privileged` (the teacher has its own prompt
    template); "" for the plain teacher."""
    route = cfg.get("route") or {}
    if route.get("mixture"):
        return "+mixture"
    if route.get("routes"):
        return "+routed"
    teacher, student = cfg.get("teacher") or {}, cfg.get("student") or {}
    if teacher.get("model") and teacher.get("model") == student.get("model"):
        return "+self"
    return "+privileged" if teacher.get("prompt_template") else ""


def loss_label(cfg: dict) -> str:
    """A run's loss as scripts/experiment.sh names it, from its run.yaml (`cfg`): `loss.variant`;
    GKD with its lambda (`gkd0.8`); the teacher modifier (`teacher_label`); `+warmupN` after N KD
    warm-up iterations."""
    loss = cfg.get("loss") or {}
    label = loss.get("variant", "?")
    if label == "gkd":
        label += str(loss.get("gkd_lambda", ""))
    label += teacher_label(cfg)
    warmup = (cfg.get("train") or {}).get("warmup_kd_iterations") or 0
    return f"{label}+warmup{warmup}" if warmup else label


def run_variant(run: Path) -> str:
    """The run's `loss.variant` from its run.yaml ("" when there is none)."""
    cfg_path = Path(run) / "run.yaml"
    if not cfg_path.is_file():
        return ""
    return ((yaml.safe_load(cfg_path.read_text()) or {}).get("loss") or {}).get("variant", "")
