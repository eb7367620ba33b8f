"""How docs/results.md writes numbers (scripts/results_tables.py lays its tables out with these):
accuracies to 3 decimals, differences in points with a true minus sign, means exact in counts printed
as such, and the facts of `experiment_table.run_facts` looked up by loss and seed."""

from __future__ import annotations

import statistics
from pathlib import Path

from eopd_trainer.eval.run_files import read_eval

MINUS = "−"


def fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "–" if value is None else pattern.format(value)


def signed(text: str) -> str:
    return text.replace("-", MINUS)


def points(x: float) -> str:
    """A difference of two accuracies in points, signed, with a true minus and no "−0.0"."""
    text = f"{100 * x + 0.0:+.1f}"
    return "+0.0" if text == "-0.0" else signed(text)


def final_of(fact: dict, set_name: str = "held-out") -> dict:
    return fact["sets"].get(set_name, {}).get("final") or {}


def answers_per_problem(facts: list[dict]) -> int:
    """The answers per problem: the largest k of any held-out Pass@k."""
    return max(int(k.split("@")[1]) for f in facts for m in f["sets"].get("held-out", {}).values()
               for k in m if k.startswith("pass@"))


def losses_in_order(facts: list[dict], names: dict[str, str]) -> list[tuple[str, list[dict]]]:
    """(the document's name, the loss's runs in seed order) in `names`' order; KeyError for a missing loss."""
    by: dict[str, list[dict]] = {}
    for f in sorted(facts, key=lambda f: f["seed"]):
        by.setdefault(f["variant"], []).append(f)
    missing = [v for v in names if v not in by]
    if missing:
        raise KeyError(f"no archived runs of {', '.join(missing)}")
    return [(label, by[variant]) for variant, label in names.items()]


def initial_rows(facts: list[dict]) -> tuple[dict, dict]:
    """The initial student's held-out and variants rows, from the one run that evaluated it."""
    runs = [f for f in facts if "initial" in f["sets"].get("held-out", {})]
    if len(runs) != 1:
        raise ValueError(f"expected one run that evaluated the initial student, found {len(runs)}")
    return runs[0]["sets"]["held-out"]["initial"], runs[0]["sets"].get("variants", {}).get("initial", {})


def exact_mean(values: list[float]) -> float:
    """The mean, rounded to 9 digits so that a mean that is exact in counts prints as such: the variants
    set's 0.003125, 0.01875 and 0.015625 (1, 6 and 5 of 320 answers) average to 0.0125 exactly, which
    float addition makes 0.012499999999999999 and "{:.3f}" would print as 0.012."""
    return round(statistics.fmean(values), 9)


def mean_range(values: list[float], pattern: str = "{:.3f}") -> str:
    """Mean (min-max), as the far-student tables write it."""
    return f"{pattern.format(exact_mean(values))} ({pattern.format(min(values))}-{pattern.format(max(values))})"


def runs_by_seed(facts: list[dict], variant: str) -> dict[int, dict]:
    runs = {f["seed"]: f for f in facts if f["variant"] == variant}
    if not runs:
        raise KeyError(f"no archived runs of {variant}")
    return dict(sorted(runs.items()))


def points_span(values: list[float]) -> str:
    """Points, "(min to max)" with true minus signs."""
    return f"({points(min(values))} to {points(max(values))})"


def tau_of(facts: list[dict]) -> str:
    """The evaluation's high-entropy threshold, as the tables print it (e.g. 0.8)."""
    taus = {read_eval(Path(f["run"]))["models"]["final"].get("high_entropy_threshold") for f in facts}
    if len(taus) != 1:
        raise ValueError(f"runs evaluated with different high-entropy thresholds: {sorted(map(str, taus))}")
    return f"{taus.pop():g}"
