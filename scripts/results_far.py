"""docs/results.md's tables of the far student (issue 35; docs/results/runs-far/): per run, mean
(min-max), paired by seed, and training from the first quarter of iterations to the last."""

from __future__ import annotations

from pathlib import Path

from eopd_trainer.eval.experiment_seeds import first_quarter_mean
from eopd_trainer.eval.experiment_table import quarter_mean
from eopd_trainer.eval.run_files import read_eval, read_iterations

from scripts.results_layout import (MINUS, answers_per_problem, exact_mean, final_of, fmt, initial_rows,
                                    losses_in_order, mean_range, points, tau_of)

#: How the document names each loss (experiment_table's labels), in the order its far-student tables list them.
FAR_LOSSES = {"eopd": "EOPD", "opd": "OPD", "gkd0.5": "GKD λ 0.5", "gkd1.0": "GKD λ 1.0", "kd": "KD", "full_fkl": "full_fkl"}


def far_per_run(facts: list[dict]) -> str:
    n, tau = answers_per_problem(facts), tau_of(facts)
    seeds = " / ".join(str(f["seed"]) for f in losses_in_order(facts, FAR_LOSSES)[0][1])
    held, variants = initial_rows(facts)
    lines = [f"| loss | seeds {seeds}: Avg@{n} | Pass@{n} | variants Avg@{n} | FKL(H_T ≥ {tau}) | tokens with H ≥ 1 "
             "| training (s) |", "|---|---|---|---|---|---|---|",
             f"| initial student | {fmt(held['avg'])} | {fmt(held[f'pass@{n}'])} | {fmt(variants.get('avg'))} "
             f"| {fmt(held['fkl_high'], '{:.2f}')} | {fmt(held['h1_student'], '{:.0%}')} | |"]
    for label, runs in losses_in_order(facts, FAR_LOSSES):
        def cells(key: str, set_name: str = "held-out", pattern: str = "{:.3f}") -> str:
            return " / ".join(fmt(final_of(f, set_name).get(key), pattern) for f in runs)
        times = [f["train_s"] for f in runs]
        lines.append(f"| {label} | {cells('avg')} | {cells(f'pass@{n}')} | {cells('avg', 'variants')} "
                     f"| {cells('fkl_high', pattern='{:.2f}')} | {cells('h1_student', pattern='{:.0%}')} "
                     f"| {min(times):.0f}-{max(times):.0f} |")
    return "\n".join(lines) + "\n"


def far_means(facts: list[dict]) -> str:
    """Mean (min-max) over seeds; bold: the held-out columns, the table's headline."""
    n, tau = answers_per_problem(facts), tau_of(facts)
    held, variants = initial_rows(facts)
    lines = [f"| loss | Avg@{n} | Pass@{n} | variants Avg@{n} | variants Pass@{n} | FKL(H_T ≥ {tau}) | tokens with H ≥ 1 |",
             "|---|---|---|---|---|---|---|",
             f"| initial student | {fmt(held['avg'])} | {fmt(held[f'pass@{n}'])} | {fmt(variants.get('avg'))} "
             f"| {fmt(variants.get(f'pass@{n}'))} | {fmt(held['fkl_high'], '{:.2f}')} | {fmt(held['h1_student'], '{:.0%}')} |"]
    for label, runs in losses_in_order(facts, FAR_LOSSES):
        def col(key: str, set_name: str = "held-out", pattern: str = "{:.3f}") -> str:
            return mean_range([final_of(f, set_name)[key] for f in runs], pattern)
        avg, pass_n = col("avg"), col(f"pass@{n}")
        avg, pass_n = (f"**{c.split(' ')[0]}** {c.split(' ', 1)[1]}" for c in (avg, pass_n))
        lines.append(f"| {label} | {avg} | {pass_n} | {col('avg', 'variants')} | {col(f'pass@{n}', 'variants')} "
                     f"| {col('fkl_high', pattern='{:.2f}')} | {col('h1_student', pattern='{:.0%}')} |")
    return "\n".join(lines) + "\n"


def far_paired(facts: list[dict]) -> str:
    """EOPD minus OPD, then every other loss minus EOPD, paired by seed, in points: the mean (bold
    where the loss is ahead in every seed), then each seed's difference in seed order."""
    n = answers_per_problem(facts)
    groups = dict(losses_in_order(facts, FAR_LOSSES))
    pairs = [("EOPD", "OPD")] + [(label, "EOPD") for label in groups if label not in ("EOPD", "OPD")]
    columns = [("held-out", "avg"), ("held-out", f"pass@{n}"), ("variants", "avg"), ("variants", f"pass@{n}")]
    lines = [f"| difference | held-out Avg@{n} | held-out Pass@{n} | variants Avg@{n} | variants Pass@{n} |",
             "|---|---|---|---|---|"]
    for a, b in pairs:
        ref = {f["seed"]: f for f in groups[b]}
        cells = []
        for set_name, key in columns:
            diffs = [final_of(f, set_name)[key] - final_of(ref[f["seed"]], set_name)[key] for f in groups[a]]
            mean = points(exact_mean(diffs))
            cells.append(f"{f'**{mean}**' if all(d > 0 for d in diffs) else mean} ({', '.join(map(points, diffs))})")
        lines.append(f"| {a} {MINUS} {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def far_training(facts: list[dict]) -> str:
    """Each seed's first-quarter -> last-quarter means; bold: an FKL at high-entropy positions that rose."""
    groups = losses_in_order(facts, FAR_LOSSES)
    seeds = " / ".join(str(f["seed"]) for f in groups[0][1])
    lines = [f"| loss, seeds {seeds} | student entropy | FKL at high-entropy positions | gate ratio (last quarter) "
             "| teacher entropy on the trained tokens (last quarter) |", "|---|---|---|---|---|"]
    for label, runs in groups:
        rows = [read_iterations(Path(f["run"])) for f in runs]

        def moved(key: str, bold_rise: bool = False) -> str:
            cells = []
            for r in rows:
                first, last = first_quarter_mean(r, key), quarter_mean(r, key)
                end = fmt(last, "{:.2f}")
                cells.append(f"{fmt(first, '{:.2f}')}→{f'**{end}**' if bold_rise and last > first else end}")
            return " / ".join(cells)

        def last(key: str) -> str:
            return " / ".join(fmt(quarter_mean(r, key), "{:.2f}") for r in rows)
        lines.append(f"| {label} | {moved('student_entropy')} | {moved('fkl_gated_mean', bold_rise=True)} "
                     f"| {last('gate_ratio')} | {last('teacher_entropy')} |")
    return "\n".join(lines) + "\n"


def _share(x: float) -> str:
    """A share of answers in percent, one decimal, "100%" when whole."""
    return f"{x:.1%}".replace(".0%", "%")


def _drop_label(layers: list[int]) -> str:
    """"drop 12, 14, 16", or "drop 8-20 (even)" for a longer run of even layers."""
    steps = {b - a for a, b in zip(layers, layers[1:])}
    if len(layers) > 3 and steps == {2} and layers[0] % 2 == 0:
        return f"drop {layers[0]}-{layers[-1]} (even)"
    return "drop " + ", ".join(map(str, layers))


def far_choice(choice: dict) -> str:
    """The far student's candidates on the training probe (docs/results/far-student/choice.json): the
    default student, each healed candidate, and the chosen one before healing. Bold: the chosen row; its
    distances also as a multiple of the default student's."""
    ref = choice["default_student"]
    lines = ["| student | layers removed | Avg@4 (training probe) | answers with a number | reverse KL | FKL at H ≥ τ "
             "| student entropy (mean) | student positions with H ≥ τ |", "|---|---|---|---|---|---|---|---|"]

    def row(label: str, layers: int, m: dict, chosen: bool = False) -> str:
        rkl, fkl = f"{m['reverse_kl']:.2f}", f"{m['fkl_high_entropy']:.2f}"
        if chosen:
            rkl += f" ({m['reverse_kl'] / ref['reverse_kl']:.1f}x)"
            fkl += f" ({m['fkl_high_entropy'] / ref['fkl_high_entropy']:.1f}x)"
        cells = [label, str(layers), f"{m['avg_at_k']:.3f}", _share(m["number_frac"]), rkl, fkl,
                 f"{m['entropy_mean_student']:.2f}", f"{m['high_entropy_share_student']:.0%}"]
        return "| " + " | ".join(f"**{c}**" if chosen else c for c in cells) + " |"

    lines.append(row(f"default (`{ref['model']}`, not healed)", 1, ref))
    candidates = sorted(choice["candidates"].items(), key=lambda kv: kv[1]["layers_removed"])
    for spec, c in candidates:
        label = _drop_label([int(x) for x in spec.split(",")]) + ", healed"
        chosen = spec == choice["chosen"]
        lines.append(row(label + (": chosen" if chosen else ""), c["layers_removed"], c["healed"], chosen))
    c = choice["candidates"][choice["chosen"]]
    lines.append(row(_drop_label([int(x) for x in choice["chosen"].split(",")]) + ", before healing",
                     c["layers_removed"], c["pruned"]))
    return "\n".join(lines) + "\n"


def far_initial(default: dict, far: dict) -> str:
    """The default and the far initial student on the held-out problems, from the runs that evaluated
    them (`default`, `far`: experiment_table facts). Bold: the far student's accuracies and distances,
    the distances also as a multiple of the default student's."""
    n = answers_per_problem([default, far])
    d_held, d_var = initial_rows([default])
    f_held, f_var = initial_rows([far])
    lines = [f"| initial student | Avg@{n} | Pass@{n} | variants set Avg@{n} | answers with a number | reverse KL to the "
             "teacher | FKL at H ≥ τ | mean token entropy | tokens with H ≥ 1 |", "|---|---|---|---|---|---|---|---|---|"]
    d_eval = read_eval(Path(default["run"]))["models"]["initial"]
    f_eval = read_eval(Path(far["run"]))["models"]["initial"]
    lines.append(f"| default (drop 14) | {d_held['avg']:.3f} | {d_held[f'pass@{n}']:.3f} | {d_var['avg']:.3f} "
                 f"| {_share(d_eval['number_frac'])} | {d_eval['reverse_kl']:.2f} | {d_held['fkl_high']:.2f} "
                 f"| {d_eval['entropy_mean_student']:.2f} | {d_held['h1_student']:.0%} |")
    rkl = f_eval["reverse_kl"] / d_eval["reverse_kl"]
    fkl = f_held["fkl_high"] / d_held["fkl_high"]
    lines.append(f"| **far (drop 7, healed)** | **{f_held['avg']:.3f}** | **{f_held[f'pass@{n}']:.3f}** | **{f_var['avg']:.3f}** "
                 f"| {_share(f_eval['number_frac'])} | **{f_eval['reverse_kl']:.2f} ({rkl:.1f}x)** "
                 f"| **{f_held['fkl_high']:.2f} ({fkl:.1f}x)** | {f_eval['entropy_mean_student']:.2f} | {f_held['h1_student']:.0%} |")
    return "\n".join(lines) + "\n"
