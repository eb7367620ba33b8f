"""A busy CPU, the whole job (issue 31, ask 7): `eopd run` of a preset alone and beside a CPU hog,
for each OpenMP wait policy of its children (`threads.omp_wait_policy`), side by side in one run.

`bench_threads` measures one learner step and one sampler run per setting; this measures what a user
sees: the training time of the job (`run_summary.json` `train_s`, the learner's wall time from its
start to its last commit, so the teacher's load and the evaluation are left out) with the teacher,
the rollout worker and the learner all running. The hog is `bench_threads`'s (a torch process doing
float32 matmuls on every core, as a second training job would). A job that shared the machine fairly
with it would take about 2x as long; the policies differ in how far above that they go.

    .venv/bin/python -m bench.bench_busy_job [--preset smollm2-cpu] [--iterations 6] [--rounds 1]
    .venv/bin/python -m bench.bench_busy_job --quick      # the tiny preset, 2 iterations: checks the wiring

Runs one job at a time (each uses the whole machine). Writes the `busy_job` section of
docs/benchmarks.md (not with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_threads import hog
from bench.report import ROOT, markdown_table, measure_and_report

POLICIES = ("inherit", "passive")


def run_job(preset: str, iterations: int, run_dir: Path, overrides: tuple[str, ...] = ()) -> dict:
    """One `eopd run` of `preset` for `iterations` (no evaluation, no progress bar) with `overrides`;
    its training time (`run_summary.json` train_s) per iteration, and the learner's per-iteration
    records (train_metrics.jsonl). The child environment has no OMP_NUM_THREADS / OMP_WAIT_POLICY,
    so the job gets what its config says."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "REDIS_URL")}
    args = [sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(ROOT / "configs" / f"{preset}.yaml"),
            f"run_dir={run_dir}", f"train.iterations={iterations}", "eval.enabled=false", "logging.progress=false",
            *overrides, "--overwrite"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"eopd run {' '.join(overrides)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "run_summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"train_s": summary["train_s"], "s_per_iteration": summary["train_s"] / iterations,
            "total_s": summary["total_s"], "iterations": [r for r in records if r.get("kind") == "iteration"]}


def _times(job: dict) -> dict:
    return {k: job[k] for k in ("train_s", "s_per_iteration", "total_s")}


def measure(preset: str, iterations: int, rounds: int) -> dict:
    cores = os.cpu_count() or 1
    per_round = []
    with tempfile.TemporaryDirectory(prefix="eopd-busy-job-") as tmp:
        for r in range(rounds):
            rec: dict = {}
            for policy in POLICIES:
                setting = (f"threads.omp_wait_policy={policy}",)
                alone = run_job(preset, iterations, Path(tmp) / f"{policy}-alone", setting)
                with hog(cores):
                    beside = run_job(preset, iterations, Path(tmp) / f"{policy}-beside", setting)
                rec[policy] = {"alone": _times(alone), "beside": _times(beside)}
            per_round.append(rec)
            print(json.dumps({"round": r, **rec}), flush=True)
    med = statistics.median
    summary = {}
    for policy in POLICIES:
        alone = [x[policy]["alone"]["s_per_iteration"] for x in per_round]
        beside = [x[policy]["beside"]["s_per_iteration"] for x in per_round]
        summary[f"{policy}_alone_s"], summary[f"{policy}_beside_s"] = med(alone), med(beside)
        summary[f"{policy}_ratio"] = med([b / a for a, b in zip(alone, beside)])
    return {"preset": preset, "iterations": iterations, "cores": cores, "rounds": per_round, **summary}


def section_text(data: dict) -> str:
    rows = [[p, f"{data[f'{p}_alone_s']:.1f}", f"{data[f'{p}_beside_s']:.1f}", f"{data[f'{p}_ratio']:.2f}x"]
            for p in POLICIES]
    base = data["inherit_alone_s"]
    return "\n".join([
        "## A busy CPU: the whole job beside a CPU hog (`python -m bench.bench_busy_job`, issue 31 ask 7)", "",
        f"`eopd run --config configs/{data['preset']}.yaml train.iterations={data['iterations']} eval.enabled=false "
        f"threads.omp_wait_policy=P`, {data['cores']} cores; seconds per iteration of training (run_summary's "
        f"train_s / iterations: teacher load and evaluation left out), {len(data['rounds'])} round(s), policies "
        f"interleaved; beside = while a hog (torch matmuls on {data['cores']} threads) runs. Fair sharing with the hog "
        f"would make the job about 2x slower. Load average {data.get('load_avg', '?')} (1/5/15 min, start -> end).", "",
        markdown_table(["omp_wait_policy", "alone s/iteration", "beside s/iteration", "beside/alone"], rows), "",
        f"Alone, passive over inherit: {data['passive_alone_s'] / base:.2f}x; beside the hog: "
        f"{data['passive_beside_s'] / data['inherit_beside_s']:.2f}x. inherit = OpenMP's default (spin, then sleep); "
        "passive = `OMP_WAIT_POLICY=PASSIVE` in every child.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny preset, 2 iterations, 1 round; prints, writes nothing")
    p.add_argument("--preset", default="smollm2-cpu")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="quick: write the results JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.iterations, args.rounds = "tiny", 2, 1
    return measure_and_report("busy_job", lambda: measure(args.preset, args.iterations, args.rounds), section_text,
                              quick=args.quick, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
