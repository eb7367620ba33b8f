"""docs/results.md's tables of the default preset's experiment (docs/results/runs/): EOPD against
OPD, the forward-KL ablations, the paper's Table 2 and GKD layouts, the KD warm-up, the teacher-context
runs and what their teachers did during training."""

from __future__ import annotations

import statistics
from pathlib import Path

from eopd_trainer.eval.experiment_table import quarter_mean
from eopd_trainer.eval.run_files import read_eval, read_iterations

from scripts.results_layout import (MINUS, answers_per_problem, exact_mean, final_of, losses_in_order, points,
                                    points_span, runs_by_seed, signed, tau_of)

def eopd_vs_opd(facts: list[dict]) -> str:
    """Per seed and on the mean: EOPD's and OPD's final students, their difference in points (range
    over seeds), Pass@n and the FKL at high-entropy positions. The mean row is bold."""
    n, tau = answers_per_problem(facts), tau_of(facts)
    eopd, opd = runs_by_seed(facts, "eopd"), runs_by_seed(facts, "opd")
    lines = [f"| seed | EOPD final | OPD final | EOPD {MINUS} OPD | Pass@{n} EOPD / OPD | FKL(H_T ≥ {tau}) EOPD / OPD |",
             "|---|---|---|---|---|---|"]
    cols = {k: ([final_of(eopd[s])[k] for s in eopd], [final_of(opd[s])[k] for s in eopd]) for k in ("avg", f"pass@{n}", "fkl_high")}
    for i, seed in enumerate(eopd):
        (ea, oa), (ep, op), (ef, of) = ((a[i], b[i]) for a, b in cols.values())
        lines.append(f"| {seed} | {ea:.3f} | {oa:.3f} | {points(ea - oa)} | {ep:.3f} / {op:.3f} | {ef:.3f} / {of:.3f} |")
    avg_d = [a - b for a, b in zip(*cols["avg"])]
    pass_d = [a - b for a, b in zip(*cols[f"pass@{n}"])]
    spread_of = lambda d: signed(f"{100 * min(d):.1f}–{100 * max(d):.1f}")  # noqa: E731
    (ea, oa), (ep, op), (ef, of) = ((exact_mean(a), exact_mean(b)) for a, b in cols.values())
    lines.append(f"| **mean** | **{ea:.3f}** | **{oa:.3f}** | **{points(exact_mean(avg_d))}** ({spread_of(avg_d)}) "
                 f"| **{ep:.3f} / {op:.3f}** ({points(exact_mean(pass_d))}; {spread_of(pass_d)}) | **{ef:.3f} / {of:.3f}** |")
    return "\n".join(lines) + "\n"


def warmup(facts: list[dict]) -> str:
    """EOPD against EOPD after a KD warm-up, per seed and on the mean (bold), Avg@n / Pass@n."""
    n = answers_per_problem(facts)
    eopd, warm = runs_by_seed(facts, "eopd"), runs_by_seed(facts, "eopd+warmup4")
    lines = ["| seed | EOPD | EOPD after 4 KD iterations | difference (points) |", "|---|---|---|---|"]
    keys = ("avg", f"pass@{n}")
    for seed in eopd:
        a, b = final_of(eopd[seed]), final_of(warm[seed])
        lines.append(f"| {seed} | {a['avg']:.3f} / {a[keys[1]]:.3f} | {b['avg']:.3f} / {b[keys[1]]:.3f} "
                     f"| {points(b['avg'] - a['avg'])} / {points(b[keys[1]] - a[keys[1]])} |")
    mean = {k: (exact_mean([final_of(f)[k] for f in eopd.values()]), exact_mean([final_of(f)[k] for f in warm.values()])) for k in keys}
    diffs = {k: [final_of(warm[s])[k] - final_of(eopd[s])[k] for s in eopd] for k in keys}
    lines.append(f"| **mean** | **{mean['avg'][0]:.3f} / {mean[keys[1]][0]:.3f}** | **{mean['avg'][1]:.3f} / "
                 f"{mean[keys[1]][1]:.3f}** | **" + " / ".join(f"{points(exact_mean(d))} {points_span(d)}" for d in diffs.values())
                 + "** |")
    return "\n".join(lines) + "\n"


def teachers(facts: list[dict]) -> str:
    """Final students per seed (Avg@n / Pass@n) under the plain teacher, the teacher given the answer,
    self-distillation and two routed teachers, and the variants set; mean (min–max), the mean bold
    where there are several seeds."""
    n = answers_per_problem(facts)
    plain, priv, self_, routed = (runs_by_seed(facts, v) for v in ("eopd", "eopd+privileged", "eopd+self", "eopd+routed"))
    lines = ["| seed | EOPD, plain teacher | EOPD, teacher given the answer | self-distillation (given the answer) "
             "| routed by kind | variants: plain | variants: given the answer |", "|---|---|---|---|---|---|---|"]

    def both(f: dict | None) -> str:
        return "–" if f is None else f"{final_of(f)['avg']:.3f} / {final_of(f)[f'pass@{n}']:.3f}"

    for seed in plain:
        lines.append(f"| {seed} | {both(plain[seed])} | {both(priv[seed])} | {both(self_[seed])} | {both(routed.get(seed))} "
                     f"| {final_of(plain[seed], 'variants')['avg']:.3f} | {final_of(priv[seed], 'variants')['avg']:.3f} |")

    def mean_of(runs: dict, set_name: str = "held-out", with_pass: bool = True) -> str:
        avg = [final_of(f, set_name)["avg"] for f in runs.values()]
        text = f"{exact_mean(avg):.3f}" if len(avg) == 1 else f"**{exact_mean(avg):.3f}** ({min(avg):.3f}–{max(avg):.3f})"
        return text + (f" / {exact_mean([final_of(f, set_name)[f'pass@{n}'] for f in runs.values()]):.3f}" if with_pass else "")

    lines.append(f"| mean (min–max) | {mean_of(plain)} | {mean_of(priv)} | {mean_of(self_)} | {mean_of(routed)} "
                 f"| {mean_of(plain, 'variants', False)} | {mean_of(priv, 'variants', False)} |")
    return "\n".join(lines) + "\n"


def fkl_ablations(facts: list[dict]) -> str:
    """OPD, EOPD, full_fkl and random_fkl per seed (Avg@n / Pass@n; FKL at high-entropy positions;
    the share of tokens with H >= 1, the teacher's at the same positions in brackets), the mean, and
    the differences to OPD and to EOPD paired by seed, in points (range over seeds). Bold: the best
    Avg@n and the best Pass@n of a row; a difference ahead in every seed on both metrics."""
    n = answers_per_problem(facts)
    order = ("opd", "eopd", "full_fkl", "random_fkl")
    runs = {v: runs_by_seed(facts, v) for v in order}
    seeds = list(runs["opd"])
    key = f"pass@{n}"

    def pair_text(avg: float, pass_n: float, best_avg: float, best_pass: float) -> str:
        a, b = f"{avg:.3f}", f"{pass_n:.3f}"
        if avg == best_avg and pass_n == best_pass:
            return f"**{a} / {b}**"
        return f"{f'**{a}**' if avg == best_avg else a} / {f'**{b}**' if pass_n == best_pass else b}"

    lines = ["| seed | OPD | EOPD | full_fkl | random_fkl |", "|---|---|---|---|---|"]
    for seed in seeds:
        finals = [final_of(runs[v][seed]) for v in order]
        best_avg, best_pass = max(m["avg"] for m in finals), max(m[key] for m in finals)
        lines.append(f"| {seed} | " + " | ".join(
            f"{pair_text(m['avg'], m[key], best_avg, best_pass)}; FKL {m['fkl_high']:.3f}; "
            f"{m['h1_student']:.0%} ({m['h1_teacher']:.0%})" for m in finals) + " |")
    means = [{k: exact_mean([final_of(f)[k] for f in runs[v].values()]) for k in ("avg", key, "fkl_high")} for v in order]
    best_avg, best_pass = max(m["avg"] for m in means), max(m[key] for m in means)
    lines.append("| mean (min–max) | " + " | ".join(
        f"{pair_text(m['avg'], m[key], best_avg, best_pass)}; FKL {m['fkl_high']:.3f}" for m in means) + " |")

    def plain(x: float) -> str:
        return signed(f"{100 * x:.1f}")

    for reference, skip in (("opd", 1), ("eopd", 2)):
        cells = ["–"] * skip
        for v in order[skip:]:
            d = {k: [final_of(runs[v][s])[k] - final_of(runs[reference][s])[k] for s in seeds] for k in ("avg", key)}
            head = f"{points(exact_mean(d['avg']))} / {points(exact_mean(d[key]))}"
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
        rows = [read_iterations(Path(f["run"])) for f in runs_by_seed(facts, variant).values()]

        def span(key: str, high_first: bool = False) -> str:
            values = [quarter_mean(r, key) for r in rows]
            lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
            return signed(f"{hi} to {lo}" if high_first else f"{lo}–{hi}")
        lines.append(f"| {label} | {span('teacher_entropy')} | {span('gate_ratio')} | {span('advantage_mean', True)} "
                     f"| {span('student_entropy')} |")
    routed = read_iterations(Path(next(iter(runs_by_seed(facts, "eopd+routed").values()))["run"]))

    def whole(name: str, key: str) -> float:
        values = [r[f"iter/by_teacher/{name}/{key}"] for r in routed if f"iter/by_teacher/{name}/{key}" in r]
        return statistics.fmean(values)
    for name, label in (("teacher", "routed: plain teacher ({share:.0%} of tokens)"),
                        ("hinted", "routed: teacher given the answer (word problems, {share:.0%} of tokens)")):
        lines.append(f"| {label.format(share=whole(name, 'token_share'))} | {whole(name, 'teacher_entropy'):.2f} (whole run) "
                     f"| {whole(name, 'gate_ratio'):.2f} | reverse KL {whole(name, 'reverse_kl'):.2f} | – |")
    return "\n".join(lines) + "\n"


#: Runs whose times were not a measurement (they shared the machine, as the text under their table says):
#: their seconds are shown apart, not in the range. Named by archive and run directory.
SHARED_RUNS = frozenset({"runs/gkd0.5-s0"})


def run_name(fact: dict) -> str:
    """A run's archive and directory, e.g. "runs/gkd0.5-s0" (run names repeat across archives)."""
    path = Path(fact["run"])
    return f"{path.parent.name}/{path.name}"


def seconds_span(runs: list[dict], key: str) -> str:
    """The runs' `key` seconds as "min–max" (one number when they round alike), the runs of SHARED_RUNS
    apart: "(N shared)"."""
    timed = [f[key] for f in runs if run_name(f) not in SHARED_RUNS]
    apart = [f[key] for f in runs if run_name(f) in SHARED_RUNS]
    lo, hi = f"{min(timed):.0f}", f"{max(timed):.0f}"
    return (lo if lo == hi else f"{lo}–{hi}") + "".join(f" ({s:.0f} shared)" for s in apart)


#: What the document adds to a loss's teacher-generated share.
SHARE_NOTES = {"gkd1.0": " (all on-policy)"}


def variants_table(facts: list[dict], names: dict[str, str], *, models: bool, teacher_share: bool) -> str:
    """The paper's Table 2 layout: per loss, Avg@n mean (min–max), each seed, the mean Pass@k, the
    Pass@n range, minus EOPD paired by seed (bold: ahead in every seed), [the teacher-generated share],
    training and whole-run seconds. Bold: the loss with the best mean Avg@n (its name and mean), and
    the best mean Pass@n. `models` adds the teacher's and the initial student's rows."""
    n = answers_per_problem(facts)
    ks = sorted(int(k.split("@")[1]) for k in final_of(facts[0]) if k.startswith("pass@"))
    groups = losses_in_order(facts, names)
    eopd = runs_by_seed(facts, "eopd")
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
    best_avg = max(exact_mean([final_of(f)["avg"] for f in runs]) for _, runs in groups)
    best_pass = max(exact_mean([final_of(f)[f"pass@{n}"] for f in runs]) for _, runs in groups)
    for (variant, label), (_, runs) in zip(names.items(), groups):
        avg = [final_of(f)["avg"] for f in runs]
        passes = [exact_mean([final_of(f)[f"pass@{k}"] for f in runs]) for k in ks]
        pass_text = " / ".join(f"**{p:.3f}**" if k == n and p == best_pass else f"{p:.3f}" for k, p in zip(ks, passes))
        top = exact_mean(avg) == best_avg
        if variant == "eopd":
            paired = "–"
        else:
            cells = []
            for key in ("avg", f"pass@{n}"):
                d = [final_of(f)[key] - final_of(eopd[f["seed"]])[key] for f in runs]
                text = f"{points(exact_mean(d))} {points_span(d)}"
                cells.append(f"**{text}**" if all(x > 0 for x in d) else text)
            paired = " / ".join(cells)
        share = ""
        if teacher_share:
            values = [f["teacher_share"] or 0.0 for f in runs]
            share = (f"{min(values):.0%}" if f"{min(values):.0%}" == f"{max(values):.0%}"
                     else f"{min(values):.0%}–{max(values):.0%}").replace("%–", "–") + SHARE_NOTES.get(variant, "") + " |"

        lines.append(f"| {f'**{label}**' if top else label} | {f'**{exact_mean(avg):.3f}**' if top else f'{exact_mean(avg):.3f}'} "
                     f"({min(avg):.3f}–{max(avg):.3f}) | {' / '.join(f'{a:.3f}' for a in avg)} | {pass_text} "
                     f"| {min(final_of(f)[f'pass@{n}'] for f in runs):.3f}–{max(final_of(f)[f'pass@{n}'] for f in runs):.3f} "
                     f"| {signed(paired)} |{' ' + share if share else ''} {seconds_span(runs, 'train_s')} | {seconds_span(runs, 'total_s')} |")
    return "\n".join(lines) + "\n"


def gkd_layouts(facts: list[dict], lambdas: tuple[str, ...], suffix: str) -> str:
    """GKD at each lambda under two data layouts, paired by seed: the runs of `gkd<lambda><suffix>`
    (TRL's layout) against those of `gkd<lambda>` (the preset's), held-out Avg@n and Pass@n means,
    the difference in points (range over seeds; bold: ahead in every seed) and the training seconds
    (range over seeds, runs that shared the machine apart)."""
    n = answers_per_problem(facts)
    key = f"pass@{n}"
    lines = [f"| λ | Avg@{n}: TRL's layout / the preset's | difference, Avg@{n} (per seed) | Pass@{n}: TRL's / the preset's "
             f"| difference, Pass@{n} | training s: TRL's / the preset's |", "|---|---|---|---|---|---|"]

    for lam in lambdas:
        new, old = runs_by_seed(facts, f"gkd{lam}{suffix}"), runs_by_seed(facts, f"gkd{lam}")
        seeds = [s for s in new if s in old]
        cells = []
        for k in ("avg", key):
            d = [final_of(new[s])[k] - final_of(old[s])[k] for s in seeds]
            text = f"{points(exact_mean(d))} ({', '.join(points(x) for x in d)})"
            cells.append((f"{exact_mean([final_of(new[s])[k] for s in seeds]):.3f} / "
                          f"{exact_mean([final_of(old[s])[k] for s in seeds]):.3f}",
                          f"**{text}**" if all(x > 0 for x in d) else text))
        lines.append(f"| {lam} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | {cells[1][1]} "
                     f"| {seconds_span([new[s] for s in seeds], 'train_s')} / {seconds_span([old[s] for s in seeds], 'train_s')} |")
    return "\n".join(lines) + "\n"


def default_run(facts: list[dict]) -> str:
    """The EOPD arm at Avg@n: teacher, initial and final students per seed (the teacher and the initial
    student evaluated once, by seed 0's run), the gain over that initial student, Pass@n and the
    variants set; the mean row bold."""
    n = answers_per_problem(facts)
    eopd = runs_by_seed(facts, "eopd")
    first = next(f for f in eopd.values() if "initial" in f["sets"]["held-out"])
    teacher, initial = first["sets"]["held-out"]["teacher"], first["sets"]["held-out"]["initial"]
    v_teacher, v_initial = first["sets"]["variants"]["teacher"], first["sets"]["variants"]["initial"]
    key = f"pass@{n}"
    lines = ["| seed | teacher | initial student | final student | gain (points) | Pass@k initial → final | variants set: final |",
             "|---|---|---|---|---|---|---|"]
    gains = []
    for seed, f in eopd.items():
        m, gain = final_of(f), final_of(f)["avg"] - initial["avg"]
        gains.append(gain)
        if f is first:
            lines.append(f"| Avg@{n}, this experiment: {seed} | {teacher['avg']:.3f} | {initial['avg']:.3f} | {m['avg']:.3f} "
                         f"| {points(gain)} | P@{n} {initial[key]:.3f} → {m[key]:.3f} | {final_of(f, 'variants')['avg']:.3f} "
                         f"(initial {v_initial['avg']:.3f}, teacher {v_teacher['avg']:.3f}) |")
        else:
            lines.append(f"| {seed} | – | – | {m['avg']:.3f} | {points(gain)} (vs seed {first['seed']}'s initial) "
                         f"| → {m[key]:.3f} | {final_of(f, 'variants')['avg']:.3f} |")
    variants = exact_mean([final_of(f, "variants")["avg"] for f in eopd.values()])
    lines.append(f"| **mean** | **{teacher['avg']:.3f}** | **{initial['avg']:.3f}** "
                 f"| **{exact_mean([final_of(f)['avg'] for f in eopd.values()]):.3f}** | **{points(exact_mean(gains))}** "
                 f"({100 * min(gains):.1f}–{100 * max(gains):.1f}) | P@{n} {initial[key]:.3f} → "
                 f"{exact_mean([final_of(f)[key] for f in eopd.values()]):.3f} | **{variants:.3f}** "
                 f"({points(variants - v_initial['avg'])} over the initial) |")
    return "\n".join(lines) + "\n"


#: The held-out problems of the side-by-side table (chosen for the document: right and wrong answers of
#: every kind), shown with each model's first sample.
SAMPLE_PROMPTS = ("Compute 8 + 3.", "How much is 2 + 5?", "Calculate 5 - 2.", "How much is 6 * 7?", "Compute 31 + 49.")


def samples(facts: list[dict]) -> str:
    """What the teacher, the initial student and seed 0's EOPD and OPD final students write (their first
    sample, `samples` of eval.json) on SAMPLE_PROMPTS; ✓/✗ by the headline grading, line breaks as " / "."""
    eopd, opd = runs_by_seed(facts, "eopd"), runs_by_seed(facts, "opd")
    seed = min(eopd)
    columns = [(eopd[seed], "teacher"), (eopd[seed], "initial"), (eopd[seed], "final"), (opd[seed], "final")]
    by_prompt = [{s["prompt"]: s for s in read_eval(Path(f["run"]))["models"][model]["samples"]} for f, model in columns]
    lines = ["| problem (answer) | teacher | initial student | EOPD final | OPD final |", "|---|---|---|---|---|"]
    for prompt in SAMPLE_PROMPTS:
        cells = []
        for table in by_prompt:
            s = table[prompt]
            cells.append(" / ".join(part.strip() for part in s["response"].splitlines() if part.strip())
                         + (" ✓" if s["correct"] else " ✗"))
        lines.append(f"| {prompt} ({by_prompt[0][prompt]['answer']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
