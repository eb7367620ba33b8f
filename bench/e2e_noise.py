"""How large an accuracy gap the head-to-head can see (issue 48's goal: where a number falls short,
say where the accuracy goes, measured): the noise in each system's final held-out Avg@k, from the
runs the report already holds.

Three sources, each measured from the archive:
- grading: a checkpoint's Avg@k is k samples of each of P problems; its standard error is
  sqrt(sum_i var_i) / P with var_i = c_i (k - c_i) / (k^2 (k - 1)) from the c_i correct answers of
  problem i (`correct_per_prompt` of the checkpoint's eval.json in the archive);
- training: the same run's last two checkpoints (16 optimizer steps apart) differ by this much;
- seeds: the standard deviation of the final Avg@k over a system's seeds (all of the above, and the
  seed's own data order and samples).
Then each system's gap to the reference (the mean over seeds of the final Avg@k, minus the
reference's) with its 95% interval (Welch's t, degrees of freedom rounded down), and the seeds per
system a 95% interval of ±3 points would need at these spreads. The same for the mean of the last
two checkpoints, a steadier reading of where a run ends (not the published one).

Pure functions over bench/results/e2e_trl.json's runs and the archive's eval.json files, and the
`e2e_noise` section of docs/benchmarks.md:

    .venv/bin/python -m bench.e2e_noise --archive bench/results/e2e-avg8 [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from bench.e2e_report import label, newest_first
from bench.report import ROOT, markdown_table, print_section

SECTION = "e2e_noise"
RESULTS = ROOT / "bench" / "results" / "e2e_trl.json"
# Student's t at 0.975 for 1..30 degrees of freedom (the 95% two-sided interval); 1.96 beyond.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
BAND = 0.03  # issue 48: "the mean of three seeds within 3 points"


def t975(df: float) -> float:
    """Student's t quantile at 0.975 for `df` degrees of freedom, rounded down (conservative)."""
    d = max(1, math.floor(df))
    return T975[d - 1] if d <= len(T975) else 1.96


def grading_se(correct_per_prompt: list[int], k: int) -> float:
    """Standard error of Avg@k from each problem's count of correct answers out of k (k >= 2)."""
    var = sum(c * (k - c) / (k * k * (k - 1)) for c in correct_per_prompt)
    return math.sqrt(var) / len(correct_per_prompt)


def gap(a: list[float], b: list[float]) -> dict:
    """mean(a) - mean(b) with Welch's standard error and 95% interval half-width (each >= 2 values)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se > 0 else float("inf")
    return {"diff": statistics.mean(a) - statistics.mean(b), "se": se, "df": df, "half": t975(df) * se}


def seeds_needed(sd_a: float, sd_b: float, band: float = BAND) -> int:
    """Seeds per system for a 95% interval of the gap no wider than ±band (normal approximation),
    at seed standard deviations sd_a and sd_b."""
    return max(2, math.ceil(1.96**2 * (sd_a**2 + sd_b**2) / band**2))


def final_counts(archive: Path, run: dict) -> list[int] | None:
    """`correct_per_prompt` of the run's last checkpoint from the archive's eval.json, or None."""
    path = archive / f"{run['system']}-s{run['seed']}" / "eval.json"
    if not run.get("checkpoints") or not path.is_file():
        return None
    model = json.loads(path.read_text())["models"].get(run["checkpoints"][-1]["label"], {})
    return model.get("correct_per_prompt")


def system_noise(runs: list[dict], archive: Path, k: int) -> dict[str, dict]:
    """Per system (newest run of each seed): final Avg@k, the previous checkpoint's and the mean of the
    two per seed, seed SD, mean grading SE of the final checkpoint, mean |last - previous checkpoint|."""
    newest: dict[tuple[str, int], dict] = {}
    for r in newest_first(runs):
        if r.get("checkpoints"):
            newest.setdefault((r["system"], r["seed"]), r)
    out: dict[str, dict] = {}
    for _, r in sorted(newest.items(), key=lambda kv: kv[0][1]):
        acc = [c["heldout"]["avg_at_k"] for c in r["checkpoints"] if "heldout" in c]
        s = out.setdefault(r["system"], {"final": [], "previous": [], "last2": [], "swing": [], "grading_se": [],
                                         "problems": 0})
        s["final"].append(acc[-1])
        s["previous"].append(acc[-2] if len(acc) >= 2 else acc[-1])
        s["last2"].append(statistics.mean(acc[-2:]))
        if len(acc) >= 2:
            s["swing"].append(abs(acc[-1] - acc[-2]))
        counts = final_counts(archive, r)
        if counts:
            s["grading_se"].append(grading_se(counts, k))
            s["problems"] = len(counts)
    for s in out.values():
        s["sd"] = statistics.stdev(s["final"]) if len(s["final"]) > 1 else None
    return out


def rows(noise: dict[str, dict], reference: str) -> list[dict]:
    """One row per system with >= 2 seeds: its spreads and its gap to the reference (final and last-two)."""
    ref = noise[reference]
    out = []
    for system, s in sorted(noise.items(), key=lambda kv: (kv[0] != reference, -statistics.mean(kv[1]["final"]))):
        if len(s["final"]) < 2:
            continue
        row = {"system": system, "n": len(s["final"]), "mean": statistics.mean(s["final"]), "sd": s["sd"],
               "grading_se": statistics.mean(s["grading_se"]) if s["grading_se"] else None,
               "swing": statistics.mean(s["swing"]) if s["swing"] else None}
        if system != reference:
            row["gap"], row["gap_last2"] = gap(s["final"], ref["final"]), gap(s["last2"], ref["last2"])
            row["gap_previous"] = gap(s["previous"], ref["previous"])
            row["change"] = [f - p for f, p in zip(s["final"], s["previous"], strict=True)]
            row["seeds_needed"] = seeds_needed(s["sd"], ref["sd"])
        out.append(row)
    return out


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def _gap_text(g: dict) -> str:
    return f"{_pts(g['diff'])} (±{100 * g['half']:.1f})"


def section_text(rs: list[dict], reference: str, k: int, problems: int) -> str:
    table = [[label(r["system"]), r["n"], f"{r['mean']:.3f}", f"{100 * r['sd']:.1f}",
              "-" if r["grading_se"] is None else f"{100 * r['grading_se']:.1f}",
              "-" if r["swing"] is None else f"{100 * r['swing']:.1f}",
              *((_gap_text(r[g]) for g in ("gap", "gap_previous", "gap_last2")) if "gap" in r else ["reference"] * 3),
              r.get("seeds_needed", "-")] for r in rs]
    others = [r for r in rs if "gap" in r]
    inside = [label(r["system"]) for r in others if abs(r["gap"]["diff"]) <= BAND and r["gap"]["half"] <= BAND]
    wide = [r for r in others if r["gap"]["half"] > BAND]
    graded = [r for r in rs if r["grading_se"] is not None and r["sd"]]
    text = (f"## Head to head: how large a gap three seeds can see (`python -m bench.e2e_noise`, issue 48)\n\n"
            f"The noise in each system's final held-out Avg@{k} ({problems} problems x {k} samples), from the runs of the "
            "head-to-head above (points of accuracy). Grading: the standard error of one checkpoint's Avg@"
            f"{k} from its per-problem counts of correct answers. Swing: the mean absolute difference between a run's "
            "last two checkpoints (16 optimizer steps apart). Seed SD: the standard deviation of the final accuracy "
            f"over seeds. Gap: the mean final accuracy minus {label(reference)}'s, ± the half-width of its 95% "
            "interval (Welch's t); the same one checkpoint earlier, and for the mean of each run's last two "
            "checkpoints (a steadier reading of where a run ends; the published one is the last checkpoint). Seeds "
            "for ±3: the seeds per system a 95% interval of ±3 points would need at these seed SDs.\n\n"
            + markdown_table(["system", "seeds", f"final Avg@{k}", "seed SD", "grading SE", "swing", "gap (final)",
                              "gap (one checkpoint earlier)", "gap (last two)", "seeds for ±3"], table) + "\n\n")
    reading = ["**Reading.**"]
    if wide:
        reading.append(f"{len(wide)} of {len(others)} gaps have a 95% interval wider than ±3 points: at these spreads "
                       "three seeds cannot tell a system within 3 points of the reference from one several points "
                       "away, and a gap whose interval includes 0 is not shown to be a cost of the system either.")
    reading.append(f"Inside ±3 points with an interval no wider than that: {', '.join(inside)}." if inside else
                   "None is shown inside ±3 points at 95%.")
    if graded:
        ratio = statistics.mean(r["grading_se"] for r in graded) / statistics.mean(r["sd"] for r in graded)
        reading.append(f"Grading alone is {ratio:.2f} of a seed's spread on the mean over systems; the rest is "
                       "training (a run moves by the swing between its last two checkpoints).")
    for r in others:
        ch = r["change"]
        if len(ch) >= 3 and (all(c < 0 for c in ch) or all(c > 0 for c in ch)):
            reading.append(f"{label(r['system'])}: every seed {'fell' if ch[0] < 0 else 'rose'} over the last 16 steps "
                           f"({', '.join(_pts(c) for c in ch)} points; gap {_gap_text(r['gap_previous'])} one checkpoint "
                           f"earlier, {_gap_text(r['gap'])} at the end).")
    return text + " ".join(reading) + "\n"


def load_runs(results: Path) -> tuple[list[dict], int]:
    data = json.loads(results.read_text())
    return data["runs"], int(data.get("eval_n") or 8)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--archive", type=Path, default=ROOT / "bench" / "results" / "e2e-avg8")
    p.add_argument("--reference", default="trl-gkd")
    p.add_argument("--write", action="store_true", help=f"write the {SECTION} section of docs/benchmarks.md")
    args = p.parse_args(argv)
    runs, k = load_runs(args.results)
    noise = system_noise(runs, args.archive, k)
    problems = max((s["problems"] for s in noise.values()), default=0)
    text = section_text(rows(noise, args.reference), args.reference, k, problems)
    return print_section(SECTION, text, write=args.write)


if __name__ == "__main__":
    raise SystemExit(main())
