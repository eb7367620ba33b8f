"""Does each divergence member train? A few iterations of `eopd run` per member on a preset, and
what the alarms watch (issue 48, ask 2 "each member must train"; learner/alarms.py): the student's
mean entropy per iteration against the band [H_te/2 - 0.5, 2 H_te + 1] around the teacher's, the
smallest divergence term of any optimizer step (a true divergence never goes below 0), the share
of truncated answers, and the alarms that fired.

    .venv/bin/python -m bench.bench_divergences                       # smollm2-cpu, 16 iterations per member
    .venv/bin/python -m bench.bench_divergences --iterations 32 --members eopd_topk_rkl,eopd_rkl_student
    .venv/bin/python -m bench.bench_divergences --quick               # tiny preset, 1 iteration, 2 members; writes nothing
    .venv/bin/python -m bench.bench_divergences --from-runs docs/results/layout/eopd-rkl-full-preset-s0 ...
                                                                      # runs already made: read, not run again

Members (`MEMBERS`): the paper's eopd (reference), eopd_topk_rkl (the reverse KL over the
student's top-k, now with its tail bucket), eopd_rkl over each support, and gkd at beta 1
(TRL's reverse KL) over the student's top-k and the full vocabulary, on-policy (gkd_lambda 1).
The full-vocabulary members read the teacher's hidden states (issue 48, ask 1: asked for in bf16 by
the loss's support alone); a member
whose run fails is reported with its error, and the others still run. A full run writes
bench/results/divergences.json and the "divergences" section of docs/benchmarks.md.

`--from-runs DIR ...` summarises runs made elsewhere instead (each DIR holds the run's `run.yaml`
and `train_metrics.jsonl`, as `scripts/layout_ablation.py` archives its cells): each run's member
is the one whose loss overrides its run.yaml carries, and its own iteration count and seed are kept.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.report import markdown_table, measure_and_report
from eopd_trainer.learner.alarms import DIVERGENCE_TERMS, entropy_band

ROOT = Path(__file__).resolve().parents[1]

#: name -> `eopd run` overrides of the loss.
MEMBERS: dict[str, tuple[str, ...]] = {
    "eopd": ("loss.variant=eopd",),
    "eopd_topk_rkl": ("loss.variant=eopd_topk_rkl",),
    "eopd_rkl_teacher": ("loss.variant=eopd_rkl", "loss.support=teacher_topk"),
    "eopd_rkl_student": ("loss.variant=eopd_rkl", "loss.support=student_topk"),
    "eopd_rkl_full": ("loss.variant=eopd_rkl", "loss.support=full"),
    "gkd_rkl_student": ("loss.variant=gkd", "loss.gkd_lambda=1", "loss.gkd_beta=1", "loss.support=student_topk"),
    "gkd_rkl_full": ("loss.variant=gkd", "loss.gkd_lambda=1", "loss.gkd_beta=1", "loss.support=full"),
}
QUICK_MEMBERS = ("eopd_topk_rkl", "gkd_rkl_full")


def summarise(metrics_path: Path) -> dict:
    """The member's numbers from its `train_metrics.jsonl` (pure: reads the file only)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.is_file() else []
    steps = [r for r in rows if r.get("kind") == "step"]
    iters = [r for r in rows if r.get("kind") == "iteration"]
    per_iter = []
    for r in iters:
        h_s, h_t = r.get("iter/student_entropy"), r.get("iter/teacher_entropy")
        lo, hi = entropy_band(h_t) if h_t is not None else (math.nan, math.nan)
        per_iter.append({"iteration": r["iteration"], "student_entropy": h_s, "teacher_entropy": h_t,
                         "band": [lo, hi], "in_band": h_s is not None and h_t is not None and lo <= h_s <= hi,
                         "loss": r.get("iter/loss"), "truncated_frac": r.get("iter/truncated_frac"),
                         "alarms": sorted(r.get("alarms", {}))})
    divergences = [s[k] for s in steps for k in DIVERGENCE_TERMS if s.get(k) not in (None, 0.0)]
    return {
        "iterations": len(iters),
        "per_iteration": per_iter,
        "all_in_band": bool(per_iter) and all(p["in_band"] for p in per_iter),
        "min_divergence_term": min(divergences) if divergences else None,
        "min_loss": min((s["loss"] for s in steps if "loss" in s), default=None),
        "alarms": sorted({a for p in per_iter for a in p["alarms"]}),
    }


def _carries(loss: dict, override: str) -> bool:
    """Whether a run.yaml's `loss` section holds what `override` ("loss.key=value") sets; numbers compare
    as numbers ("1" matches 1.0), the value parsed the way the run.yaml holds it."""
    key, _, text = override.partition("=")
    got, want = loss.get(key.removeprefix("loss.")), yaml.safe_load(text)
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return float(got) == float(want)
    return got == want


def member_of(config: dict) -> str | None:
    """The member whose loss overrides `config` (a run.yaml) carries, or None (pure). The first member
    that matches wins, so a run of the preset's eopd is "eopd" even though its support field holds the
    default."""
    loss = config.get("loss") or {}
    return next((name for name, overrides in MEMBERS.items() if all(_carries(loss, o) for o in overrides)), None)


def from_run(run_dir: Path) -> dict:
    """A member's entry from a run already made (`run.yaml`, `train_metrics.jsonl`): what
    `run_member` gives, without running it; `error` when the run's loss is no member's."""
    config = yaml.safe_load((run_dir / "run.yaml").read_text())
    name = member_of(config)
    out = {"member": name or "?", "run": str(run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir),
           "seed": config.get("seed"), "overrides": list(MEMBERS.get(name, ())),
           **summarise(run_dir / "train_metrics.jsonl")}
    if name is None:
        out["error"] = f"loss {config.get('loss', {}).get('variant')!r} is no member's ({', '.join(MEMBERS)})"
    return out


def run_member(name: str, preset: Path, iterations: int, work: Path, seed: int) -> dict:
    run_dir = work / name
    args = [sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(preset), f"run_dir={run_dir}",
            f"seed={seed}", *MEMBERS[name], f"train.iterations={iterations}", "eval.enabled=false",
            "logging.progress=false", "--overwrite"]
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    out = {"member": name, "overrides": list(MEMBERS[name]), "wall_s": round(time.monotonic() - t0, 1),
           **summarise(run_dir / "train_metrics.jsonl")}
    if proc.returncode != 0:
        out["error"] = f"exit {proc.returncode}: " + proc.stderr.strip()[-600:]
    return out


def section_text(data: dict) -> str:
    rows = []
    for m in data["members"]:
        last = m["per_iteration"][-1] if m["per_iteration"] else {}
        name = f"{m['member']} (seed {m['seed']})" if data.get("from_runs") else m["member"]
        rows.append([name, m["iterations"], _f(last.get("student_entropy")), _f(last.get("teacher_entropy")),
                     "yes" if m["all_in_band"] else "no", _f(m["min_divergence_term"]), _f(m["min_loss"]),
                     ", ".join(m["alarms"]) or "-", m.get("error", "")[:80] or "-"])
    table = markdown_table(["member", "iterations", "student H (last)", "teacher H (last)", "in band every iteration",
                            "min divergence term", "min loss", "alarms", "error"], rows)
    band = "band [H_te/2 - 0.5, 2 H_te + 1] nats (learner/alarms.py)"
    head = "## Does each divergence member train? (`python -m bench.bench_divergences`, issue 48 ask 2)\n\n"
    if data.get("from_runs"):
        runs = "; ".join(f"{m['member']}: `{m['run']}` (seed {m['seed']})" for m in data["members"])
        return (f"{head}Each divergence member's own run of `eopd run --config {data['preset']}`, read back "
                f"(`--from-runs`: runs made by other benchmarks, not run again): {runs}; {band}.\n\n{table}\n")
    return (f"{head}Each divergence member for {data['iterations']} iterations of `eopd run --config {data['preset']}` "
            f"(seed {data['seed']}); {band}; load {data.get('load_avg')}."
            f"\n\n{table}\n")


def _f(v):
    return "-" if v is None else round(float(v), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_divergences", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="config (default configs/smollm2-cpu.yaml; --quick: configs/tiny.yaml)")
    p.add_argument("--iterations", type=int, default=None, help="per member (default 16; --quick: 1)")
    p.add_argument("--members", default=None, help=f"comma-separated, of {', '.join(MEMBERS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny preset, 1 iteration, 2 members; writes nothing")
    p.add_argument("--out", type=Path, default=None, help="with --quick: write the JSON here")
    p.add_argument("--from-runs", nargs="+", type=Path, default=None, metavar="DIR",
                   help="summarise these runs (run.yaml + train_metrics.jsonl each) instead of running members")
    args = p.parse_args(argv)
    if args.from_runs:
        missing = [str(d) for d in args.from_runs if not (d / "run.yaml").is_file()]
        if missing:
            p.error(f"--from-runs: no run.yaml in {missing}")
        members = [from_run(d.resolve()) for d in args.from_runs]
        data = {"preset": args.preset or "configs/smollm2-cpu.yaml", "from_runs": True, "members": members,
                "iterations": max(m["iterations"] for m in members), "seed": None}
        return measure_and_report("divergences", lambda: data, section_text, quick=args.quick, out=args.out)
    preset = Path(args.preset or ROOT / "configs" / ("tiny.yaml" if args.quick else "smollm2-cpu.yaml")).resolve()
    iterations = args.iterations or (1 if args.quick else 16)
    members = args.members.split(",") if args.members else list(QUICK_MEMBERS if args.quick else MEMBERS)
    unknown = [m for m in members if m not in MEMBERS]
    if unknown:
        p.error(f"--members: unknown {unknown}; known: {list(MEMBERS)}")

    def measure() -> dict:
        with tempfile.TemporaryDirectory(prefix="eopd-divergences-") as work:
            results = [run_member(m, preset, iterations, Path(work), args.seed) for m in members]
        return {"preset": preset.name, "iterations": iterations, "seed": args.seed, "members": results}

    return measure_and_report("divergences", measure, section_text, quick=args.quick, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
