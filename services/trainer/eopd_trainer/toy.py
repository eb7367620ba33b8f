"""The toy experiment of paper sec. 3.2 (Table 1, Figure 1, app. B), plus its EOPD counterpart.

    eopd-toy --seeds 3 --out DIR

Setup (as in the paper). V = 80 indices. Teacher logits z ~ N(0, 1), five random entries
overwritten by 1.7, 1.9, 2.1, 2.3, 2.5, and P_te = softmax(z / T) with T = 0.3 (scenario A, low
entropy) or T = 1.0 (scenario B, high entropy). Student logits s ~ N(0, 1); its capacity-limited
distribution P_S10 is the softmax restricted to its current top-10 indices. Each step samples
x ~ P_S10, computes the reverse-KL reward r(x) = log P_te(x) - log P_S10(x) and updates
s_x <- s_x + eta * r(x). Metrics: the top-1 change count (steps at which argmax s changes) and
the per-step top-10 change rate, the Jaccard distance 1 - |S_t & S_t-1| / |S_t | S_t-1| of
consecutive top-10 sets.

Randomness: seed i draws, from `numpy.random.default_rng(i)` and in this order, the teacher
logits, the five mode positions, the student's initial logits, then the samples. So scenarios A and
B of a seed share the same z and the same initial student (only T differs), and the reverse-KL and
EOPD runs of a seed start identically: every comparison is paired. Runs are deterministic.

Choices the paper leaves open (justified in docs/toy.md):

* eta = 1.0. The reward is a log-ratio, already in logit units, so eta = 1 moves the sampled
  logit by the full reward: the scale at which the update is a plain Monte-Carlo step. With it,
  scenario A's argmax settles within about 50 steps (its top-10 change rate decays to ~0.01 by
  step ~250), and A's top-1 change count, which only depends on that transient, comes out at
  5.7 +- 1.9 over seeds 0-2 (paper: 7.3 +- 1.6). Smaller eta (0.1-0.3) gives A about 3-5, and B needs
  thousands of steps; eta = 2 gives A 8.7 +- 2.9 but a less stable A across seeds (12.8 +- 8.3
  over 10 seeds).
* steps = 650. B never settles: its top-1 count grows linearly, about 0.13 change per step at
  eta = 1, so a count is only meaningful with its horizon. 650 steps lets A fully converge and
  puts B on the paper's scale (84.0 +- 16.7); the per-step rate is reported as well.
* std over seeds is numpy's default (population, ddof = 0).

Beyond the paper, the EOPD update: the toy's loss becomes L_opd + alpha * 1[H_te >= tau] * FKL,
FKL = sum_{x in S10_te} p~(x) (log p~(x) - log P_S(x)), p~ the teacher's top-10 renormalised and
P_S the student's full softmax (as in the loss, eq. 11). One gradient step with the same eta on
both terms, from the same s: s_x += eta * r(x) and s += eta * alpha * (p~ - P_S) when gated.
With the paper's tau = 0.8 both scenarios are gated (the teacher entropies are about 2.1 and 3.9
nats here: with V = 80 and N(0, 1) logits even T = 0.3 leaves much mass off the five modes), so a
second EOPD run uses tau_mid = 3.0, between the two: the gate then does what it is for, A (low
entropy) runs pure reverse KL and B (high entropy) gets the FKL (key "eopd_tau_mid" in the JSON).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

MODES = (1.7, 1.9, 2.1, 2.3, 2.5)
SCENARIOS = {"A": 0.3, "B": 1.0}  # name -> teacher temperature
METHODS = ("rkl", "eopd")


@dataclass(frozen=True)
class ToyConfig:
    """Parameters of the toy experiment (paper values, and our documented choices of eta, steps)."""

    vocab: int = 80
    student_k: int = 10  # the student samples from its top-10 (limited capacity)
    eta: float = 1.0
    steps: int = 650
    tau: float = 0.8  # EOPD gate on the teacher entropy (nats), paper default
    tau_mid: float = 3.0  # a second EOPD run gated between the teacher entropies (A ~2.1, B ~3.9 nats)
    alpha: float = 1.0  # EOPD forward-KL weight, paper default
    fkl_k: int = 10  # EOPD forward KL over the teacher's top-10, renormalised
    tail: int = 100  # window (last steps) for the "settled" statistics


@dataclass
class ToyRun:
    """One seed, one scenario, one method."""

    top1_changes: int
    top1_changed: np.ndarray  # [steps] bool, argmax changed at this step
    top1_in_teacher_top5: np.ndarray  # [steps] bool, argmax is one of the teacher's five largest
    top10_change_rate: np.ndarray  # [steps] Jaccard distance between consecutive top-10 sets
    teacher_probs: np.ndarray  # [V]
    teacher_entropy: float
    student_logits: np.ndarray  # [V] final
    final_fkl: float  # FKL(p~ || P_S) over the teacher's top-k at the end
    final_top10_overlap: int  # |top-10 teacher & top-10 student| at the end
    gated: bool = field(default=False)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _top(s: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-s, kind="stable")[:k]


def capacity_limited(s: np.ndarray, k: int) -> np.ndarray:
    """P_S10: the student's softmax restricted to its top-k indices, as a [V] vector."""
    idx = _top(s, k)
    p = np.zeros_like(s)
    p[idx] = np.exp(_log_softmax(s[idx]))
    return p


def run_toy(seed: int, temperature: float, method: str = "rkl", cfg: ToyConfig = ToyConfig()) -> ToyRun:
    """Runs the toy for one seed and teacher temperature, with the reverse-KL (paper) or EOPD update."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(cfg.vocab)
    z[rng.choice(cfg.vocab, size=len(MODES), replace=False)] = MODES
    log_te = _log_softmax(z / temperature)
    p_te = np.exp(log_te)
    h_te = float(-(p_te * log_te).sum())
    s = rng.standard_normal(cfg.vocab)

    te_top = _top(log_te, cfg.fkl_k)
    p_tilde = np.zeros(cfg.vocab)
    p_tilde[te_top] = np.exp(_log_softmax(log_te[te_top]))
    gated = method == "eopd" and h_te >= cfg.tau

    top1 = int(np.argmax(s))
    prev = set(_top(s, cfg.student_k).tolist())
    changed, jaccard = np.zeros(cfg.steps, dtype=bool), np.empty(cfg.steps)
    te_top5, in_top5 = set(_top(log_te, 5).tolist()), np.zeros(cfg.steps, dtype=bool)
    for t in range(cfg.steps):
        idx = _top(s, cfg.student_k)
        log_s10 = _log_softmax(s[idx])
        j = rng.choice(cfg.student_k, p=np.exp(log_s10))
        x = idx[j]
        step = np.zeros(cfg.vocab)
        step[x] = cfg.eta * (log_te[x] - log_s10[j])
        if gated:  # minus the gradient of alpha * FKL(p~ || softmax(s)), taken at the same s
            step += cfg.eta * cfg.alpha * (p_tilde - np.exp(_log_softmax(s)))
        s = s + step
        new_top1 = int(np.argmax(s))
        changed[t] = new_top1 != top1
        in_top5[t] = new_top1 in te_top5
        top1 = new_top1
        cur = set(_top(s, cfg.student_k).tolist())
        jaccard[t] = 1.0 - len(prev & cur) / len(prev | cur)
        prev = cur

    log_s = _log_softmax(s)
    final_fkl = float((p_tilde[te_top] * (np.log(p_tilde[te_top]) - log_s[te_top])).sum())
    overlap = len(set(te_top.tolist()) & set(_top(s, 10).tolist()))
    return ToyRun(int(changed.sum()), changed, in_top5, jaccard, p_te, h_te, s, final_fkl, overlap, gated)


#: The runs of each scenario: JSON key -> (method, which tau). "rkl" is the paper's reward; "eopd"
#: the EOPD update gated at cfg.tau (0.8: both scenarios gated); "eopd_tau_mid" gated at cfg.tau_mid.
RUNS = {"rkl": ("rkl", "tau"), "eopd": ("eopd", "tau"), "eopd_tau_mid": ("eopd", "tau_mid")}


def experiment(seeds: int, cfg: ToyConfig = ToyConfig()) -> tuple[dict, dict]:
    """All scenarios x runs x seeds. Returns (json-ready results, raw runs for the plots)."""
    cfgs = {"tau": cfg, "tau_mid": replace(cfg, tau=cfg.tau_mid)}
    runs = {(sc, key): [run_toy(i, temp, method, cfgs[which]) for i in range(seeds)]
            for sc, temp in SCENARIOS.items() for key, (method, which) in RUNS.items()}
    out: dict = {"config": {**asdict(cfg), "seeds": list(range(seeds)), "modes": list(MODES), "std_ddof": 0},
                 "scenarios": {}}
    for sc, temp in SCENARIOS.items():
        entry: dict = {"temperature": temp}
        for m, (_, which) in RUNS.items():
            rs = runs[(sc, m)]
            counts = np.array([r.top1_changes for r in rs], dtype=float)
            rates = np.stack([r.top10_change_rate for r in rs])
            stats = {
                "top1_change_count_mean": float(counts.mean()),
                "top1_change_count_std": float(counts.std()),
                "top1_change_counts": [int(c) for c in counts],
                "top1_changes_per_step": float(counts.mean() / cfg.steps),
                "top1_changes_per_step_tail": float(np.mean([r.top1_changed[-cfg.tail:].mean() for r in rs])),
                "top1_in_teacher_top5_tail": float(np.mean([r.top1_in_teacher_top5[-cfg.tail:].mean() for r in rs])),
                "top10_change_rate": rates.mean(axis=0).round(6).tolist(),
                "top10_change_rate_per_seed": rates.round(6).tolist(),
                "top10_change_rate_tail_mean": float(rates[:, -cfg.tail:].mean()),
                "final_fkl_mean": float(np.mean([r.final_fkl for r in rs])),
                "final_top10_overlap_mean": float(np.mean([r.final_top10_overlap for r in rs])),
                "fkl_applied": bool(rs[0].gated),
                "fkl_applied_per_seed": [bool(r.gated) for r in rs],
            }
            if m == "rkl":  # the paper's Table 1 keys, at the scenario's top level
                entry.update(stats)
                entry["teacher_entropy"] = float(np.mean([r.teacher_entropy for r in rs]))
                entry["teacher_entropy_per_seed"] = [r.teacher_entropy for r in rs]
            else:
                entry[m] = {**stats, "tau": getattr(cfg, which)}
        out["scenarios"][sc] = entry
    return out, runs


# ------------------------------------------------------------------------------------------------
# Output: table, json, figures.
# ------------------------------------------------------------------------------------------------
def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for sc, e in results["scenarios"].items():
        label = {"A": "(A) Low", "B": "(B) High"}.get(sc, sc)
        rows.append([
            label,
            f"{e['temperature']:.1f}",
            f"{e['teacher_entropy']:.2f}",
            f"{e['top1_change_count_mean']:.1f} ± {e['top1_change_count_std']:.1f}",
            f"{e['eopd']['top1_change_count_mean']:.1f} ± {e['eopd']['top1_change_count_std']:.1f}",
            f"{e['eopd_tau_mid']['top1_change_count_mean']:.1f} ± {e['eopd_tau_mid']['top1_change_count_std']:.1f}"
            f" ({_gated(e['eopd_tau_mid'])})",
            f"{e['top10_change_rate_tail_mean']:.3f} / {e['eopd']['top10_change_rate_tail_mean']:.3f}"
            f" / {e['eopd_tau_mid']['top10_change_rate_tail_mean']:.3f}",
            f"{e['final_top10_overlap_mean']:.1f} / {e['eopd']['final_top10_overlap_mean']:.1f}",
            f"{e['top1_in_teacher_top5_tail']:.2f} / {e['eopd']['top1_in_teacher_top5_tail']:.2f}",
            f"{e['final_fkl_mean']:.2f} / {e['eopd']['final_fkl_mean']:.2f}",
        ])
    return rows


def _gated(stats: dict) -> str:
    per_seed = stats["fkl_applied_per_seed"]
    return "FKL on" if all(per_seed) else "FKL off" if not any(per_seed) else f"FKL on {sum(per_seed)}/{len(per_seed)}"


TABLE_HEADERS = [
    "Teacher entropy", "Temp.", "H_te", "Top-1 changes, RKL", "Top-1 changes, EOPD",
    "Top-1 changes, EOPD tau_mid", "Top-10 change rate (tail) RKL / EOPD / EOPD tau_mid",
    "Top-10 overlap RKL / EOPD",
    "Top-1 in teacher top-5 (tail) RKL / EOPD", "Final FKL RKL / EOPD",
]


def print_table(results: dict) -> None:
    rows = table_rows(results)
    cfg = results["config"]
    title = (f"Toy experiment (paper Table 1): {len(cfg['seeds'])} seeds, eta = {cfg['eta']}, "
             f"{cfg['steps']} steps; EOPD: tau = {cfg['tau']}, alpha = {cfg['alpha']}; "
             f"EOPD tau_mid: tau = {cfg['tau_mid']}")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(TABLE_HEADERS)]
        print(title)
        print(" | ".join(h.ljust(w) for h, w in zip(TABLE_HEADERS, widths)))
        for r in rows:
            print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for h in TABLE_HEADERS:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def _smooth(x: np.ndarray, window: int) -> np.ndarray:
    if window <= 1:
        return x
    kernel = np.ones(window) / window
    return np.convolve(np.pad(x, (window - 1, 0), mode="edge"), kernel, mode="valid")


def plot_change_rate(results: dict, path: Path, window: int = 20) -> None:
    """Figure 1: top-10 change rate per step, A (blue) and B (red), mean over seeds +- std,
    for the reverse-KL reward (paper) and the EOPD update side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharey=True)
    colors = {"A": "tab:blue", "B": "tab:red"}
    cfg = results["config"]
    for ax, method, title in ((axes[0], "rkl", "Reverse-KL reward (paper)"),
                              (axes[1], "eopd", f"EOPD, tau = {cfg['tau']}: FKL in A and B"),
                              (axes[2], "eopd_tau_mid", f"EOPD, tau = {cfg['tau_mid']}: FKL in B only")):
        for sc, e in results["scenarios"].items():
            per_seed = np.array((e if method == "rkl" else e[method])["top10_change_rate_per_seed"])
            sm = np.stack([_smooth(r, window) for r in per_seed])
            mean, std = sm.mean(axis=0), sm.std(axis=0)
            steps = np.arange(1, mean.size + 1)
            label = f"Scenario {sc} (T = {e['temperature']}, H = {e['teacher_entropy']:.2f})"
            ax.plot(steps, mean, color=colors.get(sc), label=label, lw=1.4)
            ax.fill_between(steps, np.clip(mean - std, 0, None), mean + std, color=colors.get(sc), alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"top-10 change rate (Jaccard, {window}-step mean)")
    axes[0].legend(loc="upper right", fontsize=8)
    n = len(results["config"]["seeds"])
    fig.suptitle(f"Top-10 change rate, mean +- std over {n} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_distributions(runs: dict, cfg: ToyConfig, path: Path, seed: int = 0) -> None:
    """Figure 5: teacher vs final student distribution (P_S10), scenarios A and B, one seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    x = np.arange(cfg.vocab)
    for ax, sc in zip(axes, SCENARIOS):
        rkl, eopd = runs[(sc, "rkl")][seed], runs[(sc, "eopd")][seed]
        ax.bar(x, rkl.teacher_probs, color="0.6", label="teacher $P_{te}$")
        for run, marker, color, label in ((rkl, "o", "tab:red", "reverse KL"), (eopd, "x", "tab:green", "EOPD")):
            p = capacity_limited(run.student_logits, cfg.student_k)
            on = p > 0  # P_S10 is zero off the student's top-10
            ax.plot(x[on], p[on], marker, ms=5, color=color, label=f"student $P_{{S^{{10}}}}$, {label}")
        ax.set_title(f"Scenario {sc}: T = {SCENARIOS[sc]}, H(teacher) = {rkl.teacher_entropy:.2f} nats")
        ax.set_xlabel("index")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("probability")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Teacher vs final student after {cfg.steps} steps (seed {seed})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`eopd-toy --seeds 3 --out DIR`: prints Table 1, writes DIR/toy_results.json and two figures."""
    p = argparse.ArgumentParser(prog="eopd-toy", description="The toy experiment of the EOPD paper (sec. 3.2).")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0 .. N-1), default 3")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--eta", type=float, default=ToyConfig.eta, help="learning rate (default 1.0)")
    p.add_argument("--steps", type=int, default=ToyConfig.steps, help="update steps (default 650)")
    p.add_argument("--tau", type=float, default=ToyConfig.tau, help="EOPD entropy gate (default 0.8)")
    p.add_argument("--tau-mid", type=float, default=ToyConfig.tau_mid,
                   help="gate of the second EOPD run, between the teacher entropies (default 3.0)")
    p.add_argument("--alpha", type=float, default=ToyConfig.alpha, help="EOPD FKL weight (default 1.0)")
    p.add_argument("--no-plots", action="store_true", help="skip the figures")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.steps < 1:
        p.error("--seeds and --steps must be >= 1")
    cfg = ToyConfig(eta=args.eta, steps=args.steps, tau=args.tau, tau_mid=args.tau_mid, alpha=args.alpha)
    results, runs = experiment(args.seeds, cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    print_table(results)
    figures = {}
    if not args.no_plots:
        figures = {"top10_change_rate": "toy_top10_change_rate.png", "distributions": "toy_distributions.png"}
        plot_change_rate(results, args.out / figures["top10_change_rate"])
        plot_distributions(runs, cfg, args.out / figures["distributions"])
    results["figures"] = figures
    (args.out / "toy_results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'toy_results.json'}" + (f" and {', '.join(figures.values())}" if figures else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
