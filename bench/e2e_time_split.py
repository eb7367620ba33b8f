"""Where a head-to-head run's training time goes (issue 48's goal: where a number falls short, say where
the time goes, measured): eopd's seconds split by process and phase, TRL's GKDTrainer's by phase.

Pure functions over what the runs write, and a `section` of docs/benchmarks.md from the runs that
carry a split (`trained.json`'s `time_split`, written by `bench_e2e --phase train|retime` since
this module exists):

- eopd (`eopd_split`): the learner's per-iteration records (`train_metrics.jsonl`: `iter/iteration_s`,
  `iter/collect_s`, `iter/steps_s`, `iter/checkpoint_s`) and the rollout worker's last log line
  (`sampling S s in N rounds, weight loads S s in N`). Start-up is the launch of `eopd run` to the
  learner's first iteration (teacher, Redis, worker and learner starting, models loading). The
  learner's iteration is its wait for the batch (collect), its forward/backward/optimizer steps, and
  the rest (publishing the new weights; a checkpoint's write is off the training clock, as in the
  head-to-head). In sync mode the worker samples inside the learner's wait: the wait less the
  worker's sampling and weight loads is the teacher's scoring and the hand-offs (queue, streams). In
  async mode the worker samples and loads weights beside the learner's steps: those seconds are not
  on the training clock, and the learner's wait is what the overlap left of sampling, scoring and
  hand-offs together (the split says `mode`; the table shows the overlapped seconds apart).
- TRL (`trl_split`): `bench/e2e_trl.py`'s stopwatch around GKD's on-policy generation and its
  teacher's forwards; the rest of the training loop is the student's forward, loss, backward and
  optimizer step (and the trainer's own bookkeeping). Start-up is the runner's launch to `train()`.

    .venv/bin/python -m bench.e2e_time_split --archive bench/results/e2e-avg8 [--write]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.report import markdown_table, print_section

SECTION = "e2e_time_split"
WORKER_TIMES = re.compile(r"sampling ([\d.]+) s in (\d+) rounds, weight loads ([\d.]+) s in (\d+)")


def worker_times(log_text: str) -> tuple[float, float]:
    """(sampling seconds, weight-load seconds) from a rollout worker's log: its last `done` line."""
    found = WORKER_TIMES.findall(log_text)
    if not found:
        raise ValueError("no 'sampling S s in N rounds, weight loads S s in N' line in the rollout worker's log")
    sample_s, _, load_s, _ = found[-1]
    return float(sample_s), float(load_s)


def eopd_split(records: list[dict], launched: float, sampling_s: float, weight_load_s: float,
               mode: str = "sync") -> dict:
    """Seconds of an `eopd run`'s training clock by phase (the module's docstring), from its metrics
    records (`train_metrics.jsonl`, every kind), its launch time (unix s), its worker's totals and
    the run's `mode`. Phases sum to the training clock up to the last iteration (checkpoint writes
    left out); in async mode the worker's sampling and weight loads are beside that clock, and its
    teacher-and-hand-off share is not separable from the learner's wait (None)."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    its = [r for r in records if r.get("kind") == "iteration"]
    if not its:
        raise ValueError("no iteration records")
    missing = [k for k in ("iter/iteration_s", "iter/collect_s", "iter/steps_s") if k not in its[0]]
    if missing:
        raise ValueError(f"iteration records without {missing} (a run from before the time split)")

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in its)

    collect, steps = total("iter/collect_s"), total("iter/steps_s")
    rest = total("iter/iteration_s") - collect - steps - total("iter/checkpoint_s")
    return {"system": "eopd", "optimizer_steps": int(its[-1]["step"]), "iterations": len(its),
            "start_s": its[0]["time"] - its[0]["iter/iteration_s"] - launched,
            "learner_steps_s": steps, "publish_s": rest, "collect_s": collect,
            "sampling_s": sampling_s, "weight_load_s": weight_load_s, "mode": mode,
            "teacher_and_handoff_s": collect - sampling_s - weight_load_s if mode == "sync" else None}


def trl_split(timeline: dict, launched: float) -> dict:
    """Seconds of a TRL GKD run's training clock by phase, from `bench/e2e_trl.py`'s timeline.json
    (its checkpoints, `train_started` and `time_split`) and the runner's launch time (unix s)."""
    watch = timeline.get("time_split") or {}
    if "generate" not in watch:
        raise ValueError("timeline without GKD's time split (a run from before it, or not GKDTrainer)")
    last = timeline["checkpoints"][-1]
    train = last["time"] - last["saved_s_before"] - timeline["train_started"]
    generate, teacher = watch["generate"]["s"], watch.get("teacher_forward", {}).get("s", 0.0)
    return {"system": "trl", "optimizer_steps": int(timeline["global_step"]),
            "start_s": timeline["train_started"] - launched, "generate_s": generate, "teacher_forward_s": teacher,
            "student_step_s": train - generate - teacher}


ROWS = [  # (label, eopd key on the clock, eopd key beside it, TRL key)
    ("start-up (processes, model loads)", "start_s", None, "start_s"),
    ("sampling the student's responses", "sampling_s", None, "generate_s"),
    ("the teacher's scores, and eopd's hand-offs (queue, streams)", "teacher_and_handoff_s", None, "teacher_forward_s"),
    ("the student's forward, loss, backward, optimizer step", "learner_steps_s", None, "student_step_s"),
    ("publishing the new weights (learner) and loading them (sampler)", "publish_s+weight_load_s", None, None),
]
# async mode: the worker's sampling and weight loads run beside the learner's steps (shown in brackets,
# not on the clock); the learner's wait for a scored batch is what the overlap left of all three.
ROWS_ASYNC = [  # as ROWS
    ("start-up (processes, model loads)", "start_s", None, "start_s"),
    ("sampling the student's responses", None, "sampling_s", "generate_s"),
    ("the teacher's scores, and eopd's hand-offs (queue, streams); async: the learner's wait for a scored "
     "batch, what the overlap left of sampling, scores and hand-offs", "collect_s", None, "teacher_forward_s"),
    ("the student's forward, loss, backward, optimizer step", "learner_steps_s", None, "student_step_s"),
    ("publishing the new weights (learner) and loading them (sampler)", "publish_s", "weight_load_s", None),
]


def _rows(split: dict) -> list[tuple[str, str | None, str | None, str | None]]:
    """ROWS or ROWS_ASYNC, for `split`'s mode."""
    return ROWS_ASYNC if split.get("mode") == "async" else ROWS


def _value(split: dict, key: str | None) -> float | None:
    if key is None:
        return None
    return sum(split[k] for k in key.split("+"))


def _total(split: dict) -> float:
    keys = [k for _, e, _, t in _rows(split) for k in ((e if split["system"] == "eopd" else t) or "").split("+") if k]
    return sum(split[k] for k in keys)


def table(eopd: dict, trl: dict) -> str:
    """Seconds per optimizer step of each phase, eopd beside TRL, and eopd's excess over TRL's; in
    async mode eopd's seconds beside the training clock in brackets, not in the total."""
    rows = []
    for label, e_key, beside_key, t_key in _rows(eopd):
        e = _value(eopd, e_key)
        e = None if e is None else e / eopd["optimizer_steps"]
        beside = _value(eopd, beside_key)
        t = _value(trl, t_key)
        t = None if t is None else t / trl["optimizer_steps"]
        shown = " ".join(x for x in ("" if e is None else f"{e:.2f}",
                                     "" if beside is None else f"({beside / eopd['optimizer_steps']:.2f} beside)") if x)
        rows.append([label, shown, "-" if t is None else f"{t:.2f}", f"{(e or 0.0) - (t or 0.0):+.2f}"])
    e_all, t_all = _total(eopd) / eopd["optimizer_steps"], _total(trl) / trl["optimizer_steps"]
    rows.append(["**total**", f"**{e_all:.2f}**", f"**{t_all:.2f}**", f"**{e_all - t_all:+.2f}** ({e_all / t_all:.2f}x)"])
    return markdown_table(["s per optimizer step", "eopd", "TRL GKDTrainer", "eopd - TRL"], rows)


def pairs(runs: list[dict], reference: str = "trl-gkd") -> list[tuple[dict, dict]]:
    """(eopd run, TRL run) of the same seed and machine (boot id), both with a time split."""
    def key(r):
        return r["seed"], (r.get("machine") or {}).get("boot_id", "")[:8]
    trl = {key(r): r for r in runs if r["system"] == reference and r.get("time_split")}
    return [(r, trl[key(r)]) for r in runs if r["system"] != reference and r.get("time_split") and key(r) in trl]


def section_text(runs: list[dict]) -> str:
    lines = ["## Head to head: where the training time goes (`python -m bench.e2e_time_split`, issue 48)", "",
             "Each eopd run of the head-to-head beside TRL's GKDTrainer of the same seed on the same machine, "
             "its training clock split by phase (bench/e2e_time_split.py says how each phase is measured); "
             "seconds per optimizer step. Both systems do the same work per step (sample 8 responses, "
             "score them with the teacher, one optimizer step on the student); eopd does it in four processes "
             "(teacher, rollout worker, Redis, learner) on the same two cores.", ""]
    found = pairs(runs)
    if not found:
        return "\n".join(lines + ["No run pair with a time split yet."])
    lines += ["What each phase holds, eopd against TRL (the code, not a measurement):", "",
              "- sampling: both generate with transformers' `generate`. eopd's rollout worker records the old "
              "log-probs from generate's own logits while it samples (`rollout.old_logprobs: auto` on a CPU fp32 "
              "student: no second forward pass; its log says so) and runs its torch threads with the run's "
              "`threads:` settings (`OMP_WAIT_POLICY=PASSIVE` by default, chosen for a shared CPU); TRL's process "
              "runs with OpenMP's default policy.",
              "- the teacher: eopd's teacher server computes its statistics over the full vocabulary (exact "
              "entropy, top-16, the token's log-prob) and, for a full-vocabulary loss, packs its final hidden "
              "states; the rollout's bytes then cross gRPC, the worker and Redis to the learner. TRL's teacher "
              "is one forward in the trainer's process.",
              "- the student's step: eopd's learner rebuilds the teacher's log-probs over the full vocabulary "
              "from those hidden states (the teacher's output projection, in chunks) inside its loss; in TRL "
              "that projection is part of the teacher's forward. eopd runs the step through DeepSpeed.", ""]
    for run, ref in found:
        m = run.get("machine") or {}
        mode = run["time_split"].get("mode", "sync")
        lines += [f"**{run['system']}**, seed {run['seed']}, on {m.get('cpu', '?')} (boot {m.get('boot_id', '?')[:8]}, "
                  f"{m.get('matmul_gflops', '?')} GFLOP/s), {run['time_split']['iterations']} iterations, {mode} mode:", "",
                  table(run["time_split"], ref["time_split"]), ""]
    return "\n".join(lines).rstrip()


def load_runs(archive: Path) -> list[dict]:
    """Every trained.json under `archive` (the runs and the re-timings)."""
    return [json.loads(p.read_text()) for p in sorted(archive.rglob("trained.json"))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archive", type=Path, default=Path("bench/results/e2e-avg8"))
    p.add_argument("--write", action="store_true", help=f"write the {SECTION} section of docs/benchmarks.md")
    args = p.parse_args(argv)
    text = section_text(load_runs(args.archive))
    return print_section(SECTION, text, write=args.write)


if __name__ == "__main__":
    raise SystemExit(main())
