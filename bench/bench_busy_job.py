"""A busy CPU, the whole job (issue 31, ask 7): `eopd run` of a preset alone and beside a CPU hog,
for each thread setting of its children (`threads:`: the OpenMP wait policy, the rollout worker's
thread count), side by side in one run.

`bench_threads` measures one learner step and one sampler run per setting; this measures what a user
sees: the training time of the job (`run_summary.json` `train_s`, the learner's wall time from its
start to its last commit, so the teacher's load and the evaluation are left out) with the teacher,
the rollout worker and the learner all running. The hog is `bench_threads`'s (a torch process doing
float32 matmuls on every core, as a second training job would). A job that shared the machine fairly
with it would take about 2x as long; the settings differ in how far above that they go. Alone, each
job's time is also split: the worker's sampling seconds per round (its last log line) and the
learner's forward/backward/optimizer seconds per iteration (`iter/steps_s`), so a setting that
helps one process at another's cost shows it.

    .venv/bin/python -m bench.bench_busy_job [--preset smollm2-cpu] [--iterations 6] [--rounds 1] [key=value ...]
    .venv/bin/python -m bench.bench_busy_job --settings passive,"brief 1000","brief 10000" --label spin
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
from bench.e2e_time_split import worker_times
from bench.report import ROOT, markdown_table, measure_and_report

#: setting -> `eopd run` overrides. `bench_threads` measured a greedy decode of 4 x 16 tokens 1.47x faster
#: on one thread than on two with passive waits; the preset's own rounds (16 responses after ~90-token
#: prompts) sampled more slowly on one (docs/benchmarks.md, *A busy CPU*: the prefill wants both cores).
SETTINGS: dict[str, tuple[str, ...]] = {
    "inherit": ("threads.omp_wait_policy=inherit",),
    "passive": ("threads.omp_wait_policy=passive",),
    "passive, sampler 1 thread": ("threads.omp_wait_policy=passive", "threads.rollout=1"),
    # async: the worker samples the next batch while the learner steps (rollouts one version old at most)
    "async, sampler 1 thread": ("mode=async", "threads.omp_wait_policy=passive", "threads.rollout=1"),
    # brief: waiting threads spin a bounded number of times, then sleep (OpenMP's default spins 300000)
    "brief 1000": ("threads.omp_wait_policy=brief", "threads.spin_count=1000"),
    "brief 10000": ("threads.omp_wait_policy=brief", "threads.spin_count=10000"),
}


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
    logs = sorted((run_dir / "logs").glob("rollout-*.log"))
    sampling_s = sum(worker_times(p.read_text())[0] for p in logs)
    its = [r for r in records if r.get("kind") == "iteration"]
    return {"train_s": summary["train_s"], "s_per_iteration": summary["train_s"] / iterations,
            "total_s": summary["total_s"], "iterations": its,
            "sampling_s_per_iteration": sampling_s / iterations,
            "steps_s_per_iteration": sum(r.get("iter/steps_s", 0.0) for r in its) / max(len(its), 1)}


def _times(job: dict) -> dict:
    return {k: job[k] for k in ("train_s", "s_per_iteration", "total_s", "sampling_s_per_iteration",
                                "steps_s_per_iteration")}


def measure(preset: str, iterations: int, rounds: int, overrides: tuple[str, ...] = (),
            names: tuple[str, ...] = tuple(SETTINGS)) -> dict:
    cores = os.cpu_count() or 1
    per_round = []
    with tempfile.TemporaryDirectory(prefix="eopd-busy-job-") as tmp:
        for r in range(rounds):
            rec: dict = {}
            order = list(names) if r % 2 == 0 else list(reversed(names))  # interleaved: drift hits all alike
            for i, name in enumerate(order):
                alone = run_job(preset, iterations, Path(tmp) / f"s{i}-alone", SETTINGS[name] + overrides)
                with hog(cores):
                    beside = run_job(preset, iterations, Path(tmp) / f"s{i}-beside", SETTINGS[name] + overrides)
                rec[name] = {"alone": _times(alone), "beside": _times(beside)}
            per_round.append(rec)
            print(json.dumps({"round": r, **rec}), flush=True)
    med = statistics.median
    summary: dict = {}
    for name in names:
        alone = [x[name]["alone"] for x in per_round]
        beside = [x[name]["beside"] for x in per_round]
        summary[name] = {
            "alone_s": med(a["s_per_iteration"] for a in alone), "beside_s": med(b["s_per_iteration"] for b in beside),
            "ratio": med(b["s_per_iteration"] / a["s_per_iteration"] for a, b in zip(alone, beside)),
            "sampling_s": med(a["sampling_s_per_iteration"] for a in alone),
            "steps_s": med(a["steps_s_per_iteration"] for a in alone), "overrides": list(SETTINGS[name])}
    return {"preset": preset, "iterations": iterations, "overrides": list(overrides), "cores": cores,
            "rounds": per_round, "settings": summary}


def section_text(data: dict) -> str:
    s = data["settings"]
    rows = [[name, " ".join(v.get("overrides") or SETTINGS[name]), f"{v['alone_s']:.1f}", f"{v['beside_s']:.1f}",
             f"{v['ratio']:.2f}x", f"{v['sampling_s']:.2f}", f"{v['steps_s']:.2f}"] for name, v in s.items()]
    base = s["passive"]
    extra = " ".join(data.get("overrides", []))
    return "\n".join([
        "## A busy CPU: the whole job beside a CPU hog (`python -m bench.bench_busy_job"
        + (f" --label {data['label']}" if data.get("label") else "") + "`, issue 31 ask 7)", "",
        f"`eopd run --config configs/{data['preset']}.yaml train.iterations={data['iterations']} eval.enabled=false "
        f"{extra + ' ' if extra else ''}SETTING`, {data['cores']} cores; seconds per iteration of training (run_summary's "
        f"train_s / iterations: teacher load and evaluation left out), {len(data['rounds'])} round(s), settings "
        f"interleaved; beside = while a hog (torch matmuls on {data['cores']} threads) runs. Fair sharing with the hog "
        f"would make the job about 2x slower. Alone, the rollout worker's sampling seconds and the learner's "
        f"forward/backward/optimizer seconds, per iteration. Load average {data.get('load_avg', '?')} "
        "(1/5/15 min, start -> end).", "",
        markdown_table(["setting", "overrides", "alone s/iteration", "beside s/iteration", "beside/alone",
                        "alone: sampling s/iteration", "alone: learner steps s/iteration"], rows), "",
        "Over `passive` (the default), alone / beside the hog: " + "; ".join(
            f"{name} {v['alone_s'] / base['alone_s']:.2f}x / {v['beside_s'] / base['beside_s']:.2f}x"
            for name, v in s.items() if name != "passive") + ". inherit = OpenMP's default (spin, then sleep); "
        "passive = `OMP_WAIT_POLICY=PASSIVE` in every child; sampler 1 thread = the rollout worker on one torch "
        "thread (`threads.rollout=1`); brief N = `threads.omp_wait_policy=brief threads.spin_count=N` (GOMP_SPINCOUNT=N: "
        "a waiting thread spins N times, then sleeps); async = `mode=async` (the worker samples the next batch while the learner "
        "steps; its rollouts at most one policy version old).", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny preset, 2 iterations, 1 round; prints, writes nothing")
    p.add_argument("--preset", default="smollm2-cpu")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="quick: write the results JSON here")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, measured in this order (passive among them): {', '.join(SETTINGS)}")
    p.add_argument("--label", default="", help="write section and results busy_job_LABEL (another set of settings)")
    p.add_argument("overrides", nargs="*", help="more `eopd run` overrides for every job (key=value)")
    args = p.parse_args(argv)
    names = tuple(n.strip() for n in args.settings.split(","))
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or "passive" not in names:
        p.error(f"--settings: unknown {unknown}" if unknown else "--settings must include passive (the reference)")
    if args.quick:
        args.preset, args.iterations, args.rounds = "tiny", 2, 1
    name = f"busy_job_{args.label}" if args.label else "busy_job"
    return measure_and_report(name, lambda: {**measure(args.preset, args.iterations, args.rounds, tuple(args.overrides),
                                                       names), "label": args.label}, section_text,
                              quick=args.quick, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
