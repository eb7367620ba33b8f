"""The per-seed tables of docs/results.md: each loss's final students seed by seed, each pair of
losses' differences seed by seed, and each run's training from its first quarter of iterations to
its last. `experiment_table` gives the mean and range over seeds; this shows the seeds themselves,
so that "ahead in every seed" can be read off.

    python -m eopd_trainer.eval.experiment_seeds docs/results/runs-far/* [--paired eopd --paired opd]

Columns of the per-run table: held-out Avg@n and Pass@n (n = the evaluation's answers per
problem), the variants set's Avg@n (where evaluated), FKL at teacher entropy >= tau and the share
of tokens with entropy >= 1 (on the final student's own held-out answers), training seconds
(`run_summary.json`, min-max). Paired table, in points: mean over the seeds both losses ran, then
each seed's difference in seed order; bold where the loss is ahead in every seed. Training table:
the student's entropy and the FKL at high-entropy positions (`iter/student_entropy`,
`iter/fkl_gated_mean`), first quarter's mean -> last quarter's, and the gate ratio and teacher
entropy on the trained tokens over the last quarter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from .experiment_table import quarter_mean, read_facts
from .run_files import read_iterations


def first_quarter_mean(rows: list[dict], key: str) -> float | None:
    """Mean of `iter/<key>` over the first quarter of the iteration records `rows` that have it."""
    values = [r[f"iter/{key}"] for r in rows if f"iter/{key}" in r]
    if not values:
        return None
    head = values[:max(1, len(values) // 4)]
    return sum(head) / len(head)


def _n(facts: list[dict]) -> int:
    """The answers per problem: the largest k of any held-out Pass@k."""
    return max((int(k.split("@")[1]) for f in facts for m in f["sets"].get("held-out", {}).values()
                for k in m if k.startswith("pass@")), default=1)


def _final(fact: dict, set_name: str = "held-out") -> dict:
    return fact["sets"].get(set_name, {}).get("final") or {}


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "–" if value is None else pattern.format(value)


def _by_variant(facts: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for f in sorted(facts, key=lambda f: (f["seed"] is None, f["seed"])):
        groups.setdefault(f["variant"], []).append(f)
    return groups


def per_run_table(facts: list[dict]) -> list[str]:
    """One row per loss, each cell its runs' values in seed order (`a / b / c`)."""
    groups, n = _by_variant(facts), _n(facts)
    seeds = sorted({f["seed"] for f in facts if f["seed"] is not None})
    out = [f"| loss | seeds {' / '.join(map(str, seeds))}: Avg@{n} | Pass@{n} | variants Avg@{n} | FKL(H_T ≥ τ) "
           "| tokens with H ≥ 1 | training (s) |", "|---|---|---|---|---|---|---|"]
    for variant, runs in groups.items():
        def cells(key, set_name="held-out", pattern="{:.3f}"):
            return " / ".join(_fmt(_final(f, set_name).get(key), pattern) for f in runs)
        times = [f["train_s"] for f in runs if f.get("train_s") is not None]
        took = "–" if not times else f"{min(times):.0f}" if len(times) == 1 else f"{min(times):.0f}-{max(times):.0f}"
        out.append(f"| {variant} | {cells('avg')} | {cells(f'pass@{n}')} | {cells('avg', 'variants')} "
                   f"| {cells('fkl_high', pattern='{:.2f}')} | {cells('h1_student', pattern='{:.0%}')} | {took} |")
    return out + [""]


def _points(diffs: list[float]) -> str:
    """Mean, then each seed's difference, in points; bold where every seed is ahead."""
    def pt(x: float) -> str:
        return f"{100 * x + 0.0:+.1f}".replace("-0.0", "+0.0")  # no "-0.0" from rounding

    text = f"{pt(statistics.fmean(diffs))} ({', '.join(pt(d) for d in diffs)})"
    return f"**{text}**" if all(d > 0 for d in diffs) else text


def paired_table(facts: list[dict], reference: str) -> list[str]:
    """Each loss's final student minus `reference`'s on the same seed, in points, on the held-out and
    the variants sets (Avg@n, Pass@n)."""
    groups, n = _by_variant(facts), _n(facts)
    if reference not in groups:
        return []
    ref = {f["seed"]: f for f in groups[reference]}
    columns = [("held-out", "avg"), ("held-out", f"pass@{n}"), ("variants", "avg"), ("variants", f"pass@{n}")]
    rows = []
    for variant, runs in groups.items():
        pairs = [(f, ref[f["seed"]]) for f in runs if f["seed"] in ref]
        if variant == reference or not pairs:
            continue
        cells = []
        for set_name, key in columns:
            diffs = [_final(a, set_name).get(key) - _final(b, set_name).get(key) for a, b in pairs
                     if _final(a, set_name).get(key) is not None and _final(b, set_name).get(key) is not None]
            cells.append(_points(diffs) if diffs else "–")
        rows.append(f"| {variant} − {reference} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ([f"| difference (mean, then by seed) | held-out Avg@{n} | held-out Pass@{n} | variants Avg@{n} "
             f"| variants Pass@{n} |", "|---|---|---|---|---|"] + rows + [""])


def training_table(facts: list[dict]) -> list[str]:
    """Per loss, each seed's first-quarter -> last-quarter means over the run's iterations."""
    groups = _by_variant(facts)
    seeds = sorted({f["seed"] for f in facts if f["seed"] is not None})
    out = [f"| loss, seeds {' / '.join(map(str, seeds))} | student entropy | FKL at high-entropy positions "
           "| gate ratio (last quarter) | teacher entropy on the trained tokens (last quarter) |",
           "|---|---|---|---|---|"]
    for variant, runs in groups.items():
        rows = [read_iterations(Path(f["run"])) for f in runs]

        def moved(key):
            return " / ".join(f"{_fmt(first_quarter_mean(r, key), '{:.2f}')}→{_fmt(quarter_mean(r, key), '{:.2f}')}"
                              for r in rows)

        def last(key):
            return " / ".join(_fmt(quarter_mean(r, key), "{:.2f}") for r in rows)
        out.append(f"| {variant} | {moved('student_entropy')} | {moved('fkl_gated_mean')} | {last('gate_ratio')} "
                   f"| {last('teacher_entropy')} |")
    return out + [""]


def tables(facts: list[dict], paired: tuple[str, ...] = ("opd",)) -> str:
    out = ["### per run: final students, seed by seed\n", *per_run_table(facts)]
    for reference in paired:
        table = paired_table(facts, reference)
        if table:
            out += [f"### paired by seed: final student minus {reference}'s, in points\n", *table]
    out += ["### training: first quarter of iterations → last, seed by seed\n", *training_table(facts)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eopd_trainer.eval.experiment_seeds",
                                description="Markdown tables of finished runs, seed by seed.")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--paired", action="append", default=None, metavar="VARIANT",
                   help="tabulate each loss minus this one, seed by seed (repeatable; default opd)")
    args = p.parse_args(argv)
    facts = read_facts(args.runs)
    if facts is None:
        return 2
    paired = tuple(args.paired or ["opd"])
    unknown = sorted(set(paired) - {f["variant"] for f in facts})
    for name in unknown:
        print(f"--paired {name}: no run of that variant here; no table for it", file=sys.stderr)
    print(tables(facts, paired), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
