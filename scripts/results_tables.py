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


def _by_seed(facts: list[dict], variant: str) -> dict[int, dict]:
    runs = {f["seed"]: f for f in facts if f["variant"] == variant}
    if not runs:
        raise KeyError(f"no archived runs of {variant}")
    return dict(sorted(runs.items()))


def _span(values: list[float]) -> str:
    """Points, "(min to max)" with true minus signs."""
    return f"({_points(min(values))} to {_points(max(values))})"


def eopd_vs_opd(facts: list[dict]) -> str:
    """Per seed and on the mean: EOPD's and OPD's final students, their difference in points (range
    over seeds), Pass@n and the FKL at high-entropy positions. The mean row is bold."""
    n, tau = _n(facts), _tau(facts)
    eopd, opd = _by_seed(facts, "eopd"), _by_seed(facts, "opd")
    lines = [f"| seed | EOPD final | OPD final | EOPD {MINUS} OPD | Pass@{n} EOPD / OPD | FKL(H_T ≥ {tau}) EOPD / OPD |",
             "|---|---|---|---|---|---|"]
    cols = {k: ([_final(eopd[s])[k] for s in eopd], [_final(opd[s])[k] for s in eopd]) for k in ("avg", f"pass@{n}", "fkl_high")}
    for i, seed in enumerate(eopd):
        (ea, oa), (ep, op), (ef, of) = ((a[i], b[i]) for a, b in cols.values())
        lines.append(f"| {seed} | {ea:.3f} | {oa:.3f} | {_points(ea - oa)} | {ep:.3f} / {op:.3f} | {ef:.3f} / {of:.3f} |")
    avg_d = [a - b for a, b in zip(*cols["avg"])]
    pass_d = [a - b for a, b in zip(*cols[f"pass@{n}"])]
    spread_of = lambda d: _signed(f"{100 * min(d):.1f}–{100 * max(d):.1f}")  # noqa: E731
    (ea, oa), (ep, op), (ef, of) = ((_mean(a), _mean(b)) for a, b in cols.values())
    lines.append(f"| **mean** | **{ea:.3f}** | **{oa:.3f}** | **{_points(_mean(avg_d))}** ({spread_of(avg_d)}) "
                 f"| **{ep:.3f} / {op:.3f}** ({_points(_mean(pass_d))}; {spread_of(pass_d)}) | **{ef:.3f} / {of:.3f}** |")
    return "\n".join(lines) + "\n"


def warmup(facts: list[dict]) -> str:
    """EOPD against EOPD after a KD warm-up, per seed and on the mean (bold), Avg@n / Pass@n."""
    n = _n(facts)
    eopd, warm = _by_seed(facts, "eopd"), _by_seed(facts, "eopd+warmup4")
    lines = ["| seed | EOPD | EOPD after 4 KD iterations | difference (points) |", "|---|---|---|---|"]
    keys = ("avg", f"pass@{n}")
    for seed in eopd:
        a, b = _final(eopd[seed]), _final(warm[seed])
        lines.append(f"| {seed} | {a['avg']:.3f} / {a[keys[1]]:.3f} | {b['avg']:.3f} / {b[keys[1]]:.3f} "
                     f"| {_points(b['avg'] - a['avg'])} / {_points(b[keys[1]] - a[keys[1]])} |")
    mean = {k: (_mean([_final(f)[k] for f in eopd.values()]), _mean([_final(f)[k] for f in warm.values()])) for k in keys}
    diffs = {k: [_final(warm[s])[k] - _final(eopd[s])[k] for s in eopd] for k in keys}
    lines.append(f"| **mean** | **{mean['avg'][0]:.3f} / {mean[keys[1]][0]:.3f}** | **{mean['avg'][1]:.3f} / "
                 f"{mean[keys[1]][1]:.3f}** | **" + " / ".join(f"{_points(_mean(d))} {_span(d)}" for d in diffs.values())
                 + "** |")
    return "\n".join(lines) + "\n"


def teachers(facts: list[dict]) -> str:
    """Final students per seed (Avg@n / Pass@n) under the plain teacher, the teacher given the answer,
    self-distillation and two routed teachers, and the variants set; mean (min–max), the mean bold
    where there are several seeds."""
    n = _n(facts)
    plain, priv, self_, routed = (_by_seed(facts, v) for v in ("eopd", "eopd+privileged", "eopd+self", "eopd+routed"))
    lines = ["| seed | EOPD, plain teacher | EOPD, teacher given the answer | self-distillation (given the answer) "
             "| routed by kind | variants: plain | variants: given the answer |", "|---|---|---|---|---|---|---|"]

    def both(f: dict | None) -> str:
        return "–" if f is None else f"{_final(f)['avg']:.3f} / {_final(f)[f'pass@{n}']:.3f}"

    for seed in plain:
        lines.append(f"| {seed} | {both(plain[seed])} | {both(priv[seed])} | {both(self_[seed])} | {both(routed.get(seed))} "
                     f"| {_final(plain[seed], 'variants')['avg']:.3f} | {_final(priv[seed], 'variants')['avg']:.3f} |")

    def mean_of(runs: dict, set_name: str = "held-out", with_pass: bool = True) -> str:
        avg = [_final(f, set_name)["avg"] for f in runs.values()]
        text = f"{_mean(avg):.3f}" if len(avg) == 1 else f"**{_mean(avg):.3f}** ({min(avg):.3f}–{max(avg):.3f})"
        return text + (f" / {_mean([_final(f, set_name)[f'pass@{n}'] for f in runs.values()]):.3f}" if with_pass else "")

    lines.append(f"| mean (min–max) | {mean_of(plain)} | {mean_of(priv)} | {mean_of(self_)} | {mean_of(routed)} "
                 f"| {mean_of(plain, 'variants', False)} | {mean_of(priv, 'variants', False)} |")
    return "\n".join(lines) + "\n"


def fkl_ablations(facts: list[dict]) -> str:
    """OPD, EOPD, full_fkl and random_fkl per seed (Avg@n / Pass@n; FKL at high-entropy positions;
    the share of tokens with H >= 1, the teacher's at the same positions in brackets), the mean, and
    the differences to OPD and to EOPD paired by seed, in points (range over seeds). Bold: the best
    Avg@n and the best Pass@n of a row; a difference ahead in every seed on both metrics."""
    n = _n(facts)
    order = ("opd", "eopd", "full_fkl", "random_fkl")
    runs = {v: _by_seed(facts, v) for v in order}
    seeds = list(runs["opd"])
    key = f"pass@{n}"

    def pair_text(avg: float, pass_n: float, best_avg: float, best_pass: float) -> str:
        a, b = f"{avg:.3f}", f"{pass_n:.3f}"
        if avg == best_avg and pass_n == best_pass:
            return f"**{a} / {b}**"
        return f"{f'**{a}**' if avg == best_avg else a} / {f'**{b}**' if pass_n == best_pass else b}"

    lines = ["| seed | OPD | EOPD | full_fkl | random_fkl |", "|---|---|---|---|---|"]
    for seed in seeds:
        finals = [_final(runs[v][seed]) for v in order]
        best_avg, best_pass = max(m["avg"] for m in finals), max(m[key] for m in finals)
        lines.append(f"| {seed} | " + " | ".join(
            f"{pair_text(m['avg'], m[key], best_avg, best_pass)}; FKL {m['fkl_high']:.3f}; "
            f"{m['h1_student']:.0%} ({m['h1_teacher']:.0%})" for m in finals) + " |")
    means = [{k: _mean([_final(f)[k] for f in runs[v].values()]) for k in ("avg", key, "fkl_high")} for v in order]
    best_avg, best_pass = max(m["avg"] for m in means), max(m[key] for m in means)
    lines.append("| mean (min–max) | " + " | ".join(
        f"{pair_text(m['avg'], m[key], best_avg, best_pass)}; FKL {m['fkl_high']:.3f}" for m in means) + " |")

    def plain(x: float) -> str:
        return _signed(f"{100 * x:.1f}")

    for reference, skip in (("opd", 1), ("eopd", 2)):
        cells = ["–"] * skip
        for v in order[skip:]:
            d = {k: [_final(runs[v][s])[k] - _final(runs[reference][s])[k] for s in seeds] for k in ("avg", key)}
            head = f"{_points(_mean(d['avg']))} / {_points(_mean(d[key]))}"
            ahead = all(x > 0 for values in d.values() for x in values)
            cells.append(f"{f'**{head}**' if ahead else head} ({plain(min(d['avg']))}–{plain(max(d['avg']))} / "
                         f"{plain(min(d[key]))}–{plain(max(d[key]))})")
        lines.append(f"| minus {'OPD' if reference == 'opd' else 'EOPD'}, paired by seed | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def teacher_metrics(facts: list[dict]) -> str:
    """What the teachers did during training (`train_metrics.jsonl`): the last quarter's mean, as the
    range over seeds, per run kind; the routed run's per-teacher metrics over the whole run."""
    lines = ["| run | teacher entropy on the student's tokens | gate ratio (H_T ≥ 0.8) | mean advantage "
             f"(teacher {MINUS} student log-prob) | student entropy |", "|---|---|---|---|---|"]
    for variant, label in (("eopd", "EOPD, plain teacher"), ("eopd+privileged", "EOPD, teacher given the answer"),
                           ("eopd+self", "self-distillation")):
        rows = [read_iterations(Path(f["run"])) for f in _by_seed(facts, variant).values()]

        def span(key: str, high_first: bool = False) -> str:
            values = [quarter_mean(r, key) for r in rows]
            lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
            return _signed(f"{hi} to {lo}" if high_first else f"{lo}–{hi}")
        lines.append(f"| {label} | {span('teacher_entropy')} | {span('gate_ratio')} | {span('advantage_mean', True)} "
                     f"| {span('student_entropy')} |")
    routed = read_iterations(Path(next(iter(_by_seed(facts, "eopd+routed").values()))["run"]))

    def whole(name: str, key: str) -> float:
        values = [r[f"iter/by_teacher/{name}/{key}"] for r in routed if f"iter/by_teacher/{name}/{key}" in r]
        return statistics.fmean(values)
    for name, label in (("teacher", "routed: plain teacher ({share:.0%} of tokens)"),
                        ("hinted", "routed: teacher given the answer (word problems, {share:.0%} of tokens)")):
        lines.append(f"| {label.format(share=whole(name, 'token_share'))} | {whole(name, 'teacher_entropy'):.2f} (whole run) "
                     f"| {whole(name, 'gate_ratio'):.2f} | reverse KL {whole(name, 'reverse_kl'):.2f} | – |")
    return "\n".join(lines) + "\n"


#: Runs whose times were not a measurement (they shared the machine, as the text under their table says):
#: their seconds are shown apart, not in the range.
SHARED_RUNS = frozenset({"gkd0.5-s0"})
#: What the document adds to a loss's teacher-generated share.
SHARE_NOTES = {"gkd1.0": " (all on-policy)"}


def variants_table(facts: list[dict], names: dict[str, str], *, models: bool, teacher_share: bool) -> str:
    """The paper's Table 2 layout: per loss, Avg@n mean (min–max), each seed, the mean Pass@k, the
    Pass@n range, minus EOPD paired by seed (bold: ahead in every seed), [the teacher-generated share],
    training and whole-run seconds. Bold: the loss with the best mean Avg@n (its name and mean), and
    the best mean Pass@n. `models` adds the teacher's and the initial student's rows."""
    n = _n(facts)
    ks = sorted(int(k.split("@")[1]) for k in _final(facts[0]) if k.startswith("pass@"))
    groups = _groups(facts, names)
    eopd = _by_seed(facts, "eopd")
    extra = " teacher-generated (measured) |" if teacher_share else ""
    lines = [f"| variant | Avg@{n} mean (min–max) | seeds {' / '.join(map(str, eopd))} | Pass@"
             + " / @".join(map(str, ks)) + f" (mean) | Pass@{n} (min–max) | {MINUS} EOPD, Avg@{n} / Pass@{n} |"
             + extra + " training (s) | whole run (s) |", "|---" * (8 + teacher_share) + "|"]
    if models:
        held = next(f["sets"]["held-out"] for f in facts if "teacher" in f["sets"]["held-out"])
        for label, key in (("teacher", "teacher"), ("initial student", "initial")):
            m = held[key]
            lines.append(f"| {label} | {m['avg']:.3f} | – | " + " / ".join(f"{m[f'pass@{k}']:.3f}" for k in ks)
                         + " | – | – | – | – |")
    best_avg = max(_mean([_final(f)["avg"] for f in runs]) for _, runs in groups)
    best_pass = max(_mean([_final(f)[f"pass@{n}"] for f in runs]) for _, runs in groups)
    for (variant, label), (_, runs) in zip(names.items(), groups):
        avg = [_final(f)["avg"] for f in runs]
        passes = [_mean([_final(f)[f"pass@{k}"] for f in runs]) for k in ks]
        pass_text = " / ".join(f"**{p:.3f}**" if k == n and p == best_pass else f"{p:.3f}" for k, p in zip(ks, passes))
        top = _mean(avg) == best_avg
        if variant == "eopd":
            paired = "–"
        else:
            cells = []
            for key in ("avg", f"pass@{n}"):
                d = [_final(f)[key] - _final(eopd[f["seed"]])[key] for f in runs]
                text = f"{_points(_mean(d))} {_span(d)}"
                cells.append(f"**{text}**" if all(x > 0 for x in d) else text)
            paired = " / ".join(cells)
        share = ""
        if teacher_share:
            values = [f["teacher_share"] or 0.0 for f in runs]
            share = (f"{min(values):.0%}" if f"{min(values):.0%}" == f"{max(values):.0%}"
                     else f"{min(values):.0%}–{max(values):.0%}").replace("%–", "–") + SHARE_NOTES.get(variant, "") + " |"

        def took(key: str) -> str:
            timed = [f[key] for f in runs if Path(f["run"]).name not in SHARED_RUNS]
            apart = [f[key] for f in runs if Path(f["run"]).name in SHARED_RUNS]
            return f"{min(timed):.0f}–{max(timed):.0f}" + "".join(f" ({s:.0f} shared)" for s in apart)
        lines.append(f"| {f'**{label}**' if top else label} | {f'**{_mean(avg):.3f}**' if top else f'{_mean(avg):.3f}'} "
                     f"({min(avg):.3f}–{max(avg):.3f}) | {' / '.join(f'{a:.3f}' for a in avg)} | {pass_text} "
                     f"| {min(_final(f)[f'pass@{n}'] for f in runs):.3f}–{max(_final(f)[f'pass@{n}'] for f in runs):.3f} "
                     f"| {_signed(paired)} |{' ' + share if share else ''} {took('train_s')} | {took('total_s')} |")
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
    near = read_facts(sorted(RUNS.iterdir()))
    if near is None:
        raise FileNotFoundError(f"{RUNS}: a run directory without run.yaml")
    return {"eopd-vs-opd": eopd_vs_opd(near), "fkl-ablations": fkl_ablations(near),
            "table-2": variants_table(near, {"kd": "KD", "grpo": "GRPO", "opd": "OPD", "eopd": "EOPD"},
                                      models=True, teacher_share=False),
            "gkd": variants_table(near, {"gkd0.5": "GKD λ = 0.5", "gkd0.8": "GKD λ = 0.8", "gkd1.0": "GKD λ = 1.0",
                                         "kd": "KD", "eopd": "EOPD", "opd": "OPD"}, models=False, teacher_share=True),
            "warmup": warmup(near), "teachers": teachers(near), "teacher-metrics": teacher_metrics(near),
            "far-per-run": far_per_run(far), "far-means": far_means(far), "far-paired": far_paired(far),
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
