"""The alarms of a run in `eopd report` (learner/alarms.py): per run, each alarm that fired, at
which iterations and its last message, and the reason of a stop by `train.stop_on`."""

from __future__ import annotations

import html
import json
from pathlib import Path

from .run_files import run_label


def run_alarms(run_dir: Path) -> tuple[dict[str, list[tuple[int, str]]], str | None]:
    """`({alarm: [(iteration, message), ...]}, stop reason or None)` from `train_metrics.jsonl`."""
    path = Path(run_dir) / "train_metrics.jsonl"
    fired: dict[str, list[tuple[int, str]]] = {}
    stopped = None
    if not path.is_file():
        return fired, stopped
    for rec in map(json.loads, path.read_text().splitlines()):
        if rec.get("kind") == "stop":
            stopped = str(rec.get("reason", ""))
        elif rec.get("kind") == "iteration":
            for name, message in rec.get("alarms", {}).items():
                fired.setdefault(name, []).append((int(rec.get("iteration", 0)), str(message)))
    return fired, stopped


def _iterations(its: list[int]) -> str:
    return ", ".join(map(str, its)) if len(its) <= 6 else f"{its[0]}-{its[-1]} ({len(its)} iterations)"


def alarms_section(runs: list[Path]) -> str:
    """The report's "Alarms" section (HTML); says so when no alarm fired."""
    rows = []
    for run in runs:
        fired, stopped = run_alarms(run)
        for name, hits in fired.items():
            rows.append(f"<tr><td class='text'>{html.escape(run_label(run))}</td><td class='text'>{html.escape(name)}"
                        f"</td><td class='text'>{_iterations([i for i, _ in hits])}</td>"
                        f"<td class='text'>{html.escape(hits[-1][1])}</td></tr>")
        if stopped:
            rows.append(f"<tr><td class='text'>{html.escape(run_label(run))}</td><td class='text'>stopped</td>"
                        f"<td></td><td class='text'>{html.escape(stopped)}</td></tr>")
    head = ("<h2>Alarms</h2><p>A divergence below zero, the student's entropy outside [H_te/2 - 0.5, 2 H_te + 1] "
            "nats, half the responses or more at the length limit (learner/alarms.py); train.stop_on stops a run on "
            "the ones it lists.</p>")
    if not rows:
        return head + "<p>No alarm fired.</p>"
    return (head + "<table><tr><th>run</th><th>alarm</th><th>iterations</th><th>last message</th></tr>"
            + "".join(rows) + "</table>")
