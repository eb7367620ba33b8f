"""`<run_dir>/run_summary.json`: what every invocation of `eopd run` on a run directory did.

    {"config": ".../run.yaml", "student_init": ..., "student_spec": ...,
     "queue": ..., "queue_backend": ...,            the latest invocation's queue
     "train_s", "eval_s", "total_s", "supervisor_cpu_s":   sums over the invocations
     "invocations": [{"started", "ended", "mode": "new" | "resume", "resumed_at": {iteration,
                      policy_version, optimizer_steps} | null, "queue", "queue_backend", "queue_state",
                      "iterations": [first, last] trained by it, "evaluated": [models], "train_s",
                      "eval_s", "total_s", "supervisor_cpu_s", "outcome"}, ...],
     "evaluation": {"models": {name: {"model": path or spec, "settings": {eval...}, "invocation": i}}}}

The file is rewritten (atomically) when an invocation starts, at every iteration it sees trained,
after every model it evaluates and when it ends, so an invocation that was killed keeps what it
did up to then; the next one marks it `killed` (no exit recorded). `evaluation` is how a resumed
run knows which models are evaluated already: a model is evaluated again only if its resolved
model or the `eval` settings changed (a longer run's `final`, say).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eopd_common.atomic_files import write_atomic

SUMMARY_NAME = "run_summary.json"
SUMMED = ("train_s", "eval_s", "total_s", "supervisor_cpu_s")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunRecord:
    def __init__(self, run_dir: Path, *, keep: bool):
        self.path = Path(run_dir) / SUMMARY_NAME
        data: dict[str, Any] = {}
        if keep and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except ValueError:
                data = {}
        if "invocations" not in data:  # a summary from before invocations were recorded: keep it as the first
            data = {"invocations": [dict(data, outcome=data.get("outcome", "completed"))] if data else []}
        self.data = data
        self.current: dict[str, Any] = {}

    def begin(self, *, mode: str, facts: dict, config: Path, resumed_at: dict | None) -> dict[str, Any]:
        for inv in self.data["invocations"]:
            if inv.get("outcome") == "running":
                inv["outcome"] = "killed (no exit recorded)"
        self.data.update(facts, config=str(config))
        self.current = {"started": _now(), "ended": None, "mode": mode, "resumed_at": resumed_at, "outcome": "running"}
        self.data["invocations"].append(self.current)
        self.save()
        return self.current

    def save(self) -> None:
        d = self.data
        for key in SUMMED:
            if isinstance(self.current.get(key), float):
                self.current[key] = round(self.current[key], 3)
        for key in SUMMED:
            values = [inv[key] for inv in d["invocations"] if isinstance(inv.get(key), (int, float))]
            if values:
                d[key] = round(sum(values), 3)
        if self.current.get("queue"):
            d["queue"], d["queue_backend"] = self.current["queue"], self.current.get("queue_backend")
        write_atomic(self.path, json.dumps(d, indent=2, default=str))

    def trained(self, iteration: int, train_s: float) -> None:
        first = (self.current.get("iterations") or [iteration])[0]
        self.current.update(iterations=[first, iteration], train_s=round(train_s, 3))
        self.save()

    def end(self, outcome: str, total_s: float) -> None:
        self.current.update(outcome=outcome, ended=_now(), total_s=round(total_s, 3))
        self.save()

    # Evaluation ------------------------------------------------------------------------------
    def to_evaluate(self, models: list[str], resolved: dict[str, str], settings: dict) -> list[str]:
        """The models whose evaluation in this run is missing or stale (another model behind the
        name, other eval settings)."""
        done = self.data.get("evaluation", {}).get("models", {})
        return [m for m in models if done.get(m, {}).get("model") != resolved[m] or done[m].get("settings") != settings]

    def evaluated(self, name: str, model: str, settings: dict) -> None:
        index = len(self.data["invocations"]) - 1
        self.data.setdefault("evaluation", {}).setdefault("models", {})[name] = {
            "model": model, "settings": settings, "invocation": index}
        self.current.setdefault("evaluated", []).append(name)
        self.save()
