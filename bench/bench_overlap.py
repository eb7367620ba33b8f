"""Is the learner idle? (issue 31, ask 4): `eopd run` of a preset in sync and in async mode
(bounded staleness, `max_staleness`), side by side in one run, on this machine.

Per mode: seconds per iteration of training (run_summary's train_s / iterations), the learner's idle
share (the time it waited on the rollouts stream over the iteration's time, `iter/idle_frac` of
train_metrics.jsonl, summed over the iterations after the first, which includes start-up), its
collect time and the mean staleness of what it trained on. In sync mode the learner waits while
the worker samples and the teacher scores the next batch; in async mode the worker samples
iteration i + 1 from the weights of i - 1 while the learner trains on i. `bench_pipeline` measures
the same split on processes it composes itself (one thread each, one or two teachers, tokens/s);
this runs the presets exactly as a user does, through `eopd run`.

    .venv/bin/python -m bench.bench_overlap [--preset smollm2-cpu] [--iterations 6]
    .venv/bin/python -m bench.bench_overlap --quick     # the tiny preset, 2 iterations

Writes the `overlap_<preset>` section of docs/benchmarks.md (not with --quick). One job at a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.bench_busy_job import run_job
from bench.report import markdown_table, measure_and_report

MODES = ("sync", "async")


def summarise(job: dict) -> dict:
    """Idle share, collect time and staleness over the iterations after the first."""
    its = job["iterations"][1:] or job["iterations"]
    total = sum(r["iter/iteration_s"] for r in its)
    return {"s_per_iteration": job["s_per_iteration"], "train_s": job["train_s"],
            "idle_frac": sum(r["iter/queue_wait_s"] for r in its) / total if total > 0 else 0.0,
            "collect_s": statistics.mean(r["iter/collect_s"] for r in its),
            "iteration_s": statistics.mean(r["iter/iteration_s"] for r in its),
            "staleness_mean": statistics.mean(r.get("iter/staleness_mean", 0.0) for r in its),
            "measured": len(its)}


def measure(preset: str, iterations: int) -> dict:
    out: dict = {"preset": preset, "iterations": iterations, "cores": os.cpu_count() or 1}
    with tempfile.TemporaryDirectory(prefix="eopd-overlap-") as tmp:
        for mode in MODES:
            out[mode] = summarise(run_job(preset, iterations, Path(tmp) / mode, (f"mode={mode}",)))
            print(mode, out[mode], flush=True)
    return out


def section_text(data: dict) -> str:
    rows = [[m, str(data[m]["measured"]), f"{data[m]['s_per_iteration']:.1f}", f"{data[m]['iteration_s']:.1f}",
             f"{data[m]['collect_s']:.1f}", f"{100 * data[m]['idle_frac']:.0f}%", f"{data[m]['staleness_mean']:.2f}"]
            for m in MODES]
    return "\n".join([
        f"## Learner idle share, sync vs async: `{data['preset']}` on this CPU (`python -m bench.bench_overlap`, issue 31 ask 4)", "",
        f"`eopd run --config configs/{data['preset']}.yaml train.iterations={data['iterations']} eval.enabled=false mode=M`, "
        f"{data['cores']} cores, one job at a time; learner idle = time waiting on the rollouts stream / iteration time, "
        f"over the iterations after the first (start-up). Load average {data.get('load_avg', '?')} (1/5/15 min, start -> end).", "",
        markdown_table(["mode", "iterations measured", "s / iteration (train_s)", "learner s / iteration", "collect s",
                        "learner idle", "staleness"], rows), "",
        f"async over sync, seconds per iteration: {data['async']['s_per_iteration'] / data['sync']['s_per_iteration']:.2f}x.", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny preset, 2 iterations; prints, writes nothing")
    p.add_argument("--preset", default="smollm2-cpu")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--out", type=Path, default=None, help="quick: write the results JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.iterations = "tiny", 2
    return measure_and_report(f"overlap_{args.preset.replace('-', '_')}", lambda: measure(args.preset, args.iterations),
                              section_text, quick=args.quick, out=args.out)


if __name__ == "__main__":
    raise SystemExit(main())
