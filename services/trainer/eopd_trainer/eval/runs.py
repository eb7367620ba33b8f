"""A run's evaluation files and the models its evaluation names, without torch: what `eopd run`'s
supervisor needs to plan and report an evaluation (`evaluate.py` computes one, and imports torch).

- `resolve_model`: `final`, `initial`, `teacher` or a model spec -> the model evaluated;
- `eval_path` / `EvalSet`: `<run_dir>/eval.json` for the held-out split, `eval-<set>.json` for another;
- `summary_line`: one line of a model's result;
- `run_config`: the run's validated config, from its run directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eopd_common.models import materialise_spec

from ..config import ConfigError, RunConfig, load_config
from ..learner.committed import POINTER, committed_tag


def summary_line(name: str, r: dict) -> str:
    """One line for a model's result: headline avg@n and pass@n, the other grading's avg@n, the
    high-entropy FKL and the reverse KL (keys missing from older eval.json files are skipped)."""
    n = r["n_samples"]
    head = r.get("headline", "strict")
    other = "flexible" if head == "strict" else "strict"
    line = f"{name}: avg@{n} {r['avg_at_k']:.3f} pass@{n} {r['pass_at_k'][str(n)]:.3f} ({head}"
    line += f"; {other} avg@{n} {r[other]['avg_at_k']:.3f})" if other in r else ")"
    if "fkl_high_entropy" in r:
        line += f" fkl(H_T>={r.get('high_entropy_threshold', float('nan'))}) {r['fkl_high_entropy']:.3f}"
    if "reverse_kl" in r:
        line += f" reverse KL {r['reverse_kl']:.3f}"
    if r.get("cache", {}).get("reused"):
        line += f" [reused from cache {r['cache']['key']}]"
    return line


def committed_export(run_dir: Path) -> Path:
    """The Hugging Face export of the run's committed checkpoint (the learner's commit pointer)."""
    tag = committed_tag(run_dir / "checkpoints")
    if tag is None:
        raise FileNotFoundError(f"{run_dir / 'checkpoints' / POINTER}: the run has no committed checkpoint")
    return run_dir / "checkpoints" / tag / "hf"


def resolve_model(name: str, run_dir: Path, cfg: RunConfig) -> str:
    """`final` (the last committed HF export), `initial` (the run's starting student), `teacher`,
    or any model spec (a layer-subset spec is built into <run_dir>/eval-models)."""
    if name == "final":
        return str(committed_export(run_dir))
    if name == "initial":
        return cfg.student.model
    if name == "teacher":
        if not cfg.teacher.model:
            raise ConfigError("teacher.model is not set")
        return cfg.teacher.model
    return materialise_spec(name, run_dir / "eval-models" / "".join(c if c.isalnum() else "_" for c in name))


def run_config(run_dir: Path, overrides: list[str] = ()) -> RunConfig:
    for name in ("run.yaml", "config.yaml"):
        if (run_dir / name).is_file():
            return load_config(run_dir / name, list(overrides))
    raise ConfigError(f"{run_dir}: no run.yaml (written by eopd run) or config.yaml")


def eval_path(run_dir: Path, set_name: str | None = None) -> Path:
    """`<run_dir>/eval.json` for the run's held-out split; `eval-<set>.json` for another set."""
    return Path(run_dir) / ("eval.json" if set_name is None else f"eval-{set_name}.json")


@dataclass(frozen=True)
class EvalSet:
    """A set evaluated: `name` None for the run's held-out split (`eval.json`), else `eval-<name>.json`."""

    name: str | None
    files: tuple[Path, ...]
