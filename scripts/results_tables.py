"""docs/results.md's tables that are laid out from the archived runs, written between their markers;
`--check` writes nothing and fails (exit 1) when one differs from what the archives say now.

    python -m scripts.results_tables [--check]

The numbers come from `experiment_table.run_facts` (eval.json, eval-variants.json, run.yaml,
train_metrics.jsonl, run_summary.json of each run under docs/results/runs*/); this file only lays them
out as the document shows them: the losses named and ordered as in the text, the initial student's
row from the run that evaluated it, differences in points with a true minus sign, and bold where the
text says what bold means (next to each table). `experiment_table` and `experiment_seeds` print the
same numbers in their generic layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from eopd_trainer.eval.experiment_seeds import first_quarter_mean
from eopd_trainer.eval.experiment_table import quarter_mean, read_facts
from eopd_trainer.eval.run_files import read_eval, read_iterations

from scripts.doc_blocks import sync

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results.md"
RUNS = ROOT / "docs" / "results" / "runs"
RUNS_FAR = ROOT / "docs" / "results" / "runs-far"
COMMAND = "python -m scripts.results_tables"
#: How the document names each loss (experiment_table's labels), in the order its far-student tables list them.
FAR_LOSSES = {"eopd": "EOPD", "opd": "OPD", "gkd0.5": "GKD λ 0.5", "gkd1.0": "GKD λ 1.0", "kd": "KD", "full_fkl": "full_fkl"}
MINUS = "−"


def _f(value: float | None, pattern: str = "{:.3f}") -> str:
    return "–" if value is None else pattern.format(value)


def _signed(text: str) -> str:
    return text.replace("-", MINUS)


def _points(x: float) -> str:
    """A difference of two accuracies in points, signed, with a true minus and no "−0.0"."""
    text = f"{100 * x + 0.0:+.1f}"
    return "+0.0" if text == "-0.0" else _signed(text)


def _final(fact: dict, set_name: str = "held-out") -> dict:
    return fact["sets"].get(set_name, {}).get("final") or {}


def _n(facts: list[dict]) -> int:
    """The answers per problem: the largest k of any held-out Pass@k."""
    return max(int(k.split("@")[1]) for f in facts for m in f["sets"].get("held-out", {}).values()
               for k in m if k.startswith("pass@"))


def _groups(facts: list[dict], names: dict[str, str]) -> list[tuple[str, list[dict]]]:
    """(the document's name, the loss's runs in seed order) in `names`' order; KeyError for a missing loss."""
    by: dict[str, list[dict]] = {}
    for f in sorted(facts, key=lambda f: f["seed"]):
        by.setdefault(f["variant"], []).append(f)
    missing = [v for v in names if v not in by]
    if missing:
        raise KeyError(f"no archived runs of {', '.join(missing)}")
    return [(label, by[variant]) for variant, label in names.items()]


def _initial(facts: list[dict]) -> tuple[dict, dict]:
    """The initial student's held-out and variants rows, from the one run that evaluated it."""
    runs = [f for f in facts if "initial" in f["sets"].get("held-out", {})]
    if len(runs) != 1:
        raise ValueError(f"expected one run that evaluated the initial student, found {len(runs)}")
    return runs[0]["sets"]["held-out"]["initial"], runs[0]["sets"].get("variants", {}).get("initial", {})


def _mean(values: list[float]) -> float:
    """The mean, rounded to 9 digits so that a mean that is exact in counts prints as such: the variants
    set's 0.003125, 0.01875 and 0.015625 (1, 6 and 5 of 320 answers) average to 0.0125 exactly, which
    float addition makes 0.012499999999999999 and "{:.3f}" would print as 0.012."""
    return round(statistics.fmean(values), 9)


def _range(values: list[float], pattern: str = "{:.3f}") -> str:
    """Mean (min-max), as the far-student tables write it."""
    return f"{pattern.format(_mean(values))} ({pattern.format(min(values))}-{pattern.format(max(values))})"


def far_per_run(facts: list[dict]) -> str:
    n, tau = _n(facts), _tau(facts)
    seeds = " / ".join(str(f["seed"]) for f in _groups(facts, FAR_LOSSES)[0][1])
    held, variants = _initial(facts)
    lines = [f"| loss | seeds {seeds}: Avg@{n} | Pass@{n} | variants Avg@{n} | FKL(H_T ≥ {tau}) | tokens with H ≥ 1 "
             "| training (s) |", "|---|---|---|---|---|---|---|",
             f"| initial student | {_f(held['avg'])} | {_f(held[f'pass@{n}'])} | {_f(variants.get('avg'))} "
             f"| {_f(held['fkl_high'], '{:.2f}')} | {_f(held['h1_student'], '{:.0%}')} | |"]
    for label, runs in _groups(facts, FAR_LOSSES):
        def cells(key: str, set_name: str = "held-out", pattern: str = "{:.3f}") -> str:
            return " / ".join(_f(_final(f, set_name).get(key), pattern) for f in runs)
        times = [f["train_s"] for f in runs]
        lines.append(f"| {label} | {cells('avg')} | {cells(f'pass@{n}')} | {cells('avg', 'variants')} "
                     f"| {cells('fkl_high', pattern='{:.2f}')} | {cells('h1_student', pattern='{:.0%}')} "
                     f"| {min(times):.0f}-{max(times):.0f} |")
    return "\n".join(lines) + "\n"


def far_means(facts: list[dict]) -> str:
    """Mean (min-max) over seeds; bold: the held-out columns, the table's headline."""
    n, tau = _n(facts), _tau(facts)
    held, variants = _initial(facts)
    lines = [f"| loss | Avg@{n} | Pass@{n} | variants Avg@{n} | variants Pass@{n} | FKL(H_T ≥ {tau}) | tokens with H ≥ 1 |",
             "|---|---|---|---|---|---|---|",
             f"| initial student | {_f(held['avg'])} | {_f(held[f'pass@{n}'])} | {_f(variants.get('avg'))} "
             f"| {_f(variants.get(f'pass@{n}'))} | {_f(held['fkl_high'], '{:.2f}')} | {_f(held['h1_student'], '{:.0%}')} |"]
    for label, runs in _groups(facts, FAR_LOSSES):
        def col(key: str, set_name: str = "held-out", pattern: str = "{:.3f}") -> str:
            return _range([_final(f, set_name)[key] for f in runs], pattern)
        avg, pass_n = col("avg"), col(f"pass@{n}")
        avg, pass_n = (f"**{c.split(' ')[0]}** {c.split(' ', 1)[1]}" for c in (avg, pass_n))
        lines.append(f"| {label} | {avg} | {pass_n} | {col('avg', 'variants')} | {col(f'pass@{n}', 'variants')} "
                     f"| {col('fkl_high', pattern='{:.2f}')} | {col('h1_student', pattern='{:.0%}')} |")
    return "\n".join(lines) + "\n"


def far_paired(facts: list[dict]) -> str:
    """EOPD minus OPD, then every other loss minus EOPD, paired by seed, in points: the mean (bold
    where the loss is ahead in every seed), then each seed's difference in seed order."""
    n = _n(facts)
    groups = dict(_groups(facts, FAR_LOSSES))
    pairs = [("EOPD", "OPD")] + [(label, "EOPD") for label in groups if label not in ("EOPD", "OPD")]
    columns = [("held-out", "avg"), ("held-out", f"pass@{n}"), ("variants", "avg"), ("variants", f"pass@{n}")]
    lines = [f"| difference | held-out Avg@{n} | held-out Pass@{n} | variants Avg@{n} | variants Pass@{n} |",
             "|---|---|---|---|---|"]
    for a, b in pairs:
        ref = {f["seed"]: f for f in groups[b]}
        cells = []
        for set_name, key in columns:
            diffs = [_final(f, set_name)[key] - _final(ref[f["seed"]], set_name)[key] for f in groups[a]]
            mean = _points(_mean(diffs))
            cells.append(f"{f'**{mean}**' if all(d > 0 for d in diffs) else mean} ({', '.join(map(_points, diffs))})")
        lines.append(f"| {a} {MINUS} {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def far_training(facts: list[dict]) -> str:
    """Each seed's first-quarter -> last-quarter means; bold: an FKL at high-entropy positions that rose."""
    groups = _groups(facts, FAR_LOSSES)
    seeds = " / ".join(str(f["seed"]) for f in groups[0][1])
    lines = [f"| loss, seeds {seeds} | student entropy | FKL at high-entropy positions | gate ratio (last quarter) "
             "| teacher entropy on the trained tokens (last quarter) |", "|---|---|---|---|---|"]
    for label, runs in groups:
        rows = [read_iterations(Path(f["run"])) for f in runs]

        def moved(key: str, bold_rise: bool = False) -> str:
            cells = []
            for r in rows:
                first, last = first_quarter_mean(r, key), quarter_mean(r, key)
                end = _f(last, "{:.2f}")
                cells.append(f"{_f(first, '{:.2f}')}→{f'**{end}**' if bold_rise and last > first else end}")
            return " / ".join(cells)

        def last(key: str) -> str:
            return " / ".join(_f(quarter_mean(r, key), "{:.2f}") for r in rows)
        lines.append(f"| {label} | {moved('student_entropy')} | {moved('fkl_gated_mean', bold_rise=True)} "
                     f"| {last('gate_ratio')} | {last('teacher_entropy')} |")
    return "\n".join(lines) + "\n"


def _tau(facts: list[dict]) -> str:
    """The evaluation's high-entropy threshold, as the tables print it (e.g. 0.8)."""
    taus = {read_eval(Path(f["run"]))["models"]["final"].get("high_entropy_threshold") for f in facts}
    if len(taus) != 1:
        raise ValueError(f"runs evaluated with different high-entropy thresholds: {sorted(map(str, taus))}")
    return f"{taus.pop():g}"


def blocks() -> dict[str, str]:
    """Every generated block of docs/results.md, by name, from the archived runs."""
    far = read_facts(sorted(RUNS_FAR.iterdir()))
    if far is None:
        raise FileNotFoundError(f"{RUNS_FAR}: a run directory without run.yaml")
    return {"far-per-run": far_per_run(far), "far-means": far_means(far), "far-paired": far_paired(far),
            "far-training": far_training(far)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description="Lay out docs/results.md's tables from the archived runs.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is out of date")
    args = p.parse_args(argv)
    stale = sync(DOC, blocks(), COMMAND, check=args.check)
    if stale and args.check:
        print(f"docs/results.md: {', '.join(stale)} differ from the archived runs; run `{COMMAND}`", file=sys.stderr)
        return 1
    print(f"docs/results.md: {', '.join(stale) + ' rewritten' if stale else 'up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
