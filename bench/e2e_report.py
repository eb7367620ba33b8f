"""The head-to-head benchmark's numbers (`bench/bench_e2e.py`), pure: accuracy against training time
per system, the time each system needs to reach the reference's final accuracy (eopd's, or another
system's: `summarise(reference=...)`), the docs section and the figure.

A *run* here is one system and seed: `{"system", "seed", "checkpoints": [{"label", "step", "train_s",
"heldout": {"avg_at_k", "pass_at_k"}, ...}], "final_variants": {...} | None, "memory", "wall_s", ...}`,
checkpoints in training order. `initial` is the evaluation of the starting student (time 0).
"""

from __future__ import annotations

import statistics

from bench.report import markdown_table

LABELS = {"eopd": "eopd (EOPD)", "opd": "eopd (OPD)", "eopd-gkd": "eopd (GKD, lambda 1)",
          "eopd-trl-gkd": "eopd (TRL's objective: GKD lambda 1, beta 1, full vocabulary)",
          "eopd-trl-gkd-sum": "eopd (TRL's objective at TRL's loss scale: summed over tokens / 16)",
          "eopd-trl-gkd-inherit": "eopd (TRL's objective, OpenMP's default wait policy as in TRL's process)",
          "eopd-trl-gkd-async": "eopd (TRL's objective, async: sampling overlaps training, one version of lag)",
          "eopd-topk-rkl": "eopd (reverse KL over the student's top-16, tail bucket)",
          "eopd-rkl-full": "eopd (EOPD with the exact full-vocabulary reverse KL)", "trl-gkd": "TRL GKDTrainer (in-process teacher)",
          "trl-server-eopd": "TRL ServerDistillationTrainer -> eopd-teacher", "trl-server-vllm": "TRL ServerDistillationTrainer -> vLLM"}


LAYOUT_LABELS = {"trl": "at TRL's layout (8 prompts x 1 response per step)",
                 "trl-async": "at TRL's layout in async mode (8 prompts x 1 response per step, one step of lag)"}

# How the report names its reference (`summarise(reference=...)`: the system whose final accuracy is
# the target and whose seconds the ratios divide by): short, and with its loss.
REFERENCE_NAMES = {"eopd": ("eopd", "eopd's (EOPD)", "EOPD"), "trl-gkd": ("TRL", "TRL GKDTrainer's", "TRL GKDTrainer")}


def reference_names(reference: str) -> tuple[str, str, str]:
    """(short name, possessive with its loss, the loss's name) of a reference system, e.g. ("eopd",
    "eopd's (EOPD)", "EOPD"); a system without its own names is called by its key."""
    return REFERENCE_NAMES.get(reference, (reference, f"{reference}'s", reference))


def label(system: str) -> str:
    """A system's name in tables and the figure; an eopd system at another layout says which
    (`eopd-gkd@trl`, e2e_systems.system_key)."""
    base, _, layout = system.partition("@")
    name = LABELS.get(base, base)
    return f"{name} {LAYOUT_LABELS.get(layout, f'at layout {layout}')}" if layout else name


def curve(run: dict, initial: float) -> list[tuple[float, float]]:
    """(training seconds, held-out Avg@k) from time 0 (the initial student) through each checkpoint."""
    return [(0.0, initial)] + [(c["train_s"], c["heldout"]["avg_at_k"]) for c in run["checkpoints"] if "heldout" in c]


def time_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """The training seconds at which a curve first reaches `target`, linearly interpolated between the
    checkpoint before and the first checkpoint at or above it; None if it never does. Accuracies
    within 1e-9 of the target count as reaching it (a mean over seeds is not exact in floating point)."""
    target -= 1e-9
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if a1 >= target:
            if a0 >= target or a1 == a0:
                return t0 if a0 >= target else t1
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return None if not points or points[0][1] < target else points[0][0]


def time_to_stay(points: list[tuple[float, float]], target: float) -> float | None:
    """The training seconds from which a curve stays at or above `target` through its last checkpoint:
    interpolated between the last checkpoint below it and the next; None if the last one is below it.
    Sturdier than `time_to_reach` on noisy curves: a checkpoint that crosses the target by chance and
    falls back does not count. Accuracies within 1e-9 of the target count as reaching it."""
    target -= 1e-9
    if not points or points[-1][1] < target:
        return None
    below = [i for i, (_, a) in enumerate(points) if a < target]
    if not below:
        return points[0][0]
    (t0, a0), (t1, a1) = points[below[-1]], points[below[-1] + 1]
    return t0 + (t1 - t0) * (target - a0) / (a1 - a0)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def machine_of(run: dict) -> str:
    """The machine a run was timed on (`machine` of its trained.json): the CPU's name and, where recorded,
    the first 8 hex digits of the kernel's boot id, e.g. "AMD EPYC (boot 94c6cf01)". Two machines can
    report the same CPU name and run 1.4-1.9x apart, so seconds pair only under the same key. "?" when
    not recorded."""
    m = run.get("machine", {})
    boot = m.get("boot_id")
    return m.get("cpu", "?") + (f" (boot {boot[:8]})" if boot else "")


def machines_line(runs: list[dict]) -> str:
    """Which machine timed which runs, e.g. "Intel(R) Xeon(R) Processor: seed 0 (eopd, trl-gkd); AMD EPYC
    (boot 94c6cf01): seeds 0 (opd), 2 (trl-server-vllm)": a seed's systems need not share one machine."""
    by_machine: dict[str, dict[int, list[str]]] = {}
    for r in runs:
        by_machine.setdefault(machine_of(r), {}).setdefault(r["seed"], []).append(r["system"])
    return "; ".join(
        f"{m}: seed{'s' if len(seeds) > 1 else ''} " + ", ".join(f"{seed} ({', '.join(sorted(systems))})" for seed, systems in sorted(seeds.items()))
        for m, seeds in sorted(by_machine.items(), key=lambda kv: (min(kv[1]), kv[0])))


def retimings_text(retimings: list[dict]) -> str:
    """The report's words on its re-timings ("" without any): which runs, on which machines."""
    if not retimings:
        return ""
    by_machine: dict[str, list[str]] = {}
    for r in retimings:
        by_machine.setdefault(machine_of(r), []).append(f"{r['system']} seed {r['seed']}")
    return ("; re-timed (trained again on a later machine for the seconds alone, never evaluated: its accuracies are "
            "the archived run's, which every re-run so far reproduced exactly), and paired there: " +
            "; ".join(f"{m}: {', '.join(sorted(rs))}" for m, rs in sorted(by_machine.items())))


def summarise(runs: list[dict], initial: float, reference: str = "eopd", retimings: list[dict] = ()) -> dict:
    """Per system: final held-out accuracy over seeds, training seconds, time to reach the target (the
    mean final Avg@k of `reference` over its seeds) per seed, and its ratio to the reference's, paired
    by seed: a system's time over the reference's time in the same seed, on the same machine
    (`machine_of`: runs on different machines, whose seconds do not compare, give no ratio), then the
    mean of those ratios. The same for the time from which it stays at or above
    the target (`time_to_stay`), and for the time to reach the reference's final accuracy in the same
    seed (`own_s`, `seed_targets`: every seed of the reference gives a ratio, where the mean over seeds
    is out of reach of the seeds that end below it). Memory.

    `retimings`: runs of `runs` timed again on other machines (`e2e_timing.retimed`: the same
    accuracies, another machine's seconds). They add machines to pair on (`timed`: per seed, each
    machine's seconds, newest timing first: `timed_at` of the run's machine, see `newest_first`); a
    seed's ratio takes the first machine, in that order, on which the reference was timed too: the
    newest pairing measures the newest code (the archive is re-timed when the code changes). Every
    other number is the runs' own."""
    by_system: dict[str, list[dict]] = {}
    for r in runs:
        by_system.setdefault(r["system"], []).append(r)
    ref = [r["checkpoints"][-1]["heldout"]["avg_at_k"] for r in by_system.get(reference, []) if r["checkpoints"]]
    target = statistics.mean(ref) if ref else None
    seed_target = {r["seed"]: r["checkpoints"][-1]["heldout"]["avg_at_k"] for r in by_system.get(reference, []) if r["checkpoints"]}
    out: dict = {"target": target, "seed_targets": seed_target, "reference": reference, "initial": initial, "systems": {}}
    for system, rs in by_system.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        finals = [r["checkpoints"][-1] for r in rs if r["checkpoints"]]
        times = [_times(r, initial, target, seed_target) for r in rs]
        out["systems"][system] = {
            "seeds": [r["seed"] for r in rs],
            "machines": [machine_of(r) for r in rs],
            "final_avg": [c["heldout"]["avg_at_k"] for c in finals if "heldout" in c],
            "final_pass": [c["heldout"]["pass_at_k"][max(c["heldout"]["pass_at_k"], key=int)] for c in finals if "heldout" in c],
            "final_variants_avg": [r["final_variants"]["avg_at_k"] for r in rs if r.get("final_variants")],
            "train_s": [c["train_s"] for c in finals],
            "reach_s": [t["reach_s"] for t in times],
            "stay_s": [t["stay_s"] for t in times],
            "own_s": [t["own_s"] for t in times],
            "peak_mb": [r["memory"].get("peak_total_mb", 0.0) for r in rs],
        }
    timed: dict[tuple[str, int], dict[str, dict]] = {}
    for r in newest_first([*runs, *retimings]):
        if r["checkpoints"]:
            timed.setdefault((r["system"], r["seed"]), {}).setdefault(
                machine_of(r), {"train_s": r["checkpoints"][-1]["train_s"], **_times(r, initial, target, seed_target)})
    for system, s in out["systems"].items():
        s["timed"] = {seed: timed.get((system, seed), {}) for seed in s["seeds"]}
    ref_timed = out["systems"].get(reference, {}).get("timed", {})
    for s in out["systems"].values():
        s["reached"], s["reach_mean_s"] = _count_and_mean(s["reach_s"])
        s["reach_ratios"] = _paired_ratios(s, "reach_s", ref_timed)
        s["reach_ratio"] = statistics.mean(s["reach_ratios"]) if s["reach_ratios"] else None
        s["stayed"], s["stay_mean_s"] = _count_and_mean(s["stay_s"])
        s["stay_ratios"] = _paired_ratios(s, "stay_s", ref_timed)
        s["own_reached"], s["own_mean_s"] = _count_and_mean(s["own_s"])
        s["own_ratios"] = _paired_ratios(s, "own_s", ref_timed)
        s["train_ratios"] = _paired_ratios(s, "train_s", ref_timed)
    return out


def newest_first(runs: list[dict]) -> list[dict]:
    """`runs` by when they were timed (`machine.timed_at`, UTC ISO), newest first; those without a
    time (timed before it was recorded) after them, in their order."""
    return sorted(runs, key=lambda r: r.get("machine", {}).get("timed_at") or "", reverse=True)


def _times(run: dict, initial: float, target: float | None, seed_target: dict) -> dict:
    """One run's seconds to the mean target (`reach_s`, `stay_s`) and to its seed's target (`own_s`);
    None where there is no target or the run does not get there."""
    points = curve(run, initial)
    return {"reach_s": time_to_reach(points, target) if target is not None else None,
            "stay_s": time_to_stay(points, target) if target is not None else None,
            "own_s": time_to_reach(points, seed_target[run["seed"]]) if run["seed"] in seed_target else None}


def _count_and_mean(times: list[float | None]) -> tuple[str, float | None]:
    """("reached/seeds", mean seconds of the seeds that reached it, or None)."""
    got = [t for t in times if t is not None]
    return f"{len(got)}/{len(times)}", (statistics.mean(got) if got else None)


def _paired_ratios(s: dict, key: str, ref_timed: dict) -> list[float]:
    """Per seed, a system's `key` seconds over the reference's in that seed on the first machine
    (`timed`: newest timing first, `newest_first`) that timed both; a seed with no such machine,
    or where either did not reach the target, gives no ratio."""
    out = []
    for seed, machines in s["timed"].items():
        ref = ref_timed.get(seed, {})
        common = [m for m in machines if m in ref]
        if common:
            t, ref_t = machines[common[0]][key], ref[common[0]][key]
            if t is not None and ref_t:
                out.append(t / ref_t)
    return out


def _ratio_text(ratios: list[float], reached: bool) -> str:
    if not reached:
        return "never"
    if not ratios:  # reached, but in no seed timed on the same machine as the reference's run
        return "no seed paired"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x (1 seed)"
    return f"{statistics.mean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} seeds)"


def _train_text(s: dict) -> str:
    """Mean training seconds over the seeds (machines mixed), then the ratio to the reference's,
    paired by seed and machine (`train_ratios`), where any seed pairs."""
    if not s["train_s"]:
        return "-"
    mean = f"{statistics.mean(s['train_s']):.0f}"
    return f"{mean}; {_ratio_text(s['train_ratios'], True)}" if s.get("train_ratios") else mean


def summary_rows(summary: dict, k: int) -> list[list]:
    rows = []
    for system, s in summary["systems"].items():
        reach = "-" if s["reach_mean_s"] is None else f"{s['reach_mean_s']:.0f} s ({s['reached']} seeds)"
        stay = "-" if s["stay_mean_s"] is None else f"{s['stay_mean_s']:.0f} s ({s['stayed']}), {_ratio_text(s['stay_ratios'], s['stay_mean_s'] is not None)}"
        rows.append([label(system), len(s["seeds"]), _spread(s["final_avg"]), _spread(s["final_pass"]),
                     _spread(s["final_variants_avg"]), _train_text(s),
                     reach, _ratio_text(s["reach_ratios"], s["reach_mean_s"] is not None), stay,
                     f"{s['own_reached']} reach it; " + _ratio_text(s["own_ratios"], s["own_mean_s"] is not None),
                     f"{max(s['peak_mb']) / 1024:.1f}" if s["peak_mb"] else "-"])
    return rows


def summary_table(summary: dict, k: int) -> str:
    r = reference_names(summary.get("reference", "eopd"))[0]
    return markdown_table(["system", "seeds", f"held-out Avg@{k} at the end", f"Pass@{k}", f"variants Avg@{k}",
                           f"training s; ratio to {r}", f"time to {r}'s final accuracy", f"ratio to {r}",
                           "time from which it stays at or above it, ratio",
                           f"ratio to {r}, target {r}'s final accuracy in the same seed", "peak GiB (all processes)"],
                          summary_rows(summary, k))


def curve_table(runs: list[dict], initial: float) -> str:
    """Every checkpoint: system, seed, step, training seconds, Avg@k, Pass@k."""
    rows = [["initial student", "-", "0", "0", f"{initial:.3f}", "-"]]
    for r in sorted(runs, key=lambda r: (r["system"], r["seed"])):
        for c in r["checkpoints"]:
            if "heldout" in c:
                h = c["heldout"]
                rows.append([label(r["system"]), r["seed"], c["label"], f"{c['train_s']:.0f}",
                             f"{h['avg_at_k']:.3f}", f"{h['pass_at_k'][max(h['pass_at_k'], key=int)]:.3f}"])
    return markdown_table(["system", "seed", "checkpoint", "training s", "held-out Avg@k", "Pass@k"], rows)


def figure(runs: list[dict], initial: float, target: float | None, path, k: int, reference: str = "eopd") -> None:
    """Held-out Avg@k against training seconds: per system the mean over seeds at each checkpoint
    (times averaged), the seeds' min-max shaded; the reference's final accuracy as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    by_system: dict[str, list[dict]] = {}
    for r in runs:
        by_system.setdefault(r["system"], []).append(r)
    for system, rs in by_system.items():
        curves = [curve(r, initial) for r in rs]
        n = min(len(c) for c in curves)
        ts = [statistics.mean(c[i][0] for c in curves) for i in range(n)]
        accs = [[c[i][1] for c in curves] for i in range(n)]
        line, = ax.plot(ts, [statistics.mean(a) for a in accs], marker="o", label=f"{label(system)} ({len(rs)} seeds)")
        if len(rs) > 1:
            ax.fill_between(ts, [min(a) for a in accs], [max(a) for a in accs], color=line.get_color(), alpha=0.15)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{reference_names(reference)[0]}'s final accuracy (mean)")
    ax.set_xlabel("training seconds (checkpoint writes excluded)")
    ax.set_ylabel(f"held-out Avg@{k}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
